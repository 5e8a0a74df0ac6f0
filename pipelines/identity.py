"""Content identities for cache keys: file digests (cached), teacher weights, tokenizers, a run's starting scorers.

Expensive outputs live under paths derived from a hash of what they depend on. A digest of a large file (model
weights, a corpus) is computed once and cached in ``$KVPOP_HOME/cache/sha256.json``, keyed by the file's absolute
path, size and modification time, so asking again costs a ``stat``; a model folder's tensors digest
(:func:`tensors_digest`, a trained model's portable base identity) likewise, keyed by its weight files' stamps.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

from kvpop.files import atomic_write_text, exclusive_lock, sha256_file
from kvpop.files import tensors_digest as _tensors_digest
from kvpop.files import weights_digest as _weights_digest
from kvpop.retrofit import SCORERS_FILE, saved_base_folder
from pipelines.config import ConfigError, PipelineConfig, config_path

DIGEST_CACHE = "sha256.json"


def _read_cache(cache: Path) -> dict:
    try:
        entries = json.loads(cache.read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def file_digest(path: str | os.PathLike, home: str | os.PathLike) -> str:
    """sha256 of a file's bytes, cached by (absolute path, size, mtime) under ``home``."""
    path = Path(path).resolve()
    stat = path.stat()
    return _cached(str(path), [stat.st_size, stat.st_mtime_ns], lambda: sha256_file(path), home)


def tensors_digest(model_dir: str | os.PathLike, home: str | os.PathLike) -> str:
    """:func:`kvpop.files.tensors_digest`, cached by the folder and its ``*.safetensors`` files' sizes and mtimes."""
    model_dir = Path(model_dir).resolve()
    stamp = [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in sorted(model_dir.glob("*.safetensors"))]
    if not stamp:
        return _tensors_digest(model_dir)  # its one-line error
    return _cached(f"tensors:{model_dir}", stamp, lambda: _tensors_digest(model_dir), home)


def _cached(key: str, stamp: list, compute, home: str | os.PathLike) -> str:
    cache = Path(home) / "cache" / DIGEST_CACHE
    entry = _read_cache(cache).get(key)
    if isinstance(entry, dict) and entry.get("stamp") == stamp:
        return entry["sha256"]
    digest = compute()
    with exclusive_lock(cache.with_suffix(".lock"), wait=True):  # concurrent writers merge instead of clobbering
        entries = _read_cache(cache)
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
    """:func:`kvpop.files.weights_digest` with the file digests cached under ``home``."""
    return _weights_digest(model_dir, functools.partial(file_digest, home=home))


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


def init_identity(cfg: PipelineConfig) -> list:
    """What ``train.init_from`` adds to a run's keys: ``[]`` without it (the keys made before it existed), else
    ``[("init_scorers_sha256", <digest of its kvpop_scorers.safetensors>)]`` — the weights, not the folder's path, so
    a moved folder names the same run and other weights another. One :class:`ConfigError` line if the file is not
    there (:func:`pipelines.train.check_init_from` checks the rest before training)."""
    if cfg.train.init_from is None:
        return []
    weights = config_path(cfg.train.init_from) / SCORERS_FILE
    if not weights.is_file():
        raise ConfigError(f"train.init_from {cfg.train.init_from}: no {SCORERS_FILE} there: give a saved scorer "
                          f"folder (a train stage's final_model)")
    return [("init_scorers_sha256", file_digest(weights, cfg.home_dir()))]


def base_folder(cfg: PipelineConfig, saved: str | os.PathLike) -> Path:
    """The base weights of the saved model folder ``saved`` for this config: ``model.path``'s folder when ``saved``
    holds scorers only, refused in one :class:`ConfigError` line if that folder is missing or its tensors are not the
    ones the scorers were trained on (the digest expected and found; cached digests), else ``saved`` itself."""
    home = cfg.home_dir()
    try:
        return saved_base_folder(saved, cfg.model.resolved_path(),
                                 tensors=functools.partial(tensors_digest, home=home),
                                 weights=functools.partial(weights_digest, home=home))
    except (OSError, ValueError) as err:
        raise ConfigError(str(err)) from None
