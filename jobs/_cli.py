"""What every job CLI shares: ``--config``/``--set`` parsing, checks before any work, and exit codes.

Bad input — an unknown key, a wrong type, a missing file, an impossible budget, a bad command line — is **one line on
stderr and exit code 2, before anything is written**: the config loader and :func:`preflight` check what needs no
Ray, and the stages raise :class:`pipelines.config.ConfigError` (e.g. ``TargetsError``) for what they can only see
once they look at their inputs, also before writing. Anything else is a failure of the run, not of the input: its
traceback and exit code 1.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Callable

from pipelines.config import ConfigError, PipelineConfig, load_config


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line (argparse prints the usage block too), exit code 2
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parser(stage: str, description: str) -> argparse.ArgumentParser:
    p = _Parser(prog=f"python -m jobs.{stage}", description=description,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", metavar="YAML", help="a preset from configs/ (default: the embedded default)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config key, dotted (e.g. --set train.steps=100 --set budget.topk=192)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    return p


def preflight(cfg: PipelineConfig) -> None:
    """Checks that need no Ray and write nothing: the teacher folder and a local data source exist, and the budget fits
    the model's context."""
    model = cfg.model.resolved_path()
    if not (model / "config.json").is_file():
        hint = "run `make model`" if cfg.model.path == "smollm2" else "point model.path at a local HF model folder"
        raise ConfigError(f"model folder {model} not found (no config.json): {hint}")
    try:
        context = json.loads((model / "config.json").read_text()).get("max_position_embeddings")
    except ValueError:
        raise ConfigError(f"{model / 'config.json'} is not valid JSON") from None
    total = cfg.budget.total
    if isinstance(context, int) and total > context:
        raise ConfigError(f"budget {cfg.budget} keeps {total} tokens, more than the model's context of "
                          f"{context} (max_position_embeddings): impossible budget")
    from pipelines.data import is_local_source

    if cfg.data.source not in ("champ", "stdlib") and is_local_source(cfg.data.source) \
            and not Path(cfg.data.source).expanduser().exists():
        raise ConfigError(f"data.source {cfg.data.source!r} does not exist")


def load(args) -> PipelineConfig:
    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        import yaml

        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        sys.exit(0)
    preflight(cfg)
    return cfg


def _fail(stage: str, err: BaseException) -> int:
    text = str(err).strip()
    message = text.splitlines()[0] if text else type(err).__name__
    print(f"kvpop {stage}: error: {message}", file=sys.stderr)
    return 2


def main(stage: str, description: str, body: Callable[[PipelineConfig], object], argv=None) -> int:
    args = parser(stage, description).parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")  # stderr: the stage's own progress and errors
    try:
        cfg = load(args)
    except (ConfigError, ValueError, OSError) as err:  # the config as given: nothing has run yet
        return _fail(stage, err)
    try:
        body(cfg)
    except ConfigError as err:  # a stage's input check (raised before it writes)
        return _fail(stage, err)
    return 0
