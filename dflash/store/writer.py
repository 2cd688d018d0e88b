"""Writing the store: creating it (or continuing one of the same content), the frozen weights,
and `ShardWriter`, which fills one planned shard in zarr-shard-aligned row ranges and marks it
complete last. The format is dflash/store/schema.py's.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import zarr
from zarr.codecs import BytesCodec

from dflash.padding import round_up
from dflash.store.plan import ShardPlan
from dflash.store.schema import (ATTRS_KEY, COMPLETE_KEY, DEFAULT_BF16_COMPRESSION, FROZEN_WEIGHT_NAMES, HIDDEN_DTYPES,
                                 StoreMismatchError, bf16_to_bits, count_nonfinite, diff_attrs, hidden_compressors,
                                 is_complete, json_normalized, plain_compressors, row_array_names)

# Row arrays are never all fill value: skip zarr's per-chunk emptiness test.
WRITE_EVERY_CHUNK = {"write_empty_chunks": True}
WEIGHT_CHUNK_BYTES = 4 << 20
WEIGHT_CHUNKS_PER_SHARD = 16


def create_or_open_store(path: Any, root_attrs: dict, overwrite: bool) -> zarr.Group:
    """Open the store at `path` for writing, creating it with `root_attrs` if it is new.

    An existing store must hold the same content (CONTENT_KEYS) or this raises
    StoreMismatchError naming every differing key; with `overwrite=True` such a store is
    deleted and started afresh. A store with the same content is always continued.
    """
    root = zarr.open_group(path, mode="a")
    existing = root.attrs.get(ATTRS_KEY)
    if existing is None and any(True for _ in root.keys()) and not overwrite:
        raise StoreMismatchError(
            f"{path} holds zarr data but no '{ATTRS_KEY}' attributes: not a dflash store; "
            "pass overwrite (--overwrite) to replace it"
        )
    differences = diff_attrs(existing, root_attrs) if existing is not None else {}
    if differences and not overwrite:
        lines = [f"  {key}: store has {old!r}, config gives {new!r}" for key, (old, new) in differences.items()]
        raise StoreMismatchError(
            f"store {path} was written for different content; differing keys:\n"
            + "\n".join(lines)
            + "\npass overwrite (CLI flag --overwrite) to delete and replace the store"
        )
    if existing is None or differences:
        root = zarr.open_group(path, mode="w")  # new, or replaced (overwrite)
        root.attrs[ATTRS_KEY] = json_normalized(root_attrs)
    shards_group(root)
    return root


def shards_group(root: zarr.Group) -> zarr.Group:
    """The store's `shards` group, made if missing. Writer processes open their shards at the
    same time: when another made the group between our look and our create, open theirs."""
    try:
        return root.require_group("shards")
    except zarr.errors.ContainsGroupError:
        return root["shards"]


def write_frozen_weights(group: zarr.Group, embed_VH: torch.Tensor, lm_head_VH: torch.Tensor) -> None:
    """Store the target's input embedding and LM head as bf16 bits; skip arrays already complete."""
    for name, weight_VH in zip(FROZEN_WEIGHT_NAMES, (embed_VH, lm_head_VH)):
        if weight_VH.dim() != 2:
            raise ValueError(f"{name} must be (vocab, hidden), got shape {tuple(weight_VH.shape)}")
        shape = tuple(weight_VH.shape)
        if name in group and group[name].attrs.get(COMPLETE_KEY) and tuple(group[name].shape) == shape:
            continue
        bits_VH = bf16_to_bits(weight_VH)
        rows_per_chunk = max(1, min(shape[0], WEIGHT_CHUNK_BYTES // (2 * shape[1])))
        rows_per_shard = rows_per_chunk * WEIGHT_CHUNKS_PER_SHARD
        array = group.create_array(
            name, shape=shape, dtype="uint16", chunks=(rows_per_chunk, shape[1]),
            shards=(rows_per_shard, shape[1]), serializer=BytesCodec(),
            compressors=plain_compressors(), overwrite=True,
        )
        for start in range(0, shape[0], rows_per_shard):
            array[start:start + rows_per_shard] = bits_VH[start:start + rows_per_shard]
        array.attrs[COMPLETE_KEY] = True


class ShardWriter:
    """Writes one planned shard: samples arrive in plan order, `commit()` marks it complete.

    `lengths` and `row_ids` (and `source_ids`, a store of several sources: each sample's source
    number) are indexed like the kept-sample list the plan refers to.
    Rows are buffered and written in whole zarr-shard row ranges so no zarr shard is read,
    modified and rewritten; the tail is written by `commit()`.
    """

    def __init__(
        self, group: zarr.Group, plan: ShardPlan, lengths: np.ndarray, row_ids: np.ndarray,
        codec: str, num_layers: int, hidden_size: int, rows_per_chunk: int,
        rows_per_zarr_shard: int, bf16_compression: str = DEFAULT_BF16_COMPRESSION, labels: bool = False,
        topk: int = 0,
        source_ids: np.ndarray | None = None,
    ):
        if codec not in HIDDEN_DTYPES:
            raise ValueError(f"shard {plan.name}: unknown codec {codec!r}")
        if rows_per_chunk <= 0 or rows_per_zarr_shard % rows_per_chunk:
            raise ValueError(
                f"rows_per_zarr_shard ({rows_per_zarr_shard}) must be a positive multiple of "
                f"rows_per_chunk ({rows_per_chunk})"
            )
        self.plan, self.codec, self.with_labels, self.topk = plan, codec, labels, topk
        self.num_layers, self.hidden_size = num_layers, hidden_size
        indices = list(plan.sample_indices)
        self.sample_lengths = np.asarray(lengths, dtype=np.int64)[indices]
        self.sample_row_ids = np.asarray(row_ids, dtype=np.int64)[indices]
        self.sample_source_ids = None if source_ids is None else np.asarray(source_ids, dtype=np.int32)[indices]
        self.offsets = np.concatenate([[0], np.cumsum(self.sample_lengths)]).astype(np.int64)
        self.num_tokens = int(self.offsets[-1])
        if self.num_tokens != plan.num_tokens or np.any(self.sample_lengths <= 0):
            raise ValueError(
                f"shard {plan.name}: sample lengths sum to {self.num_tokens} (plan says "
                f"{plan.num_tokens}); every length must be positive"
            )
        self.chunk_rows = min(rows_per_chunk, self.num_tokens)
        self.shard_rows = min(rows_per_zarr_shard, round_up(self.num_tokens, self.chunk_rows))
        self.group = self._fresh_group(group)
        self.arrays = self._create_arrays(bf16_compression)
        self._next_sample = 0
        self._buffers: dict[str, list[np.ndarray]] = {name: [] for name in self._row_array_names()}
        self._flushed_rows = 0
        self._buffered_rows = 0

    def _fresh_group(self, root: zarr.Group) -> zarr.Group:
        shards = shards_group(root)
        if is_complete(root, self.plan.name):
            raise ValueError(f"shard {self.plan.name} is already complete; refusing to rewrite it")
        if self._exists(shards):
            del shards[self.plan.name]  # an incomplete leftover of an earlier run
        return shards.create_group(self.plan.name)

    def _exists(self, shards: zarr.Group) -> bool:
        try:
            return self.plan.name in shards
        except Exception:  # corrupt leftover metadata: it exists and must go
            return True

    def _row_array_names(self) -> list[str]:
        return row_array_names(self.codec, self.with_labels, self.topk > 0)

    def _create_arrays(self, bf16_compression: str) -> dict[str, Any]:
        T, N, n = self.num_tokens, len(self.sample_lengths), self.num_layers
        width = n * self.hidden_size
        specs = {
            "hidden": ((T, width), HIDDEN_DTYPES[self.codec], hidden_compressors(self.codec, bf16_compression)),
            "input_ids": ((T,), np.dtype(np.int32), plain_compressors()),
            "loss_mask": ((T,), np.dtype(np.uint8), plain_compressors()),
        }
        if self.codec == "fp8":
            specs["scale"] = ((T, n), np.dtype(np.float32), plain_compressors())
        if self.with_labels:
            specs["labels"] = ((T,), np.dtype(np.int32), plain_compressors())
        if self.topk:
            specs["topk_ids"] = ((T, self.topk), np.dtype(np.int32), plain_compressors())
            specs["topk_probs"] = ((T, self.topk), np.dtype(np.uint16), plain_compressors())
        arrays = {}
        for name, (shape, dtype, compressors) in specs.items():
            # zarr's cost is per chunk, not per byte: the small per-token arrays (a few bytes a
            # row) are one chunk per file; only the features are cut into readable chunks.
            layout = ({"chunks": (self.chunk_rows, *shape[1:]), "shards": (self.shard_rows, *shape[1:])}
                      if name == "hidden" else {"chunks": (self.shard_rows, *shape[1:])})
            arrays[name] = self.group.create_array(
                name, shape=shape, dtype=dtype, **layout, serializer=BytesCodec(), compressors=compressors,
                config=WRITE_EVERY_CHUNK,
            )
        per_sample = [("offsets", N + 1, np.int64), ("row_ids", N, np.int64)]
        if self.sample_source_ids is not None:
            per_sample.append(("source_ids", N, np.int32))
        for name, size, dtype in per_sample:
            arrays[name] = self.group.create_array(
                name, shape=(size,), dtype=dtype, chunks=(size,),
                serializer=BytesCodec(), compressors=plain_compressors(),
            )
        return arrays

    def write_sample(
        self, i: int, hidden: np.ndarray, scale: np.ndarray | None,
        input_ids: np.ndarray, loss_mask: np.ndarray, labels: np.ndarray | None = None,
        topk_ids: np.ndarray | None = None, topk_probs: np.ndarray | None = None,
    ) -> None:
        """Add kept sample `i` (the next one of the plan): hidden (len, n*H), scale (len, n) for fp8,
        labels (len,) int32 for a store of target labels, topk_ids (len, k) int32 and topk_probs
        (len, k) uint16 for a store of soft targets (kept at supervised rows only, zeros elsewhere)."""
        local = self._next_sample
        if local >= len(self.sample_lengths) or self.plan.sample_indices[local] != i:
            expected = self.plan.sample_indices[local] if local < len(self.sample_lengths) else None
            raise ValueError(f"shard {self.plan.name}: got sample {i}, expected {expected} (plan order)")
        rows = {"hidden": hidden, "input_ids": np.asarray(input_ids).astype(np.int32),
                "loss_mask": np.asarray(loss_mask).astype(np.uint8)}
        if self.codec == "fp8":
            rows["scale"] = scale
        elif scale is not None:
            raise ValueError(f"shard {self.plan.name}: bf16 codec takes no scale (sample {i})")
        if self.with_labels:
            rows["labels"] = labels
        elif labels is not None:
            raise ValueError(f"shard {self.plan.name}: a store of data labels takes no labels (sample {i})")
        if self.topk:
            supervised = np.asarray(loss_mask).astype(bool)[:, None]
            for name, values in (("topk_ids", topk_ids), ("topk_probs", topk_probs)):
                rows[name] = None if values is None else np.where(supervised, values, 0).astype(values.dtype)
        elif topk_ids is not None or topk_probs is not None:
            raise ValueError(f"shard {self.plan.name}: a store without soft targets takes no top-k (sample {i})")
        self._check_sample(local, rows)
        for name, value in rows.items():
            self._buffers[name].append(value)
        self._next_sample += 1
        self._buffered_rows += int(self.sample_lengths[local])
        self._flush(final=False)

    def _check_sample(self, local: int, rows: dict[str, np.ndarray]) -> None:
        length, row_id = int(self.sample_lengths[local]), int(self.sample_row_ids[local])
        where = f"shard {self.plan.name}, row {row_id + 1}"
        for name, value in rows.items():
            array = self.arrays[name]
            expected_shape = (length, *array.shape[1:])
            if value is None or tuple(value.shape) != expected_shape or value.dtype != array.dtype:
                got = None if value is None else (tuple(value.shape), str(value.dtype))
                raise ValueError(f"{where}: {name} must be {expected_shape} {array.dtype}, got {got}")
        # a NaN/Inf would poison training; fail at the source, naming the row
        bad = count_nonfinite(rows["hidden"], self.codec)
        if "scale" in rows:
            bad += int((~np.isfinite(rows["scale"])).sum())
        if bad:
            raise ValueError(f"{where}: {bad} non-finite values in the context features")

    def _flush(self, final: bool) -> None:
        end = self._flushed_rows + self._buffered_rows
        stop = end if final else (end // self.shard_rows) * self.shard_rows
        if stop <= self._flushed_rows:
            return
        count = stop - self._flushed_rows
        for name, parts in self._buffers.items():
            data = np.concatenate(parts) if len(parts) > 1 else parts[0]
            self.arrays[name][self._flushed_rows:stop] = data[:count]
            self._buffers[name] = [data[count:]] if len(data) > count else []
        self._flushed_rows, self._buffered_rows = stop, end - stop

    def commit(self) -> dict:
        """Write the tail, offsets, row ids (and source ids), then the completion mark (last). Returns its stats."""
        if self._next_sample != len(self.sample_lengths):
            raise ValueError(
                f"shard {self.plan.name}: commit after {self._next_sample} of "
                f"{len(self.sample_lengths)} samples"
            )
        self._flush(final=True)
        self.arrays["offsets"][:] = self.offsets
        self.arrays["row_ids"][:] = self.sample_row_ids
        if self.sample_source_ids is not None:
            self.arrays["source_ids"][:] = self.sample_source_ids
        stats = {
            "bucket": self.plan.bucket,
            "codec": self.codec,
            "num_samples": len(self.sample_lengths),
            "num_tokens": self.num_tokens,
            "num_nonfinite": 0,  # write_sample refuses non-finite rows
            "arrays": {
                name: {"shape": list(array.shape), "dtype": str(array.dtype),
                       "stored_bytes": int(array.nbytes_stored())}
                for name, array in self.arrays.items()
            },
        }
        if self.topk:
            stats["topk"] = self.topk
        self.group.attrs[COMPLETE_KEY] = stats
        return stats
