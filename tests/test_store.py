"""Tests for the zarr store: attributes, shard writing and commit, reading, verification, stats."""

import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from support import EDGES, HIDDEN, N_LAYERS, root_attrs

from dflash.store.inspection import store_stats, verify_store
from dflash.store.plan import plan_shards
from dflash.store.reader import StoreReader
from dflash.store.schema import (CorruptShardError, StoreMismatchError, bf16_to_bits, completed_shards, diff_attrs,
                                 is_complete)
from dflash.store.writer import ShardWriter, create_or_open_store, shards_group, write_frozen_weights


def fake_sample(rng, length, codec):
    """Structured fake features: per-channel scales, so compression has something to find."""
    values = rng.normal(size=(length, N_LAYERS * HIDDEN)) * np.linspace(0.1, 8, N_LAYERS * HIDDEN)
    values_t = torch.from_numpy(values.astype(np.float32))
    if codec == "bf16":
        return bf16_to_bits(values_t), None
    scale = values_t.view(length, N_LAYERS, HIDDEN).abs().amax(-1) / 448
    fp8 = (values_t.view(length, N_LAYERS, HIDDEN) / scale[..., None]).to(torch.float8_e4m3fn)
    return fp8.view(torch.uint8).reshape(length, -1).numpy(), scale.numpy()


def build_store(path, codec="bf16", seed=0, count=24, commit=True):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 64, size=count)
    row_ids = np.arange(count) * 2 + 1
    plans = plan_shards(lengths, row_ids, EDGES, shard_tokens=300)
    root = create_or_open_store(path, root_attrs(codec, plans), overwrite=False)
    data = {}
    for plan in plans:
        writer = ShardWriter(root, plan, lengths, row_ids, codec, N_LAYERS, HIDDEN,
                             rows_per_chunk=8, rows_per_zarr_shard=32)
        for i in plan.sample_indices:
            hidden, scale = fake_sample(rng, int(lengths[i]), codec)
            ids = rng.integers(0, 50, size=lengths[i])
            mask = rng.integers(0, 2, size=lengths[i])
            data[int(row_ids[i])] = (hidden, scale, ids, mask)
            writer.write_sample(i, hidden, scale, ids, mask)
        if commit:
            writer.commit()
    return root, plans, lengths, row_ids, data


@pytest.mark.parametrize("codec", ["bf16", "fp8"])
def test_round_trip_bit_exact(tmp_path, codec):
    root, plans, lengths, row_ids, data = build_store(tmp_path / "s.zarr", codec)
    assert completed_shards(root) == {p.name for p in plans}
    reader = StoreReader(tmp_path / "s.zarr")
    assert len(reader) == len(lengths)
    assert sorted(reader.sample_row_id.tolist()) == sorted(row_ids.tolist())
    reader = pickle.loads(pickle.dumps(reader))  # as a DataLoader worker gets it
    for i in range(len(reader)):
        sample = reader.read_sample(i)
        hidden, scale, ids, mask = data[sample["row_id"]]
        assert sample["hidden"].dtype == hidden.dtype and np.array_equal(sample["hidden"], hidden)
        assert sample["input_ids"].dtype == np.int64 and np.array_equal(sample["input_ids"], ids)
        assert sample["loss_mask"].dtype == bool and np.array_equal(sample["loss_mask"], mask.astype(bool))
        assert reader.sample_num_supervised[i] == mask.sum()
        if codec == "fp8":
            assert np.array_equal(sample["scale"], scale)
        else:
            assert sample["scale"] is None
    assert verify_store(tmp_path / "s.zarr").ok


def test_writer_refuses_out_of_order_wrong_shape_and_nan(tmp_path):
    rng = np.random.default_rng(0)
    lengths, row_ids = np.array([5, 6, 7]), np.array([10, 11, 12])
    (plan,) = plan_shards(lengths, row_ids, EDGES, 100)
    root = create_or_open_store(tmp_path / "s.zarr", root_attrs("bf16", [plan]), overwrite=False)
    writer = ShardWriter(root, plan, lengths, row_ids, "bf16", N_LAYERS, HIDDEN, 4, 8)
    hidden, _ = fake_sample(rng, 6, "bf16")
    with pytest.raises(ValueError, match="expected 0"):
        writer.write_sample(1, hidden, None, np.zeros(6), np.ones(6))
    with pytest.raises(ValueError, match="row 11"):
        writer.write_sample(0, hidden, None, np.zeros(6), np.ones(6))
    hidden, _ = fake_sample(rng, 5, "bf16")
    hidden[2, 3] = 0x7FC0  # bf16 NaN
    with pytest.raises(ValueError, match="row 11: 1 non-finite"):  # row id 10 is the 11th row
        writer.write_sample(0, hidden, None, np.zeros(5), np.ones(5))
    with pytest.raises(ValueError, match="commit after 0 of 3"):
        writer.commit()


def test_attrs_mismatch_names_keys_and_overwrite_replaces(tmp_path):
    path = tmp_path / "s.zarr"
    build_store(path, count=10)
    changed = root_attrs(codec="fp8", max_length=4000, config={"seed": 1})
    diff = diff_attrs(zarr.open_group(path, mode="r").attrs["dflash"], changed)
    assert set(diff) == {"codec", "max_length", "shards"}  # `config` is not a content key
    assert diff["codec"] == ("bf16", "fp8")
    with pytest.raises(StoreMismatchError) as info:
        create_or_open_store(path, changed, overwrite=False)
    message = str(info.value)
    assert "codec" in message and "'fp8'" in message and "max_length" in message and "--overwrite" in message
    root = create_or_open_store(path, changed, overwrite=True)
    assert root.attrs["dflash"]["codec"] == "fp8"
    assert completed_shards(root) == set()
    assert list(root["shards"].group_keys()) == []  # the old shards are gone; the empty group is made up front


def test_shards_group_made_up_front_and_a_lost_create_race_opens_the_winners():
    """Writer processes open their first shards at the same moment. The store is created with
    its `shards` group, and a writer whose create loses the race opens the group the other made."""
    root = zarr.open_group(zarr.storage.MemoryStore(), mode="w")
    assert "shards" in create_or_open_store(root.store, root_attrs(), overwrite=False)

    class LostRace:  # `shards` did not exist when looked up, and did when created
        def require_group(self, name):
            raise zarr.errors.ContainsGroupError(f"a group exists at path {name!r}")

        def __getitem__(self, name):
            return root[name]

    assert shards_group(LostRace()).path == "shards"


def test_reopen_with_same_attrs_keeps_shards(tmp_path):
    path = tmp_path / "s.zarr"
    _, plans, *_ = build_store(path, count=10)
    same = zarr.open_group(path, mode="r").attrs["dflash"]
    root = create_or_open_store(path, dict(same), overwrite=False)
    assert completed_shards(root) == {p.name for p in plans}


def test_uncommitted_shard_is_not_complete_nor_read_and_is_rewritten(tmp_path):
    path = tmp_path / "s.zarr"
    root, plans, lengths, row_ids, _ = build_store(path, commit=False, count=20)
    assert completed_shards(root) == set()
    reader = StoreReader(path)
    assert len(reader) == 0 and sorted(reader.incomplete_shards) == sorted(p.name for p in plans)
    report = verify_store(path)
    assert not report.ok and all("incomplete" in report.bad[p.name] for p in plans)
    # a rerun rewrites the leftover from scratch
    writer = ShardWriter(root, plans[0], lengths, row_ids, "bf16", N_LAYERS, HIDDEN, 4, 16)
    rng = np.random.default_rng(5)
    for i in plans[0].sample_indices:
        hidden, _ = fake_sample(rng, int(lengths[i]), "bf16")
        writer.write_sample(i, hidden, None, np.zeros(lengths[i]), np.ones(lengths[i]))
    writer.commit()
    assert is_complete(root, plans[0].name)
    assert len(StoreReader(path)) == len(plans[0].sample_indices)
    with pytest.raises(ValueError, match="already complete"):
        ShardWriter(root, plans[0], lengths, row_ids, "bf16", N_LAYERS, HIDDEN, 4, 16)


def _chunk_files(path: Path, shard: str, array: str):
    return sorted(p for p in (path / "shards" / shard / array / "c").rglob("*") if p.is_file())


def test_corrupted_chunk_is_caught_by_verify(tmp_path):
    path = tmp_path / "s.zarr"
    _, plans, *_ = build_store(path, count=24)
    victim = plans[-1].name
    chunk_file = _chunk_files(path, victim, "hidden")[0]
    raw = bytearray(chunk_file.read_bytes())
    raw[10] ^= 0xFF  # inside the first compressed inner chunk
    chunk_file.write_bytes(bytes(raw))
    report = verify_store(path)
    assert not report.ok
    assert list(report.bad) == [victim], report.bad
    assert report.num_shards_checked == len(plans) - 1


def test_nan_is_caught_by_verify(tmp_path):
    path = tmp_path / "s.zarr"
    _, plans, *_ = build_store(path, count=24)
    victim = plans[0].name
    hidden = zarr.open_group(path, mode="a")["shards"][victim]["hidden"]
    rows = hidden[0:16]
    rows[3, 5] = 0x7F80  # bf16 +inf
    hidden[0:16] = rows
    report = verify_store(path)
    assert list(report.bad) == [victim] and "non-finite" in report.bad[victim]


def test_missing_planned_shard_and_broken_metadata(tmp_path):
    path = tmp_path / "s.zarr"
    _, plans, *_ = build_store(path, count=24)
    import shutil
    shutil.rmtree(path / "shards" / plans[0].name)
    (path / "shards" / plans[1].name / "offsets" / "zarr.json").write_text("{broken")
    report = verify_store(path)
    assert "missing" in report.bad[plans[0].name]
    assert plans[1].name in report.bad and len(report.bad) == 2
    with pytest.raises(CorruptShardError, match=plans[1].name):
        StoreReader(path)
    reader = StoreReader(path, on_corrupt="skip")
    assert list(reader.skipped_shards) == [plans[1].name]
    assert plans[0].name in reader.incomplete_shards
    assert len(reader) == sum(len(p.sample_indices) for p in plans[2:])


def test_frozen_weights_round_trip_and_skip(tmp_path):
    path = tmp_path / "s.zarr"
    root = create_or_open_store(path, root_attrs(), overwrite=False)
    embed = torch.randn(50, HIDDEN, dtype=torch.bfloat16)
    head = torch.randn(50, HIDDEN, dtype=torch.bfloat16)
    write_frozen_weights(root, embed, head)
    mtime = os.path.getmtime(path / "lm_head" / "zarr.json")
    write_frozen_weights(root, embed, head)  # complete: not rewritten
    assert os.path.getmtime(path / "lm_head" / "zarr.json") == mtime
    got_embed, got_head = StoreReader(path).read_frozen_weights()
    assert got_embed.dtype == torch.bfloat16 and torch.equal(got_embed, embed) and torch.equal(got_head, head)
    assert verify_store(path).ok


def test_stats_match_hand_computed(tmp_path):
    path = tmp_path / "s.zarr"
    _, plans, lengths, row_ids, data = build_store(path, count=24)
    stats = store_stats(path)
    raw_per_token = N_LAYERS * HIDDEN * 2
    assert stats["raw_bytes_per_token"] == raw_per_token
    for entry in stats["shards"]:
        plan = next(p for p in plans if p.name == entry["name"])
        shard_lengths = lengths[list(plan.sample_indices)]
        supervised = sum(data[int(row_ids[i])][3].sum() for i in plan.sample_indices)
        on_disk = sum(f.stat().st_size for f in (path / "shards" / plan.name).rglob("*")
                      if f.is_file() and f.parent != path / "shards" / plan.name)
        assert entry["samples"] == len(shard_lengths) and entry["tokens"] == shard_lengths.sum()
        assert entry["min_length"] == shard_lengths.min() and entry["max_length"] == shard_lengths.max()
        assert entry["median_length"] == pytest.approx(np.median(shard_lengths))
        assert entry["supervised_share"] == pytest.approx(supervised / shard_lengths.sum())
        assert entry["stored_bytes"] == on_disk
        assert entry["bytes_per_token"] == pytest.approx(on_disk / shard_lengths.sum())
        assert entry["compression_ratio"] == pytest.approx(shard_lengths.sum() * raw_per_token / on_disk)
    for entry in stats["buckets"]:
        in_bucket = [p for p in plans if p.bucket == entry["bucket"]]
        assert entry["samples"] == sum(len(p.sample_indices) for p in in_bucket)
        assert entry["stored_bytes"] == sum(s["stored_bytes"] for s in stats["shards"] if s["bucket"] == entry["bucket"])
    assert stats["total"]["tokens"] == lengths.sum()
    json.dumps(stats)


def test_a_store_of_another_schema_version_is_refused_by_name(tmp_path):
    import zarr

    path = tmp_path / "store"
    build_store(path, count=4)
    root = zarr.open_group(str(path), mode="r+")
    attrs = dict(root.attrs["dflash"])
    attrs["schema_version"] = 99
    root.attrs["dflash"] = attrs
    with pytest.raises(StoreMismatchError, match="schema version 99 .* this dflash reads version 1"):
        StoreReader(path)
    report = verify_store(path)
    assert not report.ok and "schema version 99" in report.bad["<root>"]
    with pytest.raises(StoreMismatchError, match="schema_version: store has 99, config gives 1"):
        create_or_open_store(path, root_attrs(), overwrite=False)
