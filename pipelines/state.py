"""A home's resumable state as one tarball (``python -m jobs.state export / import``): what the same command needs to
continue a recipe or pipeline on a fresh machine through the product's own resume, and nothing it can remake.

**Packed** (relative to ``$KVPOP_HOME``): the train and evaluate records (``records/train``, ``records/evaluate``);
per training run, the ``final_model`` and, unless a train record names that final model (a finished run: the record
reuses it and nothing resumes it), Ray Train's ``checkpoint_manager_snapshot.json`` with the ``checkpoint_*`` folders
(the DCP checkpoint the snapshot names: Ray refuses a snapshot whose checkpoint is missing); the
evaluations (``eval/``: complete results, the parts of an unfinished one, scorers read at other windows); the
learning curves' reference records (``heldout_references/``, :mod:`pipelines.heldout`); the MLflow store
(``mlflow.db``, ``mlartifacts/``); and ``kvpop-state.json``, the home it came from. **Not packed**: targets,
tokenized data and digest caches (the precompute stage remakes targets, and a phase whose train record is finished
needs none), the base model (``model.path`` names it on the new machine, checked by its tensors' digest).

**Import** unpacks into a home that holds none of those paths yet (else one :class:`StateError` line, nothing
written), then, if the home's path differs from the exported one, rewrites that path to the new one in the unpacked
JSON files (records, Ray's snapshot) and in every text column of the MLflow store (artifact locations, tags):
records name absolute folders. Members are extracted with tarfile's ``data`` filter (no absolute paths, no links
out of the home).
"""
from __future__ import annotations

import json
import os
import sqlite3
import tarfile
import tempfile
import time
from pathlib import Path

from pipelines.config import ConfigError

MANIFEST = "kvpop-state.json"
FORMAT = 1
RUN_FILES = ("checkpoint_manager_snapshot.json",)
RUN_FOLDERS = ("checkpoint_", "final_model")
TOP = ("mlflow.db", "mlartifacts", "eval", "records/train", "records/evaluate", "heldout_references")


class StateError(ConfigError):
    """A tarball or home that cannot be exported or imported (one line, exit code 2 through the CLI)."""


def members(home: Path) -> list[Path]:
    """The paths (relative to ``home``) an export packs: files and whole folders (module docstring)."""
    found = [Path(name) for name in TOP if (home / name).exists()]
    finished = _recorded_models(home)
    runs = home / "runs"
    for run in sorted(p for p in runs.iterdir() if p.is_dir()) if runs.is_dir() else []:
        done = (run / "final_model").resolve() in finished
        for item in sorted(run.iterdir()):
            if item.name == "final_model" and item.is_dir():
                found.append(item.relative_to(home))
            elif not done and ((item.is_file() and item.name in RUN_FILES) or (
                    item.is_dir() and item.name.startswith(RUN_FOLDERS) and not item.name.startswith("."))):
                found.append(item.relative_to(home))
    return found


def _recorded_models(home: Path) -> set[Path]:
    """The final models that ``home``'s train records name (their runs are finished)."""
    named = set()
    for record in sorted((home / "records" / "train").glob("*.json")):
        try:
            model_dir = json.loads(record.read_text())["payload"]["model_dir"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(model_dir, str):
            named.add(Path(model_dir).resolve())
    return named


def export(home: str | os.PathLike, out: str | os.PathLike) -> dict:
    """Pack ``home``'s resumable state into ``out`` (a ``.tgz``, written aside and renamed); the manifest."""
    home, out = Path(home).resolve(), Path(out).resolve()
    if not out.name.endswith((".tgz", ".tar.gz")):
        raise StateError(f"--out {out}: give a .tgz path")
    found = members(home)
    if not any(p.parts[0] in ("records", "runs") for p in found):
        raise StateError(f"{home} holds no train records and no training runs: nothing to resume")
    manifest = {"format": FORMAT, "home": str(home), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "members": [str(p) for p in found]}
    out.parent.mkdir(parents=True, exist_ok=True)
    aside = out.with_name(f".{out.name}.tmp")
    with tarfile.open(aside, "w:gz") as tar:
        data = json.dumps(manifest, indent=1).encode()
        info = tarfile.TarInfo(MANIFEST)
        info.size, info.mtime = len(data), int(time.time())
        with tempfile.TemporaryFile() as handle:
            handle.write(data)
            handle.seek(0)
            tar.addfile(info, handle)
        for path in found:
            tar.add(home / path, arcname=str(path))
    aside.rename(out)
    return manifest


def _read_manifest(tar: tarfile.TarFile, source: Path) -> dict:
    try:
        manifest = json.loads(tar.extractfile(MANIFEST).read())
        assert manifest["format"] == FORMAT and isinstance(manifest["members"], list)
        return manifest
    except (KeyError, AttributeError, ValueError, AssertionError, TypeError):
        raise StateError(f"{source}: not a state tarball of this version (no {MANIFEST} of format {FORMAT}): make it "
                         f"with python -m jobs.state export") from None


def import_(source: str | os.PathLike, home: str | os.PathLike) -> dict:
    """Unpack the state tarball ``source`` into ``home`` (module docstring); the manifest."""
    source, home = Path(source).resolve(), Path(home).resolve()
    if not source.is_file():
        raise StateError(f"{source}: no such file")
    try:
        tar = tarfile.open(source, "r:gz")
    except (tarfile.TarError, OSError) as err:
        raise StateError(f"{source}: not a gzipped tarball ({err})") from None
    with tar:
        manifest = _read_manifest(tar, source)
        clash = [m for m in manifest["members"] if (home / m).exists()]
        if clash:
            raise StateError(f"{home} already holds {clash[0]} (and {len(clash) - 1} more of the tarball's paths): "
                             f"import into an empty home (KVPOP_HOME) or remove them first")
        names = [m for m in tar.getnames() if m != MANIFEST]
        outside = [m for m in names if not any(m == top or m.startswith(top.rstrip("/") + "/")
                                               for top in manifest["members"])]
        if outside:
            raise StateError(f"{source}: holds {outside[0]}, outside its manifest's members")
        home.mkdir(parents=True, exist_ok=True)
        for member in tar.getmembers():
            if member.name != MANIFEST:
                tar.extract(member, home, filter="data")
    old = manifest["home"]
    if old != str(home):
        _relocate(home, manifest["members"], old, str(home))
    return manifest


def _relocate(home: Path, tops: list[str], old: str, new: str) -> None:
    """``old`` → ``new`` in the unpacked JSON files and the MLflow store's text columns."""
    for top in tops:
        path = home / top
        files = [path] if path.is_file() else sorted(path.rglob("*.json")) if path.is_dir() else []
        for file in files:
            if file.suffix != ".json":
                continue
            try:
                text = file.read_text()
            except (OSError, UnicodeDecodeError):
                continue
            if old in text:
                file.write_text(text.replace(old, new))
    db = home / "mlflow.db"
    if db.is_file():
        with sqlite3.connect(db) as conn:
            tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")]
            for table in tables:
                columns = [r[1] for r in conn.execute(f'PRAGMA table_info("{table}")')
                           if (r[2] or "").upper() in ("TEXT", "VARCHAR") or (r[2] or "").upper().startswith("VARCHAR")]
                for column in columns:
                    conn.execute(f'UPDATE "{table}" SET "{column}" = REPLACE("{column}", ?, ?) '
                                 f'WHERE "{column}" LIKE ?', (old, new, f"%{old}%"))
