"""A model's own attention pattern: which layers are local (sliding-window) and which are global (METHOD §1).

Contract: :func:`layer_windows` reads, from a transformers config, the window each layer's base attention already
has — ``None`` for a global (full causal) layer, ``W`` for a local layer whose query ``d`` sees exactly the tokens
``d - W < t <= d`` (transformers' ``sliding_window_overlay``) — by the rules transformers 5.x applies itself:

* Mistral (``model_type`` ``mistral``/``mixtral``): every layer passes ``config.sliding_window`` (``None``: global).
* otherwise ``config.layer_types`` when the config has it (Gemma 2 / 3, Qwen2, Qwen3, …; their configs fill it from
  Gemma 2's alternation, Gemma 3's ``sliding_window_pattern`` or Qwen2's ``use_sliding_window`` /
  ``max_window_layers``): ``"full_attention"`` is global, ``"sliding_attention"`` local with ``sliding_window``
  (global where that is ``None``, as the modeling code passes it).
* a config with neither (Llama, SmolLM): a ``sliding_window`` set applies to every layer, else all are global.

KVpop keeps a local layer exactly as its base has it — its own window, no sinks, no scorer, no budget, a ring of
``W`` slots per KV head in the cache — and bounds the global layers (the *evicting* layers, :func:`evicting_layers`)
with its budget, so the retained set is never larger than what the base itself sees. Anything this module cannot
read is refused in one line naming it (:class:`UnsupportedAttention`): an unknown ``layer_types`` value (chunked,
linear, …), chunked attention, bidirectional sliding windows, attention logit soft-capping — never a silent change of
the model. At run time :func:`kvpop.attention.kvpop_attention_forward` also checks the ``sliding_window`` each layer's
own forward passes against this reading.
"""
from __future__ import annotations

GLOBAL, LOCAL = "full_attention", "sliding_attention"
MISTRAL_TYPES = frozenset({"mistral", "mixtral"})  # their attention passes config.sliding_window in every layer


class UnsupportedAttention(ValueError):
    """A model whose attention KVpop cannot reproduce exactly (one line: what is missing)."""


def _text_config(config):
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def _window(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UnsupportedAttention(f"{where}: sliding_window must be an integer >= 1, got {value!r}")
    return value


def layer_windows(config) -> tuple[int | None, ...]:
    """Per layer, the base attention's own window: ``None`` (global) or ``W`` (local); see the module docstring."""
    config = _text_config(config)
    name = getattr(config, "model_type", None) or type(config).__name__
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layers, int) or layers < 1:
        raise UnsupportedAttention(f"{name}: the config names no num_hidden_layers")
    for attr, what in (("attention_chunk_size", "chunked attention"),
                       ("attn_logit_softcapping", "attention logit soft-capping")):
        if getattr(config, attr, None) is not None:
            raise UnsupportedAttention(f"{name} uses {what} ({attr}={getattr(config, attr)!r}), which KVpop's "
                                       f"attention does not implement: it would change the model")
    if getattr(config, "use_bidirectional_attention", None):
        raise UnsupportedAttention(f"{name} uses bidirectional attention (use_bidirectional_attention=True): "
                                   f"KVpop retrofits causal decoders only")
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if name in MISTRAL_TYPES or types is None:
        return (None if window is None else _window(window, name),) * layers
    types = list(types)
    if len(types) != layers:
        raise UnsupportedAttention(f"{name}: layer_types names {len(types)} layers, num_hidden_layers is {layers}")
    unknown = sorted({t for t in types if t not in (GLOBAL, LOCAL)})
    if unknown:
        raise UnsupportedAttention(f"{name}: KVpop reads the attention layer types {[GLOBAL, LOCAL]} only, this "
                                   f"model's layer_types also has {unknown}")
    return tuple(_window(window, name) if t == LOCAL and window is not None else None for t in types)


def evicting_layers(config) -> tuple[int, ...]:
    """The global layers, in order: the ones KVpop's budget bounds (scorers, targets and losses cover these only)."""
    return tuple(i for i, window in enumerate(layer_windows(config)) if window is None)
