"""What every job CLI shares: ``--config``/``--set`` parsing, checks before any work, and exit codes.

Bad input (unknown key, wrong type, missing file, impossible budget) is one line on stderr and exit code 2, before
anything is written; the stages raise :class:`pipelines.config.ConfigError` (or another ``ValueError`` subclass) for
what they can only see once they look at the data, also before writing.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable

from pipelines.config import ConfigError, PipelineConfig, load_config


def parser(stage: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m jobs.{stage}", description=description)
    p.add_argument("--config", metavar="YAML", help="a preset from configs/ (default: the embedded default)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config key, dotted (e.g. --set train.steps=100 --set budget.topk=192)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    return p


def preflight(cfg: PipelineConfig) -> None:
    """Checks that need no Ray and write nothing: the teacher folder and a local data source exist."""
    model = cfg.model.resolved_path()
    if not (model / "config.json").is_file():
        hint = "run `make model`" if cfg.model.path == "smollm2" else "point model.path at a local HF model folder"
        raise ConfigError(f"model folder {model} not found (no config.json): {hint}")
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


def main(stage: str, description: str, body: Callable[[PipelineConfig], object], argv=None) -> int:
    args = parser(stage, description).parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        cfg = load(args)
        body(cfg)
    except (ConfigError, ValueError, FileNotFoundError) as err:
        if not isinstance(err, (ConfigError, FileNotFoundError)) and type(err).__module__.startswith(("torch", "ray")):
            raise
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"kvpop {stage}: error: {message}", file=sys.stderr)
        return 2
    return 0
