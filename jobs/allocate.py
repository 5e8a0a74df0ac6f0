"""``python -m jobs.allocate [--config configs/X.yaml] [--set k=v ...]``: per-(layer, KV head) budgets from the
precomputed targets (METHOD §7), written as kvpop_allocation.json with its own record and MLflow run.

Runs after precompute, without Ray. A committed allocation for the same settings is returned as it is. Prints where
the allocation is, its mean and peak budget.
"""
import sys

from jobs._cli import main


def body(cfg):
    from pipelines import allocate  # the stage once the command line is good (it imports torch)

    result = allocate.run(cfg)
    a = result.allocation
    state = "computed" if result.computed else "committed earlier"
    print(f"allocation: {result.path} ({a.mode}, mean B {a.mean_budget}, peak {a.peak_budget}, {state}; "
          f"MLflow run {result.mlflow_run_id})")


def cli(argv=None) -> int:
    return main("allocate", __doc__, body, argv, needs_ray=False)


if __name__ == "__main__":
    sys.exit(cli())
