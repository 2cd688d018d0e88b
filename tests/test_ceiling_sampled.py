"""tools/ceiling_sampled.py against exact enumeration on a tiny Llama with a 5-token vocabulary and blocks of 3
drafts: its Monte-Carlo marginals are the target's marginals, its chain simulation gives the exact oracle tau
(sum over draft prefixes of prod_j min(q_j, p_j)), its argmax chain and its tree walk equal the enumeration
(the tree's through `walk_tree`, the serving code, over every continuation the target can sample), its sampled
tree's exact reach equals the serving code's verdicts counted. A peaked
target (T -> 0) reaches the block size. `main` runs end to end on a tiny Llama with the Qwen tokenizer."""

import itertools
import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import ceiling_sampled as ceiling  # noqa: E402

from dflash.model.modeling_dflash import walk_tree  # noqa: E402

VOCAB, DRAFTS, TEMPERATURE = 5, 3, 1.0
CONTEXT = [1, 3, 0, 2]


def tiny_target(vocab: int = VOCAB, head_scale: float = 40.0) -> LlamaForCausalLM:
    """A random Llama whose next-token distributions are far from uniform (its LM head scaled up)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         tie_word_embeddings=False)
    target = LlamaForCausalLM(config).eval().requires_grad_(False)
    target.lm_head.weight.mul_(head_scale)
    return target


def exact_conditionals(target, temperature: float) -> dict[tuple, torch.Tensor]:
    """prefix (tuple of drafted tokens, length < DRAFTS) -> the target's distribution after CONTEXT + prefix."""
    conditionals = {}
    for length in range(DRAFTS):
        for prefix in itertools.product(range(VOCAB), repeat=length):
            logits = target(input_ids=torch.tensor([CONTEXT + list(prefix)])).logits[0, -1]
            conditionals[prefix] = ceiling.probabilities(logits, temperature).double()
    return conditionals


def exact_marginals(conditionals) -> torch.Tensor:
    marginals = torch.zeros(DRAFTS, VOCAB, dtype=torch.float64)
    for length in range(DRAFTS):
        for prefix in itertools.product(range(VOCAB), repeat=length):
            weight = prefix_probability(conditionals, prefix)
            marginals[length] += weight * conditionals[prefix]
    return marginals


def prefix_probability(conditionals, prefix: tuple) -> float:
    return float(torch.tensor([conditionals[prefix[:j]][prefix[j]] for j in range(len(prefix))]).prod())


def exact_chain(conditionals, q_KV: torch.Tensor) -> torch.Tensor:
    """P(slots 1..k accepted) for drafts drawn independently from q: the sum over x_1..x_k of
    prod_j min(q_j(x_j), p_j(x_j)), p_j the target's conditional after the drafts before slot j."""
    through = torch.zeros(DRAFTS, dtype=torch.float64)
    for length in range(1, DRAFTS + 1):
        for drafts in itertools.product(range(VOCAB), repeat=length):
            kept = [min(float(q_KV[j, drafts[j]]), float(conditionals[drafts[:j]][drafts[j]])) for j in range(length)]
            through[length - 1] += torch.tensor(kept, dtype=torch.float64).prod()
    return through


@pytest.fixture(scope="module")
def setup():
    target = tiny_target()
    with torch.inference_mode():
        conditionals = exact_conditionals(target, TEMPERATURE)
        cache, logits = ceiling.prefill(target, CONTEXT)
    return target, conditionals, cache, ceiling.probabilities(logits, TEMPERATURE)


def test_marginals_are_the_targets(setup):
    target, conditionals, cache, first_V = setup
    exact = exact_marginals(conditionals)
    assert exact[1:].min() > 0.002 and exact.max() < 0.95, "the tiny target should branch"
    generator = torch.Generator().manual_seed(0)
    q, q_check = ceiling.oracle_marginals(target, cache, first_V, DRAFTS, 4096, TEMPERATURE, generator, chunk=1024,
                                          check=64)
    assert torch.equal(q[0], first_V) and torch.equal(q_check[0], first_V)
    torch.testing.assert_close(q.double(), exact, atol=0.01, rtol=0)
    torch.testing.assert_close(q.sum(-1), torch.ones(DRAFTS))
    torch.testing.assert_close(q_check.double(), exact, atol=0.1, rtol=0)  # 64 rows: coarser, still near


def test_chain_simulation_equals_the_enumeration(setup):
    target, conditionals, cache, first_V = setup
    exact_q = exact_marginals(conditionals).float()
    generator = torch.Generator().manual_seed(1)
    for q_KV in (exact_q, ceiling.sharpened(exact_q, 0.5)):
        simulated = ceiling.chain_acceptance(target, cache, first_V, q_KV, 20000, TEMPERATURE, generator, chunk=5000)
        exact = exact_chain(conditionals, q_KV)
        assert simulated.shape == (20000, DRAFTS)
        torch.testing.assert_close(simulated.mean(0), exact, atol=0.01, rtol=0)
    assert exact_chain(conditionals, exact_q)[0] == pytest.approx(1.0, abs=1e-6)  # slot 1's q is the target's p


def test_argmax_chain_is_exact(setup):
    target, conditionals, cache, first_V = setup
    q_KV = ceiling.one_hot_argmax(exact_marginals(conditionals).float())
    generator = torch.Generator().manual_seed(2)
    simulated = ceiling.chain_acceptance(target, cache, first_V, q_KV, 1, TEMPERATURE, generator, chunk=64)
    torch.testing.assert_close(simulated[0], exact_chain(conditionals, q_KV), atol=1e-5, rtol=0)


@pytest.mark.parametrize("size", [1, 4, 12])
def test_tree_reach_equals_walking_every_continuation(setup, size):
    """The walk's expected accepted depth, summed over every continuation the target can sample with its
    probability, equals `tree_reach`'s sum over nodes of their reach probability."""
    target, conditionals, cache, _ = setup
    q_KV = exact_marginals(conditionals).float()
    from dflash.model.modeling_dflash import best_first_tree

    tree = best_first_tree(CONTEXT[-1], q_KV.log(), size)
    expected = torch.zeros(DRAFTS, dtype=torch.float64)
    for continuation in itertools.product(range(VOCAB), repeat=DRAFTS):
        path, _ = walk_tree(tree, [continuation[depth] if depth < DRAFTS else 0 for depth in tree.depths])
        expected[:len(path) - 1] += prefix_probability(conditionals, continuation)
    reach = ceiling.tree_reach(target, cache, CONTEXT[-1], q_KV, size, TEMPERATURE)
    torch.testing.assert_close(reach, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("size", [3, 12])
def test_stree_reach_equals_the_served_verdicts_counted(setup, size):
    """For one drawn `stree` tree, `keep_probabilities`' exact reach per depth equals the depths the serving code
    (`recursive_verdicts`, `walk_drawn`) reaches over many verdicts, by counting."""
    target, _, cache, _ = setup
    from dflash.model.modeling_dflash import TargetSession, drawn_tree, recursive_verdicts, verify_tree, walk_drawn

    generator = torch.Generator().manual_seed(4)
    q_KV = torch.softmax(torch.randn(DRAFTS, VOCAB, generator=generator), -1)  # any drafter's q: often rejected
    tree, q_drawn = drawn_tree(CONTEXT[-1], q_KV.log(), size, 1.0, generator)
    assert len(tree.tokens) == size + 1 and max(tree.ranks) > 0, "the tree should branch"
    session = TargetSession(target, [0])
    session.cache = ceiling.copy.deepcopy(cache)
    session.cache.crop(-1)
    with torch.inference_mode():
        _, _, logits = verify_tree(session, tree, "cpu", torch.float32)
    keep = ceiling.keep_probabilities(tree, q_drawn, ceiling.probabilities(logits[0], TEMPERATURE))
    reach, exact = [1.0], torch.zeros(DRAFTS, dtype=torch.float64)
    for node in range(1, len(tree.tokens)):
        reach.append(reach[tree.parents[node]] * float(keep[tree.parents[node], tree.ranks[node]]))
        exact[tree.depths[node] - 1] += reach[node]
    counted, trials = torch.zeros(DRAFTS, dtype=torch.float64), 4000
    for _ in range(trials):
        path, _ = walk_drawn(tree, *recursive_verdicts(tree, q_drawn, logits[0], TEMPERATURE, generator))
        counted[:len(path) - 1] += 1.0 / trials
    torch.testing.assert_close(counted, exact, atol=0.03, rtol=0)
    assert float(keep.sum(-1).max()) <= 1.0 + 1e-9


def test_a_peaked_target_reaches_the_block_size():
    """At T -> 0 the oracle is the target's greedy path: every slot accepted, tau = B (15 drafts + 1)."""
    target, drafts = tiny_target(), 15
    with torch.inference_mode():
        cache, logits = ceiling.prefill(target, CONTEXT)
    temperature = 1e-3
    first_V = ceiling.probabilities(logits, temperature)
    generator = torch.Generator().manual_seed(3)
    q, _ = ceiling.oracle_marginals(target, cache, first_V, drafts, 16, temperature, generator, chunk=16, check=4)
    oracle = ceiling.chain_acceptance(target, cache, first_V, q, 16, temperature, generator, chunk=16)
    argmax = ceiling.chain_acceptance(target, cache, first_V, ceiling.one_hot_argmax(q), 1, temperature, generator, 16)
    tree = ceiling.tree_reach(target, cache, CONTEXT[-1], q, 32, temperature)
    stree = ceiling.stree_reach(target, cache, CONTEXT[-1], q, 32, temperature, generator, draws=2)
    for slots in (oracle.mean(0), argmax[0], tree, stree):
        assert 1 + float(slots.sum()) > 15.9


def test_clustered_mean():
    mean, se = ceiling.clustered_mean([1.0, 3.0, 2.0, 6.0], ["a", "a", "b", "b"])
    assert mean == 3.0
    # two clusters: residual sums -2 and +2, sqrt(2 / 1 * 8) / 4
    assert se == pytest.approx(1.0)


@pytest.mark.slow
def test_main_runs_end_to_end(tmp_path, qwen_tokenizer):
    """The whole tool on a tiny Llama with the Qwen tokenizer: two prompt sets, its tables and its JSON."""
    target = tiny_target(vocab=len(qwen_tokenizer), head_scale=1.0)
    target.save_pretrained(tmp_path / "target")
    qwen_tokenizer.save_pretrained(tmp_path / "target")
    out = tmp_path / "ceiling.json"
    summaries = ceiling.main(["--set", f"target.path={tmp_path / 'target'}", "--set", f"data.cache_dir={tmp_path}",
                              "--prompts", "embedded:chat-heldout,embedded:humaneval", "--num-prompts", "2",
                              "--offsets", "0,2", "--temperatures", "1.0", "--samples", "4", "--check-samples", "2",
                              "--blocks", "2", "--block", "4", "--trees", "4", "--strees", "4", "--tree-draws", "2",
                              "--chunk", "4", "--threads", "1",
                              "--out", str(out)])
    results = json.loads(out.read_text())["results"]
    assert [entry["prompts"] for entry in results] == ["embedded:chat-heldout", "embedded:humaneval"]
    for entry, summary in zip(results, summaries):
        assert entry["summary"]["prompts"] == 2 and 2 <= entry["summary"]["contexts"] <= 4
        for name in ("sample (oracle)", "sample, M=2", "sample:0.5", "argmax", "best chain", "tree:4", "stree:4"):
            assert 1.0 <= entry["summary"]["policies"][name]["tau"] <= 4.0
        assert summary["summary"]["policies"]["sample (oracle)"]["slots"][0] == pytest.approx(1.0)
