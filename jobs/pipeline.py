"""``python -m jobs.pipeline [--config …] [--set k=v …]``: precompute → [sweep →] train → evaluate, each
resuming.

A config with ``phases:`` is a recipe (pipelines/recipe.py, e.g. configs/recipes/smollm2_kvpop.yaml): its phases run
in order, each the whole pipeline, a phase starting from an earlier one's model through that phase's train record;
``--set phases.<phase>.<key>=value`` sets one phase, ``--set <key>=value`` every phase. The same command after a kill
resumes (finished phases are reused through their records). A missing recipe input is refused in one line naming the
command that makes it, before anything is written.

An online run (``train.targets_source=online``: its steps compute their own targets) skips the precompute stage.

With ``sweep.in_pipeline=true`` the sweep runs after precompute and the train and evaluate stages use its best config
(``<sweep dir>/best.yaml``). The README's run command: on the embedded default it runs SmolLM2-135M-Instruct on a
local Ray cluster with a local MLflow store, and ends with the command that shows its runs in ``mlflow ui``.
"""
import sys
import time
from pathlib import Path

from jobs._cli import main


def body(cfg):
    from pipelines import recipe, tracking

    start = time.perf_counter()
    result = recipe.run_pipeline(cfg)
    out = result["evaluations"][0].output_dir
    print(f"[kvpop] done in {time.perf_counter() - start:.0f} s: table and figures in {out}; "
          f"{review_hint(cfg.tracking_uri(), tracking.setup(cfg))}", flush=True)


def recipe_body(loaded):
    from pipelines import recipe, tracking

    results = recipe.run(loaded)
    for phase, result in zip(loaded.phases, results):
        where = ", ".join(str(e.output_dir) for e in result["evaluations"]) or "not evaluated"
        print(f"[kvpop] phase {phase.name}: model {result['model_dir']}; evaluation {where}", flush=True)
    last = results[-1]["config"]
    print(f"[kvpop] {review_hint(last.tracking_uri(), tracking.setup(last))}", flush=True)


def load_recipe(args):
    """The recipe at ``--config``, checked before any stage (``--print-config``: each phase's config, and exit)."""
    from pipelines import recipe

    loaded = recipe.load_recipe(args.config, args.overrides)
    if args.print_config:
        import yaml

        for phase in loaded.phases:
            print(f"# phase {phase.name}" + (f" (train.init_from: phase {phase.init_from}'s final model)"
                                              if phase.init_from else ""))
            print(yaml.safe_dump(loaded.config(phase).to_dict(), sort_keys=False) + "---")
        sys.exit(0)
    recipe.check(loaded)
    return loaded


def review_hint(uri: str, experiment_id: str) -> str:
    """How to see the runs: a command that works as written (this interpreter's ``mlflow``) and the page that opens
    the experiment on its runs (MLflow 3's UI starts on GenAI traces unless told ``workflowType=machine_learning``)."""
    page = f"/#/experiments/{experiment_id}?workflowType=machine_learning"
    if uri.startswith(("http://", "https://")):
        return f"open {uri.rstrip('/')}{page}"
    mlflow = Path(sys.executable).parent / "mlflow"
    command = f"{mlflow if mlflow.is_file() else 'mlflow'} ui --backend-store-uri {uri}"
    return f"review with `{command}`, then open http://127.0.0.1:5000{page}"


def load_any(args):
    """A recipe (a file with ``phases:``) or one config, each loaded and checked before any stage runs."""
    from pipelines.recipe import is_recipe

    if is_recipe(args.config):
        return load_recipe(args)
    from jobs._cli import load
    from pipelines.cluster import check_address

    cfg = load(args)
    check_address(cfg)
    return cfg


def run_any(loaded):
    from pipelines.recipe import Recipe

    return recipe_body(loaded) if isinstance(loaded, Recipe) else body(loaded)


def cli(argv=None) -> int:
    return main("pipeline", __doc__, run_any, argv, loader=load_any)


if __name__ == "__main__":
    sys.exit(cli())
