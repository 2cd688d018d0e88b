"""Sampled serving (temperature > 0) is lossless for every proposal policy, shown by counting.

The speculative loop (`speculative_generate`, unchanged) runs a thousand times per policy on a Markov
target, a test double whose next-token logits depend on the last token only (a table), with a
drafter double whose per-slot logits depend on the anchor only (another table, near the
target's). Counting the first three generated tokens, their joint distribution equals the
target's own (exact: p0(t1) P(t2|t1) P(t3|t2)) by a chi-square test, for `argmax`, `sample`,
`sample:0.5`, `tree:3`, `tree:8`, `tree:8:2`, `tree:8x2`, `stree:3`, `stree:8`, `stree:8:0.5` and `stree:8x2` (at
most 2 children a node of the 3 tokens) proposals; a rule that accepts every draft fails the same test. The doubles keep a
draw to a few milliseconds of loop overhead (a tiny transformer costs tens of milliseconds a forward
on a shared CPU), and a target that reads the tokens it verifies still checks that each block
slot is verified against the right context. `plain_generate`, the baseline, samples the same
distribution. On a real tiny Llama and export: every policy at temperature 0 is plain greedy
decoding, and every policy serves at temperature > 0 (and `dflash eval --workers 2` merges to the same
numbers); a tree accepts deeper than the chain when the
drafter's second choice is the right one, and a target whose cache cannot hold a tree is refused. `dflash eval --proposal argmax,sample` (slow)
gives one result per policy and tau per prompt kind.
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from support import sampled_tree_on_cuda
from transformers import LlamaConfig, LlamaForCausalLM

from dflash.model import modeling_dflash
from dflash.model.drafter import DFlashDrafter, drafter_args
from dflash.model.export import export_drafter
from dflash.model.modeling_dflash import (DFlashDraftModel, Proposal, greedy_generate, parse_proposal, plain_generate,
                                          speculative_generate)

VOCAB = 3
BLOCK = 4  # three drafts per block
TEMPERATURE = 1.0
DRAWS = 1000
POLICIES = ["argmax", "sample", "sample:0.5", "tree:3", "tree:8", "tree:8:2", "tree:8x2", "stree:3", "stree:8",
            "stree:8:0.5", "stree:8x2"]


class MarkovCache:
    """A cache with nothing to crop: the Markov target reads no context beyond each token."""
    layers = []

    def crop(self, length: int) -> None:
        pass


class MarkovTarget(torch.nn.Module):
    """A causal LM whose logits after a token are row `token` of a table."""

    def __init__(self, logits_VV: torch.Tensor):
        super().__init__()
        self.table = logits_VV
        self.embed, self.head = torch.nn.Embedding(VOCAB, 1), torch.nn.Linear(1, VOCAB)

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids, use_cache=True, output_hidden_states=False, logits_to_keep=0, past_key_values=None,
                attention_mask=None, position_ids=None):
        """A tree's mask and positions change nothing: each node's logits depend on its own token alone."""
        logits = self.table[input_ids[:, -logits_to_keep:] if logits_to_keep else input_ids]
        features = torch.zeros(*input_ids.shape, 1)
        return SimpleNamespace(logits=logits, hidden_states=(features, features), past_key_values=MarkovCache())


class TableDrafter:
    """Per anchor token, fixed logits for the block's B-1 slots (marginals, as DFlash's)."""
    block_size, target_layer_ids = BLOCK, [0]

    def __init__(self, logits_VKV: torch.Tensor):
        self.table = logits_VKV

    def new_cache(self):
        return None

    def block_logits(self, new_features, anchor, cache, embed_VH, lm_head):
        return self.table[anchor[0]]


def markov_pair(seed: int):
    """A target table and a drafter table near it: the target's next-token logits plus noise, per slot
    the logits of the token the target most likely reaches there."""
    generator = torch.Generator().manual_seed(seed)
    target_VV = 1.5 * torch.randn(VOCAB, VOCAB, generator=generator)
    rows, token = [], torch.arange(VOCAB)
    for _ in range(BLOCK - 1):
        rows.append(target_VV[token] + torch.randn(VOCAB, VOCAB, generator=generator))
        token = target_VV[token].argmax(-1)
    return target_VV, torch.stack(rows, dim=1)


def exact_joint(target_VV: torch.Tensor, last_prompt_token: int) -> np.ndarray:
    """The target's own probability of each first three tokens, flat index t1 * V^2 + t2 * V + t3."""
    P = torch.softmax(target_VV.double() / TEMPERATURE, -1)
    joint = P[last_prompt_token][:, None, None] * P[:, :, None] * P[None, :, :]
    return joint.flatten().numpy()


def counted(generate) -> np.ndarray:
    counts = np.zeros(VOCAB ** 3)
    for _ in range(DRAWS):
        t1, t2, t3 = generate()[:3]
        counts[(t1 * VOCAB + t2) * VOCAB + t3] += 1
    return counts


def chi_square_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's test, the cells expected fewer than 5 times pooled into one (the test's approximation)."""
    expected = probs * counts.sum()
    rare = expected < 5
    counts = np.append(counts[~rare], counts[rare].sum())
    expected = np.append(expected[~rare], expected[rare].sum())
    statistic = float(((counts - expected) ** 2 / expected).sum())
    # the chi-square distribution's survival function: Q(df / 2, statistic / 2)
    return float(torch.special.gammaincc(torch.tensor((expected.size - 1) / 2), torch.tensor(statistic / 2)))


def spec_counts(seed: int, policy: str) -> tuple[np.ndarray, np.ndarray]:
    target_VV, drafter_VKV = markov_pair(seed)
    target, drafter = MarkovTarget(target_VV), TableDrafter(drafter_VKV)
    prompt = torch.tensor([[0, 1]])
    generator = torch.Generator().manual_seed(seed + 100)
    proposal = parse_proposal(policy)
    counts = counted(lambda: speculative_generate(drafter, target, prompt, 3, [], TEMPERATURE, generator,
                                                  proposal).generated)
    return counts, exact_joint(target_VV, 1)


@pytest.mark.parametrize("policy", POLICIES)
def test_sampled_speculative_output_is_distributed_as_the_target(policy):
    counts, probs = spec_counts(0, policy)
    assert counts.sum() == DRAWS
    assert chi_square_p_value(counts, probs) > 1e-3, policy


def test_a_rule_that_accepts_every_draft_fails_the_same_test(monkeypatch):
    """The test can fail: committing the drafts unverified serves the drafter's distribution."""

    def accept_all(draft_tokens, q_KV, target_logits, temperature, generator):
        num_drafts = draft_tokens.shape[0]
        p_last = torch.softmax(target_logits[num_drafts].float() / temperature, -1)
        return torch.tensor(num_drafts), torch.multinomial(p_last, 1, generator=generator)[0]

    monkeypatch.setattr(modeling_dflash, "sampled_verdict", accept_all)
    counts, probs = spec_counts(0, "argmax")
    assert chi_square_p_value(counts, probs) < 1e-6


def test_plain_sampling_is_distributed_as_the_target():
    target_VV, _ = markov_pair(1)
    generator = torch.Generator().manual_seed(7)
    counts = counted(lambda: plain_generate(MarkovTarget(target_VV), torch.tensor([[2]]), 3, (), TEMPERATURE,
                                            generator))
    assert chi_square_p_value(counts, exact_joint(target_VV, 2)) > 1e-3


def test_proposal_policies_parse_and_name_a_bad_value():
    assert parse_proposal("argmax") == Proposal()
    assert parse_proposal("sample") == Proposal(sample=True)
    assert parse_proposal(" sample:0.5 ") == Proposal(sample=True, sharpen=0.5)
    assert parse_proposal("tree:64") == parse_proposal("tree:64:1") == Proposal(tree=64)
    assert parse_proposal("tree:64:2") == Proposal(tree=64, sharpen=2.0)
    assert parse_proposal("stree:64") == parse_proposal("stree:64:1") == Proposal(tree=64, drawn=True)
    assert parse_proposal("stree:8:0.5") == Proposal(tree=8, sharpen=0.5, drawn=True)
    assert parse_proposal("stree:256x32") == Proposal(tree=256, drawn=True, width=32)
    assert parse_proposal("tree:64x16:2") == Proposal(tree=64, sharpen=2.0, width=16)
    assert parse_proposal("stree:64x8") == parse_proposal("stree:64")  # 8 children a node: the default
    assert [parse_proposal(text).name for text in ("argmax", "sample", "sample:0.5", "sample:1", "tree:8",
                                                   "tree:8:2", "stree:8", "stree:8:0.5", "stree:8x8", "stree:8x32",
                                                   "tree:8x2:2")] == \
        ["argmax", "sample", "sample:0.5", "sample", "tree:8", "tree:8:2", "stree:8", "stree:8:0.5", "stree:8",
         "stree:8x32", "tree:8x2:2"]
    chains = {parse_proposal(text).greedy_key() for text in ("argmax", "sample", "sample:0.5")}
    trees = {parse_proposal(text).greedy_key() for text in ("tree:8", "tree:16", "tree:8:2")}
    assert len(chains) == 1 and len(trees) == 3 and not chains & trees
    # at T = 0 a sampled tree serves tree:N's tree (its F scales the serving temperature, 0 there)
    assert parse_proposal("stree:8").greedy_key() == parse_proposal("stree:8:0.5").greedy_key() == \
        parse_proposal("tree:8").greedy_key() != parse_proposal("stree:8x32").greedy_key()  # another shape
    for bad in ("greedy", "sample:", "sample:0", "sample:-1", "sample:x", "argmax:2", "sample:inf", "", "tree",
                "tree:0", "tree:-3", "tree:2.5", "tree:1025", "tree:8:0", "tree:8:x", "tree::2", "sample:nan",
                "stree", "stree:0", "stree:8:0", "stree:1025", "stree:8x0", "stree:8x65", "stree:8x", "tree:x8",
                "stree:8xa", "tree:8x2x2"):
        with pytest.raises(ValueError, match=f"proposal {bad!r}: expected argmax, sample or sample:F.*or tree:N"):
            parse_proposal(bad)


def test_argmax_proposals_are_q_one_hot():
    """argmax drafts the drafter's top token at any temperature and leaves q one-hot (None); sample:F draws
    from softmax(logits / (F T))."""
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    tokens, q = Proposal().draft(logits, 1.0, None)
    assert tokens.tolist() == [1, 0] and q is None
    tokens, q = parse_proposal("sample:0.5").draft(logits, 2.0, torch.Generator().manual_seed(0))
    torch.testing.assert_close(q, torch.softmax(logits, -1))
    tokens, q = Proposal(sample=True).draft(logits, 0.0, None)  # temperature 0: greedy whatever the policy
    assert tokens.tolist() == [1, 0] and q is None


def tiny_pair(tmp_path):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         initializer_range=0.3)
    target = LlamaForCausalLM(config).eval()
    args = drafter_args("tiny", vocab_size=64, mask_token_id=63, hidden_size=32, target_layer_ids=(0, 2), block_size=8)
    export_drafter(DFlashDrafter(args).state_dict(), args, tmp_path, dtype=torch.float32)
    return target, DFlashDraftModel.from_pretrained(tmp_path, dtype=torch.float32).eval()


def test_every_policy_is_greedy_at_temperature_zero_and_serves_above_it(tmp_path):
    target, draft = tiny_pair(tmp_path)
    prompt = torch.tensor([[3, 14, 15, 9, 26]])
    greedy = greedy_generate(target, prompt, 16)
    for policy in POLICIES:
        out = draft.spec_generate(target, prompt, 16, temperature=0.0, return_stats=True, proposal=policy)
        assert out.generated == greedy, policy
        sampled = speculative_generate(draft, target, prompt, 16, [], 0.8, torch.Generator().manual_seed(1),
                                       parse_proposal(policy))
        assert len(sampled.generated) == 16 and all(0 <= token < 64 for token in sampled.generated)
        assert all(1 <= length <= 8 for length in sampled.acceptance_lengths)
    assert plain_generate(target, prompt, 16) == greedy


@pytest.mark.slow
def test_eval_serves_every_listed_policy_with_tau_by_kind(tmp_path, pipeline_config, capsys, monkeypatch):
    """`dflash eval --temperature 0.8 --proposal argmax,sample` on the embedded tiny target: one result per
    policy on the same prompts, the JSON names each result's policy and gives tau per prompt kind; with
    `--workers 2` the same numbers, prompt for prompt; a timed prompt decoded first (before the untimed ones)
    keeps its place in the results; a killed eval continues from its partial file."""
    import dataclasses
    import json
    from pathlib import Path

    from dflash.config import ConfigError, load_config
    from dflash.extract.target import load_causal_lm, prepare_checkpoint
    from stages import evaluate

    config_path = pipeline_config(tmp_path, 2, 1, "")
    config = load_config(config_path)
    target = load_causal_lm(str(prepare_checkpoint(config.target.path, config.data.cache_dir)), torch.float32,
                            torch.device("cpu"))
    vocab, hidden = target.get_input_embeddings().weight.shape
    args = drafter_args("tiny", vocab_size=vocab, mask_token_id=vocab - 1, hidden_size=hidden, block_size=4)
    export_drafter(DFlashDrafter(args).state_dict(), args, tmp_path / "export", dtype=torch.float32)
    rows = [{"kind": kind, "messages": [{"role": "user", "content": text}]}
            for kind, text in (("writing", "Write a haiku about rain."), ("code", "Reverse a list in Python."))]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    options = evaluate.EvalOptions(drafters=(str(tmp_path / "export"),), prompts=str(tmp_path / "prompts.jsonl"),
                                   num_prompts=2, max_new_tokens=6, temperature=0.8, proposals=("argmax", "sample"),
                                   device="cpu", out=str(tmp_path / "eval.json"))
    evaluate.run(config, options)
    printed = capsys.readouterr().out
    assert "| argmax |" in printed and "| sample |" in printed and "tau by prompt kind: code" in printed
    results = json.loads((tmp_path / "eval.json").read_text())["results"]
    assert [result["proposal"] for result in results] == ["argmax", "sample"]
    for result in results:
        assert sorted(result["tau_by_kind"]) == ["code", "writing"] and result["num_prompts"] == 2
        assert [prompt["kind"] for prompt in result["per_prompt"]] == ["writing", "code"]
    with pytest.raises(ValueError, match="--proposal: proposal 'top-k'"):
        evaluate.run(config, evaluate.EvalOptions(drafters=options.drafters, proposals=("argmax", "top-k")))
    # --workers 2: two processes each serve a contiguous share, untimed; the merged JSON is this run's, prompt for
    # prompt (every random stream restarts at each prompt from the seed plus the prompt's index); once they have
    # ended this process decodes the first prompt again alone, and only its times make the speed figures: at
    # temperature > 0 the untimed prompt skips the plain baseline, which serves nothing else
    sharded = dataclasses.replace(options, workers=2, out=str(tmp_path / "eval-2.json"), timed_prompts=1)
    evaluate.run(config, sharded, ["-c", str(config_path)])
    assert "decoded again in one process alone on the device" in capsys.readouterr().out
    for one, two in zip(results, json.loads((tmp_path / "eval-2.json").read_text())["results"], strict=True):
        for key in ("prompt_id", "acceptance_lengths", "generated_ids"):
            assert [p[key] for p in two["per_prompt"]] == [p[key] for p in one["per_prompt"]], key
        assert [p["baseline_tokens"] for p in two["per_prompt"]] == [one["per_prompt"][0]["baseline_tokens"], 0]
        assert two["per_prompt"][1]["baseline_seconds"] == 0 and one["per_prompt"][1]["baseline_tokens"] > 0
        for key in ("proposal", "num_prompts", "generated_tokens", "verifications", "tau", "histogram", "tau_by_kind"):
            assert two[key] == one[key], key
        assert [p["timed"] for p in two["per_prompt"]] == [True, False] and two["timed_prompts"] == 1
        assert two["timing"] == "alone" and two["retimed_differing"] == 0 and one["timing"] == "inline"
        timed = two["per_prompt"][0]
        assert two["speedup"] == pytest.approx(timed["baseline_seconds"] / timed["spec_seconds"]
                                               * timed["generated_tokens"] / timed["baseline_tokens"])
        assert two["ms_per_verification"] == pytest.approx(1e3 * timed["spec_seconds"] / timed["target_forwards"])
        assert two["baseline_ms_per_token"] == pytest.approx(1e3 * timed["baseline_seconds"] / timed["baseline_tokens"])
    assert not (tmp_path / "eval-2.json.shards").exists()
    # --defer-timing: every prompt served untimed, no speed figures, the options written beside the results; `dflash
    # time-evals` then decodes the timed prompt again alone and writes the JSON back; a second call leaves it
    deferred = dataclasses.replace(options, out=str(tmp_path / "eval-deferred.json"), timed_prompts=1,
                                   defer_timing=True)
    evaluate.run(config, deferred)
    assert "not yet timed" in capsys.readouterr().out
    written = json.loads(Path(deferred.out).read_text())
    assert written["options"]["defer_timing"] is True and written["options"]["timed_prompts"] == 1
    for one, late in zip(results, written["results"], strict=True):
        assert late["timing"] == "deferred" and late["timed_prompts"] == 0 and late["speedup"] == 0
        assert [p["baseline_tokens"] for p in late["per_prompt"]] == [0, 0]
        assert [p["generated_ids"] for p in late["per_prompt"]] == [p["generated_ids"] for p in one["per_prompt"]]
    summary = tmp_path / "timing.json"
    assert evaluate.time_evals(config, [deferred.out], "cpu", str(summary)) == [deferred.out]
    assert "decoded again in one process alone" in capsys.readouterr().out
    timed_late = json.loads(Path(deferred.out).read_text())
    for one, late in zip(results, timed_late["results"], strict=True):
        assert late["timing"] == "alone" and late["timed_prompts"] == 1 and late["retimed_differing"] == 0
        assert [p["timed"] for p in late["per_prompt"]] == [True, False] and late["speedup"] > 0
        assert late["per_prompt"][0]["baseline_tokens"] == one["per_prompt"][0]["baseline_tokens"]
        for key in ("acceptance_lengths", "generated_ids", "kind"):
            assert [p[key] for p in late["per_prompt"]] == [p[key] for p in one["per_prompt"]], key
        assert late["tau"] == one["tau"] and late["tau_by_kind"] == one["tau_by_kind"]
    assert json.loads(summary.read_text())["evals"][0]["timed"] is True
    assert evaluate.time_evals(config, [deferred.out], "cpu") == []  # timed already: left as it is
    assert "timed already (alone), left as it is" in capsys.readouterr().out
    assert json.loads(Path(deferred.out).read_text()) == timed_late
    other = dataclasses.replace(config, target=dataclasses.replace(config.target, path="embedded:other"))
    evaluate.run(config, dataclasses.replace(deferred, out=str(tmp_path / "eval-deferred-2.json")))
    with pytest.raises(ConfigError, match="target.path is 'embedded:other' but .* served"):
        evaluate.time_evals(other, [str(tmp_path / "eval-deferred-2.json")], "cpu")
    monkeypatch.setattr(evaluate, "spread", lambda chosen, count: {1})  # the last prompt timed: decoded first
    second_timed = dataclasses.replace(sharded, workers=1, out=str(tmp_path / "eval-last-timed.json"))
    capsys.readouterr()
    evaluate.run(config, second_timed)
    for one, last in zip(results, json.loads((tmp_path / "eval-last-timed.json").read_text())["results"], strict=True):
        for key in ("prompt_id", "acceptance_lengths", "generated_ids", "kind"):
            assert [p[key] for p in last["per_prompt"]] == [p[key] for p in one["per_prompt"]], key
        assert [p["timed"] for p in last["per_prompt"]] == [False, True] and last["tau"] == one["tau"]
    monkeypatch.undo()
    # killed after its first prompt, an eval rerun with the same options continues from OUT.partial.jsonl: it
    # serves the second prompt alone and writes the uninterrupted run's numbers, then removes the partial file
    resumed = dataclasses.replace(options, out=str(tmp_path / "eval-resumed.json"))
    partial = tmp_path / "eval-resumed.json.partial.jsonl"
    served_prompts, decode = [], evaluate.decode_prompt

    class Killed(Exception):
        pass

    def killed_at_the_second_prompt(*args, **kwargs):
        served_prompts.append(args[2])
        if len(set(served_prompts)) > 1:
            raise Killed
        return decode(*args, **kwargs)

    monkeypatch.setattr(evaluate, "decode_prompt", killed_at_the_second_prompt)
    with pytest.raises(Killed):
        evaluate.run(config, resumed)
    assert len(partial.read_text().splitlines()) == 2  # the run's identity, the first prompt
    with partial.open("a") as cut:
        cut.write('{"index": 1, "decoded": [{"prompt_')  # a line a kill cut short: served again
    first_label, served_prompts[:] = served_prompts[0], []
    monkeypatch.setattr(evaluate, "decode_prompt", lambda *args, **kwargs: served_prompts.append(args[2]) or
                        decode(*args, **kwargs))
    evaluate.run(config, resumed)
    assert served_prompts and first_label not in served_prompts and not partial.exists()
    assert "continuing after 1 prompts served" in capsys.readouterr().out
    for one, again in zip(results, json.loads(Path(resumed.out).read_text())["results"], strict=True):
        for key in ("prompt_id", "acceptance_lengths", "generated_ids"):
            assert [p[key] for p in again["per_prompt"]] == [p[key] for p in one["per_prompt"]], key
    other_drafter = dataclasses.replace(resumed, seed=1)  # another run's partial file is not continued
    Path(resumed.out + ".partial.jsonl").write_text(json.dumps({"identity": {"seed": 0}}) + "\n")
    evaluate.run(config, other_drafter)
    assert "written by another run" in capsys.readouterr().out


def test_best_first_tree_adds_the_likeliest_paths_first():
    """Slot 0 sure of token 1; slot 1 torn between 2 and 3; slot 2 sure of 0: the tree holds both
    branches' full paths before any third-choice token, parents before children."""
    logits = torch.tensor([[0.0, 9.0, 0.0, 0.0], [0.0, 0.0, 5.0, 4.5], [9.0, 0.0, 0.0, 0.0]])
    tree = modeling_dflash.best_first_tree(7, logits, size=5, width=4)
    assert tree.tokens == [7, 1, 2, 0, 3, 0]
    assert tree.parents == [-1, 0, 1, 2, 1, 4]
    assert tree.depths == [0, 1, 2, 3, 2, 3]
    seen = tree.ancestors()
    assert seen[5].nonzero().flatten().tolist() == [0, 1, 4, 5]
    path, next_token = modeling_dflash.walk_tree(tree, [1, 3, 0, 2, 0, 5])
    assert path == [0, 1, 4, 5] and next_token == 5


def test_a_wider_tree_gives_a_node_more_children():
    """tree:NxW / stree:NxW: with a flat first slot the best-first build (and the drawn tree, whose shape is the
    same) gives the anchor up to W children; 8 without a width, as before."""
    logits = torch.zeros(3, 64)
    logits[1:, 0] = 9.0  # later slots sure: the flat first slot's candidates are the likeliest nodes
    for width, children in ((None, 8), (32, 32), (2, 2)):
        kwargs = {} if width is None else {"width": width}
        built = modeling_dflash.best_first_tree(5, logits, size=40, **kwargs)
        drawn, _ = modeling_dflash.drawn_tree(5, logits, 40, 1.0, torch.Generator().manual_seed(0), **kwargs)
        for tree in (built, drawn):
            assert tree.child_tokens()[1][0] == children and max(tree.child_tokens()[1].tolist()) == children
    root = [token for token, parent in zip(drawn.tokens, drawn.parents) if parent == 0]
    assert len(set(root)) == len(root) == 2  # the anchor's draws, without replacement


def test_recursive_verdicts_follow_the_residuals():
    """A sampled tree's rule by hand: the anchor's two children (tokens 0 then 1, drawn from q = [.5, .5, 0])
    against p = [0, .2, .8]: token 0 is rejected (p(0) = 0), the residual is [0, 0, 1], so token 1 is rejected
    too and token 2 is drawn, every time. Node 1's one child (token 1) against p = q = [.5, .5, 0] at its slot
    is always kept; node 2, a leaf, draws from its own p."""
    tree = modeling_dflash.DraftTree(tokens=[9, 0, 1, 1], parents=[-1, 0, 0, 1], depths=[0, 1, 1, 2],
                                     ranks=[0, 0, 1, 0])
    q_KV = torch.tensor([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0]])
    p = torch.tensor([[0.0, 0.2, 0.8], [0.5, 0.5, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    for seed in range(20):
        kept, drawn = modeling_dflash.recursive_verdicts(tree, q_KV, p.log(), 1.0, torch.Generator().manual_seed(seed))
        assert kept[:3] == [-1, 0, -1] and drawn[0] == 2 and drawn[2] == 2
        assert modeling_dflash.walk_drawn(tree, kept, drawn) == ([0], 2)


def plain_verdicts(tree, q_KV, target_logits, temperature, generator):
    """`recursive_verdicts` as first written: every node runs every try (a try past its children changes
    nothing), the reference of the fast path's slices."""
    size = len(tree.tokens)
    children, counts = tree.child_tokens()
    width = children.shape[1]
    p = torch.softmax(target_logits.float() / temperature, dim=-1)
    q = q_KV[torch.tensor(tree.depths).clamp(max=q_KV.shape[0] - 1)]
    kept = torch.full((size,), -1, dtype=torch.long)
    tried = torch.rand(size, width, generator=generator)
    for rank in range(width):
        token = children[:, rank:rank + 1]
        trying = (kept < 0) & (rank < counts)
        p_y, q_y = p.gather(-1, token).squeeze(-1), q.gather(-1, token).squeeze(-1)
        keep = trying & (tried[:, rank] * q_y < p_y)
        kept = torch.where(keep, rank, kept)
        p, q = modeling_dflash.after_rejection(p, q, token, (trying & ~keep)[:, None])
    return kept.tolist(), torch.multinomial(p, 1, generator=generator).squeeze(-1).tolist()


@pytest.mark.parametrize("size, width", [(1, 8), (7, 8), (64, 8), (200, 8), (64, 3), (200, 16)])
def test_recursive_verdicts_equal_every_node_running_every_try(size, width):
    """The verdicts in closed form over the nodes with children only (padded rows and tries trying nothing)
    equal the plain rule over every node and try with the residuals iterated, draw for draw, on fresh random
    trees and target logits."""
    kept_somewhere = False
    for seed in range(4):
        torch.manual_seed(seed)
        vocab, slots = 50, 6
        drafter_logits = torch.randn(slots, vocab) * 2
        tree, q_KV = modeling_dflash.drawn_tree(3, drafter_logits, size, 0.8, torch.Generator().manual_seed(seed),
                                                width=width)
        assert len(tree.tokens) == size + 1
        # the target near the drafter at each node's child slot, so that children are kept as well as rejected
        depths = torch.tensor(tree.depths).clamp(max=slots - 1)
        target_logits = drafter_logits[depths] + torch.randn(len(tree.tokens), vocab)
        fast = modeling_dflash.recursive_verdicts(tree, q_KV, target_logits, 0.8, torch.Generator().manual_seed(seed))
        plain = plain_verdicts(tree, q_KV, target_logits, 0.8, torch.Generator().manual_seed(seed))
        assert fast == plain
        kept_somewhere |= any(rank >= 0 for rank in fast[0])
    assert kept_somewhere


class OracleDrafter:
    """A drafter double that knows the target's greedy continuation: counting the context features it is
    given, it puts the right token first in every slot but slot 1, where a decoy ranks above it."""
    block_size, target_layer_ids = 8, [0, 2]

    def __init__(self, prompt_length: int, greedy: list[int], vocab: int):
        self.prompt_length, self.greedy, self.vocab = prompt_length, greedy, vocab

    def new_cache(self):
        return {"context": 0}

    def block_logits(self, new_features, anchor, cache, embed_VH, lm_head):
        cache["context"] += new_features.shape[1]
        at = cache["context"] - self.prompt_length  # the anchor's index in the generated tokens
        logits = torch.zeros(self.block_size - 1, self.vocab)
        for slot in range(self.block_size - 1):
            truth = self.greedy[min(at + 1 + slot, len(self.greedy) - 1)]
            logits[slot, truth] = 10.0
            if slot == 1:
                logits[slot, truth] = 4.5
                logits[slot, (truth + 1) % self.vocab] = 5.0
        return logits


def test_a_tree_accepts_past_the_chain_where_the_second_choice_is_right(tmp_path):
    """Temperature 0 on a tiny Llama: the chain stops at slot 1's decoy; tree:16 holds the right branch
    too, accepts whole blocks through one forward per block with the tree's mask, and still serves
    exactly the greedy tokens."""
    target, _ = tiny_pair(tmp_path)
    prompt = torch.tensor([[3, 14, 15, 9, 26]])
    greedy = greedy_generate(target, prompt, 64)
    drafter = OracleDrafter(prompt.shape[1], greedy, 64)
    chain = speculative_generate(drafter, target, prompt, 32, [], 0.0, None, parse_proposal("argmax"))
    tree = speculative_generate(drafter, target, prompt, 32, [], 0.0, None, parse_proposal("tree:16"))
    assert chain.generated == greedy[:32] and tree.generated == greedy[:32]
    assert set(chain.acceptance_lengths) == {2}
    assert set(tree.acceptance_lengths) == {8}
    assert tree.target_forwards < chain.target_forwards


class WindowLayer:
    """A cache layer that is not a plain dynamic one (as a sliding window's or a recurrent state's)."""


class WindowCache(MarkovCache):
    layers = [WindowLayer()]


def test_a_target_whose_cache_cannot_hold_a_tree_is_refused():
    target_VV, drafter_VKV = markov_pair(0)

    class WindowTarget(MarkovTarget):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.past_key_values = WindowCache()
            return out

    with pytest.raises(ValueError, match="tree proposals need .* layer 0 keeps a WindowLayer"):
        speculative_generate(TableDrafter(drafter_VKV), WindowTarget(target_VV), torch.tensor([[0, 1]]), 3, [], 0.0,
                             None, parse_proposal("tree:4"))



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("size, width", [(7, 8), (256, 8), (256, 32), (1024, 8)])
def test_recursive_verdicts_replayed_equal_eager_on_cuda(size, width):
    """The tries replayed as a CUDA graph give the eager tries' verdicts, draw for draw, on fresh trees over a
    real-sized vocabulary (several trees of one shape reuse one capture)."""
    for seed in range(3):
        tree, q_KV, target_logits = sampled_tree_on_cuda(seed, size, width, vocab=4096)
        replayed, eager = (modeling_dflash.recursive_verdicts(tree, q_KV, target_logits, 1.0,
                                                              torch.Generator("cuda").manual_seed(seed), graphs=graphs)
                           for graphs in (True, False))
        assert replayed == eager
