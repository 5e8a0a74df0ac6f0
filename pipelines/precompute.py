"""Stage 1: the frozen teacher's targets and top-K logits, precomputed once into the target store (METHOD §2, §3).

``run(cfg)`` finds this config's target directory in the store (:mod:`pipelines.store`: layout, schema, commit rules)
and computes only the shards the manifest has not committed: a complete directory costs no teacher work and does
not start Ray. Otherwise it reads the training sequences (:func:`pipelines.data.load_sequences`), joins the cluster
and checks that the teacher actors fit it, then — holding the directory's lock, so a second writer is refused —
writes the header and feeds the pending shards through Ray Data to an actor pool (:class:`TeacherActor`:
``precompute.num_actors`` actors, ``precompute.num_gpus_per_actor`` GPUs each, CPU otherwise). Each actor runs
:func:`kvpop.targets.teacher_pass` (one dense forward whose attention also runs the transposed target pass) and
writes its shard; the driver commits each finished shard to the manifest. Last, the stage commits its hand-over
record (:mod:`pipelines.records`), which the train and sweep stages read to find the directory.
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from tqdm.auto import tqdm

from kvpop.pretrained import load_pretrained
from kvpop.targets import teacher_pass
from pipelines import records, store
from pipelines.cluster import check_address, ensure_ray, require_resources
from pipelines.config import ConfigError, PipelineConfig, config_from_dict
from pipelines.data import check_inputs, load_sequences, load_tokenizer


def compute_rows(model, input_ids: np.ndarray, windows, *, top_k: int, group_reduce: str = "max",
                 query_power: float = 1.0, batch_size: int = 1) -> dict[str, np.ndarray]:
    """The teacher's outputs for ``input_ids [n, S]`` as per-row arrays (the shard columns minus ``id``)."""
    device = next(model.parameters()).device
    windows = sorted({int(w) for w in windows})
    parts: dict[str, list[np.ndarray]] = {"input_ids": [np.asarray(input_ids, dtype=np.int32)]}
    for start in range(0, len(input_ids), batch_size):
        ids = torch.tensor(np.asarray(input_ids[start:start + batch_size]), dtype=torch.long, device=device)
        out = teacher_pass(model, ids, windows, top_k=top_k, group_reduce=group_reduce, query_power=query_power)
        for w in windows:  # [L, B, Hkv, S] -> [B, L, Hkv, S]
            parts.setdefault(store.target_column(w), []).append(
                out["targets"][w].permute(1, 0, 2, 3).float().cpu().numpy())
        parts.setdefault("topk_values", []).append(out["topk_values"].float().cpu().numpy())
        parts.setdefault("topk_indices", []).append(out["topk_indices"].to(torch.int32).cpu().numpy())
    return {name: np.ascontiguousarray(np.concatenate(chunks)) for name, chunks in parts.items()}


class TeacherActor:
    """Ray Data callable class: one frozen teacher per actor; each batch is one shard, written by the actor."""

    def __init__(self, cfg: dict, folder: str, key: str, num_threads: int = 0):
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
        lines = []
        for shard, ids, input_ids in zip(batch["shard"], batch["ids"], batch["input_ids"]):
            t0 = time.perf_counter()
            rows = compute_rows(self.model, np.asarray(input_ids), p.windows, top_k=p.top_k,
                                group_reduce=p.group_reduce, query_power=p.query_power, batch_size=p.batch_size)
            t1 = time.perf_counter()
            name, size, digest = store.write_shard(self.folder, int(shard), store.shard_table(list(ids), rows,
                                                                                               self.key))
            record = store.ShardRecord(int(shard), name, len(ids), tuple(str(i) for i in ids), size, digest,
                                       round(t1 - t0, 4), round(time.perf_counter() - t1, 4), self.host)
            lines.append(record.to_json())
        return {"shard": np.asarray(batch["shard"]), "record": np.asarray(lines)}


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


def _complete(folder: Path, identity: dict) -> store.Targets | None:
    """The directory if its header is this config's and every planned shard is committed and intact; None if it has
    no header yet or misses shards; a :class:`~pipelines.store.TargetsError` if its header is not this config's."""
    if not (folder / store.HEADER).is_file():
        return None
    header = store.Header.read(folder)
    if header.identity != identity:
        raise store.TargetsError(f"{folder} holds targets of another configuration (hash collision or an edited "
                                 f"{store.HEADER}): move it away and run precompute again")
    if len(store.committed_shards(folder, header.plan)) < len(header.plan):
        return None
    return store.open_targets(folder, verify=False)  # every shard's sha256 was just checked


def _teacher_shards(cfg: PipelineConfig, writer: store.Writer, pending: list[dict], plan_size: int,
                    progress: Callable | None, t_start: float) -> tuple[float, int]:
    """Run the pending shards through the actor pool, committing each as it finishes; (teacher seconds, tokens)."""
    import ray

    p = cfg.precompute
    ds = ray.data.from_items(pending, override_num_blocks=len(pending))
    ds = ds.map_batches(
        TeacherActor,
        fn_constructor_kwargs={"cfg": cfg.to_dict(), "folder": str(writer.folder), "key": writer.header.key,
                               "num_threads": max(1, int(p.num_cpus_per_actor))},
        batch_size=1,
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=max(1, min(p.num_actors, len(pending)))),
        num_cpus=p.num_cpus_per_actor,
        **({"num_gpus": p.num_gpus_per_actor} if p.num_gpus_per_actor > 0 else {}),
    )
    teacher_s, tokens, count = 0.0, 0, plan_size - len(pending)
    bar = tqdm(total=plan_size, initial=count, desc=f"precompute {writer.header.key[:8]}", unit="shard")
    try:
        for row in ds.iter_rows():
            record = dataclasses.replace(store.ShardRecord.from_dict(json.loads(row["record"])),
                                         time=time.strftime("%Y-%m-%dT%H:%M:%S"))
            writer.commit(record)
            count += 1
            teacher_s += record.teacher_s
            tokens += record.rows * cfg.data.seq_len
            bar.set_postfix(tok_s=f"{tokens / max(time.perf_counter() - t_start, 1e-9):.0f}")
            bar.update(1)
            if progress is not None:
                progress(dataclasses.asdict(record), count, plan_size)
    finally:
        bar.close()
    return teacher_s, tokens


def run(cfg: PipelineConfig, *, progress: Callable[[dict, int, int], None] | None = None) -> PrecomputeResult:
    """Precompute (or finish precomputing) this config's targets; returns where they are and what it did.

    ``progress(record, committed, total)`` is called in the driver after each manifest commit.
    """
    t_start = time.perf_counter()
    check_address(cfg)  # a ray.address where no cluster answers fails here, before anything is written
    cfg = dataclasses.replace(cfg, home=str(cfg.home_dir()))  # workers resolve the same home as the driver
    check_inputs(cfg)  # the CLIs check it too; here for callers of the Python API, before the caches are written
    tokenizer = load_tokenizer(cfg)
    identity = store.target_identity(cfg, tokenizer)
    key = store.key_of(identity)
    folder = store.targets_root(cfg) / key
    done = _complete(folder, identity)
    computed, tokens, teacher_s = 0, 0, 0.0
    if done is None:
        sequences = load_sequences(cfg, "train", tokenizer)  # raises before anything is written on bad/empty data
        if not sequences:
            raise ConfigError("the train split has no sequences: nothing to precompute (check data.source)")
        per = cfg.precompute.sequences_per_shard
        plan = tuple(store.ShardPlan(i, store.shard_name(i), tuple(s["id"] for s in sequences[start:start + per]))
                     for i, start in enumerate(range(0, len(sequences), per)))
        header = store.Header(identity, key, plan, str(cfg.model.resolved_path()),
                              ("id", "input_ids", *[store.target_column(w) for w in identity["windows"]],
                               "topk_values", "topk_indices"), time.strftime("%Y-%m-%dT%H:%M:%S"))
        ensure_ray(cfg)
        p = cfg.precompute
        actors = max(1, min(p.num_actors, len(plan)))
        require_resources(f"{actors} teacher actors × precompute.num_cpus_per_actor", actors * p.num_cpus_per_actor,
                          actors * p.num_gpus_per_actor)
        with store.writing(folder, header) as writer:
            committed = store.committed_shards(folder, writer.header.plan)
            by_id = {s["id"]: s["input_ids"] for s in sequences}
            pending = [{"shard": e.shard, "ids": list(e.ids),
                        "input_ids": np.asarray([by_id[i] for i in e.ids], dtype=np.int32)}
                       for e in writer.header.plan if e.shard not in committed]
            if pending:
                teacher_s, tokens = _teacher_shards(cfg, writer, pending, len(plan), progress, t_start)
                computed = len(pending)
            missing = sorted({e.shard for e in plan} - set(store.read_manifest(folder)))
            if missing:
                raise RuntimeError(f"precompute finished without committing shards {missing}: run it again")
        done = store.open_targets(folder, verify=False)  # every shard was verified or written just now
    records.commit(cfg, "precompute", {"targets_key": key, "path": str(folder), "rows": done.num_rows,
                                       "shards": len(done.records)})
    return PrecomputeResult(folder, len(done.records), computed, done.num_rows, tokens,
                            time.perf_counter() - t_start, teacher_s)
