"""Stage two on a store that stage one is still writing (`train.follow`, `stage2-train --follow`).

Stage one commits shards one at a time, buckets interleaved (`dflash.store.plan.write_order`), and
its plan (root attribute `shards`) names every shard to come. A following run:

- indexes the shards complete at its start and, at fixed points (every `train.follow_every`
  steps and at the end of each segment), appends the shards completed since; sample indices
  never change, new samples get new ones;
- schedules the first epoch in segments: a segment is one `build_epoch_schedule` over the
  samples not trained yet, i.e. the untrained rest of the current segment plus the new shards'
  samples (rng stream: the segment's number). Every sample is trained once in the first epoch,
  and a segment is only planned when its steps can mix lengths (two buckets at least, when the
  plan has two); until then the run waits, shown in the progress bar and counted as data wait.
  A segment's last step is kept back until the next segment is planned and joins its samples,
  so the last segment can mix lengths even when the last shards are all of one length;
- once every planned shard is scheduled, the later epochs are ordinary epochs over the whole
  store, and the step count (the LR horizon) is exact; before that it is estimated from the
  plan's tokens and the first segment's tokens per step;
- holds out samples per shard (rng keyed by the shard's name), so the held-out set only grows;
- records the arrival order and each segment (its new shards, and after how many steps of the
  previous segment it began) in every checkpoint: `--resume` replays them and continues with
  the same schedule.

Under DDP rank 0 looks at the store and every rank follows what it found (one broadcast per
look), so all ranks plan the same segments.
"""

from __future__ import annotations

import math
import time
import zlib
from dataclasses import dataclass

import numpy as np

from dflash.dist import DistState, broadcast_object
from dflash.store.reader import StoreReader, open_existing
from dflash.store.schema import frozen_weights_complete
from dflash.train.sampler import EpochSchedule, schedule_for

_FOLLOW_HOLDOUT_STREAM = 0x464F4C4C  # "FOLL": the per-shard hold-out rng, apart from every other stream


class FollowTimeout(RuntimeError):
    """No shard completed for train.follow_timeout_s seconds."""


class FollowStopped(Exception):
    """SIGTERM while waiting for shards: the run saves and stops where it is."""


@dataclass
class Segment:
    shards: tuple[str, ...]  # the shards first scheduled here
    after_steps: int  # steps of the previous segment trained when this one took over its rest
    start_step: int  # the run's optimizer step this segment starts at
    schedule: EpochSchedule | None  # None: too few samples left for one optimizer step (reported)


class StoreFollower:
    """The first epoch's segments over a growing store, then the later epochs over all of it."""

    def __init__(self, config, reader: StoreReader, dist: DistState, recorded: dict | None = None,
                 report=print):
        self.config, self.reader, self.dist, self.report = config, reader, dist, report
        self.plan_buckets = {int(entry["bucket"]) for entry in reader.attrs.get("shards", [])}
        self.planned_tokens = sum(int(entry["num_tokens"]) for entry in reader.attrs.get("shards", []))
        self.segments: list[Segment] = []
        self.scheduled: set[str] = set()
        self.later: dict[int, EpochSchedule] = {}
        self.horizon = 0
        self.exact = False
        self.finished = reader.finished
        self._held_out: dict[str, np.ndarray] = {}
        for entry in (recorded or {}).get("segments", []):
            self._push(self._plan(tuple(entry["shards"]), int(entry["after_steps"]), int(entry["start_step"]),
                                  final=bool(entry.get("final"))))
        if recorded:
            self.horizon, self.exact = int(recorded["horizon"]), bool(recorded["exact"])
            if self.exact:
                self._build_later_epochs()

    # -- samples
    def held_out(self) -> np.ndarray:
        """Per sample of the index: held out? Drawn per shard, so earlier samples never change."""
        fraction, seed = self.config.train.holdout_fraction, self.config.train.seed
        counts = np.bincount(self.reader.sample_shard, minlength=len(self.reader.shard_names))
        parts = []
        for name, count in zip(self.reader.shard_names, counts.tolist()):
            if name not in self._held_out:
                rng = np.random.default_rng([seed, _FOLLOW_HOLDOUT_STREAM, zlib.crc32(name.encode())])
                self._held_out[name] = rng.random(count) < fraction
            parts.append(self._held_out[name])
        return np.concatenate(parts) if parts else np.zeros(0, dtype=bool)

    def _samples_of(self, shards, held_out: bool) -> np.ndarray:
        position = {name: i for i, name in enumerate(self.reader.shard_names)}
        ids = [position[name] for name in shards]
        chosen = np.isin(self.reader.sample_shard, ids) & (self.held_out() == held_out)
        return np.flatnonzero(chosen).astype(np.int64)

    def train_indices(self) -> np.ndarray:
        """The training samples of every scheduled shard."""
        return self._samples_of(sorted(self.scheduled), held_out=False)

    def eval_indices(self) -> np.ndarray:
        """The held-out samples of every scheduled shard (the set grows with the store)."""
        return self._samples_of(sorted(self.scheduled), held_out=True)

    # -- segments
    def schedule(self, segment: int) -> EpochSchedule:
        return self.segments[segment].schedule

    def _untrained(self, after_steps: int) -> np.ndarray:
        if not self.segments or self.segments[-1].schedule is None:
            return np.zeros(0, dtype=np.int64)
        schedule = self.segments[-1].schedule
        rest = schedule.rank_plan[after_steps:].reshape(-1)
        return np.array([i for m in rest.tolist() for i in schedule.micro_batches[m]], dtype=np.int64)

    def _plan(self, shards: tuple[str, ...], after_steps: int, start_step: int, final: bool) -> Segment | None:
        """The segment that takes over after `after_steps` steps of the current one and adds
        `shards`; None while its steps could not mix lengths (unless `final`: all has arrived)."""
        index, untrained = self.reader.index, self._untrained(after_steps)
        pool = np.sort(np.concatenate([untrained, self._samples_of(shards, held_out=False)]))
        if pool.size == 0:
            return Segment(shards, after_steps, start_step, None) if final else None
        mixed = np.unique(index["bucket"][pool]).size >= 2 or len(self.plan_buckets) < 2
        if not mixed and not final:
            return None
        try:
            schedule = self._schedule(pool, 0, stream=(len(self.segments) + 1,))
        except ValueError as error:
            if not final or untrained.size:
                return None  # at the end of the current segment, its rest is trained and these go alone
            self.report(f"follow: {pool.size} samples left at the end of the first epoch cannot form its last "
                        f"optimizer steps ({error}); they train from the second epoch on")
            return Segment(shards, after_steps, start_step, None)
        if not mixed:
            self.report(f"follow: the last {schedule.num_steps} steps of the first epoch hold one sequence length "
                        f"(the last shards stage one wrote are of one bucket)")
        return Segment(shards, after_steps, start_step, schedule)

    def _push(self, segment: Segment) -> None:
        self.segments.append(segment)
        self.scheduled.update(segment.shards)
        if self.horizon == 0 and segment.schedule is not None:
            self.horizon = self._estimated_horizon(segment.schedule)

    def _estimated_horizon(self, schedule: EpochSchedule) -> int:
        """Steps in all until exact: train.max_steps when set, else estimated from the plan's
        tokens and this segment's tokens per step."""
        if self.config.train.max_steps > 0:
            return self.config.train.max_steps
        tokens_per_step = float(schedule.micro_batch_tokens.sum()) / max(schedule.num_steps, 1)
        train_tokens = self.planned_tokens * (1.0 - self.config.train.holdout_fraction)
        return self.config.train.epochs * max(1, math.ceil(train_tokens / max(tokens_per_step, 1.0)))

    def _finalize(self) -> None:
        """Every planned shard is scheduled: build the later epochs and make the horizon exact."""
        self._build_later_epochs()
        last = self.segments[-1]
        first_epoch = last.start_step + (last.schedule.num_steps if last.schedule is not None else 0)
        steps = first_epoch + sum(schedule.num_steps for schedule in self.later.values())
        self.horizon = min(steps, self.config.train.max_steps) if self.config.train.max_steps > 0 else steps
        self.exact = True

    def _build_later_epochs(self) -> None:
        train_indices = self.train_indices()
        self.later = {epoch: self._schedule(train_indices, epoch) for epoch in range(1, self.config.train.epochs)}

    def _schedule(self, samples: np.ndarray, epoch: int, stream: tuple[int, ...] = ()) -> EpochSchedule:
        return schedule_for(self.config, self.reader, samples, epoch, self.dist.world_size,
                            self.config.train.accum_steps, stream)

    # -- the store
    def look(self, deadline: float | None = None, stopping=None) -> tuple[bool, bool]:
        """Append the shards completed since the last look (rank 0 looks, every rank follows).
        Returns (timed out: past `deadline` on rank 0's clock with none arrived, rank 0 asked to stop)."""
        if self.dist.is_main:
            found = (self.reader.refresh(), self.reader.finished, deadline is not None and time.monotonic() > deadline,
                     bool(stopping and stopping()))
        else:
            found = None
        names, finished, timed_out, stop = broadcast_object(self.dist, found)
        if not self.dist.is_main and names:
            self.reader.refresh(names)
        self.finished = finished
        return timed_out and not names and not finished, stop

    def pending(self) -> tuple[str, ...]:
        return tuple(name for name in self.reader.shard_names if name not in self.scheduled)

    @property
    def reserve_steps(self) -> int:
        """Steps of the current segment kept back while shards are still to come: its last step
        (which mixes lengths) joins the next segment's samples, so that segment can mix them too,
        also when the shards that arrive last are all of one length. 0 once the last segment
        is planned."""
        return 0 if self.exact else 1

    def at_fixed_point(self, steps_done: int, step: int, deadline: float | None = None,
                       stopping=None) -> Segment | None:
        """Look at the store; the new segment that replaces the current one's rest when new
        shards arrived and their steps can mix lengths, else None (the current one goes on)."""
        timed_out, stop = self.look(deadline, stopping)
        if stop:
            raise FollowStopped()
        pending = self.pending()
        final = self.finished
        segment = self._plan(pending, steps_done, step, final) if pending else None
        if segment is not None:
            self._push(segment)
            if final:
                self._finalize()
        elif timed_out:
            raise FollowTimeout(
                f"follow: no shard of {self.reader.path} completed in the last {self.config.train.follow_timeout_s:.0f} s "
                f"({len(self.reader.shard_names)} of {len(self.reader.planned_shards)} planned shards complete); is "
                f"stage one still running? `dflash inspect-cache {self.reader.path}` shows the store. Rerun stage one "
                f"with the same config to finish it, then continue this run with --resume")
        return segment

    def next_segment(self, steps_done: int, step: int, status, stopping=None) -> Segment | None:
        """At the end of the current segment (or before the first): wait until the next one can
        be planned; None when the first epoch is complete. `status(text)` shows the wait; no
        shard for train.follow_timeout_s seconds raises FollowTimeout, `stopping()` true on
        rank 0 (SIGTERM) FollowStopped."""
        arrived = len(self.reader.shard_names)
        deadline = time.monotonic() + self.config.train.follow_timeout_s
        while True:
            if self.finished and not self.pending():
                if not self.exact and self.segments:
                    self._finalize()
                return None
            segment = self.at_fixed_point(steps_done, step, deadline, stopping)
            if segment is not None:
                status("")
                return segment
            if len(self.reader.shard_names) > arrived:  # shards came, but not yet enough to mix lengths
                arrived = len(self.reader.shard_names)
                deadline = time.monotonic() + self.config.train.follow_timeout_s
            if self.finished and not self.pending():
                continue
            status(f"waiting for stage one: {len(self.reader.shard_names)} of {len(self.reader.planned_shards)} "
                   f"shards complete")
            time.sleep(self.config.train.follow_poll_s)

    def to_dict(self) -> dict:
        return {"arrival": list(self.reader.shard_names), "horizon": int(self.horizon), "exact": bool(self.exact),
                "segments": [{"shards": list(s.shards), "after_steps": s.after_steps, "start_step": s.start_step,
                              "final": s is self.segments[-1] and self.exact} for s in self.segments]}


def wait_for_store(config, dist: DistState, status) -> None:
    """Return once stage one has written the store's attributes and the target's frozen weights
    (what a following run needs before its first shard), waiting as long as train.follow_timeout_s
    allows; `status(text)` says what it waits for."""
    path, start = config.store.path, time.monotonic()
    while True:
        ready = None
        if dist.is_main:
            try:
                ready = frozen_weights_complete(open_existing(path))
            except (FileNotFoundError, KeyError, ValueError):
                ready = False
            ready = (ready, time.monotonic() - start > config.train.follow_timeout_s)
        ready, timed_out = broadcast_object(dist, ready)
        if ready:
            return
        if timed_out:
            raise FollowTimeout(f"follow: {path} has no stage-one store with the target's weights after "
                                f"{config.train.follow_timeout_s:.0f} s; start `dflash stage1-extract` with the same store.path")
        status(f"waiting for stage one to create {path} and write the target's weights")
        time.sleep(config.train.follow_poll_s)
