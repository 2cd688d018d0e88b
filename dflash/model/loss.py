"""The DFlash training loss: chunked LM head + gamma-weighted cross-entropy, and block metrics.

Slot k of a block (k = 1..B-1) predicts the token at `anchor + k` with weight
`exp(-(k-1)/gamma)`; slot 0 (the anchor token itself) has weight 0. The loss is
`sum(w * ce) / sum(w)` over supervised slots inside their sequence.

Full-vocabulary logits for all block rows do not fit (512 anchors x 16 slots x 248K vocab
is 2G elements), so `dflash_loss` runs the LM head and the cross entropy `chunk_size` rows
at a time in a custom autograd function that computes each chunk's gradient while its
logits exist (the loss ends the graph): peak memory is O(chunk_size * V), the head runs
once per row, and only rows that carry a label go through it (their indices come from the
collate, `label_rows`; without them, every row but slot 0's). Everything stays on the device.

Soft targets (`train.distill_weight`, a store written with `store.topk`): beside the cross
entropy, each labelled row adds `distill_weight * w * d(p, q)`, where p is the target's
distribution over k + 1 buckets (the k stored tokens of the slot's position and "the rest", mass
1 - sum of the k) and q the drafter's softmax summed into the same buckets (its rest from a
log-sum-exp over the other tokens, not 1 - sum). d is the forward KL(p || q) or the total
variation 0.5 * sum |p - q|. Its gradient joins the cross entropy's in the same chunk pass.

Shapes: A anchors, B block size, Q = A * B block rows, K = B - 1 labelled slots, H hidden,
V vocabulary, R rows of one chunk, L labelled rows, T tokens of the packed micro-batch, k top-k.
"""

import functools
from dataclasses import dataclass

import torch

from dflash.model.drafter import rows_dynamic

IGNORE_LABEL = -100  # label of slots that are not supervised; never equals an argmax
DISTILL_KINDS = ("kl", "tv")  # train.distill
CE_KERNELS = ("compiled", "triton")  # train.loss_kernel: the cross entropy's pass on CUDA (_ce_and_grad_on)


def default_gamma(block_size: int) -> float:
    """Decay of the slot weights used by the public DFlash recipes (7 for B=16, 5 for B=10, 4 for B=8)."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, 7.0)


def gamma_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """Per-slot weights `(B,)` float32: 0 at slot 0, `exp(-(k-1)/gamma)` at slot k >= 1."""
    slots = torch.arange(block_size, dtype=torch.float32, device=device)
    weights = torch.exp(-(slots - 1) / gamma)
    weights[0] = 0.0
    return weights


def block_labels(
    input_ids_T: torch.Tensor,
    loss_mask_T: torch.Tensor,
    doc_ids_T: torch.Tensor,
    anchor_index_A: torch.Tensor,
    anchor_valid_A: torch.Tensor,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels `(A, B)` int64 and their validity `(A, B)` bool for a packed micro-batch.

    Slot k of the anchor at flat index i is labelled with the token at flat index i + k; it
    is valid iff k >= 1, i + k is inside the packed row and in the same sequence (doc id),
    the token is supervised, and the anchor is not padding. Invalid labels are IGNORE_LABEL.
    """
    target_AB, valid_AB = _slot_targets(loss_mask_T, doc_ids_T, anchor_index_A, anchor_valid_A, block_size)
    labels_AB = torch.where(valid_AB, input_ids_T[target_AB].long(), IGNORE_LABEL)
    return labels_AB, valid_AB


def label_rows(
    loss_mask_T: torch.Tensor,
    doc_ids_T: torch.Tensor,
    anchor_index_A: torch.Tensor,
    anchor_valid_A: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """Flat indices `(L,)` int64 into the `A * B` block rows of the rows that carry a label
    (`block_labels`'s rule). The collate computes them on the host, so the loss runs the LM head
    over these rows only and the device learns their number from the shape, without a sync."""
    _, valid_AB = _slot_targets(loss_mask_T, doc_ids_T, anchor_index_A, anchor_valid_A, block_size)
    return valid_AB.reshape(-1).nonzero().squeeze(1)


def block_soft_targets(topk_ids_Tk: torch.Tensor, topk_probs_Tk: torch.Tensor, loss_mask_T: torch.Tensor,
                       doc_ids_T: torch.Tensor, anchor_index_A: torch.Tensor, anchor_valid_A: torch.Tensor,
                       block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored soft targets of each block slot: `(ids (A, B, k) int64, probs (A, B, k) float32)`.

    Slot k of the anchor at flat index i reads row i + k, the row its label comes from (a store's
    row p holds the target's distribution of the token at p); rows that are no label get zeros
    (their loss weight is 0)."""
    target_AB, valid_AB = _slot_targets(loss_mask_T, doc_ids_T, anchor_index_A, anchor_valid_A, block_size)
    keep_AB1 = valid_AB[..., None]
    return (torch.where(keep_AB1, topk_ids_Tk[target_AB].long(), 0),
            torch.where(keep_AB1, topk_probs_Tk[target_AB].float(), 0.0))


def _slot_targets(loss_mask_T, doc_ids_T, anchor_index_A, anchor_valid_A, block_size: int):
    """The flat token index each block slot predicts (clamped inside the row) and whether it is a label."""
    num_tokens = doc_ids_T.shape[0]
    slots = torch.arange(block_size, device=anchor_index_A.device)
    target_AB = anchor_index_A[:, None] + slots[None, :]
    inside = target_AB < num_tokens
    target_AB = target_AB.clamp(max=num_tokens - 1)
    same_doc = doc_ids_T[target_AB] == doc_ids_T[anchor_index_A][:, None]
    valid_AB = inside & same_doc & loss_mask_T[target_AB].bool() & (slots[None, :] >= 1) & anchor_valid_A[:, None].bool()
    return target_AB, valid_AB


def _ce_and_grad(logits_RV: torch.Tensor, labels_R: torch.Tensor, weight_R: torch.Tensor,
                 grad_dtype: torch.dtype = torch.float32, fused: bool = False):
    """Per-row cross entropy, argmax and `weight * d ce / d logits` (softmax - onehot), computed in
    float32 and returned in `grad_dtype` (the hidden states' dtype).

    One exponential pass: the row maximum gives the argmax and the shift, `exp(logits - max)`
    summed gives the log-sum-exp, and the same exponentials scaled by `weight / sum` are the
    softmax part of the gradient. Eager (`fused=False`) that happens in place and the label's
    column is corrected by index. `fused=True` is the form for the compiler (CUDA compiles it): the
    label's column subtracts `weight` in the same elementwise expression and the cast comes last, so
    compiled it is one write of the gradient in its dtype instead of a float32 gradient, an
    index_put and a cast; eager it would hold several float32 copies. Both give the same values.
    The logits themselves are not modified.
    """
    logits_RV = logits_RV.float()
    rows_R = torch.arange(logits_RV.shape[0], device=logits_RV.device)
    label_logit_R = logits_RV[rows_R, labels_R]
    max_R, argmax_R = logits_RV.max(dim=-1)
    shifted_RV = logits_RV - max_R[:, None]
    exp_RV = shifted_RV.exp() if fused else shifted_RV.exp_()
    sum_R = exp_RV.sum(dim=-1)
    ce_R = max_R + sum_R.log() - label_logit_R
    scale_R1 = (weight_R / sum_R)[:, None]
    if fused:
        softmax_part_RV = exp_RV * scale_R1
        is_label_RV = torch.arange(logits_RV.shape[1], device=logits_RV.device)[None, :] == labels_R[:, None]
        grad_RV = torch.where(is_label_RV, softmax_part_RV - weight_R[:, None], softmax_part_RV)
    else:
        grad_RV = exp_RV.mul_(scale_R1)
        grad_RV[rows_R, labels_R] -= weight_R
    return ce_R, argmax_R, grad_RV.to(grad_dtype)


@functools.cache
def _compiled_ce_and_grad():
    # One fused pass over each logits chunk instead of ~8 float32 passes (CUDA only). The chunk's rows
    # (the last chunk of every micro-batch is shorter) are dynamic from the first call: one compile.
    return rows_dynamic(torch.compile(functools.partial(_ce_and_grad, fused=True)), ((0, 0), (1, 0), (2, 0)))


def _ce_distill_and_grad(logits_RV: torch.Tensor, labels_R: torch.Tensor, weight_R: torch.Tensor,
                         ids_Rk: torch.Tensor, probs_Rk: torch.Tensor, distill_weight: float, kind: str,
                         grad_dtype: torch.dtype = torch.float32):
    """`_ce_and_grad` with the distillation term: per-row cross entropy, distillation d(p, q), argmax,
    and the gradient of `weight * (ce + distill_weight * d)` over the logits (float32 maths).

    Buckets b: the k ids and the rest. With q_v the drafter's softmax and Q_b its bucket sums, the
    rest's sum comes from the exponentials with the k columns zeroed (no 1 - sum cancellation).
    d Q_b / d z_v = q_v (1[v in b] - Q_b), so
      KL: d/dz_v = q_v * sum(P) - P_b(v) * q_v / Q_b(v)   (P_b log P_b - P_b log Q_b summed)
      TV: d/dz_v = 0.5 * q_v * (s_b(v) - sum_b s_b Q_b),  s_b = sign(Q_b - P_b).
    Rows of weight 0 (zero-filled soft targets among them) stay finite.
    """
    logits_RV = logits_RV.float()
    rows_R = torch.arange(logits_RV.shape[0], device=logits_RV.device)
    label_logit_R = logits_RV[rows_R, labels_R]
    top_logit_Rk = logits_RV.gather(1, ids_Rk)
    max_R, argmax_R = logits_RV.max(dim=-1)
    exp_RV = (logits_RV - max_R[:, None]).exp_()
    sum_R = exp_RV.sum(dim=-1)
    exp_RV.scatter_(1, ids_Rk, 0.0)  # from here the rest bucket's exponentials only
    rest_sum_R = exp_RV.sum(dim=-1).clamp(min=torch.finfo(torch.float32).tiny)
    log_sum_R = sum_R.log()
    ce_R = max_R + log_sum_R - label_logit_R
    log_q_Rk = top_logit_Rk - (max_R + log_sum_R)[:, None]
    log_q_rest_R = rest_sum_R.log() - log_sum_R
    q_Rk, q_rest_R = log_q_Rk.exp(), log_q_rest_R.exp()
    p_Rk = probs_Rk.float()
    p_rest_R = (1.0 - p_Rk.sum(dim=-1)).clamp(min=0.0)
    if kind == "kl":
        distill_R = ((torch.xlogy(p_Rk, p_Rk) - p_Rk * log_q_Rk).sum(dim=-1)
                     + torch.xlogy(p_rest_R, p_rest_R) - p_rest_R * log_q_rest_R)
        mass_R = p_Rk.sum(dim=-1) + p_rest_R
        top_grad_Rk = q_Rk * mass_R[:, None] - p_Rk
        rest_scale_R = mass_R / sum_R - p_rest_R / rest_sum_R  # times the rest's exponentials
    elif kind == "tv":
        sign_Rk, sign_rest_R = torch.sign(q_Rk - p_Rk), torch.sign(q_rest_R - p_rest_R)
        distill_R = 0.5 * ((q_Rk - p_Rk).abs().sum(dim=-1) + (q_rest_R - p_rest_R).abs())
        centre_R = (sign_Rk * q_Rk).sum(dim=-1) + sign_rest_R * q_rest_R
        top_grad_Rk = 0.5 * q_Rk * (sign_Rk - centre_R[:, None])
        rest_scale_R = 0.5 * (sign_rest_R - centre_R) / sum_R
    else:
        raise ValueError(f"train.distill must be one of {', '.join(DISTILL_KINDS)}, got {kind!r}")
    soft_weight_R = weight_R * distill_weight
    grad_RV = exp_RV.mul_((weight_R / sum_R + soft_weight_R * rest_scale_R)[:, None])
    grad_RV.scatter_(1, ids_Rk, weight_R[:, None] * q_Rk + soft_weight_R[:, None] * top_grad_Rk)
    grad_RV[rows_R, labels_R] -= weight_R
    return ce_R, distill_R, argmax_R, grad_RV.to(grad_dtype)


@functools.cache
def _compiled_ce_distill_and_grad(distill_weight: float, kind: str, grad_dtype: torch.dtype):
    # As `_compiled_ce_and_grad`: the eager form's dozen float32 passes over each logits chunk fused by the
    # compiler (CUDA only), the rows (arguments 0-4) dynamic from the first call; one compile per setting.
    compiled = torch.compile(functools.partial(_ce_distill_and_grad, distill_weight=distill_weight, kind=kind,
                                               grad_dtype=grad_dtype))
    return rows_dynamic(compiled, ((0, 0), (1, 0), (2, 0), (3, 0), (4, 0)))


class _ChunkedLMHeadCrossEntropy(torch.autograd.Function):
    """`sum_q row_weight[q] * ce(hidden[q] @ lm_head.T, label[q])`, `chunk_size` rows at a time; with
    soft targets (`soft_ids_Qk`, `soft_probs_Qk`) plus `distill_weight * row_weight[q] * d(p, q)`.

    Also returns the per-row cross entropy, distillation term (zeros without) and argmax (no gradient). The loss is the end of
    the graph, so the gradients are computed in the forward, from the logits already at hand,
    and the backward only scales them by the incoming scalar: the head runs once per row
    instead of twice (no recomputed logits).
    """

    @staticmethod
    def forward(ctx, hidden_QH, lm_head_VH, labels_Q, row_weight_Q, chunk_size, ce_kernel="compiled", soft_ids_Qk=None,
                soft_probs_Qk=None, distill_weight=0.0, distill="kl"):
        num_rows = hidden_QH.shape[0]
        want_hidden, want_head = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ce_Q = torch.empty(num_rows, dtype=torch.float32, device=hidden_QH.device)
        distill_Q = torch.zeros(num_rows, dtype=torch.float32, device=hidden_QH.device)
        argmax_Q = torch.empty(num_rows, dtype=torch.long, device=hidden_QH.device)
        grad_hidden = torch.empty_like(hidden_QH) if want_hidden else None
        grad_head = torch.zeros_like(lm_head_VH, dtype=torch.float32) if want_head else None
        safe_labels_Q = labels_Q.clamp(min=0)
        ce_and_grad = _ce_and_grad_on(hidden_QH.device, ce_kernel)
        if soft_ids_Qk is not None:
            distill_and_grad = (_compiled_ce_distill_and_grad(float(distill_weight), distill, hidden_QH.dtype)
                                if hidden_QH.is_cuda else
                                functools.partial(_ce_distill_and_grad, distill_weight=distill_weight, kind=distill,
                                                  grad_dtype=hidden_QH.dtype))
        for start in range(0, num_rows, chunk_size):
            rows = slice(start, start + chunk_size)
            logits_RV = hidden_QH[rows] @ lm_head_VH.T
            if soft_ids_Qk is None:
                ce_R, argmax_R, grad_RV = ce_and_grad(logits_RV, safe_labels_Q[rows], row_weight_Q[rows].float(),
                                                      hidden_QH.dtype)
            else:
                ce_R, distill_Q[rows], argmax_R, grad_RV = distill_and_grad(
                    logits_RV, safe_labels_Q[rows], row_weight_Q[rows].float(), soft_ids_Qk[rows], soft_probs_Qk[rows])
            ce_Q[rows], argmax_Q[rows] = ce_R, argmax_R
            if want_hidden:
                grad_hidden[rows] = grad_RV @ lm_head_VH
            if want_head:
                grad_head += grad_RV.T.float() @ hidden_QH[rows].float()
        ctx.save_for_backward(grad_hidden, grad_head.to(lm_head_VH.dtype) if want_head else None)
        ctx.mark_non_differentiable(ce_Q, distill_Q, argmax_Q)
        return ((ce_Q + distill_weight * distill_Q) * row_weight_Q).sum(), ce_Q, distill_Q, argmax_Q

    @staticmethod
    def backward(ctx, grad_loss, grad_ce_unused, grad_distill_unused, grad_argmax_unused):
        grad_hidden, grad_head = ctx.saved_tensors
        scale = grad_loss.to(torch.float32)
        grad_hidden = None if grad_hidden is None else (grad_hidden * scale).to(grad_hidden.dtype)
        grad_head = None if grad_head is None else (grad_head * scale).to(grad_head.dtype)
        return grad_hidden, grad_head, None, None, None, None, None, None, None, None


def _ce_and_grad_on(device: torch.device, ce_kernel: str):
    """The cross entropy and gradient pass of a chunk: eager on the CPU; on CUDA inductor's compile of
    `_ce_and_grad` ("compiled") or dflash's Triton kernel ("triton", dflash/model/ce_kernel.py: two reads of
    each row's logits in tiles and one write, 3% sooner in the SmolLM2-sized drafter's step); `train.loss_kernel`'s
    "auto" is resolved before (dflash.train.step.triton_or)."""
    if device.type != "cuda":
        return _ce_and_grad
    if ce_kernel == "triton":
        from dflash.model import ce_kernel as kernel

        return kernel.ce_and_grad
    if ce_kernel != "compiled":
        raise ValueError(f"loss: ce_kernel must be one of {CE_KERNELS}, got {ce_kernel!r}")
    return _compiled_ce_and_grad()


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, sum(w * ce) / sum(w); differentiable without a distillation term
    loss_sum: torch.Tensor  # scalar, sum(w * ce); differentiable as `loss` is (for normalising over micro-batches)
    weight_sum: torch.Tensor  # scalar, sum(w) over valid slots
    correct: torch.Tensor  # (A, B) bool, top-1 prediction equals a valid label
    objective: torch.Tensor | None = None  # what training differentiates: loss + distill_weight * distill
    distill: torch.Tensor | None = None  # scalar, sum(w * d) / sum(w) (no gradient); None without soft targets

    def __post_init__(self):
        if self.objective is None:
            self.objective = self.loss


def dflash_loss(
    hidden_QH: torch.Tensor,
    lm_head_VH: torch.Tensor,
    labels_AB: torch.Tensor,
    valid_AB: torch.Tensor,
    weights_B: torch.Tensor,
    chunk_size: int = 1024,
    rows_L: torch.Tensor | None = None,
    group_A: torch.Tensor | None = None,
    num_groups: int = 1,
    soft_targets: tuple[torch.Tensor, torch.Tensor] | None = None,
    distill_weight: float = 0.0,
    distill: str = "kl",
    ce_kernel: str = "compiled",
) -> LossOutput:
    """Gamma-weighted block cross entropy with the LM head applied `chunk_size` rows at a time.

    `group_A` (per anchor, 0..num_groups-1: a fused step's micro-batches, `train.fuse_accum`), when
    given, makes the loss the mean of the groups' own weighted means, what the unfused step averages
    over its micro-batches (on the device, no sync); `weight_sum` stays the sum over all groups.

    `rows_L` (from `label_rows`, computed by the collate) restricts the LM head to the rows that
    carry a label; without it every row of slots 1.. goes through the head (unlabelled ones with
    weight 0). Both give the same loss, gradients and `correct`. The selected rows are cast to the
    head's dtype (the others are never touched); the gather's backward scatters the gradient back.

    `soft_targets` (`block_soft_targets`: ids and probabilities `(A, B, k)`) with `distill_weight` > 0
    add the distillation term `distill` ("kl" or "tv", the module docstring), weighted and normalised
    as the cross entropy is; `objective` is then `loss + distill_weight * distill` and `loss` (the
    cross entropy alone) carries no gradient.

    `ce_kernel` ("compiled" or "triton", `train.loss_kernel`) chooses the cross entropy's pass on CUDA
    (`_ce_and_grad_on`); the distillation term's pass is compiled either way.
    """
    num_anchors, block_size = labels_AB.shape
    if hidden_QH.shape[0] != num_anchors * block_size:
        raise ValueError(f"loss: hidden has {hidden_QH.shape[0]} rows, labels need {num_anchors} x {block_size}")
    row_weight_AB = weights_B.to(device=hidden_QH.device, dtype=torch.float32)[None, :] * valid_AB
    weight_sum = row_weight_AB.sum()
    if group_A is not None:
        sums_G = torch.zeros(num_groups, dtype=torch.float32, device=row_weight_AB.device).index_add_(
            0, group_A, row_weight_AB.sum(1))
        row_weight_AB = row_weight_AB / (num_groups * sums_G.clamp(min=torch.finfo(torch.float32).tiny))[group_A, None]
    if rows_L is None:  # slot 0 (the anchor token) is never a label: every other row, no sync
        rows_L = torch.arange(num_anchors * block_size, device=hidden_QH.device).view(num_anchors, block_size)[:, 1:]
        rows_L = rows_L.reshape(-1)
    row_weight_L = row_weight_AB.reshape(-1).index_select(0, rows_L)
    soft_L = ()
    if soft_targets is not None and distill_weight > 0:
        soft_L = tuple(values.reshape(num_anchors * block_size, -1).index_select(0, rows_L) for values in soft_targets)
        soft_L += (float(distill_weight), distill)
    objective_sum, ce_L, distill_L, argmax_L = _ChunkedLMHeadCrossEntropy.apply(
        hidden_QH.index_select(0, rows_L).to(lm_head_VH.dtype), lm_head_VH,
        labels_AB.reshape(-1).index_select(0, rows_L), row_weight_L, chunk_size, ce_kernel, *soft_L,
    )
    argmax_AB = torch.full((num_anchors * block_size,), IGNORE_LABEL, dtype=argmax_L.dtype,
                           device=argmax_L.device).index_copy_(0, rows_L, argmax_L).view(num_anchors, block_size)
    # An all-padding micro-batch gives loss 0 (and zero gradients), not NaN.
    def normalised(total):
        return total if group_A is not None else total / weight_sum.clamp(min=torch.finfo(torch.float32).tiny)

    correct_AB = (argmax_AB == labels_AB) & valid_AB
    if not soft_L:
        return LossOutput(loss=normalised(objective_sum), loss_sum=objective_sum, weight_sum=weight_sum,
                          correct=correct_AB)
    loss_sum = (ce_L * row_weight_L).sum()
    return LossOutput(loss=normalised(loss_sum), loss_sum=loss_sum, weight_sum=weight_sum, correct=correct_AB,
                      objective=normalised(objective_sum), distill=normalised((distill_L * row_weight_L).sum()))


def accepted_slots(correct_AB: torch.Tensor, valid_AB: torch.Tensor) -> torch.Tensor:
    """Per anchor, the consecutive correct and valid slots from slot 1 (int64): the drafts one
    verification from that anchor accepts."""
    return torch.cumprod((correct_AB & valid_AB)[:, 1:].long(), dim=1).sum(dim=1)


def block_metrics(correct_AB: torch.Tensor, valid_AB: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-slot top-1 accuracy and the expected acceptance length tau, as device tensors.

    tau = 1 + mean over real blocks of the number of consecutive correct slots from slot 1
    (stopping at the first wrong or invalid slot): the tokens one draft step would yield.
    The raw counts are returned too, so that metrics can be summed over micro-batches.
    """
    hits_AK = (correct_AB & valid_AB)[:, 1:].float()
    slot_correct = hits_AK.sum(dim=0)
    slot_valid = valid_AB[:, 1:].float().sum(dim=0)
    accepted_A = accepted_slots(correct_AB, valid_AB).float()
    real_block_A = valid_AB.any(dim=1).float()
    num_blocks = real_block_A.sum()
    accepted_sum = (accepted_A * real_block_A).sum()
    return {
        "slot_accuracy": slot_correct / slot_valid.clamp(min=1.0),
        "tau": 1.0 + accepted_sum / num_blocks.clamp(min=1.0),
        "slot_correct": slot_correct,
        "slot_valid": slot_valid,
        "accepted_sum": accepted_sum,
        "num_blocks": num_blocks,
    }
