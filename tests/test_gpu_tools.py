"""``tools/gpu/``: the scripts parse; ``session.sh`` logs every part's start and end (an unknown part fails alone
and the session still ends); part ``recipe`` is the product's own commands: state imported, the recipe's one
command, state exported whatever its outcome."""
from __future__ import annotations

import subprocess
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


def _recipe_part(tmp_path, state: str, pipeline_rc: int) -> tuple[list[str], str]:
    """Part ``recipe`` with a stand-in ``python`` that logs its arguments (and fails ``jobs.pipeline`` with
    ``pipeline_rc``): the commands it ran, in order, and the part's progress line."""
    bin_dir, out = tmp_path / "bin", tmp_path / "r"
    bin_dir.mkdir()
    calls = tmp_path / "calls.log"
    stub = bin_dir / "python"
    stub.write_text(f'#!/bin/bash\necho "$*" >> {calls}\n'
                    f'case "$*" in *jobs.pipeline*) exit {pipeline_rc};; esac\n')
    stub.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "KVPOP_HOME": str(tmp_path / "home")}
    if state:
        env["RECIPE_STATE"] = state
    subprocess.run(["bash", str(TOOLS / "session.sh"), str(out), "recipe"], check=True, cwd=TOOLS.parents[1], env=env)
    end = next(line for line in (out / "progress.log").read_text().splitlines() if line.startswith("end recipe"))
    return calls.read_text().splitlines(), end


def test_the_recipe_part_imports_runs_and_exports_the_state(tmp_path):
    commands, end = _recipe_part(tmp_path, "/tmp/earlier/recipe_run.tgz", pipeline_rc=0)
    assert commands == ["-m jobs.state import /tmp/earlier/recipe_run.tgz",
                        "-m jobs.pipeline --config configs/recipes/smollm2_kvpop.yaml",
                        f"-m jobs.state export --out {tmp_path / 'r' / 'recipe_run.tgz'}"]
    assert end.split()[2] == "rc=0"


def test_a_failed_recipe_still_exports_its_state_and_fails_the_part(tmp_path):
    commands, end = _recipe_part(tmp_path, "", pipeline_rc=3)
    assert [c.split()[1] for c in commands] == ["jobs.pipeline", "jobs.state"]
    assert end.split()[2] == "rc=1"


def test_the_profile_part_runs_the_recipes_first_phase_and_brings_its_step_profile_back(tmp_path):
    """Part ``profile``: a fresh run name each time (``PROFILE_RUN``), the recipe's first phase with
    ``train.profile_steps`` through ``python -`` (a stand-in here that writes the report where the train stage
    would), ``step_profile.md`` copied into the results folder."""
    bin_dir, out, home = tmp_path / "bin", tmp_path / "r", tmp_path / "home"
    bin_dir.mkdir()
    stub = bin_dir / "python"
    stub.write_text('#!/bin/bash\ncat > "$KVPOP_HOME/script.py"\nmkdir -p "$KVPOP_HOME/runs/$PROFILE_RUN"\n'
                    'echo "profile of $PROFILE_RUN" > "$KVPOP_HOME/runs/$PROFILE_RUN/step_profile.md"\n')
    stub.chmod(0o755)
    home.mkdir()
    subprocess.run(["bash", str(TOOLS / "session.sh"), str(out), "profile"], check=True, cwd=TOOLS.parents[1],
                   env={"PATH": f"{bin_dir}:/usr/bin:/bin", "KVPOP_HOME": str(home)})
    end = next(line for line in (out / "progress.log").read_text().splitlines() if line.startswith("end profile"))
    assert end.split()[2] == "rc=0"
    assert (out / "step_profile.md").read_text().startswith("profile of profile-")
    script = (home / "script.py").read_text()
    assert "recipe.load_recipe(config" in script and "train.profile_steps=" in script and "r.phases[0]" in script
