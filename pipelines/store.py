"""The target store: the frozen teacher's targets and top-K logits as Parquet shards, committed by a manifest.

The precompute stage writes through this module, train and sweep read through :func:`open_targets`; nothing else
knows the layout. A directory (``precompute.output_root`` or ``$KVPOP_HOME/targets``, then ``<key>/``)::

    <key>/dataset.json        the Header: identity + shard plan (written once, atomically, before any shard)
    <key>/manifest.jsonl      one ShardRecord per finished shard (appended + fsynced): the commit point
    <key>/shards/shard-00000.parquet …
    <key>/.lock               held by the one writer (a second one is refused at once)

``<key>`` hashes the :func:`target_identity`: the teacher (weights + config digest, compute dtype), the data
fingerprint (source content, tokenizer, every data setting), the split, S, the sorted windows, K, the group reduction,
the shard size and the schema version, so another configuration never writes into the same directory.

**Schema** (version :data:`SCHEMA_VERSION`; one row per sequence; tensor columns are Arrow's canonical
``arrow.fixed_shape_tensor`` extension, read by pyarrow and Ray Data alike):

==================  ==============================  ==================================================
column              type                            meaning
==================  ==============================  ==================================================
``id``              string                          the sequence's stable id (``train-000123``)
``input_ids``       int32 tensor ``[S]``            token ids
``targets_w<w>``    float32 tensor ``[L, Hkv, S]``  ``y[l, g, t]`` for window ``w`` (METHOD §2);
                                                    ``-inf`` where ``t + w >= S`` (no deciding query);
                                                    ``L`` the teacher's global layers (all, unless it
                                                    has local ones: identity ``target_layers``)
``topk_values``     float32 tensor ``[S, K]``       the teacher's top-K next-token logits at each position
``topk_indices``    int32 tensor ``[S, K]``         their vocabulary ids
==================  ==============================  ==================================================

The Parquet schema metadata carries ``kvpop.schema_version`` and ``kvpop.key``.

**Commit rules.** Readers trust only the manifest: a shard file without a record (its writer killed before the
append) is recomputed, a torn last line is not committed, the last record of a shard wins. :func:`open_targets`
refuses, in one :class:`TargetsError` line saying what to do, a directory whose identity differs from what the caller
expects, an unreadable header, an incomplete or empty manifest, a missing or corrupt file, or a missing column.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from transformers import AutoConfig

from kvpop.files import LockedError, atomic_write_bytes, atomic_write_text, exclusive_lock, sha256_file
from kvpop.local_layers import UnsupportedAttention, evicting_layers
from pipelines.config import ConfigError, PipelineConfig, PrecomputeConfig, config_path, fingerprint
from pipelines.data import data_fingerprint
from pipelines.identity import teacher_identity

SCHEMA_VERSION = 1
HEADER = "dataset.json"
MANIFEST = "manifest.jsonl"
SHARDS = "shards"
LOCK = ".lock"
SPLIT = "train"  # targets are computed for the training split


class TargetsError(ConfigError):
    """Precomputed targets that cannot be used as asked: the message says why and what to do."""


def target_column(window: int) -> str:
    return f"targets_w{int(window)}"


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.parquet"


# ------------------------------------------------------------------------------------------------ identity
def target_identity(cfg: PipelineConfig, tokenizer=None) -> dict:
    """Everything the targets depend on (the teacher's shape included: it fixes the columns' shapes); its hash names
    the directory."""
    path = cfg.model.resolved_path()
    if not (path / "config.json").is_file():
        raise ConfigError(f"model.path {path} has no config.json: run `make model` for SmolLM2 or point model.path "
                          f"at a saved Hugging Face folder")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    p = cfg.precompute
    try:
        evicting = evicting_layers(config)  # targets exist for the global layers only (kvpop.local_layers)
    except UnsupportedAttention as err:
        raise ConfigError(f"model.path {path}: {err}") from None
    # a model with local layers names which layers its targets cover; one without keeps the identity it always had
    hybrid = {"target_layers": list(evicting)} if len(evicting) != config.num_hidden_layers else {}
    return {
        "kind": "kvpop.targets", "schema_version": SCHEMA_VERSION, "teacher": teacher_identity(cfg),
        "data": data_fingerprint(cfg, tokenizer), "split": SPLIT, "seq_len": cfg.data.seq_len,
        "windows": sorted({int(w) for w in p.windows}), "top_k": p.top_k, "group_reduce": p.group_reduce,
        "sequences_per_shard": p.sequences_per_shard, "num_layers": len(evicting), **hybrid,
        "num_kv_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        "vocab_size": config.vocab_size, **p.optional_settings(),
    }


# what a reader of targets does not need to match: the shard layout, and the windows (checked one by one)
LAYOUT_FIELDS = ("sequences_per_shard", "windows")


def training_identity(cfg: PipelineConfig, tokenizer=None) -> dict:
    """The identity fields a trainer's config must share with the targets it reads (all but :data:`LAYOUT_FIELDS`)."""
    kept = {k: v for k, v in target_identity(cfg, tokenizer).items() if k not in LAYOUT_FIELDS}
    return {**PrecomputeConfig.optional_defaults(), **kept}  # stated at their default too: a reader checks them


def targets_root(cfg: PipelineConfig) -> Path:
    root = cfg.precompute.output_root
    return config_path(root).resolve() if root else cfg.home_dir() / "targets"


def key_of(identity: dict) -> str:
    """The directory name of targets with this identity."""
    return fingerprint(identity)


def targets_dir(cfg: PipelineConfig, tokenizer=None) -> Path:
    """The directory this config's targets live in (whether or not they exist yet)."""
    return targets_root(cfg) / key_of(target_identity(cfg, tokenizer))


# ------------------------------------------------------------------------------------------------ records
@dataclass(frozen=True)
class ShardPlan:
    shard: int
    file: str
    ids: tuple[str, ...]


@dataclass(frozen=True)
class Header:
    """``dataset.json``: the identity and the shard plan, fixed before any shard is written."""

    identity: dict
    key: str
    plan: tuple[ShardPlan, ...]
    model_path: str
    columns: tuple[str, ...]
    created: str

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def read(cls, folder: Path) -> "Header":
        path = Path(folder) / HEADER
        try:
            raw = json.loads(path.read_text())
            return cls(identity=dict(raw["identity"]), key=str(raw["key"]),
                       plan=tuple(ShardPlan(int(e["shard"]), str(e["file"]), tuple(e["ids"])) for e in raw["plan"]),
                       model_path=str(raw.get("model_path", "")), columns=tuple(raw.get("columns", ())),
                       created=str(raw.get("created", "")))
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
            raise TargetsError(f"{path} is not a target header (unreadable or edited): move {folder} away and run "
                               f"precompute again") from None


@dataclass(frozen=True)
class ShardRecord:
    """One manifest line: a finished shard, its rows and the size and sha256 of its file."""

    shard: int
    file: str
    rows: int
    ids: tuple[str, ...]
    bytes: int
    sha256: str
    teacher_s: float = 0.0
    write_s: float = 0.0
    host: str = ""
    time: str = ""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_dict(cls, raw: dict) -> "ShardRecord":
        return cls(int(raw["shard"]), str(raw["file"]), int(raw["rows"]), tuple(raw["ids"]), int(raw["bytes"]),
                   str(raw["sha256"]), float(raw.get("teacher_s", 0.0)), float(raw.get("write_s", 0.0)),
                   str(raw.get("host", "")), str(raw.get("time", "")))


def read_manifest(folder: Path) -> dict[int, ShardRecord]:
    """``{shard: record}`` from ``manifest.jsonl`` (last line per shard wins; a torn final line is ignored)."""
    manifest = Path(folder) / MANIFEST
    if not manifest.is_file():
        return {}
    lines = manifest.read_text().split("\n")
    lines.pop()  # "" after the final newline, or a torn last line (killed mid-append): not committed
    records: dict[int, ShardRecord] = {}
    for number, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = ShardRecord.from_dict(json.loads(line))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise TargetsError(f"{manifest} line {number + 1} is not a shard record: the manifest is corrupt; delete "
                               f"that line (its shard will be recomputed) and run precompute again") from None
        records[record.shard] = record
    return records


def repair_manifest(folder: Path) -> None:
    """Cut a torn last line (a writer killed mid-append) so that the next append starts a fresh line."""
    manifest = Path(folder) / MANIFEST
    if not manifest.is_file():
        return
    data = manifest.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(manifest, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)
            os.fsync(f.fileno())


def committed_shards(folder: Path, plan: tuple[ShardPlan, ...]) -> set[int]:
    """The planned shards whose record matches the plan and whose file is intact (size + sha256)."""
    return {i for i, rec in read_manifest(folder).items()
            if i < len(plan) and rec.ids == plan[i].ids and intact(folder, rec)}


def intact(folder: Path, record: ShardRecord, *, checksum: bool = True) -> bool:
    file = Path(folder) / SHARDS / record.file
    try:
        if file.stat().st_size != record.bytes:
            return False
    except OSError:
        return False
    return not checksum or sha256_file(file) == record.sha256


# ------------------------------------------------------------------------------------------------ the writer
def shard_table(ids, rows: dict[str, np.ndarray], key: str) -> pa.Table:
    """One shard's table: ``id`` plus one tensor column per array in ``rows`` (first dim = the rows)."""
    columns = {"id": pa.array([str(i) for i in ids], pa.string())}
    for name, array in rows.items():
        columns[name] = pa.FixedShapeTensorArray.from_numpy_ndarray(np.ascontiguousarray(array))
    table = pa.table(columns)
    return table.replace_schema_metadata({"kvpop.schema_version": str(SCHEMA_VERSION), "kvpop.key": key})


def write_shard(folder: Path, index: int, table: pa.Table) -> tuple[str, int, str]:
    """Write ``table`` as shard ``index`` atomically; returns ``(file name, bytes, sha256)`` for its record."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, row_group_size=max(1, table.num_rows))
    data = sink.getvalue().to_pybytes()
    name = shard_name(index)
    atomic_write_bytes(Path(folder) / SHARDS / name, data)
    return name, len(data), hashlib.sha256(data).hexdigest()


class Writer:
    """The one writer of a directory, inside :func:`writing`: commits finished shards to the manifest."""

    def __init__(self, folder: Path, header: Header):
        self.folder, self.header = folder, header
        repair_manifest(folder)
        for stale in (folder / SHARDS).glob(".shard-*.tmp-*") if (folder / SHARDS).is_dir() else []:
            stale.unlink(missing_ok=True)  # temp files of a killed writer (we hold the lock: nobody writes them now)

    def commit(self, record: ShardRecord) -> None:
        """Append the shard's record to the manifest and fsync: from now on readers see the shard."""
        with open(self.folder / MANIFEST, "a") as f:
            f.write(record.to_json() + "\n")
            f.flush()
            os.fsync(f.fileno())


@contextlib.contextmanager
def writing(folder: Path, header: Header) -> Iterator[Writer]:
    """Lock ``folder`` (one writer at a time), write its header if new or check that it is this one, and yield the
    :class:`Writer`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        with exclusive_lock(folder / LOCK):
            if (folder / HEADER).is_file():
                found = Header.read(folder)
                if found.identity != header.identity or found.plan != header.plan:
                    raise TargetsError(f"{folder} holds targets of another configuration (hash collision or an "
                                       f"edited {HEADER}): move it away and run precompute again")
                header = found
            else:
                atomic_write_text(folder / HEADER, header.to_json())
            yield Writer(folder, header)
    except LockedError:
        raise TargetsError(f"another precompute is writing {folder}: wait for it to finish (its shards are committed "
                           f"as they finish), then run again") from None


# ------------------------------------------------------------------------------------------------ the reader
@dataclass(frozen=True)
class Targets:
    """A verified, complete target directory."""

    path: Path
    header: Header
    records: tuple[ShardRecord, ...]  # in shard order

    @property
    def identity(self) -> dict:
        return self.header.identity

    @property
    def key(self) -> str:
        return self.header.key

    @property
    def files(self) -> list[Path]:
        return [self.path / SHARDS / r.file for r in self.records]

    @property
    def num_rows(self) -> int:
        return sum(r.rows for r in self.records)

    @property
    def ids(self) -> list[str]:
        return [i for r in self.records for i in r.ids]

    def read_table(self, columns: list[str] | None = None) -> pa.Table:
        """All rows as one table (small data and tests; training reads the files through Ray Data,
        :func:`pipelines.train.training_dataset`)."""
        return pa.concat_tables([pq.read_table(f, columns=columns) for f in self.files])


def _expected_columns(identity: dict) -> dict[str, tuple[str, list[int]]]:
    s, k = identity["seq_len"], identity["top_k"]
    shape = [identity["num_layers"], identity["num_kv_heads"], s]
    cols = {"input_ids": ("int32", [s]), "topk_values": ("float", [s, k]), "topk_indices": ("int32", [s, k])}
    for w in identity["windows"]:
        cols[target_column(w)] = ("float", shape)
    return cols


def _check_schema(file: Path, identity: dict, needed: list[str]) -> None:
    try:
        schema = pq.read_schema(file)
    except (OSError, pa.ArrowException) as err:
        raise TargetsError(f"shard {file} is corrupt ({str(err).splitlines()[0]}): delete its line from "
                           f"{MANIFEST} (or the file) and run precompute again to recompute it") from None
    expected = _expected_columns(identity)
    for name in ["id", *needed]:
        if name not in schema.names:
            raise TargetsError(f"shard {file} has no column {name!r} (it has {schema.names}): it was not written by "
                               f"this schema (v{SCHEMA_VERSION}); run precompute again into a fresh directory")
        if name == "id":
            continue
        field_type = schema.field(name).type
        want_dtype, want_shape = expected[name]
        shape = list(getattr(field_type, "shape", []) or [])
        value = str(getattr(field_type, "value_type", ""))
        if shape != want_shape or value != want_dtype:
            raise TargetsError(f"shard {file} column {name!r} is {field_type}, expected a {want_dtype} tensor of "
                               f"shape {want_shape}: run precompute again into a fresh directory")


def _check_identity(folder: Path, found: dict, expect: dict) -> None:
    """``expect`` ⊆ ``found``, with a message per field that says which setting differs."""
    teacher, want = found.get("teacher", {}), expect.get("teacher")
    if want is not None and teacher.get("weights_sha256") != want["weights_sha256"]:
        raise TargetsError(f"targets at {folder} come from another teacher ({teacher.get('name')}, weights "
                           f"{str(teacher.get('weights_sha256'))[:12]}…) than the model being trained (weights "
                           f"{want['weights_sha256'][:12]}…): precompute targets with this model.path")
    if "seq_len" in expect and found.get("seq_len") != expect["seq_len"]:
        raise TargetsError(f"targets at {folder} are for sequences of {found.get('seq_len')} tokens, the config trains "
                           f"on data.seq_len={expect['seq_len']}: precompute with this seq_len or set data.seq_len="
                           f"{found.get('seq_len')}")
    settings = {"top_k": "precompute.top_k", "group_reduce": "precompute.group_reduce",
                "query_power": "precompute.query_power", "teacher": "model.dtype",
                "data": "data.* (the corpus, its tokenizer or a data setting)"}
    for name, want_value, found_value in [("teacher", (want or {}).get("dtype"), teacher.get("dtype")),
                                          *[(k, expect[k], found.get(k, PrecomputeConfig.optional_defaults().get(k)))
                                            for k in sorted(set(expect) - {"teacher"})]]:
        if want_value is not None and found_value != want_value:
            raise TargetsError(f"targets at {folder} were computed with another {settings.get(name, name)} "
                               f"({found_value!r}, this config: {want_value!r}): precompute with this config, or "
                               f"point train.targets at targets computed with it")


def open_targets(path: str | os.PathLike, *, expect: dict | None = None, windows: Iterable[int] = (),
                 verify: bool = True) -> Targets:
    """Open a target directory, refusing (with a :class:`TargetsError`) anything training must not read.

    ``expect``: identity fields that must match (e.g. :func:`training_identity` of the reading config);
    ``windows``: target columns the reader needs (all of them when empty); ``verify``: check every file's sha256.
    """
    folder = Path(path).expanduser()
    if not (folder / HEADER).is_file():
        raise TargetsError(f"no precomputed targets at {folder} (no {HEADER}): run the precompute stage for this "
                           f"config first (python -m jobs.precompute)")
    header = Header.read(folder)
    found = header.identity
    if found.get("schema_version") != SCHEMA_VERSION:
        raise TargetsError(f"{folder} holds schema v{found.get('schema_version')} targets, this code reads "
                           f"v{SCHEMA_VERSION}: run precompute again")
    _check_identity(folder, found, expect or {})
    windows = sorted(set(windows))
    absent = [w for w in windows if w not in found["windows"]]
    if absent:
        raise TargetsError(f"targets at {folder} were computed for windows {found['windows']}, not "
                           f"{'budget.window=' + str(absent[0]) if len(windows) == 1 else absent}: precompute with "
                           f"precompute.windows containing {absent[0] if len(absent) == 1 else absent}")
    committed = read_manifest(folder)
    plan = header.plan
    missing = [e.shard for e in plan if e.shard not in committed]
    if missing:
        raise TargetsError(f"targets at {folder} are incomplete ({len(plan) - len(missing)} of {len(plan)} shards "
                           f"committed): run precompute again to finish them")
    records = tuple(committed[e.shard] for e in plan)
    if not records or sum(r.rows for r in records) == 0:
        raise TargetsError(f"targets at {folder} hold no rows (empty dataset): check data.source and run precompute")
    needed = ["input_ids", "topk_values", "topk_indices", *[target_column(w) for w in windows or found["windows"]]]
    for entry, record in zip(plan, records):
        file = folder / SHARDS / record.file
        if record.ids != entry.ids:
            raise TargetsError(f"{MANIFEST} in {folder}: shard {entry.shard} holds other sequences than planned: "
                               f"delete its line and run precompute again")
        if not file.is_file():
            raise TargetsError(f"shard file {file} listed in the manifest is missing: run precompute again to "
                               f"recompute it")
        _check_schema(file, found, needed)
        if not intact(folder, record, checksum=verify):
            raise TargetsError(f"shard {file} is corrupt (size or sha256 differs from the manifest): run precompute "
                               f"again to recompute it")
    return Targets(folder, header, records)
