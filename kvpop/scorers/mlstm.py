"""KVpop's stateful scorers (METHOD §4): an mLSTM memory per KV head over the tokens' features.

Every token t writes its features into the memory (per KV head: `num_heads` mLSTM heads with their own
q/k/v projections and input/forget gates). The priority of token t is

    p[t] = readout( mLSTM read of the memory after tokens 0..r(t), with token t's own query q_t )
           + mlp(token t's features)

* `mlstm` (delayed, the default): r(t) = t + window — the token is scored when it leaves the protected
  window, with the near future it saw while protected. Parallel form: the mLSTM whose query sequence is
  shifted right by `window` (q'_τ = q_{τ-window}), so output τ belongs to token τ - window. Decoding:
  one recurrent step per token, reading with the query from a ring buffer of the last `window` queries.
* `mlstm_immediate` (ablation): r(t) = t, no shift. Decoding keeps a ring buffer of computed priorities,
  since the cache still asks for the priority of the token leaving the window.

The MLP term makes the stateful scorer a superset of KVpop-mlp.

Tokens that must not write (left padding; the end padding added to reach a multiple of the kernel's
chunk size) get gate pre-activations i = -1e4, f = +1e4: exp(i - m) == 0 and logsigmoid(f) == 0 exactly
in float32, so the memory and its stabiliser m pass through unchanged (finite values: -inf gives NaN in
the chunkwise kernel's max/exp arithmetic).

State (per sequence; NH = num_heads, dqk = qk_dim, dv = v_dim):
    c [Hkv, NH, dqk, dv], n [Hkv, NH, dqk], m [Hkv, NH]   the mLSTM memory (stabilised), float32
    q_ring [Hkv, window, NH, dqk], own_ring [Hkv, window] the last `window` queries and MLP terms (mlstm)
    p_ring [Hkv, window]                                  the last `window` priorities (mlstm_immediate)
    pos int64                                             the call counter
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from mlstm_kernels.torch.backend_module import mLSTMBackend, mLSTMBackendConfig

from kvpop.scorers.base import (PerHeadLinear, PerHeadMLP, Scorer, ScorerConfig, fp32_region, ring_append,
                                ring_from_sequence, ring_leaving, ring_swap)

# Triton's tl.dot rounds float32 inputs to TF32 by default: measured on an H200, the Triton mLSTM kernels then
# disagree with the native ones and with step() by ~3e-3 in priority (IEEE: ~4e-6, and no slower). The choice is
# read when a kernel is compiled and the in-memory kernel cache ignores later changes, so it must be in the
# environment before the first mLSTM kernel compiles: set it at import (an explicit user setting wins).
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

NO_WRITE_I = -1e4  # input-gate pre-activation of a token that must not write
NO_WRITE_F = 1e4  # forget-gate pre-activation of a token that must not write (keep everything)

# kernel names per device kind (the defaults are Triton, which does not run on CPU)
KERNELS = {
    "native": dict(chunkwise_kernel="chunkwise--native_autograd", sequence_kernel="native_sequence__native",
                   step_kernel="native"),
    "cuda": dict(sequence_kernel="native_sequence__triton", step_kernel="triton"),  # + config.cuda_chunkwise_kernel
}


@dataclass(frozen=True)
class MLSTMConfig(ScorerConfig):
    num_heads: int = 1  # mLSTM heads per KV head
    qk_dim: int = 32  # per mLSTM head (Triton kernels want >= 16)
    v_dim: int = 32
    mlp_hidden: int = 64  # the per-token MLP term
    read_norm_eps: float = 1.0  # RMS norm of the read: h / sqrt(mean(h^2) + eps); see _priority
    gate_soft_cap: float = 15.0  # cap * tanh(x / cap) on gate pre-activations, as in xLSTM-7B: keeps m bounded
    forget_bias_min: float = 3.0  # forget-gate biases start spread over [min, max] across heads:
    forget_bias_max: float = 6.0  # memory time scales of ~20..400 tokens
    chunk_size: int = 64  # chunkwise kernel; sequences are padded to a multiple of it
    eps: float = 1e-6  # mLSTM denominator eps (the same in the chunkwise and the step kernel)
    cuda_chunkwise_kernel: str = "chunkwise--triton_limit_chunk"


class MLSTMScorer(Scorer):
    name = "mlstm"
    config_class = MLSTMConfig
    delayed = True  # read token t at t + window (False: at t)

    def __init__(self, num_kv_heads: int, head_dim: int, window: int, config: MLSTMConfig = MLSTMConfig()):
        super().__init__(num_kv_heads, head_dim, window, config)
        H, NH, dqk, dv = num_kv_heads, config.num_heads, config.qk_dim, config.v_dim
        # one projection per KV head to every mLSTM head's q, k, v and gate pre-activations
        self.proj = PerHeadLinear(H, self.in_features, NH * (2 * dqk + dv + 2))
        with torch.no_grad():
            f_bias = torch.linspace(config.forget_bias_min, config.forget_bias_max, H * NH).view(H, NH)
            self.proj.bias[:, -NH:] = f_bias
        self.readout = PerHeadLinear(H, NH * dv, 1)
        self.own = PerHeadMLP(H, self.in_features, config.mlp_hidden)
        self._backends: dict[str, mLSTMBackend] = {}  # built lazily per device kind; they hold no parameters

    # --- pieces shared by forward() and step()

    def _backend(self, device: torch.device) -> mLSTMBackend:
        kind = "cuda" if device.type == "cuda" else "native"
        if kind not in self._backends:
            kernels = dict(KERNELS[kind])
            if kind == "cuda":
                kernels["chunkwise_kernel"] = self.config.cuda_chunkwise_kernel
            # float32 everywhere, so that step() and forward() agree to float32 precision
            self._backends[kind] = mLSTMBackend(mLSTMBackendConfig(
                **kernels, mode="train", chunk_size=self.config.chunk_size, return_last_states=True,
                autocast_kernel_dtype="float32", inference_state_dtype="float32", eps=self.config.eps))
        return self._backends[kind]

    def _project(self, x: torch.Tensor, valid: torch.Tensor | None):
        """x [B, H, S, 2D] -> q, k [B, H, NH, S, dqk], v [B, H, NH, S, dv], i, f [B, H, NH, S]."""
        B, H, S, _ = x.shape
        NH, dqk, dv = self.config.num_heads, self.config.qk_dim, self.config.v_dim
        y = self.proj(x).view(B, H, S, NH, 2 * dqk + dv + 2).transpose(2, 3)
        q, k, v, i, f = y.split([dqk, dqk, dv, 1, 1], dim=-1)
        cap = self.config.gate_soft_cap
        i, f = cap * torch.tanh(i[..., 0] / cap), cap * torch.tanh(f[..., 0] / cap)
        if valid is not None:  # padding does not write
            writes = valid.bool()[:, None, None, :]
            i = torch.where(writes, i, NO_WRITE_I)
            f = torch.where(writes, f, NO_WRITE_F)
        return q, k, v, i, f

    def _priority(self, h: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
        """mLSTM reads h [B, H, NH, S, dv] and MLP terms [B, H, S] -> priorities [B, H, S]."""
        B, H, NH, S, dv = h.shape
        # Per mLSTM head, without parameters (the readout's weights give the scale). It tames large reads (the
        # mLSTM denominator can be much smaller than the numerator when q.k changes sign across tokens), but with
        # eps = 1 it does not blow up small ones: a tiny eps would amplify the rounding error of a read that
        # cancels to ~0.05 twenty-fold, and step() and forward() would differ by ~2e-5.
        h = F.rms_norm(h, (dv,), eps=self.config.read_norm_eps)
        return self.readout(h.transpose(2, 3).reshape(B, H, S, NH * dv)).squeeze(-1) + own

    # --- the contract

    def forward(self, keys, values, valid=None, return_state=False):
        B, H, S, _ = keys.shape
        NH, W, L = self.config.num_heads, self.window, self.config.chunk_size
        with fp32_region(keys.device):
            x = self.features(keys, values, valid)
            own = self.own(x)  # [B, H, S]
            q, k, v, i, f = self._project(x, valid)

            # Sequence for the kernel: the S tokens, then `shift` read-only positions (so that the last
            # tokens also get a read, with the memory after the whole sequence), then no-write padding up to
            # a multiple of the chunk size. Queries move right by `shift`: position τ reads for token τ - shift.
            shift = W if self.delayed else 0
            T = -(-(S + shift) // L) * L
            q_read = F.pad(q, (0, 0, shift, T - S - shift))
            k, v = F.pad(k, (0, 0, 0, T - S)), F.pad(v, (0, 0, 0, T - S))
            i, f = F.pad(i, (0, T - S), value=NO_WRITE_I), F.pad(f, (0, T - S), value=NO_WRITE_F)

            flat = lambda t: t.reshape(B, H * NH, *t.shape[3:]).contiguous()  # kernel heads = (KV head, mLSTM head)
            h, (c, n, m) = self._backend(keys.device)(flat(q_read), flat(k), flat(v), flat(i), flat(f),
                                                      return_last_states=True, mode="train")
            h = h.view(B, H, NH, T, -1)[:, :, :, shift:shift + S]  # the read of token t
            p = self.with_head_recency(self._priority(h, own), torch.arange(S, device=keys.device).expand(B, S))
        if not return_state:
            return p
        # No-write padding leaves (c, n, m) as they were after the last real token. clone(): the kernel returns
        # views into its per-chunk states, which a cache would otherwise keep alive.
        c, n, m = c.clone().view(B, H, NH, *c.shape[2:]), n.clone().view(B, H, NH, -1), m.clone().view(B, H, NH)
        state = {"c": c, "n": n, "m": m,
                 "pos": torch.full((B,), S, dtype=torch.long, device=keys.device)}
        if self.delayed:
            state["q_ring"] = ring_from_sequence(q.transpose(2, 3), W)  # [B, H, W, NH, dqk]
            state["own_ring"] = ring_from_sequence(own, W)
        else:
            state["p_ring"] = ring_from_sequence(p, W)
        return p, state

    def init_state(self, batch_size, device):
        B, H, W = batch_size, self.num_kv_heads, self.window
        NH, dqk, dv = self.config.num_heads, self.config.qk_dim, self.config.v_dim
        state = {"c": torch.zeros(B, H, NH, dqk, dv, device=device),
                 "n": torch.zeros(B, H, NH, dqk, device=device),
                 "m": torch.zeros(B, H, NH, device=device),  # the chunkwise kernel's m_initial is 0 too
                 "pos": torch.zeros(B, dtype=torch.long, device=device)}
        if self.delayed:
            state["q_ring"] = torch.zeros(B, H, W, NH, dqk, device=device)
            state["own_ring"] = torch.zeros(B, H, W, device=device)
        else:
            state["p_ring"] = torch.zeros(B, H, W, device=device)
        return state

    def step(self, key, value, state, valid=None):
        B, H, _ = key.shape
        NH = self.config.num_heads
        pos = state["pos"]
        with fp32_region(key.device):
            valid_seq = None if valid is None else valid[:, None]
            x = self.features(key[:, :, None], value[:, :, None], valid_seq)
            own = self.own(x)[:, :, 0]  # [B, H]
            q, k, v, i, f = (t[:, :, :, 0] for t in self._project(x, valid_seq))  # drop the S=1 axis
            new_state = {"pos": pos + 1}
            if self.delayed:  # read with the query of the token leaving the window; remember this token's
                q, new_state["q_ring"] = ring_swap(state["q_ring"], pos, q)
                own, new_state["own_ring"] = ring_swap(state["own_ring"], pos, own)

            flat = lambda t: t.reshape(B, H * NH, *t.shape[3:]).contiguous()
            # under torch.compile the native (pure torch) step kernel fuses with everything around it
            device = torch.device("cpu") if torch.compiler.is_compiling() else key.device
            h, (c, n, m) = self._backend(device).step_kernel_fn(
                q=flat(q), k=flat(k), v=flat(v), i=flat(i)[..., None], f=flat(f)[..., None],
                c=flat(state["c"]), n=flat(state["n"]), m=flat(state["m"])[..., None],
                eps=self.config.eps, dtype_state=torch.float32)
            p = self._priority(h.view(B, H, NH, 1, -1), own[:, :, None])[:, :, 0]  # [B, H]
            p = self.with_head_recency(p, pos - self.window if self.delayed else pos)  # the token p belongs to
            if not self.delayed:  # this token's priority goes in; the one leaving the window comes out
                p, new_state["p_ring"] = ring_swap(state["p_ring"], pos, p)
        new_state.update(c=c.view(B, H, NH, *c.shape[2:]), n=n.view(B, H, NH, -1), m=m.view(B, H, NH))
        return p, new_state

    def resume(self, keys, values, state, valid=None):
        """The chunkwise kernel started from the state's memory; the delayed reads take their queries from the
        ring (tokens before the chunk) and from the chunk itself."""
        B, H, C, _ = keys.shape
        NH, L = self.config.num_heads, self.config.chunk_size
        pos = state["pos"]
        with fp32_region(keys.device):
            x = self.features(keys, values, valid)
            own = self.own(x)  # [B, H, C]
            q, k, v, i, f = self._project(x, valid)
            new_state = {"pos": pos + C}
            if self.delayed:  # call τ reads token τ - window with that token's query
                q_seq = q.transpose(2, 3)  # [B, H, C, NH, dqk]
                q = ring_leaving(state["q_ring"], pos, q_seq).transpose(2, 3)
                new_state["q_ring"] = ring_append(state["q_ring"], pos, q_seq)
                own, new_state["own_ring"] = ring_leaving(state["own_ring"], pos, own), ring_append(
                    state["own_ring"], pos, own)
            T = -(-C // L) * L  # no-write padding up to a multiple of the chunk size; its reads are dropped
            q, k, v = (F.pad(t, (0, 0, 0, T - C)) for t in (q, k, v))
            i, f = F.pad(i, (0, T - C), value=NO_WRITE_I), F.pad(f, (0, T - C), value=NO_WRITE_F)
            flat = lambda t: t.reshape(B, H * NH, *t.shape[3:]).contiguous()  # noqa: E731
            h, (c, n, m) = self._backend(keys.device)(
                flat(q), flat(k), flat(v), flat(i), flat(f), c_initial=flat(state["c"]), n_initial=flat(state["n"]),
                m_initial=flat(state["m"])[..., None], return_last_states=True, mode="train")
            p = self._priority(h.view(B, H, NH, T, -1)[:, :, :, :C], own)
            first = pos - self.window if self.delayed else pos  # the token of the chunk's first read
            p = self.with_head_recency(p, first[:, None] + torch.arange(C, device=keys.device))
        if not self.delayed:  # the chunk's priorities go in; those of the tokens leaving the window come out
            p, new_state["p_ring"] = ring_leaving(state["p_ring"], pos, p), ring_append(state["p_ring"], pos, p)
        new_state.update(c=c.clone().view(B, H, NH, *c.shape[2:]), n=n.clone().view(B, H, NH, -1),
                         m=m.clone().view(B, H, NH))
        return p, new_state


class MLSTMImmediateScorer(MLSTMScorer):
    """Ablation: the same model, token t read at t instead of t + window."""
    name = "mlstm_immediate"
    delayed = False
