"""Processes that share one GPU take turns through a lock file, so that the ones timing decode alone.

`dflash eval`s side by side (`dflash recipe`, `--workers`) keep the GPU busy, but a speedup timed while other
processes' kernels share the GPU is not the served one: every wait on the device queues behind theirs. With
`--device-lock PATH` each eval decodes its timed prompts `alone()` (an exclusive lock: the others finish the
prompt in hand and wait) and the rest `beside()` the others (a shared lock). A turnstile (PATH.turnstile) that
an exclusive taker holds while it waits stops new shared takers, so a timed prompt is not starved.

Timed work goes first. Each turn alone waits for the prompts the others have in hand (up to a prompt's time under
contention: 10-25 s on the H100 of 12-06, with the GPU emptying as they end), so an eval whose timed prompts come
spread among the rest costs every process that many waits. So every eval holds `timed_ahead()` (a shared lock on
PATH.pending) from its start until its timed prompts, if any, are done, all in one turn alone, and `after_timed()`
waits until nobody holds it. Every eval then times its prompts one after another, and the
untimed work of all of them runs beside each other afterwards, with no turn alone left to wait for.

A turn alone also waits until no process is still loading (`loading()`: reading the target and the drafter,
building their graphs, the warm-up). Thirteen processes start together in the recipe; the first evals loaded
timed their prompts while the others were still loading, and those steps ran at 24-89 ms where a step alone
takes about 22 (H100, 12-06). A process started with `--device-lock` holds a shared lock on PATH.loading while
it loads; so that a process still importing cannot be missed, the one that starts it takes that lock for it
(`start_loading`: the child inherits the locked file as LOADING_FD_ENV names it, and releases it when loaded).
"""

import fcntl
import os
import subprocess
from contextlib import contextmanager
from pathlib import Path


LOADING_FD_ENV = "DFLASH_DEVICE_LOADING_FD"  # a locked PATH.loading this process inherited from the one that started it


def start_loading(command: list[str], lock_path: str | os.PathLike | None, env: dict | None = None,
                  **popen_args) -> subprocess.Popen:
    """Start `command`, a process that takes turns at `lock_path`, as one still loading: it inherits a shared lock on
    PATH.loading taken here before it starts (its descriptor named by LOADING_FD_ENV) and releases it once loaded
    (`DeviceTurns.loading`), or when it exits. `lock_path` None or "": a plain start (no turns to take)."""
    if not lock_path:
        return subprocess.Popen(command, env=env, **popen_args)
    descriptor = loading_lock(lock_path)
    os.set_inheritable(descriptor, True)
    try:
        return subprocess.Popen(command, env={**(os.environ if env is None else env), LOADING_FD_ENV: str(descriptor)},
                                pass_fds=(descriptor,), **popen_args)
    finally:
        os.close(descriptor)  # the child's copy keeps the lock


def loading_lock(lock_path: str | os.PathLike) -> int:
    """A new open file of PATH.loading holding a shared lock (released by LOCK_UN on it or when every descriptor of
    it is closed)."""
    path = Path(lock_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path.with_name(path.name + ".loading"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    fcntl.flock(descriptor, fcntl.LOCK_SH)
    return descriptor


def is_open(descriptor: int) -> bool:
    try:
        os.fstat(descriptor)
    except OSError:  # named but not passed down
        return False
    return True


class DeviceTurns:
    def __init__(self, path: str | os.PathLike | None):
        """`path` None or "": no lock (one process alone on the device)."""
        self.path = Path(path) if path else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def alone(self):
        """Hold the device alone: wait until no process is loading and none decodes beside, then keep them
        waiting."""
        if self.path is not None:
            with self._open("loading") as loading_file:
                fcntl.flock(loading_file, fcntl.LOCK_EX)
                fcntl.flock(loading_file, fcntl.LOCK_UN)
        return self._turn(fcntl.LOCK_EX)

    @contextmanager
    def loading(self):
        """While inside, this process is loading: no turn alone starts. It keeps the lock it inherited
        (LOADING_FD_ENV, taken by the process that started it) or takes its own."""
        if self.path is None:
            yield
            return
        inherited = os.environ.pop(LOADING_FD_ENV, "")  # not for the processes this one starts
        descriptor = int(inherited) if inherited.isdigit() and is_open(int(inherited)) else loading_lock(self.path)
        try:
            yield
        finally:
            fcntl.flock(descriptor, fcntl.LOCK_UN)
            os.close(descriptor)

    def beside(self):
        """Decode beside the other processes (never while one holds the device alone)."""
        return self._turn(fcntl.LOCK_SH)

    @contextmanager
    def timed_ahead(self):
        """While inside: this process has timed prompts still to decode (`after_timed` waits for it). Enter it
        at the start, before loading anything, so that an eval that loads faster cannot start its untimed work
        before a slower one has said it has timed work."""
        if self.path is None:
            yield
            return
        with self._open("pending") as pending_file:
            fcntl.flock(pending_file, fcntl.LOCK_SH)
            try:
                yield
            finally:
                fcntl.flock(pending_file, fcntl.LOCK_UN)

    def after_timed(self) -> None:
        """Wait until no process has timed prompts still to decode (returns at once without a lock)."""
        if self.path is None:
            return
        with self._open("pending") as pending_file:
            fcntl.flock(pending_file, fcntl.LOCK_EX)
            fcntl.flock(pending_file, fcntl.LOCK_UN)

    @contextmanager
    def _turn(self, mode: int):
        if self.path is None:
            yield
            return
        with self._open("turnstile") as turnstile, self._open() as lock:
            fcntl.flock(turnstile, fcntl.LOCK_EX)  # one taker at a time gets past here: a waiting one blocks newcomers
            try:
                fcntl.flock(lock, mode)  # alone: the shared holders finish the prompt in hand
            finally:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _open(self, suffix: str = ""):
        return open(self.path.with_name(self.path.name + (f".{suffix}" if suffix else "")), "a")
