"""Compile artifacts kept with a run (dflash/train/compile_cache.py): written after a compile, loaded by a
later process, a missing or unreadable file is no error (torch compiles as it would without it)."""

import time

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
