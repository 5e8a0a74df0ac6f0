"""Text → the model's tokenizer → fixed-length sequences of ``data.seq_len`` tokens with stable ids.

Sources (``data.source``):

* ``"champ"`` — the packaged CHAMP math corpus (``champ-dataset``): 270 problems × 72 model-written solution
  transcripts; each transcript is one document (``"<role>: <text>"`` paragraphs), id ``"<problem>/<transcript>"``.
* ``"stdlib"`` — the CPython standard library's ``.py`` sources of the running interpreter (on every machine, no
  download; long documents, handy for long-context throughput runs), id = the file's relative path.
* a local path: a folder written by ``datasets``' ``save_to_disk`` (a ``DatasetDict`` uses ``data.split``), a
  ``.jsonl`` / ``.json`` / ``.parquet`` file, or a folder of such files.
* anything else is taken as a Hugging Face hub dataset name (``load_dataset(name, split=data.split)``); it is only
  tried when the source is not a local path and fails with a clear message when the hub is unreachable.

Documents carry the text in ``data.text_field`` and, optionally, an id in ``data.id_field`` (default: the row
number). **Held-out split by document:** the documents are shuffled once with ``data.seed``; evaluation sequences are
cut from documents taken from the *end* of that order, training sequences from the *front*, and the two never share a
document (a :class:`ConfigError` says so when the corpus is too small for both). Because each split only ever takes
documents from its own end, training sequence ``i`` does not change when ``eval_sequences`` changes and vice versa.

**Packing** (``data.packing: true``, default): documents are tokenized without special tokens, joined with the EOS
token, and cut into consecutive pieces of ``seq_len`` tokens (a document may span two sequences; the last incomplete
piece is dropped). **Truncation** (``packing: false``): each document with at least ``seq_len`` tokens gives its first
``seq_len`` tokens; shorter documents are skipped.

**Planted recall** (``data.recall_mix``, default 0): ``round(recall_mix * num_sequences)`` *training* sequences, chosen
with ``data.seed``, get 1–3 facts in [5 %, 50 %] of their length and a question on one of them, with its answer, as
their last tokens (:mod:`pipelines.planted`: corpus tokens before the question are dropped to keep ``seq_len``; the
``docs`` stay those of the cut sequence, plus ``"planted:<asked name>"``). Held-out sequences are never changed. The
format shares no vocabulary with the evaluation's recall tasks (:mod:`pipelines.recall`).

**A second training corpus** (``data.mix_source`` + ``data.mix_sequences``, default none): the training split is the
source's ``num_sequences`` sequences followed by the first ``mix_sequences`` training sequences of ``mix_source``,
built exactly as that corpus alone would be (:func:`mix_config`: the same seq_len, seed, eval_sequences, packing and
fields), so its held-out documents — those of its own first ``eval_sequences`` held-out sequences — never enter
training. Their ids are ``"mix-<its own id>"``; their ``docs`` are the mix corpus's document ids. The eval split stays
the source's only, and only the source's sequences are planted (``recall_mix``).

Each sequence is ``{"id": "<split>-<index:06d>", "input_ids": [...], "docs": [document ids it contains]}``. The result
is cached under ``$KVPOP_HOME/data/sequences/<hash>/`` where the hash covers the source's content identity (package
version, file digests, or hub name), the tokenizer, every data setting and the format version (``recall_mix`` only
when it is not 0, and the mix — its corpus's content identity and ``mix_sequences`` — only when set, so caches made
before them keep their hash); ``meta.json`` is written last and marks a complete cache. A mix corpus's own sequences
are cached under its own hash too (the cache :func:`mix_config` alone would use).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import random
import shutil
import sys
import sysconfig
import time
from importlib import metadata
from pathlib import Path
from typing import Iterable, Iterator

import champ_dataset
import pyarrow as pa
import pyarrow.parquet as pq
from transformers import AutoConfig, AutoTokenizer

from kvpop.files import atomic_write_bytes, atomic_write_text
from kvpop.local_layers import layer_windows
from kvpop.pretrained import ModelConfigError, PretrainedMissingError, read_model_config
from pipelines.config import ConfigError, PipelineConfig, config_path, corpus_name, fingerprint
from pipelines.identity import file_digest, folder_digest, tokenizer_digest
from pipelines.models import missing_message
from pipelines.planted import Planter

SPLITS = ("train", "eval")
DATA_FORMAT_VERSION = 1
LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")
TOKENIZE_CHUNK = 64


# ----------------------------------------------------------------------------------------------- sources
BUILTIN_SOURCES = ("champ", "stdlib")


def is_local_source(source: str) -> bool:
    """A path (existing, or spelled like one) rather than a hub dataset name."""
    if source in BUILTIN_SOURCES:
        return False
    path = config_path(source)
    return path.exists() or source.startswith(("/", ".", "~")) or source.endswith(LOCAL_SUFFIXES)


def source_identity(cfg: PipelineConfig) -> dict:
    """What the source's documents are, cheaply: a package version, file digests, or the hub name."""
    source = cfg.data.source
    if source == "champ":
        return {"kind": "champ", "package": "champ-dataset", "version": metadata.version("champ-dataset"),
                "subset": "v0"}
    if source == "stdlib":
        return {"kind": "stdlib", "python": sys.version.split()[0], "implementation": sys.implementation.name}
    if is_local_source(source):
        path = config_path(source).resolve()
        if not path.exists():
            raise ConfigError(f"data.source {source!r} does not exist: give a local dataset folder, a .jsonl/.parquet "
                              f"file, 'champ', or a hub dataset name")
        if path.is_file():
            return {"kind": "file", "name": path.name, "sha256": file_digest(path, cfg.home_dir())}
        return {"kind": "dir", "name": path.name, "sha256": folder_digest(path, cfg.home_dir())}
    return {"kind": "hub", "name": source, "split": cfg.data.split}


def champ_documents() -> list[tuple[str, str]]:
    docs = []
    for problem_id, problem in champ_dataset.load("v0").problems.items():
        for key, conversation in problem.conversations.items():
            parts = []
            for message in conversation.messages:
                role = "Assistant" if message.role.startswith("Model") else message.role
                parts.append(f"{role}: {message.text}")
            docs.append((f"{problem_id}/{key}", "\n\n".join(parts)))
    return docs


def stdlib_documents() -> list[tuple[str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in ("site-packages", "dist-packages") or "test" in rel.parts or "tests" in rel.parts:
            continue
        try:
            docs.append((str(rel), path.read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError):
            continue
    return docs


def _load_local(path: Path, cfg: PipelineConfig):
    import datasets  # ~0.25-0.7 s per process: only reading a source needs it, not every process importing this module

    cache_dir = str(cfg.home_dir() / "cache" / "hf-datasets")
    if path.is_dir() and ((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()
                          or (path / "state.json").is_file()):
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if cfg.data.split not in loaded:
                raise ConfigError(f"data.source {path} has splits {sorted(loaded)}, not data.split="
                                  f"{cfg.data.split!r}")
            loaded = loaded[cfg.data.split]
        return loaded
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.name.endswith(LOCAL_SUFFIXES))
    if not files:
        raise ConfigError(f"data.source {path} holds no dataset: expected a save_to_disk folder or "
                          f"{'/'.join(LOCAL_SUFFIXES)} files")
    kinds = {"parquet" if f.suffix == ".parquet" else "json" for f in files}
    if len(kinds) > 1:
        raise ConfigError(f"data.source {path} mixes parquet and json files: keep one format per source")
    if all(f.stat().st_size == 0 for f in files):
        raise ConfigError(f"data.source {path} is empty: it holds no documents; point data.source at a dataset with "
                          f"text")
    cache = Path(cache_dir)
    before = set(cache.rglob("*")) if cache.is_dir() else None
    try:
        with _datasets_logs_silenced():  # its builder logs the parse error too: the ConfigError line says it once
            return datasets.load_dataset(kinds.pop(), data_files=[str(f) for f in files], split="train",
                                         cache_dir=cache_dir)
    except Exception as err:  # malformed json/parquet
        _remove_new(cache, before)  # the failed build's lock files and folders: a bad input writes nothing
        cause = err.__cause__ or err  # datasets wraps the reader's error in a generic DatasetGenerationError
        detail = " ".join(str(cause).split()) or "no detail"
        raise ConfigError(f"data.source {path}: cannot read it as a dataset ({type(cause).__name__}: "
                          f"{detail[:300]})") from None


@contextlib.contextmanager
def _datasets_logs_silenced() -> Iterator[None]:
    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _remove_new(root: Path, before: set[Path] | None) -> None:
    """Remove what appeared under ``root`` since ``before`` (its paths then; None: ``root`` did not exist)."""
    if before is None:
        shutil.rmtree(root, ignore_errors=True)
        return
    new = set(root.rglob("*")) - before if root.is_dir() else set()
    for path in sorted(p for p in new if p.parent not in new):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def _load_hub(cfg: PipelineConfig):
    import datasets  # see _load_local

    try:
        return datasets.load_dataset(cfg.data.source, split=cfg.data.split,
                                     cache_dir=str(cfg.home_dir() / "cache" / "hf-datasets"))
    except ConnectionError:  # datasets' word for "offline and not in the local cache": nothing tried to connect
        raise ConfigError(f"data.source {cfg.data.source!r} is not a local file or folder, and a hub dataset name "
                          f"is read only from the local Hugging Face cache (KVpop runs offline, it never downloads): "
                          f"save the dataset with save_to_disk and point data.source at that folder") from None
    except Exception as err:
        detail = " ".join(str(err).split())[:300] or type(err).__name__
        raise ConfigError(f"data.source {cfg.data.source!r} (a hub dataset name, from the local cache): "
                          f"{detail}") from None


def load_documents(cfg: PipelineConfig) -> list[tuple[str, str]]:
    """``[(document id, text)]`` in the source's order (ids unique)."""
    source = cfg.data.source
    if source == "champ":
        return champ_documents()
    if source == "stdlib":
        return stdlib_documents()
    if is_local_source(source):
        path = config_path(source).resolve()
        if not path.exists():
            raise ConfigError(f"data.source {source!r} does not exist")
        table = _load_local(path, cfg)
    else:
        table = _load_hub(cfg)
    columns = list(table.column_names)
    field = cfg.data.text_field
    if field not in columns:
        raise ConfigError(f"data.source {source!r} has no column {field!r} (columns: {columns}): set data.text_field")
    if cfg.data.id_field and cfg.data.id_field not in columns:
        raise ConfigError(f"data.source {source!r} has no column {cfg.data.id_field!r} (columns: {columns}): set "
                          f"data.id_field, or leave it empty to use row numbers")
    texts = table[field]
    ids = [str(x) for x in table[cfg.data.id_field]] if cfg.data.id_field else [str(i) for i in range(len(texts))]
    if len(set(ids)) != len(ids):
        raise ConfigError(f"data.id_field {cfg.data.id_field!r} is not unique in {source!r}")
    return [(doc_id, text) for doc_id, text in zip(ids, texts) if isinstance(text, str) and text]


# ----------------------------------------------------------------------------------------------- packing
def _tokenized(docs: list[tuple[str, str]], order: Iterable[int], tokenizer) -> Iterator[tuple[int, list[int]]]:
    """``(document index, token ids)`` along ``order``, tokenizing ``TOKENIZE_CHUNK`` documents at a time."""
    order = list(order)
    for start in range(0, len(order), TOKENIZE_CHUNK):
        chunk = order[start:start + TOKENIZE_CHUNK]
        encoded = tokenizer([docs[i][1] for i in chunk], add_special_tokens=False, verbose=False)["input_ids"]
        yield from zip(chunk, encoded)


def _cut(stream: Iterator[tuple[int, list[int]]], docs, seq_len: int, want: int, packing: bool, separator):
    """Take documents from ``stream`` until ``want`` sequences are cut; returns (sequences, documents consumed)."""
    sequences: list[tuple[list[int], list[str]]] = []
    consumed = 0
    buffer: list[int] = []
    spans: list[list] = []  # [document id, tokens of it still in the buffer]
    if want <= 0:
        return sequences, consumed
    for index, ids in stream:
        consumed += 1
        doc_id = docs[index][0]
        if not packing:
            if len(ids) >= seq_len:
                sequences.append((ids[:seq_len], [doc_id]))
        else:
            piece = ids + ([separator] if separator is not None else [])
            buffer.extend(piece)
            spans.append([doc_id, len(piece)])
            while len(buffer) >= seq_len and len(sequences) < want:
                taken, need = [], seq_len
                while need:
                    use = min(need, spans[0][1])
                    taken.append(spans[0][0])
                    spans[0][1] -= use
                    need -= use
                    if spans[0][1] == 0:
                        spans.pop(0)
                sequences.append((buffer[:seq_len], taken))
                buffer = buffer[seq_len:]
        if len(sequences) >= want:
            break
    return sequences, consumed


def build_sequences(docs: list[tuple[str, str]], tokenizer, *, seq_len: int, num_train: int, num_eval: int,
                    packing: bool = True, seed: int = 0) -> dict[str, list[dict]]:
    """Both splits from ``docs`` (see the module doc for the rules); raises :class:`ConfigError` if too few."""
    if not docs:
        raise ConfigError("the data source holds no documents (empty dataset or no non-empty text): "
                          "point data.source at a dataset with text")
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    separator = tokenizer.eos_token_id
    eval_seqs, eval_used = _cut(_tokenized(docs, reversed(order), tokenizer), docs, seq_len, num_eval, packing,
                                separator)
    train_pool = order[:len(order) - eval_used]
    train_seqs, _ = _cut(_tokenized(docs, train_pool, tokenizer), docs, seq_len, num_train, packing, separator)
    for split, got, want in (("train", train_seqs, num_train), ("eval", eval_seqs, num_eval)):
        if len(got) < want:
            raise ConfigError(
                f"data.source yields only {len(got)} {split} sequences of {seq_len} tokens "
                f"({len(docs)} documents, {'packed' if packing else 'truncated'}), fewer than the "
                f"{want} asked for: lower data.num_sequences/data.eval_sequences or data.seq_len, "
                f"{'or set data.packing=true, ' if not packing else ''}or use a larger corpus")
    eval_docs = {d for _, ds in eval_seqs for d in ds}
    train_docs = {d for _, ds in train_seqs for d in ds}
    assert not eval_docs & train_docs, "train and eval sequences share documents"
    return {split: [{"id": f"{split}-{i:06d}", "input_ids": ids, "docs": ds} for i, (ids, ds) in enumerate(seqs)]
            for split, seqs in (("train", train_seqs), ("eval", eval_seqs))}


def plant_recall(rows: list[dict], tokenizer, *, fraction: float, seed: int) -> list[dict]:
    """``rows`` (the training split) with ``round(fraction * len(rows))`` of them, chosen with ``seed``, carrying
    planted facts and a question (:mod:`pipelines.planted`); the others unchanged."""
    chosen = random.Random(f"kvpop.recall_mix:{seed}").sample(range(len(rows)), round(fraction * len(rows)))
    if not chosen:
        return rows
    planter = Planter(tokenizer, len(rows[0]["input_ids"]))
    planted = list(rows)
    for i in chosen:
        row = rows[i]
        ids, name = planter.plant(row["input_ids"], random.Random(f"kvpop.recall_mix:{seed}:{row['id']}"))
        planted[i] = {**row, "input_ids": ids, "docs": [*row["docs"], f"planted:{name}"]}
    return planted


# ----------------------------------------------------------------------------------------------- cache
def check_inputs(cfg: PipelineConfig) -> None:
    """What every stage can check before it writes anything, without Ray: the teacher folder is loadable
    (``read_model_config``: files present, ``model_type`` named) and its attention pattern one KVpop reproduces
    (``kvpop.local_layers``), a local data source (and mix source) exists, and
    the budget fits the model's context. Raises :class:`ConfigError` with one line."""
    model = cfg.model.resolved_path()
    try:
        context = read_model_config(model).get("max_position_embeddings")
    except PretrainedMissingError as err:
        raise ConfigError(missing_message(model) if cfg.model.path == "smollm2" else f"model.path: {err}") from None
    except ModelConfigError as err:
        raise ConfigError(f"model.path: {err}") from None
    try:  # an attention pattern KVpop cannot reproduce (kvpop.local_layers), before anything is written
        layer_windows(AutoConfig.from_pretrained(model, local_files_only=True))
    except ValueError as err:
        raise ConfigError(f"model.path {model}: {str(err).strip().splitlines()[0]}") from None
    total = cfg.budget.total
    if isinstance(context, int) and total > context:
        raise ConfigError(f"budget {cfg.budget} keeps {total} tokens, more than the model's context of "
                          f"{context} (max_position_embeddings): impossible budget")
    check_heldout_sources(cfg)
    for key, source in (("data.source", cfg.data.source), ("data.mix_source", cfg.data.mix_source)):
        if source is not None and source not in BUILTIN_SOURCES and is_local_source(source) \
                and not config_path(source).exists():
            raise ConfigError(f"{key} {source!r} does not exist")


def check_heldout_sources(cfg: PipelineConfig) -> None:
    """``eval.heldout_sources`` before anything is written: each a local path that exists (or a built-in / hub
    name), none named as ``data.source`` is (:func:`pipelines.config.corpus_name`). One :class:`ConfigError` line."""
    for source in cfg.eval.heldout_sources:
        if source == cfg.data.source or corpus_name(source) == corpus_name(cfg.data.source):
            raise ConfigError(f"eval.heldout_sources: {source!r} is named {corpus_name(source)!r}, as data.source "
                              f"{cfg.data.source!r} is: the main corpus is evaluated already")
        if source not in BUILTIN_SOURCES and is_local_source(source) and not config_path(source).exists():
            raise ConfigError(f"eval.heldout_sources {source!r} does not exist")


def load_tokenizer(cfg: PipelineConfig):
    path = cfg.model.resolved_path()
    if not (path / "tokenizer_config.json").is_file() and not (path / "tokenizer.json").is_file():
        raise ConfigError(f"model.path {path} has no tokenizer (tokenizer.json / tokenizer_config.json): "
                          f"run `make model` for SmolLM2, or save the tokenizer next to the weights")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def mix_config(cfg: PipelineConfig) -> PipelineConfig | None:
    """The config that builds ``data.mix_source`` alone (its ``mix_sequences`` training sequences, its held-out split
    as it would hold out for itself), or None without a mix: every other data setting is ``cfg``'s."""
    d = cfg.data
    if d.mix_source is None:
        return None
    return dataclasses.replace(cfg, data=dataclasses.replace(d, source=d.mix_source, num_sequences=d.mix_sequences,
                                                             mix_source=None, mix_sequences=0, recall_mix=0.0))


def heldout_source_config(cfg: PipelineConfig, source: str) -> PipelineConfig:
    """The config whose ``eval`` split is ``source``'s held-out split (``eval.heldout_sources``): the mix corpus's
    own (:func:`mix_config`: its held-out documents never enter training), else ``source`` alone — a corpus training
    never reads — with one training sequence (the least a data config holds; the held-out split does not depend on
    it). Every other data setting is ``cfg``'s."""
    if source == cfg.data.mix_source:
        return mix_config(cfg)
    d = cfg.data
    return dataclasses.replace(cfg, data=dataclasses.replace(d, source=source, num_sequences=1, mix_source=None,
                                                             mix_sequences=0, recall_mix=0.0))


def _mix_error(err: ConfigError) -> ConfigError:
    """A data error of the mix corpus, naming the mix's settings instead of the source's."""
    return ConfigError(str(err).replace("data.source", "data.mix_source")
                       .replace("data.num_sequences", "data.mix_sequences"))


def data_fingerprint(cfg: PipelineConfig, tokenizer=None) -> str:
    """The hash that names the sequence cache (and enters the precomputed-target hash)."""
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg)
    d = cfg.data
    mix = mix_config(cfg)
    optional = {k: v for k, v in d.optional_settings().items() if k not in ("mix_source", "mix_sequences")}
    try:  # the mix by its content, not its path
        mixed = [] if mix is None else [("mix", source_identity(mix), d.mix_sequences)]
    except ConfigError as err:
        raise _mix_error(err) from None
    return fingerprint("kvpop.sequences", DATA_FORMAT_VERSION, source_identity(cfg), d.text_field, d.id_field,
                       d.split if d.source not in BUILTIN_SOURCES else "", d.seq_len, d.num_sequences, d.eval_sequences,
                       d.packing, d.seed, tokenizer_digest(tokenizer), *optional.items(), *mixed)


def sequences_dir(cfg: PipelineConfig, tokenizer=None) -> Path:
    return cfg.home_dir() / "data" / "sequences" / data_fingerprint(cfg, tokenizer)


def _write_split(path: Path, rows: list[dict]) -> None:
    table = pa.table({"id": pa.array([r["id"] for r in rows], pa.string()),
                      "input_ids": pa.array([r["input_ids"] for r in rows], pa.list_(pa.int32())),
                      "docs": pa.array([r["docs"] for r in rows], pa.list_(pa.string()))})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    atomic_write_bytes(path, sink.getvalue().to_pybytes())


def _read_split(path: Path) -> list[dict]:
    return pq.read_table(path).to_pylist()


def load_sequences(cfg: PipelineConfig, split: str = "train", tokenizer=None) -> list[dict]:
    """The ``split`` ("train" or "eval") sequences: ``[{"id", "input_ids", "docs"}]``, deterministic and cached."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg)
    folder = sequences_dir(cfg, tokenizer)
    if (folder / "meta.json").is_file():
        return _read_split(folder / f"{split}.parquet")
    t0 = time.perf_counter()
    docs = load_documents(cfg)
    built = build_sequences(docs, tokenizer, seq_len=cfg.data.seq_len, num_train=cfg.data.num_sequences,
                            num_eval=cfg.data.eval_sequences, packing=cfg.data.packing, seed=cfg.data.seed)
    built["train"] = plant_recall(built["train"], tokenizer, fraction=cfg.data.recall_mix, seed=cfg.data.seed)
    mix = mix_config(cfg)
    if mix is not None:
        try:
            mixed = load_sequences(mix, "train", tokenizer)
        except ConfigError as err:
            raise _mix_error(err) from None
        built["train"] += [{**row, "id": f"mix-{row['id']}"} for row in mixed]
    folder.mkdir(parents=True, exist_ok=True)
    for name, rows in built.items():
        _write_split(folder / f"{name}.parquet", rows)
    meta = {"format_version": DATA_FORMAT_VERSION, "source": source_identity(cfg), "data": cfg.to_dict()["data"],
            "model": str(cfg.model.resolved_path()), "documents": len(docs),
            **({"mix": {"source": source_identity(mix), "sequences": cfg.data.mix_sequences}} if mix else {}),
            "sequences": {name: len(rows) for name, rows in built.items()},
            "seconds": round(time.perf_counter() - t0, 3)}
    atomic_write_text(folder / "meta.json", json.dumps(meta, indent=2))
    return [dict(r) for r in built[split]]
