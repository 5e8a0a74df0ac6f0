"""``python -m jobs.pipeline [--config …] [--set k=v …]``: precompute → train → evaluate, each resuming.

The README's run command: on the embedded default it runs SmolLM2-135M-Instruct on a local Ray cluster with a
local MLflow store (``mlflow ui --backend-store-uri sqlite:///.kvpop/mlflow.db``).
"""
import sys
import time

from jobs._cli import main


def body(cfg):
    from pipelines import evaluate, precompute, train

    start = time.perf_counter()
    print(f"[kvpop] config {cfg.name}: model {cfg.model.resolved_path()}, data {cfg.data.source}, "
          f"S={cfg.data.seq_len}, budget {cfg.budget.budget()} (B={cfg.budget.budget().total}), "
          f"MLflow {cfg.tracking_uri()}", flush=True)
    print("[kvpop] 1/3 precompute teacher targets", flush=True)
    targets = precompute.run(cfg)
    print(f"[kvpop]     {targets.path} ({targets.shards} shards, {targets.computed} computed now)", flush=True)
    print("[kvpop] 2/3 train the scorers", flush=True)
    trained = train.run(cfg)
    print(f"[kvpop]     {trained.model_dir}", flush=True)
    print("[kvpop] 3/3 evaluate", flush=True)
    result = evaluate.run(cfg)
    print(f"[kvpop] done in {time.perf_counter() - start:.0f} s: table and figures in {result.output_dir}; "
          f"review with `mlflow ui --backend-store-uri {cfg.tracking_uri()}`", flush=True)


if __name__ == "__main__":
    sys.exit(main("pipeline", __doc__, body))
