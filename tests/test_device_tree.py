"""``benchmarks/device_tree.sh``: set-aside leaves in the index only what is outside benchmarks/results/ plus the kept
files (one in a subfolder too), ``size`` is the sum of the sizes of what a device call would copy, restore gives back
the index equal to HEAD and .git/info/exclude byte for byte (or none where there was none), working-tree files are
never touched, and a refusal is one stderr line starting with "device_tree:" and exit code 2."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "device_tree.sh"
ENV = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1", "GIT_AUTHOR_NAME": "t",
       "GIT_AUTHOR_EMAIL": "t@example.com", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com"}
FILES = {"README.md": b"readme\n", "kvpop/a.py": b"x = 1\n" * 7,
         "benchmarks/results/prose.json": b'{"points": []}\n', "benchmarks/results/other.json": b"{}" * 50,
         "benchmarks/results/plot.png": bytes(range(256)) * 4, "benchmarks/results/checkpoints/w256.tgz": b"\0" * 300,
         "benchmarks/results/checkpoints/w128.tgz": b"\1" * 200, "benchmarks/results/deep/er/x.json": b"[1]\n"}


def _git(repo, *args, check=True):
    return subprocess.run(["git", *args], cwd=repo, env=ENV, capture_output=True, text=True, check=check)


def _run(repo, *args, cwd=None):
    return subprocess.run(["bash", str(repo / "benchmarks" / "device_tree.sh"), *args], cwd=cwd or repo, env=ENV,
                          capture_output=True, text=True)


def _repo(tmp_path, exclude=b"/.gpu/\n# a comment, no newline at the end"):
    repo = tmp_path / "repo"
    for name, data in FILES.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_bytes(data)
    shutil.copy(SCRIPT, repo / "benchmarks" / "device_tree.sh")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "start")
    info = repo / ".git" / "info" / "exclude"
    if exclude is None:
        info.unlink(missing_ok=True)
    else:
        info.write_bytes(exclude)
    (repo / ".gpu").mkdir()
    (repo / ".gpu" / "ignored.bin").write_bytes(b"i" * 1000)  # ignored by the exclude file: never counted
    (repo / "notes.txt").write_bytes(b"untracked\n")  # untracked, not ignored: counted
    (repo / "benchmarks" / "results" / "new.json").write_bytes(b"n" * 77)  # untracked under results
    return repo


def _tree(repo):
    return {str(p.relative_to(repo)): p.read_bytes() for p in repo.rglob("*") if p.is_file() and ".git" not in p.parts}


def _size(out):
    bytes_, room = map(int, re.fullmatch(r"device tree: (\d+) bytes, room left under 64 MiB: (-?\d+) bytes\n",
                                         out).groups())
    assert bytes_ + room == 64 * 1024 * 1024
    return bytes_


def _bytes(repo, names):
    return sum((repo / n).stat().st_size for n in names)


def _refused(result, fragment):
    assert result.returncode == 2 and result.stdout == ""
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith("device_tree: "), result.stderr
    assert fragment in result.stderr


def test_set_aside_keeps_a_file_in_a_subfolder_and_restore_gives_everything_back(tmp_path):
    repo = _repo(tmp_path)
    exclude = (repo / ".git" / "info" / "exclude").read_bytes()
    tree = _tree(repo)
    outside = ["README.md", "benchmarks/device_tree.sh", "kvpop/a.py"]
    before = _size(_run(repo, "size").stdout)
    assert before == _bytes(repo, [*outside, "notes.txt", *[n for n in FILES if n.startswith("benchmarks/results/")],
                                   "benchmarks/results/new.json"])

    keep = ["benchmarks/results/prose.json", "benchmarks/results/checkpoints/w256.tgz"]
    result = _run(repo, "set-aside", *keep, cwd=repo / "kvpop")  # from another folder
    assert result.returncode == 0, result.stderr
    assert sorted(_git(repo, "ls-files").stdout.splitlines()) == sorted(outside + keep)
    assert _git(repo, "ls-files", "--others", "--exclude-standard").stdout.splitlines() == ["notes.txt"]
    assert _size(result.stdout) == _size(_run(repo, "size").stdout) == _bytes(repo, [*outside, *keep, "notes.txt"])
    assert _tree(repo) == tree

    result = _run(repo, "restore", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert _size(result.stdout) == before
    assert _git(repo, "diff", "--cached", "--quiet", check=False).returncode == 0
    assert _git(repo, "status", "--porcelain", "--untracked-files=no").stdout == ""
    assert (repo / ".git" / "info" / "exclude").read_bytes() == exclude
    assert not list((repo / ".git" / "info").glob("exclude.device-tree*"))
    assert _tree(repo) == tree


def test_default_keep_and_a_deeper_subfolder_where_there_was_no_exclude_file(tmp_path):
    repo = _repo(tmp_path, exclude=None)
    (repo / ".gpu" / "ignored.bin").unlink()
    (repo / ".gpu").rmdir()
    (repo / "notes.txt").unlink()
    (repo / "benchmarks" / "results" / "new.json").unlink()
    _git(repo, "mv", "benchmarks/results/prose.json",
         "benchmarks/results/learning_curves_h200_w256_qp16_prose.json")
    _git(repo, "commit", "-q", "-m", "the default name")
    assert _git(repo, "status", "--porcelain").stdout == ""
    result = _run(repo, "set-aside")
    assert result.returncode == 0, result.stderr
    kept = ["README.md", "benchmarks/device_tree.sh", "benchmarks/results/learning_curves_h200_w256_qp16_prose.json",
            "kvpop/a.py"]
    assert _git(repo, "ls-files").stdout.splitlines() == kept
    assert _size(result.stdout) == _bytes(repo, kept)
    _refused(_run(repo, "set-aside"), "already set aside")
    assert _run(repo, "restore").returncode == 0
    assert not (repo / ".git" / "info" / "exclude").exists()
    assert _git(repo, "status", "--porcelain").stdout == ""

    result = _run(repo, "set-aside", "benchmarks/results/deep/er/x.json", "benchmarks/results/checkpoints/w128.tgz")
    assert result.returncode == 0, result.stderr
    assert _git(repo, "ls-files", "benchmarks/results").stdout.splitlines() == [
        "benchmarks/results/checkpoints/w128.tgz", "benchmarks/results/deep/er/x.json"]
    assert _git(repo, "status", "--porcelain", "--ignored", "benchmarks/results").stdout.count("!!") >= 3
    assert _run(repo, "restore").returncode == 0
    assert _git(repo, "status", "--porcelain").stdout == ""
    assert not (repo / ".git" / "info" / "exclude").exists()


def test_refusals_are_one_line_and_exit_code_2_and_change_nothing(tmp_path):
    repo = _repo(tmp_path)
    exclude = (repo / ".git" / "info" / "exclude").read_bytes()
    _refused(_run(repo, "restore"), "not set aside")
    _refused(_run(repo), "usage")
    _refused(_run(repo, "stash"), "usage")
    for keep, fragment in [("benchmarks/results/nowhere.json", "not a tracked file"),
                           ("benchmarks/results/new.json", "not a tracked file"),  # untracked
                           ("benchmarks/results/checkpoints", "not a tracked file"),  # a folder
                           ("benchmarks/results/*.json", "not a tracked file"),  # not a glob
                           ("README.md", "not a path under benchmarks/results/")]:
        _refused(_run(repo, "set-aside", "benchmarks/results/prose.json", keep), fragment)
    (repo / "README.md").write_bytes(b"staged\n")
    _git(repo, "add", "README.md")
    _refused(_run(repo, "set-aside"), "index differs from HEAD")
    assert _git(repo, "diff", "--cached", "--name-only").stdout == "README.md\n"
    assert (repo / ".git" / "info" / "exclude").read_bytes() == exclude
    assert not list((repo / ".git" / "info").glob("exclude.device-tree*"))


def test_restore_touches_only_benchmarks_results_in_the_index(tmp_path):
    repo = _repo(tmp_path)
    assert _run(repo, "set-aside", "benchmarks/results/prose.json").returncode == 0
    (repo / "kvpop" / "a.py").write_bytes(b"y = 2\n")
    _git(repo, "add", "kvpop/a.py")  # staged while set aside: stays staged
    assert _run(repo, "restore").returncode == 0
    assert _git(repo, "diff", "--cached", "--name-only").stdout == "kvpop/a.py\n"
