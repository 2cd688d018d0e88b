"""Training metrics: one JSON line per logging step, a compact console line, optional wandb.

`MetricsLogger.log(step, metrics)` appends `{"step", "time", **metrics}` to
`<run_dir>/metrics.jsonl` (non-finite values become null, so every line is strict JSON),
prints `step 120 | loss 2.3140 | lr 6.00e-04 ...` through `tqdm.write` (which keeps an
active progress bar intact and is a plain print otherwise) and forwards to wandb when
enabled. wandb is imported only when used, runs offline unless told otherwise (the
`WANDB_MODE` environment variable wins over the argument), keeps quiet on the console (one
line says where its files are), and a wandb failure warns once and never stops training.
Only the writer rank (rank 0) logs anything.

`StepStats` keeps a window's metric sums on the device between logging steps, and the
non-finite guard: a step whose loss or gradient was NaN/Inf raises `NonFiniteError` (naming
the step and its rows) when the window is summarised or before a checkpoint is written.
"""

import json
import math
import os
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as torch_dist
from tqdm import tqdm

from dflash.config import WANDB_MODES
from dflash.dist import DistState
from dflash.errors import DflashError
from dflash.model.loss import block_metrics

METRICS_NAME = "metrics.jsonl"


class MetricsLogger:
    def __init__(self, run_dir: str | Path, use_wandb: bool = False, wandb_mode: str = "offline",
                 project: str = "dflash", config: dict | None = None, is_writer: bool = True):
        if wandb_mode not in WANDB_MODES:
            raise ValueError(f"wandb_mode must be one of {WANDB_MODES}, got {wandb_mode!r}")
        self.is_writer = is_writer
        self.wandb_run = None
        self.jsonl = None
        self.where = ""  # one line: where the metrics go (for the trainer's plan)
        if not is_writer:
            return
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(run_dir / METRICS_NAME, "a", buffering=1)  # line-buffered: tail -f works
        mode = os.environ.get("WANDB_MODE") or wandb_mode
        if use_wandb and mode != "disabled":
            self.wandb_run = start_wandb(run_dir, mode, project, config or {})
        self.where = f"metrics: {run_dir / METRICS_NAME}"
        if self.wandb_run is not None:
            run_files = getattr(self.wandb_run, "dir", None) or run_dir
            self.where += (f"; W&B run {self.wandb_run.url}" if mode == "online" and getattr(self.wandb_run, "url", None)
                           else f"; W&B {mode} run in {Path(run_files).parent} (`wandb sync` uploads it)")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.is_writer:
            return
        values = {name: float(value) for name, value in metrics.items()}
        record = {"step": step, "time": round(time.time(), 3)}
        record.update({name: value if math.isfinite(value) else None for name, value in values.items()})
        self.jsonl.write(json.dumps(record, allow_nan=False) + "\n")
        tqdm.write(format_line(step, values))
        if self.wandb_run is not None:
            try:
                self.wandb_run.log(values, step=step)
            except Exception as err:  # wandb trouble must never stop a training run
                warnings.warn(f"wandb.log failed, wandb logging is off for this run: {err}")
                self.wandb_run = None

    def close(self) -> None:
        if self.wandb_run is not None:
            try:
                self.wandb_run.finish()
            except Exception as err:
                warnings.warn(f"wandb.finish failed: {err}")
            self.wandb_run = None
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()


def start_wandb(run_dir: Path, mode: str, project: str, config: dict):
    """A wandb run, or None (with one warning) when wandb is missing or fails to start."""
    try:
        import wandb

        # WANDB_DIR, when set, decides where wandb writes; otherwise beside the metrics.
        wandb_dir = os.environ.get("WANDB_DIR") or str(run_dir)
        # W&B's own console output (a dozen lines at start and end) would drown the run's; the
        # logger names the run's files in one line instead.
        quiet = {"settings": wandb.Settings(silent=True, console="off")} if hasattr(wandb, "Settings") else {}
        return wandb.init(project=project, config=config, mode=mode, dir=wandb_dir, **quiet)
    except Exception as err:
        warnings.warn(f"wandb could not start ({mode}); continuing without it: {err}")
        return None


# Per-slot accuracies and per-bucket counts go to the JSONL file and W&B, not the console.
CONSOLE_SKIP = ("acc_slot", "_micro_batches")


def format_line(step: int, values: dict[str, float]) -> str:
    parts = [f"step {step}"]
    for name, value in values.items():
        if any(marker in name for marker in CONSOLE_SKIP):
            continue
        small = value != 0 and abs(value) < 1e-2
        parts.append(f"{name} {value:.2e}" if small or abs(value) >= 1e5 else f"{name} {value:.4f}")
    return " | ".join(parts)


class NonFiniteError(DflashError, FloatingPointError):
    """A step's loss or gradient was NaN/Inf; the message names the step and its samples."""


class StepStats:
    """Metric sums kept on the device between logging steps (no host sync per step)."""

    def __init__(self, block_size: int, device: torch.device):
        # loss, loss sum, weight sum, accepted, blocks, micro-batches; per slot correct, valid; distill sum, count
        self.values = torch.zeros(8 + 2 * (block_size - 1), dtype=torch.float64, device=device)
        self.block_size = block_size
        self.micro_batches = 0
        self.grad_norm = None
        self.host = {"real_tokens": 0, "padded_tokens": 0, "real_anchors": 0, "max_len": 0, "num_seqs": 0, "len_sum": 0}
        self.buckets: dict[int, int] = {}
        self.micro_batch_rows: list[np.ndarray] = []  # host: source row ids of each micro-batch
        self.micro_batch_losses: list[torch.Tensor] = []
        # Per optimizer step: (step, rows of its micro-batches, device flags [loss non-finite per
        # micro-batch..., update skipped]); checked on logging steps and before any save.
        self.steps: list[tuple[int, list[np.ndarray], torch.Tensor]] = []

    def loss_flags(self) -> torch.Tensor:
        return ~torch.isfinite(torch.stack(self.micro_batch_losses))

    def record_step(self, flags: torch.Tensor, step: int = -1) -> None:
        self.steps = [(step, self.micro_batch_rows, flags)]

    def add(self, out, valid_AB, batch) -> None:
        metrics = block_metrics(out.correct, valid_AB)
        loss = out.loss.detach().double()
        self.values[:6] += torch.stack([loss, out.loss_sum.detach().double(), out.weight_sum.double(),
                                        metrics["accepted_sum"].double(), metrics["num_blocks"].double(),
                                        torch.ones((), dtype=torch.float64, device=loss.device)])
        self.values[6:6 + self.block_size - 1] += metrics["slot_correct"].double()
        self.values[6 + self.block_size - 1:6 + 2 * (self.block_size - 1)] += metrics["slot_valid"].double()
        if out.distill is not None:
            self.values[-2:] += torch.stack([out.distill.detach().double(), torch.ones_like(loss)])
        self.micro_batches += 1
        self.micro_batch_rows.append(batch["row_ids"])
        self.micro_batch_losses.append(out.objective.detach())  # the non-finite guard covers both terms
        lengths = batch["lengths"]
        self.host["real_tokens"] += int(batch["num_real_tokens"])
        self.host["padded_tokens"] += int(batch["num_tokens"])
        self.host["real_anchors"] += int(batch["num_real_anchors"])
        self.host["max_len"] = max(self.host["max_len"], int(max(lengths)))
        self.host["num_seqs"] += len(lengths)
        self.host["len_sum"] += int(sum(lengths))
        for bucket in batch.get("group_buckets", [int(batch["bucket"])]):  # a fused step: each micro-batch's
            self.buckets[bucket] = self.buckets.get(bucket, 0) + 1

    def merge(self, other: "StepStats") -> None:
        self.values += other.values
        self.micro_batches += other.micro_batches
        for key in ("real_tokens", "padded_tokens", "real_anchors", "num_seqs", "len_sum"):
            self.host[key] += other.host[key]
        self.host["max_len"] = max(self.host["max_len"], other.host["max_len"])
        for bucket, count in other.buckets.items():
            self.buckets[bucket] = self.buckets.get(bucket, 0) + count
        if other.grad_norm is not None:
            self.grad_norm = other.grad_norm
        self.steps += other.steps

    def summarize(self, dist: DistState, with_grad_norm: bool) -> dict:
        """sync: logging step only; one transfer (after one all-reduce under DDP). Raises
        NonFiniteError when a step of the window had a non-finite loss or gradient."""
        values = self.values
        if with_grad_norm and self.grad_norm is not None:
            values = torch.cat([values, self.grad_norm.double().reshape(1)])
        flags = [step_flags for _, _, step_flags in self.steps]
        values = torch.cat([values, *(f.double() for f in flags)]) if flags else values
        if dist.is_distributed:
            values = values.clone()
            torch_dist.all_reduce(values)
        host = values.tolist()
        if flags:
            raise_if_nonfinite(self.steps, host[len(host) - sum(len(f) for f in flags):])
            host = host[:len(host) - sum(len(f) for f in flags)]
        k = self.block_size - 1
        loss_mean, _, _, accepted, blocks, count = host[:6]
        slot_correct, slot_valid = host[6:6 + k], host[6 + k:6 + 2 * k]
        metrics = {"loss": loss_mean / max(count, 1), "tau": 1 + accepted / max(blocks, 1),
                   "acc": sum(slot_correct) / max(sum(slot_valid), 1)}
        distill_sum, distill_count = host[6 + 2 * k:8 + 2 * k]
        if distill_count:
            metrics["distill"] = distill_sum / distill_count
        for slot in range(k):
            metrics[f"acc_slot{slot + 1}"] = slot_correct[slot] / max(slot_valid[slot], 1)
        if with_grad_norm and self.grad_norm is not None:
            metrics["grad_norm"] = host[-1] / dist.world_size
        return metrics

    def check_finite(self, dist: DistState) -> None:
        """Before a checkpoint: raise if an unlogged step of the window was not finite.
        sync: save steps only."""
        if self.steps:
            flags = torch.cat([step_flags for _, _, step_flags in self.steps]).double()
            if dist.is_distributed:
                flags = flags.clone()
                torch_dist.all_reduce(flags)
            raise_if_nonfinite(self.steps, flags.tolist())


def raise_if_nonfinite(steps, host_flags: list[float]) -> None:
    """NonFiniteError naming the first step whose loss or gradient was not finite, and its rows."""
    position = 0
    for step, rows, flags in steps:
        step_flags = host_flags[position:position + len(flags)]
        position += len(flags)
        if not any(step_flags):
            continue
        batches = [f"[rows {', '.join(str(int(r) + 1) for r in batch_rows)}]"
                   + (" (loss not finite)" if bad else "") for batch_rows, bad in zip(rows, step_flags)]
        raise NonFiniteError(
            f"step {step}: the loss or gradient is not finite, so its update was skipped and training stops "
            f"(no checkpoint is written from here). Its micro-batches on this rank: {'; '.join(batches)}. "
            f"Check the store's features (dflash inspect-cache STORE --verify) and the learning rate")
