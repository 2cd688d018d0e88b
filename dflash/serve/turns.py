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
