"""Scorer diagnostics for tracking: :func:`kvpop.diagnostics.diagnose` reports as MLflow metrics and one figure.

The figure answers "did the scorer learn more than recency?" at a glance: per layer, the held-out balanced accuracy
of the scorer's keep/evict decisions next to newest-wins (what a recency-only scorer does), oldest-wins and random
(all three 0.5), and the raw agreement next to the same rules (where oldest-wins looks good because the teacher
rarely keeps the token leaving the window). matplotlib is imported only when a figure is drawn.
"""
from __future__ import annotations

import math

from kvpop.diagnostics import REFERENCES, summarize

RULES = ("scorer", *REFERENCES)
STYLE = {"scorer": ("C0", "-", "o"), "newest": ("C1", "--", None), "oldest": ("C2", "--", None),
         "random": ("0.5", ":", None), "oracle": ("k", ":", None)}


def _mean(tensor) -> float:
    value = tensor.nanmean().item()
    return value if not math.isnan(value) else float("nan")


def flat_metrics(report: dict, prefix: str = "diag") -> dict[str, float]:
    """``{"<prefix>.<budget>.<rule>.<metric>": mean over layers, heads and sequences}`` plus per-layer balanced
    accuracy of the scorer (``….scorer.balanced_accuracy.layer<i>``) — NaN entries (no decision) left out."""
    summary = summarize(report)  # [layers, Hkv]
    out = {f"{prefix}.{rule}.spearman": _mean(value) for rule, value in summary["spearman"].items()}
    for budget, views in summary["budgets"].items():
        for rule, metrics in views["decisions"].items():
            for metric, value in metrics.items():
                out[f"{prefix}.{budget}.{rule}.{metric}"] = _mean(value)
        for rule, metrics in views["kept"].items():
            for metric, value in metrics.items():  # [layers, Hkv, Q]: the last query is the end of the sequence
                out[f"{prefix}.{budget}.{rule}.{metric}_end"] = _mean(value[..., -1])
        per_layer = views["decisions"]["scorer"]["balanced_accuracy"].nanmean(-1)
        for layer, value in enumerate(per_layer.tolist()):
            out[f"{prefix}.{budget}.scorer.balanced_accuracy.layer{layer:02d}"] = value
    return {k: v for k, v in out.items() if not math.isnan(v)}


def per_layer_figure(layers, curves: dict, path=None, *, title: str = "", ylabel: str = "balanced accuracy",
                     ax=None, styles: dict | None = None):
    """One line per entry of ``curves`` (name -> value per layer); saved to ``path`` when given. ``styles``: name ->
    (color, linestyle, marker) for names :data:`STYLE` does not cover (several scorers in one figure)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(8, 3.6))
    for name, values in curves.items():
        color, style, marker = {**STYLE, **(styles or {})}.get(name, ("C3", "-", "s"))  # else: a second scorer
        ax.plot(list(layers), values, label=name, color=color, linestyle=style, marker=marker, markersize=3)
    ax.set_xlabel("layer")
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=3)
    if fig is not None:
        fig.tight_layout()
        if path is not None:
            fig.savefig(path, dpi=130)
    return fig if fig is not None else ax.figure


def diagnostics_figure(report: dict, budget: str | None = None, path=None):
    """Two panels per layer at ``budget`` (default: the first, i.e. the training budget): balanced accuracy and raw
    agreement of the scorer against newest-wins, oldest-wins, random (and the oracle's 1.0 on agreement)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = summarize(report)
    budget = budget or next(iter(summary["budgets"]))
    decisions = summary["budgets"][budget]["decisions"]
    layers = range(decisions["scorer"]["agreement"].shape[0])
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
    for ax, metric, rules in ((axes[0], "balanced_accuracy", ("scorer", "newest", "oldest", "random")),
                              (axes[1], "agreement", RULES)):
        curves = {rule: decisions[rule][metric].nanmean(-1).tolist() for rule in rules}
        per_layer_figure(layers, curves, ax=ax, ylabel=metric.replace("_", " "),
                         title=f"held-out keep/evict decisions at {budget}: {metric.replace('_', ' ')}")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=130)
    return fig
