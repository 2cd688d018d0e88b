"""Benchmark stage one's hand-off: a captured batch's host tensors into shared memory for a writer.

Runs `dflash.extract.writers.WriterPool.to_slot` in a thread, as the pool's hand-off threads do, on
batches of the real shape (32,768 rows of 5 x 5120 fp8 bits plus fp32 scales, about 840 MB),
once with no slots (a fresh shared tensor per batch, the path before slots) and once with the
pool's reused slots, while the main thread spins the way the target's kernel-launching thread
runs. Prints per-batch hand-off seconds and the main thread's longest stall (the GIL held by
the hand-off), and writes JSON to `--out`. CPU only; no writer process runs (slots are handed
straight back).

    python tools/bench_handoff.py --out bench/handoff.json
"""

import argparse
import queue
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import print_table, run_metadata, write_results  # noqa: E402


class AliveProcess:
    name, exitcode = "bench", None

    @staticmethod
    def is_alive() -> bool:
        return True


def hand_off_pool(batch_bytes: int, num_slots: int):
    """A WriterPool's hand-off state alone (no processes): `num_slots` slots of `batch_bytes`."""
    from dflash.extract.writers import WriterPool, make_slots, new_handoff_stats

    pool = WriterPool.__new__(WriterPool)
    pool.handoff, pool.handoff_lock = new_handoff_stats(), threading.Lock()
    pool.free_slots = [queue.Queue()]
    pool.slots = [make_slots(batch_bytes, num_slots, pool.free_slots[0])]
    pool.processes = [AliveProcess()]
    return pool


def run(pool, batches: list, release) -> dict:
    """Hand `batches` off in a thread while the main thread spins; per-batch seconds and stalls."""
    seconds = []

    def worker():
        for captured in batches:
            start = time.perf_counter()
            slot, parts = pool.to_slot(0, captured)
            seconds.append(time.perf_counter() - start)
            release(slot, parts)

    thread = threading.Thread(target=worker)
    last = time.perf_counter()
    longest, spins = 0.0, 0
    thread.start()
    while thread.is_alive():
        now = time.perf_counter()
        longest, last, spins = max(longest, now - last), now, spins + 1
    thread.join()
    return {"batches": len(batches), "seconds_per_batch": float(np.mean(seconds)),
            "max_seconds_per_batch": float(np.max(seconds)), "main_thread_longest_stall_ms": longest * 1e3}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON results file")
    parser.add_argument("--rows", type=int, default=32_768, help="rows (tokens) per batch")
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="1,024-row batches")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows = min(args.rows, 1024)
    from dflash.extract.capture import CapturedBatch

    num_layers, hidden = 5, 5120
    hidden_bits = torch.full((1, args.rows, num_layers * hidden), 7, dtype=torch.uint8)
    scale = torch.ones((1, args.rows, num_layers), dtype=torch.float32)
    batches = [CapturedBatch(parts={"hidden": hidden_bits, "scale": scale}, ready=None)
               for _ in range(args.batches)]
    batch_bytes = hidden_bits.numel() + scale.numel() * 4 + 128
    fresh = run(hand_off_pool(batch_bytes, 0), batches, lambda slot, parts: None)
    pool = hand_off_pool(batch_bytes, 3)
    slots = run(pool, batches, lambda slot, parts: pool.free_slots[0].put(slot))
    rows = [["fresh shared tensor per batch", fresh["seconds_per_batch"], fresh["max_seconds_per_batch"],
             fresh["main_thread_longest_stall_ms"]],
            ["reused slot", slots["seconds_per_batch"], slots["max_seconds_per_batch"],
             slots["main_thread_longest_stall_ms"]]]
    print_table(f"hand-off of {args.batches} batches of {args.rows:,} rows ({batch_bytes / 1e6:,.0f} MB)",
                ["path", "s/batch (mean)", "s/batch (max)", "main thread's longest stall, ms"], rows)
    write_results(args.out, {"meta": run_metadata(["tools/bench_handoff.py", *argv]), "quick": args.quick,
                             "rows": args.rows, "batch_bytes": batch_bytes, "fresh": fresh, "slots": slots})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
