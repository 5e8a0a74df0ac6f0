"""pipelines.precompute: teacher targets into Parquet shards through Ray Data, with a manifest as the commit point.

One tiny random teacher (SmolLM2's tokenizer, 2 layers, 4 query / 2 KV heads) over 8 sequences of 64 tokens, one
sequence per shard, on the session's shared Ray cluster.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from pipelines import precompute, records, store
from pipelines.config import ConfigError
from tests.pipeline_helpers import WINDOWS, tiny_config, tiny_overrides

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.pretrained  # the tiny teachers use SmolLM2's tokenizer


def _rows(path: Path) -> dict[str, dict]:
    table = store.open_targets(path).read_table()
    arrays = {name: table.column(name).combine_chunks().to_numpy_ndarray() for name in table.column_names
              if name != "id"}
    return {seq_id: {name: array[i] for name, array in arrays.items()}
            for i, seq_id in enumerate(table.column("id").to_pylist())}


@pytest.mark.ray
def test_shards_hold_the_teachers_targets_and_topk_logits(tiny_targets, tiny_setup):
    from kvpop.pretrained import load_pretrained
    from kvpop.targets import teacher_pass

    cfg, result = tiny_targets
    assert result.shards == 8 and result.computed == 8 and result.rows == 8
    targets = store.open_targets(result.path, windows=[8], expect={"seq_len": 64})
    assert targets.ids == [f"train-{i:06d}" for i in range(8)]
    header = json.loads((result.path / store.HEADER).read_text())
    assert header["identity"]["schema_version"] == store.SCHEMA_VERSION
    assert result.path.parent == cfg.home_dir() / "targets"
    # the hand-over record names the directory (train and sweep find it there)
    assert records.for_config(cfg, "precompute").payload["path"] == str(result.path)
    model, _ = load_pretrained(tiny_setup / "teacher")
    rows = _rows(result.path)
    for seq_id, row in rows.items():
        ids = torch.tensor(row["input_ids"], dtype=torch.long)[None]
        want = teacher_pass(model, ids, WINDOWS, top_k=8, group_reduce="max")
        for w in WINDOWS:
            torch.testing.assert_close(torch.tensor(row[f"targets_w{w}"]), want["targets"][w][:, 0],
                                       rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.tensor(row["topk_values"]), want["topk_values"][0], rtol=1e-5, atol=1e-6)
        assert torch.equal(torch.tensor(row["topk_indices"]).long(), want["topk_indices"][0])
    # no teacher work the second time: every shard is committed and intact (Ray is not even needed)
    again = precompute.run(cfg)
    assert again.computed == 0 and again.path == result.path


@pytest.mark.ray
def test_a_shard_removed_from_the_manifest_is_the_only_one_recomputed(tiny_targets, tiny_setup, tmp_path):
    cfg, result = tiny_targets
    manifest = result.path / store.MANIFEST
    before = manifest.read_text().splitlines()
    kept = [line for line in before if json.loads(line)["shard"] != 3]
    manifest.write_text("\n".join(kept) + "\n")
    again = precompute.run(cfg)
    assert again.computed == 1
    after = store.read_manifest(result.path)
    old = {json.loads(line)["shard"]: json.loads(line) for line in before}
    assert after[3].sha256 == old[3]["sha256"]  # deterministic: the same bytes again
    assert store.open_targets(result.path).num_rows == 8


@pytest.mark.ray
@pytest.mark.slow
def test_a_killed_run_resumes_to_exactly_the_rows_of_an_uninterrupted_run(tiny_targets, tiny_setup, tmp_path,
                                                                         ray_cluster):
    cfg = tiny_config(tiny_setup, tmp_path / "home")
    assert store.targets_dir(cfg).name == tiny_targets[1].path.name  # same config, another home
    script = tmp_path / "driver.py"
    script.write_text(
        "import json, sys, time\n"
        "import ray\n"
        "from pipelines import precompute\n"
        "from pipelines.config import config_from_dict\n"
        "cfg = config_from_dict(json.loads(sys.argv[1]))\n"
        "ray.init(address=sys.argv[2])\n"
        "def progress(record, done, total):\n"
        "    if done >= 2:\n"
        "        time.sleep(3600)  # hold here until the test kills this driver\n"
        "precompute.run(cfg, progress=progress)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, str(script), json.dumps(cfg.to_dict()), ray_cluster], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    folder = store.targets_dir(cfg)
    try:
        deadline = time.monotonic() + 240
        while len(store.read_manifest(folder)) < 2:
            assert proc.poll() is None, "the driver exited before it was killed"
            assert time.monotonic() < deadline, "the driver committed no shards in time"
            time.sleep(0.2)
    finally:
        proc.kill()  # SIGKILL: no cleanup of any kind
        proc.wait()
    committed = len(store.read_manifest(folder))
    assert 2 <= committed < 8
    resumed = precompute.run(cfg)
    assert resumed.computed == 8 - committed
    lines = [json.loads(line) for line in (folder / store.MANIFEST).read_text().splitlines()]
    assert sorted(r["shard"] for r in lines) == list(range(8))  # no shard committed twice
    got, want = _rows(folder), _rows(tiny_targets[1].path)
    assert list(got) == list(want)
    for seq_id in want:
        for name in want[seq_id]:
            np.testing.assert_array_equal(got[seq_id][name], want[seq_id][name])


def test_an_empty_dataset_fails_before_anything_is_written(tiny_setup, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    cfg = tiny_config(tiny_setup, tmp_path / "home", f"data.source={empty}")
    with pytest.raises(ConfigError, match="no documents|cannot read"):
        precompute.run(cfg)
    assert not (tmp_path / "home" / "targets").exists()


def test_another_config_gets_another_directory(tiny_setup, tmp_path):
    home = tmp_path / "home"
    base = store.targets_dir(tiny_config(tiny_setup, home))
    for extra in ("data.seq_len=128", "precompute.windows=[8]", "precompute.top_k=4",
                  f"model.path={tiny_setup / 'other_teacher'}", "model.dtype=bfloat16", "data.seed=3"):
        assert store.targets_dir(tiny_config(tiny_setup, home, extra)) != base, extra
    # the output root and the actor layout are not part of the identity
    assert store.targets_dir(tiny_config(tiny_setup, home, "precompute.num_actors=2")) == base


@pytest.fixture
def quiet_datasets(monkeypatch):
    """What the CLI process sets before datasets is imported (here it may be imported already): no progress bars."""
    import importlib

    monkeypatch.setattr(importlib.import_module("datasets.utils.tqdm"), "_hf_datasets_progress_bars_disabled", True)


def _cli(argv: list[str], capsys) -> tuple[int, list[str]]:
    """``python -m jobs.precompute`` in this process: (exit code, stderr lines)."""
    import jobs.precompute
    from jobs._cli import main

    code = main("precompute", jobs.precompute.__doc__, jobs.precompute.body, argv)
    return code, capsys.readouterr().err.strip().splitlines()


def _argv(tiny_setup, home, *extra) -> list[str]:
    return [item for override in tiny_overrides(tiny_setup, home, *extra) for item in ("--set", override)]


def _written(home):
    """Files under ``home`` besides the content-digest memo and the datasets cache."""
    return sorted(str(p.relative_to(home)) for p in home.rglob("*") if p.is_file()
                  and p.relative_to(home).parts[0] != "cache")


def test_an_empty_corpus_file_is_one_line_and_writes_nothing(tiny_setup, tmp_path, capsys, quiet_datasets):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    home = tmp_path / "home"
    code, err = _cli(_argv(tiny_setup, home, f"data.source={empty}"), capsys)
    assert code == 2 and len(err) == 1 and "is empty: it holds no documents" in err[0], err
    assert _written(home) == []


@pytest.mark.parametrize("content", ["not json {", "[1]", '{"identity": {"kind": "x"}}'])
def test_a_garbage_dataset_json_is_one_line_and_nothing_else_is_written(tiny_setup, tmp_path, capsys, content,
                                                                         quiet_datasets):
    home = tmp_path / "home"
    folder = store.targets_dir(tiny_config(tiny_setup, home))
    folder.mkdir(parents=True)
    (folder / store.HEADER).write_text(content)
    code, err = _cli(_argv(tiny_setup, home), capsys)
    assert code == 2 and len(err) == 1 and "is not a target header" in err[0], err
    assert _written(home) == [str((folder / store.HEADER).relative_to(home))]
    assert (folder / store.HEADER).read_text() == content


@pytest.mark.ray
def test_a_second_precompute_of_a_directory_is_refused_with_one_line(tiny_targets, tiny_setup, tmp_path, capsys,
                                                                      quiet_datasets):
    from kvpop.files import exclusive_lock

    home = tmp_path / "home"
    folder = store.targets_dir(tiny_config(tiny_setup, home))
    shutil.copytree(tiny_targets[1].path, folder)
    manifest = folder / store.MANIFEST
    manifest.write_text("".join(manifest.read_text().splitlines(keepends=True)[:-1]))  # one shard still to do
    before = {p.name: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    with exclusive_lock(folder / store.LOCK):  # the first precompute, still running
        code, err = _cli(_argv(tiny_setup, home), capsys)
    assert code == 2 and len(err) == 1 and "another precompute is writing" in err[0], err
    assert {p.name: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before
    assert records.for_config(tiny_config(tiny_setup, home), "precompute") is None


def test_the_python_api_checks_the_model_before_it_writes(tiny_setup, tmp_path):
    """``precompute.run`` called directly (not through a CLI) refuses a model whose ``config.json`` names no
    ``model_type`` before the digest and sequence caches are written."""
    untyped = tmp_path / "untyped"
    shutil.copytree(tiny_setup / "teacher", untyped)
    config = json.loads((untyped / "config.json").read_text())
    del config["model_type"]
    (untyped / "config.json").write_text(json.dumps(config))
    home = tmp_path / "home"
    with pytest.raises(ConfigError, match="config.json has no model_type"):
        precompute.run(tiny_config(tiny_setup, home, f"model.path={untyped}"))
    assert _written(home) == []


@pytest.mark.parametrize("name, content", [("bad.jsonl", b"garbage{{{\nnot json\n"), ("bad.parquet", b"PAR1garbage")])
def test_a_garbage_corpus_file_is_one_line_and_leaves_no_cache_entry(tiny_setup, tmp_path, capfd, quiet_datasets,
                                                                     name, content):
    import jobs.precompute
    from jobs._cli import main

    source = tmp_path / name
    source.write_bytes(content)
    home = tmp_path / "home"
    code = main("precompute", jobs.precompute.__doc__, jobs.precompute.body,
                _argv(tiny_setup, home, f"data.source={source}"))
    err = capfd.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and f"data.source {source}: cannot read it as a dataset (ArrowInvalid" in err[0]
    assert not (home / "cache" / "hf-datasets").exists()  # no builder lock files or folders left behind


def test_a_hub_dataset_name_says_the_run_is_offline(tiny_setup, tmp_path, capsys, quiet_datasets):
    code, err = _cli(_argv(tiny_setup, tmp_path / "home", "data.source=someone/some-corpus"), capsys)
    assert code == 2 and len(err) == 1, err
    assert "'someone/some-corpus' is not a local file or folder" in err[0] and "offline" in err[0]
    assert "ConnectionError" not in err[0]
