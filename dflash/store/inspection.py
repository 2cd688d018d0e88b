"""What `dflash inspect-cache` shows: a store verified shard by shard (every chunk's checksum,
array shapes and row invariants, the frozen weights; a bad shard can be removed so that stage one
rewrites it), its statistics per bucket and per shard (lengths, supervised share, stored bytes,
compression, agreement of data and target labels), the printed tables and the length plot.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zarr

from dflash.store.reader import StoreReader
from dflash.store.schema import (ATTRS_KEY, COMPLETE_KEY, FROZEN_WEIGHT_NAMES, HIDDEN_DTYPES, StoreMismatchError,
                                 PROB_SCALE, TOPK_ARRAYS, check_schema_version, count_nonfinite, has_target_labels,
                                 open_shard, shard_names, store_topk)

# ---------------------------------------------------------------- verification


@dataclass
class VerifyReport:
    """Result of `verify_store`: `bad` maps each bad shard (or weight array) to the reason."""

    ok: bool
    num_shards_checked: int = 0
    num_samples: int = 0
    num_tokens: int = 0
    bad: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


class _CheckFailed(ValueError):
    pass


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise _CheckFailed(message)


def _expected_arrays(attrs: dict, num_tokens: int, num_samples: int) -> dict[str, tuple]:
    n, H, codec = len(attrs["target_layer_ids"]), int(attrs["hidden_size"]), attrs["codec"]
    expected = {
        "hidden": ((num_tokens, n * H), HIDDEN_DTYPES[codec]),
        "input_ids": ((num_tokens,), np.dtype(np.int32)),
        "loss_mask": ((num_tokens,), np.dtype(np.uint8)),
        "offsets": ((num_samples + 1,), np.dtype(np.int64)),
        "row_ids": ((num_samples,), np.dtype(np.int64)),
    }
    if codec == "fp8":
        expected["scale"] = ((num_tokens, n), np.dtype(np.float32))
    if has_target_labels(attrs):
        expected["labels"] = ((num_tokens,), np.dtype(np.int32))
    if store_topk(attrs):
        k = store_topk(attrs)
        expected["topk_ids"] = ((num_tokens, k), np.dtype(np.int32))
        expected["topk_probs"] = ((num_tokens, k), np.dtype(np.uint16))
    if "sources" in attrs:
        expected["source_ids"] = ((num_samples,), np.dtype(np.int32))
    return expected


def _verify_shard(shard: zarr.Group, attrs: dict, planned: dict | None) -> tuple[int, int]:
    """Check one complete shard end to end; returns (samples, tokens) or raises _CheckFailed."""
    mark = shard.attrs[COMPLETE_KEY]
    num_samples, num_tokens = int(mark["num_samples"]), int(mark["num_tokens"])
    if planned is not None:
        _expect((planned["num_samples"], planned["num_tokens"]) == (num_samples, num_tokens),
                f"plan says {planned['num_samples']} samples / {planned['num_tokens']} tokens, "
                f"completion mark says {num_samples} / {num_tokens}")
    arrays = {}
    for name, (shape, dtype) in _expected_arrays(attrs, num_tokens, num_samples).items():
        arrays[name] = shard[name]
        _expect(tuple(arrays[name].shape) == shape and arrays[name].dtype == dtype,
                f"{name} is {tuple(arrays[name].shape)} {arrays[name].dtype}, expected {shape} {dtype}")
    offsets = arrays["offsets"][:]
    _expect(offsets[0] == 0 and offsets[-1] == num_tokens and bool(np.all(np.diff(offsets) > 0)),
            f"offsets do not split {num_tokens} rows into positive lengths")
    arrays["row_ids"][:]
    if "source_ids" in arrays:
        source_ids = arrays["source_ids"][:]
        _expect(bool(((source_ids >= 0) & (source_ids < len(attrs["sources"]))).all()),
                f"source_ids outside 0..{len(attrs['sources']) - 1} (the root attribute 'sources')")
    _verify_rows(arrays, attrs["codec"], int(attrs.get("target", {}).get("vocab_size") or 0))
    return num_samples, num_tokens


def _verify_rows(arrays: dict[str, Any], codec: str, vocab_size: int) -> None:
    """Decode every chunk of the row arrays (crc32c checked by zarr), look for NaN/Inf and for
    target labels outside the vocabulary."""
    hidden = arrays["hidden"]
    block = hidden.shards[0] if hidden.shards else hidden.chunks[0]
    for start in range(0, hidden.shape[0], block):
        stop = min(start + block, hidden.shape[0])
        bad = count_nonfinite(hidden[start:stop], codec)
        _expect(bad == 0, f"{bad} non-finite values in hidden rows {start}:{stop}")
        if "scale" in arrays:
            scale = arrays["scale"][start:stop]
            _expect(bool(np.isfinite(scale).all()), f"non-finite scale in rows {start}:{stop}")
        mask = arrays["loss_mask"][start:stop]
        _expect(bool(np.isin(mask, (0, 1)).all()), f"loss_mask not 0/1 in rows {start}:{stop}")
        arrays["input_ids"][start:stop]
        if "labels" in arrays:
            labels = arrays["labels"][start:stop]
            _expect(bool((labels >= 0).all()) and (not vocab_size or bool((labels < vocab_size).all())),
                    f"target labels outside the vocabulary (0..{vocab_size - 1}) in rows {start}:{stop}")
        if "topk_ids" in arrays:
            _verify_topk(arrays["topk_ids"][start:stop], arrays["topk_probs"][start:stop], vocab_size,
                         f"rows {start}:{stop}")


def _verify_topk(ids: np.ndarray, probs: np.ndarray, vocab_size: int, where: str) -> None:
    """Soft targets: ids inside the vocabulary, each row's probabilities summing to at most 1 (each
    stored value is rounded, so up to k/2 units of 1/65535 over)."""
    _expect(bool((ids >= 0).all()) and (not vocab_size or bool((ids < vocab_size).all())),
            f"topk_ids outside the vocabulary (0..{vocab_size - 1}) in {where}")
    sums = probs.astype(np.int64).sum(axis=1)
    limit = PROB_SCALE + probs.shape[1] // 2
    _expect(bool((sums <= limit).all()),
            f"topk_probs sum above 1 in {where} (largest {sums.max() / PROB_SCALE:.6f})")


def _verify_weights(root: zarr.Group, attrs: dict, bad: dict[str, str]) -> None:
    for name in ("embed_tokens", "lm_head"):
        if name not in root:
            continue
        try:
            array = root[name]
            _expect(bool(array.attrs.get(COMPLETE_KEY)), "no completion mark")
            _expect(array.shape[1] == int(attrs["hidden_size"]) and array.dtype == np.uint16,
                    f"shape {array.shape} dtype {array.dtype}, expected (V, {attrs['hidden_size']}) uint16")
            block = array.shards[0] if array.shards else array.chunks[0]
            for start in range(0, array.shape[0], block):
                nonfinite = count_nonfinite(array[start:start + block], "bf16")
                _expect(nonfinite == 0, f"{nonfinite} non-finite values in rows {start}:{start + block}")
        except Exception as exc:
            bad[name] = f"{type(exc).__name__}: {exc}" if not isinstance(exc, _CheckFailed) else str(exc)


def repair_store(path: Any, bad: dict[str, str]) -> list[str]:
    """Remove the shards (and frozen-weight arrays) that verification found bad, so that stage one,
    rerun with the same config, rewrites exactly those. Returns what was removed."""
    root = zarr.open_group(path, mode="a")
    removed = []
    for name in bad:
        if name in FROZEN_WEIGHT_NAMES:
            if name in root:
                del root[name]
                removed.append(name)
            continue
        local = os.path.join(str(path), "shards", name)
        try:
            exists = open_shard(root, name) is not None
        except Exception:  # metadata too broken to open: it exists
            exists = True
        if not exists and not os.path.isdir(local):
            continue  # planned but never written: nothing to remove
        try:
            del root["shards"][name]
        except Exception:  # metadata too broken for zarr to delete: remove the files
            if not os.path.isdir(local):
                raise
            shutil.rmtree(local)
        removed.append(name)
    return removed


def verify_store(path: Any) -> VerifyReport:
    """Read and check every chunk of every shard; every planned shard must exist and be complete."""
    root = zarr.open_group(path, mode="r")
    attrs = root.attrs.get(ATTRS_KEY)
    if attrs is None:
        return VerifyReport(ok=False, bad={"<root>": f"no '{ATTRS_KEY}' attributes: not a dflash store"})
    try:
        check_schema_version(attrs, path)
    except StoreMismatchError as error:
        return VerifyReport(ok=False, bad={"<root>": str(error)})
    planned = {entry["name"]: entry for entry in attrs.get("shards", [])}
    report = VerifyReport(ok=True)
    for name in shard_names(root):
        try:
            shard = open_shard(root, name)
            _expect(shard is not None, "planned but missing")
            _expect(name in planned, "present but not in the plan (root attribute 'shards')")
            _expect(COMPLETE_KEY in shard.attrs, "incomplete: no completion mark")
            samples, tokens = _verify_shard(shard, attrs, planned.get(name))
        except Exception as exc:
            report.bad[name] = str(exc) if isinstance(exc, _CheckFailed) else f"{type(exc).__name__}: {exc}"
            continue
        report.num_shards_checked += 1
        report.num_samples += samples
        report.num_tokens += tokens
    _verify_weights(root, attrs, report.bad)
    report.ok = not report.bad
    return report


# ---------------------------------------------------------------- statistics


def _stored_bytes(group: zarr.Group) -> int:
    """Bytes of all arrays of a group as stored (chunk files + array metadata)."""
    return sum(int(array.nbytes_stored()) for _, array in group.arrays())


def _summary(lengths: np.ndarray, supervised: np.ndarray, stored_bytes: int, raw_bytes_per_token: int) -> dict:
    tokens = int(lengths.sum())
    return {
        "samples": int(len(lengths)),
        "tokens": tokens,
        "min_length": int(lengths.min()) if len(lengths) else None,
        "median_length": float(np.median(lengths)) if len(lengths) else None,
        "max_length": int(lengths.max()) if len(lengths) else None,
        "supervised_share": float(supervised.sum()) / tokens if tokens else None,
        "stored_bytes": int(stored_bytes),
        "bytes_per_token": stored_bytes / tokens if tokens else None,
        "compression_ratio": tokens * raw_bytes_per_token / stored_bytes if stored_bytes else None,
    }


def label_agreement(root: zarr.Group, names: list[str]) -> float | None:
    """Share of supervised positions (after the first of each sample) where the data token equals
    the target's stored label: how often the target itself would have written the data."""
    same = total = 0
    for name in names:
        shard = root["shards"][name]
        offsets = shard["offsets"][:]
        predicted = np.ones(int(offsets[-1]), dtype=bool)
        predicted[offsets[:-1]] = False  # a sample's first token has no prediction
        supervised = (shard["loss_mask"][:] == 1) & predicted
        same += int((shard["input_ids"][:] == shard["labels"][:])[supervised].sum())
        total += int(supervised.sum())
    return same / total if total else None


def _source_stats(reader: StoreReader) -> list[dict]:
    """Samples, tokens and lengths of each source of a store of several (shards mix sources, so
    stored bytes are not split by source)."""
    stats = []
    for number, name in enumerate(reader.source_names):
        mine = reader.sample_source == number
        entry = _summary(reader.sample_length[mine], reader.sample_num_supervised[mine], 0, 0)
        stats.append({"name": name, **entry, "stored_bytes": None, "bytes_per_token": None,
                      "compression_ratio": None})
    return stats


def store_stats(path: Any) -> dict:
    """Per bucket, per shard, per source (a store of several) and total statistics over the complete
    shards of a store.

    Stored bytes count every array of a shard (hidden, scale, ids, mask, offsets, row ids,
    metadata); the compression ratio compares them with raw bf16 features, n*H*2 bytes/token.
    """
    reader = StoreReader(path, on_corrupt="skip")
    root = zarr.open_group(path, mode="r")
    raw_per_token = reader.num_layers * reader.hidden_size * 2
    shard_bytes = [_stored_bytes(root["shards"][name]) for name in reader.shard_names]
    shards = []
    for k, name in enumerate(reader.shard_names):
        mask = reader.sample_shard == k
        entry = _summary(reader.sample_length[mask], reader.sample_num_supervised[mask], shard_bytes[k], raw_per_token)
        shards.append({"name": name, "bucket": reader.shard_buckets[k], **entry})
    edges = reader.attrs["bucket_edges"]
    buckets = []
    for bucket in range(len(edges) - 1):
        mask = reader.sample_bucket == bucket
        stored = sum(b for b, bk in zip(shard_bytes, reader.shard_buckets) if bk == bucket)
        entry = _summary(reader.sample_length[mask], reader.sample_num_supervised[mask], stored, raw_per_token)
        buckets.append({"bucket": bucket, "lo": edges[bucket], "hi": edges[bucket + 1], **entry})
    sources = _source_stats(reader) if reader.has_sources else []
    weights_bytes = sum(int(root[n].nbytes_stored()) for n in ("embed_tokens", "lm_head") if n in root)
    return {
        "labels": "target" if reader.has_labels else "data",
        "optional_arrays": list(TOPK_ARRAYS) if reader.topk else [], "topk": reader.topk,
        "label_agreement": label_agreement(root, reader.shard_names) if reader.has_labels else None,
        "codec": reader.codec, "num_layers": reader.num_layers, "hidden_size": reader.hidden_size,
        "raw_bytes_per_token": raw_per_token,
        "total": _summary(reader.sample_length, reader.sample_num_supervised, sum(shard_bytes), raw_per_token),
        "buckets": buckets, "shards": shards, "sources": sources, "frozen_weights_bytes": weights_bytes,
        "incomplete_shards": list(reader.incomplete_shards), "skipped_shards": dict(reader.skipped_shards),
        "max_length": reader.attrs["max_length"], "num_truncated": reader.attrs.get("num_truncated"),
    }


COLUMNS = (
    ("samples", "samples", "{:d}"), ("tokens", "tokens", "{:d}"),
    ("min_length", "min", "{:d}"), ("median_length", "median", "{:.1f}"), ("max_length", "max", "{:d}"),
    ("supervised_share", "sup%", "{:.1%}"), ("stored_bytes", "stored", None),
    ("bytes_per_token", "B/tok", "{:.1f}"), ("compression_ratio", "ratio", "{:.2f}x"),
)


COLUMN_LEGEND = ("sup%: share of the tokens that are supervised (answer tokens the loss trains on); "
                 "B/tok: stored bytes per token; ratio: raw bf16 size / stored size")


def bucket_range(edges: list[int], bucket: int) -> str:
    """A bucket's lengths as `plan.assign_bucket` fills it: [lo,hi), where the first bucket also
    holds the lengths below the first edge ([0,hi)) and the last one the last edge's length
    ([lo,hi]: data.max_length may equal it)."""
    low = 0 if bucket == 0 else edges[bucket]
    closing = "]" if bucket == len(edges) - 2 else ")"
    return f"[{low},{edges[bucket + 1]}{closing}"


def format_bytes(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num_bytes) < 1024 or unit == "TiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")


def _cell(entry: dict, key: str, fmt: str | None) -> str:
    value = entry.get(key)
    if value is None:
        return "-"
    return format_bytes(value) if fmt is None else fmt.format(value)


def format_table(label: str, rows: list[tuple[str, dict]]) -> str:
    """Fixed-width table: one labelled row per entry, the statistics columns after it."""
    header = [label] + [title for _, title, _ in COLUMNS]
    body = [[name] + [_cell(entry, key, fmt) for key, _, fmt in COLUMNS] for name, entry in rows]
    widths = [max(len(row[col]) for row in [header] + body) for col in range(len(header))]
    lines = ["  ".join([row[0].ljust(widths[0])] + [cell.rjust(w) for cell, w in zip(row[1:], widths[1:])])
             for row in [header] + body]
    return "\n".join(lines)


def print_report(stats: dict, report: dict | None, per_shard: bool, store_path: Any) -> None:
    print(f"store {store_path}: codec {stats['codec']}, {stats['num_layers']} layers x "
          f"hidden {stats['hidden_size']} (raw bf16 {stats['raw_bytes_per_token']} B/token)")
    edges = [b["lo"] for b in stats["buckets"]] + [stats["buckets"][-1]["hi"]] if stats["buckets"] else []
    rows = [(f"{b['bucket']} {bucket_range(edges, b['bucket'])}", b) for b in stats["buckets"]]
    print(format_table("bucket", rows + [("total", stats["total"])]))
    print(COLUMN_LEGEND)
    if stats.get("sources"):
        print()
        print(format_table("source", [(s["name"], s) for s in stats["sources"]]))
    if per_shard:
        print()
        print(format_table("shard", [(s["name"], s) for s in stats["shards"]]))
    print(f"frozen weights: {format_bytes(stats['frozen_weights_bytes'])}")
    if stats["labels"] == "target":
        agreement = stats["label_agreement"]
        shown = "-" if agreement is None else f"{agreement:.1%}"
        print(f"labels: the target's greedy tokens (store.labels = target); the data token equals "
              f"the target's label at {shown} of the supervised positions")
    else:
        print("labels: the data tokens (store.labels = data)")
    if stats.get("optional_arrays"):
        print(f"optional arrays: {', '.join(stats['optional_arrays'])} (k={stats['topk']})")
    if stats["num_truncated"] is not None:
        print(f"{stats['num_truncated']} samples cut at max_length ({stats['max_length']} tokens)")
    if stats["incomplete_shards"]:
        print(f"incomplete shards ({len(stats['incomplete_shards'])}): {', '.join(stats['incomplete_shards'])}")
    for name, reason in stats["skipped_shards"].items():
        print(f"unreadable shard {name}: {reason}")
    if report is not None:
        for name, reason in report["bad"].items():
            print(f"BAD {name}: {reason}")
        verdict = "OK" if report["ok"] else f"FAILED ({len(report['bad'])} bad)"
        print(f"verify: {verdict}; {report['num_shards_checked']} shards, "
              f"{report['num_samples']} samples, {report['num_tokens']} tokens checked")


def plot_lengths(store_path: Any, out_path: str) -> str:
    """PNG histogram of sequence lengths, stacked and coloured by bucket."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reader = StoreReader(store_path, on_corrupt="skip")
    edges = reader.attrs["bucket_edges"]
    bins = np.linspace(0, edges[-1], 65)
    per_bucket = [reader.sample_length[reader.sample_bucket == b] for b in range(len(edges) - 1)]
    labels = [f"bucket {b} {bucket_range(edges, b)}" for b in range(len(edges) - 1)]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.hist(per_bucket, bins=bins, stacked=True, label=labels)
    for edge in edges:
        ax.axvline(edge, color="grey", linewidth=0.6, linestyle="--")
    truncated = reader.attrs.get("num_truncated")
    if truncated:
        # Cut samples all end at max_length: their spike is the truncation, not the data.
        ax.annotate(f"{truncated} cut at max_length", xy=(reader.attrs["max_length"], ax.get_ylim()[1] * 0.9),
                    ha="right", fontsize="small")
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("samples")
    ax.set_title(f"{len(reader)} samples in {len(reader.shard_names)} shards")
    ax.legend(fontsize="small")
    fig.tight_layout()
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return str(out_path)
