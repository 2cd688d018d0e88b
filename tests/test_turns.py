"""Evals side by side take turns on the device (`dflash.serve.turns.DeviceTurns`): processes beside each other
share it, one alone waits for them and keeps later ones out, and a waiting one is not starved by newcomers.
Threads stand for processes (each `open` is its own lock holder). A summary's speed comes from its timed prompts."""

import threading
import time

from dflash.serve.evaluation import EvalResult, PromptResult, summarize
from dflash.serve.turns import DeviceTurns


def test_beside_share_alone_excludes_and_a_waiting_alone_goes_before_newcomers(tmp_path):
    turns = DeviceTurns(tmp_path / "evals" / "device.lock")
    events, lock = [], threading.Lock()

    def note(text):
        with lock:
            events.append(text)

    first_in, release_first, second_in = threading.Event(), threading.Event(), threading.Event()

    def first():
        with turns.beside():
            note("first in")
            first_in.set()
            release_first.wait(5)
            note("first out")

    def second():  # beside the first: both inside at once
        first_in.wait(5)
        with turns.beside():
            note("second in")
            second_in.set()
        note("second out")

    def timed():  # waits for the first to leave
        second_in.wait(5)
        with turns.alone():
            note("alone in")
            time.sleep(0.2)
            note("alone out")

    def newcomer():  # arrives while the timed one waits: goes after it
        timed_waits.wait(30)
        with turns.beside():
            note("newcomer in")

    timed_waits = threading.Event()
    threads = [threading.Thread(target=function) for function in (first, second, timed, newcomer)]
    for thread in threads:
        thread.start()
    # Events and locks, not sleeps, order the four (CI's machine may be loaded): once the second is in, the
    # first and second are past the turnstile, so whoever holds it is the timed one waiting for the first.
    second_in.wait(30)
    wait_until_held(turns.path.with_name(turns.path.name + ".turnstile"))
    timed_waits.set()
    time.sleep(0.3)  # the newcomer queues behind it (were it let in, the order below would say so)
    release_first.set()
    for thread in threads:
        thread.join(10)
    assert events.index("second in") < events.index("first out")  # beside each other
    assert events.index("first out") < events.index("alone in")  # alone only once they are out
    assert events.index("alone out") == events.index("alone in") + 1  # nobody in while alone
    assert events.index("alone out") < events.index("newcomer in")  # the newcomer waited at the turnstile


def wait_until_held(path, seconds: float = 60) -> None:
    """Until some holder has `path` locked (a non-blocking exclusive probe fails)."""
    import fcntl

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with open(path, "a") as probe:
            try:
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return
            fcntl.flock(probe, fcntl.LOCK_UN)
        time.sleep(0.01)
    raise AssertionError(f"nobody took {path} in {seconds} s")


def test_no_path_takes_no_lock(tmp_path):
    turns = DeviceTurns("")
    with turns.alone(), turns.alone(), turns.beside():
        pass
    assert not list(tmp_path.iterdir())


def test_speed_comes_from_the_timed_prompts_and_tau_from_all():
    def prompt(timed, lengths, spec_seconds):
        return PromptResult(prompt_id="p", prompt_tokens=3, generated_tokens=sum(lengths),
                            acceptance_lengths=lengths, target_forwards=len(lengths), spec_seconds=spec_seconds,
                            baseline_tokens=sum(lengths), baseline_seconds=2.0, timed=timed)

    result = summarize(EvalResult(drafter="d", target="t", prompts_source="s", device="cuda", dtype="bfloat16",
                                  block_size=16, temperature=0.0, max_new_tokens=8,
                                  per_prompt=[prompt(True, [4, 4], 1.0), prompt(False, [1, 1], 9.0)]))
    assert result.tau == 2.5 and result.num_prompts == 2 and result.timed_prompts == 1
    assert result.spec_tokens_per_s == 8.0 and result.baseline_tokens_per_s == 4.0 and result.speedup == 2.0


def test_timed_prompts_spread_over_the_set():
    from stages.evaluate import spread

    assert spread(0, 5) == spread(9, 5) == {0, 1, 2, 3, 4}
    assert spread(1, 120) == {0} and spread(4, 120) == {0, 40, 79, 119} and len(spread(30, 31)) == 30


def test_untimed_work_waits_for_every_process_that_said_it_has_timed_work(tmp_path):
    turns = DeviceTurns(tmp_path / "evals" / "device.lock")
    events, lock = [], threading.Lock()
    said, release = threading.Event(), threading.Event()

    def note(text):
        with lock:
            events.append(text)

    def timed_process():  # says so at its start, then times its prompts alone
        with turns.timed_ahead():
            said.set()
            release.wait(5)
            with turns.alone():
                note("timed")
            note("timed done")

    def untimed_process():  # nothing to time: its untimed prompts wait for the other's timed ones
        said.wait(5)
        turns.after_timed()
        with turns.beside():
            note("untimed")

    threads = [threading.Thread(target=function) for function in (timed_process, untimed_process)]
    for thread in threads:
        thread.start()
    time.sleep(0.3)
    assert events == []  # the untimed process still waits
    release.set()
    for thread in threads:
        thread.join(10)
    assert events.index("timed") < events.index("untimed") and events.index("timed done") < events.index("untimed")
    turns.after_timed()  # nobody has timed work left: returns at once
    with DeviceTurns("").timed_ahead():  # no lock file: nothing to say
        DeviceTurns("").after_timed()


def test_a_turn_alone_waits_until_no_process_is_loading(tmp_path):
    turns = DeviceTurns(tmp_path / "evals" / "device.lock")
    events, lock = [], threading.Lock()
    loading_in, warmed, release = threading.Event(), threading.Event(), threading.Event()

    def note(text):
        with lock:
            events.append(text)

    def loader():  # still loading its target: nobody times alone, but warming up beside is fine
        with turns.loading():
            loading_in.set()
            with turns.beside():
                note("warm-up beside")
            warmed.set()
            release.wait(5)
            note("loaded")

    def timed():
        loading_in.wait(5)
        with turns.alone():
            note("alone")

    threads = [threading.Thread(target=function) for function in (loader, timed)]
    for thread in threads:
        thread.start()
    warmed.wait(30)
    time.sleep(0.3)
    assert events == ["warm-up beside"]  # the turn alone waits for the loader
    release.set()
    for thread in threads:
        thread.join(10)
    assert events == ["warm-up beside", "loaded", "alone"]


CHILD = """
import sys, time
from pathlib import Path
from dflash.serve.turns import DeviceTurns
turns = DeviceTurns(sys.argv[1])
with turns.loading():
    Path(sys.argv[2]).touch()
    while not Path(sys.argv[3]).exists():
        time.sleep(0.05)
    Path(sys.argv[4]).touch()  # the last thing it does while loading: a turn alone that starts sees it
while not Path(sys.argv[5]).exists():  # alive, and no longer loading, until told to end
    time.sleep(0.05)
"""


def test_a_started_process_holds_the_loading_lock_from_before_its_first_line(tmp_path):
    """The starter takes the lock for the child (`start_loading`, as the recipe's runner and `--workers` do):
    a turn alone waits for a child still importing, and the child releases that very lock once loaded."""
    import fcntl
    import sys

    from dflash.serve.turns import start_loading

    lock_path = tmp_path / "evals" / "device.lock"
    inside, go, loaded, finish = (tmp_path / name for name in ("inside", "go", "loaded", "finish"))

    def someone_loading() -> bool:
        with open(lock_path.with_name("device.lock.loading"), "a") as probe:
            try:
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(probe, fcntl.LOCK_UN)
            return False

    child = start_loading([sys.executable, "-c", CHILD, *map(str, (lock_path, inside, go, loaded, finish))], lock_path)
    try:
        assert someone_loading()  # at once, before the child ran a line
        deadline = time.monotonic() + 60
        while not inside.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert inside.exists() and someone_loading()
        alone_at = []

        def timed():
            with DeviceTurns(lock_path).alone():
                alone_at.append(loaded.exists())

        thread = threading.Thread(target=timed, daemon=True)
        thread.start()
        time.sleep(0.3)
        assert not alone_at  # the child is still loading
        go.touch()
        thread.join(30)
        assert alone_at == [True] and child.poll() is None  # once it has loaded, while it still runs
    finally:
        finish.touch()
        assert child.wait(60) == 0


def test_a_loading_lock_named_but_not_passed_down_is_taken_anew(tmp_path, monkeypatch):
    import fcntl
    import os

    from dflash.serve.turns import LOADING_FD_ENV

    lock_path = tmp_path / "device.lock"
    closed = os.open(os.devnull, os.O_RDONLY)
    os.close(closed)
    monkeypatch.setenv(LOADING_FD_ENV, str(closed))
    with DeviceTurns(lock_path).loading():
        assert LOADING_FD_ENV not in os.environ  # a process this one starts gets its own
        with open(lock_path.with_name("device.lock.loading"), "a") as probe:
            try:
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = False
            except BlockingIOError:
                held = True
    assert held
