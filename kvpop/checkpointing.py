"""Training state round trip with ``torch.distributed.checkpoint`` (DCP), sharded or not.

:func:`save` writes the model and optimizer state of every rank into one checkpoint folder, plus the step in
``kvpop_step.json`` (rank 0); :func:`load` restores them into a model and optimizer built the same way (same
sharding plan, same parameter groups) and returns the step. ``trainable_only`` keeps just the parameters that
train (scorer-only training: the frozen base is rebuilt from its own folder, not stored per checkpoint).
:func:`full_model_state` gathers a sharded model's full state dict on rank 0 (CPU), e.g. to save the final model.

**Integrity.** Each rank then writes ``kvpop_manifest.<rank>.json``: the world size and the size and sha256 of every
file it wrote. :func:`verify` (which :func:`load` calls first, and a driver may call before it starts workers) refuses
a folder with a missing manifest, a missing, truncated or changed file, with one :class:`CheckpointError` line — a
checkpoint cut short by a full disk or a kill mid-copy is never unpickled.

**Provenance.** DCP's ``.metadata`` file is a pickle: loading a checkpoint runs code stored in it. The manifest proves
that the files are the ones the writer listed, not who the writer was: resume only from checkpoints you wrote
yourself; a run folder from someone else is code you execute.
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

from kvpop.files import atomic_write_text, sha256_file

STEP_FILE = "kvpop_step.json"
MANIFEST = "kvpop_manifest.{rank}.json"


class CheckpointError(ValueError):
    """A checkpoint folder that :func:`verify` refuses (one line: the folder and what is wrong)."""


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def training_state(model: nn.Module, optimizer: Optimizer, *, trainable_only: bool) -> dict:
    """``{"model": …, "optim": …}`` as DCP reads and writes it (sharded tensors stay sharded)."""
    model_state, optim_state = get_state_dict(model, optimizer)
    if trainable_only:
        names = {name for name, p in model.named_parameters() if p.requires_grad}
        model_state = {k: v for k, v in model_state.items() if k in names}
    return {"model": model_state, "optim": optim_state}


def _own_files(folder: Path, rank: int) -> list[Path]:
    """The files of ``folder`` that ``rank`` wrote: DCP's ``__<rank>_<n>.distcp``, and rank 0's ``.metadata`` and
    step file (several ranks may share one folder)."""
    own = sorted(folder.glob(f"__{rank}_*.distcp"))
    return own + [folder / name for name in (".metadata", STEP_FILE) if rank == 0 and (folder / name).is_file()]


def save(model: nn.Module, optimizer: Optimizer, folder: str | Path, *, step: int, trainable_only: bool) -> None:
    """Every rank calls this with its own (or a shared) ``folder``: its DCP files, then its manifest, last."""
    folder = Path(folder)
    dcp.save(training_state(model, optimizer, trainable_only=trainable_only), checkpoint_id=str(folder))
    rank = _rank()
    if rank == 0:
        (folder / STEP_FILE).write_text(json.dumps({"step": step}))
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    manifest = {"world_size": world, "files": {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
                                               for p in _own_files(folder, rank)}}
    atomic_write_text(folder / MANIFEST.format(rank=rank), json.dumps(manifest, indent=1))


def verify(folder: str | Path) -> None:
    """Raise :class:`CheckpointError` unless ``folder`` holds every rank's manifest and every file they list, with
    its size and sha256."""
    folder = Path(folder)
    try:
        first = json.loads((folder / MANIFEST.format(rank=0)).read_text())
        world = int(first["world_size"])
        manifests = [first] + [json.loads((folder / MANIFEST.format(rank=r)).read_text()) for r in range(1, world)]
    except FileNotFoundError as err:
        raise CheckpointError(f"checkpoint {folder} has no {Path(err.filename).name} (written before checkpoints "
                              f"carried manifests, or cut short)") from None
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"checkpoint {folder}: unreadable manifest ({type(err).__name__}: {err})") from None
    for manifest in manifests:
        for name, want in manifest["files"].items():
            path = folder / name
            if not path.is_file():
                raise CheckpointError(f"checkpoint {folder}: {name} is missing")
            if path.stat().st_size != want["bytes"]:
                raise CheckpointError(f"checkpoint {folder}: {name} holds {path.stat().st_size} bytes, its manifest "
                                      f"{want['bytes']} (truncated or changed)")
            if sha256_file(path) != want["sha256"]:
                raise CheckpointError(f"checkpoint {folder}: {name} differs from its manifest's sha256 (changed)")


def load(model: nn.Module, optimizer: Optimizer, folder: str | Path, *, trainable_only: bool) -> int:
    """Restore what :func:`save` wrote into ``model`` and ``optimizer`` (in place), once :func:`verify` accepts the
    folder; returns the saved step."""
    verify(folder)
    state = training_state(model, optimizer, trainable_only=trainable_only)
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(strict=False))
    return int(json.loads((Path(folder) / STEP_FILE).read_text())["step"])


def full_model_state(model: nn.Module) -> dict:
    """The full (unsharded) state dict on CPU, on rank 0; empty on the other ranks. Collective: every rank calls it."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
