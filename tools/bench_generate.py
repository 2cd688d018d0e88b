"""Benchmark answer generation (`dflash generate`'s engines, dflash/serve/generation.py) on one GPU.

In one run, over the same prompts and the same target:
- `slots`: the continuous-batching engine (dflash/serve/decoding.py) at each of `--slots` and
  `--attention` (its decode attention: sdpa, flex), over all
  `--prompts` prompts; then `--check` of its greedy answers are held against plain one-at-a-time
  greedy decoding (equal, a bf16 near-tie by `dflash eval`'s rule, or a real difference);
- `--transformers-cb`: transformers' own continuous batching (`generate_batch`) over the same prompts;
- `generate`: transformers' `generate` (dynamic cache; `--static` adds the static cache) at
  `--hf-batch` prompts, over the first `--hf-prompts` prompts (it is slow: a subset suffices
  for its rate), in length-sorted batches as `dflash generate`'s fallback runs them.
Tokens/s counts answer tokens before the end token, once. Each mode runs one untimed warm-up
first (the engine's CUDA graphs, transformers' compile).

Targets: a real one from a config (`-c configs/smollm2-135m.toml --set target.path=X.gguf`:
prompts of `--source` rendered with its chat template) and/or `--random-27b`, a random-weight
Qwen3.5/3.6-27B-shaped model (a hybrid: only transformers' `generate` serves it), timed beside
its bare decode step (one token per row with the KV cache, no generate loop) at the same batch.

    python tools/bench_generate.py -c configs/smollm2-135m.toml --set target.path=smol.gguf \\
        --slots 256,512,1024 --max-new-tokens 512 --out bench/generate.json
    python tools/bench_generate.py --random-27b --hf-batch 64 --hf-prompts 64 --max-new-tokens 128 --out x.json
    python tools/bench_generate.py --quick --out /tmp/generate.json    # tiny targets on the CPU
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchlib import (build_random_target, log_uniform_lengths, print_table, progress, qwen35_27b_config,  # noqa: E402
                      run_metadata, synchronize, write_results)

from dflash.serve.generation import Generator, Job, Prompt, check_greedy, describe_checks  # noqa: E402


def real_prompts(config, count: int, source: str, device):
    """(target, tokenizer, stops, prompts) of the config's target over `source` (all rows when count is 0)."""
    from dflash.data import chat, samples
    from dflash.data.tokenizer import load_target_tokenizer
    from dflash.extract.target import load_causal_lm, prepare_checkpoint, stop_token_ids, target_dtype

    checkpoint = prepare_checkpoint(config.target.path, config.data.cache_dir)
    tokenizer = load_target_tokenizer(checkpoint, config.target.chat_template)
    target = load_causal_lm(str(checkpoint), target_dtype(config.target.dtype, device), device)
    prompts = []
    for row_id, row in chat.read_rows(source):
        try:
            messages = chat.prompt_messages(row)
        except chat.RowProblem:
            continue
        prompts.append(Prompt(row_id, messages, samples.prompt_token_ids(messages, tokenizer)))
        if len(prompts) == count:
            break
    return target, tokenizer, stop_token_ids(tokenizer, target), prompts


def random_prompts(count: int, vocab_size: int, seed: int, high: int = 1024) -> list[Prompt]:
    rng = np.random.default_rng(seed)
    lengths = log_uniform_lengths(count, 32, high, seed)
    return [Prompt(i, [], rng.integers(0, vocab_size, size=int(n)).tolist()) for i, n in enumerate(lengths)]


def timed_answers(generator: Generator, jobs: list[Job], device) -> tuple[list, float]:
    synchronize(device)
    start = time.perf_counter()
    answers = generator.answers(jobs)
    synchronize(device)
    return answers, time.perf_counter() - start


def measure(name: str, target, tokenizer, stops, prompts, device, engine: str, batch: int, args,
            static: str = "off", attention: str = "sdpa") -> tuple[dict, list]:
    generator = Generator(target, tokenizer, stops, device, batch_size=batch, engine=engine, static_cache=static,
                          max_new_tokens=args.max_new_tokens, decode_attention=attention)
    jobs = [Job(prompt, 0, 0) for prompt in prompts]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    # the engine's warm-up fills every slot (its cache and graphs serve the timed run); transformers'
    # dynamic cache needs only its kernels loaded
    warm = batch if engine == "slots" or static == "on" else min(batch, 8)
    longest = sorted(jobs, key=lambda job: -len(job.prompt.input_ids))[:warm]
    generator.answers(longest)  # warm-up: the engine's cache and graphs, transformers' compile, the allocator
    answers, seconds = timed_answers(generator, jobs, device)
    tokens = sum(len(answer.token_ids) for answer in answers)
    numbers = {"target": name, "engine": f"slots ({attention})" if engine == "slots" else
               f"generate (static cache {static})",
               "batch": batch, "prompts": len(prompts), "tokens": tokens, "seconds": seconds,
               "tokens_per_s": tokens / seconds, "cut": sum(answer.cut for answer in answers),
               "mean_answer_tokens": tokens / len(answers),
               "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None}
    progress(f"{name} {numbers['engine']} batch {batch}: {numbers['tokens_per_s']:,.0f} tokens/s "
             f"({tokens:,} tokens, {seconds:.1f} s)")
    return numbers, answers


def measure_transformers_cb(name: str, target, stops, prompts, device, args) -> tuple[dict, None]:
    """transformers' own continuous batching (`generate_batch`, paged attention) over the same prompts."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=stops,
                              pad_token_id=stops[0])
    inputs = [p.input_ids for p in prompts]
    longest = sorted(inputs, key=len)[-8:]
    target.generate_batch(inputs=longest, generation_config=config)  # warm-up
    synchronize(device)
    start = time.perf_counter()
    outputs = target.generate_batch(inputs=inputs, generation_config=config)
    synchronize(device)
    seconds = time.perf_counter() - start
    tokens = 0
    for output in outputs.values():
        ids = list(output.generated_tokens)
        tokens += next((i for i, token in enumerate(ids) if token in stops), len(ids))
    numbers = {"target": name, "engine": "transformers generate_batch (continuous batching)", "batch": "auto",
               "prompts": len(prompts), "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}
    progress(f"{name} transformers generate_batch: {numbers['tokens_per_s']:,.0f} tokens/s")
    return numbers, None


def guarded(function, *args, **kwargs):
    """Run one mode; an out-of-memory batch or an unsupported cache is reported and the run goes on."""
    try:
        return function(*args, **kwargs)
    except Exception as error:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        progress(f"failed: {type(error).__name__}: {str(error)[:300]}")
        return {"error": f"{type(error).__name__}: {str(error)[:300]}"}, None


def run_real(config, args, device) -> list[dict]:
    target, tokenizer, stops, prompts = real_prompts(config, args.prompts, args.source, device)
    lengths = [len(p.input_ids) for p in prompts]
    progress(f"{len(prompts)} prompts of {args.source}: {sum(lengths):,} tokens, mean {np.mean(lengths):.0f}, "
             f"max {max(lengths)}")
    results, checked = [], False
    runs = [(int(slots), attention) for attention in args.attention.split(",") for slots in args.slots.split(",")
            if slots]
    for slots, attention in runs:
        numbers, answers = guarded(measure, config.target.path, target, tokenizer, stops, prompts, device, "slots",
                                   slots, args, attention=attention)
        if answers is not None and args.check and not checked:
            checked = True
            checks = check_greedy(target, [p.input_ids for p in prompts[:args.check]], answers[:args.check], stops,
                                  args.max_new_tokens)
            numbers["greedy_check"] = describe_checks(checks)
            numbers["greedy_check_gaps"] = [(c.first_difference, c.gap, c.tolerance) for c in checks if not c.equal]
            progress(numbers["greedy_check"])
        results.append(numbers)
    if args.transformers_cb:
        numbers, _ = guarded(measure_transformers_cb, config.target.path, target, stops, prompts, device, args)
        results.append(numbers)
    hf_prompts = prompts[:args.hf_prompts]
    for static in (["off", "on"] if args.static else ["off"]):
        numbers, _ = guarded(measure, config.target.path, target, tokenizer, stops, hf_prompts, device, "generate",
                             args.hf_batch, args, static)
        results.append(numbers)
    return results


@torch.inference_mode()
def bare_decode_step(target, prompts: list[Prompt], device, steps: int = 16) -> dict:
    """One token per row with the KV cache after a prefill, `steps` times: the forward alone."""
    width = max(len(p.input_ids) for p in prompts)
    ids = torch.tensor([p.input_ids + [0] * (width - len(p.input_ids)) for p in prompts], device=device)
    out = target(input_ids=ids, use_cache=True, logits_to_keep=1)
    cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        out = target(input_ids=token, past_key_values=cache, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    synchronize(device)
    seconds = (time.perf_counter() - start) / steps
    return {"target": "random Qwen3.5-27B shape", "engine": "bare decode step (forward only)", "batch": len(prompts),
            "seconds": seconds, "tokens_per_s": len(prompts) / seconds}


def run_random_27b(args, device) -> list[dict]:
    model_config = qwen35_27b_config()
    target = build_random_target(model_config, device, torch.bfloat16)
    prompts = random_prompts(args.hf_prompts, model_config.vocab_size, args.seed)
    stops = [model_config.vocab_size - 1]
    numbers, _ = guarded(measure, "random Qwen3.5-27B shape", target, None, stops, prompts, device, "generate",
                         args.hf_batch, args)
    bare, _ = guarded(lambda: (bare_decode_step(target, prompts[:args.hf_batch], device), None))
    progress(f"bare decode step at batch {args.hf_batch}: {bare.get('tokens_per_s', 0):,.0f} tokens/s")
    return [numbers, bare]


def quick_targets(args):
    """The CPU smoke run: the embedded tiny target (fallback) and a tiny Llama (engine)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    args.slots, args.prompts, args.hf_prompts, args.hf_batch, args.max_new_tokens, args.check = "4", 8, 8, 4, 8, 2
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    prompts = random_prompts(args.prompts, 512, args.seed, high=64)
    results = []
    for engine in ("slots", "generate"):
        numbers, _ = guarded(measure, "tiny llama", llama, None, [3], prompts, torch.device("cpu"), engine, 4, args)
        results.append(numbers)
    return results


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-c", "--config", default=None, help="dflash config of a real target (its target.path)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--source", default="embedded:code-docs", help="prompts of the real target")
    parser.add_argument("--prompts", type=int, default=0, help="prompts of --source (0: every usable row)")
    parser.add_argument("--slots", default="512,1024", help="the engine's slot counts, comma-separated")
    parser.add_argument("--attention", default="sdpa", help="the engine's decode attentions, comma-separated "
                                                            "(sdpa, flex)")
    parser.add_argument("--check", type=int, default=16, help="greedy answers held against one-at-a-time decoding")
    parser.add_argument("--hf-batch", type=int, default=1024, help="transformers' generate batch size")
    parser.add_argument("--hf-prompts", type=int, default=1024, help="prompts for transformers' generate")
    parser.add_argument("--static", action="store_true", help="also transformers' static cache")
    parser.add_argument("--transformers-cb", action="store_true",
                        help="also transformers' continuous batching (generate_batch) over every prompt")
    parser.add_argument("--random-27b", action="store_true", help="also a random 27B-shaped Qwen3.5 target")
    parser.add_argument("--quick", action="store_true", help="tiny targets on the CPU (a smoke run)")
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    results = []
    if args.quick:
        results += quick_targets(args)
    if args.config:
        from dflash.config import load_config

        results += run_real(load_config(args.config, args.overrides), args, device)
    if args.random_27b:
        results += run_random_27b(args, device)
    print_table("generate", ["target", "engine", "batch", "tokens/s", "tokens", "seconds", "mean answer", "cut",
                             "peak GiB"],
                [[r.get("target", ""), r.get("engine", ""), r.get("batch", ""), r.get("tokens_per_s", r.get("error")),
                  r.get("tokens", ""), r.get("seconds", ""), r.get("mean_answer_tokens", ""), r.get("cut", ""),
                  r.get("peak_memory_gib") or ""] for r in results])
    for r in results:
        if "greedy_check" in r:
            print(f"greedy check ({r['engine']} batch {r['batch']}): {r['greedy_check']}")
    write_results(args.out, {"meta": run_metadata(["tools/bench_generate.py", *argv]), "quick": args.quick,
                             "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
