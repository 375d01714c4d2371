import importlib.util
import pathlib

import pytest

from lowprec.runtime import KernelCache, cache_key, compile_for_arch, source_fingerprint


def _probe():
    spec = importlib.util.spec_from_file_location("probe_kernel", pathlib.Path(__file__).with_name("probe_kernel.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_memory_cache_compiles_once(tmp_path, monkeypatch):
    monkeypatch.setenv("LOWPREC_DISK_CACHE", "0")
    cache = KernelCache()
    calls = []
    src = [str(pathlib.Path(__file__).with_name("probe_kernel.py"))]

    def compile_fn():
        calls.append(1)
        return object()

    a = cache.get("probe", {"block": 128}, "sm_90a", src, compile_fn)
    b = cache.get("probe", {"block": 128}, "sm_90a", src, compile_fn)
    c = cache.get("probe", {"block": 256}, "sm_90a", src, compile_fn)
    d = cache.get("probe", {"block": 128}, "sm_100a", src, compile_fn)
    assert a is b and a is not c and c is not d and len(calls) == 3 and len(cache) == 3


def test_key_depends_on_everything(tmp_path):
    f1, f2 = tmp_path / "k1.py", tmp_path / "k2.py"
    f1.write_text("x = 1\n")
    f2.write_text("x = 2\n")
    fp1, fp2 = source_fingerprint([str(f1)]), source_fingerprint([str(f2)])
    base = cache_key("k", {"n": 1}, "sm_90a", fp1)
    assert base == cache_key("k", {"n": 1}, "sm_90a", fp1)
    assert len({base, cache_key("k", {"n": 2}, "sm_90a", fp1), cache_key("k", {"n": 1}, "sm_100a", fp1),
                cache_key("k", {"n": 1}, "sm_90a", fp2), cache_key("j", {"n": 1}, "sm_90a", fp1)}) == 5


def test_disk_cache_exports_and_reloads_tvm_ffi_kernel(tmp_path, monkeypatch):
    monkeypatch.setenv("LOWPREC_DISK_CACHE", "1")
    k = _probe()
    src = [k.__file__]
    first = KernelCache(str(tmp_path))
    compiled = first.get("probe", {}, "sm_90a", src,
                         lambda: compile_for_arch(k.scale, *k.fake_args(), arch="sm_90a", tvm_ffi=True))
    files = list(tmp_path.glob("*.so"))
    assert len(files) == 1 and compiled is not None

    second = KernelCache(str(tmp_path))  # a new process would start like this
    loaded = second.get("probe", {}, "sm_90a", src, lambda: pytest.fail("should load from disk, not compile"))
    assert callable(loaded)


def test_disk_cache_is_opt_in(tmp_path, monkeypatch):
    monkeypatch.delenv("LOWPREC_DISK_CACHE", raising=False)
    assert KernelCache(str(tmp_path)).directory is None
    monkeypatch.setenv("LOWPREC_DISK_CACHE", "1")
    assert KernelCache(str(tmp_path)).directory == str(tmp_path)


def test_unreadable_disk_entry_is_recompiled(tmp_path, monkeypatch):
    monkeypatch.setenv("LOWPREC_DISK_CACHE", "1")
    k = _probe()
    src = [k.__file__]
    key = cache_key("probe", {}, "sm_90a", source_fingerprint(src))
    (tmp_path / f"{key}.so").write_bytes(b"not a shared library")
    cache = KernelCache(str(tmp_path))
    sentinel = object()
    assert cache.get("probe", {}, "sm_90a", src, lambda: sentinel) is sentinel
