"""A sampled tree's verdict tries (`modeling_dflash.VerdictTries`) as one Triton kernel: a program per inner node.

`VerdictTries.step` tries a node's children one after another, each try a pass over the vocabulary (the mass of
max(0, p - c q)) and about ten small kernels for the whole batch of rows: at 32 children a node that is some 320
launches, 2.45 ms a replay for `stree:256x32` on an H100 (12-06) where the passes themselves read a few hundred
MB. Here each program holds its node's scalars (c, the mass, q's mass not yet drawn, the kept rank) in registers,
runs the tries in order with one pass over the vocabulary per rejected child (none once a child is kept), and writes
the residual max(0, p - c q) once. The same rule and the same order of tries as `VerdictTries.step`; the sums are
taken in another order, so a try whose two sides agree to float32 rounding may go the other way.

Imported only where Triton is (a GPU install): `evaluation.use_verdict_kernel` sets it as
`modeling_dflash.VERDICT_KERNEL` for `dflash eval`; without it `VerdictTries` runs its tensor loop.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # vocabulary entries a program reads at a time


@triton.jit
def _tries_kernel(p_ptr, q_ptr, index_ptr, tried_ptr, kept_ptr, p_stride, q_stride,
                  VOCAB: tl.constexpr, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    index_row = index_ptr + row * (2 + WIDTH)
    slot = tl.load(index_row)
    count = tl.load(index_row + 1)
    p_row = p_ptr + row * p_stride
    q_row = q_ptr + slot * q_stride
    c = tl.zeros((), dtype=tl.float32)
    mass = tl.full((), 1.0, dtype=tl.float32)  # the sum of max(0, p - c q)
    drawn = tl.zeros((), dtype=tl.float32)  # q's mass of the children tried so far
    kept = tl.full((), -1, dtype=tl.int64)
    for rank in range(WIDTH):
        token = tl.load(index_row + 2 + rank)
        p_y = tl.load(p_row + token)
        q_y = tl.load(q_row + token)
        left = tl.maximum(1.0 - drawn, 1e-30)  # S_i
        drawn += q_y
        u = tl.load(tried_ptr + row * WIDTH + rank)
        trying = (rank < count) & (kept < 0)
        keep = trying & (u * q_y * mass < tl.maximum(p_y - c * q_y, 0.0) * left)
        kept = tl.where(keep, rank, kept)
        if trying & (kept < 0):  # rejected: the next try's c and mass (one pass over the vocabulary)
            c_next = c + mass / left
            total = tl.zeros((BLOCK,), dtype=tl.float32)
            for start in range(0, VOCAB, BLOCK):
                offsets = start + tl.arange(0, BLOCK)
                inside = offsets < VOCAB
                p = tl.load(p_row + offsets, mask=inside, other=0.0)
                q = tl.load(q_row + offsets, mask=inside, other=0.0)
                total += tl.maximum(p - c_next * q, 0.0)
            mass_next = tl.sum(total, axis=0)
            moved = mass_next > 0
            c = tl.where(moved, c_next, c)
            mass = tl.where(moved, mass_next, mass)
    tl.store(kept_ptr + row, kept)
    for start in range(0, VOCAB, BLOCK):  # the residual a node that keeps none draws from
        offsets = start + tl.arange(0, BLOCK)
        inside = offsets < VOCAB
        p = tl.load(p_row + offsets, mask=inside, other=0.0)
        q = tl.load(q_row + offsets, mask=inside, other=0.0)
        tl.store(p_row + offsets, tl.maximum(p - c * q, 0.0), mask=inside)


def verdict_tries(p: torch.Tensor, q: torch.Tensor, index: torch.Tensor, tried: torch.Tensor,
                  kept: torch.Tensor) -> torch.Tensor:
    """`VerdictTries.step` on its buffers: `p` (rows, V) float32, overwritten with the residual; `q` (slots, V);
    `index` (rows, 2 + width) int64: slot, count, the children's tokens; `tried` (rows, width) the uniforms; the
    kept rank per row (-1: none) written into `kept` (rows,) int64, which is returned."""
    rows, vocab = p.shape
    width = tried.shape[1]
    assert p.is_contiguous() and q.is_contiguous() and index.is_contiguous() and tried.is_contiguous()
    assert index.shape == (rows, 2 + width) and kept.shape == (rows,)
    _tries_kernel[(rows,)](p, q, index, tried, kept, p.stride(0), q.stride(0), VOCAB=vocab, WIDTH=width,
                           BLOCK=BLOCK)
    return kept
