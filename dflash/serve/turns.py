"""Processes that share one GPU take turns through a lock file, so that the ones timing decode alone.

`dflash eval`s side by side (`dflash recipe`, `--workers`) keep the GPU busy, but a speedup timed while other
processes' kernels share the GPU is not the served one: every wait on the device queues behind theirs. With
`--device-lock PATH` each eval decodes its timed prompts `alone()` (an exclusive lock: the others finish the
prompt in hand and wait) and the rest `beside()` the others (a shared lock). A turnstile (PATH.turnstile) that
an exclusive taker holds while it waits stops new shared takers, so a timed prompt is not starved.
"""

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path


class DeviceTurns:
    def __init__(self, path: str | os.PathLike | None):
        """`path` None or "": no lock (one process alone on the device)."""
        self.path = Path(path) if path else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def alone(self):
        """Hold the device alone: wait until no process decodes beside, then keep them waiting."""
        return self._turn(fcntl.LOCK_EX)

    def beside(self):
        """Decode beside the other processes (never while one holds the device alone)."""
        return self._turn(fcntl.LOCK_SH)

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
