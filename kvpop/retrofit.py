"""``kvpop.retrofit(model, budget, scorer=...)``: KVpop on a stock transformers decoder, no forked modeling code.

Retrofitting attaches one scorer per global attention layer (``self_attn.kvpop_scorer``; a model's own local,
sliding-window layers keep their window and get none: :mod:`kvpop.local_layers`), a shared :class:`Runtime`, and
switches the model's attention implementation to ``"kvpop"`` through transformers' ``AttentionInterface`` and
``AttentionMaskInterface`` registries. ``save_retrofitted`` / ``load_retrofitted`` round-trip it through a plain
folder: ``kvpop.json`` and ``kvpop_scorers.safetensors``, plus either the base model as transformers saves it (format 1)
or, when the base weights did not change (scorer-only training), the base model's identity instead of a second copy
of the weights (format 2): a portable artifact.

**The base of a scorer-only folder** is named by identity, never by a machine's path: ``kvpop.json``'s ``base`` holds
``tensors_sha256`` (:func:`kvpop.files.tensors_digest`, the weights' values: a base converted by another transformers
version with the same tensors matches), ``model_type``, ``architectures``, the folder's ``name`` (for messages) and
``weights_sha256`` (:func:`kvpop.files.weights_digest`, the file bytes, which stored targets are keyed by). Loading
takes the base folder as an argument and refuses one whose tensors differ, in one line naming the digest expected and
the digest found. Folders written before (a ``base.path`` and ``weights_sha256`` only) still load: from ``base=`` or
else their recorded path, checked against their file digest.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import shutil
import types
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from kvpop.allocation import ALLOCATION_FILE, Allocation, AllocationError, load_allocation, save_allocation
from kvpop.attention import kvpop_attention_forward, passthrough_mask
from kvpop.budget import Budget
from kvpop.cache import CACHE_KWARG, KVpopCache
from kvpop.dms import DMSGate, attach_gates
from kvpop.files import model_identity, sha256_file, tensors_digest, weights_digest
from kvpop.local_layers import layer_windows
from kvpop.decode import chunk_bounds, padded_positions, prefill
from kvpop.policies import Policy, build_policy
from kvpop.scorers import build_scorer

ATTN_NAME = "kvpop"
FORMAT_VERSION = 1  # base weights + scorers in one folder
SCORER_ONLY_FORMAT_VERSION = 2  # scorers + the base model's identity (its tensors' and files' digests)
CONFIG_FILE = "kvpop.json"
SCORERS_FILE = "kvpop_scorers.safetensors"


@dataclass
class Runtime:
    """Shared by every attention module of one retrofitted model."""

    policy: Policy
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    base_attn_implementation: str
    scorer_spec: dict | None = None  # {"name": ..., **options}
    oracle: torch.Tensor | None = None  # [layers, B, Hkv, S] teacher targets for the oracle policy
    collected: dict | None = None  # layer -> ranked priorities (with grad) of the last forward
    pending: dict = field(default_factory=dict)  # layer -> cache layer whose update awaits its attention call
    checked_padding: tuple | None = None  # (padding mask, cache meter) a cache layer has validated in this forward
    compile_decode: bool = False  # torch.compile each layer's decoding step (fuses ~100 small kernels per layer)
    # torch.compile each layer's chunk bookkeeping (ranking, candidates, eviction positions, block structure, the
    # store) in the fused prefill on CUDA (kvpop.cache: a chunk of the cache's prefill_chunk columns); CPU ignores it
    compile_prefill: bool = False
    # generate() feeds a longer prompt in chunks of this many columns, each compressed into the B slots before the
    # next (bounded prefill: K/V memory peaks at B + chunk per layer, not at the prompt's length)
    prefill_chunk: int = 2048
    # layers whose scorer the kvpop policy leaves unused: their long-range slots go to the newest eligible tokens, a
    # streaming cache of the same B (set_streaming_layers; saved in kvpop.json)
    streaming_layers: frozenset[int] = frozenset()
    # the kvpop policy adds the window_attention policy's priority (observed attention) to the scorers' output: the
    # scorers then learn what observed attention misses (set_window_attention_prior; saved in kvpop.json)
    window_attention_prior: bool = False
    # training form of the static policies' one-pass forward (soft_retention): the retention rule relaxed with this
    # temperature, so that a loss on the logits reaches the scorers through the mask (METHOD §3, KL through the mask)
    soft_tau: float | None = None
    soft_relative: bool = False  # soft_tau times each row's priority spread (kvpop.attention.soft_temperature)
    # per layer, the base's own window (kvpop.local_layers.layer_windows): None = global, W = a local layer that keeps
    # exactly its sliding window of W tokens whatever the policy (no scorer, no budget)
    layer_windows: tuple = ()
    # the allocation the policy's per-head budgets come from (METHOD §7), with its provenance: saved with the model
    allocation: Allocation | None = None

    @property
    def evicting_layers(self) -> tuple[int, ...]:
        """The global layers, which the policy's budget bounds (all layers unless the model has local ones)."""
        if not self.layer_windows:
            return tuple(range(self.num_layers))
        return tuple(i for i, window in enumerate(self.layer_windows) if window is None)

    def layer_topk(self, layer_idx: int, policy: Policy | None = None) -> tuple[int, ...] | None:
        """Long-range slots per KV head of layer ``layer_idx`` under per-head budgets (METHOD §7; ``policy`` default
        the model's), or ``None``: every head at the policy's ``budget.topk`` (and a local layer at its own window)."""
        own = self.layer_policy(layer_idx, policy)
        if own.head_topk is None:
            return None
        return own.layer_topk(self.evicting_layers.index(layer_idx))

    def layer_policy(self, layer_idx: int, policy: Policy | None = None) -> Policy:
        """The policy layer ``layer_idx`` runs: ``policy`` (default the model's) in a global layer; in a local one
        its own sliding window, as the base has it — a streaming policy of ``Budget(0, W, 0)``."""
        window = self.layer_windows[layer_idx] if self.layer_windows else None
        if window is None:
            return policy if policy is not None else self.policy
        return _local_policy(window)


@functools.cache
def _local_policy(window: int) -> Policy:
    return build_policy("streaming", Budget(0, window, 0))


def _register() -> None:
    AttentionInterface.register(ATTN_NAME, kvpop_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, passthrough_mask)


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention modules, in layer order; a clear error when they cannot be found."""
    found = {}
    for name, module in model.named_modules():
        if (isinstance(getattr(module, "layer_idx", None), int) and hasattr(module, "k_proj")
                and hasattr(module, "v_proj") and name.endswith("attn")):
            found[module.layer_idx] = module
    layers = getattr(model.config, "num_hidden_layers", None)
    if not found or layers is None or sorted(found) != list(range(layers)):
        raise ValueError(
            f"could not find one self-attention module per layer with k_proj/v_proj and layer_idx in "
            f"{type(model).__name__} (found layers {sorted(found)}, config says {layers}). KVpop retrofits decoders "
            f"whose attention follows transformers' Llama layout (Llama, Qwen2/3, Mistral, SmolLM, …).")
    return [found[i] for i in range(layers)]


def _shape(model: nn.Module) -> tuple[int, int, int, int]:
    cfg = model.config
    heads = getattr(cfg, "num_attention_heads", None)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    if not heads or not kv_heads or heads % kv_heads:
        raise ValueError(f"{type(model).__name__}: cannot read the KV heads from its config "
                         f"(num_attention_heads={heads}, num_key_value_heads={kv_heads})")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, heads, kv_heads, head_dim


def retrofit(model: nn.Module, budget: Budget | None, scorer: str | None = "mlstm", policy: str | Policy = "kvpop",
             *, recency: float = 0.0, anchor_share: float = 0.0, anchor_recency: float = 0.0,
             scorer_options: dict | None = None, allocation: Allocation | None = None) -> nn.Module:
    """Attach scorers and switch attention to KVpop, in place; returns the model.

    ``policy`` names one of :data:`kvpop.policies.POLICIES` (or is a Policy); ``scorer=None`` attaches none (for
    baselines). The scorers are float32 and on the model's device; their inputs are detached. ``allocation``
    (:class:`kvpop.allocation.Allocation`, METHOD §7): per-head budgets for a static policy; ``budget`` must then be
    its uniform budget (or ``None``: the allocation's), and its shape the model's evicting layers × KV heads.
    """
    layers = attention_modules(model)
    num_layers, heads, kv_heads, head_dim = _shape(model)
    windows = layer_windows(model.config)  # refuses, in one line, an attention pattern it cannot read
    if allocation is not None:
        budget = _allocation_budget(allocation, budget)
    if budget is not None:
        context = getattr(model.config, "max_position_embeddings", None)
        largest = budget.total if allocation is None else allocation.peak_budget
        if context is not None and largest > context:
            raise ValueError(f"budget {budget} holds up to {largest} tokens per head, more than the model's context "
                             f"of {context}: lower topk (or window) so that sink + window + topk <= {context}")
    pol = policy if isinstance(policy, Policy) else build_policy(
        policy, budget, recency=recency, anchor_share=anchor_share, anchor_recency=anchor_recency,
        **({} if allocation is None else {"head_topk": allocation.head_topk()}))
    if pol.name == "kvpop" and scorer is None:
        raise ValueError("the kvpop policy needs a scorer: pass scorer='mlstm', 'mlp' or 'mlstm_immediate'")
    if getattr(model, "kvpop_runtime", None) is not None:
        raise ValueError("this model is already retrofitted: use kvpop.set_policy to change its policy or budget")
    device = next(model.parameters()).device
    spec = None
    if scorer is not None:
        if (budget or pol.budget) is None:
            raise ValueError("a scorer reads priorities `window` tokens late: pass a budget to retrofit it")
        window = (budget or pol.budget).window
        options = scorer_options or {}
        spec = {"name": scorer, **options}
        evicting = [module for module, own in zip(layers, windows) if own is None]  # local layers keep their window
        if scorer == DMSGate.name:  # DMS's gates read the layers' hidden states, not [k; v]
            attach_gates(evicting, model.config.hidden_size, kv_heads, window, device, **options)
        else:
            for module in evicting:
                module.kvpop_scorer = build_scorer(scorer, kv_heads, head_dim, window, **options).to(device)
    base_impl = getattr(model.config, "_attn_implementation", None) or "sdpa"
    runtime = Runtime(pol, num_layers, heads, kv_heads, head_dim, base_impl, spec, layer_windows=windows)
    runtime.allocation = _fitted_allocation(runtime, pol, allocation)
    for module in layers:
        module.kvpop_runtime = runtime  # a plain attribute: not a submodule, not in the state dict
    model.kvpop_runtime = runtime
    _register()
    model.config._attn_implementation = ATTN_NAME
    model.generate = types.MethodType(_generate_with_kvpop_cache, model)
    return model


def _generate_with_kvpop_cache(self, inputs=None, *args, prefill_chunk: int | None = None, **kwargs):
    """``generate`` with a fresh fixed-budget cache unless the caller brings one (dense keeps DynamicCache), and a
    bounded prefill: a prompt longer than ``prefill_chunk`` columns (default ``Runtime.prefill_chunk``) goes through
    the cache in chunks of that many, counted back from its end (:func:`kvpop.decode.prefill`), the last of them in
    transformers' own first forward. ``prefill_chunk=1`` prefills token by token, exactly as decoding."""
    if self.kvpop_runtime.policy.budget is None:
        return type(self).generate(self, inputs, *args, **kwargs)
    given = [kwargs.pop(name, None) for name in ("past_key_values", "cache")]
    cache = next((c for c in given if c is not None), None)
    cache = kwargs[CACHE_KWARG] = KVpopCache(self) if cache is None else cache
    ids = inputs if inputs is not None else kwargs.get("input_ids")
    if torch.is_tensor(ids) and ids.dim() == 2 and isinstance(cache, KVpopCache):
        chunk = prefill_chunk if prefill_chunk is not None else self.kvpop_runtime.prefill_chunk
        bounds = chunk_bounds(cache.get_seq_length(), ids.shape[1], chunk)
        cache.prefill_chunk = chunk
        if len(bounds) > 2:  # all but the last chunk here; transformers' first forward takes the last
            end = bounds[-2]
            mask = kwargs.get("attention_mask")
            if mask is None:
                mask = kwargs["attention_mask"] = torch.ones_like(ids)
            positions = padded_positions(mask)  # as generate computes them
            prefill(self, ids[:, :end], cache=cache, chunk=chunk, attention_mask=mask[:, :end],
                    position_ids=positions[:, :end])
    return type(self).generate(self, inputs, *args, **kwargs)



def runtime_of(model: nn.Module) -> Runtime:
    runtime = getattr(model, "kvpop_runtime", None)
    if runtime is None:
        raise ValueError("the model is not retrofitted: call kvpop.retrofit(model, budget, ...) first")
    return runtime


def set_policy(model: nn.Module, policy: str | Policy, budget: Budget | None = None, *,
               allocation: Allocation | None = None, **options) -> Policy:
    """Switch the policy (and budget) of a retrofitted model, e.g. to evaluate baselines at the same budget.

    The recency term (METHOD §3) and the anchor slots (METHOD §1) are the model's: they carry over unless
    ``recency=``, ``anchor_share=`` or ``anchor_recency=`` is given. Per-head budgets never carry over: the policy
    has them only with ``allocation=`` (METHOD §7; ``budget`` then its uniform budget, or ``None``).
    """
    runtime = runtime_of(model)
    if not isinstance(policy, Policy) and policy != "dense":
        for name in ("recency", "anchor_share", "anchor_recency"):
            options.setdefault(name, getattr(runtime.policy, name))
    if allocation is not None:
        if isinstance(policy, Policy):
            raise ValueError("set_policy: pass allocation= with a policy name (a Policy object carries head_topk)")
        budget = _allocation_budget(allocation, budget)
        if options.get("anchor_share"):  # the model's anchor slots do not carry over into per-head budgets
            raise AllocationError(f"anchor slots (anchor_share {options['anchor_share']}) are not defined under "
                                  f"per-head budgets: pass anchor_share=0 with an allocation")
        options["head_topk"] = allocation.head_topk()
    pol = policy if isinstance(policy, Policy) else build_policy(policy, budget, **options)
    fitted = _fitted_allocation(runtime, pol, allocation)
    if pol.budget is not None and runtime.scorer_spec is not None and pol.name == "kvpop":
        window = scorer_window(model)
        if window is not None and pol.budget.window != window:
            raise ValueError(f"the scorers read priorities {window} tokens late (their window); a budget with window "
                             f"{pol.budget.window} needs scorers trained for it")
    runtime.policy, runtime.allocation = pol, fitted
    return pol


def _allocation_budget(allocation: Allocation, budget: Budget | None) -> Budget:
    """The uniform budget a policy under ``allocation`` carries: ``budget`` once it is the allocation's own."""
    if not isinstance(allocation, Allocation):
        raise AllocationError(f"allocation must be a kvpop.allocation.Allocation, got {type(allocation).__name__}")
    if budget is not None:
        allocation.check_budget(budget)
    return allocation.budget


def _fitted_allocation(runtime: Runtime, policy: Policy, allocation: Allocation | None) -> Allocation | None:
    """``allocation`` (or, for a Policy given with its own ``head_topk``, the runtime's if it is the same grid) once
    the policy's per-head budgets fit the model: one row per evicting layer, one entry per KV head; else one
    :class:`AllocationError` line. ``None`` for a uniform policy."""
    grid = policy.head_topk
    if grid is None:
        return None
    want = (len(runtime.evicting_layers), runtime.num_kv_heads)
    if (len(grid), len(grid[0])) != want:
        raise AllocationError(f"per-head budgets for {len(grid)} layers × {len(grid[0])} KV heads, this model has "
                              f"{want[0]} evicting layers × {want[1]} KV heads: allocate for this model")
    if allocation is None and runtime.allocation is not None and runtime.allocation.head_topk() == grid:
        return runtime.allocation
    return allocation


def set_streaming_layers(model: nn.Module, layers) -> frozenset[int]:
    """Make the kvpop policy rank ``layers``' long-range slots newest-wins (their scorers unused): in those layers the
    cache is exactly a streaming cache of the same ``B``. A per-layer calibration of the model, chosen on training
    text by :func:`kvpop.diagnostics.streaming_layers`; ``()`` restores the scorers everywhere."""
    runtime = runtime_of(model)
    chosen = frozenset(layers)
    bad = sorted(i for i in chosen if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < runtime.num_layers)
    if bad:
        raise ValueError(f"streaming layers must be layer indices 0 … {runtime.num_layers - 1}, got {bad}")
    if chosen and runtime.scorer_spec is None:
        raise ValueError("streaming layers stand in for scorers: this model has none (retrofit with a scorer)")
    local = sorted(chosen - set(runtime.evicting_layers))
    if local:
        raise ValueError(f"layers {local} are the model's own local (sliding-window) layers: they hold no scorer to "
                         f"stand in for (streaming layers are among {list(runtime.evicting_layers)})")
    runtime.streaming_layers = chosen
    return chosen


def set_window_attention_prior(model: nn.Module, on: bool = True) -> bool:
    """Make the kvpop policy rank by the scorer's output plus the attention a token received in its window (the
    ``window_attention`` policy's priority, kvpop/policies/window_attention.py): a prior the scorers are trained on
    top of, in the mask, the cache and online training alike. A property of the trained scorers: saved in
    ``kvpop.json``."""
    runtime = runtime_of(model)
    if not isinstance(on, bool):
        raise ValueError(f"the window attention prior is on or off (a bool), got {on!r}")
    if on and runtime.scorer_spec is None:
        raise ValueError("the window attention prior is added to scorers: this model has none (retrofit with a scorer)")
    runtime.window_attention_prior = on
    return on


@contextlib.contextmanager
def oracle_priorities(model: nn.Module, targets: torch.Tensor):
    """Make the oracle policy read ``targets [layers, B, Hkv, S]`` (teacher future attention) within the block; the
    layers are the evicting ones (``Runtime.evicting_layers``: all but a model's local layers), as
    :func:`kvpop.targets.teacher_pass` returns them."""
    runtime = runtime_of(model)
    layers = len(runtime.evicting_layers)
    if targets.dim() != 4 or targets.shape[0] != layers or targets.shape[2] != runtime.num_kv_heads:
        raise ValueError(f"oracle targets must be [evicting layers={layers}, B, Hkv={runtime.num_kv_heads}, S], "
                         f"got {tuple(targets.shape)}")
    previous, runtime.oracle = runtime.oracle, targets
    try:
        yield
    finally:
        runtime.oracle = previous


@contextlib.contextmanager
def collect_priorities(model: nn.Module):
    """Collect each layer's ranked priorities ``[B, Hkv, S]`` (with grad) from one-pass forwards in the block."""
    runtime = runtime_of(model)
    store: dict[int, torch.Tensor] = {}
    previous, runtime.collected = runtime.collected, store
    try:
        yield store
    finally:
        runtime.collected = previous


@contextlib.contextmanager
def soft_retention(model: nn.Module, tau: float, relative: bool = False, recency: float | None = None):
    """One-pass forwards in the block run the relaxed retention (``kvpop.attention.SoftRetention``): every causal
    token visible, an eligible one weighted by ``sigmoid((p[t] - c[d]) / tau)`` around the hard rule's cutoff, the
    gradient flowing into the scorers. Training only: unpadded whole sequences (``use_cache=False``); streaming
    layers and ``topk = 0`` keep the hard mask (nothing to rank). ``relative``: ``tau`` in units of each (sequence, KV
    head)'s priority spread (``kvpop.attention.soft_temperature``). ``recency``: inside the block the policy ranks by
    scorer + ``recency`` · t instead of its own term (METHOD §3), so a scorer trained at λ = 0 learns what the decay
    it is evaluated with leaves to it."""
    if not (isinstance(tau, (int, float)) and not isinstance(tau, bool) and math.isfinite(tau) and tau > 0):
        raise ValueError(f"soft_retention: tau must be a finite number > 0, got {tau!r}")
    if recency is not None and not (isinstance(recency, (int, float)) and not isinstance(recency, bool)
                                    and math.isfinite(recency) and recency >= 0):
        raise ValueError(f"soft_retention: recency must be a finite number >= 0, got {recency!r}")
    runtime = runtime_of(model)
    if runtime.policy.dynamic or runtime.policy.ragged or runtime.policy.budget is None:
        raise ValueError(f"soft_retention relaxes a static policy's top-k rule; the model runs {runtime.policy.name}")
    previous = runtime.soft_tau, runtime.soft_relative, runtime.policy
    runtime.soft_tau, runtime.soft_relative = float(tau), bool(relative)
    if recency is not None:
        runtime.policy = dataclasses.replace(runtime.policy, recency=float(recency))
    try:
        yield
    finally:
        runtime.soft_tau, runtime.soft_relative, runtime.policy = previous


def scoring_modules(model: nn.Module) -> list[nn.Module]:
    """The attention modules that hold a scorer: the evicting layers' (``Runtime.evicting_layers``), in order."""
    return [m for m in attention_modules(model) if hasattr(m, "kvpop_scorer")]


def scorers(model: nn.Module) -> nn.ModuleList:
    """The per-layer scorers, in layer order (a view: they stay attached to their attention modules); a model's local
    layers have none."""
    return nn.ModuleList([m.kvpop_scorer for m in scoring_modules(model)])


def scorer_window(model: nn.Module) -> int | None:
    """How late the scorers read a priority (their window); ``None`` without scorers."""
    found = scoring_modules(model)
    return found[0].kvpop_scorer.window if found else None


def _describe(model: nn.Module) -> dict:
    runtime = runtime_of(model)
    pol = runtime.policy
    budget = pol.budget
    # per-head budgets (METHOD §7): their allocation is saved beside, as kvpop_allocation.json; named here only then,
    # so that a uniform model's kvpop.json (and the digest of its folder, which keys its evaluations) stays as it was
    allocation = {} if pol.head_topk is None else {"allocation": {
        "file": ALLOCATION_FILE, "mode": runtime.allocation.mode, "mean_budget": runtime.allocation.mean_budget}}
    return {
        "format_version": FORMAT_VERSION,
        "policy": pol.name,
        "budget": None if budget is None else {"sink": budget.sink, "window": budget.window, "topk": budget.topk},
        "recency": pol.recency,
        "anchor_share": pol.anchor_share,
        "anchor_recency": pol.anchor_recency,
        "scorer": runtime.scorer_spec,
        "scorer_window": (scorer_window(model) or (budget and budget.window)) if runtime.scorer_spec else None,
        "streaming_layers": sorted(runtime.streaming_layers),
        "window_attention_prior": runtime.window_attention_prior,
        "num_layers": runtime.num_layers,
        "num_kv_heads": runtime.num_kv_heads,
        "head_dim": runtime.head_dim,
        "base_attn_implementation": runtime.base_attn_implementation,
        **allocation,
    }


def save_retrofitted(model: nn.Module, path: str | Path, tokenizer=None, *, base: str | Path | None = None,
                     base_sha256: str | None = None, base_tensors_sha256: str | None = None) -> Path:
    """Save a retrofitted model into ``path``: ``kvpop.json``, the scorer weights and, unless ``base`` is given, the
    base weights as transformers saves them (a folder plain transformers loads too).

    ``base``: the folder holding this model's base weights unchanged (scorer-only training froze them). Then no
    second copy of the base is written; ``kvpop.json`` records the base's identity (module docstring), not its path,
    and :func:`load_retrofitted` loads the base from a folder given to it and checks its tensors' digest.
    ``base_sha256`` / ``base_tensors_sha256``: the base's :func:`kvpop.files.weights_digest` /
    :func:`kvpop.files.tensors_digest` if the caller has them, else they are computed.
    """
    from safetensors.torch import save_file

    path = Path(path)
    runtime = runtime_of(model)
    if runtime.policy.head_topk is not None and runtime.allocation is None:
        raise AllocationError("the policy has per-head budgets but no allocation to save with them: set them with "
                              "kvpop.set_policy(model, name, allocation=...)")
    path.mkdir(parents=True, exist_ok=True)
    meta = _describe(model)
    if base is not None:
        base = Path(base).expanduser().resolve()
        meta.update(format_version=SCORER_ONLY_FORMAT_VERSION,
                    base={**model_identity(base, base_tensors_sha256),
                          "weights_sha256": base_sha256 or weights_digest(base)})
        made_for = None if runtime.allocation is None else runtime.allocation.provenance["weights_sha256"]
        if made_for is not None and made_for != meta["base"]["weights_sha256"]:
            raise AllocationError(f"the allocation was made for another base model (weights {made_for[:12]}…, this "
                                  f"base {meta['base']['weights_sha256'][:12]}…): allocate for this model")
    else:
        base_state = {k: v for k, v in model.state_dict().items() if ".kvpop_scorer." not in k}
        model.config._attn_implementation = runtime.base_attn_implementation  # loadable without KVpop
        try:
            model.save_pretrained(path, state_dict=base_state)
        finally:
            model.config._attn_implementation = ATTN_NAME
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    if runtime.scorer_spec is not None:
        weights = {f"layers.{m.layer_idx}.{k}": v.detach().cpu().contiguous() for m in scoring_modules(model)
                   for k, v in m.kvpop_scorer.state_dict().items()}
        save_file(weights, str(path / SCORERS_FILE))
    if runtime.policy.head_topk is not None:
        save_allocation(path, runtime.allocation)
    (path / CONFIG_FILE).write_text(json.dumps(meta, indent=2))
    return path


def load_scorers(model: nn.Module, path: str | Path) -> None:
    """Load ``kvpop_scorers.safetensors`` from ``path`` into an already retrofitted model, checking it fits."""
    from safetensors.torch import load_file

    path = Path(path)
    meta = json.loads((path / CONFIG_FILE).read_text())
    runtime = runtime_of(model)
    mine = {"num_layers": runtime.num_layers, "num_kv_heads": runtime.num_kv_heads, "head_dim": runtime.head_dim}
    theirs = {key: meta.get(key) for key in mine}
    if mine != theirs:
        raise ValueError(f"the scorer checkpoint in {path} was trained for {theirs} but this model has {mine}: "
                         f"load it into the model it was trained with, or retrain the scorers for this one")
    if (meta.get("scorer") or {}).get("name") != (runtime.scorer_spec or {}).get("name"):
        raise ValueError(f"the checkpoint holds {meta.get('scorer')} scorers but the model was retrofitted with "
                         f"{runtime.scorer_spec}: retrofit with scorer={meta.get('scorer', {}).get('name')!r}")
    weights = load_file(str(path / SCORERS_FILE))
    saved = sorted({int(k.split(".")[1]) for k in weights})
    scored = [m.layer_idx for m in scoring_modules(model)]
    if saved != scored:
        raise ValueError(f"the scorer checkpoint in {path} holds scorers for layers {saved}, this model scores layers "
                         f"{scored} (its global layers): load it into the model it was trained with")
    for module in scoring_modules(model):
        i = module.layer_idx
        prefix = f"layers.{i}."
        state = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
        try:
            module.kvpop_scorer.load_state_dict(state, strict=True)
        except RuntimeError as err:
            raise ValueError(f"the scorer weights in {path} do not fit layer {i}'s scorer ({err}); "
                             f"retrofit with the scorer options they were trained with") from None


def base_matches(recorded: dict, *, weights_sha256: str | None = None, tensors_sha256: str | None = None) -> bool:
    """Whether a base with these digests is the ``recorded`` base of a scorer-only folder: by the tensors' digest
    where both sides have it (the identity), else by the files' digest (folders written before the identity)."""
    if recorded.get("tensors_sha256") and tensors_sha256:
        return recorded["tensors_sha256"] == tensors_sha256
    return bool(weights_sha256) and recorded.get("weights_sha256") == weights_sha256


def check_scorer_folder(path: str | Path, *, scorer: str, scorer_options: dict, window: int, base_sha256: str,
                        digest=sha256_file, base_tensors_sha256: str | None = None) -> str:
    """The digest (``digest(file)``, default its sha256) of the scorer weights in ``path``, after checking that the
    folder holds scorers a run with these settings can start from (fine-tuning): a scorer-only folder (as
    :func:`save_retrofitted` writes it with ``base``) of ``scorer`` with exactly ``scorer_options``, retrofitted at
    this budget ``window`` (the scorers read priorities that late) on the base whose :func:`kvpop.files.weights_digest`
    is ``base_sha256`` and :func:`kvpop.files.tensors_digest` ``base_tensors_sha256`` (:func:`base_matches`).
    Otherwise a one-line ``ValueError`` saying what differs (callers prefix the folder's name)."""
    path = Path(path)
    try:
        meta = json.loads((path / CONFIG_FILE).read_text())
        window_of, recorded, spec = meta["budget"]["window"], dict(meta["base"]), meta["scorer"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"not a saved scorer folder (a scorer-only {CONFIG_FILE} with its budget, scorer and base, "
                         f"as a train stage's final_model or a study's step-* folder has; {type(err).__name__}: "
                         f"{err})") from None
    if window_of != window or not base_matches(recorded, weights_sha256=base_sha256,
                                               tensors_sha256=base_tensors_sha256):
        by_tensors = bool(recorded.get("tensors_sha256") and base_tensors_sha256)
        theirs = recorded.get("tensors_sha256" if by_tensors else "weights_sha256")
        mine = base_tensors_sha256 if by_tensors else base_sha256
        raise ValueError(f"trained at window {window_of} on base {str(theirs)[:16]}…, this run trains at window "
                         f"{window} on {str(mine)[:16]}…: start from scorers of this window and base")
    mine = {"name": scorer, **scorer_options}
    if spec != mine:
        raise ValueError(f"its scorers are {json.dumps(spec)}, this run's {json.dumps(mine)}: start from scorers of "
                         f"the same scorer and options")
    if not (path / SCORERS_FILE).is_file():
        raise ValueError(f"{SCORERS_FILE} is missing")
    return digest(path / SCORERS_FILE)


def rewindow_scorer_folder(source: str | Path, target: str | Path, budget: Budget) -> Path:
    """Write into ``target`` (new or empty) the scorer-only folder ``source`` at another ``budget`` whose window may
    differ from the one it was trained at: the same scorer weights, ``budget`` and ``scorer_window = budget.window``
    in its ``kvpop.json``, everything else (base, options, recency, layers) as saved.

    Why this is well defined: no scorer parameter has the window's size. The window only says when the cache reads a
    token's priority (at ``t + window``, METHOD §1 and §4) and so how much of the near future the scorer has seen by
    then; the ring buffers that hold those ``window`` steps are state, not weights. The result is a *different* policy from
    the trained one (the scorer reads earlier or later than it learned to), to be evaluated or fine-tuned at its new
    window (``train.init_from`` checks the window), never assumed equal. A folder with its base weights inside is
    refused (this writes scorers only)."""
    source, target = Path(source), Path(target)
    meta = _saved_meta(source)
    if meta.get("format_version") != SCORER_ONLY_FORMAT_VERSION or not meta.get("scorer") or not meta.get("base"):
        raise ValueError(f"{source} is not a scorer-only folder (format {SCORER_ONLY_FORMAT_VERSION} with scorers "
                         f"and a recorded base, as a train stage's final_model or a study's step-* folder)")
    if not (source / SCORERS_FILE).is_file():
        raise ValueError(f"{source}: {SCORERS_FILE} is missing")
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ValueError(f"{target} exists and is not an empty folder: choose a new one")
    target.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source / SCORERS_FILE, target / SCORERS_FILE)
    # an allocation belongs to the budget it redistributes: the scorers at another budget run uniform
    meta = {**meta, "budget": {"sink": budget.sink, "window": budget.window, "topk": budget.topk},
            "scorer_window": budget.window}
    meta.pop("allocation", None)
    (target / CONFIG_FILE).write_text(json.dumps(meta, indent=2))
    return target


def _describe_base(recorded: dict) -> str:
    digest = recorded.get("tensors_sha256") or recorded.get("weights_sha256") or "?"
    kind = "tensors" if recorded.get("tensors_sha256") else "weights"
    return f"{recorded.get('name') or recorded.get('path', '?')} ({kind} sha256 {digest[:16]}…)"


def saved_base_folder(path: str | Path, base: str | Path | None = None, *, verify: bool = True,
                      tensors=tensors_digest, weights=weights_digest) -> Path:
    """Where the base weights of a folder written by :func:`save_retrofitted` are: itself, or (scorer-only format)
    ``base`` — else the recorded path of a folder written before the base identity — once its digest matches
    (module docstring; ``tensors`` / ``weights``: the digest functions, a caller with a cache passes its own).
    One-line ``FileNotFoundError`` / ``ValueError`` otherwise, naming the digest expected and the one found."""
    path = Path(path)
    return _base_folder(path, _saved_meta(path), base, verify, tensors, weights)


def _base_folder(path: Path, meta: dict, base: str | Path | None, verify_base: bool, tensors=tensors_digest,
                 weights=weights_digest) -> Path:
    recorded = meta.get("base")
    if recorded is None:
        return path
    if base is None and not recorded.get("path"):
        raise FileNotFoundError(f"{path} holds scorers only, for base {_describe_base(recorded)}: pass the base "
                                f"model's folder (base=, model.path)")
    folder = Path(base).expanduser() if base is not None else Path(recorded["path"])
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{path} holds scorers only; its base model folder {folder} is missing (no "
                                f"config.json): give a folder with base {_describe_base(recorded)}")
    if verify_base:
        if recorded.get("tensors_sha256"):
            kind, expected, found = "tensors", recorded["tensors_sha256"], tensors(folder)
        else:
            kind, expected, found = "weights", recorded["weights_sha256"], weights(folder)
        if found != expected:
            named = recorded.get("name") or recorded.get("path")
            raise ValueError(f"the base model at {folder} is not the one the scorers in {path} were trained on: "
                             f"expected {kind} sha256 {expected[:16]}… ({named}), found {found[:16]}…")
    return folder


def _saved_meta(path: Path) -> dict:
    """The ``kvpop.json`` of a folder written by :func:`save_retrofitted`."""
    if not (path / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{path} has no {CONFIG_FILE}: it is not a folder written by kvpop.save_retrofitted")
    return json.loads((path / CONFIG_FILE).read_text())


def saved_model_config(path: str | Path, base: str | Path | None = None) -> dict:
    """The Hugging Face ``config.json`` of a folder written by :func:`save_retrofitted`: its own, or (scorer-only
    format) its base folder's (``base``, else a recorded path) — without loading or checking weights."""
    path = Path(path)
    folder = _base_folder(path, _saved_meta(path), base, verify_base=False)
    return json.loads((folder / "config.json").read_text())


def load_retrofitted(path: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                     base: str | Path | None = None, verify_base: bool = True):
    """``(model, tokenizer_or_None)`` from a folder written by :func:`save_retrofitted`; local files only, no remote
    code.

    A scorer-only folder (saved with ``base=``) loads its base model from ``base`` (or, written before the base
    identity, from its recorded folder), after checking that folder's digest against the recorded one
    (``verify_base=False`` skips the check, which reads every weight file once).

    A folder saved under per-head budgets loads its ``kvpop_allocation.json`` too, refused in one
    :class:`kvpop.allocation.AllocationError` line if its shape is not the model's (evicting layers × KV heads), if
    it was made for another base (a scorer-only folder's recorded weights), or if it does not redistribute the saved
    budget.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    meta = _saved_meta(path)
    if meta.get("format_version") not in (FORMAT_VERSION, SCORER_ONLY_FORMAT_VERSION):
        raise ValueError(f"{path}: kvpop format {meta.get('format_version')}, this version reads {FORMAT_VERSION} "
                         f"and {SCORER_ONLY_FORMAT_VERSION}")
    folder = _base_folder(path, meta, base, verify_base)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True).to(device)
    budget = Budget(**meta["budget"]) if meta["budget"] else None
    spec = dict(meta["scorer"]) if meta["scorer"] else None
    name = spec.pop("name") if spec else None
    if budget is None and spec is not None:
        budget = Budget(0, meta["scorer_window"], 0)
    retrofit(model, budget, scorer=name, policy=meta["policy"] if meta["policy"] != "dense" else "dense",
             recency=meta.get("recency", 0.0), anchor_share=meta.get("anchor_share", 0.0),
             anchor_recency=meta.get("anchor_recency", 0.0), scorer_options=spec)
    if spec is not None or name is not None:
        load_scorers(model, path)
        set_streaming_layers(model, meta.get("streaming_layers", ()))
        set_window_attention_prior(model, bool(meta.get("window_attention_prior", False)))
    if meta.get("allocation"):
        runtime = runtime_of(model)
        recorded = meta.get("base") or {}
        allocation = load_allocation(path, num_layers=len(runtime.evicting_layers),
                                     num_kv_heads=runtime.num_kv_heads, weights_sha256=recorded.get("weights_sha256"))
        set_policy(model, meta["policy"], budget, allocation=allocation)
    tokenizer = None
    for candidate in (path, folder):
        if (candidate / "tokenizer_config.json").is_file():
            tokenizer = AutoTokenizer.from_pretrained(candidate, local_files_only=True)
            break
    return model, tokenizer
