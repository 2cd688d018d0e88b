"""Stage two's attention as Triton kernels of its own: every query row sees two contiguous key ranges.

Under the visibility rule (dflash/model/masks.py) the block row of anchor a, slot s sees its sequence's
context `[start + max(0, p + s - W + 1), start + p)` (p the anchor's position, W the window; the whole prefix
in full-attention layers) and its own block's keys `[T + a*B, T + a*B + reach)` (the whole block, or up to its
own slot in sliding layers), the context packed sequence after sequence as the collate lays it out. So a
tile of rows reads one range of context keys and one of block keys, and a kernel can loop over exactly
those, comparing each key with its row's two ranges, instead of flex attention's tile lists and `mask_mod`
(which run 64-dim heads at 84 TFLOP/s of listed pairs on an H100, 12-06). `row_ranges` computes the four
bounds per row on the device; `block_attention` is the attention (forward: `_forward_kernel`, backward:
`_dq_kernel` per row tile, `_dkdv_kernel` per key tile over the rows that can see it), a `torch.library`
custom op, so compiled layers keep it whole. Key heads are read by their query heads (grouped-query
attention), never repeated. Each kernel launches its tiles the longest first (`longest_first`: a context key
tile at the start of a long sequence walks up to ~90 row tiles, a block key tile one), so no long program
starts in the last wave.

`train.attention = "blockwise"` trains with it (CUDA, Triton), and `"auto"` (the default) on the GPUs and head sizes
`masks.training_backend` names. On one H100 (12-06) it ran the SmolLM2-sized drafter's attention in 3.1 ms a
micro-batch against flex's 4.2 (`tools/bench_block_attention.py`) and its step 4% faster; the recipe trained
with it serves as the flex-trained drafter did (12-07). Exactness: tests/test_block_attention.py
(output and gradients against the dense mask's SDPA on fresh random batches; on the CPU through Triton's
interpreter, `TRITON_INTERPRET=1`).
"""

import os
from typing import NamedTuple

import torch

BLOCK_ROWS = 64  # rows (query tile) per program
BLOCK_KEYS = 64  # keys per inner step


class KernelConfig(NamedTuple):
    """One kernel's launch: rows and keys per tile, Triton's warps and pipeline stages."""
    rows: int = BLOCK_ROWS
    keys: int = BLOCK_KEYS
    warps: int = 4
    stages: int = 3


# Each kernel's launch by head size, the fastest of `tools/bench_block_attention.py --sweep` (one H100, 12-06: the
# SmolLM2-sized drafter's micro-batch at 64 dims, the peers' step's at 128; 36 launches a kernel). The dK/dV
# kernel's key tile is `BLOCK_KEYS` for every head size: `row_ranges` makes each tile's rows (`key_tile_rows`) before
# it knows the heads.
SMALL_HEAD_CONFIGS = {"forward": KernelConfig(64, 32, 4, 3), "dq": KernelConfig(64, 32, 4, 3),
                      "dkdv": KernelConfig(64, BLOCK_KEYS, 4, 3)}  # heads of up to 64 dims
LARGE_HEAD_CONFIGS = {"forward": KernelConfig(64, 32, 4, 3), "dq": KernelConfig(64, 32, 4, 2),
                      "dkdv": KernelConfig(64, BLOCK_KEYS, 4, 2)}
CONFIGS_OVERRIDE: dict = {}  # kernel -> KernelConfig for every head size (the sweep's best, tests); its dK/dV keys
                             # are then the key tile


def kernel_configs(head_dim: int) -> dict[str, KernelConfig]:
    """Each kernel's launch for heads of `head_dim` dims."""
    base = SMALL_HEAD_CONFIGS if head_dim <= 64 else LARGE_HEAD_CONFIGS
    return {**base, **CONFIGS_OVERRIDE}


def key_tile() -> int:
    """The dK/dV kernel's key tile, the tile `key_tile_rows` lists rows for."""
    return CONFIGS_OVERRIDE["dkdv"].keys if "dkdv" in CONFIGS_OVERRIDE else BLOCK_KEYS


class RowRanges(NamedTuple):
    """Per query row, the context keys `[lo, hi)` and the block keys `[block_lo, block_hi)` it sees
    (int32 `(A*B,)`; the keys are the T context tokens, then the A*B block rows); per tile of `BLOCK_KEYS`
    keys the rows `[tile_start, tile_end)` that can see it (`key_tile_rows`) and the order the dK/dV kernel
    runs the tiles in (`tile_order`), and the order the forward and dQ kernels run tiles of `BLOCK_ROWS` rows in
    (`row_order`, `row_tile_order`): made once per micro-batch, read by every layer. Tensors only: a compiled
    layer that takes it guards on no length."""
    lo: torch.Tensor
    hi: torch.Tensor
    block_lo: torch.Tensor
    block_hi: torch.Tensor
    tile_start: torch.Tensor
    tile_end: torch.Tensor
    tile_order: torch.Tensor
    row_order: torch.Tensor


def row_ranges(doc_T: torch.Tensor, pos_T: torch.Tensor, anchor_doc_A: torch.Tensor, anchor_pos_A: torch.Tensor,
               block_size: int, window: int | None) -> RowRanges:
    """The two key ranges of every block row, on the device of the inputs, with no host sync. Needs the
    collate's layout: each sequence's context tokens contiguous at positions 0, 1, ... (doc -1: padding);
    a padded anchor (doc -1) sees no context, only its own block, as the rule says."""
    num_tokens, num_anchors = doc_T.shape[0], anchor_doc_A.shape[0]
    device = doc_T.device
    index_T = torch.arange(num_tokens, device=device)
    real_T = doc_T >= 0
    # each sequence's first context index: token i of sequence d at position p starts it at i - p
    starts = torch.full((num_tokens + 1,), num_tokens, dtype=torch.long, device=device)
    starts.scatter_reduce_(0, torch.where(real_T, doc_T.long(), num_tokens), index_T - pos_T.long(), "amin")
    real_A = anchor_doc_A >= 0
    start_A = starts[torch.where(real_A, anchor_doc_A.long(), num_tokens)]
    slot_S = torch.arange(block_size, device=device)
    pos_A1 = anchor_pos_A.long()[:, None]
    hi = (start_A[:, None] + pos_A1).expand(-1, block_size)
    lo = start_A[:, None] + (torch.clamp(pos_A1 + slot_S - window + 1, min=0) if window is not None else 0)
    lo = torch.minimum(lo.expand(-1, block_size), hi)
    hi = torch.where(real_A[:, None], hi, num_tokens)
    lo = torch.where(real_A[:, None], lo, num_tokens)
    block_lo = (num_tokens + torch.arange(num_anchors, device=device) * block_size)[:, None].expand(-1, block_size)
    reach = block_size if window is None else slot_S + 1
    block_hi = block_lo + reach
    as_rows = [x.reshape(-1).to(torch.int32).contiguous() for x in (lo, hi, block_lo, block_hi)]
    return RowRanges(*as_rows, *key_tile_rows(as_rows, num_tokens + num_anchors * block_size, key_tile()),
                     row_tile_order(as_rows, BLOCK_ROWS))


def longest_first(work: torch.Tensor) -> torch.Tensor:
    """The indices of `work` from the most to the least (ties in index order), int32: the order to launch
    programs of that much work in, so the longest start first and the last wave on the GPU is of short ones
    (tiles in their own order left the dK/dV kernel's longest programs to start last)."""
    return torch.argsort(work, descending=True, stable=True).to(torch.int32).contiguous()


def row_tile_order(ranges, block_rows: int) -> torch.Tensor:
    """The tiles of `block_rows` rows of `ranges` (lo, hi, block_lo, block_hi, as in `RowRanges`) by the keys
    they walk (the union of their rows' context ranges, then of their block ranges), the most first."""
    num_rows = ranges[0].shape[0]
    pad = -num_rows % block_rows
    work = 0
    for lo, hi in (ranges[:2], ranges[2:4]):
        lo, hi = lo.long(), hi.long()
        nonempty = lo < hi
        first = torch.nn.functional.pad(torch.where(nonempty, lo, torch.iinfo(torch.long).max), (0, pad),
                                        value=torch.iinfo(torch.long).max).view(-1, block_rows).amin(1)
        end = torch.nn.functional.pad(torch.where(nonempty, hi, 0), (0, pad)).view(-1, block_rows).amax(1)
        work = work + (end - first).clamp_min(0)
    return longest_first(work)


def key_tile_rows(ranges, num_keys: int, block_keys: int = BLOCK_KEYS
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each tile of `block_keys` keys of the rows' `ranges` (lo, hi, block_lo, block_hi, as in
    `RowRanges`), a range of rows `[start, end)` holding every row that sees one
    of its keys (a superset: the kernel masks the rest), and the tiles by the rows they walk, the most first
    (`longest_first`). Over the rows the running maximum of each range's
    end and the minimum of its start over the rows after grow, so the rows that can see keys `[k0, k1]`
    are those whose running end passes k0 and whose later-minimum start is at most k1: one interval."""
    lo_c, hi_c, lo_b, hi_b = ranges[:4]
    num_tiles = -(-num_keys // block_keys)
    first = torch.arange(num_tiles, device=lo_c.device, dtype=torch.long) * block_keys
    last = first + block_keys - 1
    bounds = []
    for lo, hi in ((lo_c, hi_c), (lo_b, hi_b)):
        hi_max = torch.cummax(hi.long(), 0).values
        lo_min = torch.flip(torch.cummin(torch.flip(lo.long(), (0,)), 0).values, (0,))
        start = torch.searchsorted(hi_max, first, right=True)
        end = torch.searchsorted(lo_min, last, right=True)
        bounds.append((start, end))
    (start_c, end_c), (start_b, end_b) = bounds
    empty_c, empty_b = start_c >= end_c, start_b >= end_b
    start = torch.where(empty_c, start_b, torch.where(empty_b, start_c, torch.minimum(start_c, start_b)))
    end = torch.where(empty_c, end_b, torch.where(empty_b, end_c, torch.maximum(end_c, end_b)))
    end = torch.where(empty_c & empty_b, start, end)
    return start.to(torch.int32).contiguous(), end.to(torch.int32).contiguous(), longest_first(end - start)


def triton_refusal(device: torch.device) -> str | None:
    """Why dflash's Triton kernels (these, the AdamW step's) cannot run on `device`, or None: they need Triton,
    and a CUDA device unless Triton's interpreter runs them (`TRITON_INTERPRET=1`)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "needs Triton (`pip install triton`, part of a GPU install: `pip install -e '.[gpu]'`)"
    if device.type != "cuda" and not _interpreted():
        return f"runs on a CUDA device (got {device}), or on the CPU under TRITON_INTERPRET=1 (slow: tests only)"
    return None


def launch_or_warm(kernel, grid, arguments, constants: dict, warm: bool = False):
    """`kernel[grid](*arguments, **constants)`, or with `warm` only the kernel compiled for those arguments and
    kept (Triton's `warmup`, nothing launched; dflash/train/warm_kernels.py), returned. Every dflash kernel
    launches through here, so a warm-up and its launch cannot pass different things."""
    if warm:
        return kernel.warmup(*arguments, grid=grid, **constants)
    kernel[grid](*arguments, **constants)
    return None


def _kernels() -> dict:
    """The Triton kernels, imported on first use."""
    from dflash.model import block_attention_kernels as kernels

    return {"forward": kernels.forward_kernel, "dq": kernels.dq_kernel, "dkdv": kernels.dkdv_kernel}


def _interpreted() -> bool:
    """Triton's interpreter (`TRITON_INTERPRET=1`, the CPU tests) runs the loops as `while` loops."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _shapes(q: torch.Tensor, k: torch.Tensor) -> tuple[int, int, int, int, int]:
    if q.ndim != 4 or k.ndim != 4 or q.shape[0] != 1 or k.shape[0] != 1:
        raise ValueError(f"block_attention: q (1, Hq, rows, D) and k, v (1, Hkv, keys, D), got {tuple(q.shape)} "
                         f"and {tuple(k.shape)}")
    heads, rows, dim = q.shape[1:]
    key_heads, keys = k.shape[1], k.shape[2]
    if heads % key_heads or k.shape[3] != dim or dim & (dim - 1) or dim < 16:
        raise ValueError(f"block_attention: {heads} query heads over {key_heads} key heads of {dim} dims "
                         f"(head dims a power of two >= 16, query heads a multiple of key heads)")
    return heads, key_heads, rows, keys, dim


def _dense_like(x: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor of `x`'s shape: what the kernels write, in the real op and its fake alike
    (`empty_like` keeps a transposed input's strides, so the fake would promise a layout the kernels do
    not write)."""
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _launch(kernel: str, grid, config: KernelConfig, *args, group: int, dim: int, warm: bool = False):
    """Launch `kernel`, or with `warm` only compile it for these arguments (Triton's `warmup`; returns the
    compiled kernel)."""
    options = {} if _interpreted() else {"num_warps": config.warps, "num_stages": config.stages}
    precision = "ieee" if args[0].dtype == torch.float32 else "tf32"  # float32: exact dots, not TF32's
    constants = dict(GROUP=group, D=dim, BM=config.rows, BN=config.keys, WHILE=_interpreted(), P=precision, **options)
    return launch_or_warm(_kernels()[kernel], grid, args, constants, warm)


def _row_order(ranges, order: torch.Tensor | None, rows: int, config: KernelConfig) -> torch.Tensor:
    """`order` (`RowRanges.row_order`) where it is of `config.rows`-row tiles, else the order made now."""
    if order is not None and order.shape[0] == -(-rows // config.rows):
        return order
    return row_tile_order(ranges, config.rows)


def launch_forward(q, k, v, out, lse, ranges, scale: float, config: KernelConfig,
                   order: torch.Tensor | None = None, warm: bool = False):
    """The forward kernel into `out` and `lse` (contiguous q, k, v; `ranges` lo, hi, block_lo, block_hi;
    `order` the row tiles' launch order, `row_tile_order` of `config.rows` rows, made here if not)."""
    heads, key_heads, rows, keys, dim = _shapes(q, k)
    order = _row_order(ranges, order, rows, config)
    return _launch("forward", (order.shape[0] * heads,), config, q, k, v, out, lse, *ranges, order, scale, rows,
                   keys, heads, group=heads // key_heads, dim=dim, warm=warm)


def launch_dq(q, k, v, grad_out, lse, delta, grad_q, ranges, scale: float, config: KernelConfig,
              order: torch.Tensor | None = None, warm: bool = False):
    heads, key_heads, rows, keys, dim = _shapes(q, k)
    order = _row_order(ranges, order, rows, config)
    return _launch("dq", (order.shape[0] * heads,), config, q, k, v, grad_out, lse, delta, grad_q, *ranges, order,
                   scale, rows, keys, heads, group=heads // key_heads, dim=dim, warm=warm)


def launch_dkdv(q, k, v, grad_out, lse, delta, grad_k, grad_v, ranges, tiles, scale: float,
                config: KernelConfig, warm: bool = False):
    """`tiles` (tile_start, tile_end, tile_order) must be `key_tile_rows` of `config.keys`-key tiles."""
    heads, key_heads, rows, keys, dim = _shapes(q, k)
    if tiles[0].shape[0] != -(-keys // config.keys):
        raise ValueError(f"block_attention: {tiles[0].shape[0]} key tiles' rows for {keys} keys in tiles of "
                         f"{config.keys}: make them with key_tile_rows(..., block_keys={config.keys})")
    return _launch("dkdv", (tiles[0].shape[0] * key_heads,), config, q, k, v, grad_out, lse, delta, grad_k, grad_v,
                   *ranges, *tiles, scale, rows, keys, key_heads, group=heads // key_heads, dim=dim, warm=warm)


# What `warm_kernels` compiles for: stage two pads a micro-batch's token and anchor axes to 128
# (`padding.micro_batch_multiple`), so its rows (anchors x block) and keys (tokens + rows) are multiples of 16,
# the class Triton specializes such an integer by.
WARM_ROWS, WARM_TOKENS = 128 * 16, 128


def warm_kernels(heads: int, key_heads: int, dim: int, dtype: torch.dtype, device: torch.device) -> list:
    """The forward, dQ and dK/dV kernels compiled for `heads` query heads over `key_heads` of `dim` dims in
    `dtype` (Triton's `warmup`: compiled and kept, nothing launched), through the launches the op makes, so
    the op's first launch finds them; the compiled kernels. The tensors are stand-ins (one element, expanded:
    the kernels read only their dtype and their alignment before a launch)."""
    rows, keys = WARM_ROWS, WARM_TOKENS + WARM_ROWS
    configs = kernel_configs(dim)

    def stand_in(*shape, kind=dtype):
        return torch.empty((), dtype=kind, device=device).expand(*shape)

    q, grad_out, out, grad_q = (stand_in(1, heads, rows, dim) for _ in range(4))
    k, v, grad_k, grad_v = (stand_in(1, key_heads, keys, dim) for _ in range(4))
    lse, delta = (stand_in(1, heads, rows, kind=torch.float32) for _ in range(2))
    ranges = [stand_in(rows, kind=torch.int32) for _ in range(4)]
    scale = dim ** -0.5

    def row_order(config):
        return stand_in(-(-rows // config.rows), kind=torch.int32)

    tiles = [stand_in(-(-keys // configs["dkdv"].keys), kind=torch.int32) for _ in range(3)]
    return [launch_forward(q, k, v, out, lse, ranges, scale, configs["forward"], row_order(configs["forward"]),
                           warm=True),
            launch_dq(q, k, v, grad_out, lse, delta, grad_q, ranges, scale, configs["dq"], row_order(configs["dq"]),
                      warm=True),
            launch_dkdv(q, k, v, grad_out, lse, delta, grad_k, grad_v, ranges, tiles, scale, configs["dkdv"],
                        warm=True)]


@torch.library.custom_op("dflash::block_attention_forward", mutates_args=())
def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
             block_lo: torch.Tensor, block_hi: torch.Tensor, tile_start: torch.Tensor, tile_end: torch.Tensor,
             tile_order: torch.Tensor, row_order: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    heads, key_heads, rows, keys, dim = _shapes(q, k)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = _dense_like(q)
    lse = torch.empty((1, heads, rows), dtype=torch.float32, device=q.device)
    launch_forward(q, k, v, out, lse, (lo, hi, block_lo, block_hi), scale, kernel_configs(dim)["forward"], row_order)
    return out, lse


@_forward.register_fake
def _(q, k, v, lo, hi, block_lo, block_hi, tile_start, tile_end, tile_order, row_order, scale):
    return _dense_like(q), q.new_empty((1, q.shape[1], q.shape[2]), dtype=torch.float32)


@torch.library.custom_op("dflash::block_attention_backward", mutates_args=())
def _backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, block_lo: torch.Tensor, block_hi: torch.Tensor,
              tile_start: torch.Tensor, tile_end: torch.Tensor, tile_order: torch.Tensor, row_order: torch.Tensor,
              scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    heads, key_heads, rows, keys, dim = _shapes(q, k)
    q, k, v, grad_out = q.contiguous(), k.contiguous(), v.contiguous(), grad_out.to(q.dtype).contiguous()
    delta = (grad_out.float() * out.float()).sum(-1).contiguous()
    grad_q, grad_k, grad_v = _dense_like(q), _dense_like(k), _dense_like(v)
    ranges = (lo, hi, block_lo, block_hi)
    configs = kernel_configs(dim)
    launch_dq(q, k, v, grad_out, lse, delta, grad_q, ranges, scale, configs["dq"], row_order)
    launch_dkdv(q, k, v, grad_out, lse, delta, grad_k, grad_v, ranges, (tile_start, tile_end, tile_order), scale,
                configs["dkdv"])
    return grad_q, grad_k, grad_v


@_backward.register_fake
def _(grad_out, q, k, v, out, lse, lo, hi, block_lo, block_hi, tile_start, tile_end, tile_order, row_order, scale):
    return _dense_like(q), _dense_like(k), _dense_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, *ranges, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, *ranges)
    ctx.scale = scale


def _backward_rule(ctx, grad_out, grad_lse):
    q, k, v, out, lse, *ranges = ctx.saved_tensors
    grad_q, grad_k, grad_v = _backward(grad_out, q, k, v, out, lse, *ranges, ctx.scale)
    return grad_q, grad_k, grad_v, *(None,) * (len(ranges) + 1)


_forward.register_autograd(_backward_rule, setup_context=_setup_context)


def block_attention(q_1NQD: torch.Tensor, k_1MKD: torch.Tensor, v_1MKD: torch.Tensor,
                    ranges: RowRanges) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v over each row's two key ranges; grouped key heads (N a multiple of M)."""
    # one dtype for the kernels' dots: the values' (q and k may come out of their RMSNorm in float32)
    q_1NQD, k_1MKD = q_1NQD.to(v_1MKD.dtype), k_1MKD.to(v_1MKD.dtype)
    out, _ = _forward(q_1NQD, k_1MKD, v_1MKD, *ranges, q_1NQD.shape[-1] ** -0.5)
    return out
