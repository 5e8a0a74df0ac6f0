"""Training state round trip with ``torch.distributed.checkpoint`` (DCP), sharded or not.

:func:`save` writes the model and optimizer state of every rank into one checkpoint folder, plus the step in
``kvpop_step.json`` (rank 0); :func:`load` restores them into a model and optimizer built the same way (same
sharding plan, same parameter groups) and returns the step. ``trainable_only`` keeps just the parameters that
train (scorer-only training: the frozen base is rebuilt from its own folder, not stored per checkpoint).
:func:`full_model_state` gathers a sharded model's full state dict on rank 0 (CPU), e.g. to save the final model.

**Provenance.** DCP's ``.metadata`` file is a pickle: loading a checkpoint runs code stored in it. Resume only from
checkpoints you wrote yourself; a run folder from someone else is code you execute.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.optim import Optimizer

STEP_FILE = "kvpop_step.json"


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def training_state(model: nn.Module, optimizer: Optimizer, *, trainable_only: bool) -> dict:
    """``{"model": …, "optim": …}`` as DCP reads and writes it (sharded tensors stay sharded)."""
    model_state, optim_state = get_state_dict(model, optimizer)
    if trainable_only:
        names = {name for name, p in model.named_parameters() if p.requires_grad}
        model_state = {k: v for k, v in model_state.items() if k in names}
    return {"model": model_state, "optim": optim_state}


def save(model: nn.Module, optimizer: Optimizer, folder: str | Path, *, step: int, trainable_only: bool) -> None:
    """Every rank calls this with its own (or a shared) ``folder``."""
    dcp.save(training_state(model, optimizer, trainable_only=trainable_only), checkpoint_id=str(folder))
    if _rank() == 0:
        (Path(folder) / STEP_FILE).write_text(json.dumps({"step": step}))


def load(model: nn.Module, optimizer: Optimizer, folder: str | Path, *, trainable_only: bool) -> int:
    """Restore what :func:`save` wrote into ``model`` and ``optimizer`` (in place); returns the saved step."""
    state = training_state(model, optimizer, trainable_only=trainable_only)
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(strict=False))
    return int(json.loads((Path(folder) / STEP_FILE).read_text())["step"])


def full_model_state(model: nn.Module) -> dict:
    """The full (unsharded) state dict on CPU, on rank 0; empty on the other ranks. Collective: every rank calls it."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
