"""The train stage's online targets, warm-up and schedule, per-epoch seeded shuffle and in-training held-out
evaluation (issue 41): online ≡ stored targets on the same batch; the learning-rate values; the row order; the run
identity of the new keys; an online Ray run resumed after N steps = one run of N + M steps, with its held-out
learning curve in MLflow and drawn from there."""
from __future__ import annotations

import dataclasses
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import kvpop
from kvpop.objective import Objective
from kvpop.pretrained import load_pretrained
from pipelines import precompute, records, row_sequence, store, train
from pipelines.config import ConfigError
from pipelines.train_worker import TrainSpec, batch_losses, build_student, lr_factor
from tests.pipeline_helpers import tiny_config

pytestmark = pytest.mark.pretrained  # the tiny teachers use SmolLM2's tokenizer


def _spec(tiny_setup, tmp_path, **options) -> TrainSpec:
    base = tiny_setup / "teacher"
    fields = dict(run_name="r", run_dir=str(tmp_path / "r"), base_path=str(base),
                  base_sha256=kvpop.files.weights_digest(base), objective=Objective(kvpop.Budget(4, 8, 16)),
                  policy="kvpop", scorer="mlstm", scorer_options={}, mode="scorer_only", target_column="targets_w8",
                  lr=0.01, base_lr=1e-5, grad_clip=1.0, steps=3, batch_size=2, seq_len=64, seed=0, use_gpu=False,
                  sharded=False, bf16=False, threads=1, checkpoint_every=1, log_every=1, fail_at_step=0,
                  tracking_uri="", mlflow_run_id="")
    return TrainSpec(**{**fields, **options})


def _grads(model) -> list[torch.Tensor]:
    return [p.grad.clone() for p in kvpop.scorers(model).parameters() if p.grad is not None]


@pytest.mark.parametrize("objective, query_power", [
    (Objective(kvpop.Budget(4, 8, 16)), 1.0),
    (Objective(kvpop.Budget(4, 8, 16), recency=0.01, extra_topks=(3, 30), weight="margin"), 16.0),
    (Objective(kvpop.Budget(4, 8, 1), beta=0.5), 1.0),  # an edge budget: one long-range slot
])
def test_online_targets_give_the_stored_loss_on_the_same_batch(tiny_setup, tmp_path, objective, query_power):
    """The step's own dense pass + transposed target pass (online) and the precompute stage's rows (stored) give the
    same losses, metrics and scorer gradients on the same sequences."""
    stored_spec = _spec(tiny_setup, tmp_path, objective=objective)
    online_spec = dataclasses.replace(stored_spec, online=True, top_k=8, target_column="",
                                      target_options={"group_reduce": "max", "query_power": query_power})
    ids = torch.randint(1, 1000, (2, 64), generator=torch.Generator().manual_seed(3))
    teacher, _ = load_pretrained(tiny_setup / "teacher", dtype=torch.float32)
    rows = precompute.compute_rows(teacher, ids.numpy(), [8], top_k=8, query_power=query_power)
    stored_batch = {name: torch.from_numpy(value) for name, value in rows.items()}  # as the shard columns arrive

    results = {}
    for name, spec, batch in (("stored", stored_spec, stored_batch),
                              ("online", online_spec, {"input_ids": ids.to(torch.int32)})):
        model, _ = build_student(spec)  # the same seeded scorers
        parts = batch_losses(model, batch, spec)
        parts["loss"].backward()
        results[name] = ({k: v.detach() for k, v in parts.items()}, _grads(model))
    (stored, stored_grads), (online, online_grads) = results["stored"], results["online"]
    assert stored.keys() == online.keys() == {"loss", "ret_loss", "kl", "boundary_acc"}
    for key in stored:
        torch.testing.assert_close(online[key], stored[key], rtol=0, atol=1e-5, msg=key)
    assert stored["ret_loss"] > 0 and len(stored_grads) == len(online_grads) > 0
    for a, b in zip(online_grads, stored_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_dense_features_train_what_the_study_trainer_trained(tiny_setup, tmp_path):
    """``train.online_features=dense``: the loss and gradients of :func:`kvpop.online.scorer_only_step` with dense
    features (the study trainer's step) on the same batch, without a student forward."""
    from kvpop.online import scorer_only_step
    from pipelines.train_worker import metric_names

    objective = Objective(kvpop.Budget(4, 8, 16), recency=0.01, tau=0.5, extra_topks=(3, 30), weight="mass")
    spec = _spec(tiny_setup, tmp_path, objective=objective, online=True, online_features="dense", target_column="",
                 target_options={"group_reduce": "max", "query_power": 4.0})
    assert metric_names(spec) == ("loss", "ret_loss", "boundary_acc")
    ids = torch.randint(1, 1000, (2, 64), generator=torch.Generator().manual_seed(4))
    model, _ = build_student(spec)
    parts = batch_losses(model, {"input_ids": ids.to(torch.int32)}, spec)
    assert set(parts) == set(metric_names(spec))
    parts["loss"].backward()
    mine = _grads(model)
    study, _ = build_student(spec)
    out = scorer_only_step(study, ids, features="dense", query_power=4.0, tau=0.5, weight="mass", topks=(3, 30))
    out["loss"].backward()
    torch.testing.assert_close(parts["ret_loss"].detach(), out["loss"].detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(parts["boundary_acc"], out["boundary_acc"], rtol=0, atol=1e-6)
    for a, b in zip(mine, _grads(study), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_warmup_and_schedule_learning_rates():
    steps, warmup = 10, 4
    assert [lr_factor(s, warmup, "constant", steps) for s in range(1, 11)] == [0.25, 0.5, 0.75, 1, 1, 1, 1, 1, 1, 1]
    assert [lr_factor(s, 0, "constant", steps) for s in (1, 5, 10)] == [1, 1, 1]
    cosine = [lr_factor(s, warmup, "cosine", steps) for s in range(1, 11)]
    assert cosine[:4] == [0.25, 0.5, 0.75, 1.0]
    expected = [0.5 * (1 + math.cos(math.pi * i / 6)) for i in range(6)]  # 6 steps after the warm-up
    assert cosine[4:] == pytest.approx(expected, abs=1e-12)
    assert all(a > b for a, b in zip(cosine[4:], cosine[5:])) and cosine[-1] > 0  # decreasing, never a wasted step
    assert lr_factor(1, 0, "cosine", 1) == 1.0  # one step, no warm-up
    with pytest.raises(ValueError, match="constant or cosine"):
        lr_factor(5, 0, "linear", 10)


@pytest.mark.parametrize("rows", [1, 2, 7])
def test_each_epoch_is_a_permutation_drawn_from_the_seed_and_the_epoch(rows):
    seed = 5
    epochs = [row_sequence.epoch_permutation(rows, seed, e) for e in range(4)]
    for order in epochs:
        assert sorted(order.tolist()) == list(range(rows))
    assert all(np.array_equal(a, b) for a, b in zip(epochs, [row_sequence.epoch_permutation(rows, seed, e)
                                                             for e in range(4)]))
    if rows == 7:  # fresh orders: not one order repeated, and another seed gives others
        assert len({tuple(o) for o in epochs}) > 1
        assert not np.array_equal(row_sequence.epoch_permutation(rows, seed + 1, 0), epochs[0])
    # the run's row sequence, at any positions (in any order), is the epochs' permutations concatenated
    positions = np.random.default_rng(0).permutation(4 * rows)
    assert np.array_equal(row_sequence.row_order(rows, positions, seed), np.concatenate(epochs)[positions])
    assert np.array_equal(row_sequence.row_order(rows, positions, None), positions % rows)  # no seed: file order


def test_new_train_keys_enter_the_run_identity_only_away_from_their_defaults(tiny_setup, tmp_path):
    base = tiny_config(tiny_setup, tmp_path)
    before = base.train.optimisation()
    assert not {"targets_source", "online_features", "warmup_steps", "schedule", "shuffle_seed", "steps",
                "eval_every"} & set(before)
    for key, value in (("targets_source", "online"), ("online_features", "dense"), ("warmup_steps", 20),
                       ("schedule", "cosine"), ("shuffle_seed", 0)):
        online = {"targets_source": "online"} if key == "online_features" else {}
        changed = dataclasses.replace(base.train, **online, **{key: value}).optimisation()
        assert changed[key] == value and changed != before
    assert dataclasses.replace(base.train, schedule="cosine").optimisation()["steps"] == base.train.steps
    evaluated = dataclasses.replace(base.train, eval_every=5, eval_sequences=1, eval_recall_samples=2,
                                    eval_heldout_sources=True)
    assert evaluated.optimisation() == before  # evaluation is operational: the same run
    assert dataclasses.replace(base.train, activation_checkpointing=True).optimisation() == before  # memory, not math
    stand_in = SimpleNamespace(key="TARGETS", identity={})  # the inputs' key, as tests/test_records.py names runs
    plain = tiny_config(tiny_setup, tmp_path, "train.eval_every=2", "eval.heldout_sources=[stdlib]")
    both = tiny_config(tiny_setup, tmp_path, "train.eval_every=2", "eval.heldout_sources=[stdlib]",
                       "train.eval_heldout_sources=true")
    assert train.run_name_of(both, stand_in) == train.run_name_of(plain, stand_in)
    assert all(records.key_for(both, stage) == records.key_for(plain, stage) for stage in ("train", "evaluate"))


@pytest.mark.parametrize("extra, message", [
    (["train.targets_source=online", "train.mode=distill"], "train.targets_source=online needs train.policy=kvpop "
                                                            "and train.mode=scorer_only"),
    (["train.targets_source=online", "train.targets=/somewhere"], "drop it for train.targets_source=online"),
    (["train.targets_source=precomputed"], "train.targets_source must be stored or online"),
    (["train.schedule=linear"], "train.schedule must be constant or cosine"),
    (["train.online_features=dense"], "train.online_features=dense reads the step's own dense pass"),
    (["train.targets_source=online", "train.online_features=sparse"], "train.online_features must be one of"),
    (["train.profile_steps=[2]"], r"train.profile_steps: profile steps are \[first step, number of steps\]"),
    (["train.profile_steps=[0, 2]"], "both integers >= 1"),
    (["train.profile_steps=[2, 0]"], "both integers >= 1"),
    (["train.steps=4", "train.profile_steps=[3, 5]"], "train.profile_steps: steps 3 … 7 are past train.steps=4"),
    (["train.warmup_steps=-1"], "train.warmup_steps must be >= 0"),
    (["train.activation_checkpointing=3"], "train.activation_checkpointing: expected true/false, got 3"),
    (["train.eval_every=2", "train.eval_sequences=3"], "train.eval_sequences=3 is more than the data stage's 2"),
    (["train.eval_every=2", "train.policy=streaming", "train.mode=distill"], "train.eval_every evaluates the scorers"),
    (["train.eval_every=2", "train.eval_heldout_sources=true"], "train.eval_heldout_sources evaluates the "
                                                                "eval.heldout_sources corpora: name at least one"),
    (["train.eval_heldout_sources=true", "eval.heldout_sources=[/data/streaming.jsonl]"],
     r"corpus names \['streaming'\] may not be streaming / oracle / dense"),
])
def test_bad_train_settings_are_one_line(tiny_setup, tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message) as err:
        tiny_config(tiny_setup, tmp_path, *extra)
    assert "\n" not in str(err.value)


def test_an_online_run_needs_no_targets_and_is_named_by_what_they_would_be(tiny_setup, tmp_path):
    cfg = tiny_config(tiny_setup, tmp_path / "home", "train.targets_source=online")
    assert cfg.train.online
    inputs = train.open_inputs(cfg)  # no precompute record, no target directory: the data stage's sequences
    assert isinstance(inputs, train.OnlineSequences) and inputs.input_ids.shape == (8, 64)
    assert inputs.identity == store.training_identity(cfg)
    assert not (tmp_path / "home" / "targets").exists() and records.for_config(cfg, "precompute") is None
    spec = train.make_spec(cfg, inputs, "n", tmp_path, "")
    assert spec.online and spec.target_column == "" and spec.top_k == 8
    assert spec.target_options == {"group_reduce": "max", "query_power": 1.0}
    other = tiny_config(tiny_setup, tmp_path / "home", "train.targets_source=online", "precompute.query_power=4")
    assert train.run_name_of(other, train.open_inputs(other)) != train.run_name_of(cfg, inputs)


def test_held_out_evaluation_measures_kvpop_against_references_measured_once(tiny_setup, tmp_path):
    from pipelines.heldout import HeldoutEvaluator

    cfg = tiny_config(tiny_setup, tmp_path / "home", "train.eval_every=1", "train.eval_sequences=2",
                      "eval.resamples=200")
    evaluator = HeldoutEvaluator(cfg)
    assert list(evaluator.items) == ["heldout."]  # the training source's alone: train.eval_heldout_sources is off
    assert [s["id"] for s in evaluator.items["heldout."]["sequences"]] == [
        s["id"] for s in train.load_sequences(cfg, "eval")][:2]
    model, _ = build_student(_spec(tiny_setup, tmp_path))
    model.eval()
    first = evaluator(model)
    references = evaluator.references["heldout."]
    assert {r["policy"] for r in references} == {"dense", "streaming", "oracle"}
    for key in ("heldout.kl", "heldout.top1", "heldout.gap_closed", "heldout.streaming.kl", "heldout.oracle.kl"):
        assert key in first and f"{key}.lo" in first and f"{key}.hi" in first, key
    assert 0 <= first["heldout.top1"] <= 1 and first["heldout.kl"] >= 0
    with torch.no_grad():  # other scorers: kvpop moves, the references are the ones measured first
        for p in kvpop.scorers(model).parameters():
            p.add_(torch.randn_like(p))
    second = evaluator(model)
    assert evaluator.references["heldout."] is references
    assert second["heldout.streaming.kl"] == first["heldout.streaming.kl"]
    assert second["heldout.kl"] != first["heldout.kl"]
    gap = (second["heldout.streaming.kl"] - second["heldout.kl"]) / (
        second["heldout.streaming.kl"] - second["heldout.oracle.kl"])
    assert second["heldout.gap_closed"] == pytest.approx(gap, abs=1e-5)  # means of item values rounded to 1e-6


def test_held_out_references_are_kept_for_a_resumed_run_keyed_by_what_they_depend_on(tiny_setup, tmp_path):
    """With an identity, the references' records are kept under $KVPOP_HOME/heldout_references/<key>: a new evaluator
    (a resumed run, a next phase on the same items) reads them — the same metrics, no second measurement — and
    another identity (card, base) or other items measure their own."""
    from pipelines.heldout import REFERENCES_DIR, HeldoutEvaluator

    cfg = tiny_config(tiny_setup, tmp_path / "home", "train.eval_every=1", "train.eval_sequences=2",
                      "eval.resamples=200")
    model, _ = build_student(_spec(tiny_setup, tmp_path))
    model.eval()
    identity = {"base_sha256": "abc", "device": "cpu"}
    first = HeldoutEvaluator(cfg, identity)(model)
    kept = cfg.home_dir() / REFERENCES_DIR
    (folder,) = kept.iterdir()
    assert first == HeldoutEvaluator(cfg)(model)  # kept or not, the same curve point
    assert list(kept.iterdir()) == [folder]  # without an identity nothing is kept
    assert HeldoutEvaluator(cfg, identity)(model) == first  # read back exactly
    text = folder / "text.json"
    part = json.loads(text.read_text())
    for record in part["records"]:
        if record["policy"] == "streaming":
            record["kl"] += 1.0
    text.write_text(json.dumps(part))
    marked = HeldoutEvaluator(cfg, identity)(model)
    assert marked["heldout.streaming.kl"] == pytest.approx(first["heldout.streaming.kl"] + 1.0)  # read, not measured
    assert marked["heldout.kl"] == first["heldout.kl"]  # kvpop is measured at every point
    assert HeldoutEvaluator(cfg, {**identity, "device": "NVIDIA H100"})(model) == first
    fewer = tiny_config(tiny_setup, tmp_path / "home", "train.eval_every=1", "train.eval_sequences=1",
                        "eval.resamples=200")
    HeldoutEvaluator(fewer, identity)(model)
    assert len(list(kept.iterdir())) == 3


def _other_corpus_config(tiny_setup, tmp_path, *extra: str):
    """The tiny config evaluating during training a corpus it never trains on, ``extra_docs`` (another seed's
    documents): 3 held-out sequences a corpus, the first 2 evaluated."""
    from tests.models import write_docs

    source = tmp_path / "extra_docs.jsonl"
    if not source.exists():
        write_docs(source, 12, seed=1)
    return tiny_config(tiny_setup, tmp_path / "home", "data.eval_sequences=3", "train.eval_every=2",
                       "train.eval_sequences=2", "eval.resamples=200", "eval.policies=[dense,streaming,oracle,kvpop]",
                       f"eval.heldout_sources=[{source}]", *extra), str(source)


def test_held_out_evaluation_of_another_corpus_is_the_evaluation_stages_on_its_items(tiny_setup, tmp_path):
    """train.eval_heldout_sources: the first train.eval_sequences of each eval.heldout_sources corpus's held-out
    split, measured as the evaluation stage measures that corpus (eval_parts.corpus_items) and logged under
    heldout.<corpus>.*; the training source's metrics are the run's without it."""
    from pipelines import eval_parts, report
    from pipelines.data import heldout_source_config
    from pipelines.heldout import HeldoutEvaluator

    # kvpop's evaluation-time ranking (recency term, anchors) is the stage's in the curve too
    ranking = ("eval.recency=0.05", "eval.anchor_share=0.25")
    cfg, source = _other_corpus_config(tiny_setup, tmp_path, "train.eval_heldout_sources=true", *ranking)
    evaluator = HeldoutEvaluator(cfg)
    assert list(evaluator.items) == ["heldout.", "heldout.extra_docs."]
    held_out = train.load_sequences(heldout_source_config(cfg, source), "eval")
    assert len(held_out) == 3
    items = evaluator.items["heldout.extra_docs."]
    assert [s["input_ids"] for s in items["sequences"]] == [s["input_ids"] for s in held_out[:2]]
    assert items["samples"] == [] and items["sequences"] != evaluator.items["heldout."]["sequences"]
    model, _ = build_student(_spec(tiny_setup, tmp_path))
    model.eval()
    found = evaluator(model)
    assert set(evaluator.references) == {"heldout.", "heldout.extra_docs."}  # each corpus's references, once
    plain, _ = _other_corpus_config(tiny_setup, tmp_path, *ranking)
    assert {k: v for k, v in found.items() if not k.startswith("heldout.extra_docs.")} == HeldoutEvaluator(plain)(model)
    # the evaluation stage on the same items: every policy at the training budget, summarised the same way
    stage_inputs = {**evaluator.items["heldout."], "budgets": [cfg.budget]}
    records, _ = eval_parts.corpus_items(cfg, stage_inputs, "extra_docs", held_out[:2], model, None, progress=False)
    summary = report.summarize(records, evaluator.budgets, resamples=200)

    def stage(table: str, policy: str, metric: str) -> float:
        return next(e["estimate"] for e in summary[table] if e["policy"] == policy and e["metric"] == metric)

    for name, table, policy, metric in (("kl", "metrics", "kvpop", "kl"), ("top1", "metrics", "kvpop", "top1_agreement"),
                                        ("streaming.kl", "metrics", "streaming", "kl"),
                                        ("oracle.top1", "metrics", "oracle", "top1_agreement"),
                                        ("gap_closed", "gap_closed", "kvpop", "kl")):
        assert found[f"heldout.extra_docs.{name}"] == pytest.approx(stage(table, policy, metric)), name
        assert f"heldout.extra_docs.{name}.lo" in found and f"heldout.extra_docs.{name}.hi" in found, name
    assert found["heldout.extra_docs.kl"] != found["heldout.kl"]
    assert not any(k.startswith("heldout.extra_docs.recall") for k in found)  # text only: no recall cells there


def test_another_corpus_is_logged_at_each_evaluation_point(tiny_setup, tmp_path):
    """The train worker's held-out runner logs heldout.<corpus>.* beside heldout.* at every evaluation point."""
    from pipelines.train_worker import HeldoutRunner

    class Client:  # the MlflowClient calls the runner makes: the batches it logs
        def __init__(self):
            self.logged = []

        def log_batch(self, run_id, metrics):
            self.logged += [(run_id, m.key, m.step, m.value) for m in metrics]

    cfg, _ = _other_corpus_config(tiny_setup, tmp_path, "train.eval_heldout_sources=true", "train.eval_sequences=1")
    spec = _spec(tiny_setup, tmp_path, steps=2, eval_every=2, eval_config=cfg.to_dict(), mlflow_run_id="run")
    model, _ = build_student(spec)
    client = Client()
    runner = HeldoutRunner(model, spec, 0, client, torch.device("cpu"))
    for step in (0, 2):
        runner(step)
        with torch.no_grad():  # the scorers move between points
            for p in kvpop.scorers(model).parameters():
                p.add_(0.5 * torch.randn_like(p))
    steps = {}
    for run_id, key, step, _ in client.logged:
        assert run_id == "run"
        steps.setdefault(key, []).append(step)
    for name in ("heldout.kl", "heldout.extra_docs.kl", "heldout.extra_docs.top1", "heldout.extra_docs.gap_closed",
                 "heldout.extra_docs.streaming.kl", "heldout.extra_docs.oracle.top1"):
        assert steps[name] == [0, 2], name
    assert len({v for _, key, _, v in client.logged if key == "heldout.extra_docs.kl"}) == 2


def test_another_corpus_without_enough_held_out_sequences_is_refused_before_training(tiny_setup, tmp_path):
    from tests.models import write_docs

    short = tmp_path / "short_docs.jsonl"
    write_docs(short, 2, seed=2, min_words=5, max_words=10)  # fewer tokens than one sequence of 64
    cfg = tiny_config(tiny_setup, tmp_path / "home", "train.targets_source=online", "train.eval_every=2",
                      f"eval.heldout_sources=[{short}]", "train.eval_heldout_sources=true")
    with pytest.raises(ConfigError, match=r"^train.eval_heldout_sources: eval.heldout_sources .*short_docs.jsonl.*: "
                                          r"data.source yields only 0 \w+ sequences of 64 tokens") as err:
        train.open_inputs(cfg)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "home" / "runs").exists()
    off = tiny_config(tiny_setup, tmp_path / "home", "train.targets_source=online", "train.eval_every=2",
                      f"eval.heldout_sources=[{short}]")
    assert train.open_inputs(off).input_ids.shape == (8, 64)  # off: the corpus is the evaluation stage's alone


def test_the_learning_curve_is_drawn_from_a_sqlite_mlflow_store(tmp_path, monkeypatch):
    import mlflow
    from matplotlib.figure import Figure
    from mlflow.entities import Metric

    from pipelines.curves import metric_history, plot_learning_curve

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    experiment = client.create_experiment("curves", artifact_location=str(tmp_path / "artifacts"))
    run = client.create_run(experiment, run_name="curve-run")
    values = {0: 0.9, 5: 0.6, 10: 0.4}
    metrics = [Metric("heldout.kl", v, 0, s) for s, v in values.items()]
    metrics += [Metric(f"heldout.kl.{side}", v + d, 0, s) for s, v in values.items() for side, d in
                (("lo", -0.05), ("hi", 0.05))]
    metrics += [Metric("heldout.streaming.kl", 1.0, 0, s) for s in values]
    metrics += [Metric("heldout.gap_closed", 1 - v, 0, s) for s, v in values.items()]
    metrics += [Metric("heldout.kl", 0.5, 1, 10)]  # a resumed run logged step 10 again: the later value counts
    # train.eval_heldout_sources: another corpus's kvpop lines (its references are not drawn)
    metrics += [Metric(f"heldout.extra_docs.{name}", v, 0, s) for s, v in values.items() for name in
                ("kl", "kl.lo", "kl.hi", "gap_closed", "streaming.kl")]
    client.log_batch(run.info.run_id, metrics=metrics)
    assert metric_history(client, run.info.run_id, "heldout.kl") == [(0, 0.9), (5, 0.6), (10, 0.5)]
    drawn = []
    original = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (drawn.append(fig), original(fig, *a, **k))[1])
    path = plot_learning_curve(run.info.run_id, uri, tmp_path / "out" / "curve.png")
    assert path == tmp_path / "out" / "curve.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    legends = {ax.get_title(): [t.get_text() for t in ax.get_legend().get_texts()] for ax in drawn[0].axes}
    assert legends == {"KL(dense ‖ policy), nats/token": ["kvpop, training corpus", "95 % interval",
                                                          "kvpop, extra_docs", "streaming"],
                       "streaming → oracle KL gap closed": ["kvpop, training corpus", "kvpop, extra_docs"]}
    extra = [line for line in drawn[0].axes[0].get_lines() if line.get_label() == "kvpop, extra_docs"]
    assert [list(line.get_ydata()) for line in extra] == [list(values.values())]
    from PIL import Image

    width, height = Image.open(path).size
    assert width > 2 * height  # two panels side by side: KL and the gap (no top-1 or recall logged)
    empty = client.create_run(experiment, run_name="no-curve")
    client.log_batch(empty.info.run_id, metrics=[Metric("loss", 1.0, 0, 1)])
    assert plot_learning_curve(empty.info.run_id, uri) is None


def _scorer_weights(model_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "kvpop_scorers.safetensors"))


@pytest.mark.ray
@pytest.mark.slow
def test_an_online_run_resumed_after_n_steps_is_one_run_of_n_plus_m_steps_with_its_curve_in_mlflow(
        tiny_setup, tmp_path, ray_cluster):
    """Online targets, a seeded shuffle per epoch (8 sequences, 2 a step: step 5 is in the second epoch), two warm-up
    steps: 3 steps, then the same run to 5 (resumed from its DCP checkpoint of step 3) holds the very scorers of one
    uninterrupted 5-step run; its held-out evaluations are the run's MLflow metrics, its curve the run's artifact.
    The resumed part also evaluates another corpus (train.eval_heldout_sources, operational: the same run)."""
    import mlflow

    from tests.models import write_docs

    write_docs(tmp_path / "extra_docs.jsonl", 12, seed=1)
    other = [f"eval.heldout_sources=[{tmp_path / 'extra_docs.jsonl'}]", "train.eval_heldout_sources=true"]
    common = ["train.targets_source=online", "train.shuffle_seed=3", "train.warmup_steps=2", "train.scorer=mlp",
              "train.batch_size=2", "train.num_workers=1", "train.cpus_per_worker=1", "train.strategy=none",
              "train.checkpoint_every=2", "train.max_failures=0", "eval.resamples=200"]
    evaluated = ["train.eval_every=2", "train.eval_sequences=2"]
    home = tmp_path / "home"
    first = train.run(tiny_config(tiny_setup, home, *common, *evaluated, "train.steps=3"))
    cfg = tiny_config(tiny_setup, home, *common, *evaluated, *other, "train.steps=5")
    resumed = train.run(cfg)
    assert resumed.run_name == first.run_name and resumed.mlflow_run_id == first.mlflow_run_id
    assert resumed.resumed_from == 3
    assert not (home / "targets").exists()  # no precompute: the steps computed their own targets
    assert records.for_config(cfg, "train").payload["targets_source"] == "online"
    once = train.run(tiny_config(tiny_setup, home, *common, "train.steps=5", "train.run_name=one-run"))
    assert once.resumed_from == 0
    mine, reference = _scorer_weights(resumed.model_dir), _scorer_weights(once.model_dir)
    assert mine.keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(mine[name], value, rtol=0, atol=0, msg=name)
    start, _ = build_student(train.make_spec(cfg, train.open_inputs(cfg), "start", tmp_path, ""))
    initial = {f"layers.{i}.{k}": v for i, s in enumerate(kvpop.scorers(start)) for k, v in s.state_dict().items()}
    assert initial.keys() == reference.keys()
    assert not all(torch.equal(initial[k], reference[k]) for k in reference), "the run did not move the scorers"

    client = mlflow.MlflowClient(cfg.tracking_uri())
    run_id = resumed.mlflow_run_id
    lr = {m.step: m.value for m in client.get_metric_history(run_id, "lr")}
    assert lr == pytest.approx({1: 0.005, 2: 0.01, 3: 0.01, 4: 0.01, 5: 0.01})  # warm-up over 2 steps, then lr
    curve = {m.step for m in client.get_metric_history(run_id, "heldout.kl")}
    assert curve == {0, 2, 3, 4, 5}  # fresh start, every 2 steps, each run's last step
    for name in ("heldout.top1", "heldout.gap_closed", "heldout.streaming.kl", "heldout.oracle.kl"):
        assert {m.step for m in client.get_metric_history(run_id, name)} == curve, name
    for name in ("heldout.extra_docs.kl", "heldout.extra_docs.gap_closed", "heldout.extra_docs.streaming.kl"):
        assert {m.step for m in client.get_metric_history(run_id, name)} == {4, 5}, name  # the resumed part's points
    assert "learning_curve.png" in {a.path for a in client.list_artifacts(run_id)}
    assert not client.get_metric_history(once.mlflow_run_id, "heldout.kl")  # evaluation is per run: off there
    params = client.get_run(run_id).data.params
    assert params["train.targets_source"] == "online" and json.loads(params["train.shuffle_seed"]) == 3


@pytest.mark.ray
def test_the_ordered_dataset_reads_each_epoch_in_its_seeded_order(tiny_setup, tmp_path, ray_cluster):
    cfg = tiny_config(tiny_setup, tmp_path / "home", "train.targets_source=online")
    inputs = train.open_inputs(cfg)
    for seed in (None, 4):
        dataset = train.ordered_dataset(inputs, ["input_ids"], 20, seed)  # 2.5 epochs of 8 rows
        got = np.stack([row["input_ids"] for row in dataset.iter_rows()])
        assert np.array_equal(got, inputs.input_ids[row_sequence.row_order(8, np.arange(20), seed)])


@pytest.mark.ray
def test_stored_targets_are_read_in_the_seeded_order_too(tiny_targets):
    targets = store.open_targets(tiny_targets[1].path)
    columns = ["input_ids", "targets_w8", "topk_indices"]
    table = targets.read_table(columns)
    order = row_sequence.row_order(targets.num_rows, np.arange(12), 1)
    got = list(train.ordered_dataset(targets, columns, 12, 1).iter_rows())
    assert len(got) == 12
    for row, index in zip(got, order):
        for name in columns:
            expected = np.asarray(table.column(name)[int(index)].as_py() if name == "input_ids" else
                                  table.column(name).combine_chunks().to_numpy_ndarray()[int(index)])
            assert np.array_equal(np.asarray(row[name]), expected), name


def test_the_pipeline_skips_precompute_for_an_online_run_and_the_sweep_refuses_one(tiny_setup, tmp_path, monkeypatch,
                                                                                   capsys):
    from jobs import pipeline
    from pipelines import sweep

    class Trained(Exception):
        pass

    def refuse(cfg):
        raise AssertionError("an online run has nothing to precompute")

    def trained(cfg):
        raise Trained(cfg.train.targets_source)

    monkeypatch.setattr(precompute, "run", refuse)
    monkeypatch.setattr(train, "run", trained)
    cfg = tiny_config(tiny_setup, tmp_path / "home", "train.targets_source=online")
    with pytest.raises(Trained, match="online"):
        pipeline.body(cfg)
    assert "precompute: skipped (train.targets_source=online)" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="the sweep's trials read precomputed targets: set "
                                          "train.targets_source=stored"):
        sweep.plan(cfg)


def test_an_online_run_reads_the_data_mix_and_starts_from_init_from(tiny_setup, tmp_path):
    """The stage's other inputs hold for online runs: ``data.mix_source`` joins the training split the steps read,
    ``train.init_from`` is checked against the base's digest and seeds the scorers."""
    from tests.models import write_docs
    from tests.test_init_from import _saved_scorers

    write_docs(tmp_path / "mix.jsonl", 30, seed=5)
    folder = _saved_scorers(tiny_setup, tmp_path)
    cfg = tiny_config(tiny_setup, tmp_path / "home", "train.targets_source=online", "train.scorer=mlstm",
                      f"data.mix_source={tmp_path / 'mix.jsonl'}", "data.mix_sequences=3", f"train.init_from={folder}")
    inputs = train.open_inputs(cfg)
    rows = train.load_sequences(cfg, "train")
    assert inputs.num_rows == 11 and sum(r["id"].startswith("mix-") for r in rows) == 3
    assert np.array_equal(inputs.input_ids, np.asarray([r["input_ids"] for r in rows]))
    spec = train.make_spec(cfg, inputs, "mixed", tmp_path, "")
    model, _ = build_student(spec)
    saved = kvpop.load_retrofitted(folder, base=tiny_setup / "teacher")[0]
    for mine, theirs in zip(kvpop.scorers(model).parameters(), kvpop.scorers(saved).parameters()):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    other = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(tiny_setup / "other_teacher")))
    with pytest.raises(ConfigError, match="train.init_from"):
        train.open_inputs(other)


@pytest.mark.ray
@pytest.mark.slow
def test_profiled_steps_of_an_online_run_are_its_step_profile_artifact(tiny_setup, tmp_path, ray_cluster):
    """``train.profile_steps=[2, 2]`` on the product's step (online targets, dense features, extra budgets): rank 0
    writes the two steps' profile as ``step_profile.md`` in the run dir and as the run's MLflow artifact, with the
    per-step figures and the profiler's tables; the setting is operational (the run's name does not change)."""
    import mlflow

    from pipelines.train_worker import PROFILE_ARTIFACT

    common = ["train.targets_source=online", "train.online_features=dense", "train.extra_topks=[3, 30]",
              "train.steps=3", "train.batch_size=2", "train.num_workers=1", "train.cpus_per_worker=1",
              "train.strategy=none", "train.checkpoint_every=3", "train.max_failures=0"]
    home = tmp_path / "home"
    cfg = tiny_config(tiny_setup, home, *common, "train.profile_steps=[2, 2]")
    plain = tiny_config(tiny_setup, home, *common)
    assert train.run_name_of(cfg, train.open_inputs(cfg)) == train.run_name_of(plain, train.open_inputs(plain))
    result = train.run(cfg)
    report = (result.run_dir / PROFILE_ARTIFACT).read_text()
    assert "2 profiled steps on cpu" in report and "| 2 |" in report and "| 3 |" in report
    kernels = int(report.split("| kernels launched (CPU: computing operators) | ")[1].split(" |")[0])
    assert kernels > 100  # a dense pass, the target pass, the scorers, the loss, the backward and AdamW
    assert report.count("aten::") >= 20 and "by count" in report
    client = mlflow.MlflowClient(cfg.tracking_uri())
    assert PROFILE_ARTIFACT in {a.path for a in client.list_artifacts(result.mlflow_run_id)}
