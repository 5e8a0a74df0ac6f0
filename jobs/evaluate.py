"""``python -m jobs.evaluate [--config …] [--set k=v …]``: every policy × budget on held-out text, recall tasks and
long generation, with 95 % bootstrap intervals and paired differences (a complete result is reused, not redone);
with ``eval.read_windows``, one more evaluation per read window (pipelines.evaluate.readings)."""
import sys

from jobs._cli import main


def body(cfg):
    from pipelines import evaluate

    for result in evaluate.run_readings(cfg):
        print(f"report, predictions and figures: {result.output_dir}{' (reused)' if result.reused else ''}\n"
              f"mlflow run: {result.run_id}")


def cli(argv=None) -> int:
    return main("evaluate", __doc__, body, argv, needs_ray=False)


if __name__ == "__main__":
    sys.exit(cli())
