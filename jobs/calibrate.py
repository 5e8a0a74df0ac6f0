"""``python -m jobs.calibrate [--config …] [--set …] [--tasks …] [--contexts …] [--depths …] [--samples N]
[--seed N] [--max-new-tokens N] [--batch-size N]``: how often the dense model (``model.path``) solves each recall
task × context × depth.

Grid options (comma-separated lists): ``--tasks`` (default: every task of ``pipelines.recall.TASKS``), ``--contexts``
in tokens (default: 1024, 2048, 4096, 8192 up to the model's context), ``--depths`` in [0, 1] (default 0.1, 0.5, 0.9),
``--samples`` per cell (default 16), ``--seed`` (default 0), ``--max-new-tokens`` of greedy generation (default 12),
``--batch-size`` prompts per forward (default 1; larger on a GPU).

Prints the table (exact match of greedy generation; first gold token at rank 1, whole answer at rank 1 and summed
gold log-probability, teacher-forced) and writes ``calibration.json`` (every row with its samples' outputs) and
``table.txt`` under ``$KVPOP_HOME/calibration/<hash of model, tokenizer and grid>/``; a grid already calibrated
there is printed again without running the model. Cells with exact match >= 0.9 are ``usable`` for the headline.
"""
import argparse
import json
import sys

from jobs import _cli
from pipelines.config import ConfigError
from pipelines.recall import TASKS, TaskSpec
from pipelines.recall import calibration as C

def _list(kind):
    def parse(text: str):
        try:
            return [kind(item) for item in text.split(",") if item.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {kind.__name__}, got {text!r}")
    return parse


def grid_parser():
    p = _cli._Parser(prog="python -m jobs.calibrate", add_help=False)
    p.add_argument("--tasks", type=_list(str), default=list(TASKS))
    p.add_argument("--contexts", type=_list(int), default=None)
    p.add_argument("--depths", type=_list(float), default=list(C.DEPTHS))
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=1)
    return p


def specs_for(grid, max_context: int | None) -> list[TaskSpec]:
    """The grid's specs, each checked against the model's context; bad input is a :class:`ConfigError`."""
    contexts = grid.contexts or [c for c in C.CONTEXTS if max_context is None or c <= max_context]
    try:
        specs = C.grid(grid.tasks, contexts, grid.depths, samples=grid.samples, seed=grid.seed)
        for spec in specs:
            spec.check_fits(max_context)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if grid.max_new_tokens < 1 or grid.batch_size < 1:
        raise ConfigError("--max-new-tokens and --batch-size must be >= 1")
    return specs


def body(cfg, grid) -> None:
    config = json.loads((cfg.model.resolved_path() / "config.json").read_text())
    specs = specs_for(grid, config.get("max_position_embeddings"))
    name = cfg.model.resolved_path().name
    print(f"recall calibration of {name} (dense): {len(specs)} cells x {grid.samples} samples", flush=True)
    rows, out, reused = C.run(cfg, specs, max_new_tokens=grid.max_new_tokens, batch_size=grid.batch_size,
                              progress=lambda line: print(line, flush=True))
    print(C.format_table(rows))
    print(f"{sum(r['usable'] for r in rows)} of {len(rows)} cells usable (dense exact match >= {C.THRESHOLD}); "
          f"{'found in' if reused else 'written to'} {out}")


def main(argv=None) -> int:
    grid, rest = grid_parser().parse_known_args(argv)
    return _cli.main("calibrate", __doc__, lambda cfg: body(cfg, grid), rest)


if __name__ == "__main__":
    sys.exit(main())
