"""Anchor sampling: eligibility, no duplicates, sorting, caps, reproducibility, uniformity."""

import numpy as np

from dflash.model.anchors import anchor_rng, eligible_anchors, sample_anchors


def random_loss_mask(rng: np.random.Generator, length: int) -> np.ndarray:
    return rng.random(length) < 0.6


def test_only_eligible_sorted_unique_and_capped():
    data_rng = np.random.default_rng(0)
    for sample_key in range(50):
        loss_mask = random_loss_mask(data_rng, int(data_rng.integers(1, 300)))
        max_anchors = int(data_rng.integers(0, 80))
        anchors = sample_anchors(loss_mask, max_anchors, anchor_rng(1, 0, sample_key))
        assert anchors.dtype == np.int64
        assert len(anchors) == min(max_anchors, int(loss_mask[1:].sum()))
        assert np.all(np.diff(anchors) > 0), "anchors must be sorted without duplicates"
        assert np.all(anchors + 1 < len(loss_mask))
        assert np.all(loss_mask[anchors + 1])


def test_all_eligible_when_fewer_than_max():
    loss_mask = np.array([0, 0, 1, 1, 0, 1, 0, 0, 1], dtype=bool)
    anchors = sample_anchors(loss_mask, 512, anchor_rng(0, 0, 0))
    np.testing.assert_array_equal(anchors, [1, 2, 4, 7])
    np.testing.assert_array_equal(eligible_anchors(loss_mask), [1, 2, 4, 7])
    # The last position never qualifies: it has no next token.
    assert len(sample_anchors(np.ones(1, dtype=bool), 8, anchor_rng(0, 0, 0))) == 0


def test_reproducible_and_fresh_each_epoch():
    loss_mask = np.ones(2000, dtype=bool)
    first = sample_anchors(loss_mask, 64, anchor_rng(7, 3, 11))
    again = sample_anchors(loss_mask, 64, anchor_rng(7, 3, 11))
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, sample_anchors(loss_mask, 64, anchor_rng(7, 4, 11)))
    assert not np.array_equal(first, sample_anchors(loss_mask, 64, anchor_rng(7, 3, 12)))
    assert not np.array_equal(first, sample_anchors(loss_mask, 64, anchor_rng(8, 3, 11)))


def test_roughly_uniform_over_eligible_positions():
    loss_mask = np.zeros(41, dtype=bool)
    loss_mask[1::2] = True  # eligible anchors: 0, 2, ..., 38 (20 positions)
    counts = np.zeros(41)
    draws = 4000
    for sample_key in range(draws):
        counts[sample_anchors(loss_mask, 5, anchor_rng(0, 0, sample_key))] += 1
    eligible = np.arange(0, 40, 2)
    assert counts[np.setdiff1d(np.arange(41), eligible)].sum() == 0
    expected = draws * 5 / 20  # 1000 per position; binomial std is about 27
    assert np.all(np.abs(counts[eligible] - expected) < 150), counts[eligible]
