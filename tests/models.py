"""Tiny random decoders built in memory (no download): the test matrix of architectures × head layouts."""
from __future__ import annotations

import torch
from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig,
                          LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM)

ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
}
# models with their own local (sliding-window) layers, each with a window of LOCAL_WINDOW tokens (kvpop.local_layers):
# name -> (config, model, layers, config options); the layouts their configs give (local L / global G):
LOCAL_WINDOW = 8
LOCAL_ARCHS = {
    "gemma2": (Gemma2Config, Gemma2ForCausalLM, 4, {"head_dim": 16, "attn_logit_softcapping": None}),  # L G L G
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, 6, {"head_dim": 16}),  # L L L L L G
    "mistral_window": (MistralConfig, MistralForCausalLM, 2, {}),  # L L: Mistral's window is every layer's
    "qwen2_window": (Qwen2Config, Qwen2ForCausalLM, 4, {"use_sliding_window": True, "max_window_layers": 2}),  # G G L L
}
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}


def tiny_model(arch: str = "llama", heads: str = "gqa", *, layers: int | None = None, vocab: int = 97, seed: int = 0):
    """``arch`` from :data:`ARCHS` (``layers`` default 2) or :data:`LOCAL_ARCHS` (its own layer count by default)."""
    q_heads, kv_heads = HEADS[heads]
    if arch in LOCAL_ARCHS:
        config_cls, model_cls, default_layers, extra = LOCAL_ARCHS[arch]
        extra = {**extra, "sliding_window": LOCAL_WINDOW}
    else:
        (config_cls, model_cls), default_layers = ARCHS[arch], 2
        extra = {"head_dim": 16} if arch == "qwen3" else {}
        if arch == "mistral":
            extra["sliding_window"] = None
    config = config_cls(vocab_size=vocab, hidden_size=64, intermediate_size=96,
                        num_hidden_layers=layers or default_layers, num_attention_heads=q_heads,
                        num_key_value_heads=kv_heads, max_position_embeddings=1024, pad_token_id=0, bos_token_id=None,
                        eos_token_id=None, **extra)
    torch.manual_seed(seed)
    return model_cls(config).eval()


def dms_model(arch: str = "llama", heads: str = "gqa", budget=None, *, offset: float = 0.0, layers: int = 2,
              seed: int = 0):
    """A tiny model retrofitted with random DMS gates (kvpop.dms): about half the tokens evicted at ``offset = 0``,
    more below; ``budget`` defaults to ``Budget(2, 5, 0)``."""
    import kvpop

    model = tiny_model(arch, heads, layers=layers, seed=seed)
    kvpop.retrofit(model, budget or kvpop.Budget(2, 5, 0), scorer="dms", policy="dms",
                   scorer_options={"scale": 1.0, "offset": offset})
    generator = torch.Generator().manual_seed(seed + 1)
    for gate in kvpop.scorers(model):
        gate.proj.weight.data.normal_(generator=generator)
    return model


def save_tiny_teacher(path, tokenizer, *, arch: str = "llama", heads: str = "gqa", layers: int = 2, seed: int = 0):
    """A tiny random decoder saved as a plain HF folder with ``tokenizer`` (its vocab sized to the tokenizer)."""
    model = tiny_model(arch, heads, layers=layers, vocab=len(tokenizer), seed=seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_docs(path, count: int = 40, *, seed: int = 0, min_words: int = 20, max_words: int = 80) -> list[dict]:
    """A small jsonl corpus of random-word documents with ids ``d0``, ``d1``, …; returns the rows."""
    import json
    import random

    rng = random.Random(seed)
    words = ("the cat sat on a mat while seven dogs ran past quickly and nobody noticed any of it at all "
             "one two three four five six").split()
    rows = [{"doc": f"d{i}", "text": " ".join(rng.choice(words) for _ in range(rng.randint(min_words, max_words)))}
            for i in range(count)]
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return rows


def _previous_token_phases(max_positions: int, pairs: int) -> tuple[torch.Tensor, float]:
    """RoPE frequencies for previous-token heads and the smallest margin of their score peak.

    A head whose query carries phase ``-k·θ_i`` in pair ``i`` (key: phase 0) scores ``Σ_i cos(θ_i (Δ - k))`` at
    distance ``Δ``: largest at ``Δ = k``; returns the frequencies and ``min_k [s(k) - max_{Δ != k} s(Δ)]`` over
    every distance a sequence of ``max_positions`` tokens has.
    """
    import math

    theta = 10000.0 ** (-torch.arange(pairs, dtype=torch.float64) / pairs)
    distance = torch.arange(max_positions, dtype=torch.float64)
    margin = math.inf
    for k in (1, 2, 3):
        score = torch.cos(theta[None, :] * (distance[:, None] - k)).sum(-1)
        margin = min(margin, (score[k] - torch.cat([score[:k], score[k + 1:]]).max()).item())
    return theta.float(), margin


@torch.no_grad()
def induction_model(vocab_size: int, used_ids, *, triggers, sinks, max_positions: int = 1024):
    """A 2-layer Llama with hand-set weights that retrieves by induction: it continues with what followed an earlier
    occurrence of its last three tokens — the copy circuit a needle-in-a-haystack answer needs.

    Every token of ``used_ids`` (plus ``triggers`` and ``sinks``) gets a one-hot embedding in four subspaces of the
    residual: A (the token), B, C, D (the tokens 1, 2, 3 back). Layer 0 has three previous-token heads whose queries
    and keys are constant biases in RoPE's high-frequency pairs (:func:`_previous_token_phases`): head ``k`` attends
    to distance ``k`` and writes that token into B, C or D. Layer 1's head 0 scores 20 nats for each of
    ``x_d = x_{j-1}``, ``x_{d-1} = x_{j-2}``, ``x_{d-2} = x_{j-3}`` (in RoPE pairs of frequency 0, so position plays no
    part) and 50 for a key in ``sinks``; its query's A part is on only for tokens in ``triggers``, so only a trigger
    whose last three tokens were seen before (60 nats) looks past the sinks, and it copies the token at ``j`` into A
    three times over, enough to win the tied-embedding readout. MLPs are zero; the other heads of layer 1 are zero.
    """
    used = sorted(set(used_ids) | set(triggers) | set(sinks))
    size = len(used)
    slot = {tok: i for i, tok in enumerate(used)}
    hidden = 4 * size
    prev_pairs = 16
    content = 3 * size + 1
    pairs = prev_pairs + (content + 1) // 2
    head_dim = 2 * pairs
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=8, num_hidden_layers=2,
                         num_attention_heads=3, num_key_value_heads=3, head_dim=head_dim, attention_bias=True,
                         max_position_embeddings=max_positions, tie_word_embeddings=True, pad_token_id=None,
                         bos_token_id=None, eos_token_id=None)
    model = LlamaForCausalLM(config).eval()
    for p in model.parameters():
        p.zero_()
    theta, margin = _previous_token_phases(max_positions + 64, prev_pairs)
    inv_freq = torch.zeros(pairs)
    inv_freq[:prev_pairs] = theta
    model.model.rotary_emb.inv_freq.copy_(inv_freq)
    model.model.rotary_emb.original_inv_freq.copy_(inv_freq)

    embed = model.model.embed_tokens.weight
    for tok in used:
        embed[tok, slot[tok]] = 1.0
    assert model.lm_head.weight.data_ptr() == embed.data_ptr(), "the readout must be the tied embedding"
    model.model.norm.weight.fill_(1.0)

    zeroth, first = model.model.layers
    zeroth.input_layernorm.weight.fill_(hidden ** -0.5)  # one unit vector in the residual -> unit after the norm
    first.input_layernorm.weight.fill_(2 * hidden ** -0.5)  # four unit vectors -> each unit after the norm
    attn = zeroth.self_attn
    amplitude = (30.0 * head_dim ** 0.5 / margin) ** 0.5  # the peak wins by >= 30 nats
    for k in (1, 2, 3):
        head = (k - 1) * head_dim
        attn.q_proj.bias[head:head + prev_pairs] = amplitude * torch.cos(k * theta)
        attn.q_proj.bias[head + pairs:head + pairs + prev_pairs] = -amplitude * torch.sin(k * theta)
        attn.k_proj.bias[head:head + prev_pairs] = amplitude
        for i in range(size):
            attn.v_proj.weight[head + i, i] = 1.0
            attn.o_proj.weight[k * size + i, head + i] = 1.0

    attn = first.self_attn
    dims = list(range(prev_pairs, pairs)) + list(range(pairs + prev_pairs, 2 * pairs))
    match = (20.0 * head_dim ** 0.5) ** 0.5  # q·k / sqrt(head_dim) = 20 nats per matching token
    for i, tok in enumerate(used):
        if tok in triggers:
            attn.q_proj.weight[dims[i], i] = match  # x_d against the key's x_{j-1}
        attn.q_proj.weight[dims[size + i], size + i] = match  # x_{d-1} against x_{j-2}
        attn.q_proj.weight[dims[2 * size + i], 2 * size + i] = match  # x_{d-2} against x_{j-3}
        attn.k_proj.weight[dims[i], size + i] = match
        attn.k_proj.weight[dims[size + i], 2 * size + i] = match
        attn.k_proj.weight[dims[2 * size + i], 3 * size + i] = match
        if tok in sinks:
            attn.k_proj.weight[dims[3 * size], i] = 50.0 * head_dim ** 0.5 / match
        attn.v_proj.weight[i, i] = 1.0
        attn.o_proj.weight[i, i] = 3.0
    attn.q_proj.bias[dims[3 * size]] = match
    return model
