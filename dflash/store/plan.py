"""Shard planning: bucket assignment, cutting buckets into shards, shards onto ranks.

The plan is computed once from the tokenized sample lengths, before any GPU work, and is
independent of the number of ranks: `plan_shards` decides what each shard holds, and
`assign_ranks` only decides who writes it. Rerunning with a different world size therefore
reuses every shard already committed.
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ShardPlan:
    """One shard: its name, bucket, the kept-sample indices it holds (in store order: shortest
    first, then row id), its tokens."""

    name: str
    bucket: int
    sample_indices: tuple[int, ...]
    num_tokens: int


def shard_name(bucket: int, index: int) -> str:
    return f"b{bucket:02d}-{index:05d}"


def assign_bucket(length: int, bucket_edges: list[int] | tuple[int, ...]) -> int:
    """Bucket of a sequence length: edges [e0..ek] give buckets [e_i, e_{i+1}), the last one
    closed ([e_{k-1}, e_k]) so that max_length == e_k fits.

    Lengths below e0 fall into bucket 0; a length above the last edge is an error (the config
    validation keeps max_length <= last edge).
    """
    if len(bucket_edges) < 2:
        raise ValueError(f"bucket_edges needs at least two edges, got {list(bucket_edges)}")
    if length > bucket_edges[-1]:
        raise ValueError(
            f"length {length} is above the last bucket edge {bucket_edges[-1]} "
            f"(bucket_edges={list(bucket_edges)})"
        )
    return min(len(bucket_edges) - 2, max(0, bisect.bisect_right(bucket_edges, length) - 1))


def plan_shards(
    lengths: np.ndarray,
    row_ids: np.ndarray,
    bucket_edges: list[int] | tuple[int, ...],
    shard_tokens: int,
) -> list[ShardPlan]:
    """Cut every bucket, in row-id order, into shards of at most `shard_tokens` tokens; inside a
    shard the samples go shortest first (`by_length`).

    `lengths[i]` and `row_ids[i]` describe kept sample i; `ShardPlan.sample_indices` refer
    to those positions. A sample longer than `shard_tokens` gets a shard of its own.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    row_ids = np.asarray(row_ids, dtype=np.int64)
    if lengths.shape != row_ids.shape:
        raise ValueError(f"lengths {lengths.shape} and row_ids {row_ids.shape} differ in shape")
    if shard_tokens <= 0:
        raise ValueError(f"shard_tokens must be positive, got {shard_tokens}")
    buckets = np.array([assign_bucket(int(n), bucket_edges) for n in lengths], dtype=np.int64)
    # stable sort on row id keeps the plan a pure function of the data
    order = np.argsort(row_ids, kind="stable")
    plans: list[ShardPlan] = []
    for bucket in range(len(bucket_edges) - 1):
        members = order[buckets[order] == bucket]
        plans.extend(_cut_bucket(bucket, members, lengths, shard_tokens))
    return plans


def _cut_bucket(
    bucket: int, members: np.ndarray, lengths: np.ndarray, shard_tokens: int
) -> list[ShardPlan]:
    plans: list[ShardPlan] = []
    current: list[int] = []
    current_tokens = 0

    def close() -> None:
        plans.append(ShardPlan(shard_name(bucket, len(plans)), bucket, by_length(current, lengths), current_tokens))

    for index in members.tolist():
        length = int(lengths[index])
        if current and current_tokens + length > shard_tokens:
            close()
            current, current_tokens = [], 0
        current.append(index)
        current_tokens += length
    if current:
        close()
    return plans


def by_length(indices: tuple[int, ...], lengths: np.ndarray) -> tuple[int, ...]:
    """A shard's samples shortest first (ties keep row-id order): stage one batches consecutive
    samples and pads each batch to its longest, so neighbours of equal length waste no compute."""
    members = np.asarray(indices, dtype=np.int64)
    return tuple(members[np.argsort(lengths[members], kind="stable")].tolist())


def assign_ranks(shards: list[ShardPlan], world_size: int) -> list[list[ShardPlan]]:
    """Token-balanced shard-to-rank assignment (longest-processing-time greedy).

    Shards go, largest first (ties by name), to the rank with the fewest tokens so far (ties
    to the lowest rank). Each rank's list is returned in plan (name) order.
    """
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    by_size = sorted(shards, key=lambda s: (-s.num_tokens, s.name))
    loads = [(0, rank) for rank in range(world_size)]  # heap of (tokens, rank)
    per_rank: list[list[ShardPlan]] = [[] for _ in range(world_size)]
    for shard in by_size:
        tokens, rank = heapq.heappop(loads)
        per_rank[rank].append(shard)
        heapq.heappush(loads, (tokens + shard.num_tokens, rank))
    return [sorted(assigned, key=lambda s: s.name) for assigned in per_rank]


def write_order(shards: list[ShardPlan]) -> list[ShardPlan]:
    """The order a rank writes its shards in: buckets interleaved in proportion to their tokens.

    A store being written then holds every sequence length from early on, so a stage two that
    follows it (`train.follow`) can mix lengths in every step from its first. Each shard is due
    at the middle of its token span inside its bucket, as a fraction of the bucket's tokens;
    shards go in due order (ties by name), each bucket's own shards staying in name order.
    """
    totals: dict[int, int] = {}
    for shard in shards:
        totals[shard.bucket] = totals.get(shard.bucket, 0) + shard.num_tokens
    done: dict[int, int] = dict.fromkeys(totals, 0)
    due = {}
    for shard in sorted(shards, key=lambda s: s.name):
        due[shard.name] = (done[shard.bucket] + shard.num_tokens / 2) / max(totals[shard.bucket], 1)
        done[shard.bucket] += shard.num_tokens
    return sorted(shards, key=lambda s: (due[s.name], s.name))

