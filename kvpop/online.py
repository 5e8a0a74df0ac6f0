"""Online targets for scorer-only training: the training step computes its own supervision (METHOD §2, §3).

In scorer-only mode the base model is frozen, so a retrofitted model is its own teacher. One dense pass of it
(:func:`kvpop.targets.teacher_pass`: the forward with its LSE, then the transposed target pass per layer) yields
every layer's targets for the scorers' window — what the precompute stage stores — with no Parquet in between.

Where the scorers' inputs come from (``features``):

* ``"dense"``: the keys and values of that same dense pass, so one forward per step. At inference the scorers read
  the keys and values of the *sparse* forward, which differ from layer 1 on (earlier layers attended to fewer
  tokens): a train/inference mismatch, small where the budget holds most of the attention.
* ``"student"``: a second forward of the student under its own mask, as the precomputed pipeline trains: the real
  inputs, at the cost of a second forward.
"""
from __future__ import annotations

import torch

from kvpop.losses import boundary_agreement, boundary_decisions, retention_loss
from kvpop.names import FEATURE_SOURCES  # also re-exported (kvpop.names says why it lives there)
from kvpop.objective import KLThroughMask
from kvpop.policies.window_attention import window_attention_priorities
from kvpop.retrofit import collect_priorities, runtime_of, scorer_window, scoring_modules
from kvpop.retention import with_recency
from kvpop.targets import teacher_pass


def _scorer_window(model) -> int:
    runtime = runtime_of(model)
    if runtime.scorer_spec is None or runtime.policy.name != "kvpop":
        raise ValueError("online targets train scorers: retrofit the model with a scorer and the kvpop policy")
    window = scorer_window(model)
    if window is None:
        raise ValueError("online targets train scorers: every layer of this model is local (its own sliding window), "
                         "none holds a scorer")
    return window


def online_targets(model, input_ids: torch.Tensor, *, group_reduce: str = "max", query_power: float = 1.0,
                   backend: str = "auto", keep: tuple[str, ...] = (), top_k: int = 0) -> dict:
    """``{"targets": [layers, B, Hkv, S]}`` for the scorers' window from one dense pass of the retrofitted model
    (and the per-layer ``keep`` tensors of :func:`kvpop.targets.teacher_pass`; with ``top_k`` > 0 its top-K logits,
    ``topk_values`` / ``topk_indices``). No gradient."""
    window = _scorer_window(model)
    out = teacher_pass(model, input_ids, [window], top_k=top_k, group_reduce=group_reduce, query_power=query_power,
                       backend=backend, keep=keep)
    logits = {name: out[name] for name in ("topk_values", "topk_indices") if top_k > 0}
    return {"targets": out["targets"][window], **{name: out[name] for name in keep}, **logits}


def dense_priorities(model, keys: list[torch.Tensor], values: list[torch.Tensor],
                     queries: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Ranked priorities ``[layers, B, Hkv, S]`` (scorer output + the policy's recency term, with grad) of each
    layer's scorer on the given per-layer ``[B, Hkv, S, D]`` keys and values; with the model's window attention
    prior (``set_window_attention_prior``) plus the prior, from the per-layer ``queries [B, Hq, S, D]`` too."""
    runtime = runtime_of(model)
    if runtime.window_attention_prior and queries is None:
        raise ValueError("this model adds the window attention prior to its scorers: pass each layer's queries too")
    out = []
    for i, (module, k, v) in enumerate(zip(scoring_modules(model), keys, values, strict=True)):
        positions = torch.arange(k.shape[2], device=k.device)
        prio = module.kvpop_scorer(k, v)
        if runtime.window_attention_prior:
            valid = torch.ones(k.shape[0], k.shape[2], dtype=torch.bool, device=k.device)
            scale = getattr(module, "scaling", k.shape[-1] ** -0.5)
            prio = prio + window_attention_priorities(queries[i], k, valid, positions.expand(k.shape[0], -1),
                                                      runtime.policy.budget, scale=scale)
        out.append(runtime.policy.ranked(prio, positions))
    return torch.stack(out)


def student_priorities(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Ranked priorities ``[layers, B, Hkv, S]`` (with grad) from a forward of the student under its own mask."""
    with collect_priorities(model) as store:
        getattr(model, model.base_model_prefix)(input_ids=input_ids, use_cache=False)  # no LM head: not needed
    return torch.stack([store[i] for i in runtime_of(model).evicting_layers]).float()


def scorer_only_step(model, input_ids: torch.Tensor, *, features: str = "dense", group_reduce: str = "max",
                     query_power: float = 1.0, backend: str = "auto", kl: KLThroughMask | None = None,
                     **loss_options) -> dict:
    """One scorer-only training step's forward: targets online, priorities, and the retention loss.

    ``loss_options`` go to :func:`kvpop.losses.retention_loss` (``tau``, ``weight``, ``balance``, ``topks``,
    ``random_pairs``, ``generator``); the teacher ranks by target (``group_reduce``, ``query_power``: METHOD §2) +
    the policy's recency term (METHOD §3). ``kl`` adds ``kl.weight`` times the KL of a relaxed forward against the
    dense pass's top-K logits (:class:`kvpop.objective.KLThroughMask`: a second forward and its backward).
    Returns ``{"loss", "boundary_acc", "student", "targets"}`` (``loss`` carries the scorers' gradient), and
    ``"kl"`` (detached) with ``kl``.
    """
    if features not in FEATURE_SOURCES:
        raise ValueError(f"features must be one of {FEATURE_SOURCES}, got {features!r}")
    policy = runtime_of(model).policy
    policy.require_one_pool("scorer_only_step")
    keep = ("keys", "values") if features == "dense" else ()
    if features == "dense" and runtime_of(model).window_attention_prior:
        keep += ("queries",)
    online = online_targets(model, input_ids, group_reduce=group_reduce, query_power=query_power, backend=backend,
                            keep=keep, top_k=kl.top_k if kl is not None else 0)
    if features == "dense":
        student = dense_priorities(model, online["keys"], online["values"], online.get("queries"))
    else:
        student = student_priorities(model, input_ids)
    teacher = with_recency(online["targets"], policy.recency)
    loss = retention_loss(student, teacher, policy.budget, **loss_options)
    with torch.no_grad():
        acc = boundary_agreement(student.detach(), boundary_decisions(teacher, policy.budget))
    out = {"loss": loss, "boundary_acc": acc, "student": student, "targets": online["targets"]}
    if kl is not None:
        divergence = kl(model, input_ids, online["topk_values"], online["topk_indices"])
        out.update(loss=loss + kl.weight * divergence, kl=divergence.detach())
    return out
