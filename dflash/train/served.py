"""The held-out tau as serving measures it (`train.eval_served_tokens = N`).

Stage two's held-out tau (`eval/tau`) averages the acceptance length over anchors drawn uniformly
from whole answers. Serving measures something else: `dflash eval` at temperature 0 decodes the
first N tokens of an answer, and each verification starts where the previous one's accepted tokens
end, so a stretch the drafter predicts well is crossed in a few long verifications and a hard one
in many short ones; its tau is the mean over verifications, not over positions. On an answer the
target wrote greedily, with the target's labels, the teacher-forced acceptance length at every
position of the answer's first N tokens is exactly what a verification starting there accepts, so
walking the answer verification by verification, as the serving loop does, gives the tau that
serving that prompt would report (up to bf16 near-ties): `eval/served_tau`.

Which held-out answers are the target's greedy ones: with `store.labels = "target"` the store holds
the target's greedy token at every position, and a greedy answer's tokens are those labels (at least
GREEDY_SHARE of them over the window: decoding and stage one's forward may round a near-tie apart).
"""

import numpy as np
import torch

from dflash.model.anchors import eligible_anchors
from dflash.model.loss import accepted_slots

GREEDY_SHARE = 0.98  # of an answer's window tokens equal to the target's labels: the target's greedy answer


def answer_start(loss_mask: np.ndarray) -> int:
    """The position of the answer's first token (the first supervised one)."""
    supervised = np.flatnonzero(np.asarray(loss_mask, dtype=bool))
    if not supervised.size:
        raise ValueError("a sample without supervised tokens has no answer to serve")
    return int(supervised[0])


def window_anchors(loss_mask: np.ndarray, tokens: int) -> np.ndarray:
    """Every eligible anchor the serving walk can reach over an answer's first `tokens` tokens: the
    positions from the answer's first token up to its `tokens`-th (int64, sorted)."""
    start = answer_start(loss_mask)
    eligible = eligible_anchors(loss_mask)
    return eligible[(eligible >= start) & (eligible < start + tokens)]


def greedy_share(input_ids: np.ndarray, labels: np.ndarray, loss_mask: np.ndarray, tokens: int,
                 block_size: int) -> float:
    """Share of the answer's first `tokens + block_size` supervised tokens that equal the target's labels
    (the verifications of the first `tokens` read up to a block past them)."""
    supervised = np.flatnonzero(np.asarray(loss_mask, dtype=bool))[:tokens + block_size]
    if not supervised.size:
        return 0.0
    return float(np.mean(np.asarray(input_ids)[supervised] == np.asarray(labels)[supervised]))


def accepted_lengths(correct_AB: torch.Tensor, valid_AB: torch.Tensor) -> torch.Tensor:
    """Per anchor, the tokens one verification from it commits: its accepted drafts and the target's token."""
    return 1 + accepted_slots(correct_AB, valid_AB)


def serve_walk(lengths_at: dict[int, int], start: int, end: int, tokens: int) -> list[int]:
    """The acceptance lengths the temperature-0 serving loop records on one greedy answer.

    `lengths_at[p]`: the tokens a verification whose anchor (the last committed token) sits at position
    p commits; `start`, `end`: the answer's first and last token positions; `tokens`: max new tokens.
    As `speculative_generate`: the prefill commits the first token, then verifications run while the
    anchor is inside the budget, and stop once the answer's last token is committed."""
    lengths = []
    generated = 1
    while generated <= tokens:
        anchor = start + generated - 1
        if anchor >= end or anchor not in lengths_at:
            break
        lengths.append(int(lengths_at[anchor]))
        generated += lengths[-1]
    return lengths


def answer_end(loss_mask: np.ndarray) -> int:
    """The position of the answer's last token: the end of the first supervised span."""
    mask = np.asarray(loss_mask, dtype=bool)
    start = answer_start(mask)
    unsupervised = np.flatnonzero(~mask[start:])
    return start + int(unsupervised[0]) - 1 if unsupervised.size else len(mask) - 1


def greedy_held_out(reader, eval_indices: np.ndarray, tokens: int, block_size: int) -> np.ndarray:
    """The held-out samples whose answers are the target's greedy ones (GREEDY_SHARE of their window
    tokens equal to the target's labels), in order. Reads their tokens and labels, not their features."""
    samples = reader.read_tokens(eval_indices.tolist())
    shares = [greedy_share(sample["input_ids"], sample["labels"], sample["loss_mask"], tokens, block_size)
              for sample in samples]
    keep = [index for index, share in zip(eval_indices.tolist(), shares) if share >= GREEDY_SHARE]
    return np.asarray(keep, dtype=np.int64)
