"""Compile artifacts kept with a run (dflash/compile_cache.py): written after a compile, loaded by a
later process, a missing or unreadable file is no error (torch compiles as it would without it)."""

import torch

from dflash.compile_cache import load_compile_artifacts, save_compile_artifacts


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
