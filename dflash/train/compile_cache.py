"""Compiled kernels that travel with a run: torch's cache artifacts in `train.out_dir`.

On CUDA the first step of a training process compiles the drafter's layers, flex attention and the
loss pass: up to a minute on a cold cache, 23-40 s on an H200 (inductor's cache lives in /tmp, so a new
machine, container or `TORCHINDUCTOR_CACHE_DIR` starts cold). After its first steps every rank
saves `torch.compiler.save_cache_artifacts()` (dynamo, AOT-autograd, inductor and Triton entries)
to `<out_dir>/compile-artifacts.bin` (device cuda:0) or `compile-artifacts.cuda<N>.bin` (cuda:N):
inductor keys its Triton kernels by device index, so a rank on cuda:1 that loaded cuda:0's file
still compiled its kernels again (H200 x2, 2026-12-01). Every later process of the run (a
`--resume`, a restart on more GPUs) loads its device's file before its first step, or cuda:0's
when its own does not exist yet. A file from another torch version or GPU is simply not hit:
torch compiles as it would without it.

torch's artifacts hold the Triton kernels inductor generated, not dflash's own (the blockwise attention's,
the AdamW step's: `@triton.jit` functions launched outside inductor), which a new machine compiled again, with
their C launchers: 5-7 s of a restart under the blockwise kernels (H100, 12-07: 9.8-12.2 s to the first step
against 4.7 under flex). Beside each artifacts file, `<stem>.triton.tar` keeps those kernels' cache entries
(the compiled binaries and metadata, and each launcher's shared object), written into Triton's cache
directory before the first step (the same H100: 4.1 s, 4 kernels restored); a kernel of another Triton or GPU
has another cache key and is not hit.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import sys
import tarfile
import threading
import time
from pathlib import Path

import torch

from dflash.outputs import atomic_file

ARTIFACTS_NAME = "compile-artifacts.bin"


def artifacts_path(out_dir: str | Path, device_index: int = 0) -> Path:
    """Where the process on cuda:`device_index` saves its artifacts."""
    return device_file(Path(out_dir) / ARTIFACTS_NAME, device_index)


def device_file(path: str | Path, device_index: int) -> Path:
    """cuda:0's artifacts file `path` itself; cuda:N's beside it, `<stem>.cudaN<suffix>`."""
    path = Path(path)
    return path if not device_index else path.with_name(f"{path.stem}.cuda{device_index}{path.suffix}")


def artifacts_to_load(out_dir: str | Path, device_index: int) -> Path:
    """This device's artifacts when a run saved them, else cuda:0's (the dynamo and AOT-autograd
    entries still apply); the returned path may not exist."""
    return own_or_first(artifacts_path(out_dir), device_index)


def own_or_first(path: str | Path, device_index: int) -> Path:
    """`device_file(path, device_index)` when it exists, else `path` (cuda:0's file)."""
    own = device_file(path, device_index)
    return own if own.is_file() else Path(path)


def load_compile_artifacts(path: str | Path) -> str:
    """Load the artifacts at `path` into torch's compile caches, and dflash's Triton kernels kept beside them
    into Triton's cache; returns what happened, in words."""
    path = Path(path)
    try:
        kernels = restore_triton_kernels(kernels_file(path))
    except Exception:  # noqa: BLE001 - another Triton's internals: its kernels compile as without the file
        kernels = 0
    if not path.is_file():
        return f"restored {kernels} of dflash's Triton kernels from {kernels_file(path)}" if kernels else ""
    kept = f"; {kernels} of dflash's Triton kernels restored" if kernels else ""
    return _load_torch_artifacts(path) + kept


def _load_torch_artifacts(path: Path) -> str:
    data = path.read_bytes()
    try:
        info = torch.compiler.load_cache_artifacts(data)  # None: torch could not read them (it logs why)
    except (RuntimeError, ValueError, OSError, EOFError, AttributeError) as error:
        info, reason = None, f"{type(error).__name__}: {error}"
    else:
        reason = "unreadable, or written by another torch"
    if info is None:
        return f"compile artifacts {path} not used ({reason}); compiling from scratch"
    return f"loaded compile artifacts {path} ({len(data) / 1e6:.1f} MB): compiled kernels are reused"


def compiled_anew() -> bool:
    """Whether this process compiled a graph that was in no cache (inductor's FX-graph cache missed)."""
    from torch._dynamo.utils import counters  # torch's own compile counters (also read by its logs)

    return counters["inductor"].get("fxgraph_cache_miss", 0) > 0


def save_compile_artifacts(path: str | Path) -> int:
    """Write every compile-cache entry of this process to `path` (atomically) when it compiled
    something new or the file is missing, and dflash's Triton kernels to `kernels_file(path)` when
    they are not all there; bytes written, 0 when nothing was written."""
    path = Path(path)
    try:
        written = save_triton_kernels(kernels_file(path))
    except Exception:  # noqa: BLE001 - another Triton's internals: the kernels compile again, training goes on
        written = 0
    if path.is_file() and not compiled_anew():
        return written  # everything came from the caches: the file already holds it
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return written
    data, _ = saved
    with atomic_file(path) as partial:
        Path(partial).write_bytes(data)
    return written + len(data)


# --------------------------------------------------------------------------- dflash's own Triton kernels

MANIFEST = "manifest.json"


def kernels_file(path: str | Path) -> Path:
    """Where dflash's Triton kernels are kept beside the artifacts file `path`: `<stem>.triton.tar`."""
    return Path(path).with_suffix(".triton.tar")


def triton_cache_dir() -> Path | None:
    """Triton's cache directory (TRITON_CACHE_DIR, else ~/.triton/cache), or None without Triton or under
    a cache manager of its own (TRITON_CACHE_MANAGER: not a directory dflash can write into)."""
    try:
        from triton import knobs
    except ImportError:
        return None
    if knobs.cache.manager_class is not None or not knobs.cache.dir:
        return None
    return Path(knobs.cache.dir)


def cache_key_dir(key_hex: str) -> str:
    """The directory of a cache entry under Triton's cache: its sha256 key in base32, as Triton names it."""
    return base64.b32encode(bytes.fromhex(key_hex)).decode("ascii").rstrip("=")


def compiled_own_kernels() -> list:
    """The compiled kernels (Triton's `CompiledKernel`) of every `@triton.jit` function in dflash's modules
    this process has launched, once each."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return []
    kernels = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "dflash" or name.startswith("dflash.")):
            continue
        for value in list(vars(module).values()):
            if not isinstance(value, JITFunction):
                continue
            for caches in list(value.device_caches.values()):
                for kernel in list(caches[0].values()):
                    if hasattr(kernel, "metadata_group") and hasattr(kernel, "hash"):  # not a compile in flight
                        kernels[kernel.hash] = kernel
    return list(kernels.values())


def launcher_entry(kernel) -> tuple[str, str] | None:
    """`(cache directory, file name)` of the C launcher Triton built for `kernel`'s signature (its key is
    the launcher's source, made as Triton's CUDA driver makes it), or None where that cannot be told."""
    try:
        import sysconfig

        from triton.backends.nvidia.driver import make_launcher
        from triton.runtime.build import platform_key

        src = kernel.src
        names = src.fn.arg_names
        constants = {((names.index(k),) if isinstance(k, str) else k): v
                     for k, v in getattr(src, "constants", {}).items()}
        text = make_launcher(constants, dict(src.signature.items()), getattr(kernel.metadata, "tensordesc_meta", None))
        key = hashlib.sha256((text + platform_key()).encode("utf-8")).hexdigest()
        return cache_key_dir(key), "__triton_launcher" + sysconfig.get_config_var("EXT_SUFFIX")
    except Exception:  # noqa: BLE001 - another Triton or backend: the kernels still travel, the launcher is rebuilt
        return None


def kernel_entries(kernels, cache_dir: Path) -> list[dict]:
    """The cache entries of `kernels`: each kernel's files (its metadata group) and its launcher's, as
    `{"dir", "files": {name: path}, "group"}` (`group`: the metadata file a kernel's group is named by)."""
    entries = {}
    for kernel in kernels:
        files = {name: path for name, path in kernel.metadata_group.items() if Path(path).is_file()}
        group = next((name for name in files if name.endswith(".json")), None)
        if group is not None:
            directory = cache_key_dir(kernel.hash)
            entries[directory] = {"dir": directory, "files": files, "group": group}
        launcher = launcher_entry(kernel)
        if launcher is not None and (cache_dir / launcher[0] / launcher[1]).is_file():
            directory, name = launcher
            entries[directory] = {"dir": directory, "files": {name: str(cache_dir / directory / name)}, "group": None}
    return sorted(entries.values(), key=lambda entry: entry["dir"])


def save_triton_kernels(path: str | Path, kernels=None) -> int:
    """Write dflash's compiled Triton kernels (`compiled_own_kernels()` unless given) and their launchers to
    the tar `path` (atomically) unless it already holds every one; bytes written."""
    cache_dir = triton_cache_dir()
    kernels = compiled_own_kernels() if kernels is None else kernels
    if cache_dir is None or not kernels:
        return 0
    entries = kernel_entries(kernels, cache_dir)
    path = Path(path)
    wanted = {(e["dir"], name) for e in entries for name in e["files"]}
    if not wanted or wanted <= kept_entries(path):
        return 0
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        manifest = [{"dir": e["dir"], "files": sorted(e["files"]), "group": e["group"]} for e in entries]
        _add_bytes(archive, MANIFEST, json.dumps(manifest, indent=1).encode())
        for entry in entries:
            for name, file_path in sorted(entry["files"].items()):
                _add_bytes(archive, f"{entry['dir']}/{name}", Path(file_path).read_bytes())
    with atomic_file(path) as partial:
        Path(partial).write_bytes(buffer.getvalue())
    return buffer.tell()


def _add_bytes(archive: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    archive.addfile(info, io.BytesIO(data))


def _read_manifest(archive: tarfile.TarFile) -> list[dict]:
    manifest = json.loads(archive.extractfile(MANIFEST).read())
    for entry in manifest:  # names become paths: one directory level of plain names, never a way out
        for name in (entry["dir"], *entry["files"], *([entry["group"]] if entry["group"] else [])):
            if not name or "/" in name or "\\" in name or name in (".", ".."):
                raise ValueError(f"unsafe name {name!r}")
    return manifest


def kept_entries(path: Path) -> set[tuple[str, str]]:
    """`(directory, file)` of every entry the tar at `path` holds; empty when it is missing or unreadable."""
    try:
        with tarfile.open(path) as archive:
            return {(e["dir"], name) for e in _read_manifest(archive) for name in e["files"]}
    except (OSError, tarfile.TarError, KeyError, ValueError, TypeError, AttributeError):
        return set()


def restore_triton_kernels(path: str | Path) -> int:
    """Write the kernels kept in the tar `path` into Triton's cache directory, each file atomically and only
    where it is missing, each kernel's group file naming its files where they now are; the number of kernels
    (launchers not counted). A missing or unreadable tar restores nothing."""
    path, cache_dir = Path(path), triton_cache_dir()
    if cache_dir is None or not path.is_file():
        return 0
    try:
        with tarfile.open(path) as archive:
            manifest = _read_manifest(archive)
            for entry in manifest:
                directory = cache_dir / entry["dir"]
                directory.mkdir(parents=True, exist_ok=True)
                for name in entry["files"]:
                    if not (directory / name).is_file():
                        _write_new(directory / name, archive.extractfile(f"{entry['dir']}/{name}").read())
                if entry["group"]:
                    children = {name: str(directory / name) for name in entry["files"]}
                    _write_new(directory / f"__grp__{entry['group']}", json.dumps({"child_paths": children}).encode(),
                               replace=True)
    except (OSError, tarfile.TarError, KeyError, ValueError, TypeError, AttributeError):
        return 0
    return sum(1 for entry in manifest if entry["group"])


def _write_new(path: Path, data: bytes, replace: bool = False) -> None:
    """Write `path` through a temporary file beside it: another process reading the cache sees all or nothing."""
    if path.is_file() and not replace:
        return
    with atomic_file(path) as partial:
        partial.write_bytes(data)


COMPILE_PHASES = {  # torch._dynamo.utils.compile_times() keys -> what they time (seconds, summed)
    "_compile.compile_inner": "dynamo, whole frames",
    "compile_fx_inner": "inductor graphs (fwd + bwd)",
    "async_compile.wait": "waiting for Triton kernel compiles",
    "PyCodeCache.load_by_key_path": "loading generated modules",
}


def compile_summary() -> dict:
    """Seconds per compile phase so far and the number of graphs compiled (torch._dynamo counters)."""
    from torch._dynamo import utils

    try:
        names, values = utils.compile_times(repr="csv", aggregate=True)
    except Exception:  # noqa: BLE001 - diagnostics only; the table can change while a compile runs
        return {}
    seconds = {name: float(value) for name, value in zip(names, values) if name in COMPILE_PHASES}
    return {"seconds": seconds, "unique_graphs": int(utils.counters["stats"].get("unique_graphs", 0))}


def describe_compile(summary: dict) -> str:
    phases = ", ".join(f"{COMPILE_PHASES[k]} {v:.1f} s" for k, v in summary.get("seconds", {}).items())
    return f"{summary.get('unique_graphs', 0)} graphs; {phases or 'no compile finished yet'}"


class CompileProgress:
    """While a first step compiles, `say(text)` every `every` seconds: the seconds so far and what
    compiled (graphs, dynamo and Triton time), so a cold start shows where it is."""

    def __init__(self, say, every: float = 5.0, prefix: str = "first step: compiling"):
        self.say, self.every, self.prefix = say, every, prefix
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.report, daemon=True, name="compile-progress")

    def __enter__(self):
        self.start = time.perf_counter()
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()

    def report(self) -> None:
        while not self.done.wait(self.every):
            self.say(f"{self.prefix}, {time.perf_counter() - self.start:.0f} s so far: "
                     f"{describe_compile(compile_summary())}")
