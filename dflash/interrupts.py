"""Ctrl-C: one line saying how to go on, exit status 130, and no traceback from any process.

The CLI catches the KeyboardInterrupt of the main process and prints `interrupted_line(command)`;
the processes a stage starts (stage one's writers, the tokenizer pool) are started inside
`children_ignore_interrupts()`, so that the terminal's SIGINT, sent to the whole process group,
does not make each of them print a traceback (a spawned one would even while still importing):
the main process stops them itself.
"""

import contextlib
import signal
import threading

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for a command stopped by Ctrl-C

# What rerunning does, per command; a command not named here resumes nothing.
HOW_TO_GO_ON = {
    "stage1-extract": "rerun the same command to resume (finished shards are kept, only missing ones are written)",
    "generate": "rerun the same command to resume (finished answer shards are kept)",
    "stage2-train": "rerun the same command with --resume to continue from the last saved checkpoint",
}


def interrupted_line(command: str) -> str:
    """The one line printed for Ctrl-C of `command`."""
    return "Interrupted: " + HOW_TO_GO_ON.get(command, "nothing was left half-written; rerun the same command")


@contextlib.contextmanager
def children_ignore_interrupts():
    """Processes started inside inherit an ignored SIGINT (it survives exec, and Python then keeps
    it ignored); this process's own handler is back on exit."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may change handlers; its children are started there
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
