"""Train-vs-inference: the packed training forward gives the logits an inference engine gets.

The "engine" below is written independently of dflash.model.drafter and dflash.model.masks: it serves
one anchor at a time, from the exported weights (state-dict keys), with the accepted
context only (positions < anchor of that sequence), a block of anchor token + mask tokens,
RoPE tables from transformers' Qwen3 rotary embedding (what engines load from the exported
`config.json`), and masks built by hand from docs/ARCHITECTURE.md. If training used the wrong
positions, leaked across sequences, or treated a sliding layer as full, the logits differ.
"""

import pytest
import torch
from support import packed_training_logits, random_packed_batch, tiny_setup
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

from dflash.model.masks import build_masks


def rms_norm(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def engine_masks(args, anchor_pos: int) -> dict:
    """Per-layer-type (B, ctx + B) masks for one block, straight from docs/ARCHITECTURE.md."""
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
