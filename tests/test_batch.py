"""Tests for the stage-two dataset, packed collate and loader (dflash/train/batch.py)."""

import numpy as np
import pytest
import torch
from support import MicroBatchSampler

from dflash.model.loss import block_labels
from dflash.train.batch import StoreDataset, build_loader, collate_packed
from dflash.train.sampler import DataCursor

NUM_LAYERS, HIDDEN = 2, 4
BLOCK_SIZE = 4


class FakeStoreReader:
    """In-memory stand-in with the StoreReader interface (attrs, index, len, read_sample)."""

    def __init__(self, lengths, buckets, codec="bf16", seed=0, row_ids=None):
        self.attrs = {"codec": codec, "hidden_size": HIDDEN, "target_layer_ids": [1, 2], "bucket_edges": [8, 32]}
        self.row_ids = list(range(len(lengths))) if row_ids is None else list(row_ids)
        self.samples = []
        for length, row_id in zip(lengths, self.row_ids):
            sample_rng = np.random.default_rng([seed, row_id])  # content depends on the row only
            loss_mask = sample_rng.random(length) < 0.6
            width = NUM_LAYERS * HIDDEN
            fp8 = codec == "fp8"
            self.samples.append({
                "hidden": sample_rng.integers(0, 256 if fp8 else 65536, (length, width)).astype(np.uint8 if fp8 else np.uint16),
                "scale": sample_rng.random((length, NUM_LAYERS)).astype(np.float32) if fp8 else None,
                "input_ids": sample_rng.integers(0, 1000, length).astype(np.int64),
                "loss_mask": loss_mask,
                "row_id": row_id,
            })
        self.index = {
            "length": np.asarray(lengths, dtype=np.int64),
            "bucket": np.asarray(buckets, dtype=np.int64),
            "num_supervised": np.array([s["loss_mask"].sum() for s in self.samples], dtype=np.int64),
        }

    def __len__(self):
        return len(self.samples)

    def read_sample(self, i):
        return {key: (value.copy() if isinstance(value, np.ndarray) else value) for key, value in self.samples[i].items()}


def make_reader(codec="bf16", num_samples=40, seed=0):
    rng = np.random.default_rng(seed)
    buckets = rng.integers(0, 2, num_samples)
    lengths = np.where(buckets == 0, rng.integers(2, 9, num_samples), rng.integers(9, 33, num_samples))
    return FakeStoreReader(lengths, buckets, codec=codec, seed=seed)


@pytest.mark.parametrize("codec", ["bf16", "fp8"])
def test_collate_lays_out_the_packed_micro_batch(codec):
    reader = make_reader(codec)
    dataset = StoreDataset(reader, max_anchors=5, seed=3)
    picked = [4, 0, 7]
    items = [dataset[(1, i)] for i in picked]
    batch = collate_packed(items, pad_multiple=16)
    lengths = [len(reader.samples[i]["input_ids"]) for i in picked]
    num_real = sum(lengths)
    T, A = batch["input_ids"].shape[0], batch["anchor_pos"].shape[0]
    assert T % 16 == 0 and A % 16 == 0 and T >= num_real
    assert batch["num_tokens"].item() == T and batch["num_real_tokens"].item() == num_real
    assert batch["hidden"].dtype == (torch.uint8 if codec == "fp8" else torch.uint16)
    assert ("scale" in batch) == (codec == "fp8")
    offset = 0
    for doc, (i, length) in enumerate(zip(picked, lengths)):
        sample, rows = reader.samples[i], slice(offset, offset + length)
        assert torch.equal(batch["doc_ids"][rows], torch.full((length,), doc))
        assert torch.equal(batch["position_ids"][rows], torch.arange(length))
        assert np.array_equal(batch["input_ids"][rows].numpy(), sample["input_ids"])
        assert np.array_equal(batch["loss_mask"][rows].numpy(), sample["loss_mask"])
        assert np.array_equal(batch["hidden"][rows].numpy(), sample["hidden"])
        if codec == "fp8":
            assert np.array_equal(batch["scale"][rows].numpy(), sample["scale"])
        offset += length
    # padding: never a document, never supervised
    assert (batch["doc_ids"][num_real:] == -1).all() and not batch["loss_mask"][num_real:].any()
    assert (batch["hidden"][num_real:].to(torch.int32) == 0).all()
    check_anchors(batch, items, reader, picked)
    # With a block size the collate lists the labelled block rows (the LM head runs over those only).
    assert "label_rows" not in batch
    with_rows = collate_packed(items, pad_multiple=16, block_size=4)
    _, valid_AB = block_labels(with_rows["input_ids"], with_rows["loss_mask"], with_rows["doc_ids"],
                               with_rows["anchor_index"], with_rows["anchor_valid"], 4)
    assert with_rows["label_rows"].tolist() == valid_AB.reshape(-1).nonzero().squeeze(1).tolist()
    assert len(with_rows["label_rows"]) > 0


def check_anchors(batch, items, reader, picked):
    valid = batch["anchor_valid"]
    num_real = sum(len(item["anchors"]) for item in items)
    assert valid.sum().item() == num_real == batch["num_real_anchors"].item()
    assert valid[:num_real].all() and not valid[num_real:].any()
    assert (batch["anchor_doc"][num_real:] == -1).all()
    assert torch.all(batch["anchor_index"][1:] >= batch["anchor_index"][:-1])  # sorted, padding last
    for a in range(num_real):
        doc, pos, flat = (batch[k][a].item() for k in ("anchor_doc", "anchor_pos", "anchor_index"))
        assert batch["doc_ids"][flat] == doc and batch["position_ids"][flat] == pos
        assert batch["input_ids"][flat] == reader.samples[picked[doc]]["input_ids"][pos]
        assert reader.samples[picked[doc]]["loss_mask"][pos + 1]  # the next token is supervised


def test_micro_batch_metadata():
    reader = make_reader()
    dataset = StoreDataset(reader, max_anchors=4, seed=0)
    same_bucket = [i for i in range(len(reader)) if reader.index["bucket"][i] == 1][:3]
    batch = collate_packed([dataset[(2, i)] for i in same_bucket], pad_multiple=8)
    assert batch["bucket"].item() == 1 and batch["epoch"].item() == 2
    assert batch["sample_indices"].tolist() == same_bucket
    assert batch["lengths"].tolist() == reader.index["length"][same_bucket].tolist()
    mixed = [same_bucket[0], int(np.flatnonzero(reader.index["bucket"] == 0)[0])]
    assert collate_packed([dataset[(0, i)] for i in mixed], 8)["bucket"].item() == -1


def test_anchors_are_reproducible_and_keyed_by_row_id():
    reader = make_reader(num_samples=10)
    dataset = StoreDataset(reader, max_anchors=3, seed=9)
    first = [dataset[(0, i)]["anchors"] for i in range(10)]
    assert all(np.array_equal(a, dataset[(0, i)]["anchors"]) for i, a in enumerate(first))
    next_epoch = [dataset[(1, i)]["anchors"] for i in range(10)]
    assert any(not np.array_equal(a, b) for a, b in zip(first, next_epoch))
    assert all(len(a) <= 3 for a in first)
    # a re-planned store lists the same rows in another order: anchors follow the row
    order = [3, 7, 0, 9, 1, 2, 8, 4, 6, 5]
    replanned = FakeStoreReader(reader.index["length"][order], reader.index["bucket"][order], row_ids=order)
    replanned_dataset = StoreDataset(replanned, max_anchors=3, seed=9)
    for new_index, row in enumerate(order):
        assert np.array_equal(replanned_dataset[(0, new_index)]["anchors"], first[row])


def test_sample_with_inconsistent_arrays_is_named():
    reader = make_reader(num_samples=3)
    reader.samples[2]["loss_mask"] = reader.samples[2]["loss_mask"][:-1]
    with pytest.raises(ValueError, match="sample 2 \\(row 3\\)"):  # row id 2 is the third row
        StoreDataset(reader, max_anchors=3, seed=0)[(0, 2)]


def test_pad_multiple_one_pads_nothing_but_keeps_one_anchor_slot():
    reader = FakeStoreReader([3], [0])
    reader.samples[0]["loss_mask"][:] = False  # no anchors at all
    batch = collate_packed([StoreDataset(reader, 4, 0)[(0, 0)]], pad_multiple=1)
    assert batch["input_ids"].shape == (3,) and batch["anchor_pos"].shape == (1,)
    assert not batch["anchor_valid"].any() and batch["anchor_doc"].item() == -1


def loader_batches(num_workers):
    reader = make_reader(num_samples=60, seed=1)
    sampler = MicroBatchSampler(
        reader.index["length"], reader.index["bucket"], token_budget=64, world_size=1, rank=0,
        accum_steps=2, seed=4, cursor=DataCursor(0, 0), num_epochs=2,
    )
    loader = build_loader(StoreDataset(reader, max_anchors=6, seed=4), sampler,
                          pad_multiple=8, num_workers=num_workers, prefetch_factor=2)
    return list(loader)


def test_loader_with_workers_matches_loader_without():
    serial, parallel = loader_batches(0), loader_batches(2)
    assert len(serial) == len(parallel) > 0
    for a, b in zip(serial, parallel):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert {b["epoch"].item() for b in serial} == {0, 1}


def test_a_fused_step_loads_the_micro_batches_of_each_step_together():
    """train.fuse_accum: the loader gives one micro-batch per step holding the rank's accum_steps
    micro-batches' samples in order, each anchor tagged with its micro-batch (`anchor_group`), and
    each micro-batch's bucket; an ordinary micro-batch carries neither."""
    from dflash.train.batch import epoch_loader
    from dflash.train.sampler import build_epoch_schedule

    reader = make_reader(num_samples=60)
    dataset = StoreDataset(reader, max_anchors=6, seed=0)
    schedule = build_epoch_schedule(reader.index["length"], reader.index["bucket"], 48, 1, 2, 0, 0)
    options = dict(pad_multiple=8, block_size=BLOCK_SIZE, num_workers=0, pin_memory=False)
    plain = list(epoch_loader(dataset, schedule, 0, 1, **options))
    fused = list(epoch_loader(dataset, schedule, 0, 1, **options, fuse=True))
    assert len(plain) == 2 * len(fused) == 2 * (schedule.num_steps - 1)
    assert "anchor_group" not in plain[0] and "group_buckets" not in plain[0]
    for step, batch in enumerate(fused):
        first, second = plain[2 * step], plain[2 * step + 1]
        assert batch["sample_indices"].tolist() == first["sample_indices"].tolist() + second["sample_indices"].tolist()
        assert batch["group_buckets"] == [int(first["bucket"]), int(second["bucket"])]
        assert int(batch["bucket"]) == -1 or first["bucket"] == second["bucket"]
        real = int(batch["num_real_anchors"])
        assert real == int(first["num_real_anchors"]) + int(second["num_real_anchors"])
        expected = [0] * int(first["num_real_anchors"]) + [1] * int(second["num_real_anchors"])
        assert batch["anchor_group"][:real].tolist() == expected
        parts = [part["anchor_pos"][:int(part["num_real_anchors"])].tolist() for part in (first, second)]
        assert batch["anchor_pos"][:real].tolist() == parts[0] + parts[1]


def test_fused_groups_number_only_the_micro_batches_left_after_skipped_samples():
    """A micro-batch whose every sample was unreadable drops out of the step (as the unfused step drops an
    empty micro-batch), so the groups left are numbered 0..G-1 and each keeps its bucket."""
    from dflash.train.batch import fused_groups

    items = [{"group": 0, "bucket": 1}, {"group": 2, "bucket": 0}, {"group": 2, "bucket": 0}]
    anchor_doc = np.array([0, 0, 1, 2, 2, -1, -1])
    groups, buckets = fused_groups(items, anchor_doc)
    assert groups.tolist() == [0, 0, 1, 1, 1, 0, 0] and buckets == [1, 0]
    assert fused_groups([{"bucket": 1}], anchor_doc) is None
