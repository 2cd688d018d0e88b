"""Ctrl-C: one line saying how to go on, exit status 130, and no traceback from any process.

The CLI catches the KeyboardInterrupt of the main process and prints `interrupted_line(command)`;
the processes a stage starts (stage one's writers, the tokenizer pool) call
`ignore_interrupts()` first, so that the terminal's SIGINT, sent to the whole process group,
does not make each of them print a traceback: the main process stops them itself.
"""

import signal

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


def ignore_interrupts() -> None:
    """In a child process: leave SIGINT to the main process, which stops its children itself."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
