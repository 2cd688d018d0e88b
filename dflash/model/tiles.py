"""The tiles of a packed stage-two micro-batch's block masks, laid out on the host.

Flex attention skips every (query, key) tile that its `BlockMask` does not list and evaluates the
`mask_mod` only inside partial tiles; the tiles are 128 x 128 (`masks.mask_tile`), 64 x 64 under the small
heads' kernel tiles (a 64-row query tile holds 4 anchors' blocks instead of 8 and so lists fewer keys no row
of it sees; `bench_stage2 --mask-tile` sets either). Which tiles those are
follows from each query row's visible keys, two index ranges (dflash/model/masks.py states the rule):
its sequence's context before the anchor, inside the sliding window, and its own block. `tile_layout`
computes them with a few numpy passes over the anchors (the collate does, in the loader's workers), and
`transpose_layout` lists them per key tile for flex's backward; `create_block_mask` found the same
tiles by evaluating the rule on all Q x (T + Q) pairs, a compiled GPU kernel per layer type and
micro-batch. `gather_context_keys` then gives each query tile its own copy of the context tiles it
reads, so that no key tile is read by more than one query tile (flex's backward runs one program per
key tile over the query tiles that read it: shared, a sequence's first context tiles are read by
dozens).

Shapes: T context tokens, A anchors, B block size, Q = A * B rows, QT = Q / tile query tiles,
KT key tiles, K' keys after gathering.
"""

import numpy as np

PADDING_DOC = -1  # doc id of padded context tokens and padded anchors
TILE = 128  # rows and keys per BlockMask tile by default (flex attention's default block size)


def tiles_key(layer_type: str) -> str:
    """The micro-batch key of a layer type's `tile_layout` (the collate writes it)."""
    return f"tiles_{layer_type}"


def transposed_key(layer_type: str) -> str:
    """The micro-batch key of a layer type's tiles listed per key tile (`transpose_layout`)."""
    return f"tiles_q_{layer_type}"


def keys_key(layer_type: str) -> str:
    """The micro-batch key of a layer type's gathered keys (`gather_context_keys`), when gathered."""
    return f"keys_{layer_type}"


def tile_layout(doc_T: np.ndarray, pos_T: np.ndarray, anchor_doc_A: np.ndarray, anchor_pos_A: np.ndarray,
                block_size: int, window: int | None, tile: int = TILE) -> np.ndarray | None:
    """The `BlockMask` tiles (`tile` x `tile`) of one layer type, from the rule above, as int32
    `(2, QT, 1 + W)`: `[0]` partial tiles (a visible pair and an invisible one), `[1]` full tiles (only
    visible pairs); per query tile the count, then the key-tile indices in ascending order (the rest 0).
    W is the longest list (at least 1), not the KT key tiles: `masks.block_mask_from_layout` pads the
    lists to KT on the device, so the loader's workers pass a few columns instead of KT.

    Needs what the collate lays out: T and A * B multiples of `tile`, each sequence's real tokens
    contiguous at positions 0, 1, ... Returns None for any other layout (`build_masks` then
    evaluates the `mask_mod` everywhere, as `create_block_mask` does).
    """
    doc_T, pos_T = np.asarray(doc_T, dtype=np.int64), np.asarray(pos_T, dtype=np.int64)
    anchor_doc_A, anchor_pos_A = np.asarray(anchor_doc_A, dtype=np.int64), np.asarray(anchor_pos_A, dtype=np.int64)
    num_tokens, num_anchors = len(doc_T), len(anchor_doc_A)
    num_rows = num_anchors * block_size
    if num_tokens % tile or num_rows % tile or not num_tokens or not num_anchors:
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
    # Row r (anchor a, slot s) sees context [start + max(0, p + s - W + 1), start + p - 1] of its
    # sequence and block keys [T + a*B, T + a*B + (s if sliding else B - 1)]. The rows of a unit (an
    # anchor's block when B divides the tile, else one row) share those ranges' ends, and the starts grow
    # with the slot: the union of the unit's ranges runs from its lowest slot's start, their intersection
    # from its highest slot's (sliding layers; the ranges do not depend on the slot in full layers).
    unit = block_size if tile % block_size == 0 else 1
    slots = np.arange(block_size).reshape(-1, unit)
    anchor_U = np.repeat(np.arange(num_anchors), len(slots))
    low_U, high_U = np.tile(slots[:, 0], num_anchors), np.tile(slots[:, -1], num_anchors)
    pos_U, start_U, real_U = anchor_pos_A[anchor_U], doc_start_A[anchor_U], real[anchor_U]
    if window is None:
        first_low = first_high = np.zeros_like(pos_U)
    else:
        first_low, first_high = (np.maximum(0, pos_U + slot - window + 1) for slot in (low_U, high_U))
    context_hi = np.where(real_U, start_U + pos_U - 1, start_U + first_low - 1)  # padded anchors: no context
    block_lo = num_tokens + anchor_U * block_size
    reach_low, reach_high = (low_U, high_U) if window is not None else (block_size - 1, block_size - 1)
    ranges = [  # per unit: the union's (lo, hi) and the intersection's
        ((start_U + first_low, context_hi), (start_U + first_high, context_hi)),
        ((block_lo, block_lo + reach_high), (block_lo, block_lo + reach_low)),
    ]
    num_query_tiles, num_key_tiles = num_rows // tile, (num_tokens + num_rows) // tile
    tile_U = (anchor_U * block_size + low_U) // tile  # each unit's query tile
    touched, covered = [], []  # (query tile, key tile) cells: some row sees a key / a unit sees every key
    for (union_lo, union_hi), (both_lo, both_hi) in ranges:
        some = union_lo <= union_hi
        touched.append(_tile_cells(tile_U[some], union_lo[some] // tile, union_hi[some] // tile, num_key_tiles))
        some = both_lo <= both_hi
        first_full, last_full = -(-both_lo[some] // tile), (both_hi[some] + 1) // tile - 1
        covered.append(_tile_cells(tile_U[some], first_full, last_full, num_key_tiles))
    touched = np.unique(np.concatenate(touched))
    cells, count = np.unique(np.concatenate(covered), return_counts=True)
    full = cells[count == tile // unit]  # every unit, so every row, of the query tile sees the whole key tile
    partial = np.setdiff1d(touched, full, assume_unique=True)
    # sorted cells: row by row, columns ascending
    return _row_lists([divmod(cells, num_key_tiles) for cells in (partial, full)], num_query_tiles)


def transpose_layout(layout: np.ndarray, num_key_tiles: int) -> np.ndarray:
    """A `tile_layout`'s tiles listed per key tile, as flex attention's backward reads them: int32
    `(2, KT, 1 + W)`, per key tile the count, then the query tiles that list it in ascending order (the
    rest 0). `BlockMask.from_kv_blocks` computes the same lists on the device, a dense (KT, QT) matrix and
    an argsort per kind and layer type every micro-batch; here the loader's workers do."""
    kinds = []
    for kind in (0, 1):
        counts = layout[kind, :, 0].astype(np.int64)
        rows = np.repeat(np.arange(len(counts)), counts)
        columns = layout[kind, rows, 1 + np.arange(len(rows)) - np.repeat(np.cumsum(counts) - counts, counts)]
        order = np.lexsort((rows, columns))  # by key tile, then query tile
        kinds.append((columns[order].astype(np.int64), rows[order]))
    return _row_lists(kinds, num_key_tiles)


def _row_lists(kinds: list[tuple[np.ndarray, np.ndarray]], num_rows: int) -> np.ndarray:
    """Per kind (partial, full) the `(row, column)` pairs, grouped by row with columns ascending, as the
    int32 `(2, num_rows, 1 + W)` lists of a layout: per row the count, then its columns (the rest 0); W is
    the longest list, at least 1."""
    counts = [np.bincount(rows, minlength=num_rows) for rows, _ in kinds]
    lists = np.zeros((2, num_rows, 1 + max(1, max(int(count.max(initial=0)) for count in counts))), dtype=np.int32)
    for kind, ((rows, columns), count) in enumerate(zip(kinds, counts)):
        first = np.cumsum(count) - count
        lists[kind, :, 0] = count
        lists[kind, rows, 1 + np.arange(len(rows)) - first[rows]] = columns
    return lists


def _tile_cells(query_tile: np.ndarray, first: np.ndarray, last: np.ndarray, num_key_tiles: int) -> np.ndarray:
    """The (query tile, key tile) cells `query_tile * num_key_tiles + k` for k in [first, last] of each
    entry (none where last < first), as one flat int64 array."""
    lengths = np.maximum(last - first + 1, 0)
    owner = np.repeat(np.arange(len(lengths)), lengths)
    offset = np.arange(len(owner)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return query_tile[owner] * num_key_tiles + first[owner] + offset


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


def gather_context_keys(layout: np.ndarray, num_tokens: int, tile: int = TILE) -> tuple[np.ndarray, np.ndarray]:
    """Each query tile its own copy of the context tiles it reads: the layout over the new keys
    `[copies (T') ; block keys (Q)]` and `keys (2, T' + Q)` int64: `[0]` the key each new key copies,
    `[1]` the query tile that owns a copy (-1 for block keys, which are never copied). The attention is
    the same as over the original keys if a query sees only its own tile's copies (`masks.gathered_mask_mod`)."""
    context_tiles = num_tokens // tile
    num_query_tiles = layout.shape[1]
    num_rows = num_query_tiles * tile
    read = []  # per query tile: the context tiles it reads, ascending
    for row in range(num_query_tiles):
        listed = np.concatenate([layout[kind, row, 1:1 + layout[kind, row, 0]] for kind in (0, 1)])
        read.append(np.unique(listed[listed < context_tiles]))
    counts = np.array([len(tiles) for tiles in read], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]])
    copied = int(counts.sum())
    source_tiles = np.concatenate(read) if copied else np.zeros(0, dtype=np.int64)
    source = np.concatenate([(source_tiles[:, None] * tile + np.arange(tile)).reshape(-1),
                             num_tokens + np.arange(num_rows)])
    owner = np.concatenate([np.repeat(np.arange(num_query_tiles), counts * tile), np.full(num_rows, -1)])
    shift = copied - context_tiles  # block tiles move by this many tiles
    gathered = np.zeros_like(layout)  # the same lists, renumbered
    for kind in (0, 1):
        for row in range(num_query_tiles):
            listed = layout[kind, row, 1:1 + layout[kind, row, 0]].astype(np.int64)
            context = listed < context_tiles
            moved = np.where(context, offsets[row] + np.searchsorted(read[row], listed), listed + shift)
            gathered[kind, row, 0] = len(moved)
            gathered[kind, row, 1:1 + len(moved)] = moved
    return gathered, np.stack([source, owner])
