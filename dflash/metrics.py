"""Training metrics: one JSON line per logging step, a compact console line, optional wandb.

`MetricsLogger.log(step, metrics)` appends `{"step", "time", **metrics}` to
`<run_dir>/metrics.jsonl` (non-finite values become null, so every line is strict JSON),
prints `step 120 | loss 2.3140 | lr 6.00e-04 ...` through `tqdm.write` (which keeps an
active progress bar intact and is a plain print otherwise) and forwards to wandb when
enabled. wandb is imported only when used, runs offline unless told otherwise (the
`WANDB_MODE` environment variable wins over the argument), keeps quiet on the console (one
line says where its files are), and a wandb failure warns once and never stops training.
Only the writer rank (rank 0) logs anything.

"""

import json
import math
import os
import time
import warnings
from pathlib import Path

from tqdm import tqdm

METRICS_NAME = "metrics.jsonl"
WANDB_MODES = ("offline", "online", "disabled")


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
