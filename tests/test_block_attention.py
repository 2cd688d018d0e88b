"""dflash's own attention kernels (dflash/model/block_attention.py) against the dense mask's SDPA, on fresh
random packed batches: each row's two key ranges are exactly the rule's visible keys, each key tile's row
range holds every row that sees one of its keys, and the kernels' output and gradients (query, key, value;
grouped key heads) equal the reference. The kernels run where Triton is installed: on a GPU, or on the CPU
through Triton's interpreter (a GPU install's package; the CPU install has none, so those tests skip there
and `tests/test_gpu.py` runs them compiled)."""

import importlib.util

import numpy as np
import pytest
import torch
from support import run_interpreted, tiled_packed_meta

from dflash.config import ConfigError
from dflash.model import block_attention
from dflash.model.block_attention import key_tile_rows, row_ranges
from dflash.model.masks import attend, build_masks, layer_windows

LAYER_TYPES = ["sliding_attention", "full_attention"]
HAS_TRITON = importlib.util.find_spec("triton") is not None


def visible_from(ranges, num_keys: int) -> torch.Tensor:
    cols = torch.arange(num_keys)[None]
    lo, hi, block_lo, block_hi = (x.long()[:, None] for x in ranges[:4])
    return ((cols >= lo) & (cols < hi)) | ((cols >= block_lo) & (cols < block_hi))


def random_case(seed: int, long: bool = False):
    """A random packed micro-batch, its block size and sliding window; `long`: sequences of 300-900 tokens with
    up to 150 anchors each and a window of 200-400, where row tiles share long context prefixes."""
    rng = np.random.default_rng(900 + seed)
    block = 16
    if long:
        return tiled_packed_meta(rng, block, length_range=(300, 900), max_anchors=150), block, int(rng.integers(200, 400))
    meta = tiled_packed_meta(rng, block)
    window = int(rng.integers(block, 120))
    return meta, block, window


@pytest.mark.parametrize("seed", range(6))
def test_row_ranges_are_the_rules_visible_keys(seed):
    meta, block, window = random_case(seed)
    dense = build_masks(meta, LAYER_TYPES, window, block_size=block, backend="dense", device="cpu")
    blockwise = build_masks(meta, LAYER_TYPES, window, block_size=block, backend="blockwise", device="cpu")
    num_keys = len(meta["doc_ids"]) + len(meta["anchor_doc"]) * block
    for layer_type in LAYER_TYPES:
        assert torch.equal(visible_from(blockwise[layer_type], num_keys), dense[layer_type][0, 0]), layer_type


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("tile", [64, 32])
def test_each_key_tiles_rows_hold_every_row_that_sees_it(seed, tile):
    meta, block, window = random_case(seed)
    num_keys = len(meta["doc_ids"]) + len(meta["anchor_doc"]) * block
    for layer_type, layer_window in layer_windows(LAYER_TYPES, window).items():
        ranges = row_ranges(meta["doc_ids"], meta["position_ids"], meta["anchor_doc"], meta["anchor_pos"], block,
                            layer_window)
        visible = visible_from(ranges, num_keys)
        start, end, order = key_tile_rows(ranges, num_keys, tile)
        assert len(start) == -(-num_keys // tile)
        assert sorted(order.tolist()) == list(range(len(start)))  # each tile once, the most rows first
        assert ((end - start)[order.long()].diff() <= 0).all()
        spans = []
        for index in range(len(start)):
            rows = visible[:, index * tile:(index + 1) * tile].any(1).nonzero().flatten()
            if len(rows):
                assert start[index] <= rows.min() and rows.max() < end[index], (layer_type, index)
            spans.append(int(end[index] - start[index]))
        assert sum(spans) < len(start) * visible.shape[0]  # not every row for every tile


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("rows", [64, 32, 128])
def test_row_tiles_launch_by_the_keys_they_walk_the_most_first(seed, rows):
    meta, block, window = random_case(seed, long=seed % 2 == 1)
    ranges = row_ranges(meta["doc_ids"], meta["position_ids"], meta["anchor_doc"], meta["anchor_pos"], block, window)
    order = block_attention.row_tile_order(ranges[:4], rows).tolist()
    lo, hi, block_lo, block_hi = (x.tolist() for x in ranges[:4])
    work = []
    for first in range(0, len(lo), rows):  # the plain reference: each tile's two spans, row by row
        keys = 0
        for starts, ends in ((lo, hi), (block_lo, block_hi)):
            spans = [(a, b) for a, b in zip(starts[first:first + rows], ends[first:first + rows]) if a < b]
            keys += max(b for _, b in spans) - min(a for a, _ in spans) if spans else 0
        work.append(keys)
    assert sorted(order) == list(range(len(work)))
    assert [work[i] for i in order] == sorted(work, reverse=True)
    assert order == sorted(order, key=lambda i: (-work[i], i))  # ties in tile order
    if rows == block_attention.BLOCK_ROWS:
        assert order == ranges.row_order.tolist()


def test_blockwise_needs_triton_and_a_device_it_runs_on(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    reason = block_attention.triton_refusal(torch.device("cpu"))
    assert reason and ("Triton" in reason or "CUDA" in reason)
    from dflash.config import load_config
    from dflash.train.step import build_context

    class Reader:
        attrs = {"codec": "fp8"}

        def read_frozen_weights(self):
            return torch.zeros(8, 4), torch.zeros(8, 4)

    from dflash.dist import DistState
    from dflash.model.drafter import drafter_args

    config = load_config(None, ["train.attention=blockwise"])
    with pytest.raises(ConfigError, match="train.attention"):
        build_context(config, drafter_args("tiny"), Reader(), DistState(0, 1, 0, torch.device("cpu")))


OTHER_TILES = {"forward": block_attention.KernelConfig(32, 128, 4, 2), "dq": block_attention.KernelConfig(128, 32, 8, 3),
               "dkdv": block_attention.KernelConfig(32, 128, 4, 2)}


def check_kernels(seed: int, device: str, other_tiles: bool = False, long: bool = False) -> None:
    """The kernels' attention and gradients against the dense mask's SDPA, both layer types; `other_tiles`:
    at launches other than the committed ones (the key tiles of the dK/dV kernel made to match); `long`:
    `random_case`'s long sequences (row tiles whose rows share long context prefixes)."""
    if other_tiles:
        block_attention.CONFIGS_OVERRIDE.update(OTHER_TILES)
        try:
            return check_kernels(seed, device, long=long)
        finally:
            block_attention.CONFIGS_OVERRIDE.clear()
    meta, block, window = random_case(seed, long)
    device = torch.device(device)
    meta = {k: v.to(device) for k, v in meta.items()}
    dense = build_masks(meta, LAYER_TYPES, window, block_size=block, backend="dense", device=device)
    blockwise = build_masks(meta, LAYER_TYPES, window, block_size=block, backend="blockwise", device=device)
    num_rows = len(meta["anchor_doc"]) * block
    num_keys = len(meta["doc_ids"]) + num_rows
    generator = torch.Generator(device=device).manual_seed(seed)
    for layer_type in LAYER_TYPES:
        q = torch.randn(1, 4, num_rows, 16, device=device, generator=generator, requires_grad=True)
        k, v = (torch.randn(1, 2, num_keys, 16, device=device, generator=generator, requires_grad=True)
                for _ in range(2))
        expected = attend(q, k, v, dense[layer_type])
        grad = torch.randn_like(expected)
        expected_grads = torch.autograd.grad(expected, (q, k, v), grad)
        out = attend(q, k, v, blockwise[layer_type])
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)
        for got, want in zip(torch.autograd.grad(out, (q, k, v), grad), expected_grads):
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (a GPU install's package)")
@pytest.mark.parametrize("seed,other_tiles,long", [(0, False, False), (1, False, False), (2, False, False),
                                                    (3, True, False), (4, False, True), (5, True, True)])
def test_kernels_equal_the_dense_masks_attention_and_gradients(seed, other_tiles, long):
    """On a GPU in this process; without one through Triton's interpreter, in a process that has
    TRITON_INTERPRET=1 from its start (Triton reads it when it is imported)."""
    if torch.cuda.is_available():
        check_kernels(seed, "cuda", other_tiles, long)
        return
    run_interpreted(f"import test_block_attention as t; t.check_kernels({seed}, 'cpu', {other_tiles}, {long})")


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (a GPU install's package)")
def test_the_training_step_under_activation_checkpointing_equals_the_dense_masks():
    """The training step's loss and gradients with the kernels recomputed in the backward
    (`train.activation_checkpointing`) against the dense mask's, through Triton's interpreter without a GPU."""
    if torch.cuda.is_available():
        pytest.skip("tests/test_gpu.py runs it on the GPU")
    run_interpreted("import test_gpu as t; t.check_blockwise_under_activation_checkpointing('cpu')")


def test_the_ops_fake_outputs_have_the_layout_the_kernels_write():
    """Under torch.compile the op's fake outputs stand for the real ones: contiguous, as the kernels write
    them, also for transposed inputs (the drafter's heads come as a transposed view)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(1, 5, 4, 16).transpose(1, 2)  # (1, 4 heads, 5 rows, 16), not contiguous
        k = torch.empty(1, 7, 2, 16).transpose(1, 2)
        ranges = [torch.empty(5, dtype=torch.int32) for _ in range(4)] + [torch.empty(1, dtype=torch.int32)] * 4
        out, lse = block_attention._forward(q, k, k, *ranges, 0.25)
        assert out.shape == q.shape and out.is_contiguous() and lse.shape == (1, 4, 5)
        grads = block_attention._backward(out, q, k, k, out, lse, *ranges, 0.25)
        assert [g.shape for g in grads] == [q.shape, k.shape, k.shape] and all(g.is_contiguous() for g in grads)
