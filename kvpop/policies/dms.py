"""DMS: a learned keep/evict decision per (token, KV head), executed when the token leaves the window (kvpop.dms).

``budget`` is ``Budget(sink, window, 0)``: DMS has no fixed long-range slots, each (layer, KV head) keeps what its
gates keep. ``relaxed=True`` is the training form (Gumbel-sigmoid gates, ``log(1 - α)`` attention bias); the hard
form (``relaxed=False``) is what prefill and the cache run. ``threshold`` shifts the hard decision (evict iff
``logit > threshold``): a knob to trade memory after training; ``cap`` (hard form only) another: at most that many
tokens per (layer, KV head), a full head dropping its kept token of the highest logit first (capped DMS,
:func:`kvpop.dms.capped_eviction_positions`). The recency term does not apply (no ranking).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from kvpop.budget import Budget
from kvpop.dms import NEVER, DMSGate, capped_eviction_positions, decision_logits, eviction_positions, relax
from kvpop.policies.base import Policy


@dataclass(frozen=True)
class DMS(Policy):
    relaxed: bool = False
    temperature: float = 0.1
    noise: bool = True  # logistic noise in the relaxed form (off: deterministic relaxation)
    threshold: float = 0.0
    cap: int = 0  # hard form: at most this many tokens per (layer, KV head) (>= sink + window); 0: no cap
    name: ClassVar[str] = "dms"
    ragged: ClassVar[bool] = True

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.budget, Budget) or self.budget.topk != 0:
            raise ValueError(f"dms keeps what its gates keep, no fixed top-k slots: use Budget(sink, window, 0), "
                             f"got {self.budget}")
        if not (isinstance(self.temperature, (int, float)) and self.temperature > 0):
            raise ValueError(f"dms: temperature must be > 0, got {self.temperature!r}")
        if not math.isfinite(self.threshold):
            raise ValueError(f"dms: threshold must be finite, got {self.threshold}")
        floor = self.budget.sink + self.budget.window
        if isinstance(self.cap, bool) or not isinstance(self.cap, int) or not (self.cap == 0 or self.cap >= floor):
            raise ValueError(f"dms: cap holds the sinks and the window: an integer >= sink + window = {floor} (0: no "
                             f"cap), got {self.cap!r}")
        if self.cap and self.relaxed:
            raise ValueError("dms: the cap is a rule of hard decisions (evaluation, decoding), not of the relaxed "
                             "training form")

    def gate_logits(self, layer) -> torch.Tensor:
        """This call's gate logits ``[B, Hkv, C]`` (one per new token), from the layer's DMS gate."""
        gate = getattr(layer.module, "kvpop_scorer", None)
        if not isinstance(gate, DMSGate):
            raise RuntimeError("the dms policy needs DMS gates: retrofit the model with scorer='dms'")
        if gate.window != self.budget.window:
            raise ValueError(f"the DMS gates were trained with window {gate.window}, the policy has "
                             f"{self.budget.window}: use Budget({self.budget.sink}, {gate.window}, 0)")
        return gate.take()

    def eviction_logits(self, layer, valid, positions) -> torch.Tensor:
        """A whole sequence's decisions ``[B, Hkv, N]``: relaxed ``u`` or hard ``z`` (evict iff > 0)."""
        z = decision_logits(self.gate_logits(layer), positions, valid[:, None, :], sink=self.budget.sink,
                            threshold=self.threshold)
        return relax(z, self.temperature, self.noise) if self.relaxed else z

    def attention_inputs(self, decisions, positions) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(kv_evict, log_keep)`` for :func:`kvpop.attention.retention_attention`: the relaxed form keeps every
        token visible with a ``log(1 - α)`` bias past its window; the hard form evicts at ``t + window``."""
        if self.relaxed:
            return torch.full_like(decisions, NEVER, dtype=torch.long), F.logsigmoid(-decisions)
        if self.cap:
            return capped_eviction_positions(decisions, positions, self.budget.sink, self.budget.window, self.cap), None
        return eviction_positions(decisions, positions, self.budget.window), None
