"""A sampled tree's verdict tries as one Triton kernel (dflash/model/verdict_kernel.py) against `VerdictTries`'
tensor loop, on fresh random rows: the same kept ranks and residuals. On a GPU in this process; without one through
Triton's interpreter in a process that has TRITON_INTERPRET=1 from its start; skipped where Triton is not installed
(a CPU install)."""

import importlib.util

import pytest
import torch
from support import run_interpreted, sampled_tree_on_cuda

from dflash.model import modeling_dflash

HAS_TRITON = importlib.util.find_spec("triton") is not None


def check_kernel(seed: int, device: str, rows: int = 16, width: int = 8, slots: int = 5, vocab: int = 2500) -> None:
    """Random rows (half with children among the likely tokens, counts 0..width, uniforms) through both."""
    from dflash.model import verdict_kernel

    generator = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(rows, vocab, generator=generator) * 3, -1)
    q = torch.softmax(torch.randn(slots, vocab, generator=generator) * 3, -1)
    index = torch.zeros(rows, 2 + width, dtype=torch.long)
    index[:, 0] = torch.randint(0, slots, (rows,), generator=generator)
    index[:, 1] = torch.randint(0, width + 1, (rows,), generator=generator)
    for row in range(rows):  # distinct children: likely ones (most tries count) or any
        likely = torch.topk(q[index[row, 0]] + p[row], width).indices
        index[row, 2:] = likely if row % 2 else torch.randperm(vocab, generator=generator)[:width]
    tried = torch.rand(rows, width, generator=generator)
    tries = modeling_dflash.VerdictTries(rows, width, slots, vocab, torch.device("cpu"), graph=False)
    for buffer, value in zip((tries.p, tries.q, tries.index, tries.tried), (p, q, index, tried)):
        buffer.copy_(value)
    want = tries.tensor_step()
    residual = p.to(device)
    got = verdict_kernel.verdict_tries(residual, q.to(device), index.to(device), tried.to(device),
                                       torch.empty(rows, dtype=torch.long, device=device))
    assert got.cpu().tolist() == want.tolist()
    assert len(set(want.tolist())) > 2  # kept at several ranks and none kept: the rule ran, not a shortcut
    torch.testing.assert_close(residual.cpu(), tries.p, atol=1e-7, rtol=1e-5)


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (a GPU install's package)")
@pytest.mark.parametrize("seed", range(3))
def test_the_kernel_keeps_what_the_tensor_tries_keep(seed):
    if torch.cuda.is_available():
        check_kernel(seed, "cuda")
        check_kernel(seed, "cuda", rows=64, width=32, vocab=49152)
        return
    run_interpreted(f"import test_verdict_kernel as t; t.check_kernel({seed}, 'cpu')")


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and Triton")
@pytest.mark.parametrize("size, width", [(7, 8), (256, 8), (256, 32), (1024, 8)])
def test_recursive_verdicts_through_the_kernel_equal_the_tensor_tries(size, width, monkeypatch):
    """`recursive_verdicts` on CUDA with the kernel (replayed in its graph) against the tensor tries, draw for draw,
    on fresh trees over SmolLM2's vocabulary."""
    from dflash.model import verdict_kernel

    for seed in range(3):
        tree, q_KV, target_logits = sampled_tree_on_cuda(seed, size, width, vocab=49152)
        verdicts = []
        for kernel in (True, False):
            monkeypatch.setattr(modeling_dflash, "VERDICT_KERNEL", verdict_kernel.verdict_tries if kernel else None)
            verdicts.append(modeling_dflash.recursive_verdicts(tree, q_KV, target_logits, 1.0,
                                                               torch.Generator("cuda").manual_seed(seed)))
        assert verdicts[0] == verdicts[1]
