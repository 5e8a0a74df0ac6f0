"""README.md is a manual whose commands work as written.

* **Runnable blocks.** A fenced ``bash`` or ``python`` block whose preceding non-blank line is the marker
  ``<!-- runnable: cpu -->`` runs on CPU, in README order, in one temporary copy of the repository's files (tracked
  and untracked-not-ignored: what a fresh clone has, plus work not yet committed), with the venv's ``bin`` first on
  ``PATH`` (and ``.venv`` linked there) and a fresh ``KVPOP_HOME`` that holds only the prepared SmolLM2 folder; the
  jobs find or start their Ray cluster as they would on a fresh clone. Blocks share that copy and home, so a later block may use what an earlier
  one trained. ``bash`` blocks run under ``set -euo pipefail``, ``python`` blocks through ``python -``. A command
  whose shown sizes are too big for CI carries its small settings in the marker, ``<!-- runnable: cpu; tiny: --set
  k=v … -->``: they are appended to each ``python -m jobs.…`` line of the block (after its continuation lines).
* **Every other block** is checked for what it names: each repository path (``configs/…``, ``benchmarks/…``,
  ``tools/…``, ``infra/…``, ``docs/…``, ``research/…``) exists, each ``python -m X`` is a module of the repository.
* **Links** to repository files resolve; the README stays at most 15 KB.

"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
MARKER = re.compile(r"^<!-- runnable: cpu(?:; tiny: (?P<tiny>.+?))? -->$")
FENCE = re.compile(r"^```(?P<lang>[\w-]*)\s*$")
REPO_PATH = re.compile(r"(?<![\w./-])((?:configs|benchmarks|tools|infra|docs|research)/[\w./-]*[\w/])")
MODULE = re.compile(r"python -m ([\w.]+)")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
BLOCK_TIMEOUT_S = 600


@dataclass(frozen=True)
class Block:
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    runnable: bool
    tiny: str


def readme_blocks(text: str) -> list[Block]:
    """The fenced blocks of ``text`` with their markers (a marker counts only right above a fence)."""
    blocks, lines, i, marker = [], text.splitlines(), 0, None
    while i < len(lines):
        line = lines[i]
        opening = FENCE.match(line)
        if opening:
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
            if end is None:
                raise ValueError(f"README.md:{i + 1}: a code block that is never closed")
            blocks.append(Block(i + 1, opening["lang"], "\n".join(lines[i + 1:end]) + "\n", marker is not None,
                                (marker["tiny"] or "") if marker else ""))
            marker, i = None, end + 1
            continue
        if line.strip():
            marker = MARKER.match(line.strip())
        i += 1
    return blocks


def with_tiny(code: str, tiny: str) -> str:
    """``code`` with ``tiny`` appended to each ``python -m jobs.…`` command (a command ends at its last ``\\``
    continuation line)."""
    if not tiny:
        return code
    lines, out, in_jobs = code.splitlines(), [], False
    for line in lines:
        in_jobs = in_jobs or bool(re.match(r"\s*python -m jobs\.", line))
        if in_jobs and not line.rstrip().endswith("\\"):
            line, in_jobs = f"{line.rstrip()} {tiny}", False
        out.append(line)
    return "\n".join(out) + "\n"


def _repo_files() -> list[str]:
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode()
    return [name for name in listed.split("\0") if name and (REPO / name).is_file()]


# ------------------------------------------------------------------------------------------------------- the parser
SAMPLE = """intro
<!-- runnable: cpu -->

```bash
echo one
```
<!-- runnable: cpu; tiny: --set train.steps=2 -->
```python
print(2)
```
<!-- runnable: cpu -->
text between: the marker no longer applies
```bash
echo three
```
```
plain
```
"""


def test_the_parser_reads_markers_only_right_above_a_fence():
    blocks = readme_blocks(SAMPLE)
    assert [(b.lang, b.code, b.runnable, b.tiny) for b in blocks] == [
        ("bash", "echo one\n", True, ""), ("python", "print(2)\n", True, "--set train.steps=2"),
        ("bash", "echo three\n", False, ""), ("", "plain\n", False, "")]
    assert [b.line for b in blocks] == [4, 8, 13, 16]
    with pytest.raises(ValueError, match="never closed"):
        readme_blocks("```bash\necho\n")


def test_tiny_settings_go_at_the_end_of_each_jobs_command():
    code = "python -m jobs.pipeline --set a=1 \\\n    --set b=2\necho done\npython -m jobs.evaluate\n"
    assert with_tiny(code, "--set t=0") == ("python -m jobs.pipeline --set a=1 \\\n    --set b=2 --set t=0\n"
                                            "echo done\npython -m jobs.evaluate --set t=0\n")
    assert with_tiny(code, "") == code


# ------------------------------------------------------------------------------------------------ the README itself
def test_the_readme_is_a_short_manual_with_runnable_blocks():
    text = README.read_text()
    assert len(text.encode()) <= 15 * 1024
    blocks = readme_blocks(text)
    assert sum(b.runnable for b in blocks) >= 3
    assert all(b.lang in ("bash", "python") for b in blocks if b.runnable)
    install = next(b for b in blocks if "make run" in b.code)
    assert [line.split("#")[0].strip() for line in install.code.splitlines()] == ["make run", "make test"]
    assert "<!-- BEGIN results:headline -->" in text and "<!-- END results:headline -->" in text


def test_every_path_module_and_link_the_readme_names_exists():
    text = README.read_text()
    missing = []
    for path in set(REPO_PATH.findall(text)) | {m for m in LINK.findall(text) if "://" not in m}:
        if not (REPO / path).exists():
            missing.append(path)
    for module in set(MODULE.findall(text)):
        parts = module.split(".")
        if not ((REPO.joinpath(*parts).with_suffix(".py")).is_file() or (REPO.joinpath(*parts) / "__init__.py").is_file()
                or module in ("pytest",)):
            missing.append(f"python -m {module}")
    assert not missing, f"README.md names what the repository does not have: {sorted(missing)}"


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.pretrained
def test_every_runnable_block_runs_on_cpu(tmp_path, smollm2_dir):
    runnable = [b for b in readme_blocks(README.read_text()) if b.runnable]
    copy, home = tmp_path / "repo", tmp_path / "home"
    for name in _repo_files():
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, copy / name)
    (copy / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
    (home / "models").mkdir(parents=True)
    (home / "models" / smollm2_dir.name).symlink_to(smollm2_dir, target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=f"{Path(sys.prefix) / 'bin'}{os.pathsep}{env.get('PATH', '')}", KVPOP_HOME=str(home))
    for block in runnable:
        code = with_tiny(block.code, block.tiny)
        command = ["bash", "-euo", "pipefail", "-c", code] if block.lang == "bash" else [sys.executable, "-"]
        started = time.monotonic()
        result = subprocess.run(command, input=None if block.lang == "bash" else code, cwd=copy, env=env,
                                capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
        print(f"README.md:{block.line} ({block.lang}): {time.monotonic() - started:.1f} s")  # shown with -s / on failure
        assert result.returncode == 0, (f"README.md:{block.line} ({block.lang}) exited {result.returncode}:\n{code}\n"
                                        f"--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}")
