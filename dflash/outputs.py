"""Output files get the permissions the user's umask gives a plainly created file.

`tempfile.mkstemp`/`mkdtemp` (behind every atomic temp-then-rename write here) create 0600
files and 0700 directories, and safetensors writes 0600 files; a checkpoint or export made
that way cannot be read by a serving process running as another user. `follow_umask(path)`
sets a file to 0666 and a directory (recursively, with its contents) to 0777, both masked by
the umask, as `open()` and `mkdir()` would have.
"""

import os
from pathlib import Path


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


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write `text` to `path` whole or not at all: a temporary file beside it (named with the
    process id, so concurrent writers never share one), flushed to disk, then renamed over it."""
    path = Path(path)
    partial = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with open(partial, "w") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    os.replace(partial, path)
