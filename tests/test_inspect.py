"""Tests for `dflash inspect-cache` (stages/inspect.py) on a small synthetic store."""

import json

import numpy as np
import pytest
import torch

from dflash.store.inspection import format_bytes
from dflash.store.plan import plan_shards
from dflash.store.schema import SCHEMA_VERSION, bf16_to_bits
from dflash.store.writer import ShardWriter, create_or_open_store
from stages import inspect as inspect_stage

EDGES = [0, 16, 64]
N_LAYERS, HIDDEN = 3, 16


@pytest.fixture
def store_path(tmp_path):
    rng = np.random.default_rng(0)
    lengths = np.array([3, 5, 12, 20, 40, 63, 30])
    row_ids = np.arange(len(lengths))
    plans = plan_shards(lengths, row_ids, EDGES, shard_tokens=100)
    attrs = {
        "schema_version": SCHEMA_VERSION, "codec": "bf16", "hidden_size": HIDDEN, "target_layer_ids": [0, 2, 4],
        "bucket_edges": EDGES,
        "max_length": 63, "shards": [{"name": p.name, "bucket": p.bucket, "num_samples": len(p.sample_indices),
                                      "num_tokens": p.num_tokens} for p in plans],
    }
    root = create_or_open_store(tmp_path / "s.zarr", attrs, overwrite=False)
    for plan in plans:
        writer = ShardWriter(root, plan, lengths, row_ids, "bf16", N_LAYERS, HIDDEN, 8, 32)
        for i in plan.sample_indices:
            hidden = bf16_to_bits(torch.randn(int(lengths[i]), N_LAYERS * HIDDEN))
            mask = np.arange(lengths[i]) % 2  # half the tokens supervised (rounded down)
            writer.write_sample(i, hidden, None, rng.integers(0, 50, lengths[i]), mask)
        writer.commit()
    return tmp_path / "s.zarr"


def test_run_prints_tables_and_verifies(store_path, capsys):
    result = inspect_stage.run(store_path, as_json=False, verify=True, per_shard=True)
    out = capsys.readouterr().out
    assert "bucket" in out and "total" in out and "b01-00000" in out and "verify: OK" in out
    assert result["ok"] and result["verify"]["num_samples"] == 7
    buckets = {b["bucket"]: b for b in result["stats"]["buckets"]}
    assert buckets[0]["samples"] == 3 and buckets[0]["tokens"] == 3 + 5 + 12
    assert buckets[1]["max_length"] == 63 and buckets[1]["median_length"] == 35.0
    assert buckets[0]["supervised_share"] == pytest.approx((1 + 2 + 6) / 20)


def test_run_json_only_and_failed_verify(store_path, capsys):
    chunk = next(p for p in (store_path / "shards" / "b00-00000" / "hidden" / "c").rglob("*") if p.is_file())
    raw = bytearray(chunk.read_bytes())
    raw[12] ^= 0x55
    chunk.write_bytes(bytes(raw))
    result = inspect_stage.run(store_path, as_json=True, verify=True)
    parsed = json.loads(capsys.readouterr().out)  # nothing but JSON on stdout
    assert parsed["ok"] is False and not result["ok"]
    assert list(parsed["verify"]["bad"]) == ["b00-00000"]


def test_plot_writes_png(store_path, tmp_path, capsys):
    out = tmp_path / "plots" / "lengths.png"
    result = inspect_stage.run(store_path, plot=str(out))
    assert result["plot"] == str(out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "length histogram" in capsys.readouterr().out


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 1024 * 1024) == "3.0 MiB"
