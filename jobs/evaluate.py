"""``python -m jobs.evaluate [--config …] [--set k=v …]``: every policy × budget on held-out text and tasks."""
import sys

from jobs._cli import main
from pipelines import evaluate


def body(cfg):
    result = evaluate.run(cfg)
    print(f"table and figures: {result.output_dir}\nmlflow run: {result.run_id}")


def cli(argv=None) -> int:
    return main("evaluate", __doc__, body, argv, needs_ray=False)


if __name__ == "__main__":
    sys.exit(cli())
