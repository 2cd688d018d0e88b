"""Gradient clipping folded into the fused AdamW's step (dflash.train.step.clip_into_step) against the
plain reference: `clip_grad_norm_` scaling every gradient in place, then the same optimizer's step. The
in-place path (`fold=False`, the benchmarks' baseline, and any optimizer that ignores `grad_scale`) too."""
import pytest
import torch

from dflash.train.step import clip_into_step, folds_grad_scale
from support import PlainDescent


@pytest.mark.parametrize("fold", [True, False], ids=["folded", "in-place"])
@pytest.mark.parametrize("clip", [0.05, 1.0, 1e4])
def test_clipping_as_the_steps_grad_scale_equals_clipping_the_gradients(clip, fold):
    generator = torch.Generator().manual_seed(int(clip * 100))
    shapes = [(37, 19), (5,), (3, 4, 6)]
    start = [torch.randn(shape, generator=generator) for shape in shapes]
    plain = [p.clone().requires_grad_() for p in start]
    folded = [p.clone().requires_grad_() for p in start]
    options = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    plain_opt, folded_opt = torch.optim.AdamW(plain, **options), torch.optim.AdamW(folded, **options)
    for step in range(4):
        grads = [torch.randn(shape, generator=generator) * (1 + 3 * step) for shape in shapes]
        for p, g in zip(plain, grads):
            p.grad = g.clone()
        for p, g in zip(folded, grads):
            p.grad = g.clone()
        plain_norm = torch.nn.utils.clip_grad_norm_(plain, clip)
        plain_opt.found_inf = torch.zeros(())
        plain_opt.step()
        folded_norm = clip_into_step(folded_opt, [p.grad for p in folded], clip, fold=fold)
        assert (folded_opt.grad_scale is not None) == fold
        folded_opt.found_inf = torch.zeros(())
        folded_opt.step()
        torch.testing.assert_close(folded_norm, plain_norm, rtol=0, atol=0)
        for a, b in zip(folded, plain):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)
            # the moments are where a missed or doubled clip would show (Adam's update barely sees the scale)
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(folded_opt.state[a][key], plain_opt.state[b][key], rtol=1e-5, atol=1e-9)


def test_a_non_finite_norm_skips_the_step_and_keeps_the_weights():
    weights = torch.randn(8, requires_grad=True)
    before = weights.detach().clone()
    optimizer = torch.optim.AdamW([weights], lr=1e-2, fused=True)
    weights.grad = torch.full((8,), float("nan"))
    norm = clip_into_step(optimizer, [weights.grad], 1.0)
    assert not torch.isfinite(norm)
    optimizer.found_inf = (~torch.isfinite(norm)).float()
    optimizer.step()
    torch.testing.assert_close(weights.detach(), before, rtol=0, atol=0)


def test_an_optimizer_that_ignores_grad_scale_gets_its_gradients_clipped_in_place():
    generator = torch.Generator().manual_seed(7)
    start = [torch.randn(11, 3, generator=generator), torch.randn(4, generator=generator)]
    grads = [torch.randn(11, 3, generator=generator) * 5, torch.randn(4, generator=generator) * 5]
    plain = [p.clone().requires_grad_() for p in start]
    ours = [p.clone().requires_grad_() for p in start]
    for params in (plain, ours):
        for p, g in zip(params, grads):
            p.grad = g.clone()
    plain_opt, ours_opt = PlainDescent(plain, lr=0.5), PlainDescent(ours, lr=0.5)
    assert not folds_grad_scale(ours_opt)
    assert folds_grad_scale(torch.optim.AdamW(ours, fused=True)) and not folds_grad_scale(torch.optim.AdamW(ours))
    plain_norm = torch.nn.utils.clip_grad_norm_(plain, 1.0)
    ours_norm = clip_into_step(ours_opt, [p.grad for p in ours], 1.0)
    assert float(ours_norm) > 1.0  # the clip bites
    torch.testing.assert_close(ours_norm, plain_norm, rtol=0, atol=0)
    plain_opt.step()
    ours_opt.step()
    for a, b in zip(ours, plain):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)
