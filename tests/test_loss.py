"""Loss: weights, labels, chunked LM head + CE against the plain full-logits loss, metrics."""

import functools
import importlib.util
import math

import pytest
import torch
import torch.nn.functional as F

from dflash.model.loss import (IGNORE_LABEL, block_labels, block_metrics, default_gamma, dflash_loss, gamma_weights,
                               label_rows)


def test_gamma_weights_and_defaults():
    weights = gamma_weights(16, 7.0)
    assert weights.shape == (16,) and weights[0] == 0 and weights[1] == 1
    assert math.isclose(weights[15].item(), math.exp(-14 / 7), rel_tol=1e-6)
    assert [default_gamma(b) for b in (16, 10, 8, 12)] == [7.0, 5.0, 4.0, 7.0]


def test_block_labels_match_a_loop():
    input_ids = torch.tensor([10, 11, 12, 13, 14, 20, 21, 22, 0, 0])
    loss_mask = torch.tensor([0, 1, 1, 0, 1, 0, 1, 1, 0, 0])
    doc_ids = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1, -1, -1])
    anchor_index = torch.tensor([0, 2, 5, 6, 0])
    anchor_valid = torch.tensor([True, True, True, True, False])
    block_size = 4
    labels, valid = block_labels(input_ids, loss_mask, doc_ids, anchor_index, anchor_valid, block_size)
    for a, start in enumerate(anchor_index.tolist()):
        for k in range(block_size):
            i = start + k
            ok = bool(anchor_valid[a]) and k >= 1 and i < 10 and doc_ids[i] == doc_ids[start] and bool(loss_mask[i])
            assert valid[a, k].item() == ok, (a, k)
            assert labels[a, k].item() == (input_ids[i].item() if ok else IGNORE_LABEL), (a, k)
    assert labels[0].tolist() == [IGNORE_LABEL, 11, 12, IGNORE_LABEL]
    assert labels[3].tolist() == [IGNORE_LABEL, 22, IGNORE_LABEL, IGNORE_LABEL]  # does not cross into padding


def plain_loss(hidden, lm_head, labels, valid, weights):
    logits = (hidden @ lm_head.T).float()
    ce = F.cross_entropy(logits, labels.reshape(-1).clamp(min=0), reduction="none").view(labels.shape)
    w = weights[None, :] * valid
    return (w * ce).sum() / w.sum(), logits.argmax(-1).view(labels.shape)


def random_problem(seed, num_anchors=6, block_size=8, hidden_size=16, vocab=50):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_anchors * block_size, hidden_size, generator=generator, dtype=torch.float64)
    lm_head = torch.randn(vocab, hidden_size, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, vocab, (num_anchors, block_size), generator=generator)
    valid = torch.rand(num_anchors, block_size, generator=generator) < 0.7
    valid[:, 0] = False
    labels = torch.where(valid, labels, IGNORE_LABEL)
    return hidden, lm_head, labels, valid, gamma_weights(block_size, default_gamma(block_size))


@pytest.mark.parametrize("chunk_size", [1, 7, 16, 1000])
def test_chunked_loss_equals_full_loss(chunk_size):
    hidden, lm_head, labels, valid, weights = random_problem(chunk_size)
    hidden_ref = hidden.clone().requires_grad_(True)
    lm_head_ref = lm_head.clone().requires_grad_(True)
    expected, argmax = plain_loss(hidden_ref, lm_head_ref, labels, valid, weights.double())
    expected.backward()
    hidden.requires_grad_(True)
    lm_head.requires_grad_(True)
    out = dflash_loss(hidden, lm_head, labels, valid, weights, chunk_size=chunk_size)
    out.loss.backward()
    torch.testing.assert_close(out.loss.double(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hidden.grad, hidden_ref.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(lm_head.grad, lm_head_ref.grad, rtol=1e-5, atol=1e-7)
    assert torch.equal(out.correct, (argmax == labels) & valid)
    assert out.weight_sum.item() == pytest.approx((weights[None, :] * valid).sum().item())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_labelled_rows_only_equals_every_row(seed):
    """The LM head over the labelled rows only (the collate's `label_rows`) gives the same loss,
    hidden gradient, weight sum and `correct` as every row through the head, on fresh inputs."""
    hidden, lm_head, labels, valid, weights = random_problem(100 + seed, num_anchors=9, block_size=8)
    if seed == 2:
        valid[:] = False  # no labelled row at all: an empty gather, loss 0
        labels[:] = IGNORE_LABEL
    rows = valid.reshape(-1).nonzero().squeeze(1)
    outputs, grads = [], []
    for rows_L in (None, rows):
        leaf = hidden.clone().requires_grad_(True)
        out = dflash_loss(leaf, lm_head, labels, valid, weights, chunk_size=5, rows_L=rows_L)
        out.loss.backward()
        outputs.append(out)
        grads.append(leaf.grad)
    every, labelled = outputs
    # The cross entropy runs in float32 (chunks of other rows, other summation order).
    torch.testing.assert_close(labelled.loss, every.loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-6, atol=1e-7)
    assert torch.equal(labelled.correct, every.correct) and labelled.weight_sum.item() == every.weight_sum.item()
    assert (seed == 2) == (labelled.loss.item() == 0.0)


def test_label_rows_are_the_valid_block_rows():
    generator = torch.Generator().manual_seed(5)
    num_tokens, block_size = 40, 4
    doc_ids = torch.tensor([0] * 13 + [1] * 9 + [2] * 12 + [-1] * 6)
    loss_mask = (torch.rand(num_tokens, generator=generator) < 0.6) & (doc_ids >= 0)
    anchor_index = torch.tensor([1, 5, 11, 12, 14, 20, 23, 30, 33, 39, 39])
    anchor_valid = torch.tensor([True] * 9 + [False] * 2)
    input_ids = torch.randint(0, 50, (num_tokens,), generator=generator)
    _, valid = block_labels(input_ids, loss_mask, doc_ids, anchor_index, anchor_valid, block_size)
    rows = label_rows(loss_mask, doc_ids, anchor_index, anchor_valid, block_size)
    assert rows.tolist() == [q for q in range(valid.numel()) if valid.reshape(-1)[q]]
    assert all(q % block_size != 0 for q in rows.tolist()) and 0 < len(rows) < valid[:, 1:].numel()


def test_frozen_lm_head_gets_no_gradient_and_bf16_runs():
    hidden, lm_head, labels, valid, weights = random_problem(3)
    hidden = hidden.to(torch.bfloat16).requires_grad_(True)
    out = dflash_loss(hidden, lm_head.to(torch.bfloat16), labels, valid, weights, chunk_size=5)
    out.loss.backward()
    assert hidden.grad.dtype == torch.bfloat16 and torch.isfinite(hidden.grad.float()).all()
    expected, _ = plain_loss(hidden.detach().double(), lm_head.to(torch.bfloat16).double(), labels, valid, weights.double())
    assert out.loss.item() == pytest.approx(expected.item(), rel=2e-2)


def test_all_invalid_gives_zero_loss_not_nan():
    hidden, lm_head, labels, _, weights = random_problem(4)
    valid = torch.zeros_like(labels, dtype=torch.bool)
    hidden.requires_grad_(True)
    out = dflash_loss(hidden, lm_head, torch.full_like(labels, IGNORE_LABEL), valid, weights, chunk_size=8)
    out.loss.backward()
    assert out.loss.item() == 0.0 and torch.count_nonzero(hidden.grad) == 0


def test_block_metrics_by_hand():
    valid = torch.tensor([
        [0, 1, 1, 1],
        [0, 1, 1, 0],
        [0, 1, 1, 1],
        [0, 0, 0, 0],  # a padding anchor: not counted
    ], dtype=torch.bool)
    correct = torch.tensor([
        [0, 1, 1, 0],  # 2 accepted
        [0, 1, 1, 1],  # slot 3 is invalid: 2 accepted
        [0, 0, 1, 1],  # first slot wrong: 0 accepted
        [0, 1, 1, 1],
    ], dtype=torch.bool) & valid
    metrics = block_metrics(correct, valid)
    assert metrics["tau"].item() == pytest.approx(1 + 4 / 3)
    torch.testing.assert_close(metrics["slot_accuracy"], torch.tensor([2 / 3, 1.0, 0.5]))
    assert metrics["num_blocks"].item() == 3 and metrics["accepted_sum"].item() == 4


def test_fused_ce_pass_equals_the_eager_one_exactly():
    """The compiler's form (the label's correction and the cast in one elementwise expression) gives
    the eager in-place pass's values bit for bit, in float32 and cast to bf16."""
    from dflash.model.loss import _ce_and_grad

    generator = torch.Generator().manual_seed(5)
    logits = (torch.randn(48, 700, generator=generator) * 4).to(torch.bfloat16)
    labels = torch.randint(0, 700, (48,), generator=generator)
    weight = torch.rand(48, generator=generator)
    for dtype in (torch.float32, torch.bfloat16):
        eager, fused = _ce_and_grad(logits, labels, weight, dtype), _ce_and_grad(logits, labels, weight, dtype, True)
        assert fused[2].dtype == dtype
        for a, b in zip(eager, fused):
            assert torch.equal(a, b)
    torch.testing.assert_close(eager[0], torch.nn.functional.cross_entropy(logits.float(), labels, reduction="none"))


def test_compiled_ce_pass_equals_eager_on_two_row_counts():
    """CUDA runs the fused, compiled CE pass; inductor on the CPU checks the same function
    (the second row count is the shape-generic recompile the last loss chunk triggers)."""
    from dflash.model.loss import _ce_and_grad

    compiled = torch.compile(functools.partial(_ce_and_grad, fused=True))
    generator = torch.Generator().manual_seed(3)
    for rows in (64, 40):
        logits = torch.randn(rows, 500, generator=generator) * 4
        labels = torch.randint(0, 500, (rows,), generator=generator)
        weight = torch.rand(rows, generator=generator)
        for eager, fused in zip(_ce_and_grad(logits, labels, weight), compiled(logits, labels, weight)):
            torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-5)
        for eager, fused in zip(_ce_and_grad(logits, labels, weight, torch.bfloat16),
                                compiled(logits, labels, weight, torch.bfloat16)):
            torch.testing.assert_close(fused.float(), eager.float(), rtol=1e-2, atol=1e-5)


HAS_TRITON = importlib.util.find_spec("triton") is not None


def check_ce_kernel(seed: int, device: str) -> None:
    """dflash's Triton pass (`train.loss_kernel = "triton"`) against `_ce_and_grad` on fresh random bf16 logits:
    the two-pass loop (the default, in one tile and in several), the resident kernel (rows held whole, forced),
    a tie between two maxima in different tiles (the first wins, as torch's argmax), a row of weight 0."""
    from dflash.model import ce_kernel
    from dflash.model.loss import _ce_and_grad

    generator = torch.Generator().manual_seed(seed)
    for rows, vocab, options in ((6, 1000, {"row_resident": 65_536}), (5, 3000, {"loop_block": 256}),
                                 (3, 49_152, {})):
        logits = (torch.randn(rows, vocab, generator=generator) * 4).to(torch.bfloat16)
        logits[0, 3] = logits[0, vocab - 2] = logits[0].max() + 1
        labels = torch.randint(0, vocab, (rows,), generator=generator)
        weight = torch.rand(rows, generator=generator)
        weight[1] = 0
        ce, argmax, grad = _ce_and_grad(logits, labels, weight, torch.bfloat16)
        ours = ce_kernel.ce_and_grad(logits.to(device), labels.to(device), weight.to(device), torch.bfloat16, **options)
        torch.testing.assert_close(ours[0].cpu(), ce, rtol=1e-5, atol=1e-5)
        assert torch.equal(ours[1].cpu(), argmax)
        torch.testing.assert_close(ours[2].cpu().float(), grad.float(), rtol=1e-2, atol=1e-6)


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (a GPU install's package)")
@pytest.mark.parametrize("seed", range(2))
def test_the_triton_cross_entropy_pass_equals_the_compiled_ones_values(seed):
    if torch.cuda.is_available():
        check_ce_kernel(seed, "cuda")
        return
    from support import run_interpreted

    run_interpreted(f"import test_loss as t; t.check_ce_kernel({seed}, 'cpu')")


def test_the_loss_kernel_is_the_cpus_eager_pass_off_cuda_and_a_bad_name_is_refused():
    from dflash.model import loss

    assert loss._ce_and_grad_on(torch.device("cpu"), "triton") is loss._ce_and_grad
    with pytest.raises(ValueError, match="ce_kernel"):
        loss._ce_and_grad_on(torch.device("cuda"), "fastest")
