"""Tiny random decoders built in memory (no download): the test matrix of architectures × head layouts."""
from __future__ import annotations

import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM)

ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
}
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}


def tiny_model(arch: str = "llama", heads: str = "gqa", *, layers: int = 2, vocab: int = 97, seed: int = 0):
    config_cls, model_cls = ARCHS[arch]
    q_heads, kv_heads = HEADS[heads]
    extra = {"head_dim": 16} if arch == "qwen3" else {}
    if arch == "mistral":
        extra["sliding_window"] = None
    config = config_cls(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                        num_attention_heads=q_heads, num_key_value_heads=kv_heads, max_position_embeddings=1024,
                        pad_token_id=0, bos_token_id=None, eos_token_id=None, **extra)
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
