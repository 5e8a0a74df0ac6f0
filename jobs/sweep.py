"""``python -m jobs.sweep [--config …] [--set k=v …]``: Ray Tune over scorers × lrs × budgets (ASHA), one TorchTrainer
per trial, nested MLflow runs; the best config is saved as a loadable preset.

Needs the precompute stage's targets for every window the sweep uses (``precompute.windows``). Prints the best
config's path and the parent MLflow run.
"""
import sys

from jobs._cli import main


def body(cfg):
    from pipelines import sweep

    result = sweep.run(cfg)
    print(f"best config: {result.best_path} ({result.best_config.sweep.metric} {result.best_value:.6g})\n"
          f"mlflow parent run: {result.parent_run_id}")


def cli(argv=None) -> int:
    return main("sweep", __doc__, body, argv)


if __name__ == "__main__":
    sys.exit(cli())
