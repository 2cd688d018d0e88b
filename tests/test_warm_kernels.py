"""dflash's own kernels compiled ahead (dflash/train/warm_kernels.py): each warm-up passes its kernel what the
real launch passes, as Triton tells launches apart (each tensor's dtype and 16-byte alignment, each integer's
class: 1, a multiple of 16, 32 or 64 bits; the constants and launch options equal), so the first real launch
finds the kernel compiled; the jobs follow the kernels the run uses; a failed warm-up is reported, not raised.
The kernels are recorders here (no launch, no compile); tests/test_gpu.py checks a real first launch compiles
nothing after the warm-up."""

import importlib.util
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from support import tiled_packed_meta

from dflash.model import block_attention
from dflash.model.masks import build_masks
from dflash.train import warm_kernels

HAS_TRITON = importlib.util.find_spec("triton") is not None


def launch_class(value):
    """What of an argument makes Triton compile a kernel anew (its specialization)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, value.data_ptr() % 16 == 0)
    if isinstance(value, torch.dtype):
        return ("tensor", value, True)  # Triton's stand-in for a tensor of that dtype, aligned
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return ("int", value == 1, value % 16 == 0, -2**31 <= value < 2**31)
    if isinstance(value, float):
        return "float"
    raise TypeError(type(value))


class Recorder:
    """A `@triton.jit` kernel's stand-in: records each launch (`kernel[grid](...)`) and warm-up."""

    def __init__(self, name: str, calls: dict):
        self.name, self.calls = name, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls["launch"].append((self.name, args, kwargs))

    def warmup(self, *args, grid, **kwargs):
        self.calls["warm"].append((self.name, args, kwargs))
        return SimpleNamespace(name=self.name)


def classes(calls):
    return {(name, tuple(launch_class(a) for a in args), tuple(sorted((k, launch_class(v)) for k, v in kw.items())))
            for name, args, kw in calls}


@pytest.mark.parametrize("heads,key_heads,dim", [(4, 2, 16), (9, 3, 64), (32, 8, 128), (2, 1, 32)])
def test_warming_the_attention_passes_what_its_launches_pass(monkeypatch, heads, key_heads, dim):
    calls = {"launch": [], "warm": []}
    monkeypatch.setattr(block_attention, "_kernels", lambda: {n: Recorder(n, calls) for n in ("forward", "dq", "dkdv")})
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    meta = tiled_packed_meta(np.random.default_rng(heads), 16)
    ranges = build_masks(meta, ["full_attention"], 0, block_size=16, backend="blockwise", device="cpu")["full_attention"]
    rows, keys = len(meta["anchor_doc"]) * 16, len(meta["doc_ids"]) + len(meta["anchor_doc"]) * 16
    q = torch.randn(1, heads, rows, dim, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, key_heads, keys, dim, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    block_attention.block_attention(q, k, v, ranges).sum().backward()  # the op's launches, recorded (no kernel runs)
    warmed = block_attention.warm_kernels(heads, key_heads, dim, torch.bfloat16, torch.device("cpu"))
    assert [kernel.name for kernel in warmed] == ["forward", "dq", "dkdv"]
    assert sorted(name for name, _, _ in calls["launch"]) == ["dkdv", "dq", "forward"]
    assert classes(calls["warm"]) == classes(calls["launch"])


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (a GPU install's package)")
def test_warming_the_loss_pass_and_adamw_passes_what_their_launches_pass(monkeypatch):
    from dflash.model import ce_kernel
    from dflash.train import adamw_kernel

    calls = {"launch": [], "warm": []}
    monkeypatch.setattr(ce_kernel, "_ce_grad_loop_kernel", Recorder("ce", calls))
    monkeypatch.setattr(adamw_kernel, "_adamw_kernel", Recorder("adamw", calls))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    vocab, dtype = 49_152, torch.bfloat16
    hidden, head = torch.randn(64, 32, dtype=dtype), torch.randn(vocab, 32, dtype=dtype)
    labels, weights = torch.randint(0, vocab, (64,)), torch.rand(64)
    for start in (0, 32):  # as the loss pass calls it: chunks of rows
        ce_kernel.ce_and_grad(hidden[start:start + 32] @ head.T, labels[start:start + 32], weights[start:start + 32],
                              dtype)
    ce_kernel.warm(vocab, dtype, torch.device("cpu"))
    model = torch.nn.Sequential(torch.nn.Linear(48, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 1, bias=True))
    optimizer = adamw_kernel.TritonAdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 48)).sum().backward()
    for grad_scale in (torch.tensor(2.0), None):
        optimizer.grad_scale, optimizer.found_inf = grad_scale, torch.zeros(())
        optimizer.step()
    optimizer.warm()
    launched = classes(calls["launch"])
    assert {name for name, _, _ in launched} == {"ce", "adamw"}
    assert launched <= classes(calls["warm"])


def test_the_jobs_are_the_kernels_the_run_launches():
    class Optimizer:
        def warm(self):
            return []

    def context(device, backend, loss_kernel):
        args = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
        return SimpleNamespace(device=torch.device(device), backend=backend, loss_kernel=loss_kernel, args=args,
                               lm_head_VH=torch.zeros(8, 4))

    assert list(warm_kernels.warm_jobs(context("cuda", "blockwise", "triton"), Optimizer())) == [
        "attention", "loss pass", "AdamW"]
    assert list(warm_kernels.warm_jobs(context("cuda", "flex", "compiled"), torch.optim.SGD([torch.zeros(1)]))) == []
    assert warm_kernels.warm_jobs(context("cpu", "blockwise", "triton"), Optimizer()) == {}
    assert warm_kernels.start(context("cpu", "blockwise", "triton"), Optimizer()) is None


def test_a_kernel_that_cannot_be_warmed_is_reported_and_the_others_still_are(capsys):
    loaded = []
    kernel = SimpleNamespace(_init_handles=lambda: loaded.append(1))

    def fails():
        raise RuntimeError("out of shared memory")

    warming = warm_kernels.Warming({"attention": fails, "AdamW": lambda: [kernel, None, kernel]}, torch.device("cpu"))
    results = warming.join()
    assert results["attention"].startswith("not warmed (RuntimeError: out of shared memory")
    assert results["AdamW"].startswith("2 compiled in") and loaded == [1, 1]
    assert "attention kernels were not compiled ahead" in capsys.readouterr().err
