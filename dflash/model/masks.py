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

Which 128 x 128 tiles of a `BlockMask` hold a visible pair, and which hold only visible pairs, follows
from each query row's visible keys, two index ranges (its sequence's context before the anchor,
inside the window; its own block): `tile_layout` computes them on the host (the collate, in the
loader's workers) for a packed micro-batch, and `build_masks` builds the `BlockMask` from them. The
`mask_mod` then runs only inside partial tiles, and nothing evaluates it over every (query, key) pair
(`create_block_mask` does, a compiled kernel over Q x (T + Q) per layer type and micro-batch).
"""

from collections.abc import Mapping
from functools import cache

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask, flex_attention

LAYER_TYPES = ("sliding_attention", "full_attention")
BACKENDS = ("flex", "dense")  # flex attention + BlockMask, or a dense boolean mask + SDPA
PADDING_DOC = -1  # doc id of padded context tokens and padded anchors
TILE = 128  # rows and keys per BlockMask tile (flex attention's default block size)
# Flex attention gets each key head repeated for its query heads (`attend`); False: grouped heads (enable_gqa).
FLEX_REPEAT_KV = True


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


def tile_layout(doc_T: np.ndarray, pos_T: np.ndarray, anchor_doc_A: np.ndarray, anchor_pos_A: np.ndarray,
                block_size: int, window: int | None) -> np.ndarray | None:
    """The `BlockMask` tiles of one layer type, from the rule above, as int32 `(2, QT, KT + 1)`:
    `[0]` partial tiles (a visible pair and an invisible one), `[1]` full tiles (only visible pairs);
    per query tile the count, then the key-tile indices in ascending order (the rest 0).

    Needs what the collate lays out: T and A * B multiples of TILE, each sequence's real tokens
    contiguous at positions 0, 1, ... Returns None for any other layout (`build_masks` then
    evaluates the `mask_mod` everywhere, as `create_block_mask` does).
    """
    doc_T, pos_T = np.asarray(doc_T, dtype=np.int64), np.asarray(pos_T, dtype=np.int64)
    anchor_doc_A, anchor_pos_A = np.asarray(anchor_doc_A, dtype=np.int64), np.asarray(anchor_pos_A, dtype=np.int64)
    num_tokens, num_anchors = len(doc_T), len(anchor_doc_A)
    num_rows = num_anchors * block_size
    if num_tokens % TILE or num_rows % TILE or not num_tokens or not num_anchors:
        return None
    starts = sequence_starts(doc_T, pos_T)
    if starts is None:
        return None
    real = anchor_doc_A != PADDING_DOC
    if real.any():
        docs = anchor_doc_A[real]
        if docs.min() < 0 or docs.max() >= len(starts) or starts[docs].min() < 0:
            return None  # an anchor of a sequence with no context token
        lengths = np.bincount(doc_T[doc_T != PADDING_DOC], minlength=len(starts))
        if anchor_pos_A[real].min() < 0 or (anchor_pos_A[real] > lengths[docs]).any():
            return None  # its context would run past its sequence
    doc_start_A = np.where(real, starts[np.where(real, anchor_doc_A, 0)], 0)
    slot_R = np.tile(np.arange(block_size), num_anchors)
    anchor_R = np.repeat(np.arange(num_anchors), block_size)
    pos_R = anchor_pos_A[anchor_R]
    # Row r (anchor a, slot s) sees context [start + max(0, p + s - W + 1), start + p - 1] of its
    # sequence and block keys [T + a*B, T + a*B + (s if sliding else B - 1)].
    first_pos = np.zeros_like(pos_R) if window is None else np.maximum(0, pos_R + slot_R - window + 1)
    context_lo = doc_start_A[anchor_R] + first_pos
    context_hi = doc_start_A[anchor_R] + pos_R - 1
    context_hi = np.where(real[anchor_R], context_hi, context_lo - 1)  # padded anchors: no context
    block_lo = num_tokens + anchor_R * block_size
    block_hi = block_lo + (slot_R if window is not None else block_size - 1)
    num_key_tiles = (num_tokens + num_rows) // TILE
    row_tile = np.arange(num_rows) // TILE
    touched = np.zeros((num_rows // TILE, num_key_tiles + 1), dtype=np.int64)
    covered = np.zeros_like(touched)
    for lo, hi in ((context_lo, context_hi), (block_lo, block_hi)):
        some = lo <= hi
        np.add.at(touched, (row_tile[some], lo[some] // TILE), 1)
        np.add.at(touched, (row_tile[some], hi[some] // TILE + 1), -1)
        first_full, last_full = -(-lo // TILE), (hi + 1) // TILE - 1
        whole = some & (first_full <= last_full)
        np.add.at(covered, (row_tile[whole], first_full[whole]), 1)
        np.add.at(covered, (row_tile[whole], last_full[whole] + 1), -1)
    any_visible = np.cumsum(touched, axis=1)[:, :-1] > 0
    full = np.cumsum(covered, axis=1)[:, :-1] == TILE  # every row of the query tile sees the whole key tile
    layout = np.zeros((2, num_rows // TILE, num_key_tiles + 1), dtype=np.int32)
    for kind, tiles in enumerate((any_visible & ~full, full)):
        layout[kind, :, 0] = tiles.sum(axis=1)
        layout[kind, :, 1:] = np.where(np.sort(~tiles, axis=1, kind="stable"), 0,
                                       np.argsort(~tiles, axis=1, kind="stable"))
    return layout


def sequence_starts(doc_T: np.ndarray, pos_T: np.ndarray) -> np.ndarray | None:
    """Flat index of each sequence's first token (`-1` for an id with no token), or None unless every
    real token sits at `start + position` of one contiguous run per sequence."""
    real = np.flatnonzero(doc_T != PADDING_DOC)
    if not len(real):
        return np.zeros(0, dtype=np.int64)
    if doc_T[real].min() < 0:
        return None
    starts = np.full(int(doc_T[real].max()) + 1, -1, dtype=np.int64)
    same = doc_T[real][1:] == doc_T[real][:-1]
    if (np.diff(real)[same] != 1).any():
        return None  # a gap inside a sequence
    first = real[np.r_[True, ~same]]
    if len(np.unique(doc_T[first])) != len(first):
        return None  # a sequence in two runs
    starts[doc_T[first]] = first
    if not np.array_equal(real - starts[doc_T[real]], pos_T[real]):
        return None
    return starts


def block_mask_from_layout(layout: torch.Tensor, mask_mod, num_queries: int, num_keys: int) -> BlockMask:
    """The `BlockMask` of a `tile_layout` (its partial and full tiles), for one batch and head."""
    layout = layout.to(torch.int32)[:, None, None]  # (2, 1, 1, QT, KT + 1)
    return BlockMask.from_kv_blocks(layout[0, ..., 0].contiguous(), layout[0, ..., 1:].contiguous(),
                                    layout[1, ..., 0].contiguous(), layout[1, ..., 1:].contiguous(),
                                    BLOCK_SIZE=TILE, mask_mod=mask_mod, seq_lengths=(num_queries, num_keys))


def _optional_field(batch_meta, name: str):
    return batch_meta.get(name) if isinstance(batch_meta, Mapping) else getattr(batch_meta, name, None)


def _meta_field(batch_meta, name: str) -> torch.Tensor:
    value = batch_meta[name] if isinstance(batch_meta, Mapping) else getattr(batch_meta, name, None)
    if value is None:
        raise KeyError(f"masks: batch metadata has no {name!r} (need doc_ids, position_ids, anchor_doc, anchor_pos)")
    return value


def default_backend(device: torch.device | str) -> str:
    """flex on CUDA; dense + SDPA elsewhere (flex has no backward on CPU)."""
    return "flex" if torch.device(device).type == "cuda" else "dense"


def layer_windows(layer_types, window: int) -> dict[str, int | None]:
    """Each distinct layer type's window (None: full attention), in first-seen order."""
    for layer_type in layer_types:
        if layer_type not in LAYER_TYPES:
            raise ValueError(f"masks: unknown layer type {layer_type!r}, expected one of {LAYER_TYPES}")
    return {layer_type: window if layer_type == "sliding_attention" else None for layer_type in dict.fromkeys(layer_types)}


def tiles_key(layer_type: str) -> str:
    """The micro-batch key of a layer type's `tile_layout` (the collate writes it)."""
    return f"tiles_{layer_type}"


def build_masks(batch_meta, layer_types, window: int, *, block_size: int, backend: str | None = None, device=None):
    """One mask per distinct layer type, shared by all layers of that type: `{layer_type: mask}`.

    `batch_meta` holds (as keys or attributes) `doc_ids (T,)`, `position_ids (T,)`,
    `anchor_doc (A,)`, `anchor_pos (A,)`, and may hold a layer type's `tile_layout` under
    `tiles_key(layer_type)`. The mask is a `BlockMask` for backend "flex" (from the layout when
    there is one, else from `create_block_mask`) and a boolean `(1, 1, A*B, T + A*B)` tensor for "dense".
    """
    device = torch.device(device) if device is not None else _meta_field(batch_meta, "doc_ids").device
    backend = backend or default_backend(device)
    if backend not in BACKENDS:
        raise ValueError(f"masks: unknown backend {backend!r}, expected one of {BACKENDS}")
    tensors = [_meta_field(batch_meta, name).to(device) for name in ("doc_ids", "position_ids", "anchor_doc", "anchor_pos")]
    num_queries = tensors[2].shape[0] * block_size
    num_keys = tensors[0].shape[0] + num_queries
    masks = {}
    for layer_type, layer_window in layer_windows(layer_types, window).items():
        mask_mod = make_mask_mod(*tensors, block_size, layer_window)
        layout = _optional_field(batch_meta, tiles_key(layer_type))
        if backend == "flex" and layout is not None:
            masks[layer_type] = block_mask_from_layout(layout.to(device), mask_mod, num_queries, num_keys)
        elif backend == "flex":
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
    # dynamic=True: the first call compiles the shape-generic kernel (the lengths of queries, keys,
    # the tile lists and the rule's tensors change every micro-batch; head dim and tiles stay static).
    # Marking those axes alone does not hold: flex's own checks specialise the first call's lengths,
    # so the default compiled a static kernel, then a generic one at the second length.
    return torch.compile(flex_attention, dynamic=True)


def attend(q_1NQD: torch.Tensor, k_1MKD: torch.Tensor, v_1MKD: torch.Tensor, mask) -> torch.Tensor:
    """Attention with grouped KV heads; the backend follows the mask (BlockMask -> flex, tensor -> SDPA)."""
    if isinstance(mask, BlockMask):
        attention = _compiled_flex_attention() if q_1NQD.is_cuda else flex_attention
        group = q_1NQD.shape[1] // k_1MKD.shape[1]
        if group > 1 and not FLEX_REPEAT_KV:
            return attention(q_1NQD, k_1MKD, v_1MKD, block_mask=mask, enable_gqa=True)
        if group > 1:
            # Each key head repeated for its query heads (the same attention). With grouped heads, flex's
            # backward runs a key head's query heads one after another in one program per key tile, and a
            # context tile is seen by every query tile of its sequence (dozens): that loop is the step's
            # longest (issue 24's profile). Repeated, each query head's share runs in its own program;
            # the repeat's backward sums the key and value gradients of the group.
            k_1MKD = k_1MKD.repeat_interleave(group, dim=1)
            v_1MKD = v_1MKD.repeat_interleave(group, dim=1)
        return attention(q_1NQD, k_1MKD, v_1MKD, block_mask=mask)
    return F.scaled_dot_product_attention(q_1NQD, k_1MKD, v_1MKD, attn_mask=mask, enable_gqa=True)
