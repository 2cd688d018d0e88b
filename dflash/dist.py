"""Distributed state and the `--gpus` launcher.

`DistState` is the one object that knows rank, world size and device; it is passed
explicitly. Both stages run one process per device under `torchrun` (multi-node through its
rendezvous); `launch_on_gpus` is the single-host convenience that re-executes the same
command under torchrun with `CUDA_VISIBLE_DEVICES` set.
"""

import os
import subprocess
import sys
from dataclasses import dataclass

import torch
import torch.distributed as torch_dist


@dataclass(frozen=True)
class DistState:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.is_distributed:
            torch_dist.barrier()


def host_cpus() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def share_threads(processes: int, env: dict | None = None) -> dict:
    """The environment for one of `processes` processes started side by side on this host: `OMP_NUM_THREADS` (the
    CPU threads torch gives each operator) set to an equal share, at least 1, of the budget, which is the
    environment's own OMP_NUM_THREADS when it names one, else every CPU. Left alone, each process takes every CPU
    (16 evals on 16 cores: 256 threads), and their idle threads spin where the others decode; torchrun shares them
    the same way."""
    env = dict(os.environ if env is None else env)
    budget = env.get("OMP_NUM_THREADS", "")
    budget = int(budget) if budget.isdigit() and int(budget) > 0 else host_cpus()
    env["OMP_NUM_THREADS"] = str(max(1, budget // max(1, processes)))
    return env


def init_distributed(device: str = "auto") -> DistState:
    """Join the process group torchrun describes in the environment (or run alone)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    resolved = resolve_device(device, local_rank)
    if world_size > 1 and not torch_dist.is_initialized():
        backend = "nccl" if resolved.type == "cuda" else "gloo"
        if resolved.type == "cuda":
            torch.cuda.set_device(resolved)
        torch_dist.init_process_group(backend=backend, device_id=resolved if resolved.type == "cuda" else None)
    return DistState(rank=rank, world_size=world_size, local_rank=local_rank, device=resolved)


def resolve_device(device: str, local_rank: int = 0) -> torch.device:
    """The package's one device rule: "auto" is cuda:<local rank> when CUDA is there, else the CPU;
    "cuda" is cuda:<local rank>; any other name is taken as it is."""
    if device == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    if device == "cuda":
        return torch.device(f"cuda:{local_rank}")
    return torch.device(device)


def shutdown(state: DistState) -> None:
    if state.is_distributed and torch_dist.is_initialized():
        torch_dist.destroy_process_group()


def all_reduce_sum(state: DistState, values: list[float]) -> list[float]:
    """Sum a few host numbers over ranks (end-of-run summaries only)."""
    if not state.is_distributed:
        return list(values)
    device = state.device if state.device.type == "cuda" else torch.device("cpu")
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    torch_dist.all_reduce(tensor)
    return tensor.tolist()


def broadcast_object(state: DistState, value):
    """Rank 0's `value` on every rank (a few host objects: what a following run found in the store)."""
    if not state.is_distributed:
        return value
    holder = [value if state.is_main else None]
    torch_dist.broadcast_object_list(holder, src=0, device=state.device if state.device.type == "cuda" else None)
    return holder[0]


def launch_on_gpus(gpus: str, module: str, module_args: list[str]) -> int:
    """Run `python -m <module> <module_args>` under torchrun on the listed GPUs, one process each."""
    gpu_ids = [g.strip() for g in gpus.split(",") if g.strip()]
    if not gpu_ids or not all(g.isdigit() for g in gpu_ids):
        raise ValueError(f"--gpus expects a comma-separated list of GPU indices, got {gpus!r}")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(gpu_ids))
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={len(gpu_ids)}", "-m", module, *module_args]
    return subprocess.call(command, env=env)
