"""benchmarks/capacity.py's step profile: what a missed decoding target is explained by."""
from __future__ import annotations

import torch

from benchmarks.capacity import profile_step


def test_the_step_profile_counts_one_call_after_a_call_outside_it():
    calls = []
    weight = torch.randn(16, 16)

    def step():
        calls.append(len(calls))
        return (weight @ weight).relu().sum()

    kernels, table = profile_step(step, torch.device("cpu"))
    assert len(calls) == 2  # the first call (a compiled step's compilation) is not in the count
    assert kernels == 3  # mm, relu, sum: one profiled call's computing operators
    assert "aten::mm" in table
