"""The pipeline on a model with its own local layers (kvpop.local_layers): precompute, train and evaluate a tiny
random Gemma 2 (local, global, local, global) end to end; targets and scorers cover its two global layers only."""
import math

import pytest

import kvpop
from kvpop.retrofit import scoring_modules
from tests.models import LOCAL_WINDOW, tiny_model, write_docs
from tests.pipeline_helpers import tiny_config


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.pretrained
def test_precompute_train_evaluate_on_a_hybrid_model(smollm2_dir, tmp_path, ray_cluster):
    from transformers import AutoTokenizer

    from pipelines import evaluate, precompute, store, train

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    teacher = tiny_model("gemma2", "gqa", vocab=len(tokenizer))
    teacher.save_pretrained(tmp_path / "teacher")
    tokenizer.save_pretrained(tmp_path / "teacher")
    write_docs(tmp_path / "docs.jsonl", 40)
    cfg = tiny_config(tmp_path, tmp_path / "home", "train.scorer=mlp", "train.lr=0.01", "train.steps=2",
                      "train.checkpoint_every=2", "train.batch_size=2", "train.num_workers=1",
                      "train.cpus_per_worker=1", "train.max_failures=0", "eval.policies=[dense,streaming,oracle,kvpop]",
                      "eval.budgets=[28]", "eval.compression_ratios=[]", "eval.task_samples=0",
                      "eval.generation_prompts=0", "eval.resamples=100", "eval.batch_size=2")

    targets = store.open_targets(precompute.run(cfg).path)
    assert targets.identity["target_layers"] == [1, 3] and targets.identity["num_layers"] == 2
    column = targets.read_table([store.target_column(8)]).schema.field(store.target_column(8))
    assert list(column.type.shape) == [2, 2, 64]  # [global layers, Hkv, S]

    trained = train.run(cfg)
    assert math.isfinite(trained.metrics["ret_loss"])
    model, _ = kvpop.load_retrofitted(trained.model_dir, base=cfg.model.resolved_path())
    assert model.kvpop_runtime.layer_windows == (LOCAL_WINDOW, None, LOCAL_WINDOW, None)
    assert [m.layer_idx for m in scoring_modules(model)] == [1, 3]

    result = evaluate.run(cfg, progress=False)
    rows = {(m["policy"], m["metric"]) for m in result.summary["metrics"]}
    assert ("kvpop", "kl") in rows and ("oracle", "kl") in rows and ("streaming", "kl") in rows
