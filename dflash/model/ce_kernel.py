"""The loss pass's cross entropy and its gradient as one Triton kernel (`train.loss_kernel`, "auto" on CUDA).

`dflash.model.loss._ce_and_grad` compiled by inductor reads each chunk's bf16 logits several times (the row
maximum, the sum of exponentials, the gradient) and writes the gradient once: 15 ms of the SmolLM2-sized
drafter's 116 ms step on an H100 (12-06), where its ~11 GB of logits a step take about 3.5 ms a pass. Here one
program owns one row and reads it twice in tiles of `LOOP_BLOCK` columns: an online maximum (and its first
index) and sum of exponentials, then the gradient; one write. The values are `_ce_and_grad`'s: per row the cross
entropy `max + log(sum(exp(logits - max))) - logits[label]`, the argmax (the first of equal maxima, as torch's),
and `weight * (softmax - onehot)` in the hidden states' dtype, all in float32 inside.
Timed on one H100 (12-07, `tools/bench_stage2.py`): the SmolLM2-sized drafter's step 111.6-111.8 ms against the
compiled pass's 115.2-115.4 (119.8K tokens/s against 115.6K), the peers' step (Qwen's 248,320 logits a row)
261.8 against 263.9. A row of up to `ROW_RESIDENT` columns can instead be read once into registers
(`row_resident`, the bench's `--ce-row-resident`); at SmolLM2's 49,152 (65,536 padded over 1,024 threads) that
spilled the registers and made the step 136.7 ms against the compiled 116.6, so `ROW_RESIDENT` is 0.
Imported only where Triton is (a GPU install; the CPU tests run it through Triton's interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dflash.model.block_attention import _interpreted, launch_or_warm

ROW_RESIDENT = 0  # rows up to this long are held at once, read once (0: every row takes the two-pass loop)
LOOP_BLOCK = 8192  # columns a step of the two-pass loop reads


@triton.jit
def _ce_grad_resident_kernel(logits_ptr, labels_ptr, weight_ptr, ce_ptr, argmax_ptr, grad_ptr, vocab, stride_logits,
                             stride_grad, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    columns = tl.arange(0, BLOCK)
    inside = columns < vocab
    logits = tl.load(logits_ptr + row * stride_logits + columns, mask=inside, other=float("-inf")).to(tl.float32)
    label = tl.load(labels_ptr + row)
    weight = tl.load(weight_ptr + row)
    row_max, row_argmax = tl.max(logits, 0, return_indices=True, return_indices_tie_break_left=True)
    exps = tl.exp(logits - row_max)
    total = tl.sum(exps, 0)
    label_logit = tl.sum(tl.where(columns == label, logits, 0.0), 0)
    tl.store(ce_ptr + row, row_max + tl.log(total) - label_logit)
    tl.store(argmax_ptr + row, row_argmax.to(tl.int64))
    grad = exps * (weight / total) - tl.where(columns == label, weight, 0.0)
    tl.store(grad_ptr + row * stride_grad + columns, grad.to(grad_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _max_sum_step(row_logits, start, vocab, running_max, running_sum, best, BLOCK: tl.constexpr):
    """One tile of the online maximum, its first index and the sum of exponentials."""
    columns = start + tl.arange(0, BLOCK)
    logits = tl.load(row_logits + columns, mask=columns < vocab, other=float("-inf")).to(tl.float32)
    block_max, block_argmax = tl.max(logits, 0, return_indices=True, return_indices_tie_break_left=True)
    new_max = tl.maximum(running_max, block_max)
    running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(logits - new_max), 0)
    best = tl.where(block_max > running_max, start + block_argmax, best)  # a tie keeps the earlier tile's
    return new_max, running_sum, best


@triton.jit
def _grad_step(row_logits, row_grad, start, vocab, label, weight, running_max, scale, BLOCK: tl.constexpr):
    columns = start + tl.arange(0, BLOCK)
    inside = columns < vocab
    logits = tl.load(row_logits + columns, mask=inside, other=float("-inf")).to(tl.float32)
    grad = tl.exp(logits - running_max) * scale - tl.where(columns == label, weight, 0.0)
    tl.store(row_grad + columns, grad.to(row_grad.dtype.element_ty), mask=inside)


@triton.jit
def _ce_grad_loop_kernel(logits_ptr, labels_ptr, weight_ptr, ce_ptr, argmax_ptr, grad_ptr, vocab, stride_logits,
                         stride_grad, BLOCK: tl.constexpr, WHILE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_logits = logits_ptr + row * stride_logits
    row_grad = grad_ptr + row * stride_grad
    label = tl.load(labels_ptr + row)
    weight = tl.load(weight_ptr + row)
    running_max = tl.full([], float("-inf"), tl.float32)
    running_sum = tl.zeros([], tl.float32)
    best = tl.zeros([], tl.int32)
    if WHILE:  # Triton's interpreter: its `range` takes no tensor bounds
        start = 0
        while start < vocab:
            running_max, running_sum, best = _max_sum_step(row_logits, start, vocab, running_max, running_sum, best,
                                                           BLOCK)
            start += BLOCK
    else:
        for start in range(0, vocab, BLOCK):
            running_max, running_sum, best = _max_sum_step(row_logits, start, vocab, running_max, running_sum, best,
                                                           BLOCK)
    label_logit = tl.load(row_logits + label).to(tl.float32)
    tl.store(ce_ptr + row, running_max + tl.log(running_sum) - label_logit)
    tl.store(argmax_ptr + row, best.to(tl.int64))
    scale = weight / running_sum
    if WHILE:
        start = 0
        while start < vocab:
            _grad_step(row_logits, row_grad, start, vocab, label, weight, running_max, scale, BLOCK)
            start += BLOCK
    else:
        for start in range(0, vocab, BLOCK):
            _grad_step(row_logits, row_grad, start, vocab, label, weight, running_max, scale, BLOCK)


def ce_and_grad(logits_RV: torch.Tensor, labels_R: torch.Tensor, weight_R: torch.Tensor,
                grad_dtype: torch.dtype = torch.float32, row_resident: int | None = None,
                loop_block: int | None = None, warm: bool = False):
    """`(ce_R, argmax_R, grad_RV)` as `dflash.model.loss._ce_and_grad` returns them, from one kernel launch.
    `row_resident` and `loop_block` (default: the module's `ROW_RESIDENT` and `LOOP_BLOCK`, which
    tools/bench_stage2.py's `--ce-row-resident` sets) choose the kernel and its tile: the tests force the loop on
    short rows. `warm`: only compile the kernel for these arguments (Triton's `warmup`) and return it."""
    row_resident = ROW_RESIDENT if row_resident is None else row_resident
    loop_block = LOOP_BLOCK if loop_block is None else loop_block
    rows, vocab = logits_RV.shape
    if logits_RV.stride(1) != 1:
        logits_RV = logits_RV.contiguous()
    labels_R = labels_R.contiguous()
    weight_R = weight_R.float().contiguous()
    ce_R = torch.empty(rows, dtype=torch.float32, device=logits_RV.device)
    argmax_R = torch.empty(rows, dtype=torch.int64, device=logits_RV.device)
    grad_RV = torch.empty((rows, vocab), dtype=grad_dtype, device=logits_RV.device)
    if rows == 0:
        return ce_R, argmax_R, grad_RV
    arguments = (logits_RV, labels_R, weight_R, ce_R, argmax_R, grad_RV, vocab, logits_RV.stride(0), grad_RV.stride(0))
    if vocab <= row_resident:
        block = triton.next_power_of_2(vocab)
        kernel, constants = _ce_grad_resident_kernel, dict(BLOCK=block, num_warps=max(4, min(32, block // 2048)))
    else:
        kernel = _ce_grad_loop_kernel
        constants = dict(BLOCK=loop_block, WHILE=_interpreted(), num_warps=16 if loop_block >= 4096 else 4)
    compiled = launch_or_warm(kernel, (rows,), arguments, constants, warm)
    return compiled if warm else (ce_R, argmax_R, grad_RV)


def warm(vocab: int, dtype: torch.dtype, device: torch.device):
    """The kernel compiled for rows of `vocab` logits in `dtype` (the loss pass's: logits and gradient in the
    head's dtype, labels int64, weights float32) and kept, nothing launched; the compiled kernel."""
    return ce_and_grad(torch.empty(1, vocab, dtype=dtype, device=device),
                       torch.zeros(1, dtype=torch.long, device=device), torch.ones(1, device=device), dtype, warm=True)
