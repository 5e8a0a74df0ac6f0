"""kvpop.profiling: the step profiler's window, counts and report (CPU; the CUDA parts need a GPU)."""
from __future__ import annotations

import pytest
import torch

from kvpop.profiling import StepProfiler, check_profile_steps


def test_the_step_profiler_records_only_its_steps_and_counts_their_ops_and_host_reads():
    layer = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    profiler = StepProfiler("cpu", first=2, count=2, rows=5)
    for step in range(1, 6):
        with profiler.step(step):
            loss = layer(torch.randn(4, 8)).relu().sum()
            loss.backward()
            opt.step()
            profiler.issued()
            bool(loss > 0)  # one host read per step
        torch.randn(100).exp()  # between steps: not recorded
    assert profiler.done and [r["step"] for r in profiler.steps] == [2, 3]
    summary = profiler.summary()
    assert summary["steps"] == 2 and summary["host_reads"] == 1 and summary["kernels"] > 5
    assert summary["syncs"] is None and summary["device_s"] is None  # CUDA figures
    assert 0 < summary["host_s"] <= summary["wall_s"]
    report = profiler.markdown("a test")
    assert report.startswith("# a test") and "aten::addmm" in report and "aten::exp" not in report
    assert "| 2 |" in report and "| 3 |" in report and "| 4 |" not in report


@pytest.mark.parametrize("value, expected", [([], None), ((), None), (None, None), ([3, 2], (3, 2))])
def test_profile_steps_are_first_and_count(value, expected):
    assert check_profile_steps(value) == expected


@pytest.mark.parametrize("value", [[1], [0, 1], [1, 0], [1, 2, 3], [1.0, 2], [True, 2]])
def test_bad_profile_steps_are_one_line(value):
    with pytest.raises(ValueError, match=r"\[first step, number of steps\]"):
        check_profile_steps(value)
