"""File mechanics shared by the package and the pipelines: a file's sha256, atomic writes, an exclusive lock.

* :func:`sha256_file`: the hex sha256 of a file's bytes, read in blocks (constant memory for multi-GB weights).
* :func:`weights_digest`: a model folder's ``*.safetensors`` + ``config.json`` *file bytes* (the teacher identity of
  stored targets). :func:`tensors_digest`: its tensors' *values* (name, dtype, shape, bytes), whatever the files'
  headers, metadata, order or sharding: the same weights converted by another transformers version digest the same.
* :func:`atomic_write_bytes` / :func:`atomic_write_text`: write to a temporary file in the same directory, fsync it,
  rename it over the target and fsync the directory: a reader (or a crash) sees the old content or the new, never a
  torn file.
* :func:`exclusive_lock`: an ``flock`` on a lock file for the life of a ``with`` block. With ``wait=False`` a second
  holder gets :class:`LockedError` at once instead of waiting; the kernel drops the lock when its process dies, so a
  killed run never leaves a stale lock behind.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import struct
import tempfile
from pathlib import Path
from typing import Iterator

BLOCK = 1 << 22


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(BLOCK):
            h.update(block)
    return h.hexdigest()


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode())


class LockedError(RuntimeError):
    """Another process holds the lock."""


@contextlib.contextmanager
def exclusive_lock(path: str | os.PathLike, *, wait: bool = False) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing) for the block; if another process holds it, wait
    for it (``wait=True``) or raise :class:`LockedError`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            raise LockedError(f"{path} is locked by another process") from None
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def weights_digest(model_dir: str | os.PathLike, file_digest=sha256_file) -> str:
    """sha256 over a model folder's ``*.safetensors`` files and its ``config.json`` (the architecture).

    ``file_digest(path) -> hex`` digests one file (a caller with a digest cache passes its own).
    """
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no *.safetensors weights: point at a saved Hugging Face folder")
    h = hashlib.sha256()
    for name in ["config.json", *[f.name for f in files]]:
        if (model_dir / name).is_file():
            h.update(name.encode())
            h.update(file_digest(model_dir / name).encode())
    return h.hexdigest()


def tensors_digest(model_dir: str | os.PathLike) -> str:
    """sha256 over the tensors of a model folder's ``*.safetensors`` files, sorted by name: each name, dtype, shape
    and raw (little-endian) bytes — the weights' values, not the files: another header layout, metadata, tensor order
    or sharding of the same tensors gives the same digest. Read from the safetensors format itself (an 8-byte header
    length, a JSON header of ``{name: {dtype, shape, data_offsets}}``, the data), a tensor at a time."""
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no *.safetensors weights: point at a saved Hugging Face folder")
    where = {}
    for file in files:
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, entry in header.items():
            if name != "__metadata__":
                where[name] = (file, 8 + length, entry)
    h = hashlib.sha256()
    for name in sorted(where):
        file, data_start, entry = where[name]
        start, end = entry["data_offsets"]
        h.update(json.dumps([name, entry["dtype"], list(entry["shape"]), end - start]).encode())
        with open(file, "rb") as f:
            f.seek(data_start + start)
            left = end - start
            while left > 0:
                block = f.read(min(BLOCK, left))
                if not block:
                    raise ValueError(f"{file}: truncated safetensors file (tensor {name})")
                h.update(block)
                left -= len(block)
    return h.hexdigest()


def model_identity(model_dir: str | os.PathLike, tensors_sha256: str | None = None) -> dict:
    """What names a base model wherever it lies: its tensors' digest (:func:`tensors_digest`, or the one given),
    its ``model_type`` and ``architectures`` from ``config.json``, and the folder's name (for messages only)."""
    model_dir = Path(model_dir)
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    return {"name": model_dir.name, "model_type": config.get("model_type"),
            "architectures": config.get("architectures"),
            "tensors_sha256": tensors_sha256 or tensors_digest(model_dir)}
