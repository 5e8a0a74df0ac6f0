"""Running a retrofitted model under each eviction policy, for evaluation (METHOD §5, §6). Torch + transformers only.

A :class:`Setting` is one policy at one budget (dense: no budget). How it runs is decided by the policy's own
``dynamic`` flag (:data:`kvpop.POLICIES`), never by its name:

* **static** policies (streaming, random, oracle, kvpop): teacher forcing is one masked forward
  (``model(ids, use_cache=False)``), which the fixed cache reproduces exactly (METHOD §5);
* **dynamic** policies (TOVA, H2O) re-score the cache from the attention they observe, so they run only through the
  fixed cache, token by token as decoding: on CUDA the left padding and the first real column in one call, then one
  decoding step captured once and replayed as a CUDA graph per column (:class:`kvpop.decode.GraphedDecoder`);
  elsewhere one call whose attention layers step token by token inside (``teacher_forced_logits(prefill=S)``);
* **dense** is the model's dense mode, or a separate ``reference`` model (the teacher of a distilled student).

The **oracle** ranks tokens by the dense teacher's future-attention targets (METHOD §2) of the very tokens it is
run on (:func:`teacher_targets`; ``target_options`` names the target definition, e.g. the ``group_reduce`` and
``query_power`` the scorer was trained on). In generation it gets the targets of the prompt followed by *dense's* greedy
continuation, by position: exact for the tokens dense produced, and for the oracle's own tokens until they diverge
from dense's (a table padded with ``-inf`` beyond: such tokens rank lowest).

Batches of unequal prompts are **left-padded**: the fixed cache takes left padding in the first chunk, and positions
count real tokens only (``cumsum(mask) - 1``, as ``generate`` does), so a padded row gives the same logits as the
row alone. **Generation** (:func:`continue_prompts`) takes the prompt as ``generate()`` does (the bounded prefill:
a dynamic policy by the cache's chunk rule), once; then the cache is repeated row by row
(``batch_repeat_interleave``) so that the greedy continuation and a given continuation to teacher-force (dense's
own, a gold answer) advance in the same decoding steps, graphed on CUDA (a ragged policy's steps run eagerly: DMS's
cache grows with Python-side checks). Greedy decoding runs a fixed number of
steps (a graph has static shapes); the caller cuts each row after its first EOS.

Item-level results, the per-item values evaluation bootstraps:

* :func:`teacher_forced_items`: per (setting, held-out sequence), :func:`kvpop.metrics.per_sequence` against the
  dense reference over positions ``>= B`` (before them every policy still sees the whole prefix);
* :func:`dms_occupancy`: a DMS model's ragged memory on the held-out sequences — the fixed budget ``B`` it matches
  in *mean* retained tokens (:func:`kvpop.dms.matched_total`), and per (layer, KV head) its mean and max retained
  tokens over the queries ``d >= B`` plus the peak: DMS is compared with fixed-budget policies at that ``B``
  (``metric_start=B``), its peak stated; capped DMS (``Setting(..., cap=)``, the row ``dms-cap``) at a given ``B``
  (``start=``), its peak the cap at most;
* :func:`generation_items`: per (setting, prompt), the greedy continuation, the tokens until its first divergence
  from dense's, and — with a continuation to teacher-force (dense's own, or a gold answer) — KL(dense ‖ policy) and
  top-1 agreement on it, plus any ``score`` of the policy's logits that predict the continuation's tokens.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from kvpop.allocation import Allocation
from kvpop.budget import Budget
from kvpop.cache import CACHE_KWARG, KVpopCache
from kvpop.decode import GraphedDecoder, chunk_bounds, padded_positions, prefill, teacher_forced_logits
from kvpop.dms import matched_total, retained_per_query
from kvpop.metrics import first_divergence, per_sequence
from kvpop.policies import ALLOCATABLE, POLICIES, build_policy
from kvpop.retrofit import collect_priorities, oracle_priorities, runtime_of, set_policy
from kvpop.targets import teacher_pass


@dataclass(frozen=True)
class Setting:
    """One policy at one requested budget (its total names the row; streaming turns it all into window).
    ``recency``: the recency term (METHOD §3) the policy ranks with here; ``anchor_share`` / ``anchor_recency``: its
    anchor slots (METHOD §1); ``None``: the model's own. ``allocation``: per-head budgets redistributing ``budget``
    (METHOD §7; no anchor slots): the row ``<policy>-H``. ``cap``: a ragged policy (DMS) holding at most that many
    tokens per (layer, KV head) (:func:`kvpop.dms.capped_eviction_positions`): the row ``<policy>-cap``."""

    policy: str
    budget: Budget | None = None
    recency: float | None = None
    anchor_share: float | None = None
    anchor_recency: float | None = None
    allocation: Allocation | None = None
    cap: int = 0

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; known: {sorted(POLICIES)}")
        if (self.policy == "dense") != (self.budget is None):
            raise ValueError(f"{self.policy}: {'dense takes no budget' if self.budget else 'needs a budget'}")
        if self.recency is not None and (self.recency < 0 or self.policy == "dense"):
            raise ValueError(f"{self.policy}: recency must be >= 0 and needs a ranked policy, got {self.recency}")
        if self.policy == "dense" and self.options:
            raise ValueError(f"dense ranks nothing: it takes no anchor slots, got {self.options}")
        if self.allocation is not None:
            if self.policy not in ALLOCATABLE:
                raise ValueError(f"{self.policy}: per-head budgets are for {', '.join(ALLOCATABLE)}")
            self.allocation.check_budget(self.budget)
            if self.anchor_share:
                raise ValueError(f"{self.key}: anchor slots are not defined under per-head budgets")
        if self.cap and not POLICIES[self.policy].ragged:
            raise ValueError(f"{self.policy}: a cap is for a ragged policy (dms); a fixed budget holds its own")

    @property
    def name(self) -> str:
        """The row's name: the policy, ``-H`` under per-head budgets, ``-cap`` under a cap."""
        if self.cap:
            return f"{self.policy}{CAPPED_SUFFIX}"
        return self.policy if self.allocation is None else f"{self.policy}{ALLOCATED_SUFFIX}"

    @property
    def label(self) -> str:
        """The budget the row runs at, as the tables print it (per-head budgets: their mode and peak)."""
        if self.budget is None:
            return "full"
        if self.cap:
            return f"{self.effective} cap {self.cap}"
        if self.allocation is None:
            return str(self.effective)
        return f"{self.effective} {self.allocation.mode} peak {self.allocation.peak_budget}"

    @property
    def options(self) -> dict:
        """The policy options this setting sets (the rest are the model's own)."""
        out = {name: getattr(self, name) for name in ("recency", "anchor_share", "anchor_recency")
               if getattr(self, name) is not None}
        if self.allocation is not None:
            out.update(allocation=self.allocation, anchor_share=0.0)
        if self.cap:
            out["cap"] = self.cap
        return out

    @property
    def dynamic(self) -> bool:
        return POLICIES[self.policy].dynamic

    @property
    def total(self) -> int | None:
        return None if self.budget is None else self.budget.total

    @property
    def effective(self) -> Budget | None:
        """The budget the policy actually runs with (streaming: ``Budget(sink, window + topk, 0)``)."""
        return None if self.budget is None else build_policy(self.policy, self.budget).budget

    @property
    def key(self) -> str:
        return "dense" if self.budget is None else f"{self.name}.B{self.budget.total}"

    def memory(self, seq_len: int, start: int) -> dict:
        """Tokens held per (layer, KV head) at the queries ``start <= d < seq_len`` the metrics count, two ways:
        ``mean`` over heads and queries, and ``peak`` (the most any head holds: what a serving engine reserves per
        head). A head of budget ``b`` holds ``min(d + 1, b)`` at query ``d``; dense holds ``d + 1``. Ragged
        policies (DMS) are measured instead (:func:`dms_occupancy`, :func:`kvpop.dms.capped_occupancy`)."""
        if POLICIES[self.policy].ragged:
            raise ValueError(f"{self.policy} keeps a ragged number of tokens: measure it (dms_occupancy)")
        queries = torch.arange(start, seq_len, dtype=torch.float64) + 1
        if self.budget is None:
            budgets = torch.tensor([float(seq_len)], dtype=torch.float64)
        elif self.allocation is None:
            budgets = torch.tensor([float(self.effective.total)], dtype=torch.float64)
        else:
            budgets = self.allocation.tensor().double().flatten()
        held = torch.minimum(queries[None, :], budgets[:, None])
        return {"mean": float(held.mean()) if held.numel() else 0.0,
                "peak": int(held.max()) if held.numel() else 0}


ALLOCATED_SUFFIX = "-H"  # a row under per-head budgets (METHOD §7) is its policy's name and this
CAPPED_SUFFIX = "-cap"  # a ragged policy's row under a cap per (layer, KV head), likewise


def settings(policies: Sequence[str], budgets: Sequence[Budget], *, kvpop_recency: float | None = None,
             kvpop_anchor_share: float | None = None, kvpop_anchor_recency: float | None = None,
             allocated: Sequence[str] = (), allocations: dict | None = None) -> list[Setting]:
    """Dense once (if listed), then every other policy at every budget, budgets in the given order.
    ``kvpop_recency``, ``kvpop_anchor_share``, ``kvpop_anchor_recency``: the kvpop rows rank with these instead of
    the model's own (the others keep theirs). ``allocated`` policies run again at every budget under
    ``allocations[budget.total]`` (an :class:`kvpop.allocation.Allocation`), as rows ``<policy>-H`` (the kvpop one
    with ``kvpop_recency`` too)."""
    out = [Setting("dense")] if "dense" in policies else []
    for b in budgets:
        for p in policies:
            if p != "dense":
                out.append(Setting(p, b, *((kvpop_recency, kvpop_anchor_share, kvpop_anchor_recency)
                                           if p == "kvpop" else ())))
        for p in allocated:
            if allocations is None or b.total not in allocations:
                raise ValueError(f"{p}{ALLOCATED_SUFFIX} at B={b.total}: no allocation for that budget")
            out.append(Setting(p, b, kvpop_recency if p == "kvpop" else None, allocation=allocations[b.total]))
    return out


@contextlib.contextmanager
def applied(model, setting: Setting) -> Iterator[None]:
    """``model`` runs ``setting`` inside the block; its policy is restored afterwards. A model that is not
    retrofitted (a plain reference teacher) can only run dense."""
    runtime = getattr(model, "kvpop_runtime", None)
    if runtime is None:
        if setting.policy != "dense":
            raise ValueError(f"{setting.key} needs a retrofitted model (kvpop.retrofit or kvpop.load_retrofitted)")
        yield
        return
    previous = runtime.policy, runtime.allocation
    set_policy(model, setting.policy, setting.budget, **setting.options)
    try:
        yield
    finally:
        runtime.policy, runtime.allocation = previous


def _device(model) -> torch.device:
    return next(model.parameters()).device


# ----------------------------------------------------------------------------------------------- padding
def left_pad(rows: Sequence[Sequence[int]], pad_id: int = 0, device=None):
    """``(ids [B, W], mask [B, W], positions [B, W])``: rows right-aligned; positions count real tokens from 0
    (padding gets 0: it is never attended to)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        if len(row):
            ids[i, width - len(row):] = torch.as_tensor(list(row), dtype=torch.long)
            mask[i, width - len(row):] = 1
    return ids.to(device), mask.to(device), padded_positions(mask).to(device)


def oracle_table(per_row: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    """Per-row targets ``[layers, Hkv, n_i]`` → one table ``[layers, B, Hkv, width]``, indexed by each row's real
    token positions, ``-inf`` where a row has no target (tokens not seen by the teacher rank lowest)."""
    first = per_row[0]
    table = torch.full((first.shape[0], len(per_row), first.shape[1], width), float("-inf"), device=first.device)
    for i, targets in enumerate(per_row):
        n = min(width, targets.shape[-1])
        table[:, i, :, :n] = targets[..., :n]
    return table


# ----------------------------------------------------------------------------------------------- logits
@torch.no_grad()
def dense_logits(model, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Logits ``[B, S, V]`` of the dense model (a retrofitted model in its dense mode, or a plain one)."""
    with applied(model, Setting("dense")):
        return model(input_ids=ids, attention_mask=mask, position_ids=_positions(ids, mask), use_cache=False).logits


def _positions(ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
    return padded_positions(mask)


@torch.no_grad()
def teacher_targets(model, ids: torch.Tensor, windows: Sequence[int], *, group_reduce: str = "max",
                    query_power: float = 1.0, backend: str = "auto") -> dict[int, torch.Tensor]:
    """Oracle priorities ``{window: [layers, B, Hkv, S]}``: the dense teacher's future-attention targets of
    ``ids`` (unpadded rows), one pass for all windows. Works on a plain and on a retrofitted model.
    ``group_reduce``, ``query_power`` and ``backend``: :func:`kvpop.targets.teacher_pass`'s (``backend="chunked"``
    where every call has a new length, see :func:`_row_targets`)."""
    return teacher_pass(model, ids, windows=sorted(set(windows)), top_k=1, group_reduce=group_reduce,
                        query_power=query_power, backend=backend)["targets"]


@torch.no_grad()
def forced_logits(model, setting: Setting, ids: torch.Tensor, *, mask: torch.Tensor | None = None,
                  targets: torch.Tensor | None = None, start: int = 0) -> torch.Tensor:
    """Teacher-forced logits ``[B, S - start, V]`` of ``ids`` (left padding in ``mask``) under ``setting``.

    ``targets`` ``[layers, B, Hkv, S]`` (indexed by real token positions) are the oracle's priorities.
    """
    if setting.policy == "oracle" and targets is None:
        raise ValueError("the oracle needs the teacher's targets of these tokens (teacher_targets)")
    context = oracle_priorities(model, targets) if setting.policy == "oracle" else contextlib.nullcontext()
    with applied(model, setting), context:
        if setting.policy == "dense" or not setting.dynamic:
            return model(input_ids=ids, attention_mask=mask, position_ids=_positions(ids, mask), use_cache=False,
                         logits_to_keep=ids.shape[1] - start).logits
        if ids.is_cuda:
            return _graphed_forced(model, ids, mask, start)
        return teacher_forced_logits(model, ids, prefill=ids.shape[1], attention_mask=mask)[:, start:]


def sequence_logits(model, setting: Setting, ids: Sequence[int] | torch.Tensor, *,
                    targets: torch.Tensor | None = None) -> torch.Tensor:
    """Logits ``[S, V]`` of one unpadded token sequence under ``setting`` (the oracle computes its own targets
    from ``model`` when none are given)."""
    ids = torch.as_tensor(ids, dtype=torch.long, device=_device(model)).reshape(1, -1)
    if setting.policy == "oracle" and targets is None:
        targets = teacher_targets(model, ids, [setting.budget.window])[setting.budget.window]
    return forced_logits(model, setting, ids, targets=targets)[0]


def _first_column(mask: torch.Tensor | None) -> int:
    """Columns of the first call before the graph steps through the rest: the left padding (which must sit in the
    first call) and one real token."""
    return 1 if mask is None else int((mask == 0).sum(-1).max()) + 1


def _graphed_forced(model, ids, mask, start):
    """Dynamic teacher forcing on CUDA: one graphed decoding step per column after the first call (token by token,
    as decoding); only the logits from ``start`` on are kept (a ``[B, S - start, V]`` buffer)."""
    size, first = ids.shape[1], _first_column(mask)
    positions = _positions(ids, mask)
    cache = KVpopCache(model, dynamic_chunks=False)
    head = model(input_ids=ids[:, :first], attention_mask=None if mask is None else mask[:, :first],
                 position_ids=positions[:, :first], use_cache=True, **{CACHE_KWARG: cache}).logits
    out = head.new_empty(ids.shape[0], size - start, head.shape[-1])
    if first > start:
        out[:, :first - start] = head[:, start:]
    decoder = GraphedDecoder(model, cache)
    for column in range(first, size):
        logits = decoder(ids[:, column:column + 1], positions[:, column:column + 1])
        if column >= start:
            out[:, column - start] = logits[:, 0]
    return out


# ----------------------------------------------------------------------------------------------- generation
@dataclass
class Continuation:
    """What :func:`continue_prompts` returns for one batch: ``tokens`` (greedy, ``max_new_tokens`` per row),
    ``logits`` ``[B, max_new_tokens, V]`` that produced them (only when asked), ``forced`` ``[B, longest, V]``: column
    ``j`` predicts forced token ``j`` (only with a forced continuation)."""

    tokens: list[list[int]]
    logits: torch.Tensor | None = None
    forced: torch.Tensor | None = None


@torch.no_grad()
def continue_prompts(model, setting: Setting, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                     pad_id: int = 0, targets: Sequence[torch.Tensor] | None = None,
                     forced: Sequence[Sequence[int]] | None = None, keep_logits: bool = False) -> Continuation:
    """One left-padded batch of ``prompts`` through the cache once, then greedy decoding — and, with ``forced`` (one
    token list per prompt), those tokens teacher-forced after the same prompt, in the same steps: after the prompt
    the cache is repeated row by row (``batch_repeat_interleave``), even rows decode greedily, odd rows are fed the
    forced tokens (right-filled with ``pad_id`` past a row's end: they come after every counted column).

    The prompt goes in as ``generate()`` takes it: the bounded prefill in chunks of ``Runtime.prefill_chunk``
    (:func:`kvpop.decode.prefill`; a dynamic policy by the cache's chunk rule), the last chunk in the call that gives
    the first token's logits; so a row gives the tokens ``generate()`` gives it, alone or in a padded batch.

    ``targets``: the oracle's, one ``[layers, Hkv, n_i]`` per prompt, indexed by token position (prompt, then
    continuation); positions past ``n_i`` get ``-inf``.
    """
    if setting.policy == "oracle" and targets is None:
        raise ValueError("the oracle needs the teacher's targets of each prompt (teacher_targets)")
    device = _device(model)
    ids, mask, positions = left_pad(prompts, pad_id, device)
    width, rows = ids.shape[1], len(prompts)
    longest = max((len(f) for f in forced), default=0) if forced is not None else 0
    steps = max(max_new_tokens, longest)
    table = oracle_table(targets, width + steps).to(device) if setting.policy == "oracle" else None
    fixed = setting.budget is not None
    graphed = fixed and ids.is_cuda and not POLICIES[setting.policy].ragged  # DMS's growing cache: eager steps
    with applied(model, setting), (oracle_priorities(model, table) if table is not None else contextlib.nullcontext()):
        cache = KVpopCache(model) if fixed else None
        end = 0
        if fixed:  # all but the last prefill chunk through the bounded prefill, as generate() does
            chunk = model.kvpop_runtime.prefill_chunk
            end = chunk_bounds(0, width, chunk)[-2]
            if end:
                prefill(model, ids[:, :end], cache=cache, chunk=chunk, attention_mask=mask[:, :end],
                        position_ids=positions[:, :end])
        out = model(input_ids=ids[:, end:], attention_mask=mask, position_ids=positions[:, end:], use_cache=True,
                    logits_to_keep=1, **({CACHE_KWARG: cache} if fixed else {}))
        cache = cache if fixed else getattr(out, CACHE_KWARG)
        last = out.logits[:, -1]
        decoder = GraphedDecoder(model, cache) if graphed else None
        branches = 2 if forced is not None else 1
        if branches == 2:  # even rows: greedy; odd rows: the forced tokens
            cache.batch_repeat_interleave(2)
            mask = mask.repeat_interleave(2, 0)
            if table is not None:
                table = table.repeat_interleave(2, 1)
            last = last.repeat_interleave(2, 0)
            fed = torch.full((rows, steps), pad_id, dtype=torch.long, device=device)
            for i, tokens in enumerate(forced):
                fed[i, :len(tokens)] = torch.as_tensor(list(tokens), dtype=torch.long)
            decoder = GraphedDecoder(model, cache) if graphed else None  # the repeated cache: a graph of its own
        context = oracle_priorities(model, table) if table is not None else contextlib.nullcontext()
        position = positions[:, -1:].repeat_interleave(branches, 0) + 1
        collected = []
        with context:
            for step in range(steps):
                collected.append(last)
                token = last.argmax(-1, keepdim=True)
                if branches == 2:
                    token[1::2, 0] = fed[:, step]
                if step == steps - 1:
                    break
                if decoder is not None:
                    last = decoder(token, position)[:, 0]
                else:
                    mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
                    last = model(input_ids=token, attention_mask=mask, position_ids=position, use_cache=True,
                                 **{CACHE_KWARG: cache}).logits[:, 0]
                position = position + 1
    logits = torch.stack(collected, 1)  # [rows * branches, steps, V]: column j predicts token j
    greedy_logits = logits[::branches, :max_new_tokens]
    return Continuation(greedy_logits.argmax(-1).tolist(), greedy_logits if keep_logits else None,
                        logits[1::2, :longest] if forced is not None else None)


def greedy(model, setting: Setting, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, pad_id: int = 0,
           targets: Sequence[torch.Tensor] | None = None) -> list[list[int]]:
    """Greedy continuations of ``prompts`` (one left-padded batch), ``max_new_tokens`` tokens each (cut at EOS by
    the caller). ``targets``: the oracle's, one ``[layers, Hkv, n_i]`` per prompt."""
    return continue_prompts(model, setting, prompts, max_new_tokens=max_new_tokens, pad_id=pad_id,
                            targets=targets).tokens


def cut_at_eos(tokens: Sequence[int], eos_id: int | None) -> list[int]:
    """The tokens up to and including the first EOS."""
    tokens = list(tokens)
    if eos_id is not None and eos_id in tokens:
        return tokens[:tokens.index(eos_id) + 1]
    return tokens


def evicting_share(prompt_lengths: Sequence[int], tokens: int, total: int) -> float:
    """The share of the ``tokens`` greedy steps after each prompt taken while a cache of ``total`` slots has evicted:
    step ``j`` (0-based) reads the prompt and ``j`` generated tokens, ``L + j`` in all, so it sees an eviction when
    ``L + j > total``. At 0 no token was ever evicted: such a row differs from dense only by the bounded path's
    arithmetic (in bf16, a noise floor), not by its policy."""
    if tokens <= 0 or not prompt_lengths:
        return 0.0
    steps = sum(max(0, min(tokens, int(n) + tokens - total - 1)) for n in prompt_lengths)  # j > total - L
    return steps / (len(prompt_lengths) * tokens)


# ----------------------------------------------------------------------------------------------- item loops
def _batches(count: int, size: int) -> Iterator[range]:
    for start in range(0, count, size):
        yield range(start, min(count, start + size))


@torch.no_grad()
def teacher_forced_items(model, sequences: Sequence[torch.Tensor], runs: Sequence[Setting], *, reference=None,
                         batch_size: int = 4, dynamic_limit: int = 0, metric_start: int | None = None,
                         target_options: dict | None = None,
                         progress: Callable[[int], None] | None = None) -> list[dict]:
    """One record per (setting, sequence) of equal-length held-out ``sequences``: ``{"policy", "B", "budget",
    "item", top1_agreement, kl, token_acc, token_acc_dense, positions, labelled}`` over positions ``>= B``
    (or ``metric_start``). Dense gets one record per budget (its own dense mode against ``reference``).
    ``dynamic_limit`` > 0: dynamic policies on the first that many sequences only. ``target_options``: the options
    of :func:`teacher_targets` the oracle ranks by (``group_reduce``, ``query_power``; default METHOD §2's)."""
    reference = model if reference is None else reference
    device = _device(model)
    budgets = list(dict.fromkeys(s.budget for s in runs if s.budget is not None))
    windows = sorted({b.window for b in budgets})
    records = []
    for rows in _batches(len(sequences), batch_size):
        ids = torch.stack([torch.as_tensor(sequences[i], dtype=torch.long) for i in rows]).to(device)
        dense = dense_logits(reference, ids)
        targets = (teacher_targets(reference, ids, windows, **(target_options or {}))
                   if any(s.policy == "oracle" for s in runs) else {})
        for setting in runs:
            if setting.policy == "dense":
                own = dense if reference is model else dense_logits(model, ids)
                for budget in budgets:
                    start = budget.total if metric_start is None else metric_start
                    records += _records(setting, budget.total, "full", rows, own, dense, ids, start)
            else:
                keep = len(rows) if not (setting.dynamic and dynamic_limit) else max(0, dynamic_limit - rows[0])
                if keep:
                    start = setting.total if metric_start is None else metric_start
                    table = targets[setting.budget.window][:, :keep] if setting.policy == "oracle" else None
                    logits = forced_logits(model, setting, ids[:keep], targets=table, start=start)
                    records += _records(setting, setting.total, setting.label, rows[:keep], logits,
                                        dense[:keep, start:], ids[:keep, start:], 0)
            if progress is not None:
                progress(len(rows))
    return records


@torch.no_grad()
def dms_occupancy(model, sequences: Sequence[torch.Tensor], *, batch_size: int = 4, start: int | None = None) -> dict:
    """A DMS model (hard gates, capped or not) on equal-length ``sequences``: ``{"B", "mean", "peak", "mean_per_head"
    [L][Hkv], "max_per_head" [L][Hkv]}`` — ``B`` the fixed budget of the same mean memory (or ``start``, given: the
    budget the row sits at), the statistics over the queries ``d >= B``, the positions the metrics count at B."""
    policy = runtime_of(model).policy
    if policy.name != "dms" or getattr(policy, "relaxed", False):
        raise ValueError(f"dms_occupancy needs a model under the hard dms policy, not {policy.name!r}")
    device, counts = _device(model), []
    for rows in _batches(len(sequences), batch_size):
        ids = torch.stack([torch.as_tensor(sequences[i], dtype=torch.long) for i in rows]).to(device)
        with collect_priorities(model) as collected:
            model(input_ids=ids, use_cache=False)
        counts.append(retained_per_query([collected[i] for i in sorted(collected)], policy.budget.window,
                                         sink=policy.budget.sink, cap=policy.cap))
    counts = torch.cat(counts, dim=1)  # [L, N, Hkv, S]
    total = matched_total(counts, policy.budget.sink + policy.budget.window) if start is None else start
    tail = counts[..., total:]
    return {"B": total, "mean": float(tail.float().mean()), "peak": int(tail.max()),
            "mean_per_head": tail.float().mean(dim=(1, 3)).tolist(), "max_per_head": tail.amax(dim=(1, 3)).tolist()}


def _records(setting, total, budget, rows, logits, dense, ids, start) -> list[dict]:
    if start:
        logits, dense, ids = logits[:, start:], dense[:, start:], ids[:, start:]
    return [{"policy": setting.name, "B": total, "budget": budget, "item": i, **metrics}
            for i, metrics in zip(rows, per_sequence(logits, dense, ids))]


@torch.no_grad()
def generation_items(model, prompts: Sequence[Sequence[int]], runs: Sequence[Setting], *, max_new_tokens: int,
                     eos_id: int | None, pad_id: int = 0, batch_size: int = 8, reference=None,
                     forced: str | Sequence[Sequence[int]] | None = "dense",
                     score: Callable[[torch.Tensor, int], dict] | None = None, target_options: dict | None = None,
                     progress: Callable[[int], None] | None = None) -> list[dict]:
    """One record per (setting, prompt): ``{"policy", "B", "budget", "item", "tokens", "divergence"}`` — the
    greedy continuation (cut after EOS) and the index of its first token that differs from dense's (its full length
    if none does) — plus, when ``forced`` is ``"dense"`` (dense's own continuation) or one token list per prompt
    (e.g. gold answers), ``kl`` and ``top1_agreement`` of the setting against dense on that continuation
    teacher-forced after the prompt, and ``score(logits [len(continuation), V], prompt index)``'s entries — row
    ``j`` of those logits predicts continuation token ``j``.

    Dense (from ``reference``, default the model's own dense mode) always runs, as the comparison; its record has
    ``policy == "dense"`` and ``B = None``. The oracle has the targets of prompt + dense's continuation
    (``target_options``: as in :func:`teacher_forced_items`).
    Prompts are batched in order of length (less padding); records are in that order too.
    """
    reference = model if reference is None else reference
    runs = [s for s in runs if s.policy != "dense"]
    windows = sorted({s.budget.window for s in runs if s.policy == "oracle"})
    by_length = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # batches of similar length: less padding
    records = []
    for span in _batches(len(prompts), batch_size):
        rows = [by_length[j] for j in span]
        batch = [list(prompts[i]) for i in rows]
        given = None if forced is None or forced == "dense" else [list(forced[i]) for i in rows]
        dense = continue_prompts(reference, Setting("dense"), batch, max_new_tokens=max_new_tokens, pad_id=pad_id,
                                 forced=given, keep_logits=forced == "dense")
        dense_tokens = [cut_at_eos(t, eos_id) for t in dense.tokens]
        if forced == "dense":  # dense teacher-forced on its own continuation: the logits it generated it with
            given = dense_tokens
            dense.forced = dense.logits[:, :max(len(t) for t in given)]
        records += _generation_records(Setting("dense"), rows, dense_tokens, dense_tokens, dense.forced, dense.forced,
                                       given, score)
        targets = ({w: [t[:, 0] for t in per] for w, per in _row_targets(
            reference, [p + d for p, d in zip(batch, dense_tokens)], windows, **(target_options or {})).items()}
            if windows else {})
        for setting in runs:
            out = continue_prompts(model, setting, batch, max_new_tokens=max_new_tokens, pad_id=pad_id,
                                   targets=targets.get(setting.budget.window) if setting.policy == "oracle" else None,
                                   forced=given)
            tokens = [cut_at_eos(t, eos_id) for t in out.tokens]
            records += _generation_records(setting, rows, tokens, dense_tokens, out.forced, dense.forced, given, score)
            if progress is not None:
                progress(len(rows))
    return records


def _row_targets(model, rows: Sequence[Sequence[int]], windows, **options) -> dict[int, list[torch.Tensor]]:
    """Teacher targets of each unpadded row: ``{window: [[layers, 1, Hkv, n_i]]}``. Every row has a length of its own,
    so not FlexAttention: compiled on CUDA, it builds one kernel per shape (seconds each, per row). ``options``:
    :func:`teacher_targets`'s target definition."""
    device = _device(model)
    per_row = [teacher_targets(model, torch.tensor([list(r)], device=device), windows, **options, backend="chunked")
               for r in rows]
    return {w: [t[w] for t in per_row] for w in windows}


def _generation_records(setting, rows, tokens, dense_tokens, logits, dense, given, score) -> list[dict]:
    metrics = [{} for _ in rows]
    if given is not None:
        counted = torch.zeros(logits.shape[:2], dtype=torch.bool, device=logits.device)
        for j, continuation in enumerate(given):
            counted[j, :len(continuation)] = True
        for j, m in enumerate(per_sequence(logits, dense, None, valid=counted)):
            metrics[j] = {"kl": m["kl"], "top1_agreement": m["top1_agreement"]}
            if score is not None:
                metrics[j].update(score(logits[j, :len(given[j])], rows[j]))
    return [{"policy": setting.name, "B": setting.total, "budget": setting.label, "item": i, "tokens": t,
             "divergence": first_divergence(t, d), **m}
            for i, t, d, m in zip(rows, tokens, dense_tokens, metrics)]
