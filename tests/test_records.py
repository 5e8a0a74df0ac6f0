"""pipelines.records: committed hand-over records, keyed by config values only; finding the trained model reads one
record (no tokenizer, no weight hashing); the crash points used by the exactly-once tests."""
from __future__ import annotations

import subprocess
import sys

import pytest

from pipelines import evaluate, records, train
from pipelines.config import ConfigError, load_config


def _cfg(home, *extra):
    return load_config(None, [f"home={home}", "model.path=/nowhere/teacher", *extra])


def test_write_read_and_latest(tmp_path):
    assert records.read(tmp_path, "train", "k1") is None
    first = records.write(tmp_path, "train", "k1", {"steps": 1}, config="a")
    assert records.read(tmp_path, "train", "k1") == first
    records.write(tmp_path, "train", "k2", {"steps": 2}, config="b")
    again = records.write(tmp_path, "train", "k1", {"steps": 3}, config="a")  # a re-run replaces the record
    assert records.read(tmp_path, "train", "k1").payload == {"steps": 3}
    assert records.latest(tmp_path, "train", "a") == again and records.latest(tmp_path, "train", "c") is None
    records.path_of(tmp_path, "train", "k3").write_text('{"stage": "tr')  # torn: not committed
    assert records.read(tmp_path, "train", "k3") is None


def test_keys_follow_the_settings_a_stage_output_depends_on(tmp_path):
    base = _cfg(tmp_path)
    same = {"precompute.num_actors=3", "train.steps=500", "train.num_workers=2", "eval.budgets=[200]",
            "precompute.output_root=/else"}
    for extra in same:
        other = _cfg(tmp_path, extra)
        assert records.precompute_key(other) == records.precompute_key(base), extra
        assert records.train_key(other) == records.train_key(base), extra
    for extra in ("data.seq_len=1024", "precompute.top_k=8", "model.dtype=bfloat16", "data.seed=1"):
        assert records.precompute_key(_cfg(tmp_path, extra)) != records.precompute_key(base), extra
        assert records.train_key(_cfg(tmp_path, extra)) != records.train_key(base), extra
    for extra in ("train.lr=0.5", "budget.topk=16", "train.run_name=x", "name=other", "train.targets=/t"):
        other = _cfg(tmp_path, extra)
        assert records.precompute_key(other) == records.precompute_key(base), extra
        assert records.train_key(other) != records.train_key(base), extra
        assert records.evaluate_key(other) != records.evaluate_key(base), extra
    for extra in ("eval.budgets=[100]", "eval.checkpoint=/m"):
        assert records.evaluate_key(_cfg(tmp_path, extra)) != records.evaluate_key(base), extra
        assert records.train_key(_cfg(tmp_path, extra)) == records.train_key(base), extra
    assert records.key_for(base, "evaluate") == records.evaluate_key(base)
    with pytest.raises(ValueError, match="no record key for stage 'sweep'"):
        records.key_for(base, "sweep")


def test_query_power_is_validated_and_keys_another_target_set(tmp_path):
    """precompute.query_power (METHOD §2): a bad value is one ConfigError; another β is another precompute (and so
    train) key, while β = 1 written out keeps the key of a config that never named it (targets made before it)."""
    base = _cfg(tmp_path)
    for value in ("0.5", "0", "nan", "inf"):
        with pytest.raises(ConfigError, match="precompute.query_power must be a finite number >= 1"):
            _cfg(tmp_path, f"precompute.query_power={value}")
    with pytest.raises(ConfigError, match="precompute.query_power: expected a number"):
        _cfg(tmp_path, "precompute.query_power=x")
    assert _cfg(tmp_path, "precompute.query_power=8").precompute.query_power == 8.0  # one type: 8 and 8.0, one key
    assert records.precompute_key(_cfg(tmp_path, "precompute.query_power=8")) == records.precompute_key(
        _cfg(tmp_path, "precompute.query_power=8.0"))
    assert records.precompute_key(_cfg(tmp_path, "precompute.query_power=1")) == records.precompute_key(base)
    other = _cfg(tmp_path, "precompute.query_power=8")
    assert records.precompute_key(other) != records.precompute_key(base)
    assert records.train_key(other) != records.train_key(base)


def test_eval_recency_is_validated_and_keys_only_the_evaluation_when_set(tmp_path):
    """eval.recency (the kvpop rows' recency term at evaluation): a bad value or one without a kvpop row is one
    ConfigError; unset, the evaluate key is the one recorded before the setting existed (b9fe1770e582e013 for this
    config); set, it is another evaluation of the same trained model."""
    base = _cfg(tmp_path)
    for extra, message in (("eval.recency=-0.001", "eval.recency must be >= 0"),
                           ("eval.policies=[dense,streaming]", "eval.recency sets the kvpop rows' recency term")):
        with pytest.raises(ConfigError, match=message):
            _cfg(tmp_path, "eval.recency=0.001", extra)
    assert _cfg(tmp_path, "eval.recency=null").eval.recency is None
    assert records.evaluate_key(load_config(None, ["home=/tmp/h", "model.path=/nowhere/teacher"])) == \
        "b9fe1770e582e013"
    assert records.evaluate_key(_cfg(tmp_path, "eval.recency=null")) == records.evaluate_key(base)
    blended = _cfg(tmp_path, "eval.recency=0.001")
    assert blended.eval.recency == 0.001 and records.evaluate_key(blended) != records.evaluate_key(base)
    assert records.train_key(blended) == records.train_key(base)


def test_eval_anchor_slots_are_validated_and_key_only_the_evaluation_when_set(tmp_path):
    """eval.anchor_share / eval.anchor_recency (the kvpop rows' anchor slots): bad values or no kvpop row are one
    ConfigError each; unset, the evaluate key is the one recorded before they existed; set, another evaluation."""
    base = _cfg(tmp_path)
    for extra, message in (("eval.anchor_share=1.5", "eval.anchor_share must be in"),
                           ("eval.anchor_recency=-1", "eval.anchor_recency must be >= 0"),
                           ("eval.policies=[dense,streaming]", "set the kvpop rows' anchor slots")):
        with pytest.raises(ConfigError, match=message):
            _cfg(tmp_path, "eval.anchor_share=0.25", extra)
    assert records.evaluate_key(load_config(None, ["home=/tmp/h", "model.path=/nowhere/teacher", "eval.anchor_share=null",
                                                   "eval.anchor_recency=null"])) == "b9fe1770e582e013"
    anchored = _cfg(tmp_path, "eval.recency=0.002", "eval.anchor_share=0.25")
    assert records.evaluate_key(anchored) not in (records.evaluate_key(base),
                                                  records.evaluate_key(_cfg(tmp_path, "eval.recency=0.002")))
    assert records.evaluate_key(_cfg(tmp_path, "eval.recency=0.002", "eval.anchor_share=0.25",
                                     "eval.anchor_recency=0.0003")) != records.evaluate_key(anchored)
    assert records.train_key(anchored) == records.train_key(base)


def test_the_trained_model_is_found_from_the_record_alone(tmp_path, monkeypatch):
    """Train's record names the model for the train stage's readers and for evaluate, without a tokenizer or a
    weight hash (both patched to fail)."""
    cfg = _cfg(tmp_path)
    with pytest.raises(ConfigError, match="no trained retrofitted model for config 'default'"):
        train.model_dir(cfg)
    model = tmp_path / "runs" / "r" / "final_model"
    model.mkdir(parents=True)
    (model / "kvpop.json").write_text("{}")  # evaluate checks that the named folder is a saved retrofitted model
    records.commit(cfg, "train", {"run_name": "r", "model_dir": str(model), "mlflow_run_id": "abc", "steps": 90,
                                  "targets": "/t", "mode": "scorer_only"})

    def refuse(*args, **kwargs):
        raise AssertionError("finding the trained model must not load a tokenizer nor hash weights")
    for target in ("transformers.AutoTokenizer.from_pretrained", "transformers.AutoConfig.from_pretrained",
                   "pipelines.data.load_tokenizer", "pipelines.train.load_tokenizer",
                   "pipelines.identity.weights_digest", "pipelines.identity.file_digest", "kvpop.files.sha256_file",
                   "kvpop.files.weights_digest"):
        monkeypatch.setattr(target, refuse)
    assert train.model_dir(cfg) == model  # the teacher folder does not even exist
    assert evaluate.trained_model_path(cfg) == model
    assert train.trained_model_record(cfg).payload["mlflow_run_id"] == "abc"
    assert train.model_dir(load_config(None, [f"home={tmp_path}", "model.path=/nowhere/teacher",
                                              "train.steps=3"])) == model  # steps do not name another run


@pytest.mark.parametrize("armed", [True, False])
def test_a_crash_point_kills_the_process_only_when_armed(armed):
    code = "from pipelines import records\nrecords.crash_point('here')\nprint('survived')"
    env = {records.CRASH_ENV: "here" if armed else "elsewhere"}
    proc = subprocess.run([sys.executable, "-c", code], env={**__import__("os").environ, **env},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == (records.CRASH_EXIT_CODE if armed else 0)
    assert ("survived" in proc.stdout) is not armed



# configs/recipes/smollm2_kvpop.yaml's keys and run names since its cosine schedule (the earlier, constant-lr keys held
# from 7d28dfa to 0777c6e): a GPU run of the recipe resumes across sessions by them, so settings added later
# (train.allocation, eval.allocated, …) must leave them alone at their defaults
RECIPE_KEYS = {
    "champ": {"precompute": "f8f4246753d73545", "train": "03f03a533cd52b9a", "evaluate": "0ba6e3d91a5f1b87",
              "run_name": "smollm2-kvpop-champ-mlstm-scorer_only-s4-w256-k252-574651cc69"},
    "kernel": {"precompute": "3411abbbc99c8b07", "train": "e6e0c12d08fbd7f0", "evaluate": "63a5619410f06d04",
               "run_name": "smollm2-kvpop-kernel-mlstm-scorer_only-s4-w256-k252-ffa4f7f92a"}}


def test_the_recipes_keys_do_not_move_with_settings_left_at_their_default(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from pipelines.models import REPO_ROOT
    from pipelines.recipe import load_recipe

    monkeypatch.setenv("KVPOP_HOME", str(tmp_path))
    recipe = load_recipe(REPO_ROOT / "configs" / "recipes" / "smollm2_kvpop.yaml")
    for phase in recipe.phases:
        cfg = recipe.config(phase)
        assert cfg.train.allocation == "" and cfg.eval.allocated == ()
        found = {stage: records.key_for(cfg, stage) for stage in ("precompute", "train", "evaluate")}
        # the train stage's run name over a stand-in for the online inputs' key (what names the MLflow run)
        found["run_name"] = train.run_name_of(cfg, SimpleNamespace(key="TARGETS", identity={}))
        assert found == RECIPE_KEYS[phase.name], phase.name
