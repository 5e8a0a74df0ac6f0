"""What every job CLI shares: ``--config``/``--set`` parsing, checks before any work, and exit codes.

Bad input — an unknown key, a wrong type, a missing file, a model folder transformers cannot load, an impossible
budget, a Ray address where no cluster answers, a bad command line — is **one line on stderr and exit code 2, before
anything is written**: the config loader and :func:`preflight` check what needs no Ray, and the stages raise
:class:`pipelines.config.ConfigError` (e.g. ``TargetsError``) for what they can only see once they look at their
inputs, also before writing. Ctrl-C is one line and exit code 130. Anything else is a failure of the run, not of the
input: its traceback and exit code 1.

Ctrl-C while a stage runs ends the process at once (:func:`_leave_on_interrupt`) instead of unwinding: a
KeyboardInterrupt can land anywhere — inside ``logging``'s lock release, where it is ignored and leaves the lock held
(the run then hangs), or inside ``ray.init``, whose clean-up then crashes — and nothing needs it, since every stage
commits its work atomically and resumes after a kill (the processes ``ray.init`` starts share the driver's fate).

The command line is parsed before anything heavy is imported (torch, Ray, transformers take seconds): a bad flag or
``--help`` answers at once; the stage CLIs import their stage inside ``body``.

The process environment (offline Hugging Face libraries) is set by ``jobs/__init__.py`` (through ``pipelines/__init__.py``),
before anything imports them.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from pipelines.config import PipelineConfig


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line (argparse prints the usage block too), exit code 2
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def name_pairs(values: list[str], known=None) -> tuple[dict[str, str], list[str]]:
    """Repeated ``NAME=VALUE`` options as ``{NAME: VALUE}``, and those that are not one (or whose NAME is not in
    ``known``), for the caller's one-line error."""
    bad = [v for v in values if v.count("=") != 1 or (known is not None and v.split("=")[0] not in known)]
    return dict(v.split("=") for v in values if v not in bad), bad


def bare_parser(name: str, description: str) -> argparse.ArgumentParser:
    """``python -m jobs.<name>``'s parser: a bad command line is one line and exit code 2 (also in subcommands made
    with ``add_subparsers(parser_class=type(p))``)."""
    return _Parser(prog=f"python -m jobs.{name}", description=description,
                   formatter_class=argparse.RawDescriptionHelpFormatter)


def parser(stage: str, description: str) -> argparse.ArgumentParser:
    """A stage CLI's parser: ``--config``, ``--set``, ``--print-config``."""
    p = bare_parser(stage, description)
    p.add_argument("--config", metavar="YAML", help="a preset from configs/ (default: the embedded default)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config key, dotted (e.g. --set train.steps=100 --set budget.topk=192)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    return p


def preflight(cfg: PipelineConfig) -> None:
    """Checks that need no Ray and write nothing (:func:`pipelines.data.check_inputs`, which the first stage repeats
    for callers of the Python API)."""
    from pipelines.data import check_inputs  # datasets and the corpus readers: only once the config is good

    check_inputs(cfg)


def load(args) -> PipelineConfig:
    from pipelines.config import load_config

    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        import yaml

        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        sys.exit(0)
    preflight(cfg)
    return cfg


def fail(stage: str, err: BaseException) -> int:
    text = str(err).strip()
    message = text.splitlines()[0] if text else type(err).__name__
    print(f"kvpop {stage}: error: {message}", file=sys.stderr)
    return 2


def _interrupt_line(stage: str) -> str:
    return f"kvpop {stage}: interrupted"


def interrupted(stage: str) -> int:
    print(_interrupt_line(stage), file=sys.stderr)
    return 130


def _leave_on_interrupt(stage: str):
    def handler(signum, frame):
        os.write(2, f"{_interrupt_line(stage)}\n".encode())
        os._exit(130)
    return handler


def main(stage: str, description: str, body: Callable[[PipelineConfig], object], argv=None, *,
         needs_ray: bool = True, loader: Callable | None = None) -> int:
    """Parse ``argv``, load and check the config, run ``body(cfg)``; the exit code. ``needs_ray=False``: a stage that
    runs without Ray (evaluate) does not probe ``ray.address``. ``loader(args)``: what ``body`` gets instead of the
    config (a recipe), loaded and checked by it (its errors are the config's: one line, exit code 2)."""
    args = parser(stage, description).parse_args(argv)
    from pipelines.cluster import check_address  # once the command line is good (the config module imports torch)
    from pipelines.config import ConfigError

    try:
        try:
            cfg = loader(args) if loader is not None else load(args)
            if needs_ray and loader is None:
                check_address(cfg)
        except (ConfigError, ValueError, OSError) as err:  # the config as given: nothing has run yet
            return fail(stage, err)
        previous = signal.signal(signal.SIGINT, _leave_on_interrupt(stage))
        try:
            body(cfg)
        except ConfigError as err:  # a stage's input check (raised before it writes)
            return fail(stage, err)
        finally:
            signal.signal(signal.SIGINT, previous)
    except KeyboardInterrupt:
        return interrupted(stage)
    return 0
