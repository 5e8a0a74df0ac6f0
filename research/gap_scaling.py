"""One recipe at several training scales: the share of the streaming → oracle KL gap each recency-blend rule closes on
every corpus against the tokens its scorer was trained on, and the line through those points on a log scale — how
far the measured scales are from issue 12's 0.60 on held-out text, and whether more of the same data moves it.

    python research/gap_scaling.py --family h200_w256_qp16_multik h200_w256_qp16_multik11 h200_w256_qp16_multik30 \\
        --rules kvpop+0.002 kvpop+0.003 --tag multik     # -> research/results/gap_scaling_multik.{json,md,png}

A family member ``TAG`` is a committed GPU ``recency_blend_<TAG>.json`` (its gap per corpus as
:mod:`research.gap_frontier` merges it) and the learning-curves study ``learning_curves_<TAG>.json`` that trained its
scorer (its last point's token count). The fit is ordinary least squares of the gap on log2(tokens) per corpus and
rule: a description of the measured points (the slope is the gap gained per doubling of the data), and where it
reaches the target an extrapolation beyond them, never a measurement. Members must be distinct scales of one recipe;
the caller names them.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from research.gap_frontier import CORPORA, TARGET, collect  # noqa: E402


def parse_args(argv=None):
    from jobs._cli import bare_parser

    p = bare_parser("gap_scaling", __doc__.split("\n\n")[0])
    p.prog = "research/gap_scaling.py"
    p.add_argument("--family", nargs="+", required=True, metavar="TAG", help="recency-blend tags of one recipe at "
                   "several training scales (each with learning_curves_<TAG>.json)")
    p.add_argument("--rules", nargs="+", default=["kvpop+0.002", "kvpop+0.003"], help="recency-blend rules to follow")
    p.add_argument("--B", type=int, default=512, help="total budget of the rules")
    p.add_argument("--results", default=str(REPO / "research" / "results"))
    p.add_argument("--tag", required=True, help="output name: gap_scaling_<tag>.{json,md,png}")
    p.add_argument("--out", default=None, help="output folder (default: --results)")
    args = p.parse_args(argv)
    if len(set(args.family)) < 2:
        p.error("--family needs at least two distinct tags (scales) to describe a trend")
    return args


def trained_tokens(folder: Path, tag: str) -> int:
    """The token count of the last evaluated point of ``learning_curves_<tag>.json``: the scorer the blend used."""
    path = folder / f"learning_curves_{tag}.json"
    if not path.is_file():
        raise ValueError(f"{path.name} is missing: the study that trained the scorer of recency_blend_{tag}.json")
    points = json.loads(path.read_text()).get("points") or []
    if not points or not points[-1].get("tokens"):
        raise ValueError(f"{path.name} has no trained point (tokens > 0)")
    return int(points[-1]["tokens"])


def fit(points: list[tuple[float, float]]) -> dict:
    """Least squares ``gap = a + b * log2(tokens)`` through ``(tokens, gap)`` points; ``b`` per doubling and, where
    ``b > 0``, the tokens at which the line reaches TARGET (None otherwise, or with fewer than two distinct scales)."""
    xs = [math.log2(t) for t, _ in points]
    ys = [g for _, g in points]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return {"per_doubling": None, "reaches_target_tokens": None}
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    a = my - b * mx
    reach = 2 ** ((TARGET - a) / b) if b > 0 else None
    return {"per_doubling": b, "reaches_target_tokens": reach}


def build(folder: Path, family: list[str], rules: list[str], B: int) -> dict:
    rows = collect(folder, B)
    members = []
    for tag in family:
        found = {row["rule"]: row for row in rows if tag in row["tags"] and row["rule"] in rules}
        missing = [r for r in rules if r not in found]
        if missing:
            raise ValueError(f"recency_blend_{tag}.json has no gap on all of {CORPORA} at B = {B} for {missing}")
        members.append({"tag": tag, "tokens": trained_tokens(folder, tag),
                        "rules": {r: {"gap": found[r]["gap"], "recall_kept": found[r]["recall_kept"]}
                                  for r in rules}})
    if len({m["tokens"] for m in members}) < 2:
        raise ValueError("the family's scorers were all trained on the same token count: no scale to follow")
    members.sort(key=lambda m: m["tokens"])
    fits = {r: {c: fit([(m["tokens"], m["rules"][r]["gap"][c]["mean"]) for m in members]) for c in CORPORA}
            for r in rules}
    return {"B": B, "target": TARGET, "members": members, "fits": fits}


def render(result: dict) -> str:
    members, fits = result["members"], result["fits"]
    lines = [f"# The KL gap closed against training tokens, one recipe (B = {result['B']})", "",
             "From the committed GPU results (`research/gap_scaling.py`): per scale the recency-blend gap (95 % "
             "bootstrap interval, n items) and the headline recall kept (× dense). The fit is a least-squares line "
             "on log2(tokens) through these points; where it reaches "
             f"{result['target']:.2f} that is an extrapolation beyond the measured scales, not a measurement.", "",
             "| rule | tokens (tag) | " + " | ".join(CORPORA) + " | recall × dense |",
             "|---|---|" + "---|" * len(CORPORA) + "---|"]
    for rule in fits:
        for m in members:
            cell = m["rules"][rule]
            gaps = " | ".join(f"{g['mean']:.2f} [{g['low']:.2f}, {g['high']:.2f}] (n {g['n']})"
                              for g in (cell["gap"][c] for c in CORPORA))
            kept = "–" if cell["recall_kept"] is None else f"{cell['recall_kept']:.2f}"
            lines.append(f"| {rule} | {m['tokens'] / 1e6:.2f}M ({m['tag']}) | {gaps} | {kept} |")
        slopes = " | ".join(_describe(fits[rule][c], [m["tokens"] for m in members]) for c in CORPORA)
        lines.append(f"| {rule} | fit: per doubling; reaches {result['target']:.2f} at | {slopes} | |")
    return "\n".join(lines) + "\n"


REACH_LIMIT = 16  # an extrapolation further than this many times the largest measured scale is not given a number


def _describe(f: dict, measured: list[int]) -> str:
    """The slope per doubling and where the line reaches the target, relative to the measured scales."""
    if f["per_doubling"] is None:
        return "–"
    reach, largest = f["reaches_target_tokens"], max(measured)
    if reach is None:
        where = "never (not rising)"
    elif reach <= min(measured):
        where = "the line is above it at every measured scale"
    elif reach <= largest:
        where = f"~{reach / 1e6:.0f}M (between the measured scales)"
    elif reach <= REACH_LIMIT * largest:
        where = f"~{reach / 1e6:.0f}M (extrapolated, {reach / largest:.1f}× the largest scale)"
    else:
        where = f"beyond {REACH_LIMIT}× the largest scale (extrapolated)"
    return f"{f['per_doubling']:+.3f}; {where}"


def draw(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rules = list(result["fits"])
    fig, axes = plt.subplots(1, len(rules), figsize=(5.5 * len(rules), 4.5), squeeze=False, sharey=True)
    tokens = [m["tokens"] for m in result["members"]]
    for ax, rule in zip(axes[0], rules):
        for corpus, color in zip(CORPORA, ("tab:blue", "tab:orange", "tab:green")):
            gaps = [m["rules"][rule]["gap"][corpus] for m in result["members"]]
            ax.errorbar(tokens, [g["mean"] for g in gaps], yerr=[[g["mean"] - g["low"] for g in gaps],
                                                                 [g["high"] - g["mean"] for g in gaps]],
                        marker="o", capsize=3, color=color, label=corpus)
            f = result["fits"][rule][corpus]
            if f["per_doubling"] is not None:  # the fit, drawn on to 4× the largest scale (dotted: extrapolated)
                xs = [tokens[0], tokens[-1], 4 * tokens[-1]]
                mean_x = sum(math.log2(t) for t in tokens) / len(tokens)
                mean_y = sum(g["mean"] for g in gaps) / len(gaps)
                ax.plot(xs, [mean_y + f["per_doubling"] * (math.log2(x) - mean_x) for x in xs], ls=":",
                        color=color, lw=1)
        ax.axhline(result["target"], ls="--", color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(tokens + [4 * tokens[-1]], [f"{t / 1e6:.0f}M" for t in tokens + [4 * tokens[-1]]])
        ax.set_xlabel("training tokens (the last: 4× the largest, extrapolated)")
        ax.set_title(rule)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("KL gap closed (streaming → oracle)")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    folder = Path(args.results)
    try:
        result = build(folder, args.family, args.rules, args.B)
    except (OSError, ValueError, KeyError) as err:
        print(f"gap_scaling: {err}", file=sys.stderr)
        return 2
    from research.scorer_records import write_result

    out = Path(args.out or folder)
    out.mkdir(parents=True, exist_ok=True)
    write_result(out, f"gap_scaling_{args.tag}", result, render(result))
    draw(result, out / f"gap_scaling_{args.tag}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
