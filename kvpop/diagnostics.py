"""What a scorer learned: its static priorities against the teacher's, on the decisions the cache makes.

Inputs are two tensors ``[..., S]`` (in practice ``[layers, B, Hkv, S]``): the student's priorities as the policy
ranks them (what :func:`kvpop.collect_priorities` returns: scorer output plus the recency term) and the teacher's
future-attention targets ``y`` (METHOD §2; ``-inf`` where a token has no deciding query). The teacher ranks by
``with_recency(y, λ)`` with the policy's ``λ`` (METHOD §3). Every metric is computed per row (each layer, sequence
and KV head), so that callers can average per layer / head and bootstrap over sequences.

1. **Decisions** (METHOD §3, :func:`kvpop.losses.boundary_decisions`): at each query with more than ``k`` eligible
   tokens, does the teacher keep ``t_new = d - w`` over its boundary token? ``agreement`` (raw), ``balanced_accuracy``
   (mean of the keep and the evict recalls) and ``auc`` (of the margin ``p[t_new] - p[t_bnd]`` as a keep score).
   The teacher keeps ``t_new`` only ~15-25 % of the time, so raw agreement rewards never admitting; balanced
   accuracy is 0.5 for a rule that always (or never) admits. The AUC of a position rule is not 0.5: its margin is
   the boundary token's age gap, which carries information; compare a scorer's AUC with ``newest``'s.
2. **Kept sets**: overlap of the long-range tokens held at a few query positions with the oracle's (the teacher's
   priorities), and the share of the oracle's future-attention mass ``Σ exp(y)`` that they hold.
3. **Rank correlation**: Spearman's ρ of priority with the teacher's over the tokens that have a target.

4. **Attention under eviction** (:func:`attention_under_eviction`): at every query of every layer and query head,
   on the dense model's own (teacher-forced) attention, the share that falls on tokens the rule has evicted by then,
   and how far the head's output moves when the softmax runs over the retained tokens only — what the three views
   above approximate through the targets, measured on what the outputs are made of. The share is split
   into the band a streaming cache of the same size keeps (ages ``w <= d - t < w + k``) and the older tokens: what a
   scorer gives up near the window for what it holds far back. A token can hold much attention and little output
   (a secondary attention sink with a small value): the output change is the one that counts.

Every view also runs the reference rules as priorities through the same code: ``newest`` (priority = position:
always admits ``t_new``, what a scorer that learned only recency does), ``oldest`` (never admits), ``random``
(seeded) and ``oracle`` (the teacher's own priorities: 1.0 by construction).

5. **Streaming layers** (:func:`streaming_layers`): the layers where the scorer's choices move the dense model's
   attention outputs more than a streaming cache of the same size, the calibration ``kvpop.set_streaming_layers``
   applies.
"""
from __future__ import annotations

import torch

from kvpop.budget import Budget
from kvpop.losses import boundary_decisions, boundary_margins, student_keeps
from kvpop.retention import eviction_positions, with_recency

REFERENCES = ("newest", "oldest", "random", "oracle")


# -----------------------------------------------------------------------------
# rank statistics along the last dim, over a mask


def average_ranks(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """0-based ranks of ``x`` among the masked entries of its row, ties averaged; NaN outside the mask.

    Masked-out entries are moved to ``+inf`` so they sort after every real one; a real entry must be finite.
    """
    if bool((mask & ~torch.isfinite(x)).any()):
        raise ValueError("average_ranks: values inside the mask must be finite")
    x = torch.where(mask, x.double(), float("inf")).contiguous()
    ordered = x.sort(-1).values
    below = torch.searchsorted(ordered, x, right=False)
    up_to = torch.searchsorted(ordered, x, right=True)
    return torch.where(mask, (below + up_to - 1).double() / 2, float("nan"))


def auc(scores: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Area under the ROC curve of ``scores`` for the boolean ``labels`` per row (Mann-Whitney U, ties count 1/2).

    NaN where a row has no positive or no negative inside ``mask``.
    """
    ranks = average_ranks(scores, mask)
    positive = mask & labels
    n_pos = positive.sum(-1).double()
    n_neg = (mask & ~labels).sum(-1).double()
    rank_sum = torch.where(positive, ranks, 0.0).sum(-1)
    u = rank_sum - n_pos * (n_pos - 1) / 2
    return u / (n_pos * n_neg)  # 0/0 -> NaN where a class is missing


def spearman(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Spearman's ρ (Pearson correlation of average ranks) per row over ``mask``; NaN if either side is constant."""
    ra, rb = average_ranks(a, mask), average_ranks(b, mask)
    n = mask.sum(-1, keepdim=True).double()
    ra = torch.where(mask, ra - torch.where(mask, ra, 0.0).sum(-1, keepdim=True) / n, 0.0)
    rb = torch.where(mask, rb - torch.where(mask, rb, 0.0).sum(-1, keepdim=True) / n, 0.0)
    return (ra * rb).sum(-1) / ((ra * ra).sum(-1) * (rb * rb).sum(-1)).sqrt()


# -----------------------------------------------------------------------------
# the three views


def reference_priorities(teacher_priority: torch.Tensor, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """The reference rules as static priorities of the teacher's shape (see the module doc)."""
    size = teacher_priority.shape[-1]
    position = torch.arange(size, dtype=torch.float64, device=teacher_priority.device).expand(teacher_priority.shape)
    generator = torch.Generator().manual_seed(seed)
    noise = torch.rand(teacher_priority.shape, generator=generator, dtype=torch.float64)
    return {"newest": position, "oldest": -position, "random": noise.to(teacher_priority.device),
            "oracle": teacher_priority.double()}


def decision_metrics(priority: torch.Tensor, teacher_priority: torch.Tensor, budget: Budget,
                     decisions=None) -> dict[str, torch.Tensor]:
    """Per row ``[...]``: ``decisions`` (count), ``keep_rate`` (teacher's), ``agreement``, ``balanced_accuracy``,
    ``auc``, and ``weighted_agreement``: agreement weighted by the teacher's margin ``|q[t_new] - q[t_bnd]|`` (its
    priorities ``q``), so that near-ties, which cost little either way, count little. Rows without a decision give
    NaN (``k = 0``, or no query with more than ``k`` eligible tokens)."""
    dec = decisions if decisions is not None else boundary_decisions(teacher_priority, budget)
    valid, keep = dec.valid, dec.keep
    keeps = student_keeps(priority, dec)
    count = valid.sum(-1).double()
    positives = keep.sum(-1).double()
    negatives = count - positives
    kept_right = (keeps & keep).sum(-1).double()
    evicted_right = (~keeps & ~keep & valid).sum(-1).double()
    margins = torch.where(valid, boundary_margins(priority.double(), dec), 0.0)
    weight = torch.where(valid, boundary_margins(teacher_priority.double(), dec).abs(), 0.0)
    agree = (keeps == keep) & valid
    return {"decisions": count,
            "weighted_agreement": torch.where(agree, weight, 0.0).sum(-1) / weight.sum(-1),
            "keep_rate": positives / count,
            "agreement": (kept_right + evicted_right) / count,
            "balanced_accuracy": (kept_right / positives + evicted_right / negatives) / 2,
            "auc": auc(margins, keep, valid)}


def kept_long_range(priority: torch.Tensor, budget: Budget, queries) -> torch.Tensor:
    """``[..., Q, S]`` bool: the eligible tokens held in the ``k`` long-range slots at each query position."""
    size = priority.shape[-1]
    evict = eviction_positions(priority, budget)  # [..., S]
    pos = torch.arange(size, device=priority.device)
    d = torch.as_tensor(list(queries), device=priority.device)[:, None]  # [Q, 1]
    eligible = (pos >= budget.sink) & (pos <= d - budget.window)
    return eligible & (d < evict[..., None, :])


def kept_set_metrics(priority: torch.Tensor, oracle_kept: torch.Tensor, mass: torch.Tensor, budget: Budget,
                     queries) -> dict[str, torch.Tensor]:
    """Per row and query ``[..., Q]``: ``overlap`` = |kept ∩ oracle kept| / |oracle kept| and ``mass_ratio`` =
    ``Σ_kept m / Σ_oracle kept m`` (``m = exp(y)``, the future attention); NaN where the oracle keeps nothing."""
    kept = kept_long_range(priority, budget, queries)
    n_oracle = oracle_kept.sum(-1).double()
    both = (kept & oracle_kept).sum(-1).double()
    mass = mass[..., None, :]
    oracle_mass = torch.where(oracle_kept, mass, 0.0).sum(-1)
    ratio = torch.where(kept, mass, 0.0).sum(-1) / oracle_mass
    nothing = n_oracle == 0
    return {"overlap": torch.where(nothing, float("nan"), both / n_oracle.clamp(min=1)),
            "mass_ratio": torch.where(nothing, float("nan"), ratio)}


def default_queries(size: int, budget: Budget) -> list[int]:
    """A few query positions over the sequence, ending at the last: 1/4, 1/2, 3/4 and ``S - 1``."""
    return sorted({max(0, size * i // 4 - 1) for i in (1, 2, 3)} | {size - 1})


def diagnose(student: torch.Tensor, targets: torch.Tensor, budgets, *, recency: float = 0.0, queries=None,
             seed: int = 0) -> dict:
    """All three views for the scorer and the reference rules, per row ``[...]`` (see the module doc).

    ``student``: ranked priorities ``[..., S]``; ``targets``: the teacher's ``y`` of the scorer's window, same shape;
    ``budgets``: the training budget and the evaluation ones (one window). Returns::

        {"queries": [...], "spearman": {rule: [...]},
         "budgets": {str(budget): {"decisions": {rule: {metric: [...]}},
                                   "kept": {rule: {"overlap" | "mass_ratio": [..., Q]}}}}}

    with ``rule`` in ``("scorer", *REFERENCES)``.
    """
    if student.shape != targets.shape:
        raise ValueError(f"student priorities {tuple(student.shape)} and teacher targets {tuple(targets.shape)} "
                         f"must have the same shape [layers, B, Hkv, S]")
    if torch.isnan(student).any() or torch.isnan(targets).any():
        raise ValueError("priorities or targets contain NaN")
    budgets = list(budgets)
    if not budgets or len({b.window for b in budgets}) != 1 or len({b.sink for b in budgets}) != 1:
        raise ValueError(f"budgets must share one sink and window (targets depend on the window), got "
                         f"{[str(b) for b in budgets]}")
    size = student.shape[-1]
    student = student.detach().double()
    targets = targets.detach().double()
    teacher = with_recency(targets, recency)
    rules = {"scorer": student, **reference_priorities(teacher, seed=seed)}
    queries = default_queries(size, budgets[0]) if queries is None else sorted({int(q) for q in queries})
    if any(q < 0 or q >= size for q in queries):
        raise ValueError(f"query positions must lie in [0, {size}), got {queries}")

    sink, window = budgets[0].sink, budgets[0].window
    pos = torch.arange(size, device=student.device)
    has_target = (pos >= sink) & (pos < size - window) & torch.isfinite(targets)
    report = {"queries": queries,
              "spearman": {name: spearman(p, teacher, has_target) for name, p in rules.items()},
              "budgets": {}}
    mass = torch.where(torch.isfinite(targets), targets.exp(), 0.0)
    for budget in budgets:
        dec = boundary_decisions(teacher, budget)
        oracle_kept = kept_long_range(teacher, budget, queries)
        report["budgets"][str(budget)] = {
            "decisions": {name: decision_metrics(p, teacher, budget, dec) for name, p in rules.items()},
            "kept": {name: kept_set_metrics(p, oracle_kept, mass, budget, queries) for name, p in rules.items()}}
    return report


def attention_under_eviction(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                             evictions: dict[str, torch.Tensor], budget: Budget, *, scale: float,
                             rows: int = 256) -> dict[str, dict[str, torch.Tensor]]:
    """Per rule, four ``[B, H, S]`` tensors over query positions ``d`` of one attention layer:

    - ``lost``: the share of ``d``'s dense causal attention on tokens the rule no longer retains at ``d`` (METHOD
      §1's predicate on its eviction positions);
    - ``lost_far``: the part of it on tokens older than the streaming band (``d - t >= window + topk``);
    - ``output_change``: ``|o_rule - o|``, how far the head's output moves when attention is the softmax over the
      retained tokens only (what the masked forward computes) instead of over all of them, and ``output_norm``:
      ``|o|`` (the same for every rule). Compare their sums, not their per-query ratio: a head that attends to a
      sink has a near-zero output, which any change makes a large relative error that the residual stream barely
      sees.

    ``queries [B, H, S, D]``, ``keys [B, Hkv, S, D]`` and ``values [B, Hkv, S, Dv]`` as attention saw them (after
    RoPE and norms; query head ``h`` reads KV head ``h // (H / Hkv)``, as ``repeat_kv`` does); ``evictions``:
    ``{rule: [B, Hkv, S]}`` from :func:`kvpop.retention.eviction_positions`. Rows are processed ``rows`` queries at
    a time (no ``[S, S]`` per head is held); computed in float32 at least. Queries before ``budget.total`` lose
    nothing under any rule and are not computed (0).
    """
    batch, heads, size, _ = queries.shape
    kv_heads = keys.shape[1]
    if keys.shape[0] != batch or keys.shape[2] != size or heads % kv_heads or values.shape[:3] != keys.shape[:3]:
        raise ValueError(f"queries {tuple(queries.shape)}, keys {tuple(keys.shape)} and values "
                         f"{tuple(values.shape)} must be [B, H, S, D], [B, Hkv, S, D] and [B, Hkv, S, Dv] with H a "
                         f"multiple of Hkv")
    for name, e in evictions.items():
        if tuple(e.shape) != (batch, kv_heads, size):
            raise ValueError(f"evictions[{name!r}] must be [B, Hkv, S] = {(batch, kv_heads, size)}, "
                             f"got {tuple(e.shape)}")
    group = heads // kv_heads
    dtype = torch.promote_types(queries.dtype, torch.float32)
    k, v = keys.to(dtype)[:, :, None], values.to(dtype)[:, :, None]  # [B, Hkv, 1, S, D]: shared by the group
    q = queries.to(dtype).unflatten(1, (kv_heads, group))  # [B, Hkv, G, S, D], as repeat_kv pairs them
    evicted_at = {name: e[:, :, None, None, :] for name, e in evictions.items()}  # [B, Hkv, 1, 1, S]
    out = {name: {part: queries.new_zeros(batch, heads, size, dtype=dtype)
                  for part in ("lost", "lost_far", "output_change", "output_norm")} for name in evictions}
    first = min(budget.total, size)  # before it no query has more tokens than the budget: nothing is evicted
    for start in range(first, size, rows):
        end = min(start + rows, size)
        pos = torch.arange(end, device=queries.device)  # keys past the chunk's last query get no attention
        d = pos[start:, None]  # [r, 1]
        probs = (q[:, :, :, start:end] @ k[..., :end, :].transpose(-1, -2) * scale).masked_fill(
            pos[None, :] > d, float("-inf")).softmax(-1)  # [B, Hkv, G, r, end]
        dense = probs @ v[..., :end, :]
        dense_norm = dense.norm(dim=-1).flatten(1, 2)
        eligible = (pos[None, :] >= budget.sink) & (pos[None, :] <= d - budget.window)  # [r, end]
        far = (d - pos[None, :]) >= budget.window + budget.topk
        for name, e in evicted_at.items():
            gone = probs * (eligible & (e[..., :end] <= d)).to(dtype)  # METHOD §1: evicted = eligible, past e[t]
            lost = gone.sum(-1)
            kept_out = (dense - gone @ v[..., :end, :]) / (1 - lost)[..., None].clamp(min=torch.finfo(dtype).tiny)
            cell = out[name]
            rows_of = slice(start, end)
            cell["lost"][:, :, rows_of] = lost.flatten(1, 2)
            cell["lost_far"][:, :, rows_of] = (gone * far.to(dtype)).sum(-1).flatten(1, 2)
            cell["output_change"][:, :, rows_of] = (kept_out - dense).norm(dim=-1).flatten(1, 2)
            cell["output_norm"][:, :, rows_of] = dense_norm
    return out


def summarize(report: dict, dim: int = 1) -> dict:
    """The report with every per-row tensor averaged over ``dim`` (the sequences: ``[layers, Hkv]`` remain),
    ignoring NaN rows."""
    def mean(value):
        if isinstance(value, dict):
            return {key: mean(v) for key, v in value.items()}
        if torch.is_tensor(value):
            return value.nanmean(dim)
        return value
    return mean(report)


def with_topks(budget: Budget, topks) -> list[Budget]:
    """``budget`` then one budget per other long-range size in ``topks`` (same sink and window)."""
    return [budget] + [Budget(budget.sink, budget.window, int(k)) for k in topks if int(k) != budget.topk]


@torch.no_grad()
def diagnose_model(model, input_ids: torch.Tensor, topks=(), *, features: str = "student", batch_size: int = 4,
                   queries=None, seed: int = 0, target_options: dict | None = None) -> dict:
    """:func:`diagnose` of a retrofitted model's scorers on held-out ``input_ids [N, S]``.

    The teacher is the model's own dense pass (:func:`kvpop.online.online_targets`: exact for scorer-only training,
    where the base is frozen); the scorers read the keys and values of the student's forward under its policy's
    budget (``features="student"``, what inference sees) or of the dense pass (``"dense"``). Budgets: the policy's
    and one per extra long-range size in ``topks``; the teacher ranks with the policy's recency term.
    ``target_options``: the target definition the scorers were trained on (``group_reduce``, ``query_power``).
    """
    from kvpop.online import FEATURE_SOURCES, dense_priorities, online_targets, student_priorities
    from kvpop.retrofit import runtime_of

    if features not in FEATURE_SOURCES:
        raise ValueError(f"features must be one of {FEATURE_SOURCES}, got {features!r}")
    runtime = runtime_of(model)
    policy = runtime.policy
    students, targets = [], []
    for batch in input_ids.split(batch_size):
        keep = (("keys", "values") + ("queries",) * runtime.window_attention_prior) if features == "dense" else ()
        online = online_targets(model, batch, keep=keep, **(target_options or {}))
        targets.append(online["targets"])
        students.append(dense_priorities(model, online["keys"], online["values"], online.get("queries"))
                        if features == "dense" else student_priorities(model, batch))
    budgets = with_topks(policy.budget, topks)
    return diagnose(torch.cat(students, 1), torch.cat(targets, 1), budgets, recency=policy.recency,
                    queries=queries, seed=seed)


@torch.no_grad()
def attention_model(model, input_ids: torch.Tensor, topks=(), *, batch_size: int = 1, seed: int = 0,
                    target_options: dict | None = None) -> dict:
    """:func:`attention_under_eviction` of a retrofitted model's scorers and the reference rules on held-out
    ``input_ids [N, S]``, per layer: ``{str(budget): {rule: {part: [layers, N, H]}}}`` with the parts of
    :func:`attention_under_eviction`, each the mean over the queries at which eviction can happen (``d >=
    budget.total``; before that every rule keeps every token).

    Priorities as in :func:`diagnose_model` (the student's own forward; the teacher's targets with the policy's
    recency term for ``oracle``; ``newest`` is a streaming cache of the same size); the attention is the dense
    pass's. Budgets: the policy's and one per extra long-range size in ``topks``.
    """
    from kvpop.online import online_targets, student_priorities
    from kvpop.retrofit import runtime_of, scoring_modules

    policy = runtime_of(model).policy
    budgets = with_topks(policy.budget, topks)
    modules = scoring_modules(model)  # the evicting layers, as the targets and kept tensors
    found: dict = {str(b): {} for b in budgets}  # budget -> rule -> part -> per layer, the batches' [b, H]
    for batch in input_ids.split(batch_size):
        online = online_targets(model, batch, keep=("queries", "keys", "values"), **(target_options or {}))
        teacher = with_recency(online["targets"].double(), policy.recency)
        rules = {"scorer": student_priorities(model, batch).double(), **reference_priorities(teacher, seed=seed)}
        for layer, module in enumerate(modules):
            q, k, v = online["queries"][layer], online["keys"][layer], online["values"][layer]
            scale = getattr(module, "scaling", q.shape[-1] ** -0.5)
            for budget in budgets:
                evictions = {name: eviction_positions(p[layer], budget) for name, p in rules.items()}
                measured = attention_under_eviction(q, k, v, evictions, budget, scale=scale)
                for name, parts in measured.items():
                    cell = found[str(budget)].setdefault(name, {part: [[] for _ in modules] for part in parts})
                    for part, value in parts.items():
                        cell[part][layer].append(value[..., budget.total:].mean(-1).cpu())
    return {key: {name: {part: torch.stack([torch.cat(batches) for batches in per_layer])
                         for part, per_layer in parts.items()}
                  for name, parts in rules_found.items()}
            for key, rules_found in found.items()}


def layer_output_errors(found: dict) -> dict:
    """Per budget and rule of :func:`attention_model`'s result: the output error ``Σ |o_rule - o| / Σ |o|`` of each
    layer over its sequences, queries and heads (a list, one float per layer)."""
    return {budget: {rule: (parts["output_change"].double().mean((1, 2)) /
                            parts["output_norm"].double().mean((1, 2))).tolist()
                     for rule, parts in rules.items()}
            for budget, rules in found.items()}


def streaming_layers(model, input_ids: torch.Tensor, *, batch_size: int = 1) -> dict:
    """Which layers should run a streaming cache instead of their scorer, from training text ``input_ids [N, S]``
    (``S`` > the policy's ``B``): ``{"layers": [...], "scorer": [...], "streaming": [...]}``, the layers where the
    scorer's output error (:func:`layer_output_errors`, at the policy's budget) exceeds newest-wins', and both
    errors per layer. The model's scorers are measured as they are, whatever streaming layers it has now."""
    from kvpop.retrofit import runtime_of

    runtime = runtime_of(model)
    if runtime.policy.name != "kvpop":
        raise ValueError(f"streaming layers calibrate the kvpop policy's scorers, not {runtime.policy.name!r}")
    if input_ids.dim() != 2 or input_ids.shape[1] <= runtime.policy.budget.total:
        raise ValueError(f"calibration text must be [N, S] with S > B = {runtime.policy.budget.total} (where "
                         f"eviction happens), got {tuple(input_ids.shape)}")
    previous, runtime.streaming_layers = runtime.streaming_layers, frozenset()
    try:
        found = attention_model(model, input_ids, batch_size=batch_size)
    finally:
        runtime.streaming_layers = previous
    errors = layer_output_errors(found)[str(runtime.policy.budget)]
    scorer, streaming = errors["scorer"], errors["newest"]
    layers = runtime.evicting_layers  # the errors are per layer with a scorer (a model's local layers have none)
    return {"layers": [layers[i] for i, (a, b) in enumerate(zip(scorer, streaming)) if a > b], "scorer": scorer,
            "streaming": streaming}
