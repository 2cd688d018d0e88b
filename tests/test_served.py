"""The held-out tau as served (dflash.train.served, `train.eval_served_tokens`): the walk over a greedy
answer against a transcription of the serving loop on fresh random acceptance, the window's anchors,
the greedy answers' selection, and the evaluation end to end on a store."""

import numpy as np
import pytest
import torch

from dflash.config import ConfigError, load_config
from dflash.train import served


def serving_loop_reference(accepted_at: dict[int, int], answer: list[int], start: int, stop: int,
                           max_new_tokens: int) -> list[int]:
    """`speculative_generate`'s loop, transcribed, on an answer the target decodes greedily: `accepted_at[p]`
    drafts accepted from the anchor at position p (the answer's tokens at start.. are the target's own)."""
    generated = [answer[start]]
    stopped = generated[0] == stop
    lengths = []
    while len(generated) <= max_new_tokens and not stopped:
        anchor = start + len(generated) - 1
        accepted = accepted_at[anchor]
        committed = answer[anchor + 1:anchor + 1 + accepted + 1]  # the accepted drafts and the target's token
        generated += committed
        stopped = stop in committed
        lengths.append(accepted + 1)
    return lengths


@pytest.mark.parametrize("seed", range(6))
def test_the_walk_records_what_the_serving_loop_records(seed):
    rng = np.random.default_rng(seed)
    block, stop = 16, -7
    start = int(rng.integers(3, 30))
    answer_length = int(rng.integers(5, 120))
    end = start + answer_length - 1  # the stop token's position
    answer = list(rng.integers(0, 100, size=start)) + list(rng.integers(0, 100, size=answer_length - 1)) + [stop]
    # Acceptance from each anchor: the teacher-forced count, which stops at the answer's end (later slots
    # have no label); long runs and short ones, as a drafter gives.
    accepted_at = {p: int(min(rng.choice([0, 0, 1, 3, 7, block - 1]), end - p)) for p in range(start, end)}
    for max_new_tokens in (1, 8, 32, 128):
        reference = serving_loop_reference(accepted_at, answer, start, stop, max_new_tokens)
        walk = served.serve_walk({p: a + 1 for p, a in accepted_at.items()}, start, end, max_new_tokens)
        assert walk == reference


def test_window_anchors_cover_every_position_the_walk_reaches():
    mask = np.array([0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0], dtype=bool)  # the answer: positions 3..8
    assert served.answer_start(mask) == 3 and served.answer_end(mask) == 8
    assert served.window_anchors(mask, 4).tolist() == [3, 4, 5, 6]
    assert served.window_anchors(mask, 100).tolist() == [3, 4, 5, 6, 7]  # 8 predicts nothing supervised
    assert served.answer_end(np.array([0, 1, 1], dtype=bool)) == 2


def test_accepted_lengths_follow_the_tau_rule():
    correct = torch.tensor([[1, 1, 1, 0, 1], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    valid = torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 1, 1], [0, 1, 1, 0, 0]], dtype=torch.bool)
    assert served.accepted_lengths(correct, valid).tolist() == [3, 1, 3]


def test_greedy_share_separates_the_targets_own_answer():
    mask = np.array([0, 0, 1, 1, 1, 1, 1], dtype=bool)
    labels = np.array([5, 6, 7, 8, 9, 10, 11])
    assert served.greedy_share(labels.copy(), labels, mask, 3, 2) == 1.0
    sampled = labels.copy()
    sampled[3] = 0
    assert served.greedy_share(sampled, labels, mask, 3, 2) == pytest.approx(0.8)
    sampled[0] = 0  # prompt tokens do not count
    assert served.greedy_share(sampled, labels, mask, 3, 2) == pytest.approx(0.8)


def test_the_config_refuses_what_the_walk_cannot_measure():
    with pytest.raises(ConfigError, match="store.labels = \"target\""):
        load_config(None, ["train.eval_served_tokens=64"])
    with pytest.raises(ConfigError, match="train.max_anchors"):
        load_config(None, ["train.eval_served_tokens=64", "store.labels=target", "train.max_anchors=32"])
    with pytest.raises(ConfigError, match=r"eval_served_tokens must be >= 0, got -1"):
        load_config(None, ["train.eval_served_tokens=-1"])
    config = load_config(None, ["train.eval_served_tokens=8", "store.labels=target"])
    assert config.train.eval_served_tokens == 8
