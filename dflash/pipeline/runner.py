"""Runs `dflash recipe`'s parts: phase by phase, each phase planned once the earlier ones finished,
its parts one after the other or side by side (subprocesses at once on the one GPU). One line per
part as it starts and ends, with its wall time (side by side: each part's own, from its start to its
end); the parts' own output (their progress bars) passes through. A part whose record is valid is
skipped; a failed one stops the recipe with an error naming it.

The walk reads only the temperature-0 held-out evals' JSONs, which side by side end minutes before the
chat evals do: it starts beside the evals still running as soon as the ones it reads are written (a
follower of the eval phase), instead of after the last of them. Its phase then finds it complete."""

import json
import os
import subprocess
import time
from pathlib import Path

from dflash.dist import share_threads
from dflash.errors import DflashError
from dflash.pipeline import records
from dflash.pipeline.parts import PHASES, PLANNERS, Part, RecipeRun, side_by_side, walk_parts, walked_evals

POLL_SECONDS = 1.0  # side by side: how often the parts' processes are looked at


class PartFailed(DflashError):
    """A part's subprocess exited with an error; the message names the part and its command."""


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] recipe: {text}", flush=True)


def run_recipe(run: RecipeRun, start_phase: str = PHASES[0], end_phase: str = PHASES[-1]) -> None:
    """Every phase from `start_phase` (earlier phases must be complete) to `end_phase`, then nothing else: the
    report is `dflash.pipeline.report`'s."""
    run.layout.records.mkdir(parents=True, exist_ok=True)
    for phase in PHASES[PHASES.index(start_phase):PHASES.index(end_phase) + 1]:
        parts = PLANNERS[phase](run)
        todo = [part for part in parts if not skipped(run, part)]
        if todo:
            at_once = side_by_side(run.config, phase) and len(todo) > 1
            run_parts(run, todo, at_once, followers(run, phase, todo) if at_once else [])


def followers(run: RecipeRun, phase: str, todo: list[Part]) -> list[tuple[Part, set[str]]]:
    """The parts of later phases that may start beside `todo` once the parts of it they read have ended:
    the walk, beside the evals, when some eval it reads is still to run (`(part, names it waits for)`)."""
    if phase != "eval":
        return []
    names = {part.name for part in todo}
    read = {path.stem for path in walked_evals(run)}
    return [(part, read & names) for part in walk_parts(run)
            if read & names and not records.is_complete(run.layout, part)]


def skipped(run: RecipeRun, part: Part) -> bool:
    if part.stale or not records.is_complete(run.layout, part):
        return False
    record = records.read_record(run.layout, part.name)
    say(f"{part.name}: complete ({record['seconds']:.1f} s, {record['finished']}), skipped")
    return True


def run_parts(run: RecipeRun, parts: list[Part], at_once: bool,
              following: list[tuple[Part, set[str]]] = ()) -> None:
    """`parts` in turn, or all started at once and waited for, each recorded when it ends; a follower
    `(part, names)` starts beside the others once the parts named have ended well. A failure stops the
    recipe after the others ended (their records are written: a rerun keeps them); followers not yet
    started then stay for their own phase."""
    if not at_once:
        for part in parts:
            finish(run, part, *start(part))
        return
    say(f"{', '.join(part.name for part in parts)}: side by side")
    share = len(parts) + len(following)  # every part's CPU threads: its share of the host (followers come later)
    running = [(part, *start(part, share)) for part in parts]
    waiting, ended, failures = list(following), set(), []
    while running:
        for item in [item for item in running if item[1].poll() is not None]:
            running.remove(item)
            error = finish_quietly(run, *item)
            if error:
                failures.append(error)
            else:
                ended.add(item[0].name)
        for follower in [follower for follower in waiting if follower[1] <= ended and not failures]:
            waiting.remove(follower)
            say(f"{follower[0].name}: what it reads is written ({', '.join(sorted(follower[1]))}): beside the rest")
            running.append((follower[0], *start(follower[0], share)))
        if running:
            time.sleep(POLL_SECONDS)
    if failures:
        raise failures[0]


def start(part: Part, side_by_side: int = 1) -> tuple[subprocess.Popen, float, list[str]]:
    """Start `part`, one of `side_by_side` parts at once (each gets that share of the CPU threads)."""
    command = part.command + part.resume_args
    say(f"{part.name}: started{' (continuing: ' + ' '.join(part.resume_args) + ')' if part.resume_args else ''}: "
        f"{' '.join(command)}")
    env = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_MODE="disabled")
    if side_by_side > 1:
        env = share_threads(side_by_side, env)
    if part.phase == "train":  # stage two names every recompile's failed guard (TORCH_LOGS= turns it off)
        env.setdefault("TORCH_LOGS", "recompiles")
    return subprocess.Popen(command, env=env), time.monotonic(), command


def finish(run: RecipeRun, part: Part, process: subprocess.Popen, began: float, command: list[str]) -> None:
    code = process.wait()
    seconds = time.monotonic() - began
    if code != 0:
        say(f"{part.name}: failed (exit {code}) after {seconds:.1f} s")
        raise PartFailed(f"recipe part {part.name} failed with exit code {code}: {' '.join(command)} "
                         f"(rerun `dflash recipe` to continue from it)")
    records.write_record(run.layout, part, seconds, command, {**part.info, **facts(run, part)})
    say(f"{part.name}: done in {seconds:.1f} s")


def finish_quietly(run: RecipeRun, part: Part, process, began, command) -> PartFailed | None:
    try:
        finish(run, part, process, began, command)
    except PartFailed as error:
        return error
    return None


def facts(run: RecipeRun, part: Part) -> dict:
    """What a finished part made, read from the files it wrote (for the report's rates)."""
    layout = run.layout
    if part.phase == "generate":
        folder = part.outputs[0].parent
        return {"answers": sum(1 for path in folder.glob("part-*.jsonl") for _ in path.open())}
    if part.phase == "extract":
        from dflash.store.reader import StoreReader

        reader = StoreReader(layout.store)
        found = {"samples": len(reader), "tokens": int(reader.sample_length.sum()),
                 "supervised_tokens": int(reader.sample_num_supervised.sum())}
        if getattr(reader, "source_names", None) and hasattr(reader, "sample_source"):  # a store of data.mix
            found["tokens_by_source"] = {name: int(reader.sample_length[reader.sample_source == number].sum())
                                         for number, name in enumerate(reader.source_names)}
        return found
    if part.phase == "train":
        lines = [json.loads(line) for line in (layout.drafter / "metrics.jsonl").read_text().splitlines() if line]
        seen = [line for line in lines if "tokens_seen" in line]
        return {"steps": max((line.get("step", 0) for line in lines), default=0),
                "tokens_seen": seen[-1]["tokens_seen"] if seen else 0}
    if part.phase == "eval":
        results = json.loads(Path(part.outputs[0]).read_text())["results"]
        return {"generated_tokens": sum(result["generated_tokens"] for result in results),
                "drafters": len(results)}
    return {}
