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


def test_every_prefill_row_kind_runs_on_cpu_as_the_eager_prefill():
    """The graphed rows (captured in the prefill, or kept from an earlier one) replay only on CUDA; on CPU they are
    the eager bounded prefill, and the kept graph holds nothing."""
    import kvpop
    from benchmarks.capacity import GRAPHED, KEPT, kept_graph, run_prefill
    from kvpop.decode import cache_tensors
    from tests.models import tiny_model

    model = tiny_model("llama", "gqa")
    kvpop.retrofit(model, kvpop.Budget(2, 4, 6), scorer="mlstm")
    ids = torch.randint(1, 97, (2, 40))
    caches = [run_prefill(model, policy, ids, 8) for policy in ("kvpop", GRAPHED, KEPT)]
    for other in caches[1:]:
        assert all(torch.equal(a, b) for a, b in zip(cache_tensors(caches[0]), cache_tensors(other), strict=True))
    assert kept_graph().decoder is None
