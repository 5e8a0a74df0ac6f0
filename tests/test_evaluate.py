"""pipelines.evaluate on a tiny random Llama (SmolLM2's tokenizer, so that the task prompts tokenize for real)."""
import copy
import math

import pytest
import torch

import kvpop
from kvpop import Budget
from pipelines import evaluate as E
from pipelines import tasks as T
from tests.models import tiny_model

BUDGET = Budget(2, 8, 14)
SEQ = 48


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from threads, and 2 threads on a busy 2-core box run ~50x slower (spin-waits)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)


def retrofitted(tokenizer, seed=0):
    model = tiny_model("llama", "gqa", vocab=len(tokenizer), seed=seed)
    return kvpop.retrofit(model, BUDGET, scorer="mlp")


def sequences(count=3, size=SEQ, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"id": f"s{i}", "input_ids": torch.randint(3, 2000, (size,), generator=g).tolist()} for i in range(count)]


@pytest.mark.pretrained
def test_all_policies_two_budgets(tokenizer):
    model = retrofitted(tokenizer)
    tasks = {name: T.generate_samples(name, 2, tokenizer, context=64) for name in T.TASKS}
    details = {}
    rows = E.evaluate_model(model, tokenizer, sequences(), budgets=[24, 16], tasks=tasks, batch_size=2,
                            generation_batch_size=4, dynamic_sequences=2, progress=False, details=details)
    assert model.kvpop_runtime.policy.name == "kvpop" and model.kvpop_runtime.policy.budget == BUDGET  # restored
    assert [(r["policy"], r["B"]) for r in rows] == [(p, b) for b in (24, 16) for p in E.POLICY_ORDER]
    columns = ["policy", "budget", "B", "CR", "n_seq", "positions", "top1_agreement", "kl", "token_acc",
               "token_acc_dense", "CR_tasks", *T.TASKS, "token_acc_rel", *(f"{t}_rel" for t in T.TASKS)]
    for row in rows:
        assert list(row) == columns
        assert row["CR"] == pytest.approx(1 - row["B"] / SEQ)
        assert row["n_seq"] == (2 if row["policy"] in ("tova", "h2o") else 3)
        assert row["positions"] == row["n_seq"] * (SEQ - row["B"])
        for key in ("top1_agreement", "kl", "token_acc", "token_acc_dense", *T.TASKS):
            assert math.isfinite(row[key]), (row["policy"], key)
        if row["policy"] == "dense":
            assert row["top1_agreement"] == 1.0 and abs(row["kl"]) < 1e-6
            assert row["token_acc"] == row["token_acc_dense"]
        else:
            assert row["kl"] > 0
    streaming = next(r for r in rows if r["policy"] == "streaming" and r["B"] == 16)
    assert streaming["budget"] == "s2-w14-k0"  # same total, no long-range slots
    assert next(r for r in rows if r["policy"] == "kvpop" and r["B"] == 16)["budget"] == "s2-w8-k6"
    # retention summaries for the static policies with long-range slots, with the oracle overlap for the others
    kinds = {(r["policy"], r["total"]) for r in details["retention"]}
    assert kinds == {(p, b) for p in ("random", "oracle", "kvpop") for b in (24, 16)}
    kv = next(r for r in details["retention"] if r["policy"] == "kvpop" and r["total"] == 16)
    assert len(kv["mean_age"]) == 2 and len(kv["mean_age"][0]) == 2 and "oracle_overlap" in kv
    assert all(8 <= a <= SEQ for layer in kv["mean_age"] for a in layer)  # long-range tokens are older than w
    assert all(0 <= o <= 1 for layer in kv["oracle_overlap"] for o in layer)
    assert len(details["generations"]["kvpop.B16"]) == 6
    text = E.format_table(rows)
    assert "kvpop" in text and "s2-w8-k6" in text
    metrics = E.row_metrics(rows)
    assert metrics["dense.B24.top1_agreement"] == 1.0 and "kvpop.B16.kl" in metrics
    import matplotlib.pyplot as plt

    for fig in (E.plot_metrics_vs_cr(rows, list(T.TASKS)), E.plot_retention(details["retention"])):
        assert fig is not None
        plt.close(fig)


@pytest.mark.pretrained
def test_left_padded_generation_equals_one_prompt_at_a_time(tokenizer):
    """Batched generation pads on the left; every policy (the oracle with its per-prompt targets) must give each
    prompt the continuation it gets alone."""
    model = kvpop.retrofit(tiny_model("llama", "gqa", vocab=len(tokenizer)), BUDGET, scorer="mlstm")
    prompts = [T.prompt_ids(s, tokenizer) for n in T.TASKS for s in T.generate_samples(n, 2, tokenizer, context=64)]
    assert len({len(p) for p in prompts}) > 1
    targets = [E.teacher_targets(model, torch.tensor([p]), BUDGET.window)[:, 0] for p in prompts]
    for name in E.POLICY_ORDER:
        kvpop.set_policy(model, name, None if name == "dense" else BUDGET)
        extra = {"oracle_targets": targets} if name == "oracle" else {}
        batched = E.generate(model, tokenizer, prompts, max_new_tokens=6, batch_size=6, **extra)
        alone = E.generate(model, tokenizer, prompts, max_new_tokens=6, batch_size=1, **extra)
        assert batched == alone, name


def test_budget_covering_the_sequence_equals_dense():
    model = kvpop.retrofit(tiny_model("llama", "gqa"), BUDGET, scorer="mlstm")
    seqs = [torch.randint(1, 97, (40,)) for _ in range(2)]
    rows = E.evaluate_model(model, None, seqs, budgets=[Budget(2, 8, 40)], metric_start=0, progress=False)
    assert len(rows) == 7
    for row in rows:
        assert row["top1_agreement"] == 1.0, row["policy"]
        assert abs(row["kl"]) < 1e-6, row["policy"]
        assert row["positions"] == 80


def test_reference_model_and_oracle_targets_on_a_retrofitted_model():
    base = tiny_model("llama", "gqa")
    ids = torch.randint(1, 97, (2, 40))
    plain = E.teacher_targets(base, ids, 8)
    model = kvpop.retrofit(copy.deepcopy(base), BUDGET, scorer="mlp")  # policy kvpop: the teacher pass swaps it
    assert torch.equal(E.teacher_targets(model, ids, 8), plain)
    assert model.config._attn_implementation == "kvpop"
    same = E.evaluate_model(model, None, ids, policies=["dense", "streaming"], reference=base, progress=False)
    assert same[0]["top1_agreement"] == 1.0 and abs(same[0]["kl"]) < 1e-6
    other = E.evaluate_model(model, None, ids, policies=["dense"], reference=tiny_model("llama", "gqa", seed=1),
                             progress=False)
    assert other[0]["kl"] > 1e-3  # the dense row is the student's own dense mode against the teacher


def test_resolve_budgets():
    base = Budget(4, 32, 96)
    assert E.resolve_budgets(base, 512) == [base]
    got = E.resolve_budgets(base, 512, totals=(256, 128), ratios=(0.75, 0.875))
    assert got == [Budget(4, 32, 220), Budget(4, 32, 92), Budget(4, 32, 28)]  # 128 = CR .75: deduplicated
    with pytest.raises(E.ConfigError, match="sink \\+ window"):
        E.resolve_budgets(base, 512, totals=(30,))


def test_errors():
    model = kvpop.retrofit(tiny_model("llama", "gqa"), BUDGET, scorer=None, policy="streaming")
    ids = torch.randint(1, 97, (1, 40))
    with pytest.raises(ValueError, match="needs a model retrofitted with scorers"):
        E.evaluate_model(model, None, ids, progress=False)
    with pytest.raises(ValueError, match="unknown policies"):
        E.evaluate_model(model, None, ids, policies=["lru"], progress=False)
    with pytest.raises(ValueError, match="retrofitted"):
        E.evaluate_model(tiny_model("llama", "gqa"), None, ids, progress=False)


@pytest.mark.pretrained
def test_run_logs_table_metrics_and_figures(tokenizer, tmp_path, monkeypatch):
    import mlflow

    from pipelines.config import config_from_dict

    model = retrofitted(tokenizer)
    checkpoint = kvpop.save_retrofitted(model, tmp_path / "trained", tokenizer)
    cfg = config_from_dict({
        "home": str(tmp_path / "home"),
        "budget": {"sink": 2, "window": 8, "topk": 14}, "precompute": {"windows": [8]}, "data": {"seq_len": SEQ},
        "eval": {"checkpoint": str(checkpoint), "budgets": [24, 16], "task_samples": 1, "task_context": 64,
                 "batch_size": 2, "generation_batch_size": 3, "policies": ["dense", "streaming", "tova", "oracle",
                                                                           "kvpop"]}})
    monkeypatch.setattr(E, "load_eval_sequences", lambda cfg, tokenizer=None: sequences(2))
    result = E.run(cfg, progress=False)
    assert len(result.rows) == 10
    assert result.output_dir.parent == cfg.home_dir() / "eval"
    for name in ("table.txt", "table.csv", "table.json", "metrics_vs_cr.png", "retention.png"):
        assert (result.output_dir / name).is_file(), name
    mlflow.set_tracking_uri(cfg.tracking_uri())
    run = mlflow.get_run(result.run_id)
    assert run.data.tags["kvpop.stage"] == "evaluate"
    assert run.data.metrics["dense.B24.top1_agreement"] == 1.0
    assert "kvpop.B16.kl" in run.data.metrics and "tova.B24.token_acc" in run.data.metrics
    assert "oracle.B16.kv_retrieval" in run.data.metrics
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(result.run_id, "eval")}
    assert {"eval/table.json", "eval/table.csv", "eval/metrics_vs_cr.png", "eval/retention.png"} <= artifacts
