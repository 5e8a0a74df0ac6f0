"""``tools/gpu/``: the scripts parse; ``session.sh`` logs every part's start and end (an unknown part fails alone
and the session still ends); ``run_state.sh`` packs exactly the runs' state a later session resumes from."""
from __future__ import annotations

import subprocess
import tarfile
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools" / "gpu"


@pytest.mark.parametrize("script", sorted(p.name for p in TOOLS.glob("*.sh")))
def test_the_script_parses(script):
    subprocess.run(["bash", "-n", str(TOOLS / script)], check=True)


def test_a_session_logs_each_part_and_an_unknown_part_fails_alone(tmp_path):
    out = tmp_path / "r"
    subprocess.run(["bash", str(TOOLS / "session.sh"), str(out), "nosuch,alsonot"], check=True,
                   cwd=TOOLS.parents[1], env={"PATH": "/usr/bin:/bin", "KVPOP_HOME": str(tmp_path / "home")})
    progress = (out / "progress.log").read_text().splitlines()
    assert sorted(line.split()[:3 if line.startswith("end") else 2] for line in progress[:-1]) == [
        ["end", "alsonot", "rc=1"], ["end", "nosuch", "rc=1"], ["start", "alsonot"], ["start", "nosuch"]]
    assert progress[-1].startswith("done ")
    assert (out / "nosuch.log").read_text().strip() == "unknown part nosuch"


def _home(root: Path, checkpoint: bool = True) -> Path:
    files = ["mlflow.db", "runs/a/checkpoint_manager_snapshot.json", "runs/a/final_model/model.safetensors",
             "runs/b/checkpoint_manager_snapshot.json", "shards/x.parquet", "runs/a/notes.txt"]
    if checkpoint:
        files += ["runs/a/checkpoint_000001/state.pt", "runs/b/checkpoint_000002/state.pt"]
    for name in files:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(name)
    return root


def test_run_state_packs_the_store_snapshots_checkpoints_and_final_models(tmp_path):
    home = _home(tmp_path / "home")
    tarball = tmp_path / "state.tgz"
    subprocess.run(["bash", str(TOOLS / "run_state.sh"), str(tarball)], check=True, env={"PATH": "/usr/bin:/bin",
                   "KVPOP_HOME": str(home)})
    with tarfile.open(tarball) as tar:
        files = sorted(m.name for m in tar.getmembers() if m.isfile())
    assert files == ["mlflow.db", "runs/a/checkpoint_000001/state.pt", "runs/a/checkpoint_manager_snapshot.json",
                     "runs/a/final_model/model.safetensors", "runs/b/checkpoint_000002/state.pt",
                     "runs/b/checkpoint_manager_snapshot.json"]


def test_run_state_fails_where_there_is_no_checkpoint(tmp_path):
    home = _home(tmp_path / "home", checkpoint=False)
    result = subprocess.run(["bash", str(TOOLS / "run_state.sh"), str(tmp_path / "state.tgz")], capture_output=True,
                            env={"PATH": "/usr/bin:/bin", "KVPOP_HOME": str(home)})
    assert result.returncode != 0
