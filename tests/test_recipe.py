"""A recipe (pipelines/recipe.py): one file, one command, phases chained through train records, any decoder.

The shrunk recipe end to end on a tiny random Llama, trained as the recipe file trains (online targets, warm-up, a
shuffle per epoch) and evaluated on an unseen corpus too (``eval.heldout_sources``): its kernel corpus made by
``jobs.corpus``, phase one killed right after it finished, phase two stopped mid-training, the home exported, wiped
and imported elsewhere, the same command finishing with one FINISHED training run per phase and the CR the trained
window cannot reach read at a shorter one.
One phase on a tiny hybrid Gemma 2 folder (a non-Llama decoder with local layers of its own). Bad recipes and missing inputs: one line, exit code 2, nothing written.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipelines import records
from pipelines.config import ConfigError
from pipelines.recipe import load_recipe
from pipelines.schema import parse_override, set_path
from tests.pipeline_helpers import tiny_overrides

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.pretrained  # the tiny teachers use SmolLM2's tokenizer

EVAL = ["eval.policies=[dense, streaming, oracle, kvpop]", "eval.compression_ratios=[0.5625, 0.84375]",
        "eval.read_windows=[4]", "eval.task_samples=0", "eval.generation_prompts=0", "eval.resamples=100",
        "eval.dynamic_sequences=1"]
TRAIN = ["train.scorer=mlstm", "train.steps=2", "train.checkpoint_every=2", "train.cpus_per_worker=1"]


def _write_recipe(path: Path, root: Path, phases: list, inputs: dict | None = None, *extra: str) -> Path:
    """A recipe file over the tiny pipeline config (tests/pipeline_helpers.py), without its home (given by --set)."""
    tree: dict = {"name": "tiny"}
    for item in tiny_overrides(root, Path("/unused"), *TRAIN, *EVAL, *extra):
        key, value = parse_override(item)
        if key != "home":
            set_path(tree, key, value)
    tree["phases"] = phases
    if inputs:
        tree["inputs"] = inputs
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return path


def _kernel_sources(folder: Path) -> Path:
    words = "the kernel maps each page of memory once and the scheduler runs every task in turn".split()
    for i in range(12):
        (folder / f"doc{i}.rst.txt").parent.mkdir(parents=True, exist_ok=True)
        (folder / f"doc{i}.rst.txt").write_text(" ".join(words[(i + j) % len(words)] for j in range(120)) + "\n")
    return folder


# how configs/recipes/smollm2_kvpop.yaml trains, read from it: online targets, warm-up, a shuffle per epoch
_RECIPE_TRAIN = yaml.safe_load((REPO / "configs" / "recipes" / "smollm2_kvpop.yaml").read_text())["train"]
RECIPE_TRAINING = [f"train.{key}={_RECIPE_TRAIN[key]}"
                   for key in ("targets_source", "online_features", "warmup_steps", "shuffle_seed")]


def _unseen_corpus(path: Path) -> Path:
    """A corpus no phase trains on (``eval.heldout_sources``): a few documents of another vocabulary."""
    path.parent.mkdir(parents=True, exist_ok=True)
    words = "a list keeps its items in order and a dict maps each key to one value".split()
    path.write_text("".join(json.dumps({"text": " ".join(words[(i * 3 + j) % len(words)] for j in range(90))}) + "\n"
                            for i in range(8)))
    return path


def _two_phases(mix: Path) -> list:
    return [{"name": "first", "evaluate": False, "set": {"train.lr": 0.01}},
            {"name": "second", "init_from": "first",
             "set": {"train.lr": 0.005, "train.steps": 4, "data.num_sequences": 4, "data.mix_source": str(mix),
                     "data.mix_sequences": 2}}]


def _pipeline(recipe: Path, home: Path, ray_address: str, *sets: str, crash_at: str = "",
              cwd: Path = REPO) -> subprocess.CompletedProcess:
    """``python -m jobs.pipeline --config <recipe>`` as a user runs it (in ``cwd``), joined to the session's
    cluster."""
    env = {**os.environ, "PYTHONPATH": str(REPO), records.CRASH_ENV: crash_at, "RAY_ADDRESS": ray_address}
    argv = [sys.executable, "-m", "jobs.pipeline", "--config", str(recipe), "--set", f"home={home}"]
    for item in sets:
        argv += ["--set", item]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, cwd=cwd)


def _train_runs(home: Path) -> list:
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("tests")
    return client.search_runs([experiment.experiment_id], filter_string="tags.`kvpop.stage` = 'train'")


# ------------------------------------------------------------------------------------------------ no Ray
def test_a_missing_input_is_one_line_naming_its_command_and_nothing_is_written(tiny_setup, tmp_path, capsys):
    from jobs.pipeline import cli

    mix = tmp_path / "data" / "kernel.jsonl"
    command = f"python -m jobs.corpus --sources {tmp_path / 'src'} --out {mix}"
    recipe = _write_recipe(tmp_path / "r.yaml", tiny_setup, _two_phases(mix), {str(mix): command})
    home = tmp_path / "home"
    assert cli(["--config", str(recipe), "--set", f"home={home}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"kvpop pipeline: error: input {mix} is missing: make it with `{command}`"
    assert not home.exists() and not (tmp_path / "data").exists() and not (REPO / "mlflow.db").exists()
    # an undeclared missing source of a later phase: its phase's one line, before phase one runs
    bare = _write_recipe(tmp_path / "bare.yaml", tiny_setup, _two_phases(mix))
    assert cli(["--config", str(bare), "--set", f"home={home}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "phase second: data.mix_source" in err and "does not exist" in err, err
    assert not home.exists()


def test_bad_recipes_are_refused_in_one_line(tiny_setup, tmp_path, capsys):
    from jobs.pipeline import cli

    good = [{"name": "a"}, {"name": "b", "init_from": "a"}]
    cases = [([{"name": "a", "init_from": "b"}, {"name": "b"}], (), "init_from 'b' is not an earlier phase"),
             ([{"name": "a"}, {"name": "a"}], (), "two phases are named a"),
             ([{"name": "a", "steps": 3}], (), "unknown key(s) steps"),
             ([{"name": "a", "set": {"train.nope": 1}}], (), "phase a: "),
             ([{"name": "a", "set": {"train.init_from": "x"}, "init_from": "a"}], (), "is not an earlier phase"),
             ([], (), "phases must be a non-empty list"),
             ([{"name": "a", "baselines": {"dms": "b"}}, {"name": "b"}], (), "baselines maps row names to earlier"),
             (good, ("phases.c.train.steps=3",), "names a phase of"),
             (good, ("phases.b.evaluate=3",), "a phase's evaluate is true or false"),
             (good, ("phases.b.train.steps=0",), "phase b: train.steps and train.batch_size must be >= 1")]
    for phases, sets, message in cases:
        recipe = _write_recipe(tmp_path / "r.yaml", tiny_setup, phases)
        argv = ["--config", str(recipe), "--set", f"home={tmp_path / 'home'}"]
        for item in sets:
            argv += ["--set", item]
        assert cli(argv) == 2, message
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, (message, err)
    assert not (tmp_path / "home").exists()


def test_phase_overrides_and_names(tiny_setup, tmp_path):
    recipe = load_recipe(_write_recipe(tmp_path / "r.yaml", tiny_setup, _two_phases(tmp_path / "m.jsonl")),
                         ["train.lr=0.02", "phases.second.train.steps=7", "phases.first.evaluate=true"])
    first, second = recipe.phases
    assert first.evaluate and second.init_from == "first"
    a, b = recipe.config(first), recipe.config(second, init_from="/somewhere")
    assert (a.name, b.name) == ("tiny-first", "tiny-second")
    assert (a.train.lr, b.train.lr) == (0.02, 0.02)  # the command line wins over every phase's own set
    assert (a.train.steps, b.train.steps) == (2, 7) and b.train.init_from == "/somewhere"
    with pytest.raises(ConfigError):
        load_recipe(tmp_path / "r.yaml", ["phases.first.train.lr=-1"])
    # an earlier phase's final model as a row of a later phase's evaluation (phase key baselines)
    rows = _two_phases(tmp_path / "m.jsonl")
    rows[1]["baselines"] = {"dms": "first"}
    rows[1]["set"]["eval.capped"] = True
    recipe = load_recipe(_write_recipe(tmp_path / "b.yaml", tiny_setup, rows))
    assert recipe.config(recipe.phases[1]).eval.baselines == {"dms": "phase:first"}  # checked before it exists
    assert recipe.config(recipe.phases[1], "/a", {"dms": "/trained/dms"}).eval.baselines == {"dms": "/trained/dms"}


# ------------------------------------------------------------------------------------------------ end to end
@pytest.mark.slow
@pytest.mark.ray
def test_the_shrunk_recipe_end_to_end_with_a_kill_and_a_move_between_machines(tiny_setup, tmp_path, ray_cluster,
                                                                              monkeypatch):
    from jobs.corpus import cli as corpus
    from jobs.state import cli as state

    # the corpora named as the recipe file names them, relative to where the command runs: Ray Train runs its
    # workers (the learning curve's held-out corpora) in folders of its own
    mix, unseen = Path("data/kernel.jsonl"), Path("data/unseen_docs.jsonl")
    sources = _kernel_sources(tmp_path / "src")
    _unseen_corpus(tmp_path / unseen)
    recipe = _write_recipe(tmp_path / "recipe.yaml", tiny_setup, _two_phases(mix),
                           {str(mix): f"python -m jobs.corpus --sources {sources} --out {mix}"}, *RECIPE_TRAINING,
                           f"eval.heldout_sources=[{unseen}]", "train.eval_every=2", "train.eval_heldout_sources=true")
    assert corpus(["--sources", str(sources), "--out", str(tmp_path / mix)]) == 0
    home = tmp_path / "machine1" / "home"

    # 1. killed right after phase one committed
    killed = _pipeline(recipe, home, ray_cluster, crash_at="recipe.phase_done.first", cwd=tmp_path)
    assert killed.returncode == records.CRASH_EXIT_CODE, killed.stderr[-3000:]
    assert [r.info.status for r in _train_runs(home)] == ["FINISHED"]
    # 2. the same command: phase one reused through its record, phase two stopped mid-training (step 2 checkpointed)
    partial = _pipeline(recipe, home, ray_cluster, "phases.second.train.fail_at_step=3", "train.max_failures=0",
                        cwd=tmp_path)
    assert partial.returncode == 1, partial.stderr[-3000:]
    assert "phase 1/2 first: trained already (2 steps" in partial.stdout, partial.stdout[-3000:]
    second_run = {r.info.run_name: r for r in _train_runs(home)}
    assert sorted(r.info.status for r in second_run.values()) == ["FAILED", "FINISHED"]

    # 3. a fresh machine: export, wipe, import elsewhere (another home path), the same command again
    assert state(["export", "--out", str(tmp_path / "state.tgz"), "--home", str(home)]) == 0
    shutil.rmtree(tmp_path / "machine1")
    home = tmp_path / "machine2" / "kvpop"
    assert state(["import", str(tmp_path / "state.tgz"), "--home", str(home)]) == 0
    assert not (home / "targets").exists()  # online targets: none stored, none carried
    done = _pipeline(recipe, home, ray_cluster, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "phase 1/2 first: trained already" in done.stdout
    runs = _train_runs(home)
    assert sorted(r.info.run_name for r in runs) == sorted(second_run) and len(runs) == 2
    assert [r.info.status for r in runs] == ["FINISHED", "FINISHED"]  # one FINISHED training run per phase
    monkeypatch.chdir(tmp_path)  # where the recipe's relative corpora are
    loaded = load_recipe(recipe, [f"home={home}"])
    first_cfg = loaded.config(loaded.phases[0])
    first = records.for_config(first_cfg, "train")
    second_cfg = loaded.config(loaded.phases[1], init_from=first.payload["model_dir"])
    second = records.for_config(second_cfg, "train")
    assert first.payload["model_dir"].startswith(str(home)) and second.payload["steps"] == 4
    # the same MLflow run, resumed
    assert second.payload["mlflow_run_id"] == second_run[second.payload["run_name"]].info.run_id
    import mlflow

    history = mlflow.MlflowClient(f"sqlite:///{home / 'mlflow.db'}").get_metric_history(
        second.payload["mlflow_run_id"], "loss")
    assert sorted({m.step for m in history}) == [1, 2, 3, 4]
    # the learning curve read the unseen corpus in the training workers too
    logged = mlflow.MlflowClient(f"sqlite:///{home / 'mlflow.db'}").get_run(second.payload["mlflow_run_id"])
    assert any(key.startswith("heldout.unseen_docs.") for key in logged.data.metrics), sorted(logged.data.metrics)
    meta = json.loads((Path(second.payload["model_dir"]) / "kvpop.json").read_text())
    assert "path" not in meta["base"] and str(tmp_path) not in json.dumps(meta)
    # evaluated at the trained window (CR 0.5625: B = 28) and, read at window 4, at CR 0.84375 (B = 10 < 4 + 8)
    from pipelines.evaluate import readings

    evaluations = [json.loads((Path(records.for_config(c, "evaluate").payload["output_dir"]) / "metrics.json")
                              .read_text()) for c in [second_cfg, *readings(second_cfg)]]
    assert [b["budget"] for b in evaluations[0]["budgets"]] == ["s4-w8-k16"]
    assert [u["B"] for u in evaluations[0]["unreachable"]] == [10]
    assert [b["budget"] for b in evaluations[1]["budgets"]] == ["s4-w4-k2"] and not evaluations[1]["unreachable"]
    # the unseen corpus's held-out split beside the main one, at every reading
    for evaluation in evaluations:
        other = evaluation["summary"]["corpora"]["unseen_docs"]
        assert other["source"] == str(unseen) and {m["n"] for m in other["metrics"]} == {2}
        assert any(g["policy"] == "kvpop" and g["metric"] == "kl" for g in other["gap_closed"])
    assert not (home / "targets").exists()  # trained online: the precompute stage never ran


@pytest.mark.slow
@pytest.mark.ray
def test_one_phase_on_a_hybrid_gemma2_folder(tiny_setup, tmp_path, ray_cluster, capsys):
    """One phase of a recipe on a tiny random Gemma 2 folder (local, global, local, global layers): a non-Llama
    decoder through precompute, training and evaluation end to end, its targets and scorers covering its two global
    layers only (its local layers keep their own window, kvpop.local_layers)."""
    import math

    import mlflow
    from transformers import AutoTokenizer

    import kvpop
    from jobs.pipeline import cli
    from kvpop.retrofit import scoring_modules
    from pipelines import store, train
    from tests.models import LOCAL_WINDOW, tiny_model

    tokenizer = AutoTokenizer.from_pretrained(tiny_setup / "teacher")
    teacher = tmp_path / "gemma2"
    tiny_model("gemma2", "gqa", vocab=len(tokenizer)).save_pretrained(teacher)
    tokenizer.save_pretrained(teacher)
    recipe = _write_recipe(tmp_path / "recipe.yaml", tiny_setup, [{"name": "only"}], None, f"model.path={teacher}",
                           "eval.read_windows=[]", "eval.compression_ratios=[0.5625]")
    home = tmp_path / "home"
    assert cli(["--config", str(recipe), "--set", f"home={home}"]) == 0
    assert "phase 1/1 only:" in capsys.readouterr().out
    cfg = load_recipe(recipe, [f"home={home}"])
    cfg = cfg.config(cfg.phases[0])

    targets = store.open_targets(train.targets_path(cfg))
    assert targets.identity["target_layers"] == [1, 3] and targets.identity["num_layers"] == 2
    column = targets.read_table([store.target_column(8)]).schema.field(store.target_column(8))
    assert list(column.type.shape) == [2, 2, 64]  # [global layers, Hkv, S]

    payload = records.for_config(cfg, "train").payload
    run = mlflow.MlflowClient(cfg.tracking_uri()).get_run(payload["mlflow_run_id"])
    assert run.info.status == "FINISHED" and math.isfinite(run.data.metrics["ret_loss"])
    meta = json.loads((Path(payload["model_dir"]) / "kvpop.json").read_text())
    assert meta["base"]["model_type"] == "gemma2" and meta["num_kv_heads"] == 2
    assert meta["head_dim"] == json.loads((teacher / "config.json").read_text())["head_dim"]
    model, _ = kvpop.load_retrofitted(payload["model_dir"], base=teacher)
    assert model.kvpop_runtime.layer_windows == (LOCAL_WINDOW, None, LOCAL_WINDOW, None)
    assert [m.layer_idx for m in scoring_modules(model)] == [1, 3]

    evaluation = json.loads((Path(records.for_config(cfg, "evaluate").payload["output_dir"]) / "metrics.json")
                            .read_text())
    assert [b["budget"] for b in evaluation["budgets"]] == ["s4-w8-k16"]
    rows = {(m["policy"], m["metric"]) for m in evaluation["summary"]["metrics"]}
    assert {("kvpop", "kl"), ("oracle", "kl"), ("streaming", "kl")} <= rows


def test_a_scorer_of_another_base_is_refused_in_one_line_before_anything_is_written(tiny_setup, tmp_path, capsys):
    """A trained model is a portable artifact: ``eval.checkpoint`` loads on ``model.path`` when its tensors are the
    ones the scorers were trained on; another base is one line naming both digests, exit code 2."""
    import kvpop
    from jobs.evaluate import cli
    from kvpop.files import tensors_digest
    from kvpop.pretrained import load_pretrained

    model, tokenizer = load_pretrained(tiny_setup / "teacher")
    kvpop.retrofit(model, kvpop.Budget(4, 8, 16), scorer="mlp")
    folder = kvpop.save_retrofitted(model, tmp_path / "scorers", base=tiny_setup / "teacher")
    home = tmp_path / "home"
    other = tiny_setup / "other_teacher"
    argv = [x for o in tiny_overrides(tiny_setup, home, f"eval.checkpoint={folder}", f"model.path={other}")
            for x in ("--set", o)]
    capsys.readouterr()
    assert cli(argv) == 2
    err = capsys.readouterr().err.strip()
    expected, found = tensors_digest(tiny_setup / "teacher")[:16], tensors_digest(other)[:16]
    assert len(err.splitlines()) == 1, err
    assert f"expected tensors sha256 {expected}… (teacher), found {found}…" in err, err
    assert not (home / "eval").exists() and not (home / "data").exists() and not (home / "mlflow.db").exists()


def test_read_windows_give_each_unreachable_cr_the_largest_window_that_leaves_long_range_slots(tiny_setup, tmp_path):
    import kvpop
    from kvpop.pretrained import load_pretrained
    from pipelines.config import load_config
    from pipelines.evaluate import readings

    model, _ = load_pretrained(tiny_setup / "teacher")
    kvpop.retrofit(model, kvpop.Budget(4, 8, 16), scorer="mlstm")
    folder = kvpop.save_retrofitted(model, tmp_path / "scorers", base=tiny_setup / "teacher")
    sets = tiny_overrides(tiny_setup, tmp_path / "home", f"eval.checkpoint={folder}",
                          "eval.compression_ratios=[0.5625, 0.84375, 0.875, 0.90625]")  # B = 28, 10, 8, 6
    assert readings(load_config(None, sets)) == []
    found = readings(load_config(None, [*sets, "eval.read_windows=[2, 4, 16]"]))
    # B = 10: w4 (4 + 4 < 10); B = 8: w2 (4 + 4 = 8 leaves none); B = 6: none fits (4 + 2 = 6); w16 is longer
    assert [(c.eval.compression_ratios, c.eval.read_windows) for c in found] == [((0.84375,), ()), ((0.875,), ())]
    metas = [json.loads((Path(c.eval.checkpoint) / "kvpop.json").read_text()) for c in found]
    assert [m["budget"]["window"] for m in metas] == [4, 2] and all(m["scorer_window"] == m["budget"]["window"]
                                                                    for m in metas)
    assert [Path(c.eval.checkpoint) for c in found] == [Path(c.eval.checkpoint) for c in readings(
        load_config(None, [*sets, "eval.read_windows=[2, 4, 16]"]))]  # made once, then reused
    with pytest.raises(ConfigError, match="eval.read_windows must all be >= 1"):
        load_config(None, [*sets, "eval.read_windows=[0]"])
