"""Save and load QuantizedTensors (alone or inside state dicts) with safetensors.

A QuantizedTensor stored under key ``k`` becomes the tensors ``k::data``, ``k::scale`` (and
``k::global_scale``); its recipe, logical shape and original dtype go into the file's metadata
under ``lowprec.quantized`` as JSON. Plain tensors are stored as they are; a tensor that is another
one (tied weights) is stored once and its other names go under ``lowprec.aliases``, shared again
on load.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import safetensors
import safetensors.torch
import torch

from .nn.fsdp import FP8AllGatherWeight
from .tensor import QuantizedTensor

__all__ = ["save", "load"]

_FORMAT_VERSION = "1"
_SINGLE_KEY = "tensor"
_PARTS = ("data", "scale", "global_scale")
_KINDS = ("state_dict", "quantized_tensor")


def save(obj: QuantizedTensor | Mapping[str, torch.Tensor | QuantizedTensor], path: str | os.PathLike,
         metadata: Mapping[str, str] | None = None) -> None:
    """Save a QuantizedTensor, or a flat ``{name: Tensor | QuantizedTensor}`` dict, to ``path``.

    ``metadata``: extra string key/values to keep in the file (keys starting ``lowprec.`` are
    reserved). The file's metadata also says ``"format": "pt"`` (unless ``metadata`` sets
    ``"format"``), as transformers' ``save_pretrained`` writes it.
    """
    if isinstance(obj, QuantizedTensor):
        entries, kind = {_SINGLE_KEY: obj}, "quantized_tensor"
    elif isinstance(obj, Mapping):
        entries, kind = obj, "state_dict"
    else:
        raise TypeError(f"obj: expected a QuantizedTensor or a dict of tensors, got {type(obj).__name__}")
    if metadata is not None and not isinstance(metadata, Mapping):
        raise TypeError(f"metadata: expected a dict of string keys and values, got {type(metadata).__name__}")
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    if any(k.startswith("lowprec.") for k in meta):
        raise ValueError("metadata: keys starting with 'lowprec.' are reserved")
    tensors: dict[str, torch.Tensor] = {}
    quantized: dict[str, dict] = {}
    for key, value in entries.items():
        if not isinstance(key, str) or "::" in key:
            raise ValueError(f"obj: keys must be strings without '::', got {key!r}")
        if isinstance(value, QuantizedTensor):
            parts = (value.data, value.scale, value.global_scale)
            for part, t in zip(_PARTS, parts):
                if t is not None:
                    tensors[f"{key}::{part}"] = t.detach()
            quantized[key] = value.metadata()
        elif isinstance(value, torch.Tensor):
            # enable_fp8_all_gather's wrapper (a parameter of named_parameters()) has no storage of its
            # own: the master weight it wraps
            tensors[key] = (value.hp if isinstance(value, FP8AllGatherWeight) else value).detach()
        else:
            raise TypeError(f"obj[{key!r}]: expected a Tensor or QuantizedTensor, got {type(value).__name__}")
    # ties are found on the tensors as given: .contiguous() of a strided tensor and .cpu() of a
    # CUDA one make a new copy for each name, which would hide them
    tensors, aliases = _unshare(tensors)
    tensors = {name: t.contiguous().cpu() for name, t in tensors.items()}
    # as transformers' save_pretrained and huggingface_hub's save_torch_state_dict write it: readers
    # such as transformers 4's from_pretrained refuse a file with metadata but no "format"
    meta.setdefault("format", "pt")
    meta.update({
        "lowprec.format_version": _FORMAT_VERSION,
        "lowprec.kind": kind,
        "lowprec.quantized": json.dumps(quantized, sort_keys=True),
    })
    if aliases:
        meta["lowprec.aliases"] = json.dumps(aliases, sort_keys=True)
    safetensors.torch.save_file(tensors, os.fspath(path), metadata=meta)


def _unshare(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """safetensors stores no two tensors over the same memory (tied weights): a tensor that is
    another one exactly is stored once and named in ``aliases`` (``{alias: stored name}``,
    shared again by :func:`load`); one that only overlaps another (a view) is stored as a copy."""
    stored: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    storages: set[tuple] = set()
    for name, t in tensors.items():
        ptr = (t.device, t.untyped_storage().data_ptr()) if t.numel() else None  # one address space per device
        ident = (ptr, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if ptr is not None and ident in seen:
            aliases[name] = seen[ident]
            continue
        if ptr is not None and ptr in storages:
            t = t.clone()
        else:
            storages.add(ptr)
        seen[ident] = name
        stored[name] = t
    return stored, aliases


def load(path: str | os.PathLike, device: str | int | torch.device = "cpu") -> QuantizedTensor | dict:
    """Load what :func:`save` wrote: a QuantizedTensor, or a dict of Tensors / QuantizedTensors.

    Files without lowprec metadata load as plain tensors, except names holding ``::``: lowprec
    writes a quantized entry's parts as ``key::data``, ``key::scale``, so such a name needs its
    entry in the metadata (else a ValueError naming it). Damaged lowprec metadata (a format
    version or kind this version does not read, a quantized entry without its recipe, shape,
    dtype or tensors, parts that do not fit together) raises one ValueError naming the key.

    ``device``: any form ``torch.device`` takes (``"cuda:1"``, ``0``, ``torch.device("cuda", 0)``,
    ``"cpu:0"``); a CUDA device without CUDA is a ValueError.
    """
    path = os.fspath(path)
    with safetensors.safe_open(path, framework="pt", device=_safetensors_device(device)) as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    version = meta.get("lowprec.format_version", _FORMAT_VERSION)
    if version != _FORMAT_VERSION:
        raise ValueError(f"{path}: metadata 'lowprec.format_version' is {version!r}; this lowprec reads "
                         f"{_FORMAT_VERSION!r}")
    kind = meta.get("lowprec.kind", "state_dict")
    if kind not in _KINDS:
        raise ValueError(f"{path}: metadata 'lowprec.kind' is {kind!r}; expected one of {_KINDS}")
    quantized = _json_object(meta, "lowprec.quantized", path)
    for alias, name in _json_object(meta, "lowprec.aliases", path).items():
        if not isinstance(name, str) or name not in tensors:
            raise ValueError(f"{path}: metadata 'lowprec.aliases' makes {alias!r} an alias of {name!r}, which the "
                             f"file does not hold")
        tensors[alias] = tensors[name]

    out: dict[str, torch.Tensor | QuantizedTensor] = {}
    parts: dict[str, dict[str, torch.Tensor]] = {key: {} for key in quantized}
    for name, t in tensors.items():
        if "::" not in name:
            out[name] = t
            continue
        key, part = name.rsplit("::", 1)  # from the right: a key may end with ':' ('w:' -> 'w:::data')
        if part not in _PARTS:
            raise ValueError(f"{path}: tensor {name!r} is no part of a quantized entry (expected {_PARTS})")
        parts.setdefault(key, {})[part] = t
    for key in sorted(parts):
        where = f"{path}: entry {key!r}"
        info, found = quantized.get(key), parts[key]
        if not isinstance(info, dict) or "recipe" not in info:
            if info is None or isinstance(info, dict):
                raise ValueError(f"{path}: quantized entry {key!r} has no recipe in the file's metadata")
            raise ValueError(f"{where}: expected a JSON object (recipe, shape, dtype), got {info!r}")
        if not found:
            raise ValueError(f"{where}: no tensors ({key!r}::data, ::scale) in the file")
        for part in ("data", "scale"):
            if part not in found:
                raise ValueError(f"{where}: tensor '{key}::{part}' is missing")
        out[key] = QuantizedTensor.from_parts(found["data"], found["scale"], found.get("global_scale"), info, where)
    if kind == "quantized_tensor":
        if set(out) != {_SINGLE_KEY}:
            raise ValueError(f"{path}: metadata 'lowprec.kind' is 'quantized_tensor', but the file holds "
                             f"{sorted(out)} instead of one entry {_SINGLE_KEY!r}")
        return out[_SINGLE_KEY]
    return out


def _safetensors_device(device: str | int | torch.device) -> str:
    """``device`` as safetensors names it: it takes ``"cpu"``, ``"cuda"``, ``"cuda:N"``, not
    ``"cpu:0"`` or the string of an index (``str(0)``)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:  # an index without an accelerator, a bad string or type
        raise ValueError(f"device: {device!r} is not a device here ({e})") from None
    if dev.type == "cpu":
        return "cpu"
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} is a CUDA device, but CUDA is not available")
    return str(dev)


def _json_object(meta: dict[str, str], key: str, path: str) -> dict:
    try:
        value = json.loads(meta.get(key, "{}"))
    except ValueError:
        raise ValueError(f"{path}: metadata {key!r} is not valid JSON") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: metadata {key!r} must be a JSON object, got {type(value).__name__}")
    return value
