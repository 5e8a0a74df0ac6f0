"""``python -m jobs.corpus (--deb PACKAGE.deb | --sources DIR) [--exclude SUBFOLDER …] --out FILE.jsonl``: a Sphinx
documentation's reST sources as a local corpus for ``data.source`` / ``data.mix_source`` (pipelines/corpus.py).

The recipe's kernel corpus (configs/recipes/smollm2_kvpop.yaml, ``inputs``), from Debian bookworm's linux-doc-6.1
(``apt-get download linux-doc-6.1``):

    python -m jobs.corpus --deb linux-doc-6.1_*.deb --exclude translations --out .kvpop/data/linux_docs.jsonl

Bad input is one line on stderr and exit code 2, nothing written.
"""
import sys
from pathlib import Path

from jobs._cli import bare_parser, fail, interrupted


def cli(argv=None) -> int:
    p = bare_parser("corpus", __doc__)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--deb", type=Path, help="a documentation package file (linux-doc-X, python3.X-doc)")
    source.add_argument("--sources", type=Path, help="a folder of *.rst.txt files (an unpacked html/_sources)")
    p.add_argument("--exclude", nargs="+", default=[], metavar="SUBFOLDER",
                   help="leave out the documents under these subfolders of the sources (e.g. translations)")
    p.add_argument("--out", type=Path, required=True, help="the .jsonl to write")
    args = p.parse_args(argv)
    from pipelines.config import ConfigError
    from pipelines.corpus import build

    try:
        docs = build(args.out, deb=args.deb, sources=args.sources, exclude=tuple(args.exclude))
    except ConfigError as err:
        return fail("corpus", err)
    except KeyboardInterrupt:
        return interrupted("corpus")
    print(f"{len(docs)} documents, {sum(len(d['text']) for d in docs) / 1e6:.1f}M characters -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(cli())
