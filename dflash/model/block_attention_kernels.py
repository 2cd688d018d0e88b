"""The Triton kernels of dflash/model/block_attention.py (a module of their own: Triton is a GPU install's
package, and a kernel's helpers must be module globals for Triton to find them).

Each query row sees the keys of its two ranges, context `[lo, hi)` and block `[block_lo, block_hi)`. A row
tile walks the key tiles of the union of its rows' context ranges, then of its block ranges; a key tile (the
gradients of keys and values) walks the row tiles that can see it. Each grid is one axis, heads fastest, its
tiles in the order the launch gives (`ORDER`: the longest first). Invisible scores are -1e30, finite, so a
row with no visible key yet never makes a NaN. Loops over a runtime range are `for` loops on a GPU and
`while` loops under Triton's interpreter (`WHILE`), whose `range` takes no tensor bounds; the loop bodies
(`*_step`) are the same code either way. `P` is the dots' input precision: "ieee" for float32 inputs (exact,
as the dense reference), "tf32" otherwise (bf16 and fp16 dots ignore it).
"""

import triton
import triton.language as tl


@triton.jit
def sees(cols, lo, hi, block_lo, block_hi):
    c = cols[None, :]
    return ((c >= lo[:, None]) & (c < hi[:, None])) | ((c >= block_lo[:, None]) & (c < block_hi[:, None]))


@triton.jit
def row_tile(ORDER, num_rows, num_heads, GROUP: tl.constexpr, BM: tl.constexpr):
    """This program's query head, its key head, and its tile of rows. The grid is one axis, heads fastest, row
    tiles in `ORDER` (the most key tiles first, so the longest programs start first and the last wave is of
    short ones); heads in int64, so offsets past 2**31 elements (heads x rows x head dim) do not wrap."""
    program = tl.program_id(0)
    head = (program % num_heads).to(tl.int64)
    rows = tl.load(ORDER + program // num_heads) * BM + tl.arange(0, BM)
    return head, head // GROUP, rows, rows < num_rows


@triton.jit
def load_ranges(rows, row_ok, LO, HI, BLO, BHI):
    """The two key ranges of `rows`."""
    lo = tl.load(LO + rows, mask=row_ok, other=0)
    hi = tl.load(HI + rows, mask=row_ok, other=0)
    block_lo = tl.load(BLO + rows, mask=row_ok, other=0)
    block_hi = tl.load(BHI + rows, mask=row_ok, other=0)
    return lo, hi, block_lo, block_hi


@triton.jit
def load_backward_rows(rows, row_ok, head, Q, DO, LSE, DELTA, num_rows, D: tl.constexpr):
    """What the backward reads of `rows` of one query head: q, the output's gradient, the logsumexp, delta."""
    dims = tl.arange(0, D)
    offsets = head * num_rows * D + rows[:, None] * D + dims[None, :]
    q = tl.load(Q + offsets, mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + offsets, mask=row_ok[:, None], other=0.0)
    lse = tl.load(LSE + head * num_rows + rows, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + head * num_rows + rows, mask=row_ok, other=0.0)
    return q, do, lse, delta


@triton.jit
def span(lo, hi, num_keys, BN: tl.constexpr):
    """The key tiles a row tile reads for one of its ranges: `[first, end)`, `first` on a tile's edge."""
    nonempty = lo < hi
    first = tl.min(tl.where(nonempty, lo, num_keys), 0)
    end = tl.max(tl.where(nonempty, hi, 0), 0)
    return (first // BN) * BN, end


@triton.jit
def forward_step(n, q, k_base, v_base, lo, hi, block_lo, block_hi, m_i, l_i, acc, num_keys, scale,
                 D: tl.constexpr, BN: tl.constexpr, P: tl.constexpr):
    """One key tile into a row tile's online softmax."""
    dims = tl.arange(0, D)
    cols = n + tl.arange(0, BN)
    col_ok = cols < num_keys
    k_DN = tl.load(k_base + cols[None, :] * D + dims[:, None], mask=col_ok[None, :], other=0.0)
    s = tl.dot(q, k_DN, input_precision=P) * scale
    visible = sees(cols, lo, hi, block_lo, block_hi)
    s = tl.where(visible, s, -1e30)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.where(visible, tl.exp(s - m_new[:, None]), 0.0)
    alpha = tl.exp(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v_ND = tl.load(v_base + cols[:, None] * D + dims[None, :], mask=col_ok[:, None], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v_ND.dtype), v_ND, input_precision=P)
    return m_new, l_i, acc


@triton.jit
def forward_range(first, end, q, k_base, v_base, lo, hi, block_lo, block_hi, m_i, l_i, acc, num_keys, scale,
                  D: tl.constexpr, BN: tl.constexpr, WHILE: tl.constexpr, P: tl.constexpr):
    if WHILE:
        n = first
        while n < end:
            m_i, l_i, acc = forward_step(n, q, k_base, v_base, lo, hi, block_lo, block_hi, m_i, l_i, acc,
                                         num_keys, scale, D, BN, P)
            n += BN
    else:
        for n in range(first, end, BN):
            m_i, l_i, acc = forward_step(n, q, k_base, v_base, lo, hi, block_lo, block_hi, m_i, l_i, acc,
                                         num_keys, scale, D, BN, P)
    return m_i, l_i, acc


@triton.jit
def forward_kernel(Q, K, V, O, LSE, LO, HI, BLO, BHI, ORDER, scale, num_rows, num_keys, num_heads,
                   GROUP: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, WHILE: tl.constexpr,
                   P: tl.constexpr):
    head, key_head, rows, row_ok = row_tile(ORDER, num_rows, num_heads, GROUP, BM)
    dims = tl.arange(0, D)
    q = tl.load(Q + head * num_rows * D + rows[:, None] * D + dims[None, :], mask=row_ok[:, None], other=0.0)
    lo, hi, block_lo, block_hi = load_ranges(rows, row_ok, LO, HI, BLO, BHI)
    k_base = K + key_head * num_keys * D
    v_base = V + key_head * num_keys * D
    m_i = tl.full([BM], -1e30, tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    first, end = span(lo, hi, num_keys, BN)
    m_i, l_i, acc = forward_range(first, end, q, k_base, v_base, lo, hi, block_lo, block_hi, m_i, l_i, acc,
                                  num_keys, scale, D, BN, WHILE, P)
    first, end = span(block_lo, block_hi, num_keys, BN)
    m_i, l_i, acc = forward_range(first, end, q, k_base, v_base, lo, hi, block_lo, block_hi, m_i, l_i, acc,
                                  num_keys, scale, D, BN, WHILE, P)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    tl.store(O + head * num_rows * D + rows[:, None] * D + dims[None, :], out.to(O.dtype.element_ty),
             mask=row_ok[:, None])
    tl.store(LSE + head * num_rows + rows, m_i + tl.log(l_safe), mask=row_ok)


@triton.jit
def dq_step(n, q, do, lse, delta, k_base, v_base, lo, hi, block_lo, block_hi, dq, num_keys, scale,
            D: tl.constexpr, BN: tl.constexpr, P: tl.constexpr):
    dims = tl.arange(0, D)
    cols = n + tl.arange(0, BN)
    col_ok = cols < num_keys
    k_ND = tl.load(k_base + cols[:, None] * D + dims[None, :], mask=col_ok[:, None], other=0.0)
    v_ND = tl.load(v_base + cols[:, None] * D + dims[None, :], mask=col_ok[:, None], other=0.0)
    s = tl.dot(q, tl.trans(k_ND), input_precision=P) * scale
    visible = sees(cols, lo, hi, block_lo, block_hi)
    p = tl.where(visible, tl.exp(s - lse[:, None]), 0.0)
    dp = tl.dot(do, tl.trans(v_ND), input_precision=P)
    ds = p * (dp - delta[:, None])
    return dq + tl.dot(ds.to(k_ND.dtype), k_ND, input_precision=P)


@triton.jit
def dq_range(first, end, q, do, lse, delta, k_base, v_base, lo, hi, block_lo, block_hi, dq, num_keys, scale,
             D: tl.constexpr, BN: tl.constexpr, WHILE: tl.constexpr, P: tl.constexpr):
    if WHILE:
        n = first
        while n < end:
            dq = dq_step(n, q, do, lse, delta, k_base, v_base, lo, hi, block_lo, block_hi, dq, num_keys, scale, D, BN, P)
            n += BN
    else:
        for n in range(first, end, BN):
            dq = dq_step(n, q, do, lse, delta, k_base, v_base, lo, hi, block_lo, block_hi, dq, num_keys, scale, D, BN, P)
    return dq


@triton.jit
def dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, LO, HI, BLO, BHI, ORDER, scale, num_rows, num_keys, num_heads,
              GROUP: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, WHILE: tl.constexpr,
              P: tl.constexpr):
    head, key_head, rows, row_ok = row_tile(ORDER, num_rows, num_heads, GROUP, BM)
    dims = tl.arange(0, D)
    offsets = head * num_rows * D + rows[:, None] * D + dims[None, :]
    q, do, lse, delta = load_backward_rows(rows, row_ok, head, Q, DO, LSE, DELTA, num_rows, D)
    lo, hi, block_lo, block_hi = load_ranges(rows, row_ok, LO, HI, BLO, BHI)
    k_base = K + key_head * num_keys * D
    v_base = V + key_head * num_keys * D
    dq = tl.zeros([BM, D], tl.float32)
    first, end = span(lo, hi, num_keys, BN)
    dq = dq_range(first, end, q, do, lse, delta, k_base, v_base, lo, hi, block_lo, block_hi, dq, num_keys, scale,
                  D, BN, WHILE, P)
    first, end = span(block_lo, block_hi, num_keys, BN)
    dq = dq_range(first, end, q, do, lse, delta, k_base, v_base, lo, hi, block_lo, block_hi, dq, num_keys, scale,
                  D, BN, WHILE, P)
    tl.store(DQ + offsets, (dq * scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def dkdv_step(m, head, cols, k_ND, v_ND, dk, dv, Q, DO, LSE, DELTA, LO, HI, BLO, BHI, num_rows, scale,
              D: tl.constexpr, BM: tl.constexpr, P: tl.constexpr):
    """One row tile of one query head into a key tile's key and value gradients."""
    rows = m + tl.arange(0, BM)
    row_ok = rows < num_rows
    q, do, lse, delta = load_backward_rows(rows, row_ok, head, Q, DO, LSE, DELTA, num_rows, D)
    lo, hi, block_lo, block_hi = load_ranges(rows, row_ok, LO, HI, BLO, BHI)
    s = tl.dot(q, tl.trans(k_ND), input_precision=P) * scale
    visible = sees(cols, lo, hi, block_lo, block_hi) & row_ok[:, None]
    p = tl.where(visible, tl.exp(s - lse[:, None]), 0.0)
    dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=P)
    dp = tl.dot(do, tl.trans(v_ND), input_precision=P)
    ds = p * (dp - delta[:, None])
    dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=P)
    return dk, dv


@triton.jit
def dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, LO, HI, BLO, BHI, ROW_START, ROW_END, ORDER, scale, num_rows,
                num_keys, num_key_heads, GROUP: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                WHILE: tl.constexpr, P: tl.constexpr):
    """One key tile of one key head (grid: one axis, key heads fastest, key tiles in `ORDER`: the most rows
    first) over the row tiles of its query heads that can see it."""
    program = tl.program_id(0)
    tile, key_head = tl.load(ORDER + program // num_key_heads), (program % num_key_heads).to(tl.int64)
    cols = tile * BN + tl.arange(0, BN)
    dims = tl.arange(0, D)
    col_ok = cols < num_keys
    key_offsets = key_head * num_keys * D + cols[:, None] * D + dims[None, :]
    k_ND = tl.load(K + key_offsets, mask=col_ok[:, None], other=0.0)
    v_ND = tl.load(V + key_offsets, mask=col_ok[:, None], other=0.0)
    dk = tl.zeros([BN, D], tl.float32)
    dv = tl.zeros([BN, D], tl.float32)
    row_start = (tl.load(ROW_START + tile) // BM) * BM
    row_end = tl.load(ROW_END + tile)
    # A runtime loop over the query heads, not one unrolled per head: the same inner loop, a third to a quarter
    # of the compile (0.4 s against 1.0-1.6 at 64 dims, 0.5 against 1.8-2.1 at 128; tools/kernel_report.py)
    for g in range(GROUP):
        head = key_head * GROUP + g
        if WHILE:
            m = row_start
            while m < row_end:
                dk, dv = dkdv_step(m, head, cols, k_ND, v_ND, dk, dv, Q, DO, LSE, DELTA, LO, HI, BLO, BHI, num_rows,
                                   scale, D, BM, P)
                m += BM
        else:
            for m in range(row_start, row_end, BM):
                dk, dv = dkdv_step(m, head, cols, k_ND, v_ND, dk, dv, Q, DO, LSE, DELTA, LO, HI, BLO, BHI, num_rows,
                                   scale, D, BM, P)
    tl.store(DK + key_offsets, (dk * scale).to(DK.dtype.element_ty), mask=col_ok[:, None])
    tl.store(DV + key_offsets, dv.to(DV.dtype.element_ty), mask=col_ok[:, None])
