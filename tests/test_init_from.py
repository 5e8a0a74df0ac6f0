"""``train.init_from``: a fresh run's scorers start from a saved scorer folder (fine-tuning), checked against the
run's scorer, window and base in one line; the run's keys hold the folder's weights digest, not its path; a resumed
run continues from its own checkpoint whatever init_from says. No Ray: the worker's start (:func:`start_student`)
and the driver's checks are called directly on the tiny teacher of ``tiny_setup``."""
from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
from safetensors.torch import load_file

import kvpop
from kvpop import checkpointing
from kvpop.objective import Objective
from pipelines import records, train
from pipelines.config import ConfigError
from pipelines.identity import init_identity, teacher_identity
from pipelines.train_worker import TrainSpec, build_student, start_student, write_final_model
from tests.pipeline_helpers import tiny_config

pytestmark = pytest.mark.pretrained  # the tiny teachers use SmolLM2's tokenizer


def _spec(tiny_setup, tmp_path, *, teacher: str = "teacher", options: dict | None = None, window: int = 8,
          init_from: str = "", lr: float = 0.01) -> TrainSpec:
    base = tiny_setup / teacher
    return TrainSpec(run_name="r", run_dir=str(tmp_path / "r"), base_path=str(base),
                     base_sha256=kvpop.files.weights_digest(base), objective=Objective(kvpop.Budget(4, window, 16)),
                     policy="kvpop", scorer="mlstm", scorer_options=options or {}, mode="scorer_only",
                     target_column=f"targets_w{window}", lr=lr, base_lr=1e-5, grad_clip=1.0, steps=3, batch_size=1,
                     seq_len=64, seed=0, use_gpu=False, sharded=False, bf16=False, threads=1, checkpoint_every=1,
                     log_every=1, fail_at_step=0, tracking_uri="", mlflow_run_id="", init_from=init_from)


def _saved_scorers(tiny_setup, tmp_path, name: str = "saved", shift: float = 0.05, **spec_options):
    """A scorer-only final model (as the train stage writes it) whose scorers moved away from their init."""
    spec = _spec(tiny_setup, tmp_path, **spec_options)
    model, tokenizer = build_student(spec)
    with torch.no_grad():
        for p in kvpop.scorers(model).parameters():
            p.add_(shift)
    write_final_model(model, tmp_path / name, tokenizer, spec, steps=7)
    return tmp_path / name


def _scorer_state(model) -> dict:
    return {f"layers.{i}.{k}": v.detach().clone() for i, s in enumerate(kvpop.scorers(model))
            for k, v in s.state_dict().items()}


def test_a_fresh_run_starts_from_the_saved_scorers_exactly(tiny_setup, tmp_path):
    folder = _saved_scorers(tiny_setup, tmp_path)
    saved = load_file(str(folder / "kvpop_scorers.safetensors"))
    model, _, optimizer, trainable, step = start_student(_spec(tiny_setup, tmp_path, init_from=str(folder)), "cpu")
    assert step == 0 and trainable
    mine = _scorer_state(model)
    assert mine.keys() == saved.keys()
    for name, value in saved.items():
        torch.testing.assert_close(mine[name], value, rtol=0, atol=0, msg=name)
    fresh, *_ = start_student(_spec(tiny_setup, tmp_path), "cpu")  # without init_from: the seeded init, not these
    assert any(not torch.equal(v, saved[k]) for k, v in _scorer_state(fresh).items())
    assert all(not torch.equal(v, saved[k]) for k, v in _scorer_state(fresh).items() if "weight" in k)


def test_a_resumed_run_continues_its_own_checkpoint_not_init_from(tiny_setup, tmp_path):
    import ray.train

    folder = _saved_scorers(tiny_setup, tmp_path)
    own, _ = build_student(_spec(tiny_setup, tmp_path))
    with torch.no_grad():
        for p in kvpop.scorers(own).parameters():
            p.sub_(0.03)  # the run's own weights at its last checkpoint: neither the init nor init_from's
    optimizer = torch.optim.AdamW([p for p in own.parameters() if p.requires_grad])
    checkpointing.save(own, optimizer, tmp_path / "ckpt", step=2, trainable_only=True)
    spec = _spec(tiny_setup, tmp_path, init_from=str(folder))
    model, _, _, _, step = start_student(spec, "cpu", checkpoint=ray.train.Checkpoint.from_directory(tmp_path / "ckpt"))
    assert step == 2
    saved = load_file(str(folder / "kvpop_scorers.safetensors"))
    for name, value in _scorer_state(own).items():
        torch.testing.assert_close(_scorer_state(model)[name], value, rtol=0, atol=0, msg=name)
        assert not torch.equal(value, saved[name])


def test_the_driver_checks_the_folder_in_one_line(tiny_setup, tmp_path):
    folder = _saved_scorers(tiny_setup, tmp_path)
    cfg = tiny_config(tiny_setup, tmp_path / "home", "train.scorer=mlstm", f"train.init_from={folder}")
    base = teacher_identity(cfg)["weights_sha256"]
    digest = train.check_init_from(cfg, base)
    assert init_identity(cfg) == [("init_scorers_sha256", digest)]
    assert train.check_init_from(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, init_from=None)),
                                 base) is None
    other = _saved_scorers(tiny_setup, tmp_path, "other", options={"features": "kv_norms"})
    distilled = tmp_path / "distilled"
    model, tokenizer = build_student(_spec(tiny_setup, tmp_path))
    kvpop.save_retrofitted(model, distilled, tokenizer)  # its own base weights: not a scorer-only folder
    cases = [
        (["train.init_from=" + str(tmp_path / "nothing")], base, "not a saved scorer folder"),
        ([f"train.init_from={distilled}"], base, "not a saved scorer folder"),
        ([f"train.init_from={folder}", "budget.window=16"], base, "trained at window 8 on base"),
        ([f"train.init_from={folder}", f"model.path={tiny_setup / 'other_teacher'}"], teacher_identity(tiny_config(
            tiny_setup, tmp_path / "home", f"model.path={tiny_setup / 'other_teacher'}"))["weights_sha256"],
         "start from scorers of this window and base"),
        ([f"train.init_from={other}"], base, "start from scorers of the same scorer and options"),
        ([f"train.init_from={folder}", "train.scorer=mlp"], base, "start from scorers of the same scorer"),
    ]
    for extra, sha, message in cases:
        bad = tiny_config(tiny_setup, tmp_path / "home", "train.scorer=mlstm", *extra)
        with pytest.raises(ConfigError, match=message) as err:
            train.check_init_from(bad, sha)
        assert "\n" not in str(err.value) and str(err.value).startswith("train.init_from ")
    with pytest.raises(ConfigError, match="train.init_from is a saved scorer folder for train.policy=kvpop"):
        tiny_config(tiny_setup, tmp_path / "home", "train.policy=streaming", "train.mode=distill",
                    f"train.init_from={folder}")


def test_the_run_is_named_by_the_init_weights_not_the_folder(tiny_setup, tmp_path):
    folder = _saved_scorers(tiny_setup, tmp_path)
    plain = tiny_config(tiny_setup, tmp_path / "home", "train.scorer=mlstm")
    started = tiny_config(tiny_setup, tmp_path / "home", "train.scorer=mlstm", f"train.init_from={folder}")
    moved = tmp_path / "elsewhere" / "copy"
    shutil.copytree(folder, moved)
    relocated = tiny_config(tiny_setup, tmp_path / "home", "train.scorer=mlstm", f"train.init_from={moved}")
    assert "init_from" not in started.train.optimisation() and init_identity(plain) == []
    assert records.train_key(started) == records.train_key(relocated) != records.train_key(plain)
    assert records.evaluate_key(started) == records.evaluate_key(relocated) != records.evaluate_key(plain)
    targets = type("Targets", (), {"key": "k"})()  # run_name_of reads the targets' key only
    assert train.run_name_of(started, targets) == train.run_name_of(relocated, targets) != \
        train.run_name_of(plain, targets)
    other = _saved_scorers(tiny_setup, tmp_path, "other", shift=0.07)
    shutil.copy(other / "kvpop_scorers.safetensors", moved / "kvpop_scorers.safetensors")  # other weights, same place
    assert records.train_key(relocated) != records.train_key(started)
    assert train.run_name_of(relocated, targets) != train.run_name_of(started, targets)
    spec_folder = train.make_spec(started, type("T", (), {"identity": {"teacher": {"weights_sha256": "x"}}})(),
                                  "n", tmp_path, "").init_from
    assert spec_folder == str(folder.resolve())


def test_the_pipeline_refuses_a_missing_init_folder_before_any_stage(tiny_setup, tmp_path, capsys):
    from jobs.pipeline import cli
    from tests.pipeline_helpers import tiny_overrides

    home = tmp_path / "home"
    sets = [x for o in tiny_overrides(tiny_setup, home, "train.scorer=mlstm",
                                      f"train.init_from={tmp_path / 'phase1' / 'final_model'}") for x in ("--set", o)]
    assert cli(sets) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "train.init_from" in err and "not a saved scorer folder" in err, err
    assert not (home / "targets").exists() and not (home / "data").exists()
