"""`dflash inspect-cache`: print bucket and shard statistics of a store, verify it, plot lengths.

`run` returns a plain dict (statistics, the verification report, `ok`); the CLI maps
`ok == False` to exit code 1.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from dflash.store import StoreReader, repair_store, store_stats, verify_store

COLUMNS = (
    ("samples", "samples", "{:d}"), ("tokens", "tokens", "{:d}"),
    ("min_length", "min", "{:d}"), ("median_length", "median", "{:.1f}"), ("max_length", "max", "{:d}"),
    ("supervised_share", "sup%", "{:.1%}"), ("stored_bytes", "stored", None),
    ("bytes_per_token", "B/tok", "{:.1f}"), ("compression_ratio", "ratio", "{:.2f}x"),
)


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


def _print_report(stats: dict, report: dict | None, per_shard: bool, store_path: Any) -> None:
    print(f"store {store_path}: codec {stats['codec']}, {stats['num_layers']} layers x "
          f"hidden {stats['hidden_size']} (raw bf16 {stats['raw_bytes_per_token']} B/token)")
    rows = [(f"{b['bucket']} [{b['lo']},{b['hi']})", b) for b in stats["buckets"]]
    print(format_table("bucket", rows + [("total", stats["total"])]))
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
    labels = [f"bucket {b} [{edges[b]},{edges[b + 1]})" for b in range(len(edges) - 1)]
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


def run(store_path: Any, as_json: bool = False, verify: bool = False,
        per_shard: bool = False, plot: str | None = None, repair: bool = False) -> dict:
    """Statistics (and optionally verification, repair and a length plot) of the store at `store_path`.

    `repair` (with `verify`) removes the bad shards so that stage one rewrites them."""
    stats = store_stats(store_path)
    report = verify_store(store_path).to_dict() if verify else None
    removed = repair_store(store_path, report["bad"]) if repair and report and report["bad"] else []
    result = {
        "repaired": removed,
        "store": str(store_path),
        "stats": stats,
        "verify": report,
        "ok": report["ok"] if report is not None else True,
        "plot": plot_lengths(store_path, plot) if plot else None,
    }
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        _print_report(stats, report, per_shard, store_path)
        if removed:
            print(f"repair: removed {len(removed)} bad shard(s) or array(s): {', '.join(removed)}; rerun stage "
                  f"one with the same config to rewrite them (it redoes only what is missing)")
        if plot:
            print(f"length histogram written to {plot}")
    return result
