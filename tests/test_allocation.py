"""Per-head budget allocation (kvpop/allocation.py) against brute-force references: slot gains query by query, the
retention rule's own retained mass, the concave hull by exhaustive chords, the allocation by enumerating every split."""
import itertools
import json
import random

import pytest
import torch

from kvpop import Budget
from kvpop.allocation import (ALLOCATION_FILE, Allocation, AllocationError, allocate, budget_summary, check_budgets,
                              concave_envelope, greedy_counts, kept_mass, load_allocation, query_positions,
                              save_allocation, slot_gain_sums, slot_gains)
from kvpop.retention import visible


def random_targets(shape, seed, ties=False, window=1):
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(-3, 0, shape, generator=gen).float() if ties else torch.randn(shape, generator=gen)
    y[..., y.shape[-1] - window:] = float("-inf")  # no deciding query for the last `window` tokens (METHOD §2)
    return y


def brute_gains(targets, sink, window, ranking=None, stride=1):
    """Slot gains query by query: order the eligible tokens best first (newer wins ties), the k-th one's mass."""
    n, layers, heads, size = targets.shape
    slots = size - sink - window
    out = torch.zeros(layers, heads, slots, dtype=torch.float64)
    positions = list(range(size - 1, sink + window - 1, -stride))
    for b, l, g in itertools.product(range(n), range(layers), range(heads)):
        y = targets[b, l, g].double().tolist()
        key = y if ranking is None else ranking[b, l, g].tolist()
        for d in positions:
            eligible = sorted(range(sink, d - window + 1), key=lambda t: (key[t], t), reverse=True)
            for j, t in enumerate(eligible):
                out[l, g, j] += torch.tensor(y[t], dtype=torch.float64).exp()
    return out / (n * len(positions))


@pytest.mark.parametrize("case", range(12))
def test_slot_gains_match_brute_force(case):
    rng = random.Random(case)
    size, sink, window = rng.randint(4, 14), rng.randint(0, 2), rng.randint(1, 3)
    if sink + window >= size:
        size = sink + window + 1
    shape = (rng.randint(1, 2), 2, rng.randint(1, 2), size)
    targets = random_targets(shape, case, ties=case % 2 == 0, window=window)
    ranking = None if case % 3 == 0 else torch.randint(0, 3, shape).float() if case % 3 == 1 else torch.randn(shape)
    stride = 1 + case % 3
    got = slot_gains(targets, sink, window, ranking=ranking, query_stride=stride)
    torch.testing.assert_close(got, brute_gains(targets, sink, window, ranking, stride))


@pytest.mark.parametrize("scorer", [False, True])
def test_cumulative_gain_is_the_mass_the_retention_rule_keeps(scorer):
    """U(k) = Σ_{j<k} gain(j) is the mean long-range target mass that METHOD §1's rule (the dense reference
    kvpop.retention.visible) retains with k slots, ranked by the targets (oracle) or by a scorer."""
    sink, window, size = 1, 2, 12
    targets = random_targets((2, 1, 2, size), 7, ties=True, window=window)
    ranking = torch.randint(0, 3, targets.shape).float() if scorer else None
    gains = slot_gains(targets, sink, window, ranking=ranking)
    mass = targets.double().exp()
    pos = torch.arange(size)
    queries = query_positions(size, sink, window)
    for k in range(size - sink - window + 1):
        mask = visible(targets if ranking is None else ranking, Budget(sink, window, k))  # [N, L, H, S, S]
        long_range = (pos[None, :] >= sink) & (pos[None, :] <= pos[:, None] - window)
        kept = ((mask & long_range).double() * mass[..., None, :]).sum(-1)[..., queries].mean((0, -1))  # [L, H]
        torch.testing.assert_close(kept, gains[..., :k].sum(-1))


def test_oracle_gains_are_non_increasing_and_sums_add_over_batches():
    targets = random_targets((3, 2, 2, 16), 3, window=2)
    gains = slot_gains(targets, 1, 2)
    assert (gains[..., 1:] <= gains[..., :-1]).all()
    first, n1 = slot_gain_sums(targets[:1], 1, 2)
    rest, n2 = slot_gain_sums(targets[1:], 1, 2)
    torch.testing.assert_close((first + rest) / (n1 + n2), gains)


def brute_envelope(gains):
    """Least concave majorant of U by every chord: Û(k) = max over i <= k <= j of the chord (i, j) at k."""
    values = [0.0] + list(itertools.accumulate(gains))
    n = len(values)
    hull = [max(values[i] + (k - i) * (values[j] - values[i]) / (j - i) if j > i else values[i]
                for i in range(k + 1) for j in range(k, n)) for k in range(n)]
    return [hull[k + 1] - hull[k] for k in range(n - 1)]


@pytest.mark.parametrize("seed", range(20))
def test_concave_envelope_matches_chords(seed):
    rng = random.Random(seed)
    row = [float(rng.randint(0, 4)) if seed % 2 else rng.random() for _ in range(rng.randint(1, 9))]
    got = concave_envelope(torch.tensor([row], dtype=torch.float64))[0].tolist()
    assert got == pytest.approx(brute_envelope(row), abs=1e-12)
    assert all(a >= b for a, b in zip(got, got[1:]))
    decreasing = sorted(row, reverse=True)
    # a concave U comes back as it is
    assert concave_envelope(torch.tensor(decreasing, dtype=torch.float64)).tolist() == decreasing


def value(gains, counts):
    return sum(float(gains[i, :c].sum()) for i, c in enumerate(counts))


def brute_best(gains, total):
    """Exhaustive: the best Σ_i U_i(k_i) over every split of `total` slots (0 <= k_i <= K)."""
    rows, slots = gains.shape
    return max(value(gains, split) for split in itertools.product(range(slots + 1), repeat=rows)
               if sum(split) == total)


def small_gains(seed, concave):
    rng = random.Random(seed)
    rows, slots = rng.randint(1, 4), rng.randint(1, 4)
    ties = seed % 2 == 0
    table = [[float(rng.randint(0, 3)) if ties else rng.random() for _ in range(slots)] for _ in range(rows)]
    if concave:
        table = [sorted(row, reverse=True) for row in table]
    return torch.tensor(table, dtype=torch.float64)


@pytest.mark.parametrize("seed", range(30))
def test_greedy_is_exact_on_concave_utilities(seed):
    gains = small_gains(seed, concave=True)
    rows, slots = gains.shape
    for total in range(rows * slots + 1):
        counts = greedy_counts(gains, total)
        assert int(counts.sum()) == total and counts.min() >= 0 and counts.max() <= slots
        assert value(gains, counts.tolist()) == pytest.approx(brute_best(gains, total), abs=1e-9)


@pytest.mark.parametrize("seed", range(30))
def test_greedy_is_exact_on_the_hull_of_non_concave_utilities(seed):
    gains = small_gains(seed + 100, concave=False)
    hull = concave_envelope(gains)
    rows, slots = gains.shape
    for total in range(rows * slots + 1):
        counts = greedy_counts(gains, total).tolist()
        assert sum(counts) == total
        assert value(hull, counts) == pytest.approx(brute_best(hull, total), abs=1e-9)  # optimal for the relaxation
        assert value(gains, counts) <= brute_best(gains, total) + 1e-9


@pytest.mark.parametrize("mode", ["per_head", "per_layer"])
def test_allocate_is_optimal_against_enumeration_on_stored_style_targets(mode):
    sink, window, size = 1, 1, 6
    targets = random_targets((2, 2, 2, size), 11, ties=True, window=window)
    gains = slot_gains(targets, sink, window)
    layers, heads, slots = gains.shape
    for mean in range(sink + window, size + 1):
        budgets = allocate(gains, sink=sink, window=window, mean_budget=mean, mode=mode)
        check_budgets(budgets.tolist(), mean_budget=mean, sink=sink, window=window, seq_len=size)
        counts = budgets - sink - window
        if mode == "per_head":
            best = brute_best(gains.reshape(-1, slots), layers * heads * (mean - sink - window))
            got = value(gains.reshape(-1, slots), counts.reshape(-1).tolist())
        else:
            assert (budgets == budgets[:, :1]).all()
            best = brute_best(gains.sum(1), layers * (mean - sink - window))
            got = value(gains.sum(1), counts[:, 0].tolist())
        assert got == pytest.approx(best, abs=1e-12)


@pytest.mark.parametrize("mode", ["per_head", "per_layer"])
def test_edge_budgets_floor_and_everything(mode):
    sink, window, size = 2, 3, 12
    gains = slot_gains(random_targets((1, 3, 2, size), 5, window=window), sink, window)
    assert (allocate(gains, sink=sink, window=window, mean_budget=sink + window, mode=mode) == sink + window).all()
    assert (allocate(gains, sink=sink, window=window, mean_budget=size, mode=mode) == size).all()


def test_equal_gains_give_the_uniform_allocation():
    gains = torch.full((3, 2, 8), 0.25, dtype=torch.float64)
    assert (allocate(gains, sink=1, window=1, mean_budget=6) == 6).all()
    assert (allocate(gains, sink=1, window=1, mean_budget=6, mode="per_layer") == 6).all()
    zero = torch.zeros(1, 4, 8, dtype=torch.float64)  # targets -inf everywhere: every slot worthless
    assert allocate(zero, sink=0, window=1, mean_budget=3).tolist() == [[3, 3, 3, 3]]


def test_a_dominant_head_takes_the_slots():
    gains = torch.zeros(2, 2, 6, dtype=torch.float64)
    gains[1, 0] = torch.linspace(1.0, 0.5, 6)
    budgets = allocate(gains, sink=1, window=1, mean_budget=3)  # 4 extra slots in all, head (1, 0) worth them all
    assert budgets.tolist() == [[2, 2], [6, 2]]


@pytest.mark.parametrize("bad,message", [
    (dict(mean_budget=1), "mean budget"), (dict(mean_budget=13), "mean budget"), (dict(mode="per_group"), "mode"),
    (dict(mean_budget=4.0), "mean budget")])
def test_allocate_refuses_bad_input(bad, message):
    gains = torch.zeros(1, 2, 10, dtype=torch.float64)
    with pytest.raises(AllocationError, match=message):
        allocate(gains, **{**dict(sink=1, window=1, mean_budget=4, mode="per_head"), **bad})


def test_slot_gains_refuse_bad_input():
    targets = random_targets((1, 1, 1, 8), 0)
    with pytest.raises(AllocationError, match="NaN"):
        slot_gains(targets.masked_fill(torch.arange(8) == 2, float("nan")), 1, 1)
    with pytest.raises(AllocationError, match="shape"):
        slot_gains(targets, 1, 1, ranking=torch.randn(1, 1, 1, 7))
    with pytest.raises(AllocationError, match="-inf"):
        slot_gains(targets, 1, 1, ranking=targets)
    with pytest.raises(AllocationError, match="stride"):
        slot_gains(targets, 1, 1, query_stride=0)
    with pytest.raises(AllocationError, match="sink \\+ window < S"):
        slot_gains(targets, 4, 4)
    with pytest.raises(AllocationError, match="layers, kv_heads"):
        slot_gains(targets[0], 1, 1)


PROVENANCE = {"calibration_sha256": "c" * 64, "weights_sha256": "a" * 64, "utility": "oracle", "sequences": 2}


def make(budgets, **changes):
    fields = dict(budgets=budgets, mean_budget=5, sink=1, window=2, seq_len=16, mode="per_head",
                  provenance=PROVENANCE)
    return Allocation(**{**fields, **changes})


def test_allocation_round_trips_through_a_model_folder(tmp_path):
    gains = slot_gains(random_targets((1, 3, 2, 16), 1, window=2), 1, 2)
    budgets = allocate(gains, sink=1, window=2, mean_budget=5)
    allocation = Allocation.from_tensor(budgets, mean_budget=5, sink=1, window=2, seq_len=16, mode="per_head",
                                        provenance=PROVENANCE)
    path = save_allocation(tmp_path, allocation)
    assert path.name == ALLOCATION_FILE
    loaded = load_allocation(tmp_path, num_layers=3, num_kv_heads=2, weights_sha256="a" * 64)
    assert loaded == allocation and torch.equal(loaded.tensor(), budgets)
    assert torch.equal(loaded.topk(), budgets - 3)
    assert loaded.head_budget(2, 1) == Budget(1, 2, int(budgets[2, 1]) - 3)
    assert loaded.head_budget(2, 1).total == int(budgets[2, 1])
    summary = budget_summary(loaded.tensor())
    assert summary["mean"] == 5 and summary["peak"] == int(budgets.max()) == loaded.peak_budget


@pytest.mark.parametrize("budgets,message", [
    (((5, 5), (5, 6)), "sum to 21, not"),
    (((2, 8), (5, 5)), "layer 0 head 0 has budget 2, below sink \\+ window = 3"),
    (((3, 17), (0 + 5, 0 + 5)), "above S = 16"),
    (((5, 5), (5,)), "grid"),
    ((), "grid"),
    (((5, 5.0), (5, 5)), "not an integer"),
])
def test_allocation_refuses_bad_budgets(budgets, message):
    with pytest.raises(AllocationError, match=message):
        make(budgets)


def test_allocation_refuses_bad_fields():
    with pytest.raises(AllocationError, match="same budget"):
        make(((4, 6), (5, 5)), mode="per_layer")
    with pytest.raises(AllocationError, match="mode"):
        make(((5, 5), (5, 5)), mode="per_group")
    with pytest.raises(AllocationError, match="provenance lacks \\['weights_sha256'\\]"):
        make(((5, 5), (5, 5)), provenance={**PROVENANCE, "weights_sha256": ""})
    with pytest.raises(AllocationError, match="utility"):
        make(((5, 5), (5, 5)), provenance={**PROVENANCE, "utility": "dms"})


def test_load_refuses_another_model_and_broken_files(tmp_path):
    with pytest.raises(AllocationError, match="no allocation at"):
        load_allocation(tmp_path, num_layers=2, num_kv_heads=2)
    save_allocation(tmp_path, make(((5, 5), (4, 6))))
    with pytest.raises(AllocationError, match="for 2 layers × 2 KV heads, this model has 3 × 2"):
        load_allocation(tmp_path, num_layers=3, num_kv_heads=2)
    with pytest.raises(AllocationError, match="another base model"):
        load_allocation(tmp_path, num_layers=2, num_kv_heads=2, weights_sha256="b" * 64)
    raw = json.loads((tmp_path / ALLOCATION_FILE).read_text())
    raw["budgets"][0][0] = 6  # edited by hand: no longer sums
    (tmp_path / ALLOCATION_FILE).write_text(json.dumps(raw))
    with pytest.raises(AllocationError, match="sum to 21"):
        load_allocation(tmp_path, num_layers=2, num_kv_heads=2)
    (tmp_path / ALLOCATION_FILE).write_text("{not json")
    with pytest.raises(AllocationError, match="not an allocation file"):
        load_allocation(tmp_path, num_layers=2, num_kv_heads=2)
    (tmp_path / ALLOCATION_FILE).write_text(json.dumps({**raw, "format_version": 9}))
    with pytest.raises(AllocationError, match="format 9"):
        load_allocation(tmp_path, num_layers=2, num_kv_heads=2)


def test_kept_mass_is_the_cumulative_gain_of_each_head():
    gains = torch.tensor([[[3.0, 2.0, 1.0], [5.0, 0.0, 0.0]]], dtype=torch.float64)
    assert kept_mass(gains, torch.tensor([[4, 2]]), sink=1, window=1) == pytest.approx((3.0 + 2.0 + 0.0) / 2)
    assert kept_mass(gains, torch.tensor([[3, 5]]), sink=1, window=1) == pytest.approx((3.0 + 5.0) / 2)


# ------------------------------------------------------------------------------------------------ the stage
def _store_targets(cfg, rows: int, seed: int = 0):
    """A committed target directory for ``cfg`` (random targets, no teacher pass) and its precompute record."""
    import numpy as np

    from pipelines import records, store
    from pipelines.data import load_tokenizer

    tokenizer = load_tokenizer(cfg)
    identity = store.target_identity(cfg, tokenizer)
    folder = store.targets_dir(cfg, tokenizer)
    size, k, shape = identity["seq_len"], identity["top_k"], (identity["num_layers"], identity["num_kv_heads"])
    rng = np.random.default_rng(seed)
    plan = tuple(store.ShardPlan(i, store.shard_name(i), (f"train-{i:06d}",)) for i in range(rows))
    columns = {}
    for w in identity["windows"]:
        y = (rng.standard_normal((rows, *shape, size)) * np.array([1.0, 3.0])[None, None, :, None]).astype(np.float32)
        y[..., size - w:] = -np.inf
        columns[store.target_column(w)] = y
    header = store.Header(identity, store.key_of(identity), plan, str(cfg.model.resolved_path()), ("id",), "now")
    with store.writing(folder, header) as writer:
        for entry in plan:
            i = entry.shard
            row = {"input_ids": rng.integers(0, 100, (1, size)).astype(np.int32),
                   **{name: y[i:i + 1] for name, y in columns.items()},
                   "topk_values": rng.standard_normal((1, size, k)).astype(np.float32),
                   "topk_indices": rng.integers(0, 100, (1, size, k)).astype(np.int32)}
            name, nbytes, digest = store.write_shard(folder, i, store.shard_table(entry.ids, row, header.key))
            writer.commit(store.ShardRecord(i, name, 1, entry.ids, nbytes, digest))
    records.commit(cfg, "precompute", {"targets_key": header.key, "path": str(folder), "rows": rows,
                                       "shards": rows})
    return identity, columns


@pytest.mark.slow
def test_the_allocate_stage_writes_its_allocation_record_and_mlflow_run(tiny_setup, tmp_path, capsys):
    import mlflow

    from jobs.allocate import cli
    from pipelines import allocate as stage
    from pipelines import records
    from pipelines.config import ConfigError
    from tests.pipeline_helpers import tiny_config, tiny_overrides

    home = tmp_path / "home"
    cfg = tiny_config(tiny_setup, home, "allocate.query_stride=4", "allocate.sequences=3")
    with pytest.raises(ConfigError, match="no precomputed targets"):
        stage.run(cfg)
    assert not (home / "allocations").exists()
    identity, columns = _store_targets(cfg, rows=4)
    b = cfg.budget
    result = stage.run(cfg)
    assert result.computed and result.path.name == ALLOCATION_FILE
    gains = slot_gains(torch.from_numpy(columns[f"targets_w{b.window}"][:3]), b.sink, b.window, query_stride=4)
    expected = allocate(gains, sink=b.sink, window=b.window, mean_budget=b.total)
    assert torch.equal(result.allocation.tensor(), expected)
    assert result.allocation.provenance["sequences"] == 3 and result.allocation.provenance["utility"] == "oracle"
    weights = identity["teacher"]["weights_sha256"]
    assert load_allocation(result.path.parent, num_layers=2, num_kv_heads=2, weights_sha256=weights) == \
        result.allocation
    record = records.for_config(cfg, "allocate")
    assert record.payload["path"] == str(result.path) and record.payload["peak"] == int(expected.max())
    run = mlflow.MlflowClient(cfg.tracking_uri()).get_run(result.mlflow_run_id)
    assert run.data.tags["kvpop.stage"] == "allocate" and run.data.metrics["budget_peak"] == int(expected.max())
    assert run.data.metrics["kept_mass_allocated"] >= run.data.metrics["kept_mass_uniform"]
    assert [a.path for a in mlflow.MlflowClient(cfg.tracking_uri()).list_artifacts(run.info.run_id)] == \
        [ALLOCATION_FILE]
    again = stage.run(cfg)
    assert not again.computed and again.mlflow_run_id == result.mlflow_run_id
    capsys.readouterr()
    overrides = tiny_overrides(tiny_setup, home, "allocate.query_stride=4", "allocate.sequences=3")
    assert cli([arg for o in overrides for arg in ("--set", o)]) == 0
    assert f"allocation: {result.path} (per_head, mean B {b.total}" in capsys.readouterr().out
    layer = stage.run(tiny_config(tiny_setup, home, "allocate.query_stride=4", "allocate.mode=per_layer"))
    assert layer.computed and (layer.allocation.tensor() == layer.allocation.tensor()[:, :1]).all()
    with pytest.raises(ConfigError, match="allocate.sequences=9 but the targets"):
        stage.run(tiny_config(tiny_setup, home, "allocate.sequences=9"))


@pytest.mark.parametrize("setting,message", [("allocate.mode=per_group", "allocate.mode must be one of"),
                                             ("allocate.mean_budget=513", "allocate.mean_budget=513 must be in"),
                                             ("allocate.mean_budget=60", "[sink + window, data.seq_len] = [68, 512]"),
                                             ("allocate.query_stride=0", "allocate.query_stride must be >= 1")])
def test_the_allocate_cli_refuses_bad_settings_in_one_line(setting, message, capsys):
    from jobs.allocate import cli

    assert cli(["--set", setting]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
