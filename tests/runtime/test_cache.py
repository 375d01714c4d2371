import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from lowprec.runtime import KernelCache, cache, cache_key, compile_for_arch, source_fingerprint


def _probe():
    spec = importlib.util.spec_from_file_location("probe_kernel", pathlib.Path(__file__).with_name("probe_kernel.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compile_probe():
    k = _probe()
    return compile_for_arch(k.scale, *k.fake_args(), arch="sm_90a", tvm_ffi=True)


def test_memory_cache_compiles_once(monkeypatch):
    monkeypatch.setenv("LOWPREC_DISK_CACHE", "0")
    c = KernelCache()
    calls = []

    def compile_fn():
        calls.append(1)
        return object()

    a = c.get("probe", {"block": 128}, "sm_90a", compile_fn)
    b = c.get("probe", {"block": 128}, "sm_90a", compile_fn)
    d = c.get("probe", {"block": 256}, "sm_90a", compile_fn)
    e = c.get("probe", {"block": 128}, "sm_100a", compile_fn)
    assert a is b and a is not d and d is not e and len(calls) == 3 == c.compiles and len(c) == 3


def test_key_depends_on_kernel_config_arch_and_source():
    fp = source_fingerprint()
    base = cache_key("k", {"n": 1}, "sm_90a")
    assert base == cache_key("k", {"n": 1}, "sm_90a") == cache_key("k", {"n": 1}, "sm_90a", fp)
    assert len({base, cache_key("k", {"n": 2}, "sm_90a"), cache_key("k", {"n": 1}, "sm_100a"),
                cache_key("k", {"n": 1}, "sm_90a", "0" * 64), cache_key("j", {"n": 1}, "sm_90a")}) == 5


def test_fingerprint_covers_every_package_source_file(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "sub" / "helper.py").write_text("y = 1\n")
    (pkg / "notes.txt").write_text("not source\n")
    seen = {source_fingerprint(pkg)}

    def fresh():  # a new process: nothing memoized
        cache._tree_fingerprint.cache_clear()
        return source_fingerprint(pkg)

    assert fresh() in seen  # stable
    (pkg / "notes.txt").write_text("still not source\n")
    assert fresh() in seen
    (pkg / "sub" / "helper.py").write_text("y = 2\n")  # a shared helper, not the kernel's own file
    seen.add(fresh())
    (pkg / "sub" / "new.py").write_text("")  # a new (even empty) file
    seen.add(fresh())
    (pkg / "sub" / "new.py").rename(pkg / "sub" / "renamed.py")
    seen.add(fresh())
    assert len(seen) == 4
    cache._tree_fingerprint.cache_clear()


def test_fingerprint_of_the_package_is_memoized_and_covers_it(monkeypatch):
    root = pathlib.Path(cache.__file__).resolve().parents[1]
    assert root.name == "lowprec"
    assert source_fingerprint() == source_fingerprint(root)
    reads = []
    monkeypatch.setattr(pathlib.Path, "read_bytes", lambda self: reads.append(self) or b"")
    source_fingerprint()  # memoized: no file read again
    assert reads == []


def test_key_changes_with_dsl_and_tvm_ffi_versions(monkeypatch):
    versions = cache._versions()
    assert set(versions) == {"cutlass-dsl", "tvm-ffi", "python"}
    base = cache_key("k", {}, "sm_90a")
    for dist in ("cutlass-dsl", "tvm-ffi"):
        monkeypatch.setattr(cache, "_versions", lambda dist=dist: {**versions, dist: "9.9.9"})
        assert cache_key("k", {}, "sm_90a") != base


def test_disk_cache_is_on_by_default(tmp_path, monkeypatch):
    monkeypatch.delenv("LOWPREC_DISK_CACHE", raising=False)
    monkeypatch.delenv("LOWPREC_CACHE_DIR", raising=False)
    assert KernelCache(str(tmp_path)).directory == str(tmp_path)
    assert KernelCache().directory == os.path.expanduser("~/.cache/lowprec/kernels")
    monkeypatch.setenv("LOWPREC_CACHE_DIR", str(tmp_path / "env"))
    assert KernelCache().directory == str(tmp_path / "env")
    monkeypatch.setenv("LOWPREC_DISK_CACHE", "0")
    assert KernelCache(str(tmp_path)).directory is None and KernelCache().directory is None
    c = KernelCache(str(tmp_path / "off"))
    c.get("probe", {}, "sm_90a", _compile_probe)
    assert not (tmp_path / "off").exists()


def test_disk_cache_exports_and_reloads_tvm_ffi_kernel(tmp_path, monkeypatch):
    monkeypatch.delenv("LOWPREC_DISK_CACHE", raising=False)
    first = KernelCache(str(tmp_path))
    compiled = first.get("probe", {}, "sm_90a", _compile_probe)
    (entry_dir,) = tmp_path.iterdir()
    assert entry_dir.name == source_fingerprint()[:16]
    assert sorted(p.suffix for p in entry_dir.iterdir()) == [".cubin", ".o"]  # no temporary left behind
    assert first.compiles == 1 and first.loads == 0

    second = KernelCache(str(tmp_path))  # a new process would start like this
    loaded = second.get("probe", {}, "sm_90a", lambda: pytest.fail("should load from disk, not compile"))
    assert callable(loaded) and second.loads == 1 and second.compiles == 0
    assert loaded.__cubin__ == compiled.__cubin__  # sass_of works on a loaded kernel too


def _entry(tmp_path, kernel="probe"):
    path = pathlib.Path(KernelCache(str(tmp_path))._path(cache_key(kernel, {}, "sm_90a")))
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


@pytest.mark.parametrize("damage", ["garbage", "empty", "truncated", "bad_sections"])
def test_unreadable_disk_entry_is_recompiled(tmp_path, monkeypatch, damage):
    monkeypatch.delenv("LOWPREC_DISK_CACHE", raising=False)
    KernelCache(str(tmp_path)).get("probe", {}, "sm_90a", _compile_probe)
    path = _entry(tmp_path)
    good = path.read_bytes()
    if damage == "garbage":
        path.write_bytes(b"not an object file")
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "truncated":  # a writer killed halfway (without our tmp + rename)
        path.write_bytes(good[: len(good) // 2])
    else:  # a whole ELF header over a damaged section table
        shoff = int.from_bytes(good[40:48], "little")
        path.write_bytes(good[:shoff] + b"\xff" * (len(good) - shoff))
    c = KernelCache(str(tmp_path))
    with pytest.warns(RuntimeWarning, match="unreadable cached kernel"):
        kernel = c.get("probe", {}, "sm_90a", _compile_probe)
    assert c.compiles == 1 and c.loads == 0 and kernel is not None
    assert path.read_bytes() == good  # rewritten: the next process loads it
    again = KernelCache(str(tmp_path))
    again.get("probe", {}, "sm_90a", lambda: pytest.fail("the rewritten entry should load"))
    assert again.loads == 1


def _elf(section_headers_end: int) -> bytes:
    """A 64-bit ELF header alone, whose (one) section header would end at ``section_headers_end``."""
    head = bytearray(64)
    head[:6] = b"\x7fELF\x02\x01"
    head[40:48] = (section_headers_end - 64).to_bytes(8, "little")
    head[58:60], head[60:62] = (64).to_bytes(2, "little"), (1).to_bytes(2, "little")
    return bytes(head)


@pytest.mark.parametrize("cubin", ["whole", "unreadable", "truncated"])
def test_an_unreadable_cubin_is_recompiled_like_an_unreadable_object(tmp_path, monkeypatch, cubin):
    """No kernel is compiled or linked: the linker is a stand-in."""
    import types

    monkeypatch.delenv("LOWPREC_DISK_CACHE", raising=False)
    runtime = types.ModuleType("cutlass.runtime")
    runtime.load_module = lambda path, enable_tvm_ffi: types.SimpleNamespace(lowprec_kernel=types.SimpleNamespace())
    monkeypatch.setitem(sys.modules, "cutlass.runtime", runtime)
    path = _entry(tmp_path)
    path.write_bytes(_elf(64))
    cubin_path = path.with_suffix(".cubin")
    if cubin == "unreadable":  # exists, but open() fails (as without read permission)
        cubin_path.mkdir()
    else:
        cubin_path.write_bytes(_elf(64) if cubin == "whole" else _elf(4096))
    c = KernelCache(str(tmp_path))
    compiled = types.SimpleNamespace()  # no export_to_c: kept in memory only
    if cubin == "whole":
        assert c.get("probe", {}, "sm_90a", lambda: pytest.fail("should load")).__cubin__ == _elf(64)
        assert c.loads == 1
        return
    with pytest.warns(RuntimeWarning, match="unreadable cached kernel .*cubin"):
        assert c.get("probe", {}, "sm_90a", lambda: compiled) is compiled
    assert c.compiles == 1 and c.loads == 0


def test_disk_write_is_atomic(tmp_path, monkeypatch):
    """The object file appears whole under its name or not at all: it is written to a temporary
    file beside it and renamed; a failed export leaves neither a partial entry nor a temporary."""
    monkeypatch.delenv("LOWPREC_DISK_CACHE", raising=False)
    compiled = _compile_probe()
    path = _entry(tmp_path)
    seen = []
    real_replace = os.replace

    def replace(src, dst):
        seen.append((src, dst, os.path.exists(dst), os.path.getsize(src)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    cache._store(compiled, str(path))
    (src, dst, existed, size), = [s for s in seen if s[1].endswith(".o")]
    assert dst == str(path) and not existed and os.path.dirname(src) == str(path.parent) and src != dst
    assert size == path.stat().st_size > 0

    class Failing:
        __cubin__ = b"cubin"

        def export_to_c(self, path, function_name):
            pathlib.Path(path).write_bytes(b"\x7fELF half")
            raise RuntimeError("killed halfway")

    other = _entry(tmp_path, "other")
    cache._store(Failing(), str(other))  # the disk layer is an optimization: no error
    assert not other.exists()
    assert sorted(p.name for p in path.parent.iterdir() if p.name.startswith(".tmp")) == []


def test_old_fingerprint_directories_are_pruned(tmp_path, monkeypatch):
    monkeypatch.delenv("LOWPREC_DISK_CACHE", raising=False)
    for i in range(10):
        old = tmp_path / f"{i:016x}"
        old.mkdir()
        os.utime(old, (1000 + i, 1000 + i))
    (tmp_path / "mine").mkdir()  # not a fingerprint directory: left alone
    KernelCache(str(tmp_path)).get("probe", {}, "sm_90a", _compile_probe)
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert kept == sorted([f"{i:016x}" for i in range(3, 10)] + ["mine", source_fingerprint()[:16]])


def test_concurrent_gets_compile_once(tmp_path, monkeypatch):
    monkeypatch.setenv("LOWPREC_DISK_CACHE", "0")
    c = KernelCache()
    calls = []
    barrier = threading.Barrier(8)

    def compile_fn():
        calls.append(1)
        return object()

    def worker(out):
        barrier.wait()
        out.append(c.get("probe", {"n": 1}, "sm_90a", compile_fn))

    results = []
    threads = [threading.Thread(target=worker, args=(results,)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len({id(r) for r in results}) == 1


# --------------------------------------------------------------------------------------- GPU
_CHILD = textwrap.dedent("""
    import json, sys
    import torch
    from lowprec.runtime import kernel_cache
    from lowprec.gemm.sm90.interface import gemm_blockwise_fp8
    from lowprec.quant.sm90.interface import quantize_1x128, quantize_128x128

    torch.manual_seed(0)
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(384, 512, device="cuda", dtype=torch.bfloat16)
    a, sa = quantize_1x128(x)  # shared-memory slots
    b, sb = quantize_128x128(w)
    d = gemm_blockwise_fp8(a, sa, b, sb)  # dynamic shared memory (the max-dynamic-smem attribute)
    torch.cuda.synchronize()
    torch.save({"a": a.view(torch.uint8).cpu(), "sa": sa.cpu(), "b": b.view(torch.uint8).cpu(), "sb": sb.cpu(),
                "d": d.cpu()}, sys.argv[1])
    print(json.dumps({"compiles": kernel_cache.compiles, "loads": kernel_cache.loads}))
""")


@pytest.mark.gpu
def test_kernels_load_from_disk_in_a_fresh_process(tmp_path):
    """A GEMM (dynamic shared memory) and two quantize kernels compiled and saved by one process
    load in a fresh one without compiling and give the same bits."""
    if torch.cuda.get_device_capability() != (9, 0) or importlib.util.find_spec("cutlass") is None:
        pytest.skip("needs an sm_90 GPU and nvidia-cutlass-dsl")
    env = {**os.environ, "LOWPREC_CACHE_DIR": str(tmp_path / "kernels")}
    env.pop("LOWPREC_DISK_CACHE", None)  # the default: on
    env["PYTHONPATH"] = os.pathsep.join([str(pathlib.Path(cache.__file__).resolve().parents[2]),
                                         env.get("PYTHONPATH", "")])
    runs = []
    for i in range(2):
        done = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / f"out{i}.pt")], env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-4000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert runs[0] == {"compiles": 3, "loads": 0}
    assert runs[1] == {"compiles": 0, "loads": 3}
    first, second = torch.load(tmp_path / "out0.pt"), torch.load(tmp_path / "out1.pt")
    for name in first:
        bits = [t[name].contiguous().view(torch.uint8) for t in (first, second)]
        assert torch.equal(*bits), name


def test_the_memory_key_tells_1_from_true(monkeypatch):
    """1 == True hash alike; the in-memory key keeps the types, as the disk key (a string) does."""
    monkeypatch.setenv("LOWPREC_DISK_CACHE", "0")
    kernels = KernelCache()
    assert cache_key("k", {"x": 1}, "sm_90a") != cache_key("k", {"x": True}, "sm_90a")
    assert kernels.get("k", {"x": 1}, "sm_90a", lambda: "compiled for 1") == "compiled for 1"
    assert kernels.get("k", {"x": True}, "sm_90a", lambda: "compiled for True") == "compiled for True"


def test_cache_dir_from_the_environment_expands_the_home_directory(tmp_path, monkeypatch):
    """As the default (~/.cache/lowprec/kernels) is: '~' in LOWPREC_CACHE_DIR is the home
    directory, not a directory named '~' under the working directory."""
    monkeypatch.delenv("LOWPREC_DISK_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("LOWPREC_CACHE_DIR", "~/kernels")
    assert KernelCache().directory == os.path.join(str(tmp_path), "kernels")
    assert KernelCache("~/mine").directory == os.path.join(str(tmp_path), "mine")
    monkeypatch.setenv("LOWPREC_CACHE_DIR", str(tmp_path / "plain"))
    assert KernelCache().directory == str(tmp_path / "plain")


@pytest.mark.parametrize("value", ["false", "off", "no", "FALSE", " 0 "])
def test_disk_cache_off_spellings_turn_it_off(tmp_path, monkeypatch, value):
    monkeypatch.setenv("LOWPREC_DISK_CACHE", value)
    assert KernelCache(str(tmp_path)).directory is None


@pytest.mark.parametrize("value", ["1", "true", "on", "yes", ""])
def test_disk_cache_on_spellings_keep_it_on(tmp_path, monkeypatch, value):
    monkeypatch.setenv("LOWPREC_DISK_CACHE", value)
    assert KernelCache(str(tmp_path)).directory == str(tmp_path)


def test_bad_disk_cache_value_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("LOWPREC_DISK_CACHE", "disabled")
    with pytest.raises(ValueError, match="LOWPREC_DISK_CACHE"):
        _ = KernelCache(str(tmp_path)).directory
