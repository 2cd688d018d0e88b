"""How well a drafter's first slot matches the target at temperature T > 0, where serving samples.

The chain serves slot 1 with the lossless rule: a draft x drawn from q (the drafter's slot-1 distribution at T)
is kept with probability min(1, p(x)/q(x)), p the target's distribution after the anchor at T, so slot 1 is
accepted with probability sum_x min(p(x), q(x)) = 1 - TV(p, q): 1 for a drafter whose q is p. This serves each
prompt as `dflash eval --proposal sample --temperature T` does (`speculative_generate`), and at every
verification reads the drafter's slot-1 logits and the target's logits at the anchor (its `observe` hook), then
reports per prompt set, averaged over verifications:

- `accept`: sum min(p, q), slot 1's acceptance under `sample`; `accept argmax`: p(argmax q), under `argmax`;
- `accept q^(1/F)`: the same with q sharpened (F < 1) or flattened (F > 1), as `sample:F` draws (`--sharpen`);
- `top-1 agrees`: how often argmax q is argmax p; `p max`: the target's own top probability (what a drafter of
  the target's argmax alone, one-hot, would get);
- `H(p)`, `H(q)`: entropies in nats. H(q) well below H(p) is a drafter sharper than the target (a calibration
  gap that training on the target's distribution, `train.distill`, addresses); H(q) above H(p) with a low
  `accept` is a drafter that does not know where the target puts its mass (an accuracy gap).

Slot 1 alone: later slots' target rows are conditioned on the drafted tokens, which the served chain rarely keeps.
On a GPU the drafter's block runs eagerly here (the numbers do not depend on it).

    python tools/calibration_sampled.py -c configs/smollm2-recipe.toml --set target.path=CHECKPOINT \\
        --drafter EXPORT_DIR --prompts embedded:chat-heldout,embedded:humaneval --num-prompts 12 --out calib.json
"""

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import print_table, progress, run_metadata, write_results  # noqa: E402

from dflash.model.modeling_dflash import Proposal, speculative_generate  # noqa: E402


def slot_one(draft_logits: torch.Tensor, target_logits: torch.Tensor, temperature: float,
             sharpen: tuple[float, ...]) -> dict:
    """One verification's slot-1 figures from the drafter's first slot and the target's row at the anchor."""
    log_q = torch.log_softmax(draft_logits.float() / temperature, dim=-1)
    log_p = torch.log_softmax(target_logits.float() / temperature, dim=-1)
    q, p = log_q.exp(), log_p.exp()
    figures = {"accept": float(torch.minimum(p, q).sum()), "accept argmax": float(p[q.argmax()]),
               "top-1 agrees": float(q.argmax() == p.argmax()), "p max": float(p.max()),
               "H(p)": float(-(p * log_p).sum()), "H(q)": float(-(q * log_q).sum())}
    for factor in sharpen:
        figures[f"accept q^(1/{factor:g})"] = float(torch.minimum(p, torch.softmax(log_q / factor, dim=-1)).sum())
    return figures


def summarize(rows: list[dict]) -> dict:
    """The mean of each figure over verifications, with its standard error."""
    if not rows:
        return {}
    summary = {}
    for key in rows[0]:
        values = [row[key] for row in rows]
        mean = sum(values) / len(values)
        spread = math.sqrt(sum((value - mean) ** 2 for value in values) / max(len(values) - 1, 1) / len(values))
        summary[key] = {"mean": mean, "stderr": spread}
    return summary


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-c", "--config", default=None, help="the target's config")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="config overrides KEY=VALUE")
    parser.add_argument("--drafter", required=True, help="a drafter export (`dflash export`)")
    parser.add_argument("--prompts", default="embedded:chat-heldout,embedded:humaneval",
                        help="prompt sets, comma-separated, as `dflash eval --prompts` reads them")
    parser.add_argument("--num-prompts", type=int, default=12, help="prompts per set, spread over it")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--sharpen", default="0.7,1.5", help="factors F of the q^(1/F) rows ('' for none)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    if args.temperature <= 0:
        parser.error("--temperature must be > 0 (at 0 the chain verifies the argmax: `dflash eval` measures it)")
    args.sharpen = tuple(float(value) for value in args.sharpen.split(",") if value.strip())
    return args


def main(argv=None):
    from dflash.config import load_config
    from dflash.data.tokenizer import load_target_tokenizer
    from dflash.extract.target import load_causal_lm, prepare_checkpoint, stop_token_ids, target_dtype
    from dflash.serve.evaluation import check_drafter_export, load_drafter, load_prompts

    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    check_drafter_export(args.drafter)
    config = load_config(args.config, args.overrides)
    device = torch.device(args.device)
    dtype = target_dtype(config.target.dtype, device)
    checkpoint = prepare_checkpoint(config.target.path, config.data.cache_dir)
    tokenizer = load_target_tokenizer(checkpoint, config.target.chat_template)
    target = load_causal_lm(str(checkpoint), dtype, device)
    draft = load_drafter(args.drafter, target, dtype, device)
    stops = stop_token_ids(tokenizer, target)
    results, start = [], time.perf_counter()
    for source in args.prompts.split(","):
        prompts = load_prompts(config, source, 10 ** 9, tokenizer)
        step = max(1, len(prompts) // max(args.num_prompts, 1))
        rows = []
        for index, prompt in enumerate(prompts[::step][:args.num_prompts]):
            generator = torch.Generator(device=device).manual_seed(args.seed + index)
            seen = []
            speculative_generate(draft, target, torch.as_tensor(prompt.ids, dtype=torch.long, device=device)[None],
                                 args.max_new_tokens, stops, args.temperature, generator, Proposal(sample=True),
                                 graphs=False, observe=lambda drafted, verified: seen.append(
                                     slot_one(drafted[0], verified[0], args.temperature, args.sharpen)))
            rows += seen
            progress(f"{source} {prompt.label}: {len(seen)} verifications, slot 1 accepted "
                     f"{sum(row['accept'] for row in seen) / max(len(seen), 1):.3f}")
        results.append({"prompts": source, "verifications": len(rows), "summary": summarize(rows)})
    keys = list(results[0]["summary"]) if results and results[0]["summary"] else []
    print_table(f"slot 1 at T={args.temperature:g} (mean over verifications)", ["prompts", "verifications", *keys],
                [[entry["prompts"], entry["verifications"],
                  *(f"{entry['summary'][key]['mean']:.3f} ± {entry['summary'][key]['stderr']:.3f}" for key in keys)]
                 for entry in results])
    print(f"\n{time.perf_counter() - start:.0f} s")
    if args.out:
        write_results(args.out, {"meta": run_metadata(["tools/calibration_sampled.py", *argv]), "args": vars(args),
                                 "results": results})
    return results


if __name__ == "__main__":
    main()
