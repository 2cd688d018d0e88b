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

Which tiles of a `BlockMask` (`mask_tile`: 128 x 128, 64 x 64 for heads of up to 64 dims) hold visible pairs is
laid out on the host by dflash/model/tiles.py (the collate, in the loader's workers); `build_masks`
builds the `BlockMask` from that layout, and the `mask_mod` runs only inside partial tiles. Without a
layout it falls back to `create_block_mask`, which evaluates the rule on every (query, key) pair.
"""

import functools
from collections.abc import Mapping
from functools import cache

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask, flex_attention

from dflash.model.block_attention import RowRanges, block_attention, row_ranges, triton_refusal
from dflash.model.tiles import PADDING_DOC, TILE, keys_key, tiles_key, transposed_key

LAYER_TYPES = ("sliding_attention", "full_attention")
# flex attention + BlockMask, a dense boolean mask + SDPA, or dflash's own kernels over each row's key ranges
# (dflash/model/block_attention.py: CUDA and Triton, or Triton's interpreter)
BACKENDS = ("flex", "dense", "blockwise")
# Heads of at most 64 dims (the SmolLM2-sized drafter's 9 x 64): 64 x 64 tiles instead of inductor's default
# (128 x 64 on an H200). The small drafter's step on an H200 (12-03): 88.3K -> 96.4K tokens/s at 4,096 anchors
# per micro-batch; the backward's tiles (12-06, the fused step of `bench_stage2.py --target smollm2-135m`):
# 32 x 64 for dQ and 64 x 32 for dK/dV with 4 warps and 3 stages, 126.4 -> 121.9 ms a step (100.8K -> 104.6K
# tokens/s; the same tiles with inductor's warps and stages 154.5 ms, 64 x 64 with 2 stages 124.4). 128-dim
# heads (the 27B-shaped drafter) keep inductor's defaults, where they were measured.
SMALL_HEAD_DIM = 64
SMALL_HEAD_OPTIONS = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32,
                      "num_warps": 4, "num_stages": 3}


# The window of a full-attention layer in the shared rule: wider than any position difference.
FULL_WINDOW = 1 << 40


def make_mask_mod(ctx_doc_T, ctx_pos_T, anchor_doc_A, anchor_pos_A, block_size: int, window: int | None):
    """The visibility rule as a flex-attention `mask_mod(b, h, q_idx, kv_idx) -> bool`.

    `window=None` means a full-attention layer. Padded anchors (doc -1) see only their own
    block, so no query row is ever fully masked (SDPA would return NaN for it).

    Both layer types run the same code: the window (`FULL_WINDOW` for a full layer) and how far past
    its own slot a block token sees inside its block (1 key: causal, sliding layers; the whole block,
    full layers) are 0-d tensors the rule reads. So compiled flex attention compiles one graph for
    both layer types; a Python branch or int on the window made it compile one per type (a graph, and
    its kernels' compile, more in every cold start).
    """
    num_context, num_anchors = ctx_doc_T.shape[0], anchor_doc_A.shape[0]
    if num_context < 1 or num_anchors < 1:
        raise ValueError(f"masks: need at least one context token and one anchor, got T={num_context}, A={num_anchors}")
    if window is not None and window < block_size:
        raise ValueError(f"masks: sliding window {window} is smaller than block size {block_size}")
    window_t, reach_t = _rule_constants(window, block_size, anchor_pos_A.device)

    def mask_mod(b, h, q_idx, kv_idx):
        # Indices are clamped because both branches are evaluated for every (q, kv) pair.
        anchor = torch.clamp(q_idx // block_size, max=num_anchors - 1)
        slot = q_idx % block_size
        doc, pos = anchor_doc_A[anchor], anchor_pos_A[anchor]
        ctx = torch.clamp(kv_idx, max=num_context - 1)
        ctx_pos = ctx_pos_T[ctx]
        # Inside the block the window holds trivially (window >= block size).
        sees_context = ((ctx_doc_T[ctx] == doc) & (doc != PADDING_DOC) & (ctx_pos < pos)
                        & (pos + slot - ctx_pos < window_t))
        block_key = torch.clamp(kv_idx - num_context, min=0)
        sees_block = (block_key // block_size == anchor) & (block_key % block_size - slot < reach_t)
        is_context = kv_idx < num_context
        return (is_context & sees_context) | (~is_context & sees_block)

    return mask_mod


@cache
def _rule_constants(window: int | None, block_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule's window and in-block reach as 0-d int64 tensors on `device`, made once (a tensor made
    per micro-batch would be a copy to the device, and a sync, every step)."""
    values = (FULL_WINDOW, block_size) if window is None else (window, 1)
    return tuple(torch.tensor(value, dtype=torch.int64, device=device) for value in values)


def layout_tile(layout: torch.Tensor, num_queries: int) -> int:
    """The tile size of a `tile_layout` (`(2, QT, 1 + W)`) over `num_queries` rows."""
    return num_queries // layout.shape[1]


def block_mask_from_layout(layout: torch.Tensor, mask_mod, num_queries: int, num_keys: int,
                           transposed: torch.Tensor | None = None) -> BlockMask:
    """The `BlockMask` of a `tile_layout` (its partial and full tiles), for one batch and head; the
    lists padded to every key (or query) tile, as `BlockMask` reads them. With the lists per key tile
    (`tiles.transpose_layout`) the mask takes them as they are; without, `from_kv_blocks` computes them."""
    tile = layout_tile(layout, num_queries)
    if tile < TILE and layout.is_cuda:
        backward_configs_follow_options()
    num_query_tiles, num_key_tiles = layout.shape[1], -(-num_keys // tile)
    kv_num, kv_indices, full_kv_num, full_kv_indices = _lists(layout, num_key_tiles)
    if transposed is None:
        return BlockMask.from_kv_blocks(kv_num, kv_indices, full_kv_num, full_kv_indices, BLOCK_SIZE=tile,
                                        mask_mod=mask_mod, seq_lengths=(num_queries, num_keys))
    q_num, q_indices, full_q_num, full_q_indices = _lists(transposed, num_query_tiles)
    return BlockMask(seq_lengths=(num_queries, num_keys), kv_num_blocks=kv_num, kv_indices=kv_indices,
                     full_kv_num_blocks=full_kv_num, full_kv_indices=full_kv_indices, q_num_blocks=q_num,
                     q_indices=q_indices, full_q_num_blocks=full_q_num, full_q_indices=full_q_indices,
                     BLOCK_SIZE=(tile, tile), mask_mod=mask_mod)


def _lists(layout: torch.Tensor, width: int) -> tuple[torch.Tensor, ...]:
    """A layout's (2, rows, 1 + W) lists as `BlockMask` holds them: the partial tiles' counts `(1, 1, rows)`
    and indices `(1, 1, rows, width)`, then the full tiles', int32, the indices padded with 0."""
    layout = layout.to(torch.int32)
    if layout.shape[-1] < width + 1:
        layout = F.pad(layout, (0, width + 1 - layout.shape[-1]))
    layout = layout[:, None, None]  # (2, 1, 1, rows, width + 1)
    return (layout[0, ..., 0].contiguous(), layout[0, ..., 1:].contiguous(),
            layout[1, ..., 0].contiguous(), layout[1, ..., 1:].contiguous())


def gathered_mask_mod(mask_mod, keys_2K: torch.Tensor, tile: int = TILE):
    """The rule over gathered keys (`tiles.gather_context_keys`): new key k stands for key `keys[0, k]`,
    and a copy is seen only by the query tile (`tile` rows) that owns it (`keys[1, k]`; -1: a block key,
    not copied)."""
    source_K, owner_K = keys_2K[0], keys_2K[1]

    def gathered(b, h, q_idx, kv_idx):
        owner = owner_K[kv_idx]
        return ((owner < 0) | (owner == q_idx // tile)) & mask_mod(b, h, q_idx, source_K[kv_idx])

    return gathered


class GatheredMask:
    """A `BlockMask` over gathered keys and which key each new key copies: `attend` gathers the keys
    and values before flex attention (`gather_keys`)."""

    def __init__(self, block_mask: BlockMask, source_K: torch.Tensor):
        self.block_mask, self.source_K = block_mask, source_K


class _GatherKeys(torch.autograd.Function):
    """`x.index_select(2, index)` whose backward sums the copies' gradients in float32 (a key copied for
    dozens of query tiles would lose precision summed in bf16)."""

    @staticmethod
    def forward(ctx, x_1NKD, index_M):
        ctx.save_for_backward(index_M)
        ctx.num_keys = x_1NKD.shape[2]
        return x_1NKD.index_select(2, index_M)

    @staticmethod
    def backward(ctx, grad_1NMD):
        (index_M,) = ctx.saved_tensors
        shape = (*grad_1NMD.shape[:2], ctx.num_keys, grad_1NMD.shape[3])
        dtype = torch.promote_types(grad_1NMD.dtype, torch.float32)
        grad = torch.zeros(shape, dtype=dtype, device=grad_1NMD.device)
        return grad.index_add_(2, index_M, grad_1NMD.to(dtype)).to(grad_1NMD.dtype), None


def gather_keys(x_1NKD: torch.Tensor, index_M: torch.Tensor) -> torch.Tensor:
    return _GatherKeys.apply(x_1NKD, index_M)


def _optional_field(batch_meta, name: str):
    return batch_meta.get(name) if isinstance(batch_meta, Mapping) else getattr(batch_meta, name, None)


def _meta_field(batch_meta, name: str) -> torch.Tensor:
    value = _optional_field(batch_meta, name)
    if value is None:
        raise KeyError(f"masks: batch metadata has no {name!r} (need doc_ids, position_ids, anchor_doc, anchor_pos)")
    return value


def default_backend(device: torch.device | str) -> str:
    """`build_masks`' backend when none is named: flex on CUDA; dense + SDPA elsewhere (flex has no backward on
    CPU). Training resolves `train.attention = "auto"` with `training_backend`."""
    return "flex" if torch.device(device).type == "cuda" else "dense"


# `train.attention = "auto"` on CUDA picks dflash's own kernels for the head sizes where they were timed faster
# than flex in the step and a recipe trained with them (one H100, 12-07: the SmolLM2-sized drafter's 64-dim heads
# 4% a step, the 27B-shaped drafter's 128-dim heads 2.5% the peers' step and 3% the default budget; the recipe's
# train part 450.5 s against 482 s, the drafter it trained serving the hand-written chat prompts at tau 2.680
# against the flex-trained 2.691). Other head sizes keep flex until timed, and so do GPUs before Hopper
# (capability 9.0, the H100 and H200 it was timed on; older cards have less shared memory a block for the kernels'
# committed tiles: "blockwise" names it there).
BLOCKWISE_AUTO_HEAD_DIMS = (64, 128)
BLOCKWISE_AUTO_CAPABILITY = (9, 0)


def training_backend(attention: str, device: torch.device | str, head_dim: int, gathered: bool = False) -> str:
    """The backend stage two trains with for `train.attention`: a named one as it is; "auto": dense + SDPA off
    CUDA, dflash's blockwise kernels on a CUDA device of `BLOCKWISE_AUTO_CAPABILITY` or newer for heads of
    `BLOCKWISE_AUTO_HEAD_DIMS` where Triton is installed, flex otherwise and with `train.gather_context_keys`
    (`gathered`: a layout of flex's tiles)."""
    if attention != "auto":
        return attention
    device = torch.device(device)
    if (device.type == "cuda" and head_dim in BLOCKWISE_AUTO_HEAD_DIMS and not gathered
            and triton_refusal(device) is None
            and torch.cuda.get_device_capability(device) >= BLOCKWISE_AUTO_CAPABILITY):
        return "blockwise"
    return default_backend(device)


def layer_windows(layer_types, window: int) -> dict[str, int | None]:
    """Each distinct layer type's window (None: full attention), in first-seen order."""
    for layer_type in layer_types:
        if layer_type not in LAYER_TYPES:
            raise ValueError(f"masks: unknown layer type {layer_type!r}, expected one of {LAYER_TYPES}")
    return {layer_type: window if layer_type == "sliding_attention" else None
            for layer_type in dict.fromkeys(layer_types)}


def build_masks(batch_meta, layer_types, window: int, *, block_size: int, backend: str | None = None, device=None):
    """One mask per distinct layer type, shared by all layers of that type: `{layer_type: mask}`.

    `batch_meta` holds (as keys or attributes) `doc_ids (T,)`, `position_ids (T,)`,
    `anchor_doc (A,)`, `anchor_pos (A,)`, and may hold a layer type's `tile_layout` under
    `tiles_key(layer_type)`. The mask is a `BlockMask` for backend "flex" (from the layout when
    there is one, else from `create_block_mask`), a boolean `(1, 1, A*B, T + A*B)` tensor for "dense" and
    each row's key ranges (`block_attention.RowRanges`, the collate's packed layout) for "blockwise".
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
        if backend == "blockwise":
            masks[layer_type] = row_ranges(*tensors, block_size, layer_window)
            continue
        mask_mod = make_mask_mod(*tensors, block_size, layer_window)
        layout = _optional_field(batch_meta, tiles_key(layer_type))
        keys = _optional_field(batch_meta, keys_key(layer_type))
        transposed = _optional_field(batch_meta, transposed_key(layer_type))
        transposed = transposed.to(device) if transposed is not None else None
        if backend == "flex" and layout is not None and keys is not None:
            keys = keys.to(device)
            mask_mod = gathered_mask_mod(mask_mod, keys, layout_tile(layout, num_queries))
            block_mask = block_mask_from_layout(layout.to(device), mask_mod, num_queries, keys.shape[1],
                                                transposed)
            masks[layer_type] = GatheredMask(block_mask, keys[0])
        elif backend == "flex" and layout is not None:
            masks[layer_type] = block_mask_from_layout(layout.to(device), mask_mod, num_queries, num_keys, transposed)
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


FLEX_OPTIONS_OVERRIDE: dict = {}  # non-empty: the kernel options for every head size (bench_stage2 --flex-options)


MASK_TILE_OVERRIDE = 0  # non-zero: the block masks' tile in place of TILE (bench_stage2 --mask-tile)


SMALL_HEAD_TILE = 64  # the block masks' tile for heads of at most SMALL_HEAD_DIM dims


def mask_tile(head_dim: int) -> int:
    """The block masks' tile (rows and keys) for heads of `head_dim`: the benchmark's override, else
    `SMALL_HEAD_TILE` for small heads (when every kernel tile of theirs divides it), else `TILE`. Every kernel
    tile (`flex_kernel_options`) must lie inside one mask tile. Under the small heads' kernel tiles a 64 x 64
    mask lists fewer keys no row sees: at the SmolLM2-sized drafter's budget (two 16K-token buckets of 4,096
    anchors) its tiles hold 80% visible pairs instead of 65%, and the step took 121.6 ms instead of 134.8 on
    an H100 (12-06, `tools/bench_stage2.py --mask-tile`)."""
    options = flex_kernel_options(head_dim)
    blocks = [value for key, value in options.items() if key.startswith("BLOCK_")]
    small = head_dim <= SMALL_HEAD_DIM and all(SMALL_HEAD_TILE % value == 0 for value in blocks)
    tile = MASK_TILE_OVERRIDE or (SMALL_HEAD_TILE if small else TILE)
    for key, value in options.items():
        if key.startswith("BLOCK_") and tile % value:
            raise ValueError(f"masks: the block masks' tile {tile} is not a multiple of the kernel option "
                             f"{key}={value} (heads of {head_dim} dims)")
    return tile


@cache
def backward_configs_follow_options() -> None:
    """Let flex attention's backward compile over masks of tiles smaller than `TILE`.

    torch's lowering of the backward (2.11-2.13) checks the mask's tile against the block sizes of its
    own heuristic's configs (on an H100 or H200, 128-key blocks for 64-dim heads), not against the kernel
    options that replace them, so it finds no kernel for 64-key tiles. This sets inductor's choices
    (`inductor_choices_class`, read by every thread that compiles, and this thread's) to ones whose backward
    configs carry the kernel options' block sizes; where another choices class is set already, it stays.
    """
    from torch._inductor import config as inductor_config
    from torch._inductor.virtualized import V

    if getattr(inductor_config, "inductor_choices_class", "absent") is not None:
        return
    inductor_config.inductor_choices_class = _choices_with_options_blocks()
    V.set_choices_handler(inductor_config.inductor_choices_class())


def _choices_with_options_blocks():
    from dflash.model.flex_choices import ChoicesWithOptionsBlocks  # imports inductor: only when needed

    ChoicesWithOptionsBlocks.kernel_options = staticmethod(flex_kernel_options)
    return ChoicesWithOptionsBlocks


def flex_kernel_options(head_dim: int) -> dict:
    """Flex's kernel options on CUDA: `SMALL_HEAD_OPTIONS` for small heads, inductor's defaults for the others
    (or the benchmark's override, a tile sweep's)."""
    if FLEX_OPTIONS_OVERRIDE:
        return dict(FLEX_OPTIONS_OVERRIDE)
    return dict(SMALL_HEAD_OPTIONS) if head_dim <= SMALL_HEAD_DIM else {}


def attend(q_1NQD: torch.Tensor, k_1MKD: torch.Tensor, v_1MKD: torch.Tensor, mask) -> torch.Tensor:
    """Attention with grouped KV heads; the backend follows the mask (BlockMask -> flex, GatheredMask ->
    flex over gathered keys, RowRanges -> dflash's kernels, tensor -> SDPA)."""
    if isinstance(mask, RowRanges):
        return block_attention(q_1NQD, k_1MKD, v_1MKD, mask)
    if not isinstance(mask, (BlockMask, GatheredMask)):
        return F.scaled_dot_product_attention(q_1NQD, k_1MKD, v_1MKD, attn_mask=mask, enable_gqa=True)
    attention = _compiled_flex_attention() if q_1NQD.is_cuda else flex_attention
    options = flex_kernel_options(q_1NQD.shape[-1]) if q_1NQD.is_cuda else {}
    if options:
        attention = functools.partial(attention, kernel_options=options)
    if isinstance(mask, GatheredMask):
        # Every key tile is read by one query tile: the grouped heads' loop in flex's backward is short.
        return attention(q_1NQD, gather_keys(k_1MKD, mask.source_K), gather_keys(v_1MKD, mask.source_K),
                         block_mask=mask.block_mask, enable_gqa=True)
    group = q_1NQD.shape[1] // k_1MKD.shape[1]
    if group > 1:
        # Each key head repeated for its query heads (the same attention). With grouped heads, flex's
        # backward runs a key head's query heads one after another in one program per key tile, and a
        # context tile is seen by every query tile of its sequence (dozens): that loop is the step's
        # longest (issue 24's profile). Repeated, each query head's share runs in its own program;
        # the repeat's backward sums the key and value gradients of the group. Grouped heads measured
        # slower on an H200 (12-02, the small drafter: 82.4K vs 88.4K tokens/s).
        k_1MKD = k_1MKD.repeat_interleave(group, dim=1)
        v_1MKD = v_1MKD.repeat_interleave(group, dim=1)
    return attention(q_1NQD, k_1MKD, v_1MKD, block_mask=mask)
