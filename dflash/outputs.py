"""Output files get the permissions the user's umask gives a plainly created file.

`tempfile.mkstemp`/`mkdtemp` (behind every atomic temp-then-rename write here) create 0600
files and 0700 directories, and safetensors writes 0600 files; a checkpoint or export made
that way cannot be read by a serving process running as another user. `follow_umask(path)`
sets a file to 0666 and a directory (recursively, with its contents) to 0777, both masked by
the umask, as `open()` and `mkdir()` would have. `atomic_file` and `atomic_dir` are the one
temp-then-rename write of the package (files; directories such as checkpoints, exports and
converted targets): whole or nothing, with those permissions. `require_finite` is the guard
every checkpoint and export passes before its weights are written.
"""

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import torch

from dflash.errors import DflashError


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def follow_umask(path: str | Path) -> None:
    mask = current_umask()
    path = Path(path)
    paths = [path, *path.rglob("*")] if path.is_dir() else [path]
    for item in paths:
        item.chmod((0o777 if item.is_dir() else 0o666) & ~mask)


@contextlib.contextmanager
def atomic_file(path: str | Path):
    """Yield a temporary path beside `path`; when the block ends without an error the file written
    there gets the umask's permissions and is renamed over `path` (whole or not at all). The
    temporary name carries the process id, so concurrent writers never share one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        yield partial
        follow_umask(partial)
        os.replace(partial, path)
    finally:
        if partial.exists():
            partial.unlink()


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write `text` to `path` atomically (`atomic_file`), flushed to disk before the rename."""
    with atomic_file(path) as partial, open(partial, "w") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())


@contextlib.contextmanager
def atomic_dir(out_dir: str | Path, staging_prefix: str = ""):
    """Yield a fresh staging directory beside `out_dir` (its name starts with `staging_prefix`,
    by default `.<name>.partial-`); when the block ends without an error its files get the
    umask's permissions and are flushed to disk, and it replaces `out_dir`. An existing
    `out_dir` (one the caller judged incomplete or replaceable) is first moved aside under the
    same prefix and removed after the rename: a crash leaves `out_dir` whole, old or new, and at
    most a hidden leftover beside it, never a half-written or half-deleted `out_dir`."""
    out_dir = Path(out_dir)
    prefix = staging_prefix or f".{out_dir.name}.partial-"
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=prefix))
    try:
        yield staging
        follow_umask(staging)  # mkdtemp and safetensors make it private
        for path in staging.rglob("*"):
            if path.is_file():
                fsync_path(path)
        if out_dir.exists():
            retired = out_dir.with_name(f"{prefix}retired-{out_dir.name}")
            shutil.rmtree(retired, ignore_errors=True)
            os.rename(out_dir, retired)
            os.rename(staging, out_dir)
            shutil.rmtree(retired)
        else:
            os.rename(staging, out_dir)
        fsync_path(out_dir.parent)
    finally:
        if staging.exists():
            shutil.rmtree(staging)


def fsync_path(path: str | Path) -> None:
    """fsync a file or directory, so a write or rename is durable before the next step relies on it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class NonFiniteWeightsError(DflashError, ValueError):
    """Weights about to be written hold NaN/Inf; the message names the first such key."""


def require_finite(state: dict[str, torch.Tensor], what: str, error: type[Exception] = NonFiniteWeightsError) -> None:
    """Refuse weights holding NaN/Inf, naming the first such key (no export or checkpoint of them)."""
    for key, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise error(f"{what}: {key} holds non-finite values (NaN/Inf); refusing to write it")
