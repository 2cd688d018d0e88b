"""`dflash recipe`: the whole pipeline as one resumable command with a report.

generate (every source of `recipe.sources`, side by side with `recipe.parallel_generates`) -> stage
one -> stage two -> export (the last checkpoint, and every earlier one with `recipe.curve`) -> eval
(every set of `recipe.evals` at each of its temperatures, side by side with `recipe.parallel_evals`)
-> the teacher-forced walk of the temperature-0 held-out evals -> the evals served side by side timed last, in
one process alone on the GPU (`dflash time-evals`). Each part is a `python -m stages.cli`
subprocess; its completion record (run_dir/results/PART.json) is written after it succeeded, and a
rerun skips the complete parts and continues a killed one the way that stage resumes (generate's and
stage one's shards, stage two's checkpoints, evals rerun). The library is dflash/pipeline/.
"""

from importlib import resources
from pathlib import Path

from dflash.config import Config, ConfigError
from dflash.pipeline import records, report
from dflash.pipeline.layout import RunLayout
from dflash.pipeline.parts import PHASES, RecipeRun
from dflash.pipeline.runner import run_recipe, say

DEFAULT_CONFIG = "tiny-recipe.toml"  # the embedded tiny recipe, when no -c is given


def default_config_path() -> str:
    """configs/tiny-recipe.toml of this source tree, or as installed (dflash.configs)."""
    beside = Path(__file__).resolve().parents[1] / "configs" / DEFAULT_CONFIG
    return str(beside) if beside.is_file() else str(resources.files("dflash.configs").joinpath(DEFAULT_CONFIG))


def phase_of(start_from: str | None) -> str:
    """The phase `--from` names (a phase, or a part of it); the first without it."""
    if not start_from:
        return PHASES[0]
    phase = start_from if start_from in PHASES else next(
        (name for name in PHASES if start_from.startswith(name)), None)
    if phase is None:
        raise ConfigError(f"--from {start_from}: not a part or phase of the recipe (phases: {', '.join(PHASES)})")
    return phase


def start_phase(run: RecipeRun, start_from: str | None) -> str:
    """The phase `--from` names, its records and later ones cleared."""
    phase = phase_of(start_from)
    if not start_from:
        return phase
    cleared = records.clear_from(run.layout, phase)
    if cleared:
        say(f"--from {start_from}: rerunning {', '.join(cleared)} and what follows")
    return phase


def end_phase(until: str | None, start: str) -> str:
    """The last phase to run: `--until`'s (a phase), or the last one."""
    if not until:
        return PHASES[-1]
    if until not in PHASES:
        raise ConfigError(f"--until {until}: not a phase of the recipe (phases: {', '.join(PHASES)})")
    if PHASES.index(until) < PHASES.index(start):
        raise ConfigError(f"--until {until} comes before the phase the run starts from ({start})")
    return until


def run(config: Config, config_path: str | None, overrides: tuple[str, ...], start_from: str | None = None,
        until: str | None = None) -> dict:
    """The recipe, then its report; returns report.json's content. With `until` before the last phase: the phases up
    to it, no report (returns {})."""
    recipe_run = RecipeRun(config, config_path, tuple(overrides))
    last = end_phase(until, phase_of(start_from))  # both checked before --from clears anything
    run_recipe(recipe_run, start_phase(recipe_run, start_from), last)
    if last != PHASES[-1]:
        say(f"stopped after {last} (--until): a rerun without --until continues from "
            f"{PHASES[PHASES.index(last) + 1]}; the report is written once the last phase has run")
        return {}
    return report.write_report(recipe_run.layout)


def rerender(run_dir: str) -> None:
    """`--report RUN_DIR`: report.md and the plots again, from report.json (gathered anew from the run's
    JSON files when report.json is missing)."""
    layout = RunLayout(Path(run_dir))
    if not layout.report_json.is_file():
        if not layout.records.is_dir():
            raise ConfigError(f"--report {run_dir}: no recipe run there (no results/ folder)")
        report.write_report(layout)
        return
    report.render(layout)
