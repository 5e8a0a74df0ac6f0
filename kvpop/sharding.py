"""The FSDP2 plan of a retrofitted decoder (``torch.distributed.fsdp.fully_shard``).

One FSDP unit per scorer, kept in fp32 (compute and gradient reduction: its priorities decide rankings at near-ties),
one per decoder layer and one for the root. With ``bf16`` the layers and the root compute in bf16 and reduce
gradients in fp32, over fp32 master weights. The units follow the module structure, so the same plan shards a
frozen base (scorer-only training: only the scorers' gradients are reduced) and a trained one (distillation).
Works on any process group, gloo on CPU included.
"""
from __future__ import annotations

import torch
from torch import nn
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
