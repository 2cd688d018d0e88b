"""Benchmark stage two: the real training step at the `qwen3.6-27b` drafter size on synthetic data.

Builds the drafter with dflash/train/step.py's own pieces (`build_model`: fp32 master weights,
`build_optimizer`: fused AdamW, `apply_parallelism`: compiled layers), a frozen random
248,320 x 5120 bf16 embedding and LM head, and synthetic packed micro-batches of the real
shape made by `dflash.train.batch.collate_packed`: sequences from a log-uniform length mix over
64..4096, random fp8-encoded context features (5 x 5120 per token), loss masks ~70%
supervised, up to 512 anchors per sequence, block 16. Every step is `dflash.train.step.train_step`.

Modes:
  peer     exactly 8,192 source tokens (one 8,192-token sequence) and 512 anchors x 16 per
           optimizer step, one micro-batch: the peers' step (speculators 310 ms, SpecForge 374 ms).
  default  micro-batches packed by `dflash.train.sampler.build_epoch_schedule` under the config's
           train.token_budget, train.accum_steps micro-batches per optimizer step.
After a warm-up over every distinct step (compile, autotune), N steps are timed with CUDA
events. Reported: ms/step, source tokens/s, anchor-slots/s, MFU by the issue-5 formula,
peak memory; `--profile DIR` adds a torch.profiler trace and counts host-device syncs;
`--loader` writes a small synthetic store with dflash/store/writer.py and measures the DataLoader's
own throughput against what the trainer consumes; `--fed-epochs N` then trains N epochs over
that store fed by the loader, as stage two's loop does, and reports the data-wait fraction.
`--loader-only --stand-in-tokens-per-s R` does the same on any machine with a stand-in step that
busies the main thread as long as a trainer at R tokens/s would (R from a GPU run).

    python tools/bench_stage2.py --out bench/stage2.json --loader --profile bench/trace   # H200
    python tools/bench_stage2.py --quick --loader --out /tmp/stage2.json                  # CPU
    torchrun --nproc-per-node 2 tools/bench_stage2.py --modes peer --out bench/ddp.json    # DDP, 2 GPUs
    python tools/bench_stage2.py --target smollm2-135m --modes default --compile --token-budget 16384 \
        --accum-steps 2 --out bench/small.json      # the SmolLM2-sized auto drafter (issue 24)
"""

import time

PROCESS_START = time.perf_counter()  # a cold start counted from here too: setup before the first step included

import argparse
import atexit
import contextlib
import json
import os
import shutil
import sys
import tempfile
import warnings
from collections import Counter, defaultdict
from pathlib import Path

if "--cold" in sys.argv:  # before torch reads them: empty compile caches, as on a new machine
    _cold_dir = tempfile.mkdtemp(prefix="dflash-cold-")
    atexit.register(shutil.rmtree, _cold_dir, ignore_errors=True)  # the caches served this run only
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(_cold_dir, "inductor")
    os.environ["TRITON_CACHE_DIR"] = os.path.join(_cold_dir, "triton")
    if "--cold-serial" in sys.argv:  # kernels compile in this process, one at a time: each one's own seconds
        os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    # Every graph compiled past a function's first says why (the guard that failed): a cold start's
    # graph count is then accounted for in the log (on 12-02 the default budget had 9 graphs, the peers' step 7).
    os.environ.setdefault("TORCH_LOGS", "recompiles")

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchlib import (StackSampler, gpu_gaps, log_uniform_lengths, print_table, run_metadata,  # noqa: E402
                      synchronize, write_results)

from dflash.train.compile_cache import CompileProgress, compile_summary, describe_compile  # noqa: E402
from dflash.model import block_attention  # noqa: E402
from dflash.train import warm_kernels  # noqa: E402
from dflash.model.loss import CE_KERNELS  # noqa: E402
from dflash.model.masks import flex_kernel_options  # noqa: E402

PEAK_BF16_FLOPS = 790e12
SYNC_EVENT_NAMES = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "Memcpy DtoH")


# --------------------------------------------------------------------------- set-up


def bench_config(args):
    from dflash.config import Config, replace

    size = "tiny" if args.quick else "qwen3.6-27b"
    train = {"compile": args.compile}
    if args.quick:
        train.update(token_budget=256, accum_steps=2, max_anchors=8, loss_chunk=256, num_workers=1)
    if args.token_budget:
        train["token_budget"] = args.token_budget
    if args.accum_steps:
        train["accum_steps"] = args.accum_steps
    if args.anchor_budget:
        train["anchor_budget"] = args.anchor_budget
    if args.workers:
        train["num_workers"] = args.workers
    if getattr(args, "loss_chunk", 0):
        train["loss_chunk"] = args.loss_chunk
    if getattr(args, "fuse_accum", False):
        train["fuse_accum"] = True
    if getattr(args, "gather_keys", False):
        train["gather_context_keys"] = True
    if getattr(args, "optimizer", ""):
        train["optimizer"] = args.optimizer
    if getattr(args, "loss_kernel", ""):
        train["loss_kernel"] = args.loss_kernel
    data = {"max_length": min(4096, train.get("token_budget", Config().train.token_budget))}
    return replace(Config(), drafter={"size": size}, train=train, data=data)


# Targets whose `auto` drafter the bench can size without their checkpoint (`--target NAME`): the text
# config summary stage one records in a store (dflash.extract.target.text_config_summary).
TARGET_SHAPES = {
    "smollm2-135m": {"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
                     "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152,
                     "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 8192},
}


def bench_drafter_args(config, target: str):
    """The named size's arguments, or (`--target`) the `auto` drafter of a target: a name of
    TARGET_SHAPES or a checkpoint directory, whose config is read as stage one reads it."""
    from dflash.extract.target import default_layer_ids, text_config_summary
    from dflash.model.drafter import auto_drafter_args, drafter_args

    if not target:
        # The named size's own mask token (the config's -1 means "the store's choice"; there is no store here).
        return drafter_args(config.drafter.size, block_size=config.drafter.block_size)
    if target in TARGET_SHAPES:
        summary = TARGET_SHAPES[target]
    else:
        from transformers import AutoConfig

        summary = text_config_summary(AutoConfig.from_pretrained(target))
    layer_ids = default_layer_ids(summary["num_hidden_layers"], 5)
    return auto_drafter_args(summary, layer_ids, mask_token_id=0, block_size=config.drafter.block_size)


def build_trainer(config, dist, target: str = "", attention: str = ""):
    """Model, optimizer, wrapped model (DDP under torchrun) and TrainContext as stage two builds them."""
    from dflash.model.loss import default_gamma, gamma_weights
    from dflash.model.masks import training_backend
    from dflash.train.step import TrainContext, apply_parallelism, build_model, build_optimizer, triton_or

    device = dist.device
    args = bench_drafter_args(config, target)
    model = build_model(config, args, dist)
    optimizer = build_optimizer(model, config)
    wrapped = apply_parallelism(model, config, dist)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    generator = torch.Generator(device=device).manual_seed(0)
    embed_VH = (torch.randn(args.vocab_size, args.hidden_size, device=device, dtype=dtype, generator=generator)
                * 0.02)
    lm_head_VH = (torch.randn(args.vocab_size, args.hidden_size, device=device, dtype=dtype, generator=generator)
                  * 0.02)
    ctx = TrainContext(args=args, codec="fp8", embed_VH=embed_VH, lm_head_VH=lm_head_VH,
                       weights_B=gamma_weights(args.block_size, default_gamma(args.block_size), device=device),
                       backend=training_backend(attention or config.train.attention, device, args.head_dim,
                                                config.train.gather_context_keys),
                       loss_chunk=config.train.loss_chunk, device=device,
                       loss_kernel=triton_or(config.train.loss_kernel, "compiled", device))
    return model, optimizer, wrapped, ctx


# --------------------------------------------------------------------------- synthetic data


class FeaturePool:
    """A pool of random fp8-encoded context-feature rows; samples take consecutive rows from it."""

    def __init__(self, num_rows: int, num_layers: int, hidden_size: int, device: torch.device, seed: int):
        from dflash.store import codecs

        generator = torch.Generator(device=device).manual_seed(seed)
        hidden, scale = [], []
        for start in range(0, num_rows, 1024):
            rows = min(1024, num_rows - start)
            features = torch.randn(rows, num_layers, hidden_size, device=device, generator=generator)
            encoded = codecs.encode(features, "fp8")
            hidden.append(encoded["hidden"].cpu())
            scale.append(encoded["scale"].cpu())
        self.hidden = torch.cat(hidden).numpy()
        self.scale = torch.cat(scale).numpy()

    def rows(self, start: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        start = start % (len(self.hidden) - length + 1)
        return self.hidden[start:start + length], self.scale[start:start + length]


def supervised_start(length: int, rng: np.random.Generator) -> int:
    """Where the supervised answer starts: after a prompt of 20-40% of the sample."""
    return max(1, int(rng.uniform(0.2, 0.4) * length))


def synthetic_item(pool: FeaturePool, length: int, row_id: int, bucket: int, max_anchors: int,
                   vocab_size: int, rng: np.random.Generator, num_anchors: int | None = None,
                   start: int | None = None) -> dict:
    """One `StoreDataset`-shaped item: prompt unsupervised, answer (from `start`) supervised, sorted anchors."""
    from dflash.model.anchors import eligible_anchors, sample_anchors

    loss_mask = np.zeros(length, dtype=bool)
    loss_mask[supervised_start(length, rng) if start is None else start:] = True
    if num_anchors is None:
        anchors = sample_anchors(loss_mask, max_anchors, rng)
    else:
        anchors = np.sort(rng.choice(eligible_anchors(loss_mask), size=num_anchors, replace=False))
    hidden, scale = pool.rows(int(rng.integers(0, 1 << 30)), length)
    return {"hidden": hidden, "scale": scale, "input_ids": rng.integers(0, vocab_size, length, dtype=np.int64),
            "loss_mask": loss_mask, "row_id": row_id, "anchors": anchors, "sample_index": row_id,
            "epoch": 0, "bucket": bucket}


def collate_options(ctx, config, mask_rule: bool = False) -> dict:
    """What the trainer's loop passes to the collate (`--gather-keys` changes it);
    `mask_rule` (`--mask-rule`): no tile layouts, so the block masks come from create_block_mask."""
    from dflash.train.batch import collate_options as trainer_options

    options = trainer_options(ctx.backend, ctx.args, config.train.gather_context_keys)
    return dict(options, mask_windows=None, gather_keys=False) if mask_rule else options


def peer_steps(pool, args_drafter, num_distinct: int, seed: int, options: dict) -> list[list[dict]]:
    """Steps of one micro-batch: one 8,192-token sequence with exactly 512 anchors."""
    from dflash.train.batch import collate_packed

    rng = np.random.default_rng(seed)
    steps = []
    for step in range(num_distinct):
        item = synthetic_item(pool, 8192, step, 0, 512, args_drafter.vocab_size, rng, num_anchors=512)
        steps.append([collate_packed([item], **dict(options, pad_multiple=128))])
    return steps


def length_range(config, lengths_arg: str = "") -> tuple[int, int]:
    """The synthetic sequences' length range: `--lengths LOW,HIGH`, else 64..min(4096, max_length)."""
    high = min(4096, config.data.max_length)
    if not lengths_arg:
        return min(64, high // 2), high
    low, high = (int(x) for x in lengths_arg.split(","))
    if not 2 <= low < high <= config.data.max_length + 1:
        raise SystemExit(f"--lengths {lengths_arg}: need 2 <= LOW < HIGH <= data.max_length + 1 "
                         f"({config.data.max_length + 1})")
    return low, high


def default_steps(pool, config, args_drafter, num_distinct: int, seed: int, options: dict,
                  lengths_arg: str = "") -> list[list[dict]]:
    """Steps as the sampler builds them: bucketed packing under token_budget, accum_steps each (with
    train.fuse_accum, one micro-batch of them all, as the trainer's loader packs them)."""
    from dflash.store.plan import assign_bucket
    from dflash.train.batch import collate_packed
    from dflash.train.sampler import build_epoch_schedule

    edges = config.store.bucket_edges
    low, high = length_range(config, lengths_arg)
    lengths = log_uniform_lengths(num_distinct * config.train.accum_steps * config.train.token_budget // 200 + 64,
                                  low, high, seed)
    buckets = np.array([assign_bucket(int(n), edges) for n in lengths])
    rng = np.random.default_rng(seed)
    starts = np.array([supervised_start(int(n), rng) for n in lengths], dtype=np.int64)
    schedule = build_epoch_schedule(lengths, buckets, config.train.token_budget, 1, config.train.accum_steps, seed, 0,
                                    anchors=np.minimum(lengths - starts, config.train.max_anchors),
                                    anchor_budget=config.train.anchor_budget)
    steps = []
    for step in range(min(num_distinct, schedule.num_steps)):
        groups = []
        for group, samples in enumerate(schedule.step(step)[0]):
            items = [synthetic_item(pool, int(lengths[i]), int(i), int(buckets[i]), config.train.max_anchors,
                                    args_drafter.vocab_size, rng, start=int(starts[i])) for i in samples]
            groups.append([dict(item, group=group) for item in items] if config.train.fuse_accum else items)
        if config.train.fuse_accum:
            groups = [[item for items in groups for item in items]]
        steps.append([collate_packed(items, **options) for items in groups])
    return steps


def pin(steps: list[list[dict]]) -> list[list[dict]]:
    if not torch.cuda.is_available():
        return steps
    return [[{k: v.pin_memory() if torch.is_tensor(v) else v for k, v in b.items()} for b in step] for step in steps]


# --------------------------------------------------------------------------- measurement


def step_flops(args_drafter, source_tokens: int, anchors: int) -> float:
    """Issue 5's per-step FLOP count: dense drafter + fc + context K/V projections + LM head."""
    from dflash.model.drafter import count_parameters

    fc_params = args_drafter.context_feature_size * args_drafter.hidden_size
    non_fc = count_parameters(args_drafter) - fc_params
    slots = anchors * args_drafter.block_size
    kv_width = args_drafter.num_key_value_heads * args_drafter.head_dim
    return (6 * non_fc * slots + 6 * fc_params * source_tokens
            + args_drafter.num_layers * 12 * args_drafter.hidden_size * kv_width * source_tokens
            + 4 * args_drafter.hidden_size * args_drafter.vocab_size * slots)


ATTENTION_FLOPS_PER_PAIR_DIM = 14  # per (query, key) pair and head dimension: forward QK and PV (4), backward 10


def attention_pairs(batch: dict, args_drafter) -> dict:
    """A micro-batch's attention work over every layer and query head: `visible` (query, key) pairs, the
    rule's (the work an exact kernel would do), and `listed` pairs, those of the tiles its block masks list
    (partial and full: the work flex attention does; None where the batch has no tile layout: the rule's masks,
    or the blockwise kernels')."""
    from dflash.model.masks import layer_windows
    from dflash.model.tiles import tiles_key

    block = args_drafter.block_size
    pos_A = np.asarray(batch["anchor_pos"], dtype=np.int64)
    real_A = np.asarray(batch["anchor_doc"]) >= 0
    slot_S = np.arange(block)
    visible, listed = 0, 0
    windows = layer_windows(args_drafter.layer_types, args_drafter.sliding_window)
    for layer_type in args_drafter.layer_types:
        key = tiles_key(layer_type)
        if key not in batch:
            listed = None
        elif listed is not None:
            layout = np.asarray(batch[key])
            tile = len(pos_A) * block // layout.shape[1]
            listed += int(layout[0, :, 0].sum() + layout[1, :, 0].sum()) * tile * tile
        window = windows[layer_type]
        pos_AS = pos_A[real_A][:, None]
        if window is None:  # the whole prefix and the whole block
            visible += int(pos_AS.sum()) * block + int(real_A.sum()) * block * block
        else:  # the prefix within the window, the block up to the row's own slot
            first_AS = np.maximum(0, pos_AS + slot_S[None] - window + 1)
            visible += int((pos_AS - first_AS).clip(min=0).sum()) + int(real_A.sum()) * block * (block + 1) // 2
        visible += int((~real_A).sum()) * (block * block if window is None else block * (block + 1) // 2)
    heads = args_drafter.num_attention_heads
    return {"visible": visible * heads, "listed": listed * heads if listed is not None else None}


def attention_work(steps: list[list[dict]], args_drafter, num_steps: int) -> dict | None:
    """`attention_pairs` per optimizer step over the first `num_steps` steps (cycling) and the TFLOP of the
    visible and the listed pairs (forward and backward; the listed ones None without tile layouts)."""
    pairs = [attention_pairs(batch, args_drafter) for index in range(num_steps)
             for batch in steps[index % len(steps)]]
    if not pairs:
        return None
    flops = ATTENTION_FLOPS_PER_PAIR_DIM * args_drafter.head_dim
    visible = sum(p["visible"] for p in pairs) / num_steps
    work = {"visible_pairs_per_step": visible, "tflop_per_step_visible": visible * flops / 1e12,
            "listed_pairs_per_step": None, "listed_visible_fraction": None, "tflop_per_step_listed": None}
    if all(p["listed"] is not None for p in pairs):
        listed = sum(p["listed"] for p in pairs) / num_steps
        work.update(listed_pairs_per_step=listed, listed_visible_fraction=visible / listed if listed else 0.0,
                    tflop_per_step_listed=listed * flops / 1e12)
    return work


def run_step(wrapped, ctx, optimizer, step: list[dict], config):
    from dflash.train.step import to_device, train_step

    micro_batches = [to_device(batch, ctx.device) for batch in step]
    return train_step(wrapped, ctx, micro_batches, optimizer, config.train.lr, config.train.clip)


def time_steps(wrapped, ctx, optimizer, steps, config, num_steps: int) -> list[float]:
    """Milliseconds of each of `num_steps` steps (cycling through `steps`), CUDA events on a GPU."""
    device = ctx.device
    if device.type != "cuda":
        times = []
        for index in range(num_steps):
            start = time.perf_counter()
            run_step(wrapped, ctx, optimizer, steps[index % len(steps)], config)
            times.append((time.perf_counter() - start) * 1e3)
        return times
    events = [torch.cuda.Event(enable_timing=True) for _ in range(num_steps + 1)]
    host_ms = []
    events[0].record()
    for index in range(num_steps):
        start = time.perf_counter()
        run_step(wrapped, ctx, optimizer, steps[index % len(steps)], config)
        host_ms.append((time.perf_counter() - start) * 1e3)
        events[index + 1].record()
    torch.cuda.synchronize(device)  # sync: end of the timed loop
    HOST_MS.extend(host_ms)
    return [events[i].elapsed_time(events[i + 1]) for i in range(num_steps)]


# Host milliseconds each timed step took to enqueue (no sync inside a step: when this is close to
# the step's GPU time, the step is bound by the host's Python and launches, not by the GPU).
HOST_MS: list[float] = []
FIRST_STEP_END: dict = {}  # seconds from the process's start to the end of its first optimizer step


class KernelCompileTimes:
    """Seconds spent per Triton kernel in this process while compiling: each config's compile
    (`CachingAutotuner._precompile_config`: Triton to PTX, ptxas; with parallel compile workers the
    main process mostly loads what they built) and autotuning (`benchmark_all_configs`), by kernel name."""

    def __init__(self):
        self.seconds = defaultdict(float)
        self.counts = Counter()
        self.patched = []

    def __enter__(self):
        try:
            from torch._inductor.runtime.triton_heuristics import CachingAutotuner
        except ImportError:  # no Triton (a CPU machine): nothing to time
            return self
        for method, phase in (("_precompile_config", "compile"), ("benchmark_all_configs", "autotune")):
            original = getattr(CachingAutotuner, method, None)
            if original is None:
                continue
            setattr(CachingAutotuner, method, self.timed(original, phase))
            self.patched.append((CachingAutotuner, method, original))
        return self

    def timed(self, original, phase: str):
        def wrapper(autotuner, *args, **kwargs):
            start = time.perf_counter()
            try:
                return original(autotuner, *args, **kwargs)
            finally:
                name = f"{phase}: {getattr(getattr(autotuner, 'fn', None), '__name__', '?')[:80]}"
                self.seconds[name] += time.perf_counter() - start
                self.counts[name] += 1
        return wrapper

    def __exit__(self, *exc) -> None:
        for owner, method, original in self.patched:
            setattr(owner, method, original)

    def summary(self, top: int = 15) -> dict:
        ranked = sorted(self.seconds.items(), key=lambda item: -item[1])
        by_phase = defaultdict(float)
        for name, seconds in ranked:
            by_phase[name.split(":")[0]] += seconds
        return {"kernels": len(ranked), "seconds_by_phase": dict(by_phase),
                "slowest": [{"kernel": name, "seconds": seconds, "calls": self.counts[name]}
                            for name, seconds in ranked[:top]]}


def compile_monitor(name: str, every: float = 30.0):
    """Prints the compile time so far every `every` seconds while a warm-up runs (every rank under
    DDP: the first step waits for the slowest rank's compile), so a run cut short by its time limit
    still shows where its warm-up went."""
    rank = f"rank {os.environ['RANK']}, " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    return CompileProgress(lambda text: print(text, flush=True), every=every, prefix=f"{name}: {rank}warm-up")


def measure_mode(name, wrapped, ctx, optimizer, steps, config, num_steps: int, sample_first: bool = False) -> dict:
    warmup_s = []
    sampled = {}
    with compile_monitor(name), KernelCompileTimes() as kernels:
        warm_up(name, wrapped, ctx, optimizer, steps, config, warmup_s, sampled if sample_first else None)
    compiled = compile_summary()
    compiled["triton_kernels"] = kernels.summary()
    if compiled and os.environ.get("RANK", "0") == "0":
        print(f"{name}: compile totals after warm-up: {describe_compile(compiled)}", flush=True)
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    HOST_MS.clear()
    times_ms = time_steps(wrapped, ctx, optimizer, steps, config, num_steps)
    numbers = summarize_mode(name, ctx, steps, times_ms, num_steps, warmup_s, compiled)
    numbers["host_ms_per_step_median"] = float(np.median(HOST_MS)) if HOST_MS else None
    if sampled:
        numbers["first_step_sampled"] = sampled
    return numbers


AB_SWITCHES = ("cast-weights-once", "compile-norms")  # --ab: what a variant may switch on


def ab_switches_used(variants: list[str]) -> set[str]:
    """The switches some --ab variant turns on (the others stay as the command line set them)."""
    return {switch for variant in variants for switch in variant.split("+")}


def ab_switches(model, ctx) -> dict:
    """Each --ab switch: a function that turns it on or off in this process, on the model built once."""
    from dflash.model.drafter import compiled_norm, rms_norm

    compiled = []

    def norms(on: bool) -> None:  # as compile_layers does under drafter.COMPILE_NORMS
        if on and not compiled:
            compiled.append(compiled_norm())
        model.norm_fn = compiled[0] if on else rms_norm

    return {"cast-weights-once": lambda on: setattr(ctx, "cast_weights_once", on), "compile-norms": norms}


def measure_ab(name, wrapped, ctx, optimizer, steps, config, num_steps: int, variants: list[str], rounds: int,
               switches: dict) -> dict:
    """Variants of the step timed in turn in one process: each (`base`, or switches joined by `+`) warmed on every
    distinct step, then `rounds` rounds of `num_steps` steps of each in turn, so the machine's state and the data are
    the same for all and no process is set up twice. Per variant: ms/step (median), tokens/s and MFU over all its
    rounds, each round's median, and the ratio of its median to base's."""
    def apply(variant: str) -> None:
        on = set(variant.split("+"))
        for switch, turn in switches.items():
            turn(switch in on)

    for variant in variants:
        if variant != "base":  # base is the mode's own step, warmed before its timing
            apply(variant)
            warm_up(f"{name} {variant}", wrapped, ctx, optimizer, steps, config, [])
    times = {variant: [] for variant in variants}
    for _ in range(rounds):
        for variant in variants:
            apply(variant)
            times[variant].append(time_steps(wrapped, ctx, optimizer, steps, config, num_steps))
    apply("base")
    results = {}
    for variant, rounds_ms in times.items():
        summary = summarize_mode(name, ctx, steps, [ms for round_ms in rounds_ms for ms in round_ms],
                                 num_steps * rounds, [], {})
        results[variant] = {key: summary[key] for key in ("ms_per_step_median", "ms_per_step_mean", "tokens_per_s",
                                                          "mfu")}
        results[variant]["round_medians_ms"] = [float(np.median(round_ms)) for round_ms in rounds_ms]
    for numbers in results.values():
        numbers["vs_base"] = numbers["ms_per_step_median"] / results["base"]["ms_per_step_median"]
    return results


def warm_up(name, wrapped, ctx, optimizer, steps, config, warmup_s: list, sampled: dict | None = None) -> None:
    """Runs each distinct step once; with `sampled` (a dict) the first one's main thread is sampled
    (benchlib.StackSampler) and its report printed and kept there."""
    for step in steps:  # warm-up: every distinct shape compiles and autotunes once
        start = time.perf_counter()
        sampler = StackSampler() if sampled is not None and not warmup_s else None
        with sampler or contextlib.nullcontext():
            run_step(wrapped, ctx, optimizer, step, config)
            synchronize(ctx.device)
        warmup_s.append(time.perf_counter() - start)
        if sampler is not None:
            sampled.update(sampler.print_report(f"{name}: the first step's main thread, sampled"))
        if len(warmup_s) == 1 and FIRST_STEP_END.get("s") is None:  # the process's first optimizer step
            FIRST_STEP_END["s"] = time.perf_counter() - PROCESS_START
        print(f"{name}: warm-up step {len(warmup_s)} of {len(steps)} took {warmup_s[-1]:.1f} s", flush=True)


def summarize_mode(name, ctx, steps, times_ms, num_steps: int, warmup_s: list, compiled: dict) -> dict:
    used = [steps[i % len(steps)] for i in range(num_steps)]
    tokens = sum(int(b["num_real_tokens"]) for step in used for b in step)
    anchors = sum(int(b["num_real_anchors"]) for step in used for b in step)
    seconds = sum(times_ms) / 1e3
    flops = sum(step_flops(ctx.args, int(b["num_real_tokens"]), int(b["num_real_anchors"]))
                for step in used for b in step)
    cuda = ctx.device.type == "cuda"
    return {
        "mode": name, "steps": num_steps, "distinct_steps": len(steps), "warmup_seconds": warmup_s,
        "warmup_compile": compiled,
        "micro_batches_per_step": len(steps[0]),
        "ms_per_step_mean": float(np.mean(times_ms)), "ms_per_step_median": float(np.median(times_ms)),
        "source_tokens_per_step": tokens / num_steps, "anchors_per_step": anchors / num_steps,
        "tokens_per_s": tokens / seconds, "anchor_slots_per_s": anchors * ctx.args.block_size / seconds,
        "tflop_per_step": flops / num_steps / 1e12, "mfu": flops / seconds / PEAK_BF16_FLOPS,
        "peak_allocated_gib": torch.cuda.max_memory_allocated(ctx.device) / 2**30 if cuda else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(ctx.device) / 2**30 if cuda else None,
        "distinct_shapes": len({(int(b["num_tokens"]), len(b["anchor_pos"])) for s in steps for b in s}),
        "attention": attention_work(steps, ctx.args, num_steps),
    }


def profile_steps(wrapped, ctx, optimizer, steps, config, out_dir: Path, num_steps: int) -> dict:
    """A torch.profiler trace of `num_steps` steps and the sync events inside the steps (each step
    runs under a `record_function` label; the bench's closing synchronize and the one torch.profiler
    makes on exit fall outside them and are not counted); then the Python lines that synchronise,
    with the calls that led there, from `torch.cuda.set_sync_debug_mode` warnings."""
    from torch.profiler import ProfilerActivity, profile, record_function

    out_dir.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for index in range(num_steps):
            with record_function(f"{STEP_LABEL} {index}"):
                run_step(wrapped, ctx, optimizer, steps[index % len(steps)], config)
        synchronize(ctx.device)
    trace = out_dir / "stage2_trace.json"
    prof.export_chrome_trace(str(trace))
    events = list(prof.events())
    step_ranges = [(e.time_range.start, e.time_range.end) for e in events if e.name.startswith(STEP_LABEL)]
    counts = count_sync_events(events, step_ranges)
    host_ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:20]
    return {"trace": str(trace), "profiled_steps": num_steps, "kernel_time": kernel_time(events, num_steps),
            "gpu_gaps": gpu_gaps(json.loads(trace.read_text()), num_steps),
            "host_self_ms_per_step": {e.key[:90]: e.self_cpu_time_total / 1e3 / num_steps for e in host_ops},
            "host_calls_per_step": {e.key[:90]: e.count / num_steps for e in host_ops},
            "kernel_launches_per_step": sum(1 for e in events if e.name in ("cudaLaunchKernel", "cuLaunchKernel",
                                                                              "cudaLaunchKernelExC"))
            / num_steps,
            "sync_events_per_step": {name: counts[name] / num_steps for name in SYNC_EVENT_NAMES},
            "sync_events_outside_steps": {name: n - counts[name] for name, n in count_sync_events(events, None).items()
                                          if n > counts[name]},
            "sync_sites": sync_sites(wrapped, ctx, optimizer, steps, config)}


STEP_LABEL = "bench_stage2: profiled step"

ATTENTION_CLASSES = ("flex attention (Triton templates)", "dflash block attention (Triton)")

KERNEL_CLASSES = (  # (class, substrings of the kernel name), first match wins
    ("matmul (cuBLAS / CUTLASS)", ("gemm", "nvjet", "cutlass", "xmma", "cublas")),
    ("optimizer (multi-tensor apply, dflash AdamW)", ("multi_tensor_apply", "_adamw_kernel")),
    ("flex attention (Triton templates)", ("flex", "triton_tem")),
    ("dflash block attention (Triton)", ("forward_kernel", "dq_kernel", "dkdv_kernel")),
    ("compiled fused (Triton)", ("triton_",)),
    ("NCCL", ("nccl",)),
    ("ATen elementwise / reduce", ("elementwise", "reduce", "vectorized", "softmax", "index", "scatter", "gather")),
    ("copy / fill", ("memcpy", "memset", "copy", "fill")),
)


def kernel_time(events, num_steps: int) -> dict:
    """GPU kernel milliseconds per profiled step by kernel class, the 12 longest kernels, and each class's 6
    longest (so the classes outside the matmuls name what they are)."""
    by_class, by_name, class_of = Counter(), Counter(), {}
    for event in events:
        if getattr(event, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        name = event.name
        if name.startswith(STEP_LABEL) or "#" in name:  # the GPU-side spans of record_function labels
            continue
        ms = event.time_range.elapsed_us() / 1e3 / num_steps
        lowered = name.lower()
        kind = next((label for label, keys in KERNEL_CLASSES if any(k in lowered for k in keys)), "other")
        by_class[kind] += ms
        by_name[name[:90]] += ms
        class_of[name[:90]] = kind
    longest_by_class = defaultdict(dict)
    for name, ms in by_name.most_common():
        if len(longest_by_class[class_of[name]]) < 6:
            longest_by_class[class_of[name]][name] = ms
    return {"ms_per_step_by_class": dict(by_class.most_common()), "total_ms_per_step": sum(by_class.values()),
            "longest_kernels_ms_per_step": dict(by_name.most_common(12)),
            "longest_kernels_by_class": dict(longest_by_class)}


def count_sync_events(events, step_ranges) -> Counter:
    """Profiler events per name in SYNC_EVENT_NAMES: the host-side `cuda*Synchronize` calls only
    inside one of `step_ranges` (all of them when `step_ranges` is None), device-to-host copies
    wherever they fall (they run on the GPU's timeline, which lags the host's step ranges).
    `events` need `.name` and `.time_range.start/.end`."""
    counts = Counter()
    for event in events:
        start, end = event.time_range.start, event.time_range.end
        inside = step_ranges is None or any(low <= start and end <= high for low, high in step_ranges)
        for name in SYNC_EVENT_NAMES:
            if name in event.name and (inside or not name.startswith("cuda")):
                counts[name] += 1
    return counts


def sync_sites(wrapped, ctx, optimizer, steps, config) -> dict:
    """Every synchronising call in one step (CUDA only): `{file:line: {count, stack}}`."""
    if ctx.device.type != "cuda":
        return {}
    torch.cuda.set_sync_debug_mode("warn")
    try:
        # The text of c10's sync warning; set_sync_debug_mode's own "prototype feature ... synchronizing
        # operations" notice is not a sync.
        return warning_sites(lambda: run_step(wrapped, ctx, optimizer, steps[0], config),
                             "called a synchronizing CUDA operation")
    finally:
        torch.cuda.set_sync_debug_mode("default")


def warning_sites(fn, match: str, depth: int = 12) -> dict:
    """Run `fn` and collect the warnings whose message contains `match`: per `file:line` the count
    and, for the first one, the innermost `depth` frames of the Python stack that raised it (the
    line alone names only the library function that synchronised, not who called it)."""
    import traceback

    found: dict[str, dict] = {}

    def record(message, category, filename, lineno, file=None, line=None):
        if match not in str(message):
            return
        site = found.setdefault(f"{filename}:{lineno}", {"count": 0, "stack": []})
        site["count"] += 1
        if not site["stack"]:
            frames = [f for f in traceback.extract_stack()[:-1] if not f.filename.endswith("warnings.py")]
            site["stack"] = [f"{f.filename}:{f.lineno} in {f.name}" for f in frames[-depth:]]

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        fn()
    return found


# --------------------------------------------------------------------------- loader


def write_synthetic_store(path: Path, pool: FeaturePool, config, args_drafter, num_tokens: int, seed: int) -> None:
    """A store of the real row shape (fp8, n x H per token) holding about `num_tokens` tokens."""
    from dflash.store import plan
    from dflash.store import schema as store_format
    from dflash.store import writer as store_writer

    edges = config.store.bucket_edges
    high = min(4096, config.data.max_length)
    lengths = log_uniform_lengths(max(8, 4 * num_tokens // 64), min(64, high // 2), high, seed)
    lengths = lengths[: int(np.searchsorted(np.cumsum(lengths), num_tokens)) + 1]
    row_ids = np.arange(len(lengths), dtype=np.int64)
    shards = plan.plan_shards(lengths, row_ids, list(edges), config.store.shard_tokens)
    attrs = {"schema_version": store_format.SCHEMA_VERSION, "codec": "fp8", "hidden_size": args_drafter.hidden_size,
             "target_layer_ids": list(args_drafter.target_layer_ids), "bucket_edges": list(edges),
             "max_length": high, "target": {"vocab_size": args_drafter.vocab_size}, "config_hash": "bench",
             "shards": [{"name": s.name, "bucket": s.bucket, "num_samples": len(s.sample_indices),
                         "num_tokens": s.num_tokens} for s in shards]}
    group = store_writer.create_or_open_store(str(path), attrs, overwrite=True)
    rng = np.random.default_rng(seed)
    rows_per_chunk = config.extract.rows_per_chunk
    for shard in shards:
        writer = store_writer.ShardWriter(group, shard, lengths, row_ids, codec="fp8",
                                   num_layers=len(args_drafter.target_layer_ids), hidden_size=args_drafter.hidden_size,
                                   rows_per_chunk=rows_per_chunk,
                                   rows_per_zarr_shard=rows_per_chunk * config.extract.chunks_per_file)
        for i in shard.sample_indices:
            length = int(lengths[i])
            hidden, scale = pool.rows(int(rng.integers(0, 1 << 30)), length)
            loss_mask = np.zeros(length, dtype=np.uint8)
            loss_mask[int(0.3 * length):] = 1
            writer.write_sample(i, hidden, scale, rng.integers(0, args_drafter.vocab_size, length).astype(np.int32),
                                loss_mask)
        writer.commit()


def loader_over_store(config, ctx, store_dir: Path, epochs: int):
    """The trainer's DataLoader (dataset, schedule, collate) over `epochs` epochs of the store, in one loader."""
    from dflash.store.reader import StoreReader
    from dflash.train.batch import StoreDataset, build_loader
    from dflash.train.sampler import schedule_for

    reader = StoreReader(str(store_dir))
    dataset = StoreDataset(reader, config.train.max_anchors, config.train.seed)
    batches = []
    for epoch in range(epochs):
        schedule = schedule_for(config, reader, np.arange(len(reader)), epoch, 1, config.train.accum_steps)
        batches += [[(epoch, int(i)) for i in samples] for _, _, samples in schedule.rank_batches(0, 0)]
    loader = build_loader(dataset, batches, **collate_options(ctx, config), num_workers=config.train.num_workers,
                          pin_memory=ctx.device.type == "cuda")
    return reader, batches, loader


def measure_fed(config, ctx, store_dir: Path, epochs: int, step_fn, warm_steps: int = 2) -> dict:
    """Optimizer steps fed by the real loader, as dflash/train/loop.py's loop runs them: `step_fn(micro_batches)`
    is the step. The data-wait fraction is the host time blocked in `next(loader)` over the wall
    time of the timed steps (the first `warm_steps` steps, worker start-up and new shapes, are not timed)."""
    _, batches, loader = loader_over_store(config, ctx, store_dir, epochs)
    accum = config.train.accum_steps
    num_steps = len(batches) // accum
    if num_steps <= warm_steps:
        raise SystemExit(f"--loader-tokens x --fed-epochs gives {num_steps} optimizer steps; need more than "
                         f"{warm_steps}")
    iterator = iter(loader)
    wait, tokens, anchors = 0.0, 0, 0
    start = time.perf_counter()
    for step in range(num_steps):
        if step == warm_steps:
            synchronize(ctx.device)
            wait, tokens, anchors, start = 0.0, 0, 0, time.perf_counter()
        wait_start = time.perf_counter()
        micro_batches = [next(iterator) for _ in range(accum)]
        wait += time.perf_counter() - wait_start
        tokens += sum(int(b["num_real_tokens"]) for b in micro_batches)
        anchors += sum(int(b["num_real_anchors"]) for b in micro_batches)
        step_fn(micro_batches)
    synchronize(ctx.device)
    seconds = time.perf_counter() - start
    timed = num_steps - warm_steps
    return {"num_workers": config.train.num_workers, "timed_steps": timed, "untimed_warm_steps": warm_steps,
            "seconds": seconds, "data_wait_seconds": wait, "data_wait": wait / seconds,
            "ms_per_step": seconds / timed * 1e3, "tokens_per_s": tokens / seconds,
            "anchor_slots_per_s": anchors * ctx.args.block_size / seconds}


def stand_in_step_fn(tokens_per_s: float):
    """A stand-in for the GPU step: keeps the main thread busy (as eager kernel launches do) for as
    long as a trainer consuming `tokens_per_s` real tokens per second would take on these micro-batches."""
    def step(micro_batches):
        until = time.perf_counter() + sum(int(b["num_real_tokens"]) for b in micro_batches) / tokens_per_s
        while time.perf_counter() < until:
            pass
    return step


def measure_loader(config, ctx, store_dir: Path, epochs: int) -> dict:
    """Tokens/s of the trainer's own DataLoader (stage two's dataset, schedule and collate) over
    the synthetic store, `epochs` epochs in one loader. The batches the workers prefetch while
    starting are not timed: the rate is the steady state."""
    reader, batches, loader = loader_over_store(config, ctx, store_dir, epochs)
    workers = config.train.num_workers
    iterator = iter(loader)
    warm = min(len(batches) // 2, 1 + 2 * workers)  # worker start-up and its prefetch
    for _ in range(warm):
        next(iterator)
    start, tokens, count = time.perf_counter(), 0, 0
    for batch in iterator:
        tokens += int(batch["num_real_tokens"])
        count += 1
    seconds = time.perf_counter() - start
    return {"store_tokens": int(reader.sample_length.sum()), "num_workers": workers, "epochs": epochs,
            "micro_batches": count, "untimed_warm_micro_batches": warm, "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds if seconds > 0 else 0.0}


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny drafter on the CPU, two steps per mode")
    parser.add_argument("--out", required=True, help="JSON results file")
    parser.add_argument("--modes", default="peer,default", help="comma list of peer, default")
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps per mode")
    parser.add_argument("--distinct-steps", type=int, default=4, help="distinct synthetic steps cycled through")
    parser.add_argument("--token-budget", type=int, default=0, help="override train.token_budget")
    parser.add_argument("--accum-steps", type=int, default=0, help="override train.accum_steps")
    parser.add_argument("--anchor-budget", type=int, default=0, help="override train.anchor_budget")
    parser.add_argument("--loss-chunk", type=int, default=0,
                        help="override train.loss_chunk (block rows per LM-head and loss chunk; the recipe's 4,096): "
                             "fewer chunks, fewer launches and compiled calls a step, larger logits")
    parser.add_argument("--fuse-accum", action="store_true",
                        help="train.fuse_accum: each step's accum_steps micro-batches packed as one (the same samples "
                             "and loss, one forward and backward)")
    parser.add_argument("--flex-options", type=json.loads, default={},
                        help="flex attention's kernel options as JSON, for every head size, in place of dflash's "
                             "(e.g. '{\"BLOCK_M1\": 32, \"BLOCK_N1\": 64, \"BLOCK_M2\": 64, \"BLOCK_N2\": 32}' for "
                             "the backward's tiles): a sweep of the tiles")
    parser.add_argument("--gather-keys", action="store_true",
                        help="train.gather_context_keys: each query tile its own copy of the context keys it reads, "
                             "so no key tile is read by two query tiles in flex's backward")
    parser.add_argument("--mask-tile", type=int, default=0,
                        help="the block masks' tile (rows and keys) in place of dflash's (masks.mask_tile: 64 for heads of "
                             "up to 64 dims, else 128), a multiple of every kernel tile")
    parser.add_argument("--optimizer", choices=("torch", "triton"), default="",
                        help="AdamW's update in place of train.optimizer's: torch's fused AdamW or dflash's Triton "
                             "kernel (dflash/train/adamw_kernel.py)")
    parser.add_argument("--loss-kernel", choices=CE_KERNELS, default="",
                        help="the cross entropy's pass in place of train.loss_kernel's: inductor's compile of it or "
                             "dflash's Triton kernel (dflash/model/ce_kernel.py)")
    parser.add_argument("--ce-row-resident", type=int, default=-1,
                        help="with the Triton loss kernel: the longest row its kernel holds whole (dflash.model."
                             "ce_kernel.ROW_RESIDENT, 0: every row read twice in tiles, the two-pass loop); "
                             "65536 holds SmolLM2's 49,152 logits a row at once (slower: 12-07)")
    parser.add_argument("--no-warm-kernels", action="store_true",
                        help="do not compile dflash's own Triton kernels in the background before the first step "
                             "(dflash/train/warm_kernels.py, as stage two does): each compiles at its first launch "
                             "(the cold start's baseline)")
    parser.add_argument("--cast-weights-once", action="store_true",
                        help="train.cast_weights_once: each step's micro-batches share one bf16 cast of each "
                             "weight and their weight gradients are added into the fp32 ones in one pass "
                             "(dflash.model.drafter.weights_cast_once) instead of the compiled halves casting the "
                             "fp32 masters at every micro-batch and autograd casting and adding each gradient: the "
                             "same gradients")
    parser.add_argument("--compile-norms", action="store_true",
                        help="with --compile: the context's norm and the final norm compiled too, one graph for both "
                             "(dflash.model.drafter.COMPILE_NORMS; eager, each is six passes over its rows)")
    parser.add_argument("--ab", type=lambda text: [v.strip() for v in text.split(",") if v.strip()], default=[],
                        help="after each mode's own timing, time variants of its step in turn in the same process "
                             "(no second setup, the same machine state): a comma list of variants, each switches "
                             f"joined by '+' among {', '.join(AB_SWITCHES)}; base (none) is always timed. E.g. "
                             "--ab cast-weights-once,compile-norms,cast-weights-once+compile-norms")
    parser.add_argument("--ab-rounds", type=int, default=4,
                        help="with --ab: rounds of --steps steps per variant, the variants in turn each round")
    parser.add_argument("--no-warm-compile-workers", action="store_true",
                        help="do not start inductor's compile workers before the model is built (dflash/train/"
                             "warm_kernels.start_compile_workers, as stage two does): inductor starts them at its "
                             "first graph, and compiles in this process until they answer (the cold start's baseline)")
    parser.add_argument("--clip", choices=("folded", "in-place"), default="folded",
                        help="gradient clipping folded into AdamW's step as its grad_scale (dflash.train.step."
                             "clip_into_step, as stage two trains) or, the baseline, every gradient scaled in place "
                             "first as clip_grad_norm_ does (one more pass over them)")
    parser.add_argument("--attention", choices=("flex", "blockwise"), default="",
                        help="the attention backend in place of train.attention's (auto: blockwise on an H100 or "
                             "newer for 64- and 128-dim heads, masks.training_backend): flex, or blockwise, dflash's "
                             "own Triton kernels over each row's key ranges (dflash/model/block_attention.py)")
    parser.add_argument("--blockwise-configs", default="",
                        help="a tools/bench_block_attention.py --sweep JSON: its best launch of each blockwise kernel "
                             "for every head size in place of dflash's (block_attention.kernel_configs; with "
                             "--attention blockwise)")
    parser.add_argument("--mask-rule", action="store_true",
                        help="build the block masks with create_block_mask (the rule on every query-key pair) "
                             "instead of the collate's tile layout, as before")
    parser.add_argument("--lengths", default="",
                        help="LOW,HIGH: the default mode's synthetic sequence lengths, log-uniform in [LOW, HIGH) "
                             "(default 64,4096); short chat data such as code-docs: 100,1500")
    parser.add_argument("--compile", action="store_true", help="torch.compile the drafter layers (train.compile)")
    parser.add_argument("--profile", default="", help="directory for a profiler trace of two steps of the last mode "
                                                      "(kernel time by class, host-device syncs)")
    parser.add_argument("--loader", action="store_true", help="also measure the DataLoader over a synthetic store")
    parser.add_argument("--loader-only", action="store_true",
                        help="only the loader, at the real row shape, no model (fine on a CPU machine)")
    parser.add_argument("--loader-tokens", type=int, default=131_072, help="tokens in the synthetic store")
    parser.add_argument("--loader-epochs", type=int, default=3, help="epochs over that store in the loader run")
    parser.add_argument("--workers", type=int, default=0, help="override train.num_workers (DataLoader workers)")
    parser.add_argument("--fed-epochs", type=int, default=0,
                        help="with --loader: also train this many epochs over the synthetic store fed by the "
                             "loader, as stage two's loop does, and report the data-wait fraction")
    parser.add_argument("--stand-in-tokens-per-s", type=float, default=0.0,
                        help="with --loader-only: feed a stand-in step that keeps the main thread busy for as long "
                             "as a trainer at this rate (e.g. a measured GPU rate) and report the data wait")
    parser.add_argument("--compile-artifacts", default="",
                        help="load torch's compile artifacts from this file before the warm-up (when it exists) and "
                             "save them there after each mode (dflash/train/compile_cache.py: the cold start of a second "
                             "process); a DDP rank on cuda:N uses STEM.cudaN.SUFFIX beside it, loading PATH while that does not exist")
    parser.add_argument("--target", default="",
                        help="time the `auto` drafter of this target instead of the named size: "
                             f"{', '.join(TARGET_SHAPES)} or a checkpoint directory")
    parser.add_argument("--cold", action="store_true",
                        help="start from empty inductor and Triton caches (a temporary directory), as a new machine "
                             "does: the first warm-up step is the cold start; the JSON's warmup_compile has the "
                             "compile phases and the slowest Triton kernels, and the log says why each recompiled "
                             "graph recompiled (TORCH_LOGS=recompiles unless TORCH_LOGS is set)")
    parser.add_argument("--sample-first-step", action="store_true",
                        help="sample the main thread's Python stack through the process's first step "
                             "(benchlib.StackSampler, every 2 ms) and print where its time went as a call tree: "
                             "a cold start's or a restart's seconds by function; the JSON keeps it")
    parser.add_argument("--cold-serial", action="store_true",
                        help="with --cold: compile kernels in this process one at a time, so each kernel's own "
                             "compile seconds are measured (a slower start than the default parallel compile)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.cold_serial and not args.cold:
        parser.error("--cold-serial needs --cold")
    for variant in args.ab:
        unknown = set(variant.split("+")) - set(AB_SWITCHES)
        if unknown:
            parser.error(f"--ab {variant}: unknown switch {sorted(unknown)[0]!r} (expected {', '.join(AB_SWITCHES)})")
        if "compile-norms" in variant.split("+") and not args.compile:
            parser.error(f"--ab {variant}: compile-norms needs --compile")
    for switch in ab_switches_used(args.ab):  # base must be without them
        if getattr(args, switch.replace("-", "_")):
            parser.error(f"--{switch} with --ab {switch}: the base would have it too")
    if args.ab and args.steps % args.distinct_steps:
        parser.error("--ab: --steps must be a multiple of --distinct-steps (each round the same steps)")
    if args.quick:
        args.steps, args.distinct_steps, args.loader_tokens = 1, 1, min(args.loader_tokens, 1_000)
        args.modes = ",".join(m for m in args.modes.split(",") if m != "peer") or "default"
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    from dflash.dist import DistState, init_distributed, shutdown

    if "WORLD_SIZE" in os.environ:  # torchrun: DDP over the ranks, each on its own synthetic steps
        dist = init_distributed("cpu" if args.quick else "auto")
    else:
        dist = DistState(rank=0, world_size=1, local_rank=0,
                         device=torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu"))
    try:
        return run(args, argv, dist)
    finally:
        shutdown(dist)


def run(args, argv, dist) -> int:
    device = dist.device
    torch.manual_seed(args.seed)
    config = bench_config(args)
    if args.loader_only:
        return run_loader_only(args, argv, config, device)
    workers_early = args.compile and device.type == "cuda" and not args.no_warm_compile_workers
    if workers_early:  # as stage two: inductor's compile workers come up while the trainer is built
        warm_kernels.start_compile_workers()
    if args.compile_artifacts:  # before anything compiles: a second process starts from the first's kernels
        from dflash.train.compile_cache import load_compile_artifacts, own_or_first

        path = own_or_first(args.compile_artifacts, dist.device.index or 0)
        print(load_compile_artifacts(path) or f"no compile artifacts at {path} yet", flush=True)
    from dflash.model import masks

    masks.FLEX_OPTIONS_OVERRIDE.update(args.flex_options)  # before anything compiles flex
    from dflash.model import drafter as drafter_module

    drafter_module.COMPILE_NORMS = args.compile_norms  # read by compile_layers as the trainer is built
    masks.MASK_TILE_OVERRIDE = args.mask_tile  # the collate options below read it
    if args.blockwise_configs:
        swept = json.loads(Path(args.blockwise_configs).read_text())["best"]
        for kernel, rows in swept.items():
            best = rows["best"]
            if best is None:  # no config of this kernel ran: it keeps the committed one
                continue
            block_attention.CONFIGS_OVERRIDE[kernel] = block_attention.KernelConfig(
                best["rows"], best["keys"], best["warps"], best["stages"])
    if args.ce_row_resident >= 0:
        from dflash.model import ce_kernel

        ce_kernel.ROW_RESIDENT = args.ce_row_resident
    model, optimizer, wrapped, ctx = build_trainer(config, dist, args.target, args.attention)
    ctx.fold_clip = args.clip == "folded"
    ctx.cast_weights_once = args.cast_weights_once or config.train.cast_weights_once
    flex_options = flex_kernel_options(ctx.args.head_dim) if device.type == "cuda" else {}  # as masks.attend uses them
    from dflash.model.drafter import count_parameters

    say = print if dist.is_main else (lambda *a, **k: None)
    drafter_name = f"auto ({args.target})" if args.target else config.drafter.size
    say(f"drafter {drafter_name}: {count_parameters(ctx.args) / 1e9:.3f}B trainable parameters; "
        f"token_budget {config.train.token_budget}, anchor_budget {config.train.anchor_budget}, accum_steps "
        f"{config.train.accum_steps}{' fused' if config.train.fuse_accum else ''}, loss_chunk {config.train.loss_chunk}, "
        f"compile {config.train.compile}, optimizer {type(optimizer).__name__} (clip {args.clip}), "
        f"{'weights cast once a step, ' if ctx.cast_weights_once else ''}"
        f"{'norms compiled, ' if args.compile_norms else ''}"
        f"loss kernel {ctx.loss_kernel}, "
        f"attention {ctx.backend}, block masks "
        f"{'rule' if args.mask_rule else 'tiles'}{', gathered keys' if args.gather_keys else ''}"
        f", flex options {flex_options or 'inductor defaults'}, "
        f"device {device}, "
        f"world size {dist.world_size}")
    pool = FeaturePool(16_384 if not args.quick else 2_048, len(ctx.args.target_layer_ids), ctx.args.hidden_size,
                       device, args.seed)
    results = {"meta": run_metadata(["tools/bench_stage2.py", *argv]), "quick": args.quick,
               "block_masks": "rule" if args.mask_rule else "tiles", "gathered_keys": args.gather_keys,
               "flex_options": flex_options, "optimizer": type(optimizer).__name__, "clip": args.clip,
               "loss_kernel": ctx.loss_kernel, "compile_workers_started_early": workers_early,
               "cast_weights_once": ctx.cast_weights_once, "compile_norms": args.compile_norms,
               **({"ce_row_resident": args.ce_row_resident} if args.ce_row_resident >= 0 else {}),
               "drafter": drafter_name, "trainable_params": count_parameters(ctx.args),
               "world_size": dist.world_size, "modes": {}}
    profiled_steps = None
    seed = args.seed + 1000 * dist.rank  # each rank its own data, as under the real sampler
    options = collate_options(ctx, config, args.mask_rule)
    results["mask_tile"] = options["mask_tile"]
    if ctx.backend == "blockwise":
        results["blockwise_configs"] = {name: config._asdict()
                                        for name, config in block_attention.kernel_configs(ctx.args.head_dim).items()}
    say(f"block masks' tile {options['mask_tile']}")
    warming = None  # dflash's own kernels compiled in the background (dflash/train/warm_kernels.py)
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        if mode == "peer":
            steps = pin(peer_steps(pool, ctx.args, args.distinct_steps, seed, options))
        elif mode == "default":
            steps = pin(default_steps(pool, config, ctx.args, args.distinct_steps, seed, options, args.lengths))
        else:
            raise SystemExit(f"--modes: unknown mode {mode!r} (expected peer or default)")
        if warming is None and not args.no_warm_kernels:  # as stage two: started before its first step
            warming = warm_kernels.start(ctx, optimizer) or False
        first_mode = not results["modes"]
        results["modes"][mode] = numbers = measure_mode(mode, wrapped, ctx, optimizer, steps, config, args.steps,
                                                        sample_first=args.sample_first_step and first_mode)
        if first_mode:  # the process's cold start, its setup (imports, model, data) included
            numbers["process_start_to_first_step_s"] = FIRST_STEP_END.get("s")
        if args.compile_artifacts and dist.device.type == "cuda":  # every rank its device's kernels
            from dflash.train.compile_cache import device_file, save_compile_artifacts

            numbers["compile_artifacts_bytes"] = save_compile_artifacts(
                device_file(args.compile_artifacts, dist.device.index or 0))
        if dist.is_distributed:
            scale_to_world(numbers, dist)
        say(f"{mode}: {numbers['ms_per_step_median']:,.1f} ms/step, {numbers['tokens_per_s']:,.0f} tokens/s, "
            f"MFU {numbers['mfu']:.3f}, peak {numbers['peak_allocated_gib'] or 0:.1f} GiB allocated", flush=True)
        if args.ab:
            numbers["ab"] = measure_ab(mode, wrapped, ctx, optimizer, steps, config, args.steps,
                                       ["base", *args.ab], args.ab_rounds,
                                       {switch: turn for switch, turn in ab_switches(model, ctx).items()
                                        if switch in ab_switches_used(args.ab)})
            say(f"{mode}: A/B, alternated in this process: " + "; ".join(
                f"{variant} {row['ms_per_step_median']:,.1f} ms ({row['vs_base']:.3f}x base)"
                for variant, row in numbers["ab"].items()), flush=True)
        profiled_steps = steps  # the profile runs the last mode's steps (already compiled)
        del steps
    if warming:
        results["warm_kernels"] = warming.join()
        say("dflash's kernels compiled ahead: " + "; ".join(f"{name} {what}" for name, what in
                                                            results["warm_kernels"].items()))
    # Loader and fed steps before the profile: a cut-short run keeps what it measured (JSON after each part).
    if args.loader and dist.is_main:
        write_results(args.out, results)
        step_fn = (lambda micro_batches: run_step(wrapped, ctx, optimizer, micro_batches, config)) \
            if args.fed_epochs else None
        measure_loading(args, config, ctx, pool, results, step_fn, args.fed_epochs, say)
    if args.profile and dist.is_main:
        write_results(args.out, results)
        steps = profiled_steps or pin(default_steps(pool, config, ctx.args, 1, seed, options, args.lengths))
        num_profiled = 1 if args.quick else 2
        results["profile"] = profile = profile_steps(wrapped, ctx, optimizer, steps, config, Path(args.profile),
                                                     num_profiled)
        attention = attention_work(steps, ctx.args, num_profiled)
        by_class = profile["kernel_time"]["ms_per_step_by_class"]
        attention_ms = sum(by_class.get(kind, 0.0) for kind in ATTENTION_CLASSES)
        if attention and attention_ms:  # what the attention achieves on the visible pairs (and flex on its tiles')
            profile["attention_ms_per_step"] = attention_ms
            profile["attention_tflop_per_s_visible"] = attention["tflop_per_step_visible"] / attention_ms * 1e3
            if attention["tflop_per_step_listed"] is not None:
                profile["flex_tflop_per_s_listed"] = attention["tflop_per_step_listed"] / attention_ms * 1e3
    if dist.is_main:
        report(args, results)
    return 0


def run_loader_only(args, argv, config, device) -> int:
    """The loader at the drafter's real row shape with no model (runs on a CPU machine too)."""
    from types import SimpleNamespace

    drafter = bench_drafter_args(config, args.target)
    # The collate of a GPU trainer (flex attention: each micro-batch's tile layouts) on any machine.
    ctx = SimpleNamespace(args=drafter, device=device, backend="flex")
    pool = FeaturePool(4_096, len(drafter.target_layer_ids), drafter.hidden_size, device, args.seed)
    results = {"meta": run_metadata(["tools/bench_stage2.py", *argv]), "quick": args.quick,
               "drafter": config.drafter.size, "modes": {}}
    step_fn = stand_in_step_fn(args.stand_in_tokens_per_s) if args.stand_in_tokens_per_s else None
    measure_loading(args, config, ctx, pool, results, step_fn, args.fed_epochs or args.loader_epochs)
    if "fed" in results:
        results["fed"]["stand_in_tokens_per_s"] = args.stand_in_tokens_per_s
    report(args, results)
    return 0


def measure_loading(args, config, ctx, pool, results: dict, step_fn, fed_epochs: int, say=lambda *a, **k: None):
    """A synthetic store of `--loader-tokens` tokens, the loader's own rate over it (`results["loader"]`)
    and, given a `step_fn`, `fed_epochs` epochs of steps fed by the loader (`results["fed"]`)."""
    with tempfile.TemporaryDirectory(prefix="bench-stage2-store-") as store_dir:
        store_path = Path(store_dir) / "store"
        write_synthetic_store(store_path, pool, config, ctx.args, args.loader_tokens, args.seed)
        results["loader"] = loader = measure_loader(config, ctx, store_path, args.loader_epochs)
        say(f"loader: {loader['tokens_per_s']:,.0f} tokens/s with {loader['num_workers']} workers", flush=True)
        if step_fn is not None:
            results["fed"] = fed = measure_fed(config, ctx, store_path, fed_epochs, step_fn)
            say(f"fed by the loader: {fed['ms_per_step']:,.1f} ms/step, {fed['tokens_per_s']:,.0f} tokens/s, "
                f"data wait {fed['data_wait']:.2%}", flush=True)


def scale_to_world(numbers: dict, dist) -> None:
    """Under DDP: rates summed over ranks (each rank trains its own micro-batches), time the slowest rank's."""
    import torch.distributed as torch_dist

    keys = ("tokens_per_s", "anchor_slots_per_s", "mfu")
    values = torch.tensor([numbers[k] for k in keys], dtype=torch.float64, device=dist.device)
    torch_dist.all_reduce(values)
    slowest = torch.tensor([numbers["ms_per_step_median"]], dtype=torch.float64, device=dist.device)
    torch_dist.all_reduce(slowest, op=torch_dist.ReduceOp.MAX)
    numbers.update({k: float(v) for k, v in zip(keys, values.tolist())})
    numbers["ms_per_step_median"] = float(slowest.item())
    numbers["note"] = f"rates summed over {dist.world_size} DDP ranks; mfu is the sum over GPUs (per GPU: / world size)"


def report(args, results: dict) -> None:
    rows = []
    for mode, numbers in results["modes"].items():
        rows.append([mode, numbers["micro_batches_per_step"], numbers["source_tokens_per_step"],
                     numbers["anchors_per_step"], numbers["ms_per_step_median"], numbers["tokens_per_s"],
                     numbers["anchor_slots_per_s"], numbers["tflop_per_step"], numbers["mfu"],
                     numbers["peak_allocated_gib"] if numbers["peak_allocated_gib"] is not None else "n/a",
                     numbers.get("host_ms_per_step_median") or "n/a"])
    print_table("stage two training step", ["mode", "micro-batches/step", "source tokens/step", "anchors/step",
                                            "ms/step (median)", "tokens/s", "anchor-slots/s", "TFLOP/step", "MFU",
                                            "peak GiB", "host ms/step"], rows)
    for mode, numbers in results["modes"].items():
        attention = numbers.get("attention")
        if attention:
            listed = (f", {attention['listed_pairs_per_step'] / 1e9:.2f}G in the block masks' tiles "
                      f"({attention['listed_visible_fraction']:.0%} of them visible, "
                      f"{attention['tflop_per_step_listed']:.2f} TFLOP)" if attention["listed_pairs_per_step"] else "")
            print(f"{mode}: attention {attention['visible_pairs_per_step'] / 1e9:.2f}G visible (query, key) pairs "
                  f"a step over every layer and head ({attention['tflop_per_step_visible']:.2f} TFLOP forward and "
                  f"backward){listed}")
    for mode, numbers in results["modes"].items():
        compiled = numbers.get("warmup_compile") or {}
        kernels = compiled.get("triton_kernels") or {}
        from_start = numbers.get("process_start_to_first_step_s")
        from_start = f" ({from_start:.1f} s from the process's start)" if from_start else ""
        print(f"\n{mode}: first optimizer step after {numbers['warmup_seconds'][0]:.1f} s{from_start}; warm-up steps "
              + ", ".join(f"{s:.1f}" for s in numbers["warmup_seconds"]) + f" s; {describe_compile(compiled)}")
        if kernels.get("slowest"):
            phases = ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in kernels["seconds_by_phase"].items())
            print_table(f"{mode}: slowest Triton kernels in the warm-up ({kernels['kernels']} timed; {phases})",
                        ["kernel", "seconds", "calls"],
                        [[k["kernel"], k["seconds"], k["calls"]] for k in kernels["slowest"]])
    if "profile" in results:
        profile = results["profile"]
        print_table("host-device syncs per step (profiler, inside the profiled steps)", ["event", "per step"],
                    [[name, count] for name, count in profile["sync_events_per_step"].items()])
        kernels = profile["kernel_time"]
        print_table(f"GPU kernel time per profiled step ({kernels['total_ms_per_step']:.1f} ms)",
                    ["kernel class", "ms/step", "share"],
                    [[kind, ms, ms / max(kernels["total_ms_per_step"], 1e-9)]
                     for kind, ms in kernels["ms_per_step_by_class"].items()])
        print_table("longest kernels", ["kernel", "ms/step"], list(kernels["longest_kernels_ms_per_step"].items()))
        print_table("longest kernels of each class but the matmuls", ["class", "kernel", "ms/step"],
                    [[kind, name, ms] for kind, names in kernels.get("longest_kernels_by_class", {}).items()
                     if not kind.startswith("matmul") for name, ms in names.items()])
        gaps = profile.get("gpu_gaps") or {}
        if gaps:
            print_table(f"GPU idle per step: {gaps['idle_ms_per_step']:.1f} of {gaps['span_ms_per_step']:.1f} ms "
                        "(first to last device event), by gap size", ["gaps", "count", "ms/step"],
                        [[size, row["count"], row["ms_per_step"]] for size, row in gaps["idle_by_gap_size"].items()])
            print_table("longest GPU gaps", ["us", "at ms", "after", "before"],
                        [[g["us"], g["at_ms"], g["after"], g["before"]] for g in gaps["longest_gaps"]])
        if profile.get("attention_tflop_per_s_visible"):
            print(f"attention: {profile['attention_ms_per_step']:.1f} ms a step, "
                  f"{profile['attention_tflop_per_s_visible']:.0f} TFLOP/s on the visible pairs"
                  + (f", {profile['flex_tflop_per_s_listed']:.0f} on the pairs of flex's tiles"
                     if profile.get("flex_tflop_per_s_listed") else ""))
        print_table(f"host self time per step ({profile['kernel_launches_per_step']:.0f} kernel launches per step)",
                    ["op", "ms/step", "calls/step"],
                    [[op, ms, profile["host_calls_per_step"][op]] for op, ms in profile["host_self_ms_per_step"].items()])
        outside = profile.get("sync_events_outside_steps") or {}
        if outside:
            print("outside the profiled steps (expected: the bench's closing synchronize and torch.profiler's own "
                  "on exit): "
                  + ", ".join(f"{name} x{count}" for name, count in outside.items()))
        if profile["sync_sites"]:
            print_table("synchronising lines (set_sync_debug_mode, one step)", ["site", "count"],
                        [[site, found["count"]] for site, found in profile["sync_sites"].items()])
            for site, found in profile["sync_sites"].items():
                print(f"called from (innermost last) for {site}:\n  " + "\n  ".join(found["stack"]))
        print(f"trace: {profile['trace']}")
    if "loader" in results:
        loader = results["loader"]
        consumed = results["modes"].get("default", next(iter(results["modes"].values()), {})).get("tokens_per_s", 0.0)
        consumed = consumed or results.get("fed", {}).get("stand_in_tokens_per_s", 0.0)
        loader["trainer_tokens_per_s"] = consumed
        loader["headroom"] = loader["tokens_per_s"] / consumed if consumed else None
        print_table("loader (dflash.train.batch.epoch_loader over a synthetic fp8 store)",
                    ["workers", "micro-batches", "tokens/s", "trainer consumes tokens/s", "headroom"],
                    [[loader["num_workers"], loader["micro_batches"], loader["tokens_per_s"], consumed,
                      loader["headroom"] if loader["headroom"] is not None else "n/a"]])
    if "fed" in results:
        fed = results["fed"]
        stand_in = fed.get("stand_in_tokens_per_s")
        print_table("steps fed by the loader (dflash.train.loop's loop: next(loader), to_device, train_step)"
                    + (f"; stand-in step at {stand_in:,.0f} tokens/s" if stand_in else ""),
                    ["workers", "timed steps", "ms/step", "tokens/s", "data wait"],
                    [[fed["num_workers"], fed["timed_steps"], fed["ms_per_step"], fed["tokens_per_s"],
                      fed["data_wait"]]])
    write_results(args.out, results)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
