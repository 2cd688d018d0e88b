"""tools/profile_serving.py's operator counts: views and metadata are left out, every computing operator is
counted once, and a phase inside another counts toward the outer one only; `--target-graphs on` profiles the
static target session."""

import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import profile_serving  # noqa: E402


def test_counter_counts_computing_operators_not_views():
    a, b = torch.randn(4, 6), torch.randn(4, 6)
    with profile_serving.OpCounter() as counter:
        c = (a + b).view(6, 4).t()  # one add; the view and the transpose launch nothing
        c.sum().detach()  # one sum
    assert counter.count == 2


def test_phases_count_their_own_operators_and_an_inner_phase_counts_toward_the_outer():
    totals, ops, counter = defaultdict(float), defaultdict(int), profile_serving.OpCounter()
    inner = profile_serving.wrapped(lambda x: x * 2, "inner", totals, torch.device("cpu"), False, ops, counter)
    outer = profile_serving.wrapped(lambda x: inner(x) + 1, "outer", totals, torch.device("cpu"), False, ops, counter)
    with counter:
        outer(torch.ones(3))
        inner(torch.ones(3))
    assert dict(ops) == {"outer": 2, "inner": 1} and counter.count == 3 + 2  # + the two torch.ones


def test_the_profile_through_the_static_target_session_decodes_the_same(tmp_path, qwen_tokenizer):
    """A Llama checkpoint and a random drafter at T = 0: `--target-graphs on` verifies through the static session
    (timed as "verify (static)", transformers' forward not called) with the same tau, tokens and verifications (the
    session's own equality with transformers: tests/test_target_graphs.py)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(qwen_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    LlamaForCausalLM(config).eval().save_pretrained(tmp_path / "target")
    qwen_tokenizer.save_pretrained(tmp_path / "target")
    results = {}
    for graphs in ("off", "on"):
        out = tmp_path / f"profile-{graphs}.json"
        profile_serving.main(["--set", f"target.path={tmp_path / 'target'}", "--set", f"data.cache_dir={tmp_path}",
                              "--set", "target.layer_ids=[1, 3]", "--num-prompts", "2", "--max-new-tokens", "12",
                              "--proposal", "sample,tree:8", "--device", "cpu", "--target-graphs", graphs,
                              "--out", str(out)])
        results[graphs] = json.loads(out.read_text())["results"]
    for eager, static in zip(results["off"], results["on"]):
        assert (eager["tau"], eager["tokens"], eager["verifications"]) == \
            (static["tau"], static["tokens"], static["verifications"])
        assert "verify" in eager["phases_ms_per_verification"] and "verify" not in static["phases_ms_per_verification"]
        assert static["phases_ms_per_verification"]["verify (static)"] > 0
