"""Serving capacity and prefill speed (issues 14 and 44): the bounded prefill against dense's, and the largest batch
that fits on one GPU with its decode throughput, for dense at its best and for KVpop at B = 2048 and 1024, at 8k /
32k / 128k context, for SmolLM2-135M's and Qwen3-0.6B's shapes (random weights); the byte floor next to every decode
figure.

* **Prefill** (its own table): seconds and tokens/s of one row and of a batch of rows (``prefill_batch_tokens`` per
  batch: 32 rows at 8k, 8 at 32k, 2 at 128k) at every context, dense beside KVpop in the same run and their ratio
  (``× dense``). KVpop's prompt goes through :func:`kvpop.prefill` in chunks of ``prefill_chunk`` columns (the fused
  path: FlexAttention over the B slots + the chunk, ``Runtime.compile_prefill`` compiling the chunk bookkeeping);
  at ``sweep_context`` with one row every chunk size of ``prefill_chunks`` (1k / 2k / 4k / 8k) is timed too. With
  ``graph_prefill`` (the GPU presets; ``--no-graph-prefill``) each KVpop row is timed a second time with its full
  chunks replayed as one CUDA graph (``kvpop-B<B>-graphed``: :func:`kvpop.prefill` ``graphed=True``, the graph
  captured inside every timed prefill, as a user's single prefill pays it) and a third time replaying the graph an
  earlier prefill of the same shapes captured (``kvpop-B<B>-graph-kept``: ``graphed=ChunkGraph()``, as a server
  that captured at start-up pays it). Each
  configuration is warmed up first (compiling its shapes; ``warmup_s``) on a prompt of two chunks, then timed.
  ``--profile FILE`` writes a torch.profiler table of the top kernels of one KVpop prefill and of dense's, and of
  one step of every timed decoding batch (eager, outside the graph; a compiled step after its compilation), so a
  missed target names the kernel that holds it back.
* **Dense at its best**: each row's keys/values in an exact-sized preallocated buffer (``context`` slots per layer),
  one decoding step of the whole model captured as a CUDA graph, attention by SDPA with the query heads grouped on
  their KV head and no mask (a flash decoding kernel on CUDA). To keep the step's shapes constant (a graph replays
  fixed shapes) the new token overwrites the oldest slot: every timed step attends to exactly ``context`` tokens,
  which is what dense decoding at that context reads. Its prefill: one flash causal pass over the prompt.
* **KVpop decoding**: the mLSTM scorer, budget ``Budget(4, 256, B - 260)``, one decoding step of the whole model
  captured as a CUDA graph (:class:`kvpop.decode.GraphedDecoder`); ``compile_decode`` ``on`` also fuses each layer's
  KVpop step with torch.compile (``Runtime.compile_decode``), ``both`` times the largest batch both ways.
* **Largest batch**: one real prefill of a single row, then the per-row state (dense: ``context`` tokens of K/V;
  KVpop: its slots, metadata and scorer state, measured) and a per-row estimate of a step's activations give the
  batch from the free memory (``--margin-gib`` kept back); the row is replicated to that batch (the decode state a
  prefill of every row would leave — prefilling hundreds of rows at 128k would take longer than the whole run) and a
  step is captured; on running out of memory the batch backs off by 10 %. Then ``--fractions`` of it are timed too.
* **Byte floor** of a step: weights + the state it reads (dense K/V; KVpop K/V + metadata + scorer state) ÷ the
  device copy bandwidth measured in the same run.
* **Time limit** (``--time-limit``): each model gets its share (time an earlier model leaves goes to the next), its
  prefill table ``prefill_share`` of that and decoding the rest; past it no new configuration starts (a row says
  ``skipped``). The prefill table runs what the issue's targets read first: one row at every context, then the
  batches of rows, then the chunk-size sweep.

    python benchmarks/capacity.py --preset quick --out /tmp/capacity_quick.json   # ~7 min on an H100 / H200
    python benchmarks/capacity.py --preset h200 --out /tmp/capacity_h200.json     # every figure, ~15 GPU minutes
    python benchmarks/capacity.py --preset cpu-tiny                                 # a smoke run on CPU
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import platform
import sys
import time
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.decode import copy_bandwidth, time_steps, weight_bytes  # noqa: E402
from kvpop.profiling import kernel_count, profiled  # noqa: E402  (the one profile formatter: the train step's too)

SHAPES = {  # (architecture, config): the published models' shapes, random weights
    "smollm2-135m": ("llama", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                                   num_key_value_heads=3, head_dim=64, vocab_size=49152, rope_theta=100000.0)),
    "qwen3-0.6b": ("qwen3", dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936)),
    "tiny-llama": ("llama", dict(hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6,
                                 num_key_value_heads=2, head_dim=16, vocab_size=257)),
    "tiny-qwen3": ("qwen3", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=16, vocab_size=300)),
}

GPU = dict(models=["qwen3-0.6b", "smollm2-135m"], contexts=[8192, 32768, 131072], budgets=[2048, 1024], sink=4,
           window=256, dtype="bfloat16", prefill_chunk=4096, prefill_chunks=[1024, 2048, 4096, 8192],
           sweep_context=32768, prefill_batch_tokens=262144, compile_prefill=True, graph_prefill=True,
           margin_gib=4.0, memory_gib=None,
           max_batch=1 << 16, prefill_share=0.6)
PRESETS = {
    # every figure: prefill, then decoding at every context, the largest batch and fractions of it
    "h200": dict(GPU, decode_contexts=[131072, 32768, 8192], steps=20, fractions=[1.0, 0.5, 0.25],
                 compile_decode="both", time_limit=900.0),
    # what issue 44's targets read, in ~7 minutes: the prefill table at 32k and 128k (the compiled prefill's
    # warm-up takes 30-50 s per model and budget on an H100: with 8k first, 270 s covered the 8k rows only),
    # decoding at one context (a KVpop row's state does not depend on it) at the largest batch, eager and compiled
    "quick": dict(GPU, contexts=[32768, 131072], decode_contexts=[32768], steps=20, fractions=[1.0],
                  compile_decode="both", time_limit=420.0),
    "cpu-tiny": dict(models=["tiny-llama", "tiny-qwen3"], contexts=[128, 256], budgets=[64, 40], sink=2, window=16,
                     dtype="float32", prefill_chunk=32, prefill_chunks=[16, 32, 64], sweep_context=256,
                     prefill_batch_tokens=512, compile_prefill=False, graph_prefill=False, decode_contexts=[256],
                     steps=2, fractions=[1.0, 0.5], compile_decode="off", margin_gib=0.0, memory_gib=0.004, max_batch=8,
                     time_limit=600.0, prefill_share=0.6),
}
DENSE_ATTENTION = "kvpop_capacity_dense"
GRAPHED = "kvpop-graphed"  # prefill rows whose full chunks replay a CUDA graph (kvpop.prefill(graphed=True))
KEPT = "kvpop-graph-kept"  # ... a graph an earlier prefill of the same shapes captured (graphed=ChunkGraph())


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _gib(nbytes) -> float:
    return nbytes / 2**30


def build_model(name: str, dtype, device, max_len: int):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    arch, shape = SHAPES[name]
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[arch]
    config = config_cls(**shape, max_position_embeddings=max_len, tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        return model_cls(config).to(dtype).eval()


# -----------------------------------------------------------------------------
# dense at its best: an exact-sized buffer per layer, SDPA (GQA grouped, no mask), a graphed step


def _dense_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Prefill: causal over the prompt; decoding: the query against every slot of the buffer."""
    group = query.shape[1] // key.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=query.shape[2] > 1,
                                                           scale=scaling, enable_gqa=group > 1)
    return out.transpose(1, 2).contiguous(), None


def use_dense_attention(model) -> None:
    from transformers import AttentionInterface

    from kvpop.attention import passthrough_mask

    AttentionInterface.register(DENSE_ATTENTION, _dense_attention)
    try:
        from transformers.masking_utils import AttentionMaskInterface
        AttentionMaskInterface.register(DENSE_ATTENTION, passthrough_mask)
    except ImportError:  # pragma: no cover - very old transformers
        pass
    model.config._attn_implementation = DENSE_ATTENTION


def dense_cache(model, batch: int, length: int):
    """A transformers Cache of exact-sized ring buffers ``[batch, Hkv, length, D]``, one per layer."""
    from transformers.cache_utils import Cache, CacheLayerMixin

    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    index = torch.zeros(1, dtype=torch.long, device=model.device)  # the slot the next decoding step overwrites

    class RingLayer(CacheLayerMixin):
        is_compileable = False
        is_sliding = False

        def __init__(self):
            super().__init__()
            shape = (batch, cfg.num_key_value_heads, length, head_dim)
            self.keys = torch.empty(shape, dtype=model.dtype, device=model.device)
            self.values = torch.empty_like(self.keys)
            self.is_initialized = True

        def lazy_initialization(self, key_states, value_states):
            pass

        def update(self, key_states, value_states, *args, **kwargs):
            if key_states.shape[2] == 1:
                self.keys.index_copy_(2, index, key_states)
                self.values.index_copy_(2, index, value_states)
                return self.keys, self.values
            self.keys[:, :, :key_states.shape[2]] = key_states
            self.values[:, :, :value_states.shape[2]] = value_states
            return key_states, value_states

        def get_seq_length(self):
            return length

        def get_mask_sizes(self, query_length):
            return length + query_length, 0

        def get_max_length(self):
            return length

    cache = Cache(layers=[RingLayer() for _ in range(cfg.num_hidden_layers)])
    cache.ring_index = index
    return cache


# -----------------------------------------------------------------------------
# measurements


def profile_step(step, device) -> tuple[int, str]:
    """``(kernels, table)`` of one call of ``step`` after a call outside the profile (a compiled step compiles and
    autotunes there, not in the count): the kernels it launches — on CUDA as the profiler sees them; on CPU, the
    outermost aten operators that compute (looking through views and conversions to what they call), ~ what would
    launch on a GPU — and the profiler's table of its top kernels by their own device time (CPU: operator time)."""
    with torch.no_grad():
        step()
        _sync(device)
        prof, _, table = profiled(step, device, rows=25)
    return kernel_count(prof, device), table


def step_activation_bytes(model, extra_per_layer: int = 0) -> int:
    """A generous per-row estimate of one decoding step's transient memory: logits (and their float32 copy), the
    hidden and MLP activations, and whatever a layer's cache step allocates (``extra_per_layer``)."""
    cfg = model.config
    size = model.dtype.itemsize
    return (cfg.vocab_size * (size + 4) + 16 * cfg.hidden_size * size + 4 * cfg.intermediate_size * size
            + 4 * extra_per_layer)


def free_bytes(device, args) -> int:
    if args["memory_gib"] is not None:
        return int(args["memory_gib"] * 2**30)
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0] - int(args["margin_gib"] * 2**30)


def _oom_cleanup(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class Config:
    """One (model, policy, context): prefill one row, then decoding at the largest batch and at fractions of it."""

    def __init__(self, model, name, policy, context, budget, args, device, bandwidth):
        self.model, self.name, self.policy, self.context, self.budget = model, name, policy, context, budget
        self.args, self.device, self.bandwidth = args, device, bandwidth
        self.weights = weight_bytes(model)

    def row(self, **fields):
        return {"model": self.name, "policy": self.policy, "context": self.context, **fields}

    # -- prefill of one row

    def prefill(self):
        """One row's prefill: the decode state every batch replicates (timed too; the prefill table is the sweep's)."""
        cfg = self.model.config
        ids = torch.randint(0, cfg.vocab_size, (1, self.context), device=self.device)
        self._reset_peak()
        before = self._allocated()
        _sync(self.device)
        t0 = time.perf_counter()
        cache = run_prefill(self.model, "dense" if self.policy == "dense" else "kvpop", ids, self.args["prefill_chunk"])
        if self.policy == "dense":
            kv_peak = state = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
        else:
            kv_peak = cache.peak_kv_bytes
            state = sum(cache.nbytes().values())
        _sync(self.device)
        seconds = time.perf_counter() - t0
        self.cache, self.state_per_row = cache, state
        return {"prefill_s": seconds, "prefill_tokens_per_s": self.context / seconds,
                "prefill_peak_gib": _gib(self._peak() - before) if self.device.type == "cuda" else None,
                "prefill_kv_peak_gib": _gib(kv_peak), "state_per_row_gib": _gib(state),
                "prefill_chunk": None if self.policy == "dense" else self.args["prefill_chunk"]}

    # -- decoding at one batch

    def decoder(self, batch: int):
        """``(replay, bytes read per step, (kernels per step, their profile table))`` for ``batch`` rows, the one
        prefilled row replicated."""
        import kvpop
        from kvpop.decode import capture_graph

        cfg = self.model.config
        ids = torch.randint(0, cfg.vocab_size, (batch, 1), device=self.device)
        position = torch.full((batch, 1), self.context, device=self.device)
        if self.policy == "dense":
            cache = dense_cache(self.model, batch, self.context)
            for layer, row in zip(cache.layers, self.cache.layers):
                layer.keys.copy_(row.keys.expand_as(layer.keys))
                layer.values.copy_(row.values.expand_as(layer.values))

            def forward():
                logits = self.model(input_ids=ids, position_ids=position, use_cache=True, logits_to_keep=1,
                                    **{_cache_kwarg(): cache}).logits
                cache.ring_index.add_(1).remainder_(self.context)  # the next step overwrites the next oldest slot
                return logits

            kernels = profile_step(forward, self.device) if self.args["count_kernels"] else (None, None)
            state = batch * self.state_per_row
            if self.device.type == "cuda":
                graph, _ = capture_graph(forward)
                return graph.replay, state, kernels
            return forward, state, kernels
        cache = self.cache.repeated(batch)
        decoder = kvpop.decode.GraphedDecoder(self.model, cache, snapshot=False)

        def forward():
            return self.model(input_ids=ids, position_ids=position, use_cache=True, logits_to_keep=1,
                              **{_cache_kwarg(): cache}).logits

        kernels = profile_step(forward, self.device) if self.args["count_kernels"] else (None, None)
        state = sum(cache.nbytes().values())
        if self.device.type == "cuda":
            decoder(ids, position)  # captures (warm-up steps included), then one replay
            return decoder.graph.replay, state, kernels
        return forward, state, kernels

    def decode(self, batch: int) -> dict:
        self._reset_peak()
        replay, state, (kernels, table) = self.decoder(batch)
        with torch.no_grad():
            replay()
            step = time_steps(replay, self.args["steps"], self.device)
        floor = (self.weights + state) / self.bandwidth
        compiled = self.policy != "dense" and self.model.kvpop_runtime.compile_decode
        if table is not None and self.args.get("profile") is not None:
            append_profile(self.args["profile"], f"{self.name} {self.policy} decoding step, context {self.context}, "
                           f"batch {batch}{', compiled layer step' if compiled else ''}", table)
        return {"batch": batch, "compiled_step": compiled, "step_ms": 1e3 * step, "tokens_per_s": batch / step,
                "floor_ms": 1e3 * floor,
                "x_floor": step / floor, "state_gib": _gib(state), "kv_exceeds_weights": state > self.weights,
                "kernels_per_step": kernels,
                "decode_peak_gib": _gib(self._peak()) if self.device.type == "cuda" else None}

    def largest_batch(self):
        """From the memory model, verified by running it; backs off by 10 % on running out of memory."""
        extra = 0 if self.policy == "dense" else 4 * self.budget * self.model.config.num_key_value_heads * 8
        per_row = self.state_per_row + step_activation_bytes(self.model, extra)
        batch = max(1, min(self.args["max_batch"], free_bytes(self.device, self.args) // per_row))
        for attempt in range(5):
            try:
                return batch, attempt, self.decode(batch)
            except (torch.OutOfMemoryError, RuntimeError) as err:  # a graph capture reports it as a RuntimeError
                if "out of memory" not in str(err).lower():
                    raise
                _oom_cleanup(self.device)
                batch = max(1, int(batch * 0.9))
        return batch, 5, None

    # -- helpers

    def _reset_peak(self):
        _oom_cleanup(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()

    def _allocated(self):
        return torch.cuda.memory_allocated() if self.device.type == "cuda" else 0

    def _peak(self):
        return torch.cuda.max_memory_allocated() if self.device.type == "cuda" else 0


def _cache_kwarg():
    from kvpop.cache import CACHE_KWARG
    return CACHE_KWARG


# -----------------------------------------------------------------------------
# prefill: dense against KVpop's bounded prefill, one row and a batch of rows, chunk sizes


def set_policy(model, args, policy: str, budget: int | None) -> None:
    """Dense attention at its best (flash causal prefill) or KVpop at budget ``B`` (the preset's sink and window)."""
    import kvpop

    if policy == "dense":
        use_dense_attention(model)
        return
    model.config._attn_implementation = "kvpop"
    kvpop.set_policy(model, "kvpop", kvpop.Budget(args["sink"], args["window"], budget - args["sink"] - args["window"]))


@functools.cache
def kept_graph():
    """The :class:`kvpop.decode.ChunkGraph` of the ``kvpop-graph-kept`` rows (one at a time: another shape, budget
    or model recaptures)."""
    from kvpop.decode import ChunkGraph

    return ChunkGraph()


@torch.no_grad()
def run_prefill(model, policy: str, ids, chunk: int):
    """One prefill of ``ids`` ``[rows, context]``: dense's causal pass into an exact-sized cache, or KVpop's bounded
    prefill in chunks of ``chunk`` columns (:func:`kvpop.prefill`); returns the cache."""
    import kvpop

    if policy != "dense":
        return kvpop.prefill(model, ids, chunk=chunk, graphed=kept_graph() if policy == KEPT else policy == GRAPHED)
    rows, context = ids.shape
    cache = dense_cache(model, rows, context)
    model(input_ids=ids, position_ids=torch.arange(context, device=ids.device).expand(rows, context), use_cache=True,
          logits_to_keep=1, **{_cache_kwarg(): cache})
    return cache


def prefill_rows(context: int, args) -> list[int]:
    """One row, and a batch of ``prefill_batch_tokens // context`` rows (if more than one)."""
    return sorted({1, max(1, args["prefill_batch_tokens"] // context)})


def prefill_plan(args, policies) -> list[tuple]:
    """``(context, rows, policy, budget, chunk)``, what issue 44's targets read first (a run that hits its time limit
    loses the rest): one row at every context, dense then every budget at ``prefill_chunk`` (with ``graph_prefill``
    each budget also with its full chunks replayed as a CUDA graph, captured in the prefill, policy
    ``kvpop-graphed``, or by an earlier prefill of the same shapes, ``kvpop-graph-kept``); then the batches of
    rows, likewise; then the other chunks of ``prefill_chunks`` at ``sweep_context`` with one row."""
    kvpops = ["kvpop", GRAPHED, KEPT] if args.get("graph_prefill") else ["kvpop"]

    def group(context, rows, chunks, with_dense=True):
        dense = [(context, rows, "dense", None, None)] if with_dense and "dense" in policies else []
        return dense + [(context, rows, policy, budget, chunk) for budget in args["budgets"] for chunk in chunks
                        for policy in kvpops if "kvpop" in policies]

    plan = [row for context in args["contexts"] for row in group(context, 1, [args["prefill_chunk"]])]
    plan += [row for context in args["contexts"] for rows in prefill_rows(context, args)[1:]
             for row in group(context, rows, [args["prefill_chunk"]])]
    if args["sweep_context"] in args["contexts"]:  # dense at that context is already timed (x_dense refers to it)
        others = sorted(set(args["prefill_chunks"]) - {args["prefill_chunk"]})
        plan += group(args["sweep_context"], 1, others, with_dense=False) if others else []
    return plan


def time_prefill(model, policy, ids, chunk, device, short: float = 0.5, repeats: int = 5):
    """``(seconds, peak GiB above what was allocated before)`` of one prefill; one that takes less than ``short``
    seconds is repeated up to ``repeats`` times and the median taken."""
    _oom_cleanup(device)
    before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    while len(times) < (1 if times and times[0] >= short else repeats):
        _sync(device)
        t0 = time.perf_counter()
        cache = run_prefill(model, policy, ids, chunk)
        _sync(device)
        times.append(time.perf_counter() - t0)
        del cache
    peak = _gib(torch.cuda.max_memory_allocated() - before) if device.type == "cuda" else None
    return sorted(times)[len(times) // 2], peak


def prefill_table(model, name, args, policies, device, result, out, deadline) -> None:
    """Every configuration of :func:`prefill_plan`: warmed up on a prompt of two chunks (its compiled shapes), then
    timed; KVpop's rows carry their tokens/s as a multiple of dense's at the same context and rows (``x_dense``)."""
    dense_speed = {}
    for context, rows, policy, budget, chunk in prefill_plan(args, policies):
        label = "dense" if policy == "dense" else f"kvpop-B{budget}" + policy[len("kvpop"):]
        head = {"model": name, "policy": label, "context": context, "rows": rows, "chunk": chunk,
                "compiled": policy != "dense" and device.type == "cuda" and args["compile_prefill"]}
        if time.perf_counter() > deadline:
            _emit(result, out, {**head, "skipped": "time limit"}, "prefill")
            continue
        set_policy(model, args, policy, budget)
        try:
            with warnings.catch_warnings(record=True) as caught:  # kvpop.cache: a shape that failed to compile
                warnings.simplefilter("always", RuntimeWarning)
                ids = torch.randint(0, model.config.vocab_size, (rows, context), device=device)
                t0 = time.perf_counter()
                warm = (torch.randint_like(ids, model.config.vocab_size) if policy == KEPT  # captures the kept graph
                        else ids[:, :min(context, 2 * chunk if chunk else 1024)])  # compiles its shapes
                run_prefill(model, policy, warm, chunk)
                _sync(device)
                warmup = time.perf_counter() - t0
                seconds, peak = time_prefill(model, policy, ids, chunk, device)
        except torch.OutOfMemoryError:
            _oom_cleanup(device)
            _emit(result, out, {**head, "error": "out of memory"}, "prefill")
            continue
        except Exception as err:  # noqa: BLE001 - recorded as the row; the other rows still run
            _emit(result, out, {**head, "error": error_line(err)}, "prefill")
            continue
        speed = rows * context / seconds
        row = {**head, "prefill_s": seconds, "tokens_per_s": speed, "peak_gib": peak, "warmup_s": warmup}
        fallbacks = [str(w.message) for w in caught if "torch.compile failed" in str(w.message)]
        if fallbacks:  # timed eagerly where compiling failed: say so beside the figure
            row["compile_fallback"] = fallbacks[0][:200]
        if policy == "dense":
            dense_speed[context, rows] = speed
        elif (context, rows) in dense_speed:
            row["x_dense"] = speed / dense_speed[context, rows]
        _emit(result, out, row, "prefill")
    _oom_cleanup(device)


def profile_prefill(model, name, args, device, path: Path) -> None:
    """Append to ``path`` a torch.profiler table of the top kernels (by their own device time; CPU: operator time)
    of one KVpop prefill (the first budget, ``prefill_chunk``, one row at ``sweep_context``) and of dense's."""
    context, chunk, budget = args["sweep_context"], args["prefill_chunk"], args["budgets"][0]
    for policy in ("kvpop", "dense"):
        set_policy(model, args, policy, budget)
        ids = torch.randint(0, model.config.vocab_size, (1, context), device=device)
        run_prefill(model, policy, ids[:, :min(context, 2 * chunk)], chunk)  # its compiled shapes, outside the profile
        _sync(device)
        _, sort, table = profiled(lambda: run_prefill(model, policy, ids, chunk), device, rows=30)
        label = "dense" if policy == "dense" else f"kvpop-B{budget}, chunk {chunk}"
        append_profile(path, f"{name} {label} prefill, context {context}, one row (sorted by {sort})", table)
    print(f"# profile of {name}'s prefill appended to {path}", flush=True)


def append_profile(path: Path, title: str, table: str) -> None:
    """One section of the ``--profile`` file: a prefill's or a decoding step's top kernels."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(f"## {title}\n\n{table}\n\n")


def run_config(model, name, policy, context, budget, args, device, bandwidth, result, deadline, out):
    """Prefill, the largest batch, then the fractions of it; rows appended to ``result`` as they come. A failure
    is recorded as a row and the run goes on (an unattended GPU session should not lose the other figures)."""
    config = Config(model, name, policy, context, budget, args, device, bandwidth)
    stage = "prefill"
    try:
        prefill = config.prefill()
        stage = "largest batch"
        batch, backoffs, first = config.largest_batch()
        if first is None:
            _emit(result, out, config.row(**prefill, error="out of memory at every batch tried"))
            return
        _emit(result, out, config.row(**prefill, largest_batch=batch, backoffs=backoffs, **first))
        if args["compile_decode"] == "both" and policy != "dense":  # the same batch with the layer step compiled
            stage = "compiled step"
            runtime = model.kvpop_runtime
            runtime.compile_decode = True
            try:
                _emit(result, out, config.row(**config.decode(batch), largest_compiled=True))
            finally:
                runtime.compile_decode = False
        for fraction in args["fractions"][1:]:
            smaller = max(1, int(batch * fraction))
            if smaller == batch or time.perf_counter() > deadline:
                continue
            stage = f"batch {smaller}"
            _emit(result, out, config.row(**config.decode(smaller)))
    except Exception as err:  # noqa: BLE001 - recorded, see the docstring
        _emit(result, out, config.row(error=f"{stage}: {error_line(err)}"))
    finally:
        config.cache = None
        _oom_cleanup(device)


def error_line(err: Exception) -> str:
    """A row's error: the exception's type and the first line of its message."""
    return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:200]}"


def _emit(result, out, row, table="rows"):
    result[table].append(row)
    print(json.dumps(row), flush=True)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))


def main(argv=None):
    from pipelines import ledger  # here, not at the top: transformers imports a module named `kernels` (this folder's)

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="quick")
    parser.add_argument("--out", default="")
    parser.add_argument("--models", nargs="*", choices=sorted(SHAPES))
    parser.add_argument("--contexts", type=int, nargs="*", help="prefill contexts")
    parser.add_argument("--decode-contexts", type=int, nargs="*", help="decoding contexts (none: no decoding)")
    parser.add_argument("--budgets", type=int, nargs="*", help="KVpop budgets B (sink and window fixed by the preset)")
    parser.add_argument("--policies", nargs="*", default=["dense", "kvpop"], choices=["dense", "kvpop"])
    parser.add_argument("--steps", type=int, help="timed decoding steps per batch (after warm-up)")
    parser.add_argument("--fractions", type=float, nargs="*", help="batches timed, as fractions of the largest")
    parser.add_argument("--prefill-chunk", type=int, help="KVpop's prefill chunk (columns per call)")
    parser.add_argument("--prefill-chunks", type=int, nargs="*", help="chunk sizes timed at --sweep-context")
    parser.add_argument("--sweep-context", type=int, help="the context of the chunk-size sweep (one row)")
    parser.add_argument("--prefill-batch-tokens", type=int, help="tokens per prefill batch (rows = this ÷ context)")
    parser.add_argument("--no-compile-prefill", dest="compile_prefill", action="store_false", default=None,
                        help="the fused prefill's bookkeeping eager (Runtime.compile_prefill off)")
    parser.add_argument("--no-graph-prefill", dest="graph_prefill", action="store_false", default=None,
                        help="no kvpop-B<B>-graphed / -graph-kept prefill rows (full chunks replayed as a CUDA graph)")
    parser.add_argument("--compile-decode", choices=["off", "on", "both"],
                        help="torch.compile each layer's KVpop decoding step; both: the largest batch both ways")
    parser.add_argument("--compile", dest="compile_decode", action="store_const", const="on",
                        help="same as --compile-decode on")
    parser.add_argument("--profile", metavar="FILE", help="write profiler tables of one KVpop and one dense prefill "
                        "and of every timed decoding batch's step")
    parser.add_argument("--margin-gib", type=float, help="device memory kept back when sizing the batch")
    parser.add_argument("--memory-gib", type=float, help="size batches for this much memory instead of the free")
    parser.add_argument("--max-batch", type=int)
    parser.add_argument("--time-limit", type=float,
                        help="start no new configuration after this many seconds (each model its share, the prefill "
                             "table `prefill_share` of it)")
    parser.add_argument("--no-kernel-count", action="store_true", help="skip profiling one step per batch")
    parser.add_argument("--render", metavar="RESULT.json", help="print the tables of a result file and exit")
    ledger.add_publish_arguments(parser)
    ns = parser.parse_args(argv)
    if ns.render:
        print(table(json.loads(Path(ns.render).read_text())))
        return None
    args = dict(PRESETS[ns.preset])
    for key in ("models", "contexts", "decode_contexts", "budgets", "steps", "fractions", "prefill_chunk",
                "prefill_chunks", "sweep_context", "prefill_batch_tokens", "compile_prefill", "graph_prefill",
                "compile_decode",
                "margin_gib", "memory_gib", "max_batch", "time_limit"):
        if getattr(ns, key) is not None:
            args[key] = getattr(ns, key)
    args["count_kernels"] = not ns.no_kernel_count
    for budget in args["budgets"]:
        if budget <= args["sink"] + args["window"]:
            parser.error(f"budget {budget} must exceed sink + window = {args['sink'] + args['window']}")
    for name in ("prefill_chunk", "sweep_context", "prefill_batch_tokens"):
        if args[name] < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {args[name]}")
    if any(chunk < 1 for chunk in args["prefill_chunks"]):
        parser.error(f"--prefill-chunks must be >= 1, got {args['prefill_chunks']}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and args["memory_gib"] is None and args["decode_contexts"]:
        parser.error("on CPU pass --memory-gib (there is no device memory to size the batch from)")
    return run(args, ns, device)


def run(args, ns, device):
    import kvpop
    from pipelines import ledger

    started = time.perf_counter()
    dtype = getattr(torch, args["dtype"])
    bandwidth = copy_bandwidth(device, 2.0 if device.type == "cuda" else 0.05)
    result = {"preset": ns.preset, "device": torch.cuda.get_device_name() if device.type == "cuda" else
              platform.processor() or platform.machine(), "torch": torch.__version__, "dtype": args["dtype"],
              "copy_bandwidth_gbs": bandwidth / 1e9, "sink": args["sink"], "window": args["window"],
              "compiled_prefill": device.type == "cuda" and args["compile_prefill"],
              "compiled_kvpop_step": args["compile_decode"], "steps": args["steps"], "models": {}, "prefill": [],
              "rows": []}
    if device.type == "cuda":
        result["device_memory_gib"] = _gib(torch.cuda.get_device_properties(0).total_memory)
    out = Path(ns.out) if ns.out else None
    profile = args["profile"] = Path(ns.profile) if ns.profile else None  # decoding steps append to it too
    if profile is not None:
        profile.unlink(missing_ok=True)
    max_len = max(args["contexts"] + args["decode_contexts"]) + 1024
    for index, name in enumerate(args["models"]):
        model = build_model(name, dtype, device, max_len)
        result["models"][name] = {**SHAPES[name][1], "architecture": SHAPES[name][0],
                                  "weights_gib": _gib(weight_bytes(model))}
        kvpop.retrofit(model, kvpop.Budget(args["sink"], args["window"], max(args["budgets"]) - args["sink"] -
                                           args["window"]), scorer="mlstm")
        model.kvpop_runtime.compile_prefill = args["compile_prefill"]
        model.kvpop_runtime.compile_decode = args["compile_decode"] == "on"
        plan = [(context, policy, budget) for context in args["decode_contexts"]
                for policy, budget in ([("dense", None)] if "dense" in ns.policies else [])
                + ([("kvpop", b) for b in args["budgets"]] if "kvpop" in ns.policies else [])]
        # each model its share of the time limit (what an earlier one leaves goes to the next), the prefill table
        # `prefill_share` of it and decoding the rest: slow compiles must not cost a whole model or the decode table
        t0 = time.perf_counter()
        deadline = started + args["time_limit"] * (index + 1) / len(args["models"])
        share = args["prefill_share"] if plan else 1.0
        prefill_table(model, name, args, ns.policies, device, result, out, t0 + share * (deadline - t0))
        print(f"# {name} prefill: {time.perf_counter() - t0:.1f} s", flush=True)
        if profile is not None and "kvpop" in ns.policies:
            profile_prefill(model, name, args, device, profile)
        for context, policy, budget in plan:
            label = "dense" if policy == "dense" else f"kvpop-B{budget}"
            if time.perf_counter() > deadline:
                _emit(result, out, {"model": name, "policy": label, "context": context, "skipped": "time limit"})
                continue
            set_policy(model, args, policy, budget)
            t0 = time.perf_counter()
            run_config(model, name, label, context, budget, args, device, bandwidth, result, deadline, out)
            print(f"# {name} {label} {context}: {time.perf_counter() - t0:.1f} s", flush=True)
        kept_graph().release()  # the last kept graph's buffers and memory pool
        del model
        _oom_cleanup(device)
    result["seconds"] = time.perf_counter() - started
    print(table(result))
    if out:
        out.write_text(json.dumps(result, indent=2))
        out.with_suffix(".md").write_text(table(result) + "\n")
        ledger.publish_file("capacity", out, result, ns)
    return result


def _fmt(value, spec):
    return "—" if value is None else format(value, spec)


def table(result) -> str:
    """Two markdown tables: decoding (every batch) and prefill (one row per model, policy and context)."""
    lines = [f"Serving capacity on {result['device']} ({result['dtype']}, copy bandwidth "
             f"{result['copy_bandwidth_gbs']:.0f} GB/s, {result['steps']} timed steps per batch, KVpop sink "
             f"{result['sink']} / window {result['window']}, KVpop step compiled: {result['compiled_kvpop_step']})",
             "", "Models (random weights): " + "; ".join(
                 f"{name}: {m['num_hidden_layers']} layers, {m['num_attention_heads']}/{m['num_key_value_heads']} "
                 f"heads × {m['head_dim']}, weights {m['weights_gib']:.2f} GiB"
                 for name, m in result["models"].items()),
             "", "**Decoding** (largest batch that fits first, then smaller ones)", "",
             "| model | policy | context | batch | largest? | compiled step | ms/step | tokens/s | floor ms | × floor "
             "| state GiB | K/V > weights | kernels/step | decode peak GiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        head = f"| {r['model']} | {r['policy']} | {r['context']} |"
        if "skipped" in r or "error" in r:
            lines.append(f"{head} {r.get('skipped', r.get('error'))} | | | | | | | | | | |")
            continue
        lines.append(f"{head} {r['batch']} | {'yes' if 'largest_batch' in r else ''} | "
                     f"{'yes' if r.get('compiled_step') else 'no'} | {r['step_ms']:.2f} | "
                     f"{r['tokens_per_s']:.0f} | {r['floor_ms']:.2f} | {r['x_floor']:.2f} | {r['state_gib']:.2f} | "
                     f"{'yes' if r['kv_exceeds_weights'] else 'no'} | {_fmt(r.get('kernels_per_step'), 'd')} | "
                     f"{_fmt(r.get('decode_peak_gib'), '.1f')} |")
    lines += ["", f"**Prefill** (KVpop's chunk bookkeeping compiled: {result.get('compiled_prefill')}; warm-up = "
              "the first run, compiling its shapes, not in the timing)", "",
              "| model | policy | context | rows | chunk | seconds | tokens/s | × dense | peak GiB (above weights) | "
              "warm-up s |", "|---|---|---|---|---|---|---|---|---|---|"]
    order = {name: i for i, name in enumerate(result["models"])}  # as run: the targets first; read: per context
    for r in sorted(result.get("prefill", []), key=lambda r: (order.get(r["model"], 0), r["context"], r["rows"],
                                                              r["policy"] != "dense", r["policy"], r["chunk"] or 0)):
        head = f"| {r['model']} | {r['policy']} | {r['context']} | {r['rows']} | {_fmt(r['chunk'], 'd')} |"
        if "skipped" in r or "error" in r:
            lines.append(f"{head} {r.get('skipped', r.get('error'))} | | | | |")
            continue
        lines.append(f"{head} {r['prefill_s']:.3f} | {r['tokens_per_s']:.0f} | {_fmt(r.get('x_dense'), '.2f')} | "
                     f"{_fmt(r['peak_gib'], '.2f')} | {r['warmup_s']:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
