"""Saving a stage-two run and resuming it: which checkpoint `--resume` means, the config that
resumes it on this many ranks, restoring model, optimizer, RNG and data cursor, and writing a
checkpoint of the run, refused when its weights are not finite. The checkpoint's own format,
and the finite guard that exports apply too, are dflash/train/checkpoint.py's.
"""

import dataclasses
from pathlib import Path

import torch

from dflash.config import Config, ConfigError, replace
from dflash.dist import DistState
from dflash.outputs import require_finite
from dflash.train.checkpoint import (capture_rng_states, latest_checkpoint, load_checkpoint, read_state,
                                     restore_rng_states, save_checkpoint)
from dflash.train.sampler import DataCursor


def save_run(config: Config, dist: DistState, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int,
             cursor: DataCursor, tokens_seen: int, follow_state: dict | None = None) -> Path:
    """A checkpoint of the run at `step` (written by the writer rank); `follow_state` is a
    following run's record of arrivals and segments."""
    model_state = {k: v.detach() for k, v in model.state_dict().items()}  # fp32 master weights
    require_finite(model_state, f"checkpoint of step {step}")  # sync: save steps only
    scheduler_state = {"step": step, "tokens_seen": tokens_seen, "world_size": dist.world_size}
    if follow_state is not None:
        scheduler_state["follow"] = follow_state
    return save_checkpoint(config.train.out_dir, step, model_state, optimizer.state_dict(), scheduler_state,
                           cursor.to_dict(), capture_rng_states(), config.to_dict(), config.train.keep_last,
                           is_writer=dist.is_main, drafter_args=dataclasses.asdict(model.args))


def resolve_resume(config: Config, resume: str | None) -> Path | None:
    if resume is None:
        return None
    if resume == "latest":
        path = latest_checkpoint(config.train.out_dir)
        if path is None:
            raise ConfigError(f"--resume: no complete checkpoint in train.out_dir ({config.train.out_dir})")
        return path
    return Path(resume)


def resume_config(config: Config, path: Path, dist: DistState) -> Config:
    """The config that resumes `path` on this many ranks with the run's global schedule.

    An optimizer step is world size x `train.accum_steps` micro-batches, and the epoch's schedule
    (which samples, packed how, mixed in which step) depends on that product alone; the ranks
    only split each step's micro-batches. So a run written on N ranks resumes on M ranks with
    `train.accum_steps` = N x accum / M: the same samples in the same optimizer steps, the same
    learning rates, and losses equal up to the order of the gradient reductions."""
    state = read_state(path)
    if "holdout_by" not in state["config"]["train"] and config.train.holdout_by != "sample":
        if dist.is_main:  # checkpoints from before the key split by sample: keep the run's split
            print(f"resuming {path}: written before train.holdout_by, so its held-out split is by sample")
        config = replace(config, train={"holdout_by": "sample"})
    saved_world = state["scheduler"].get("world_size")
    saved_accum = state["config"]["train"]["accum_steps"]
    if saved_world is None:  # checkpoints from before the world size was saved
        return config
    step_size = saved_world * saved_accum
    if dist.world_size * config.train.accum_steps == step_size:
        return config
    if step_size % dist.world_size:
        raise ConfigError(f"--resume {path}: its optimizer steps hold {step_size} micro-batches ({saved_world} ranks x "
                          f"train.accum_steps {saved_accum}), which {dist.world_size} ranks cannot split evenly; "
                          f"resume on a number of ranks that divides {step_size}")
    accum = step_size // dist.world_size
    if dist.is_main:
        print(f"resuming a {saved_world}-rank run on {dist.world_size} rank(s): train.accum_steps {config.train.accum_steps} "
              f"-> {accum}, so every optimizer step keeps its {step_size} micro-batches")
    return replace(config, train={"accum_steps": accum})


def restore(path: Path, model, optimizer, dist: DistState) -> tuple[DataCursor, int, int]:
    checkpoint = load_checkpoint(path)
    model.load_state_dict(checkpoint.model_state)
    optimizer.load_state_dict(checkpoint.optimizer_state)
    restore_rng_states(checkpoint.rng_states)
    if dist.is_main:
        print(f"resumed from {path} at step {checkpoint.step}")
    return DataCursor.from_dict(checkpoint.data_cursor), checkpoint.step, checkpoint.scheduler_state.get("tokens_seen", 0)
