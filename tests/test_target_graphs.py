"""The static target session of `dflash eval` (dflash/serve/target_graphs.py) against transformers' forward with
its dynamic cache (`TargetSession`), on fresh random tiny targets of the families it serves: the same features and
logits for a prompt, chains, rollbacks, trees and kept paths, and the same decoding through the serving loop. On
the CPU it runs eagerly; on a GPU (tests/test_gpu.py) its CUDA graphs."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from dflash.extract.tiny_target import tiny_target_config
from dflash.model.modeling_dflash import (Proposal, TargetSession, best_first_tree, plain_generate,
                                          speculative_generate, verify_tree)
from dflash.serve.target_graphs import StaticTargetSession

VOCAB = 300
LAYER_IDS = [0, 2, 3]  # the last layer's output included: transformers gives it after the final norm


def tiny(family: str, seed: int):
    torch.manual_seed(seed)
    sizes = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.3)
    config = LlamaConfig(**sizes) if family == "llama" else Qwen3Config(**sizes, head_dim=16)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def same(got, want):
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)  # float32 sums in another order; values up to ~30


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])  # on CUDA through the session's graphs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("seed", range(2))
@torch.inference_mode()
def test_the_static_session_equals_transformers_through_chains_rollbacks_and_trees(family, seed, device):
    target = tiny(family, seed).to(device)
    generator = torch.Generator().manual_seed(100 + seed)
    static = StaticTargetSession(target, LAYER_IDS, max_context=300)
    assert static.use_graphs == (device == "cuda")
    dynamic = TargetSession(target, LAYER_IDS)

    def randint(high, shape):
        return torch.randint(0, high, shape, generator=generator).to(device)

    prompt = randint(VOCAB, (1, int(torch.randint(3, 40, (1,), generator=generator))))
    same(static.forward(prompt, logits_to_keep=1), dynamic.forward(prompt, logits_to_keep=1))
    for _ in range(3):
        chain = randint(VOCAB, (1, 6))
        same(static.forward(chain), dynamic.forward(chain))
        rejected = int(torch.randint(0, 6, (1,), generator=generator))
        static.rollback(rejected, chain[:, :6 - rejected])
        dynamic.rollback(rejected, chain[:, :6 - rejected])
        assert static.cached_length() == dynamic.cached_length()
        # a tree of 12 nodes from random per-slot logits, verified, one of its paths kept
        tree = best_first_tree(int(chain[0, 0]), torch.randn(5, VOCAB, generator=generator) * 3, 12, width=3)
        got, want = verify_tree(static, tree, device, torch.float32), verify_tree(dynamic, tree, device, torch.float32)
        assert got[0] == want[0]
        same(got[1:], want[1:])
        node = int(torch.randint(0, len(tree.tokens), (1,), generator=generator))
        path = [node]
        while tree.parents[path[-1]] >= 0:
            path.append(tree.parents[path[-1]])
        static.keep(got[0], path[::-1])
        dynamic.keep(want[0], path[::-1])
        assert static.cached_length() == dynamic.cached_length()
    last = randint(VOCAB, (1, 1))
    same(static.forward(last, logits_to_keep=1), dynamic.forward(last, logits_to_keep=1))


class RandomDrafter:
    """Per-slot logits from a seeded stream: proposals that are partly right and partly wrong."""

    def __init__(self, block_size: int = 8):
        self.block_size, self.target_layer_ids = block_size, LAYER_IDS
        self.generator = torch.Generator().manual_seed(0)

    def new_cache(self):
        return None

    def block_logits(self, new_features, anchor, cache, embed_VH, lm_head):
        return torch.randn(self.block_size - 1, VOCAB, generator=self.generator) * 2


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("proposal", [Proposal(sample=True), Proposal(tree=16, width=4)], ids=["chain", "tree"])
def test_the_serving_loop_decodes_the_same_through_the_static_session(family, proposal):
    target = tiny(family, 3)
    prompt = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(5))
    session = StaticTargetSession(target, LAYER_IDS, max_context=12 + 40 + 32)
    for temperature in (0.0, 1.0):
        runs = []
        for use in (None, session):
            generator = torch.Generator().manual_seed(9)
            runs.append(speculative_generate(RandomDrafter(), target, prompt, 40, [], temperature, generator,
                                             proposal, graphs=False, session=use))
        assert runs[0].generated == runs[1].generated
        assert runs[0].acceptance_lengths == runs[1].acceptance_lengths
        plain = [plain_generate(target, prompt, 30, (), temperature, torch.Generator().manual_seed(2), session=use)
                 for use in (None, session)]
        assert plain[0] == plain[1]


def test_static_sessions_serve_only_full_attention_targets_and_name_an_overflow():
    from transformers import AutoModelForCausalLM as Auto

    linear = Auto.from_config(tiny_target_config()).eval()  # Qwen3.5: linear-attention layers
    assert not StaticTargetSession.supports(linear)
    with pytest.raises(ValueError, match="cannot serve"):
        StaticTargetSession(linear, [0], 64)
    target = tiny("llama", 0)
    assert StaticTargetSession.supports(target)
    session = StaticTargetSession(target, [0], 10)
    assert session.max_context == 256  # rounded up
    with torch.inference_mode(), pytest.raises(ValueError, match="exceed"):
        session.forward(torch.zeros(1, 257, dtype=torch.long))


def test_dflash_eval_serves_the_same_through_target_graphs(tmp_path, qwen_tokenizer):
    """`dflash eval --target-graphs` on a Llama checkpoint: the same outputs and acceptance as transformers' forward,
    and the report says which served."""
    from transformers import LlamaForCausalLM

    from dflash.config import load_config
    from dflash.model.drafter import DFlashDrafter, drafter_args
    from dflash.model.export import export_drafter
    from stages import evaluate

    vocab = len(qwen_tokenizer)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.2)
    LlamaForCausalLM(config).eval().save_pretrained(tmp_path / "target")
    qwen_tokenizer.save_pretrained(tmp_path / "target")
    args = drafter_args("tiny", vocab_size=vocab, mask_token_id=vocab - 1, hidden_size=64, target_layer_ids=(1, 3))
    export_drafter(DFlashDrafter(args).state_dict(), args, tmp_path / "drafter", dtype=torch.float32)
    config = load_config(None, [f"target.path={tmp_path / 'target'}", f"data.cache_dir={tmp_path}"])
    served = {}
    for graphs in (False, True):
        options = evaluate.EvalOptions(drafters=(str(tmp_path / "drafter"),), prompts="embedded:chat-heldout",
                                       num_prompts=1, max_new_tokens=12, proposals=("sample", "tree:16x4"),
                                       device="cpu", target_graphs=graphs)
        served[graphs] = evaluate.run(config, options)
    for eager, static in zip(served[False], served[True]):
        assert not eager.target_graphs and static.target_graphs
        assert [p.generated_ids for p in eager.per_prompt] == [p.generated_ids for p in static.per_prompt]
        assert [p.acceptance_lengths for p in eager.per_prompt] == [p.acceptance_lengths for p in static.per_prompt]
    # served untimed through the graphs, then timed alone (`dflash time-evals` reads target_graphs from the JSON)
    out = tmp_path / "deferred.json"
    options = evaluate.EvalOptions(drafters=(str(tmp_path / "drafter"),), prompts="embedded:chat-heldout",
                                   num_prompts=1, max_new_tokens=12, proposals=("sample",), device="cpu",
                                   target_graphs=True, defer_timing=True, timed_prompts=1, out=str(out))
    evaluate.run(config, options)
    eager = tmp_path / "deferred-eager.json"
    eager.write_text(out.read_text())
    assert evaluate.time_evals(config, [str(out)], "cpu") == [str(out)]
    (timed,) = json.loads(out.read_text())["results"]
    assert timed["timing"] == "alone" and timed["target_graphs"] and timed["retimed_differing"] == 0
    assert timed["per_prompt"][0]["generated_ids"] == served[True][0].per_prompt[0].generated_ids
    # served through the graphs, timed with transformers' forward (`time-evals --no-target-graphs`): the JSON says so
    assert evaluate.time_evals(config, [str(eager)], "cpu", target_graphs=False) == [str(eager)]
    written = json.loads(eager.read_text())
    (timed,) = written["results"]
    assert timed["timing"] == "alone" and not timed["target_graphs"] and not written["options"]["target_graphs"]
    assert timed["retimed_differing"] == 0
    # timed already: left alone, unless `--again` (a copy timed the other way: the graphs' speed figures)
    assert evaluate.time_evals(config, [str(eager)], "cpu", target_graphs=True) == []
    assert evaluate.time_evals(config, [str(eager)], "cpu", target_graphs=True, again=True) == [str(eager)]
    (timed,) = json.loads(eager.read_text())["results"]
    assert timed["timing"] == "alone" and timed["target_graphs"] and timed["retimed_differing"] == 0
    assert timed["per_prompt"][0]["generated_ids"] == served[True][0].per_prompt[0].generated_ids


def test_a_session_without_feature_layers_serves_the_plain_decoding():
    """A plain-only eval's session (no drafter, no feature layers) decodes as transformers does."""
    target = tiny("qwen3", 4)
    prompt = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(1))
    session = StaticTargetSession(target, [], 64)
    assert plain_generate(target, prompt, 20, session=session) == plain_generate(target, prompt, 20)
