"""Compiled kernels that travel with a run: torch's cache artifacts in `train.out_dir`.

On CUDA the first step of a training process compiles the drafter's layers, flex attention and the
loss pass: up to a minute on a cold cache, 23-40 s on an H200 (inductor's cache lives in /tmp, so a new
machine, container or `TORCHINDUCTOR_CACHE_DIR` starts cold). After its first steps every rank
saves `torch.compiler.save_cache_artifacts()` (dynamo, AOT-autograd, inductor and Triton entries)
to `<out_dir>/compile-artifacts.bin` (device cuda:0) or `compile-artifacts.cuda<N>.bin` (cuda:N):
inductor keys its Triton kernels by device index, so a rank on cuda:1 that loaded cuda:0's file
still compiled its kernels again (H200 x2, 2026-12-01). Every later process of the run (a
`--resume`, a restart on more GPUs) loads its device's file before its first step, or cuda:0's
when its own does not exist yet. A file from another torch version or GPU is simply not hit:
torch compiles as it would without it.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

from dflash.outputs import atomic_file

ARTIFACTS_NAME = "compile-artifacts.bin"


def artifacts_path(out_dir: str | Path, device_index: int = 0) -> Path:
    """Where the process on cuda:`device_index` saves its artifacts."""
    return device_file(Path(out_dir) / ARTIFACTS_NAME, device_index)


def device_file(path: str | Path, device_index: int) -> Path:
    """cuda:0's artifacts file `path` itself; cuda:N's beside it, `<stem>.cudaN<suffix>`."""
    path = Path(path)
    return path if not device_index else path.with_name(f"{path.stem}.cuda{device_index}{path.suffix}")


def artifacts_to_load(out_dir: str | Path, device_index: int) -> Path:
    """This device's artifacts when a run saved them, else cuda:0's (the dynamo and AOT-autograd
    entries still apply); the returned path may not exist."""
    return own_or_first(artifacts_path(out_dir), device_index)


def own_or_first(path: str | Path, device_index: int) -> Path:
    """`device_file(path, device_index)` when it exists, else `path` (cuda:0's file)."""
    own = device_file(path, device_index)
    return own if own.is_file() else Path(path)


def load_compile_artifacts(path: str | Path) -> str:
    """Load the artifacts at `path` into torch's compile caches; returns what happened, in words."""
    path = Path(path)
    if not path.is_file():
        return ""
    data = path.read_bytes()
    try:
        info = torch.compiler.load_cache_artifacts(data)  # None: torch could not read them (it logs why)
    except (RuntimeError, ValueError, OSError, EOFError, AttributeError) as error:
        info, reason = None, f"{type(error).__name__}: {error}"
    else:
        reason = "unreadable, or written by another torch"
    if info is None:
        return f"compile artifacts {path} not used ({reason}); compiling from scratch"
    return f"loaded compile artifacts {path} ({len(data) / 1e6:.1f} MB): compiled kernels are reused"


def compiled_anew() -> bool:
    """Whether this process compiled a graph that was in no cache (inductor's FX-graph cache missed)."""
    from torch._dynamo.utils import counters  # torch's own compile counters (also read by its logs)

    return counters["inductor"].get("fxgraph_cache_miss", 0) > 0


def save_compile_artifacts(path: str | Path) -> int:
    """Write every compile-cache entry of this process to `path` (atomically) when it compiled
    something new or the file is missing; bytes written, 0 when nothing was written."""
    path = Path(path)
    if path.is_file() and not compiled_anew():
        return 0  # everything came from the caches: the file already holds it
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return 0
    data, _ = saved
    with atomic_file(path) as partial:
        Path(partial).write_bytes(data)
    return len(data)


COMPILE_PHASES = {  # torch._dynamo.utils.compile_times() keys -> what they time (seconds, summed)
    "_compile.compile_inner": "dynamo, whole frames",
    "compile_fx_inner": "inductor graphs (fwd + bwd)",
    "async_compile.wait": "waiting for Triton kernel compiles",
    "PyCodeCache.load_by_key_path": "loading generated modules",
}


def compile_summary() -> dict:
    """Seconds per compile phase so far and the number of graphs compiled (torch._dynamo counters)."""
    from torch._dynamo import utils

    try:
        names, values = utils.compile_times(repr="csv", aggregate=True)
    except Exception:  # noqa: BLE001 - diagnostics only; the table can change while a compile runs
        return {}
    seconds = {name: float(value) for name, value in zip(names, values) if name in COMPILE_PHASES}
    return {"seconds": seconds, "unique_graphs": int(utils.counters["stats"].get("unique_graphs", 0))}


def describe_compile(summary: dict) -> str:
    phases = ", ".join(f"{COMPILE_PHASES[k]} {v:.1f} s" for k, v in summary.get("seconds", {}).items())
    return f"{summary.get('unique_graphs', 0)} graphs; {phases or 'no compile finished yet'}"


class CompileProgress:
    """While a first step compiles, `say(text)` every `every` seconds: the seconds so far and what
    compiled (graphs, dynamo and Triton time), so a cold start shows where it is."""

    def __init__(self, say, every: float = 5.0, prefix: str = "first step: compiling"):
        self.say, self.every, self.prefix = say, every, prefix
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.report, daemon=True, name="compile-progress")

    def __enter__(self):
        self.start = time.perf_counter()
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()

    def report(self) -> None:
        while not self.done.wait(self.every):
            self.say(f"{self.prefix}, {time.perf_counter() - self.start:.0f} s so far: "
                     f"{describe_compile(compile_summary())}")
