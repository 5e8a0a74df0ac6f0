"""``python -m jobs.train [--config …] [--set k=v …]``: Ray Train (FSDP2 on GPUs) on the precomputed shards.

A restarted run with the same config resumes from its last checkpoint. Prints the model folder and MLflow run.
"""
import sys

from jobs._cli import main


def body(cfg):
    from pipelines import train

    result = train.run(cfg)
    print(f"model: {result.model_dir}\nmlflow run: {result.mlflow_run_id}")


def cli(argv=None) -> int:
    return main("train", __doc__, body, argv)


if __name__ == "__main__":
    sys.exit(cli())
