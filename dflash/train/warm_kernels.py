"""dflash's own Triton kernels compiled at stage two's start, beside torch.compile's tracing.

On a machine with empty caches the first step compiles every kernel it launches: inductor's in its pool of workers,
dflash's own (the blockwise attention's forward, dQ and dK/dV kernels, the loss pass's cross entropy, AdamW's
update) one after another in the training process at their first launch: 0.2-1.3 s each, about 2.5 s in all for one
head shape, compiled for an H100 on the project's CPU machine (`tools/kernel_report.py`), and 9-10 s in threads
beside dynamo's tracing on an H100 host (12-07, before the dK/dV kernel's loop over its query heads was a runtime
loop). `start` compiles them in background threads as soon as the trainer knows its kernels (Triton's `warmup`: each
kernel compiled for the arguments its launch passes, and kept in the process, nothing launched; Triton leaves
Python's lock in its compiler passes, not in its Python front end), and loads each onto the device, so their first
launch in the first step finds them ready. Each is warmed through the code path that launches it
(`block_attention.warm_kernels`, `ce_kernel.warm`, `TritonAdamW.warm`). A kernel that cannot be warmed is reported
and compiles at its first launch, as without this.

`start_compile_workers` starts inductor's pool of compile workers as stage two begins, before the store and the model
are set up: inductor starts it only when its backend receives the first graph, and compiles that graph's kernels in
the training process, one at a time, until the pool answers.
"""

from __future__ import annotations

import sys
import threading
import time

import torch


class Warming:
    """The background compiles `start` began: `join()` waits for them and returns what each did."""

    def __init__(self, jobs: dict, device: torch.device):
        self.results: dict[str, str] = {}
        if device.type == "cuda" and device.index is None:  # this thread's device: a new thread's would be cuda:0
            device = torch.device("cuda", torch.cuda.current_device())
        self.threads = [threading.Thread(target=self._run, args=(name, job, device), name=f"dflash-warm-{name}",
                                         daemon=True) for name, job in jobs.items()]
        for thread in self.threads:
            thread.start()

    def _run(self, name: str, job, device: torch.device) -> None:
        started = time.perf_counter()
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)  # a thread's own current device: the kernels are cached per device
            kernels = [kernel for kernel in job() if kernel is not None]
            for kernel in kernels:  # the module onto the device and its C launcher built, as a first launch would
                if hasattr(kernel, "_init_handles"):
                    kernel._init_handles()
            self.results[name] = f"{len(kernels)} compiled in {time.perf_counter() - started:.1f} s"
        except Exception as error:  # an optimization only: the kernel compiles at its first launch instead
            self.results[name] = f"not warmed ({type(error).__name__}: {error})"[:300]
            print(f"dflash: the {name} kernels were not compiled ahead ({self.results[name]}); "
                  "they compile at their first launch", file=sys.stderr, flush=True)

    def join(self) -> dict[str, str]:
        for thread in self.threads:
            thread.join()
        return dict(self.results)


def warm_jobs(ctx, optimizer) -> dict:
    """The kernels `ctx` (a `dflash.train.step.TrainContext`) and `optimizer` will launch that are dflash's
    own, as named jobs that compile them."""
    if ctx.device.type != "cuda":
        return {}
    jobs = {}
    if ctx.backend == "blockwise":
        jobs["attention"] = lambda: _attention(ctx)
    if ctx.loss_kernel == "triton":
        jobs["loss pass"] = lambda: _loss_pass(ctx)
    if callable(getattr(optimizer, "warm", None)):
        jobs["AdamW"] = optimizer.warm
    return jobs


def _attention(ctx) -> list:
    from dflash.model import block_attention

    args = ctx.args
    return block_attention.warm_kernels(args.num_attention_heads, args.num_key_value_heads, args.head_dim,
                                        torch.bfloat16, ctx.device)  # the dtype the drafter's autocast gives q, k, v


def _loss_pass(ctx) -> list:
    from dflash.model import ce_kernel  # imports Triton: a GPU install's package

    return [ce_kernel.warm(ctx.lm_head_VH.shape[0], ctx.lm_head_VH.dtype, ctx.device)]


def start_compile_workers() -> None:
    """Start inductor's pool of compile workers now, before the store, the model and the data are set up, rather
    than when its backend receives the first graph: until the pool answers (2.7-2.9 s on the project's 2-core
    CPU; a sidecar process imports torch and starts the workers), inductor compiles each Triton kernel of a graph
    in this process, one after another (`AsyncCompile.use_process_pool`). Inductor's own call, so nothing else
    changes; a no-op where inductor would not start one (no Triton, `TORCHINDUCTOR_COMPILE_THREADS=1`,
    `TORCH_WARM_POOL=0`)."""
    from torch._inductor.async_compile import maybe_warm_pool

    maybe_warm_pool()


def start(ctx, optimizer) -> Warming | None:
    """Compile dflash's own kernels for this run in background threads (CUDA only); None where there are none."""
    jobs = warm_jobs(ctx, optimizer)
    return Warming(jobs, ctx.device) if jobs else None
