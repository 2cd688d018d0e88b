"""Stage one's device side: run the target over right-padded batches, encode its features on the
device, hand them to the writer processes, and commit shards (`write_shards`).

GPU work (capture, fp8 quantisation) overlaps compression and writing, which writer processes
do from bounded queues (dflash/extract/writers.py, one shard per process at a time). Nothing here waits
for the device except the writers' hand-off threads.
"""

import time
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm import tqdm

from dflash.extract.target import pad_batch
from dflash.extract.writers import WriterPool
from dflash.padding import round_up, target_batch_multiple
from dflash.store import codecs
from dflash.store import schema as store_format


@dataclass
class WriteStats:
    """What `write_shards` did on this rank."""

    shards_written: int = 0
    num_samples: int = 0
    num_tokens: int = 0
    padded_tokens: int = 0  # rows the target ran, padding included (batches padded to their longest)
    stored_bytes: int = 0
    writer_wait_seconds: float = 0.0  # the target's thread blocked on full writer queues (back-pressure)
    drain_seconds: float = 0.0  # after the last forward, waiting for the writers to finish
    handoff: dict = field(default_factory=dict)  # the writer hand-off threads' seconds (WriterPool.handoff)


def write_shards(config, dist, target, samples, lengths, row_ids, shards, capture=None,
                 source_ids=None) -> WriteStats:
    """Capture every shard on the device; writer processes (dflash/extract/writers.py) compress and commit
    into the store at config.store.path, which must exist.

    `lengths`, `row_ids` and `source_ids` (None: a store of one source) are indexed like `samples`
    (the kept-sample list the plan uses).
    Shard k goes to writer k % extract.writer_processes, so a shard's batches and its commit
    stay in order while several shards compress at once. `capture(target, batch, codec, device)`
    makes each batch's `CapturedBatch` (default `capture_batch`; benchmarks pass their own).
    """
    result = WriteStats()
    if not shards:
        return result
    capture = capture or capture_batch
    total_tokens = sum(s.num_tokens for s in shards)
    bar = tqdm(total=total_tokens, unit="tok", unit_scale=True, disable=not dist.is_main,
               desc=f"extract (rank 0 of {dist.world_size})", dynamic_ncols=True)
    shard_options = {"codec": config.store.codec, "num_layers": len(target.layer_ids),
                     "hidden_size": target.hidden_size, "rows_per_chunk": config.extract.rows_per_chunk,
                     "rows_per_zarr_shard": config.extract.rows_per_chunk * config.extract.chunks_per_file,
                     "labels": target.predict_labels, "topk": target.topk}
    if source_ids is not None:
        shard_options["source_ids"] = np.asarray(source_ids, dtype=np.int32)
    writers = WriterPool(min(config.extract.writer_processes, len(shards)), config.store.path,
                         lengths, row_ids, shard_options, batch_bytes=encoded_batch_bytes(config, target))
    multiple = target_batch_multiple(dist.device)
    try:
        for key, shard in enumerate(shards):
            writers.open_shard(key, shard)
            shard_samples = [samples[i] for i in shard.sample_indices]
            for first, batch in padded_batches(shard_samples, config.extract.batch_tokens, multiple):
                result.padded_tokens += len(batch) * padded_length(batch, multiple)
                captured = capture(target, batch, config.store.codec, dist.device)
                writers.write(key, shard.name, shard.sample_indices[first:first + len(batch)], batch, captured)
                bar.update(sum(len(s.input_ids) for s in batch))
            writers.commit(key, shard.name)
        drain_start = time.perf_counter()
        committed = writers.close()
        result.drain_seconds += time.perf_counter() - drain_start
    except BaseException:
        writers.terminate()
        raise
    finally:
        bar.close()
    result.writer_wait_seconds += writers.blocked_seconds
    result.handoff = dict(writers.handoff)
    for stats in committed:
        result.shards_written += 1
        result.num_samples += stats["num_samples"]
        result.num_tokens += stats["num_tokens"]
        result.stored_bytes += sum(array["stored_bytes"] for array in stats["arrays"].values())
    return result


def encoded_batch_bytes(config, target) -> int:
    """Upper bound of one encoded batch on the host: batch_tokens rows plus 25% for the
    padding of short sequences, of `n*H` codec values (and n fp32 scales, an int32 label)."""
    num_layers = len(target.layer_ids)
    per_row = num_layers * target.hidden_size * store_format.HIDDEN_DTYPES[config.store.codec].itemsize
    per_row += 4 * num_layers if config.store.codec == "fp8" else 0
    per_row += 4 if target.predict_labels else 0  # int32 target labels
    per_row += 6 * target.topk  # soft targets: int32 ids and uint16 probabilities
    return int(1.25 * config.extract.batch_tokens) * per_row


def padded_length(batch, multiple: int) -> int:
    """The length `capture_batch` pads a batch to: its longest sample, rounded up to `multiple`."""
    return round_up(max(len(s.input_ids) for s in batch), multiple)


def padded_batches(samples, batch_tokens: int, multiple: int = 1):
    """Consecutive samples (plan order) whose padded size n * `padded_length` fits batch_tokens;
    a longer sample alone is a batch."""
    start = 0
    while start < len(samples):
        end, longest = start, 0
        while end < len(samples):
            longest_next = max(longest, padded_length(samples[end:end + 1], multiple))
            if end > start and longest_next * (end - start + 1) > batch_tokens:
                break
            longest, end = longest_next, end + 1
        yield start, samples[start:end]
        start = end


ENCODE_ROWS = 8192  # tokens encoded at a time: bounds the float32 temporaries of the fp8 codec


@dataclass
class CapturedBatch:
    """One batch's encoded features on the host, `(B, T_padded, ...)`; valid once `wait()` returns."""

    parts: dict[str, torch.Tensor]
    ready: torch.cuda.Event | None

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()  # sync: writer hand-off thread only; this batch's device copies


def capture_batch(target, batch, codec: str, device: torch.device) -> CapturedBatch:
    """Forward one right-padded batch, encode it on the device and start the copy to the host.

    Nothing here waits for the device: the copy lands in pinned memory and `CapturedBatch.wait`
    (called by a writer hand-off thread) waits for it, so the next forward is queued behind this one.
    A target loaded with `predict_labels` adds `labels (B, T)` int32, its greedy next tokens; one
    loaded with `topk` adds `topk_ids (B, T, k)` int32 and `topk_probs (B, T, k)` uint16 bits (as
    int16): only k entries a row cross to the host (`TargetModel.capture_head`).
    """
    cuda = device.type == "cuda"
    input_ids, attention_mask = pad_batch([s.input_ids for s in batch], pad_id=0,
                                          multiple=target_batch_multiple(device))
    if cuda:
        input_ids, attention_mask = input_ids.pin_memory(), attention_mask.pin_memory()
    head = {}
    if target.runs_head:
        hidden_BTnH, head = target.capture_head(input_ids, attention_mask)
        if "topk_probs" in head:
            head["topk_probs"] = store_format.probs_to_bits(head["topk_probs"])
    else:
        hidden_BTnH = target.capture(input_ids, attention_mask)
    batch_size, seq_len, num_layers, hidden_size = hidden_BTnH.shape
    rows_RnH = hidden_BTnH.view(batch_size * seq_len, num_layers, hidden_size)
    parts = {}
    for start in range(0, rows_RnH.shape[0], ENCODE_ROWS):
        for name, chunk in codecs.encode(rows_RnH[start:start + ENCODE_ROWS], codec).items():
            if name not in parts:  # host buffers for the whole batch, filled chunk by chunk
                parts[name] = torch.empty((rows_RnH.shape[0], *chunk.shape[1:]), dtype=chunk.dtype, pin_memory=cuda)
            parts[name][start:start + chunk.shape[0]].copy_(chunk, non_blocking=cuda)
    parts = {name: part.view(batch_size, seq_len, *part.shape[1:]) for name, part in parts.items()}
    for name, values in head.items():  # labels, topk_ids, topk_probs
        parts[name] = torch.empty(values.shape, dtype=values.dtype, pin_memory=cuda)
        parts[name].copy_(values, non_blocking=cuda)
    ready = None
    if cuda:
        ready = torch.cuda.Event()
        ready.record()
    return CapturedBatch(parts=parts, ready=ready)
