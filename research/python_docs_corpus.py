"""A Sphinx documentation's reST sources as a local corpus: one ``{"id", "text"}`` line per document in a
``.jsonl`` file that ``data.source`` (and ``learning_curves.py --mix-source``) reads like any local file.

Made for the Python documentation — prose of another kind than champ's math transcripts, English documentation with
code examples — and used as well for the Linux kernel's (Debian's ``linux-doc-6.1``: ``--exclude translations``
keeps it English), a prose corpus of a third source for a training mix whose held-out corpora (the standard
library's code, the Python docs) both stay unseen. Read from Debian's ``python3.11-doc`` where it is installed
(``/usr/share/doc/python3.11/html/_sources``), from a folder of ``*.rst.txt`` files, or straight from a package file
(``--deb``: unpacked with ``dpkg-deb`` into a temporary folder; its one ``html/_sources`` folder is read). Documents
are sorted by path, so the same sources give the same file byte for byte.

    python research/python_docs_corpus.py --out .kvpop/data/python_docs.jsonl
    python research/python_docs_corpus.py --deb /var/cache/apt/archives/python3.11-doc_*_all.deb --out ...
    python research/python_docs_corpus.py --deb linux-doc-6.1_6.1.176-1_all.deb --exclude translations --out ...

Bad input (no sources, an empty folder, a package without them) is one line and exit code 2.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

INSTALLED = Path("/usr/share/doc/python3.11/html/_sources")
SUFFIX = ".rst.txt"


def documents(folder: Path, exclude: tuple[str, ...] = ()) -> list[dict]:
    """``[{"id": path relative to folder, "text"}]`` of every non-empty ``*.rst.txt`` under ``folder``, by path,
    except those under a subfolder named in ``exclude`` (relative to ``folder``)."""
    from pipelines.config import ConfigError

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
    from pipelines.config import ConfigError

    if not deb.is_file():
        raise ConfigError(f"--deb {deb}: no such file")
    if shutil.which("dpkg-deb") is None:
        raise ConfigError("--deb needs dpkg-deb (Debian's dpkg); give --sources with the unpacked _sources folder")
    done = subprocess.run(["dpkg-deb", "-x", str(deb), str(into)], capture_output=True, text=True)
    if done.returncode != 0:
        raise ConfigError(f"--deb {deb}: dpkg-deb could not unpack it: {done.stderr.strip().splitlines()[-1:]}")
    found = sorted(into.rglob("_sources"))
    if not found:
        raise ConfigError(f"--deb {deb}: holds no html/_sources folder (is it python3.X-doc or linux-doc-X?)")
    if len(found) > 1:
        raise ConfigError(f"--deb {deb}: holds {len(found)} _sources folders; unpack it (dpkg-deb -x) and give "
                          f"--sources with the one to read")
    return found[0]


def write_corpus(docs: list[dict], out: Path) -> None:
    from kvpop.files import atomic_write_text

    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, "".join(json.dumps(doc, ensure_ascii=False) + "\n" for doc in docs))


def main(argv=None) -> int:
    from jobs._cli import bare_parser
    from pipelines.config import ConfigError

    p = bare_parser("python_docs_corpus", __doc__)
    p.prog = "research/python_docs_corpus.py"
    source = p.add_mutually_exclusive_group()
    source.add_argument("--sources", type=Path, default=None, help=f"a folder of *{SUFFIX} files (default: "
                        f"{INSTALLED}, where python3.11-doc is installed)")
    source.add_argument("--deb", type=Path, default=None, help="a documentation package file instead "
                        "(python3.X-doc, linux-doc-X)")
    p.add_argument("--exclude", nargs="+", default=[], metavar="SUBFOLDER",
                   help="leave out the documents under these subfolders of the sources (e.g. translations)")
    p.add_argument("--out", type=Path, required=True, help="the .jsonl to write")
    args = p.parse_args(argv)
    try:
        if args.out.suffix != ".jsonl":
            raise ConfigError(f"--out {args.out}: give a .jsonl path (data.source reads it by its suffix)")
        with tempfile.TemporaryDirectory() as tmp:
            folder = unpacked_sources(args.deb, Path(tmp)) if args.deb else (args.sources or INSTALLED)
            if not folder.is_dir():
                raise ConfigError(f"{folder}: no such folder; install python3.11-doc, or give --sources or --deb")
            docs = documents(folder, tuple(args.exclude))
        write_corpus(docs, args.out)
    except ConfigError as err:
        print(f"python_docs_corpus: {err}", file=sys.stderr)
        return 2
    chars = sum(len(d["text"]) for d in docs)
    print(f"{len(docs)} documents, {chars / 1e6:.1f}M characters -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
