"""Configs for the pipeline tests: a tiny random teacher over a small jsonl corpus (see the ``tiny_setup`` fixture)."""
from __future__ import annotations

from pathlib import Path

from pipelines.config import PipelineConfig, load_config

WINDOWS = (8, 16)


def tiny_overrides(root: Path, home: Path, *extra: str) -> list[str]:
    """8 training sequences of 64 tokens, one per shard; budget s4-w8-k16; top-8 logits; a small mlp scorer."""
    return [
        f"home={home}", f"model.path={root / 'teacher'}", f"data.source={root / 'docs.jsonl'}", "data.seq_len=64",
        "data.num_sequences=8", "data.eval_sequences=2", "budget.sink=4", "budget.window=8", "budget.topk=16",
        f"precompute.windows={list(WINDOWS)}", "precompute.top_k=8", "precompute.sequences_per_shard=1",
        "precompute.num_cpus_per_actor=1", "tracking.experiment=tests", *extra]


def tiny_config(root: Path, home: Path, *extra: str) -> PipelineConfig:
    """The config of :func:`tiny_overrides`."""
    return load_config(None, tiny_overrides(root, home, *extra))
