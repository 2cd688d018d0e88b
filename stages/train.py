"""Stage two: train the DFlash drafter from a stage-one store.

`run(config, resume)` wires the library together: open the store, size the drafter for it and
refuse a store that does not match (dflash/train/sizing.py), build the drafter and its optimizer
(dflash/train/step.py) and the per-epoch schedules of mixed-length micro-batches
(dflash/train/sampler.py), restore a checkpoint on `--resume` (dflash/train/resume.py), and run the loop
with metrics, held-out evaluation and checkpoints (dflash/train/loop.py). With `train.follow` the store may still be being written: the follower
(dflash/train/follow.py) schedules the first epoch as shards arrive.
"""

import os

import torch

from dflash.config import Config, ConfigError
from dflash.dist import DistState, init_distributed, shutdown
from dflash.store.reader import StoreReader
from dflash.train import mix, warm_kernels
from dflash.train.checkpoint import read_state
from dflash.train.compile_cache import artifacts_to_load, load_compile_artifacts
from dflash.train.follow import StoreFollower, wait_for_store
from dflash.train.loop import StopFlag, TrainResult, TrainState, loop, print_plan
from dflash.train.metrics import MetricsLogger
from dflash.train.resume import resolve_resume, restore, resume_config
from dflash.train.sampler import DataCursor, schedule_for
from dflash.train.sizing import build_drafter_args, check_labels
from dflash.train.step import apply_parallelism, build_context, build_model, build_optimizer, describe_kernels


def run(config: Config, resume: str | None = None) -> TrainResult:
    # Varying micro-batch shapes fragment the default CUDA allocator; set before CUDA starts.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    dist = init_distributed("auto")
    try:
        return train(config, dist, resume)
    finally:
        shutdown(dist)


def train(config: Config, dist: DistState, resume: str | None) -> TrainResult:
    if config.train.warm_kernels and config.train.compile and dist.device.type == "cuda":
        warm_kernels.start_compile_workers()  # inductor's workers come up while the store and model are set up
    torch.manual_seed(config.train.seed)
    checkpoint_path = resolve_resume(config, resume)
    follow_state = read_state(checkpoint_path)["scheduler"].get("follow") if checkpoint_path else None
    if checkpoint_path is not None and config.train.follow and follow_state is None:
        raise ConfigError(f"--resume {checkpoint_path}: that run did not follow the store; resume it without "
                          f"train.follow / --follow")
    if follow_state is not None or config.train.follow:
        mix.refuse_follow(config)
    reader = open_reader(config, dist, follow_state)
    check_labels(config, reader.attrs)
    if checkpoint_path is not None:
        config = resume_config(config, checkpoint_path, dist)
    args = build_drafter_args(config, reader.attrs)
    if follow_state is not None or config.train.follow:  # after resume_config: segments use its accum_steps
        follower = StoreFollower(config, reader, dist, follow_state)
        if not follower.segments:
            follower.next_segment(0, 0, status=Announcer(dist))
        if not follower.segments or follower.segments[0].schedule is None:
            raise ConfigError(f"store.path {config.store.path}: stage one finished with too few training samples "
                              f"for one optimizer step of train.accum_steps x world size micro-batches")
        train_indices, eval_indices = follower.train_indices(), follower.eval_indices()
        schedules, total_steps = [], follower.horizon
        steps_per_epoch = [follower.segments[0].schedule.num_steps]
    else:
        follower = None
        train_indices, eval_indices, schedules = plan_epochs(config, reader, dist)
        steps_per_epoch = [schedule.num_steps for schedule in schedules]
        total_steps = sum(steps_per_epoch) if config.train.max_steps <= 0 else min(config.train.max_steps, sum(steps_per_epoch))
    model = build_model(config, args, dist)
    optimizer = build_optimizer(model, config)
    ctx = build_context(config, args, reader, dist)
    cursor, step = DataCursor(), 0
    result = TrainResult(run_dir=config.train.out_dir)
    if checkpoint_path is not None:
        cursor, step, result.tokens_seen = restore(checkpoint_path, model, optimizer, dist)
    if dist.device.type == "cuda":
        loaded = load_compile_artifacts(artifacts_to_load(config.train.out_dir, dist.device.index or 0))
        if loaded and dist.is_main:
            print(loaded)
    if config.train.warm_kernels:  # dflash's own kernels compiled beside the first step's tracing
        warm_kernels.start(ctx, optimizer)
    wrapped = apply_parallelism(model, config, dist)
    logger = MetricsLogger(config.train.out_dir, use_wandb=config.train.wandb != "disabled",
                           wandb_mode=config.train.wandb, project=config.train.wandb_project,
                           config=config.to_dict(), is_writer=dist.is_main)
    if dist.is_main:
        print_plan(config, model, reader, train_indices, eval_indices, steps_per_epoch, total_steps, step, follower)
        print(describe_kernels(ctx, optimizer))
        print(logger.where)
    state = TrainState(config=config, dist=dist, model=model, wrapped=wrapped, optimizer=optimizer, ctx=ctx,
                       reader=reader, eval_indices=eval_indices, schedules=schedules, total_steps=total_steps,
                       logger=logger, result=result, stop=StopFlag(), cursor=cursor, step=step, first_step=step,
                       follower=follower)
    try:
        loop(state)
    finally:
        state.stop.restore()
        logger.close()
    return result


def plan_epochs(config: Config, reader: StoreReader, dist: DistState) -> tuple:
    """`(train_indices, eval_indices, schedules)`: the held-out split (per source in a store of several)
    and every epoch's schedule over its samples, weighted by data.mix (dflash/train/mix.py). Index
    arithmetic, no data read; built once, the schedules also fix the LR horizon."""
    train_indices, eval_indices = mix.held_out_split(config, reader)
    if train_indices.size == 0:  # a store written before stage one refused sources without samples
        raise ConfigError(f"store.path {config.store.path}: no training samples ({len(reader)} in the store, "
                          f"{eval_indices.size} held out by train.holdout_fraction); rerun stage one with "
                          f"--overwrite on a data.source with usable rows")
    source_mix = mix.resolve_mix(config, reader)
    epochs = [mix.epoch_samples(source_mix, reader, train_indices, config.train.seed, epoch)
              for epoch in range(config.train.epochs)]
    if dist.is_main and source_mix is not None:
        print("mix (data.mix):\n" + mix.describe_mix(source_mix, reader, train_indices, epochs[0]))
    elif dist.is_main and len(reader.source_names) > 1:
        print(f"the store holds the sources {', '.join(reader.source_names)} and the config has no data.mix: "
              f"every training sample once an epoch (the sources' own shares)")
    schedules = [schedule_for(config, reader, samples, epoch, dist.world_size, config.train.accum_steps)
                 for epoch, samples in enumerate(epochs)]
    return train_indices, eval_indices, schedules


def open_reader(config: Config, dist: DistState, follow_state: dict | None):
    """The store's reader: every complete shard; a following run waits for the store to exist,
    and a resumed one indexes the shards its checkpoint saw, in their arrival order."""
    on_corrupt = "skip" if config.train.skip_corrupt_shards else "raise"
    soft_targets = config.train.distill_weight > 0  # the distillation term reads the stored top-k
    if follow_state is not None:
        return StoreReader(config.store.path, on_corrupt=on_corrupt, shards=follow_state["arrival"],
                           soft_targets=soft_targets)
    if config.train.follow:
        wait_for_store(config, dist, status=Announcer(dist))
    return StoreReader(config.store.path, on_corrupt=on_corrupt, soft_targets=soft_targets)


class Announcer:
    """Prints a following run's wait before its progress bar exists: once per change of text."""

    def __init__(self, dist: DistState):
        self.is_main, self.last = dist.is_main, ""

    def __call__(self, text: str) -> None:
        if text and text != self.last and self.is_main:
            print(f"follow: {text}", flush=True)
        self.last = text
