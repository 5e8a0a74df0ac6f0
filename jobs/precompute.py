"""``python -m jobs.precompute [--config configs/X.yaml] [--set k=v ...]``: teacher targets → Parquet shards.

Re-running skips committed shards; a killed run resumes. Prints where the shards are.
"""
import sys

from jobs._cli import main


def body(cfg):
    from pipelines import precompute

    result = precompute.run(cfg)
    print(f"targets: {result.path} ({result.shards} shards, {result.computed} computed now)")


def cli(argv=None) -> int:
    return main("precompute", __doc__, body, argv)


if __name__ == "__main__":
    sys.exit(cli())
