"""`dflash inspect-cache`: print bucket and shard statistics of a store, verify it, plot lengths.

`run` returns a plain dict (statistics, the verification report, `ok`); the CLI maps
`ok == False` to exit code 1. Verification, statistics and the tables are dflash/store/inspection.py's.
"""

from __future__ import annotations

import json
from typing import Any

from dflash.store.inspection import plot_lengths, print_report, repair_store, store_stats, verify_store
from dflash.store.reader import check_is_store


def run(store_path: Any, as_json: bool = False, verify: bool = False,
        per_shard: bool = False, plot: str | None = None, repair: bool = False) -> dict:
    """Statistics (and optionally verification, repair and a length plot) of the store at `store_path`.

    `repair` (with `verify`) removes the bad shards so that stage one rewrites them."""
    check_is_store(store_path)
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
        print_report(stats, report, per_shard, store_path)
        if removed:
            print(f"repair: removed {len(removed)} bad shard(s) or array(s): {', '.join(removed)}; rerun stage "
                  f"one with the same config to rewrite them (it redoes only what is missing)")
        if plot:
            print(f"length histogram written to {plot}")
    return result
