"""tools/calibration_sampled.py: slot 1's figures from hand-made distributions, the serving loop's `observe`
hook against the target's own forward (the row it passes is the target's logits after the committed tokens and
the anchor), and `main` end to end on a tiny Llama with the Qwen tokenizer and a random drafter."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dflash.model.drafter import DFlashDrafter, drafter_args
from dflash.model.export import export_drafter
from dflash.model.modeling_dflash import DFlashDraftModel, Proposal, speculative_generate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import calibration_sampled as calibration  # noqa: E402


def test_slot_one_figures_from_known_distributions():
    p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.3, 0.5])
    figures = calibration.slot_one(q.log(), p.log(), 1.0, (1.0, 0.5))
    assert figures["accept"] == pytest.approx(0.2 + 0.3 + 0.2)
    assert figures["accept argmax"] == pytest.approx(0.2) and figures["top-1 agrees"] == 0.0
    assert figures["p max"] == pytest.approx(0.5)
    assert figures["H(p)"] == pytest.approx(-sum(x * math.log(x) for x in (0.5, 0.3, 0.2)))
    assert figures["accept q^(1/1)"] == pytest.approx(figures["accept"])
    sharp = torch.tensor([0.04, 0.09, 0.25]) / 0.38  # q^2, renormalised
    assert figures["accept q^(1/0.5)"] == pytest.approx(float(torch.minimum(p, sharp).sum()))
    same = calibration.slot_one(p.log(), p.log(), 0.5, ())  # at T = 0.5 both are p^2, renormalised: q = p
    assert same["accept"] == pytest.approx(1.0) and same["top-1 agrees"] == 1.0
    assert same["p max"] == pytest.approx(0.25 / 0.38)


def tiny_pair(tmp_path, vocab: int = 300):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    config.initializer_range = 0.2
    target = LlamaForCausalLM(config).eval()
    args = drafter_args("tiny", vocab_size=vocab, mask_token_id=vocab - 1, hidden_size=64, target_layer_ids=(1, 3, 4))
    torch.manual_seed(1)
    export_drafter(DFlashDrafter(args).state_dict(), args, tmp_path / "drafter", dtype=torch.float32)
    return target, tmp_path / "drafter"


def test_the_hook_sees_every_chain_verification_with_the_targets_row_at_the_anchor(tmp_path):
    target, export = tiny_pair(tmp_path)
    draft = DFlashDraftModel.from_pretrained(export, dtype=torch.float32).eval()
    prompt = torch.tensor([[5, 17, 42, 8, 99]])
    seen = []
    stats = speculative_generate(draft, target, prompt, 24, [], 1.0, torch.Generator().manual_seed(3),
                                 Proposal(sample=True), graphs=False,
                                 observe=lambda drafted, verified: seen.append((drafted.clone(), verified.clone())))
    assert len(seen) == len(stats.acceptance_lengths) > 1
    committed = 1  # the prefill's token; each verification then commits its acceptance length
    for (drafted, verified), length in zip(seen, stats.acceptance_lengths):
        assert drafted.shape == (draft.block_size - 1, 300) and verified.shape == (draft.block_size, 300)
        prefix = torch.cat([prompt, torch.tensor([stats.generated[:committed]])], dim=1)
        with torch.no_grad():
            expected = target(prefix).logits[0, -1]
        torch.testing.assert_close(verified[0], expected, atol=1e-4, rtol=1e-4)
        committed += length
    none = speculative_generate(draft, target, prompt, 24, [], 1.0, torch.Generator().manual_seed(3),
                                Proposal(sample=True), graphs=False)
    assert none.generated == stats.generated  # the hook changes nothing served


def test_main_runs_end_to_end(tmp_path, qwen_tokenizer):
    target, export = tiny_pair(tmp_path, vocab=len(qwen_tokenizer))
    target.save_pretrained(tmp_path / "target")
    qwen_tokenizer.save_pretrained(tmp_path / "target")
    out = tmp_path / "calib.json"
    results = calibration.main(["--set", f"target.path={tmp_path / 'target'}", "--set", f"data.cache_dir={tmp_path}",
                                "--drafter", str(export), "--prompts", "embedded:chat-heldout,embedded:humaneval",
                                "--num-prompts", "2", "--max-new-tokens", "8", "--threads", "1", "--out", str(out)])
    written = json.loads(out.read_text())["results"]
    assert [entry["prompts"] for entry in written] == ["embedded:chat-heldout", "embedded:humaneval"]
    for entry in results:
        summary = entry["summary"]
        assert entry["verifications"] >= 2
        for key in ("accept", "accept argmax", "top-1 agrees", "p max", "accept q^(1/0.7)", "accept q^(1/1.5)"):
            assert 0.0 <= summary[key]["mean"] <= 1.0
        assert summary["H(p)"]["mean"] >= 0 and summary["H(q)"]["mean"] >= 0
    with pytest.raises(SystemExit):
        calibration.parse_args(["--drafter", str(export), "--temperature", "0"])
