"""Simulate the proposal policies of sampled serving: expected tokens per verification (tau) on a
synthetic target and drafter, on the CPU, before any GPU measurement.

The target is a Markov chain over a small vocabulary: next-token logits a random Gaussian table
(`--peaks` scales them: larger is more peaked), or with `--branches N` text-like rows, where N
plausible next tokens (random ones, logits peak, peak - 1, ...) hold nearly all the mass, so a
block's continuation branches at every slot. A DFlash drafter predicts per-slot marginals, not a joint:
here slot k's logits are the log of the target's true marginal k steps after the anchor (at
temperature 1, what training fits) plus Gaussian noise of scale `--noise` (the drafter's error).
The target verifies slot k against its conditional given the draft before it, so drafts drawn
independently from marginals can form a block the chain never takes. Each policy drafts blocks of
B-1 tokens from random anchors, and the lossless rule (accept x with min(1, p(x)/q(x))) runs on
every slot at once; tau = 1 + the mean number of accepted drafts.

    python tools/sim_proposals.py                       # the default grid
    python tools/sim_proposals.py --vocab 256 --block 16 --temperatures 0.7,1.0 --noises 0.5,1.0
"""

import argparse

import torch


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--block", type=int, default=16, help="block size B (B-1 drafts)")
    parser.add_argument("--blocks", type=int, default=20000, help="simulated blocks per cell")
    parser.add_argument("--peaks", default="3,6", help="target logit scales (comma-separated)")
    parser.add_argument("--noises", default="0.3,1.0", help="drafter logit noise scales (comma-separated)")
    parser.add_argument("--temperatures", default="0.5,1.0", help="serving temperatures (comma-separated)")
    parser.add_argument("--branches", default="0", help="plausible next tokens per token, 0: a dense Gaussian table "
                                                        "(comma-separated)")
    parser.add_argument("--policies", default="argmax,sample,sample:0.5,sample:0.25")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def target_logits(vocab: int, peak: float, branches: int, generator) -> torch.Tensor:
    """`(V, V)` next-token logits: a Gaussian table, or `branches` random plausible tokens per row."""
    if branches == 0:
        return peak * torch.randn(vocab, vocab, generator=generator)
    order = torch.rand(vocab, vocab, generator=generator).argsort(-1)[:, :branches]
    logits = torch.zeros(vocab, vocab)
    logits.scatter_(1, order, peak - torch.arange(branches, dtype=torch.float32).expand(vocab, branches))
    return logits


def drafter_logits(target_VV: torch.Tensor, num_drafts: int, noise: float, generator) -> torch.Tensor:
    """`(V, K, V)`: per anchor, slot k's logits = log of the chain's marginal k+1 steps on (T = 1) + noise."""
    step = torch.softmax(target_VV, -1)
    marginal, rows = torch.eye(target_VV.shape[0]), []
    for _ in range(num_drafts):
        marginal = marginal @ step
        rows.append(marginal.clamp_min(1e-30).log())
    clean = torch.stack(rows, dim=1)
    return clean + noise * torch.randn(clean.shape, generator=generator)


def draft_blocks(logits_NKV: torch.Tensor, policy: str, temperature: float, generator):
    """Drafts `(N, K)` and the q of each draft `(N, K)` (1 for argmax proposals: q is one-hot)."""
    if policy == "argmax":
        tokens = logits_NKV.argmax(-1)
        return tokens, torch.ones(tokens.shape)
    sharpen = float(policy.partition(":")[2] or 1.0)
    q = torch.softmax(logits_NKV / (sharpen * temperature), -1)
    N, K, V = q.shape
    tokens = torch.multinomial(q.reshape(N * K, V), 1, generator=generator).view(N, K)
    return tokens, q.gather(-1, tokens[..., None]).squeeze(-1)


def tau(target_VV, drafts_VKV, policy: str, temperature: float, blocks: int, generator) -> float:
    """1 + mean accepted drafts per block, anchors uniform over the vocabulary."""
    vocab, num_drafts = target_VV.shape[0], drafts_VKV.shape[1]
    anchors = torch.randint(vocab, (blocks,), generator=generator)
    tokens, q_draft = draft_blocks(drafts_VKV[anchors], policy, temperature, generator)
    previous = torch.cat([anchors[:, None], tokens[:, :-1]], 1)  # the context token each slot is verified after
    if temperature <= 0:
        keeps = tokens == target_VV[previous].argmax(-1)
    else:
        p_draft = torch.softmax(target_VV[previous] / temperature, -1).gather(-1, tokens[..., None]).squeeze(-1)
        keeps = torch.rand(p_draft.shape, generator=generator) < p_draft / q_draft
    return 1.0 + float(keeps.int().cumprod(1).sum(1).float().mean())


def main():
    args = parse_args()
    generator = torch.Generator().manual_seed(args.seed)
    policies = args.policies.split(",")
    floats = lambda text: [float(value) for value in text.split(",")]  # noqa: E731
    print(f"vocab {args.vocab}, block {args.block}, {args.blocks:,} blocks per cell; tau = tokens per verification")
    print("| branches | target peak | drafter noise | T | greedy (T=0) | " + " | ".join(policies) + " |")
    print("| ---: | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in policies) + " |")
    cells = [(int(b), peak, noise) for b in args.branches.split(",") for peak in floats(args.peaks)
             for noise in floats(args.noises)]
    for branches, peak, noise in cells:
        target_VV = target_logits(args.vocab, peak, branches, generator)
        drafts_VKV = drafter_logits(target_VV, args.block - 1, noise, generator)
        greedy = tau(target_VV, drafts_VKV, "argmax", 0.0, args.blocks, generator)
        for temperature in floats(args.temperatures):
            taus = [tau(target_VV, drafts_VKV, policy, temperature, args.blocks, generator) for policy in policies]
            print(f"| {branches or 'dense'} | {peak:g} | {noise:g} | {temperature:g} | {greedy:.2f} | "
                  + " | ".join(f"{value:.2f}" for value in taus) + " |")


if __name__ == "__main__":
    main()
