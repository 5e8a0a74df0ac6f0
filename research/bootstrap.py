"""The benchmarks' view of ``pipelines/stats.py``: a paired difference over held-out sequences as a plain dict.

``paired_bootstrap(a, b)``: ``mean(a - b)`` over the pairs where both are finite, with its 95 % percentile-bootstrap
interval (:func:`pipelines.stats.paired_difference`, the evaluation's own rule); ``n = 0`` when no pair is left.
"""
from __future__ import annotations

import math

import numpy as np

from pipelines.stats import paired_difference


def paired_bootstrap(a, b) -> dict:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    finite = np.isfinite(a) & np.isfinite(b)
    if not finite.any():
        return {"mean": math.nan, "low": math.nan, "high": math.nan, "n": 0}
    d = paired_difference(a[finite], b[finite])
    return {"mean": d.estimate, "low": d.lo, "high": d.hi, "n": d.n}


def format_interval(d: dict, digits: int = 3) -> str:
    """``+0.012 [+0.004, +0.020] *`` — the star where the interval excludes 0 (none over one item: no interval)."""
    if d["n"] == 0:
        return "n/a"
    if not (math.isfinite(d["low"]) and math.isfinite(d["high"])):
        return f"{d['mean']:+.{digits}f} (n {d['n']}: no interval)"
    mark = " *" if d["low"] > 0 or d["high"] < 0 else ""
    return f"{d['mean']:+.{digits}f} [{d['low']:+.{digits}f}, {d['high']:+.{digits}f}]{mark}"
