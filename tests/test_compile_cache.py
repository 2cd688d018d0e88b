"""Compile artifacts kept with a run (dflash/train/compile_cache.py): written after a compile, loaded by a
later process, a missing or unreadable file is no error (torch compiles as it would without it)."""

import time

import pytest
import torch

from dflash.train.compile_cache import (CompileProgress, artifacts_path, artifacts_to_load, load_compile_artifacts,
                                        save_compile_artifacts)


def test_artifacts_round_trip_and_a_bad_file_is_not_used(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    compiled = torch.compile(lambda x: (x.sin() * 2).sum())
    assert torch.allclose(compiled(torch.ones(8)), (torch.ones(8).sin() * 2).sum())
    path = tmp_path / "run" / "compile-artifacts.bin"
    assert save_compile_artifacts(path) > 0
    assert load_compile_artifacts(path).startswith("loaded compile artifacts")
    assert load_compile_artifacts(tmp_path / "missing.bin") == ""
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"not torch's")
    assert "not used" in load_compile_artifacts(bad)


def test_each_device_has_its_own_file_and_falls_back_to_cuda0s(tmp_path):
    assert artifacts_path(tmp_path, 0).name == "compile-artifacts.bin"
    assert artifacts_path(tmp_path, 3).name == "compile-artifacts.cuda3.bin"
    assert artifacts_to_load(tmp_path, 3) == artifacts_path(tmp_path, 0)  # nothing saved yet: cuda:0's name
    artifacts_path(tmp_path, 3).write_bytes(b"x")
    assert artifacts_to_load(tmp_path, 3) == artifacts_path(tmp_path, 3)
    assert artifacts_to_load(tmp_path, 1) == artifacts_path(tmp_path, 0)


def test_the_first_step_says_what_has_compiled_while_it_compiles():
    """CompileProgress reports the seconds so far and the compile totals every `every` seconds, and stops."""
    said = []
    with CompileProgress(said.append, every=0.02):
        time.sleep(0.2)
    count = len(said)
    time.sleep(0.1)
    assert count >= 2 and len(said) == count, "reports while inside, none after"
    assert said[0].startswith("first step: compiling, 0 s so far: ") and "graphs" in said[0]


class FakeKernel:
    """What dflash reads of Triton's CompiledKernel: its cache key and its metadata group (file -> path)."""

    def __init__(self, cache_dir, key_hex: str, name: str):
        from dflash.train.compile_cache import cache_key_dir

        self.hash = key_hex
        directory = cache_dir / cache_key_dir(key_hex)
        directory.mkdir(parents=True)
        self.metadata_group = {}
        for suffix, data in ((".json", b'{"name": "%s"}' % name.encode()), (".cubin", bytes(range(256)) * 4)):
            (directory / (name + suffix)).write_bytes(data)
            self.metadata_group[name + suffix] = str(directory / (name + suffix))


def test_dflash_triton_kernels_travel_beside_the_artifacts_into_another_cache(tmp_path, monkeypatch):
    """The blockwise and AdamW kernels (no part of torch's artifacts) are kept in `<stem>.triton.tar` with their
    launchers and written into a new machine's Triton cache: every file byte for byte, each kernel's group file
    naming its files where they now are, nothing rewritten when the tar already holds every kernel."""
    import json

    from dflash.train import compile_cache

    first, second = tmp_path / "first-cache", tmp_path / "second-cache"
    kernels = [FakeKernel(first, "ab" * 32, "forward_kernel"), FakeKernel(first, "cd" * 32, "dq_kernel")]
    launcher_dir = compile_cache.cache_key_dir("ef" * 32)
    (first / launcher_dir).mkdir()
    (first / launcher_dir / "__triton_launcher.so").write_bytes(b"\x7fELF launcher")
    monkeypatch.setattr(compile_cache, "launcher_entry", lambda kernel: (launcher_dir, "__triton_launcher.so"))
    monkeypatch.setattr(compile_cache, "triton_cache_dir", lambda: first)
    artifacts = tmp_path / "run" / "compile-artifacts.cuda1.bin"
    artifacts.parent.mkdir()
    tar = compile_cache.kernels_file(artifacts)
    assert tar.name == "compile-artifacts.cuda1.triton.tar"
    assert compile_cache.save_triton_kernels(tar, kernels) > 0
    assert compile_cache.save_triton_kernels(tar, kernels) == 0  # already kept
    assert compile_cache.save_triton_kernels(tar, kernels + [FakeKernel(first, "01" * 32, "dkdv_kernel")]) > 0

    monkeypatch.setattr(compile_cache, "triton_cache_dir", lambda: second)
    said = compile_cache.load_compile_artifacts(artifacts)  # no torch artifacts yet: the kernels alone
    assert said == f"restored 3 of dflash's Triton kernels from {tar}"
    for directory in (compile_cache.cache_key_dir(k) for k in ("ab" * 32, "cd" * 32, "01" * 32)):
        group_file = next((second / directory).glob("__grp__*.json"))
        children = json.loads(group_file.read_text())["child_paths"]
        assert sorted(children) == sorted(p.name for p in (first / directory).iterdir())
        for name, path in children.items():
            assert path == str(second / directory / name)
            assert (second / directory / name).read_bytes() == (first / directory / name).read_bytes()
    assert (second / launcher_dir / "__triton_launcher.so").read_bytes() == b"\x7fELF launcher"
    assert not list(second.rglob("*.tmp.*"))


def test_a_bad_kernels_tar_restores_nothing_and_no_name_leaves_the_cache(tmp_path, monkeypatch):
    import io
    import json
    import tarfile

    from dflash.train import compile_cache

    monkeypatch.setattr(compile_cache, "triton_cache_dir", lambda: tmp_path / "cache")
    bad = tmp_path / "compile-artifacts.triton.tar"
    bad.write_bytes(b"not a tar")
    assert compile_cache.restore_triton_kernels(bad) == 0
    escaping = io.BytesIO()
    with tarfile.open(fileobj=escaping, mode="w") as archive:
        data = json.dumps([{"dir": "..", "files": ["x.json"], "group": "x.json"}]).encode()
        info = tarfile.TarInfo(compile_cache.MANIFEST)
        info.size = len(data)
        archive.addfile(info, io.BytesIO(data))
    bad.write_bytes(escaping.getvalue())
    assert compile_cache.restore_triton_kernels(bad) == 0
    assert not (tmp_path / "x.json").exists()


def test_the_cache_directory_is_named_as_triton_names_it():
    triton = pytest.importorskip("triton")  # not part of the CPU install: where it is, the names agree
    from triton.runtime.cache import _base32

    from dflash.train.compile_cache import cache_key_dir

    key = "0123456789abcdef" * 4
    assert cache_key_dir(key) == _base32(key), triton.__version__


def test_kernels_that_cannot_be_kept_leave_the_artifacts_and_the_run_alone(tmp_path, monkeypatch):
    """Another Triton's internals (an attribute gone, a layout changed) cost the kept kernels, never the save
    of torch's artifacts or the load."""
    from dflash.train import compile_cache

    def broken(*args, **kwargs):
        raise AttributeError("'JITFunction' object has no attribute 'device_caches'")

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(compile_cache, "save_triton_kernels", broken)
    monkeypatch.setattr(compile_cache, "restore_triton_kernels", broken)
    compiled = torch.compile(lambda x: (x.cos() * 3).sum())
    compiled(torch.ones(8))
    path = tmp_path / "compile-artifacts.bin"
    assert compile_cache.save_compile_artifacts(path) > 0
    assert compile_cache.load_compile_artifacts(path).startswith("loaded compile artifacts")
