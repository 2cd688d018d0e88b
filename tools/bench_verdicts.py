"""A sampled tree's verdicts (`recursive_verdicts` at T > 0) by themselves: time per call, replayed as a CUDA graph
(`VerdictTries`) against the same tries run eagerly, and whether both give the same verdicts; on CUDA with Triton
also the tries as one Triton kernel (dflash/model/verdict_kernel.py, in its graph, as `dflash eval` serves them)
and whether it gives the eager tensor tries' verdicts.

Trees are `drawn_tree`s of each `--shapes` entry (`N` or `NxW`: N drafted nodes, at most W children a node) over a
random drafter's 16 slots, with target logits near the drafter's, over a `--vocab`-token vocabulary (SmolLM2's by
default). Each call is timed from the host with the device drained after it, `--reps` calls after one warm-up
(the capture):

    python3 tools/bench_verdicts.py --shapes 256,256x32,1024,1024x32 --out verdicts.json

Off CUDA only the eager tries run (the graph column is empty).
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import print_table, run_metadata, synchronize, write_results  # noqa: E402

from dflash.model import modeling_dflash  # noqa: E402
from dflash.serve.evaluation import use_verdict_kernel  # noqa: E402


def parse_shape(text: str) -> tuple[int, int]:
    size, _, width = text.partition("x")
    return int(size), int(width or modeling_dflash.TREE_WIDTH)


def time_verdicts(tree, q_KV, target_logits, device, graphs: bool, reps: int, kernel: bool = False):
    """`(ms per call, verdicts)` over `reps` calls after a warm-up, the device drained after each; `kernel`: the
    tries as the Triton kernel (else the tensor loop)."""
    use_verdict_kernel(kernel)

    def call():
        generator = torch.Generator(device=device).manual_seed(1)
        return modeling_dflash.recursive_verdicts(tree, q_KV, target_logits, 1.0, generator, graphs=graphs)
    verdicts = call()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(reps):
        verdicts = call()
        synchronize(device)
    return 1e3 * (time.perf_counter() - start) / reps, verdicts


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="256,256x32,1024,1024x32", help="comma-separated N or NxW")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="a smoke run: two small trees, V = 2,048, 2 calls")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    if args.quick:
        args.shapes, args.vocab, args.reps = "64,16x4", 2048, 2
    device = torch.device(args.device)
    torch.manual_seed(0)
    slots, rows, results = 16, [], []
    for text in (item.strip() for item in args.shapes.split(",") if item.strip()):
        size, width = parse_shape(text)
        drafter_logits = torch.randn(slots, args.vocab, device=device) * 3
        tree, q_KV = modeling_dflash.drawn_tree(3, drafter_logits, size, 1.0,
                                                torch.Generator(device=device).manual_seed(0), width=width)
        depths = torch.tensor(tree.depths, device=device).clamp(max=slots - 1)
        target_logits = drafter_logits[depths] + torch.randn(len(tree.tokens), args.vocab, device=device)
        inner = int((tree.child_tokens()[1] > 0).sum())
        eager_ms, eager = time_verdicts(tree, q_KV, target_logits, device, False, args.reps)
        graph_ms, graph = (time_verdicts(tree, q_KV, target_logits, device, True, args.reps)
                           if device.type == "cuda" else (None, None))
        kernel_ms, kernel = (time_verdicts(tree, q_KV, target_logits, device, True, args.reps, kernel=True)
                             if device.type == "cuda" and use_verdict_kernel() else (None, None))
        equal = None if graph is None else graph == eager
        kernel_equal = None if kernel is None else kernel == eager
        reserved = torch.cuda.memory_reserved(device) / 2**20 if device.type == "cuda" else None
        results.append({"shape": f"stree:{size}x{width}", "inner_nodes": inner, "eager_ms": eager_ms,
                        "graph_ms": graph_ms, "equal": equal, "kernel_ms": kernel_ms, "kernel_equal": kernel_equal,
                        "reserved_mib": reserved,
                        "captured": sum(tries.graph is not None for tries in modeling_dflash.VERDICT_TRIES.values())})
        rows.append([f"stree:{size}x{width}", inner, eager_ms, "-" if graph_ms is None else graph_ms,
                     "-" if equal is None else equal, "-" if kernel_ms is None else kernel_ms,
                     "-" if kernel_equal is None else kernel_equal, "-" if reserved is None else reserved])
    print_table(f"verdicts per call, {device}, V = {args.vocab:,}, {args.reps} calls",
                ["tree", "inner nodes", "eager ms", "graph ms", "equal", "kernel ms (graph)", "kernel equal",
                 "reserved MiB (all so far)"], rows)
    if args.out:
        write_results(args.out, {"meta": run_metadata(sys.argv), "quick": args.quick, "args": vars(args),
                                 "results": results})


if __name__ == "__main__":
    main()
