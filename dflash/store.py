"""The zarr v3 store of context features: root attributes, shard writing, reading, checks.

Layout and attributes follow docs/INTERNALS.md. A shard group `shards/<name>` is written by
one process: its arrays are created at full size from the plan, filled in zarr-shard-aligned
row ranges, and the group attribute `complete` is written last, so a crash never leaves a
shard that looks complete. Every chunk carries a crc32c checksum (the codec chain's last
step), and the sharding index carries its own.

Only public zarr API is used (`zarr.open_group`, `Group.create_array`, `Array.nbytes_stored`)
so the module runs on zarr 3.1 and 3.4.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch
import zarr
from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, ZstdCodec

from dflash.errors import DflashError
from dflash.padding import round_up
from dflash.plan import ShardPlan

SCHEMA_VERSION = 1
ATTRS_KEY = "dflash"
COMPLETE_KEY = "complete"
# Root attributes that define what the store holds; any difference means another store. The
# target's `path` is not compared (a moved checkpoint is the same target; its weights
# fingerprint and config hash are), nor paths and worker counts (`content` leaves them out).
CONTENT_KEYS = (
    "schema_version", "content", "target", "target_layer_ids", "hidden_size", "codec",
    "tokenizer", "max_length", "bucket_edges", "shards",
)
LOCATION_KEYS = {"target": ("path",)}
HIDDEN_DTYPES = {"bf16": np.dtype(np.uint16), "fp8": np.dtype(np.uint8)}
LABEL_CHOICES = ("data", "target")
# bf16 compression: blosc (zstd-1, byte shuffle) by default; bit shuffle wins on trained activations
# and loses on random ones, so it waits for a trained target at the real shape (BENCHMARKS.md, Codecs).
DEFAULT_BF16_COMPRESSION = "blosc"
# Row arrays are never all fill value: skip zarr's per-chunk emptiness test.
WRITE_EVERY_CHUNK = {"write_empty_chunks": True}
WEIGHT_CHUNK_BYTES = 4 << 20
WEIGHT_CHUNKS_PER_SHARD = 16


def row_array_names(codec: str, labels: bool) -> list[str]:
    """The per-token arrays of a shard: features, ids, mask, and the fp8 scales and target labels
    where the store has them."""
    return ["hidden", "input_ids", "loss_mask"] + (["scale"] if codec == "fp8" else []) + (["labels"] if labels else [])


def has_target_labels(attrs: dict) -> bool:
    """Whether a store's root attributes say it holds the target's labels (older stores: data)."""
    return attrs.get("labels", "data") == "target"


class StoreMismatchError(DflashError, RuntimeError):
    """An existing store holds different content than the current config asks for."""


class CorruptShardError(DflashError, RuntimeError):
    """A shard's arrays cannot be opened or decoded."""


# ---------------------------------------------------------------- root attributes


def _json_normalized(value: Any) -> Any:
    """What a value looks like after a trip through zarr's JSON attributes (tuples -> lists)."""
    return json.loads(json.dumps(value))


def diff_attrs(old: dict, new: dict) -> dict[str, tuple[Any, Any]]:
    """Content differences between two `dflash` attribute dicts, as `dotted.key -> (old, new)`
    down to the leaves. Keys a store predates (`content`, `target.weights` before they existed)
    are not compared."""
    old, new = _json_normalized(old), _json_normalized(new)
    differences: dict[str, tuple[Any, Any]] = {}
    for key in CONTENT_KEYS:
        if key not in old and key == "content":
            continue
        mine, theirs = old.get(key), new.get(key)
        if key in LOCATION_KEYS and isinstance(mine, dict) and isinstance(theirs, dict):
            mine = {k: v for k, v in mine.items() if k not in LOCATION_KEYS[key]}
            theirs = {k: v for k, v in theirs.items() if k not in LOCATION_KEYS[key]}
        _diff_values(key, mine, theirs, differences)
    return differences


def _diff_values(key: str, old: Any, new: Any, out: dict) -> None:
    if isinstance(old, dict) and isinstance(new, dict):
        for name in sorted(old):  # a key the store predates (e.g. target.weights) is not compared
            _diff_values(f"{key}.{name}", old[name], new.get(name), out)
    elif old != new:
        out[key] = (old, new)


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
        root.attrs[ATTRS_KEY] = _json_normalized(root_attrs)
    shards_group(root)
    return root


def shards_group(root: zarr.Group) -> zarr.Group:
    """The store's `shards` group, made if missing. Writer processes open their shards at the
    same time: when another made the group between our look and our create, open theirs."""
    try:
        return root.require_group("shards")
    except zarr.errors.ContainsGroupError:
        return root["shards"]


# ---------------------------------------------------------------- codecs and bit views


def hidden_compressors(codec: str, bf16_compression: str = DEFAULT_BF16_COMPRESSION) -> list:
    """Bytes-to-bytes codec chain of the `hidden` array, crc32c last."""
    if codec == "fp8":
        return [ZstdCodec(level=1), Crc32cCodec()]
    if codec != "bf16":
        raise ValueError(f"unknown codec {codec!r}; expected 'bf16' or 'fp8'")
    if bf16_compression == "zstd":
        return [ZstdCodec(level=1), Crc32cCodec()]
    if bf16_compression == "blosc":
        return [BloscCodec(cname="zstd", clevel=1, shuffle="shuffle", typesize=2), Crc32cCodec()]
    raise ValueError(f"unknown bf16_compression {bf16_compression!r}; expected 'blosc' or 'zstd'")


def _plain_compressors() -> list:
    return [ZstdCodec(level=1), Crc32cCodec()]


def bf16_to_bits(tensor: torch.Tensor) -> np.ndarray:
    """bf16 tensor -> numpy uint16 with the same bits (CPU copy)."""
    as_bf16 = tensor.detach().to(device="cpu", dtype=torch.bfloat16).contiguous()
    return as_bf16.view(torch.int16).numpy().view(np.uint16)


def bits_to_bf16(bits: np.ndarray) -> torch.Tensor:
    """numpy uint16 bf16 bits -> bf16 tensor (bit-exact)."""
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16)


def count_nonfinite(hidden: np.ndarray, codec: str) -> int:
    """NaN/Inf values of encoded hidden rows, read from the bits (no float conversion).

    bf16 (uint16): exponent bits all ones (0x7F80). float8_e4m3fn (uint8) has no Inf and one
    NaN pattern per sign, S.1111.111 (0x7F / 0xFF).
    """
    bits = np.ascontiguousarray(hidden)
    if codec == "bf16":
        return int(np.count_nonzero((bits.view(np.uint16) & 0x7F80) == 0x7F80))
    return int(np.count_nonzero((bits.view(np.uint8) & 0x7F) == 0x7F))


# ---------------------------------------------------------------- frozen weights


FROZEN_WEIGHT_NAMES = ("embed_tokens", "lm_head")


def frozen_weights_complete(group: zarr.Group) -> bool:
    """Whether both frozen-weight arrays carry their completion mark."""
    return all(name in group and group[name].attrs.get(COMPLETE_KEY) for name in FROZEN_WEIGHT_NAMES)


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
            compressors=_plain_compressors(), overwrite=True,
        )
        for start in range(0, shape[0], rows_per_shard):
            array[start:start + rows_per_shard] = bits_VH[start:start + rows_per_shard]
        array.attrs[COMPLETE_KEY] = True


# ---------------------------------------------------------------- shard writing


def open_shard(root: zarr.Group, name: str) -> zarr.Group | None:
    """The shard group `shards/<name>`, or None when absent (raises if its metadata is corrupt)."""
    if "shards" not in root:
        return None
    try:
        return root["shards"][name]
    except KeyError:
        return None


def is_complete(group: zarr.Group, name: str) -> bool:
    """True when shard `name` exists and carries its completion mark."""
    try:
        shard = open_shard(group, name)
    except Exception:  # unreadable metadata: the shard is not complete and will be rewritten
        return False
    return shard is not None and COMPLETE_KEY in shard.attrs


def shard_names(root: zarr.Group) -> list[str]:
    """Planned shard names (root attribute `shards`) plus any other shard groups present."""
    planned = [entry["name"] for entry in root.attrs.get(ATTRS_KEY, {}).get("shards", [])]
    present: list[str] = []
    if "shards" in root:
        try:
            present = list(root["shards"].group_keys())
        except Exception:  # a member with corrupt metadata breaks the listing; plan still known
            present = []
    return sorted(set(planned) | set(present))


def completed_shards(group: zarr.Group) -> set[str]:
    """Names of all shards that carry their completion mark."""
    return {name for name in shard_names(group) if is_complete(group, name)}


class ShardWriter:
    """Writes one planned shard: samples arrive in plan order, `commit()` marks it complete.

    `lengths` and `row_ids` are indexed like the kept-sample list the plan refers to.
    Rows are buffered and written in whole zarr-shard row ranges so no zarr shard is read,
    modified and rewritten; the tail is written by `commit()`.
    """

    def __init__(
        self, group: zarr.Group, plan: ShardPlan, lengths: np.ndarray, row_ids: np.ndarray,
        codec: str, num_layers: int, hidden_size: int, rows_per_chunk: int,
        rows_per_zarr_shard: int, bf16_compression: str = DEFAULT_BF16_COMPRESSION, labels: bool = False,
    ):
        if codec not in HIDDEN_DTYPES:
            raise ValueError(f"shard {plan.name}: unknown codec {codec!r}")
        if rows_per_chunk <= 0 or rows_per_zarr_shard % rows_per_chunk:
            raise ValueError(
                f"rows_per_zarr_shard ({rows_per_zarr_shard}) must be a positive multiple of "
                f"rows_per_chunk ({rows_per_chunk})"
            )
        self.plan, self.codec, self.with_labels = plan, codec, labels
        self.num_layers, self.hidden_size = num_layers, hidden_size
        indices = list(plan.sample_indices)
        self.sample_lengths = np.asarray(lengths, dtype=np.int64)[indices]
        self.sample_row_ids = np.asarray(row_ids, dtype=np.int64)[indices]
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
        return row_array_names(self.codec, self.with_labels)

    def _create_arrays(self, bf16_compression: str) -> dict[str, Any]:
        T, N, n = self.num_tokens, len(self.sample_lengths), self.num_layers
        width = n * self.hidden_size
        specs = {
            "hidden": ((T, width), HIDDEN_DTYPES[self.codec], hidden_compressors(self.codec, bf16_compression)),
            "input_ids": ((T,), np.dtype(np.int32), _plain_compressors()),
            "loss_mask": ((T,), np.dtype(np.uint8), _plain_compressors()),
        }
        if self.codec == "fp8":
            specs["scale"] = ((T, n), np.dtype(np.float32), _plain_compressors())
        if self.with_labels:
            specs["labels"] = ((T,), np.dtype(np.int32), _plain_compressors())
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
        for name, size in (("offsets", N + 1), ("row_ids", N)):
            arrays[name] = self.group.create_array(
                name, shape=(size,), dtype=np.int64, chunks=(size,),
                serializer=BytesCodec(), compressors=_plain_compressors(),
            )
        return arrays

    def write_sample(
        self, i: int, hidden: np.ndarray, scale: np.ndarray | None,
        input_ids: np.ndarray, loss_mask: np.ndarray, labels: np.ndarray | None = None,
    ) -> None:
        """Add kept sample `i` (the next one of the plan): hidden (len, n*H), scale (len, n) for fp8,
        labels (len,) int32 for a store of target labels."""
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
        """Write the tail, offsets and row ids, then the completion mark (last). Returns its stats."""
        if self._next_sample != len(self.sample_lengths):
            raise ValueError(
                f"shard {self.plan.name}: commit after {self._next_sample} of "
                f"{len(self.sample_lengths)} samples"
            )
        self._flush(final=True)
        self.arrays["offsets"][:] = self.offsets
        self.arrays["row_ids"][:] = self.sample_row_ids
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
        self.group.attrs[COMPLETE_KEY] = stats
        return stats


# ---------------------------------------------------------------- reading


def open_existing(path: Any) -> zarr.Group:
    """The store at `path` for reading; a missing local store is named with what writes it."""
    if isinstance(path, (str, os.PathLike)) and "://" not in str(path) and not os.path.exists(path):
        raise FileNotFoundError(f"store.path: there is no store at {path}; `dflash stage1-extract` writes it")
    return zarr.open_group(path, mode="r")


def _read_root_attrs(root: zarr.Group, path: Any) -> dict:
    attrs = root.attrs.get(ATTRS_KEY)
    if attrs is None:
        raise StoreMismatchError(f"{path} has no '{ATTRS_KEY}' attributes: not a dflash store")
    check_schema_version(attrs, path)
    return attrs


def check_schema_version(attrs: dict, path: Any) -> None:
    """A store of another format version is refused by name, before any array is read."""
    version = attrs.get("schema_version")
    if version != SCHEMA_VERSION:
        raise StoreMismatchError(
            f"store {path} has schema version {version} (written by dflash {attrs.get('package_version', '?')}); "
            f"this dflash reads version {SCHEMA_VERSION}: rewrite it with this version's stage one "
            f"(--overwrite), or read it with the version that wrote it")


def _shard_index(shard: zarr.Group, codec: str, labels: bool) -> dict[str, np.ndarray]:
    """Per-sample index of one complete shard; raises if its arrays cannot be opened or read."""
    names = row_array_names(codec, labels) + ["offsets", "row_ids"]
    arrays = {name: shard[name] for name in names}
    offsets = np.asarray(arrays["offsets"][:], dtype=np.int64)
    row_ids = np.asarray(arrays["row_ids"][:], dtype=np.int64)
    loss_mask = np.asarray(arrays["loss_mask"][:], dtype=np.int64)
    lengths = np.diff(offsets)
    if len(offsets) != len(row_ids) + 1 or offsets[0] != 0 or offsets[-1] != arrays["hidden"].shape[0] \
            or np.any(lengths <= 0) or len(loss_mask) != offsets[-1]:
        raise ValueError(f"offsets inconsistent with arrays (offsets[-1]={offsets[-1]}, "
                         f"hidden rows={arrays['hidden'].shape[0]}, samples={len(row_ids)})")
    supervised = np.add.reduceat(loss_mask, offsets[:-1]) if len(row_ids) else np.zeros(0, np.int64)
    return {"start": offsets[:-1], "length": lengths, "row_id": row_ids, "num_supervised": supervised}


class StoreReader:
    """Random access to the samples of every complete shard of a store.

    The sample index (numpy arrays `sample_*`) is built once; zarr arrays are opened lazily
    in each process and not pickled, so the reader can go to DataLoader workers.
    `on_corrupt="skip"` skips shards that cannot be opened and records them in `skipped_shards`.
    `shards` indexes exactly those shards, in that order (a following run's arrival order);
    `refresh()` appends shards completed since, keeping every earlier sample index.
    """

    def __init__(self, path: Any, on_corrupt: str = "raise", shards: list[str] | None = None):
        if on_corrupt not in ("raise", "skip"):
            raise ValueError(f"on_corrupt must be 'raise' or 'skip', got {on_corrupt!r}")
        self.path = path
        self.on_corrupt = on_corrupt
        root = open_existing(path)
        self.attrs = _read_root_attrs(root, path)
        self.codec: str = self.attrs["codec"]
        self.hidden_size: int = int(self.attrs["hidden_size"])
        self.num_layers: int = len(self.attrs["target_layer_ids"])
        self.has_labels: bool = has_target_labels(self.attrs)
        self.incomplete_shards: list[str] = []
        self.skipped_shards: dict[str, str] = {}
        self.shard_names: list[str] = []
        self.shard_buckets: list[int] = []
        self._parts: list[dict] = []
        self._append(root, shard_names(root) if shards is None else shards, required=shards is not None)
        self._root: zarr.Group | None = None
        self._arrays: dict[str, dict[str, Any]] = {}

    @property
    def planned_shards(self) -> list[str]:
        """The shard names stage one planned (root attribute `shards`)."""
        return [entry["name"] for entry in self.attrs.get("shards", [])]

    @property
    def finished(self) -> bool:
        """Every planned shard is indexed (or skipped as corrupt): stage one wrote the whole store."""
        done = set(self.shard_names) | set(self.skipped_shards)
        return all(name in done for name in self.planned_shards)

    def refresh(self, names: list[str] | None = None) -> list[str]:
        """Append the shards completed since the index was built (all of `names`, in that order,
        when given: what another rank found); returns the names appended."""
        root = open_existing(self.path)
        known = set(self.shard_names) | set(self.skipped_shards)
        before = len(self.shard_names)
        self.incomplete_shards = []
        self._append(root, [name for name in (shard_names(root) if names is None else names) if name not in known],
                     required=names is not None)
        return self.shard_names[before:]

    def _append(self, root: zarr.Group, names: list[str], required: bool = False) -> None:
        parts = [self._index_shard(root, name, required) for name in names]
        self._parts += [part for part in parts if part is not None]
        self._build_index(self._parts)

    def _index_shard(self, root: zarr.Group, name: str, required: bool = False) -> dict | None:
        try:
            shard = open_shard(root, name)
            complete = shard is not None and COMPLETE_KEY in shard.attrs
            if complete:
                index = _shard_index(shard, self.codec, self.has_labels)
                bucket = int(shard.attrs[COMPLETE_KEY]["bucket"])
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
            if self.on_corrupt == "raise":
                raise CorruptShardError(f"shard {name} cannot be opened: {reason}") from exc
            self.skipped_shards[name] = reason
            return None
        if not complete:
            if required:
                raise CorruptShardError(f"shard {name} is not complete, but this run's checkpoint trained on it")
            self.incomplete_shards.append(name)
            return None
        index["shard"] = np.full(len(index["start"]), len(self.shard_names), dtype=np.int64)
        index["bucket"] = np.full(len(index["start"]), bucket, dtype=np.int64)
        self.shard_names.append(name)
        self.shard_buckets.append(bucket)
        return index

    def _build_index(self, parts: list[dict]) -> None:
        def gather(key: str) -> np.ndarray:
            return np.concatenate([p[key] for p in parts]).astype(np.int64) if parts else np.zeros(0, np.int64)

        self.sample_shard = gather("shard")
        self.sample_start = gather("start")  # first row of the sample inside its shard
        self.sample_length = gather("length")
        self.sample_bucket = gather("bucket")
        self.sample_num_supervised = gather("num_supervised")
        self.sample_row_id = gather("row_id")
        self.sample_local = np.concatenate([np.arange(len(p["start"])) for p in parts]) if parts else np.zeros(0, np.int64)
        # The per-sample table stage two schedules from (dflash.sampler, dflash.batch).
        self.index = {"length": self.sample_length, "bucket": self.sample_bucket,
                      "num_supervised": self.sample_num_supervised, "row_id": self.sample_row_id}

    def __len__(self) -> int:
        return len(self.sample_length)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_root"], state["_arrays"] = None, {}  # zarr handles are reopened per process
        state["_parts"] = []  # only refresh() needs them; DataLoader workers read, never refresh
        return state

    def _shard_arrays(self, name: str) -> dict[str, Any]:
        if name not in self._arrays:
            if self._root is None:
                self._root = zarr.open_group(self.path, mode="r")
            shard = self._root["shards"][name]
            self._arrays[name] = {key: shard[key] for key in row_array_names(self.codec, self.has_labels)}
        return self._arrays[name]

    def read_sample(self, i: int) -> dict:
        """Sample i: hidden (len, n*H) uint16|uint8, scale (len, n) float32 or None,
        input_ids int64, loss_mask bool, labels int64 (the target's, or None in a store of data
        labels), row_id."""
        name = self.shard_names[self.sample_shard[i]]
        start = int(self.sample_start[i])
        stop = start + int(self.sample_length[i])
        try:
            arrays = self._shard_arrays(name)
            sample = {
                "hidden": arrays["hidden"][start:stop],
                "scale": arrays["scale"][start:stop] if "scale" in arrays else None,
                "input_ids": arrays["input_ids"][start:stop].astype(np.int64),
                "loss_mask": arrays["loss_mask"][start:stop].astype(bool),
                "labels": arrays["labels"][start:stop].astype(np.int64) if "labels" in arrays else None,
                "row_id": int(self.sample_row_id[i]),
            }
        except Exception as exc:
            raise CorruptShardError(
                f"shard {name}: cannot read sample {i} (row {int(self.sample_row_id[i]) + 1}): "
                f"{type(exc).__name__}: {exc}. Repair: `dflash inspect-cache {self.path} --verify --repair` "
                f"removes the bad shards, then stage one (same config) rewrites them; or set "
                f"train.skip_corrupt_shards = true to skip unreadable samples"
            ) from exc
        return sample

    def read_frozen_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(embed_tokens, lm_head) as bf16 tensors (vocab, hidden)."""
        root = zarr.open_group(self.path, mode="r")
        weights = []
        for name in ("embed_tokens", "lm_head"):
            if name not in root or not root[name].attrs.get(COMPLETE_KEY):
                raise KeyError(f"store {self.path} has no complete '{name}' array")
            weights.append(bits_to_bf16(root[name][:]))
        return weights[0], weights[1]
