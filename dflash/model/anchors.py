"""Anchor sampling: which positions of a sequence start a training block.

An anchor at position `a` is eligible when the token at `a + 1` is supervised (the block's
first predicted slot has a label). Up to `max_anchors` eligible positions are drawn
uniformly without replacement, fresh every epoch, and returned sorted (sorted anchors keep
the flex-attention block mask dense). The generator is derived from (seed, epoch, sample),
so the draw is reproducible from those three numbers alone, in any worker, after resume.
"""

import numpy as np


def anchor_rng(seed: int, epoch: int, sample_key: int, source: int = 0) -> np.random.Generator:
    """The generator for one sample in one epoch (independent of order and worker); `source`, the
    sample's source in a store of several (row ids repeat across sources), keys the others apart."""
    return np.random.default_rng([seed, epoch, sample_key] + ([source] if source else []))


def eligible_anchors(loss_mask: np.ndarray) -> np.ndarray:
    """Positions `a` with `a + 1 < len` and `loss_mask[a + 1]`, as int64."""
    supervised_next = np.asarray(loss_mask, dtype=bool)[1:]
    return np.flatnonzero(supervised_next).astype(np.int64)


def sample_anchors(loss_mask: np.ndarray, max_anchors: int, rng: np.random.Generator) -> np.ndarray:
    """Sorted int64 anchor positions: all eligible ones if there are at most `max_anchors`,
    else `max_anchors` of them drawn uniformly without replacement."""
    if max_anchors < 0:
        raise ValueError(f"anchors: max_anchors must be >= 0, got {max_anchors}")
    eligible = eligible_anchors(loss_mask)
    if len(eligible) <= max_anchors:
        return eligible
    chosen = rng.choice(eligible, size=max_anchors, replace=False)
    return np.sort(chosen)
