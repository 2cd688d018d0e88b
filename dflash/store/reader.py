"""Reading the store: `StoreReader` indexes every complete shard once and reads one sample at a
time (zarr arrays opened lazily in each process, so the reader can go to DataLoader workers).
The format is dflash/store/schema.py's.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np
import torch
import zarr

from dflash.data.chat import source_name
from dflash.store.schema import (ATTRS_KEY, COMPLETE_KEY, CorruptShardError, StoreMismatchError, bits_to_bf16,
                                 check_schema_version, has_target_labels, open_shard, row_array_names, shard_names,
                                 store_topk)


def check_is_store(path: Any) -> None:
    """Refuse a local path that is no store (missing, a file, a folder without zarr's root metadata)
    in the project's words, before zarr answers with its own."""
    if not isinstance(path, (str, os.PathLike)) or "://" in str(path):
        return
    if not os.path.exists(path):
        raise FileNotFoundError(f"store.path: there is no store at {path}; `dflash stage1-extract` writes it")
    if not os.path.isdir(path):
        raise StoreMismatchError(f"{path} is not a dflash store (a file; a store is the folder stage one writes at "
                                 f"store.path)")
    if not os.path.isfile(os.path.join(path, "zarr.json")):
        raise StoreMismatchError(f"{path} is not a dflash store (no zarr.json in it); `dflash stage1-extract` "
                                 f"writes one at store.path")


def open_existing(path: Any) -> zarr.Group:
    """The store at `path` for reading; a missing local store is named with what writes it."""
    check_is_store(path)
    return zarr.open_group(path, mode="r")


def _read_root_attrs(root: zarr.Group, path: Any) -> dict:
    attrs = root.attrs.get(ATTRS_KEY)
    if attrs is None:
        raise StoreMismatchError(f"{path} is not a dflash store (no '{ATTRS_KEY}' attributes in its zarr.json); "
                                 f"`dflash stage1-extract` writes one at store.path")
    check_schema_version(attrs, path)
    return attrs


def _shard_index(shard: zarr.Group, codec: str, labels: bool, sources: bool = False) -> dict[str, np.ndarray]:
    """Per-sample index of one complete shard (with `sources`, each sample's source number from its
    `source_ids`; else source 0); raises if its arrays cannot be opened or read."""
    names = row_array_names(codec, labels) + ["offsets", "row_ids"] + (["source_ids"] if sources else [])
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
    source = np.asarray(arrays["source_ids"][:], dtype=np.int64) if sources else np.zeros(len(row_ids), np.int64)
    if len(source) != len(row_ids):
        raise ValueError(f"source_ids has {len(source)} entries for {len(row_ids)} samples")
    return {"start": offsets[:-1], "length": lengths, "row_id": row_ids, "num_supervised": supervised,
            "source": source}


class StoreReader:
    """Random access to the samples of every complete shard of a store.

    The sample index (numpy arrays `sample_*`) is built once; zarr arrays are opened lazily
    in each process and not pickled, so the reader can go to DataLoader workers.
    `on_corrupt="skip"` skips shards that cannot be opened and records them in `skipped_shards`.
    `shards` indexes exactly those shards, in that order (a following run's arrival order);
    `refresh()` appends shards completed since, keeping every earlier sample index.
    """

    def __init__(self, path: Any, on_corrupt: str = "raise", shards: list[str] | None = None,
                 soft_targets: bool = False):
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
        self.topk: int = store_topk(self.attrs)  # k of the store's soft targets, 0 without
        if soft_targets and not self.topk:
            raise StoreMismatchError(f"train.distill_weight: the store at {path} holds no soft targets (top-k); "
                                     f"run stage one with store.topk > 0 (into another store.path) or set "
                                     f"train.distill_weight = 0")
        self.soft_targets = soft_targets  # read_sample returns them
        # A store of data.mix's sources names them (root attribute `sources`); an older or single-source
        # store holds one source, named after the data.source that wrote it.
        self.has_sources: bool = "sources" in self.attrs
        self.source_names: list[str] = list(self.attrs["sources"]) if self.has_sources else [source_name(
            str(self.attrs.get("config", {}).get("data", {}).get("source", "data")))]
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
                index = _shard_index(shard, self.codec, self.has_labels, self.has_sources)
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
        self.sample_source = gather("source")  # the number of its source, in `source_names`
        self.sample_local = np.concatenate([np.arange(len(p["start"])) for p in parts]) if parts else np.zeros(0, np.int64)
        # The per-sample table stage two schedules from (dflash.train.sampler, dflash.train.batch).
        self.index = {"length": self.sample_length, "bucket": self.sample_bucket,
                      "num_supervised": self.sample_num_supervised, "row_id": self.sample_row_id,
                      "source": self.sample_source}

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
            self._arrays[name] = {key: shard[key] for key in row_array_names(self.codec, self.has_labels,
                                                                             self.soft_targets)}
        return self._arrays[name]

    def read_sample(self, i: int) -> dict:
        """Sample i: hidden (len, n*H) uint16|uint8, scale (len, n) float32 or None,
        input_ids int64, loss_mask bool, labels int64 (the target's, or None in a store of data
        labels), row_id, source (its number in `source_names`); with `soft_targets`, topk_ids (len, k)
        int32 and topk_probs (len, k) uint16 (`schema.bits_to_probs` decodes them)."""
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
                "source": int(self.sample_source[i]),
            }
            if self.soft_targets:
                sample["topk_ids"] = arrays["topk_ids"][start:stop]
                sample["topk_probs"] = arrays["topk_probs"][start:stop]
        except Exception as exc:
            raise CorruptShardError(
                f"shard {name}: cannot read sample {i} ({self.sample_label(i)}): "
                f"{type(exc).__name__}: {exc}. Repair: `dflash inspect-cache {self.path} --verify --repair` "
                f"removes the bad shards, then stage one (same config) rewrites them; or set "
                f"train.skip_corrupt_shards = true to skip unreadable samples"
            ) from exc
        return sample

    def sample_label(self, i: int) -> str:
        """How users see sample i's origin: its row, and its source in a store of several."""
        row = f"row {int(self.sample_row_id[i]) + 1}"
        return f"{row} of source {self.source_names[self.sample_source[i]]}" if self.has_sources else row

    def read_tokens(self, indices) -> list[dict]:
        """The samples' input_ids int64, loss_mask bool and labels int64 (or None), without their
        features, in the order given; each shard's token arrays are read once."""
        by_shard = {}
        for i in indices:
            by_shard.setdefault(int(self.sample_shard[i]), []).append(int(i))
        samples = {}
        for shard, members in by_shard.items():
            arrays = self._shard_arrays(self.shard_names[shard])
            columns = {key: arrays[key][:] for key in ("input_ids", "loss_mask", "labels") if key in arrays}
            for i in members:
                rows = slice(int(self.sample_start[i]), int(self.sample_start[i] + self.sample_length[i]))
                samples[i] = {"input_ids": columns["input_ids"][rows].astype(np.int64),
                              "loss_mask": columns["loss_mask"][rows].astype(bool),
                              "labels": columns["labels"][rows].astype(np.int64) if "labels" in columns else None}
        return [samples[int(i)] for i in indices]

    def prompt_groups(self) -> np.ndarray:
        """Per sample, the number of its prompt (the tokens before its first supervised one), equal
        for samples with equal prompts and numbered in order of first appearance: several answers to
        one prompt (`dflash generate --num-samples`) share a number. Reads every shard's ids and mask."""
        keys = np.zeros(len(self), dtype=np.uint64)
        for shard, name in enumerate(self.shard_names):
            members = np.flatnonzero(self.sample_shard == shard)
            if not members.size:
                continue
            arrays = self._shard_arrays(name)
            ids, mask = arrays["input_ids"][:], arrays["loss_mask"][:]
            for i in members:
                start, stop = int(self.sample_start[i]), int(self.sample_start[i] + self.sample_length[i])
                prompt = ids[start:start + int(np.argmax(mask[start:stop]))]
                keys[i] = np.frombuffer(hashlib.blake2b(np.ascontiguousarray(prompt, dtype=np.int64).tobytes(),
                                                        digest_size=8).digest(), dtype=np.uint64)[0]
        _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
        rank = np.empty(len(first), dtype=np.int64)
        rank[np.argsort(first, kind="stable")] = np.arange(len(first))
        return rank[inverse]

    def read_frozen_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(embed_tokens, lm_head) as bf16 tensors (vocab, hidden)."""
        root = zarr.open_group(self.path, mode="r")
        weights = []
        for name in ("embed_tokens", "lm_head"):
            if name not in root or not root[name].attrs.get(COMPLETE_KEY):
                raise KeyError(f"store {self.path} has no complete '{name}' array")
            weights.append(bits_to_bf16(root[name][:]))
        return weights[0], weights[1]
