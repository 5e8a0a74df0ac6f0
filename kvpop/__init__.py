"""KVpop: learned, fixed-budget KV-cache eviction (METHOD.md). Pure torch + transformers; no Ray here."""
from kvpop.budget import Budget

__all__ = ["Budget"]
