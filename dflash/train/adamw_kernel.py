"""AdamW's update as a Triton kernel, one launch per parameter tensor (`train.optimizer = "triton"`).

torch's fused AdamW moves each fp32 parameter's 28 bytes (parameter, gradient, the two moments read; parameter
and moments written) at about half the GPU memory's rate: 19.9 ms a step for the 27B drafter's 1.73B parameters
on an H200 (12-03), where the bytes alone take about 10. Here each program streams one tile of a parameter and
its state once, in registers, and the gradient clipping's factor (`grad_scale`, dflash.train.step.clip_into_step)
and the skip of a non-finite step (`found_inf`) are read from the device as torch's fused step reads them, so
nothing syncs. The update is torch's (`torch.optim.AdamW` with `fused=True`, `amsgrad=False`, no `maximize`):

    param *= 1 - lr * weight_decay
    exp_avg = beta1 * exp_avg + (1 - beta1) * grad;  exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad^2
    param -= lr / (1 - beta1^step) * exp_avg / (sqrt(exp_avg_sq) / sqrt(1 - beta2^step) + eps)

The state (`step`, `exp_avg`, `exp_avg_sq`) is torch's fused AdamW's, so checkpoints move between the two.
Imported only where Triton is (a GPU install).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dflash.model.block_attention import launch_or_warm

BLOCK = 2048  # elements a program updates


@triton.jit
def _adamw_kernel(param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, step_ptr, scale_ptr, skip_ptr, numel,
                  lr, beta1, beta2, eps, weight_decay, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < tl.where(tl.load(skip_ptr) == 0, numel, 0)  # a skipped step writes nothing
    step = tl.load(step_ptr).to(tl.float32)
    bias_correction1 = 1.0 - tl.exp2(step * tl.log2(beta1))
    bias_correction2_sqrt = tl.sqrt(1.0 - tl.exp2(step * tl.log2(beta2)))
    param = tl.load(param_ptr + offsets, mask=inside, other=0.0)
    grad = tl.load(grad_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    if HAS_SCALE:
        grad = grad / tl.load(scale_ptr)
    exp_avg = tl.load(exp_avg_ptr + offsets, mask=inside, other=0.0)
    exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=inside, other=0.0)
    param = param * (1.0 - lr * weight_decay)
    exp_avg = beta1 * exp_avg + (1.0 - beta1) * grad
    exp_avg_sq = beta2 * exp_avg_sq + (1.0 - beta2) * grad * grad
    denom = tl.sqrt(exp_avg_sq) / bias_correction2_sqrt + eps
    param = param - (lr / bias_correction1) * exp_avg / denom
    tl.store(param_ptr + offsets, param, mask=inside)
    tl.store(exp_avg_ptr + offsets, exp_avg, mask=inside)
    tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq, mask=inside)


class TritonAdamW(torch.optim.AdamW):
    """`torch.optim.AdamW(fused=True)` whose step runs `_adamw_kernel` per parameter. Built with `fused=True`
    so its state is the fused step's (a device `step` per parameter; a checkpoint's loads the same way); where
    a parameter or gradient is not contiguous float32 the whole step is torch's fused one."""

    def __init__(self, params, **options):
        options = {**options, "fused": True}
        if options.get("amsgrad") or options.get("maximize"):
            raise ValueError("TritonAdamW: amsgrad and maximize are torch's fused AdamW's alone")
        super().__init__(params, **options)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("TritonAdamW.step takes no closure")
        groups = [(group, [p for p in group["params"] if p.grad is not None]) for group in self.param_groups]
        if not all(kernel_ready(p) for _, params in groups for p in params):
            return super().step()  # torch's fused step, on the same state
        grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        for group, params in groups:
            if not params:
                continue
            device = params[0].device
            states = [self._state_for(p) for p in params]
            steps = [state["step"] for state in states]
            torch._foreach_add_(steps, 1)
            skip = found_inf.to(device) if found_inf is not None else torch.zeros((), device=device)
            scale = grad_scale.to(device) if grad_scale is not None else skip  # unread without HAS_SCALE
            for param, state in zip(params, states):
                _update(param, param.grad, state["exp_avg"], state["exp_avg_sq"], state["step"], scale, skip, group,
                        grad_scale is not None)
            if found_inf is not None:
                torch._foreach_sub_(steps, [skip] * len(steps))  # a skipped step does not count (torch's rule)

    def warm(self) -> list:
        """The kernel compiled for each parameter's launch (with and without the clipping's `grad_scale`) and
        kept, nothing launched (Triton's `warmup`); the compiled kernels. Stand-ins of one element for the
        tensors: a launch specializes on their dtype and alignment and on the integer `numel`."""
        kernels = []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.requires_grad and p.dtype == torch.float32]
            for device in {p.device for p in params}:
                one = torch.empty((), dtype=torch.float32, device=device)
                for numel in {p.numel() for p in params if p.device == device}:
                    for has_scale in (True, False):
                        kernels.append(_update(one, one, one, one, one, one, one, group, has_scale, numel, warm=True))
        return kernels

    def _state_for(self, param: torch.Tensor) -> dict:
        state = self.state[param]
        if not state:  # torch's fused AdamW's state, made as its first step makes it
            state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state


def _update(param, grad, exp_avg, exp_avg_sq, step, scale, skip, group: dict, has_scale: bool,
            numel: int | None = None, warm: bool = False):
    """One parameter's update (`numel`: the parameter's unless given); with `warm` only the kernel compiled for
    these arguments (Triton's `warmup`), returned."""
    numel = param.numel() if numel is None else numel
    beta1, beta2 = group["betas"]
    arguments = (param, grad, exp_avg, exp_avg_sq, step, scale, skip, numel, float(group["lr"]), float(beta1),
                 float(beta2), float(group["eps"]), float(group["weight_decay"]))
    return launch_or_warm(_adamw_kernel, (triton.cdiv(numel, BLOCK),), arguments,
                          dict(HAS_SCALE=has_scale, BLOCK=BLOCK), warm)


def kernel_ready(param: torch.Tensor) -> bool:
    grad = param.grad
    return (param.dtype == torch.float32 and grad is not None and param.is_contiguous() and grad.is_contiguous()
            and param.device.type == grad.device.type and param.numel() > 0)
