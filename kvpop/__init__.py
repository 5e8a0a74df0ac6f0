"""KVpop: learned, fixed-budget KV-cache eviction (METHOD.md). Pure torch + transformers; no Ray here."""
from kvpop.budget import Budget
from kvpop.cache import KVpopCache
from kvpop import dms_cache  # noqa: F401  registers the DMS cache layer (kvpop.cache.LAYER_TYPES)
from kvpop import headwise_cache  # noqa: F401  registers the per-head budgets' cache layer (likewise)
from kvpop.decode import prefill, teacher_forced_logits
from kvpop.parameters import trainable_parameters
from kvpop.policies import POLICIES, build_policy
from kvpop.retrofit import (collect_priorities, load_retrofitted, load_scorers, oracle_priorities, retrofit,
                            save_retrofitted, scorers, set_policy, set_streaming_layers,
                            set_window_attention_prior)

__all__ = ["Budget", "KVpopCache", "POLICIES", "build_policy", "collect_priorities", "load_retrofitted",
           "load_scorers", "oracle_priorities", "prefill", "retrofit", "save_retrofitted", "scorers", "set_policy",
           "set_streaming_layers", "set_window_attention_prior", "teacher_forced_logits",
           "trainable_parameters"]
