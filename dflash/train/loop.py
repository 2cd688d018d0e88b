"""A stage-two run: its state and the loop over optimizer steps around dflash/train/step.py's
`train_step`, with metrics windows (dflash/train/metrics.py), held-out evaluation, and checkpoints
(dflash/train/resume.py; every `train.save_every` steps, at the end, on SIGTERM and before stopping
on an unreadable sample). Only logging steps move numbers to the host, in one transfer.
`stages/train.py` builds the parts and calls `loop`.
"""

import functools
import os
import signal
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from dflash.config import Config, ConfigError, replace
from dflash.dist import DistState, broadcast_object
from dflash.store.reader import StoreReader
from dflash.store.schema import CorruptShardError
from dflash.train import served
from dflash.train.batch import StoreDataset, collate_options, collate_packed, epoch_loader
from dflash.train.compile_cache import CompileProgress, artifacts_path, kernels_file, save_compile_artifacts
from dflash.train.follow import FollowStopped, FollowTimeout, StoreFollower
from dflash.train.metrics import MetricsLogger, StepStats
from dflash.train.resume import save_run
from dflash.train.sampler import DataCursor, held_out_micro_batches
from dflash.train.step import TrainContext, evaluate, evaluate_served, learning_rate, to_device, train_step


@dataclass
class TrainResult:
    run_dir: str
    steps: int = 0
    losses: list[float] = field(default_factory=list)  # every optimizer step's loss
    last_metrics: dict = field(default_factory=dict)
    eval_metrics: dict = field(default_factory=dict)
    checkpoint: str | None = None
    tokens_seen: int = 0  # context tokens trained on, rank 0's count times the ranks (as tokens_per_s)
    skipped_samples: int = 0  # unreadable samples skipped on this rank (train.skip_corrupt_shards)
    out_of_time: bool = False  # stopped by train.max_minutes before the last step


@dataclass
class TrainState:
    """One run: what the loop reads (config, model and its wrapper, optimizer, context, store,
    schedules, logger) and what it advances (data cursor, step, result)."""

    config: Config
    dist: DistState
    model: torch.nn.Module  # the drafter itself: its state is what a checkpoint holds
    wrapped: torch.nn.Module  # the same under DDP / compile: what steps run
    optimizer: torch.optim.Optimizer
    ctx: TrainContext
    reader: StoreReader
    eval_indices: np.ndarray
    schedules: list  # one per epoch (empty when following: the follower holds them)
    total_steps: int
    logger: MetricsLogger
    result: TrainResult
    stop: "StopFlag"
    cursor: DataCursor
    step: int
    first_step: int  # the step this process started (or resumed) at
    follower: StoreFollower | None = None  # train.follow: the store is still being written


def current_schedule(state: TrainState):
    """The schedule the data cursor points into (None: a following run's empty last segment)."""
    cursor = state.cursor
    if state.follower is None:
        return state.schedules[cursor.epoch]
    return state.follower.schedule(cursor.segment) if cursor.epoch == 0 else state.follower.later[cursor.epoch]


def keep_going(state: TrainState) -> bool:
    """Steps remain: before the horizon, or (following, without train.max_steps) while the
    first epoch's length is still an estimate."""
    if state.stop.requested or state.result.out_of_time:
        return False
    if state.step < state.total_steps:
        return True
    follower = state.follower
    return follower is not None and not follower.exact and state.config.train.max_steps <= 0


def follow_point(state: TrainState, schedule, bar, timer, window) -> bool:
    """A following run's fixed point (every train.follow_every steps and at each segment's end):
    take up new shards; at a segment's end (its reserve step left) wait for the next one. True
    when the cursor moved (the step count and held-out set may have grown)."""
    follower, cursor = state.follower, state.cursor
    try:
        if schedule.num_steps - cursor.step > follower.reserve_steps:
            segment = follower.at_fixed_point(cursor.step, state.step)
        else:
            start = time.perf_counter()
            try:
                segment = follower.next_segment(cursor.step, state.step, bar.set_postfix_str,
                                                stopping=lambda: state.stop.requested)
            except FollowStopped:
                state.stop.requested = True  # every rank: rank 0's flag decided
                return False
            finally:
                timer["wait"] += time.perf_counter() - start
    except FollowTimeout as error:
        raise follow_stop(error, state, window) from None
    if segment is None and cursor.step < schedule.num_steps:
        return False
    state.cursor = DataCursor(epoch=1, step=0) if segment is None else DataCursor(0, 0, len(follower.segments) - 1)
    state.total_steps = follower.horizon
    state.eval_indices = follower.eval_indices()
    bar.total = max(state.total_steps, state.step)
    bar.refresh()
    return True


class StopFlag:
    """SIGTERM asks for a final checkpoint at the next step boundary."""

    def __init__(self):
        self.requested = False
        self.previous = signal.signal(signal.SIGTERM, self.handle)

    def handle(self, signum, frame) -> None:
        self.requested = True

    def restore(self) -> None:
        signal.signal(signal.SIGTERM, self.previous)


def loop(state: TrainState) -> None:
    config, dist, ctx, result, stop = state.config, state.dist, state.ctx, state.result, state.stop
    reader = state.reader
    dataset = StoreDataset(reader, config.train.max_anchors, config.train.seed, config.train.skip_corrupt_shards)
    # With flex attention the loader's workers lay out each micro-batch's block-mask tiles (dflash.model.tiles).
    loader_options = collate_options(ctx.backend, ctx.args, config.train.gather_context_keys)
    collate = functools.partial(collate_packed, **loader_options)
    eval_micro_batches = {}  # by held-out set size: a following run's set only grows
    served_micro_batches = {}  # the same, for train.eval_served_tokens
    bar = tqdm(total=state.total_steps, initial=state.step, unit="step", disable=not dist.is_main, dynamic_ncols=True,
               desc="train")
    window = StepStats(ctx.args.block_size, ctx.device)
    timer = {"start": time.perf_counter(), "wait": 0.0}
    losses = []  # every step's loss, on the device until the end
    started = time.perf_counter()  # train.max_minutes counts from here
    tokens_before = result.tokens_seen  # a resumed run's earlier tokens: not this process's rate
    notice = first_step_notice(ctx, dist)
    if notice:
        bar.set_postfix_str(notice)
    while keep_going(state):
        schedule = current_schedule(state)
        if schedule is None:  # a following run's last segment had too few samples for a step (reported)
            state.cursor = DataCursor(epoch=state.cursor.epoch + 1, step=0)
            continue
        if (state.follower is not None and state.cursor.epoch == 0
                and schedule.num_steps - state.cursor.step <= state.follower.reserve_steps
                and follow_point(state, schedule, bar, timer, window)):
            continue  # a new segment no longer than its reserve: more shards were awaited before training it
        if schedule.num_steps == 0:
            raise ConfigError(f"epoch {state.cursor.epoch} has no optimizer step: too few samples for "
                              f"train.accum_steps x world size micro-batches")
        iterator = iter(epoch_loader(dataset, schedule, dist.rank, state.cursor.step, **loader_options,
                                     num_workers=config.train.num_workers, pin_memory=dist.device.type == "cuda",
                                     fuse=config.train.fuse_accum))
        per_step = 1 if config.train.fuse_accum else config.train.accum_steps  # loaded micro-batches a step
        for step_in_epoch in range(state.cursor.step, schedule.num_steps):
            if not keep_going(state):
                break
            wait_start = time.perf_counter()
            try:
                micro_batches = [to_device(next(iterator), ctx.device) for _ in range(per_step)]
            except CorruptShardError as error:
                raise corrupt_stop(error, state, window) from None
            count_skipped(micro_batches, result, bar)
            timer["wait"] += time.perf_counter() - wait_start
            lr = learning_rate(config, state.step, state.total_steps)
            with CompileProgress(bar.set_postfix_str) if notice and state.step == state.first_step else nullcontext():
                stats = train_step(state.wrapped, ctx, micro_batches, state.optimizer, lr, config.train.clip,
                                   state.step + 1)
            window.merge(stats)
            result.tokens_seen += stats.host["real_tokens"] * dist.world_size
            state.step += 1
            step = state.step
            losses.append(stats.values[0] / stats.micro_batches)
            if notice and step == state.first_step + 1:
                bar.set_postfix_str("")
            if step == state.first_step + 2:  # the first steps' graphs are compiled: keep the kernels with the run
                keep_compile_artifacts(state, bar.write)
            bar.update(1)
            moved = advance_cursor(state, schedule, step_in_epoch, bar, timer, window)
            if step % config.train.log_every == 0 or step == state.total_steps:
                log_window(config, dist, window, lr, timer, state.logger, step, bar, result)
                window = StepStats(ctx.args.block_size, ctx.device)
                result.out_of_time = out_of_time(state, started)
            if state.eval_indices.size and (step % config.train.eval_every == 0 or step == state.total_steps
                                            or result.out_of_time):
                if state.eval_indices.size not in eval_micro_batches:
                    eval_micro_batches[state.eval_indices.size] = held_out_micro_batches(
                        config, reader, state.eval_indices, dist.rank, dist.world_size)
                try:
                    result.eval_metrics = evaluate(dist, state.wrapped, ctx, dataset, collate,
                                                   eval_micro_batches[state.eval_indices.size])
                    if config.train.eval_served_tokens:
                        result.eval_metrics.update(evaluate_served_held_out(state, collate, served_micro_batches))
                except CorruptShardError as error:
                    raise corrupt_stop(error, state, window) from None
                state.logger.log(step, {f"eval/{k}": v for k, v in result.eval_metrics.items()})
            if step % config.train.save_every == 0 and step < state.total_steps:
                save(state, window)
            if moved:
                break
    bar.close()
    step = state.step
    result.checkpoint = str(save(state, window))
    result.steps = step
    result.losses = torch.stack(losses).tolist() if losses else []  # sync: end of run
    if stop.requested and dist.is_main:
        print(f"SIGTERM: saved checkpoint {result.checkpoint} at step {step}; resume with --resume")
    elif result.out_of_time and dist.is_main:
        print(f"train.max_minutes ({config.train.max_minutes:g}) reached: stopped at step {step} of "
              f"{state.total_steps}; checkpoint {result.checkpoint}\n"
              f"  export it for serving: dflash export {result.checkpoint} EXPORT_DIR")
    elif dist.is_main:
        skipped = f", {result.skipped_samples} unreadable samples skipped" if result.skipped_samples else ""
        print(f"done: {run_summary(result, step, step - state.first_step, tokens_before, started)}{skipped}; "
              f"checkpoint {result.checkpoint}\n"
              f"  export it for serving: dflash export {result.checkpoint} EXPORT_DIR")


def run_summary(result: TrainResult, steps: int, steps_here: int, tokens_before: int, started: float) -> str:
    """The steps, the wall time of this process's loop (from its first step's start: setup before it left out),
    its context tokens and their rate (a resumed run's earlier steps and tokens left out), and the last held-out
    numbers: what a finished run's last line says."""
    seconds = time.perf_counter() - started
    tokens = result.tokens_seen - tokens_before
    resumed = f" ({steps_here} in this run)" if steps_here != steps else ""
    rate = tokens / max(seconds, 1e-9)
    text = (f"{steps} steps{resumed} in {seconds / 60:.1f} min, {tokens:,} tokens at {rate:,.0f} tokens/s "
            f"(compiling and held-out passes included)")
    held_out = result.eval_metrics
    if held_out:
        served = f", served tau {held_out['served_tau']:.3f}" if "served_tau" in held_out else ""
        text += f"; held-out loss {held_out['loss']:.4f}, tau {held_out['tau']:.3f}{served}"
    return text


def out_of_time(state: TrainState, started: float) -> bool:
    """train.max_minutes has passed (rank 0's clock decides, so every rank stops at the same step)."""
    limit = state.config.train.max_minutes
    if limit <= 0 or state.step >= state.total_steps:
        return False
    return bool(broadcast_object(state.dist, time.perf_counter() - started >= limit * 60))


def advance_cursor(state: TrainState, schedule, step_in_epoch: int, bar, timer, window) -> bool:
    """The cursor after a step; True when it left this schedule (the next epoch, or a
    following run's next segment), so the loop starts a new loader."""
    cursor = state.cursor
    state.cursor = DataCursor(epoch=cursor.epoch, step=step_in_epoch + 1, segment=cursor.segment)
    follower = state.follower
    if follower is not None and cursor.epoch == 0:
        at_end = schedule.num_steps - state.cursor.step <= follower.reserve_steps
        if not at_end and state.step % state.config.train.follow_every:
            return False
        return follow_point(state, schedule, bar, timer, window)
    if state.cursor.step == schedule.num_steps:
        state.cursor = DataCursor(epoch=cursor.epoch + 1, step=0)
        return True
    return False


def keep_compile_artifacts(state: TrainState, say) -> None:
    """Each rank saves its compiled kernels beside the checkpoints, one file per device index
    (dflash/train/compile_cache.py); rank 0 says so."""
    device = state.dist.device
    if device.type != "cuda":
        return
    path = artifacts_path(state.config.train.out_dir, device.index or 0)
    written = save_compile_artifacts(path)
    if written and state.dist.is_main:
        kernels = kernels_file(path)
        beside = f" and dflash's Triton kernels in {kernels.name}" if kernels.is_file() else ""
        say(f"saved compile artifacts {path}{beside} ({written / 1e6:.1f} MB; every rank its own device's): later "
            "processes of this run start warm")


def follow_stop(error: FollowTimeout, state: TrainState, window: StepStats) -> FollowTimeout:
    """Stage one stopped writing: save the steps trained, then stop with what to do."""
    if state.step == state.first_step:
        return error
    saved = save(state, window)
    return FollowTimeout(f"{error}. Saved {saved} at step {state.step}")


def corrupt_stop(error, state: TrainState, window: StepStats) -> CorruptShardError:
    """The error to stop with when a sample cannot be read (and skipping is off): the steps trained
    since the start are saved first, so nothing is lost; the message says how to repair."""
    message = str(error).strip().splitlines()[-1]  # from a DataLoader worker: its traceback, then the error
    message = message.split("CorruptShardError: ", 1)[-1]
    if state.step > state.first_step:
        saved = save(state, window)
        message += f". Training stopped before step {state.step + 1}; saved {saved} (continue with --resume)"
    return CorruptShardError(message)


def count_skipped(micro_batches: list[dict], result: "TrainResult", bar) -> None:
    """Samples skipped as unreadable (train.skip_corrupt_shards) are counted and named once each."""
    for batch in micro_batches:
        for message in batch.get("skipped", ()):
            result.skipped_samples += 1
            bar.write(f"skipped: {message.split('. Repair:')[0]}")


def first_step_notice(ctx: TrainContext, dist: DistState) -> str:
    """What the progress bar says while the first step compiles (CUDA only): up to a minute on a cold
    compile cache, during which nothing else moves (under DDP the ranks wait for the slowest)."""
    if ctx.device.type != "cuda":
        return ""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir  # private; for the notice only
        cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()
    except ImportError:
        cache = "the inductor cache"
    ranks = f"; each of the {dist.world_size} ranks compiles for its own GPU" if dist.is_distributed else ""
    return f"first step: compiling kernels, up to a minute on a cold cache ({cache}){ranks}"


def log_window(config, dist, window: StepStats, lr, timer, logger, step, bar, result) -> None:
    metrics = window.summarize(dist, config.train.log_grad_norm)
    elapsed = time.perf_counter() - timer["start"]
    host = window.host
    metrics.update({
        "lr": lr,
        "tokens_per_s": host["real_tokens"] * dist.world_size / max(elapsed, 1e-9),
        # a small drafter's step costs by its block rows (anchors x block size) more than by its context tokens
        "anchor_slots_per_s": host["real_anchors"] * window.block_size * dist.world_size / max(elapsed, 1e-9),
        "anchors_per_token": host["real_anchors"] / max(host["real_tokens"], 1),
        "data_wait": timer["wait"] / max(elapsed, 1e-9),
        "avg_seq_len": host["len_sum"] / max(host["num_seqs"], 1),
        "max_seq_len": host["max_len"],
        "padding_efficiency": host["real_tokens"] / max(host["padded_tokens"], 1),
        "tokens_seen": result.tokens_seen,
        "skipped_samples": result.skipped_samples,
    })
    for bucket, count in sorted(window.buckets.items()):
        metrics[f"bucket{bucket}_micro_batches"] = count
    logger.log(step, metrics)
    bar.set_postfix(loss=f"{metrics['loss']:.3f}", tau=f"{metrics['tau']:.2f}")
    result.last_metrics = metrics
    timer.update(start=time.perf_counter(), wait=0.0)


def save(state: TrainState, window: StepStats) -> Path:
    """A checkpoint of the run, once no step of the unlogged window was non-finite."""
    window.check_finite(state.dist)
    follow_state = state.follower.to_dict() if state.follower is not None else None
    return save_run(state.config, state.dist, state.model, state.optimizer, state.step, state.cursor,
                    state.result.tokens_seen, follow_state)


def evaluate_served_held_out(state: TrainState, collate, micro_batches: dict) -> dict:
    """eval/served_tau (train.eval_served_tokens): the held-out answers that are the target's greedy ones,
    their micro-batches chosen once per held-out set size."""
    config, reader, dist = state.config, state.reader, state.dist
    tokens = config.train.eval_served_tokens
    if state.eval_indices.size not in micro_batches:
        greedy = served.greedy_held_out(reader, state.eval_indices, tokens, state.ctx.args.block_size)
        # packed by their window's anchors (at most `tokens` each), not their training anchors: more answers a batch
        packing = replace(config, train={"max_anchors": min(config.train.max_anchors, tokens)})
        micro_batches[state.eval_indices.size] = held_out_micro_batches(packing, reader, greedy, dist.rank,
                                                                        dist.world_size)
        if dist.is_main:
            walked = sum(len(micro_batch) for micro_batch in micro_batches[state.eval_indices.size]) * dist.world_size
            tqdm.write(f"held-out tau as served: {greedy.size} of the {state.eval_indices.size} held-out answers are "
                       f"the target's greedy ones; about {walked} of them (train.eval_batches micro-batches) walked "
                       f"over their first {tokens} tokens")
    dataset = StoreDataset(reader, config.train.max_anchors, config.train.seed, config.train.skip_corrupt_shards,
                           served_tokens=tokens)
    return evaluate_served(dist, state.wrapped, state.ctx, dataset, collate, micro_batches[state.eval_indices.size],
                           tokens)


def print_plan(config, model, reader, train_indices, eval_indices, steps_per_epoch, total_steps, step,
               follower: StoreFollower | None = None) -> None:
    args = model.args
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    tokens = int(reader.sample_length[train_indices].sum())
    answer_tokens = int(reader.sample_num_supervised[train_indices].sum())  # the answers' tokens trained on
    print(f"store {config.store.path}: {len(reader)} samples ({train_indices.size} train: {tokens:,} tokens, "
          f"{answer_tokens:,} of them answer tokens; {eval_indices.size} held out), codec {reader.attrs['codec']}, "
          f"{'the target' if reader.has_labels else 'data'} labels")
    for name, reason in reader.skipped_shards.items():
        print(f"  skipped corrupt shard {name}: {reason}")
    if reader.skipped_shards:
        print(f"  {len(reader.skipped_shards)} corrupt shard(s) skipped")
    if follower is not None and not follower.exact:
        print(f"  following the store: {len(reader.shard_names)} of {len(reader.planned_shards)} planned shards "
              f"taken up so far; the first epoch takes up the others as stage one completes them (every "
              f"{config.train.follow_every} steps and at the end of each segment)")
    elif reader.incomplete_shards:
        planned = len(reader.incomplete_shards) + len(reader.shard_names) + len(reader.skipped_shards)
        print(f"  {len(reader.incomplete_shards)} of {planned} planned shards are not complete (stage one is "
              f"still running, or stopped): this run trains on the complete ones only and does not pick up "
              f"later ones; finish stage one (rerun it with the same config) to train on the whole store, "
              f"or follow it as it is written (--follow)")
    print(f"drafter {config.drafter.size}: {trainable / 1e6:,.1f}M trainable parameters, "
          f"{args.num_layers} layers {list(args.layer_types)} (window {args.sliding_window}), hidden "
          f"{args.hidden_size}, {args.num_attention_heads} heads x {args.head_dim} ({args.num_key_value_heads} KV), "
          f"MLP {args.intermediate_size}, block {args.block_size}, mask token {args.mask_token_id}, "
          f"target layers {list(args.target_layer_ids)}")
    if follower is not None and not follower.exact:
        print(f"schedule: {config.train.epochs} epochs, first segment {steps_per_epoch[0]} steps, ~{total_steps} steps "
              f"in all (estimated until stage one finishes), starting at step {step}")
    else:
        print(f"schedule: {config.train.epochs} epochs x ~{int(np.mean(steps_per_epoch))} steps, "
              f"{total_steps} steps in all, starting at step {step}")
