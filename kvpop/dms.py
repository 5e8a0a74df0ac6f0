"""DMS (Dynamic Memory Sparsification) as a learned baseline: gates, delayed eviction, schedule and objective.

DMS (Łańcucki, Staniszewski, Nawrot, Ponti, "Inference-Time Hyper-Scaling with KV Cache Compression",
NeurIPS 2025, arXiv 2506.05345) learns one keep/evict decision per (token, KV head) and executes an eviction
only when the token leaves a sliding window. What follows is the public recipe of NVIDIA Model-Optimizer's
``experimental/dms`` (``dms/core.py``, ``dms/attention.py``, ``dms/attention_prefill.py``,
``dms/training/engine.py``, ``models/qwen3/modeling_qwen3_dms.py``, ``configs/qwen3_8b.yaml``):

* **Gate.** ``logit = scale · W h - offset`` per KV head, ``W`` a linear adapter on the layer's normalised hidden
  state, zero-initialised, ``scale = 100``, ``offset = 5`` (``dms_separate_alpha=True``, ``alpha_per: head``): at
  step 0 every token is kept. NVIDIA applies its own RMSNorm to the residual stream; we read the attention module's
  input, which is that RMSNorm times the layer's norm weight: the same linear functions of the normalised state.
  Why an adapter and not the paper's borrowed query channel: a borrowed channel stops feeding attention, so the
  base model must be retrained before it is itself again; an adapter leaves the frozen base intact, so DMS trains
  in this project's scorer-only mode (base frozen, the gates in ``self_attn.kvpop_scorer``) and in ``distill``
  mode alike, each comparable with KVpop trained the same way at matched training tokens. Unlike a KVpop scorer's
  ``[k; v]``, the gate's input is not detached: in ``distill`` mode its loss reaches the base, as in the paper.
* **Shift by one.** The gate read at token ``t + 1`` decides token ``t`` ("eviction info about i'th token is
  produced by i'th+1 token"); the last token of a sequence has no decision yet and is kept.
* **Delayed eviction.** ``window`` counts the current token, like :class:`kvpop.Budget` (NVIDIA's
  ``window_size`` is ``window - 1``): an evicted token ``t`` is visible to the queries ``t <= d <= t + window - 1``
  and gone after; a kept token, and a sink ``t < sink`` (an extension: DMS itself has none), stays for good. So
  its eviction position (METHOD §1's ``e[t]``) is ``t + window`` or never, and the hard mask is METHOD §1's
  retention rule with these ``e``: :func:`kvpop.retention.retained`.
* **Relaxation (training).** Binary-concrete (Gumbel-sigmoid) gates: ``u = (logit + ε) / τ`` with logistic noise
  ``ε`` (a difference of two Gumbels), ``τ = 0.1``, ``α = σ(u)`` the eviction probability. Every causal token
  stays visible and token ``t`` adds ``log(1 - α_t) = logsigmoid(-u_t)`` to the scores of the queries past its
  window (``d - t >= window``). As ``τ → 0`` without noise this is the hard mask with ``evict = logit > 0``.
* **Schedule and objective.** The compression ratio ``CR = 1 / keep-rate`` grows linearly in steps from 1 to its
  final value (``dms_schedule``), then stays. The loss is the logit distillation plus
  ``max(0, keep-rate - target)`` per sequence (one-sided: keeping fewer tokens than the target is not penalised),
  the keep-rate measured on straight-through hard decisions (``(α > ½) - α.detach() + α``). The distillation is
  this project's top-K KL (:func:`kvpop.losses.topk_kl`, METHOD §3) where NVIDIA uses the full vocabulary.

Memory is ragged: each (layer, KV head) holds its window plus whatever its gates kept, so compare DMS with other
policies at matched *mean* retained tokens and report the peak (:func:`retained_counts`, :func:`matched_total`,
``kvpop.dms_cache``).

**Capped DMS** (ours, issue 43: the comparison at the same reservation). A serving engine reserves a head's peak, so
at matched *peak* memory DMS runs with a cap of ``C`` slots per (layer, KV head): when a head is full, the kept token
(``z <= 0``) past the window with the highest eviction logit goes first (ties: the older). That is METHOD §1's rule
with ``k = C - sink - window`` long-range slots and the static priority ``-z`` — an evicted token (``z > 0``) has
``-inf`` and never holds a slot, and leaves with its window as before — so ``e[t]`` is the smaller of DMS's and that
rule's (:func:`capped_eviction_positions`), a head never holds more than ``C``, and a token once evicted never
returns: the cache reproduces the mask (``kvpop.dms_cache``). The cap is an inference knob of the hard form.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvpop.attention import NEVER  # eviction position of a token kept for good, as in every retention mask
from kvpop.budget import Budget
from kvpop.losses import topk_kl
from kvpop.retention import eviction_positions as ranked_eviction_positions
from kvpop.scorers.base import fp32_region
NO_DECISION = float("-inf")  # decision logit of a token that is never evicted: the last one, sinks, padding


# -----------------------------------------------------------------------------
# the gate: one per attention layer, attached as ``self_attn.kvpop_scorer`` by ``kvpop.retrofit(scorer="dms")``


class DMSGate(nn.Module):
    """Eviction logits ``[B, Hkv, C]`` from the attention module's input hidden states ``[B, C, hidden]``.

    A forward pre-hook on the attention module runs the gate on that module's input and leaves the logits in
    :attr:`pending`; the DMS policy or cache of the same call takes them (:meth:`take`). Float32, like scorers.
    """

    name = "dms"

    def __init__(self, hidden_size: int, num_kv_heads: int, window: int, *, scale: float = 100.0,
                 offset: float = 5.0):
        super().__init__()
        for arg, value in (("hidden_size", hidden_size), ("num_kv_heads", num_kv_heads), ("window", window)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DMSGate: {arg} must be an integer >= 1, got {value!r}")
        if not (math.isfinite(scale) and scale > 0) or not math.isfinite(offset):
            raise ValueError(f"DMSGate: scale must be finite and > 0 and offset finite, got {scale}, {offset}")
        self.hidden_size, self.num_kv_heads, self.window = hidden_size, num_kv_heads, window
        self.scale, self.offset = float(scale), float(offset)
        self.proj = nn.Linear(hidden_size, num_kv_heads, bias=False)
        nn.init.zeros_(self.proj.weight)  # every logit starts at -offset: keep everything (CR 1)
        self.pending: torch.Tensor | None = None

    def forward(self, hidden_states: torch.Tensor, *unexpected, **also_unexpected) -> torch.Tensor:
        if unexpected or also_unexpected:
            raise TypeError("this layer's kvpop_scorer is a DMS gate (retrofit scorer='dms'): it reads hidden states, "
                            "not [k; v]; the kvpop policy needs a model retrofitted with scorer='mlstm', 'mlp', …")
        with fp32_region(hidden_states.device):
            logits = self.proj(hidden_states.float()) * self.scale - self.offset
        return logits.transpose(1, 2)

    def take(self) -> torch.Tensor:
        """The logits the pre-hook computed for the current call (once: a second take is an error)."""
        logits, self.pending = self.pending, None
        if logits is None:
            raise RuntimeError("the DMS gate has no logits for this call: its forward pre-hook did not run "
                               "(retrofit the model with scorer='dms')")
        return logits

    def config_dict(self) -> dict:
        return {"name": self.name, "hidden_size": self.hidden_size, "num_kv_heads": self.num_kv_heads,
                "window": self.window, "scale": self.scale, "offset": self.offset}

    def state_nbytes(self, batch_size: int) -> int:
        """No decode state: a decision needs only the next token's hidden state."""
        return 0

    def extra_repr(self) -> str:
        return f"hidden={self.hidden_size}, kv_heads={self.num_kv_heads}, window={self.window}, scale={self.scale}, " \
               f"offset={self.offset}"


def _run_gate(module, args, kwargs):
    """Forward pre-hook of an attention module: gate its input hidden states for the attention call to take."""
    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    module.kvpop_scorer.pending = module.kvpop_scorer(hidden)


def attach_gates(attention_modules: Sequence[nn.Module], hidden_size: int, num_kv_heads: int, window: int,
                 device=None, **options) -> None:
    """One :class:`DMSGate` per attention module as ``module.kvpop_scorer`` (so training, saving and loading treat
    it as the layer's scorer), plus the pre-hook that feeds it. ``options``: ``scale``, ``offset``."""
    unknown = sorted(set(options) - {"scale", "offset"})
    if unknown:
        raise ValueError(f"unknown DMS gate option(s) {unknown}; known: ['offset', 'scale']")
    for module in attention_modules:
        module.kvpop_scorer = DMSGate(hidden_size, num_kv_heads, window, **options).to(device)
        module.register_forward_pre_hook(_run_gate, with_kwargs=True)


# -----------------------------------------------------------------------------
# decisions and delayed eviction


def decision_logits(gates: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, *, sink: int,
                    threshold: float = 0.0) -> torch.Tensor:
    """``z[..., t] = gates[..., t + 1] - threshold``: evict token ``t`` iff ``z > 0``.

    ``gates [B, Hkv, N]`` (one per token, in order), ``positions``/``valid`` broadcastable to it. Tokens with no
    decision get :data:`NO_DECISION`: the last one (its deciding token has not come), sinks, padding.
    """
    following = F.pad(gates[..., 1:], (0, 1), value=NO_DECISION)
    valid = valid.expand(gates.shape)
    has_next = F.pad(valid[..., 1:], (0, 1), value=False)
    decided = valid & has_next & (positions >= sink)
    return torch.where(decided, following - threshold, NO_DECISION)


def relax(decisions: torch.Tensor, temperature: float, noise: bool = True) -> torch.Tensor:
    """Binary-concrete relaxation ``u = (z + ε) / τ``, ``ε`` logistic (``log U - log(1 - U)``); ``α = σ(u)``."""
    if not temperature > 0:
        raise ValueError(f"the DMS temperature must be > 0, got {temperature}")
    if noise:
        uniform = torch.rand_like(decisions).clamp(1e-6, 1 - 1e-6)
        decisions = decisions + (uniform.log() - (-uniform).log1p())
    return decisions / temperature


def eviction_positions(decisions: torch.Tensor, positions: torch.Tensor, window: int) -> torch.Tensor:
    """METHOD §1's ``e[t]`` for hard decisions: ``t + window`` if evicted (``z > 0``), else :data:`NEVER`."""
    return torch.where(decisions > 0, positions + window, NEVER)


def capped_keep_priority(decisions: torch.Tensor) -> torch.Tensor:
    """The static priority the cap ranks kept tokens by: ``-z`` (the lowest eviction logit is kept longest), ``-inf``
    for a token DMS evicts (``z > 0``: it never holds a long-range slot), ``+inf`` for one with no decision yet."""
    return torch.where(decisions > 0, float("-inf"), -decisions.float())


def capped_eviction_positions(decisions: torch.Tensor, positions: torch.Tensor, sink: int, window: int,
                              cap: int) -> torch.Tensor:
    """``e[t]`` of capped DMS (module docstring): the smaller of :func:`eviction_positions` and METHOD §1's rule with
    ``cap - sink - window`` slots on :func:`capped_keep_priority`. ``decisions [..., N]``, ``positions``
    broadcastable to it and strictly increasing along the last dim (pads and free slots negative, as in
    :func:`kvpop.retention.eviction_positions`)."""
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < sink + window:
        raise ValueError(f"a DMS cap holds the sinks and the window: it must be an integer >= sink + window = "
                         f"{sink + window}, got {cap!r}")
    ranked = ranked_eviction_positions(capped_keep_priority(decisions), Budget(sink, window, cap - sink - window),
                                       positions=positions.expand(decisions.shape))
    return torch.minimum(eviction_positions(decisions, positions, window), ranked)


def retained_counts(query_pos: torch.Tensor, token_pos: torch.Tensor, evict_pos: torch.Tensor,
                    valid: torch.Tensor) -> torch.Tensor:
    """Tokens visible to each query: ``#{t valid: t <= d < e[t]}`` → ``[..., Q]``, in O((N + Q) log N).

    Holds for DMS's eviction positions (``e[t] > t``, sinks never), where visibility is exactly that interval.
    ``token_pos``, ``evict_pos``, ``valid`` ``[..., N]``; ``query_pos`` broadcastable to ``[..., Q]``.
    """
    starts = torch.where(valid, token_pos, NEVER).sort(-1).values
    ends = torch.where(valid, evict_pos, NEVER).sort(-1).values
    queries = query_pos.expand(*starts.shape[:-1], query_pos.shape[-1]).contiguous()
    return torch.searchsorted(starts, queries, right=True) - torch.searchsorted(ends, queries, right=True)


def retained_per_query(decisions: Sequence[torch.Tensor], window: int, *, sink: int = 0,
                       cap: int = 0) -> torch.Tensor:
    """``[L, B, Hkv, S]``: the tokens each query of unpadded sequences sees, from each layer's hard decision logits
    ``[B, Hkv, S]`` (``kvpop.collect_priorities`` of a hard DMS forward): what the DMS cache holds query by query.
    ``cap``: capped DMS's (``sink`` its sink), 0 for none."""
    counts = []
    for z in decisions:
        positions = torch.arange(z.shape[-1], device=z.device)
        evict = capped_eviction_positions(z, positions, sink, window, cap) if cap else \
            eviction_positions(z, positions, window)
        counts.append(retained_counts(positions, positions.expand(z.shape), evict,
                                      torch.ones_like(z, dtype=torch.bool)))
    return torch.stack(counts)


def retained_stats(decisions: Sequence[torch.Tensor], window: int, start: int = 0) -> dict[str, torch.Tensor]:
    """Mean and max retained tokens per (layer, KV head) over the queries ``d >= start`` of unpadded sequences
    (:func:`retained_per_query`). ``{"mean": [L, Hkv] float, "max": [L, Hkv] long}``."""
    counts = retained_per_query(decisions, window)[..., start:]
    return {"mean": counts.float().mean(dim=(1, 3)), "max": counts.amax(dim=(1, 3))}


def matched_total(counts: torch.Tensor, floor: int) -> int:
    """The fixed budget ``B`` that matches DMS's *mean* memory: the mean over the queries ``d >= B`` (the positions
    a fixed-budget evaluation counts at B, where its cache holds exactly B tokens) of the tokens DMS retains there
    equals ``B`` (rounded). ``counts [..., S]`` from :func:`retained_per_query`; ``floor`` = sink + window (DMS
    holds at least that much once it evicts). Found by fixed-point iteration from ``floor``: DMS's occupancy grows
    with ``d`` by at most one token per step, so the iteration only moves up and stops."""
    size = counts.shape[-1]
    total = min(floor, size - 1)
    for _ in range(size):
        following = min(size - 1, max(floor, int(round(float(counts[..., total:].float().mean())))))
        if following == total:
            break
        total = following
    return total


# -----------------------------------------------------------------------------
# the compression schedule and the training objective


@dataclass(frozen=True)
class CompressionSchedule:
    """Target keep-rate by step, as published: ``CR(step) = 1 + (1 / final_keep_rate - 1) · min(step / steps, 1)``
    and ``keep_rate = 1 / CR`` (linear in the compression ratio, not in the keep-rate). ``steps = 0``: the final
    target from the start. ``run_steps``: the run's length, which the anneal must fit in."""

    final_keep_rate: float
    steps: int
    run_steps: int

    def __post_init__(self):
        rate = self.final_keep_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not (0 < rate <= 1):
            raise ValueError(f"the DMS final keep-rate must be in (0, 1] (1 / compression ratio), got {rate!r}")
        for name in ("steps", "run_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"CompressionSchedule.{name} must be an integer >= 0, got {value!r}")
        if self.steps > self.run_steps:
            raise ValueError(f"the DMS schedule anneals over {self.steps} steps but the run has {self.run_steps}: "
                             f"lower the schedule's steps to at most {self.run_steps} (or train longer)")

    def compression(self, step: int) -> float:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        progress = 1.0 if self.steps == 0 else min(step / self.steps, 1.0)
        return 1.0 + (1.0 / self.final_keep_rate - 1.0) * progress

    def keep_rate(self, step: int) -> float:
        return 1.0 / self.compression(step)


def keep_rates(decisions: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per sequence ``[B]``: the fraction of decided (layer, head, token) entries kept, over all layers.

    ``decisions``: each layer's ``[B, Hkv, S]`` logits (relaxed ``u`` in training; :data:`NO_DECISION` where
    undecided). Straight-through: the value counts hard decisions (``u > 0`` evicts), the gradient is that of
    ``1 - σ(u)``. A sequence with no decision keeps everything (1).
    """
    if not decisions:
        raise ValueError("keep_rates needs the decisions of at least one layer (kvpop.collect_priorities)")
    kept, counted = 0.0, 0
    for u in decisions:
        decided = torch.isfinite(u)
        alpha = torch.sigmoid(u)
        evicted = (u > 0).to(alpha.dtype) + alpha - alpha.detach()
        kept = kept + torch.where(decided, 1.0 - evicted, 0.0).sum(dim=(1, 2))
        counted = counted + decided.sum(dim=(1, 2))
    counted = torch.as_tensor(counted)
    return torch.where(counted > 0, kept / counted.clamp(min=1), torch.ones_like(counted, dtype=torch.float32))


def dms_loss(student_logits: torch.Tensor, teacher_topk_logits: torch.Tensor, teacher_topk_indices: torch.Tensor,
             decisions: Sequence[torch.Tensor], step: int, schedule: CompressionSchedule, *,
             mask: torch.Tensor | None = None, keep_weight: float = 1.0) -> tuple[torch.Tensor, dict]:
    """DMS's objective ``KL_topK + keep_weight · mean_b max(0, keep_rate_b - target(step))``; ``(loss, metrics)``.

    ``student_logits [B, S, V]`` from a relaxed DMS forward, ``decisions`` that forward's per-layer relaxed logits
    (``kvpop.collect_priorities``), teacher top-K ``[B, S, K]``, ``mask [B, S]`` the positions the KL counts.
    Metrics are detached tensors: ``loss``, ``kl``, ``keep_loss``, ``keep_rate``, ``target_keep_rate``.
    """
    kl = topk_kl(student_logits, teacher_topk_logits, teacher_topk_indices, mask=mask)
    keep = keep_rates(decisions)
    target = schedule.keep_rate(step)
    keep_loss = F.relu(keep - target).mean()
    loss = kl + keep_weight * keep_loss
    metrics = {"loss": loss.detach(), "kl": kl.detach(), "keep_loss": keep_loss.detach(),
               "keep_rate": keep.detach().mean(), "target_keep_rate": torch.tensor(target)}
    return loss, metrics
