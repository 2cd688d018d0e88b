"""Tests for bucket assignment, shard planning and shard-to-rank balance."""

import numpy as np
import pytest
from support import rank_imbalance, rank_token_counts

from dflash.store.plan import ShardPlan, assign_bucket, assign_ranks, plan_shards

EDGES = [16, 64, 256, 1024]


def test_assign_bucket_edges():
    assert assign_bucket(1, EDGES) == 0  # below the first edge
    assert assign_bucket(16, EDGES) == 0
    assert assign_bucket(63, EDGES) == 0
    assert assign_bucket(64, EDGES) == 1
    assert assign_bucket(255, EDGES) == 1
    assert assign_bucket(256, EDGES) == 2
    assert assign_bucket(1023, EDGES) == 2
    assert assign_bucket(1024, EDGES) == 2  # the last bucket is closed: max_length == last edge fits
    with pytest.raises(ValueError, match="1024"):
        assign_bucket(1025, EDGES)


def _random_samples(seed, count=300):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 1024, size=count)
    row_ids = rng.permutation(count * 3)[:count]  # sparse, unordered (rows were filtered)
    return lengths, row_ids


def test_plan_covers_every_sample_once_within_limits():
    lengths, row_ids = _random_samples(0)
    shard_tokens = 900
    plans = plan_shards(lengths, row_ids, EDGES, shard_tokens)
    seen = [i for p in plans for i in p.sample_indices]
    assert sorted(seen) == list(range(len(lengths)))
    for p in plans:
        assert p.num_tokens == int(lengths[list(p.sample_indices)].sum())
        assert all(assign_bucket(int(lengths[i]), EDGES) == p.bucket for i in p.sample_indices)
        assert p.num_tokens <= shard_tokens or len(p.sample_indices) == 1
        # inside a shard: shortest first, ties in row-id order (stage one pads batches of neighbours)
        order = [(int(lengths[i]), int(row_ids[i])) for i in p.sample_indices]
        assert order == sorted(order)
        assert p.name.startswith(f"b{p.bucket:02d}-")
    assert len({p.name for p in plans}) == len(plans)


def test_plan_packs_greedily_and_isolates_long_samples():
    lengths = np.array([100, 90, 100, 300, 100])
    row_ids = np.arange(5)
    plans = plan_shards(lengths, row_ids, [0, 1000], shard_tokens=250)
    assert [p.sample_indices for p in plans] == [(1, 0), (2,), (3,), (4,)]  # cut in row-id order, then by length
    assert [p.name for p in plans] == ["b00-00000", "b00-00001", "b00-00002", "b00-00003"]
    assert [p.num_tokens for p in plans] == [190, 100, 300, 100]


def test_plan_deterministic_and_follows_row_id_order():
    lengths, row_ids = _random_samples(1)
    first = plan_shards(lengths, row_ids, EDGES, 700)
    assert first == plan_shards(lengths.copy(), row_ids.copy(), EDGES, 700)
    # the same samples listed in another order give the same shards (by row id)
    perm = np.random.default_rng(2).permutation(len(lengths))
    shuffled = plan_shards(lengths[perm], row_ids[perm], EDGES, 700)
    as_rows = lambda plans, ids: [(p.name, tuple(ids[list(p.sample_indices)])) for p in plans]
    assert as_rows(first, row_ids) == as_rows(shuffled, row_ids[perm])


def test_rank_assignment_balanced_deterministic_and_plan_independent():
    lengths, row_ids = _random_samples(3, count=600)
    plans = plan_shards(lengths, row_ids, EDGES, 2000)
    for world in (1, 2, 3, 5):
        assignment = assign_ranks(plans, world)
        assert assignment == assign_ranks(plans, world)
        names = sorted(s.name for shards in assignment for s in shards)
        assert names == sorted(p.name for p in plans)
        counts = rank_token_counts(assignment)
        assert sum(counts) == int(lengths.sum())
        # LPT bound: max load <= mean + largest shard
        assert max(counts) <= sum(counts) / world + max(p.num_tokens for p in plans)
    assert rank_imbalance(assign_ranks(plans, 3)) < 1.05


def test_rank_assignment_lpt_example():
    shards = [ShardPlan(f"b00-{i:05d}", 0, (i,), t) for i, t in enumerate([7, 5, 4, 3, 3])]
    assignment = assign_ranks(shards, 2)
    assert rank_token_counts(assignment) == [10, 12]
    assert [s.name for s in assignment[0]] == ["b00-00000", "b00-00003"]


def test_write_order_interleaves_buckets_and_keeps_each_bucket_in_name_order():
    from dflash.store.plan import write_order

    shards = [ShardPlan(f"b{b:02d}-{i:05d}", b, (), tokens) for b, count, tokens in [(0, 2, 100), (1, 6, 100), (2, 3, 200)]
              for i in range(count)]
    order = write_order(shards)
    assert sorted(s.name for s in order) == sorted(s.name for s in shards)
    for bucket in range(3):
        names = [s.name for s in order if s.bucket == bucket]
        assert names == sorted(names)
    first_half = {s.bucket for s in order[:len(order) // 2]}
    assert first_half == {0, 1, 2}  # every length is written early, not bucket after bucket
    assert order[0].bucket != order[1].bucket


@pytest.mark.parametrize("multiple", [1, 16])
def test_batches_of_a_shard_keep_its_order_and_fit_the_budget_once_padded(multiple):
    """Stage one's batches: consecutive samples of the shard (shortest first), each batch's padded size
    (its longest sample rounded up to the pad multiple, times its samples) within batch_tokens."""
    from types import SimpleNamespace

    from dflash.extract.capture import padded_batches

    lengths, row_ids = _random_samples(4)
    plans = plan_shards(lengths, row_ids, EDGES, 4000)
    shards_of_many = 0
    for plan in plans:
        samples = [SimpleNamespace(input_ids=np.zeros(lengths[i])) for i in plan.sample_indices]
        batches = list(padded_batches(samples, 1000, multiple))
        assert [first for first, _ in batches] == list(np.cumsum([0] + [len(b) for _, b in batches[:-1]]))
        assert sum(len(b) for _, b in batches) == len(samples)
        for _, batch in batches:
            padded = -(-max(len(s.input_ids) for s in batch) // multiple) * multiple
            assert padded * len(batch) <= 1000 or len(batch) == 1
        shards_of_many += len(batches) > 1
    assert shards_of_many > 0
