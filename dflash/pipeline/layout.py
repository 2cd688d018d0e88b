"""Where `dflash recipe` keeps everything under its run folder (`recipe.run_dir`)."""

from dataclasses import dataclass
from pathlib import Path

from dflash.train.checkpoint import CHECKPOINTS_DIR

LAST_EXPORT = "export"  # the last checkpoint's export; earlier ones are export-<step> (dflash.train.walk reads them)


@dataclass(frozen=True)
class RunLayout:
    root: Path

    def answers(self, source: str) -> Path:
        """One source's answers (`dflash generate --out`)."""
        return self.root / "answers" / source

    @property
    def answers_root(self) -> Path:
        return self.root / "answers"

    @property
    def store(self) -> Path:
        return self.root / "store"

    @property
    def drafter(self) -> Path:
        return self.root / "drafter"

    @property
    def checkpoints(self) -> Path:
        return self.drafter / CHECKPOINTS_DIR

    def export(self, step: int | None = None) -> Path:
        """The export of checkpoint `step` (None: the last checkpoint's)."""
        return self.root / "exports" / (LAST_EXPORT if step is None else f"{LAST_EXPORT}-{step:08d}")

    @property
    def evals(self) -> Path:
        return self.root / "evals"

    def eval_json(self, part: str) -> Path:
        """What `dflash eval --out` writes for eval part `part`."""
        return self.evals / f"{part}.json"

    @property
    def walk_json(self) -> Path:
        return self.evals / "walk.json"

    @property
    def timing_json(self) -> Path:
        """`dflash time-evals --summary`: which evals were timed alone at the end."""
        return self.evals / "timing.json"

    @property
    def records(self) -> Path:
        """Completion records, one JSON per part (`records.py`)."""
        return self.root / "results"

    def record(self, part: str) -> Path:
        return self.records / f"{part}.json"

    @property
    def report_md(self) -> Path:
        return self.root / "report.md"

    @property
    def report_json(self) -> Path:
        return self.root / "report.json"

    @property
    def plots(self) -> Path:
        return self.root / "plots"
