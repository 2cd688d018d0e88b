"""The visibility rule: mask_mod (dense backend) vs a loop-by-loop reference, flex vs SDPA."""

import numpy as np
import pytest
import torch
from support import reference_dense_mask, tiled_packed_meta
from torch.nn.attention.flex_attention import create_block_mask, create_mask

from dflash.model.masks import (GatheredMask, attend, block_mask_from_layout, build_masks, default_backend, gather_keys,
                                gathered_mask_mod, layer_windows, make_mask_mod)
from dflash.model.tiles import TILE, gather_context_keys, tile_layout, tiles_key

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


def assert_flex_attends_like_dense(meta: dict, flex: dict, dense: dict, block_size: int, seed: int) -> None:
    """Flex attention through `flex`'s masks equals SDPA through `dense`'s, per layer type, on random q, k, v
    (4 query heads over 2 key heads)."""
    num_queries = len(meta["anchor_doc"]) * block_size
    num_keys = len(meta["doc_ids"]) + num_queries
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, num_queries, 8, generator=generator)
    k = torch.randn(1, 2, num_keys, 8, generator=generator)
    v = torch.randn(1, 2, num_keys, 8, generator=generator)
    for layer_type in LAYER_TYPES:
        dense_out = attend(q, k, v, dense[layer_type])
        assert torch.isfinite(dense_out).all()
        torch.testing.assert_close(attend(q, k, v, flex[layer_type]), dense_out, atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("seed", range(3))
def test_flex_block_mask_matches_dense_sdpa(seed):
    rng = np.random.default_rng(100 + seed)
    block_size, window = 4, 5
    meta = random_packed_meta(rng, block_size, pad_context=3, pad_anchors=2)
    dense = build_masks(meta, LAYER_TYPES, window, block_size=block_size, backend="dense", device="cpu")
    flex = build_masks(meta, LAYER_TYPES, window, block_size=block_size, backend="flex", device="cpu")
    assert_flex_attends_like_dense(meta, flex, dense, block_size, seed)


def test_default_backend():
    assert default_backend("cpu") == "dense" and default_backend("cuda") == "flex"


def test_auto_trains_with_blockwise_on_cuda_only_where_it_was_measured(monkeypatch):
    from dflash.model import masks

    refusals = iter([None, "needs Triton"])
    monkeypatch.setattr(masks, "triton_refusal", lambda device: next(refusals))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: (9, 0))  # an H100 / H200
    assert [masks.training_backend("auto", "cuda", 64), masks.training_backend("auto", "cuda", 128)] == \
        ["blockwise", "flex"]  # the second without Triton
    monkeypatch.setattr(masks, "triton_refusal", lambda device: None)
    assert masks.training_backend("auto", "cuda", 128) == "blockwise"
    assert masks.training_backend("auto", "cuda", 256) == "flex"  # not timed there
    assert masks.training_backend("auto", "cuda", 32) == "flex"
    assert masks.training_backend("auto", "cuda", 64, gathered=True) == "flex"  # gathered keys are flex's layout
    assert masks.training_backend("auto", "cpu", 64) == "dense"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: (8, 6))  # a card it was not timed on
    assert masks.training_backend("auto", "cuda", 64) == "flex"
    for named in masks.BACKENDS:
        assert masks.training_backend(named, "cpu", 64) == named


def test_bad_inputs_are_named():
    meta = {"doc_ids": torch.zeros(4, dtype=torch.long), "position_ids": torch.arange(4),
            "anchor_doc": torch.zeros(1, dtype=torch.long), "anchor_pos": torch.tensor([2])}
    with pytest.raises(ValueError, match="smaller than block size"):
        build_masks(meta, LAYER_TYPES, 3, block_size=4, backend="dense", device="cpu")
    with pytest.raises(ValueError, match="unknown layer type"):
        build_masks(meta, ["linear_attention"], 8, block_size=4, backend="dense", device="cpu")
    with pytest.raises(KeyError, match="anchor_pos"):
        build_masks({k: v for k, v in meta.items() if k != "anchor_pos"}, LAYER_TYPES, 8, block_size=4, device="cpu")


def layout_of(meta: dict, block_size: int, window, tile: int = TILE):
    return tile_layout(*(meta[k].numpy() for k in ("doc_ids", "position_ids", "anchor_doc", "anchor_pos")),
                       block_size, window, tile)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("block_size", [16, 4, 6])
@pytest.mark.parametrize("tile_size", [TILE, 64])
def test_tile_layout_equals_create_block_mask(seed, block_size, tile_size):
    """The tiles laid out from each row's key ranges are exactly the ones create_block_mask finds by
    evaluating the rule on every (query, key) pair: the same partial and full tiles, in the same order
    (whole blocks per query tile, and blocks of 6 rows that straddle the tiles' edges)."""
    rng = np.random.default_rng(seed)
    meta = tiled_packed_meta(rng, block_size, tile_size)
    num_queries = len(meta["anchor_doc"]) * block_size
    num_keys = len(meta["doc_ids"]) + num_queries
    for window in (int(rng.integers(block_size, 200)), block_size, None):
        layout = layout_of(meta, block_size, window, tile_size)
        assert layout is not None
        mask_mod = make_mask_mod(meta["doc_ids"], meta["position_ids"], meta["anchor_doc"], meta["anchor_pos"],
                                 block_size, window)
        expected = create_block_mask(mask_mod, 1, 1, num_queries, num_keys, device="cpu", BLOCK_SIZE=tile_size)
        for kind, (num, indices) in enumerate([(expected.kv_num_blocks, expected.kv_indices),
                                               (expected.full_kv_num_blocks, expected.full_kv_indices)]):
            num, indices = num[0, 0].numpy(), indices[0, 0].numpy()
            assert np.array_equal(layout[kind, :, 0], num), f"window {window}: tile counts differ ({kind=})"
            for tile, count in enumerate(num):
                assert np.array_equal(layout[kind, tile, 1:1 + count], indices[tile, :count])


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("tile_size", [TILE, 64])
def test_block_mask_from_tiles_attends_like_dense_sdpa(seed, tile_size):
    """The collate's tiles, through build_masks, give the attention of the dense mask."""
    rng = np.random.default_rng(200 + seed)
    block_size, window = 16, int(rng.integers(16, 120))
    meta = tiled_packed_meta(rng, block_size, tile_size)
    windows = layer_windows(LAYER_TYPES, window)
    tiled = dict(meta, **{tiles_key(t): torch.from_numpy(layout_of(meta, block_size, w, tile_size))
                          for t, w in windows.items()})
    flex = build_masks(tiled, LAYER_TYPES, window, block_size=block_size, backend="flex", device="cpu")
    dense = build_masks(meta, LAYER_TYPES, window, block_size=block_size, backend="dense", device="cpu")
    assert_flex_attends_like_dense(meta, flex, dense, block_size, seed)


def test_tile_layout_declines_layouts_it_cannot_read():
    """Not the collate's layout: None, and build_masks evaluates the rule (create_block_mask) instead."""
    rng = np.random.default_rng(7)
    meta = tiled_packed_meta(rng, 16)
    arrays = {k: v.numpy().copy() for k, v in meta.items()}
    assert tile_layout(arrays["doc_ids"][:-1], arrays["position_ids"][:-1], arrays["anchor_doc"],
                       arrays["anchor_pos"], 16, None) is None  # T not a multiple of the tile
    shifted = arrays["position_ids"].copy()
    shifted[arrays["doc_ids"] == 0] += 1  # positions that do not start at 0
    assert tile_layout(arrays["doc_ids"], shifted, arrays["anchor_doc"], arrays["anchor_pos"], 16, None) is None
    split = arrays["doc_ids"].copy()
    split[: TILE] = 0
    split[1] = 1  # sequence 0 in two runs
    assert tile_layout(split, arrays["position_ids"], arrays["anchor_doc"], arrays["anchor_pos"], 16, None) is None
    beyond = arrays["anchor_pos"].copy()
    beyond[0] = 10_000  # an anchor past its sequence's end
    assert tile_layout(arrays["doc_ids"], arrays["position_ids"], arrays["anchor_doc"], beyond, 16, None) is None


@pytest.mark.parametrize("tile_size", [TILE, 64])
def test_collate_lays_out_the_tiles_the_rule_gives(tile_size):
    """collate_packed with mask_windows writes each layer type's tiles (`mask_tile` in size); through
    block_mask_from_layout they equal create_block_mask's."""
    from dflash.train.batch import collate_packed

    rng = np.random.default_rng(3)
    items = []
    for row, length in enumerate([37, 260, 5, 129]):
        loss_mask = np.zeros(length, dtype=bool)
        loss_mask[length // 3:] = True
        anchors = np.sort(rng.choice(np.flatnonzero(loss_mask[1:]), size=min(20, int(loss_mask[1:].sum())),
                                     replace=False)) if loss_mask[1:].any() else np.zeros(0, dtype=np.int64)
        items.append({"hidden": np.zeros((length, 8), dtype=np.uint16), "input_ids": rng.integers(0, 50, length),
                      "scale": None, "loss_mask": loss_mask, "row_id": row, "anchors": anchors, "sample_index": row,
                      "epoch": 0, "bucket": 0})
    windows = layer_windows(LAYER_TYPES, 64)
    batch = collate_packed(items, pad_multiple=128, block_size=16, mask_windows=windows, mask_tile=tile_size)
    num_queries = len(batch["anchor_doc"]) * 16
    num_keys = len(batch["doc_ids"]) + num_queries
    for layer_type, window in windows.items():
        layout = batch[tiles_key(layer_type)]
        mask_mod = make_mask_mod(batch["doc_ids"], batch["position_ids"], batch["anchor_doc"], batch["anchor_pos"],
                                 16, window)
        expected = create_block_mask(mask_mod, 1, 1, num_queries, num_keys, device="cpu", BLOCK_SIZE=tile_size)
        built = block_mask_from_layout(layout, mask_mod, num_queries, num_keys)
        assert torch.equal(built.to_dense(), expected.to_dense()), layer_type
        assert torch.equal(built.full_kv_num_blocks, expected.full_kv_num_blocks)
    assert not any(key.startswith("tiles_") for key in collate_packed(items, pad_multiple=128, block_size=16))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_with_repeated_key_heads_equals_grouped_heads():
    """attend's flex path repeats each key head for its query heads: the same attention as enable_gqa."""
    from torch.nn.attention.flex_attention import flex_attention

    meta = tiled_packed_meta(np.random.default_rng(11), 16)
    num_queries = len(meta["anchor_doc"]) * 16
    num_keys = len(meta["doc_ids"]) + num_queries
    mask_mod = make_mask_mod(meta["doc_ids"], meta["position_ids"], meta["anchor_doc"], meta["anchor_pos"], 16, 40)
    mask = block_mask_from_layout(torch.from_numpy(layout_of(meta, 16, 40)), mask_mod, num_queries, num_keys)
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 6, num_queries, 8, generator=generator)
    k = torch.randn(1, 2, num_keys, 8, generator=generator)
    v = torch.randn(1, 2, num_keys, 8, generator=generator)
    grouped = flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
    torch.testing.assert_close(attend(q, k, v, mask), grouped, atol=1e-6, rtol=1e-6)


def assert_layout_lists(layout: np.ndarray, expected) -> None:
    """A `tile_layout` lists exactly a `BlockMask`'s partial and full tiles, in its order."""
    for kind, (num, indices) in enumerate([(expected.kv_num_blocks, expected.kv_indices),
                                           (expected.full_kv_num_blocks, expected.full_kv_indices)]):
        num, indices = num[0, 0].numpy(), indices[0, 0].numpy()
        assert np.array_equal(layout[kind, :, 0], num)
        for tile, count in enumerate(num):
            assert np.array_equal(layout[kind, tile, 1:1 + count], indices[tile, :count])


def gathered(meta: dict, block_size: int, window, tile_size: int = TILE):
    """The tile layout over each query tile's own context keys, and those keys (tiles.gather_context_keys)."""
    return gather_context_keys(layout_of(meta, block_size, window, tile_size), len(meta["doc_ids"]), tile_size)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("tile_size", [TILE, 64])
def test_gathered_tiles_equal_create_block_mask_over_the_gathered_keys(seed, tile_size):
    """After gathering, the layout still lists exactly the tiles the rule gives over the new keys, and
    no new key tile is read by two query tiles."""
    rng = np.random.default_rng(300 + seed)
    meta = tiled_packed_meta(rng, 16, tile_size)
    num_queries = len(meta["anchor_doc"]) * 16
    for window in (int(rng.integers(16, 200)), None):
        layout, keys = gathered(meta, 16, window, tile_size)
        mask_mod = make_mask_mod(meta["doc_ids"], meta["position_ids"], meta["anchor_doc"], meta["anchor_pos"],
                                 16, window)
        expected = create_block_mask(gathered_mask_mod(mask_mod, torch.from_numpy(keys), tile_size), 1, 1,
                                     num_queries, keys.shape[1], device="cpu", BLOCK_SIZE=tile_size)
        assert_layout_lists(layout, expected)
        readers = (expected.q_num_blocks + expected.full_q_num_blocks)[0, 0].numpy()
        assert readers.max() == 1, "a gathered key tile is read by more than one query tile"


def plain_attention(q_1NQD, k_1MKD, v_1MKD, mask_11QK):
    """Softmax attention written out (grouped key heads repeated), for float64 references."""
    group = q_1NQD.shape[1] // k_1MKD.shape[1]
    k_1NKD, v_1NKD = (x.repeat_interleave(group, dim=1) for x in (k_1MKD, v_1MKD))
    scores = (q_1NQD @ k_1NKD.transpose(-1, -2)) / q_1NQD.shape[-1] ** 0.5
    return scores.masked_fill(~mask_11QK, float("-inf")).softmax(dim=-1) @ v_1NKD


@pytest.mark.parametrize("seed", range(3))
def test_attention_over_gathered_keys_equals_shared_keys_with_gradients(seed):
    """The same attention, and the same gradients for queries, keys and values (the copies' gradients
    summed back), as over the shared keys: plain float64 attention both ways."""
    rng = np.random.default_rng(400 + seed)
    meta = tiled_packed_meta(rng, 16)
    window = int(rng.integers(16, 150))
    num_queries = len(meta["anchor_doc"]) * 16
    num_keys = len(meta["doc_ids"]) + num_queries
    mask_mod = make_mask_mod(meta["doc_ids"], meta["position_ids"], meta["anchor_doc"], meta["anchor_pos"], 16,
                             window)
    _, keys = gathered(meta, 16, window)
    keys = torch.from_numpy(keys)
    shared_mask = create_mask(mask_mod, 1, 1, num_queries, num_keys, device="cpu")
    gathered_mask = create_mask(gathered_mask_mod(mask_mod, keys), 1, 1, num_queries, keys.shape[1], device="cpu")
    generator = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(1, heads, rows, 8, generator=generator, dtype=torch.float64)
              for heads, rows in ((4, num_queries), (2, num_keys), (2, num_keys))]
    results = []
    for mask, gather in ((shared_mask, False), (gathered_mask, True)):
        q, k, v = (x.clone().requires_grad_() for x in inputs)
        k_used, v_used = (gather_keys(k, keys[0]), gather_keys(v, keys[0])) if gather else (k, v)
        out = plain_attention(q, k_used, v_used, mask)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        results.append((out.detach(), q.grad, k.grad, v.grad))
    for shared, gathered_result in zip(*results):
        torch.testing.assert_close(gathered_result, shared)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_both_layer_types_share_one_compiled_flex_graph():
    """The sliding and the full layers' rules are one code with tensor constants: compiled flex attention
    traces one graph for both (a cold start compiles flex once), and each still attends like its dense mask."""
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.reset()
    rng = np.random.default_rng(5)
    block_size, window = 16, 40
    meta = tiled_packed_meta(rng, block_size)
    windows = layer_windows(LAYER_TYPES, window)
    tiled = dict(meta, **{tiles_key(t): torch.from_numpy(layout_of(meta, block_size, w)) for t, w in windows.items()})
    flex = build_masks(tiled, LAYER_TYPES, window, block_size=block_size, backend="flex", device="cpu")
    dense = build_masks(meta, LAYER_TYPES, window, block_size=block_size, backend="dense", device="cpu")
    num_queries = len(meta["anchor_doc"]) * block_size
    num_keys = len(meta["doc_ids"]) + num_queries
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, num_queries, 8, generator=generator)
    k, v = (torch.randn(1, 2, num_keys, 8, generator=generator) for _ in range(2))
    compiled = torch.compile(flex_attention, dynamic=True, backend="aot_eager")
    before = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        for layer_type in LAYER_TYPES:
            out = compiled(q, k, v, block_mask=flex[layer_type])
            expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense[layer_type])
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] - before == 1
    assert not torch.equal(dense[LAYER_TYPES[0]], dense[LAYER_TYPES[1]])  # two different rules all the same


def collate_items(rng: np.random.Generator) -> list[dict]:
    """Three `StoreDataset`-like items (300, 41 and 170 tokens, 30 anchors each) for collate_packed."""
    items = []
    for row, length in enumerate([300, 41, 170]):
        loss_mask = np.zeros(length, dtype=bool)
        loss_mask[length // 4:] = True
        anchors = np.sort(rng.choice(np.flatnonzero(loss_mask[1:]), size=30, replace=False))
        items.append({"hidden": np.zeros((length, 8), dtype=np.uint16), "scale": None,
                      "input_ids": rng.integers(0, 50, length), "loss_mask": loss_mask, "row_id": row,
                      "anchors": anchors, "sample_index": row, "epoch": 0, "bucket": 0})
    return items


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("tile_size", [TILE, 64])
def test_flex_over_gathered_keys_equals_dense_sdpa(tile_size):
    """collate_packed(gather_keys=True) -> build_masks -> attend: flex over each query tile's own copies of
    its context keys, as dense SDPA over all keys (the CPU runs flex's forward only)."""
    from dflash.train.batch import collate_packed

    items = collate_items(np.random.default_rng(5))
    windows = layer_windows(LAYER_TYPES, 96)
    batch = collate_packed(items, pad_multiple=128, block_size=16, mask_windows=windows, gather_keys=True,
                           mask_tile=tile_size)
    flex = build_masks(batch, LAYER_TYPES, 96, block_size=16, backend="flex", device="cpu")
    dense = build_masks(batch, LAYER_TYPES, 96, block_size=16, backend="dense", device="cpu")
    assert all(isinstance(flex[layer_type], GatheredMask) for layer_type in LAYER_TYPES)
    assert_flex_attends_like_dense(batch, flex, dense, 16, 1)


def test_flex_kernel_options_small_heads_and_the_benchmarks_override(monkeypatch):
    from dflash.model import masks

    assert masks.flex_kernel_options(64) == masks.SMALL_HEAD_OPTIONS and masks.SMALL_HEAD_OPTIONS["BLOCK_M"] == 64
    assert masks.flex_kernel_options(128) == {}
    monkeypatch.setattr(masks, "FLEX_OPTIONS_OVERRIDE", {"BLOCK_M1": 32, "BLOCK_N1": 64})
    assert masks.flex_kernel_options(64) == masks.flex_kernel_options(128) == {"BLOCK_M1": 32, "BLOCK_N1": 64}


def test_mask_tile_is_the_default_or_the_override_and_holds_every_kernel_tile(monkeypatch):
    """The block masks' tile is 64 for small heads (their kernel tiles divide it), TILE for larger ones,
    unless the benchmark overrides it; kernel options that 64 cannot hold keep TILE; a tile that some kernel
    tile does not divide is an error naming the option; the trainer's collate lays out tiles of that size."""
    from dflash.model import masks
    from dflash.model.drafter import drafter_args
    from dflash.train.batch import collate_options

    assert masks.mask_tile(64) == masks.mask_tile(16) == masks.SMALL_HEAD_TILE == 64
    assert masks.mask_tile(128) == masks.mask_tile(256) == TILE
    assert collate_options("flex", drafter_args("tiny", head_dim=64))["mask_tile"] == 64
    assert collate_options("flex", drafter_args("tiny", head_dim=128))["mask_tile"] == TILE
    assert collate_options("dense", drafter_args("tiny", head_dim=64))["mask_tile"] == TILE
    monkeypatch.setattr(masks, "MASK_TILE_OVERRIDE", 128)
    assert masks.mask_tile(64) == 128
    monkeypatch.setattr(masks, "MASK_TILE_OVERRIDE", 0)
    monkeypatch.setattr(masks, "FLEX_OPTIONS_OVERRIDE", {"BLOCK_M": 128, "BLOCK_N": 64})
    assert masks.mask_tile(64) == TILE  # a 128-row kernel tile does not fit a 64-row mask tile
    monkeypatch.setattr(masks, "MASK_TILE_OVERRIDE", 64)
    with pytest.raises(ValueError, match="BLOCK_M=128"):
        masks.mask_tile(64)


def test_the_backward_choices_pickle_into_inductors_cache_keys():
    """Inductor pickles its config, the choices class included, into each FX graph cache key: the class
    `backward_configs_follow_options` installs pickles by reference (a class made inside a function did
    not, and every graph under 64-key tiles compiled from scratch)."""
    import pickle

    from dflash.model import masks

    choices = masks._choices_with_options_blocks()
    assert pickle.loads(pickle.dumps(choices)) is choices
    assert pickle.loads(pickle.dumps(choices())).__class__ is choices


def test_backward_configs_carry_the_kernel_options_blocks(monkeypatch):
    """Under the choices `backward_configs_follow_options` installs, flex attention's backward configs for
    small heads on an H100/H200 (capability 9.0) are the small heads' blocks, which divide a 64-key tile
    (inductor's own: 128-key blocks, which made the lowering find no kernel); other heads keep inductor's."""
    from torch._inductor.choices import InductorChoices

    from dflash.model import masks

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: (9, 0))
    choices = masks._choices_with_options_blocks()()
    own = InductorChoices().get_flex_attention_bwd_configs(64, torch.bfloat16, "cuda")
    assert any(64 % config.block_n1 or 64 % config.block_m2 for config in own)  # the bug's premise
    (config,) = choices.get_flex_attention_bwd_configs(64, torch.bfloat16, "cuda")
    options = masks.SMALL_HEAD_OPTIONS
    assert (config.block_m1, config.block_n1, config.block_m2, config.block_n2) == tuple(
        options[name] for name in ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2"))
    assert choices.get_flex_attention_bwd_configs(128, torch.bfloat16, "cuda") == \
        InductorChoices().get_flex_attention_bwd_configs(128, torch.bfloat16, "cuda")


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("tile_size", [TILE, 64])
@pytest.mark.parametrize("gather", [False, True])
def test_transposed_tiles_equal_what_from_kv_blocks_computes(seed, tile_size, gather):
    """The tiles per key tile the collate lays out (`tiles.transpose_layout`, what flex's backward reads)
    are the ones `BlockMask.from_kv_blocks` computes on the device: the same counts, the same query tiles in
    the same order, the same shapes and dtypes (only the padding after each list may differ)."""
    from dflash.model.tiles import transpose_layout

    rng = np.random.default_rng(500 + seed)
    meta = tiled_packed_meta(rng, 16, tile_size)
    num_queries = len(meta["anchor_doc"]) * 16
    num_keys = len(meta["doc_ids"]) + num_queries
    for window in (int(rng.integers(16, 200)), None):
        if gather:
            layout, keys = gathered(meta, 16, window, tile_size)
            num_keys = keys.shape[1]
        else:
            layout = layout_of(meta, 16, window, tile_size)
        mask_mod = make_mask_mod(meta["doc_ids"], meta["position_ids"], meta["anchor_doc"], meta["anchor_pos"],
                                 16, window)
        transposed = torch.from_numpy(transpose_layout(layout, num_keys // tile_size))
        built = block_mask_from_layout(torch.from_numpy(layout), mask_mod, num_queries, num_keys, transposed)
        expected = block_mask_from_layout(torch.from_numpy(layout), mask_mod, num_queries, num_keys)
        assert built.BLOCK_SIZE == expected.BLOCK_SIZE and built.seq_lengths == expected.seq_lengths
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
            assert torch.equal(getattr(built, name), getattr(expected, name)), name
        for counts, indices in (("q_num_blocks", "q_indices"), ("full_q_num_blocks", "full_q_indices")):
            got, want = getattr(built, indices), getattr(expected, indices)
            assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous(), indices
            assert torch.equal(getattr(built, counts), getattr(expected, counts)), counts
            for row, count in enumerate(getattr(expected, counts)[0, 0].tolist()):
                assert torch.equal(got[0, 0, row, :count], want[0, 0, row, :count]), (indices, row)
