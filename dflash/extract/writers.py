"""Stage one's writer processes: compression and zarr writes away from the target's process.

zarr runs all of a process's I/O on one asyncio event loop, and its Python work holds the
GIL that the main thread needs to launch the target's kernels. So each rank hands encoded
batches to `size` writer processes (spawned, one zarr event loop each). Shard k goes to
process k % size, which opens the shard, writes its batches in order and commits it.

Data path: the main thread queues a `CapturedBatch` (pinned host tensors whose device copy
may still be in flight) with no wait; one hand-off thread per process waits for the copy's
CUDA event, copies the tensors into one of the process's shared-memory slots (/dev/shm) and
puts the job on the process's queue; the process copies the batch's real rows out of the
slot (its shard writer may hold rows until a zarr shard file is full) and hands the slot
back. The slots are made once: a fresh shared tensor per batch cost up to a second of page
faults per GiB, part of it holding the GIL that the target's thread needs (a batch that does
not fit a slot still goes that way). Each slot faults its pages in on its first batch:
writing them all ahead, while the first forwards ran, measured slower (docs/benchmarks-log.md).
Slots and queues are bounded, so the main thread blocks (back-pressure) when the writers
fall behind, and host memory stays bounded. Writer processes run at a lower CPU priority
(nice +10) and the hand-off copies use one core each: the one thread whose delay idles the
GPU is the one launching the target's kernels.

A writer process dies with its parent (PR_SET_PDEATHSIG), so a killed run leaves no process
that could touch the store while a rerun repairs it. A failure in a process is re-raised in
the main process with the process's traceback (it names the shard and row).
"""

import ctypes
import errno
import os
import queue
import shutil
import signal
import sys
import threading
import time
import traceback
import warnings

import numpy as np
import torch
import torch.multiprocessing as mp

from dflash.errors import DflashError
from dflash.interrupts import children_ignore_interrupts
from dflash.padding import round_up

PR_SET_PDEATHSIG = 1
RESULT_POLL_SECONDS = 0.5
SHARED_MEMORY_DIR = "/dev/shm"
SLOTS_PER_WRITER = 3  # shared-memory batch buffers per writer process: one being written, two queued
SLOT_ALIGN = 64  # bytes; each part of a batch starts at a multiple of it inside its slot
WRITER_NICENESS = 10  # writer processes yield the CPU to the thread that launches the target's kernels


class WriterError(DflashError, RuntimeError):
    """A writer process failed; the message names the shard (and row, or process) in one line,
    and the failing process's traceback is attached as a note (shown with `dflash --debug`)."""

    def __init__(self, message: str, details: str = ""):
        super().__init__(message)
        if details:
            self.add_note(details)


def describe_failure(error: BaseException, store_path: str) -> str:
    """One line for a writer's exception; a full disk names the store it was writing."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"no space left on the device of {store_path} ({error.strerror})"
    return f"{type(error).__name__}: {error}"


def check_shared_memory(size: int, batch_bytes: int, where: str = SHARED_MEMORY_DIR) -> bool:
    """Warn when `where` may not hold the batches in flight (a container's default /dev/shm is
    64 MB); the estimate is a worst case, so this warns instead of refusing. Returns whether it fits."""
    if not os.path.isdir(where) or batch_bytes <= 0:
        return True
    needed = size * SLOTS_PER_WRITER * batch_bytes
    free = shutil.disk_usage(where).free
    if needed > free:
        warnings.warn(
            f"stage one may need up to {needed / 2**30:.1f} GiB of shared memory in {where} "
            f"({size} writer process(es) x {SLOTS_PER_WRITER} batches of {batch_bytes / 2**20:,.0f} MiB) and "
            f"{free / 2**30:.1f} GiB are free; if a writer fails with 'No space left on device', lower "
            f"extract.writer_processes or extract.batch_tokens, or give the container more (--shm-size)",
            stacklevel=3)
        return False
    return True


class WriterPool:
    """`size` writer processes for one store; see the module docstring."""

    def __init__(self, size: int, store_path: str, lengths: np.ndarray, row_ids: np.ndarray, shard_options: dict,
                 batch_bytes: int = 0):
        check_shared_memory(size, batch_bytes)
        self.committed: list[dict] = []
        self.error: tuple[str, str] | None = None  # (one-line message, traceback)
        self.blocked_seconds = 0.0  # the caller's time blocked on full queues (back-pressure)
        # Hand-off threads' seconds: waiting for device copies, waiting for a free slot, copying into
        # slots (and the longest such copy, a slot's first with its page faults): where a batch's time goes.
        self.handoff, self.handoff_lock = new_handoff_stats(), threading.Lock()
        context = mp.get_context("spawn")
        self.results = context.Queue()
        self.job_queues = [context.Queue(maxsize=2) for _ in range(size)]
        self.free_slots = [context.Queue() for _ in range(size)]  # slot numbers, handed back by the process
        num_slots = SLOTS_PER_WRITER if batch_bytes > 0 else 0
        self.slots = [make_slots(batch_bytes, num_slots, free) for free in self.free_slots]
        self.processes = [
            context.Process(target=writer_main, name=f"dflash-writer-{i}", daemon=True,
                            args=(store_path, np.asarray(lengths), np.asarray(row_ids), shard_options, jobs,
                                  self.results, self.slots[i], self.free_slots[i]))
            for i, jobs in enumerate(self.job_queues)
        ]
        with children_ignore_interrupts():  # Ctrl-C: the main process stops the writers (terminate)
            for process in self.processes:
                process.start()
        self.handoffs = [queue.Queue(maxsize=2) for _ in range(size)]
        self.threads = [threading.Thread(target=self.hand_off, args=(i,), daemon=True,
                                         name=f"dflash-writer-handoff-{i}") for i in range(size)]
        for thread in self.threads:
            thread.start()

    def hand_off(self, index: int) -> None:
        """Jobs of process `index` from the main thread to the process, batches through a slot.
        Never blocks on a dead process: a job for one becomes the pool's error."""
        pending = self.handoffs[index]
        while True:
            job = pending.get()
            try:
                if job is not None and job[0] == "batch":
                    job = (*job[:-1], self.to_slot(index, job[-1]))
                self.put_while_alive(index, job)
            except WriterError as error:
                self.error = self.error or (str(error), "")
            except BaseException as error:  # re-raised by the main thread at its next submit or close
                self.error = self.error or (f"writer hand-off: {type(error).__name__}: {error}",
                                            traceback.format_exc())
            if job is None:
                return

    def add_handoff(self, **seconds: float) -> None:
        with self.handoff_lock:
            for name, value in seconds.items():
                self.handoff[name] += value
            if "slot_copy" in seconds:
                self.handoff["batches"] += 1
                self.handoff["slot_copy_max"] = max(self.handoff["slot_copy_max"], seconds["slot_copy"])

    def put_while_alive(self, index: int, job) -> None:
        while True:
            try:
                return self.job_queues[index].put(job, timeout=RESULT_POLL_SECONDS)
            except queue.Full:
                self.raise_if_dead(index)

    def to_slot(self, index: int, captured) -> tuple[int | None, dict]:
        """Wait for the batch's device copy, then copy it into a free slot of process `index`
        (waiting while the process holds them all): `(slot, layout)`. A batch larger than a slot
        goes into fresh shared tensors: `(None, tensors)`."""
        start = time.perf_counter()
        captured.wait()  # sync: hand-off thread only, this batch's device-to-host copy
        waited = time.perf_counter()
        slots = self.slots[index]
        layout, offset = {}, 0
        for name, tensor in captured.parts.items():
            layout[name] = (offset, tensor.dtype, tuple(tensor.shape))
            offset += round_up(tensor.nbytes, SLOT_ALIGN)
        if not slots or offset > slots[0].numel():
            return None, to_shared_memory(captured)
        slot = self.wait_free_slot(index)
        got_slot = time.perf_counter()
        for name, tensor in captured.parts.items():
            copy_bytes(slots[slot], layout[name][0], tensor)
        self.add_handoff(device_copy_wait=waited - start, slot_wait=got_slot - waited,
                         slot_copy=time.perf_counter() - got_slot)
        return slot, layout

    def wait_free_slot(self, index: int) -> int:
        while True:
            try:
                return self.free_slots[index].get(timeout=RESULT_POLL_SECONDS)
            except queue.Empty:
                self.raise_if_dead(index)

    def raise_if_dead(self, index: int) -> None:
        process = self.processes[index]
        if not process.is_alive():
            raise WriterError(f"writer process {process.name} died (exit code {process.exitcode}; -9 is SIGKILL, "
                              f"e.g. the out-of-memory killer) before taking all its batches; the shards it "
                              f"had not committed are redone by a rerun")

    def open_shard(self, key: int, plan) -> None:
        self._submit(key, ("open", plan))

    def write(self, key: int, shard_name: str, indices, batch, captured) -> None:
        """Queue one captured batch: `indices` are the samples' kept-sample indices (plan order)."""
        samples = [(np.asarray(s.input_ids), np.asarray(s.loss_mask)) for s in batch]
        self._submit(key, ("batch", shard_name, list(indices), samples, captured))

    def commit(self, key: int, shard_name: str) -> None:
        self._submit(key, ("commit", shard_name))

    def _submit(self, key: int, job: tuple) -> None:
        self._collect(block=False)
        self._raise_if_failed()
        pending = self.handoffs[key % len(self.handoffs)]
        try:
            pending.put_nowait(job)
        except queue.Full:
            start = time.perf_counter()
            pending.put(job)
            self.blocked_seconds += time.perf_counter() - start

    def close(self) -> list[dict]:
        """Wait for every queued job; return the commit stats of every shard written."""
        for pending in self.handoffs:
            pending.put(None)
        for thread in self.threads:
            thread.join()
        while any(p.is_alive() for p in self.processes):
            self._collect(block=True)
        self._collect(block=False)
        for process in self.processes:
            process.join()
            if process.exitcode not in (0, None) and self.error is None:
                self.error = (f"writer process {process.name} exited with code {process.exitcode}", "")
        self._raise_if_failed()
        return self.committed

    def terminate(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.terminate()

    def _collect(self, block: bool) -> None:
        while True:
            try:
                kind, payload = self.results.get(timeout=RESULT_POLL_SECONDS) if block else self.results.get_nowait()
            except queue.Empty:
                return
            if kind == "committed":
                self.committed.append(payload)
            elif self.error is None:
                self.error = payload
            block = False

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            self.terminate()
            raise WriterError(*self.error)


def new_handoff_stats() -> dict:
    return {"device_copy_wait": 0.0, "slot_wait": 0.0, "slot_copy": 0.0, "slot_copy_max": 0.0,
            "batches": 0}


def new_shared_bytes(nbytes: int) -> torch.Tensor:
    """A flat uint8 tensor in shared memory; its pages are only allocated when first written."""
    return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(nbytes))


def make_slots(batch_bytes: int, count: int, free) -> list[torch.Tensor]:
    """`count` shared-memory slots of `batch_bytes` each, their numbers put on the queue `free`."""
    slots = [new_shared_bytes(batch_bytes) for _ in range(count)]
    for number in range(count):
        free.put(number)
    return slots


def slot_view(slot: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    """The part of `slot` that holds one tensor of `dtype` and `shape` from byte `offset`."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    return slot[offset:offset + nbytes].view(dtype).view(shape)


def copy_bytes(slot: torch.Tensor, offset: int, tensor: torch.Tensor) -> None:
    """Copy contiguous `tensor` into `slot` from byte `offset` on this thread alone, without the
    GIL (numpy): torch's copy would wake every intra-op thread, and the batch lands in its slot
    just as the target's thread must launch the next forward."""
    source = tensor.reshape(-1).view(torch.uint8).numpy()
    np.copyto(slot[offset:offset + source.size].numpy(), source)


def to_shared_memory(captured) -> dict:
    """The batch's host tensors, copied into fresh shared tensors (the device copy has landed)."""
    shared = {}
    for name, tensor in captured.parts.items():
        shared[name] = torch.empty(tensor.shape, dtype=tensor.dtype).share_memory_()
        shared[name].copy_(tensor)
    return shared


def die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def writer_main(store_path: str, lengths: np.ndarray, row_ids: np.ndarray, shard_options: dict, jobs, results,
                slots: list, free_slots) -> None:
    """One writer process: open / batch / commit jobs until None; report commits and the first error.
    A batch that came in a slot hands the slot back once written (or skipped after a failure)."""
    die_with_parent()
    os.nice(WRITER_NICENESS)
    import zarr

    from dflash.store import writer as store_writer

    group = zarr.open_group(store_path, mode="r+")
    writers: dict[str, store_writer.ShardWriter] = {}
    failed = False
    while (job := jobs.get()) is not None:
        slot, parts = job[-1] if job[0] == "batch" else (None, None)
        if slot is not None:
            parts = {name: slot_view(slots[slot], *where) for name, where in parts.items()}
        try:
            if failed:
                continue  # drain: the main process raises the reported error
            if job[0] == "open":
                plan = job[1]
                writers[plan.name] = store_writer.ShardWriter(group, plan, lengths, row_ids, **shard_options)
            elif job[0] == "batch":
                _, name, indices, samples, _ = job
                write_batch(writers[name], indices, samples, parts, copy=slot is not None)
            else:
                stats = writers.pop(job[1]).commit()
                results.put(("committed", stats))
        except BaseException as error:
            failed = True
            name = job[1] if job[0] != "open" else job[1].name
            results.put(("error", (f"writer process, shard {name}: {describe_failure(error, store_path)}",
                                   traceback.format_exc())))
        finally:
            if slot is not None:
                free_slots.put(slot)


def write_batch(shard_writer, indices, samples, parts: dict, copy: bool) -> None:
    """Each sample's rows of the padded `(B, T, ...)` batch, in plan order. The shard writer keeps
    rows until a zarr shard file is full, so rows from a slot (reused once this returns) are
    copied out first (`copy`): the real rows only, in this process."""
    hidden_BTF = parts["hidden"].numpy()
    scale_BTn = parts["scale"].numpy() if "scale" in parts else None
    labels_BT = parts["labels"].numpy() if "labels" in parts else None
    topk_ids_BTk = parts["topk_ids"].numpy() if "topk_ids" in parts else None
    topk_probs_BTk = parts["topk_probs"].numpy().view(np.uint16) if "topk_probs" in parts else None
    for row, (index, (input_ids, loss_mask)) in enumerate(zip(indices, samples)):
        length = len(input_ids)
        hidden = hidden_BTF[row, :length]
        scale = None if scale_BTn is None else scale_BTn[row, :length]
        labels = None if labels_BT is None else labels_BT[row, :length].copy()
        soft = {} if topk_ids_BTk is None else {"topk_ids": topk_ids_BTk[row, :length],
                                                 "topk_probs": topk_probs_BTk[row, :length]}
        if copy:
            hidden, scale = hidden.copy(), None if scale is None else scale.copy()
        # the shard writer zero-fills the soft targets of unsupervised rows (a copy, slot or not)
        shard_writer.write_sample(index, hidden, scale, input_ids, loss_mask, labels=labels, **soft)
