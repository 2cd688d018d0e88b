"""Train-vs-inference: the packed training forward gives the logits an inference engine gets.

The "engine" below is written independently of dflash.drafter and dflash.masks: it serves
one anchor at a time, from the exported weights (state-dict keys), with the accepted
context only (positions < anchor of that sequence), a block of anchor token + mask tokens,
RoPE tables from transformers' Qwen3 rotary embedding (what engines load from the exported
`config.json`), and masks built by hand from ARCHITECTURE.md. If training used the wrong
positions, leaked across sequences, or treated a sliding layer as full, the logits differ.
"""

import numpy as np
import pytest
import torch
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

from dflash.drafter import DFlashDrafter, block_embeddings, block_positions, drafter_args
from dflash.loss import block_labels, dflash_loss, gamma_weights
from dflash.masks import build_masks

VOCAB = 512
WINDOW = 20  # smaller than the sequences, so sliding layers really cut the context


def tiny_setup(seed: int):
    """A tiny drafter trained for a few steps (so no weight sits at its init value)."""
    torch.manual_seed(seed)
    args = drafter_args("tiny", vocab_size=VOCAB, mask_token_id=VOCAB - 1, sliding_window=WINDOW)
    model = DFlashDrafter(args)
    embed = torch.randn(VOCAB, args.hidden_size)
    lm_head = torch.randn(VOCAB, args.hidden_size)
    train_a_few_steps(args, model, embed, lm_head, random_packed_batch(seed + 100, args.context_feature_size,
                                                                       args.block_size))
    return args, model.eval(), embed, lm_head


def train_a_few_steps(args, model, embed, lm_head, batch, steps: int = 5) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_mask = torch.ones_like(batch["input_ids"])
    labels, valid = block_labels(batch["input_ids"], loss_mask, batch["doc_ids"], batch["anchor_index"],
                                 batch["anchor_doc"] >= 0, args.block_size)
    masks = build_masks(batch, args.layer_types, args.sliding_window, block_size=args.block_size, backend="dense")
    block = block_embeddings(embed, batch["input_ids"], batch["anchor_index"], args.block_size, args.mask_token_id)
    positions = block_positions(batch["anchor_pos"], args.block_size)
    for _ in range(steps):
        hidden = model(batch["hidden"], block, batch["position_ids"], positions, masks)
        dflash_loss(hidden, lm_head, labels, valid, gamma_weights(args.block_size, 7.0)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert not torch.equal(model.norm.weight, torch.ones_like(model.norm.weight))


def random_packed_batch(seed: int, feature_size: int, block_size: int) -> dict:
    """2-3 sequences packed in one row with sorted anchors, plus padded context and a padded anchor."""
    rng = np.random.default_rng(seed)
    doc_ids, position_ids, anchor_doc, anchor_pos, anchor_index = [], [], [], [], []
    for doc in range(int(rng.integers(2, 4))):
        length = int(rng.integers(25, 60))
        chosen = np.sort(rng.choice(length, size=5, replace=False))
        chosen[0] = 0  # an anchor with no context at all
        anchor_index += (len(doc_ids) + chosen).tolist()
        anchor_doc += [doc] * len(chosen)
        anchor_pos += chosen.tolist()
        doc_ids += [doc] * length
        position_ids += list(range(length))
    anchor_index.append(0)  # padded anchor: points anywhere, doc -1
    anchor_doc.append(-1)
    anchor_pos.append(0)
    doc_ids += [-1] * 7
    position_ids += [0] * 7
    num_tokens = len(doc_ids)
    return {
        "doc_ids": torch.tensor(doc_ids), "position_ids": torch.tensor(position_ids),
        "anchor_doc": torch.tensor(anchor_doc), "anchor_pos": torch.tensor(anchor_pos),
        "anchor_index": torch.tensor(anchor_index),
        "input_ids": torch.from_numpy(rng.integers(0, VOCAB - 1, num_tokens)),
        "hidden": torch.from_numpy(rng.standard_normal((num_tokens, feature_size)).astype(np.float32)),
    }


def packed_training_logits(args, model, embed, lm_head, batch, masks=None, position_shift=0):
    block = block_embeddings(embed, batch["input_ids"], batch["anchor_index"], args.block_size, args.mask_token_id)
    positions = block_positions(batch["anchor_pos"], args.block_size) + position_shift
    if masks is None:
        masks = build_masks(batch, args.layer_types, args.sliding_window, block_size=args.block_size, backend="dense")
    with torch.no_grad():
        hidden = model(batch["hidden"], block, batch["position_ids"], positions, masks)
    return (hidden @ lm_head.T).view(-1, args.block_size, VOCAB)


def rms_norm(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def engine_masks(args, anchor_pos: int) -> dict:
    """Per-layer-type (B, ctx + B) masks for one block, straight from ARCHITECTURE.md."""
    block = args.block_size
    query_pos = anchor_pos + torch.arange(block)[:, None]
    context_pos = torch.arange(anchor_pos)[None, :]
    sliding_context = query_pos - context_pos < args.sliding_window
    causal_block = torch.ones(block, block).tril().bool()
    return {
        "full_attention": torch.ones(block, anchor_pos + block, dtype=torch.bool),
        "sliding_attention": torch.cat([sliding_context, causal_block], dim=1),
    }


def engine_attention(weights, prefix, args, x_BH, context_CH, cos_sin, mask):
    heads, kv_heads, dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
    eps = args.rms_norm_eps
    q = (x_BH @ weights[f"{prefix}.q_proj.weight"].T).view(-1, heads, dim)
    k = (torch.cat([context_CH, x_BH]) @ weights[f"{prefix}.k_proj.weight"].T).view(-1, kv_heads, dim)
    v = (torch.cat([context_CH, x_BH]) @ weights[f"{prefix}.v_proj.weight"].T).view(-1, kv_heads, dim)
    q = rms_norm(q, weights[f"{prefix}.q_norm.weight"], eps).transpose(0, 1)
    k = rms_norm(k, weights[f"{prefix}.k_norm.weight"], eps).transpose(0, 1)
    cos, sin = cos_sin
    num_context = context_CH.shape[0]
    q, _ = apply_rotary_pos_emb(q, q, cos[num_context:], sin[num_context:], unsqueeze_dim=0)
    k, _ = apply_rotary_pos_emb(k, k, cos, sin, unsqueeze_dim=0)
    k = k.repeat_interleave(heads // kv_heads, dim=0)
    v = v.transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)
    scores = (q @ k.transpose(1, 2)) / dim**0.5
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    out = (probs @ v).transpose(0, 1).reshape(-1, heads * dim)
    return out @ weights[f"{prefix}.o_proj.weight"].T


def engine_block_logits(args, weights, embed, lm_head, rotary, features_CF, anchor_token, anchor_pos):
    """One draft step for one anchor: context = the accepted tokens' features only."""
    eps = args.rms_norm_eps
    context = rms_norm(features_CF @ weights["fc.weight"].T, weights["hidden_norm.weight"], eps)
    tokens = torch.tensor([anchor_token] + [args.mask_token_id] * (args.block_size - 1))
    x = embed[tokens]
    positions = torch.arange(anchor_pos + args.block_size)  # context 0..p-1, block p..p+B-1
    cos_sin = rotary(x, positions[None, :])
    cos_sin = (cos_sin[0][0], cos_sin[1][0])
    masks = engine_masks(args, anchor_pos)
    for i, layer_type in enumerate(args.layer_types):
        prefix = f"layers.{i}"
        normed = rms_norm(x, weights[f"{prefix}.input_layernorm.weight"], eps)
        x = x + engine_attention(weights, f"{prefix}.self_attn", args, normed, context, cos_sin, masks[layer_type])
        normed = rms_norm(x, weights[f"{prefix}.post_attention_layernorm.weight"], eps)
        gate = normed @ weights[f"{prefix}.mlp.gate_proj.weight"].T
        up = normed @ weights[f"{prefix}.mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ weights[f"{prefix}.mlp.down_proj.weight"].T
    return rms_norm(x, weights["norm.weight"], eps) @ lm_head.T


def engine_rotary(args) -> Qwen3RotaryEmbedding:
    config = Qwen3Config(
        hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads, head_dim=args.head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
    )
    return Qwen3RotaryEmbedding(config)


def engine_logits_for_all_anchors(args, model, embed, lm_head, batch) -> torch.Tensor:
    weights = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    rotary = engine_rotary(args)
    per_anchor = []
    for anchor, doc in enumerate(batch["anchor_doc"].tolist()):
        if doc < 0:
            continue
        index, pos = int(batch["anchor_index"][anchor]), int(batch["anchor_pos"][anchor])
        features = batch["hidden"][index - pos:index]  # this sequence's tokens before the anchor
        assert torch.all(batch["doc_ids"][index - pos:index + 1] == doc)
        token = int(batch["input_ids"][index])
        per_anchor.append(engine_block_logits(args, weights, embed, lm_head, rotary, features, token, pos))
    return torch.stack(per_anchor)


@pytest.mark.parametrize("seed", [0, 1])
def test_packed_training_forward_equals_inference_engine(seed):
    args, model, embed, lm_head = tiny_setup(seed)
    batch = random_packed_batch(seed, args.context_feature_size, args.block_size)
    real = batch["anchor_doc"] >= 0
    training = packed_training_logits(args, model, embed, lm_head, batch)[real]
    with torch.no_grad():
        engine = engine_logits_for_all_anchors(args, model, embed, lm_head, batch)
    torch.testing.assert_close(training, engine, atol=1e-5, rtol=1e-5)


def test_engine_detects_position_off_by_one_and_sliding_served_as_full():
    """The comparison above must fail for the classic train/serve mismatches."""
    args, model, embed, lm_head = tiny_setup(0)
    batch = random_packed_batch(0, args.context_feature_size, args.block_size)
    real = batch["anchor_doc"] >= 0
    with torch.no_grad():
        engine = engine_logits_for_all_anchors(args, model, embed, lm_head, batch)
    shifted = packed_training_logits(args, model, embed, lm_head, batch, position_shift=1)[real]
    assert (shifted - engine).abs().max() > 1e-3
    full = build_masks(batch, ["full_attention"], args.sliding_window, block_size=args.block_size, backend="dense")
    all_full = {"sliding_attention": full["full_attention"], "full_attention": full["full_attention"]}
    served_full = packed_training_logits(args, model, embed, lm_head, batch, masks=all_full)[real]
    assert (served_full - engine).abs().max() > 1e-3
