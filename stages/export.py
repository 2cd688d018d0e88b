"""`dflash export`: a training checkpoint directory -> the inference export (dflash/model/export.py's
format), with the drafter arguments the checkpoint saved (older checkpoints: from its config,
a named size or the export it started from).
"""

from pathlib import Path

from dflash.model.drafter import DrafterArgs, drafter_args
from dflash.model.export import export_drafter, load_exported
from dflash.train.checkpoint import Checkpoint, load_checkpoint


def run(checkpoint: str, out_dir: str) -> Path:
    """Export `checkpoint` to `out_dir`; returns the export directory."""
    if not Path(checkpoint).is_dir():
        raise FileNotFoundError(f"there is no checkpoint directory {checkpoint}; stage2-train writes them under "
                                f"train.out_dir/checkpoints (step-NNNNNNNN)")
    loaded = load_checkpoint(checkpoint)
    return export_drafter(loaded.model_state, checkpoint_drafter_args(loaded), out_dir)


def checkpoint_drafter_args(loaded: Checkpoint) -> DrafterArgs:
    """The drafter arguments a checkpoint saved; older checkpoints: a named size or the export it started from."""
    if loaded.drafter_args is not None:
        fields = dict(loaded.drafter_args)
        fields.update(layer_types=tuple(fields["layer_types"]), target_layer_ids=tuple(fields["target_layer_ids"]))
        return DrafterArgs(**fields)
    config = loaded.config
    if config["drafter"].get("init_from"):
        args, _ = load_exported(config["drafter"]["init_from"])
        return args
    return drafter_args(config["drafter"]["size"], block_size=config["drafter"]["block_size"],
                        mask_token_id=config["drafter"]["mask_token_id"])
