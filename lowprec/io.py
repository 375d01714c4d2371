"""Save and load QuantizedTensors (alone or inside state dicts) with safetensors.

A QuantizedTensor stored under key ``k`` becomes the tensors ``k::data``, ``k::scale`` (and
``k::global_scale``); its recipe, logical shape and original dtype go into the file's metadata
under ``lowprec.quantized`` as JSON. Plain tensors are stored as they are.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import safetensors
import safetensors.torch
import torch

from .tensor import QuantizedTensor

__all__ = ["save", "load"]

_FORMAT_VERSION = "1"
_SINGLE_KEY = "tensor"
_PARTS = ("data", "scale", "global_scale")


def save(obj: QuantizedTensor | Mapping[str, torch.Tensor | QuantizedTensor], path: str | os.PathLike,
         metadata: Mapping[str, str] | None = None) -> None:
    """Save a QuantizedTensor, or a flat ``{name: Tensor | QuantizedTensor}`` dict, to ``path``.

    ``metadata``: extra string key/values to keep in the file (keys starting ``lowprec.`` are
    reserved).
    """
    if isinstance(obj, QuantizedTensor):
        entries, kind = {_SINGLE_KEY: obj}, "quantized_tensor"
    elif isinstance(obj, Mapping):
        entries, kind = obj, "state_dict"
    else:
        raise TypeError(f"obj: expected a QuantizedTensor or a dict of tensors, got {type(obj).__name__}")
    tensors: dict[str, torch.Tensor] = {}
    quantized: dict[str, dict] = {}
    for key, value in entries.items():
        if not isinstance(key, str) or "::" in key:
            raise ValueError(f"obj: keys must be strings without '::', got {key!r}")
        if isinstance(value, QuantizedTensor):
            parts = (value.data, value.scale, value.global_scale)
            for part, t in zip(_PARTS, parts):
                if t is not None:
                    tensors[f"{key}::{part}"] = t.detach().contiguous().cpu()
            quantized[key] = value.metadata()
        elif isinstance(value, torch.Tensor):
            tensors[key] = value.detach().contiguous().cpu()
        else:
            raise TypeError(f"obj[{key!r}]: expected a Tensor or QuantizedTensor, got {type(value).__name__}")
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    if any(k.startswith("lowprec.") for k in meta):
        raise ValueError("metadata: keys starting with 'lowprec.' are reserved")
    meta.update({
        "lowprec.format_version": _FORMAT_VERSION,
        "lowprec.kind": kind,
        "lowprec.quantized": json.dumps(quantized, sort_keys=True),
    })
    safetensors.torch.save_file(tensors, os.fspath(path), metadata=meta)


def load(path: str | os.PathLike, device: str | torch.device = "cpu") -> QuantizedTensor | dict:
    """Load what :func:`save` wrote: a QuantizedTensor, or a dict of Tensors / QuantizedTensors.

    Raises ValueError when a quantized entry's recipe is missing or not one lowprec knows.
    """
    path = os.fspath(path)
    with safetensors.safe_open(path, framework="pt", device=str(device)) as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    kind = meta.get("lowprec.kind", "state_dict")
    try:
        quantized = json.loads(meta.get("lowprec.quantized", "{}"))
    except ValueError:
        raise ValueError(f"{path}: metadata 'lowprec.quantized' is not valid JSON") from None

    out: dict[str, torch.Tensor | QuantizedTensor] = {}
    part_keys = {k for k in tensors if "::" in k}
    for key in sorted({k.split("::", 1)[0] for k in part_keys}):
        info = quantized.get(key)
        if info is None or "recipe" not in info:
            raise ValueError(f"{path}: quantized entry {key!r} has no recipe in the file's metadata")
        out[key] = QuantizedTensor.from_parts(tensors[f"{key}::data"], tensors[f"{key}::scale"],
                                              tensors.get(f"{key}::global_scale"), info, f"{path}: entry {key!r}")
    for key, t in tensors.items():
        if "::" not in key:
            out[key] = t
    if kind == "quantized_tensor":
        return out[_SINGLE_KEY]
    return out
