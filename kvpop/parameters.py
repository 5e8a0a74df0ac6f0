"""Which parameters train (METHOD §3): the scorers always, the base model too when it is distilled.

A model without scorers trains only in ``distill`` mode (StreamingLLM+: the base under the streaming mask).

The scorers are found through the module structure that :func:`kvpop.retrofit` built (each attention module's
``kvpop_scorer``), never by matching parameter names, so the selection survives wrappers that rename parameters
(FSDP2's ``fully_shard`` keeps the modules and swaps their parameters for DTensors: call again after sharding to get
those).
"""
from __future__ import annotations

from torch import nn

from kvpop.names import TRAIN_MODES  # also re-exported (kvpop.names says why it lives there)
from kvpop.retrofit import scorers


def trainable_parameters(model: nn.Module, mode: str) -> dict[str, list[nn.Parameter]]:
    """``{"scorers": [...], "base": [...]}`` and freeze everything else: in ``scorer_only`` mode the base model is
    frozen (``base`` is empty), in ``distill`` mode it trains too.

    Sets ``requires_grad`` on every parameter of ``model`` so that exactly the returned ones train.
    """
    if mode not in TRAIN_MODES:
        raise ValueError(f"mode must be one of {TRAIN_MODES}, got {mode!r}")
    scorer_params = list(scorers(model).parameters())
    if not scorer_params and mode == "scorer_only":
        raise ValueError("the model has no scorers to train: retrofit it with scorer='mlstm' (or 'mlp', …) first, "
                         "or train its base (mode='distill')")
    owned = {id(p) for p in scorer_params}
    base = [p for p in model.parameters() if id(p) not in owned]
    for p in scorer_params:
        p.requires_grad_(True)
    for p in base:
        p.requires_grad_(mode == "distill")
    return {"scorers": scorer_params, "base": base if mode == "distill" else []}
