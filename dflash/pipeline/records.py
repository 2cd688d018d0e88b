"""Completion records: run_dir/results/PART.json, written only after a part succeeded, with its wall
time, its command, its outputs and a few facts read from what it wrote (never from a log).

A rerun skips a part whose record is valid: the record exists, was written for the same command and
every output it names still exists. `clear_from` deletes the records of a phase and every later one
(`dflash recipe --from PART`)."""

import json
import time
from pathlib import Path

from dflash.outputs import write_text_atomic
from dflash.pipeline.layout import RunLayout
from dflash.pipeline.parts import PHASES, Part


FINISHED_FORMAT = "%Y-%m-%dT%H:%M:%S%z"  # a record's "finished": local time with its UTC offset


def write_record(layout: RunLayout, part: Part, seconds: float, ran: list[str], facts: dict) -> dict:
    """The record of `part`, which just succeeded after `seconds` running `ran`."""
    record = {"part": part.name, "phase": part.phase, "command": part.command, "ran": ran, "seconds": seconds,
              "finished": time.strftime(FINISHED_FORMAT), "outputs": [str(path) for path in part.outputs],
              "facts": facts}
    write_text_atomic(layout.record(part.name), json.dumps(record, indent=1) + "\n")
    return record


def read_record(layout: RunLayout, name: str) -> dict | None:
    path = layout.record(name)
    return json.loads(path.read_text()) if path.is_file() else None


def all_records(layout: RunLayout) -> list[dict]:
    """Every completion record, in phase order (then by name)."""
    found = [json.loads(path.read_text()) for path in sorted(layout.records.glob("*.json"))]
    return sorted(found, key=lambda record: (PHASES.index(record["phase"]), record["part"]))


def is_complete(layout: RunLayout, part: Part) -> bool:
    """Whether `part` ran to its end with this very command (whichever Python ran it) and its outputs are
    still there."""
    record = read_record(layout, part.name)
    return (record is not None and record["command"][1:] == part.command[1:]
            and all(Path(path).exists() for path in part.outputs))


def clear_from(layout: RunLayout, phase: str) -> list[str]:
    """Delete the records of `phase` and every later phase; returns the parts cleared."""
    later = set(PHASES[PHASES.index(phase):])
    cleared = []
    for record in all_records(layout):
        if record["phase"] in later:
            layout.record(record["part"]).unlink()
            cleared.append(record["part"])
    return cleared
