"""The per-epoch schedule of stage-two micro-batches: bucketed, interleaved, split over ranks.

For one epoch, from `(seed, epoch)` alone:
1. each length bucket's samples are shuffled (rng from `(seed, epoch, bucket)`) and packed,
   in that order, into micro-batches of at most `token_budget` tokens;
2. micro-batches are split in two where needed (largest first) so that every optimizer step
   can mix buckets and the micro-batch count is a multiple of `world_size * accum_steps`;
   no sample is ever dropped or repeated;
3. buckets are interleaved into one global sequence, each drawn in proportion to its
   micro-batch count, with no two neighbours from the same bucket whenever the remaining
   counts allow it;
4. an optimizer step is `world_size * accum_steps` consecutive micro-batches of that
   sequence; a step made of one bucket only swaps a micro-batch with a nearby step, so
   every step mixes sequence lengths (docs/ARCHITECTURE.md: a requirement, not a knob);
5. inside a step each rank gets exactly `accum_steps` micro-batches, token-balanced.

The data state is a `DataCursor(epoch, step)`: resuming rebuilds the epoch's schedule and
starts at `step`, reading nothing that was skipped. A run that follows a store still being
written (dflash/train/follow.py) schedules its first epoch in segments; `segment` says which.

`schedule_for` and `held_out_micro_batches` build a run's schedules from its config and the
store's index (lengths, buckets, supervised counts), reading no sample.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Iterator, Sequence

import numpy as np

from dflash.padding import round_up

# Second key of the hold-out rng, so it never coincides with a (seed, epoch, bucket) stream.
_HOLDOUT_STREAM = 0x484F4C44  # "HOLD"

MicroBatch = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class DataCursor:
    """Position in the data order: the next optimizer step to run is `step` of `epoch` (of its
    `segment`, while a following run's first epoch is scheduled in segments)."""

    epoch: int = 0
    step: int = 0
    segment: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"epoch": int(self.epoch), "step": int(self.step), "segment": int(self.segment)}

    @classmethod
    def from_dict(cls, state: dict) -> DataCursor:
        missing = {"epoch", "step"} - set(state)
        if missing:
            raise KeyError(f"DataCursor.from_dict: missing keys {sorted(missing)} in {state!r}")
        return cls(epoch=int(state["epoch"]), step=int(state["step"]), segment=int(state.get("segment", 0)))


def split_holdout(num_samples: int, fraction: float, seed: int, groups: np.ndarray | None = None,
                  stream: tuple[int, ...] = ()) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic train / eval split of sample indices `0..num_samples-1`.

    Returns `(train_indices, eval_indices)`, both sorted int64. The eval set has
    `round(fraction * num_samples)` samples, at least one when `fraction > 0`, and the
    train set is never left empty. With `groups` (per sample, numbered in order of first
    appearance, e.g. `StoreReader.prompt_groups`), whole groups are held out, in the order of a
    permutation of the groups, until the eval set has at least that many samples: the answers
    to one prompt never fall on both sides. One sample per group gives the split without groups.
    `stream` extends the rng key (one source of a mix: dflash.train.mix.held_out_split).
    """
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"split_holdout: fraction must be in [0, 1), got {fraction}")
    num_eval = int(round(fraction * num_samples))
    if fraction > 0 and num_samples > 1:
        num_eval = min(max(num_eval, 1), num_samples - 1)
    rng = np.random.default_rng([seed, _HOLDOUT_STREAM, *stream])
    if groups is None:
        order = rng.permutation(num_samples)
        return np.sort(order[num_eval:]).astype(np.int64), np.sort(order[:num_eval]).astype(np.int64)
    groups = np.asarray(groups, dtype=np.int64)
    sizes = np.bincount(groups)
    order = rng.permutation(len(sizes))
    taken = int(np.searchsorted(np.cumsum(sizes[order]), num_eval)) + 1 if num_eval else 0
    held = np.zeros(len(sizes), dtype=bool)
    held[order[:min(taken, len(sizes) - 1)]] = True  # at least one group trains
    return np.flatnonzero(~held[groups]).astype(np.int64), np.flatnonzero(held[groups]).astype(np.int64)


def holdout_groups(config, reader) -> np.ndarray | None:
    """The groups `split_holdout` keeps together under `train.holdout_by`: the store's prompts, or
    none (every sample alone)."""
    if config.train.holdout_by == "prompt" and config.train.holdout_fraction > 0:
        return reader.prompt_groups()
    return None


def pack_bucket(sample_indices: np.ndarray, lengths: np.ndarray, token_budget: int,
                anchors: np.ndarray | None = None, anchor_budget: int = 0) -> list[MicroBatch]:
    """Pack samples, in the given order, into consecutive micro-batches of <= token_budget tokens
    and, when `anchors` (per-sample anchor counts) is given, <= anchor_budget anchors.

    Short sequences carry many more anchors per token than long ones, and the drafter's work
    (and memory) grows with anchors x block size: the second budget keeps a micro-batch of
    short sequences the size of one of long ones. Every sample keeps all its anchors.
    """
    micro_batches: list[MicroBatch] = []
    current: list[int] = []
    current_tokens = current_anchors = 0
    for sample in sample_indices.tolist():
        length = int(lengths[sample])
        count = 0 if anchors is None else int(anchors[sample])
        if length > token_budget:
            raise ValueError(
                f"sample {sample} has {length} tokens, more than token_budget={token_budget}; "
                "raise train token budget to at least the store's max_length"
            )
        if anchors is not None and count > anchor_budget:
            raise ValueError(f"sample {sample} has {count} anchors, more than anchor_budget={anchor_budget}; "
                             "raise train.anchor_budget to at least train.max_anchors")
        if current and (current_tokens + length > token_budget
                        or (anchors is not None and current_anchors + count > anchor_budget)):
            micro_batches.append(tuple(current))
            current, current_tokens, current_anchors = [], 0, 0
        current.append(sample)
        current_tokens += length
        current_anchors += count
    if current:
        micro_batches.append(tuple(current))
    return micro_batches


def split_in_two(micro_batch: MicroBatch, lengths: np.ndarray) -> tuple[MicroBatch, MicroBatch]:
    """Split a micro-batch of >= 2 samples, keeping order, where the two token counts are closest."""
    tokens = np.cumsum([int(lengths[s]) for s in micro_batch])
    total = int(tokens[-1])
    cut = 1 + int(np.argmin(np.abs(2 * tokens[:-1] - total)))
    return micro_batch[:cut], micro_batch[cut:]


class _BucketPacking:
    """The micro-batches of every bucket, with a cheap 'split the largest one' operation.

    A micro-batch is keyed by a tuple that sorts in packing order; a split replaces key `k`
    by `k + (0,)` and `k + (1,)`, which sort in its place.
    """

    def __init__(self, packed: dict[int, list[MicroBatch]], lengths: np.ndarray):
        self.lengths = lengths
        self.by_bucket: dict[int, dict[tuple, MicroBatch]] = {}
        self.splittable: dict[int, list] = {}  # bucket -> heap of (-tokens, key)
        for bucket, micro_batches in packed.items():
            self.by_bucket[bucket] = {}
            self.splittable[bucket] = []
            for position, micro_batch in enumerate(micro_batches):
                self._add(bucket, (position,), micro_batch)
        self.num_splits = 0

    def _add(self, bucket: int, key: tuple, micro_batch: MicroBatch) -> None:
        self.by_bucket[bucket][key] = micro_batch
        if len(micro_batch) >= 2:
            tokens = int(sum(int(self.lengths[s]) for s in micro_batch))
            heapq.heappush(self.splittable[bucket], (-tokens, key))

    def count(self, bucket: int | None = None) -> int:
        if bucket is None:
            return sum(len(m) for m in self.by_bucket.values())
        return len(self.by_bucket[bucket])

    def split_largest(self, buckets: Sequence[int]) -> bool:
        """Split the largest splittable micro-batch of `buckets`; False if there is none."""
        tops = [(self.splittable[b][0], b) for b in buckets if self.splittable[b]]
        if not tops:
            return False
        (_, key), bucket = min(tops)
        heapq.heappop(self.splittable[bucket])
        first, second = split_in_two(self.by_bucket[bucket].pop(key), self.lengths)
        self._add(bucket, key + (0,), first)
        self._add(bucket, key + (1,), second)
        self.num_splits += 1
        return True

    def ordered(self, bucket: int) -> list[MicroBatch]:
        return [self.by_bucket[bucket][key] for key in sorted(self.by_bucket[bucket])]


def _ensure_mixable(packing: _BucketPacking, step_size: int) -> None:
    """Split micro-batches of the other buckets until no bucket fills a whole step by necessity.

    Every step can hold >= 2 buckets iff, for every bucket b, the micro-batches not in b are at
    least as many as the steps (`ceil(M / step_size)`): each mixed step holds one of them.
    """
    buckets = sorted(packing.by_bucket)
    if len(buckets) < 2:
        return
    while True:
        total = packing.count()
        num_steps = math.ceil(total / step_size)
        short = [b for b in buckets if total - packing.count(b) < num_steps]
        if not short:
            return
        dominant = short[0]
        others = [b for b in buckets if b != dominant]
        if not packing.split_largest(others):
            raise ValueError(
                f"cannot mix buckets in every optimizer step: bucket {dominant} holds "
                f"{packing.count(dominant)} of {total} micro-batches and the other buckets cannot be "
                f"split further ({num_steps} steps of {step_size}); raise accum_steps, or use bucket "
                "edges that spread the data more evenly"
            )


def _fix_count(packing: _BucketPacking, step_size: int, num_samples: int) -> None:
    """Split the largest micro-batches until the count is a positive multiple of step_size.

    Reaching the next multiple keeps the number of steps, so mixability is preserved.
    """
    target = max(step_size, round_up(packing.count(), step_size))
    if target > num_samples:
        raise ValueError(
            f"{num_samples} samples cannot fill {target // step_size} optimizer step(s) of "
            f"world_size*accum_steps={step_size} micro-batches (each needs >= 1 sample); use fewer "
            "ranks or accumulation steps, or more data"
        )
    buckets = sorted(packing.by_bucket)
    while packing.count() < target:
        if not packing.split_largest(buckets):
            raise AssertionError("unreachable: fewer splittable micro-batches than samples allow")


def _no_repeat_still_possible(remaining: dict[int, int], last: int) -> bool:
    """Can `remaining` be ordered with no equal neighbours, the first differing from `last`?"""
    total = sum(remaining.values())
    return all(
        count <= (total - count) + (0 if bucket == last else 1) for bucket, count in remaining.items()
    )


def interleave_buckets(counts: dict[int, int]) -> list[int]:
    """The bucket of each slot of the global micro-batch sequence.

    Each bucket's k-th micro-batch is due at virtual time `(k + 0.5) / count` (even spread,
    proportional to counts; the most overdue bucket goes next). Among buckets that keep a
    no-equal-neighbours ordering possible, the most overdue one other than the previous slot's
    bucket is taken; when one bucket holds too many micro-batches for that, repeats are
    unavoidable and the plain due order spreads them.
    """
    remaining = {b: c for b, c in counts.items() if c > 0}
    drawn = dict.fromkeys(remaining, 0)
    order: list[int] = []
    previous = None
    for _ in range(sum(remaining.values())):
        candidates = [b for b, c in remaining.items() if c > 0]
        avoiding_repeat = [
            b for b in candidates
            if b != previous and _no_repeat_still_possible({**remaining, b: remaining[b] - 1}, b)
        ]
        pool = avoiding_repeat or candidates
        bucket = min(pool, key=lambda b: ((drawn[b] + 0.5) / counts[b], b))
        order.append(bucket)
        remaining[bucket] -= 1
        drawn[bucket] += 1
        previous = bucket
    return order


def _find_donor(slots: list[int], buckets_of: list[int], step: int, step_size: int) -> tuple[int, int] | None:
    """Nearest slot (of another step) whose bucket differs from `step`'s single bucket and
    whose step stays mixed after receiving one micro-batch of that bucket; returns
    (donor slot, receiving slot inside `step`)."""
    num_steps = len(slots) // step_size
    bucket = buckets_of[slots[step * step_size]]
    for distance in range(1, num_steps):
        for other in (step + distance, step - distance):
            if not 0 <= other < num_steps:
                continue
            members = slots[other * step_size:(other + 1) * step_size]
            for j, slot in enumerate(members):
                rest = members[:j] + members[j + 1:]
                if buckets_of[slot] != bucket and any(buckets_of[s] != bucket for s in rest):
                    edge = (step + 1) * step_size - 1 if other > step else step * step_size
                    return other * step_size + j, edge
    return None


def _mix_every_step(slots: list[int], buckets_of: list[int], step_size: int) -> None:
    """Swap micro-batches in place so that no step holds a single bucket (when >= 2 exist)."""
    if len(set(buckets_of)) < 2:
        return
    for step in range(len(slots) // step_size):
        members = slots[step * step_size:(step + 1) * step_size]
        if len({buckets_of[s] for s in members}) > 1:
            continue
        found = _find_donor(slots, buckets_of, step, step_size)
        if found is None:  # _ensure_mixable guarantees a donor (pigeonhole)
            raise AssertionError(f"no micro-batch to mix into optimizer step {step}")
        donor, receiver = found
        slots[donor], slots[receiver] = slots[receiver], slots[donor]


def _assign_ranks(tokens: np.ndarray, step_slots: list[int], world_size: int) -> list[list[int]]:
    """Give each rank len(step_slots)/world_size micro-batches: largest first, snake order."""
    by_size = sorted(step_slots, key=lambda s: (-int(tokens[s]), s))
    per_rank: list[list[int]] = [[] for _ in range(world_size)]
    for j, slot in enumerate(by_size):
        round_index, offset = divmod(j, world_size)
        rank = offset if round_index % 2 == 0 else world_size - 1 - offset
        per_rank[rank].append(slot)
    return [sorted(slots) for slots in per_rank]


@dataclasses.dataclass
class EpochSchedule:
    """One epoch's micro-batches in global order and their split over steps and ranks.

    `micro_batches[m]` is a tuple of sample indices, all of bucket `micro_batch_buckets[m]`;
    `rank_plan[step, rank, k]` is the micro-batch id that `rank` runs as accumulation
    micro-step `k` of optimizer `step`.
    """

    epoch: int
    world_size: int
    accum_steps: int
    micro_batches: list[MicroBatch]
    micro_batch_buckets: np.ndarray  # (M,) int64
    micro_batch_tokens: np.ndarray  # (M,) int64
    rank_plan: np.ndarray  # (num_steps, world_size, accum_steps) int64
    num_splits: int  # micro-batches split to make steps mixable and the count divisible

    @property
    def num_steps(self) -> int:
        return int(self.rank_plan.shape[0])

    def step(self, step_index: int) -> list[list[MicroBatch]]:
        """The micro-batches of one optimizer step, one list of accum_steps per rank."""
        if not 0 <= step_index < self.num_steps:
            raise IndexError(f"step {step_index} out of range: epoch {self.epoch} has {self.num_steps} steps")
        return [[self.micro_batches[m] for m in rank_slots] for rank_slots in self.rank_plan[step_index].tolist()]

    def rank_batches(self, rank: int, start_step: int = 0) -> Iterator[tuple[int, int, MicroBatch]]:
        """Yield `(step, micro_step, sample_indices)` for `rank` from `start_step` on;
        `micro_step` is the accumulation index 0..accum_steps-1 inside the step."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range for world_size {self.world_size}")
        if not 0 <= start_step <= self.num_steps:
            raise ValueError(f"start_step {start_step} out of range: epoch {self.epoch} has {self.num_steps} steps")
        for step in range(start_step, self.num_steps):
            for micro_step, m in enumerate(self.rank_plan[step, rank].tolist()):
                yield step, micro_step, self.micro_batches[m]


def _validate_schedule_args(lengths, buckets, token_budget, world_size, accum_steps, sample_indices):
    if lengths.shape != buckets.shape or lengths.ndim != 1:
        raise ValueError(f"lengths {lengths.shape} and buckets {buckets.shape} must be equal 1-d shapes")
    if token_budget < 1 or world_size < 1 or accum_steps < 1:
        raise ValueError(
            f"need token_budget, world_size, accum_steps >= 1, got {token_budget}, {world_size}, {accum_steps}"
        )
    if sample_indices.size == 0:
        raise ValueError("the schedule has no samples")
    bad = sample_indices[lengths[sample_indices] < 1]
    if bad.size:
        raise ValueError(f"sample {int(bad[0])} has length {int(lengths[bad[0]])}; lengths must be >= 1")
    if np.unique(buckets[sample_indices]).size >= 2 and world_size * accum_steps < 2:
        raise ValueError(
            "world_size * accum_steps is 1 but the data has several length buckets: a micro-batch "
            "holds one bucket, so an optimizer step could never mix sequence lengths; set "
            "accum_steps >= 2"
        )


def build_epoch_schedule(
    lengths: np.ndarray,
    buckets: np.ndarray,
    token_budget: int,
    world_size: int,
    accum_steps: int,
    seed: int,
    epoch: int,
    sample_indices: np.ndarray | None = None,
    anchors: np.ndarray | None = None,
    anchor_budget: int = 0,
    stream: tuple[int, ...] = (),
) -> EpochSchedule:
    """The schedule of `epoch` over `sample_indices` (default: all samples).

    `lengths[i]`, `buckets[i]` are sample i's token count and bucket (the store index);
    `anchors[i]`, when given, its anchor count, packed under `anchor_budget` per micro-batch.
    `stream` extends the shuffle's rng key (a following run's segment). Deterministic in all
    arguments; every entry of `sample_indices` appears exactly once (a sample a mix repeats,
    dflash/train/mix.py, is several entries).
    """
    lengths, buckets = np.asarray(lengths, dtype=np.int64), np.asarray(buckets, dtype=np.int64)
    if sample_indices is None:
        sample_indices = np.arange(lengths.shape[0], dtype=np.int64)
    sample_indices = np.asarray(sample_indices, dtype=np.int64)
    _validate_schedule_args(lengths, buckets, token_budget, world_size, accum_steps, sample_indices)
    step_size = world_size * accum_steps

    packed = {}
    for bucket in np.unique(buckets[sample_indices]).tolist():
        members = sample_indices[buckets[sample_indices] == bucket]
        rng = np.random.default_rng([seed, epoch, bucket, *stream])
        packed[bucket] = pack_bucket(rng.permutation(members), lengths, token_budget, anchors, anchor_budget)
    packing = _BucketPacking(packed, lengths)
    _ensure_mixable(packing, step_size)
    _fix_count(packing, step_size, int(sample_indices.size))

    per_bucket = {b: packing.ordered(b) for b in sorted(packing.by_bucket)}
    order = interleave_buckets({b: len(m) for b, m in per_bucket.items()})
    cursors = dict.fromkeys(per_bucket, 0)
    micro_batches, mb_buckets = [], []
    for bucket in order:
        micro_batches.append(per_bucket[bucket][cursors[bucket]])
        mb_buckets.append(bucket)
        cursors[bucket] += 1

    slots = list(range(len(micro_batches)))
    _mix_every_step(slots, mb_buckets, step_size)
    micro_batches = [micro_batches[s] for s in slots]
    mb_buckets_M = np.array([mb_buckets[s] for s in slots], dtype=np.int64)
    tokens_M = np.array([int(lengths[list(mb)].sum()) for mb in micro_batches], dtype=np.int64)
    num_steps = len(micro_batches) // step_size
    rank_plan = np.array(
        [_assign_ranks(tokens_M, list(range(s * step_size, (s + 1) * step_size)), world_size) for s in range(num_steps)],
        dtype=np.int64,
    ).reshape(num_steps, world_size, accum_steps)
    return EpochSchedule(epoch, world_size, accum_steps, micro_batches, mb_buckets_M, tokens_M, rank_plan, packing.num_splits)


def anchor_counts(config, reader) -> np.ndarray:
    """Per-sample anchors, at most max_anchors (an upper bound: one more than the eligible count
    when the first token is supervised); read from the store index, no sample is read."""
    return np.minimum(reader.index["num_supervised"], config.train.max_anchors)


def schedule_for(config, reader, sample_indices, epoch: int, world_size: int, accum_steps: int,
                 stream: tuple[int, ...] = ()) -> EpochSchedule:
    """The schedule of `epoch` over these samples of the store: the config's token and anchor
    budgets and seed, steps of `world_size` x `accum_steps` micro-batches."""
    return build_epoch_schedule(reader.index["length"], reader.index["bucket"], config.train.token_budget,
                                world_size, accum_steps, config.train.seed, epoch, sample_indices=sample_indices,
                                anchors=anchor_counts(config, reader), anchor_budget=config.train.anchor_budget,
                                stream=stream)


def held_out_micro_batches(config, reader, eval_indices: np.ndarray, rank: int, world_size: int) -> list[MicroBatch]:
    """This rank's share of the first eval_batches held-out micro-batches, fixed for the run."""
    if not eval_indices.size:
        return []
    try:
        # world 1, accum 2: only the packing and order matter here (eval never steps).
        micro_batches = schedule_for(config, reader, eval_indices, 0, world_size=1, accum_steps=2).micro_batches
    except ValueError:
        # Too few held-out samples for mixed steps (one sample, or all in one bucket but one): pack them plainly.
        buckets = reader.index["bucket"][eval_indices]
        anchors = anchor_counts(config, reader)
        micro_batches = [micro_batch for bucket in np.unique(buckets)
                         for micro_batch in pack_bucket(eval_indices[buckets == bucket], reader.index["length"],
                                                        config.train.token_budget, anchors,
                                                        config.train.anchor_budget)]
    return micro_batches[rank::world_size][:config.train.eval_batches]
