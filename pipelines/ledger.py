"""The results ledger: every measured run as one JSON line in git, rendered into RESULTS.md and mirrored in MLflow.

Results are runs (an evaluation, a benchmark, a training, a study), and the runs live in MLflow; but GPU machines are
wiped after each session, so what a run measured travels back and persists as one compact line of
``results/ledger.jsonl`` (no per-item records, no figures). ``python -m jobs.results`` renders ``RESULTS.md`` from it,
imports it into an MLflow store and exports an MLflow store's new runs into it. The product benchmarks append their
line themselves (:func:`publish_file`); the evaluation stage logs to MLflow only, and ``export`` brings its runs in
(:func:`export_runs`); ``scorer`` adds a trained model as a tracked artifact with its line (:func:`scorer_folder_run`).
Nothing else writes the file.

**Layout.** ``results/ledger.jsonl`` (one :class:`Run` a line, in the order appended), ``results/artifacts/<name>``
(the few tracked files ``RESULTS.md`` cites, each with its sha256 in a run's ``artifacts``), ``RESULTS.md`` (rendered).

**Schema** (one JSON object a line, keys in this order)::

    run_id     the MLflow run id where the run was logged to MLflow, else a ledger id (32 hex digits: a legacy result's
               is the sha256 of "<source path>@<name>@<commit>", a run logged without MLflow gets a random one)
    name       "<producer>/<tag>": evaluate/smollm2_scorer_wide_kernel, capacity/h200, recency_blend/h200_w256_…,
               learning_curves/h200_qp16 (a study's final checkpoint), compare_studies/… (a paired comparison)
    kind       evaluation | benchmark | training | study (a figure a one-off study script produced is a study)
    params     {name: str | int | float | bool | null}
    metrics    {key: {"value": v, "lo": l, "hi": h, "n": n}}: lo/hi the 95 % interval where one exists, n the items
    tags       {name: str}: provenance; "commit" and "produced_by" required, and where known "config_hash",
               "data_digest", "weights_digest", "device", "dtype", "start_time" / "end_time" (when it ran, UTC,
               "2026-12-07T16:34:12Z": an imported MLflow run starts and ends then) (free-form others: "source", …)
    artifacts  [{"name", "path", "sha256", "size"}]: files the run produced that stay tracked (results/artifacts/)

Metric keys use only ``A-Z a-z 0-9 _ . - / :`` (MLflow's alphabet) and never end in ``.lo``, ``.hi`` or ``.n`` (the
suffixes an interval takes in MLflow). A key ``<corpus>/<policy>/cr<CR>/<metric>`` is a **leaderboard cell**
(policy × compression ratio × corpus); any other key ``<row>/…/<column>`` is a cell of the run's own table (serving
benchmarks). Policy names are the evaluation's (``kvpop``, ``streaming``, …); a rule with the recency term λ and a
share a of anchor slots reads ``kvpop_r<λ>_a<a>``.

**Append-only.** Lines are never edited or removed: a re-measurement is a new run. :func:`append` refuses a run id
already in the file and writes under an exclusive lock. :func:`read` refuses, in one :class:`LedgerError` line naming
the line number, a line that is not JSON, a missing or unknown key, a bad kind, name, key or value, a run id twice.
:func:`artifact` refuses a tracked artifact whose sha256 differs from the ledger's.
"""
from __future__ import annotations

import datetime
import gzip
import hashlib
import io
import json
import math
import os
import re
import subprocess
import tarfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from kvpop.files import atomic_write_text, exclusive_lock, sha256_file
from pipelines import tracking
from pipelines.tracking import git_commit
from pipelines.config import ConfigError, PipelineConfig, TrackingConfig, corpus_name, fingerprint
from pipelines.models import REPO_ROOT, kvpop_home

ROOT = REPO_ROOT
LEDGER = ROOT / "results" / "ledger.jsonl"
ARTIFACTS = ROOT / "results" / "artifacts"
RESULTS_MD = ROOT / "RESULTS.md"
README = ROOT / "README.md"
# the last commit whose tree holds the lab notebook (git tags are not kept by every clone: name the commit)
NOTEBOOK_COMMIT = "f14922b5f5e3a262710ca16a3ff3b5e39863e2db"
KINDS = ("evaluation", "benchmark", "training", "study")
PROVENANCE = ("commit", "config_hash", "data_digest", "weights_digest", "device", "dtype", "produced_by")
RUN_TIMES = ("start_time", "end_time")  # tags: when a run ran, as MLflow shows it (not rendered)
_TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"
REQUIRED_TAGS = ("commit", "produced_by")
KEYS = ("run_id", "name", "kind", "params", "metrics", "tags", "artifacts")
INTERVAL_SUFFIXES = (".lo", ".hi", ".n")
HEADLINE_BEGIN, HEADLINE_END = "<!-- BEGIN results:headline -->", "<!-- END results:headline -->"

_RUN_ID = re.compile(r"^[0-9a-f]{32}$")
_NAME = re.compile(r"^[a-z0-9_]+/[A-Za-z0-9_.\-]+$")
_KEY = re.compile(r"^[A-Za-z0-9_.\-/:]+$")
_COMMIT = tracking.COMMIT_ID
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class LedgerError(ConfigError):
    """A ledger line, a run or an artifact that cannot be used as given: the message says which and why."""


# ------------------------------------------------------------------------------------------------ the types
@dataclass(frozen=True)
class Metric:
    value: float
    lo: float | None = None
    hi: float | None = None
    n: int | None = None

    def to_dict(self) -> dict:
        return {k: v for k, v in (("value", self.value), ("lo", self.lo), ("hi", self.hi), ("n", self.n))
                if v is not None}


@dataclass(frozen=True)
class Artifact:
    name: str
    path: str  # relative to the repository root
    sha256: str
    size: int

    def to_dict(self) -> dict:
        return {"name": self.name, "path": self.path, "sha256": self.sha256, "size": self.size}


@dataclass(frozen=True)
class Run:
    run_id: str
    name: str
    kind: str
    params: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Metric] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    artifacts: tuple[Artifact, ...] = ()

    @property
    def producer(self) -> str:
        return self.name.split("/", 1)[0]

    @property
    def commit(self) -> str:
        return self.tags["commit"]

    def to_dict(self) -> dict:
        return {"run_id": self.run_id, "name": self.name, "kind": self.kind, "params": dict(self.params),
                "metrics": {k: m.to_dict() for k, m in self.metrics.items()}, "tags": dict(self.tags),
                "artifacts": [a.to_dict() for a in self.artifacts]}

    def to_line(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False, allow_nan=False, separators=(", ", ": "))


def utc_text(ms: int | float | None) -> str | None:
    """Epoch milliseconds (MLflow's run times) as a ledger time tag; None stays None."""
    if ms is None:
        return None
    return datetime.datetime.fromtimestamp(ms / 1000, datetime.timezone.utc).strftime(_TIME_FORMAT)


def epoch_ms(text: str | None) -> int | None:
    """A ledger time tag as MLflow's epoch milliseconds; None (absent, or not a time) stays None."""
    try:
        moment = datetime.datetime.strptime(text or "", _TIME_FORMAT)
    except ValueError:
        return None
    return int(moment.replace(tzinfo=datetime.timezone.utc).timestamp() * 1000)


def _number(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise LedgerError(f"{what}: {value!r} is not a finite number")
    return value


def check_metric_key(key: str, what: str = "metric") -> None:
    if not isinstance(key, str) or not _KEY.match(key) or key.endswith(INTERVAL_SUFFIXES):
        raise LedgerError(f"{what} key {key!r}: use only A-Z a-z 0-9 _ . - / : and no .lo/.hi/.n ending")


def metric(value, lo=None, hi=None, n=None, *, key: str = "metric") -> Metric:
    """A validated :class:`Metric` (``lo <= value <= hi`` is not required: a paired mean may sit outside a
    percentile interval of a ratio; ``lo <= hi`` is)."""
    value = _number(value, key)
    lo = None if lo is None else _number(lo, f"{key}.lo")
    hi = None if hi is None else _number(hi, f"{key}.hi")
    if (lo is None) != (hi is None):
        raise LedgerError(f"{key}: an interval needs both lo and hi")
    if lo is not None and lo > hi:
        raise LedgerError(f"{key}: interval [{lo}, {hi}] has lo > hi")
    if n is not None and (isinstance(n, bool) or not isinstance(n, (int, float)) or n != int(n) or n < 1):
        raise LedgerError(f"{key}: n {n!r} is not a positive integer")
    return Metric(value, lo, hi, None if n is None else int(n))


def make_run(run_id: str, name: str, kind: str, params: dict | None = None, metrics: dict | None = None,
             tags: dict | None = None, artifacts: Iterable | None = None) -> Run:
    """A validated :class:`Run`; ``metrics`` values may be :class:`Metric`, a plain number, or a dict with ``value``
    (and ``lo``, ``hi``, ``n``)."""
    if not isinstance(run_id, str) or not _RUN_ID.match(run_id):
        raise LedgerError(f"run_id {run_id!r}: 32 lower-case hex digits expected")
    if not isinstance(name, str) or not _NAME.match(name):
        raise LedgerError(f"name {name!r}: '<producer>/<tag>' expected (producer a-z 0-9 _, tag A-Z a-z 0-9 _ . -)")
    if kind not in KINDS:
        raise LedgerError(f"{name}: kind {kind!r} is not one of {', '.join(KINDS)}")
    params = dict(params or {})
    for key, value in params.items():
        check_metric_key(key, f"{name}: param")
        if value is not None and not isinstance(value, (str, int, float, bool)):
            raise LedgerError(f"{name}: param {key} = {value!r} is not a str, number, bool or null")
        if isinstance(value, float) and not math.isfinite(value):
            raise LedgerError(f"{name}: param {key} = {value!r} is not finite")
    checked = {}
    for key, value in (metrics or {}).items():
        check_metric_key(key, f"{name}: metric")
        if isinstance(value, Metric):
            value = value.to_dict()
        if not isinstance(value, dict):
            value = {"value": value}
        unknown = set(value) - {"value", "lo", "hi", "n"}
        if unknown or "value" not in value:
            raise LedgerError(f"{name}: metric {key}: keys value, lo, hi, n expected, got {sorted(value)}")
        checked[key] = metric(value["value"], value.get("lo"), value.get("hi"), value.get("n"), key=f"{name}: {key}")
    tags = dict(tags or {})
    for key, value in tags.items():
        if not isinstance(key, str) or not _KEY.match(key) or not isinstance(value, str):
            raise LedgerError(f"{name}: tag {key!r} = {value!r}: a name and a string value expected")
    for key in REQUIRED_TAGS:
        if not tags.get(key):
            raise LedgerError(f"{name}: tag {key!r} is required")
    if not _COMMIT.match(tags["commit"]):
        raise LedgerError(f"{name}: commit {tags['commit']!r} is not a git commit id")
    arts = []
    for a in artifacts or ():
        if isinstance(a, dict):
            if set(a) != {"name", "path", "sha256", "size"}:
                raise LedgerError(f"{name}: artifact keys name, path, sha256, size expected, got {sorted(a)}")
            a = Artifact(**a)
        if not _SHA256.match(str(a.sha256)) or not isinstance(a.size, int) or a.size < 0:
            raise LedgerError(f"{name}: artifact {a.name!r}: a sha256 (64 hex digits) and a size in bytes expected")
        arts.append(a)
    return Run(run_id, name, kind, params, checked, tags, tuple(arts))


def parse_line(line: str, where: str = "line") -> Run:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise LedgerError(f"{where}: not JSON ({err.msg})") from None
    if not isinstance(record, dict):
        raise LedgerError(f"{where}: a JSON object expected")
    missing, unknown = [k for k in KEYS if k not in record], [k for k in record if k not in KEYS]
    if missing or unknown:
        raise LedgerError(f"{where}: missing keys {missing}, unknown keys {unknown}")
    for key, kind in (("params", dict), ("metrics", dict), ("tags", dict), ("artifacts", list)):
        if not isinstance(record[key], kind):
            raise LedgerError(f"{where}: {key} must be a JSON {'object' if kind is dict else 'array'}")
    try:
        return make_run(**record)
    except LedgerError as err:
        raise LedgerError(f"{where}: {err}") from None


# ------------------------------------------------------------------------------------------------ the file
def read(path: str | os.PathLike = LEDGER) -> list[Run]:
    """Every run of the ledger, in file order (a missing file is an empty ledger)."""
    path = Path(path)
    if not path.exists():
        return []
    runs, seen = [], {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        run = parse_line(line, f"{path}:{number}")
        if run.run_id in seen:
            raise LedgerError(f"{path}:{number}: run_id {run.run_id} already on line {seen[run.run_id]}")
        seen[run.run_id] = number
        runs.append(run)
    return runs


def append(runs: Iterable[Run], path: str | os.PathLike = LEDGER) -> list[Run]:
    """Append ``runs`` (validated again) to the ledger; refuses the whole batch if one id is already there or twice.
    Returns what was appended."""
    path = Path(path)
    runs = [parse_line(r.to_line(), r.name) for r in runs]
    path.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(path.with_name(path.name + ".lock"), wait=True):
        have = {r.run_id for r in read(path)}
        ids = [r.run_id for r in runs]
        clash = sorted((have & set(ids)) | {i for i in ids if ids.count(i) > 1})
        if clash:
            raise LedgerError(f"{path}: run_id {clash[0]} is already in the ledger (it is append-only: a new "
                              f"measurement is a new run)")
        text = "".join(r.to_line() + "\n" for r in runs)
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
    return runs


def ledger_id(*parts: str) -> str:
    """A deterministic ledger id for a result that has no MLflow run id."""
    return hashlib.sha256("@".join(parts).encode()).hexdigest()[:32]


# ------------------------------------------------------------------------------------------------ provenance
def provenance(*, config: Any = None, data_digest: str | None = None, weights_digest: str | None = None,
               device: str | None = None, dtype: str | None = None, produced_by: str) -> dict[str, str]:
    """The provenance tags of a run made now: the checkout's commit, a hash of the run's configuration (any JSON-able
    value: a config dataclass, a script's arguments), and what is known of data, weights, device and dtype."""
    tags = {"commit": git_commit(), "produced_by": produced_by}
    if config is not None:
        tags["config_hash"] = fingerprint(config)
    for key, value in (("data_digest", data_digest), ("weights_digest", weights_digest), ("device", device),
                       ("dtype", dtype)):
        if value:
            tags[key] = str(value)
    return tags


# ------------------------------------------------------------------------------------------------ converters
# One converter per result format: the benchmarks call them on the result they just measured, and
# :func:`ingest_legacy` on the results committed before the ledger existed.
def _cr_key(cr: float) -> str:
    return f"cr{round(float(cr), 6):g}"


def cell(corpus: str, policy: str, cr: float, name: str) -> str:
    """A leaderboard metric key."""
    return f"{corpus}/{policy}/{_cr_key(cr)}/{name}"


def parse_cell(key: str) -> tuple[str, str, float, str] | None:
    parts = key.split("/")
    if len(parts) != 4 or not parts[2].startswith("cr"):
        return None
    try:
        return parts[0], parts[1], float(parts[2][2:]), parts[3]
    except ValueError:
        return None


def _interval(d: dict, n=None) -> dict:
    """``{"mean"|"estimate", "low"|"lo", "high"|"hi", "n"}`` → a metric dict."""
    value = d.get("estimate", d.get("mean"))
    return {"value": value, "lo": d.get("lo", d.get("low")), "hi": d.get("hi", d.get("high")), "n": d.get("n", n)}


def eval_summary_metrics(summary: dict, corpus: str) -> dict[str, dict]:
    """The evaluation stage's ``summary`` (``metrics.json``; :mod:`pipelines.report`) as leaderboard cells: every
    metric of every policy × CR with its interval, the share of the KL gap closed and recall's share of dense. Recall
    cells (synthetic prompts, not the corpus) go to corpus ``recall``, the long generations' to ``generation``; the
    summary's other corpora (``corpora``, ``eval.heldout_sources``) to their own."""
    out = {}
    for m in summary.get("metrics", []):
        where = {"recall": "recall", "generation": "generation"}.get(m.get("part"), corpus)
        out[cell(where, m["policy"], m["CR"], m["metric"])] = _interval(m)
    for g in summary.get("gap_closed", []):
        out[cell(corpus, g["policy"], g["CR"], f"{g['metric']}.gap_closed")] = _interval(g)
    for r in summary.get("recall_share") or []:
        out[cell("recall", r["policy"], r["CR"], "recall_exact.share_of_dense")] = _interval(r)
    for name, other in (summary.get("corpora") or {}).items():  # eval.heldout_sources: text metrics, their corpus
        out.update(eval_summary_metrics(other, name))
    return {k: v for k, v in out.items() if v["value"] is not None and math.isfinite(v["value"])}


def _rule_name(rule: str) -> str:
    """A recency_blend rule (``kvpop+0.0025@a0.0625``) as a policy name (``kvpop_r0.0025_a0.0625``)."""
    name = rule.replace("+", "_r").replace("@a", "_a").replace("@", "_")
    return re.sub(r"[^A-Za-z0-9_.\-]", "_", name)


def _budget_total(budget: str) -> int:
    found = re.match(r"^s(\d+)-w(\d+)-k(\d+)$", budget)
    if not found:
        raise LedgerError(f"budget {budget!r}: 's<sink>-w<window>-k<topk>' expected")
    return sum(int(x) for x in found.groups())


def recency_blend_metrics(result: dict) -> tuple[dict, dict]:
    """``benchmarks/recency_blend.py``'s result: per corpus each rule's mean KL and top-1 (n items), the share of
    the streaming → oracle KL gap it closes (with its interval) and, on the recall cells, exact match and its
    share of dense's (with intervals). Returns (params, metrics)."""
    args = result["args"]
    seq_len = int(args.get("seq_len") or 4096)
    total = _budget_total(result["budget"])
    cr = 1 - total / seq_len
    metrics = {}
    for source, summary in (result.get("summary") or {}).items():
        corpus = corpus_name(source)
        n = len(summary.get("items") or []) or None
        if n is not None and n <= 1:  # a recall-only run's one placeholder text item
            continue
        for name, column in (("kl", "kl"), ("top1", "top1_agreement")):
            for rule, value in (summary.get(name) or {}).items():
                metrics[cell(corpus, _rule_name(rule), cr, column)] = {"value": value, "n": n}
        for key, value in (result.get("versus_references") or {}).get(source, {}).items():
            if key.startswith("gap:") and isinstance(value, dict) and "mean" in value and "λ" not in key:
                metrics[cell(corpus, _rule_name(key[4:]), cr, "kl.gap_closed")] = _interval(value, n)
    recall = result.get("recall") or {}
    n = len(recall.get("items") or []) or None
    for rule, value in (recall.get("exact") or {}).items():
        metrics[cell("recall", _rule_name(rule), cr, "recall_exact")] = {"value": value, "n": n}
    for key, value in recall.items():
        if key.startswith("share:"):
            metrics[cell("recall", _rule_name(key[6:]), cr, "recall_exact.share_of_dense")] = _interval(value)
    params = {"budget": result["budget"], "seq_len": seq_len, "sequences": args.get("sequences"),
              "recency": json.dumps(args.get("recency")), "anchors": json.dumps(args.get("anchors")),
              "sources": json.dumps([corpus_name(s) for s in args.get("sources", [])]),
              "recall_tasks": json.dumps(args.get("recall_tasks")), "model": args.get("model")}
    return params, metrics


def _slug(value) -> str:
    return re.sub(r"_+", "_", re.sub(r"[^A-Za-z0-9_.\-]", "_", str(value))).strip("_")


def _table_metrics(rows: Iterable[dict], row_keys: Iterable[str], columns: Iterable[str], prefix: str = "") -> dict:
    """Rows of a benchmark's table as ``[<prefix>/]<row key values…>/<column>`` metrics (numbers only)."""
    out = {}
    row_keys, columns = list(row_keys), list(columns)
    for row in rows:
        path = "/".join(_slug(row[k]) if k != "context" else f"ctx{row[k]}" for k in row_keys if row.get(k) is not None)
        for column in columns:
            value = row.get(column)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                out[f"{prefix}{path}/{column}"] = {"value": value}
    return out


def capacity_metrics(result: dict) -> tuple[dict, dict]:
    """``benchmarks/capacity.py``: per model × context × policy the largest batch that fits, its decode tokens/s,
    × the byte floor, the prefill and its peak (the summary rows; the batch sweep's other rows are not kept; a
    largest batch timed again with the compiled layer step under ``…/compiled``); and the prefill table, per model ×
    context × policy × rows × chunk: seconds, tokens/s, × dense, peak (``prefill/…``)."""
    rows = [r for r in result["rows"] if "largest_batch" in r]  # the batch sweep's summary rows
    metrics = _table_metrics(rows, ("model", "context", "policy"),
                             ("largest_batch", "tokens_per_s", "x_floor", "prefill_s", "prefill_tokens_per_s",
                              "prefill_peak_gib"))
    compiled = [{**r, "step": "compiled"} for r in result["rows"] if r.get("largest_compiled")]
    metrics.update(_table_metrics(compiled, ("model", "context", "policy", "step"),
                                  ("batch", "tokens_per_s", "x_floor")))
    prefill = [{**r, "rows": f"rows{r['rows']}", "chunk": None if r.get("chunk") is None else f"chunk{r['chunk']}"}
               for r in result.get("prefill", []) if "prefill_s" in r]
    metrics.update(_table_metrics(prefill, ("model", "context", "policy", "rows", "chunk"),
                                  ("prefill_s", "tokens_per_s", "x_dense", "peak_gib"), prefix="prefill/"))
    params = {"preset": result.get("preset"), "sink": result.get("sink"), "window": result.get("window"),
              "steps": result.get("steps"), "copy_bandwidth_gbs": result.get("copy_bandwidth_gbs"),
              "compiled_prefill": result.get("compiled_prefill"),
              "compiled_kvpop_step": result.get("compiled_kvpop_step")}
    return params, metrics


def decode_metrics(result: dict) -> tuple[dict, dict]:
    """``benchmarks/decode.py``: per policy × context × batch the per-token latency (eager, CUDA graph), the decode
    peak memory and the cache size."""
    metrics = _table_metrics(result["rows"], ("policy", "context", "batch"),
                             ("graph_ms", "eager_ms", "decode_peak_gib", "cache_gib", "prefill_s", "x_floor"))
    params = {"preset": result.get("preset"), "budget": json.dumps(result.get("budget")),
              "compiled_decode_step": result.get("compiled_decode_step"), "isolated": result.get("isolated")}
    return params, metrics


def kernels_metrics(result: dict) -> tuple[dict, dict]:
    """``benchmarks/kernels.py``: the target pass against a causal forward per S, the training kernel against
    causal, and the correctness check's largest error."""
    targets = result.get("targets") if isinstance(result.get("targets"), list) else []  # a dict: its error
    metrics = _table_metrics(targets, ("S",), ("forward_ms", "targets_ms", "ratio",
                                                                    "targets_peak_gib"), prefix="targets/S")
    train = result.get("train") or {}
    if "S" in train:
        metrics.update(_table_metrics([train], ("S",), ("causal_fwd_bwd_ms", "kvpop_fwd_bwd_ms", "ratio",
                                                         "kvpop_peak_gib"), prefix="train/S"))
    checks = result.get("correctness") if isinstance(result.get("correctness"), list) else []
    errors = [c.get("max_abs_err") for c in checks if c.get("max_abs_err") is not None]
    if errors:
        metrics["correctness/all/max_abs_err"] = {"value": max(errors)}
    return {"preset": result.get("preset")}, metrics


def precompute_metrics(result: dict) -> tuple[dict, dict]:
    """``benchmarks/precompute_gpu.py``: per measured step (dense forward, teacher pass, one layer, a shard, the
    stage) its time, tokens/s, peak memory and ratio to its reference."""
    metrics = _table_metrics(result.get("rows") or [], ("measure",),
                             ("ms", "tokens_per_s", "peak_gib", "relative_to_dense", "relative_to_attention"))
    params = {k: result.get(k) for k in ("model", "seq_len", "batch_size", "top_k", "corpus")}
    params["windows"] = json.dumps(result.get("windows"))
    return params, metrics


def cost_model_metrics(result: dict) -> tuple[dict, dict]:
    """``benchmarks/cost_model.py``: per stage its tokens/s per GPU, peak memory and wall seconds
    (``stage/<stage>/…``; a failed stage has none), per serving context the prefill and decode figures
    (``serving/ctx<context>/…``), per stage and per pipeline its wall hours and GPU-hours at each GPU count
    (``hours/<stage>/gpus<N>/…``, ``pipeline/<precompute_scorer_only>/gpus<N>/…``). The shape is a param."""
    metrics = _table_metrics(result.get("stages") or [], ("stage",), ("tokens_per_s_per_gpu", "peak_gib", "wall_s"),
                             prefix="stage/")
    metrics.update(_table_metrics(result.get("serving") or [], ("context",),
                                  ("prefill_s", "prefill_tokens_per_s", "decode_ms_per_token", "decode_tokens_per_s",
                                   "peak_gib"), prefix="serving/"))
    for prefix, name, rows in (("hours/", "stage", result.get("hours") or []),
                               ("pipeline/", "pipeline", result.get("pipelines") or [])):
        metrics.update(_table_metrics([{**r, "gpu_count": f"gpus{r['gpus']}"} for r in rows], (name, "gpu_count"),
                                      ("hours", "gpu_hours"), prefix=prefix))
    params = {"shape": result.get("shape_name"), **{k: result.get(k) for k in (
        "seq_len", "budget", "scorer", "gpus", "steps", "tokens", "efficiency", "torch")}}
    return params, metrics


def quality_metrics(result: dict) -> tuple[dict, dict]:
    """``benchmarks/quality.py``: its table (policy × CR: top-1, KL, recall tasks) as leaderboard cells."""
    corpus = corpus_name(str(result.get("corpus") or "champ"))
    metrics = {}
    for row in result.get("table") or []:
        policy = _slug(row["policy"])
        for column, name in (("top1", "top1_agreement"), ("kl", "kl")):
            if isinstance(row.get(column), (int, float)):
                metrics[cell(corpus, policy.strip("_"), row["CR"], name)] = {"value": row[column]}
    params = {"config": result.get("config"), "seq_len": result.get("seq_len"),
              "overrides": json.dumps(result.get("overrides") or [])}
    return params, metrics


def _final_point(points: list[dict]) -> dict:
    """A learning-curves study's last checkpoint (the most training tokens; the later one on a tie)."""
    if not points:
        raise LedgerError("learning curves: the study has no checkpoint")
    return max(enumerate(points), key=lambda ip: (ip[1].get("tokens") or 0, ip[0]))[1]


def _study_summary_metrics(summary: dict, corpus: str) -> dict:
    """A learning-curves summary (the evaluation's shape plus paired ``differences``) as leaderboard cells: the
    evaluation's metrics and gap closed (:func:`eval_summary_metrics`), and each paired difference as
    ``<metric>.minus_<baseline>`` (``minus_best_heuristic``: the best of streaming / TOVA / H2O per metric)."""
    out = eval_summary_metrics(summary, corpus)
    for d in summary.get("differences") or []:
        where = {"recall": "recall", "generation": "generation"}.get(d.get("part"), corpus)
        m = _interval(d)
        if m["value"] is not None and math.isfinite(m["value"]):
            out[cell(where, d["policy"], d["CR"], f"{d['metric']}.minus_{_slug(d['vs'])}")] = m
    return out


def learning_curves_metrics(result: dict) -> tuple[dict, dict]:
    """``benchmarks/learning_curves.py`` (now ``research/``): one scorer trained and evaluated at growing token
    counts. Kept: the final checkpoint only — its summary on every corpus (KVpop's metrics, gap closed and paired
    differences, with intervals), the reference policies' summaries (streaming, TOVA, H2O, oracle, dense: measured
    once), the held-out keep/evict diagnostics at each budget, and the training the checkpoint had (tokens, steps,
    epochs, seconds). Per-item records and earlier checkpoints are not kept."""
    meta = result.get("meta") or {}
    args = meta.get("args") or ((meta.get("sessions") or [{}])[-1].get("args") or {})
    corpus = corpus_name(str(args.get("source") or "champ"))
    point = _final_point(result.get("points") or [])
    metrics = _study_summary_metrics(point.get("summary") or {}, corpus)
    for source, part in (point.get("corpora") or {}).items():
        metrics.update(_study_summary_metrics(part.get("summary") or {}, corpus_name(source)))
    references = result.get("references") or {}
    metrics.update({k: v for k, v in _study_summary_metrics(references.get("summary") or {}, corpus).items()
                    if ".minus_" not in k})  # the references' differences among themselves: not the study's
    for source, part in (references.get("corpora") or {}).items():
        metrics.update({k: v for k, v in _study_summary_metrics(part.get("summary") or {}, corpus_name(source))
                        .items() if ".minus_" not in k})
    diagnostics = point.get("diagnostics") or {}
    for policy, value in (diagnostics.get("spearman") or {}).items():
        if isinstance(value, (int, float)) and math.isfinite(value):
            metrics[f"diagnostics/spearman/{_slug(policy)}"] = {"value": value}
    for budget, policies in (diagnostics.get("budgets") or {}).items():
        for policy, stats in policies.items():
            for stat, value in stats.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                    metrics[f"diagnostics/{_slug(budget)}/{_slug(policy)}/{stat}"] = {"value": value}
    for key in ("tokens", "step", "epochs", "train_s"):
        if isinstance(point.get(key), (int, float)):
            metrics[f"training/{key}"] = {"value": point[key]}
    params = {"budget": meta.get("train_budget") or (f"s{args.get('sink')}-w{args.get('window')}-k{args.get('topk')}"
                                                     if args.get("window") is not None else None),
              "source": corpus, "seq_len": args.get("seq_len"), "scorer": args.get("scorer"),
              "features": args.get("features"), "query_power": args.get("query_power"),
              "recency": args.get("recency"), "lr": args.get("lr"), "batch": args.get("batch"),
              "train_sequences": args.get("train_sequences"), "eval_sequences": args.get("eval_sequences"),
              "eval_sources": json.dumps([corpus_name(s) for s in args.get("eval_sources") or []]),
              "recall_tasks": json.dumps(args.get("recall_tasks")), "model": args.get("model")}
    return params, metrics


_COMPARE_METRICS = {"KL": "kl", "kl": "kl", "top-1": "top1_agreement", "top1": "top1_agreement",
                    "recall exact": "recall_exact", "exact": "recall_exact", "gold logp": "recall_gold_logprob",
                    "logprob": "recall_gold_logprob"}


def _compare_rows_metrics(rows: Iterable[dict], default_B=None) -> dict:
    """A comparison's rows (the baseline's mean, the candidate's, their paired difference with its interval) as
    ``<corpus>[/<rule>]/B<B>/<metric>/{baseline,candidate,difference}`` metrics (a cell of the run's own table)."""
    out = {}
    for row in rows:
        corpus = corpus_name(str(row["corpus"])) if not str(row["corpus"]).startswith("recall ") else \
            "recall_" + _slug(str(row["corpus"])[len("recall "):])
        name = _COMPARE_METRICS.get(row.get("metric"), _COMPARE_METRICS.get(row.get("label"), _slug(row["metric"])))
        path = "/".join(p for p in (corpus, _rule_name(row["rule"]) if row.get("rule") else None,
                                    f"B{row.get('B', default_B)}", name) if p)
        n = row.get("n")
        for side in ("baseline", "candidate"):
            if isinstance(row.get(side), (int, float)):
                out[f"{path}/{side}"] = {"value": row[side], "n": n}
        out[f"{path}/difference"] = _interval(row["difference"], n)
    return {k: v for k, v in out.items() if v["value"] is not None and math.isfinite(v["value"])}


def compare_studies_metrics(result: dict) -> tuple[dict, dict]:
    """``benchmarks/compare_studies.py`` (now ``research/``): two learning-curves studies' scorers on the same
    held-out items, the candidate minus the baseline, paired per item — per corpus, budget and metric the two means
    and the difference with its interval; the token count of each side's checkpoint."""
    metrics = _compare_rows_metrics(result["rows"])
    for side in ("baseline", "candidate"):
        if isinstance((result.get(side) or {}).get("tokens"), (int, float)):
            metrics[f"{side}/tokens"] = {"value": result[side]["tokens"]}
    params = {f"{side}{suffix}": (result.get(side) or {}).get(key) for side in ("baseline", "candidate")
              for suffix, key in (("", "path"), ("_label", "label"))}
    return params, metrics


def compare_blends_metrics(result: dict) -> tuple[dict, dict]:
    """``benchmarks/compare_blends.py`` (now ``research/``): two scorers' recency-blend records on the same
    sequences, per corpus and rule (and recall task) the two means and the paired difference with its interval."""
    metrics = _compare_rows_metrics(list(result["rows"]) + list(result.get("recall") or []), result.get("B"))
    params = {"baseline": result.get("baseline"), "candidate": result.get("candidate"), "B": result.get("B"),
              "aliases": json.dumps(result.get("aliases") or {})}
    return params, metrics

# ------------------------------------------------------------------------------------------------ legacy results
def _file_commit(path: str, at: str, root: Path = ROOT) -> str:
    out = subprocess.run(["git", "-C", str(root), "log", "--diff-filter=A", "--format=%H", at, "--", path],
                         capture_output=True, text=True)
    found = out.stdout.split()
    if out.returncode or not found:
        raise LedgerError(f"{path}: not added in the history of {at}")
    return found[-1]


def git_show(path: str, at: str, root: Path = ROOT) -> bytes:
    out = subprocess.run(["git", "-C", str(root), "show", f"{at}:{path}"], capture_output=True)
    if out.returncode:
        reason = (out.stderr.decode().strip().splitlines() or ["git show failed"])[-1]
        raise LedgerError(f"{at}:{path}: not in git ({reason})")
    return out.stdout


def _device_tags(result: dict) -> dict:
    return {k: str(result[s]) for k, s in (("device", "device"), ("dtype", "dtype")) if result.get(s)}


def legacy_runs(path: str, result: dict, commit: str, *, extra: dict | None = None) -> list[Run]:
    """The ledger runs of one legacy result file (``benchmarks/results/<stem>.json`` or a pipeline folder's
    ``metrics.json``) added at ``commit``. Each run's commit is the one recorded in the result, else ``commit`` (the
    commit that added the file); its run id the MLflow run id the result records, else :func:`ledger_id` of the
    path, the run's name and the commit. ``extra`` holds what a pipeline folder's other files say (``run_id``,
    ``config``)."""
    stem = Path(path).parent.name if Path(path).name == "metrics.json" else Path(path).stem
    commit = str(result.get("commit") or commit)
    base_tags = {"commit": commit, "source": path, **_device_tags(result)}

    def one(name, kind, produced_by, params, metrics, run_id=None, tags=None):
        return make_run(run_id or ledger_id(path, name, commit), name, kind, params, metrics,
                        {**base_tags, "produced_by": produced_by, **(tags or {})})

    producer, _, tag = stem.partition("_")
    if stem.startswith("pipeline_"):
        extra = extra or {}
        config = extra.get("config") or {}
        tags = {"dtype": str((config.get("model") or {}).get("dtype") or "")}
        if (config.get("model") or {}).get("files_sha256"):
            tags["weights_digest"] = config["model"]["files_sha256"]
        if (config.get("heldout") or {}).get("sha256"):
            tags["data_digest"] = config["heldout"]["sha256"]
        if config:
            tags["config_hash"] = fingerprint(config)
        tags = {k: v for k, v in tags.items() if v}
        corpus = "champ"
        device, _, preset = stem[len("pipeline_"):].partition("_")  # pipeline_<device>_<preset>
        tags["device"] = {"h200": "NVIDIA H200", "h100": "NVIDIA H100"}.get(device, device)
        name = f"evaluate/{preset}"
        params = {"seq_len": (config.get("heldout") or {}).get("seq_len"),
                  "eval_sequences": (config.get("heldout") or {}).get("count"),
                  "budgets": json.dumps(config.get("budgets"))}
        metrics = eval_summary_metrics(result["summary"], corpus)
        return [one(name, "evaluation", "pipelines/evaluate.py", params, metrics, extra.get("run_id"), tags)]
    if producer == "recency" and tag.startswith("blend_"):
        params, metrics = recency_blend_metrics(result)
        return [one(f"recency_blend/{tag[len('blend_'):]}", "study", "benchmarks/recency_blend.py", params, metrics)]
    if producer == "learning" and tag.startswith("curves_"):
        params, metrics = learning_curves_metrics(result)
        sessions = (result.get("meta") or {}).get("sessions") or [{}]
        device = {"device": str(sessions[-1]["device"])} if sessions[-1].get("device") else {}
        return [one(f"learning_curves/{tag[len('curves_'):]}", "study", "benchmarks/learning_curves.py", params,
                    metrics, tags=device)]
    if producer == "compare":  # two scripts wrote compare_<tag>.json; their formats tell them apart
        script = "compare_studies" if isinstance(result.get("baseline"), dict) else "compare_blends"
        params, metrics = (compare_studies_metrics if script == "compare_studies" else compare_blends_metrics)(result)
        return [one(f"{script}/{tag}", "study", f"benchmarks/{script}.py", params, metrics)]
    if producer == "baselines":
        runs = []
        entries = result.get("results")
        if entries is None:  # an evaluation a session cut short, summarized from its finished parts
            crs = sorted({m["CR"] for m in result["summary"]["metrics"]})
            entries = [{"CR": crs[0], "B": round((1 - crs[0]) * result["seq_len"]), "summary": result["summary"]}]
            tag = re.sub(r"_cr[0-9.]+_parts$", "", tag) + "_parts"
        for entry in entries:
            corpus = corpus_name(str(entry.get("corpus") or "champ"))
            partial = tag.endswith("_parts")
            base = tag.removesuffix("_parts")
            name = (f"baselines/{re.sub(r'_cr[0-9.]+$', '', base)}_cr{entry['CR']:g}"
                    + ("" if corpus == "champ" else f"_{corpus}") + ("_parts" if partial else ""))
            params = {"config": result.get("config"), "seq_len": result.get("seq_len"), "steps": result.get("steps"),
                      "CR": entry["CR"], "B": entry["B"], "corpus": corpus}
            metrics = eval_summary_metrics(entry["summary"], corpus)
            for method, info in (result.get("training") or {}).items():
                for key in ("tokens", "gpu_seconds"):
                    if isinstance(info.get(key), (int, float)):
                        metrics[f"training/{_slug(method)}/{key}"] = {"value": info[key]}
            runs.append(one(name, "study", "benchmarks/baselines_h200.py", params, metrics, entry.get("mlflow_run")))
        return runs
    if producer == "eval":
        corpus = "champ"
        params = {"config": result.get("config"), "seq_len": result.get("seq_len"),
                  "overrides": json.dumps(result.get("overrides") or [])}
        return [one(f"evaluate/{tag or 'h200'}", "evaluation", "benchmarks/eval_h200.py", params,
                    eval_summary_metrics(result["summary"], corpus), result.get("mlflow_run"))]
    converters = {"capacity": capacity_metrics, "decode": decode_metrics, "kernels": kernels_metrics,
                  "precompute": precompute_metrics, "quality": quality_metrics, "cost_model": cost_model_metrics}
    if producer in converters:
        params, metrics = converters[producer](result)
        script = "precompute_gpu" if producer == "precompute" else producer
        return [one(f"{producer}/{tag}", "benchmark", f"benchmarks/{script}.py", params, metrics)]
    raise LedgerError(f"{path}: no converter for results of '{producer}'")


def pack_folder(folder: Path, arcname: str) -> bytes:
    """``folder``'s files as a gzipped tarball under ``arcname``, byte for byte the same for the same files (sorted
    names, no times, owners or modes)."""
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as stream, tarfile.open(fileobj=stream, mode="w") as tar:
        for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
            info = tarfile.TarInfo(f"{arcname}/{path.relative_to(folder).as_posix()}")
            info.size, info.mode = path.stat().st_size, 0o644
            with path.open("rb") as f:
                tar.addfile(info, f)
    return buffer.getvalue()


def scorer_folder_run(folder: Path, name: str, commit: str, root: Path = ROOT) -> Run:
    """A train stage's ``final_model`` folder packed into ``results/artifacts/<name>_scorer.tgz`` (:func:`pack_folder`)
    and recorded as the training run ``train/<name>`` that produced it, at ``commit`` (:func:`scorer_tarball_run`).
    Refuses a folder without the stage's ``kvpop.json`` and ``kvpop_train.json``."""
    folder = Path(folder)
    missing = [f for f in ("kvpop.json", "kvpop_train.json") if not (folder / f).is_file()]
    if missing:
        raise LedgerError(f"{folder}: not a train stage's final_model (no {', '.join(missing)})")
    return scorer_tarball_run(f"results/artifacts/{name}_scorer.tgz", pack_folder(folder, "final_model"), commit,
                              root, source="/".join(folder.resolve().parts[-3:]))  # runs/<run>/final_model


def scorer_tarball_run(path: str, data: bytes, commit: str, root: Path = ROOT, source: str | None = None) -> Run:
    """A scorer tarball (the train stage's ``final_model``; a legacy one: ``checkpoints/pipeline_<device>_<preset>_
    scorer.tgz``) copied to ``results/artifacts/`` and recorded as the training run that produced it (its
    ``kvpop_train.json``: steps, mode, run name; ``kvpop.json``: budget, scorer, the base weights' sha256);
    ``source`` (default ``path``): where it came from."""
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        def member(name):
            found = [m for m in archive.getmembers() if m.name.endswith(name)]
            return json.loads(archive.extractfile(found[0]).read()) if found else {}
        train, model = member("kvpop_train.json"), member("kvpop.json")
    target = root / "results" / "artifacts" / Path(path).name
    target.parent.mkdir(parents=True, exist_ok=True)
    if not target.exists() or sha256_file(target) != hashlib.sha256(data).hexdigest():
        target.write_bytes(data)
    stem = Path(path).name.removesuffix("_scorer.tgz")
    preset = stem.split("_", 2)[2] if stem.startswith("pipeline_") else stem
    budget = model.get("budget") or {}
    params = {"steps": train.get("steps"), "mode": train.get("mode"), "policy": train.get("policy"),
              "run_name": train.get("run_name"), "scorer": (model.get("scorer") or {}).get("name"),
              "scorer_features": (model.get("scorer") or {}).get("features"),
              "budget": f"s{budget.get('sink')}-w{budget.get('window')}-k{budget.get('topk')}" if budget else None}
    tags = {"commit": commit, "produced_by": "pipelines/train.py", "source": source or path}
    if (model.get("base") or {}).get("weights_sha256"):
        tags["weights_digest"] = model["base"]["weights_sha256"]
    name = f"train/{preset}"
    return make_run(ledger_id(path, name, commit), name, "training", params, {}, tags,
                    [artifact_entry(target.name, target, root)])


def ingest_legacy(paths: Iterable[str], at: str, root: Path = ROOT) -> list[Run]:
    """The runs of legacy result files read from git at commit ``at`` (never the working tree: the folder left
    HEAD). A ``…/metrics.json`` of a pipeline folder also reads its ``complete.json`` (MLflow run id) and
    ``config.json`` (provenance); a ``….tgz`` scorer becomes a tracked artifact (:func:`scorer_tarball_run`)."""
    runs = []
    for path in paths:
        if path.endswith(".tgz"):
            runs.append(scorer_tarball_run(path, git_show(path, at, root), _file_commit(path, at, root), root))
            continue
        result = json.loads(git_show(path, at, root))
        extra = None
        if Path(path).name == "metrics.json":
            folder = Path(path).parent
            extra = {"run_id": json.loads(git_show(str(folder / "complete.json"), at, root)).get("run_id"),
                     "config": json.loads(git_show(str(folder / "config.json"), at, root))}
        runs += legacy_runs(path, result, _file_commit(path, at, root), extra=extra)
    return runs


# ------------------------------------------------------------------------------------------------ rendering
def _natural(text: str):
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", text)]


def fmt(value: float) -> str:
    """4 significant digits; from 1,000 up, whole numbers with thousands separators."""
    if isinstance(value, int) or abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.4g}"


def fmt_metric(m: Metric) -> str:
    text = fmt(m.value)
    if m.lo is not None:
        text += f" [{fmt(m.lo)}, {fmt(m.hi)}]"
    return text


def _short(run_id: str) -> str:
    return run_id[:12]


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


LEADERBOARD_COLUMNS = (("kl.gap_closed", "KL gap closed"), ("kl", "KL"), ("top1_agreement", "top-1"),
                       ("recall_exact", "recall exact"), ("recall_exact.share_of_dense", "recall × dense"))


def _leaderboard(runs: list[Run], order: bool = True) -> list[str]:
    """policy × CR × corpus rows (a run's cells grouped), one column per headline metric; sorted by run name,
    corpus, CR, policy (``order=False``: the runs' order kept)."""
    rows = []
    for run in runs:
        cells: dict[tuple, dict[str, Metric]] = {}
        for key, m in run.metrics.items():
            parsed = parse_cell(key)
            if parsed and parsed[3] in dict(LEADERBOARD_COLUMNS):
                corpus, policy, cr, name = parsed
                cells.setdefault((corpus, policy, cr), {})[name] = m
        for (corpus, policy, cr), values in cells.items():
            rows.append(((_natural(run.name) if order else (), _natural(corpus), cr, _natural(policy)),
                         [policy, f"{cr:.4g}", corpus] + [fmt_metric(values[c]) if c in values else "—"
                                                          for c, _ in LEADERBOARD_COLUMNS]
                         + [f"`{run.name}`", run.kind, f"`{_short(run.run_id)}`", f"`{run.commit[:10]}`"]))
    if order:
        rows.sort(key=lambda r: r[0])
    else:  # the runs' order, each run's rows sorted
        rank = {run.name: i for i, run in enumerate(runs)}
        rows.sort(key=lambda r: (rank[r[1][-4].strip("`")],) + r[0][1:])
    header = ["policy", "CR", "corpus"] + [label for _, label in LEADERBOARD_COLUMNS] + ["run", "kind", "run id",
                                                                                           "commit"]
    return _table(header, [r[1] for r in rows]) if rows else ["(none)"]


def _run_table(run: Run) -> list[str]:
    """A benchmark's own table: ``<row…>/<column>`` keys → rows × columns, each row with the run id and commit."""
    rows: dict[str, dict[str, Metric]] = {}
    columns: list[str] = []
    for key, m in run.metrics.items():
        # an evaluation's ``….resolved`` flags restate its paired intervals (MLflow and report.txt keep them)
        if parse_cell(key) or key.endswith(".resolved"):
            continue
        row, _, column = key.rpartition("/")
        row = row or "(run)"
        rows.setdefault(row, {})[column] = m
        if column not in columns:
            columns.append(column)
    columns.sort(key=_natural)
    body = [[f"`{row}`"] + [fmt_metric(rows[row][c]) if c in rows[row] else "—" for c in columns]
            + [f"`{_short(run.run_id)}`", f"`{run.commit[:10]}`"] for row in sorted(rows, key=_natural)]
    return _table(["row"] + columns + ["run id", "commit"], body) if body else []


def _describe(run: Run) -> str:
    tags = ", ".join(f"{k} `{run.tags[k]}`" for k in PROVENANCE if k in run.tags and k != "commit")
    # a benchmark's settings (preset, what was compiled, …) say what its numbers are of
    params = ", ".join(f"{k} `{v}`" for k, v in sorted(run.params.items()) if run.kind == "benchmark"
                       and v not in (None, "") and k != "copy_bandwidth_gbs")
    return (f"**`{run.name}`** ({run.kind}; run `{run.run_id}`, commit `{run.commit}`"
            + (f"; {tags}" if tags else "") + ")" + (f"; {params}" if params else ""))


# README's headline: (run name, policies) — those policies' leaderboard rows of the runs of that name made at its
# latest run's commit (one evaluation may log one run per reading, e.g. per read window). The recommended recipe's
# evaluation, made by its one command (configs/recipes/smollm2_kvpop.yaml).
HEADLINE = (("evaluate/smollm2-kvpop-kernel", ("tova", "oracle", "kvpop")),)


def _only_policies(run: Run, policies: tuple[str, ...]) -> Run:
    keep = {k: m for k, m in run.metrics.items() if (parse_cell(k) or ("", "", 0, ""))[1] in policies}
    return Run(run.run_id, run.name, run.kind, run.params, keep, run.tags, run.artifacts)


def headline_table(runs: list[Run]) -> str:
    """The small table README.md shows: :data:`HEADLINE`'s rows (a name not in the ledger is left out)."""
    latest = {r.name: r for r in runs}
    chosen = [_only_policies(r, policies) for name, policies in HEADLINE if name in latest
              for r in runs if r.name == name and r.commit == latest[name].commit]
    return "\n".join(_leaderboard(chosen, order=False)) if chosen else "(none of the headline runs is in the ledger)"


def render(runs: list[Run], artifacts_root: Path = ROOT) -> str:
    """RESULTS.md from the ledger: a function of the runs (sorted by name, then id) and of which of their artifacts
    are in the tree under ``artifacts_root``, so a re-render of the same ledger and tree is byte-identical."""
    runs = sorted(runs, key=lambda r: (_natural(r.name), r.run_id))
    board = [r for r in runs if r.producer != "baselines" and any(parse_cell(k) for k in r.metrics)]
    baselines = [r for r in runs if r.producer == "baselines"]
    serving = [r for r in runs if r.kind == "benchmark"]
    out = ["# Results", "",
           "Rendered by `python -m jobs.results render` from `results/ledger.jsonl` (one line per run; do not edit "
           "this file by hand). Every number is a run's: each row names its run (the MLflow run id, or a ledger id "
           "for a result logged before the ledger; `python -m jobs.results import` loads them all into MLflow) and "
           "the commit that produced it. Intervals are 95 % bootstrap intervals over items, `mean [lo, hi]`. "
           "Kind `study` marks a figure a one-off study script measured (not the product's own stages).", "",
           f"The lab notebook (per-item records, the study scripts and their outputs, session logs) lives in git history "
           f"at commit `{NOTEBOOK_COMMIT[:12]}` (`git archive {NOTEBOOK_COMMIT[:12]} benchmarks/results | tar x -C /tmp/lab`).",
           "",
           "## Headline", "", headline_table(runs), "",
           "## Leaderboard: policy × CR × corpus", "",
           "KL gap closed = the share of the streaming → oracle KL gap a policy closes; recall × dense = exact match "
           "on the recall cells as a share of dense's. `kvpop_r<λ>` ranks by the scorer + λ·t (the recency term), "
           "`_a<a>` gives a share a of the long-range slots to anchors ranked by the scorer alone (a further `_r<λa>`: "
           "the anchors' own recency term).", ""]
    out += _leaderboard(board) + [""]
    others = [(run, _run_table(run)) for run in runs if run.kind != "benchmark" and run.producer != "baselines"]
    if any(table for _, table in others):
        out += ["Other figures of evaluations, studies and trainings:", ""]
        for run, table in others:
            if table:
                out += [_describe(run), ""] + table + [""]
    out += ["## Serving", ""]
    for run in serving:
        table = _run_table(run)
        if table:
            out += [_describe(run), ""] + table + [""]
    out += ["## Learned baselines (StreamingLLM+, DMS, KVpop + distill)", "",
            "Each trained method evaluated by the evaluation stage on the same items; DMS at matched mean memory.", ""]
    out += _leaderboard(baselines) + [""]
    for run in baselines:
        table = _run_table(run)
        if table:
            out += [f"Training cost, {_describe(run)}:", ""] + table + [""]
    out += ["## Artifacts", "", "Load one with `pipelines.ledger.artifact(name)` (checks the sha256, unpacks to a "
            "cache folder). One that has left the tree is in git history (`git log -- <path>`).", ""]
    arts = [(a, r) for r in runs for a in r.artifacts]
    rows = [[f"`{a.name}`" + ("" if (artifacts_root / a.path).is_file() else " (git history only)"), f"`{a.sha256}`",
             fmt(a.size), f"`{r.name}` (`{_short(r.run_id)}`)", f"`{r.commit[:10]}`"]
            for a, r in sorted(arts, key=lambda x: x[0].name)]
    out += (_table(["name", "sha256", "bytes", "produced by", "commit"], rows) if rows else ["(none)"]) + [""]
    return "\n".join(out)


def refresh_readme(text: str, runs: list[Run]) -> str:
    """``text`` with the block between the headline markers replaced by the rendered headline table (unchanged if
    the markers are absent)."""
    start, end = text.find(HEADLINE_BEGIN), text.find(HEADLINE_END)
    if start < 0 or end < start:
        return text
    block = f"{HEADLINE_BEGIN}\n{headline_table(runs)}\n{HEADLINE_END}"
    return text[:start] + block + text[end + len(HEADLINE_END):]


def write_results(ledger: Path = LEDGER, out: Path = RESULTS_MD, readme: Path | None = README) -> list[Path]:
    """Render RESULTS.md (and README.md's headline block, where its markers are); the files changed."""
    runs = read(ledger)
    changed = []
    text = render(runs)
    if not out.exists() or out.read_text() != text:
        atomic_write_text(out, text)
        changed.append(out)
    if readme is not None and readme.exists():
        old = readme.read_text()
        new = refresh_readme(old, runs)
        if new != old:
            atomic_write_text(readme, new)
            changed.append(readme)
    return changed


# ------------------------------------------------------------------------------------------------ MLflow
_TAG_PREFIX = "kvpop."
_RESERVED = {"ledger_id": "kvpop.ledger_id", "kind": "kvpop.kind", "name": "kvpop.name",
             "artifacts": "kvpop.artifacts", "stage": "kvpop.stage"}
_STAGE_KIND = {"evaluate": "evaluation", "train": "training", "benchmark": "benchmark", "study": "study"}


def _mlflow_payload(run: Run):
    """(params, metrics, tags) of a ledger run as MLflow entities: params JSON-encoded (so types survive), each
    interval as ``<key>.lo`` / ``.hi`` / ``.n``, provenance as ``kvpop.<tag>``."""
    from mlflow.entities import Metric as MlMetric, Param, RunTag

    params = [Param(k, json.dumps(v)) for k, v in run.params.items()]
    metrics = []
    for key, m in run.metrics.items():
        for suffix, value in (("", m.value), (".lo", m.lo), (".hi", m.hi), (".n", m.n)):
            if value is not None:
                metrics.append(MlMetric(key + suffix, float(value), 0, 0))
    tags = {f"{_TAG_PREFIX}{k}": v for k, v in run.tags.items()}
    tags.update({_RESERVED["ledger_id"]: run.run_id, _RESERVED["kind"]: run.kind, _RESERVED["name"]: run.name,
                 _RESERVED["stage"]: run.producer, "mlflow.runName": run.name,
                 "mlflow.source.git.commit": run.commit})
    if run.artifacts:
        tags[_RESERVED["artifacts"]] = json.dumps([a.to_dict() for a in run.artifacts])
    return params, metrics, [RunTag(k, v) for k, v in tags.items()]


def _log_batches(client, run_id: str, params, metrics, tags) -> None:
    for start in range(0, len(params), 100):  # MLflow caps a batch at 100 params, 1000 entities in all
        client.log_batch(run_id, params=params[start:start + 100])
    for start in range(0, len(metrics), 900):
        client.log_batch(run_id, metrics=metrics[start:start + 900])
    client.log_batch(run_id, tags=tags)


def _ledger_ids(client, experiment_id: str) -> set[str]:
    from mlflow.entities import ViewType

    ids, token = set(), None
    while True:
        page = client.search_runs([experiment_id], run_view_type=ViewType.ALL, max_results=1000, page_token=token)
        ids |= {r.data.tags.get(_RESERVED["ledger_id"]) or r.info.run_id for r in page}
        token = page.token
        if not token:
            return ids


def import_runs(runs: list[Run], cfg) -> list[Run]:
    """Each ledger run not yet in the config's MLflow store (by its ledger id, kept as tag ``kvpop.ledger_id``;
    an MLflow-native run counts by its own id) becomes a finished run there. Returns the runs imported: a second
    import of the same ledger imports nothing."""
    import mlflow


    experiment_id = tracking.setup(cfg)
    client = mlflow.MlflowClient(cfg.tracking_uri())
    have = _ledger_ids(client, experiment_id)
    done = []
    for run in runs:
        if run.run_id in have:
            continue
        params, metrics, tags = _mlflow_payload(run)
        start, end = (epoch_ms(run.tags.get(tag)) for tag in RUN_TIMES)  # a line without them: 0, unknown
        new = client.create_run(experiment_id, run_name=run.name, start_time=start or 0)
        _log_batches(client, new.info.run_id, params, metrics, tags)
        client.set_terminated(new.info.run_id, "FINISHED", end_time=end or start or 0)
        done.append(run)
    return done


def _param_value(text: str):
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return text
    return value if isinstance(value, (str, int, float, bool)) or value is None else text


def _fold(flat: dict[str, float]) -> dict[str, dict]:
    """MLflow's flat metrics (``k``, ``k.lo``, ``k.hi``, ``k.n``) as ledger metrics."""
    out = {}
    for key, value in flat.items():
        if key.endswith(INTERVAL_SUFFIXES) and key.rpartition(".")[0] in flat:
            continue
        m = {"value": value}
        for suffix in INTERVAL_SUFFIXES:
            if key + suffix in flat:
                m[suffix[1:]] = flat[key + suffix]
        if m.get("n") is not None:
            m["n"] = int(m["n"])
        if (m.get("lo") is None) != (m.get("hi") is None):
            m.pop("lo", None), m.pop("hi", None)
        out[key] = m
    return out


def _native_cells(metrics: dict, params: dict) -> dict:
    """The evaluation stage's ``<policy>.B<total>.<metric>`` keys as leaderboard cells (CR = 1 − B/S, corpus the
    config's ``data.source``), its ``<corpus>.<policy>.B<total>.<metric>`` keys (``eval.heldout_sources``) as cells
    of that corpus; other keys as they are."""
    seq_len = params.get("data.seq_len")
    corpus = corpus_name(str(params.get("data.source") or "champ"))
    out = {}
    for key, m in metrics.items():
        found = re.match(r"^(?:([A-Za-z0-9_\-]+)\.)?([A-Za-z0-9_\-]+)\.B(\d+)\.(.+)$", key)
        if not found or not isinstance(seq_len, int) or found.group(4).endswith(".resolved"):
            out[key] = m
            continue
        other, policy, total, name = found.group(1), found.group(2), int(found.group(3)), found.group(4)
        if other is not None:  # eval.heldout_sources: <corpus>.<policy>.B<total>.<metric>, text metrics only
            out[cell(other, policy, 1 - total / seq_len, name)] = m
            continue
        where = "recall" if name.startswith("recall_") else "generation" if name.startswith("gen_") else corpus
        out[cell(where, policy, 1 - total / seq_len, name)] = m
    return out


def _valid_key(key: str) -> bool:
    try:
        check_metric_key(key)
        return True
    except LedgerError:
        return False


def export_runs(cfg, known: set[str], skipped: list | None = None) -> list[Run]:
    """The config's MLflow store's finished runs that the ledger lacks (not in ``known`` by ledger id or MLflow id)
    as ledger runs: an imported run comes back as it went in; a run a stage logged (``kvpop.stage`` tag: evaluate,
    train, benchmark) becomes ``<stage>/<config name>`` (its ``kvpop.config`` tag, else the run name) with its
    metrics folded into intervals, the evaluation's as leaderboard cells. Runs with no stage tag and unfinished runs
    are left out, and so are runs without a commit (``mlflow.source.git.commit``, set by MLflow where the code ran
    from a git checkout): their names are added to ``skipped``."""
    import mlflow
    from mlflow.entities import ViewType


    experiment_id = tracking.setup(cfg)
    client = mlflow.MlflowClient(cfg.tracking_uri())
    found, token = [], None
    while True:
        page = client.search_runs([experiment_id], run_view_type=ViewType.ACTIVE_ONLY, max_results=1000,
                                  page_token=token, order_by=["attributes.start_time ASC"])
        found += list(page)
        token = page.token
        if not token:
            break
    runs = []
    for r in found:
        tags = r.data.tags
        run_id = tags.get(_RESERVED["ledger_id"]) or r.info.run_id
        stage = tags.get(_RESERVED["stage"])
        if run_id in known or stage is None or r.info.status != "FINISHED":
            continue
        params = {k: _param_value(v) for k, v in r.data.params.items() if _valid_key(k)}
        metrics = _fold({k: v for k, v in r.data.metrics.items()
                         if _valid_key(k[:-len(k.rpartition(".")[2]) - 1] if k.endswith(INTERVAL_SUFFIXES) else k)})
        own = {k[len(_TAG_PREFIX):]: v for k, v in tags.items()
               if k.startswith(_TAG_PREFIX) and k not in _RESERVED.values() and _valid_key(k[len(_TAG_PREFIX):])}
        if _RESERVED["ledger_id"] in tags:
            name, kind = tags[_RESERVED["name"]], tags[_RESERVED["kind"]]
        else:
            name = f"{_slug(stage).lower()}/{_slug(tags.get('kvpop.config') or r.info.run_name or r.info.run_id)}"
            kind = _STAGE_KIND.get(stage, "study")
            own.setdefault("commit", tags.get(tracking.COMMIT_TAG, ""))
            own.setdefault("produced_by", f"pipelines/{stage}.py" if stage in ("evaluate", "train") else stage)
            for tag, value in zip(RUN_TIMES, (r.info.start_time, r.info.end_time)):
                if value:
                    own.setdefault(tag, utc_text(value))
            if stage == "evaluate":
                metrics = _native_cells(metrics, params)
        if not own.get("commit"):
            if skipped is not None:
                skipped.append(f"{name} ({r.info.run_id}): no commit recorded")
            continue
        artifacts = json.loads(tags.get(_RESERVED["artifacts"], "[]"))
        runs.append(make_run(run_id, name, kind, params, metrics, own, artifacts))
        known = known | {run_id}
    return runs


# ------------------------------------------------------------------------------------------------ benchmarks
def publish(name: str, kind: str, params: dict, metrics: dict, tags: dict, files: Iterable[Path] = (), *,
            ledger: Path = LEDGER, tracking_uri: str | None = None, experiment: str = "kvpop") -> Run:
    """Log one measured run to MLflow (params, metrics with intervals, provenance tags, ``files`` — the result's
    JSON / markdown — as artifacts) and append its ledger line, its run id the MLflow run's. Where MLflow is not
    installed (a bare GPU machine) the ledger line alone is written, with a random ledger id: the ledger travels
    back in git and ``jobs.results import`` loads it into MLflow later. The one helper every product benchmark
    calls."""
    tags = {"end_time": utc_text(time.time() * 1000), **tags}  # now, unless the caller knows better
    run = make_run(uuid.uuid4().hex, name, kind, params, metrics, tags)
    try:
        import mlflow
    except ImportError:
        return append([run], ledger)[0]

    cfg = PipelineConfig(tracking=TrackingConfig(uri=tracking_uri or "", experiment=experiment))
    experiment_id = tracking.setup(cfg)
    client = mlflow.MlflowClient(cfg.tracking_uri())
    start, end = (epoch_ms(tags.get(tag)) for tag in RUN_TIMES)
    created = client.create_run(experiment_id, run_name=name, start_time=start)
    run = make_run(created.info.run_id, name, kind, params, metrics, tags)
    params_, metrics_, tags_ = _mlflow_payload(run)
    tags_ = [t for t in tags_ if t.key != _RESERVED["ledger_id"]]  # MLflow's own id is the ledger's
    _log_batches(client, run.run_id, params_, metrics_, tags_)
    for path in files:
        if Path(path).exists():
            client.log_artifact(run.run_id, str(path), "result")
    client.set_terminated(run.run_id, "FINISHED", end_time=end)
    return append([run], ledger)[0]


def publish_result(producer: str, tag: str, result: dict, files: Iterable[Path] = (), *, config: Any = None,
                   weights_digest: str | None = None, data_digest: str | None = None,
                   ledger: Path = LEDGER) -> Run:
    """:func:`publish` for a product benchmark's result dict: its converter's params and metrics, provenance from
    the result (device, dtype) and the caller (its arguments as ``config``, digests where it has them)."""
    converters = {"capacity": capacity_metrics, "decode": decode_metrics, "kernels": kernels_metrics,
                  "precompute": precompute_metrics, "quality": quality_metrics, "cost_model": cost_model_metrics}
    params, metrics = converters[producer](result)
    script = "precompute_gpu" if producer == "precompute" else producer
    tags = provenance(config=config, data_digest=data_digest, weights_digest=weights_digest,
                      device=result.get("device"), dtype=result.get("dtype"), produced_by=f"benchmarks/{script}.py")
    if isinstance(result.get("seconds"), (int, float)):  # the benchmark's own duration: when it started
        tags["start_time"] = utc_text((time.time() - result["seconds"]) * 1000)
    return publish(f"{producer}/{_slug(tag)}", "benchmark", params, metrics, tags, files, ledger=ledger)


# ------------------------------------------------------------------------------------------------ artifacts
def artifact(name: str, ledger: Path = LEDGER, cache: Path | None = None, root: Path = ROOT) -> Path:
    """The tracked artifact ``name`` (a scorer tarball), its sha256 checked against the ledger's, unpacked into a
    cache folder (``$KVPOP_HOME/artifacts/<sha256[:16]>``; once); returns that folder. Refuses an unknown name, a
    missing file or a sha256 mismatch in one :class:`LedgerError` line."""
    entries = [a for r in read(ledger) for a in r.artifacts if a.name == name]
    if not entries:
        raise LedgerError(f"artifact {name!r}: not in the ledger")
    entry = entries[-1]
    path = root / entry.path
    if not path.is_file():
        raise LedgerError(f"artifact {name!r}: {path} is missing")
    digest = sha256_file(path)
    if digest != entry.sha256:
        raise LedgerError(f"artifact {name!r}: sha256 {digest[:16]}… of {path} is not the ledger's "
                          f"{entry.sha256[:16]}…: refusing it")
    if cache is None:
        cache = kvpop_home() / "artifacts"
    target = Path(cache) / entry.sha256[:16]
    if (target / ".complete").exists():
        return target
    target.mkdir(parents=True, exist_ok=True)
    if tarfile.is_tarfile(path):
        with tarfile.open(path) as archive:
            archive.extractall(target, filter="data")
    else:
        (target / path.name).write_bytes(path.read_bytes())
    (target / ".complete").write_text(entry.sha256 + "\n")
    return target


def artifact_entry(name: str, path: Path, root: Path = ROOT) -> Artifact:
    """An :class:`Artifact` for a file under the repository."""
    path = Path(path)
    return Artifact(name, str(path.resolve().relative_to(root.resolve())), sha256_file(path), path.stat().st_size)


def add_publish_arguments(parser) -> None:
    """A product benchmark's ``--ledger`` and ``--no-publish`` (what :func:`publish_file` reads)."""
    parser.add_argument("--ledger", default=str(LEDGER),
                        help="the results ledger a written result is appended to (default results/ledger.jsonl)")
    parser.add_argument("--no-publish", action="store_true",
                        help="write the result files only: no MLflow run, no ledger line")


def publish_file(producer: str, out: Path, result: dict, args, *, weights_digest: str | None = None,
                 data_digest: str | None = None, config: Any = None) -> Run | None:
    """What a product benchmark calls once its result file ``out`` (``<producer>_<tag>.json``, and ``.md`` beside
    it) is written: :func:`publish_result` with the tag from the file name, the files as artifacts and ``config``
    (a benchmark that runs the stages passes their resolved :class:`PipelineConfig`; default: the command line,
    ``args`` parsed with :func:`add_publish_arguments`) as the config hash. Nothing with ``--no-publish``."""
    if getattr(args, "no_publish", False):
        return None
    out = Path(out)
    tag = out.stem[len(producer) + 1:] if out.stem.startswith(producer + "_") else out.stem
    if config is None:
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in sorted(vars(args).items())
                  if k not in ("ledger", "no_publish", "out")}
    run = publish_result(producer, tag or "run", result, [out, out.with_suffix(".md")], config=config,
                         weights_digest=weights_digest, data_digest=data_digest, ledger=Path(args.ledger))
    print(f"[ledger] run {run.run_id} ({run.name}) appended to {args.ledger}", flush=True)
    return run
