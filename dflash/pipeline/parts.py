"""The parts of `dflash recipe`, planned from the config phase by phase.

Each part is one `python -m stages.cli ...` subprocess (the walk: `python -m dflash.train.walk`) with
the outputs that show it finished. Every command gets the recipe's `-c`/`--set` and the run folder's
paths (store.path, train.out_dir, data.source or data.mix), so each stage reads the same config as the
recipe. Flags of features that are off (`--turns 1`, no `--proposal`) are left out.
"""

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from dflash.config import Config, ConfigError, RecipeEval, RecipeSource
from dflash.pipeline.layout import RunLayout
from dflash.train.checkpoint import STEP_PREFIX, complete_checkpoints, latest_checkpoint

PHASES = ("generate", "extract", "train", "export", "eval", "walk", "time")
HELDOUT = "heldout"  # `dflash eval --prompts heldout[:SOURCE]`: the store's held-out prompts, walkable


@dataclass(frozen=True)
class Part:
    name: str  # unique in a run: its record's file name
    phase: str  # one of PHASES
    command: list[str]  # what the record is valid for
    outputs: tuple[Path, ...]  # what must exist for its record to stay valid
    resume_args: list[str] = field(default_factory=list)  # added when it continues a killed run (stage two)
    info: dict = field(default_factory=dict)  # planned facts its record keeps (a source's weight, an export's step)
    stale: bool = False  # what it wrote was since replaced (an eval served again): it runs even with a valid record


@dataclass(frozen=True)
class RecipeRun:
    """What every part is planned from: the loaded config and how it was given."""
    config: Config
    config_path: str | None
    overrides: tuple[str, ...]

    @property
    def layout(self) -> RunLayout:
        return RunLayout(Path(self.config.recipe.run_dir))


def sources(config: Config) -> tuple[RecipeSource, ...]:
    """The recipe's sources, each named (empty `recipe.sources`: data.source answered greedily)."""
    found = config.recipe.sources or (RecipeSource(source=config.data.source),)
    named = tuple(RecipeSource(**{**vars(source), "name": source.name or source_name(source.source)})
                  for source in found)
    names = [source.name for source in named]
    for name in names:
        if names.count(name) > 1:
            raise ConfigError(f"recipe.sources: two sources are named {name!r}; give each its own name")
    return named


def source_name(source: str) -> str:
    """embedded:code-docs -> code-docs; /data/chats.jsonl -> chats."""
    return Path(source.removeprefix("embedded:").rstrip("/")).stem or "data"


def evals(config: Config) -> tuple[RecipeEval, ...]:
    found = config.recipe.evals or (RecipeEval(name=HELDOUT),)
    named = tuple(RecipeEval(**{**vars(item), "name": item.name or source_name(item.prompts.replace(":", "-"))})
                  for item in found)
    names = [item.name for item in named]
    for name in names:
        if names.count(name) > 1:
            raise ConfigError(f"recipe.evals: two eval sets are named {name!r}; give each its own name")
    return named


def stage(run: RecipeRun, command: str, *args: str, data: tuple[str, ...] | None = None) -> list[str]:
    """`python -m stages.cli COMMAND` with the recipe's config, the run folder's paths and the data it reads
    (`data`: these data.* settings instead of the answers')."""
    return [sys.executable, "-m", "stages.cli", command, *config_args(run, data), *args]


def config_args(run: RecipeRun, data: tuple[str, ...] | None = None) -> list[str]:
    layout = run.layout
    paths = (f"store.path={layout.store}", f"train.out_dir={layout.drafter}",
             *(data_sets(run) if data is None else data))
    given = ["-c", run.config_path] if run.config_path else []
    return given + [item for override in (*run.overrides, *paths) for item in ("--set", override)]


def data_sets(run: RecipeRun) -> tuple[str, ...]:
    """What stage one trains on: one source's answers, or (several) all of them as data.mix."""
    found = sources(run.config)
    if len(found) == 1:
        return (f"data.source={run.layout.answers(found[0].name)}",)
    mix = ", ".join(f'{{source = "{run.layout.answers(source.name)}", weight = {source.weight!r}, '
                    f'name = "{source.name}"}}' for source in found)
    return (f"data.source={run.layout.answers_root}", f"data.mix=[{mix}]")


SIDE_BY_SIDE_CACHE = 0.7  # of the GPU's memory, split evenly among generates side by side for their KV caches


def generate_parts(run: RecipeRun) -> list[Part]:
    found = sources(run.config)
    share = SIDE_BY_SIDE_CACHE / len(found) if side_by_side(run.config, "generate") and len(found) > 1 else 0.0
    return [generate_part(run, source, share) for source in found]


def generate_part(run: RecipeRun, source: RecipeSource, cache_share: float = 0.0) -> Part:
    """`cache_share` > 0: its KV cache's share of the GPU (side by side: each source an equal one)."""
    out = run.layout.answers(source.name)
    new_tokens = source.new_tokens or run.config.generate.max_new_tokens
    args = ["--out", str(out), "--max-new-tokens", str(new_tokens),
            "--rows-per-shard", str(run.config.generate.rows_per_shard)]
    if source.samples:
        args += ["--temperature", f"{source.temperature:g}", "--num-samples", str(source.samples), "--with-greedy"]
    if source.limit:
        args += ["--limit", str(source.limit)]
    if source.ask_temperature:
        args += ["--ask-temperature", f"{source.ask_temperature:g}"]
    if source.turns != 1:
        args += ["--turns", str(source.turns)]
    if cache_share:
        args += ["--cache-share", f"{cache_share:.4f}"]
    command = stage(run, "generate", *args, data=(f"data.source={source.source}",))
    return Part(f"generate-{source.name}", "generate", command, (out / "generate-manifest.txt",),
                info={"source": source.name, "prompts": source.source, "weight": source.weight})


def extract_parts(run: RecipeRun) -> list[Part]:
    return [Part("extract", "extract", stage(run, "stage1-extract"), (run.layout.store,))]


def train_parts(run: RecipeRun) -> list[Part]:
    """Stage two; a killed one continues from its last checkpoint (`--resume`)."""
    resume = ["--resume"] if latest_checkpoint(run.layout.drafter) is not None else []
    return [Part("train", "train", stage(run, "stage2-train"), (run.layout.drafter / "metrics.jsonl",), resume)]


def checkpoint_steps(layout: RunLayout) -> list[int]:
    return [int(path.name[len(STEP_PREFIX):]) for path in complete_checkpoints(layout.checkpoints)]


def export_parts(run: RecipeRun) -> list[Part]:
    """The last checkpoint's export, and with recipe.curve every earlier one's."""
    steps = checkpoint_steps(run.layout)
    if not steps:
        raise ConfigError(f"stage two left no complete checkpoint under {run.layout.checkpoints}")
    wanted = [(steps[-1], None)] + ([(step, step) for step in steps[:-1]] if run.config.recipe.curve else [])
    parts = []
    for step, named in wanted:
        out = run.layout.export(named)
        command = [sys.executable, "-m", "stages.cli", "export", str(run.layout.checkpoints / f"{STEP_PREFIX}{step:08d}"),
                   str(out)]
        parts.append(Part(out.name, "export", command, (out / "config.json",), info={"step": step}))
    return parts


def exports(run: RecipeRun) -> list[Path]:
    """The exports served: the last checkpoint's first (results[0] of every eval), then the curve's."""
    steps = checkpoint_steps(run.layout)
    return [run.layout.export()] + ([run.layout.export(step) for step in steps[:-1]] if run.config.recipe.curve else [])


def eval_name(item: RecipeEval, temperature: float) -> str:
    return f"eval-{item.name}-t{temperature:g}"


def eval_parts(run: RecipeRun) -> list[Part]:
    """One `dflash eval` per eval set and temperature; at temperature 0 (with the curve) every export at once."""
    parts = []
    settings = run.config.eval
    found = evals(run.config)
    many = side_by_side(run.config, "eval") and sum(len(item.temperatures) for item in found) > 1
    for item in found:
        for temperature in item.temperatures:
            name = eval_name(item, temperature)
            served = exports(run) if item.curve and temperature == 0 else [run.layout.export()]
            args = [arg for export in served for arg in ("--drafter", str(export))]
            args += ["--prompts", item.prompts, "--num-prompts", str(item.num_prompts or settings.num_prompts),
                     "--max-new-tokens", str(item.new_tokens or settings.max_new_tokens),
                     "--temperature", f"{temperature:g}", "--seed", str(settings.seed),
                     "--out", str(run.layout.eval_json(name))]
            if item.proposals:
                args += ["--proposal", ",".join(item.proposals)]
            if item.workers > 1:
                args += ["--workers", str(item.workers)]
            if (many or item.workers > 1) and run.config.recipe.timed_prompts:
                args += ["--timed-prompts", str(run.config.recipe.timed_prompts)]
            deferred = many and bool(run.config.recipe.timed_prompts)
            if deferred:  # side by side: timed alone at the end (`time_parts`)
                args += ["--defer-timing"]
            # the speed figures' target is eval.timed_target_graphs' wherever this eval times its own prompts
            if settings.target_graphs if deferred else settings.timed_target_graphs:
                args += ["--target-graphs"]
            parts.append(Part(name, "eval", stage(run, "eval", *args), (run.layout.eval_json(name),),
                              info={"eval_set": item.name, "prompts": item.prompts, "temperature": temperature}))
    return parts


def walked_evals(run: RecipeRun) -> list[Path]:
    """The temperature-0 evals of held-out prompts: the walk's."""
    return [run.layout.eval_json(eval_name(item, 0.0)) for item in evals(run.config)
            if item.prompts.split(":")[0] == HELDOUT and 0.0 in item.temperatures]


def walk_parts(run: RecipeRun) -> list[Part]:
    walked = walked_evals(run)
    if not run.config.recipe.walk or not walked or run.config.store.labels != "target":
        return []
    command = [sys.executable, "-m", "dflash.train.walk", *config_args(run), "--checkpoints",
               str(run.layout.checkpoints), *[arg for path in walked for arg in ("--eval", str(path))],
               "--out", str(run.layout.walk_json)]
    return [Part("walk", "walk", command, (run.layout.walk_json,))]


def time_parts(run: RecipeRun) -> list[Part]:
    """The evals served side by side (`--defer-timing`) timed last, in one process alone on the GPU (`dflash
    time-evals`): beside other processes a step's waits queue behind their kernels. Stale when an eval it times
    was served again since (its JSON says deferred)."""
    deferred = [run.layout.eval_json(part.name) for part in eval_parts(run) if "--defer-timing" in part.command]
    if not deferred:
        return []
    graphs = "--target-graphs" if run.config.eval.timed_target_graphs else "--no-target-graphs"
    command = stage(run, "time-evals", *map(str, deferred), "--summary", str(run.layout.timing_json), graphs)
    return [Part("time-evals", "time", command, (run.layout.timing_json,), stale=any(map(still_deferred, deferred)))]


def still_deferred(path: Path) -> bool:
    """Whether an eval JSON's speed figures are still to be timed (missing or unreadable: to be served)."""
    try:
        results = json.loads(path.read_text())["results"]
    except (OSError, ValueError, KeyError, TypeError):
        return True
    return any(result.get("timing") == "deferred" for result in results)


PLANNERS = {"generate": generate_parts, "extract": extract_parts, "train": train_parts, "export": export_parts,
            "eval": eval_parts, "walk": walk_parts, "time": time_parts}


def side_by_side(config: Config, phase: str) -> bool:
    """Whether a phase's parts run at once on the one GPU."""
    return {"generate": config.recipe.parallel_generates, "eval": config.recipe.parallel_evals}.get(phase, False)
