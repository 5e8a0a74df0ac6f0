"""configs/ presets load and validate; infra/ manifests parse (and the cluster launcher YAML fits Ray's schema)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pipelines.config import REPO_ROOT, load_config

PRESETS = sorted((REPO_ROOT / "configs").glob("*.yaml"))


def test_the_expected_presets_exist():
    assert {"default.yaml", "smollm2.yaml", "qwen3-4b.yaml", "qwen3-8b.yaml"} <= {p.name for p in PRESETS}



def _header(path: Path) -> list[str]:
    lines = path.read_text().splitlines()
    return lines[:next(i for i, line in enumerate(lines) if not line.startswith("#"))]


def test_presets_are_few_and_their_headers_short():
    """At most 8 presets (recipes included); each header — what you get, what it needs, the command, the RESULTS.md
    row it reproduces — at most 6 lines, and it names that row or says there is none."""
    presets = [p for p in sorted((REPO_ROOT / "configs").rglob("*.yaml"))]
    assert len(presets) <= 8, [p.name for p in presets]
    for path in presets:
        header = _header(path)
        assert 1 <= len(header) <= 6, f"{path.name}: {len(header)} header lines"
    for path in presets:
        if path.name != "default.yaml":  # the embedded default (`make run`): a demonstration, no RESULTS.md row
            assert "RESULTS.md" in "\n".join(_header(path)), f"{path.name}: the header names no RESULTS.md row"


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_every_preset_loads_and_validates(path):
    cfg = load_config(path)
    assert cfg.budget.window in cfg.precompute.windows
    assert cfg.budget.total <= cfg.data.seq_len
    for window in {b[1] for b in cfg.sweep.budgets}:
        assert window in cfg.precompute.windows, f"{path.name}: sweep window {window} has no targets"
    assert yaml.safe_load(path.read_text())  # nothing but a mapping


def test_default_yaml_is_the_embedded_default():
    assert load_config(REPO_ROOT / "configs" / "default.yaml") == load_config()


@pytest.mark.parametrize("name", ["qwen3-4b", "qwen3-8b"])
def test_the_paper_presets(name):
    cfg = load_config(REPO_ROOT / "configs" / f"{name}.yaml")
    assert cfg.data.seq_len == 16384 and "Nemotron-Math-v2" in cfg.data.source
    assert cfg.budget.total == 4096 and sorted(cfg.eval.budgets) == [2048, 4096]
    assert (cfg.train.num_workers, cfg.train.use_gpu, cfg.train.strategy, cfg.train.precision) == (8, True, "fsdp",
                                                                                                   "bf16")
    assert cfg.model.dtype == "bfloat16" and cfg.precompute.top_k == 256 and cfg.train.mode == "distill"
    assert name.split("-")[1].upper() in cfg.model.path


def test_infra_manifests():
    import jsonschema
    import ray
    from ray.runtime_env import RuntimeEnv

    infra = REPO_ROOT / "infra"
    cluster = yaml.safe_load((infra / "cluster.yaml").read_text())
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    jsonschema.validate(cluster, schema)
    RuntimeEnv(**yaml.safe_load((infra / "runtime_env.yaml").read_text()))
    job = yaml.safe_load((infra / "kuberay-rayjob.yaml").read_text())
    assert job["kind"] == "RayJob" and job["spec"]["entrypoint"].startswith("python -m jobs.pipeline --config configs/")
    RuntimeEnv(**yaml.safe_load(job["spec"]["runtimeEnvYAML"]))
    preset = job["spec"]["entrypoint"].split("--config ")[1].split()[0]
    load_config(REPO_ROOT / preset)
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"]
    assert head[0]["name"] == "ray-head" and "command" not in head[0]  # KubeRay generates the Ray container's command
    assert head[1]["command"][:2] == ["mlflow", "server"]


def test_the_smollm2_recipe_is_its_two_phases():
    """configs/recipes/smollm2_kvpop.yaml: phase champ (lr 3e-3, 30.02M tokens on 5,120 champ sequences), then phase
    kernel (its scorers, found through phase champ's train record, fine-tuned at lr 1e-3 to 3.01M tokens on champ +
    the kernel docs); the kernel corpus is a declared input made by jobs.corpus; CR 93.75 % is read at window 128."""
    from pipelines.recipe import load_recipe

    path = REPO_ROOT / "configs" / "recipes" / "smollm2_kvpop.yaml"
    header = [line for line in path.read_text().splitlines() if line.startswith("#")]
    assert path.read_text().startswith("#") and len([h for h in header if not h.startswith("#  ")]) <= 6
    recipe = load_recipe(path)
    assert [p.name for p in recipe.phases] == ["champ", "kernel"]
    assert recipe.phases[1].init_from == "champ" and recipe.phases[0].init_from is None
    wide, kernel = (recipe.config(p) for p in recipe.phases)
    assert (wide.name, kernel.name) == ("smollm2-kvpop-champ", "smollm2-kvpop-kernel")
    for cfg in (wide, kernel):
        assert (cfg.budget.sink, cfg.budget.window, cfg.budget.topk, cfg.data.seq_len) == (4, 256, 252, 4096)
        assert (cfg.train.policy, cfg.train.mode, cfg.train.scorer) == ("kvpop", "scorer_only", "mlstm")
        assert cfg.train.scorer_options == {"features": "kv_norms"} and cfg.train.extra_topks == (60, 124, 508, 1020)
        assert cfg.precompute.query_power == 16 and cfg.train.batch_size == 4 and cfg.data.source == "champ"
        assert cfg.eval.recency == 0.0025 and cfg.eval.anchor_share == 0.0625
        assert cfg.eval.compression_ratios == (0.875, 0.9375) and cfg.eval.read_windows == (128,)
        assert cfg.model.path == "smollm2" and cfg.train.init_from is None
    assert (wide.train.lr, wide.train.steps, wide.data.num_sequences) == (3e-3, 1832, 5120)
    assert round(wide.train.steps * wide.train.batch_size * wide.data.seq_len / 1e6, 2) == 30.02
    assert (wide.data.mix_source, wide.data.mix_sequences) == (None, 0)
    assert (kernel.train.lr, kernel.train.steps, kernel.data.num_sequences) == (1e-3, 184, 1120)
    assert round(kernel.train.steps * kernel.train.batch_size * kernel.data.seq_len / 1e6, 2) == 3.01
    assert (kernel.data.mix_source, kernel.data.mix_sequences) == (".kvpop/data/linux_docs.jsonl", 1120)
    assert recipe.inputs[kernel.data.mix_source].startswith("python -m jobs.corpus --deb linux-doc-6.1")
    # phase kernel's data is phase champ's but for the pool: the same held-out split, tokenization and targets
    same = ("seq_len", "eval_sequences", "packing", "seed", "text_field", "id_field")
    assert [getattr(wide.data, k) for k in same] == [getattr(kernel.data, k) for k in same]
    assert wide.precompute.target_options() == kernel.precompute.target_options()
    assert not recipe.phases[0].evaluate and recipe.phases[1].evaluate


def test_the_headwise_recipe_compares_per_head_budgets_with_dms_at_both_accountings():
    """configs/recipes/smollm2_headwise.yaml (issue 43's GPU comparison): per CR a DMS and a uniform KVpop phase
    (not evaluated), then the scorer trained at the allocation, evaluated with -H rows, both as rows and DMS capped;
    DMS's keep-rate that of mean memory B (research/baselines_h200.py's rule)."""
    from pipelines.recipe import load_recipe
    from research.baselines_h200 import dms_keep_rate

    recipe = load_recipe(REPO_ROOT / "configs" / "recipes" / "smollm2_headwise.yaml")
    by_name = {p.name: p for p in recipe.phases}
    assert list(by_name) == ["dms87", "uniform87", "headwise87", "dms94", "uniform94", "headwise94"]
    for cr, total in (("87", 512), ("94", 256)):
        dms, uniform, headwise = (recipe.config(by_name[f"{kind}{cr}"]) for kind in ("dms", "uniform", "headwise"))
        assert {c.budget.total for c in (dms, uniform, headwise)} == {total} and headwise.data.seq_len == 4096
        assert 1 - total / 4096 in (0.875, 0.9375) and headwise.budget.window in headwise.precompute.windows
        assert dms.train.policy == "dms" and dms.train.dms_keep_rate == pytest.approx(
            dms_keep_rate(total, 4, 128, 4096), abs=1e-5)
        assert (uniform.train.allocation, headwise.train.allocation) == ("", "allocate")
        assert uniform.train.optimisation() == {k: v for k, v in headwise.train.optimisation().items()
                                                if k != "allocation"}  # the same training but for the allocation
        assert headwise.eval.allocated == ("kvpop", "oracle") and headwise.eval.capped
        assert headwise.eval.baselines == {"dms": f"phase:dms{cr}", "kvpop_uniform": f"phase:uniform{cr}"}
        assert headwise.eval.heldout_sources == ("stdlib",) and headwise.data.eval_sequences == 64
        assert not by_name[f"dms{cr}"].evaluate and not by_name[f"uniform{cr}"].evaluate
