"""Training checkpoints: tensors in safetensors, everything else in JSON, never pickle.

Layout of one checkpoint, `<out_dir>/checkpoints/step-{step:08d}/`:
- `model.safetensors`: the fp32 master weights
- `optimizer.safetensors`: per-parameter optimizer state as `state.{index}.{field}`, with
  the param groups (lr, betas, ...) as JSON in the file's metadata
- `rng.safetensors`: torch/CUDA generator states (uint8 tensors)
- `state.json`: step, scheduler state, data cursor, numpy/python RNG states, run config,
  the resolved drafter arguments (what `dflash export` writes the config from); written
  last, so its presence marks a complete checkpoint

A checkpoint is written into a hidden temp dir beside its final place and renamed into
place, so a crash never leaves a `step-*` dir that looks complete; older ones are pruned to
`keep_last`. Under DDP every rank holds the full state and only the writer (rank 0) saves;
every rank reads it on resume, whatever the number of ranks (the schedule of an optimizer
step does not depend on it, see dflash/train/resume.py's `resume_config`). Weights holding NaN/Inf
are never written (`dflash.outputs.require_finite`, which exports apply too).
"""

import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dflash.model.drafter import DrafterArgs, drafter_args
from dflash.model.export import load_exported
from dflash.outputs import atomic_dir

CHECKPOINTS_DIR = "checkpoints"
STEP_PREFIX = "step-"
TEMP_PREFIX = ".tmp-step-"
STATE_NAME = "state.json"  # written last: the completion mark
OPTIMIZER_META_KEY = "dflash_optimizer"
FORMAT_VERSION = 1


@dataclass
class Checkpoint:
    path: Path
    step: int
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict  # torch.optim format, ready for optimizer.load_state_dict
    scheduler_state: dict
    data_cursor: dict
    rng_states: dict  # as given to save_checkpoint; see capture_rng_states
    config: dict
    drafter_args: dict | None = None  # `DrafterArgs` fields; None in checkpoints from before they were saved


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def save_checkpoint(
    out_dir: str | Path,
    step: int,
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict,
    scheduler_state: dict,
    data_cursor: dict,
    rng_states: dict,
    config: dict,
    keep_last: int,
    is_writer: bool = True,
    drafter_args: dict | None = None,
) -> Path:
    """Write checkpoint `step` of the run in `out_dir`; return its final path.

    Ranks that are not the writer return the path without touching the disk.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    root = Path(out_dir) / CHECKPOINTS_DIR
    final_dir = root / step_dir_name(step)
    if not is_writer:
        return final_dir
    # A re-save of a step replaces it; its temp and retired dirs carry TEMP_PREFIX, which pruning clears.
    with atomic_dir(final_dir, staging_prefix=f"{TEMP_PREFIX}{step:08d}-") as work_dir:
        write_checkpoint_files(work_dir, step, model_state, optimizer_state, scheduler_state,
                               data_cursor, rng_states, config, drafter_args)
    prune_checkpoints(root, keep_last)
    return final_dir


def write_checkpoint_files(work_dir: Path, step, model_state, optimizer_state, scheduler_state,
                           data_cursor, rng_states, config, drafter_args=None) -> None:
    model_tensors = {key: value.detach().to("cpu").contiguous() for key, value in model_state.items()}
    save_file(model_tensors, str(work_dir / "model.safetensors"), metadata={"format": "pt"})
    optimizer_tensors, optimizer_meta = flatten_optimizer_state(optimizer_state)
    save_file(optimizer_tensors, str(work_dir / "optimizer.safetensors"),
              metadata={OPTIMIZER_META_KEY: to_json(optimizer_meta, "optimizer param_groups")})
    rng_tensors, rng_plain = split_rng_states(rng_states)
    save_file(rng_tensors, str(work_dir / "rng.safetensors"))
    state = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "scheduler": scheduler_state,
        "data_cursor": data_cursor,
        "rng": rng_plain,
        "config": config,
        "drafter_args": drafter_args,
    }
    write_synced(work_dir / STATE_NAME, to_json(state, "checkpoint state"))


def prune_checkpoints(root: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` complete checkpoints, and stale temp dirs."""
    for stale in root.glob(f"{TEMP_PREFIX}*"):
        shutil.rmtree(stale, ignore_errors=True)
    for old in complete_checkpoints(root)[:-keep_last]:
        shutil.rmtree(old)


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete `step-*` dirs under `root`, oldest first."""
    found = []
    for path in root.glob(f"{STEP_PREFIX}*"):
        digits = path.name[len(STEP_PREFIX):]
        if path.is_dir() and digits.isdigit() and (path / STATE_NAME).is_file():
            found.append((int(digits), path))
    return [path for _, path in sorted(found)]


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of the run in `out_dir`, or None when there is none."""
    found = complete_checkpoints(Path(out_dir) / CHECKPOINTS_DIR)
    return found[-1] if found else None


def read_state(path: str | Path) -> dict:
    """A checkpoint's `state.json` alone (step, scheduler, data cursor, config), without its tensors."""
    return json.loads((Path(path) / STATE_NAME).read_text())


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read a checkpoint written by `save_checkpoint`; tensors come back on the CPU."""
    path = Path(path)
    state_path = path / STATE_NAME
    if not state_path.is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint: {STATE_NAME} is missing")
    state = json.loads(state_path.read_text())
    if state.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{state_path}: format_version {state.get('format_version')}, expected {FORMAT_VERSION}")
    optimizer_tensors, metadata = read_safetensors(path / "optimizer.safetensors")
    if OPTIMIZER_META_KEY not in metadata:
        raise ValueError(f"{path / 'optimizer.safetensors'}: metadata lacks {OPTIMIZER_META_KEY!r}")
    optimizer_meta = json.loads(metadata[OPTIMIZER_META_KEY])
    rng_tensors, _ = read_safetensors(path / "rng.safetensors")
    return Checkpoint(
        path=path,
        step=state["step"],
        model_state=read_safetensors(path / "model.safetensors")[0],
        optimizer_state=unflatten_optimizer_state(optimizer_tensors, optimizer_meta),
        scheduler_state=state["scheduler"],
        data_cursor=state["data_cursor"],
        rng_states=join_rng_states(rng_tensors, state["rng"]),
        config=state["config"],
        drafter_args=state.get("drafter_args"),
    )


def flatten_optimizer_state(optimizer_state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """`optimizer.state_dict()` -> (flat tensors `state.{index}.{field}`, JSON-able meta).

    Non-tensor per-parameter values (a float `step` in some optimizers) go into the meta.
    """
    tensors, scalars = {}, {}
    for index, fields in optimizer_state["state"].items():
        for name, value in fields.items():
            if torch.is_tensor(value):
                tensors[f"state.{index}.{name}"] = value.detach().to("cpu").contiguous()
            else:
                scalars[f"state.{index}.{name}"] = value
    # JSON turns tuples (AdamW's betas) into lists; remember which were tuples to restore them.
    tuple_keys = [sorted(key for key, value in group.items() if isinstance(value, tuple))
                  for group in optimizer_state["param_groups"]]
    meta = {"param_groups": optimizer_state["param_groups"], "tuple_keys": tuple_keys, "scalars": scalars}
    return tensors, meta


def unflatten_optimizer_state(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    """Inverse of `flatten_optimizer_state`: a dict for `optimizer.load_state_dict`."""
    state: dict[int, dict] = {}
    for flat_key, value in [*tensors.items(), *meta["scalars"].items()]:
        _, index, name = flat_key.split(".", 2)
        state.setdefault(int(index), {})[name] = value
    param_groups = [
        {key: tuple(value) if key in tuple_keys else value for key, value in group.items()}
        for group, tuple_keys in zip(meta["param_groups"], meta["tuple_keys"], strict=True)
    ]
    return {"state": dict(sorted(state.items())), "param_groups": param_groups}


def capture_rng_states() -> dict:
    """The host RNG states to checkpoint: torch CPU (+ CUDA when present), numpy, python."""
    states = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(legacy=False),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: dict) -> None:
    """Inverse of `capture_rng_states`, accepting the form `load_checkpoint` returns."""
    torch.set_rng_state(states["torch"])
    numpy_state = dict(states["numpy"])
    numpy_state["state"] = dict(numpy_state["state"], key=np.asarray(numpy_state["state"]["key"], dtype=np.uint32))
    np.random.set_state(numpy_state)
    version, internal, gauss_next = states["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def split_rng_states(rng_states: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Tensors (and lists of tensors, one per device) -> safetensors; the rest -> JSON."""
    tensors, plain = {}, {}
    for name, value in rng_states.items():
        if torch.is_tensor(value):
            tensors[name] = value.to("cpu").contiguous()
        elif isinstance(value, (list, tuple)) and value and all(torch.is_tensor(v) for v in value):
            for device_index, device_state in enumerate(value):
                tensors[f"{name}.{device_index}"] = device_state.to("cpu").contiguous()
        else:
            plain[name] = value
    return tensors, plain


def join_rng_states(tensors: dict[str, torch.Tensor], plain: dict) -> dict:
    states = dict(plain)
    per_device: dict[str, dict[int, torch.Tensor]] = {}
    for key, value in tensors.items():
        name, dot, device_index = key.rpartition(".")
        if dot and device_index.isdigit():
            per_device.setdefault(name, {})[int(device_index)] = value
        else:
            states[key] = value
    for name, by_index in per_device.items():
        states[name] = [by_index[i] for i in sorted(by_index)]
    return states


def to_json(value, what: str) -> str:
    """JSON text of plain data; numpy arrays and scalars become lists and numbers."""

    def convert(obj):
        if isinstance(obj, np.ndarray):
            return obj.tolist()
        if isinstance(obj, np.generic):
            return obj.item()
        raise TypeError(f"{what}: {type(obj).__name__} value {obj!r:.80} is not plain data")

    return json.dumps(value, default=convert, allow_nan=True)


def read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file missing: {path}")
    with safe_open(str(path), framework="pt") as reader:
        return {key: reader.get_tensor(key) for key in reader.keys()}, reader.metadata() or {}


def write_synced(path: Path, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def checkpoint_drafter_args(loaded: Checkpoint) -> DrafterArgs:
    """The drafter arguments a checkpoint saved; older checkpoints: a named size or the export it started from
    (`dflash export` and `dflash.train.walk` read a checkpoint's drafter with it)."""
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
