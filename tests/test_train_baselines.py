"""The trained baselines through the train stage (issue 13): ``train.policy = dms`` (DMS gates, adapter-only) and
``train.policy = streaming`` (StreamingLLM+: the base under the sinks + window mask). Config checks, what trains,
the loss parts, and (Ray) a whole run per policy that dies, resumes, is tracked and reloads under its policy."""
from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

import kvpop
from kvpop.objective import METRICS, DMSObjective, StreamingObjective
from kvpop.retrofit import runtime_of
from pipelines import records, tracking, train
from pipelines.config import ConfigError, load_config
from pipelines.train_worker import TRAIN_MARKER, TrainSpec, batch_losses, build_student, write_final_model
from tests.pipeline_helpers import tiny_config

pytestmark = pytest.mark.pretrained  # the tiny teachers use SmolLM2's tokenizer

DMS = ["train.policy=dms", "train.dms_keep_rate=0.5", "train.dms_schedule_steps=4"]
STREAMING = ["train.policy=streaming", "train.mode=distill", "train.base_lr=0.01"]
POLICY_OVERRIDES = {"dms": DMS, "streaming": STREAMING}


# -----------------------------------------------------------------------------
# the config


@pytest.mark.parametrize("overrides, message", [
    (["train.policy=h2o"], "train.policy must be one of kvpop, dms, streaming"),
    (["train.policy=streaming"], "train.policy=streaming .* set train.mode=distill"),
    (["train.policy=dms", "train.steps=10", "train.dms_schedule_steps=20"],
     "anneals over 20 steps but the run has 10"),
    (["train.policy=dms", "train.dms_keep_rate=0"], r"keep-rate must be in \(0, 1\]"),
    (["train.policy=dms", "train.dms_keep_rate=1.5"], r"keep-rate must be in \(0, 1\]"),
    (["train.policy=dms", "train.dms_temperature=0"], "train.dms_temperature must be > 0"),
    (["train.loss_weight=loud"], "train.loss_weight must be none, margin or mass"),
])
def test_bad_policy_settings_are_one_config_error(overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_config(None, overrides)
    assert "\n" not in str(err.value)


def test_the_loss_weight_reaches_the_objective():
    from pipelines.train import objective_of

    for weight in ("margin", "mass"):
        assert objective_of(load_config(None, [f"train.loss_weight={weight}"])).weight == weight
    assert objective_of(load_config(None, [])).weight is None


def test_extra_topks_reach_the_objective_and_name_the_run_only_when_set():
    from pipelines.train import objective_of

    plain = load_config(None, [])
    assert objective_of(plain).extra_topks == () and "extra_topks" not in plain.train.optimisation()  # names kept
    multi = load_config(None, ["train.extra_topks=[124, 508]"])
    assert objective_of(multi).extra_topks == (124, 508)
    assert multi.train.optimisation()["extra_topks"] == (124, 508)
    assert multi.train.optimisation() != plain.train.optimisation()
    for overrides, message in ((["train.extra_topks=[0]"], "train.extra_topks must be long-range sizes >= 1"),
                               (["train.extra_topks=[8]", "train.policy=dms"], "train.extra_topks is for"),
                               (["train.extra_topks=8"], "train.extra_topks: expected a list")):
        with pytest.raises(ConfigError, match=message) as err:
            load_config(None, overrides)
        assert "\n" not in str(err.value)


def test_run_names_separate_the_policies_and_keep_the_kvpop_ones():
    kvpop_cfg = load_config(None, [])
    assert "policy" not in kvpop_cfg.train.optimisation()  # a kvpop run is named as before train.policy existed
    assert not set(kvpop_cfg.train.DMS_KEYS) & set(kvpop_cfg.train.optimisation())
    dms = load_config(None, ["train.policy=dms"])
    assert dms.train.label == "dms" and dms.train.optimisation()["dms_keep_rate"] == 0.25
    assert "scorer" not in dms.train.optimisation()  # the gates are DMS's, train.scorer does not apply
    assert load_config(None, ["train.policy=dms", "train.scorer=mlp"]).train.optimisation() == dms.train.optimisation()
    assert load_config(None, ["train.policy=dms", "train.dms_keep_rate=0.5"]).train.optimisation() != \
        dms.train.optimisation()
    assert load_config(None, STREAMING).train.label == "streaming+"


def test_the_baselines_need_no_top_k_slots(tiny_setup, tmp_path):
    """budget.topk = 0 has no KVpop decision to learn, but DMS and StreamingLLM+ train at it."""
    with pytest.raises(ConfigError, match="budget.topk is 0"):
        train.check_trainable(tiny_config(tiny_setup, tmp_path, "budget.topk=0"))
    for extra in (DMS, STREAMING):
        train.check_trainable(tiny_config(tiny_setup, tmp_path, "budget.topk=0", *extra))


def test_the_objectives_follow_the_budget(tiny_setup, tmp_path):
    dms = train.objective_of(tiny_config(tiny_setup, tmp_path, *DMS))
    assert isinstance(dms, DMSObjective) and dms.budget == kvpop.Budget(4, 8, 0)  # delayed eviction over the window
    assert dms.schedule.final_keep_rate == 0.5 and dms.schedule.steps == 4
    streaming = train.objective_of(tiny_config(tiny_setup, tmp_path, *STREAMING))
    assert isinstance(streaming, StreamingObjective) and streaming.budget == kvpop.Budget(4, 24, 0)  # same B = 28


# -----------------------------------------------------------------------------
# one step, without Ray


def _spec(tmp_path, tiny_setup, policy: str) -> TrainSpec:
    cfg = tiny_config(tiny_setup, tmp_path, *POLICY_OVERRIDES[policy], "train.steps=6")
    shutil.copytree(tiny_setup / "teacher", tmp_path / "base", dirs_exist_ok=True)
    t = cfg.train
    return TrainSpec(run_name="r", run_dir=str(tmp_path / "r"), base_path=str(tmp_path / "base"),
                     base_sha256=kvpop.files.weights_digest(tmp_path / "base"), objective=train.objective_of(cfg),
                     policy=policy, scorer=t.scorer, scorer_options={}, mode=t.mode, target_column="", lr=0.01,
                     base_lr=0.01, grad_clip=1.0, steps=6, batch_size=2, seq_len=64, seed=0, use_gpu=False,
                     sharded=False, bf16=False, threads=1, checkpoint_every=1, log_every=1, fail_at_step=0,
                     tracking_uri="", mlflow_run_id="", dms_temperature=t.dms_temperature)


def _batch(model, seq_len=64, k=8):
    ids = torch.randint(1, 200, (2, seq_len))
    with torch.no_grad():
        top = model(input_ids=ids, use_cache=False).logits.topk(k, dim=-1)
    return {"input_ids": ids, "topk_values": top.values, "topk_indices": top.indices}


@pytest.mark.parametrize("policy", ["dms", "streaming"])
def test_one_step_trains_what_the_policy_trains_and_the_saved_model_decodes_under_it(tmp_path, tiny_setup, policy):
    spec = _spec(tmp_path, tiny_setup, policy)
    model, tokenizer = build_student(spec)
    teacher, _ = kvpop.pretrained.load_pretrained(spec.base_path, dtype=torch.float32)
    batch = _batch(teacher)
    parts = batch_losses(model, batch, spec, step=2)
    assert set(parts) == set(METRICS[policy])
    parts["loss"].backward()
    grads = {name: p.grad is not None and bool(p.grad.abs().max() > 0) for name, p in model.named_parameters()}
    gates = {name for name in grads if ".kvpop_scorer." in name}
    if policy == "dms":  # adapter-only: the gates learn, the base is frozen
        assert gates and all(grads[name] for name in gates)
        assert not any(grads[name] for name in grads if name not in gates)
        assert float(parts["target_keep_rate"]) == pytest.approx(1 / (1 + (1 / 0.5 - 1) * 2 / 4))
        # fresh gates (logit -5) keep all but the rare token the logistic noise pushes past 0
        assert 0.95 <= float(parts["keep_rate"]) < 1.0 + 1e-6 and 0.95 <= float(parts["retained_fraction"]) <= 1.0
    else:  # StreamingLLM+: no scorers, every base weight that feeds the masked forward learns
        assert not gates and grads["model.layers.0.self_attn.q_proj.weight"] and grads["model.embed_tokens.weight"]
        assert float(parts["kl"].detach()) > 0  # the sinks + window mask changes the logits of the evicting positions

    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))  # trained weights: the saved model must hold them
    out = tmp_path / "r" / "final_model"
    write_final_model(model, out, tokenizer, spec, steps=6)
    assert json.loads((out / TRAIN_MARKER).read_text())["policy"] == policy
    weights = sorted(p.name for p in out.glob("*.safetensors"))
    assert weights == (["kvpop_scorers.safetensors"] if policy == "dms" else ["model.safetensors"])
    loaded, _ = kvpop.load_retrofitted(out, base=spec.base_path)  # DMS: gates only, the base by identity
    pol = runtime_of(loaded).policy
    assert pol.name == policy and pol.budget == spec.budget and not getattr(pol, "relaxed", False)
    ids = batch["input_ids"][:1]
    with torch.no_grad():
        one_pass = loaded(ids, use_cache=False).logits
    assert (kvpop.teacher_forced_logits(loaded, ids, prefill=11) - one_pass).abs().max() <= 1e-4


# -----------------------------------------------------------------------------
# the stage: Ray Train, FSDP2 over 2 CPU workers, DCP checkpoints, resume, MLflow


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("policy", ["dms", "streaming"])
def test_a_baseline_trains_through_the_stage_resumes_and_reloads(tiny_targets, tiny_setup, policy):
    import mlflow

    # resuming and FSDP over 2 workers are policy-independent (tests/test_train.py): one baseline goes through them,
    # the other trains 2 steps on one worker
    crash = policy == "dms"
    steps, workers = (6, 2) if crash else (2, 1)
    cfg = tiny_config(tiny_setup, tiny_targets[0].home_dir(), *POLICY_OVERRIDES[policy], f"train.steps={steps}",
                      "train.checkpoint_every=2", "train.batch_size=2", f"train.num_workers={workers}",
                      "train.cpus_per_worker=1", "train.max_failures=0", *(["train.fail_at_step=3"] if crash else []))
    assert cfg.train.resolved_strategy == ("fsdp" if crash else "none")
    if crash:  # DMS's state includes its keep-rate schedule: the resumed run must continue it, not restart it
        with pytest.raises(Exception, match="fault injected at step 3"):
            train.run(cfg)
    result = train.run(cfg)
    assert result.resumed_from == (2 if crash else 0) and result.metrics["step"] == steps
    assert f"-{cfg.train.label}-" in result.run_name
    payload = records.for_config(cfg, "train").payload
    assert payload["policy"] == policy and payload["model_dir"] == str(result.model_dir)

    client = mlflow.MlflowClient(cfg.tracking_uri())
    run = client.get_run(tracking.find_run(cfg, result.run_name, "train"))
    assert run.info.status == "FINISHED" and run.data.params["train.policy"] == policy
    for key in METRICS[policy]:
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, key)) == list(range(1, steps + 1)), key
    if policy == "dms":
        targets = [m.value for m in sorted(client.get_metric_history(run.info.run_id, "target_keep_rate"),
                                           key=lambda m: m.step)]
        assert targets[-1] == pytest.approx(0.5) and targets[0] > targets[-1]  # the schedule anneals

    loaded, _ = kvpop.load_retrofitted(result.model_dir, base=cfg.model.resolved_path())
    assert runtime_of(loaded).policy.name == policy
    ids = torch.randint(1, 200, (1, 40))
    with torch.no_grad():
        one_pass = loaded(ids, use_cache=False).logits
    assert (kvpop.teacher_forced_logits(loaded, ids, prefill=9) - one_pass).abs().max() <= 1e-4
    fewer = dataclasses.replace(cfg, train=dataclasses.replace(
        cfg.train, steps=steps - 1, dms_schedule_steps=min(cfg.train.dms_schedule_steps, steps - 1)))
    with pytest.raises(ConfigError, match="asks for fewer"):
        train.run(fewer)


@pytest.mark.ray
@pytest.mark.parametrize("policy", ["dms", "streaming"])
def test_targets_without_top_k_logits_are_refused_before_anything_is_written(tiny_targets, tiny_setup, tmp_path,
                                                                             policy):
    import pyarrow.parquet as pq

    from pipelines import store
    from tests.test_train import _copy_targets, _rewrite_manifest_entry

    folder = _copy_targets(tiny_targets, tmp_path)
    shard0 = folder / store.SHARDS / store.shard_name(0)
    pq.write_table(pq.read_table(shard0).drop_columns(["topk_indices"]), shard0)
    _rewrite_manifest_entry(folder, 0)
    home = tmp_path / "home"
    cfg = tiny_config(tiny_setup, home, f"train.targets={folder}", "train.steps=4", *POLICY_OVERRIDES[policy])
    with pytest.raises(ConfigError, match="has no column 'topk_indices'") as err:
        train.run(cfg)
    assert "\n" not in str(err.value)
    assert not (home / "runs").exists() and not (home / "mlflow.db").exists()


# -----------------------------------------------------------------------------
# the sweep


def test_train_policy_is_a_sweep_axis():
    from pipelines import sweep

    cfg = load_config(None, ["sweep.scorers=[mlp, mlstm]", "sweep.steps=20", "train.dms_schedule_steps=10",
                             "train.mode=distill", "sweep.grid={train.policy: [kvpop, dms, streaming]}"])
    points = sweep.variants(cfg)
    policies = [p["train.policy"] for p in points]
    assert policies == ["kvpop", "dms", "streaming", "kvpop"]  # a baseline trains no scorer: once, not per scorer
    assert [p["train.scorer"] for p in points if p["train.policy"] == "kvpop"] == ["mlp", "mlstm"]
    for point in points:  # each trial's config is valid (sweep.plan builds them the same way)
        trial = sweep.apply_overrides(cfg.to_dict(), {**point, "train.steps": cfg.sweep.steps})
        assert trial.train.policy == point["train.policy"]
    with pytest.raises(ConfigError, match="sweep.metric=ret_loss is not reported by train.policy=dms"):
        sweep.variants(load_config(None, ["sweep.metric=ret_loss", "sweep.grid={train.policy: [kvpop, dms]}"]))
    with pytest.raises(ConfigError, match="anneals over 60 steps but the run has 20"):  # the trial's own check
        sweep.apply_overrides(cfg.to_dict(), {"train.policy": "dms", "train.dms_schedule_steps": 60,
                                              "train.steps": 20})
