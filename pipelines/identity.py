"""Content identities for cache keys: file digests (cached), teacher weights, tokenizers, data sources.

Expensive outputs live under paths derived from a hash of what they depend on (Levanter/Marin style). A digest
of a large file (model weights, a corpus) is computed once and cached in ``$KVPOP_HOME/cache/sha256.json``, keyed by
the file's absolute path, size and modification time, so asking again costs a ``stat``.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import tempfile
from pathlib import Path

from pipelines.config import PipelineConfig

DIGEST_CACHE = "sha256.json"


def _cache_file(home: Path) -> Path:
    return Path(home) / "cache" / DIGEST_CACHE


def _sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a synced temporary file and a rename: readers see all of it or nothing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_digest(path: str | os.PathLike, home: str | os.PathLike) -> str:
    """sha256 of a file's bytes, cached by (absolute path, size, mtime) under ``home``."""
    path = Path(path).resolve()
    stat = path.stat()
    key = str(path)
    stamp = [stat.st_size, stat.st_mtime_ns]
    cache = _cache_file(Path(home))
    try:
        entries = json.loads(cache.read_text())
    except (OSError, ValueError):
        entries = {}
    entry = entries.get(key)
    if isinstance(entry, dict) and entry.get("stamp") == stamp:
        return entry["sha256"]
    digest = _sha256(path)
    cache.parent.mkdir(parents=True, exist_ok=True)
    with open(cache.with_suffix(".lock"), "w") as lock:  # concurrent writers merge instead of clobbering
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            entries = json.loads(cache.read_text())
        except (OSError, ValueError):
            entries = {}
        entries[key] = {"stamp": stamp, "sha256": digest}
        atomic_write_text(cache, json.dumps(entries, indent=1, sort_keys=True))
    return digest


def folder_digest(path: str | os.PathLike, home: str | os.PathLike, *, suffixes: tuple[str, ...] | None = None) -> str:
    """A digest of every file below ``path`` (relative names + file digests), optionally only some suffixes."""
    path = Path(path).resolve()
    h = hashlib.sha256()
    for item in sorted(p for p in path.rglob("*") if p.is_file()):
        if suffixes is not None and not item.name.endswith(suffixes):
            continue
        if any(part.startswith(".") for part in item.relative_to(path).parts):
            continue
        h.update(str(item.relative_to(path)).encode())
        h.update(file_digest(item, home).encode())
    return h.hexdigest()


def weights_digest(model_dir: str | os.PathLike, home: str | os.PathLike) -> str:
    """sha256 over a model folder's ``*.safetensors`` files and its ``config.json`` (the architecture)."""
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no *.safetensors weights: point model.path at a saved HF folder")
    h = hashlib.sha256()
    for name in ["config.json", *[f.name for f in files]]:
        if (model_dir / name).is_file():
            h.update(name.encode())
            h.update(file_digest(model_dir / name, home).encode())
    return h.hexdigest()


def teacher_identity(cfg: PipelineConfig) -> dict:
    """What makes teacher outputs what they are: the weights (and architecture) digest and the compute dtype.

    The folder path is recorded for information but is not part of the identity: the same weights moved to another
    ``KVPOP_HOME`` (e.g. on the GPU machine) keep their targets.
    """
    path = cfg.model.resolved_path()
    return {"name": path.name, "weights_sha256": weights_digest(path, cfg.home_dir()), "dtype": cfg.model.dtype}


def tokenizer_digest(tokenizer) -> str:
    """A digest of a tokenizer's behaviour: its serialised fast tokenizer (or vocab) and special tokens."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:  # slow tokenizer
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps([tokenizer.bos_token_id, tokenizer.eos_token_id]).encode())
    return h.hexdigest()
