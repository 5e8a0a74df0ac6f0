"""A Sphinx documentation's reST sources as a local corpus (``python -m jobs.corpus``): one ``{"id", "text"}`` line
per document in a ``.jsonl`` that ``data.source`` / ``data.mix_source`` read like any local file.

The sources are a folder of ``*.rst.txt`` files (``--sources``) or a Debian documentation package (``--deb``:
unpacked with ``dpkg-deb`` into a temporary folder, its one ``html/_sources`` folder read) — e.g. ``linux-doc-6.1``
(the recipe's kernel corpus, ``--exclude translations`` keeps it English) or ``python3.11-doc``. Documents are sorted
by path and empty ones dropped, so the same sources give the same file byte for byte; the file is written
atomically. Bad input (no such file or folder, no ``dpkg-deb``, a package without sources, no document) is one
:class:`ConfigError` line, raised before anything is written.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

from kvpop.files import atomic_write_text
from pipelines.config import ConfigError

SUFFIX = ".rst.txt"


def documents(folder: Path, exclude: tuple[str, ...] = ()) -> list[dict]:
    """``[{"id": path relative to folder, "text"}]`` of every non-empty ``*.rst.txt`` under ``folder``, by path,
    except those under a subfolder named in ``exclude`` (relative to ``folder``)."""
    skipped = [Path(name).parts for name in exclude]
    paths = [path for path in sorted(folder.rglob("*" + SUFFIX))
             if not any(path.relative_to(folder).parts[:len(parts)] == parts for parts in skipped)]
    docs = [{"id": str(path.relative_to(folder)), "text": text} for path in paths
            if (text := path.read_text(encoding="utf-8", errors="replace")).strip()]
    if not docs:
        raise ConfigError(f"{folder}: no non-empty *{SUFFIX} files (the reST sources of a Sphinx documentation)"
                          + (f" outside {', '.join(exclude)}" if exclude else ""))
    return docs


def unpacked_sources(deb: Path, into: Path) -> Path:
    """``deb``'s ``_sources`` folder, unpacked under ``into``."""
    if not deb.is_file():
        raise ConfigError(f"--deb {deb}: no such file (e.g. `apt-get download linux-doc-6.1`)")
    if shutil.which("dpkg-deb") is None:
        raise ConfigError("--deb needs dpkg-deb (Debian's dpkg); give --sources with the unpacked _sources folder")
    done = subprocess.run(["dpkg-deb", "-x", str(deb), str(into)], capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        raise ConfigError(f"--deb {deb}: dpkg-deb could not unpack it: {last}")
    found = sorted(into.rglob("_sources"))
    if not found:
        raise ConfigError(f"--deb {deb}: holds no html/_sources folder (is it a python3.X-doc or linux-doc-X?)")
    if len(found) > 1:
        raise ConfigError(f"--deb {deb}: holds {len(found)} _sources folders; unpack it (dpkg-deb -x) and give "
                          f"--sources with the one to read")
    return found[0]


def build(out: Path, *, deb: Path | None = None, sources: Path | None = None,
          exclude: tuple[str, ...] = ()) -> list[dict]:
    """Write the corpus of ``deb`` (or the folder ``sources``) to ``out`` (a ``.jsonl``); its documents."""
    if out.suffix != ".jsonl":
        raise ConfigError(f"--out {out}: give a .jsonl path (data.source reads it by its suffix)")
    if (deb is None) == (sources is None):
        raise ConfigError("give one of --deb (a documentation package) or --sources (a folder of *.rst.txt)")
    with tempfile.TemporaryDirectory() as tmp:
        folder = unpacked_sources(deb, Path(tmp)) if deb is not None else sources
        if not folder.is_dir():
            raise ConfigError(f"--sources {folder}: no such folder")
        docs = documents(folder, tuple(exclude))
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, "".join(json.dumps(doc, ensure_ascii=False) + "\n" for doc in docs))
    return docs
