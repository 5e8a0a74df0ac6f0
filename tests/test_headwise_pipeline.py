"""Per-head budgets in the pipeline (issue 43 items 3-4): training at the allocate stage's allocation, the evaluation's
``<policy>-H`` rows beside the uniform ones, and every row's memory two ways (mean and peak per (layer, KV head))."""
import dataclasses
import json

import pyarrow.parquet as pq
import pytest
import torch

import kvpop
from kvpop import Budget
from kvpop.allocation import ALLOCATION_FILE, Allocation, allocate, save_allocation
from kvpop.evaluation import Setting, settings
from pipelines.config import ConfigError, config_from_dict
from tests.models import tiny_model

pytestmark = pytest.mark.pretrained  # the tiny teachers use SmolLM2's tokenizer


# ---------------------------------------------------------------------------------------------- training
@pytest.mark.slow
def test_training_at_the_allocate_stages_allocation(tiny_setup, tmp_path):
    """``train.allocation=allocate``: the allocate record's budgets reach the workers' objective and student, name the
    run apart, train each head at its own cutoff on a stored batch, and travel with the final model; a missing record,
    another model's allocation or another mean are one line each."""
    from pipelines import allocate as stage
    from pipelines import store, train
    from pipelines.train_worker import batch_losses, build_student, write_final_model
    from tests.pipeline_helpers import tiny_config
    from tests.test_allocation import _store_targets

    home = tmp_path / "home"
    uniform = tiny_config(tiny_setup, home, "allocate.query_stride=4")
    cfg = tiny_config(tiny_setup, home, "allocate.query_stride=4", "train.allocation=allocate")
    identity, _ = _store_targets(uniform, rows=4)
    with pytest.raises(ConfigError, match="no allocate record for this config: run the allocate stage first"):
        train.open_inputs(cfg)
    made = stage.run(cfg)
    targets = train.open_inputs(cfg)
    spec = train.make_spec(cfg, targets, "headwise", tmp_path, "")
    assert spec.allocation == made.allocation and spec.objective.head_topk == made.allocation.head_topk()
    assert spec.objective.budget == cfg.budget
    name = train.run_name_of(cfg, targets)
    assert "per_head" in name and name != train.run_name_of(uniform, targets)

    model, tokenizer = build_student(spec)
    assert model.kvpop_runtime.policy.head_topk == made.allocation.head_topk()
    table = pq.read_table(targets.files[0])
    batch = {c: torch.from_numpy(table.column(c).combine_chunks().to_numpy_ndarray().copy())
             for c in ("input_ids", spec.target_column, "topk_values", "topk_indices")}
    losses = batch_losses(model, batch, spec)
    losses["loss"].backward()
    assert torch.isfinite(losses["loss"]) and all(p.grad is not None for p in kvpop.scorers(model).parameters())
    flat = dataclasses.replace(spec, objective=dataclasses.replace(spec.objective, head_topk=None))
    assert batch_losses(model, batch, flat)["ret_loss"].item() != pytest.approx(losses["ret_loss"].item())

    out = tmp_path / "run" / "final_model"
    write_final_model(model, out, tokenizer, spec, steps=1)
    assert (out / ALLOCATION_FILE).is_file()
    loaded, _ = kvpop.load_retrofitted(out, base=cfg.model.resolved_path())
    assert loaded.kvpop_runtime.allocation == made.allocation

    other = dataclasses.replace(made.allocation, provenance={**made.allocation.provenance, "weights_sha256": "b" * 64})
    save_allocation(tmp_path / "other", other)
    elsewhere = tiny_config(tiny_setup, home, f"train.allocation={tmp_path / 'other'}")
    with pytest.raises(ConfigError, match="train.allocation: .*another base model"):
        train.open_inputs(elsewhere)
    with pytest.raises(ConfigError, match="allocate.mean_budget=40, not budget.total=28"):
        tiny_config(tiny_setup, home, "train.allocation=allocate", "allocate.mean_budget=40")
    with pytest.raises(ConfigError, match="not defined beside train.allocation"):
        tiny_config(tiny_setup, home, "train.allocation=allocate", "train.extra_topks=[4]")


# ---------------------------------------------------------------------------------------------- evaluation
def test_settings_name_label_and_memory_of_allocated_rows():
    alloc = Allocation(budgets=((4, 10), (7, 7)), mean_budget=7, sink=1, window=3, seq_len=16, mode="per_head",
                       provenance={"calibration_sha256": "c", "weights_sha256": "a", "utility": "oracle"})
    b = Budget(1, 3, 3)
    runs = settings(["dense", "streaming", "kvpop"], [b], allocated=["kvpop", "oracle"], allocations={7: alloc})
    assert [s.name for s in runs] == ["dense", "streaming", "kvpop", "kvpop-H", "oracle-H"]
    assert runs[3].label == "s1-w3-k3 per_head peak 10" and runs[3].key == "kvpop-H.B7"
    # held at the queries 7 … 15 (metrics count d >= B): min(d + 1, b) per head
    want = sum(min(d + 1, x) for x in (4, 10, 7, 7) for d in range(7, 16)) / 36
    assert runs[3].memory(16, 7) == {"mean": pytest.approx(want), "peak": 10}
    assert runs[2].memory(16, 7) == {"mean": 7.0, "peak": 7} and runs[1].memory(16, 7)["peak"] == 7
    assert runs[0].memory(16, 7) == {"mean": pytest.approx(sum(range(8, 17)) / 9), "peak": 16}
    with pytest.raises(ValueError, match="per-head budgets are for"):
        Setting("streaming", b, allocation=alloc)
    with pytest.raises(ValueError, match="redistributes"):
        Setting("kvpop", Budget(1, 3, 4), allocation=alloc)
    with pytest.raises(ValueError, match="no allocation for that budget"):
        settings(["kvpop"], [Budget(1, 3, 5)], allocated=["kvpop"], allocations={7: alloc})


SEQ = 48


@pytest.fixture
def evaluation(smollm2_dir, tmp_path, monkeypatch):
    """A tiny retrofitted checkpoint, a DMS baseline (random gates), five held-out sequences, and an allocate record
    whose gains favour one head."""
    from transformers import AutoTokenizer

    from pipelines import allocate as stage
    from pipelines import eval_parts, records

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    model = kvpop.retrofit(tiny_model("llama", "gqa", vocab=len(tokenizer)), Budget(2, 8, 14), scorer="mlp")
    checkpoint = kvpop.save_retrofitted(model, tmp_path / "trained", tokenizer)
    dms = kvpop.retrofit(tiny_model("llama", "gqa", vocab=len(tokenizer), seed=1), Budget(2, 8, 0), scorer="dms",
                         policy="dms", scorer_options={"scale": 1.0, "offset": 2.0})
    for gate in kvpop.scorers(dms):
        gate.proj.weight.data.normal_(generator=torch.Generator().manual_seed(3))
    kvpop.save_retrofitted(dms, tmp_path / "dms", tokenizer)
    g = torch.Generator().manual_seed(0)
    heldout = [{"id": f"eval-{i:06d}", "input_ids": torch.randint(3, 2000, (SEQ,), generator=g).tolist(), "docs": []}
               for i in range(5)]
    monkeypatch.setattr(eval_parts, "heldout_sequences", lambda cfg, tok: heldout)
    monkeypatch.setattr(eval_parts, "training_documents", lambda cfg, tok: [])
    cfg = config_from_dict({
        "home": str(tmp_path / "home"), "model": {"path": str(checkpoint)}, "budget": {"sink": 2, "window": 8,
                                                                                      "topk": 14},
        "precompute": {"windows": [8]}, "data": {"seq_len": SEQ}, "tracking": {"experiment": "tests"},
        "eval": {"checkpoint": str(checkpoint), "compression_ratios": [0.5, 0.75],
                 "policies": ["dense", "streaming", "oracle", "kvpop"], "allocated": ["kvpop", "oracle"],
                 "tasks": ["niah_single"], "task_contexts": [128], "task_depths": [0.5], "task_samples": 1,
                 "task_min_dense": 0.0, "max_new_tokens": 3, "generation_prompts": 0, "batch_size": 2,
                 "generation_batch_size": 2, "resamples": 200, "dynamic_sequences": 0,
                 "baselines": {"dms": str(tmp_path / "dms")}, "capped": True}})
    slots = SEQ - 10
    scale = torch.tensor([[1.6, 1.0], [0.8, 1.2]], dtype=torch.float64)  # [L, Hkv]: unequal heads
    gains = scale[..., None] * torch.linspace(1.0, 0.01, slots, dtype=torch.float64)
    budgets = allocate(gains, sink=2, window=8, mean_budget=24)
    made = Allocation.from_tensor(budgets, mean_budget=24, sink=2, window=8, seq_len=SEQ, mode="per_head",
                                  provenance={"calibration_sha256": "c" * 64, "weights_sha256": "a" * 64,
                                              "utility": "oracle"})
    path = save_allocation(tmp_path / "allocation", made)
    torch.save(gains, path.parent / stage.GAINS_FILE)
    records.commit(cfg, "allocate", {"path": str(path), "mlflow_run_id": "", "targets": "", "mode": "per_head",
                                     "mean": 24.0, "peak": made.peak_budget})
    return cfg, gains


@pytest.mark.slow
def test_the_evaluation_adds_allocated_rows_and_reports_memory_two_ways(evaluation):
    """``eval.allocated``: kvpop-H and oracle-H at every budget (allocated from the record's gains at each mean),
    compared with their uniform rows, recall cells for them too, and a memory table where -H holds the same mean
    and a larger peak; ``eval.capped``: DMS again at its matched budget, capped at the -H rows' peak there (dms-cap),
    paired with kvpop-H at the same reservation; without an allocate record, one line."""
    from pipelines import evaluate as E

    cfg, gains = evaluation
    result = E.run(cfg, progress=False)
    found = [json.loads(line) for line in (result.output_dir / "predictions.jsonl").read_text().splitlines()]
    text = {(r["policy"], r["B"]): r for r in found if r["part"] == "text"}
    for total in (24, 12):
        want = allocate(gains, sink=2, window=8, mean_budget=total)
        assert text[("kvpop-H", total)]["budget"].endswith(f"per_head peak {int(want.max())}")
        assert ("oracle-H", total) in text
    assert {r["policy"] for r in found if r["part"] == "recall"} >= {"kvpop-H", "oracle-H"}
    kl = {(r["policy"], r["B"], r["item"]): r["kl"] for r in found if r["part"] == "text"}
    assert any(kl[("kvpop-H", *k[1:])] != pytest.approx(v, abs=1e-7) for k, v in kl.items() if k[0] == "kvpop")
    diffs = result.summary["differences"]
    assert any(d["policy"] == "kvpop-H" and d["vs"] == "kvpop" for d in diffs)
    assert any(d["policy"] == "oracle-H" and d["vs"] == "oracle" for d in diffs)
    memory = {(m["policy"], m["B"]): m for m in result.summary["memory"]}
    assert memory[("kvpop", 24)] == {"policy": "kvpop", "B": 24, "mean": 24.0, "peak": 24}
    assert memory[("kvpop-H", 24)]["peak"] == int(allocate(gains, sink=2, window=8, mean_budget=24).max()) > 24
    assert memory[("kvpop-H", 24)]["mean"] <= 24 and memory[("dense", 24)]["peak"] == SEQ
    assert "memory per (layer, KV head)" in result.text and "kvpop-H, oracle-H: the same policies" in result.text

    matched = result.summary["occupancy"]["dms"]["B"]
    capped = result.summary["capped"]["dms"]
    peak = int(allocate(gains, sink=2, window=8, mean_budget=matched).max())
    assert capped["B"] == matched and capped["cap"] == max(peak, matched) >= capped["peak"]
    assert memory[("dms-cap", matched)]["peak"] == capped["peak"] <= memory[("kvpop-H", matched)]["peak"]
    assert memory[("dms-cap", matched)]["mean"] < memory[("dms", matched)]["mean"]
    assert capped["peak"] == capped["cap"] < result.summary["occupancy"]["dms"]["peak"]  # the cap binds
    cap_rows = [r for r in found if r["policy"] == "dms-cap"]
    assert {r["part"] for r in cap_rows} == {"text", "recall"} and {r["B"] for r in cap_rows} == {matched}
    assert all(r["budget"].startswith(f"s2-w8-k0 cap {capped['cap']}") for r in cap_rows)
    assert any(d["policy"] == "kvpop-H" and d["vs"] == "dms-cap" and d["B"] == matched for d in diffs)
    assert f"dms-cap: dms capped at {capped['cap']} tokens" in result.text
    identity = json.loads((result.output_dir / "config.json").read_text())
    assert identity["allocated"]["policies"] == ["kvpop", "oracle"] and len(identity["allocated"]["gains_sha256"]) == 64
    assert identity["capped"] is True

    bare = config_from_dict({**cfg.to_dict(), "home": str(cfg.home_dir().parent / "elsewhere")})
    with pytest.raises(ConfigError, match="eval.allocated: no allocation .* run the allocate stage first"):
        E.plan(bare)


def test_report_pairs_allocated_rows_with_their_uniform_rows():
    from pipelines import report

    records = [{"part": "text", "policy": p, "B": 8, "item": f"i{i}", "top1_agreement": v + 0.01 * i, "kl": 1 - v,
                "token_acc": v} for i in range(6) for p, v in (("dense", 1.0), ("streaming", 0.5), ("oracle", 0.9),
                                                               ("kvpop", 0.7), ("kvpop-H", 0.8), ("oracle-H", 0.95),
                                                               ("dms", 0.75))]
    summary = report.summarize(records, [{"B": 8, "CR": 0.5}], resamples=200)
    pairs = {(d["policy"], d["vs"]) for d in summary["differences"] if d["metric"] == "kl"}
    assert {("kvpop-H", "kvpop"), ("oracle-H", "oracle"), ("kvpop-H", "dms"), ("kvpop", "dms")} <= pairs
    assert ("kvpop", "kvpop-H") not in pairs  # -H is not a trained baseline's row
    table = report.format_memory([{"policy": "kvpop-H", "B": 8, "mean": 7.5, "peak": 13},
                                  {"policy": "dms", "B": 8, "mean": 8.0, "peak": 16}])
    assert "kvpop-H" in table and "13" in table and "peak" in table
    logged = report.mlflow_metrics({**summary, "memory": [{"policy": "kvpop-H", "B": 8, "mean": 7.5, "peak": 13}]})
    assert logged["kvpop-H.B8.memory_mean"] == 7.5 and logged["kvpop-H.B8.memory_peak"] == 13


# ---------------------------------------------------------------------------------------------- the sweep
def test_the_sweep_crosses_allocation_mode_with_mean_budget(tiny_setup, tmp_path):
    """``sweep.grid`` ``train.allocation`` × ``allocate.mode`` with ``sweep.budgets``: one uniform trial per budget and
    one per (mode, budget), each trial allocated by the driver before Tune at its own mean, in its own mode, and
    training at it (its spec's objective, its own run name)."""
    from pipelines import sweep, train
    from tests.pipeline_helpers import tiny_config
    from tests.test_allocation import _store_targets

    home = tmp_path / "home"
    grid = ["sweep.scorers=[mlp]", "sweep.lrs=[0.01]", "sweep.budgets=[[4, 8, 12], [4, 8, 20]]",
            "sweep.grid={train.allocation: ['', allocate], allocate.mode: [per_head, per_layer]}",
            "allocate.query_stride=4", "sweep.steps=2", "sweep.grace_period=1"]
    cfg = tiny_config(tiny_setup, home, *grid)
    _store_targets(cfg, rows=4)
    plan = sweep.plan(cfg)
    labels = [sweep.variant_label(p) for p in plan.variants]
    assert labels == ["mlp-s4-w8-k12-lr0.01-uniform", "mlp-s4-w8-k12-lr0.01-H-per_head",
                      "mlp-s4-w8-k12-lr0.01-H-per_layer", "mlp-s4-w8-k20-lr0.01-uniform",
                      "mlp-s4-w8-k20-lr0.01-H-per_head", "mlp-s4-w8-k20-lr0.01-H-per_layer"]
    made = sweep.allocate_trials(plan)
    assert [(m.allocation.mean_budget, m.allocation.mode) for m in made] == [
        (24, "per_head"), (24, "per_layer"), (32, "per_head"), (32, "per_layer")]
    for m in made:
        grid_ = m.allocation.tensor()
        assert int(grid_.sum()) == grid_.numel() * m.allocation.mean_budget
        if m.allocation.mode == "per_layer":
            assert all(len(set(row)) == 1 for row in m.allocation.budgets)
    assert len({m.path for m in made}) == 4
    trials = [sweep.apply_overrides(plan.base, p) for p in plan.variants]
    targets = train.open_inputs(trials[1])
    names = {train.run_name_of(t, targets) for t in trials}
    assert len(names) == 6
    assert train.make_spec(trials[4], targets, "t", tmp_path, "").objective.head_topk == made[2].allocation.head_topk()
    assert train.make_spec(trials[3], targets, "t", tmp_path, "").objective.head_topk is None
