"""A paired bootstrap for the benchmarks of issue 12, until the project's ``pipelines/stats.py`` (issue 11) lands.

``paired_bootstrap(a, b)``: the mean of ``a - b`` over paired items (held-out sequences) and its 95 % percentile
interval from resampling the items with replacement; NaN pairs are dropped.
"""
from __future__ import annotations

import math

import torch


def paired_bootstrap(a, b, resamples: int = 4000, seed: int = 0) -> dict:
    diff = torch.tensor(a, dtype=torch.float64) - torch.tensor(b, dtype=torch.float64)
    diff = diff[~torch.isnan(diff)]
    if diff.numel() == 0:
        return {"mean": math.nan, "low": math.nan, "high": math.nan, "n": 0}
    generator = torch.Generator().manual_seed(seed)
    index = torch.randint(0, diff.numel(), (resamples, diff.numel()), generator=generator)
    means = diff[index].mean(1)
    low, high = torch.quantile(means, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return {"mean": diff.mean().item(), "low": low, "high": high, "n": int(diff.numel())}


def format_interval(d: dict, digits: int = 3) -> str:
    """``+0.012 [+0.004, +0.020] *`` — the star where the interval excludes 0."""
    if d["n"] == 0:
        return "n/a"
    mark = "" if d["low"] <= 0 <= d["high"] else " *"
    return f"{d['mean']:+.{digits}f} [{d['low']:+.{digits}f}, {d['high']:+.{digits}f}]{mark}"
