"""Benchmark stage one: bare target forward vs the full capture + encode + store-write path.

Builds a Qwen3.5-27B-shaped target from a config with random bf16 weights directly on the
GPU (no download), draws a realistic length mix, and runs the same right-padded,
length-bucketed batches through
  1. the bare transformers forward, `model(input_ids, attention_mask, logits_to_keep=1)`
     with nothing kept (the reference), and the same without the padding mask (capture runs
     the model without it: right padding cannot change a real row of a causal LM),
  2. `capture only`: `TargetModel.capture` (layers after the last captured id dropped) +
     `codecs.encode` on the GPU + copy to host, nothing written,
  3. the writers alone: the same path fed with already captured batches (no forward), the
     ceiling of compression and writing,
  4. the full stage-one path, per codec: `dflash.extract.capture.write_shards` (writer processes,
     `store_writer.ShardWriter`, zstd, zarr) into a local temporary store.
The full path is also reported over its forward span alone, from the first batch's forward to
the end of the last batch's device copies: starting the writer pool before it and the writers
finishing the last shards after it are paid once per rank per run, so the rate over the span
is what a long run converges to (the seconds outside it are reported beside it). It prints
tokens/s, the ratio to the bare forward, MFU (2 x params of the layers run x tokens, plus the
causal score FLOPs of the full-attention layers run, over 790 TFLOP/s), stored bytes/token
per codec and the write rate, and writes the numbers as JSON to `--out`.

`--profile DIR` then runs the capture-only and the full pass once more under torch.profiler
and reads the GPU's timeline: how long the GPU sat idle inside each pass, its longest gaps,
and what the target's thread was doing meanwhile (the explanation of any gap between them).

    python tools/bench_stage1.py --out bench/stage1.json            # H200
    python tools/bench_stage1.py --quick --out /tmp/stage1.json     # tiny target on CPU

`--labels` also times the capture with the target's greedy labels (`store.labels = "target"`:
every layer, the final norm and the chunked LM-head argmax) against the capture without them.

Its helpers shared with the other tools are in tools/benchlib.py.
"""

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

# Run as a script: make the repository root importable (dflash) without installing.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchlib import (GPU_EVENT_CATEGORIES, build_random_target, log_uniform_lengths, merge_intervals,  # noqa: E402
                      print_table, progress, qwen35_27b_config, run_metadata, synchronize, write_results)

from dflash.padding import round_up  # noqa: E402

if not torch.cuda.is_available():
    # CPU runs: keep transformers on its pure-torch Gated DeltaNet (fla's Triton kernels need a GPU).
    sys.modules.setdefault("fla", None)

PEAK_BF16_FLOPS = 790e12  # H200 dense bf16, the ceiling issue 5 measures MFU against
REAL_LAYER_COUNT = 5


# --------------------------------------------------------------------------- target


def layer_parameters(model, num_layers: int | None = None) -> int:
    """Parameters of the first `num_layers` decoder layers (all when None); embeddings are lookups."""
    layers = model.model.layers if num_layers is None else model.model.layers[:num_layers]
    return sum(p.numel() for p in layers.parameters())


def mfu(flops: float, seconds: float) -> float:
    return flops / max(seconds, 1e-12) / PEAK_BF16_FLOPS


# --------------------------------------------------------------------------- data


def make_samples(lengths: np.ndarray, vocab_size: int, seed: int) -> list:
    """Random-token samples; loss masks follow chat shape (prompt unsupervised, answer supervised)."""
    from dflash.data.samples import Sample

    rng = np.random.default_rng(seed)
    samples = []
    for row_id, length in enumerate(lengths.tolist()):
        loss_mask = np.zeros(length, dtype=np.uint8)
        loss_mask[int(0.3 * length):] = 1
        input_ids = rng.integers(0, vocab_size, size=length, dtype=np.int64).astype(np.int32)
        samples.append(Sample(row_id=row_id, input_ids=input_ids, loss_mask=loss_mask))
    return samples


def bucketed_batches(samples: list, bucket_edges, batch_tokens: int, shard_tokens: int) -> list[list]:
    """The batches stage one runs: the plan's shards (bucketed, each shortest first), each cut into
    right-padded batches of consecutive samples."""
    from dflash.extract.capture import padded_batches
    from dflash.store.plan import plan_shards

    lengths = np.array([len(s) for s in samples])
    plans = plan_shards(lengths, np.array([s.row_id for s in samples]), bucket_edges, shard_tokens)
    return [batch for plan in plans
            for _, batch in padded_batches([samples[i] for i in plan.sample_indices], batch_tokens, multiple=16)]


def warmup_batches(batches: list[list]) -> list[list]:
    """One batch per length class (multiples of 128): every kernel variant compiles and
    autotunes before anything is timed."""
    seen, chosen = set(), []
    for batch in batches:
        padded = round_up(max(len(s) for s in batch), 128)
        if padded not in seen:
            seen.add(padded)
            chosen.append(batch)
    return chosen


def attention_flops(config, layers_run: int, lengths) -> float:
    """Score and value FLOPs of the causal full-attention layers among the first `layers_run`
    (2 x 2 x heads x head_dim x L^2 / 2 per sequence); parameter FLOPs miss them."""
    full_layers = sum(t == "full_attention" for t in config.layer_types[:layers_run])
    width = config.num_attention_heads * config.head_dim
    return full_layers * 2 * width * float(sum(int(n) ** 2 for n in lengths))


# --------------------------------------------------------------------------- passes


def time_bare_forward(model, batches, device, mask: bool = True) -> float:
    """Seconds for `model(..., logits_to_keep=1)` over every batch (with or without the padding
    mask); outputs are dropped."""
    from dflash.extract.target import pad_batch

    synchronize(device)
    start = time.perf_counter()
    with torch.inference_mode():
        for batch in batches:
            input_ids, attention_mask = pad_batch([s.input_ids for s in batch], pad_id=0)
            model(input_ids=input_ids.to(device, non_blocking=True),
                  attention_mask=attention_mask.to(device, non_blocking=True) if mask else None, logits_to_keep=1,
                  use_cache=False)
    synchronize(device)
    return time.perf_counter() - start


def time_capture_only(target, batches, codec: str, device) -> float:
    """Seconds for capture + encode on the device + copy to host (dflash.extract.capture.capture_batch)."""
    from dflash.extract.capture import capture_batch

    synchronize(device)
    start = time.perf_counter()
    for batch in batches:
        capture_batch(target, batch, codec, device)
    synchronize(device)
    return time.perf_counter() - start


def compiled_capture(target, warmup, batches, codec: str, device) -> dict:
    """Compile the target's decoder layers (in place), warm them up, check their features against
    the eager ones on two batches (relative L2 over each batch), and time capture + encode + copy."""
    from dflash.extract.target import compile_decoder_layers, pad_batch

    def features(batch):
        input_ids, attention_mask = pad_batch([s.input_ids for s in batch], pad_id=0)
        return target.capture(input_ids, attention_mask).float()

    checked = batches[:1] + batches[-1:]
    eager = [features(batch) for batch in checked]
    layers = compile_decoder_layers(target)
    start = time.perf_counter()
    time_capture_only(target, warmup + checked, codec, device)
    warmup_seconds = time.perf_counter() - start
    gaps = [float((features(batch) - ref).norm() / ref.norm()) for batch, ref in zip(checked, eager)]
    del eager
    progress(f"decoder layers compiled ({layers}): warm-up {warmup_seconds:.1f} s, features vs eager relative L2 "
             f"{max(gaps):.2e}")
    seconds = time_capture_only(target, batches, codec, device)
    progress(f"capture + encode {codec} + copy, compiled layers: {sum(len(s) for b in batches for s in b) / seconds:,.0f}"
             " tokens/s")
    return {"layers": layers, "warmup_seconds": warmup_seconds, "relative_l2": max(gaps), "seconds": seconds}


def capture_pool(target, batches, codec: str, device) -> dict[str, np.ndarray]:
    """Encoded host rows `(R, ...)` of real captured batches, R >= the largest padded batch."""
    from dflash.extract.capture import capture_batch
    from dflash.padding import target_batch_multiple

    multiple = target_batch_multiple(device)
    needed = max(len(b) * round_up(max(len(s) for s in b), multiple) for b in batches)
    parts, rows = [], 0
    for batch in sorted(batches, key=len, reverse=True):
        captured = capture_batch(target, batch, codec, device)
        captured.wait()
        parts.append({k: v.numpy().reshape(-1, *v.shape[2:]) for k, v in captured.parts.items()})
        rows += len(parts[-1]["hidden"])
        if rows >= needed:
            break
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def captures_from_pool(pool: dict[str, np.ndarray], device):
    """A capture function for `write_shards` that returns views of `pool` (no forward): the writers alone."""
    from dflash.extract.capture import CapturedBatch
    from dflash.padding import target_batch_multiple

    multiple = target_batch_multiple(device)

    def capture_batch(target, batch, codec, device):
        padded = round_up(max(len(s.input_ids) for s in batch), multiple)
        rows = len(batch) * padded
        return CapturedBatch(parts={k: torch.from_numpy(v[:rows].reshape(len(batch), padded, *v.shape[1:]))
                                    for k, v in pool.items()}, ready=None)

    return capture_batch


def run_full_path(target, samples, bucket_edges, codec: str, batch_tokens: int, writer_processes: int, device,
                  store_dir: Path, pool: dict | None = None, shard_tokens: int = 0) -> dict:
    """The stage-one writer path into a fresh local store; returns seconds, bytes and writer load.

    With `pool` (from `capture_pool`) the target is not run: this measures the writers alone.
    """
    from dflash.config import Config, replace
    from dflash.dist import DistState
    from dflash.extract.capture import capture_batch, write_shards
    from dflash.store import inspection, plan
    from dflash.store import writer as store_writer

    # A real run has thousands of shards spread over the writer processes; a short benchmark
    # with the default 262K-token shards would leave one process writing most of the data.
    total = sum(len(s) for s in samples)
    shard_tokens = shard_tokens or max(batch_tokens, total // (4 * writer_processes))
    config = replace(Config(), store={"codec": codec, "path": str(store_dir), "bucket_edges": tuple(bucket_edges),
                                      "shard_tokens": shard_tokens},
                     extract={"batch_tokens": batch_tokens, "writer_processes": writer_processes},
                     data={"max_length": min(batch_tokens, 4096)})
    lengths = np.array([len(s) for s in samples], dtype=np.int64)
    row_ids = np.array([s.row_id for s in samples], dtype=np.int64)
    shards = plan.plan_shards(lengths, row_ids, list(bucket_edges), config.store.shard_tokens)
    attrs = synthetic_store_attrs(target, codec, bucket_edges, shards)
    store_writer.create_or_open_store(str(store_dir), attrs, overwrite=True)
    dist = DistState(rank=0, world_size=1, local_rank=0, device=device)
    synchronize(device)
    start = time.perf_counter()
    span = ForwardSpan(device)
    capture = captures_from_pool(pool, device) if pool else span.timed(capture_batch)
    result = write_shards(config, dist, target, samples, lengths, row_ids, shards, capture=capture)
    seconds = time.perf_counter() - start
    stats = inspection.store_stats(str(store_dir))
    numbers = {"seconds": seconds, "stored_bytes": stats["total"]["stored_bytes"], "tokens": stats["total"]["tokens"],
               "bytes_per_token": stats["total"]["bytes_per_token"], "writer_processes": writer_processes,
               "writer_wait_seconds": result.writer_wait_seconds, "drain_seconds": result.drain_seconds,
               "handoff": result.handoff}
    if not pool:
        numbers.update(forward_span_seconds=span.seconds(), startup_seconds=span.first_call - start,
                       fixed_seconds=seconds - span.seconds())
    return numbers


class ForwardSpan:
    """The stage-one loop's own time inside `write_shards`: from the first batch's forward to the
    end of the last batch's device copies (CUDA events; host time on the CPU, where capture is
    synchronous). Outside it: starting the writer pool before, writers finishing after. A run
    pays those once per rank, so tokens / this span is what a long run converges to."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.first_call = self.last_return = 0.0
        self.start_event = self.end_event = None

    def timed(self, original):
        def capture_batch(*args, **kwargs):
            if not self.first_call:
                self.first_call = time.perf_counter()
                if self.cuda:
                    self.start_event = torch.cuda.Event(enable_timing=True)
                    self.start_event.record()
            captured = original(*args, **kwargs)
            self.last_return = time.perf_counter()
            if self.cuda:
                self.end_event = torch.cuda.Event(enable_timing=True)
                self.end_event.record()
            return captured

        return capture_batch

    def seconds(self) -> float:
        if self.cuda:
            self.end_event.synchronize()
            return self.start_event.elapsed_time(self.end_event) / 1e3
        return self.last_return - self.first_call


# --------------------------------------------------------------------------- GPU timeline

HOST_EVENT_CATEGORIES = ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation")
GAP_SECONDS = 1e-3  # GPU idle stretches at least this long are listed one by one
HOST_CALLS = ("cudaHostAlloc", "cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize",
              "cudaMemcpyAsync", "cudaLaunchKernel", "aten::copy_", "aten::pin_memory", "aten::_local_scalar_dense")


def profiled_pass(label: str, out_dir: Path, device, fn) -> dict:
    """Run `fn()` under torch.profiler inside a `label` annotation (the device synchronised
    before the annotation closes), write the Chrome trace and summarise it (`gpu_timeline`)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    out_dir.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        with record_function(label):
            fn()
            synchronize(device)
    trace = out_dir / f"{label.replace(' ', '_').replace(':', '')}.json"
    prof.export_chrome_trace(str(trace))
    summary = gpu_timeline(json.loads(trace.read_text()), label)
    summary["trace"] = str(trace)
    return summary


def gpu_timeline(trace: dict, label: str) -> dict:
    """The GPU's busy and idle time inside the `label` annotation of a torch.profiler Chrome
    trace, from its first to its last device event (kernels, copies, memsets), and what the
    annotation's thread (the one that launches the target's kernels) was in during the idle
    stretches: seconds of overlap per event name (nested events each count), the longest gaps,
    and every thread's time in the host calls that can hold the launching thread back."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    window = next(e for e in events if e.get("cat") == "user_annotation" and e.get("name") == label)
    low, high, main_tid = window["ts"], window["ts"] + window["dur"], window["tid"]
    merged = merge_intervals((e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                             if e.get("cat") in GPU_EVENT_CATEGORIES and low <= e["ts"] <= high)
    busy = sum(end - start for start, end in merged)
    span = merged[-1][1] - merged[0][0] if merged else 0.0
    gaps = [(merged[i][1], merged[i + 1][0]) for i in range(len(merged) - 1)
            if merged[i + 1][0] - merged[i][1] >= GAP_SECONDS * 1e6]
    host = [e for e in events if e.get("cat") in HOST_EVENT_CATEGORIES and e.get("name") != label
            and low <= e["ts"] <= high]
    main = [e for e in host if e["tid"] == main_tid]
    in_gaps: dict[str, float] = {}
    listed = []
    for start, end in gaps:
        overlapping = []
        for e in main:
            overlap = min(end, e["ts"] + e.get("dur", 0)) - max(start, e["ts"])
            if overlap > 0:
                in_gaps[e["name"]] = in_gaps.get(e["name"], 0.0) + overlap / 1e6
                overlapping.append((overlap, e["name"]))
        listed.append({"at_s": (start - merged[0][0]) / 1e6, "seconds": (end - start) / 1e6,
                       "main_thread_in": [name for _, name in sorted(overlapping, reverse=True)[:4]]})
    before: dict[str, float] = {}
    first_gpu = merged[0][0] if merged else high
    for e in main:
        overlap = min(first_gpu, e["ts"] + e.get("dur", 0)) - e["ts"]
        if overlap > 0:
            before[e["name"]] = before.get(e["name"], 0.0) + overlap / 1e6
    calls: dict[str, dict] = {}
    for e in (e for e in host if e["name"] in HOST_CALLS):
        thread = "main" if e["tid"] == main_tid else "other threads"
        entry = calls.setdefault(f"{e['name']} ({thread})", {"count": 0, "seconds": 0.0, "longest_s": 0.0})
        entry["count"] += 1
        entry["seconds"] += e.get("dur", 0) / 1e6
        entry["longest_s"] = max(entry["longest_s"], e.get("dur", 0) / 1e6)
    kernel_seconds = sum(e.get("dur", 0) for e in events
                         if e.get("cat") == "kernel" and low <= e["ts"] <= high) / 1e6
    return {
        "span_s": span / 1e6, "busy_s": busy / 1e6, "idle_s": (span - busy) / 1e6,
        "before_first_gpu_event_s": (first_gpu - low) / 1e6,
        "after_last_gpu_event_s": (high - merged[-1][1]) / 1e6 if merged else 0.0,
        "main_thread_before_gpu_s": dict(sorted(before.items(), key=lambda kv: -kv[1])[:12]),
        "busy_fraction": busy / span if span else 0.0, "kernel_s": kernel_seconds,
        "gaps_over_1ms": len(gaps), "gap_seconds_over_1ms": sum(end - start for start, end in gaps) / 1e6,
        "longest_gaps": sorted(listed, key=lambda g: -g["seconds"])[:8],
        "main_thread_during_gaps_s": dict(sorted(in_gaps.items(), key=lambda kv: -kv[1])[:12]),
        "host_calls": calls,
    }


def profile_passes(target, batches, samples, bucket_edges, codec: str, args, device, store_root: Path) -> dict:
    """The capture-only and the full pass once more, each under the profiler (`profiled_pass`)."""
    out_dir = Path(args.profile)
    capture = profiled_pass("bench_stage1 capture only", out_dir, device,
                            lambda: time_capture_only(target, batches, codec, device))
    full_numbers = {}

    def full_pass():
        full_numbers.update(run_full_path(target, samples, bucket_edges, codec, args.batch_tokens,
                                          args.writer_processes, device, store_root / "profiled"))

    full = profiled_pass("bench_stage1 full path", out_dir, device, full_pass)
    shutil.rmtree(store_root / "profiled", ignore_errors=True)
    full["run"] = full_numbers
    return {"codec": codec, "capture_only": capture, "full": full}


def synthetic_store_attrs(target, codec: str, bucket_edges, shards) -> dict:
    from dflash.store import schema as store_format

    return {
        "schema_version": store_format.SCHEMA_VERSION, "package_version": "bench",
        "target": {"path": "random-init", "config_hash": "", "model_type": target.model_type,
                   "num_hidden_layers": target.num_layers, "hidden_size": target.hidden_size,
                   "vocab_size": target.vocab_size},
        "target_layer_ids": list(target.layer_ids), "hidden_size": target.hidden_size, "codec": codec,
        "tokenizer": {}, "max_length": int(bucket_edges[-1]), "bucket_edges": list(bucket_edges),
        "config": {}, "config_hash": "bench",
        "shards": [{"name": s.name, "bucket": s.bucket, "num_samples": len(s.sample_indices),
                    "num_tokens": s.num_tokens} for s in shards],
    }


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny target on the CPU, a few thousand tokens")
    parser.add_argument("--out", required=True, help="JSON results file")
    parser.add_argument("--tokens", type=int, default=131_072, help="real tokens per pass")
    parser.add_argument("--batch-tokens", type=int, default=32_768, help="padded tokens per forward")
    parser.add_argument("--codecs", default="fp8,bf16")
    parser.add_argument("--writer-processes", type=int, default=4, help="extract.writer_processes of the full path")
    parser.add_argument("--store-dir", default="", help="where the temporary stores go (default: a temp dir)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--labels", action="store_true",
                        help="also time capture with the target's greedy labels (store.labels = target)")
    parser.add_argument("--essential", action="store_true",
                        help="skip the unmasked bare forward and the writers-alone pass (a large --tokens in one "
                             "10-minute run: the bare forward, capture and the full path remain)")
    parser.add_argument("--padding-only", action="store_true",
                        help="only print the padding efficiency of stage one's batches for --tokens of the length mix "
                             "(no target, any machine)")
    parser.add_argument("--compile-layers", action="store_true",
                        help="then compile the target's decoder layers regionally (dflash.extract.target.compile_decoder_layers) "
                             "and time capture and the full path again, checking the features against eager")
    parser.add_argument("--profile", default="", help="directory for profiler traces of the capture-only and full "
                                                      "passes, run once more after the timed ones")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.batch_tokens = min(args.tokens, 600), min(args.batch_tokens, 512)
    return args


def build_target(args, device: torch.device):
    from dflash.extract.tiny_target import tiny_target_config

    config = tiny_target_config() if args.quick else qwen35_27b_config()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return config, build_random_target(config, device, dtype)


def pick_samples(args, vocab_size: int) -> list:
    high = 160 if args.quick else 4096
    lengths = log_uniform_lengths(4 * args.tokens // 64, 64, high, args.seed)
    lengths = lengths[: int(np.searchsorted(np.cumsum(lengths), args.tokens)) + 1]
    return make_samples(lengths, vocab_size, args.seed)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    from dflash.config import StoreConfig
    from dflash.extract.target import TargetModel, default_layer_ids

    bucket_edges = StoreConfig().bucket_edges
    if args.padding_only:
        from dflash.extract.capture import padded_length

        samples = pick_samples(args, 1000)
        batches = bucketed_batches(samples, bucket_edges, args.batch_tokens, StoreConfig().shard_tokens)
        real = sum(len(s) for s in samples)
        padded = sum(len(b) * padded_length(b, 16) for b in batches)
        print(f"{len(samples)} samples, {real:,} tokens in {len(batches)} batches of <= {args.batch_tokens:,} padded "
              f"tokens: padding efficiency {real / padded:.4f}")
        write_results(args.out, {"meta": run_metadata(["tools/bench_stage1.py", *argv]), "tokens": real,
                                 "padded_tokens": padded, "batches": len(batches), "padding_efficiency": real / padded})
        return 0
    config, model = build_target(args, device)
    progress("target built")
    samples = pick_samples(args, config.vocab_size)
    batches = bucketed_batches(samples, bucket_edges, args.batch_tokens, StoreConfig().shard_tokens)
    real_tokens = sum(len(s) for s in samples)
    padded_tokens = sum(len(b) * max(len(s) for s in b) for b in batches)
    layer_ids = default_layer_ids(config.num_hidden_layers, REAL_LAYER_COUNT)
    all_params, cut_params = layer_parameters(model), layer_parameters(model, layer_ids[-1] + 1)
    print(f"target: {config.num_hidden_layers} layers, hidden {config.hidden_size}, {all_params / 1e9:.2f}B layer "
          f"parameters ({cut_params / 1e9:.2f}B up to layer {layer_ids[-1]}); {len(samples)} samples, "
          f"{real_tokens:,} tokens in {len(batches)} batches (padding efficiency {real_tokens / padded_tokens:.3f})")

    warmup = [] if args.quick else warmup_batches(batches)
    progress(f"warm-up: {len(warmup)} batches (one per padded length)")
    time_bare_forward(model, warmup, device)
    bare_seconds = time_bare_forward(model, batches, device)
    progress(f"bare forward: {real_tokens / bare_seconds:,.0f} tokens/s")
    unmasked_seconds = None
    if not args.essential:
        time_bare_forward(model, warmup, device, mask=False)
        unmasked_seconds = time_bare_forward(model, batches, device, mask=False)
        progress(f"bare forward without the padding mask: {real_tokens / unmasked_seconds:,.0f} tokens/s")
    codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
    labels_seconds = None
    if args.labels:  # before the cut: target labels run every layer, the final norm and the LM head
        labelled = TargetModel(model, layer_ids, config_hash="random-init", model_type=config.model_type,
                               predict_labels=True)
        time_capture_only(labelled, warmup, codecs[0], device)
        labels_seconds = time_capture_only(labelled, batches, codecs[0], device)
        progress(f"capture + target labels + encode {codecs[0]} + copy: {real_tokens / labels_seconds:,.0f} tokens/s")
        del labelled
    target = TargetModel(model, layer_ids, config_hash="random-init", model_type=config.model_type)
    time_capture_only(target, warmup, codecs[0], device)
    capture_seconds = time_capture_only(target, batches, codecs[0], device)
    progress(f"capture + encode {codecs[0]} + copy: {real_tokens / capture_seconds:,.0f} tokens/s")
    if labels_seconds is not None:
        progress(f"target labels cost {labels_seconds / capture_seconds:.3f}x the time of data labels "
                 f"(capture + encode + copy; goal <= 1.10x)")
    store_root = Path(args.store_dir or tempfile.mkdtemp(prefix="bench-stage1-"))
    full, writers_only = {}, {}
    try:
        for codec in codecs:
            if args.essential:
                full[codec] = run_full_path(target, samples, bucket_edges, codec, args.batch_tokens,
                                            args.writer_processes, device, store_root / f"store-{codec}")
                shutil.rmtree(store_root / f"store-{codec}", ignore_errors=True)
                say_full(f"full stage one, {codec}", full[codec])
                continue
            pool = capture_pool(target, batches, codec, device)
            writers_only[codec] = run_full_path(target, samples, bucket_edges, codec, args.batch_tokens,
                                                args.writer_processes, device, store_root / f"writers-{codec}", pool)
            del pool
            shutil.rmtree(store_root / f"writers-{codec}", ignore_errors=True)
            progress(f"writers alone, {codec}: {writers_only[codec]['tokens'] / writers_only[codec]['seconds']:,.0f} "
                     f"tokens/s")
            full[codec] = run_full_path(target, samples, bucket_edges, codec, args.batch_tokens, args.writer_processes,
                                        device, store_root / f"store-{codec}")
            shutil.rmtree(store_root / f"store-{codec}", ignore_errors=True)
            say_full(f"full stage one, {codec}", full[codec])
        compiled = None
        if args.compile_layers:
            compiled = compiled_capture(target, warmup, batches, codecs[0], device)
            full[f"{codecs[0]}, compiled layers"] = run_full_path(target, samples, bucket_edges, codecs[0],
                                                                  args.batch_tokens, args.writer_processes, device,
                                                                  store_root / "store-compiled")
            shutil.rmtree(store_root / "store-compiled", ignore_errors=True)
            say_full(f"full stage one, {codecs[0]}, compiled layers", full[f"{codecs[0]}, compiled layers"])
        profiled = profile_passes(target, batches, samples, bucket_edges, codecs[0], args, device,
                                  store_root) if args.profile else None
    finally:
        if not args.store_dir:
            shutil.rmtree(store_root, ignore_errors=True)
    lengths = [len(s) for s in samples]
    flops = {"bare": 2 * all_params * real_tokens + attention_flops(config, config.num_hidden_layers, lengths),
             "cut": 2 * cut_params * real_tokens + attention_flops(config, layer_ids[-1] + 1, lengths)}
    report(args, argv, config, layer_ids, real_tokens, padded_tokens, all_params, cut_params, flops,
           bare_seconds, unmasked_seconds, capture_seconds, codecs[0], full, writers_only, profiled,
           labels_seconds, compiled)
    return 0


def say_full(name: str, numbers: dict) -> None:
    handoff = numbers["handoff"]
    progress(f"{name}: {numbers['tokens'] / numbers['seconds']:,.0f} tokens/s, {numbers['bytes_per_token']:,.0f} "
             f"B/token; of {numbers['seconds']:.1f} s, {numbers['writer_wait_seconds']:.1f} s blocked on writer "
             f"queues, {numbers['drain_seconds']:.1f} s draining the writers after the last forward; hand-off "
             f"threads: {handoff.get('slot_copy', 0):.2f} s copying {handoff.get('batches', 0)} batches into slots "
             f"(longest {handoff.get('slot_copy_max', 0):.2f} s)")


def report(args, argv, config, layer_ids, real_tokens, padded_tokens, all_params, cut_params, flops,
           bare_seconds, unmasked_seconds, capture_seconds, capture_codec, full, writers_only,
           profiled=None, labels_seconds=None, compiled=None) -> None:
    raw_bytes = REAL_LAYER_COUNT * config.hidden_size * 2
    bare_rate = real_tokens / bare_seconds
    rows = [["bare forward (logits_to_keep=1)", bare_rate, 1.0, mfu(flops["bare"], bare_seconds), "", "", ""]]
    if unmasked_seconds is not None:
        rate = real_tokens / unmasked_seconds
        rows.append(["  same without the padding mask (as capture runs)", rate, rate / bare_rate,
                     mfu(flops["bare"], unmasked_seconds), "", "", ""])
    rate = real_tokens / capture_seconds
    rows.append([f"capture + encode {capture_codec} + copy to host", rate, rate / bare_rate,
                 mfu(flops["cut"], capture_seconds), "", "", ""])
    if compiled is not None:
        rate = real_tokens / compiled["seconds"]
        rows.append([f"  same, decoder layers compiled ({compiled['warmup_seconds']:.0f} s warm-up, features "
                     f"{compiled['relative_l2']:.1e} from eager)", rate, rate / bare_rate,
                     mfu(flops["cut"], compiled["seconds"]), "", "", ""])
        compiled.update(tokens_per_s=rate, ratio_to_bare=rate / bare_rate, mfu=mfu(flops["cut"], compiled["seconds"]))
    if labels_seconds is not None:
        rate = real_tokens / labels_seconds
        rows.append([f"capture + target labels + encode {capture_codec} + copy ({labels_seconds / capture_seconds:.3f}x "
                     f"the time without)", rate, rate / bare_rate, mfu(flops["bare"], labels_seconds), "", "", ""])
    for codec, numbers in full.items():
        rate = numbers["tokens"] / numbers["seconds"]
        rows.append([f"full stage one, {codec} (zarr write)", rate, rate / bare_rate,
                     mfu(flops["cut"], numbers["seconds"]), numbers["bytes_per_token"],
                     raw_bytes / numbers["bytes_per_token"], numbers["stored_bytes"] / numbers["seconds"] / 1e6])
        loop_seconds = numbers["seconds"] - numbers["drain_seconds"]
        loop_rate = numbers["tokens"] / loop_seconds
        rows.append(["  same, before the final drain", loop_rate, loop_rate / bare_rate,
                     mfu(flops["cut"], loop_seconds), "", "", ""])
        span_rate = numbers["tokens"] / numbers["forward_span_seconds"]
        rows.append([f"  same, first forward to last copy (a long run's rate; {numbers['fixed_seconds']:.1f} s "
                     f"outside it, paid once per run)", span_rate, span_rate / bare_rate,
                     mfu(flops["cut"], numbers["forward_span_seconds"]), "", "", ""])
        numbers.update(tokens_per_s_steady=span_rate, ratio_to_bare_steady=span_rate / bare_rate,
                       mfu_steady=mfu(flops["cut"], numbers["forward_span_seconds"]))
        numbers.update(tokens_per_s=rate, ratio_to_bare=rate / bare_rate,
                       mfu=mfu(flops["cut"], numbers["seconds"]),
                       write_mb_per_s=numbers["stored_bytes"] / numbers["seconds"] / 1e6,
                       tokens_per_s_before_drain=loop_rate, ratio_to_bare_before_drain=loop_rate / bare_rate)
    print_table("stage one", ["path", "tokens/s", "x bare", "MFU", "bytes/token", "x smaller than bf16", "write MB/s"],
                rows)
    for numbers in writers_only.values():
        numbers["tokens_per_s"] = numbers["tokens"] / numbers["seconds"]
        numbers["write_mb_per_s"] = numbers["stored_bytes"] / numbers["seconds"] / 1e6
    print_table("writer processes", ["codec", "processes", "writers alone tokens/s", "writers alone x bare"],
                [[c, n["writer_processes"], n["tokens_per_s"], n["tokens_per_s"] / bare_rate]
                 for c, n in writers_only.items()])
    if profiled:
        report_profile(profiled)
    write_results(args.out, {
        "meta": run_metadata(["tools/bench_stage1.py", *argv]), "quick": args.quick, "profile": profiled,
        "capture_seconds": capture_seconds, "capture_with_labels_seconds": labels_seconds,
        "target": {"num_hidden_layers": config.num_hidden_layers, "hidden_size": config.hidden_size,
                   "layer_ids": layer_ids, "layer_params": all_params, "layer_params_run": cut_params},
        "tokens": real_tokens, "padded_tokens": padded_tokens, "tflop": {k: v / 1e12 for k, v in flops.items()},
        "raw_bf16_bytes_per_token": raw_bytes,
        "bare": {"seconds": bare_seconds, "tokens_per_s": bare_rate, "mfu": mfu(flops["bare"], bare_seconds)},
        "bare_unmasked": None if unmasked_seconds is None else {
            "seconds": unmasked_seconds, "tokens_per_s": real_tokens / unmasked_seconds,
            "ratio_to_bare": bare_seconds / unmasked_seconds, "mfu": mfu(flops["bare"], unmasked_seconds)},
        "capture_only": {"codec": capture_codec, "seconds": capture_seconds,
                         "tokens_per_s": real_tokens / capture_seconds,
                         "ratio_to_bare": real_tokens / capture_seconds / bare_rate,
                         "mfu": mfu(flops["cut"], capture_seconds)},
        "capture_compiled": compiled, "full": full, "writers_only": writers_only,
    })


def report_profile(profiled: dict) -> None:
    passes = {"capture only": profiled["capture_only"], f"full path, {profiled['codec']}": profiled["full"]}
    print_table("GPU timeline (profiler)", ["pass", "span s", "GPU busy s", "busy", "kernel s", "idle s",
                                            "gaps >= 1 ms", "in those gaps s"],
                [[name, p["span_s"], p["busy_s"], p["busy_fraction"], p["kernel_s"], p["idle_s"], p["gaps_over_1ms"],
                  p["gap_seconds_over_1ms"]] for name, p in passes.items()])
    for name, p in passes.items():
        print(f"\n{name}: the target's thread during the GPU's gaps >= 1 ms (s, nested events each count): "
              + ", ".join(f"{k} {v:.3f}" for k, v in p["main_thread_during_gaps_s"].items()))
        for gap in p["longest_gaps"][:4]:
            print(f"  gap of {gap['seconds'] * 1e3:.1f} ms at {gap['at_s']:.2f} s: {', '.join(gap['main_thread_in'])}")
        print(f"  {p['before_first_gpu_event_s']:.2f} s before the first GPU event (the thread in: "
              + ", ".join(f"{k} {v:.3f}" for k, v in list(p["main_thread_before_gpu_s"].items())[:6])
              + f"), {p['after_last_gpu_event_s']:.2f} s after the last")
        print("  host calls: " + ", ".join(f"{k} x{v['count']} {v['seconds']:.3f} s (longest {v['longest_s']:.3f})"
                                           for k, v in sorted(p["host_calls"].items())))
        print(f"  trace: {p['trace']}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
