"""The visibility rule: mask_mod (dense backend) vs a loop-by-loop reference, flex vs SDPA."""

import numpy as np
import pytest
import torch
from support import reference_dense_mask

from dflash.model.masks import attend, build_masks, default_backend

LAYER_TYPES = ["sliding_attention", "full_attention"]


def random_packed_meta(rng: np.random.Generator, block_size: int, pad_context: int, pad_anchors: int) -> dict:
    """Several sequences of random lengths packed in one row, sorted random anchors, padding."""
    doc_ids, position_ids, anchor_doc, anchor_pos = [], [], [], []
    for doc in range(int(rng.integers(2, 5))):
        length = int(rng.integers(1, 25))
        doc_ids += [doc] * length
        position_ids += list(range(length))
        chosen = np.sort(rng.choice(length, size=int(rng.integers(1, min(length, 6) + 1)), replace=False))
        anchor_doc += [doc] * len(chosen)
        anchor_pos += chosen.tolist()
    doc_ids += [-1] * pad_context
    position_ids += [0] * pad_context
    anchor_doc += [-1] * pad_anchors
    anchor_pos += [0] * pad_anchors
    return {name: torch.tensor(values) for name, values in [
        ("doc_ids", doc_ids), ("position_ids", position_ids), ("anchor_doc", anchor_doc), ("anchor_pos", anchor_pos)
    ]}


@pytest.mark.parametrize("seed", range(6))
def test_mask_mod_equals_reference(seed):
    rng = np.random.default_rng(seed)
    block_size, window = 4, 5
    meta = random_packed_meta(rng, block_size, pad_context=int(rng.integers(0, 4)), pad_anchors=int(rng.integers(0, 3)))
    masks = build_masks(meta, LAYER_TYPES, window, block_size=block_size, backend="dense", device="cpu")
    for layer_type, layer_window in [("sliding_attention", window), ("full_attention", None)]:
        expected = reference_dense_mask(
            meta["doc_ids"], meta["position_ids"], meta["anchor_doc"], meta["anchor_pos"], block_size, layer_window
        )
        assert masks[layer_type].shape == (1, 1, *expected.shape)
        assert torch.equal(masks[layer_type][0, 0], expected), f"{layer_type} mask differs from the reference"
        assert masks[layer_type].any(dim=-1).all(), "a query row sees nothing (SDPA would give NaN)"
    num_context = len(meta["doc_ids"])
    sliding_ctx = masks["sliding_attention"][0, 0, :, :num_context]
    full_ctx = masks["full_attention"][0, 0, :, :num_context]
    assert torch.all(full_ctx >= sliding_ctx)


def test_window_cuts_and_block_is_causal_only_for_sliding():
    block_size, window = 4, 5
    meta = {
        "doc_ids": torch.tensor([0] * 12 + [1] * 3),
        "position_ids": torch.tensor(list(range(12)) + list(range(3))),
        "anchor_doc": torch.tensor([0, 1]),
        "anchor_pos": torch.tensor([9, 2]),
    }
    masks = build_masks(meta, LAYER_TYPES, window, block_size=block_size, backend="dense", device="cpu")
    sliding, full = masks["sliding_attention"][0, 0], masks["full_attention"][0, 0]
    # Anchor 0 (doc 0, position 9), slot 0 (query position 9): full sees positions 0..8,
    # sliding sees 5..8 (9 - p < 5); slot 3 (position 12) sees 8 only.
    assert full[0, :15].tolist() == [True] * 9 + [False] * 6
    assert sliding[0, :15].tolist() == [False] * 5 + [True] * 4 + [False] * 6
    assert sliding[3, :15].tolist() == [False] * 8 + [True] + [False] * 6
    # Block keys of anchor 0 are columns 15..18: bidirectional in full, causal in sliding.
    assert full[0, 15:19].all() and not full[0, 19:].any()
    assert sliding[1, 15:19].tolist() == [True, True, False, False]
    # Anchor 1 (doc 1, position 2) never sees doc 0.
    assert full[4:8, :12].sum() == 0 and full[4, 12:15].tolist() == [True, True, False]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("seed", range(3))
def test_flex_block_mask_matches_dense_sdpa(seed):
    rng = np.random.default_rng(100 + seed)
    block_size, window = 4, 5
    meta = random_packed_meta(rng, block_size, pad_context=3, pad_anchors=2)
    dense = build_masks(meta, LAYER_TYPES, window, block_size=block_size, backend="dense", device="cpu")
    flex = build_masks(meta, LAYER_TYPES, window, block_size=block_size, backend="flex", device="cpu")
    num_queries = len(meta["anchor_doc"]) * block_size
    num_keys = len(meta["doc_ids"]) + num_queries
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, num_queries, 8, generator=generator)
    k = torch.randn(1, 2, num_keys, 8, generator=generator)
    v = torch.randn(1, 2, num_keys, 8, generator=generator)
    for layer_type in LAYER_TYPES:
        flex_out = attend(q, k, v, flex[layer_type])
        dense_out = attend(q, k, v, dense[layer_type])
        assert torch.isfinite(dense_out).all()
        torch.testing.assert_close(flex_out, dense_out, atol=1e-5, rtol=1e-5)


def test_default_backend():
    assert default_backend("cpu") == "dense" and default_backend("cuda") == "flex"


def test_bad_inputs_are_named():
    meta = {"doc_ids": torch.zeros(4, dtype=torch.long), "position_ids": torch.arange(4),
            "anchor_doc": torch.zeros(1, dtype=torch.long), "anchor_pos": torch.tensor([2])}
    with pytest.raises(ValueError, match="smaller than block size"):
        build_masks(meta, LAYER_TYPES, 3, block_size=4, backend="dense", device="cpu")
    with pytest.raises(ValueError, match="unknown layer type"):
        build_masks(meta, ["linear_attention"], 8, block_size=4, backend="dense", device="cpu")
    with pytest.raises(KeyError, match="anchor_pos"):
        build_masks({k: v for k, v in meta.items() if k != "anchor_pos"}, LAYER_TYPES, 8, block_size=4, device="cpu")
