"""Teacher-forced comparison of a policy's logits with the dense model's on the same tokens (METHOD §6).

For logits at query position ``d`` (the prediction of token ``d + 1``), over the positions ``start <= d < S``
(by default ``start`` is the budget total ``B``: before it, every policy still sees the whole prefix):

* ``top1_agreement``: ``argmax policy == argmax dense``;
* ``kl``: ``KL(dense ‖ policy) = Σ_v p_dense(v) (log p_dense(v) − log p_policy(v))``, natural log, mean per token;
* ``token_acc`` / ``token_acc_dense``: ``argmax == input_ids[d + 1]`` for the policy / for dense, over the same
  positions except the last one (``d = S − 1`` has no next token).

:func:`compare_logits` returns *sums and counts* for one batch, so that sequences of any number aggregate exactly
(token-weighted) with :func:`merge` and :func:`summarize`. :func:`per_sequence` returns the same metrics as one
mean per sequence: the per-item values that evaluation bootstraps (positions inside one sequence are not
independent, sequences are). :func:`first_divergence` compares two generated continuations. Pure torch.
"""
from __future__ import annotations

import math

import torch

SUM_KEYS = ("top1_agreement", "kl", "token_acc", "token_acc_dense")
COUNT_KEYS = {"top1_agreement": "positions", "kl": "positions", "token_acc": "labelled",
              "token_acc_dense": "labelled"}


def _positions(size: int, start: int, valid: torch.Tensor | None, batch: int, device) -> torch.Tensor:
    """Boolean ``[B, S]``: the query positions that count (``>= start`` and, if given, ``valid``)."""
    keep = (torch.arange(size, device=device) >= start).expand(batch, size)
    if valid is not None:
        keep = keep & valid.to(device=device, dtype=torch.bool)
    return keep


@torch.no_grad()
def compare_logits(policy_logits: torch.Tensor, dense_logits: torch.Tensor, input_ids: torch.Tensor | None = None,
                   *, start: int = 0, valid: torch.Tensor | None = None, chunk: int = 256) -> dict[str, float]:
    """Sums and counts of the metrics for one batch of logits ``[B, S, V]`` (or ``[S, V]``).

    ``input_ids [B, S]`` (the tokens the logits were computed on) give the token accuracies; without them those
    two sums are 0 over 0 positions. ``valid [B, S]`` excludes positions (padding). ``chunk`` positions are
    converted to log-probabilities at a time, so no second ``[B, S, V]`` float tensor is allocated.

    Returns ``{"top1_agreement", "kl", "token_acc", "token_acc_dense"}`` (sums) and ``{"positions", "labelled"}``
    (counts); turn them into means with :func:`summarize`.
    """
    rows = _row_sums(policy_logits, dense_logits, input_ids, start, valid, chunk)
    return {key: (int(value.sum()) if key in ("positions", "labelled") else float(value.sum()))
            for key, value in rows.items()}


@torch.no_grad()
def per_sequence(policy_logits: torch.Tensor, dense_logits: torch.Tensor, input_ids: torch.Tensor | None = None,
                 *, start: int = 0, valid: torch.Tensor | None = None, chunk: int = 256) -> list[dict[str, float]]:
    """The metrics of :func:`compare_logits` as one mean per sequence (row): ``[{"top1_agreement", "kl",
    "token_acc", "token_acc_dense", "positions", "labelled"}]``, NaN where a row has no position to count."""
    rows = _row_sums(policy_logits, dense_logits, input_ids, start, valid, chunk)
    batch = rows["positions"].shape[0]
    return [summarize({key: (int(value[b]) if key in ("positions", "labelled") else float(value[b]))
                       for key, value in rows.items()}) for b in range(batch)]


def _row_sums(policy_logits, dense_logits, input_ids, start, valid, chunk) -> dict[str, torch.Tensor]:
    """Per-row sums (float64 ``[B]``) and counts (int64 ``[B]``): the one implementation of the metrics."""
    if policy_logits.shape != dense_logits.shape:
        raise ValueError(f"policy logits {tuple(policy_logits.shape)} and dense logits {tuple(dense_logits.shape)} "
                         f"differ: compare the same tokens")
    if policy_logits.dim() == 2:
        policy_logits, dense_logits = policy_logits[None], dense_logits[None]
        input_ids = None if input_ids is None else input_ids.reshape(1, -1)
        valid = None if valid is None else valid.reshape(1, -1)
    if policy_logits.dim() != 3:
        raise ValueError(f"logits must be [B, S, V] or [S, V], got {tuple(policy_logits.shape)}")
    batch, size, _ = policy_logits.shape
    if input_ids is not None and tuple(input_ids.shape) != (batch, size):
        raise ValueError(f"input_ids must be [B, S] = {(batch, size)}, got {tuple(input_ids.shape)}")
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    device = policy_logits.device
    keep = _positions(size, start, valid, batch, device)
    labelled = keep.clone()
    labelled[:, -1] = False  # the last position predicts a token that is not there
    if valid is not None:  # the next token must be real too
        labelled[:, :-1] &= valid[:, 1:].to(device=device, dtype=torch.bool)
    sums = {key: torch.zeros(batch, dtype=torch.float64, device=device) for key in SUM_KEYS}
    for lo in range(0, size, chunk):
        hi = min(size, lo + chunk)
        k = keep[:, lo:hi]
        if not bool(k.any()):
            continue
        pol = policy_logits[:, lo:hi].float()
        den = dense_logits[:, lo:hi].float()
        top_pol, top_den = pol.argmax(-1), den.argmax(-1)
        sums["top1_agreement"] += ((top_pol == top_den) & k).sum(-1)
        log_p = torch.log_softmax(den, -1)
        log_q = torch.log_softmax(pol, -1)
        kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # [B, chunk]
        sums["kl"] += torch.where(k, kl, 0.0).double().sum(-1)
        if input_ids is not None:
            lab = labelled[:, lo:hi]
            nxt = input_ids.to(device)[:, lo + 1:hi + 1]
            if nxt.shape[1] < hi - lo:  # the last chunk: pad the missing next token (never counted)
                nxt = torch.cat([nxt, nxt.new_full((batch, hi - lo - nxt.shape[1]), -1)], 1)
            sums["token_acc"] += ((top_pol == nxt) & lab).sum(-1)
            sums["token_acc_dense"] += ((top_den == nxt) & lab).sum(-1)
    counts = {"positions": keep.sum(-1).cpu(),
              "labelled": labelled.sum(-1).cpu() if input_ids is not None else torch.zeros(batch, dtype=torch.long)}
    return {**{key: value.cpu() for key, value in sums.items()}, **counts}


def first_divergence(generated, reference) -> int:
    """The index of the first token where two continuations differ; the shorter length if one is a prefix of the
    other (equal continuations: their length). Token ids as lists or 1-D tensors."""
    a, b = list(map(int, generated)), list(map(int, reference))
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def merge(stats: list[dict] | tuple[dict, ...]) -> dict[str, float]:
    """Add up the sums and counts of several :func:`compare_logits` results (sequences, batches)."""
    total = dict.fromkeys((*SUM_KEYS, "positions", "labelled"), 0)
    for item in stats:
        for key in total:
            total[key] += item.get(key, 0)
    return total


def summarize(stats: dict | list[dict]) -> dict[str, float]:
    """Token-weighted means: ``{"top1_agreement", "kl", "token_acc", "token_acc_dense", "positions",
    "labelled"}``; a metric with no position to count is NaN."""
    total = merge(stats if isinstance(stats, (list, tuple)) else [stats])
    out = {}
    for key in SUM_KEYS:
        count = total[COUNT_KEYS[key]]
        out[key] = total[key] / count if count else math.nan
    out["positions"], out["labelled"] = total["positions"], total["labelled"]
    return out


def mean_over_sequences(values: list[dict], keys=SUM_KEYS) -> dict[str, float]:
    """Per-sequence means averaged with equal weight per sequence (the alternative to :func:`summarize`)."""
    out = {}
    for key in keys:
        finite = [v[key] for v in values if key in v and not math.isnan(v[key])]
        out[key] = sum(finite) / len(finite) if finite else math.nan
    return out
