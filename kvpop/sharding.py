"""The FSDP2 plan of a retrofitted decoder (``torch.distributed.fsdp.fully_shard``).

One FSDP unit per scorer, kept in fp32 (compute and gradient reduction: its priorities decide rankings at near-ties),
one per decoder layer and one for the root. With ``bf16`` the layers and the root compute in bf16 and reduce
gradients in fp32, over fp32 master weights. The units follow the module structure, so the same plan shards a
frozen base (scorer-only training: only the scorers' gradients are reduced) and a trained one (distillation).
Works on any process group, gloo on CPU included.

:func:`checkpoint_layers` trades compute for memory beside the plan: each decoder layer keeps only its inputs for the
backward and runs its forward again there.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed._composable import checkpoint as composable_checkpoint
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from kvpop.retrofit import scorers


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a transformers causal LM laid out like Llama (``<base>.layers``)."""
    base = getattr(model, model.base_model_prefix, None)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no {model.base_model_prefix}.layers: cannot shard it per layer")
    return list(layers)


def shard(model: nn.Module, *, bf16: bool = False) -> nn.Module:
    """Apply the plan in place (the process group must be initialised); returns ``model``."""
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else fp32
    for scorer in scorers(model):
        fully_shard(scorer, mp_policy=fp32)
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=mixed)
    fully_shard(model, mp_policy=mixed)
    return model


def checkpoint_layers(model: nn.Module) -> nn.Module:
    """Activation checkpointing of every decoder layer, in place; returns ``model``. A forward saves each layer's
    inputs only, and the backward runs the layer's forward again (non-reentrant, the random state replayed): the same
    loss and gradients for about one more forward. The retrofitted attention runs inside the layer, so the scorers'
    priorities (collected by :func:`kvpop.objective.student_forward`) keep their gradient, a frozen base's too.

    The hook-based form (``torch.distributed._composable.checkpoint``: names and state dict unchanged) because its
    replay runs the layer's module hooks as well: FSDP2 gathers the layer's parameters for it even when no gradient
    reaches the layer's output (scorer-only: the priorities leave the layer beside it), where a checkpointed
    ``forward`` would replay on the sharded parameters. Train with ``use_cache=False``: the replay of a forward that
    wrote a cache would write it again."""
    for layer in decoder_layers(model):
        composable_checkpoint(layer)
    return model
