"""Stage 1: the frozen teacher's targets and top-K logits, precomputed once into Parquet shards (METHOD §2, §3).

``run(cfg)`` reads the training sequences (:func:`pipelines.data.load_sequences`), plans shards of
``precompute.sequences_per_shard`` sequences, and feeds the unfinished ones through Ray Data to an actor pool
(:class:`TeacherActor`, ``precompute.num_actors`` actors, ``precompute.num_gpus_per_actor`` GPUs each on a GPU
cluster, CPU otherwise). Each actor holds the teacher and runs :func:`kvpop.targets.teacher_pass` — one dense forward
whose attention also runs the transposed target pass (FlexAttention on CUDA, row-chunked on CPU; neither forms an
S×S map) and whose logits are projected in chunks — then writes the shard itself (temporary file, fsync, rename).
The driver appends one line per finished shard to the manifest: **the manifest is the commit point**.

Directory (``precompute.output_root`` or ``$KVPOP_HOME/targets``, then ``<key>/``)::

    <key>/dataset.json        identity + shard plan (written once, atomically, before any shard)
    <key>/manifest.jsonl      one JSON line per finished shard (appended + fsynced by the driver)
    <key>/shards/shard-00000.parquet …

``<key>`` hashes the teacher identity (weights + config digest, compute dtype), the data fingerprint (source content,
tokenizer, every data setting), the split, S, the sorted windows, K, the group reduction, the shard size and the
schema version: another configuration never writes into the same directory.

**Schema** (version :data:`SCHEMA_VERSION`; one row per sequence; tensor columns are Arrow's canonical
``arrow.fixed_shape_tensor`` extension, read by pyarrow and Ray Data alike):

==================  ==============================  ==================================================
column              type                            meaning
==================  ==============================  ==================================================
``id``              string                          the sequence's stable id (``train-000123``)
``input_ids``       int32 tensor ``[S]``            token ids
``targets_w<w>``    float32 tensor ``[L, Hkv, S]``  ``y[l, g, t]`` for window ``w`` (METHOD §2);
                                                    ``-inf`` where ``t + w >= S`` (no deciding query)
``topk_values``     float32 tensor ``[S, K]``       the teacher's top-K next-token logits at each position
``topk_indices``    int32 tensor ``[S, K]``         their vocabulary ids
==================  ==============================  ==================================================

The Parquet schema metadata carries ``kvpop.schema_version`` and ``kvpop.key``.

**Manifest line**: ``{"shard", "file", "rows", "ids", "bytes", "sha256", "teacher_s", "write_s", "host", "time"}``.
Readers trust only the manifest: a shard file without a line (a run killed between rename and append) is recomputed
and replaced on the next run; a torn last line (killed mid-append) is ignored; if a shard appears twice the last line
wins. **Resume**: a re-run verifies each committed shard (size + sha256) and sends only the missing or damaged ones
to the teacher — a complete directory costs no teacher work and does not even start Ray.

:func:`open_targets` is the reader: it refuses (one :class:`TargetsError` line, saying what to do) a directory whose
identity does not match what the caller expects, an incomplete or empty manifest, a missing or corrupt file, or a
shard missing a column.
"""
from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from pipelines.config import ConfigError, PipelineConfig, config_from_dict, fingerprint
from pipelines.identity import atomic_write_text, fsync_dir, teacher_identity

SCHEMA_VERSION = 1
HEADER = "dataset.json"
MANIFEST = "manifest.jsonl"
SHARDS = "shards"
LOCK = ".lock"


class TargetsError(ConfigError):
    """Precomputed targets that cannot be used as asked: the message says why and what to do."""


def target_column(window: int) -> str:
    return f"targets_w{int(window)}"


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.parquet"


# ------------------------------------------------------------------------------------------------ identity
def _model_shape(cfg: PipelineConfig) -> dict:
    from transformers import AutoConfig

    path = cfg.model.resolved_path()
    if not (path / "config.json").is_file():
        raise ConfigError(f"model.path {path} has no config.json: run `make model` for SmolLM2 or point model.path "
                          f"at a saved Hugging Face folder")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    heads = config.num_attention_heads
    return {"num_layers": config.num_hidden_layers, "num_kv_heads": getattr(config, "num_key_value_heads", None)
            or heads, "vocab_size": config.vocab_size}


def target_identity(cfg: PipelineConfig, split: str = "train", tokenizer=None) -> dict:
    """Everything the targets depend on; its hash names the output directory."""
    from pipelines.data import data_fingerprint

    p = cfg.precompute
    return {
        "kind": "kvpop.targets",
        "schema_version": SCHEMA_VERSION,
        "teacher": teacher_identity(cfg),
        "data": data_fingerprint(cfg, tokenizer),
        "split": split,
        "seq_len": cfg.data.seq_len,
        "windows": sorted({int(w) for w in p.windows}),
        "top_k": p.top_k,
        "group_reduce": p.group_reduce,
        "sequences_per_shard": p.sequences_per_shard,
        **_model_shape(cfg),
    }


def targets_root(cfg: PipelineConfig) -> Path:
    root = cfg.precompute.output_root
    return Path(root).expanduser().resolve() if root else cfg.home_dir() / "targets"


def targets_dir(cfg: PipelineConfig, split: str = "train", tokenizer=None) -> Path:
    """The directory this config's targets live in (whether or not they exist yet)."""
    return targets_root(cfg) / fingerprint(target_identity(cfg, split, tokenizer))


# ------------------------------------------------------------------------------------------------ manifest
def read_manifest(path: Path) -> dict[int, dict]:
    """``{shard: record}`` from ``manifest.jsonl`` (last line per shard wins; a torn final line is ignored)."""
    manifest = Path(path) / MANIFEST
    if not manifest.is_file():
        return {}
    lines = manifest.read_text().split("\n")
    lines.pop()  # "" after the final newline, or a torn last line (killed mid-append): not committed
    records: dict[int, dict] = {}
    for number, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            records[int(record["shard"])] = record
        except (ValueError, KeyError, TypeError):
            raise TargetsError(f"{manifest} line {number + 1} is not a shard record: the manifest is corrupt; delete "
                               f"that line (its shard will be recomputed) and run precompute again") from None
    return records


def _repair_manifest(path: Path) -> None:
    """Cut a torn last line (a driver killed mid-append) so that the next append starts a fresh line."""
    manifest = Path(path) / MANIFEST
    if not manifest.is_file():
        return
    data = manifest.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(manifest, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)
            os.fsync(f.fileno())


def _append_manifest(path: Path, record: dict) -> None:
    manifest = Path(path) / MANIFEST
    with open(manifest, "a") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _sha256(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _intact(folder: Path, record: dict, *, checksum: bool = True) -> bool:
    file = folder / SHARDS / record["file"]
    try:
        if file.stat().st_size != record["bytes"]:
            return False
    except OSError:
        return False
    return not checksum or _sha256(file) == record["sha256"]


# ------------------------------------------------------------------------------------------------ compute + write
def compute_rows(model, input_ids: np.ndarray, windows, *, top_k: int, group_reduce: str = "max",
                 batch_size: int = 1) -> dict[str, np.ndarray]:
    """The teacher's outputs for ``input_ids [n, S]`` as per-row arrays (the shard columns minus ``id``)."""
    import torch

    from kvpop.targets import teacher_pass

    device = next(model.parameters()).device
    windows = sorted({int(w) for w in windows})
    parts: dict[str, list[np.ndarray]] = {"input_ids": [np.asarray(input_ids, dtype=np.int32)]}
    for start in range(0, len(input_ids), batch_size):
        ids = torch.tensor(np.asarray(input_ids[start:start + batch_size]), dtype=torch.long, device=device)
        out = teacher_pass(model, ids, windows, top_k=top_k, group_reduce=group_reduce)
        for w in windows:  # [L, B, Hkv, S] -> [B, L, Hkv, S]
            parts.setdefault(target_column(w), []).append(out["targets"][w].permute(1, 0, 2, 3).float().cpu().numpy())
        parts.setdefault("topk_values", []).append(out["topk_values"].float().cpu().numpy())
        parts.setdefault("topk_indices", []).append(out["topk_indices"].to(torch.int32).cpu().numpy())
    return {name: np.ascontiguousarray(np.concatenate(chunks)) for name, chunks in parts.items()}


def shard_table(ids, rows: dict[str, np.ndarray], key: str):
    import pyarrow as pa

    columns = {"id": pa.array([str(i) for i in ids], pa.string())}
    for name, array in rows.items():
        columns[name] = pa.FixedShapeTensorArray.from_numpy_ndarray(np.ascontiguousarray(array))
    table = pa.table(columns)
    return table.replace_schema_metadata({"kvpop.schema_version": str(SCHEMA_VERSION), "kvpop.key": key})


def write_shard(folder: Path, index: int, table) -> tuple[str, int, str]:
    """Write ``table`` as shard ``index`` atomically (temp file, fsync, rename); returns (file, bytes, sha256)."""
    import pyarrow.parquet as pq

    shards = Path(folder) / SHARDS
    shards.mkdir(parents=True, exist_ok=True)
    name = shard_name(index)
    tmp = shards / f".{name}.tmp-{uuid.uuid4().hex}"
    try:
        pq.write_table(table, tmp, row_group_size=max(1, table.num_rows))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        digest = _sha256(tmp)
        size = tmp.stat().st_size
        os.replace(tmp, shards / name)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(shards)
    return name, size, digest


class TeacherActor:
    """Ray Data callable class: one frozen teacher per actor; each batch is one shard, written by the actor."""

    def __init__(self, cfg: dict, folder: str, key: str, num_threads: int = 0):
        import torch

        from kvpop.pretrained import load_pretrained

        self.cfg = config_from_dict(cfg)
        self.folder, self.key = Path(folder), key
        if num_threads > 0:
            torch.set_num_threads(num_threads)
        device = "cuda" if self.cfg.precompute.num_gpus_per_actor > 0 and torch.cuda.is_available() else "cpu"
        dtype = getattr(torch, self.cfg.model.dtype)
        self.model, _ = load_pretrained(self.cfg.model.resolved_path(), dtype=dtype, device=device)
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.host = f"{socket.gethostname()}:{os.getpid()}"

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        p = self.cfg.precompute
        records = []
        for shard, ids, input_ids in zip(batch["shard"], batch["ids"], batch["input_ids"]):
            t0 = time.perf_counter()
            rows = compute_rows(self.model, np.asarray(input_ids), p.windows, top_k=p.top_k,
                                group_reduce=p.group_reduce, batch_size=p.batch_size)
            t1 = time.perf_counter()
            name, size, digest = write_shard(self.folder, int(shard), shard_table(list(ids), rows, self.key))
            t2 = time.perf_counter()
            records.append(json.dumps({"shard": int(shard), "file": name, "rows": len(ids), "ids": [str(i) for i in ids],
                                       "bytes": size, "sha256": digest, "teacher_s": round(t1 - t0, 4),
                                       "write_s": round(t2 - t1, 4), "host": self.host}))
        return {"shard": np.asarray(batch["shard"]), "record": np.asarray(records)}


# ------------------------------------------------------------------------------------------------ the stage
@dataclass
class PrecomputeResult:
    path: Path
    shards: int  # planned
    computed: int  # sent to the teacher by this run
    rows: int
    tokens_computed: int
    seconds: float
    teacher_seconds: float  # summed over shards computed by this run

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_computed / self.seconds if self.seconds > 0 else 0.0


class _DirectoryLock:
    def __init__(self, folder: Path):
        self.path = folder / LOCK

    def __enter__(self):
        self.file = open(self.path, "a+")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.close()
            raise RuntimeError(f"another precompute is writing {self.path.parent}: wait for it to finish (its "
                               f"shards are committed as they finish), then run again") from None
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.file, fcntl.LOCK_UN)
        self.file.close()


def _check_resources(cfg: PipelineConfig, pending: int) -> None:
    """The actor pool must fit the cluster, with a CPU to spare for Ray Data (else it waits forever)."""
    import ray

    p = cfg.precompute
    actors = max(1, min(p.num_actors, pending))
    resources = ray.cluster_resources()
    if actors * p.num_cpus_per_actor >= resources.get("CPU", 0):
        raise ConfigError(f"precompute.num_actors × precompute.num_cpus_per_actor = {actors * p.num_cpus_per_actor:g} "
                          f"CPUs leaves none of the cluster's {resources.get('CPU', 0):g} to Ray Data: lower them or "
                          f"raise ray.num_cpus")
    if actors * p.num_gpus_per_actor > resources.get("GPU", 0):
        raise ConfigError(f"precompute needs {actors * p.num_gpus_per_actor:g} GPUs ({actors} actors × "
                          f"{p.num_gpus_per_actor:g}); the cluster has {resources.get('GPU', 0):g}: lower "
                          f"precompute.num_actors or set precompute.num_gpus_per_actor=0 for CPU")


def run(cfg: PipelineConfig, *, split: str = "train",
        progress: Callable[[dict, int, int], None] | None = None) -> PrecomputeResult:
    """Precompute (or finish precomputing) this config's targets; returns where they are and what it did.

    ``progress(record, committed, total)`` is called in the driver after each manifest commit.
    """
    from tqdm.auto import tqdm

    from pipelines.cluster import check_address
    from pipelines.data import load_sequences, load_tokenizer

    t_start = time.perf_counter()
    check_address(cfg)  # a ray.address where no cluster answers fails here, before anything is written
    cfg = dataclasses.replace(cfg, home=str(cfg.home_dir()))  # workers resolve the same home as the driver
    tokenizer = load_tokenizer(cfg)
    sequences = load_sequences(cfg, split, tokenizer)  # raises before anything is written on bad/empty data
    if not sequences:
        raise ConfigError(f"the {split} split has no sequences: nothing to precompute (check data.source)")
    identity = target_identity(cfg, split, tokenizer)
    key = fingerprint(identity)
    folder = targets_root(cfg) / key
    per = cfg.precompute.sequences_per_shard
    plan = [{"shard": i, "file": shard_name(i), "ids": [s["id"] for s in sequences[start:start + per]]}
            for i, start in enumerate(range(0, len(sequences), per))]
    folder.mkdir(parents=True, exist_ok=True)
    with _DirectoryLock(folder):
        header_path = folder / HEADER
        if header_path.is_file():
            header = json.loads(header_path.read_text())
            if header.get("identity") != identity or header.get("plan") != plan:
                raise TargetsError(f"{folder} holds targets of another configuration (hash collision or an edited "
                                   f"{HEADER}): move it away and run precompute again")
        else:
            header = {"identity": identity, "key": key, "plan": plan, "model_path": str(cfg.model.resolved_path()),
                      "columns": ["id", "input_ids", *[target_column(w) for w in identity["windows"]],
                                  "topk_values", "topk_indices"],
                      "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
            atomic_write_text(header_path, json.dumps(header, indent=1))
        for stale in (folder / SHARDS).glob(".shard-*.tmp-*") if (folder / SHARDS).is_dir() else []:
            stale.unlink(missing_ok=True)  # temp files of a killed run (we hold the lock: nobody writes them now)
        _repair_manifest(folder)
        committed = read_manifest(folder)
        done = {i for i, rec in committed.items()
                if i < len(plan) and rec.get("ids") == plan[i]["ids"] and _intact(folder, rec)}
        pending = [entry for entry in plan if entry["shard"] not in done]
        total_rows = len(sequences)
        if not pending:
            return PrecomputeResult(folder, len(plan), 0, total_rows, 0, time.perf_counter() - t_start, 0.0)

        import ray

        from pipelines.cluster import ensure_ray

        ensure_ray(cfg)
        _check_resources(cfg, len(pending))
        by_id = {s["id"]: s["input_ids"] for s in sequences}
        items = [{"shard": e["shard"], "ids": e["ids"],
                  "input_ids": np.asarray([by_id[i] for i in e["ids"]], dtype=np.int32)} for e in pending]
        p = cfg.precompute
        ds = ray.data.from_items(items, override_num_blocks=len(items))
        ds = ds.map_batches(
            TeacherActor,
            fn_constructor_kwargs={"cfg": cfg.to_dict(), "folder": str(folder), "key": key,
                                   "num_threads": max(1, int(p.num_cpus_per_actor))},
            batch_size=1,
            batch_format="numpy",
            compute=ray.data.ActorPoolStrategy(size=max(1, min(p.num_actors, len(items)))),
            num_cpus=p.num_cpus_per_actor,
            **({"num_gpus": p.num_gpus_per_actor} if p.num_gpus_per_actor > 0 else {}),
        )
        teacher_s, tokens, count = 0.0, 0, len(done)
        bar = tqdm(total=len(plan), initial=len(done), desc=f"precompute {key[:8]}", unit="shard")
        try:
            for row in ds.iter_rows():
                record = json.loads(row["record"])
                record["time"] = time.strftime("%Y-%m-%dT%H:%M:%S")
                _append_manifest(folder, record)
                count += 1
                teacher_s += record["teacher_s"]
                tokens += record["rows"] * cfg.data.seq_len
                elapsed = time.perf_counter() - t_start
                bar.set_postfix(tok_s=f"{tokens / max(elapsed, 1e-9):.0f}")
                bar.update(1)
                if progress is not None:
                    progress(record, count, len(plan))
        finally:
            bar.close()
        missing = [e["shard"] for e in plan if e["shard"] not in read_manifest(folder)]
        if missing:
            raise RuntimeError(f"precompute finished without committing shards {missing}: run it again")
    return PrecomputeResult(folder, len(plan), len(pending), total_rows, tokens, time.perf_counter() - t_start,
                            teacher_s)


# ------------------------------------------------------------------------------------------------ the reader
@dataclass
class Targets:
    """A verified, complete target directory."""

    path: Path
    header: dict
    records: list[dict]  # manifest records in shard order

    @property
    def identity(self) -> dict:
        return self.header["identity"]

    @property
    def files(self) -> list[Path]:
        return [self.path / SHARDS / r["file"] for r in self.records]

    @property
    def num_rows(self) -> int:
        return sum(r["rows"] for r in self.records)

    @property
    def ids(self) -> list[str]:
        return [i for r in self.records for i in r["ids"]]

    def columns(self, window: int | None = None) -> list[str]:
        windows = self.identity["windows"] if window is None else [window]
        return ["input_ids", *[target_column(w) for w in windows], "topk_values", "topk_indices"]

    def read_table(self, columns: list[str] | None = None):
        """All rows as one pyarrow table (small data and tests; training streams through Ray Data)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        return pa.concat_tables([pq.read_table(f, columns=columns) for f in self.files])


def _expected_columns(identity: dict) -> dict[str, tuple[str, list[int]]]:
    s, k = identity["seq_len"], identity["top_k"]
    shape = [identity["num_layers"], identity["num_kv_heads"], s]
    cols = {"input_ids": ("int32", [s]), "topk_values": ("float", [s, k]), "topk_indices": ("int32", [s, k])}
    for w in identity["windows"]:
        cols[target_column(w)] = ("float", shape)
    return cols


def _check_schema(file: Path, identity: dict, needed: list[str]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

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


def open_targets(path: str | os.PathLike, *, teacher_sha256: str | None = None, seq_len: int | None = None,
                 window: int | None = None, identity: dict | None = None, verify: bool = True) -> Targets:
    """Open a target directory, refusing (with a :class:`TargetsError`) anything training must not read.

    ``identity`` demands an exact match (the config's own targets); ``teacher_sha256`` / ``seq_len`` / ``window``
    check only what a trainer needs (e.g. for a directory given explicitly). ``verify`` checks every file's sha256.
    """
    folder = Path(path).expanduser()
    header_path = folder / HEADER
    if not header_path.is_file():
        raise TargetsError(f"no precomputed targets at {folder} (no {HEADER}): run the precompute stage for this "
                           f"config first (pipelines.precompute.run)")
    try:
        header = json.loads(header_path.read_text())
        found = header["identity"]
        plan = header["plan"]
    except (ValueError, KeyError):
        raise TargetsError(f"{header_path} is not a target header: delete {folder} and run precompute again") from None
    if found.get("schema_version") != SCHEMA_VERSION:
        raise TargetsError(f"{folder} holds schema v{found.get('schema_version')} targets, this code reads "
                           f"v{SCHEMA_VERSION}: run precompute again")
    if identity is not None and found != identity:
        diff = sorted(k for k in set(found) | set(identity) if found.get(k) != identity.get(k))
        raise TargetsError(f"targets at {folder} were computed for another configuration (differs in {diff}): run "
                           f"precompute with this config")
    teacher = found["teacher"]
    if teacher_sha256 is not None and teacher["weights_sha256"] != teacher_sha256:
        raise TargetsError(f"targets at {folder} come from another teacher ({teacher['name']}, weights "
                           f"{teacher['weights_sha256'][:12]}…) than the model being trained (weights "
                           f"{teacher_sha256[:12]}…): precompute targets with this model.path")
    if seq_len is not None and found["seq_len"] != seq_len:
        raise TargetsError(f"targets at {folder} are for sequences of {found['seq_len']} tokens, the config trains on "
                           f"data.seq_len={seq_len}: precompute with this seq_len or set data.seq_len="
                           f"{found['seq_len']}")
    if window is not None and window not in found["windows"]:
        raise TargetsError(f"targets at {folder} were computed for windows {found['windows']}, not budget.window="
                           f"{window}: precompute with precompute.windows containing {window}")
    committed = read_manifest(folder)
    missing = [e["shard"] for e in plan if e["shard"] not in committed]
    if missing:
        raise TargetsError(f"targets at {folder} are incomplete ({len(plan) - len(missing)} of {len(plan)} shards "
                           f"committed): run precompute again to finish them")
    records = [committed[e["shard"]] for e in plan]
    if not records or sum(r["rows"] for r in records) == 0:
        raise TargetsError(f"targets at {folder} hold no rows (empty dataset): check data.source and run precompute")
    needed = ["input_ids", "topk_values", "topk_indices",
              *([target_column(window)] if window is not None else [target_column(w) for w in found["windows"]])]
    for entry, record in zip(plan, records):
        file = folder / SHARDS / record["file"]
        if record.get("ids") != entry["ids"]:
            raise TargetsError(f"{MANIFEST} in {folder}: shard {entry['shard']} holds other sequences than planned: "
                               f"delete its line and run precompute again")
        if not file.is_file():
            raise TargetsError(f"shard file {file} listed in the manifest is missing: run precompute again to "
                               f"recompute it")
        _check_schema(file, found, needed)
        if file.stat().st_size != record["bytes"] or (verify and _sha256(file) != record["sha256"]):
            raise TargetsError(f"shard {file} is corrupt (size or sha256 differs from the manifest): run precompute "
                               f"again to recompute it")
    return Targets(folder, header, records)
