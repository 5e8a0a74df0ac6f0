"""No model or dataset hub at run time: the environment that keeps the Hugging Face libraries offline.

``huggingface_hub`` reads ``HF_HUB_OFFLINE`` once, when it is first imported (transformers and datasets import it),
so :func:`go_offline` must run before any of them: ``jobs/__init__.py`` calls it first thing in every CLI, and
:data:`OFFLINE_ENV` is what Ray workers get in their runtime env (``pipelines/cluster.py``; ``infra/`` sets the same
variables for submitted jobs and cluster nodes). With it, a hub name fails at once unless the local HF cache has it.
Standard library only, so that importing it imports nothing else.
"""
from __future__ import annotations

import os

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def go_offline() -> None:
    """Set :data:`OFFLINE_ENV` in this process (and so in every process it starts)."""
    os.environ.update(OFFLINE_ENV)
