"""KVpop: learned, fixed-budget KV-cache eviction (METHOD.md). Pure torch + transformers; no Ray here.

The public names below are imported when first used (PEP 562): ``from kvpop.budget import Budget`` or
``pipelines.config`` (which every CLI process imports) no longer pay for the retrofit and its transformers model
machinery (~2 s of a core here) when they never use it. The modules that register cache layers
(``kvpop.dms_cache``, ``kvpop.headwise_cache``: torch and transformers' Cache, nothing more) are still imported with
the package, so that any KVpopCache finds them.
"""
from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING

_WHERE = {
    "Budget": "kvpop.budget",
    "KVpopCache": "kvpop.cache",
    "prefill": "kvpop.decode", "teacher_forced_logits": "kvpop.decode",
    "trainable_parameters": "kvpop.parameters",
    "POLICIES": "kvpop.policies", "build_policy": "kvpop.policies",
    **{name: "kvpop.retrofit" for name in (
        "collect_priorities", "load_retrofitted", "load_scorers", "oracle_priorities", "retrofit", "save_retrofitted",
        "scorers", "set_policy", "set_streaming_layers", "set_window_attention_prior")},
}

__all__ = sorted(_WHERE)

if TYPE_CHECKING:  # what a type checker and an IDE see: the same names, imported eagerly
    from kvpop.budget import Budget
    from kvpop.cache import KVpopCache
    from kvpop.decode import prefill, teacher_forced_logits
    from kvpop.parameters import trainable_parameters
    from kvpop.policies import POLICIES, build_policy
    from kvpop.retrofit import (collect_priorities, load_retrofitted, load_scorers, oracle_priorities, retrofit,
                                save_retrofitted, scorers, set_policy, set_streaming_layers,
                                set_window_attention_prior)


def __getattr__(name: str):
    """A public name, or a submodule (``kvpop.dms_cache`` after ``import kvpop``), imported on first use."""
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
    elif not name.startswith("__"):
        try:
            value = importlib.import_module(f"kvpop.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"kvpop.{name}":
                raise
            raise AttributeError(f"module 'kvpop' has no attribute {name!r}") from None
    else:
        raise AttributeError(f"module 'kvpop' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


class _Package(types.ModuleType):
    """``kvpop.retrofit`` and ``kvpop.scorers`` are functions (of ``kvpop.retrofit``) that share their name with a
    submodule; importing the submodule (``from kvpop.retrofit import …``) would make the package's name the module.
    The package keeps the function, as the eager imports did; the modules stay in ``sys.modules``."""

    def __setattr__(self, name: str, value) -> None:
        if name in _WHERE and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

from kvpop import dms_cache  # noqa: E402,F401  registers the DMS cache layer (kvpop.cache.LAYER_TYPES)
from kvpop import headwise_cache  # noqa: E402,F401  registers the per-head budgets' cache layer (likewise)
