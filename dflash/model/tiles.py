"""The tiles of a packed stage-two micro-batch's block masks, laid out on the host.

Flex attention skips every 128 x 128 (query, key) tile that its `BlockMask` does not list and evaluates
the `mask_mod` only inside partial tiles. Which tiles those are follows from each query row's visible
keys, two index ranges (dflash/model/masks.py states the rule): its sequence's context before the
anchor, inside the sliding window, and its own block. `tile_layout` computes them with a few numpy
passes over the rows (the collate does, in the loader's workers); `create_block_mask` found the same
tiles by evaluating the rule on all Q x (T + Q) pairs, a compiled GPU kernel per layer type and
micro-batch. `gather_context_keys` then gives each query tile its own copy of the context tiles it
reads, so that no key tile is read by more than one query tile (flex's backward runs one program per
key tile over the query tiles that read it: shared, a sequence's first context tiles are read by
dozens).

Shapes: T context tokens, A anchors, B block size, Q = A * B rows, QT = Q / TILE query tiles,
KT key tiles, K' keys after gathering.
"""

import numpy as np

PADDING_DOC = -1  # doc id of padded context tokens and padded anchors
TILE = 128  # rows and keys per BlockMask tile (flex attention's default block size)


def tiles_key(layer_type: str) -> str:
    """The micro-batch key of a layer type's `tile_layout` (the collate writes it)."""
    return f"tiles_{layer_type}"


def keys_key(layer_type: str) -> str:
    """The micro-batch key of a layer type's gathered keys (`gather_context_keys`), when gathered."""
    return f"keys_{layer_type}"


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
        order = np.argsort(~tiles, axis=1, kind="stable")  # listed tiles first, ascending
        layout[kind, :, 1:] = np.where(np.take_along_axis(tiles, order, axis=1), order, 0)
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


def gather_context_keys(layout: np.ndarray, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Each query tile its own copy of the context tiles it reads: the layout over the new keys
    `[copies (T') ; block keys (Q)]` and `keys (2, T' + Q)` int64: `[0]` the key each new key copies,
    `[1]` the query tile that owns a copy (-1 for block keys, which are never copied). The attention is
    the same as over the original keys if a query sees only its own tile's copies (`masks.gathered_mask_mod`)."""
    context_tiles = num_tokens // TILE
    num_query_tiles = layout.shape[1]
    num_rows = num_query_tiles * TILE
    read = []  # per query tile: the context tiles it reads, ascending
    for tile in range(num_query_tiles):
        listed = np.concatenate([layout[kind, tile, 1:1 + layout[kind, tile, 0]] for kind in (0, 1)])
        read.append(np.unique(listed[listed < context_tiles]))
    counts = np.array([len(tiles) for tiles in read], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]])
    copied = int(counts.sum())
    source_tiles = np.concatenate(read) if copied else np.zeros(0, dtype=np.int64)
    source = np.concatenate([(source_tiles[:, None] * TILE + np.arange(TILE)).reshape(-1),
                             num_tokens + np.arange(num_rows)])
    owner = np.concatenate([np.repeat(np.arange(num_query_tiles), counts * TILE), np.full(num_rows, -1)])
    shift = copied - context_tiles  # block tiles move by this many tiles
    gathered = np.zeros((2, num_query_tiles, copied + num_rows // TILE + 1), dtype=np.int32)
    for kind in (0, 1):
        for tile in range(num_query_tiles):
            listed = layout[kind, tile, 1:1 + layout[kind, tile, 0]].astype(np.int64)
            context = listed < context_tiles
            moved = np.where(context, offsets[tile] + np.searchsorted(read[tile], listed), listed + shift)
            gathered[kind, tile, 0] = len(moved)
            gathered[kind, tile, 1:1 + len(moved)] = moved
    return gathered, np.stack([source, owner])
