"""Served acceptance: the export's own inference code, the speculative loop, and `dflash eval`.

- The export loads with `AutoModel.from_pretrained(dir, trust_remote_code=True)` and gives
  the packed training forward's logits, with the context fed to its cache in pieces.
- The loop commits exactly what an oracle drafter proposes up to its first wrong token, and
  its output equals plain greedy decoding, on a Llama target (cache cropped) and a Qwen3.5
  target (linear attention: cache replayed).
- The greedy check (one forward over prompt and output) passes the greedy output and tells a
  differing one apart: where the target's top two tokens tie exactly, an output that took the other
  one is a near-tie (logit gap 0); a token the target ranks far lower is not; a stop token passed or
  an early end is a mismatch.
- `dflash eval` end to end on the embedded tiny target with an `auto` drafter: lossless, tau >= 1.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from support import VOCAB, packed_training_logits, random_packed_batch, tiny_setup
from transformers import AutoModel, LlamaConfig, LlamaForCausalLM

from dflash.config import ConfigError, load_config
from dflash.model.drafter import DFlashDrafter, drafter_args
from dflash.model.export import AUTO_MAP, MODELING_NAME, export_drafter
from dflash.model.modeling_dflash import (DFlashDraftModel, accept, greedy_generate, layer_croppable,
                                          parse_proposal, speculative_generate)
from dflash.serve.evaluation import EvalResult, PromptResult, decode_prompt, greedy_check, lossless_verdict, summarize
from stages import extract, train


def served_logits(draft, embed, lm_head, batch, block_size: int, mask_token_id: int) -> torch.Tensor:
    """Per real anchor: the context before it goes into the draft cache in two pieces, then the block."""
    per_anchor = []
    for anchor, doc in enumerate(batch["anchor_doc"].tolist()):
        if doc < 0:
            continue
        index, pos = int(batch["anchor_index"][anchor]), int(batch["anchor_pos"][anchor])
        features = batch["hidden"][index - pos:index][None]
        block = embed[torch.tensor([int(batch["input_ids"][index])] + [mask_token_id] * (block_size - 1))][None]
        cache = draft.new_cache()
        half = pos // 2
        with torch.no_grad():
            if half:
                draft(features[:, :half], block, cache)  # an earlier block: its context joins the cache
            hidden = draft(features[:, half:], block, cache)
        assert cache.length == pos
        per_anchor.append(hidden[0] @ lm_head.T)
    return torch.stack(per_anchor)


@pytest.mark.parametrize("seed", [0, 1])
def test_export_served_through_auto_model_gives_training_logits(seed, tmp_path):
    args, model, embed, lm_head = tiny_setup(seed)
    export_drafter(model.state_dict(), args, tmp_path, dtype=torch.float32)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["auto_map"] == AUTO_MAP and (tmp_path / MODELING_NAME).is_file()
    remote = AutoModel.from_pretrained(tmp_path, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(remote).__name__ == "DFlashDraftModel" and type(remote) is not DFlashDraftModel
    local = DFlashDraftModel.from_pretrained(tmp_path, dtype=torch.float32).eval()
    batch = random_packed_batch(seed, args.context_feature_size, args.block_size)
    training = packed_training_logits(args, model, embed, lm_head, batch)[batch["anchor_doc"] >= 0]
    for draft in (remote, local):
        assert (draft.block_size, draft.mask_token_id, draft.target_layer_ids) == (16, VOCAB - 1, [1, 3, 5])
        served = served_logits(draft, embed, lm_head, batch, args.block_size, args.mask_token_id)
        torch.testing.assert_close(served, training, atol=1e-5, rtol=1e-5)


def test_greedy_acceptance_counts_the_matching_prefix():
    logits = torch.full((4, 10), -5.0)
    for row, token in enumerate([3, 4, 9, 1]):
        logits[row, token] = 5.0  # the target's choices after anchor, d1, d2, d3
    assert accept(torch.tensor([3, 4, 5]), None, logits, 0.0, None) == (2, [3, 4, 9])
    assert accept(torch.tensor([3, 4, 9]), None, logits, 0.0, None) == (3, [3, 4, 9, 1])
    assert accept(torch.tensor([7, 4, 9]), None, logits, 0.0, None) == (0, [3])


def test_sampled_acceptance_is_lossless_for_a_single_slot():
    """With q != p the committed first token is still distributed as p (the standard rule)."""
    generator = torch.Generator().manual_seed(0)
    p_logits = torch.log(torch.tensor([[0.6, 0.3, 0.1], [1 / 3, 1 / 3, 1 / 3]]))
    q_logits = torch.log(torch.tensor([[0.2, 0.2, 0.6]]))
    counts = torch.zeros(3)
    for _ in range(4000):
        draft = torch.multinomial(q_logits.softmax(-1)[0], 1, generator=generator)
        _, committed = accept(draft, q_logits.softmax(-1), p_logits, 1.0, generator)
        counts[committed[0]] += 1
    torch.testing.assert_close(counts / counts.sum(), torch.tensor([0.6, 0.3, 0.1]), atol=0.03, rtol=0)


def tiny_llama(seed: int = 0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    # Larger weights than the 0.02 default, so greedy decoding does not repeat one token.
    config.initializer_range = 0.2
    return LlamaForCausalLM(config).eval()


def random_export(tmp_path, vocab: int, hidden: int, layer_ids) -> DFlashDraftModel:
    args = drafter_args("tiny", vocab_size=vocab, mask_token_id=vocab - 1, hidden_size=hidden,
                        target_layer_ids=tuple(layer_ids))
    torch.manual_seed(1)
    export_drafter(DFlashDrafter(args).state_dict(), args, tmp_path, dtype=torch.float32)
    return DFlashDraftModel.from_pretrained(tmp_path, dtype=torch.float32).eval()


class OracleDrafter:
    """Proposes the true greedy continuation, with a wrong token at `wrong_slot` (1-based), if any."""

    def __init__(self, truth: list[int], prompt_len: int, wrong_slot: int | None, block_size: int = 16):
        self.truth, self.prompt_len, self.wrong_slot = truth, prompt_len, wrong_slot
        self.block_size, self.target_layer_ids, self.committed = block_size, [1], 0

    def new_cache(self):
        return None

    def block_logits(self, new_features, anchor, cache, embed_VH, lm_head):
        self.committed += new_features.shape[1]  # prompt, then the tokens each verification kept
        start = self.committed - self.prompt_len  # index of the anchor in the generated tokens
        drafts = [self.truth[start + k] if start + k < len(self.truth) else 0 for k in range(1, self.block_size)]
        if self.wrong_slot is not None:
            drafts[self.wrong_slot - 1] = (drafts[self.wrong_slot - 1] + 1) % 300
        return torch.nn.functional.one_hot(torch.tensor(drafts), 300).float()  # argmax: the drafts


@pytest.mark.parametrize("wrong_slot", [None, 1, 3])
def test_loop_commits_what_an_oracle_drafter_gets_right(wrong_slot):
    target = tiny_llama()
    prompt = torch.tensor([[5, 17, 42, 99, 7, 250]])
    truth = greedy_generate(target, prompt, 80)
    stats = speculative_generate(OracleDrafter(truth, prompt.shape[1], wrong_slot), target, prompt, 80, [], 0.0)
    assert stats.generated == truth
    committed_per_block = 16 if wrong_slot is None else wrong_slot
    assert stats.acceptance_lengths[:-1] == [committed_per_block] * (len(stats.acceptance_lengths) - 1)
    assert sum(stats.acceptance_lengths) >= 79  # the first token comes from the prefill


def test_a_mismatch_at_a_rounding_tie_is_told_apart_from_a_real_one():
    target = tiny_llama()
    prompt = torch.tensor([[5, 17, 42, 99, 7, 250]])
    truth = greedy_generate(target, prompt, 30)
    chosen = truth[10]
    twin = max(set(range(chosen + 1, 300)) - set(truth) - set(prompt[0].tolist()))
    head = target.get_output_embeddings().weight
    with torch.no_grad():
        head[twin] = head[chosen]  # an exact tie: argmax keeps the lower id, `chosen`
    truth = greedy_generate(target, prompt, 30)
    assert truth[10] == chosen
    with torch.no_grad():
        logits = target(input_ids=torch.cat([prompt, torch.tensor([truth[:10]])], 1)).logits[0, -1]
    unlikely = int(logits.argmin())

    def checked(token):  # an output that took `token` at position 10, its last
        output = truth[:10] + [token]
        first, gap, tolerance = greedy_check(target, prompt, output, [], 11)
        return PromptResult("row 1", prompt.shape[1], len(output), [1] * len(output), len(output), 1.0,
                            first_mismatch=first, mismatch_gap=gap, tie_tolerance=tolerance,
                            near_tie=gap is not None and abs(gap) <= tolerance)

    assert greedy_check(target, prompt, truth, [], 30) == (None, None, None)
    assert decode_prompt(OracleDrafter(truth, prompt.shape[1], None), target, "row 1", prompt, None, 30, 0.0,
                         [], None, torch.device("cpu")).first_mismatch is None
    tie, real = checked(twin), checked(unlikely)
    # an exact tie of the head rows: the same logits up to the matmul's rounding (0 on some CPUs, 9.5e-7 on
    # others), so the twin is either greedy as well or a near-tie
    assert tie.first_mismatch in (None, 10) and real.first_mismatch == 10
    if tie.first_mismatch is not None:
        assert abs(tie.mismatch_gap) <= tie.tie_tolerance and tie.near_tie
    assert real.mismatch_gap == pytest.approx(float(logits[chosen] - logits[unlikely]), abs=1e-5)
    assert real.mismatch_gap > real.tie_tolerance and not real.near_tie
    # a stop token passed, and an early end without one, are not greedy decoding either
    stop = truth[5]
    assert greedy_check(target, prompt, truth, [stop], 30)[:2] == (truth.index(stop), None)
    assert greedy_check(target, prompt, truth[:20], [], 30) == (20, None, None)
    assert greedy_check(target, prompt, truth[:20], [], 20) == (None, None, None)
    if tie.first_mismatch is None:  # where the rounding made the twin greedy too: the near-tie by hand
        tie.first_mismatch, tie.mismatch_gap, tie.tie_tolerance, tie.near_tie = 10, 0.0, real.tie_tolerance, True
    result = EvalResult("d", "t", "p", "cpu", "float32", 16, 0.0, 30, per_prompt=[tie])
    assert lossless_verdict(summarize(result)) == "yes up to float32 near-ties (1 prompts)"
    result.per_prompt.append(real)
    assert lossless_verdict(summarize(result)) == "NO: 1 prompts differ (+1 near-ties)"


def test_the_greedy_check_runs_once_per_distinct_output_of_a_prompt(monkeypatch):
    from dflash.serve import evaluation

    target = tiny_llama()
    prompt = torch.tensor([[5, 17, 42, 99, 7, 250]])
    truth = greedy_generate(target, prompt, 12)
    calls = []
    monkeypatch.setattr(evaluation, "greedy_check", lambda *args: calls.append(args) or (None, None, None))
    checks = {}
    for wrong_slot in (None, 2):  # two policies' worth of decoding, the same greedy output
        decode_prompt(OracleDrafter(truth, prompt.shape[1], wrong_slot), target, "row 1", prompt, None, 12,
                      0.0, [], None, torch.device("cpu"), checks=checks)
    assert len(calls) == 1 and list(checks) == [tuple(truth)]


def test_a_timed_prompt_carries_the_host_load_of_its_calls(monkeypatch, capsys):
    """`timed` reads the machine's CPU ticks around the call (`host_load`: the busy and the stolen share of every
    tick that passed, against a plain sum over the fields); a timed prompt keeps its baseline's and its own,
    the report tells the most and the mean, and an untimed prompt keeps none."""
    from dflash.serve import evaluation

    rng = np.random.default_rng()
    before = [int(v) for v in rng.integers(0, 10**6, 8)]
    delta = [int(v) for v in rng.integers(0, 500, 8)]
    after = [a + d for a, d in zip(before, delta)]
    user, nice, system, idle, iowait, irq, softirq, steal = delta
    load = evaluation.host_load(before, after)
    assert load.busy == pytest.approx((user + nice + system + irq + softirq) / sum(delta))
    assert load.steal == pytest.approx(steal / sum(delta))
    assert evaluation.host_load(before, before) is None and evaluation.host_load(None, after) is None
    ticks = evaluation.host_ticks()
    if ticks is not None:  # Linux: 8 counters that never go back
        assert len(ticks) == 8 and all(b >= a >= 0 for a, b in zip(ticks, evaluation.host_ticks()))

    readings = iter([before, after, after, [a + 2 * d for a, d in zip(after, delta)]] + [after] * 2)
    monkeypatch.setattr(evaluation, "host_ticks", lambda: next(readings))
    target = tiny_llama()
    prompt = torch.tensor([[5, 17, 42, 99, 7, 250]])
    truth = greedy_generate(target, prompt, 12)
    baseline = evaluation.timed(torch.device("cpu"), lambda: truth)
    assert baseline.value == truth and baseline.host == load
    decoded = decode_prompt(OracleDrafter(truth, prompt.shape[1], None), target, "row 1", prompt, baseline, 12,
                            0.0, [], None, torch.device("cpu"))
    assert (decoded.baseline_host_busy, decoded.baseline_host_steal) == load
    assert (decoded.spec_host_busy, decoded.spec_host_steal) == load  # the same ticks passed, twice as many
    assert decoded.baseline_tokens == len(truth)
    untimed = decode_prompt(OracleDrafter(truth, prompt.shape[1], None), target, "row 1", prompt, None, 12, 0.0,
                            [], None, torch.device("cpu"))
    assert untimed.spec_host_busy is None and untimed.baseline_host_busy is None
    untimed.timed = False
    result = summarize(EvalResult("d", "t", "p", "cpu", "float32", 16, 0.0, 12, per_prompt=[decoded, untimed]))
    evaluation.print_report([result])
    assert f"{load.busy:.0%} busy at most, {load.busy:.0%} on average; {load.steal:.1%} stolen" in capsys.readouterr().out


def test_tau_is_split_between_code_blocks_and_prose():
    """Each verification counts inside a ``` block when its first committed token does: the fence
    count of the text before it is odd; a fence split over two tokens counts once it is whole."""
    from dflash.serve.evaluation import PromptResult, mark_code

    class Chars:  # one token per character
        @staticmethod
        def decode(ids):
            return "".join(map(chr, ids))

    text = "Hi\n```py\nx = 1\n```\nDone."
    lengths = [3, 2, 4, 5, 4, 3, 3]  # verifications starting at 0 "Hi", 3 "``", 5 "`py", 9 "x =", 14, 18, 21
    assert sum(lengths) == len(text)
    prompt = mark_code(PromptResult("row 1", 4, len(text), lengths, len(lengths), 1.0,
                                    generated_ids=[ord(c) for c in text]), Chars)
    assert prompt.text == text
    starts = [0, 3, 5, 9, 14, 18, 21]
    assert prompt.in_code == [text[:start].count("```") % 2 == 1 for start in starts]
    assert prompt.in_code == [False, False, False, True, True, False, False]  # at 5 the fence is not whole yet
    result = summarize(EvalResult("d", "t", "p", "cpu", "float32", 16, 0.0, 64, per_prompt=[prompt]))
    assert (result.verifications_in_code, result.verifications_outside_code) == (2, 5)
    assert result.tau_in_code == pytest.approx(9 / 2) and result.tau_outside_code == pytest.approx(15 / 5)
    unmarked = PromptResult("row 2", 4, 5, [5], 1, 1.0)  # no text: counted in tau, not in the split
    result = summarize(EvalResult("d", "t", "p", "cpu", "float32", 16, 0.0, 64, per_prompt=[prompt, unmarked]))
    assert result.verifications == 8 and result.verifications_in_code + result.verifications_outside_code == 7


def test_prompts_are_filtered_by_their_text(qwen_tokenizer):
    """--match keeps the prompts whose rendered text matches, --exclude drops them; the first ones
    that pass, as many as asked for."""
    from dflash.config import Config, ConfigError
    from dflash.serve.evaluation import load_prompts

    config = Config()
    matched = load_prompts(config, "embedded:code-chat", 2, qwen_tokenizer, match=r"def (has_close|truncate)_")
    assert [prompt.label for prompt in matched] == ["row 1", "row 3"]  # HumanEval/0 and /2 among the first rows
    assert "has_close_elements" in qwen_tokenizer.decode(matched[0][1].tolist())
    kept = load_prompts(config, "embedded:code-chat", 2, qwen_tokenizer, exclude="Complete the following")
    assert all("standard library module" in qwen_tokenizer.decode(ids.tolist()) for _, ids, _ in kept)
    with pytest.raises(ValueError, match="no usable prompt matches"):
        load_prompts(config, "embedded:humaneval", 2, qwen_tokenizer, match="no prompt says this")
    with pytest.raises(ConfigError, match="not a regular expression"):
        load_prompts(config, "embedded:humaneval", 2, qwen_tokenizer, match="(")


def test_spec_generate_equals_greedy_on_llama_and_qwen35(tmp_path, tiny_target_dir):
    from dflash.extract.target import load_causal_lm

    # On a GPU machine flash-linear-attention serves Qwen3.5 only on the GPU (conftest keeps it away on CPU-only ones).
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    llama = tiny_llama().to(device)
    qwen35 = load_causal_lm(str(tiny_target_dir), torch.float32, device)
    for name, target, layer_ids in (("llama", llama, [1, 3, 4]), ("qwen35", qwen35, [1, 3, 5])):
        vocab, hidden = target.get_input_embeddings().weight.shape
        draft = random_export(tmp_path / name, vocab, hidden, layer_ids).to(device)
        prompt = torch.tensor([[11, 23, 35, 47, 59, 71, 83, 95]], device=device)
        expected = greedy_generate(target, prompt, 40)
        out = draft.spec_generate(target, prompt, max_new_tokens=40, return_stats=True)
        assert out.generated == expected, name
        assert out.output_ids[0, prompt.shape[1]:].tolist() == expected
        assert all(1 <= length <= 16 for length in out.acceptance_lengths)
        assert sum(out.acceptance_lengths) >= len(expected) - 1
    # A stop token ends both loops at the same place.
    stop = expected[10]
    assert speculative_generate(draft, qwen35, prompt, 40, [stop], 0.0).generated == \
        greedy_generate(qwen35, prompt, 40, [stop])


def test_the_auto_proposal_is_a_tree_where_the_target_can_verify_one(tiny_target_dir):
    """`--proposal auto` (the default): on a full-attention target (Llama) tree:64x16 (64 nodes, up to 16
    children a node) at temperature 0 and the sampled tree stree:256x32 above it; sample on a target with linear-attention layers (Qwen3.5), whose cache
    cannot hold a tree's branches apart, at any temperature."""
    from dflash.extract.target import load_causal_lm
    from stages import evaluate

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    options = evaluate.EvalOptions(drafters=("export",))
    assert options.proposals == ("auto",)
    assert evaluate.target_takes_trees(tiny_llama().to(device), device)
    assert not evaluate.target_takes_trees(load_causal_lm(str(tiny_target_dir), torch.float32, device), device)
    assert [p.name for p in evaluate.served_proposals(options, takes_trees=True)] == ["tree:64x16"]
    assert [p.name for p in evaluate.served_proposals(options, takes_trees=False)] == ["sample"]
    mixed = evaluate.EvalOptions(drafters=("export",), proposals=("auto", "argmax"), temperature=1.0)
    assert [p.name for p in evaluate.served_proposals(mixed, takes_trees=True)] == ["stree:256x32", "argmax"]
    assert [p.name for p in evaluate.served_proposals(mixed, takes_trees=False)] == ["sample", "argmax"]
    sampled = evaluate.EvalOptions(drafters=("export",), temperature=0.7)
    assert [p.name for p in evaluate.served_proposals(sampled, takes_trees=True)] == ["stree:256x32"]


@pytest.mark.slow
def test_eval_on_the_tiny_default_is_lossless(tmp_path, pipeline_config, capsys):
    root = tmp_path
    config = pipeline_config(root, 30, 10, f"""
[store]
path = "{root / 'store'}"
bucket_edges = [64, 192, 320, 512]
shard_tokens = 4096
[extract]
batch_tokens = 2048
[drafter]
size = "auto"
num_layers = 2
[train]
out_dir = "{root / 'run'}"
epochs = 1
max_steps = 4
token_budget = 512
accum_steps = 2
max_anchors = 8
loss_chunk = 512
holdout_fraction = 0.1
eval_every = 100
log_every = 2
num_workers = 0
wandb = "disabled"
compile = false
""")
    cli = [sys.executable, "-m", "stages.cli"]
    extract.run(load_config(config))  # the two stages in this process; export and eval as a user runs them
    capsys.readouterr()
    train.run(load_config(config))
    trained = capsys.readouterr().out
    assert "drafter auto:" in trained and "2 layers ['sliding_attention', 'full_attention']" in trained
    checkpoint = sorted((root / "run" / "checkpoints").glob("step-*"))[-1]
    subprocess.run(cli + ["export", str(checkpoint), str(root / "export")], check=True, capture_output=True)
    exported = json.loads((root / "export" / "config.json").read_text())
    assert exported["hidden_size"] == 64 and exported["num_attention_heads"] == 4  # the tiny target's
    assert exported["dflash_config"]["mask_token_id"] == 248070
    evaluated = subprocess.run(cli + ["eval", "-c", str(config), "--drafter", str(root / "export"),
                                      "--num-prompts", "2", "--max-new-tokens", "24",
                                      "--out", str(root / "eval.json"), "--plot", str(root / "eval.png")],
                               capture_output=True, text=True)
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    assert "lossless: every output token is the target's greedy choice, on all 2 prompts" in evaluated.stdout
    [report] = json.loads((root / "eval.json").read_text())["results"]
    assert report["num_prompts"] == 2 and report["mismatched_prompts"] == 0 and report["tau"] >= 1.0
    assert report["proposal"] == "sample"  # the default, auto, on a target with linear-attention layers
    # its operator threads: tests/conftest.py's share under xdist (inherited), else torch's default, as here
    threads = int(os.environ.get("OMP_NUM_THREADS") or torch.get_num_threads())
    assert report["cpu_threads"] == threads and f", {threads} CPU thread" in evaluated.stdout
    assert sum(report["histogram"]) == report["verifications"] > 0
    assert all("(sample " in p["prompt_id"] for p in report["per_prompt"])  # the held-out split
    assert (root / "eval.png").stat().st_size > 0


def test_a_linear_attention_layer_is_cropped_only_while_it_records_its_past():
    """transformers <= 5.24 marks such a layer not croppable; 5.25 marks it croppable but crops only with `record_past`."""
    from types import SimpleNamespace as Layer
    assert layer_croppable(Layer())  # an attention layer of any release
    assert layer_croppable(Layer(is_croppable=True))
    assert not layer_croppable(Layer(is_croppable=False))  # linear attention up to 5.24
    assert not layer_croppable(Layer(is_croppable=True, record_past=False))  # 5.25, not recording
    assert layer_croppable(Layer(is_croppable=True, record_past=True))


def test_workers_share_the_prompts_in_contiguous_near_equal_parts():
    from stages.evaluate import shard_bounds

    assert [shard_bounds(f"{index}/3", 10) for index in range(3)] == [(0, 3), (3, 6), (6, 10)]
    assert shard_bounds("1/2", 1) == (0, 1) and shard_bounds("0/2", 1) == (0, 0)
    for bad in ("2/2", "1", "a/b", "-1/2"):
        with pytest.raises(ConfigError, match=f"--shard {bad!r}: expected I/K"):
            shard_bounds(bad, 10)


def test_eval_workers_share_the_cpu_threads(tmp_path, monkeypatch):
    """`--workers K`: each worker process gets 1/K of the eval's OMP_NUM_THREADS (at least 1), not every CPU, and
    serves its share untimed (`--defer-timing`: the parent times alone once they have ended)."""
    import subprocess
    import sys

    from stages import evaluate

    given, commands, popen = [], [], subprocess.Popen

    def start(command, env=None, **popen_args):
        given.append(env["OMP_NUM_THREADS"])
        commands.append(command)
        return popen([sys.executable, "-c", "raise SystemExit(1)"], **popen_args)

    monkeypatch.setattr(evaluate.subprocess, "Popen", start)
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    options = evaluate.EvalOptions(drafters=("d",), workers=3, out=str(tmp_path / "eval.json"))
    with pytest.raises(RuntimeError, match="eval worker 0/3 exited with status 1"):
        evaluate.run_sharded(None, options, [])
    assert given == ["2", "2", "2"]
    assert all("--defer-timing" in command and "--shard" in command for command in commands)


def block_pieces(seed: int, features: torch.Tensor, vocab: int):
    """A sequence fed as serving does: the prompt's context at once (more than a block), then 1-16 tokens a
    step; with the step's anchor token."""
    rng = torch.Generator().manual_seed(seed)
    start, pieces = 37, []
    pieces.append((features[:, :start], torch.randint(vocab - 1, (1,), generator=rng)))
    while start < features.shape[1]:
        size = int(torch.randint(1, 17, (1,), generator=rng))
        pieces.append((features[:, start:start + size], torch.randint(vocab - 1, (1,), generator=rng)))
        start += size
    return pieces


@pytest.mark.parametrize("seed", [0, 1])
def test_the_static_block_step_gives_the_growing_caches_logits(seed, tmp_path):
    """BlockGraph's step (what a CUDA graph replays; run eagerly here) against block_logits with the growing
    DraftCache, on a trained tiny drafter with sliding-window layers, over two sequences in the same buffers."""
    from dflash.model.modeling_dflash import BlockGraph, block_graph

    args, model, embed, lm_head = tiny_setup(seed)
    export_drafter(model.state_dict(), args, tmp_path, dtype=torch.float32)
    draft = DFlashDraftModel.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert "sliding_attention" in draft.config.layer_types and "full_attention" in draft.config.layer_types
    head = torch.nn.Linear(args.hidden_size, VOCAB, bias=False)
    head.weight.data.copy_(lm_head)
    torch.manual_seed(seed)
    graphed = block_graph(draft, embed, head, 140, graph=False)
    for sequence in range(2):
        features = torch.randn(1, 120 + 7 * sequence, args.context_feature_size)
        cache = draft.new_cache()
        graphed.reset()
        with torch.no_grad():
            for features_piece, anchor in block_pieces(seed + sequence, features, VOCAB):
                expected = draft.block_logits(features_piece, anchor, cache, embed, head)
                torch.testing.assert_close(graphed.block_logits(features_piece, anchor), expected, atol=1e-5,
                                           rtol=1e-5)
        assert graphed.length == cache.length == features.shape[1]
    assert block_graph(draft, embed, head, 140, graph=False) is graphed  # one capture per capacity
    small = BlockGraph(draft, embed, head, capacity=40, graph=False)
    with pytest.raises(ValueError, match="holds 40 positions"):
        small.block_logits(torch.randn(1, 50, args.context_feature_size), torch.tensor([3]))


@pytest.mark.parametrize("policy,temperature", [("sample", 0.0), ("tree:8", 0.0), ("sample", 1.0),
                                                ("stree:8", 1.0)])
def test_spec_generate_serves_the_same_with_the_static_block(policy, temperature, tmp_path):
    llama = tiny_llama()
    draft = random_export(tmp_path, 300, 64, [1, 3, 4])
    prompt = torch.tensor([[11, 23, 35, 47, 59, 71, 83, 95] * 3])
    served = [speculative_generate(draft, llama, prompt, 60, [], temperature, torch.Generator().manual_seed(5),
                                   parse_proposal(policy), graphs=graphs) for graphs in (False, True)]
    assert served[0].generated == served[1].generated and len(served[0].generated) == 60
    assert served[0].acceptance_lengths == served[1].acceptance_lengths


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA graph needs a GPU")
def test_the_captured_block_graph_replays_the_eager_step(tmp_path):
    from dflash.model.modeling_dflash import block_graph

    args, model, embed, lm_head = tiny_setup(0)
    export_drafter(model.state_dict(), args, tmp_path, dtype=torch.float32)
    device = torch.device("cuda")
    draft = DFlashDraftModel.from_pretrained(tmp_path, dtype=torch.float32).eval().to(device)
    embed, head = embed.to(device), torch.nn.Linear(args.hidden_size, VOCAB, bias=False).to(device)
    head.weight.data.copy_(lm_head)
    features = torch.randn(1, 200, args.context_feature_size, device=device)
    with torch.inference_mode():
        static, graphed = (block_graph(draft, embed, head, 220, graph=graph) for graph in (False, True))
        assert graphed.graph is not None and static.graph is None
        cache = draft.new_cache()
        for features_piece, anchor in block_pieces(0, features, VOCAB):
            anchor = anchor.to(device)
            expected = static.block_logits(features_piece, anchor).clone()
            torch.testing.assert_close(graphed.block_logits(features_piece, anchor), expected)  # the replay
            growing = draft.block_logits(features_piece, anchor, cache, embed, head)  # the eager drafter
            torch.testing.assert_close(expected, growing, atol=1e-4, rtol=1e-4)


def test_a_timing_process_warms_each_shape_and_capacity_once():
    """`Server.warm_up`: the plain decoding once per temperature kind; at T=0 one chain per drafter (every chain
    policy is greedy verification) and each tree shape, above it every policy; once per drafter cache capacity
    among the prompts (a block graph is captured per capacity); nothing twice in one process."""
    from types import SimpleNamespace

    from dflash.model.modeling_dflash import parse_proposal
    from stages import evaluate

    calls = []
    original = evaluate.warm_up
    evaluate.warm_up = lambda drafts, target, ids, new_tokens, stops, device, proposals, graphs, temperature, *_: \
        calls.append(([id(d) for d in drafts], len(ids), [p.name for p in proposals], temperature))
    try:
        class Draft:  # a drafter as warm_up sees it (hashable by identity, as a module is)
            block_size = 16

        one, two = Draft(), Draft()
        policies = [parse_proposal(name) for name in ("sample", "argmax", "tree:64x16", "stree:64x16")]
        served = [(draft, proposal) for draft in (one, two) for proposal in policies]
        short, long_ = SimpleNamespace(ids=[1] * 40), SimpleNamespace(ids=[1] * 600)  # capacities 512 and 1024
        warmed = set()
        greedy = evaluate.Server(None, torch.device("cpu"), [], evaluate.EvalOptions(drafters=(), max_new_tokens=128),
                                 served, False)
        greedy.warm_up([short, short], warmed)
        assert calls == [([id(one)], 40, ["sample", "tree:64x16"], 0.0), ([id(two)], 40, ["sample", "tree:64x16"], 0.0)]
        calls.clear()
        greedy.warm_up([short], warmed)
        assert calls == []  # warmed already in this process
        greedy.warm_up([long_], warmed)
        assert [call[:3] for call in calls] == [([id(one)], 600, ["sample", "tree:64x16"]),
                                                ([id(two)], 600, ["sample", "tree:64x16"])]
        calls.clear()
        sampled = evaluate.Server(None, torch.device("cpu"), [],
                                  evaluate.EvalOptions(drafters=(), max_new_tokens=128, temperature=1.0),
                                  served[4:], False)
        sampled.warm_up([short], warmed)
        assert calls == [([id(two)], 40, ["sample", "argmax", "tree:64x16", "stree:64x16"], 1.0)]
        calls.clear()
        plain_only = evaluate.Server(None, torch.device("cpu"), [],
                                     evaluate.EvalOptions(drafters=(), max_new_tokens=128, temperature=0.7),
                                     served[:1], False)
        plain_only.warm_up([short], {key for key in warmed if key != ("plain", True)} | {
            (id(one), parse_proposal("sample"), True, 512)})
        assert calls == [([], 40, [], 0.7)]  # the drafter's policy warmed, the plain decoding at T > 0 not yet
    finally:
        evaluate.warm_up = original
