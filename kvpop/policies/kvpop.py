"""KVpop: priorities from the learned per-layer scorer (METHOD §4), attached to each attention module.

``stepwise=True`` computes a sequence's priorities with the scorer's recurrent step instead of its parallel form:
bit-identical to what decoding computes. The two forms agree to ~1e-6 in fp32, which is enough to flip a ranking
at a near-tie; the stepwise mode separates that floating-point effect from real bugs in invariant checks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvpop.policies.base import StaticPolicy


def _scorer(layer):
    scorer = getattr(layer.module, "kvpop_scorer", None)
    if scorer is None:
        raise RuntimeError("the kvpop policy needs scorers: retrofit the model with scorer='mlstm' (or 'mlp', …)")
    return scorer


def _stepwise(scorer, keys, values, valid):
    bsz, hkv, size, _ = keys.shape
    state = scorer.init_state(bsz, keys.device)
    prio = torch.zeros(bsz, hkv, size, device=keys.device)
    for tau in range(size):
        p, state = scorer.step(keys[:, :, tau], values[:, :, tau], state, valid=None if valid is None else valid[:, tau])
        if tau >= scorer.window:
            prio[:, :, tau - scorer.window] = p
    return prio, state


@dataclass(frozen=True)
class KVpop(StaticPolicy):
    stepwise: bool = False
    name: ClassVar[str] = "kvpop"

    def sequence_priorities(self, layer, keys, values, valid, positions):
        if self.stepwise:
            return _stepwise(_scorer(layer), keys, values, valid)[0]
        return _scorer(layer)(keys, values, valid=valid)

    def start(self, layer, keys, values, valid, positions):
        if self.stepwise:
            return _stepwise(_scorer(layer), keys, values, valid)
        return _scorer(layer)(keys, values, valid=valid, return_state=True)

    def step(self, layer, key, value, valid, position, state):
        scorer = _scorer(layer)
        if state is None:
            state = scorer.init_state(key.shape[0], key.device)
        return scorer.step(key, value, state, valid=valid)
