"""The paper-scale cost model (issue 44 item 3): what training a scorer for Qwen3-4B / Qwen3-8B costs, measured on the
product's own stages, turned into GPU-hours for the original work's 2B training tokens.

The benchmark writes a **random-weight model folder** of the shape (:data:`SHAPES`: the published ``config.json``
numbers of Qwen/Qwen3-4B and Qwen/Qwen3-8B as a transformers ``Qwen3Config``; nothing comes from a hub) and runs, on
that folder and the preset's config (``configs/qwen3-4b.yaml`` / ``qwen3-8b.yaml``; the tiny shape: the embedded
default), the stages a user runs:

1. **precompute** (:func:`pipelines.precompute.run`: Ray Data teacher actors, the dense forward plus the transposed
   target pass, Parquet shards). Throughput: the shards' tokens over their teacher + write seconds
   (:class:`pipelines.store.ShardRecord`), each actor's first shard left out when it has more (CUDA warm-up).
2. **train, scorer-only** and 3. **train, distill** (:func:`pipelines.train.run`: Ray Train, FSDP2 and bf16 as the
   config resolves them on GPUs). Distillation on CUDA checkpoints its decoder layers' activations
   (``train.activation_checkpointing``; without it Qwen3-4B at S = 16,384 ran out of memory on one 80 GB H100)
   unless ``--no-activation-checkpointing``; ``--set train.activation_checkpointing=true`` applies it to both modes.
   A distillation whose fp32 weights, gradients and AdamW state (16 B a parameter, sharded over ``--gpus``) exceed
   one GPU is not run: its row says how many GPUs it needs (:func:`distill_memory_short`).
   Throughput: ``batch_size × S`` over the median ``step_s`` the workers logged to MLflow, the first
   ``--warmup-steps`` steps left out.
4. **serving**: the trained scorer-only model loaded with :func:`kvpop.load_retrofitted`, the bounded prefill
   (:func:`kvpop.prefill`) of one random row at each ``--contexts`` length, then ``--decode-steps`` decoding steps
   (a CUDA graph of the whole step, :class:`kvpop.decode.GraphedDecoder`, on CUDA; eager on CPU).

**Result.** The JSON (``--out``, default ``<work>/cost_model_<shape>_S<S>.json``) and a markdown table beside it;
then, unless ``--no-publish``, :func:`pipelines.ledger.publish_file` logs them as one MLflow run and appends its
line to ``--ledger`` (``results/ledger.jsonl``), named ``cost_model/<file stem without "cost_model_">``. Its
metrics (:func:`pipelines.ledger.cost_model_metrics`): each stage's tokens/s and peak memory, the serving figures
per context, GPU-hours per GPU count; the shape is a param; provenance tags: commit, hash of the stages' config,
device, dtype.

Every stage prints one progress line. Peak GPU memory per stage is the device's used memory sampled by
``nvidia-smi`` while the stage runs (the Ray stages run in other processes), minus what was used before it; the
serving stage reports ``torch.cuda.max_memory_allocated``. On CPU no memory is reported.

**Tokens.** The tokenizer is SmolLM2's (the prepared folder, copied into the model folder); the model keeps the
shape's real vocabulary (151,936), so the embedding and the logits cost what they cost in the real model and every
token id the tokenizer makes (< 49,152) is valid. The corpus is the builtin ``stdlib`` source (Python's standard
library sources): real text, no download; what the tokens say does not change the cost.

**GPU-hours** (:func:`gpu_hours`): per stage, ``hours = tokens / (tokens/s per GPU × GPUs × efficiency) / 3600`` of
wall clock and ``GPU-hours = hours × GPUs``, for ``--tokens`` (2e9) and 1 / 8 / 64 GPUs. The scaling assumption is
linear data parallelism per stage (``--efficiency`` 1.0 unless measured otherwise): each GPU precomputes its own
sequences and each training worker steps on its own batch at the one-GPU rate; precompute covers every training
token once (one epoch). A pipeline (precompute + scorer-only, precompute + distill) costs the sum of its stages;
the stage with the most hours bounds it.

    python benchmarks/cost_model.py --shape qwen3-4b --device cuda --out results/cost_model/qwen3-4b.json
    python benchmarks/cost_model.py --shape qwen3-8b --device cuda --dry-plan     # the plan, nothing run
    python benchmarks/cost_model.py --shape tiny-qwen3-4b --device cpu --seq-len 256 --contexts 512  # CPU smoke run

Bad input is one line and exit code 2 (a CUDA request without CUDA, a bad override, an impossible budget).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import pipelines  # noqa: E402,F401  offline Hugging Face environment before transformers is imported
from pipelines import ledger  # noqa: E402
from pipelines.config import ConfigError, PipelineConfig, fingerprint, load_config  # noqa: E402

# The published config.json values (Qwen/Qwen3-4B, Qwen/Qwen3-8B); max_position_embeddings is raised per run to the
# longest context measured. tiny-qwen3-4b: Qwen3-4B's pattern at tiny width for CPU tests — GQA 4:1, head_dim set
# apart from hidden/heads (heads × head_dim = 1.6 × hidden, as 32 × 128 = 1.6 × 2560), MLP 3.8 × hidden, tied
# embeddings — with 4 layers and the tokenizer's vocabulary.
SHAPES = {
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                     rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=40960),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
                     rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=40960),
    "tiny-qwen3-4b": dict(hidden_size=80, intermediate_size=304, num_hidden_layers=4, num_attention_heads=8,
                          num_key_value_heads=2, head_dim=16, vocab_size=49152, tie_word_embeddings=True,
                          rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=40960),
}
PRESETS = {"qwen3-4b": REPO / "configs" / "qwen3-4b.yaml", "qwen3-8b": REPO / "configs" / "qwen3-8b.yaml",
           "tiny-qwen3-4b": None}
TRAIN_MODES = ("scorer_only", "distill")
GPU_COUNTS = (1, 8, 64)
MARKER = ".kvpop-cost-model"  # in the work folder: the benchmark only ever deletes a folder that carries it


# ------------------------------------------------------------------------------------------------ set-up
def _fail(message: str) -> None:
    print(f"cost_model: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _progress(stage: str, message: str) -> None:
    print(f"[cost_model] {stage}: {message}", flush=True)


def stage_config(args, work: Path) -> PipelineConfig:
    """The preset's config pointed at the benchmark's model folder, corpus, home and device (``--set`` last)."""
    cuda = args.device == "cuda"
    cpus = args.cpus_per_worker
    overrides = [
        f"name=cost-{args.shape}", f"home={work / 'home'}", f"model.path={work / 'model'}",
        f"model.dtype={'bfloat16' if cuda else 'float32'}",
        "data.source=stdlib", "data.text_field=text", f"data.seq_len={args.seq_len}",
        f"data.num_sequences={args.sequences}", "data.eval_sequences=1",
        "precompute.sequences_per_shard=1", f"precompute.num_actors={args.gpus}", "precompute.batch_size=1",
        f"precompute.num_gpus_per_actor={1 if cuda else 0}", f"precompute.num_cpus_per_actor={cpus}",
        f"train.num_workers={args.gpus}", f"train.use_gpu={'true' if cuda else 'false'}",
        f"train.cpus_per_worker={cpus}", f"train.batch_size={args.batch_size}", f"train.steps={args.steps}",
        f"train.precision={'bf16' if cuda else 'auto'}", "train.log_every=1", f"train.checkpoint_every={args.steps}",
        "train.max_failures=0",
        f"ray.num_cpus={max(4, args.gpus * cpus + 2)}",
        f"tracking.uri={os.environ.get('MLFLOW_TRACKING_URI') or 'sqlite:///' + str(work / 'mlflow.db')}",
        "tracking.experiment=cost-model", *args.overrides]
    preset = PRESETS[args.shape]
    return load_config(str(preset) if preset else None, overrides)


def write_model(shape: str, folder: Path, *, max_positions: int, dtype: str, device: str) -> dict:
    """A random-weight ``Qwen3ForCausalLM`` of ``shape`` with SmolLM2's tokenizer in ``folder`` (kept if it already
    holds this exact config); returns the config written."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from pipelines.models import smollm2_dir

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir(), local_files_only=True)
    values = {**SHAPES[shape], "max_position_embeddings": max(SHAPES[shape]["max_position_embeddings"],
                                                               max_positions)}
    if len(tokenizer) > values["vocab_size"]:
        raise ConfigError(f"the tokenizer has {len(tokenizer)} tokens, more than shape {shape}'s vocabulary")
    config = Qwen3Config(**values, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, attn_implementation="sdpa")
    wanted = {**config.to_dict(), "dtype": dtype}
    saved = folder / "config.json"
    if saved.is_file() and (folder / "tokenizer.json").is_file():
        old = json.loads(saved.read_text())
        if all(old.get(k) == v for k, v in values.items()) and old.get("dtype") == dtype:
            return wanted
    shutil.rmtree(folder, ignore_errors=True)
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it is fastest (minutes on CPU for 8B)
        model = Qwen3ForCausalLM._from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()  # the stages' memory is sampled device-wide: give this process's cache back
    return wanted


class MemorySampler:
    """The peak of the GPUs' used memory (MiB, summed over devices, minus the used memory at start) while the
    ``with`` block runs, sampled by ``nvidia-smi``: the Ray stages allocate in other processes. None without a GPU."""

    def __init__(self, enabled: bool, interval: float = 0.2):
        self.enabled, self.interval = enabled, interval
        self.peak_gib: float | None = None

    @staticmethod
    def used_mib() -> float:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, check=True, timeout=30).stdout
        return float(sum(float(x) for x in out.split()))

    def __enter__(self):
        if self.enabled:
            try:
                self.base = self.used_mib()
            except (OSError, subprocess.SubprocessError, ValueError) as err:  # no nvidia-smi: no memory figure
                _progress("memory", f"not sampled ({_error_line(err)})")
                self.enabled = False
                return self
            self.top = self.base
            self.stop = threading.Event()
            self.thread = threading.Thread(target=self._poll, daemon=True)
            self.thread.start()
        return self

    def _poll(self):
        while not self.stop.wait(self.interval):
            try:
                self.top = max(self.top, self.used_mib())
            except (OSError, subprocess.SubprocessError, ValueError):
                continue

    def __exit__(self, *exc):
        if self.enabled:
            self.stop.set()
            self.thread.join()
            self.peak_gib = (self.top - self.base) / 1024
        return False


# ------------------------------------------------------------------------------------------------ the stages
def measure_precompute(cfg: PipelineConfig, cuda: bool) -> dict:
    from pipelines import precompute, store

    t0 = time.perf_counter()
    with MemorySampler(cuda) as memory:
        result = precompute.run(cfg)
    wall = time.perf_counter() - t0
    shards = sorted(store.read_manifest(result.path).values(), key=lambda r: r.shard)
    by_host: dict[str, list] = {}
    for record in shards:
        by_host.setdefault(record.host, []).append(record)
    timed = [r for records in by_host.values() for r in (records[1:] if len(records) > 1 else records)]
    tokens = sum(r.rows for r in timed) * cfg.data.seq_len
    seconds = sum(r.teacher_s + r.write_s for r in timed)
    disk = sum(r.bytes for r in shards)
    return {"stage": "precompute", "tokens_per_s_per_gpu": tokens / seconds, "timed_tokens": tokens,
            "timed_seconds": seconds, "teacher_s": sum(r.teacher_s for r in timed),
            "write_s": sum(r.write_s for r in timed), "wall_s": wall, "shards": len(shards),
            "bytes_per_token": disk / (sum(r.rows for r in shards) * cfg.data.seq_len), "peak_gib": memory.peak_gib,
            "targets": str(result.path)}


def _step_seconds(cfg: PipelineConfig, run_id: str, warmup_steps: int) -> tuple[list[float], int]:
    """The ``step_s`` values the workers logged after the warm-up steps (all of them if no more), and the count."""
    import mlflow

    history = mlflow.MlflowClient(cfg.tracking_uri()).get_metric_history(run_id, "step_s")
    steps = sorted((m.step, m.value) for m in history)
    timed = [value for step, value in steps if step > warmup_steps] or [value for _, value in steps]
    return timed, len(steps)


def activation_checkpointing(args, cfg: PipelineConfig, mode: str) -> bool:
    """Whether the ``mode`` stage checkpoints its decoder layers' activations: distillation on CUDA unless
    ``--no-activation-checkpointing``, any mode with ``--set train.activation_checkpointing=true``."""
    return cfg.train.activation_checkpointing or (mode == "distill" and args.device == "cuda"
                                                  and not args.no_activation_checkpointing)


def measure_train(cfg: PipelineConfig, mode: str, cuda: bool, warmup_steps: int, checkpointing: bool = False) -> dict:
    """One training run in ``mode`` under a fixed run name, its decoder layers' activations checkpointed with
    ``checkpointing``. A run that fails after its timed steps (a final checkpoint or model that does not fit the disk,
    at 4B/8B distillation ~50 GB) still yields its step times, with the error beside them; one that fails before them
    raises."""
    from pipelines import tracking, train

    name = f"{cfg.name}-{mode}"
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, mode=mode, run_name=name,
                                                             activation_checkpointing=checkpointing))
    t0 = time.perf_counter()
    error, model_dir = None, None
    with MemorySampler(cuda) as memory:
        try:
            result = train.run(cfg)
            run_id, model_dir = result.mlflow_run_id, str(result.model_dir)
        except Exception as err:  # noqa: BLE001 - see the docstring
            run_id, error = tracking.find_run(cfg, name, "train"), _error_line(err)
            if run_id is None:
                raise
    wall = time.perf_counter() - t0
    timed, logged = _step_seconds(cfg, run_id, warmup_steps)
    if error is not None and logged < cfg.train.steps:
        raise RuntimeError(f"{logged} of {cfg.train.steps} steps logged before the run failed: {error}")
    step_s = statistics.median(timed)
    tokens = cfg.train.batch_size * cfg.data.seq_len  # per worker per step
    return {"stage": f"train_{mode}", "tokens_per_s_per_gpu": tokens / step_s, "step_s": step_s,
            "timed_steps": len(timed), "tokens_per_step_per_gpu": tokens, "wall_s": wall,
            "strategy": cfg.train.resolved_strategy, "precision": cfg.train.resolved_precision,
            "activation_checkpointing": checkpointing, "peak_gib": memory.peak_gib, "model_dir": model_dir,
            "mlflow_run_id": run_id,
            **({"failed_after_steps": error} if error else {})}


def measure_serving(model_dir: Path, contexts: list[int], *, base: Path, chunk: int, decode_steps: int, device: str,
                    dtype: str, vocab: int) -> list[dict]:
    """Bounded prefill and decoding of one random row per context with the trained model (what a user serves),
    after one untimed warm-up row; a context that fails (out of memory at 128k) is a row with its error."""
    import torch

    import kvpop
    from benchmarks.decode import time_steps
    from kvpop.cache import CACHE_KWARG
    from kvpop.decode import GraphedDecoder

    model, _ = kvpop.load_retrofitted(model_dir, base=base, dtype=getattr(torch, dtype), device=device,
                                      verify_base=False)  # the scorers' base: the folder written above
    model.eval()
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def one_row(context: int, steps: int) -> dict:
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        ids = torch.randint(0, vocab, (1, context), generator=torch.Generator().manual_seed(context)).to(device)
        sync()
        t0 = time.perf_counter()
        cache = kvpop.prefill(model, ids, chunk=chunk)
        sync()
        prefill_s = time.perf_counter() - t0
        token, position = ids[:, -1:], torch.full((1, 1), context, device=device)
        with torch.no_grad():
            if cuda:
                decoder = GraphedDecoder(model, cache)

                def step():
                    decoder(token, position)
            else:
                def step():
                    model(input_ids=token, position_ids=position, use_cache=True, **{CACHE_KWARG: cache})
            step()  # the graph's capture, or an eager warm-up step
            decode_s = time_steps(step, steps, torch.device(device))
        return {"context": context, "prefill_chunk": chunk, "prefill_s": prefill_s,
                "prefill_tokens_per_s": context / prefill_s, "decode_ms_per_token": 1e3 * decode_s,
                "decode_tokens_per_s": 1.0 / decode_s, "decode_steps": steps,
                "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}

    one_row(min(min(contexts), 2 * chunk), 1)  # warm-up: kernels, allocator, graph pools
    rows = []
    for context in contexts:
        try:
            rows.append(one_row(context, decode_steps))
            r = rows[-1]
            _progress("serving", f"{context}: prefill {r['prefill_s']:.2f} s ({r['prefill_tokens_per_s']:.0f} "
                                 f"tokens/s), decode {r['decode_ms_per_token']:.2f} ms/token")
        except Exception as err:  # noqa: BLE001 - e.g. out of memory at 128k: the shorter contexts stay
            rows.append({"context": context, "error": _error_line(err)})
            _progress("serving", f"{context}: failed: {rows[-1]['error']}")
    return rows


# ------------------------------------------------------------------------------------------------ arithmetic
def gpu_hours(rates: dict[str, float], tokens: float, gpus=GPU_COUNTS, efficiency: float = 1.0) -> list[dict]:
    """Per stage and GPU count: wall-clock hours ``tokens / (rate × gpus × efficiency) / 3600`` and GPU-hours
    (``hours × gpus``), for ``rates = {stage: tokens/s on one GPU}`` (the linear data-parallel assumption)."""
    rows = []
    for stage, rate in rates.items():
        for count in gpus:
            hours = tokens / (rate * count * efficiency) / 3600
            rows.append({"stage": stage, "gpus": count, "tokens_per_s_per_gpu": rate, "hours": hours,
                         "gpu_hours": hours * count})
    return rows


def pipelines_cost(rows: list[dict]) -> list[dict]:
    """Per pipeline (precompute + one training mode) and GPU count: summed hours and the stage that bounds it."""
    out = []
    by = {(r["stage"], r["gpus"]): r for r in rows}
    for mode in TRAIN_MODES:
        stages = ("precompute", f"train_{mode}")
        for count in sorted({r["gpus"] for r in rows}):
            parts = [by[(s, count)] for s in stages if (s, count) in by]
            if len(parts) < len(stages):
                continue
            bound = max(parts, key=lambda r: r["hours"])
            out.append({"pipeline": f"precompute + {mode}", "gpus": count,
                        "hours": sum(p["hours"] for p in parts), "gpu_hours": sum(p["gpu_hours"] for p in parts),
                        "bounded_by": bound["stage"]})
    return out


def _fmt(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def table(result: dict) -> str:
    """The result as markdown: per-stage measurements, GPU-hours, pipelines, serving."""
    shape = result["shape"]
    lines = [f"# Cost model: {result['shape_name']} on {result['device']} ({result['dtype']})", "",
             f"Random weights, {shape['num_hidden_layers']} layers, {shape['num_attention_heads']}/"
             f"{shape['num_key_value_heads']} heads × {shape['head_dim']}, hidden {shape['hidden_size']}, vocab "
             f"{shape['vocab_size']}; S = {result['seq_len']}, budget {result['budget']}, scorer "
             f"{result['scorer']}, {result['gpus']} GPU(s) per stage; commit {result['commit']}.", "",
             "| stage | tokens/s per GPU | peak GiB | wall s | notes |", "|---|---|---|---|---|"]
    for s in result["stages"]:
        if "error" in s:
            lines.append(f"| {s['stage']} | failed | | | {s['error']} |")
            continue
        note = (f"{s['timed_tokens']} tokens over {s['timed_seconds']:.2f} s of teacher + write; "
                f"{s['bytes_per_token']:.0f} B of targets per token" if s["stage"] == "precompute" else
                f"median step {s['step_s']:.3f} s over {s['timed_steps']} steps; {s['strategy']}, {s['precision']}"
                + ("; activation checkpointing" if s.get("activation_checkpointing") else "")
                + (f"; failed after its steps: {s['failed_after_steps']}" if "failed_after_steps" in s else ""))
        lines.append(f"| {s['stage']} | {s['tokens_per_s_per_gpu']:.1f} | {_fmt(s['peak_gib'], '.1f')} | "
                     f"{s['wall_s']:.1f} | {note} |")
    lines += ["", f"**GPU-hours for {result['tokens']:.3g} training tokens** (linear data-parallel per stage, "
              f"efficiency {result['efficiency']:g}: hours = tokens / (tokens/s per GPU × GPUs × efficiency) / "
              f"3600; precompute covers every token once)", "",
              "| stage | GPUs | hours (wall) | GPU-hours |", "|---|---|---|---|"]
    lines += [f"| {r['stage']} | {r['gpus']} | {r['hours']:.2f} | {r['gpu_hours']:.1f} |" for r in result["hours"]]
    lines += ["", "| pipeline | GPUs | hours (wall) | GPU-hours | bounded by |", "|---|---|---|---|---|"]
    lines += [f"| {r['pipeline']} | {r['gpus']} | {r['hours']:.2f} | {r['gpu_hours']:.1f} | {r['bounded_by']} |"
              for r in result["pipelines"]]
    if result["serving"]:
        lines += ["", "**Serving** (the trained model, one row: bounded prefill, then decoding)", "",
                  "| context | chunk | prefill s | prefill tokens/s | decode ms/token | decode tokens/s | peak GiB (weights "
                  "included) |",
                  "|---|---|---|---|---|---|---|"]
        for r in result["serving"]:
            if "error" in r:
                lines.append(f"| {r['context']} | failed: {r['error']} | | | | | |")
                continue
            lines.append(f"| {r['context']} | {r['prefill_chunk']} | {r['prefill_s']:.2f} | "
                         f"{r['prefill_tokens_per_s']:.0f} | {r['decode_ms_per_token']:.2f} | "
                         f"{r['decode_tokens_per_s']:.1f} | {_fmt(r['peak_gib'], '.1f')} |")
    lines += ["", f"Reproduce: `{result['command']}`"]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ the run
def _error_line(err: BaseException) -> str:
    text = (str(err).strip().splitlines() or [""])[0][:240]
    return f"{type(err).__name__}: {text}"


def parameter_count(shape: dict) -> int:
    """The parameters of a Qwen3 decoder of ``shape`` (embeddings, untied head, attention with q/k norms, MLP)."""
    h, d, layers = shape["hidden_size"], shape["head_dim"], shape["num_hidden_layers"]
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d
    per_layer = 2 * h * q + 2 * h * kv + 3 * h * shape["intermediate_size"] + 2 * h + 2 * d
    head = 0 if shape["tie_word_embeddings"] else shape["vocab_size"] * h
    return shape["vocab_size"] * h + head + layers * per_layer + h


def plan_lines(args, cfg: PipelineConfig, work: Path) -> list[str]:
    shape = SHAPES[args.shape]
    params = parameter_count(shape)
    targets_per_token = (4 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * len(cfg.precompute.windows)
                         + 8 * cfg.precompute.top_k)
    return [f"shape {args.shape}: {json.dumps(shape)}, {params / 1e9:.2f}B parameters",
            f"model folder {work / 'model'} ({cfg.model.dtype}, SmolLM2's tokenizer, "
            f"{params * (2 if cfg.model.dtype != 'float32' else 4) / 2**30:.1f} GiB), KVpop home {work / 'home'}",
            f"config: {PRESETS[args.shape] or 'the embedded default'} with S = {cfg.data.seq_len}, "
            f"{cfg.data.num_sequences} sequences, budget {cfg.budget}, scorer {cfg.train.scorer}",
            f"precompute: {cfg.precompute.num_actors} actor(s), ~{targets_per_token} B of targets per token "
            f"({targets_per_token * cfg.data.seq_len * cfg.data.num_sequences / 2**30:.2f} GiB in all)",
            *(f"train {mode}: {cfg.train.steps} steps × {cfg.train.batch_size} × {cfg.data.seq_len} tokens on "
              f"{cfg.train.num_workers} worker(s), {cfg.train.resolved_strategy}, {cfg.train.resolved_precision}"
              + (", activation checkpointing" if activation_checkpointing(args, cfg, mode) else "")
              for mode in args.modes),
            *([f"distill: ~{optimiser_state_bytes(args.shape) / 2**30:.0f} GiB of fp32 weights, gradients and AdamW "
               f"state to shard over the GPUs, and a final checkpoint (~{params * 12 / 2**30:.0f} GiB) and fp32 "
               f"model (~{params * 4 / 2**30:.0f} GiB) on disk"] if "distill" in args.modes else []),
            f"serving: bounded prefill (chunk {args.prefill_chunk}) + {args.decode_steps} decoding steps at "
            f"{args.contexts or 'no contexts'}",
            f"GPU-hours for {args.tokens:.3g} tokens on {list(GPU_COUNTS)} GPUs, efficiency {args.efficiency:g}",
            f"MLflow (the stages' runs): {cfg.tracking_uri()} experiment {cfg.tracking.experiment}",
            "result: " + ("written only (--no-publish)" if args.no_publish else
                          f"an MLflow run and a line of {args.ledger} (pipelines.ledger.publish_file)")]


def optimiser_state_bytes(shape: str) -> int:
    """What distilling ``shape`` holds before any activation: fp32 weights, gradients and AdamW's two moments, 16 B
    a parameter (FSDP2 shards them evenly over the GPUs)."""
    return parameter_count(SHAPES[shape]) * 16


def distill_memory_short(args, mode: str, cuda: bool) -> str:
    """Why distillation cannot fit ``args.gpus`` GPUs, or "": its :func:`optimiser_state_bytes` alone exceed one
    GPU's memory."""
    if mode != "distill" or not cuda:
        return ""
    import torch

    state = optimiser_state_bytes(args.shape)
    memory = torch.cuda.get_device_properties(0).total_memory
    per_gpu = state / args.gpus
    if per_gpu <= memory:
        return ""
    needed = -(-state // memory)
    return (f"fp32 weights, gradients and AdamW state {per_gpu / 2**30:.0f} GiB per GPU > the GPU's "
            f"{memory / 2**30:.0f} GiB: needs --gpus >= {needed} (FSDP2 shards them), not run on {args.gpus}")


def run(args) -> dict:
    import torch

    from pipelines import tracking
    from pipelines.train import runs_root

    started = time.perf_counter()
    cuda = args.device == "cuda"
    work = Path(args.work or REPO / ".kvpop" / "cost_model" / args.shape).expanduser().resolve()
    cfg = stage_config(args, work)
    if args.dry_plan:
        for line in plan_lines(args, cfg, work):
            print(line)
        return {}
    home = work / "home"
    if home.exists() and not (work / MARKER).is_file():
        raise ConfigError(f"{work} exists and was not made by this benchmark: pass another --work")
    work.mkdir(parents=True, exist_ok=True)
    (work / MARKER).touch()
    shutil.rmtree(home, ignore_errors=True)  # every stage must compute: a complete target directory costs nothing
    tracking.setup(dataclasses.replace(cfg, home=str(work)))  # the experiment's artifacts outlive the emptied home
    out = (Path(args.out).expanduser().resolve() if args.out
           else work / f"cost_model_{args.shape}_S{cfg.data.seq_len}.json")

    _progress("model", f"writing a random-weight {args.shape} folder")
    written = write_model(args.shape, work / "model", max_positions=max([args.seq_len, *args.contexts]) + 64,
                          dtype=cfg.model.dtype, device=args.device)
    stages, rates = [], {}
    _progress("precompute", f"{cfg.data.num_sequences} × {cfg.data.seq_len} tokens")
    precompute = measure_precompute(cfg, cuda)
    stages.append(precompute)
    rates["precompute"] = precompute["tokens_per_s_per_gpu"]
    _progress("precompute", f"{precompute['tokens_per_s_per_gpu']:.1f} tokens/s per GPU, peak "
                            f"{_fmt(precompute['peak_gib'], '.1f')} GiB, {precompute['wall_s']:.1f} s")
    scorer_model = None
    for mode in args.modes:
        _progress(f"train_{mode}", f"{cfg.train.steps} steps")
        short = distill_memory_short(args, mode, cuda)
        if short:  # an out-of-memory run that would only cost the GPU minutes it takes to fail
            stages.append({"stage": f"train_{mode}", "error": short})
            _progress(f"train_{mode}", f"not run: {short}")
            continue
        try:
            measured = measure_train(cfg, mode, cuda, args.warmup_steps,
                                     activation_checkpointing(args, cfg, mode))
        except Exception as err:  # noqa: BLE001 - an out-of-memory distillation must not lose the other figures
            stages.append({"stage": f"train_{mode}", "error": _error_line(err)})
            _progress(f"train_{mode}", f"failed: {_error_line(err)}")
            continue
        stages.append(measured)
        rates[f"train_{mode}"] = measured["tokens_per_s_per_gpu"]
        if mode == "scorer_only" and measured["model_dir"]:
            scorer_model = Path(measured["model_dir"])
        else:  # a distilled model's checkpoint and weights (tens of GB at 4B/8B) are not needed again
            shutil.rmtree(runs_root(cfg) / f"{cfg.name}-{mode}", ignore_errors=True)
        _progress(f"train_{mode}", f"{measured['tokens_per_s_per_gpu']:.1f} tokens/s per GPU, peak "
                                   f"{_fmt(measured['peak_gib'], '.1f')} GiB, {measured['wall_s']:.1f} s")
    serving = []
    if args.contexts and scorer_model is not None:
        _progress("serving", f"prefill + decoding at {args.contexts}")
        serving = measure_serving(scorer_model, args.contexts, base=work / "model", chunk=args.prefill_chunk,
                                  decode_steps=args.decode_steps, device=args.device, dtype=cfg.model.dtype,
                                  vocab=written["vocab_size"])
    hours = gpu_hours(rates, args.tokens, efficiency=args.efficiency)
    result = {
        "shape_name": args.shape, "shape": SHAPES[args.shape], "device": torch.cuda.get_device_name() if cuda
        else platform.processor() or platform.machine(), "dtype": cfg.model.dtype, "torch": torch.__version__,
        "seq_len": cfg.data.seq_len, "budget": str(cfg.budget), "scorer": cfg.train.scorer, "gpus": args.gpus,
        "steps": cfg.train.steps, "tokens": args.tokens, "efficiency": args.efficiency, "gpu_counts": list(GPU_COUNTS),
        "commit": ledger.git_commit(), "config_hash": fingerprint(cfg),  # the ledger line's provenance tags
        "command": "python benchmarks/cost_model.py " + " ".join(args.argv),
        "stages": stages, "hours": hours, "pipelines": pipelines_cost(hours), "serving": serving,
        "seconds": time.perf_counter() - started}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    markdown = out.with_suffix(".md")
    markdown.write_text(table(result) + "\n")
    print(table(result))
    published = ledger.publish_file("cost_model", out, result, args, config=cfg)
    if published is not None:  # the local JSON names its ledger line (the MLflow run's id where MLflow is installed)
        result["run_id"] = published.run_id
        out.write_text(json.dumps(result, indent=2) + "\n")
    _progress("done", f"{out} and {markdown.name}"
                      + (f", ledger run {published.run_id} ({published.name})" if published else "")
                      + f", {result['seconds']:.0f} s")
    return result


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit code 2 (argparse would print the usage block too)
        self.exit(2, f"cost_model: error: {message} (see --help)\n")


def parse(argv=None):
    parser = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-4b")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--seq-len", type=int, default=16384, help="S of precompute and training")
    parser.add_argument("--sequences", type=int, default=0, help="sequences precomputed (0: one per shard, 3 per "
                        "actor, so that each actor has a timed shard after its first)")
    parser.add_argument("--steps", type=int, default=8, help="training steps per mode")
    parser.add_argument("--warmup-steps", type=int, default=2, help="first steps left out of the median")
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per GPU per training step")
    parser.add_argument("--gpus", type=int, default=1, help="teacher actors and training workers (one GPU each)")
    parser.add_argument("--cpus-per-worker", type=int, default=0, help="0: 4 on CUDA, 1 on CPU")
    parser.add_argument("--modes", nargs="*", choices=TRAIN_MODES, default=list(TRAIN_MODES))
    parser.add_argument("--no-activation-checkpointing", action="store_true",
                        help="distill on CUDA without train.activation_checkpointing (every activation kept)")
    parser.add_argument("--contexts", type=int, nargs="*", default=[32768, 131072],
                        help="serving contexts (bounded prefill + decoding); none: skip serving")
    parser.add_argument("--prefill-chunk", type=int, default=2048)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--tokens", type=float, default=2e9, help="training tokens the GPU-hours are for")
    parser.add_argument("--efficiency", type=float, default=1.0, help="data-parallel scaling efficiency (0, 1]")
    parser.add_argument("--work", default="", help="model folder, KVpop home and MLflow store "
                        "(default .kvpop/cost_model/<shape>; its home/ is emptied at start)")
    parser.add_argument("--out", default="", help="result JSON (the markdown table next to it; default in --work)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a key of the stages' config (e.g. --set budget.topk=1792)")
    parser.add_argument("--dry-plan", action="store_true", help="print what would run and exit")
    ledger.add_publish_arguments(parser)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.cpus_per_worker == 0:
        args.cpus_per_worker = 4 if args.device == "cuda" else 1
    if args.sequences == 0:
        args.sequences = 3 * args.gpus
    for name in ("seq_len", "sequences", "steps", "batch_size", "gpus", "prefill_chunk", "decode_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup_steps < 0 or args.warmup_steps >= args.steps:
        parser.error("--warmup-steps must be >= 0 and fewer than --steps")
    if not 0 < args.efficiency <= 1 or args.tokens <= 0:
        parser.error("--efficiency must be in (0, 1] and --tokens > 0")
    if any(c < 1 for c in args.contexts):
        parser.error("--contexts must be >= 1")
    return args


def main(argv=None):
    import torch

    args = parse(argv)
    if args.device == "cuda" and not args.dry_plan and not torch.cuda.is_available():
        _fail("--device cuda but CUDA is not available here: pass --device cpu (tiny shapes) or run on a GPU")
    if args.device == "cuda" and not args.dry_plan and torch.cuda.device_count() < args.gpus:
        _fail(f"--gpus {args.gpus} but only {torch.cuda.device_count()} CUDA device(s) here")
    try:
        return run(args)
    except ConfigError as err:
        _fail(_error_line(err).removeprefix(f"{type(err).__name__}: "))


if __name__ == "__main__":
    main()
