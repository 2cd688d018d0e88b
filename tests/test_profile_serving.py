"""tools/profile_serving.py's operator counts: views and metadata are left out, every computing operator is
counted once, and a phase inside another counts toward the outer one only."""

import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import profile_serving  # noqa: E402


def test_counter_counts_computing_operators_not_views():
    a, b = torch.randn(4, 6), torch.randn(4, 6)
    with profile_serving.OpCounter() as counter:
        c = (a + b).view(6, 4).t()  # one add; the view and the transpose launch nothing
        c.sum().detach()  # one sum
    assert counter.count == 2


def test_phases_count_their_own_operators_and_an_inner_phase_counts_toward_the_outer():
    totals, ops, counter = defaultdict(float), defaultdict(int), profile_serving.OpCounter()
    inner = profile_serving.wrapped(lambda x: x * 2, "inner", totals, torch.device("cpu"), False, ops, counter)
    outer = profile_serving.wrapped(lambda x: inner(x) + 1, "outer", totals, torch.device("cpu"), False, ops, counter)
    with counter:
        outer(torch.ones(3))
        inner(torch.ones(3))
    assert dict(ops) == {"outer": 2, "inner": 1} and counter.count == 3 + 2  # + the two torch.ones
