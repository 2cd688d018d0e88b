"""Tests for the per-epoch micro-batch schedule (dflash/train/sampler.py)."""

import itertools

import numpy as np
import pytest
from support import MicroBatchSampler, bucket_counts

from dflash.train.sampler import DataCursor, _assign_ranks, build_epoch_schedule, interleave_buckets, split_holdout

BUCKET_EDGES = [64, 128, 256, 512]


def make_store_index(num_samples, bucket_shares, seed=0):
    """Random (lengths, buckets) where a bucket-b sample has a length in (edge[b-1], edge[b]]."""
    rng = np.random.default_rng(seed)
    buckets = rng.choice(len(bucket_shares), size=num_samples, p=bucket_shares).astype(np.int64)
    low = np.array([1] + [e + 1 for e in BUCKET_EDGES[:-1]])[buckets]
    high = np.array(BUCKET_EDGES)[buckets]
    return rng.integers(low, high + 1).astype(np.int64), buckets


def all_scheduled_samples(schedule):
    return [s for step in range(schedule.num_steps) for rank in schedule.step(step) for mb in rank for s in mb]


def global_sequence_buckets(schedule):
    return schedule.micro_batch_buckets.tolist()


CASES = [  # (shares, world_size, accum_steps, token_budget)
    ([0.25, 0.25, 0.25, 0.25], 1, 2, 1024),
    ([0.4, 0.3, 0.2, 0.1], 3, 4, 2048),
    ([0.7, 0.1, 0.1, 0.1], 2, 3, 1500),
    ([0.1, 0.1, 0.1, 0.7], 1, 4, 600),  # long bucket dominates: needs splitting to mix
    ([1.0], 4, 1, 700),
]


@pytest.mark.parametrize("shares,world,accum,budget", CASES)
def test_every_sample_exactly_once_within_budget(shares, world, accum, budget):
    lengths, buckets = make_store_index(900, shares, seed=1)
    schedule = build_epoch_schedule(lengths, buckets, budget, world, accum, seed=3, epoch=0)
    seen = all_scheduled_samples(schedule)
    assert sorted(seen) == list(range(len(lengths)))
    assert len(schedule.micro_batches) == schedule.num_steps * world * accum
    for mb in schedule.micro_batches:
        assert lengths[list(mb)].sum() <= budget
        assert len(set(buckets[list(mb)].tolist())) == 1  # a micro-batch holds one bucket


def test_anchor_budget_bounds_micro_batches_of_short_sequences():
    lengths, buckets = make_store_index(900, [0.4, 0.3, 0.2, 0.1], seed=4)
    anchors = np.minimum(lengths * 3 // 4, 96)  # short sequences carry more anchors per token
    plain = build_epoch_schedule(lengths, buckets, 2048, 2, 2, seed=3, epoch=0)
    bounded = build_epoch_schedule(lengths, buckets, 2048, 2, 2, seed=3, epoch=0, anchors=anchors,
                                   anchor_budget=256)
    assert sorted(all_scheduled_samples(bounded)) == list(range(len(lengths)))
    assert max(anchors[list(mb)].sum() for mb in plain.micro_batches) > 256  # the budget binds
    for mb in bounded.micro_batches:
        assert anchors[list(mb)].sum() <= 256 and lengths[list(mb)].sum() <= 2048
    with pytest.raises(ValueError, match="anchor_budget"):
        build_epoch_schedule(lengths, buckets, 2048, 2, 2, seed=3, epoch=0, anchors=anchors, anchor_budget=64)


@pytest.mark.parametrize("shares,world,accum,budget", CASES)
def test_every_step_mixes_buckets_and_ranks_are_balanced(shares, world, accum, budget):
    lengths, buckets = make_store_index(900, shares, seed=2)
    schedule = build_epoch_schedule(lengths, buckets, budget, world, accum, seed=5, epoch=1)
    for step in range(schedule.num_steps):
        per_rank = schedule.step(step)
        assert [len(r) for r in per_rank] == [accum] * world
        flat = [mb for r in per_rank for mb in r]
        assert len(set(flat)) == len(flat)  # disjoint across ranks
        if len(shares) > 1:
            assert len({int(buckets[mb[0]]) for mb in flat}) >= 2, f"step {step} holds one bucket"
        rank_tokens = [sum(int(lengths[list(mb)].sum()) for mb in r) for r in per_rank]
        largest = max(int(lengths[list(mb)].sum()) for mb in flat)
        assert max(rank_tokens) - min(rank_tokens) <= largest


def test_ranks_get_more_even_tokens_than_a_plain_split():
    lengths, buckets = make_store_index(3000, [0.4, 0.3, 0.2, 0.1], seed=4)
    schedule = build_epoch_schedule(lengths, buckets, 2048, 4, 4, seed=0, epoch=0)
    snake_spread, plain_spread = 0, 0
    for step in range(schedule.num_steps):
        ids = range(step * 16, (step + 1) * 16)
        tokens = schedule.micro_batch_tokens[list(ids)]
        plain = tokens.reshape(4, 4).sum(axis=1)  # consecutive micro-batches per rank
        balanced = [schedule.micro_batch_tokens[schedule.rank_plan[step, r]].sum() for r in range(4)]
        snake_spread += max(balanced) - min(balanced)
        plain_spread += plain.max() - plain.min()
    assert snake_spread < plain_spread


def test_snake_order_evens_out_sorted_micro_batches():
    tokens = np.array([8, 7, 6, 5, 4, 3, 2, 1])
    per_rank = _assign_ranks(tokens, list(range(8)), world_size=2)
    assert per_rank == [[0, 3, 4, 7], [1, 2, 5, 6]]  # 18 tokens each; plain round-robin gives 20 / 16


def test_bucket_shares_hold_in_the_first_half():
    lengths, buckets = make_store_index(4000, [0.4, 0.3, 0.2, 0.1], seed=6)
    schedule = build_epoch_schedule(lengths, buckets, 1024, 2, 2, seed=0, epoch=0)
    sequence = np.array(global_sequence_buckets(schedule))
    half = sequence[: len(sequence) // 2]
    for bucket, count in bucket_counts(schedule).items():
        overall_share = count / len(sequence)
        assert abs((half == bucket).mean() - overall_share) < 0.01, bucket


def test_no_same_bucket_neighbours_when_avoidable():
    lengths, buckets = make_store_index(3000, [0.3, 0.25, 0.25, 0.2], seed=7)
    schedule = build_epoch_schedule(lengths, buckets, 1024, 1, 2, seed=0, epoch=0)
    counts = bucket_counts(schedule)
    assert max(counts.values()) <= sum(counts.values()) - max(counts.values()) + 1  # avoidable here
    sequence = global_sequence_buckets(schedule)
    assert all(a != b for a, b in zip(sequence, sequence[1:]))


@pytest.mark.parametrize("counts", [{0: 3, 1: 1, 2: 1}, {0: 5, 1: 4}, {0: 10, 1: 2}, {0: 7, 1: 1, 2: 1, 3: 2}])
def test_interleave_repeats_only_what_is_unavoidable(counts):
    order = interleave_buckets(counts)
    assert {b: order.count(b) for b in counts} == counts
    largest = max(counts.values())
    unavoidable = max(0, largest - (sum(counts.values()) - largest) - 1)
    assert sum(a == b for a, b in zip(order, order[1:])) == unavoidable


def test_deterministic_and_different_across_epochs():
    lengths, buckets = make_store_index(500, [0.4, 0.3, 0.2, 0.1], seed=8)
    first = build_epoch_schedule(lengths, buckets, 1024, 2, 2, seed=11, epoch=0)
    again = build_epoch_schedule(lengths, buckets, 1024, 2, 2, seed=11, epoch=0)
    next_epoch = build_epoch_schedule(lengths, buckets, 1024, 2, 2, seed=11, epoch=1)
    other_seed = build_epoch_schedule(lengths, buckets, 1024, 2, 2, seed=12, epoch=0)
    assert first.micro_batches == again.micro_batches
    assert np.array_equal(first.rank_plan, again.rank_plan)
    assert first.micro_batches != next_epoch.micro_batches
    assert first.micro_batches != other_seed.micro_batches


def test_count_fix_up_splits_without_dropping():
    lengths = np.full(10, 100, dtype=np.int64)
    buckets = np.zeros(10, dtype=np.int64)
    # budget 400 packs 4+4+2 = 3 micro-batches; 4 ranks need a multiple of 4
    schedule = build_epoch_schedule(lengths, buckets, 400, 4, 1, seed=0, epoch=0)
    assert len(schedule.micro_batches) == 4 and schedule.num_splits == 1
    assert sorted(all_scheduled_samples(schedule)) == list(range(10))
    assert sorted(len(mb) for mb in schedule.micro_batches) == [2, 2, 2, 4]  # the largest was halved


def test_too_few_samples_for_one_step_is_an_error():
    lengths = np.full(3, 10, dtype=np.int64)
    with pytest.raises(ValueError, match="3 samples cannot fill"):
        build_epoch_schedule(lengths, np.zeros(3, dtype=np.int64), 100, 4, 1, seed=0, epoch=0)


def test_sample_over_budget_names_its_index():
    lengths = np.array([10, 10, 999, 10], dtype=np.int64)
    with pytest.raises(ValueError, match="sample 2 has 999 tokens"):
        build_epoch_schedule(lengths, np.zeros(4, dtype=np.int64), 100, 1, 1, seed=0, epoch=0)


def test_single_micro_batch_steps_with_several_buckets_are_refused():
    lengths, buckets = make_store_index(50, [0.5, 0.5], seed=0)
    with pytest.raises(ValueError, match="accum_steps >= 2"):
        build_epoch_schedule(lengths, buckets, 1024, 1, 1, seed=0, epoch=0)


def test_unmixable_data_is_an_error():
    # bucket 1 is a single sample: at most one step can hold it, but there are many steps
    lengths = np.array([100] * 40 + [50], dtype=np.int64)
    buckets = np.array([0] * 40 + [1], dtype=np.int64)
    with pytest.raises(ValueError, match="cannot mix buckets"):
        build_epoch_schedule(lengths, buckets, 100, 1, 2, seed=0, epoch=0)


def test_sample_subset_is_respected():
    lengths, buckets = make_store_index(400, [0.5, 0.5], seed=9)
    train, held_out = split_holdout(400, 0.1, seed=1)
    schedule = build_epoch_schedule(lengths, buckets, 1024, 1, 2, seed=0, epoch=0, sample_indices=train)
    assert sorted(all_scheduled_samples(schedule)) == train.tolist()
    assert not set(all_scheduled_samples(schedule)) & set(held_out.tolist())


def test_split_holdout_is_deterministic_and_partitions():
    train, held_out = split_holdout(1000, 0.05, seed=3)
    again_train, again_held_out = split_holdout(1000, 0.05, seed=3)
    assert np.array_equal(train, again_train) and np.array_equal(held_out, again_held_out)
    assert len(held_out) == 50 and np.array_equal(np.sort(np.concatenate([train, held_out])), np.arange(1000))
    assert not np.array_equal(held_out, split_holdout(1000, 0.05, seed=4)[1])
    assert len(split_holdout(10, 0.0, seed=0)[1]) == 0


@pytest.mark.parametrize("num_samples,fraction", [(1000, 0.05), (7, 0.3), (2, 0.5), (10, 0.0)])
def test_split_holdout_by_singleton_groups_is_the_split_by_sample(num_samples, fraction):
    by_sample = split_holdout(num_samples, fraction, seed=5)
    by_group = split_holdout(num_samples, fraction, seed=5, groups=np.arange(num_samples))
    assert all(np.array_equal(a, b) for a, b in zip(by_sample, by_group))


def test_split_holdout_keeps_every_answer_of_a_prompt_on_one_side():
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 6, size=300)  # answers per prompt
    groups = rng.permutation(np.repeat(np.arange(300), sizes))  # answers of one prompt spread over the store
    _, first = np.unique(groups, return_index=True)  # renumber in order of first appearance
    rank = np.empty(300, dtype=np.int64)
    rank[np.argsort(first)] = np.arange(300)
    groups = rank[groups]
    train, held_out = split_holdout(len(groups), 0.1, seed=2, groups=groups)
    assert not set(groups[train]) & set(groups[held_out])
    assert np.array_equal(np.sort(np.concatenate([train, held_out])), np.arange(len(groups)))
    assert round(0.1 * len(groups)) <= len(held_out) < round(0.1 * len(groups)) + 6


def test_rank_batches_resume_gives_exactly_the_rest():
    lengths, buckets = make_store_index(600, [0.4, 0.3, 0.3], seed=10)
    schedule = build_epoch_schedule(lengths, buckets, 1024, 2, 3, seed=0, epoch=0)
    for rank in range(2):
        full = list(schedule.rank_batches(rank))
        assert len(full) == schedule.num_steps * 3
        resumed = list(schedule.rank_batches(rank, start_step=5))
        assert resumed == [item for item in full if item[0] >= 5]


def sampler_stream(cursor, rank, num_epochs=3):
    lengths, buckets = make_store_index(300, [0.4, 0.3, 0.3], seed=12)
    sampler = MicroBatchSampler(
        lengths, buckets, token_budget=1024, world_size=2, rank=rank, accum_steps=2, seed=7,
        cursor=cursor, num_epochs=num_epochs,
    )
    return list(sampler)


def test_micro_batch_sampler_resumes_at_a_cursor():
    full = sampler_stream(DataCursor(0, 0), rank=1)
    steps_epoch0 = build_epoch_schedule(*make_store_index(300, [0.4, 0.3, 0.3], seed=12), 1024, 2, 2, 7, 0).num_steps
    cursor = DataCursor.from_dict(DataCursor(epoch=1, step=3).to_dict())
    resumed = sampler_stream(cursor, rank=1)
    skipped = (steps_epoch0 + 3) * 2  # two micro-batches per step on this rank
    assert resumed == full[skipped:]
    assert {epoch for batch in full for epoch, _ in batch} == {0, 1, 2}


def test_micro_batch_sampler_ranks_cover_each_epoch_once():
    per_rank = [sampler_stream(DataCursor(0, 0), rank, num_epochs=2) for rank in range(2)]
    for epoch in range(2):
        seen = [s for stream in per_rank for batch in stream for e, s in batch if e == epoch]
        assert sorted(seen) == list(range(300))
    assert len(per_rank[0]) == len(per_rank[1])  # lock-step: same number of micro-batches


def test_data_cursor_from_dict_names_missing_keys():
    with pytest.raises(KeyError, match="step"):
        DataCursor.from_dict({"epoch": 1})
    assert DataCursor.from_dict({"epoch": 2, "step": 9}) == DataCursor(2, 9)


def test_many_configurations_keep_the_invariants():
    for seed, (world, accum) in itertools.product(range(3), [(1, 2), (2, 1), (2, 2), (3, 5)]):
        lengths, buckets = make_store_index(300, [0.6, 0.2, 0.15, 0.05], seed=seed)
        schedule = build_epoch_schedule(lengths, buckets, 900, world, accum, seed=seed, epoch=seed)
        assert sorted(all_scheduled_samples(schedule)) == list(range(300))
        for step in range(schedule.num_steps):
            step_buckets = {int(buckets[mb[0]]) for r in schedule.step(step) for mb in r}
            assert len(step_buckets) >= 2
