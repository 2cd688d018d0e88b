"""`dflash recipe` end to end on the CPU with its tiny default (configs/tiny-recipe.toml): every part runs and
the report is written; a recipe killed (SIGKILL of its process group) inside generate, stage one, stage two
and an eval, then rerun (its evals side by side and untimed, the walk beside them, then every eval's timed prompt
decoded again alone by `dflash time-evals`), serves the same numbers as one never interrupted."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


# 2 anchors per sequence instead of the default's 16: every anchor's block is 16 rows of 248K-vocabulary logits, and
# on 2 cores stage two took 131 of the default recipe's 250 s (at 4 anchors, 16 s of CPU for its 4 steps, 11 at 2);
# the parts and their resumption are the same.
CHEAPER = ("train.max_anchors=2", "train.eval_served_tokens=2")


def recipe(run_dir: Path, cache: Path, *settings: str) -> list[str]:
    sets = [arg for setting in (*CHEAPER, *settings) for arg in ("--set", setting)]
    return [sys.executable, "-m", "stages.cli", "recipe", "--set", f"recipe.run_dir={run_dir}",
            "--set", f"data.cache_dir={cache}", *sets]


def environment() -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")


def run_to_end(run_dir: Path, cache: Path, *settings: str) -> str:
    done = subprocess.run(recipe(run_dir, cache, *settings), cwd=run_dir.parent, env=environment(), capture_output=True,
                          text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def kill_when(run_dir: Path, cache: Path, appeared, *settings: str) -> None:
    """Start the recipe, SIGKILL it and its parts as soon as `appeared(run_dir)` holds."""
    process = subprocess.Popen(recipe(run_dir, cache, *settings), cwd=run_dir.parent, env=environment(),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        while not appeared(run_dir):
            assert process.poll() is None, "the recipe ended before the moment it was to be killed at"
            time.sleep(0.2)
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def older_than(path: Path, seconds: float) -> bool:
    return path.exists() and time.time() - path.stat().st_mtime > seconds


def served(run_dir: Path) -> list:
    """Every eval's served numbers, per drafter (the wall-clock ones left out)."""
    keys = ("tau", "histogram", "slot_acceptance", "generated_tokens", "verifications")
    return [(path.name, [[result[key] for key in keys] for result in json.loads(path.read_text())["results"]])
            for path in sorted((run_dir / "evals").glob("eval-*.json"))]


def test_the_tiny_recipe_reports_and_resumes_after_kills_with_the_same_served_numbers(tmp_path):
    cache = tmp_path / "cache"
    whole = tmp_path / "whole"
    whole.mkdir()
    output = run_to_end(whole, cache)
    assert "recipe: train: done in" in output
    text = (whole / "report.md").read_text()
    assert "## Served" in text and "## Teacher-forced (walk) vs served" in text
    for name in ("served-curve", "acceptance-lengths", "slot-acceptance", "temperatures"):
        assert (whole / "plots" / f"{name}.png").stat().st_size > 0
    report = json.loads((whole / "report.json").read_text())
    first = json.loads((whole / "evals" / "eval-heldout-t0.json").read_text())["results"][0]
    assert report["evals"][0]["results"][0]["tau"] == first["tau"]  # the eval JSON's number, copied

    killed = tmp_path / "killed"
    killed.mkdir()
    moments = [lambda root: any((root / "answers" / "code-docs").glob("part-*.jsonl")),  # generate
               lambda root: any((root / "store" / "shards").glob("*")),  # stage one's first shard
               lambda root: (root / "drafter" / "checkpoints" / "step-00000002" / "state.json").exists(),
               lambda root: older_than(root / "results" / "export-00000002.json", 5.0)]  # inside the first eval
    # the killed run serves its evals side by side, untimed, the walk starting beside the temperature-1 eval once the
    # temperature-0 one is written; the last phase times each eval's first prompt in one process alone
    side_by_side = ("recipe.parallel_evals=true", "recipe.timed_prompts=1")
    for moment in moments:
        kill_when(killed, cache, moment, *side_by_side)
    output = run_to_end(killed, cache, *side_by_side)
    assert "(continuing: --resume)" in output or "train: complete" in output
    assert served(killed) == served(whole)
    for path in sorted((killed / "evals").glob("eval-*.json")):
        assert {(result["timing"], result["timed_prompts"])
                for result in json.loads(path.read_text())["results"]} == {("alone", 1)}, path.name
    report_md = (killed / "report.md").read_text()
    assert "(1 alone) |" in report_md and "not timed yet" not in report_md
    assert "recipe: walk: what it reads is written (eval-heldout-t0): beside the rest" in output or \
        "eval-heldout-t0: complete" in output
