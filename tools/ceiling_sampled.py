"""How high a DFlash drafter's tau could go at temperature T > 0: an oracle drafter, served on the real target.

A DFlash block's slot k has one distribution q_k per context c (the committed tokens), the same whatever is drawn
for the slots before it. The natural best such drafter is the oracle whose q_k is the target's own marginal of
the token k steps after c, its sampling of the tokens in between summed out. At T = 0 the oracle is exact (tau =
block size); at T > 0 the target's continuations branch, and a block of independent draws from marginals meets
them less often. This measures that cap with the lossless chain rule of `modeling_dflash.sampled_verdict`.

Contexts: per prompt of each `--prompts` set (loaded as `dflash eval --prompts` loads them, `--num-prompts`
spread evenly over the set's first `--pool` prompts), the chat-templated prompt plus the first o tokens of one
continuation the target samples at T (`plain_generate`), for each o in `--offsets` the continuation reaches
before its end token. Per context, with the KV cache of c copied into a static cache of a batch of rows:

- the marginals: `--samples` M continuations of B-1 tokens drawn from the target at T; q_k is the mean of the
  target's conditional distributions at step k over the M rows (`q_1` is the target's distribution after c,
  exactly). This average of conditionals is unbiased for the marginal and has every token in its support; the
  first `--check-samples` rows alone give a coarser q, whose tau shows how far M is from converged;
- the chain: `--blocks` S blocks drawn fresh from q (never the rows that estimated it), each verified against
  the target's conditionals at its own drafts (one forward of S rows); the fraction of blocks accepting slot k is
  E[prod_{j<k} min(1, p_j(x_j)/q_j(x_j)) * sum_x min(q_k(x), p_k(x))]: the last slot's test averaged exactly;
  tau = 1 + the sum over k. Also the same with q sharpened (`--sharpen F`: q^(1/F), renormalised, as
  `sample:F`), and `argmax` proposals (one-hot q at each marginal's argmax, exact: one block); "best chain" takes
  per context the best of these (a drafter's q is free: each is a DFlash drafter served by the `sample` rule);
- `--trees N`: a best-first tree of N drafts built from the oracle marginals (`best_first_tree`), verified by the
  walk (`walk_tree`: the target samples at each node, the walk follows the child holding its token): tau is the
  sum over nodes of the probability that the walk reaches them (exact, one `verify_tree` forward);
- `--strees N`: `stree:N`, the same shape with each slot's children drawn from q without replacement
  (`drawn_tree`) and verified by recursive rejection sampling (`recursive_verdicts`): the reach of each node is
  exact for the drawn tree (`keep_probabilities`), averaged over `--tree-draws` trees.

Every tau is a mean over contexts with a standard error clustered by prompt (a prompt's contexts share its
continuation). The marginal oracle is the natural best drafter, not a proven one: q = the marginal maximises no
chain objective in general, so the best of the policies above is a lower bound on the ceiling, not the ceiling.
A continuation that samples the end token goes on as the target continues it (served, the answer would stop).
`--prompts heldout:NAME` needs the recipe's store (`dflash eval` reads its held-out split there); without one,
`embedded:code-docs` is the same population. The target must be plain attention (the cache is copied per row):

    python tools/ceiling_sampled.py -c configs/smollm2-recipe.toml --set target.path=CHECKPOINT_DIR \\
        --prompts embedded:code-docs,embedded:chat-heldout --temperatures 1.0 --out ceiling-t1.json
"""

import argparse
import copy
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import print_table, progress, run_metadata, write_results  # noqa: E402

from dflash.model.modeling_dflash import (TargetSession, after_rejection, best_first_tree,  # noqa: E402
                                          cache_keyword, drawn_tree, plain_generate, verify_tree)


@dataclass
class ContextResult:
    """One context's oracle: per policy, the fraction of blocks accepting slot k (k = 1..B-1); tau = 1 + its sum."""
    prompt: str
    offset: int  # generated tokens before the anchor
    context_tokens: int
    oracle: list[float]
    check: list[float]  # the oracle estimated from the first --check-samples rows only
    argmax: list[float]
    sharpened: dict[str, list[float]] = field(default_factory=dict)  # "sample:F" -> slots
    trees: dict[str, list[float]] = field(default_factory=dict)  # "tree:N" -> P(the walk reaches depth k)
    oracle_block_sd: float = 0.0  # standard deviation of one simulated block's expected tokens (the MC noise)


# ----------------------------------------------------------------------------- the target's distributions


def probabilities(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits.float() / temperature, dim=-1)


@torch.inference_mode()
def prefill(target, context_ids: list[int]):
    """`(DynamicCache of the context, the target's logits after it (V,))`."""
    ids = torch.tensor([context_ids], dtype=torch.long, device=target.device)
    out = target(input_ids=ids, use_cache=True, logits_to_keep=1)
    return getattr(out, "cache", None) or out.past_key_values, out.logits[0, -1]


def expanded_cache(target, cache, rows: int, extra: int):
    """A StaticCache of `rows` copies of `cache` with room for `extra` more tokens. A dynamic cache would copy
    every row's whole context at each new token (half a decode step's time on the CPU)."""
    from transformers import StaticCache

    layers = getattr(cache, "layers", [])
    if not layers or any(getattr(layer, "keys", None) is None or getattr(layer, "is_sliding", False)
                         for layer in layers):
        raise ValueError("ceiling_sampled: the target's cache must be plain attention layers (keys and values per "
                         "token); a linear-attention or sliding-window target is not supported")
    static = StaticCache(config=target.config, max_cache_len=cache.get_seq_length() + extra)
    for index, layer in enumerate(layers):
        static.update(layer.keys.expand(rows, -1, -1, -1), layer.values.expand(rows, -1, -1, -1), index)
    return static


@torch.inference_mode()
def oracle_marginals(target, cache, first_V: torch.Tensor, num_drafts: int, samples: int, temperature: float,
                     generator, chunk: int, check: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`(q (K, V), q from the first `check` rows (K, V))`: slot k's marginal after the context, the mean of the
    target's conditionals at step k over `samples` continuations it samples at `temperature`. `first_V` is the
    target's distribution of the first token (exact: every row's step 1)."""
    keyword = cache_keyword(target)
    sums = torch.zeros(num_drafts, first_V.shape[-1], dtype=torch.float64)
    check_sums = torch.zeros_like(sums)
    for start in range(0, samples, chunk):
        rows = min(chunk, samples - start)
        static = expanded_cache(target, cache, rows, num_drafts)
        probs = first_V.expand(rows, -1)
        for slot in range(1, num_drafts):
            tokens = torch.multinomial(probs, 1, generator=generator)
            logits = target(input_ids=tokens, use_cache=True, **{keyword: static}).logits[:, -1]
            probs = probabilities(logits, temperature)
            sums[slot] += probs.sum(0, dtype=torch.float64)
            check_sums[slot] += probs[:max(0, check - start)].sum(0, dtype=torch.float64)
    q = (sums / samples).float()
    q_check = (check_sums / max(check, 1)).float()
    q[0] = q_check[0] = first_V
    return q, q_check


@torch.inference_mode()
def chain_acceptance(target, cache, first_V: torch.Tensor, q_KV: torch.Tensor, blocks: int, temperature: float,
                     generator, chunk: int) -> torch.Tensor:
    """`(blocks, K)`: per block of drafts drawn from `q_KV` (slot k independently from row k), the probability
    that the chain rule accepts slots 1..k: prod_{j<k} min(1, p_j(x_j)/q_j(x_j)) times slot k's acceptance
    averaged over its draw, sum_x min(q_k(x), p_k(x)) (p_j: the target's conditional after the context and the
    drafts before slot j). A one-hot `q_KV` is argmax proposals (then one block is exact)."""
    num_drafts = q_KV.shape[0]
    drafts_SK = torch.multinomial(q_KV, blocks, replacement=True, generator=generator).T
    keyword = cache_keyword(target)
    accepted = []
    for start in range(0, blocks, chunk):
        drafts = drafts_SK[start:start + chunk]
        rows = drafts.shape[0]
        p = first_V.expand(rows, 1, -1)
        if num_drafts > 1:
            static = expanded_cache(target, cache, rows, num_drafts)
            logits = target(input_ids=drafts[:, :-1], use_cache=True, **{keyword: static}).logits
            p = torch.cat([p, probabilities(logits, temperature)], dim=1)  # (rows, K, V)
        p_draft = p.gather(-1, drafts[..., None]).squeeze(-1)
        q_draft = q_KV.gather(-1, drafts.T).T
        ratio = (p_draft / q_draft).clamp(max=1.0)
        overlap = torch.minimum(p, q_KV).sum(-1)  # slot k's acceptance, averaged over its own draw
        before = torch.cat([torch.ones(rows, 1), ratio[:, :-1].cumprod(1)], dim=1)  # slots < k all accepted
        accepted.append((before * overlap).double())
    return torch.cat(accepted)


def one_hot_argmax(q_KV: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(q_KV).scatter_(-1, q_KV.argmax(-1, keepdim=True), 1.0)


def sharpened(q_KV: torch.Tensor, factor: float) -> torch.Tensor:
    """q^(1/F) renormalised: `sample:F`'s draws from softmax(logits / (F T)) when q = softmax(logits / T)."""
    logq = q_KV.clamp_min(1e-38).log() / factor
    return torch.softmax(logq, dim=-1)


@torch.inference_mode()
def tree_reach(target, cache, anchor: int, q_KV: torch.Tensor, size: int, temperature: float) -> torch.Tensor:
    """`(K,)`: the probability that the walk of a best-first tree of `size` drafts built from `q_KV` reaches depth
    k (accepts k drafts); tau = 1 + its sum. `cache` holds the context up to its last token `anchor`; the tree's
    forward reads the anchor again as its root, so it runs on a copy without it (as served: the anchor is never
    in the cache before its verification). The probability of reaching a node is the product of the target's
    probabilities of the tokens on its path, each at its parent: the walk follows a child exactly when the
    target samples that child's token there."""
    tree = best_first_tree(anchor, q_KV.clamp_min(1e-38).log(), size)
    p_NV = probabilities(tree_logits(target, cache, tree), temperature)
    return reach_by_depth(tree, [float(p_NV[parent, token]) for parent, token in zip(tree.parents, tree.tokens)],
                          q_KV.shape[0])


def tree_logits(target, cache, tree) -> torch.Tensor:
    """`(n, V)`: the target's logits at the tree's nodes, verified on a copy of `cache` without its last token
    (the anchor, the tree's root)."""
    session = TargetSession(target, [0])
    session.cache = copy.deepcopy(cache)
    session.cache.crop(-1)
    _, _, logits = verify_tree(session, tree, target.device, target.get_input_embeddings().weight.dtype)
    return logits[0]


def reach_by_depth(tree, passes: list[float], num_drafts: int) -> torch.Tensor:
    """`(K,)`: the summed probability of reaching the tree's nodes at each depth 1..K, where the walk reaches node i
    from its parent with probability `passes[i]` (node 0's is unused)."""
    reach = [1.0]
    depth_reach = torch.zeros(num_drafts, dtype=torch.float64)
    for node in range(1, len(tree.tokens)):
        reach.append(reach[tree.parents[node]] * passes[node])
        depth_reach[tree.depths[node] - 1] += reach[node]
    return depth_reach


def keep_probabilities(tree, q_KV: torch.Tensor, p_NV: torch.Tensor) -> torch.Tensor:
    """`(n, width)`: the probability that node n keeps its child of rank r under `recursive_verdicts`' rule,
    exactly for the drawn children the tree holds: child r is tried after children 0..r-1 were rejected, and is
    kept with probability min(1, p_r(y_r) / q_r(y_r)), where a rejection of y_r turns p_r into
    norm(max(0, p_r - q_r)) and q_r into q_r without y_r, renormalised (deterministic updates: they depend on
    which child was rejected, never on the draw that rejected it)."""
    children, counts = tree.child_tokens()
    size, width = children.shape
    inner = counts.nonzero().squeeze(-1)  # the nodes with children (a leaf keeps none)
    keep_all = torch.zeros(size, width, dtype=torch.float64)
    children, counts = children[inner], counts[inner]
    p = p_NV[inner].double()
    q = q_KV.double()[torch.tensor(tree.depths)[inner].clamp(max=q_KV.shape[0] - 1)]
    alive = torch.ones(len(inner), dtype=torch.float64)  # all earlier children rejected
    keep = torch.zeros(len(inner), width, dtype=torch.float64)
    for rank in range(width):
        token = children[:, rank:rank + 1]
        trying = rank < counts
        ratio = (p.gather(-1, token) / q.gather(-1, token).clamp_min(1e-300)).squeeze(-1).clamp(max=1.0)
        keep[:, rank] = torch.where(trying, alive * ratio, 0.0)
        alive = torch.where(trying, alive * (1 - ratio), alive)
        p, q = after_rejection(p, q, token, trying[:, None])  # the served rule's update
    keep_all[inner] = keep
    return keep_all


@torch.inference_mode()
def stree_reach(target, cache, anchor: int, q_KV: torch.Tensor, size: int, temperature: float, generator,
                draws: int) -> torch.Tensor:
    """`(K,)`: as `tree_reach` for `stree:N` (`drawn_tree` over q, `recursive_verdicts`): the probability that the
    walk accepts k drafts, exact per drawn tree (`keep_probabilities`), averaged over `draws` trees drawn afresh."""
    depth_reach = torch.zeros(q_KV.shape[0], dtype=torch.float64)
    logq_KV = q_KV.clamp_min(1e-38).log()
    for _ in range(draws):
        tree, q_drawn = drawn_tree(anchor, logq_KV, size, 1.0, generator)
        keep = keep_probabilities(tree, q_drawn, probabilities(tree_logits(target, cache, tree), temperature))
        passes = [float(keep[parent, rank]) for parent, rank in zip(tree.parents, tree.ranks)]
        depth_reach += reach_by_depth(tree, passes, q_KV.shape[0])
    return depth_reach / draws


# ----------------------------------------------------------------------------- contexts and the oracle per context


def sampled_contexts(target, prompt_ids: list[int], offsets: list[int], stops: list[int], temperature: float,
                     generator) -> list[tuple[int, list[int]]]:
    """`(offset, context ids)`: the prompt and the first `offset` tokens of one continuation the target samples
    at `temperature`, for each offset the continuation reaches before its end token."""
    longest = max(offsets)
    continuation = []
    if longest:
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=target.device)
        continuation = plain_generate(target, ids, longest, stops, temperature, generator)
    end = next((index for index, token in enumerate(continuation) if token in stops), len(continuation))
    return [(offset, prompt_ids + continuation[:offset]) for offset in offsets if offset <= end]


def measure_context(target, label: str, offset: int, context_ids: list[int], args, temperature: float,
                    generator) -> ContextResult:
    """Every policy's oracle acceptance at one context."""
    num_drafts = args.block - 1
    cache, logits = prefill(target, context_ids)
    first_V = probabilities(logits, temperature)
    q, q_check = oracle_marginals(target, cache, first_V, num_drafts, args.samples, temperature, generator,
                                  args.chunk, args.check_samples)

    def chain(q_KV, blocks=args.blocks):
        return chain_acceptance(target, cache, first_V, q_KV, blocks, temperature, generator, args.chunk)

    oracle = chain(q)
    result = ContextResult(prompt=label, offset=offset, context_tokens=len(context_ids),
                           oracle=oracle.mean(0).tolist(), check=chain(q_check).mean(0).tolist(),
                           argmax=chain(one_hot_argmax(q), 1)[0].tolist(), oracle_block_sd=float(oracle.sum(1).std()))
    for factor in args.sharpen:
        result.sharpened[f"sample:{factor:g}"] = chain(sharpened(q, factor)).mean(0).tolist()
    for size in args.trees:
        result.trees[f"tree:{size}"] = tree_reach(target, cache, context_ids[-1], q, size, temperature).tolist()
    for size in args.strees:
        result.trees[f"stree:{size}"] = stree_reach(target, cache, context_ids[-1], q, size, temperature, generator,
                                                    args.tree_draws).tolist()
    return result


def policies(result: ContextResult, check_samples: int) -> dict[str, list[float]]:
    """Policy name -> per-slot acceptance, in the tables' order. "best chain" is, per context, the chain policy
    of the oracle (sample, sample:F, argmax) with the highest tau: a drafter's q can be any distribution (its
    logits are free), so one that is one-hot or sharpened in some contexts is as served by `sample` as any
    other. Picked on the same simulation it reports, so a little optimistic where the simulation is noisy."""
    chains = {"sample (oracle)": result.oracle, **result.sharpened, "argmax": result.argmax}
    best = max(chains.values(), key=sum)
    return {"sample (oracle)": result.oracle, f"sample, M={check_samples}": result.check, **result.sharpened,
            "argmax": result.argmax, "best chain": best, **result.trees}


# ----------------------------------------------------------------------------- statistics and reporting


def clustered_mean(values: list[float], groups: list[str]) -> tuple[float, float]:
    """`(mean, standard error)` of the mean of `values`, clustered by `groups` (values of one group are
    correlated: one prompt's contexts share its continuation); nan with fewer than two groups."""
    values_n = np.asarray(values, dtype=np.float64)
    mean = float(values_n.mean())
    labels = sorted(set(groups))
    if len(labels) < 2:
        return mean, float("nan")
    sums = np.array([sum(value - mean for value, group in zip(values_n, groups) if group == label)
                     for label in labels])
    return mean, float(np.sqrt(len(labels) / (len(labels) - 1) * (sums ** 2).sum()) / len(values_n))


def summarize(results: list[ContextResult], args) -> dict:
    """Per policy: tau (mean, clustered standard error) and the mean per-slot acceptance; the check's paired
    difference and the M-sample bias it implies, per offset the oracle's tau."""
    groups = [result.prompt for result in results]
    table = {}
    for name in policies(results[0], args.check_samples):
        slots = np.array([policies(result, args.check_samples)[name] for result in results])
        mean, se = clustered_mean((1 + slots.sum(1)).tolist(), groups)
        table[name] = {"tau": mean, "se": se, "slots": slots.mean(0).tolist()}
    difference, se = clustered_mean([sum(result.oracle) - sum(result.check) for result in results], groups)
    # If the bias is a / M: tau(M) - tau(m) = a (M - m) / (m M), and the bias left at M, a / M, is that x m / (M - m).
    left = difference * args.check_samples / (args.samples - args.check_samples)
    offsets = sorted({result.offset for result in results})
    return {
        "contexts": len(results), "prompts": len(set(groups)), "policies": table,
        "check_difference": {"tau": difference, "se": se, "bias_left_at_M": left},
        "oracle_by_offset": {str(offset): float(np.mean([1 + sum(r.oracle) for r in results if r.offset == offset]))
                             for offset in offsets},
        "block_sd": float(np.mean([result.oracle_block_sd for result in results])),
    }


def report(summaries: list[dict], args) -> None:
    names = list(summaries[0]["summary"]["policies"])
    rows = []
    for entry in summaries:
        summary = entry["summary"]
        cells = [f"{summary['policies'][name]['tau']:.3f} ± {summary['policies'][name]['se']:.3f}" for name in names]
        rows.append([entry["prompts"], f"{entry['temperature']:g}", f"{summary['contexts']} ({summary['prompts']})",
                     *cells])
    print_table(f"oracle tau at T > 0 (M = {args.samples} continuations, S = {args.blocks} blocks per context, "
                f"block {args.block}; mean ± standard error over contexts, clustered by prompt)",
                ["prompts", "T", "contexts (prompts)", *names], rows)
    print_table("fraction of blocks accepting slot k (k = 1..B-1), as `dflash eval`'s slot acceptance",
                ["prompts", "T", "policy", *[str(k) for k in range(1, args.block)]],
                [[entry["prompts"], f"{entry['temperature']:g}", name,
                  *[f"{value:.2f}" for value in entry["summary"]["policies"][name]["slots"]]]
                 for entry in summaries for name in ("sample (oracle)", "argmax")])
    offsets = list(summaries[0]["summary"]["oracle_by_offset"])
    rows = []
    for entry in summaries:
        summary, check = entry["summary"], entry["summary"]["check_difference"]
        rows.append([entry["prompts"], f"{entry['temperature']:g}",
                     *[f"{summary['oracle_by_offset'].get(offset, float('nan')):.3f}" for offset in offsets],
                     f"{check['tau']:+.3f} ± {check['se']:.3f}", f"{check['bias_left_at_M']:+.3f}",
                     summary["block_sd"]])
    print_table("the oracle's tau by offset (generated tokens before the anchor), and its convergence in M",
                ["prompts", "T", *[f"offset {offset}" for offset in offsets],
                 f"tau(M={args.samples}) - tau(M={args.check_samples})", f"bias left at M={args.samples} (~1/M)",
                 "one block's sd"], rows)


# ----------------------------------------------------------------------------- main


def load(args):
    from dflash.config import load_config
    from dflash.data.tokenizer import load_target_tokenizer
    from dflash.extract.target import load_causal_lm, prepare_checkpoint, stop_token_ids

    config = load_config(args.config, args.overrides)
    checkpoint = prepare_checkpoint(config.target.path, config.data.cache_dir)
    tokenizer = load_target_tokenizer(checkpoint, config.target.chat_template)
    target = load_causal_lm(str(checkpoint), torch.float32, torch.device("cpu"))
    return config, tokenizer, target, stop_token_ids(tokenizer, target)


def spread_prompts(config, source: str, num_prompts: int, pool: int, tokenizer):
    """`num_prompts` prompts evenly spaced over the first `pool` (0: all) of `source`, loaded as `dflash eval
    --prompts` loads them: a set's first rows are often alike (code-docs' come module by module)."""
    from dflash.serve.evaluation import load_prompts

    prompts = load_prompts(config, source, pool or 10 ** 9, tokenizer)
    picks = np.unique(np.linspace(0, len(prompts) - 1, min(num_prompts, len(prompts))).round().astype(int))
    return [prompts[index] for index in picks]


def parse_args(argv):
    numbers = lambda kind: lambda text: [kind(item) for item in text.split(",") if item.strip()]  # noqa: E731
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-c", "--config", default=None, help="the target's config (a plain-attention target)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="config overrides KEY=VALUE")
    parser.add_argument("--prompts", type=numbers(str), default="embedded:code-docs,embedded:chat-heldout",
                        help="prompt sets, comma-separated, each as `dflash eval --prompts` takes it")
    parser.add_argument("--num-prompts", type=int, default=16, help="prompts per set")
    parser.add_argument("--pool", type=int, default=0, help="spread the prompts over a set's first POOL (0: all)")
    parser.add_argument("--offsets", type=numbers(int), default="0,32,64",
                        help="generated tokens before each context's anchor")
    parser.add_argument("--temperatures", type=numbers(float), default="1.0,0.7")
    parser.add_argument("--samples", type=int, default=128, help="M: continuations that estimate the marginals")
    parser.add_argument("--check-samples", type=int, default=32, help="the oracle again from the first M' of them")
    parser.add_argument("--blocks", type=int, default=32, help="S: simulated blocks per context and policy")
    parser.add_argument("--sharpen", type=numbers(float), default="0.5", help="sample:F policies of the oracle")
    parser.add_argument("--trees", type=numbers(int), default="64", help="tree sizes built from the oracle (none: '')")
    parser.add_argument("--strees", type=numbers(int), default="64",
                        help="sampled trees (`stree:N`: children drawn from the oracle q) of these sizes (none: '')")
    parser.add_argument("--tree-draws", type=int, default=8, help="sampled trees drawn per context and size")
    parser.add_argument("--block", type=int, default=16, help="block size B (B-1 drafted slots)")
    parser.add_argument("--chunk", type=int, default=64, help="rows per target forward")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    if args.block < 2 or not 0 < args.check_samples < args.samples or min(args.temperatures) <= 0:
        parser.error("need --block >= 2, 0 < --check-samples < --samples and temperatures > 0")
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    config, tokenizer, target, stops = load(args)
    sets = {source: spread_prompts(config, source, args.num_prompts, args.pool, tokenizer) for source in args.prompts}
    summaries, start = [], time.perf_counter()
    for temperature in args.temperatures:
        for source, prompts in sets.items():
            results, began = [], time.perf_counter()
            for index, prompt in enumerate(prompts):
                generator = torch.Generator().manual_seed(args.seed + index)  # a prompt's draws: its own stream
                for offset, ids in sampled_contexts(target, prompt.ids.tolist(), args.offsets, stops, temperature,
                                                    generator):
                    results.append(measure_context(target, prompt.label, offset, ids, args, temperature, generator))
                    progress(f"{source} T={temperature:g} {prompt.label} offset {offset} ({len(ids)} tokens): "
                             f"oracle tau {1 + sum(results[-1].oracle):.3f}, argmax {1 + sum(results[-1].argmax):.3f}"
                             + "".join(f", {name} {1 + sum(slots):.3f}" for name, slots in results[-1].trees.items()))
            summaries.append({"prompts": source, "temperature": temperature, "seconds": time.perf_counter() - began,
                              "summary": summarize(results, args), "contexts": [asdict(r) for r in results]})
    report(summaries, args)
    print(f"\n{time.perf_counter() - start:.0f} s on {args.threads} thread(s)")
    if args.out:
        write_results(args.out, {"meta": run_metadata(["tools/ceiling_sampled.py", *argv]), "args": vars(args),
                                 "results": summaries})
    return summaries


if __name__ == "__main__":
    main()
