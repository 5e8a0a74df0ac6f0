"""``python -m jobs.pipeline [--config …] [--set k=v …]``: precompute → [sweep →] train → evaluate, each resuming.

With ``sweep.in_pipeline=true`` the sweep runs after precompute and the train and evaluate stages use its best config
(``<sweep dir>/best.yaml``). The README's run command: on the embedded default it runs SmolLM2-135M-Instruct on a
local Ray cluster with a local MLflow store (``mlflow ui --backend-store-uri sqlite:///.kvpop/mlflow.db``).
"""
import sys
import time

from jobs._cli import main


def body(cfg):
    from pipelines import evaluate, precompute, sweep, train

    start = time.perf_counter()
    stages = 4 if cfg.sweep.in_pipeline else 3
    print(f"[kvpop] config {cfg.name}: model {cfg.model.resolved_path()}, data {cfg.data.source}, "
          f"S={cfg.data.seq_len}, budget {cfg.budget} (B={cfg.budget.total}), "
          f"MLflow {cfg.tracking_uri()}", flush=True)
    print(f"[kvpop] 1/{stages} precompute teacher targets", flush=True)
    targets = precompute.run(cfg)
    print(f"[kvpop]     {targets.path} ({targets.shards} shards, {targets.computed} computed now)", flush=True)
    if cfg.sweep.in_pipeline:
        print(f"[kvpop] 2/{stages} sweep", flush=True)
        swept = sweep.run(cfg)
        cfg = swept.best_config
        print(f"[kvpop]     best config {swept.best_path}: scorer {cfg.train.scorer}, lr {cfg.train.lr:g}, budget "
              f"{cfg.budget}", flush=True)
    print(f"[kvpop] {stages - 1}/{stages} train the scorers", flush=True)
    trained = train.run(cfg)
    print(f"[kvpop]     {trained.model_dir}", flush=True)
    print(f"[kvpop] {stages}/{stages} evaluate", flush=True)
    result = evaluate.run(cfg)
    uri = cfg.tracking_uri()
    review = f"open {uri}" if uri.startswith("http") else f"review with `mlflow ui --backend-store-uri {uri}`"
    print(f"[kvpop] done in {time.perf_counter() - start:.0f} s: table and figures in {result.output_dir}; {review}",
          flush=True)


if __name__ == "__main__":
    sys.exit(main("pipeline", __doc__, body))
