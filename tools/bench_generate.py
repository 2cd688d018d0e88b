"""Benchmark answer generation (`dflash generate`'s engine, dflash/generation.py) on one GPU.

Targets: a real one from a config (`-c configs/smollm2-135m.toml --set target.path=X.gguf`:
real prompts, rendered from `--source` with its chat template) and/or `--random-27b`, a
random-weight Qwen3.5/3.6-27B-shaped model built on the GPU (random-token prompts; a random
model rarely emits an end token, so every answer runs to --max-new-tokens). For every
`--batch-sizes` x static cache off/on it generates the answers of `--prompts` prompts
(length-sorted batches, longest first, as `dflash generate` does) after one warm-up batch, and
reports generated tokens/s (end tokens and what follows them are not counted). The dynamic
cache at the largest batch is the plain `generate` baseline (8.8K tokens/s for SmolLM2 at batch
1024 x 256 new tokens on an H200 when issue 13 was filed).

    python tools/bench_generate.py -c configs/smollm2-135m.toml --set target.path=smol.gguf \\
        --batch-sizes 512,1024 --prompts 2048 --max-new-tokens 256 --out bench/generate.json
    python tools/bench_generate.py --random-27b --batch-sizes 64,256 --prompts 256 --max-new-tokens 128 --out x.json
    python tools/bench_generate.py --quick --out /tmp/generate.json    # tiny target on the CPU
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchlib import (  # noqa: E402
    build_random_target, log_uniform_lengths, print_table, progress, qwen35_27b_config, run_metadata,
    synchronize, write_results,
)

from dflash.generation import Generator, Prompt  # noqa: E402


def real_prompts(config, count: int, source: str, device):
    """(target, tokenizer, stops, prompts) of the config's target over `source`."""
    from dflash import data
    from dflash.target import load_causal_lm, prepare_checkpoint, stop_token_ids, target_dtype
    from dflash.tokenizer import load_target_tokenizer

    checkpoint = prepare_checkpoint(config.target.path, config.data.cache_dir)
    tokenizer = load_target_tokenizer(checkpoint, config.target.chat_template)
    target = load_causal_lm(str(checkpoint), target_dtype(config.target.dtype, device), device)
    prompts = []
    for row_id, row in data.read_rows(source):
        try:
            messages = data.prompt_messages(row)
        except data.RowProblem:
            continue
        prompts.append(Prompt(row_id, messages, data.prompt_token_ids(messages, tokenizer)))
        if len(prompts) == count:
            break
    return target, tokenizer, stop_token_ids(tokenizer, target), prompts


def random_prompts(count: int, vocab_size: int, seed: int, high: int = 1024) -> list[Prompt]:
    rng = np.random.default_rng(seed)
    lengths = log_uniform_lengths(count, 32, high, seed)
    return [Prompt(i, [], rng.integers(0, vocab_size, size=int(n)).tolist()) for i, n in enumerate(lengths)]


def measure(target, tokenizer, stops, prompts, device, batch_size: int, static: bool, max_new_tokens: int) -> dict:
    generator = Generator(target, tokenizer, stops, device, batch_size=batch_size,
                          static_cache="on" if static else "off", max_new_tokens=max_new_tokens)
    generator.batch([p.input_ids for p in prompts[:batch_size]])  # warm-up (and the compile, if any)
    synchronize(device)
    start = time.perf_counter()
    answers = generator.answers(prompts)
    synchronize(device)
    seconds = time.perf_counter() - start
    tokens = sum(len(a.token_ids) for a in answers)
    return {"batch_size": batch_size, "static_cache": static, "prompts": len(prompts), "tokens": tokens,
            "seconds": seconds, "tokens_per_s": tokens / seconds, "cut": sum(a.cut for a in answers),
            "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None}


def run_target(name: str, target, tokenizer, stops, prompts, device, args) -> list[dict]:
    results = []
    for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
        for static in (False, True):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            try:
                numbers = measure(target, tokenizer, stops, prompts, device, batch_size, static, args.max_new_tokens)
            except Exception as error:  # an out-of-memory batch or an unsupported cache: report, go on
                numbers = {"batch_size": batch_size, "static_cache": static, "error": f"{type(error).__name__}: "
                                                                                     f"{str(error)[:300]}"}
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            numbers["target"] = name
            results.append(numbers)
            progress(f"{name} batch {batch_size} static={static}: "
                     + (f"{numbers['tokens_per_s']:,.0f} tokens/s" if "error" not in numbers else numbers["error"]))
    return results


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-c", "--config", default=None, help="dflash config of a real target (its target.path)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--source", default="embedded:code-docs", help="prompts of the real target")
    parser.add_argument("--random-27b", action="store_true", help="also a random 27B-shaped Qwen3.5 target")
    parser.add_argument("--quick", action="store_true", help="the embedded tiny target on the CPU")
    parser.add_argument("--batch-sizes", default="256,1024")
    parser.add_argument("--prompts", type=int, default=2048)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    if args.quick:
        args.batch_sizes, args.prompts, args.max_new_tokens = "4", 8, 8
    results = []
    if args.config or args.quick:
        from dflash.config import load_config

        config = load_config(args.config, args.overrides)
        target, tokenizer, stops, prompts = real_prompts(config, args.prompts, args.source, device)
        results += run_target(config.target.path, target, tokenizer, stops, prompts, device, args)
        del target
    if args.random_27b:
        model_config = qwen35_27b_config()
        target = build_random_target(model_config, device, torch.bfloat16)
        prompts = random_prompts(args.prompts, model_config.vocab_size, args.seed)
        results += run_target("random Qwen3.5-27B shape", target, None, [model_config.vocab_size - 1], prompts,
                              device, args)
    print_table("generate", ["target", "batch", "static cache", "tokens/s", "tokens", "seconds", "cut", "peak GiB"],
                [[r["target"], r["batch_size"], "on" if r["static_cache"] else "off",
                  r.get("tokens_per_s", r.get("error")), r.get("tokens", ""), r.get("seconds", ""), r.get("cut", ""),
                  r.get("peak_memory_gib") or ""]
                 for r in results])
    write_results(args.out, {"meta": run_metadata(["tools/bench_generate.py", *argv]), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
