"""kvpop.pretrained: the generic local loader — its folder check refuses what transformers could not load, before
transformers runs — and SmolLM2 loaded through it (the provisioning is tests/test_models.py)."""
import json

import pytest
import torch

from kvpop.pretrained import (ModelConfigError, PretrainedMissingError, load_pretrained, missing_files,
                              read_model_config)


def _folder(path, config) -> str:
    """A folder with the files the check asks for; ``config`` is written as config.json (a str verbatim)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    (path / "model.safetensors").write_bytes(b"not read by the check")
    (path / "tokenizer_config.json").write_text("{}")
    return path


def test_missing_folder_gives_clear_error(tmp_path):
    with pytest.raises(PretrainedMissingError, match="does not exist: give a local Hugging Face model folder"):
        load_pretrained(tmp_path / "nope")
    assert issubclass(PretrainedMissingError, FileNotFoundError)


def test_incomplete_folder_names_what_is_missing(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(PretrainedMissingError, match=r"incomplete \(missing \['model.safetensors', "
                                                     r"'tokenizer_config.json'\]\).*save_pretrained"):
        load_pretrained(tmp_path)


def test_sharded_weights_count_as_weights(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    assert missing_files(tmp_path) == ["config.json", "tokenizer_config.json"]


@pytest.mark.parametrize("config, message", [
    ({"architectures": ["LlamaForCausalLM"], "hidden_size": 64}, "has no model_type, so transformers cannot tell"),
    ({"model_type": ""}, "has no model_type"),
    ({"model_type": 3}, "has no model_type"),
    ("{not json", "is not valid JSON"),
    ("[1, 2]", "is not a JSON object"),
])
def test_config_transformers_cannot_load_is_refused_before_transformers(tmp_path, monkeypatch, config, message):
    import transformers

    folder = _folder(tmp_path / "m", config)

    def never(*args, **kwargs):
        raise AssertionError("transformers was asked to load a folder the check should have refused")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", never)
    with pytest.raises(ModelConfigError, match=message) as info:
        load_pretrained(folder)
    assert isinstance(info.value, ValueError) and str(folder / "config.json") in str(info.value)


def test_read_model_config_returns_the_config(tmp_path):
    config = {"model_type": "llama", "max_position_embeddings": 1024}
    assert read_model_config(_folder(tmp_path / "m", config)) == config


@pytest.mark.pretrained
def test_tiny_saved_model_round_trips(tmp_path, smollm2_dir):
    from transformers import AutoTokenizer

    from tests.models import save_tiny_teacher

    folder = save_tiny_teacher(tmp_path / "tiny", AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True))
    model, tokenizer = load_pretrained(folder, dtype=torch.float64)
    assert model.config.model_type == "llama" and not model.training
    assert all(p.dtype == torch.float64 for p in model.parameters())
    assert tokenizer.eos_token == "<|im_end|>"


# ---------------------------------------------------------------------------------------------------- SmolLM2
@pytest.mark.pretrained
def test_smollm2_loads_local_only(smollm2):
    model, tokenizer = smollm2
    cfg = model.config
    assert cfg.model_type == "llama"
    assert cfg.num_hidden_layers == 30
    assert cfg.num_attention_heads == 9
    assert cfg.num_key_value_heads == 3
    assert cfg.hidden_size // cfg.num_attention_heads == 64
    assert cfg.max_position_embeddings == 8192
    assert getattr(model, "hf_quantizer", None) is None
    assert not model.training
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6
    assert tokenizer.eos_token == "<|im_end|>"
    ids = tokenizer("def add(a, b):\n    return a + b\n", return_tensors="pt").input_ids
    assert tokenizer.decode(ids[0]) == "def add(a, b):\n    return a + b\n"
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], cfg.vocab_size) and torch.isfinite(logits).all()


@pytest.mark.pretrained
def test_smollm2_generates_sensible_text(smollm2):
    model, tokenizer = smollm2
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    text = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in text, text
