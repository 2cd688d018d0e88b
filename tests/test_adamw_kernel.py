"""AdamW's update as a Triton kernel (dflash/train/adamw_kernel.py) against torch's fused AdamW on fresh random
parameters and gradients: the same weights and moments over several steps, with clipping's `grad_scale`, a
skipped (non-finite) step and weight decay; state moves between the two. On a GPU in this process; without one
through Triton's interpreter in a process that has TRITON_INTERPRET=1 from its start; skipped where Triton is
not installed (a CPU install)."""

import copy
import importlib.util

import pytest
import torch
from support import run_interpreted

HAS_TRITON = importlib.util.find_spec("triton") is not None


def check_against_torch(seed: int, device: str, sizes=(4099, 37 * 19, 5, 2 * 2048)) -> None:
    from dflash.train.adamw_kernel import TritonAdamW

    generator = torch.Generator().manual_seed(seed)
    start = [torch.randn(size, generator=generator).to(device) for size in sizes]
    ours_params = [p.clone().requires_grad_() for p in start]
    torch_params = [p.clone().requires_grad_() for p in start]
    options = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
    ours = TritonAdamW(ours_params, **options)
    reference = torch.optim.AdamW(torch_params, fused=True, **options)
    for step in range(6):
        grads = [torch.randn(size, generator=generator).to(device) * (1 + step) for size in sizes]
        scale = torch.tensor(1.0 + step % 3, device=device)  # clipping's factor, folded into the step
        skip = torch.tensor(float(step == 3), device=device)  # step 3: a non-finite step, skipped
        for optimizer, params in ((ours, ours_params), (reference, torch_params)):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            optimizer.grad_scale, optimizer.found_inf = scale, skip
            optimizer.step()
        for a, b in zip(ours_params, torch_params):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)
            for key in ("exp_avg", "exp_avg_sq", "step"):
                torch.testing.assert_close(ours.state[a][key], reference.state[b][key], rtol=1e-4, atol=1e-7)
    assert float(ours.state[ours_params[0]]["step"]) == 5  # six steps, one skipped
    moved = [(a.detach() - s).abs().max() for a, s in zip(ours_params, start)]
    assert min(moved) > 1e-4  # the steps moved every parameter
    # a checkpoint of one loads into the other and steps on alike
    ours.load_state_dict(copy.deepcopy(reference.state_dict()))  # a copy: loading keeps the tensors it is given
    for p, g in zip(ours_params, torch_params):
        p.data.copy_(g.detach())
    grads = [torch.randn(size, generator=generator).to(device) for size in sizes]
    for optimizer, params in ((ours, ours_params), (reference, torch_params)):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        optimizer.grad_scale = optimizer.found_inf = None
        optimizer.step()
    for a, b in zip(ours_params, torch_params):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (a GPU install's package)")
@pytest.mark.parametrize("seed", range(2))
def test_the_kernel_steps_as_torchs_fused_adamw(seed):
    if torch.cuda.is_available():
        check_against_torch(seed, "cuda")
        check_against_torch(seed, "cuda", sizes=(5120 * 17408 // 8, 5120, 3))
        return
    run_interpreted(f"import test_adamw_kernel as t; t.check_against_torch({seed}, 'cpu')")


def test_auto_takes_dflashs_kernels_only_on_cuda_where_triton_runs(monkeypatch):
    """`train.optimizer` and `train.loss_kernel` default to "auto": dflash's Triton kernels on a CUDA device
    where Triton runs, torch's AdamW and inductor's pass where it does not; a named choice is kept as given."""
    from dflash.config import load_config
    from dflash.train import step

    config = load_config(None, [])
    assert (config.train.optimizer, config.train.loss_kernel) == ("auto", "auto")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert step.triton_or("auto", "torch", cpu) == "torch"
    assert step.triton_or("auto", "compiled", cpu) == "compiled"
    assert type(step.build_optimizer(torch.nn.Linear(3, 2), config)) is torch.optim.AdamW
    monkeypatch.setattr(step, "triton_refusal", lambda device: None)
    assert step.triton_or("auto", "compiled", cuda) == "triton"
    assert step.triton_or("auto", "compiled", cpu) == "compiled"
    monkeypatch.setattr(step, "triton_refusal", lambda device: "needs Triton")
    assert step.triton_or("auto", "torch", cuda) == "torch"
    assert step.triton_or("triton", "torch", cpu) == "triton"
    assert step.triton_or("compiled", "compiled", cuda) == "compiled"
    from types import SimpleNamespace

    on_cpu = SimpleNamespace(backend="dense", loss_kernel="compiled", device=cpu)
    line = step.describe_kernels(on_cpu, step.build_optimizer(torch.nn.Linear(3, 2), config))
    assert "attention dense, AdamW torch's fused, loss pass eager" in line
    on_gpu = SimpleNamespace(backend="blockwise", loss_kernel="triton", device=cuda)
    assert "attention blockwise, AdamW torch's fused, loss pass triton" in step.describe_kernels(on_gpu, object())
