"""`dflash export`: a training checkpoint directory -> the inference export (dflash/model/export.py's
format), with the drafter arguments the checkpoint saved (older checkpoints: from its config,
a named size or the export it started from).
"""

from pathlib import Path

from dflash.model.export import export_drafter
from dflash.train.checkpoint import checkpoint_drafter_args, load_checkpoint


def run(checkpoint: str, out_dir: str) -> Path:
    """Export `checkpoint` to `out_dir`; returns the export directory."""
    if not Path(checkpoint).is_dir():
        raise FileNotFoundError(f"there is no checkpoint directory {checkpoint}; stage2-train writes them under "
                                f"train.out_dir/checkpoints (step-NNNNNNNN)")
    loaded = load_checkpoint(checkpoint)
    return export_drafter(loaded.model_state, checkpoint_drafter_args(loaded), out_dir)
