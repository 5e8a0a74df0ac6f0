"""The retention rule of METHOD §1, exactly, in O(S log S) per row and O(S) memory.

At query position ``d`` a KV head keeps: the sinks ``t < sink``, the window ``d - window < t <= d``, and the
``topk`` *eligible* tokens ``sink <= t <= d - window`` with the highest static priority, ties won by the newer
token. Because priorities are static and the eligible set only grows, an evicted token never returns, so the
whole rule is captured by one number per token, its eviction position ``e[t]``: the first query position at
which ``t`` is no longer retained (``S`` if that does not happen inside the sequence).

How ``e`` is computed without an S×S tensor: rank the candidates ``[sink, S)`` by (priority, position), so that
"u beats t" is ``rank[u] > rank[t]``. Let ``theta[D]`` be the ``topk``-th largest rank among the eligible prefix
``[sink, D]``; it never decreases in ``D``, and ``t`` is kept at ``d`` iff ``rank[t] >= theta[d - window]``. So
``e[t] = window + max(t, first D with theta[D] > rank[t])``: one binary search per token. ``theta`` for every
prefix comes from a wavelet-matrix descent (one pass per bit of the rank, each O(S)), vectorised over rows.

Anchor slots (two top-k pools over the same eligible tokens, each on its own static priority) keep the property:
each pool's ``e`` is the rule above, and a token leaves the union when it has left both, ``max`` of the two.

Per-head budgets (METHOD §7): sink and window are shared, ``topk`` may differ row by row (``topk=`` a long tensor
broadcastable to the leading dims, e.g. ``[Hkv]`` for priorities ``[B, Hkv, S]``). Each row is the rule above at its
own ``k``; the wavelet descent takes a ``k`` per row, so rows of any budgets are still one vectorised pass. A row at
``k = 0`` (the floor: sinks and window only) evicts a token as it leaves the window; a row whose ``k`` covers every
eligible token evicts nothing.
"""
from __future__ import annotations

import torch

from kvpop.budget import Budget


def _check_priority(priority: torch.Tensor) -> None:
    if not torch.is_tensor(priority) or not priority.is_floating_point():
        raise ValueError(f"priority must be a float tensor [..., S], got {type(priority).__name__} "
                         f"{getattr(priority, 'dtype', '')}")
    if priority.dim() < 1 or priority.shape[-1] < 1:
        raise ValueError(f"priority must have shape [..., S] with S >= 1, got {tuple(priority.shape)}")
    if torch.isnan(priority).any():
        raise ValueError("priority contains NaN: the ranking (and so the mask) would be undefined")


def ranks_newer_wins(priority: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank the last dim ascending by (priority, position): ties go to the newer (higher) position.

    Returns ``(rank, order)`` with ``rank[..., t]`` in ``0 … n-1`` and ``order`` its inverse
    (``order[..., r]`` is the position holding rank ``r``).
    """
    order = torch.sort(priority, dim=-1, stable=True).indices  # stable: equal priorities keep position order
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    return rank, order


def row_topk(topk, lead: torch.Size, device) -> torch.Tensor | None:
    """``topk`` (``None``, an int, or a long tensor broadcastable to ``lead``) as one long per row ``[*lead]``;
    ``None`` stays ``None`` (the budget's own). Negative or non-integer values are a one-line ``ValueError``."""
    if topk is None:
        return None
    if isinstance(topk, bool) or not (isinstance(topk, int) or (torch.is_tensor(topk) and not topk.is_floating_point()
                                                                and not topk.is_complex())):
        raise ValueError(f"topk must be an int or an integer tensor (one per row), got {type(topk).__name__}")
    k = torch.as_tensor(topk, dtype=torch.long, device=device)
    if (k < 0).any():
        raise ValueError(f"topk must be >= 0 in every row, got a minimum of {int(k.min())}")
    try:
        return k.expand(lead)
    except RuntimeError:
        raise ValueError(f"topk of shape {tuple(k.shape)} does not broadcast to the rows {tuple(lead)}") from None


def prefix_kth_largest(rank: torch.Tensor, k: int | torch.Tensor) -> torch.Tensor:
    """``theta[..., j]`` = the ``k``-th largest of ``rank[..., :j+1]`` (``-1`` while fewer than ``k`` exist).

    ``rank`` is a permutation of ``0 … n-1`` on its last dim. ``k``: an int, or a long tensor broadcastable to the
    leading dims (each row its own ``k``). Wavelet-matrix descent: for every prefix at once, walk the bits of the
    answer from the top, keeping the prefix's interval in the stably bit-partitioned array. Time O(n log n), memory
    O(n) per row; never an n×n tensor. An int ``k`` is checked on the host: no step waits on the device (a fused
    prefill chunk); a ``k`` per row is checked on the device's values (per-head budgets, masks).
    """
    if isinstance(k, int) and not isinstance(k, bool):
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        k_rows = k
    else:
        k_rows = row_topk(k, rank.shape[:-1], rank.device)
        if k_rows.numel() and int(k_rows.min()) < 1:
            raise ValueError(f"k must be >= 1, got {int(k_rows.min())}")
    return wavelet_kth_largest(rank, k_rows)


def wavelet_kth_largest(rank: torch.Tensor, k_rows: int | torch.Tensor) -> torch.Tensor:
    """:func:`prefix_kth_largest` without its checks: ``k_rows`` an int >= 1 or a long tensor of values >= 1 already
    expanded to the leading dims. Never reads a device value on the host, so callers that know their ``k`` (a
    training step's budgets) queue the whole descent without a sync."""
    lead, n = rank.shape[:-1], rank.shape[-1]
    arr = rank.reshape(-1, n)
    rows, device = arr.shape[0], arr.device
    prefix_len = torch.arange(1, n + 1, device=device).expand(rows, n)
    lo = torch.zeros(rows, n, dtype=torch.long, device=device)
    hi = prefix_len.clone()
    if isinstance(k_rows, int):
        remaining = torch.full((rows, n), k_rows, dtype=torch.long, device=device)
    else:
        k_rows = k_rows.reshape(rows, 1)
        remaining = k_rows.expand(rows, n).clone()
    answer = torch.zeros(rows, n, dtype=torch.long, device=device)
    zero_col = torch.zeros(rows, 1, dtype=torch.long, device=device)
    position = torch.arange(n, device=device).expand(rows, n)
    for bit in reversed(range(max(1, (n - 1).bit_length()))):
        bits = (arr >> bit) & 1
        ones_before = torch.cat([zero_col, bits.cumsum(-1)], dim=-1)  # [rows, n+1]
        zeros_total = n - ones_before[:, -1:]
        ones_lo, ones_hi = ones_before.gather(-1, lo), ones_before.gather(-1, hi)
        ones_in = ones_hi - ones_lo
        take_one = ones_in >= remaining  # the k-th largest has this bit set
        answer |= take_one.long() << bit
        remaining = torch.where(take_one, remaining, remaining - ones_in)
        lo = torch.where(take_one, zeros_total + ones_lo, lo - ones_lo)
        hi = torch.where(take_one, zeros_total + ones_hi, hi - ones_hi)
        if bit:  # stable partition for the next bit: zeros first, then ones, each in order
            target = torch.where(bits.bool(), zeros_total + ones_before[:, :-1], position - ones_before[:, :-1])
            arr = torch.empty_like(arr).scatter_(-1, target, arr)
    answer = torch.where(prefix_len >= k_rows, answer, torch.full_like(answer, -1))
    return answer.reshape(*lead, n)


def eviction_positions(priority: torch.Tensor, budget: Budget, positions: torch.Tensor | None = None,
                       topk: torch.Tensor | None = None, *, check: bool = True) -> torch.Tensor:
    """``e[..., t]``: the first query position at which token ``t`` is no longer retained, ``S`` if never.

    ``priority`` is float ``[..., S]`` (any leading dims); sinks and tokens whose eviction would fall at or past
    the end get ``S``. Token ``t`` is visible to query ``d`` iff ``t <= d`` and
    (``t < sink`` or ``t > d - window`` or ``d < e[t]``) — see :func:`retained`.

    ``positions`` (optional, broadcastable to ``priority``, strictly increasing along the last dim) gives each
    entry's sequence position when the entries are a subset of the tokens — a cache's slots plus a new chunk, or a
    left-padded row (pads get negative positions: like sinks they never compete). The subset must contain every
    token still retained at the first query of interest (evicted tokens never return, so the rest cannot matter).
    Then ``e`` is in positions and "never" is ``positions.max() + 1``.

    ``topk`` (optional, a long tensor broadcastable to the leading dims): each row's own long-range slots in place of
    ``budget.topk`` (per-head budgets, METHOD §7); ``budget`` then gives the shared sink and window.

    Without ``topk``, no step waits on the device (a fused prefill chunk runs it inside ``torch.compile`` / a CUDA
    stream without a host round trip); ``check=False`` also skips the input check, whose NaN test is one such wait.
    """
    if check:
        _check_priority(priority)
    size = priority.shape[-1]
    s, w, k = budget.sink, budget.window, budget.topk
    k_rows = row_topk(topk, priority.shape[:-1], priority.device)
    if positions is None:
        pos = torch.arange(size, device=priority.device).expand(priority.shape)
        never = size
    else:
        pos = positions.to(device=priority.device, dtype=torch.long).expand(priority.shape)
        never = pos.amax() + 1  # a 0-dim tensor: reading it on the host would wait for the device
    competes = pos >= s
    if (k == 0) if k_rows is None else not bool((k_rows > 0).any()):
        leave = pos + w  # nothing to keep: evicted as soon as it leaves the window
    else:
        # non-competitors sit before every competitor and get -inf, so they take the lowest ranks and never evict one
        rank, _ = ranks_newer_wins(torch.where(competes, priority, float("-inf")))
        # theta[r, j]: k-th best rank of row r once entries 0..j are eligible (a row at k = 0 is overridden below);
        # rows of one 2-D buffer: inductor (torch 2.11, CUDA) cannot lower searchsorted over a reshaped view of one
        rows = rank.reshape(-1, size)
        theta = prefix_kth_largest(rows, k if k_rows is None else k_rows.clamp(min=1).reshape(-1))
        first_beaten = torch.searchsorted(theta, rows, right=True).reshape(rank.shape)
        index = torch.maximum(first_beaten, torch.arange(size, device=priority.device))  # not before it is eligible
        leave = torch.where(index < size, pos.gather(-1, index.clamp(max=size - 1)) + w, never)
        if k_rows is not None:
            leave = torch.where(k_rows[..., None] > 0, leave, pos + w)
    return torch.where(competes, torch.minimum(leave, torch.as_tensor(never, device=leave.device)), never)


def retained(query_pos: torch.Tensor, token_pos: torch.Tensor, eviction: torch.Tensor, budget: Budget):
    """The visibility predicate of METHOD §1 on broadcastable tensors (used by masks and references alike)."""
    causal = token_pos <= query_pos
    protected = (token_pos < budget.sink) | (token_pos > query_pos - budget.window)
    return causal & (protected | (query_pos < eviction))


def visible_from_eviction(eviction: torch.Tensor, budget: Budget) -> torch.Tensor:
    """Dense ``[..., S, S]`` mask (query, key) from eviction positions; for small S only."""
    size = eviction.shape[-1]
    pos = torch.arange(size, device=eviction.device)
    return retained(pos[:, None], pos[None, :], eviction[..., None, :], budget)


def visible(priority: torch.Tensor, budget: Budget, topk: torch.Tensor | None = None) -> torch.Tensor:
    """Dense reference ``[..., S, S]`` (query ``d``, key ``t``): the rule applied directly at every query.

    Independent of :func:`eviction_positions` (a per-query top-k over the eligible prefix), O(S² log S):
    for tests and small S only. ``topk`` as in :func:`eviction_positions`: each row is then the rule at its own
    budget, row by row.
    """
    _check_priority(priority)
    k_rows = row_topk(topk, priority.shape[:-1], priority.device)
    if k_rows is not None:
        rows = priority.reshape(-1, priority.shape[-1])
        size = priority.shape[-1]
        masks = [visible(row, Budget(budget.sink, budget.window, int(k))) for row, k in zip(rows, k_rows.reshape(-1))]
        return torch.stack(masks).reshape(*priority.shape, size) if masks else \
            torch.zeros(*priority.shape, size, dtype=torch.bool, device=priority.device)
    size = priority.shape[-1]
    s, w, k = budget.sink, budget.window, budget.topk
    pos = torch.arange(size, device=priority.device)
    d, t = pos[:, None], pos[None, :]
    mask = (t <= d) & ((t < s) | (t > d - w))
    eligible = (t >= s) & (t <= d - w)  # [S, S]
    if k > 0:
        rank, _ = ranks_newer_wins(priority)  # ranks over all positions order the same as over the eligible ones
        score = torch.where(eligible, rank[..., None, :].expand(*priority.shape[:-1], size, size), -1)
        top = score.topk(min(k, size), dim=-1).indices  # the k best eligible per query (ineligible score -1)
        chosen = torch.zeros_like(mask.expand_as(score)).scatter(-1, top, True) & eligible
        mask = mask | chosen
    return mask.expand(*priority.shape[:-1], size, size)


def with_recency(priority: torch.Tensor, recency: float, positions: torch.Tensor | None = None) -> torch.Tensor:
    """``priority[t] + recency * t`` (METHOD §3): ranks like a decay in ``d - t`` and stays static.

    The one implementation of the recency term: the policies rank the student by it (mask and cache alike) and the
    training objective ranks the teacher by it. ``positions`` (broadcastable to ``priority``) are the tokens'
    sequence positions when the entries are not ``0 … S-1`` (a cache's slots, a chunk).
    """
    if recency < 0:
        raise ValueError(f"recency must be >= 0, got {recency}")
    if recency == 0:
        return priority
    if positions is None:
        positions = torch.arange(priority.shape[-1], device=priority.device)
    return priority + recency * positions.to(priority.dtype)


def anchored_eviction_positions(ranked: torch.Tensor, anchor_ranked: torch.Tensor | None, budget: Budget,
                                anchors: int, positions: torch.Tensor | None = None, *,
                                check: bool = True) -> torch.Tensor:
    """``e`` when ``anchors`` of the ``topk`` long-range slots rank apart (METHOD §1, anchor slots).

    Two pools over the same eligible tokens: ``topk - anchors`` slots keep the best by ``ranked`` (the priority with
    the policy's recency term), ``anchors`` slots the best by ``anchor_ranked`` (the same priority with the anchors'
    own term); a token is retained while either pool holds it. Each pool is the rule of :func:`eviction_positions`
    on its own static priority, so each evicts a token once and for all, and so does their union:
    ``e = max(e_main, e_anchor)``. At most ``topk`` long-range tokens are retained (fewer where the pools overlap).
    ``anchors = 0`` is the one-pool rule (``anchor_ranked`` unused). ``positions`` and ``check`` as in
    :func:`eviction_positions`.
    """
    if not 0 <= anchors <= budget.topk:
        raise ValueError(f"anchors must be in 0 … topk = {budget.topk}, got {anchors}")
    if anchors == 0:
        return eviction_positions(ranked, budget, positions, check=check)
    main = eviction_positions(ranked, Budget(budget.sink, budget.window, budget.topk - anchors), positions,
                              check=check)
    anchor = eviction_positions(anchor_ranked, Budget(budget.sink, budget.window, anchors), positions, check=check)
    return torch.maximum(main, anchor)


def visible_anchored(ranked: torch.Tensor, anchor_ranked: torch.Tensor, budget: Budget, anchors: int) -> torch.Tensor:
    """Dense reference of :func:`anchored_eviction_positions`: each pool's rule applied at every query
    (:func:`visible`), a key visible if either pool's mask has it. For tests and small S only."""
    main = visible(ranked, Budget(budget.sink, budget.window, budget.topk - anchors))
    return main | visible(anchor_ranked, Budget(budget.sink, budget.window, anchors))


def kept_counts(eviction: torch.Tensor, budget: Budget) -> torch.Tensor:
    """Tokens retained at the last query position, per row — at most ``budget.total``."""
    size = eviction.shape[-1]
    last = torch.tensor(size - 1, device=eviction.device)
    pos = torch.arange(size, device=eviction.device)
    return retained(last, pos, eviction, budget).sum(-1)


def soft_cutoffs(ranked: torch.Tensor, budget: Budget, topk: torch.Tensor | None = None) -> torch.Tensor:
    """``c[..., d]``: the threshold between the kept and the evicted long-range tokens at query ``d`` — the midpoint
    of the ``topk``-th and ``(topk + 1)``-th largest ranked priority among the eligible ``[sink, d - window]`` — or
    ``-inf`` where at most ``topk`` are eligible (no eviction yet). ``ranked`` float ``[..., S]``, positions
    ``0 … S-1`` (unpadded whole sequences: soft retention is a training form).

    Kept tokens lie above ``c[d]``, evicted ones below (ties at the cutoff sit on it), so ``sigmoid((p[t] - c[d]) /
    tau)`` is a relaxed retention that tends to the hard rule as ``tau -> 0`` (METHOD §3, KL through the mask). Same
    order statistics as :func:`eviction_positions` (``ranks_newer_wins`` + :func:`prefix_kth_largest`), O(S log S);
    ``topk = 0`` evicts every eligible token: ``+inf`` where any is eligible. ``topk=`` (per-row long-range slots,
    as in :func:`eviction_positions`) gives each row its own cutoff.
    """
    _check_priority(ranked)
    size, device = ranked.shape[-1], ranked.device
    s, w = budget.sink, budget.window
    k_rows = row_topk(topk, ranked.shape[:-1], device)
    k = torch.full(ranked.shape[:-1], budget.topk, dtype=torch.long, device=device) if k_rows is None else k_rows
    k = k[..., None]  # [..., 1]: one k per row
    pos = torch.arange(size, device=device)
    last = pos - w  # the newest eligible token of query d
    eligible = (last - s + 1).clamp(min=0)
    none_kept = torch.where(eligible > 0, float("inf"), float("-inf")).to(ranked.dtype).expand(ranked.shape)
    if not bool((k > 0).any()):
        return none_kept.clone()
    competes = pos >= s
    rank, order = ranks_newer_wins(torch.where(competes, ranked, float("-inf")))
    ascending = ranked.gather(-1, order)  # ranked priority by rank
    index = last.clamp(min=0).expand(ranked.shape)
    kth = prefix_kth_largest(rank, k[..., 0].clamp(min=1)).gather(-1, index).clamp(min=0)
    next_kth = prefix_kth_largest(rank, k[..., 0].clamp(min=1) + 1).gather(-1, index).clamp(min=0)
    cut = (ascending.gather(-1, kth) + ascending.gather(-1, next_kth)) / 2
    cut = torch.where(eligible > k, cut, torch.full_like(cut, float("-inf")))
    return torch.where(k > 0, cut, none_kept)


def soft_retention_bias(ranked: torch.Tensor, cutoffs: torch.Tensor, budget: Budget, tau: float) -> torch.Tensor:
    """Dense ``[..., S, S]`` (query, key) additive scores of the relaxed retention: ``log sigmoid((p[t] - c[d]) /
    tau)`` for the eligible ``sink <= t <= d - window``, 0 for sinks and the window, ``-inf`` above the diagonal.
    For tests and small S only (the attention backends compute it per block, never S×S)."""
    size = ranked.shape[-1]
    pos = torch.arange(size, device=ranked.device)
    d, t = pos[:, None], pos[None, :]
    eligible = (t >= budget.sink) & (t <= d - budget.window)
    z = (ranked[..., None, :] - cutoffs[..., :, None]) / tau
    bias = torch.where(eligible, torch.nn.functional.logsigmoid(z), torch.zeros((), dtype=z.dtype))
    return bias.masked_fill(t > d, float("-inf"))
