"""The per-KV-head cache budget of METHOD §1: sinks + protected window + learned long-range slots."""
from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Budget:
    """At most ``total = sink + window + topk`` tokens per (layer, KV head, sequence).

    * ``sink``: positions ``0 … sink-1`` are always kept.
    * ``window``: at query ``d`` the tokens ``d - window < t <= d`` are always kept (the current token
      counts, so ``window >= 1``).
    * ``topk``: slots for the eligible tokens ``sink <= t <= d - window`` with the highest static priority.
    """

    sink: int
    window: int
    topk: int

    def __post_init__(self) -> None:
        for name, minimum, rule in (("sink", 0, ">= 0"), ("window", 1, ">= 1"), ("topk", 0, ">= 0")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"Budget.{name} must be an integer {rule}, got {value!r} ({type(value).__name__})")
            if value < minimum:
                raise ValueError(f"Budget.{name} must be {rule}, got {value}")

    @property
    def total(self) -> int:
        return self.sink + self.window + self.topk

    def compression_ratio(self, seq_len: int) -> float:
        """CR = 1 - B / seq_len, as METHOD §6 reports it."""
        return 1.0 - self.total / seq_len

    @classmethod
    def from_total(cls, total: int, *, sink: int, window: int) -> "Budget":
        """The budget with ``total`` slots, the given sinks and window, and the rest as top-k slots."""
        topk = total - sink - window
        if topk < 0:
            raise ValueError(f"budget total {total} is smaller than sink + window = {sink + window}")
        return cls(sink, window, topk)

    @classmethod
    def parse(cls, label: str) -> "Budget":
        """The budget a :meth:`__str__` label names (``s4-w256-k252``); ValueError for anything else."""
        found = re.fullmatch(r"s(\d+)-w(\d+)-k(\d+)", str(label))
        if not found:
            raise ValueError(f"not a budget split s<sink>-w<window>-k<topk>: {label!r}")
        return cls(*(int(x) for x in found.groups()))

    def __str__(self) -> str:
        return f"s{self.sink}-w{self.window}-k{self.topk}"
