"""Who may attend to whom in a packed stage-two micro-batch: one `mask_mod`, two backends.

Layout (docs/INTERNALS.md, "Stage-two tensors"): queries are the `A*B` block tokens (query
`q` is slot `q % B` of anchor `q // B`); keys are `[context tokens (T) ; block tokens (A*B)]`.
The rule (docs/ARCHITECTURE.md): a block at anchor position `p` of sequence `d` sees the context
tokens of `d` at positions `< p`, and the block tokens of its own block only; full-attention
layers see the whole block, sliding-window layers are causal inside the block and only see
keys at absolute positions within the window (`p + j - key_pos < W`).

The same `mask_mod` builds a flex-attention `BlockMask` (CUDA) or a dense boolean mask for
SDPA (CPU, where flex has no backward), so CPU tests check the real mask logic against a
loop-by-loop statement of the rule (tests/support.py).
"""

from collections.abc import Mapping
from functools import cache

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask, flex_attention

LAYER_TYPES = ("sliding_attention", "full_attention")
BACKENDS = ("flex", "dense")  # flex attention + BlockMask, or a dense boolean mask + SDPA
PADDING_DOC = -1  # doc id of padded context tokens and padded anchors


def make_mask_mod(ctx_doc_T, ctx_pos_T, anchor_doc_A, anchor_pos_A, block_size: int, window: int | None):
    """The visibility rule as a flex-attention `mask_mod(b, h, q_idx, kv_idx) -> bool`.

    `window=None` means a full-attention layer. Padded anchors (doc -1) see only their own
    block, so no query row is ever fully masked (SDPA would return NaN for it).
    """
    num_context, num_anchors = ctx_doc_T.shape[0], anchor_doc_A.shape[0]
    if num_context < 1 or num_anchors < 1:
        raise ValueError(f"masks: need at least one context token and one anchor, got T={num_context}, A={num_anchors}")
    if window is not None and window < block_size:
        raise ValueError(f"masks: sliding window {window} is smaller than block size {block_size}")

    def mask_mod(b, h, q_idx, kv_idx):
        # Indices are clamped because both branches are evaluated for every (q, kv) pair.
        anchor = torch.clamp(q_idx // block_size, max=num_anchors - 1)
        slot = q_idx % block_size
        doc, pos = anchor_doc_A[anchor], anchor_pos_A[anchor]
        ctx = torch.clamp(kv_idx, max=num_context - 1)
        ctx_pos = ctx_pos_T[ctx]
        sees_context = (ctx_doc_T[ctx] == doc) & (doc != PADDING_DOC) & (ctx_pos < pos)
        block_key = torch.clamp(kv_idx - num_context, min=0)
        sees_block = block_key // block_size == anchor
        if window is not None:
            sees_context = sees_context & (pos + slot - ctx_pos < window)
            # Inside the block the window holds trivially (window >= block size).
            sees_block = sees_block & (block_key % block_size <= slot)
        is_context = kv_idx < num_context
        return (is_context & sees_context) | (~is_context & sees_block)

    return mask_mod


def _meta_field(batch_meta, name: str) -> torch.Tensor:
    value = batch_meta[name] if isinstance(batch_meta, Mapping) else getattr(batch_meta, name, None)
    if value is None:
        raise KeyError(f"masks: batch metadata has no {name!r} (need doc_ids, position_ids, anchor_doc, anchor_pos)")
    return value


def default_backend(device: torch.device | str) -> str:
    """flex on CUDA; dense + SDPA elsewhere (flex has no backward on CPU)."""
    return "flex" if torch.device(device).type == "cuda" else "dense"


def build_masks(batch_meta, layer_types, window: int, *, block_size: int, backend: str | None = None, device=None):
    """One mask per distinct layer type, shared by all layers of that type: `{layer_type: mask}`.

    `batch_meta` holds (as keys or attributes) `doc_ids (T,)`, `position_ids (T,)`,
    `anchor_doc (A,)`, `anchor_pos (A,)`. The mask is a `BlockMask` for backend "flex" and a
    boolean `(1, 1, A*B, T + A*B)` tensor for "dense".
    """
    device = torch.device(device) if device is not None else _meta_field(batch_meta, "doc_ids").device
    backend = backend or default_backend(device)
    if backend not in BACKENDS:
        raise ValueError(f"masks: unknown backend {backend!r}, expected one of {BACKENDS}")
    tensors = [_meta_field(batch_meta, name).to(device) for name in ("doc_ids", "position_ids", "anchor_doc", "anchor_pos")]
    num_queries = tensors[2].shape[0] * block_size
    num_keys = tensors[0].shape[0] + num_queries
    masks = {}
    for layer_type in dict.fromkeys(layer_types):
        if layer_type not in LAYER_TYPES:
            raise ValueError(f"masks: unknown layer type {layer_type!r}, expected one of {LAYER_TYPES}")
        layer_window = window if layer_type == "sliding_attention" else None
        mask_mod = make_mask_mod(*tensors, block_size, layer_window)
        if backend == "flex":
            build = _compiled_create_block_mask() if device.type == "cuda" else create_block_mask
            masks[layer_type] = build(mask_mod, 1, 1, num_queries, num_keys, device=device)
        else:
            masks[layer_type] = create_mask(mask_mod, 1, 1, num_queries, num_keys, device=device)
    return masks


@cache
def _compiled_create_block_mask():
    # Compiled, the mask_mod is evaluated tile by tile and the (Q, KV) mask never materialises.
    return torch.compile(create_block_mask)


@cache
def _compiled_flex_attention():
    # Uncompiled flex_attention on CUDA materialises the full score matrix; compile once.
    # Default dynamic: the second distinct (Q, KV) length compiles one shape-generic kernel
    # instead of one kernel per padded length.
    return torch.compile(flex_attention)


def attend(q_1NQD: torch.Tensor, k_1MKD: torch.Tensor, v_1MKD: torch.Tensor, mask) -> torch.Tensor:
    """Attention with grouped KV heads; the backend follows the mask (BlockMask -> flex, tensor -> SDPA)."""
    if isinstance(mask, BlockMask):
        attention = _compiled_flex_attention() if q_1NQD.is_cuda else flex_attention
        return attention(q_1NQD, k_1MKD, v_1MKD, block_mask=mask, enable_gqa=True)
    return F.scaled_dot_product_attention(q_1NQD, k_1MKD, v_1MKD, attn_mask=mask, enable_gqa=True)
