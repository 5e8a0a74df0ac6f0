"""``python -m jobs.pipeline [--config …] [--set k=v …]``: precompute → [sweep →] train → evaluate, each resuming.

With ``sweep.in_pipeline=true`` the sweep runs after precompute and the train and evaluate stages use its best config
(``<sweep dir>/best.yaml``). The README's run command: on the embedded default it runs SmolLM2-135M-Instruct on a
local Ray cluster with a local MLflow store, and ends with the command that shows its runs in ``mlflow ui``.
"""
import sys
import time
from pathlib import Path

from jobs._cli import main


def body(cfg):
    from pipelines import evaluate, precompute, sweep, tracking, train

    start = time.perf_counter()
    if cfg.train.init_from is not None:  # the train stage's input: refused now, not after the precompute's hours
        from pipelines.identity import teacher_identity

        train.check_init_from(cfg, teacher_identity(cfg)["weights_sha256"])
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
    print(f"[kvpop] done in {time.perf_counter() - start:.0f} s: table and figures in {result.output_dir}; "
          f"{review_hint(cfg.tracking_uri(), tracking.setup(cfg))}", flush=True)


def review_hint(uri: str, experiment_id: str) -> str:
    """How to see the runs: a command that works as written (this interpreter's ``mlflow``) and the page that opens
    the experiment on its runs (MLflow 3's UI starts on GenAI traces unless told ``workflowType=machine_learning``)."""
    page = f"/#/experiments/{experiment_id}?workflowType=machine_learning"
    if uri.startswith(("http://", "https://")):
        return f"open {uri.rstrip('/')}{page}"
    mlflow = Path(sys.executable).parent / "mlflow"
    command = f"{mlflow if mlflow.is_file() else 'mlflow'} ui --backend-store-uri {uri}"
    return f"review with `{command}`, then open http://127.0.0.1:5000{page}"


def cli(argv=None) -> int:
    return main("pipeline", __doc__, body, argv)


if __name__ == "__main__":
    sys.exit(cli())
