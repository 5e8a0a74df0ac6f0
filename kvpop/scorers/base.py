"""The scorer contract (METHOD §4) and the small pieces every scorer is built from.

A scorer covers ONE attention layer and ALL of its KV heads, with separate weights per KV head
(batched: parameters shaped [Hkv, in, out]). It maps each token's detached `[k; v]` to a static
priority `p[t]`, which the cache reads once, when `t` leaves the protected window (query position
`t + window`, METHOD §1).

Two equivalent paths:

* `forward(keys, values, valid)` scores a whole sequence at once (training, prefill).
* `step(key, value, state, valid)` takes the token of call τ (counting from 0) and returns the
  priority of token τ - window, the one that leaves the window now (decoding).

* `resume(keys, values, state, valid)` continues from a state with a chunk of C calls at once and
  returns what those C calls of step() return (chunked prefill: memory bounded by the chunk, not S).

Contract: `forward(...)[..., t] == step(...)` at call τ = t + window, for every t <= S-1-window, and
`resume(...) == ` the C steps it replaces. Tokens t > S-1-window have not been read yet: forward still
returns finite priorities for them (stateful scorers read them with the memory after the last token),
but callers must not use them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

State = dict[str, torch.Tensor]  # every tensor has the batch on dim 0, so a cache can index / reorder it


# -----------------------------------------------------------------------------
# configs: frozen dataclasses of hyperparameters, saved and loaded as plain dicts


# what a scorer sees of each token (see token_features)
FEATURE_SETS = ("kv", "kv_norms")


# the unit of a learned per-head recency term: its parameter is the priority a token loses per this many tokens of age
HEAD_RECENCY_UNIT = 256.0


@dataclass(frozen=True)
class ScorerConfig:
    norm_eps: float = 1e-6  # eps of the parameter-free RMS norms
    features: str = "kv"  # kv: [rms(k); rms(v)]; kv_norms: also the log RMS of k and of v that the norm removes
    head_recency: bool = False  # a learned recency term per KV head in the output (see Scorer.with_head_recency)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "ScorerConfig":
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown {cls.__name__} field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**values)


# -----------------------------------------------------------------------------
# the interface


class Scorer(nn.Module, ABC):
    name: ClassVar[str]
    config_class: ClassVar[type[ScorerConfig]]

    def __init__(self, num_kv_heads: int, head_dim: int, window: int, config: ScorerConfig):
        super().__init__()
        for arg, value in (("num_kv_heads", num_kv_heads), ("head_dim", head_dim), ("window", window)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{type(self).__name__}: {arg} must be an integer >= 1, got {value!r}")
        if not isinstance(config, self.config_class):
            raise TypeError(f"{type(self).__name__} needs a {self.config_class.__name__}, got {type(config).__name__}")
        if config.features not in FEATURE_SETS:
            raise ValueError(f"{type(self).__name__}: features must be one of {FEATURE_SETS}, got {config.features!r}")
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.window = window
        self.config = config
        self.in_features = 2 * head_dim + (2 if config.features == "kv_norms" else 0)
        if config.head_recency:  # λ_h = head_recency[h] / HEAD_RECENCY_UNIT; 0 at init: the scorer without it
            self.head_recency = nn.Parameter(torch.zeros(num_kv_heads))

    def features(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """[B, H, S, D] keys and values -> [B, H, S, in_features] float32 token features (see token_features)."""
        return token_features(keys, values, valid, self.config.norm_eps, norms=self.config.features == "kv_norms")

    def with_head_recency(self, priority: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """``priority`` [B, H, S] of the tokens with call indices ``index`` [B, S] (or [B] for S = 1 squeezed:
        priority [B, H]) plus ``λ_h · index`` with the learned per-head λ_h (``config.head_recency``; else
        unchanged). METHOD §4: the policy's recency term (§3) with one λ per KV head, learned with the scorer. The
        call index, not the position: under left padding the two differ by a constant per row, and priorities are
        only ever compared within a row and head, so the ranking is the same; forward(), step() and resume() all
        count calls, so they agree."""
        if not self.config.head_recency:
            return priority
        rate = self.head_recency.float() / HEAD_RECENCY_UNIT  # [H]
        if priority.dim() == 2:
            return priority + rate[None, :] * index.to(priority.dtype)[:, None]
        return priority + rate[None, :, None] * index.to(priority.dtype)[:, None, :]

    def config_dict(self) -> dict[str, Any]:
        """Everything needed to rebuild this scorer: `build_scorer(**scorer.config_dict())`."""
        return {"name": self.name, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "window": self.window, **self.config.to_dict()}

    @abstractmethod
    def forward(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor | None = None,
                return_state: bool = False) -> torch.Tensor | tuple[torch.Tensor, State]:
        """keys, values [B, Hkv, S, D]; valid [B, S] bool (False = left padding, ignored).

        Returns priorities [B, Hkv, S] float32, and with `return_state` the decode state after the
        whole sequence (step() continues from it exactly as if the sequence had been stepped)."""

    @abstractmethod
    def init_state(self, batch_size: int, device: torch.device | str) -> State:
        """The decode state before the first token."""

    @abstractmethod
    def step(self, key: torch.Tensor, value: torch.Tensor, state: State,
             valid: torch.Tensor | None = None) -> tuple[torch.Tensor, State]:
        """key, value [B, Hkv, D] of call τ; valid [B] bool. Returns (priority of token τ - window
        [B, Hkv] float32, new state). For τ < window the priority is finite but meaningless.
        Padding calls (valid=False) still advance the call counter, like positions in forward()."""

    def resume(self, keys: torch.Tensor, values: torch.Tensor, state: State,
               valid: torch.Tensor | None = None) -> tuple[torch.Tensor, State]:
        """keys, values [B, Hkv, C, D]: C calls from `state` at once; valid [B, C]. Returns (priorities
        [B, Hkv, C] of the tokens leaving the window at each call, new state) — exactly `step_through`.
        This default steps; scorers override it with their parallel form."""
        return step_through(self, keys, values, state, valid)

    def state_nbytes(self, batch_size: int) -> int:
        """Bytes of decode state for `batch_size` sequences: fixed, whatever the number of steps."""
        state = self.init_state(batch_size, torch.device("meta"))
        return sum(t.numel() * t.element_size() for t in state.values())

    def extra_repr(self) -> str:
        return f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, window={self.window}, {self.config}"


# -----------------------------------------------------------------------------
# building blocks


def fp32_region(device: torch.device) -> contextlib.AbstractContextManager:
    """Scorers compute in float32 even when the model runs under bf16 autocast (priorities are compared
    across thousands of tokens; the retention loss is a difference of priorities)."""
    return torch.autocast(device_type=device.type, enabled=False)


def token_features(keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor | None, eps: float,
                   norms: bool = False) -> torch.Tensor:
    """[B, H, S, D] keys and values -> [B, H, S, 2D] float32 features `[rms(k); rms(v)]`, detached (METHOD §4,
    features).

    Detached: the retention loss trains only the scorer (METHOD §3). RMS-normalised separately, without
    parameters: key and value scales vary by orders of magnitude across layers. `norms` appends
    `log RMS(k), log RMS(v)` ([B, H, S, 2D + 2]): the scale the normalisation removes is what sets a key's
    attention logits (q·k grows with |k|), so within one layer and head it is informative. Padding tokens
    become 0, with masked_fill rather than a product, so that garbage (even NaN) there cannot leak."""
    keys, values = keys.detach().float(), values.detach().float()
    k = F.rms_norm(keys, (keys.shape[-1],), eps=eps)
    v = F.rms_norm(values, (values.shape[-1],), eps=eps)
    parts = [k, v]
    if norms:
        parts += [0.5 * (t.square().mean(-1, keepdim=True) + eps).log() for t in (keys, values)]
    x = torch.cat(parts, dim=-1)
    if valid is not None:
        x = x.masked_fill(~valid.bool()[:, None, :, None], 0.0)
    return x


class PerHeadLinear(nn.Module):
    """One independent linear map per KV head: x [B, H, S, in] -> [B, H, S, out]."""

    def __init__(self, num_heads: int, in_features: int, out_features: int):
        super().__init__()
        # std 1/sqrt(in): unit-scale outputs for unit-scale inputs, so the initial priorities are spread
        self.weight = nn.Parameter(torch.randn(num_heads, in_features, out_features) / math.sqrt(in_features))
        self.bias = nn.Parameter(torch.zeros(num_heads, out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # .float(): a no-op for the float32 weights a scorer keeps, a guard when a whole model is cast to bf16
        return torch.einsum("bhsi,hio->bhso", x, self.weight.float()) + self.bias.float()[:, None, :]

    def extra_repr(self) -> str:
        heads, fan_in, fan_out = self.weight.shape
        return f"heads={heads}, in={fan_in}, out={fan_out}"


class PerHeadMLP(nn.Module):
    """Two-layer GELU MLP per KV head with a scalar output: x [B, H, S, in] -> [B, H, S]."""

    def __init__(self, num_heads: int, in_features: int, hidden: int):
        super().__init__()
        self.fc = PerHeadLinear(num_heads, in_features, hidden)
        self.out = PerHeadLinear(num_heads, hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x))).squeeze(-1)


# -----------------------------------------------------------------------------
# ring buffers of the last `window` per-token entries, used by step()
# Token t lives in slot t % window; every tensor is [B, H, window, *E].


def ring_from_sequence(values: torch.Tensor, window: int) -> torch.Tensor:
    """[B, H, S, *E] per-token values -> the ring after tokens 0..S-1 (slots of tokens < 0 are zero)."""
    B, H, S = values.shape[:3]
    last = values[:, :, -window:]
    if S < window:
        last = torch.cat([last.new_zeros(B, H, window - S, *values.shape[3:]), last], dim=2)
    # last[:, :, j] is token S - window + j, whose slot is (S + j) % window
    return torch.roll(last, shifts=S % window, dims=2)


def ring_swap(ring: torch.Tensor, pos: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """At call `pos` [B]: return the entry of token pos - window and the ring with token pos's `new`
    [B, H, *E] in its place. Out of place, so a caller's old state stays valid."""
    B, H, window = ring.shape[:3]
    trailing = ring.shape[3:]
    index = (pos % window).view(B, 1, 1, *([1] * len(trailing))).expand(B, H, 1, *trailing)
    old = ring.gather(2, index).squeeze(2)
    return old, ring.scatter(2, index, new.unsqueeze(2).to(ring.dtype))


def ring_ordered(ring: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The entries of tokens pos - window … pos - 1, oldest first, from the ring after `pos` [B] calls."""
    B, H, window = ring.shape[:3]
    trailing = ring.shape[3:]
    index = (pos[:, None] + torch.arange(window, device=ring.device)) % window  # token pos - window + j
    index = index.view(B, 1, window, *([1] * len(trailing))).expand(B, H, window, *trailing)
    return ring.gather(2, index)


def ring_leaving(ring: torch.Tensor, pos: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """What C calls of `ring_swap` from call `pos` with entries `new` [B, H, C, *E] hand out, in order: the
    entries of tokens pos - window … pos + C - 1 - window."""
    return torch.cat([ring_ordered(ring, pos), new.to(ring.dtype)], dim=2)[:, :, :new.shape[2]]


def ring_append(ring: torch.Tensor, pos: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """The ring after C calls from call `pos` wrote `new` [B, H, C, *E] (out of place)."""
    B, H, window = ring.shape[:3]
    trailing = ring.shape[3:]
    last = torch.cat([ring_ordered(ring, pos), new.to(ring.dtype)], dim=2)[:, :, -window:]  # tokens pos+C-window…
    index = (pos[:, None] + new.shape[2] + torch.arange(window, device=ring.device)) % window
    index = index.view(B, 1, window, *([1] * len(trailing))).expand(B, H, window, *trailing)
    return torch.empty_like(ring).scatter_(2, index, last)


def step_through(scorer: Scorer, keys: torch.Tensor, values: torch.Tensor, state: State,
                 valid: torch.Tensor | None = None) -> tuple[torch.Tensor, State]:
    """C calls of `scorer.step`: (priorities [B, Hkv, C] they return, final state) — the reference every
    `resume` is held to, and bit-identical to decoding."""
    out = []
    for i in range(keys.shape[2]):
        p, state = scorer.step(keys[:, :, i], values[:, :, i], state, valid=None if valid is None else valid[:, i])
        out.append(p)
    return torch.stack(out, dim=-1), state
