"""``python -m jobs.state``: a home's resumable state packed and unpacked elsewhere with its paths rewritten (the
end-to-end resume is tests/test_recipe.py's); bad tarballs and occupied homes are one line, exit code 2, nothing
written."""
from __future__ import annotations

import json
import sqlite3
import tarfile

from jobs.state import cli
from pipelines import state


def _home(home):
    (home / "records" / "train").mkdir(parents=True)
    (home / "records" / "precompute").mkdir(parents=True)
    record = {"payload": {"model_dir": str(home / "runs/r/final_model")}}
    (home / "records" / "train" / "k.json").write_text(json.dumps(record))
    (home / "records" / "precompute" / "p.json").write_text("{}")
    for name in ("r", "u"):  # r finished (its final model is recorded), u half-trained
        run = home / "runs" / name
        for folder in ("checkpoint_2026-01-01_00-00-00.000000", "final_model", ".final_model.tmp", "other"):
            (run / folder).mkdir(parents=True)
            (run / folder / "x.bin").write_bytes(b"\0\1")
        (run / "checkpoint_manager_snapshot.json").write_text(json.dumps({"path": str(run / "checkpoint_2026")}))
    (home / "heldout_references" / "0123abcd").mkdir(parents=True)  # a learning curve's reference records
    (home / "heldout_references" / "0123abcd" / "text.json").write_text("{}")
    (home / "targets" / "t").mkdir(parents=True)
    (home / "targets" / "t" / "shard.parquet").write_bytes(b"big")
    with sqlite3.connect(home / "mlflow.db") as conn:
        conn.execute("CREATE TABLE experiments (id INTEGER, artifact_location VARCHAR(256))")
        conn.execute("CREATE TABLE tags (key VARCHAR(250), value TEXT, n INTEGER)")
        conn.execute("INSERT INTO experiments VALUES (1, ?)", (f"file://{home}/mlartifacts/tests",))
        conn.execute("INSERT INTO tags VALUES ('kvpop.model_dir', ?, 3)", (record["payload"]["model_dir"],))


def test_export_packs_what_resume_needs_and_import_moves_it(tmp_path, capsys):
    old, new = tmp_path / "a" / "home", tmp_path / "b" / "other"
    _home(old)
    out = tmp_path / "state.tgz"
    assert cli(["export", "--out", str(out), "--home", str(old)]) == 0
    with tarfile.open(out) as tar:
        names = set(tar.getnames())
    assert {"records/train/k.json", "runs/u/checkpoint_manager_snapshot.json", "runs/r/final_model/x.bin",
            "runs/u/checkpoint_2026-01-01_00-00-00.000000/x.bin", "runs/u/final_model/x.bin", "mlflow.db",
            "heldout_references/0123abcd/text.json", state.MANIFEST} <= names
    # a finished run's checkpoints stay behind: its record reuses the final model
    assert not any(n.startswith(("targets", "records/precompute", "runs/r/checkpoint", "runs/r/other",
                                 "runs/u/other", "runs/r/.final", "runs/u/.final")) for n in names)
    assert cli(["import", str(out), "--home", str(new)]) == 0
    record = json.loads((new / "records" / "train" / "k.json").read_text())
    assert record["payload"]["model_dir"] == str(new / "runs/r/final_model")
    assert str(new) in (new / "runs/u/checkpoint_manager_snapshot.json").read_text()
    with sqlite3.connect(new / "mlflow.db") as conn:
        assert conn.execute("SELECT artifact_location FROM experiments").fetchone()[0] == \
            f"file://{new}/mlartifacts/tests"
        assert conn.execute("SELECT value, n FROM tags").fetchone() == (str(new / "runs/r/final_model"), 3)
    capsys.readouterr()
    # a second import into the same home clashes: refused, nothing changed
    before = (new / "records" / "train" / "k.json").read_text()
    assert cli(["import", str(out), "--home", str(new)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "already holds" in err, err
    assert (new / "records" / "train" / "k.json").read_text() == before


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "junk.tgz").write_text("not a tarball")
    with tarfile.open(tmp_path / "other.tgz", "w:gz") as tar:
        tar.add(__file__, arcname="x.py")
    for argv, message in [(["export", "--out", str(tmp_path / "s.tgz"), "--home", str(tmp_path / "empty")],
                           "nothing to resume"),
                          (["export", "--out", str(tmp_path / "s.zip"), "--home", str(tmp_path / "empty")],
                           "give a .tgz path"),
                          (["import", str(tmp_path / "nowhere.tgz"), "--home", str(tmp_path / "h")], "no such file"),
                          (["import", str(tmp_path / "junk.tgz"), "--home", str(tmp_path / "h")],
                           "not a gzipped tarball"),
                          (["import", str(tmp_path / "other.tgz"), "--home", str(tmp_path / "h")],
                           "not a state tarball")]:
        capsys.readouterr()
        assert cli(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, (argv, err)
    assert not (tmp_path / "h").exists() and not (tmp_path / "s.tgz").exists()
