"""``python -m jobs.state export --out STATE.tgz`` / ``python -m jobs.state import STATE.tgz``: a home's resumable
state (records, each run's last DCP checkpoint + Ray Train snapshot, final models, evaluations, the MLflow store) as
one tarball, so that a recipe cut off with its machine continues on a fresh one with the same command
(pipelines/state.py says what is packed and how paths are rewritten). ``--home`` defaults to ``$KVPOP_HOME`` (else
``<repo>/.kvpop``). A bad tarball or a home that already holds its paths is one line and exit code 2.

    python -m jobs.state export --out /tmp/kvpop-state.tgz       # at the end of a GPU session
    python -m jobs.state import /tmp/kvpop-state.tgz             # in the next one, then the same recipe command
"""
import sys
from pathlib import Path

from jobs._cli import bare_parser, fail, interrupted


def cli(argv=None) -> int:
    p = bare_parser("state", __doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True, parser_class=type(p))
    out = sub.add_parser("export", help="pack the home's resumable state into a .tgz")
    out.add_argument("--out", type=Path, required=True, help="the .tgz to write")
    into = sub.add_parser("import", help="unpack a state .tgz into the home")
    into.add_argument("tarball", type=Path)
    for parser in (out, into):
        parser.add_argument("--home", type=Path, help="the KVpop home (default: $KVPOP_HOME, else <repo>/.kvpop)")
    args = p.parse_args(argv)
    from pipelines import state
    from pipelines.config import ConfigError
    from pipelines.models import kvpop_home

    home = args.home or Path(kvpop_home())
    try:
        if args.command == "export":
            manifest = state.export(home, args.out)
            print(f"{len(manifest['members'])} paths of {manifest['home']} -> {args.out}")
        else:
            manifest = state.import_(args.tarball, home)
            print(f"{len(manifest['members'])} paths of {manifest['home']} -> {home.resolve()}")
    except ConfigError as err:
        return fail("state", err)
    except KeyboardInterrupt:
        return interrupted("state")
    return 0


if __name__ == "__main__":
    sys.exit(cli())
