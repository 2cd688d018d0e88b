"""Helpers shared by the benchmarks under tools/: Markdown tables, result files with the run's
command, date, machine and commit, the benchmarks' length mix, and the random Qwen3.5/3.6-27B-shaped
target. Run the tools as scripts (`python tools/NAME.py`) so that `tools/` is on sys.path.
"""

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch


def print_table(title: str, header: list[str], rows: list[list]) -> None:
    """A Markdown table on stdout (pastes straight into docs/benchmarks-log.md and BENCHMARKS.md)."""
    print(f"\n## {title}")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join(" --- " for _ in header) + "|")
    for row in rows:
        print("| " + " | ".join(format_cell(cell) for cell in row) + " |")


def format_cell(value) -> str:
    if isinstance(value, float):
        if value == 0 or 1e-3 <= abs(value) < 1e6:
            return f"{value:,.4g}" if abs(value) < 10 else f"{value:,.1f}"
        return f"{value:.3e}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def run_metadata(argv: list[str]) -> dict:
    """Command, date, machine and commit, stored beside every result (every BENCHMARKS.md row cites them)."""
    # DFLASH_COMMIT: set by whoever copied the tree to a machine whose .git is not this tree's.
    commit = os.environ.get("DFLASH_COMMIT", "")
    try:
        commit = commit or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                          cwd=Path(__file__).resolve().parent, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu"
    return {"command": " ".join([Path(sys.executable).name, *argv]), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "device": device, "torch": torch.__version__, "python": platform.python_version(), "commit": commit}


def write_results(path: str, results: dict) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(f"\nresults written to {out}")


def log_uniform_lengths(count: int, low: int, high: int, seed: int) -> np.ndarray:
    """Sequence lengths log-uniform in [low, high): as many 64-128 as 2048-4096 samples.

    The default bucket mix of the benchmarks; chat data has many short and a long tail of
    long conversations, and every bucket gets a fair share of the work.
    """
    rng = np.random.default_rng(seed)
    lengths = np.exp(rng.uniform(np.log(low), np.log(high), size=count))
    return np.clip(lengths.astype(np.int64), low, high - 1)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def qwen35_27b_config():
    """The text config of Qwen3.5/3.6-27B (64 layers, [linear x3, full] x16, hidden 5120)."""
    from transformers import Qwen3_5TextConfig

    from dflash.recipe import VOCAB_SIZE

    return Qwen3_5TextConfig(
        vocab_size=VOCAB_SIZE, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
        num_attention_heads=24, num_key_value_heads=4, head_dim=256,
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=16, linear_num_value_heads=48,
        max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
    )


def build_random_target(config, device: torch.device, dtype: torch.dtype):
    """A random-init causal LM built in place on `device` (27B in bf16 builds in seconds on a GPU)."""
    from transformers import Qwen3_5ForCausalLM

    with torch.device(device):
        model = Qwen3_5ForCausalLM._from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval().requires_grad_(False)


def progress(message: str) -> None:
    """One line per finished pass, flushed: a run cut short by a time limit still reports."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


GPU_EVENT_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")  # a torch.profiler Chrome trace's device events


def merge_intervals(intervals) -> list[list[float]]:
    """`(start, end)` pairs merged where they overlap or touch, in order: the time something ran."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


GAP_BINS_US = (10.0, 100.0, 1000.0)  # gap sizes: < 10 us (a launch's bubble), < 100 us, < 1 ms, longer


def gpu_gaps(trace: dict, num_steps: int) -> dict:
    """Where the GPU idles between its first and last device event of a Chrome trace (every event in it: a
    profile of `num_steps` back-to-back steps, whose kernels lag the host's step annotations): busy and idle
    milliseconds a step, the idle time by gap size (`GAP_BINS_US`), and the longest gaps with the device events
    on either side."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    device = sorted((e["ts"], e["ts"] + e.get("dur", 0), e.get("name", "")) for e in events
                    if e.get("cat") in GPU_EVENT_CATEGORIES)
    merged = merge_intervals((start, end) for start, end, _ in device)
    if not merged:
        return {}
    span = merged[-1][1] - merged[0][0]
    busy = sum(end - start for start, end in merged)
    labels = [f"< {int(b)} us" if b < 1000 else "< 1 ms" for b in GAP_BINS_US] + ["1 ms or more"]
    by_size = {label: {"count": 0, "ms_per_step": 0.0} for label in labels}
    gaps = []
    for left, right in zip(merged, merged[1:]):
        gap = right[0] - left[1]
        label = labels[sum(gap >= b for b in GAP_BINS_US)]
        by_size[label]["count"] += 1
        by_size[label]["ms_per_step"] += gap / 1e3 / num_steps
        gaps.append((gap, left[1], right[0]))
    longest = []
    for gap, end, start in sorted(gaps, reverse=True)[:8]:
        before = max((e for e in device if e[1] <= end), key=lambda e: e[1])[2]
        after = min((e for e in device if e[0] >= start), key=lambda e: e[0])[2]
        longest.append({"us": gap, "at_ms": (end - merged[0][0]) / 1e3, "after": before[:60], "before": after[:60]})
    return {"span_ms_per_step": span / 1e3 / num_steps, "busy_ms_per_step": busy / 1e3 / num_steps,
            "idle_ms_per_step": (span - busy) / 1e3 / num_steps,
            "idle_by_gap_size": {k: v for k, v in by_size.items() if v["count"]}, "longest_gaps": longest}


class StackSampler:
    """Where one thread's wall time goes, sampled: a daemon thread reads the thread's Python stack every
    `interval` seconds (`sys._current_frames`) while the `with` block runs. Unlike cProfile it adds no
    cost per call, and it counts time the thread spends waiting (on Python's lock, the GPU, a file) where
    the wait happens. `report()` ranks functions by their share of the sampled time: where the stack holds them
    (inclusive) and where they are its innermost frame (exclusive); `tree()` draws the call tree."""

    def __init__(self, interval: float = 0.002, thread_id: int | None = None):
        import threading

        self.interval = interval
        self.thread_id = threading.get_ident() if thread_id is None else thread_id
        self.stacks: list[tuple[float, tuple[str, ...]]] = []  # (seconds since the sample before, the stack)
        self._raw: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)
        self.seconds = 0.0
        self._start = time.perf_counter()

    @staticmethod
    def frame_name(code) -> str:
        parts = Path(code.co_filename).parts
        for root in ("site-packages", "dflash", "tools", "stages"):  # a short path from the package root
            if root in parts:
                parts = parts[parts.index(root) + (root == "site-packages"):]
                break
        return f"{'/'.join(parts[-3:])}:{code.co_name}"

    def _run(self) -> None:
        last = self._start
        while not self._stop.wait(self.interval):
            frame = sys._current_frames().get(self.thread_id)  # waits for Python's lock: a busy thread is
            now = time.perf_counter()  # sampled less often, so each sample weighs the time since the last
            codes = []  # the code objects only (named in the report): a sample holds the lock briefly
            while frame is not None:
                codes.append(frame.f_code)
                frame = frame.f_back
            self._raw.append((now - last, codes))
            last = now

    def __enter__(self):
        self._start = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.seconds = time.perf_counter() - self._start
        names: dict = {}
        self.stacks = [(weight, tuple(names.setdefault(code, self.frame_name(code)) for code in reversed(codes)))
                       for weight, codes in self._raw]
        self._raw = []

    def report(self, top: int = 25) -> dict:
        """`{"seconds", "samples", "inclusive": [[function, share], ...], "exclusive": [...]}`, the `top` largest."""
        from collections import Counter

        inclusive, exclusive = Counter(), Counter()
        for weight, stack in self.stacks:
            for name in set(stack):
                inclusive[name] += weight
            if stack:
                exclusive[stack[-1]] += weight
        total = sum(weight for weight, _ in self.stacks) or 1.0

        def ranked(counter):
            return [[name, round(count / total, 4)] for name, count in counter.most_common(top)]

        return {"seconds": self.seconds, "samples": len(self.stacks), "inclusive": ranked(inclusive),
                "exclusive": ranked(exclusive)}

    def tree(self, threshold: float = 0.03, max_lines: int = 60) -> list[str]:
        """The sampled call tree, one line per function holding at least `threshold` of the samples: seconds,
        share, indented by depth; a frame whose only child holds all its samples is folded into that child."""
        root: dict = {"count": 0.0, "children": {}}
        for weight, stack in self.stacks:
            node = root
            node["count"] += weight
            for name in stack:
                node = node["children"].setdefault(name, {"count": 0.0, "children": {}})
                node["count"] += weight
        total = root["count"] or 1.0
        lines: list[str] = []

        def walk(node, depth):
            for name, child in sorted(node["children"].items(), key=lambda item: -item[1]["count"]):
                if child["count"] / total < threshold or len(lines) >= max_lines:
                    continue
                folded = child
                while len(folded["children"]) == 1:  # a chain of one caller each: its innermost frame speaks
                    (inner_name, inner), = folded["children"].items()
                    if inner["count"] != folded["count"]:
                        break
                    name, folded = inner_name, inner
                share = folded["count"] / total
                lines.append(f"{share * self.seconds:7.2f} s {share:6.1%} {'  ' * depth}{name}")
                walk(folded, depth + 1)

        walk(root, 0)
        return lines

    def print_report(self, title: str, top: int = 20, threshold: float = 0.03) -> dict:
        """Prints the call tree and the innermost frames; returns `report(top)` with the tree's lines."""
        report = self.report(top)
        report["tree"] = self.tree(threshold)
        print(f"\n{title}: {report['seconds']:.2f} s, {report['samples']} samples; the call tree:", flush=True)
        print("\n".join(report["tree"]))
        print("innermost frames:")
        for name, share in report["exclusive"]:
            print(f"{share * report['seconds']:7.2f} s {share:6.1%} {name}")
        return report
