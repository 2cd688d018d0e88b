"""Stage two's attention alone: dflash's blockwise kernels against flex attention on one packed micro-batch.

The micro-batch is laid out as the collate lays one out (sequences of random lengths packed up to
`--tokens`, `--anchors` sorted anchors spread over them, blocks of `--block-size`), at the SmolLM2-sized
drafter's heads by default (9 query heads over 3 key heads of 64 dims). It times, on CUDA (medians of
`--repeats` runs):

- flex attention as stage two calls it (`masks.attend`: compiled, the block mask of the device's tile for
  these heads), forward and forward + backward;
- the blockwise op (`block_attention`), forward and forward + backward, at its committed kernel configs;
- `--sweep`: each blockwise kernel alone (forward, dQ, dK/dV) over tiles, warps and stages; the best of each
  is printed with the launches to put in `dflash/model/block_attention.py`'s `SMALL_HEAD_CONFIGS` /
  `LARGE_HEAD_CONFIGS`.

Each time is also given as TFLOP/s over the visible query-key pairs (4 * D flops a pair forward, 10 * D
forward + backward: the convention of FlashAttention's benchmarks). The blockwise output and gradients are
compared with flex's (bf16; the largest absolute difference is printed).

    python tools/bench_block_attention.py --sweep --out attention.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchlib import run_metadata, write_results  # noqa: E402
from dflash.model import block_attention, masks  # noqa: E402
from dflash.model.block_attention import KernelConfig, key_tile_rows  # noqa: E402
from dflash.model.tiles import tile_layout, tiles_key, transpose_layout, transposed_key  # noqa: E402


def packed_batch(rng: np.random.Generator, tokens: int, anchors: int, lengths: tuple[int, int], block_size: int,
                 tile: int) -> dict:
    """Sequences of lengths in `lengths` up to `tokens`, `anchors` anchors shared by them in proportion to
    their lengths (distinct positions, sorted), both padded to `tile` as the collate pads them."""
    sizes = []
    while sum(sizes) + lengths[0] <= tokens:
        sizes.append(int(min(rng.integers(lengths[0], lengths[1] + 1), tokens - sum(sizes))))
    share = np.array(sizes) / sum(sizes) * anchors
    counts = np.minimum(np.floor(share).astype(int), np.array(sizes) - 1)
    anchor_doc, anchor_pos = [], []
    for doc, (size, count) in enumerate(zip(sizes, counts)):
        chosen = np.sort(rng.choice(np.arange(1, size), size=count, replace=False))
        anchor_doc += [doc] * count
        anchor_pos += chosen.tolist()
    num_tokens = -(-sum(sizes) // tile) * tile
    per_tile = tile // np.gcd(tile, block_size)
    num_anchors = -(-len(anchor_doc) // per_tile) * per_tile
    doc_ids = np.repeat(np.arange(len(sizes)), sizes)
    position_ids = np.concatenate([np.arange(n) for n in sizes])
    pad, pad_a = num_tokens - len(doc_ids), num_anchors - len(anchor_doc)
    return {"doc_ids": torch.tensor(np.r_[doc_ids, [-1] * pad]),
            "position_ids": torch.tensor(np.r_[position_ids, [0] * pad]),
            "anchor_doc": torch.tensor(anchor_doc + [-1] * pad_a, dtype=torch.long),
            "anchor_pos": torch.tensor(anchor_pos + [0] * pad_a, dtype=torch.long)}


def visible_pairs(ranges) -> int:
    lo, hi, block_lo, block_hi = (x.long() for x in ranges[:4])
    return int(((hi - lo).clamp_min(0) + (block_hi - block_lo).clamp_min(0)).sum())


def median_ms(fn, repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def tflops(pairs: int, dim: int, heads: int, ms: float, flops_per_pair_dim: int) -> float:
    return pairs * heads * dim * flops_per_pair_dim / (ms * 1e-3) / 1e12


def forward_backward(attention, q, k, v, grad):
    def run():
        for x in (q, k, v):
            x.grad = None
        attention(q, k, v).backward(grad)
    return run


def sweep(kernel: str, inputs: dict, configs: list[KernelConfig], repeats: int) -> list[dict]:
    """Each config of one kernel alone, into fresh outputs; a config Triton cannot build is reported."""
    rows = []
    for config in configs:
        try:
            if kernel == "forward":
                run = lambda: block_attention.launch_forward(  # noqa: E731
                    inputs["q"], inputs["k"], inputs["v"], inputs["out"], inputs["lse"], inputs["ranges"],
                    inputs["scale"], config)
            elif kernel == "dq":
                run = lambda: block_attention.launch_dq(  # noqa: E731
                    inputs["q"], inputs["k"], inputs["v"], inputs["do"], inputs["lse"], inputs["delta"],
                    inputs["dq"], inputs["ranges"], inputs["scale"], config)
            else:
                tiles = key_tile_rows(inputs["ranges"], inputs["k"].shape[2], config.keys)
                run = lambda: block_attention.launch_dkdv(  # noqa: E731
                    inputs["q"], inputs["k"], inputs["v"], inputs["do"], inputs["lse"], inputs["delta"],
                    inputs["dk"], inputs["dv"], inputs["ranges"], tiles, inputs["scale"], config)
            ms = median_ms(run, repeats)
            rows.append({"kernel": kernel, **config._asdict(), "ms": round(ms, 4)})
        except Exception as error:  # a tile Triton cannot fit (shared memory, registers)
            rows.append({"kernel": kernel, **config._asdict(), "error": f"{type(error).__name__}: {error}"[:200]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def sweep_configs() -> dict[str, list[KernelConfig]]:
    grid = itertools.product((32, 64, 128), (32, 64, 128), (4, 8), (2, 3))
    configs = [KernelConfig(r, k, w, s) for r, k, w, s in grid]
    return {"forward": configs, "dq": configs, "dkdv": configs}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384, help="context tokens of the micro-batch")
    parser.add_argument("--anchors", type=int, default=4096, help="anchors of the micro-batch")
    parser.add_argument("--lengths", default="100,1500", help="sequence lengths, min,max")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--sweep", action="store_true", help="each blockwise kernel over tiles, warps, stages")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="", help="write the results as JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_block_attention: needs a CUDA device", file=sys.stderr)
        return 2
    if (reason := block_attention.triton_refusal(torch.device("cuda"))):
        print(f"bench_block_attention: {reason}", file=sys.stderr)
        return 2
    device, dtype = torch.device("cuda"), torch.bfloat16
    low, high = (int(x) for x in args.lengths.split(","))
    tile = masks.mask_tile(args.head_dim)
    meta = packed_batch(np.random.default_rng(args.seed), args.tokens, args.anchors, (low, high), args.block_size,
                        tile)
    # the flex mask from the collate's tile lists (as stage two builds it), at the tile of these heads
    layout = tile_layout(*(meta[name].numpy() for name in ("doc_ids", "position_ids", "anchor_doc", "anchor_pos")),
                         args.block_size, None, tile)
    meta[tiles_key("full_attention")] = torch.from_numpy(layout)
    meta[transposed_key("full_attention")] = torch.from_numpy(
        transpose_layout(layout, (meta["doc_ids"].shape[0] + meta["anchor_doc"].shape[0] * args.block_size) // tile))
    meta = {name: value.to(device) for name, value in meta.items()}
    num_rows = meta["anchor_doc"].shape[0] * args.block_size
    num_keys = meta["doc_ids"].shape[0] + num_rows
    generator = torch.Generator(device).manual_seed(args.seed)

    def randn(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, generator=generator)

    q = randn(1, args.heads, num_rows, args.head_dim).requires_grad_()
    k = randn(1, args.kv_heads, num_keys, args.head_dim).requires_grad_()
    v = randn(1, args.kv_heads, num_keys, args.head_dim).requires_grad_()
    grad = randn(1, args.heads, num_rows, args.head_dim)
    ranges = masks.build_masks(meta, ["full_attention"], 0, block_size=args.block_size, backend="blockwise")[
        "full_attention"]
    flex_mask = masks.build_masks(meta, ["full_attention"], 0, block_size=args.block_size, backend="flex")[
        "full_attention"]
    pairs = visible_pairs(ranges)
    results = {"run": run_metadata(sys.argv), "rows": num_rows, "keys": num_keys, "visible_pairs": pairs,
               "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "mask_tile": tile,
               "configs": {name: config._asdict() for name, config in
                           block_attention.kernel_configs(args.head_dim).items()}}

    def flex(q_, k_, v_):
        return masks.attend(q_, k_, v_, flex_mask)

    def blockwise(q_, k_, v_):
        return block_attention.block_attention(q_, k_, v_, ranges)

    outputs = {}
    for name, attention in (("flex", flex), ("blockwise", blockwise)):
        with torch.no_grad():
            forward_ms = median_ms(lambda: attention(q, k, v), args.repeats)
        both_ms = median_ms(forward_backward(attention, q, k, v, grad), args.repeats)
        for x in (q, k, v):
            x.grad = None
        out = attention(q, k, v)
        out.backward(grad)
        outputs[name] = [out.detach().float(), *(x.grad.float() for x in (q, k, v))]
        results[name] = {"forward_ms": round(forward_ms, 3), "forward_backward_ms": round(both_ms, 3),
                         "forward_tflops": round(tflops(pairs, args.head_dim, args.heads, forward_ms, 4), 1),
                         "forward_backward_tflops": round(tflops(pairs, args.head_dim, args.heads, both_ms, 10), 1)}
        print(name, json.dumps(results[name]), flush=True)
    results["max_abs_difference"] = {part: float((a - b).abs().max()) for part, a, b in
                                     zip(("out", "dq", "dk", "dv"), outputs["flex"], outputs["blockwise"])}
    results["blockwise_speedup"] = round(results["flex"]["forward_backward_ms"]
                                         / results["blockwise"]["forward_backward_ms"], 3)
    print("max |flex - blockwise|:", results["max_abs_difference"], "speedup", results["blockwise_speedup"])
    if args.sweep:
        with torch.no_grad():
            qc, kc, vc, do = (x.detach().contiguous() for x in (q, k, v, grad))
            out = torch.empty_like(qc)
            lse = torch.empty((1, args.heads, num_rows), dtype=torch.float32, device=device)
            scale = args.head_dim ** -0.5
            committed_configs = block_attention.kernel_configs(args.head_dim)
            block_attention.launch_forward(qc, kc, vc, out, lse, ranges[:4], scale, committed_configs["forward"])
            inputs = {"q": qc, "k": kc, "v": vc, "do": do, "out": out, "lse": lse, "ranges": ranges[:4],
                      "scale": scale, "delta": (do.float() * out.float()).sum(-1).contiguous(),
                      "dq": torch.empty_like(qc), "dk": torch.empty_like(kc), "dv": torch.empty_like(vc)}
            results["sweep"], best = [], {}
            for kernel, configs in sweep_configs().items():
                rows = sweep(kernel, inputs, configs, args.repeats)
                results["sweep"] += rows
                timed = [row for row in rows if "ms" in row]
                committed = committed_configs[kernel]._asdict()
                best[kernel] = {"best": min(timed, key=lambda row: row["ms"]) if timed else None,
                                "committed": next((row for row in timed
                                                   if all(row[key] == committed[key] for key in committed)), None)}
                print(kernel, "best", best[kernel]["best"], "committed", best[kernel]["committed"], flush=True)
            results["best"] = best
    if args.out:
        write_results(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
