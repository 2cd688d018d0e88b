"""`dflash recipe`'s report: report.json gathered from the parts' records, stage two's metrics.jsonl and
the eval and walk JSONs (their numbers copied, never recomputed), report.md and PNG plots rendered
from report.json alone (`dflash recipe --report RUN_DIR` renders again)."""

import json
from datetime import datetime, timedelta
from pathlib import Path

from dflash.outputs import write_text_atomic
from dflash.pipeline import records
from dflash.pipeline.layout import RunLayout

RESULT_KEYS = ("drafter", "proposal", "temperature", "num_prompts", "max_new_tokens", "generated_tokens",
               "verifications", "tau", "speedup", "spec_tokens_per_s", "baseline_tokens_per_s", "tau_in_code",
               "verifications_in_code", "tau_outside_code", "verifications_outside_code", "tau_by_kind",
               "histogram", "slot_acceptance", "mismatched_prompts", "timed_prompts", "timing", "ms_per_verification",
               "baseline_ms_per_token", "target_graphs")
RATES = {"generate": ("answers", "answers/s"), "extract": ("tokens", "tokens/s"), "train": ("tokens_seen", "tokens/s"),
         "eval": ("generated_tokens", "tokens/s")}


def gather(layout: RunLayout) -> dict:
    """report.json's content, from the run folder's JSON files."""
    done = records.all_records(layout)
    metrics = read_metrics(layout.drafter / "metrics.jsonl")
    steps = {str(Path(record["outputs"][0]).parent): record["facts"]["step"] for record in done
             if record["phase"] == "export"}
    return {"run_dir": str(layout.root), "seconds": sum(record["seconds"] for record in done),
            "wall_seconds": wall_seconds(done),
            "parts": [part_row(record) for record in done], "mix": mix(done, metrics),
            "train": train_summary(metrics), "evals": [eval_entry(record, steps, metrics) for record in done
                                                       if record["phase"] == "eval"],
            "walk": walk_rows(layout.walk_json)}


def wall_seconds(done: list[dict]) -> float | None:
    """From the first part's start to the last part's end (parts side by side overlap, so the parts' sum
    is more); a run killed and rerun counts the time between too. None without records."""
    spans = []
    for record in done:
        try:
            end = datetime.strptime(record.get("finished", ""), records.FINISHED_FORMAT)
        except ValueError:  # a record without its time of day: no end-to-end figure
            return None
        spans.append((end - timedelta(seconds=record["seconds"]), end))
    return (max(end for _, end in spans) - min(start for start, _ in spans)).total_seconds() if spans else None


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.is_file() else []


def part_row(record: dict) -> dict:
    row = {"part": record["part"], "phase": record["phase"], "seconds": record["seconds"]}
    key, unit = RATES.get(record["phase"], (None, ""))
    if key and record["facts"].get(key):
        row["rate"], row["rate_unit"] = record["facts"][key] / max(record["seconds"], 1e-9), unit
    return row


def mix(done: list[dict], metrics: list[dict]) -> list[dict]:
    """Each source: its weight and share of the weights, the answers the target wrote, the tokens of them
    in the store (a store of data.mix counts them per source) and, where stage two logs them as
    `tokens_seen/NAME`, the tokens trained on."""
    last = next((line for line in reversed(metrics) if "tokens_seen" in line), {})
    stored = next((record["facts"] for record in done if record["phase"] == "extract"), {})
    sources = [record["facts"] for record in done if record["phase"] == "generate"]
    by_source = stored.get("tokens_by_source") or ({sources[0]["source"]: stored.get("tokens")} if len(sources) == 1
                                                   else {})
    total = sum(source["weight"] for source in sources)
    return [{"source": source["source"], "prompts": source["prompts"], "weight": source["weight"],
             "share": source["weight"] / total, "answers": source.get("answers"),
             "stored_tokens": by_source.get(source["source"]), "tokens_seen": last.get(f"tokens_seen/{source['source']}")}
            for source in sources]


def train_summary(metrics: list[dict]) -> dict:
    held = [line for line in metrics if "eval/tau" in line]
    seen = [line for line in metrics if "tokens_seen" in line]
    return {"steps": max((line.get("step", 0) for line in metrics), default=0),
            "tokens_seen": seen[-1]["tokens_seen"] if seen else 0,
            "heldout_tau": held[-1]["eval/tau"] if held else None,
            "heldout_served_tau": held[-1].get("eval/served_tau") if held else None,
            "curve": [{"step": line["step"], "heldout_tau": line["eval/tau"],
                       "heldout_served_tau": line.get("eval/served_tau")} for line in held]}


def tokens_at(metrics: list[dict], step: int | None) -> int | None:
    """Tokens seen by `step` (the last logged line at or before it)."""
    seen = [line for line in metrics if "tokens_seen" in line and (step is None or line["step"] <= step)]
    return seen[-1]["tokens_seen"] if seen else None


def eval_entry(record: dict, steps: dict, metrics: list[dict]) -> dict:
    results = json.loads(Path(record["outputs"][0]).read_text())["results"]
    rows = []
    for result in results:
        row = {key: result[key] for key in RESULT_KEYS if key in result}
        row["step"] = steps.get(str(Path(result["drafter"])))
        row["tokens_seen"] = tokens_at(metrics, row["step"])
        rows.append(row)
    return {"part": record["part"], "eval_set": record["facts"]["eval_set"], "prompts": record["facts"]["prompts"],
            "temperature": record["facts"]["temperature"], "json": record["outputs"][0], "results": rows}


def walk_rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    keys = ("eval", "drafter", "checkpoint", "walked_prompts", "served_tau", "served_tau_same_prompts",
            "teacher_forced_tau", "ratio")
    return [{key: entry[key] for key in keys} for entry in json.loads(path.read_text())["walks"]]


def write_report(layout: RunLayout) -> dict:
    """Gather report.json, then render report.md and the plots from it."""
    report = gather(layout)
    write_text_atomic(layout.report_json, json.dumps(report, indent=1) + "\n")
    render(layout)
    return report


def render(layout: RunLayout) -> None:
    """report.md and the PNGs from report.json alone."""
    report = json.loads(layout.report_json.read_text())
    plots = draw_plots(report, layout.plots)
    write_text_atomic(layout.report_md, markdown(report, [path.relative_to(layout.root) for path in plots]))
    print(f"report: {layout.report_md} ({len(plots)} plots under {layout.plots})")


def number(value, digits: int = 3) -> str:
    """A number as the tables show it; none (or NaN: a walk with no prompt walked) as "-"."""
    return "-" if value is None or value != value else f"{value:,.{digits}f}"


def markdown(report: dict, plots: list[Path]) -> str:
    lines = [f"# Recipe report: {report['run_dir']}", "", took(report), "",
             "## Parts", "", "| part | seconds | rate |", "|---|---:|---:|"]
    lines += [f"| {row['part']} | {row['seconds']:,.1f} | "
              f"{number(row.get('rate'), 1) + ' ' + row['rate_unit'] if 'rate' in row else ''} |"
              for row in report["parts"]]
    lines += ["", "## Data mix as trained", "", "| source | prompts | weight (share) | answers | tokens stored | "
              "tokens trained |", "|---|---|---:|---:|---:|---:|"]
    lines += [f"| {row['source']} | {row['prompts']} | {row['weight']:g} ({row['share']:.1%}) | {row['answers']} | "
              f"{number(row['stored_tokens'], 0)} | {number(row['tokens_seen'], 0)} |" for row in report["mix"]]
    train = report["train"]
    lines += ["", "## Stage two", "", f"{train['steps']} steps, {int(train['tokens_seen']):,} tokens seen; last held-out "
              f"teacher-forced tau {number(train['heldout_tau'])}, walked as served "
              f"{number(train['heldout_served_tau'])}.", ""]
    lines += served_tables(report["evals"])
    lines += sampling_table(report["evals"])
    if report["walk"]:
        lines += ["## Teacher-forced (walk) vs served, same prompts", "",
                  "| eval | drafter | prompts | teacher-forced tau | served tau | ratio |", "|---|---|---:|---:|---:|---:|"]
        lines += [f"| {Path(row['eval']).stem} | {Path(row['drafter']).name} | {row['walked_prompts']} | "
                  f"{number(row['teacher_forced_tau'])} | {number(row['served_tau_same_prompts'])} | "
                  f"{number(row['ratio'])} |" for row in report["walk"]]
        lines.append("")
    lines += ["## Plots", ""] + [f"![{path.stem}]({path})" for path in plots]
    return "\n".join(lines) + "\n"


def took(report: dict) -> str:
    """The report's first line: the run end to end, and the parts' summed seconds."""
    wall = report.get("wall_seconds")
    if wall is None:
        return f"{report['seconds']:,.1f} s summed over the parts."
    return (f"{wall:,.0f} s end to end, from the first part's start to the last part's end ({report['seconds']:,.1f} s "
            f"summed over the parts, which overlap where they run side by side).")


def served_tables(evals: list[dict]) -> list[str]:
    """Served tau per eval set, temperature, proposal and drafter (the eval JSONs' numbers)."""
    lines = ["## Served", "", "| eval set | prompts | T | proposal | drafter | step | tokens seen | tau | speedup | "
             "tau in code | tau in prose | tau by kind |", "|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for entry in evals:
        for row in entry["results"]:
            kinds = ", ".join(f"{kind} {tau:.3f}" for kind, tau in (row.get("tau_by_kind") or {}).items())
            lines.append(f"| {entry['eval_set']} | {entry['prompts']} | {entry['temperature']:g} | "
                         f"{row.get('proposal', '') or ''} | {Path(row['drafter']).name} | {row['step']} | "
                         f"{number(row['tokens_seen'], 0)} | {number(row['tau'])} | {speedup_cell(row)} | "
                         f"{number(row.get('tau_in_code') if row.get('verifications_in_code') else None)} | "
                         f"{number(row.get('tau_outside_code') if row.get('verifications_outside_code') else None)} | "
                         f"{kinds} |")
    return lines + [""]


def sampling_table(evals: list[dict]) -> list[str]:
    """What sampling keeps: each eval set's tau at T > 0 as a fraction of the same drafter's tau on the same set at
    T = 0, against the same policy (T = 0 serves `stree:N` as `tree:N`; draws at F x T have no T = 0 row of their
    own), the chain (greedy verification of the argmax block) and the best T = 0 policy."""
    greedy = {}  # (eval set, drafter) -> {proposal: tau} at T = 0
    for entry in evals:
        if entry["temperature"] == 0:
            for row in entry["results"]:
                greedy.setdefault((entry["eval_set"], row["drafter"]), {})[row.get("proposal") or ""] = row["tau"]
    rows = []
    for entry in (entry for entry in evals if entry["temperature"] > 0):
        for row in entry["results"]:
            at_zero = greedy.get((entry["eval_set"], row["drafter"]))
            if not at_zero:
                continue
            chain = next((at_zero[name] for name in ("sample", "argmax", "") if name in at_zero), None)
            ratios = [row["tau"] / tau if tau else None for tau in
                      (at_zero.get(row.get("proposal") or ""), chain, max(at_zero.values()))]
            rows.append(f"| {entry['eval_set']} | {entry['temperature']:g} | {row.get('proposal', '') or ''} | "
                        f"{Path(row['drafter']).name} | {number(row['tau'])} | {speedup_cell(row)} | "
                        + " | ".join(number(ratio, 2) for ratio in ratios) + " |")
    if not rows:
        return []
    return ["## Sampling against greedy", "", "Served tau at T > 0 as a fraction of the same drafter's on the same set "
            "at T = 0: the same policy's, the chain's and the best policy's.", "",
            "| eval set | T | proposal | drafter | tau | speedup | x same policy at T=0 | x chain at T=0 | "
            "x best at T=0 |", "|---|---:|---|---|---:|---:|---:|---:|---:|", *rows, ""]


def speedup_cell(row: dict) -> str:
    """The speedup, and over how many prompts when not every prompt's time counts: "alone" where they were decoded
    again in one process alone on the GPU after the rest (`dflash time-evals`); none yet where that is still to run;
    "target graphs" where the timed target ran as CUDA graphs over a static cache (else transformers' forward)."""
    timing, timed = row.get("timing"), row.get("timed_prompts")  # no timing: a report of before 12-06 17:30
    if timing == "deferred":
        return "not timed yet"
    partial = bool(timed and row.get("num_prompts") and timed < row["num_prompts"])
    notes = [f"{timed} {'timed' if timing == 'inline' else 'alone'}"] if timed and (timing == "alone" or partial) else []
    notes += ["target graphs"] if row.get("target_graphs") else []
    return number(row["speedup"], 2) + (f" ({', '.join(notes)})" if notes else "")


def draw_plots(report: dict, folder: Path) -> list[Path]:
    """The served curve, acceptance-length histograms, per-slot acceptance and temperature 0 vs 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    drawn = []
    for name, draw in (("served-curve", draw_curve), ("acceptance-lengths", draw_histograms),
                       ("slot-acceptance", draw_slots), ("temperatures", draw_temperatures)):
        figure, axes = plt.subplots(figsize=(7, 4.5))
        if draw(axes, report["evals"]):
            axes.legend(fontsize="small")
            figure.tight_layout()
            figure.savefig(folder / f"{name}.png", dpi=100)
            drawn.append(folder / f"{name}.png")
        plt.close(figure)
    return drawn


def last_results(evals: list[dict]):
    """(entry, its last checkpoint's result) per eval; results[0] is the last checkpoint's."""
    return [(entry, entry["results"][0]) for entry in evals if entry["results"]]


def draw_curve(axes, evals: list[dict]) -> bool:
    """One line per eval and proposal policy served at more than one checkpoint."""
    drawn = False
    for entry in evals:
        by_policy: dict[str, list] = {}
        for row in entry["results"]:
            by_policy.setdefault(row.get("proposal") or "", []).append((row["tokens_seen"] or 0, row["tau"]))
        for policy, points in by_policy.items():
            if len(points) > 1:
                suffix = f", {policy}" if len(by_policy) > 1 else ""
                axes.plot(*zip(*sorted(points)), marker="o",
                          label=f"{entry['eval_set']} (T={entry['temperature']:g}{suffix})")
                drawn = True
    axes.set(xlabel="tokens seen", ylabel="served tau", title="served curve")
    return drawn


def draw_histograms(axes, evals: list[dict]) -> bool:
    found = last_results(evals)
    width = 0.8 / max(len(found), 1)
    for index, (entry, row) in enumerate(found):
        fractions = [count / max(row["verifications"], 1) for count in row["histogram"]]
        axes.bar([k + 1 + (index - (len(found) - 1) / 2) * width for k in range(len(fractions))], fractions, width,
                 label=f"{entry['part']}: tau {row['tau']:.2f}")
    axes.set(xlabel="tokens committed per target forward", ylabel="fraction of verifications",
             title="acceptance lengths (last checkpoint)")
    return bool(found)


def draw_slots(axes, evals: list[dict]) -> bool:
    found = last_results(evals)
    for entry, row in found:
        axes.plot(range(1, len(row["slot_acceptance"]) + 1), row["slot_acceptance"], marker="o", label=entry["part"])
    axes.set(xlabel="block slot", ylabel="fraction of blocks accepting it", ylim=(0, 1),
             title="per-slot acceptance (last checkpoint)")
    return bool(found)


def draw_temperatures(axes, evals: list[dict]) -> bool:
    """Each eval set served at several temperatures: the last checkpoint's tau at each."""
    by_set: dict[str, list] = {}
    for entry, row in last_results(evals):
        by_set.setdefault(entry["eval_set"], []).append((entry["temperature"], row["tau"]))
    several = {name: sorted(points) for name, points in by_set.items() if len(points) > 1}
    for name, points in several.items():
        axes.plot(*zip(*points), marker="o", label=name)
    axes.set(xlabel="temperature", ylabel="served tau", title="served tau by temperature (last checkpoint)")
    return bool(several)
