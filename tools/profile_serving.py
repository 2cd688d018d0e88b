"""Where a speculative decoding step's time goes, per proposal policy, one process alone on the device.

Each policy (`argmax`, `sample`, `tree:N`, ...) decodes the same prompts through `speculative_generate`, the
loop `dflash eval` serves, with its phases wrapped: the drafter's block, drafting (a chain's draws or the
tree's best-first build), the target's verification forward, the verdict (a chain's acceptance rule or the
tree's walk) and the cache's rollback. With `--sync` every phase drains the device queue before and after,
so the phases add up to the step's critical path; without it they are host (enqueue) times, the loop's
pace when the host is the bottleneck. Also the plain decoding baseline's time per token, and tau. With
`--target-graphs on` the target serves as `dflash eval --target-graphs` serves it (a static cache, each forward's
shape a CUDA graph), for the baseline and the verifications alike. With
`--count-ops` each phase's ATen operators per verification are counted too (views left out: about one kernel
launch each on a GPU), a measure of the host's work that any machine gives, the CPU included.

    python3 tools/profile_serving.py -c configs/smollm2-recipe.toml --set target.path=smol.gguf \\
        --drafter runs/recipe/exports/export --prompts embedded:chat-heldout --num-prompts 8 \\
        --proposal sample,tree:16,tree:64 --temperature 0 --sync --out serve.json

Without `-c` the target is the embedded tiny default; without `--drafter`, a randomly initialised drafter
sized from the target (its tau is about 1: the phase times still hold).
"""

import argparse
import sys
import time
from collections import defaultdict
from contextlib import nullcontext
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import run_metadata, write_results  # noqa: E402

from dflash.model import modeling_dflash  # noqa: E402
from dflash.serve.target_graphs import StaticTargetSession  # noqa: E402

PHASES = {  # phase name -> (object, attribute) wrapped while a policy decodes
    "draft block": (modeling_dflash.DFlashDraftModel, "block_logits"),
    "draft block (graph)": (modeling_dflash.BlockGraph, "block_logits"),  # --drafter-graphs on a GPU
    "chain draws": (modeling_dflash.Proposal, "draft"),
    "tree build": (modeling_dflash, "best_first_tree"),
    "stree build": (modeling_dflash, "drawn_tree"),
    "stree verdicts": (modeling_dflash, "recursive_verdicts"),
    "verify": (modeling_dflash.TargetSession, "forward"),
    "chain verdict": (modeling_dflash, "accept"),
    "tree walk": (modeling_dflash, "walk_tree"),
    "rollback": (modeling_dflash.TargetSession, "rollback"),
    "tree keep": (modeling_dflash.TargetSession, "keep"),
    "verify (static)": (StaticTargetSession, "forward"),  # --target-graphs on
    "rollback (static)": (StaticTargetSession, "rollback"),
    "tree keep (static)": (StaticTargetSession, "keep"),
}


class OpCounter(TorchDispatchMode):
    """Counts the ATen operators that run while it is active, views and metadata left out (no kernel)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func not in NO_KERNEL:
            self.count += 1
        return func(*args, **(kwargs or {}))


NO_KERNEL = {torch.ops.aten.detach.default, torch.ops.aten.lift_fresh.default, torch.ops.aten.sym_size.int,
             torch.ops.aten.sym_stride.int, torch.ops.aten.sym_numel.default, torch.ops.aten.is_same_size.default}


def wrapped(function, name: str, totals: dict, device: torch.device, sync: bool, ops: dict, counter):
    """`function` timed into `totals[name]` (and its operators counted into `ops[name]` when `counter` runs); a
    phase called inside another (a rollback's replayed forward) counts toward the outer one only."""
    def timed(*args, **kwargs):
        if totals.get("inside") or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            return function(*args, **kwargs)  # nested, or a CUDA graph's capture (which a sync would break)
        totals["inside"] = True
        if sync and device.type == "cuda":
            torch.cuda.synchronize(device)  # sync: the profile's, never the served loop's
        start, first = time.perf_counter(), counter.count if counter else 0
        value = function(*args, **kwargs)
        if sync and device.type == "cuda":
            torch.cuda.synchronize(device)
        totals[name] += time.perf_counter() - start
        if counter:
            ops[name] += counter.count - first
        totals["inside"] = False
        return value
    return timed


def profile_policy(draft, target, prompts, args, stops, device, policy: str, session=None) -> dict:
    """Decode every prompt with `policy`, the phases timed; ms per verification per phase."""
    totals, saved, ops = defaultdict(float), {}, defaultdict(int)
    counter = OpCounter() if args.count_ops else None
    for name, (owner, attribute) in PHASES.items():
        saved[name] = getattr(owner, attribute)
        setattr(owner, attribute, wrapped(saved[name], name, totals, device, args.sync, ops, counter))
    verifications = tokens = 0
    generator = torch.Generator(device=device).manual_seed(args.seed)
    try:
        with counter or nullcontext():
            start = time.perf_counter()
            for ids in prompts:
                out = modeling_dflash.speculative_generate(draft, target, ids, args.max_new_tokens, stops,
                                                           args.temperature, generator,
                                                           modeling_dflash.parse_proposal(policy),
                                                           args.drafter_graphs == "on" and device.type == "cuda",
                                                           session=session)
                verifications += len(out.acceptance_lengths)
                tokens += len(out.generated)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - start
    finally:
        for name, (owner, attribute) in PHASES.items():
            setattr(owner, attribute, saved[name])
    # the verification forward also prefills each prompt once: counted in "verify" as the loop does
    phases = {name: round(1e3 * value / max(verifications, 1), 3) for name, value in totals.items()
              if value and name in PHASES}
    phases["other"] = round(1e3 * seconds / max(verifications, 1) - sum(phases.values()), 3) if not args.sync else None
    result = {"policy": policy, "tau": tokens / max(verifications, 1), "verifications": verifications,
              "tokens": tokens, "seconds": seconds, "ms_per_verification": 1e3 * seconds / max(verifications, 1),
              "tokens_per_s": tokens / seconds, "phases_ms_per_verification": phases}
    if counter:  # the prompts' prefills are in "verify", as their time is
        result["ops_per_verification"] = {name: round(value / max(verifications, 1), 1) for name, value in ops.items()
                                          if value}
        result["ops_per_verification"]["other"] = round((counter.count - sum(ops.values())) / max(verifications, 1), 1)
        result["ops_per_verification"]["total"] = round(counter.count / max(verifications, 1), 1)
    return result


def load(args, device):
    from dflash.config import load_config
    from dflash.data.tokenizer import load_target_tokenizer
    from dflash.extract.target import load_causal_lm, prepare_checkpoint, stop_token_ids, target_dtype
    from dflash.serve.evaluation import load_drafter, load_prompts

    config = load_config(args.config, args.overrides)
    dtype = target_dtype(config.target.dtype, device)
    checkpoint = prepare_checkpoint(config.target.path, config.data.cache_dir)
    tokenizer = load_target_tokenizer(checkpoint, config.target.chat_template)
    target = load_causal_lm(str(checkpoint), dtype, device)
    if args.drafter:
        draft = load_drafter(args.drafter, target, dtype, device)
    else:
        import tempfile

        from dflash.extract.target import default_layer_ids
        from dflash.model.drafter import DFlashDrafter, auto_drafter_args
        from dflash.model.export import export_drafter

        text = target.config.get_text_config().to_dict()
        vocab = target.get_input_embeddings().weight.shape[0]
        layer_ids = list(config.target.layer_ids) or default_layer_ids(text["num_hidden_layers"],
                                                                        config.target.num_layer_ids)
        drafter = auto_drafter_args(text, layer_ids, mask_token_id=vocab - 1)
        folder = tempfile.mkdtemp(prefix="profile-serving-")
        export_drafter(DFlashDrafter(drafter).state_dict(), drafter, folder, dtype=dtype)
        draft = load_drafter(folder, target, dtype, device)
    prompts = load_prompts(config, args.prompts, args.num_prompts, tokenizer)
    ids = [torch.as_tensor(prompt.ids, dtype=torch.long, device=device)[None] for prompt in prompts]
    return target, draft, ids, stop_token_ids(tokenizer, target)


@torch.inference_mode()
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-c", "--config", default=None, help="the target's config (default: the tiny default)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="config overrides KEY=VALUE")
    parser.add_argument("--drafter", default="", help="an export directory (default: a random drafter)")
    parser.add_argument("--prompts", default="embedded:chat-heldout", help="a data source, as dflash eval --prompts")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--proposal", default="sample,tree:16,tree:64", help="comma-separated policies")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sync", action="store_true", help="drain the queue around every phase (critical path)")
    parser.add_argument("--count-ops", action="store_true",
                        help="also count each phase's ATen operators per verification (slows the loop: its times "
                             "are then not the served pace)")
    parser.add_argument("--drafter-graphs", choices=("on", "off"), default="on",
                        help="on a GPU, the drafter's block and a sampled tree's verdicts replayed as CUDA graphs "
                             "(as dflash eval serves them)")
    parser.add_argument("--target-graphs", choices=("on", "off"), default="off",
                        help="the target over a static cache, each forward's shape a CUDA graph on a GPU, for the "
                             "baseline and the verifications (dflash eval --target-graphs)")
    parser.add_argument("--verdict-kernel", choices=("on", "off"), default="on",
                        help="a sampled tree's verdict tries as one Triton kernel on CUDA where Triton is installed")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", default="")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    from dflash.dist import resolve_device
    from dflash.model.modeling_dflash import plain_generate

    device = resolve_device(args.device)
    from dflash.serve.evaluation import use_verdict_kernel

    use_verdict_kernel(args.verdict_kernel == "on")
    target, draft, prompts, stops = load(args, device)
    session = None
    if args.target_graphs == "on" and not StaticTargetSession.supports(target):
        print("--target-graphs: this target's family is not served over a static cache; transformers' forward serves")
    elif args.target_graphs == "on":
        widest = max([draft.block_size] + [modeling_dflash.parse_proposal(text).tree
                                           for text in args.proposal.split(",") if text.strip()])
        max_context = max(ids.shape[1] for ids in prompts) + args.max_new_tokens + widest + 1
        session = StaticTargetSession(target, list(draft.target_layer_ids), max_context)
    policies = []
    for policy in (text.strip() for text in args.proposal.split(",") if text.strip()):
        try:  # untimed warm-up: kernel selection and allocator growth
            profile_policy(draft, target, prompts[:1], args, stops, device, policy, session)
            policies.append(policy)
        except ValueError as refusal:  # e.g. a tree on a target with linear-attention layers
            print(f"{policy}: not served: {refusal}")
    if session is not None:  # the baseline's shape captured before it is timed
        plain_generate(target, prompts[0], 4, stops, args.temperature, session=session)
    start, baseline_tokens = time.perf_counter(), 0
    generator = torch.Generator(device=device).manual_seed(args.seed)
    counter = OpCounter() if args.count_ops else None
    with counter or nullcontext():
        for ids in prompts:
            baseline_tokens += len(plain_generate(target, ids, args.max_new_tokens, stops, args.temperature, generator,
                                                  session=session))
    baseline_ms = 1e3 * (time.perf_counter() - start) / max(baseline_tokens, 1)
    baseline_ops = counter.count / max(baseline_tokens, 1) if counter else None
    results = [profile_policy(draft, target, prompts, args, stops, device, policy, session) for policy in policies]
    names = [name for name in PHASES if any(name in r["phases_ms_per_verification"] for r in results)] + \
        ([] if args.sync else ["other"])
    print(f"## serving step profile: {device}, T={args.temperature:g}, {len(prompts)} prompts x {args.max_new_tokens} "
          f"tokens, {'phases synced' if args.sync else 'host times'}"
          f"{', target graphs' if session is not None else ''}; plain decoding {baseline_ms:.2f} ms per token")
    print("| policy | tau | ms / verification | tokens/s | speedup | " + " | ".join(names) + " |")
    print("| --- | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in names) + " |")
    for r in results:
        phases = r["phases_ms_per_verification"]
        print(f"| {r['policy']} | {r['tau']:.3f} | {r['ms_per_verification']:.2f} | {r['tokens_per_s']:.1f} | "
              f"{r['tokens_per_s'] * baseline_ms / 1e3:.2f}x | "
              + " | ".join(f"{phases.get(name) or 0:.2f}" for name in names) + " |")
    if counter:
        names = [name for name in [*PHASES, "other"] if any(name in r["ops_per_verification"] for r in results)]
        print(f"\n## ATen operators per verification (views left out); plain decoding {baseline_ops:.1f} per token")
        print("| policy | total | per token | " + " | ".join(names) + " |")
        print("| --- | ---: | ---: | " + " | ".join("---:" for _ in names) + " |")
        for r in results:
            counted = r["ops_per_verification"]
            print(f"| {r['policy']} | {counted['total']:.0f} | {counted['total'] / r['tau']:.0f} | "
                  + " | ".join(f"{counted.get(name, 0):.0f}" for name in names) + " |")
    if args.out:
        write_results(args.out, {"meta": run_metadata(["tools/profile_serving.py", *argv]),
                                 "baseline_ms_per_token": baseline_ms, "baseline_ops_per_token": baseline_ops,
                                 "results": results})


if __name__ == "__main__":
    main()
