"""A run's learning curve, drawn from its MLflow metric history alone (the ``heldout.*`` metrics of
:mod:`pipelines.heldout`, logged by the train stage with ``train.eval_every``).

:func:`plot_learning_curve` reads the history of one run from a tracking store and draws one panel per held-out
metric the run logged — KL and top-1 against dense (kvpop with its 95 % band, streaming and the oracle as the
references), the fraction of the streaming → oracle KL gap closed, headline recall exact match — against the
training step; with ``train.eval_heldout_sources``, one more kvpop line per other corpus in the KL, top-1 and gap
panels, labelled by its name (in domain against out of domain; that corpus's references are its metrics, not drawn).
The train stage logs the figure as the run's ``learning_curve.png`` artifact at the end of training; for a run still
going (or any other), call it with the run's id::

    python -c "from pipelines.curves import plot_learning_curve; print(plot_learning_curve('<run id>', \\
        'sqlite:///.kvpop/mlflow.db', 'curve.png'))"
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from pipelines.heldout import PREFIX, corpus_prefix, logged_corpora

# (panel title, kvpop's metric, the references drawn beside it)
PANELS = (
    ("KL(dense ‖ policy), nats/token", "kl", ("streaming.kl", "oracle.kl")),
    ("top-1 agreement with dense", "top1", ("streaming.top1", "oracle.top1")),
    ("streaming → oracle KL gap closed", "gap_closed", ()),
    ("recall exact match (headline cells)", "recall_exact", ("dense.recall_exact",)),
)


def metric_history(client, run_id: str, name: str) -> list[tuple[int, float]]:
    """``[(step, value)]`` of one metric, by step (the last value logged at a step wins: a resumed run may repeat
    one)."""
    by_step = {}
    for m in sorted(client.get_metric_history(run_id, name), key=lambda m: (m.step, m.timestamp)):
        by_step[m.step] = m.value
    return sorted(by_step.items())


def _kvpop_line(ax, client, run_id: str, metric: str, color: str, label: str, band_label: str | None = None) -> None:
    """One metric's history with its 95 % band (where ``.lo`` / ``.hi`` were logged); nothing if it was not logged."""
    points = metric_history(client, run_id, metric)
    if not points:
        return
    steps = [s for s, _ in points]
    ax.plot(steps, [v for _, v in points], marker="o", color=color, label=label)
    lo, hi = (dict(metric_history(client, run_id, f"{metric}.{side}")) for side in ("lo", "hi"))
    banded = [s for s in steps if s in lo and s in hi]
    if banded:
        ax.fill_between(banded, [lo[s] for s in banded], [hi[s] for s in banded], color=color, alpha=0.2,
                        label=band_label)


def plot_learning_curve(run_id: str, tracking_uri: str, out: str | Path | None = None) -> Path | None:
    """Draw run ``run_id``'s held-out learning curve into the PNG ``out`` (default: a new temporary folder's
    ``learning_curve.png``); returns its path, or None when the run logged no held-out metric."""
    import matplotlib
    import mlflow

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    client = mlflow.MlflowClient(tracking_uri)
    run = client.get_run(run_id)
    panels = [(title, name, refs) for title, name, refs in PANELS if f"{PREFIX}{name}" in run.data.metrics]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4.8 * len(panels), 4.4), squeeze=False)
    corpora = logged_corpora(run.data.metrics)
    for ax, (title, name, refs) in zip(axes[0], panels):
        _kvpop_line(ax, client, run_id, f"{PREFIX}{name}", "C3", "kvpop, training corpus" if corpora else "kvpop",
                    "95 % interval")
        for i, corpus in enumerate(corpora):  # C0, C1: the references'; C3: the training corpus's
            _kvpop_line(ax, client, run_id, f"{corpus_prefix(corpus)}{name}", f"C{4 + i}", f"kvpop, {corpus}")
        for i, ref in enumerate(refs):
            history = metric_history(client, run_id, f"{PREFIX}{ref}")
            if history:  # a reference is one value: a line across the run
                ax.axhline(history[-1][1], color=f"C{i}", linestyle="--", label=ref.split(".")[0])
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
        # under the panel: inside, the legend covers the bands of a run whose curves fill the axes
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    fig.suptitle(f"held-out learning curve of {run.info.run_name}", fontsize=11)
    fig.tight_layout()
    path = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="kvpop-curve-")) / "learning_curve.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
