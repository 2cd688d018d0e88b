"""Smoke test of the benchmark tools: each runs with --quick on the CPU, prints its table and
writes its JSON. They run in parallel (they are independent processes) and are `slow` (minutes
on 2 cores); the profile readers below are quick. No timing asserts."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

TOOLS = {
    "bench_stage1": (["--quick"], "## stage one", ("bare", "capture_only", "full")),
    "bench_stage2": (["--quick", "--cold", "--sample-first-step", "--ab", "cast-weights-once", "--ab-rounds", "2",
                      "--loader", "--fed-epochs", "3", "--profile", "{tmp}/trace"],
                     "## stage two training step", ("modes", "loader", "fed", "profile")),
    "bench_codecs": (["--quick", "--sources", "random-target"], "## codecs", ("sources",)),
    "bench_handoff": (["--quick"], "## hand-off", ("fresh", "slots")),
    "bench_generate": (["--quick"], "## generate", ("results",)),
    "bench_verdicts": (["--quick"], "## verdicts", ("results",)),
}


@pytest.fixture(scope="module")
def tool_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tools")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), WANDB_MODE="offline")
    processes = {}
    for tool, (flags, _, _) in TOOLS.items():
        out = tmp / f"{tool}.json"
        command = [sys.executable, str(REPO / "tools" / f"{tool}.py"), *[f.format(tmp=tmp) for f in flags],
                   "--out", str(out)]
        processes[tool] = (subprocess.Popen(command, cwd=tmp, env=env, stdout=subprocess.PIPE,
                                            stderr=subprocess.STDOUT, text=True), out)
    return {tool: (process.communicate(timeout=600)[0], process.returncode, out)
            for tool, (process, out) in processes.items()}


@pytest.mark.slow
@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_tool_runs_quick_and_writes_results(tool_runs, tool):
    output, returncode, out = tool_runs[tool]
    _, table_title, keys = TOOLS[tool]
    assert returncode == 0, output[-4000:]
    assert table_title in output
    assert "| --- |" in output
    results = json.loads(out.read_text())
    assert results["quick"] is True
    assert results["meta"]["command"].endswith(" ".join(["--out", str(out)]))
    for key in keys:
        assert key in results, f"{tool}: no {key!r} in {sorted(results)}"


@pytest.mark.slow
def test_bench_stage2_counts_a_cold_start_from_the_process_start_too(tool_runs):
    """The first step's seconds and, beside them, the seconds from the process's start to that step's end (setup
    included, so work moved before the step is not hidden); inductor's workers started early only under compile
    on CUDA."""
    output, _, out = tool_runs["bench_stage2"]
    results = json.loads(out.read_text())
    first = results["modes"]["default"]
    assert first["process_start_to_first_step_s"] > first["warmup_seconds"][0] > 0
    assert results["compile_workers_started_early"] is False  # --quick: the CPU, no compile
    assert "s from the process's start)" in output
    ab = first["ab"]  # --ab: base and the variant timed in turn, two rounds each
    assert list(ab) == ["base", "cast-weights-once"] and ab["base"]["vs_base"] == 1.0
    assert all(len(row["round_medians_ms"]) == 2 and row["ms_per_step_median"] > 0 for row in ab.values())
    assert "A/B, alternated in this process" in output
    sampled = first["first_step_sampled"]  # --sample-first-step: where the first step's seconds went
    assert "the first step's main thread, sampled" in output
    assert sampled["samples"] > 0 and any("train_step" in line for line in sampled["tree"])


def test_stage_two_starts_inductors_compile_workers_through_inductors_own_call(monkeypatch):
    import torch._inductor.async_compile as async_compile

    from dflash.train import warm_kernels

    calls = []
    monkeypatch.setattr(async_compile, "maybe_warm_pool", lambda: calls.append("warm"))
    warm_kernels.start_compile_workers()
    assert calls == ["warm"]


def test_stage2_flop_formula_matches_issue_5():
    """The peers' step (8,192 tokens, 512 anchors) is 129.3 TFLOP at the qwen3.6-27b size."""
    sys.path.insert(0, str(REPO / "tools"))
    from bench_stage2 import step_flops

    from dflash.model.drafter import drafter_args

    assert step_flops(drafter_args("qwen3.6-27b"), 8192, 512) / 1e12 == pytest.approx(129.3, abs=0.1)


@pytest.mark.slow
def test_gpu_hours_reads_the_bench_results(tool_runs):
    stage1, stage2 = tool_runs["bench_stage1"][2], tool_runs["bench_stage2"][2]
    result = subprocess.run([sys.executable, str(REPO / "tools" / "gpu_hours.py"), "--stage1", str(stage1),
                             "--stage2", str(stage2), "--mode", "default"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    rates = json.loads(stage1.read_text())
    bare, full = rates["bare"]["tokens_per_s"], rates["full"]["fp8"]
    # online / offline follows from the rates: 6 bare forwards + 6 epochs of training vs one stage one
    # (at its rate over the forward span, plus the seconds outside it once) + 6 epochs
    assert full["tokens_per_s_steady"] >= full["tokens_per_s_before_drain"] >= full["tokens_per_s"]
    assert full["fixed_seconds"] >= full["drain_seconds"]
    stage_one = 1 / full["tokens_per_s_steady"] + full["fixed_seconds"] / 1e9
    train = json.loads(stage2.read_text())["modes"]["default"]["tokens_per_s"]
    expected = (6 / bare + 6 / train) / (stage_one + 6 / train)
    assert f"online / offline = {expected:.2f}x" in result.stdout


def test_profile_names_who_called_the_synchronising_line():
    """bench_stage2's sync report keeps the stack above a warned sync (the line alone is only the
    library function that synchronised), counts per site, and ignores other warnings, also
    set_sync_debug_mode's own notice (which mentions "synchronizing operations")."""
    import warnings

    sys.path.insert(0, str(REPO / "tools"))
    from bench_stage2 import warning_sites

    def library_sync():
        warnings.warn("called a synchronizing CUDA operation")

    def caller_in_a_step():
        warnings.warn("Synchronization debug mode is a prototype feature and does not yet detect all "
                      "synchronizing operations")
        library_sync()
        library_sync()
        warnings.warn("an unrelated warning")

    sites = warning_sites(caller_in_a_step, "called a synchronizing CUDA operation")
    assert len(sites) == 1
    (site, found), = sites.items()
    assert site.endswith(".py:" + str(library_sync.__code__.co_firstlineno + 1))
    assert found["count"] == 2
    assert any("in caller_in_a_step" in frame for frame in found["stack"])
    assert found["stack"][-1].endswith("in library_sync")


def test_profile_counts_only_syncs_inside_the_steps():
    """The bench's closing synchronize and torch.profiler's own on exit lie outside the steps and
    are not counted; device-to-host copies count wherever their GPU time falls."""
    from types import SimpleNamespace

    sys.path.insert(0, str(REPO / "tools"))
    from bench_stage2 import count_sync_events

    def event(name, start, end):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end))

    events = [event("cudaDeviceSynchronize", 10, 12), event("cudaStreamSynchronize", 20, 21),
              event("aten::mm", 22, 30), event("cudaDeviceSynchronize", 101, 102),
              event("cudaDeviceSynchronize", 110, 111), event("Memcpy DtoH (Device -> Pinned)", 105, 106)]
    counts = count_sync_events(events, [(0, 50), (50, 100)])
    assert counts["cudaDeviceSynchronize"] == 1 and counts["cudaStreamSynchronize"] == 1
    assert counts["Memcpy DtoH"] == 1  # on the GPU's timeline, which lags the host's step ranges
    assert count_sync_events(events, None)["cudaDeviceSynchronize"] == 3
    assert count_sync_events(events, [])["cudaDeviceSynchronize"] == 0


def test_gpu_timeline_finds_the_idle_gaps_and_what_the_launching_thread_did():
    """bench_stage1's reading of a profiler trace, on a hand-made one: overlapping kernels merge,
    a copy counts as busy, gaps >= 1 ms are listed with the annotation thread's events in them,
    and events outside the annotation or on other threads are not blamed."""
    sys.path.insert(0, str(REPO / "tools"))
    from bench_stage1 import gpu_timeline

    label = "bench_stage1 full path"
    events = [
        {"cat": "user_annotation", "name": label, "ts": 0.0, "dur": 100_000.0, "tid": 1},
        {"cat": "kernel", "name": "gemm", "ts": 10_000.0, "dur": 10_000.0},
        {"cat": "kernel", "name": "gemm", "ts": 15_000.0, "dur": 15_000.0},  # overlaps: busy 10-30 ms
        {"cat": "gpu_memcpy", "name": "Memcpy DtoH", "ts": 30_000.0, "dur": 5_000.0},  # busy to 35 ms
        {"cat": "kernel", "name": "gemm", "ts": 35_500.0, "dur": 4_500.0},  # a 0.5 ms gap: not listed
        {"cat": "kernel", "name": "gemm", "ts": 60_000.0, "dur": 20_000.0},  # the 20 ms gap 40-60 ms
        {"cat": "kernel", "name": "late", "ts": 200_000.0, "dur": 1_000.0},  # outside the annotation
        {"cat": "cpu_op", "name": "aten::pin_memory", "ts": 38_000.0, "dur": 12_000.0, "tid": 1},  # 10 ms in gap
        {"cat": "cuda_runtime", "name": "cudaHostAlloc", "ts": 39_000.0, "dur": 6_000.0, "tid": 1},  # 5 ms in gap
        {"cat": "cpu_op", "name": "aten::copy_", "ts": 40_000.0, "dur": 20_000.0, "tid": 2},  # another thread
    ]
    summary = gpu_timeline({"traceEvents": events}, label)
    assert summary["span_s"] == pytest.approx(0.070)  # 10 ms .. 80 ms
    assert summary["busy_s"] == pytest.approx(0.0495)  # 25 + 4.5 + 20 ms
    assert summary["idle_s"] == pytest.approx(0.0205)
    assert summary["kernel_s"] == pytest.approx(0.0495)  # kernels only (no copy), overlaps counted twice
    assert summary["gaps_over_1ms"] == 1 and summary["gap_seconds_over_1ms"] == pytest.approx(0.020)
    (gap,) = summary["longest_gaps"]
    assert gap["at_s"] == pytest.approx(0.030) and gap["main_thread_in"] == ["aten::pin_memory", "cudaHostAlloc"]
    assert summary["main_thread_during_gaps_s"] == pytest.approx({"aten::pin_memory": 0.010, "cudaHostAlloc": 0.005})
    assert summary["before_first_gpu_event_s"] == pytest.approx(0.010)
    assert summary["after_last_gpu_event_s"] == pytest.approx(0.020)
    assert summary["main_thread_before_gpu_s"] == {}
    assert summary["host_calls"]["cudaHostAlloc (main)"]["count"] == 1
    assert summary["host_calls"]["aten::copy_ (other threads)"]["seconds"] == pytest.approx(0.020)


def test_bench_stage2_times_each_triton_kernel_it_compiles():
    """--cold's per-kernel table: seconds and calls by phase and kernel name (a stand-in autotuner)."""
    import time
    from types import SimpleNamespace

    sys.path.insert(0, str(REPO / "tools"))
    from bench_stage2 import KernelCompileTimes

    times = KernelCompileTimes()
    autotuner = SimpleNamespace(fn=SimpleNamespace(__name__="triton_tem_fused_flex_attention_backward_1"))
    compile_one = times.timed(lambda self, config: time.sleep(0.01), "compile")
    compile_one(autotuner, None)
    compile_one(autotuner, None)
    summary = times.summary()
    assert summary["kernels"] == 1 and summary["seconds_by_phase"]["compile"] >= 0.02
    assert summary["slowest"][0] == {"kernel": "compile: triton_tem_fused_flex_attention_backward_1",
                                     "seconds": summary["seconds_by_phase"]["compile"], "calls": 2}


@pytest.mark.parametrize("seed", range(4))
def test_bench_attention_work_counts_the_dense_masks_pairs_and_the_listed_tiles(seed):
    """bench_stage2's attention work on fresh random packed batches: the visible pairs equal the dense
    masks' (every layer, every query head), the listed pairs are the tiles create_block_mask lists."""
    from types import SimpleNamespace

    from support import tiled_packed_meta
    from torch.nn.attention.flex_attention import create_block_mask

    from dflash.model.masks import build_masks, layer_windows, make_mask_mod
    from dflash.model.tiles import TILE, tile_layout, tiles_key

    sys.path.insert(0, str(REPO / "tools"))
    from bench_stage2 import attention_pairs, attention_work

    rng = np.random.default_rng(300 + seed)
    block = 16
    layer_types = ("sliding_attention", "sliding_attention", "full_attention")
    args = SimpleNamespace(block_size=block, layer_types=layer_types, sliding_window=int(rng.integers(block, 200)),
                           num_attention_heads=3, head_dim=8)
    meta = tiled_packed_meta(rng, block)
    arrays = [meta[k].numpy() for k in ("doc_ids", "position_ids", "anchor_doc", "anchor_pos")]
    windows = layer_windows(layer_types, args.sliding_window)
    batch = dict(meta, **{tiles_key(t): torch.from_numpy(tile_layout(*arrays, block, w)) for t, w in windows.items()})
    dense = build_masks(meta, layer_types, args.sliding_window, block_size=block, backend="dense", device="cpu")
    num_queries, num_keys = len(arrays[2]) * block, len(arrays[0]) + len(arrays[2]) * block
    visible = listed = 0
    for layer_type in layer_types:
        visible += int(dense[layer_type].sum())
        rule = create_block_mask(make_mask_mod(meta["doc_ids"], meta["position_ids"], meta["anchor_doc"],
                                               meta["anchor_pos"], block, windows[layer_type]),
                                 1, 1, num_queries, num_keys, device="cpu", BLOCK_SIZE=TILE)
        listed += int(rule.kv_num_blocks.sum() + rule.full_kv_num_blocks.sum()) * TILE * TILE
    pairs = attention_pairs(batch, args)
    assert pairs == {"visible": visible * 3, "listed": listed * 3}
    work = attention_work([[batch, batch]], args, 3)
    assert work["visible_pairs_per_step"] == 2 * visible * 3 and 0 < work["listed_visible_fraction"] <= 1
    assert work["tflop_per_step_listed"] == pytest.approx(2 * listed * 3 * 14 * 8 / 1e12)
    assert attention_pairs(dict(meta), args) == {"visible": visible * 3, "listed": None}  # no tiles: none listed
    assert attention_work([[dict(meta)]], args, 1)["tflop_per_step_listed"] is None


@pytest.mark.parametrize("seed", range(3))
def test_bench_block_attention_batches_are_the_collates_layout_and_count_the_dense_masks_pairs(seed):
    """bench_block_attention's micro-batch: T and A*B padded to the tile, every real anchor inside its
    sequence, the tile layout made from it, and its visible pairs those of the dense mask."""
    from dflash.model.masks import build_masks
    from dflash.model.tiles import tile_layout

    sys.path.insert(0, str(REPO / "tools"))
    from bench_block_attention import packed_batch, visible_pairs

    rng = np.random.default_rng(seed)
    block, tile = 16, 64
    meta = packed_batch(rng, int(rng.integers(200, 2000)), int(rng.integers(8, 120)), (20, 300), block, tile)
    doc, pos, anchor_doc, anchor_pos = (meta[k] for k in ("doc_ids", "position_ids", "anchor_doc", "anchor_pos"))
    assert len(doc) % tile == 0 and len(anchor_doc) * block % tile == 0
    real = anchor_doc >= 0
    lengths = torch.bincount(doc[doc >= 0])
    assert bool((anchor_pos[real] < lengths[anchor_doc[real]]).all()) and bool((anchor_pos[real] >= 1).all())
    assert tile_layout(doc.numpy(), pos.numpy(), anchor_doc.numpy(), anchor_pos.numpy(), block, None, tile) is not None
    dense = build_masks(meta, ["full_attention"], 0, block_size=block, backend="dense", device="cpu")["full_attention"]
    ranges = build_masks(meta, ["full_attention"], 0, block_size=block, backend="blockwise",
                         device="cpu")["full_attention"]
    assert visible_pairs(ranges) == int(dense.sum())


def test_stack_sampler_weighs_each_sample_by_its_time_and_folds_single_callers():
    """The sampler's report from hand-made samples: each stack weighs the seconds since the sample before it, a
    frame whose one callee holds all its time is folded into it, shares below the threshold are left out."""
    sys.path.insert(0, str(REPO / "tools"))
    from benchlib import StackSampler

    sampler = StackSampler()
    sampler.seconds = 1.0
    sampler.stacks = [(0.5, ("main", "step", "trace", "guard")), (0.3, ("main", "step", "trace", "guard")),
                      (0.18, ("main", "step", "launch")), (0.02, ("main", "log"))]
    assert sampler.tree(threshold=0.05) == ["   1.00 s 100.0% main",
                                            "   0.98 s  98.0%   step",
                                            "   0.80 s  80.0%     guard",  # trace's only callee: folded
                                            "   0.18 s  18.0%     launch"]
    report = sampler.report(top=2)
    assert report["exclusive"] == [["guard", 0.8], ["launch", 0.18]]
    assert report["inclusive"][0] == ["main", 1.0] and report["samples"] == 4
    with StackSampler(interval=0.001) as live:  # a live thread: its own frames, named from the package root
        time.sleep(0.05)
    assert live.stacks and all("tests/test_tools_smoke.py:" in "".join(stack) for _, stack in live.stacks)


def test_kernel_time_sums_kernels_by_class_and_names_each_classs_longest():
    """bench_stage2's kernel table from profiler events: GPU events only, record_function spans left out, per step,
    each class's longest kernels listed apart (the matmuls' never crowd out the rest)."""
    from types import SimpleNamespace

    sys.path.insert(0, str(REPO / "tools"))
    from bench_stage2 import STEP_LABEL, kernel_time

    def event(name, us, device=torch.autograd.DeviceType.CUDA):
        return SimpleNamespace(name=name, device_type=device,
                               time_range=SimpleNamespace(elapsed_us=lambda: us))

    events = ([event(f"nvjet_gemm_{i}", 1000.0 * (i + 2)) for i in range(8)]
              + [event("void at::native::vectorized_elementwise_kernel<4>", 600.0), event("triton_poi_fused_0", 400.0),
                 event(f"{STEP_LABEL} 0", 9e6), event("aten::mm", 5e5, torch.autograd.DeviceType.CPU)])
    times = kernel_time(events, num_steps=2)
    assert times["ms_per_step_by_class"]["matmul (cuBLAS / CUTLASS)"] == pytest.approx(sum(range(2, 10)) / 2)
    assert times["total_ms_per_step"] == pytest.approx((sum(range(2, 10)) + 1.0) / 2)
    by_class = times["longest_kernels_by_class"]
    assert list(by_class["matmul (cuBLAS / CUTLASS)"]) == [f"nvjet_gemm_{i}" for i in range(7, 1, -1)]  # 6 longest
    assert by_class["ATen elementwise / reduce"] == {"void at::native::vectorized_elementwise_kernel<4>": 0.3}
    assert by_class["compiled fused (Triton)"] == {"triton_poi_fused_0": 0.2}


def test_gpu_gaps_splits_a_steps_idle_time_by_gap_size():
    """bench_stage2's reading of its trace: device events merged, the idle time between the first and the last
    one per step by gap size, the longest gaps named by the events on either side."""
    sys.path.insert(0, str(REPO / "tools"))
    from benchlib import gpu_gaps

    events = [
        {"cat": "kernel", "name": "gemm", "ts": 0.0, "dur": 100.0},
        {"cat": "kernel", "name": "gemm2", "ts": 50.0, "dur": 100.0},  # overlaps: busy 0-150 us
        {"cat": "gpu_memset", "name": "Memset", "ts": 155.0, "dur": 5.0},  # a 5 us bubble
        {"cat": "kernel", "name": "adamw", "ts": 210.0, "dur": 40.0},  # a 50 us gap
        {"cat": "kernel", "name": "norm", "ts": 2250.0, "dur": 750.0},  # a 2 ms gap
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 5000.0},  # the host: not the GPU's time
    ]
    gaps = gpu_gaps({"traceEvents": events}, num_steps=2)
    assert gaps["span_ms_per_step"] == pytest.approx(1.5)
    assert gaps["busy_ms_per_step"] == pytest.approx((150 + 5 + 40 + 750) / 2e3)
    assert gaps["idle_ms_per_step"] == pytest.approx((5 + 50 + 2000) / 2e3)
    assert gaps["idle_by_gap_size"] == {"< 10 us": {"count": 1, "ms_per_step": pytest.approx(0.0025)},
                                        "< 100 us": {"count": 1, "ms_per_step": pytest.approx(0.025)},
                                        "1 ms or more": {"count": 1, "ms_per_step": pytest.approx(1.0)}}
    first = gaps["longest_gaps"][0]
    assert first["us"] == pytest.approx(2000) and first["after"] == "adamw" and first["before"] == "norm"
    assert gpu_gaps({"traceEvents": events[-1:]}, 1) == {}
