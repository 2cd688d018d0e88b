"""Where the decoding engine's time goes on one GPU: host-side phases (decode steps, prefill,
collect) timed with syncs, and the CUDA kernels of a few decode steps by total time.

    python tools/profile_decoding.py -c configs/smollm2-135m.toml --set target.path=X.gguf --slots 1024 --prompts 3000
"""

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dflash.serve.decoding import Request, SlotDecoder  # noqa: E402


def random_smollm2(device, count: int):
    """A random-weight model of SmolLM2-135M's shape and prompts of code-docs-like lengths (it
    rarely emits its end token: every answer runs to --max-new-tokens)."""
    import numpy as np
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rope_theta=100000.0, tie_word_embeddings=True)
    with torch.device(device):
        target = LlamaForCausalLM(config).to(torch.bfloat16).eval().requires_grad_(False)
    rng = np.random.default_rng(0)
    lengths = np.exp(rng.uniform(np.log(30), np.log(400), size=count)).astype(int)
    return target, [2], [rng.integers(0, 49152, size=n).tolist() for n in lengths]


@torch.inference_mode()
def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-c", "--config", default=None, help="a real target's config (else a random SmolLM2 shape)")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--slots", type=int, default=1024)
    parser.add_argument("--prompts", type=int, default=3000)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--check-every", type=int, default=8)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    if args.config:
        from bench_generate import real_prompts

        from dflash.config import load_config

        target, _, stops, prompts = real_prompts(load_config(args.config, args.overrides), args.prompts,
                                                 "embedded:code-docs", device)
        prompts = [p.input_ids for p in prompts]
    else:
        target, stops, prompts = random_smollm2(device, args.prompts)
    context = max(len(p) for p in prompts) + args.max_new_tokens
    decoder = SlotDecoder(target, stops, slots=args.slots, max_new_tokens=args.max_new_tokens, max_context=context,
                          check_every=args.check_every)
    spent, calls, steps_by_attend = defaultdict(float), defaultdict(int), defaultdict(int)
    for name in ("_run_steps", "_refill", "_collect"):
        original = getattr(decoder, name)

        def timed(*a, _original=original, _name=name, **k):
            torch.cuda.synchronize()
            start = time.perf_counter()
            value = _original(*a, **k)
            torch.cuda.synchronize()
            spent[_name] += time.perf_counter() - start
            calls[_name] += 1
            if _name == "_run_steps":
                steps_by_attend[a[0]] += a[1]
            return value
        setattr(decoder, name, timed)
    requests = lambda: [Request(i, p) for i, p in enumerate(prompts)]  # noqa: E731
    decoder.run(requests()[:args.slots], lambda done: None)  # warm-up: graphs
    spent.clear(); calls.clear(); steps_by_attend.clear()
    tokens = [0]
    start = time.perf_counter()
    decoder.run(requests(), lambda done: tokens.__setitem__(0, tokens[0] + len(done.token_ids)))
    total = time.perf_counter() - start
    print(f"{tokens[0]:,} tokens in {total:.1f} s: {tokens[0] / total:,.0f} tokens/s")
    for name in spent:
        print(f"  {name}: {spent[name]:.2f} s in {calls[name]} calls")
    steps = sum(steps_by_attend.values())
    print(f"  decode steps {steps}: {spent['_run_steps'] / steps * 1e3:.2f} ms each; by attended length "
          + ", ".join(f"{a}: {n}" for a, n in sorted(steps_by_attend.items())))
    print(f"  live slots per step (tokens / steps): {tokens[0] / steps:.0f} of {args.slots}")
    attend = max(steps_by_attend, key=steps_by_attend.get)
    graph = decoder.graphs[attend, False]
    for label, fn in (("graph replay", graph.replay), ("eager step", lambda: decoder._step(attend))):
        torch.cuda.synchronize(); t = time.perf_counter()
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        print(f"  {label} at attend {attend}: {(time.perf_counter() - t) / 20 * 1e3:.2f} ms")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            decoder._step(attend)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70))


if __name__ == "__main__":
    main(sys.argv[1:])
