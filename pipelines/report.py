"""Evaluation results with their intervals: per-item records → a summary (JSON), a text report, MLflow metrics, figures.

Records are what :mod:`kvpop.evaluation` returns, tagged by the stage with ``part`` (``text``: held-out sequences,
``recall``: task samples, ``generation``: long free generation from prompts) and a string ``item`` id. A metric's
value may be ``None`` where it is undefined for an item (a problem dense did not solve); such items are left out.

:func:`summarize` gives, per part × metric × budget:

* every policy's mean with its 95 % percentile-bootstrap interval over items (:mod:`pipelines.stats`);
* every policy's paired difference to ``streaming`` and to the *best heuristic* — the best of the :data:`HEURISTICS`
  that ran (streaming, TOVA, H2O, window attention) by the point estimate at that budget, chosen per metric — on the
  items both have, with ``resolved`` (the interval excludes 0) and the items a difference of that size would need
  (:func:`pipelines.stats.items_needed`); and
  ``kvpop``'s paired difference to each trained baseline's row (a policy name outside :data:`POLICY_ORDER`:
  ``eval.baselines``, e.g. StreamingLLM+ or DMS); a row under per-head budgets (``<policy>-H``, METHOD §7) against
  its uniform row, and ``kvpop-H`` against every heuristic and trained baseline as ``kvpop`` is;
* the fraction of the streaming → oracle gap each other policy closes (a paired ratio of means);
* for the recall part, accuracy per cell (task, context, depth); the headline recall metrics use only the cells the
  stage marked ``headline`` (dense accuracy at least the calibration threshold), and each policy's headline exact
  match is also given as a share of dense's on the same samples (a paired ratio of means).

Wording follows the intervals: "above" / "below" only where the paired interval excludes 0, otherwise "not resolved
(≈ N items needed)". Per-item values are rounded to 1e-6 first, so that float noise is not a resolved difference.
Dense records of the generation parts carry ``B = None`` and stand in every budget's block.

**More corpora** (the stage's ``eval.heldout_sources``): a summary may hold ``corpora`` — ``{corpus name: {"source",
**its own summarize() of that corpus's text records}}``. :func:`format_report` adds a section per corpus after the
main one; :func:`mlflow_metrics` names its metrics ``<corpus>.<the main names>``.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from pipelines import stats

HEURISTICS = ("streaming", "tova", "h2o", "window_attention")
POLICY_ORDER = ("dense", "streaming", "tova", "h2o", "window_attention", "random", "oracle",
                "kvpop", "window_attention-H", "random-H", "oracle-H", "kvpop-H")  # then trained baselines' rows
NARRATED = ("kvpop", "oracle", "kvpop-H", "oracle-H")  # what the closing sentences speak about (and trained baselines)
ALLOCATED = "-H"  # a row under per-head budgets: its policy's name and this (kvpop.evaluation.ALLOCATED_SUFFIX)
PART_TITLES = {"text": "held-out text, teacher-forced against dense (positions >= B)",
               "recall": "recall tasks, greedy exact match and gold answer teacher-forced (headline cells)",
               "generation": "long free generation from held-out prompts (dense's continuation teacher-forced)"}
ITEM_NAMES = {"text": "sequences", "recall": "samples", "generation": "prompts"}


@dataclass(frozen=True)
class Metric:
    part: str
    field: str  # in the records
    name: str  # in the JSON and MLflow names
    label: str  # in the printed table
    higher_is_better: bool
    digits: int = 3


METRICS = (
    Metric("text", "top1_agreement", "top1_agreement", "top1", True),
    Metric("text", "kl", "kl", "kl", False, 4),
    Metric("text", "token_acc", "token_acc", "acc", True),
    Metric("recall", "exact", "recall_exact", "exact", True),
    Metric("recall", "first_token_hit", "recall_first_token", "first_tok", True),
    Metric("recall", "all_top1", "recall_gold_top1", "gold_top1", True),
    Metric("recall", "logprob", "recall_gold_logprob", "gold_logp", True, 2),
    Metric("generation", "divergence", "gen_divergence", "diverge_at", True, 1),
    Metric("generation", "kl", "gen_kl", "gen_kl", False, 4),
    Metric("generation", "top1_agreement", "gen_top1", "gen_top1", True),
    Metric("generation", "answer_agrees", "gen_answer_agrees", "answer=dense", True),
    Metric("generation", "solved", "gen_solved_where_dense", "solved|dense", True),
)
HEADLINE = ("top1_agreement", "kl", "recall_exact", "gen_divergence", "gen_kl")
DECIMALS = 6  # per-item values are rounded: float noise (fp32 KL of equal distributions, ~1e-9) is no difference
GAP_METRICS = ("top1_agreement", "kl", "gen_kl")


def _order(policy: str) -> int:
    return POLICY_ORDER.index(policy) if policy in POLICY_ORDER else len(POLICY_ORDER)


def _values(records, metric: Metric, total: int) -> dict[str, dict[str, float]]:
    """``{policy: {item: value}}`` at budget ``total`` (dense's budget-free records included)."""
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for r in records:
        if r["part"] != metric.part or r["B"] not in (total, None) or not r.get("headline", True):
            continue
        value = r.get(metric.field)
        if value is not None and not (isinstance(value, float) and math.isnan(value)):
            out[r["policy"]][r["item"]] = round(float(value), DECIMALS)
    return out


def _common(a: dict, b: dict) -> list[str]:
    return sorted(set(a) & set(b))


def summarize(records: Sequence[dict], budgets: Sequence[dict], *, resamples: int = stats.RESAMPLES,
              seed: int = stats.SEED) -> dict:
    """``budgets``: ``[{"B", "CR", ...}]`` (reachable only). Returns ``{"metrics", "differences", "gap_closed",
    "recall_share", "cells"}``, lists of JSON-able dicts."""
    options = {"resamples": resamples, "seed": seed}
    summary = {"metrics": [], "differences": [], "gap_closed": [], "recall_share": [], "cells": recall_cells(records)}
    for budget in budgets:
        total = budget["B"]
        for metric in METRICS:
            values = _values(records, metric, total)
            if not values:
                continue
            base = {"part": metric.part, "metric": metric.name, "B": total, "CR": budget["CR"]}
            for policy in sorted(values, key=_order):
                interval = stats.mean_interval(list(values[policy].values()), **options)
                summary["metrics"].append({**base, "policy": policy, **interval.to_dict()})
            summary["differences"] += _differences(values, metric, base, options)
            summary["gap_closed"] += _gaps(values, metric, base, options)
            if metric.name == "recall_exact":
                summary["recall_share"] += _recall_shares(values, base, options)
    return summary


def best_heuristic(values: dict[str, dict[str, float]], metric: Metric) -> str | None:
    """The best of the heuristics that ran by the point estimate (``None`` if none of them ran)."""
    present = [h for h in HEURISTICS if values.get(h)]
    if not present:
        return None
    sign = 1 if metric.higher_is_better else -1
    return max(present, key=lambda h: sign * sum(values[h].values()) / len(values[h]))


def trained_baseline(policy: str) -> bool:
    """A row of ``eval.baselines`` (StreamingLLM+, DMS, …): any name that is not one of the evaluated policies."""
    return policy not in POLICY_ORDER


def _vs_label(vs: str) -> str:
    return {"streaming": "streaming", "best_heuristic": "the best heuristic"}.get(vs, vs)


def _differences(values, metric, base, options) -> list[dict]:
    out = []
    best = best_heuristic(values, metric)
    for policy in sorted(values, key=_order):
        if policy == "dense":
            continue
        pairs = [("streaming", "streaming"), ("best_heuristic", best)]
        kvpop = policy in ("kvpop", "kvpop" + ALLOCATED)
        if kvpop or trained_baseline(policy):  # a trained policy against every heuristic, not only the
            pairs += [(h, h) for h in HEURISTICS[1:] if h != best]  # best by point estimate (issue 12's acceptance)
        if kvpop:  # KVpop against each trained baseline's row (issue 13), on the same items
            pairs += [(other, other) for other in values if trained_baseline(other)]
        if policy.endswith(ALLOCATED):  # per-head budgets against the same policy's uniform ones (issue 43)
            pairs.append((policy.removesuffix(ALLOCATED),) * 2)
        for vs, baseline in pairs:
            if baseline is None or baseline == policy or baseline not in values:
                continue
            items = _common(values[policy], values[baseline])
            if not items:
                continue
            diff = stats.paired_difference([values[policy][i] for i in items], [values[baseline][i] for i in items],
                                           **options)
            out.append({**base, "policy": policy, "vs": vs, "baseline": baseline, **diff.to_dict()})
    return out


def _gaps(values, metric, base, options) -> list[dict]:
    """Fraction of the streaming → oracle gap closed, for every other policy (KL and top-1 metrics)."""
    if metric.name not in GAP_METRICS or "streaming" not in values or "oracle" not in values:
        return []
    out = []
    for policy in sorted(values, key=_order):
        if policy in ("dense", "streaming", "oracle"):
            continue
        items = sorted(set(values[policy]) & set(values["streaming"]) & set(values["oracle"]))
        if not items:
            continue
        sign = 1.0 if metric.higher_is_better else -1.0  # closes the gap = moves towards the oracle
        interval = stats.gap_closed(*([-sign * values[p][i] for i in items] for p in (policy, "streaming", "oracle")),
                                    **options)
        out.append({**base, "policy": policy, **interval.to_dict()})
    return out


RECALL_LINE = 0.8  # issue 12's recall acceptance: at least this share of dense's exact match


def versus_line(lo: float, hi: float, line: float = RECALL_LINE) -> str:
    """Whether a share's 95 % interval puts it at least at ``line``: "yes" (low end ≥ line), "no" (high end below),
    else "not resolved"."""
    return "yes" if lo >= line else "no" if hi < line else "not resolved"


def _recall_shares(values, base, options) -> list[dict]:
    """Each policy's headline exact match as a share of dense's on the same samples: mean over mean with its paired
    bootstrap interval (:func:`versus_line` reads it against :data:`RECALL_LINE`)."""
    if "dense" not in values:
        return []
    out = []
    for policy in sorted(values, key=_order):
        items = _common(values[policy], values["dense"])
        if policy == "dense" or not items:
            continue
        share = stats.bootstrap_for(len(items), **options).ratio([values[policy][i] for i in items],
                                                                  [values["dense"][i] for i in items])
        out.append({**base, "policy": policy, **share.to_dict()})
    return out


def recall_cells(records: Sequence[dict]) -> list[dict]:
    """Exact-match accuracy per (policy, B, task, context, depth), headline or not."""
    groups: dict[tuple, list[float]] = defaultdict(list)
    for r in records:
        if r["part"] == "recall" and r.get("exact") is not None:
            groups[(r["policy"], r["B"], r["task"], r["context"], r["depth"])].append(float(r["exact"]))
    return [{"policy": p, "B": b, "task": t, "context": c, "depth": d, "exact": sum(v) / len(v), "n": len(v)}
            for (p, b, t, c, d), v in sorted(groups.items(), key=lambda kv: (_order(kv[0][0]), kv[0][1] or 0,
                                                                                kv[0][2:]))]


# ----------------------------------------------------------------------------------------------- text
def _metric(name: str) -> Metric:
    return next(m for m in METRICS if m.name == name)


def _fmt(value: float | None, digits: int, signed: bool = False) -> str:
    if value is None or math.isnan(value):
        return "-"
    if not math.isfinite(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


def _cell(entry: dict | None, digits: int, signed: bool = False) -> str:
    """``mean [lo, hi]``; the mean alone when the interval is a point (every item the same)."""
    if entry is None:
        return "-"
    if entry["lo"] == entry["hi"] == entry["estimate"]:
        return _fmt(entry["estimate"], digits, signed)
    return (f"{_fmt(entry['estimate'], digits, signed)} [{_fmt(entry['lo'], digits, signed)}, "
            f"{_fmt(entry['hi'], digits, signed)}]")


def percent(cr: float) -> str:
    """``0.9375`` → ``"93.75%"``, ``0.75`` → ``"75%"``."""
    return f"{100 * cr:.2f}".rstrip("0").rstrip(".") + "%"


def _grid(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return [line(headers), "  ".join("-" * w for w in widths), *map(line, rows)]


def _pipes(headers: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers),
            *("| " + " | ".join(row) + " |" for row in rows)]


def format_report(summary: dict, budgets: Sequence[dict], *, labels: dict | None = None,
                  unreachable: Sequence[dict] = (), evicting: dict | None = None, markdown: bool = False) -> str:
    """The report: per part a table per budget (mean [95 % interval] per metric), the paired differences, the KL gap
    closed, the recall cells, and closing sentences on which differences are resolved. ``labels``: ``{(policy, B):
    budget string}`` for the budget column. ``evicting``: ``{B: share of generated tokens taken after an eviction}``
    (:func:`kvpop.evaluation.evicting_share`), said above the generation tables. ``markdown``: pipe tables and
    ``###`` headings instead of plain text."""
    table = _pipes if markdown else _grid
    heading = (lambda text: ["", f"### {text}", ""]) if markdown else (lambda text: ["", f"== {text}"])
    labels = labels or {}
    lines = []
    if unreachable:
        lines.append("Not reachable with sink and window fixed (B < sink + window): " + ", ".join(
            f"CR {percent(u['CR'])} (B = {u['B']})" for u in unreachable) + ".")
    by_key = {(m["metric"], m["policy"], m["B"]): m for m in summary["metrics"]}
    for part in PART_TITLES:
        metrics = [m for m in METRICS if any(e["metric"] == m.name for e in summary["metrics"])
                   and m.part == part]
        if not metrics:
            continue
        n_items = max(e["n"] for e in summary["metrics"] if e["part"] == part)
        lines += heading(f"{PART_TITLES[part]}: mean [95% bootstrap interval over up to {n_items} "
                         f"{ITEM_NAMES[part]}]")
        if part == "generation" and evicting:
            lines += ["", "Share of generated tokens taken after an eviction (prompt + generated > B): " + ", ".join(
                f"B = {b} {share:.0%}" for b, share in evicting.items()) + ". At 0 % a row differs from dense by "
                "arithmetic alone (the bounded path's noise floor; a distilled model's by its weights too)."]
        for budget in budgets:
            policies = sorted({e["policy"] for e in summary["metrics"] if e["part"] == part and e["B"] == budget["B"]},
                              key=_order)
            rows = [[p, labels.get((p, budget["B"]), ""), *(_cell(by_key.get((m.name, p, budget["B"])), m.digits)
                                                           for m in metrics)] for p in policies]
            lines += ["", f"B = {budget['B']} (CR {percent(budget['CR'])})", *([""] if markdown else [])]
            lines += table(["policy", "budget", *(m.label for m in metrics)], rows)
    headers, rows = _differences_rows(summary["differences"])
    if rows:
        lines += heading("paired differences, policy - baseline: mean [95% interval], * = resolved (the interval "
                         "excludes 0); every metric in metrics.json")
        lines += table(headers, rows)
    gaps = [g for g in summary["gap_closed"] if g["metric"] in ("kl", "gen_kl")]
    if gaps:
        lines += heading("fraction of the streaming -> oracle KL gap closed [95% interval] (1 = the oracle's KL)")
        lines += table(["policy", "B", "metric", "gap closed"], [
            [g["policy"], str(g["B"]), _metric(g["metric"]).label, _cell(g, 2)] for g in gaps])
    shares = summary.get("recall_share") or []  # absent from summaries written before it existed
    if shares:
        lines += heading("headline recall exact match as a share of dense's on the same samples [95% interval]")
        lines += table(["policy", "B", "share of dense", f"at least {RECALL_LINE:g} x dense"], [
            [s["policy"], str(s["B"]), _cell(s, 3), versus_line(s["lo"], s["hi"])] for s in shares])
    headers, rows = _cells_rows(summary["cells"], budgets)
    if rows:
        lines += heading("recall exact match per cell (task, context tokens, depth)")
        if not any(e["part"] == "recall" for e in summary["metrics"]):
            lines += ["No cell reaches the calibration threshold for dense: no headline recall numbers.", ""]
        lines += table(headers, rows)
    lines += ["", *(f"- {line}" if markdown else line for line in sentences(summary, budgets))]
    for name, corpus in (summary.get("corpora") or {}).items():
        lines += [*heading(f"held-out corpus {name} ({corpus['source']}): the text part, every policy and budget"),
                  format_report(corpus, budgets, labels=labels, markdown=markdown)]
    return "\n".join(lines)


def _differences_rows(differences: list[dict]) -> tuple[list[str], list[list[str]]]:
    """One row per (budget, policy, baseline kind), one column per headline metric; ``*`` = resolved. Against the
    best heuristic, the cell names which one it was (it is chosen per metric)."""
    names = [n for n in HEADLINE if any(d["metric"] == n for d in differences)]
    at = {(d["B"], d["policy"], d["vs"], d["metric"]): d for d in differences}
    rows = []
    for total, policy, vs in sorted({(d["B"], d["policy"], d["vs"]) for d in differences},
                                    key=lambda k: (-k[0], _order(k[1]), k[2] != "streaming")):
        cells = []
        for name in names:
            d = at.get((total, policy, vs, name))
            if d is None or (vs == "best_heuristic" and d["baseline"] == "streaming"):
                cells.append("-" if d is None else "(= streaming)")
                continue
            cell = _cell(d, _metric(name).digits + 1, True) + ("*" if d["resolved"] else "")
            cells.append(cell + (f" {d['baseline']}" if vs == "best_heuristic" else ""))
        rows.append([policy, _vs_label(vs).removeprefix("the "), str(total), *cells])
    return ["policy", "vs", "B", *(_metric(n).label for n in names)], rows


def _cells_rows(cells: list[dict], budgets) -> tuple[list[str], list[list[str]]]:
    keys = sorted({(c["task"], c["context"], c["depth"]) for c in cells})
    columns = [("dense", None)] + [(p, b["B"]) for b in budgets for p in sorted(
        {c["policy"] for c in cells if c["B"] == b["B"]}, key=_order)]
    at = {(c["policy"], c["B"], c["task"], c["context"], c["depth"]): c for c in cells}
    rows = [[f"{t} c{c} d{d:g}", *(_fmt(at[(p, b, t, c, d)]["exact"], 2) if (p, b, t, c, d) in at else "-"
                                   for p, b in columns)] for t, c, d in keys]
    return ["cell", *(p if b is None else f"{p}@{b}" for p, b in columns)], rows


def sentences(summary: dict, budgets: Sequence[dict]) -> list[str]:
    """Per budget and narrated policy, two sentences — against streaming, against the best heuristic — saying on
    which headline metrics the paired difference is resolved, in which direction, and what the others would need."""
    groups = defaultdict(list)
    for d in summary["differences"]:
        if (d["policy"] in NARRATED or trained_baseline(d["policy"])) and d["metric"] in HEADLINE:
            if d["vs"] == "best_heuristic" and d["baseline"] == "streaming":
                continue  # the same comparison as against streaming
            groups[(d["B"], d["policy"], d["vs"])].append(d)
    cr = {b["B"]: b["CR"] for b in budgets}
    out = []
    for (total, policy, vs), diffs in sorted(groups.items(), key=lambda kv: (-kv[0][0], _order(kv[0][1]),
                                                                              kv[0][2] != "streaming")):
        which = _vs_label(vs)
        out.append(f"At B = {total} (CR {percent(cr.get(total, math.nan))}), {policy} vs {which}: "
                   + "; ".join(_phrase(d) for d in diffs) + ".")
    return out or ["No paired differences to report (no narrated policy, or no baseline ran)."]


def _phrase(d: dict) -> str:
    """``top1 above (+0.009 [+0.004, +0.014], better)``, ``kl not resolved vs tova (…; ~120 sequences needed)``."""
    metric = _metric(d["metric"])
    against = f" {d['baseline']}" if d["vs"] == "best_heuristic" else ""
    span = _cell(d, metric.digits + 1, True)
    if d["resolved"]:
        better = (d["estimate"] > 0) == metric.higher_is_better
        return f"{metric.label} {'above' if d['estimate'] > 0 else 'below'}{against} ({span}, " \
               f"{'better' if better else 'worse'})"
    if d["estimate"] == 0 and d["lo"] == d["hi"] == 0:
        return f"{metric.label} identical{' to' + against if against else ''} on every item"
    need = d["items_needed"]
    need_text = f"~{int(need)} {ITEM_NAMES[metric.part]} needed" if math.isfinite(need) else "no mean difference"
    return f"{metric.label} not resolved{' vs' + against if against else ''} ({span}; {need_text})"


def mlflow_metrics(summary: dict) -> dict[str, float]:
    """``<policy>.B<total>.<metric>`` with ``.lo`` / ``.hi``; paired differences as ``….vs_<baseline
    kind>`` (+ ``.lo``, ``.hi``, ``.resolved``); gap closed as ``….gap_closed``; headline recall as a share of dense's
    as ``….recall_exact.share_of_dense``; memory per (layer, KV head) (``summary["memory"]``) as
    ``….memory_mean`` / ``….memory_peak``; a summary's other corpora (``corpora``) as ``<corpus>.`` + these. Finite
    values only."""
    out = {}
    for m in summary["metrics"]:
        key = f"{m['policy']}.B{m['B']}.{m['metric']}"
        out.update({key: m["estimate"], f"{key}.lo": m["lo"], f"{key}.hi": m["hi"]})
    for d in summary["differences"]:
        key = f"{d['policy']}.B{d['B']}.{d['metric']}.vs_{d['vs']}"
        out.update({key: d["estimate"], f"{key}.lo": d["lo"], f"{key}.hi": d["hi"], f"{key}.resolved": float(d["resolved"])})
    for g in summary["gap_closed"]:
        key = f"{g['policy']}.B{g['B']}.{g['metric']}.gap_closed"
        out.update({key: g["estimate"], f"{key}.lo": g["lo"], f"{key}.hi": g["hi"]})
    for r in summary.get("recall_share") or []:
        key = f"{r['policy']}.B{r['B']}.recall_exact.share_of_dense"
        out.update({key: r["estimate"], f"{key}.lo": r["lo"], f"{key}.hi": r["hi"]})
    for m in summary.get("memory") or []:
        key = f"{m['policy']}.B{m['B']}"
        out.update({f"{key}.memory_mean": m["mean"], f"{key}.memory_peak": m["peak"]})
    for name, corpus in (summary.get("corpora") or {}).items():
        out.update({f"{name}.{k}": v for k, v in mlflow_metrics(corpus).items()})
    return {k: float(v) for k, v in out.items() if v is not None and math.isfinite(v)}


# ----------------------------------------------------------------------------------------------- figures
def plot_metrics_vs_cr(summary: dict):
    """Each headline metric against the compression ratio, one line per policy with its 95 % interval as a band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in HEADLINE if any(m["metric"] == n for m in summary["metrics"])]
    if not names:
        return None
    fig, axes = plt.subplots(1, len(names), figsize=(4.8 * len(names), 4.2), squeeze=False)
    for ax, name in zip(axes[0], names):
        entries = [m for m in summary["metrics"] if m["metric"] == name]
        for policy in sorted({m["policy"] for m in entries}, key=_order):
            pts = sorted((m["CR"], m["estimate"], m["lo"], m["hi"]) for m in entries if m["policy"] == policy)
            xs, ys, lo, hi = zip(*pts)
            color = f"C{_order(policy)}"
            ax.plot(xs, ys, marker="o", ms=4, color=color, label=policy, ls="--" if policy == "dense" else "-")
            ax.fill_between(xs, lo, hi, color=color, alpha=0.18, lw=0)
        metric = _metric(name)
        ax.set_title(f"{metric.label} ({'higher' if metric.higher_is_better else 'lower'} is better)", fontsize=10)
        ax.set_xlabel("compression ratio CR = 1 - B/S")
        ax.grid(alpha=0.3)
        if name in ("kl", "gen_kl"):
            ax.set_yscale("symlog", linthresh=1e-3)
    handles = {}
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=len(handles), frameon=False)
    fig.suptitle("Policies vs compression: mean and 95% bootstrap interval over items", fontsize=11)
    fig.tight_layout(rect=(0, 0.08, 1, 0.94))
    return fig


def plot_recall_maps(summary: dict, total: int):
    """Recall exact match as a context × depth heat map per policy at budget ``total`` (dense as the reference),
    averaged over tasks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [c for c in summary["cells"] if c["B"] in (total, None)]
    if not cells:
        return None
    contexts = sorted({c["context"] for c in cells})
    depths = sorted({c["depth"] for c in cells})
    policies = sorted({c["policy"] for c in cells}, key=_order)
    fig, axes = plt.subplots(1, len(policies), figsize=(2.4 * len(policies) + 1, 2.2 + 0.35 * len(contexts)),
                             squeeze=False)
    for ax, policy in zip(axes[0], policies):
        grid = np.full((len(contexts), len(depths)), np.nan)
        for i, context in enumerate(contexts):
            for j, depth in enumerate(depths):
                hits = [c for c in cells if c["policy"] == policy and c["context"] == context and c["depth"] == depth]
                if hits:
                    grid[i, j] = sum(c["exact"] * c["n"] for c in hits) / sum(c["n"] for c in hits)
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto", origin="lower")
        for i in range(len(contexts)):
            for j in range(len(depths)):
                if not np.isnan(grid[i, j]):
                    ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=8,
                            color="w" if grid[i, j] < 0.6 else "k")
        ax.set_title(policy, fontsize=10)
        ax.set_xticks(range(len(depths)), [f"{d:g}" for d in depths])
        ax.set_yticks(range(len(contexts)), [str(c) for c in contexts])
        ax.set_xlabel("needle depth")
    axes[0][0].set_ylabel("context (tokens)")
    fig.colorbar(image, ax=axes[0].tolist(), label="exact match")
    fig.suptitle(f"Recall exact match at B = {total} (mean over tasks)", fontsize=11)
    return fig


def save_figures(summary: dict, budgets: Sequence[dict], out) -> list[str]:
    """``metrics_vs_cr.png`` and one ``recall_map_B<total>.png`` per budget (when recall ran) into ``out``."""
    import matplotlib.pyplot as plt

    figures = {"metrics_vs_cr.png": plot_metrics_vs_cr(summary)}
    for b in budgets:
        figures[f"recall_map_B{b['B']}.png"] = plot_recall_maps(summary, b["B"])
    saved = []
    for name, fig in figures.items():
        if fig is not None:
            fig.savefig(out / name, dpi=110)
            plt.close(fig)
            saved.append(name)
    return saved


def format_memory(rows: Sequence[dict], *, markdown: bool = False) -> str:
    """The memory table: per row and budget, tokens held per (layer, KV head) at the counted queries, two ways —
    the ``mean`` (what "matched at B" matches) and the ``peak`` (what a serving engine reserves per head) —
    from the evaluation stage's ``summary["memory"]``."""
    if not rows:
        return ""
    table = _pipes if markdown else _grid
    head = ["", "### memory per (layer, KV head), tokens", ""] if markdown else ["", "== memory per (layer, KV head), "
                                                                                  "tokens at the counted queries"]
    body = [[r["policy"], str(r["B"]), f"{r['mean']:.1f}", str(r["peak"])]
            for r in sorted(rows, key=lambda r: (-r["B"], _order(r["policy"]), r["policy"]))]
    return "\n".join(head + table(["policy", "B", "mean held", "peak"], body))
