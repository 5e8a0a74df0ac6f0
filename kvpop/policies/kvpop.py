"""KVpop: priorities from the learned per-layer scorer (METHOD §4), attached to each attention module.

``stepwise=True`` computes a sequence's priorities with the scorer's recurrent step instead of its parallel form:
bit-identical to what decoding computes. The two forms agree to ~1e-6 in fp32, which is enough to flip a ranking
at a near-tie; the stepwise mode separates that floating-point effect from real bugs in invariant checks.

With the model's *window attention prior* (``kvpop.set_window_attention_prior``) a token's priority is the scorer's
output plus the ``window_attention`` policy's (its log attention from the queries of its window): the scorers are
trained on top of observed attention and the state holds both parts (the prior's under ``window_attention.``).

The model's *streaming layers* (``kvpop.set_streaming_layers``) skip their scorer: every eligible token gets priority
0, so ties go to the newer (METHOD §1) and the ``topk`` slots hold the newest eligible tokens — with the window, the
``window + topk`` newest tokens, a streaming cache of the same ``B``, in the mask and the cache alike.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvpop.policies.base import StaticPolicy
from kvpop.policies.window_attention import WindowAttention
from kvpop.scorers.base import step_through

PRIOR = "window_attention."  # the prefix of the prior's entries in the policy state (beside the scorer's)


def _scorer(layer):
    scorer = getattr(layer.module, "kvpop_scorer", None)
    if scorer is None:
        raise RuntimeError("the kvpop policy needs scorers: retrofit the model with scorer='mlstm' (or 'mlp', …)")
    return scorer


def _streams(layer) -> bool:
    return layer.layer_idx in layer.runtime.streaming_layers


def _prior(layer, budget):
    """The window attention prior at ``budget`` if the model adds it to its scorers (``set_window_attention_prior``)."""
    return WindowAttention(budget) if layer.runtime.window_attention_prior else None


def _split(state):
    """``(scorer state, prior state)`` of a policy state (``None`` for either that has not started)."""
    if state is None:
        return None, None
    prior = {k[len(PRIOR):]: v for k, v in state.items() if k.startswith(PRIOR)}
    return {k: v for k, v in state.items() if not k.startswith(PRIOR)}, prior or None


def _join(scorer_state, prior_state):
    return {**scorer_state, **{PRIOR + k: v for k, v in (prior_state or {}).items()}}


def _stepwise(scorer, keys, values, valid):
    """Priorities ``[B, Hkv, S]`` of a whole sequence from the recurrent step (the last ``window`` stay 0)."""
    prio, _ = step_through(scorer, keys, values, scorer.init_state(keys.shape[0], keys.device), valid)
    return torch.nn.functional.pad(prio[..., scorer.window:], (0, min(scorer.window, keys.shape[2])))


@dataclass(frozen=True)
class KVpop(StaticPolicy):
    stepwise: bool = False
    name: ClassVar[str] = "kvpop"

    def sequence_priorities(self, layer, keys, values, valid, positions):
        if _streams(layer):
            return super().sequence_priorities(layer, keys, values, valid, positions)
        if self.stepwise:
            prio = _stepwise(_scorer(layer), keys, values, valid)
        else:
            prio = _scorer(layer)(keys, values, valid=valid)
        prior = _prior(layer, self.budget)
        return prio if prior is None else prio + prior.sequence_priorities(layer, keys, values, valid, positions)

    def resume(self, layer, keys, values, valid, positions, state):
        if _streams(layer):
            return super().resume(layer, keys, values, valid, positions, state)

        def scored(scorer, state):
            if self.stepwise:
                return step_through(scorer, keys, values, state, valid)
            return scorer.resume(keys, values, state, valid=valid)

        return self._with_prior(layer, keys, state, scored,
                                lambda prior, s: prior.resume(layer, keys, values, valid, positions, s))

    def step(self, layer, key, value, valid, position, state):
        if _streams(layer):
            return super().step(layer, key, value, valid, position, state)
        return self._with_prior(layer, key, state, lambda scorer, s: scorer.step(key, value, s, valid=valid),
                                lambda prior, s: prior.step(layer, key, value, valid, position, s))

    def _with_prior(self, layer, key, state, scored, prior_scored):
        """The scorer's ``(raw, state)`` from ``scored(scorer, its state)`` plus, with the window attention prior, the
        prior's from ``prior_scored(prior, its state)``; one state dict holds both (:func:`_split`)."""
        scorer = _scorer(layer)
        state, prior_state = _split(state)
        if state is None:
            state = scorer.init_state(key.shape[0], key.device)
        raw, state = scored(scorer, state)
        prior = _prior(layer, self.budget)
        if prior is not None:
            extra, prior_state = prior_scored(prior, prior_state)
            raw = raw + extra
        return raw, _join(state, prior_state)

    def priorities_at(self, layer, positions, num_kv_heads):  # the streaming layers' (the base class's paths)
        return torch.zeros(positions.shape[0], num_kv_heads, positions.shape[-1], device=positions.device)
