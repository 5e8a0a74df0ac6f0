"""Precompute throughput and memory: what the teacher stage costs, and what the target pass adds to the forward.

Measures, on one device (CUDA if present), for one model at sequence length S:

* ``dense forward``  — the teacher's plain forward (its own attention implementation, SDPA by default) plus the
  chunked top-K logit projection: what a teacher costs without targets;
* ``teacher pass``   — :func:`kvpop.targets.teacher_pass`: the dense forward whose attention also returns its LSE and
  runs the transposed target pass for every window, plus the same top-K projection;
* per layer, on the model's real query/key shapes: the causal attention forward with LSE and the transposed target
  pass alone (FlexAttention on CUDA, row-chunked on CPU), and their ratio;
* ``shard``          — the precompute actor's whole unit of work without Ray (:func:`pipelines.precompute.compute_rows`
  + Parquet write of one shard): the stage's tokens/s, and the bytes per sequence on disk;
* optionally (``--ray``) the real stage, ``pipelines.precompute.run``, on a local Ray cluster.

Peak memory is ``torch.cuda.max_memory_allocated`` per measurement (CPU: not measured). Sequences come from the
running interpreter's standard library sources (present on every machine; real long-range structure) tokenized with
the model's tokenizer, or random tokens (``--corpus random``).

Prints a table and writes ``benchmarks/results/precompute_<device>_<model>_S<S>.json``.

Examples::

    python benchmarks/precompute_gpu.py                                   # SmolLM2, S=8192, 4 sequences, on CUDA
    python benchmarks/precompute_gpu.py --model PATH --seq-len 16384 --windows 128 256
    python benchmarks/precompute_gpu.py --device cpu --seq-len 256 --sequences 2 --repeats 1   # smoke test
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def timed(fn, device: torch.device, repeats: int, warmup: int = 1) -> tuple[float, float | None]:
    """Median seconds over ``repeats`` calls after ``warmup`` calls (compilation), and the peak memory (GiB)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    _reset_peak(device)
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2], _peak_gib(device)


def stdlib_sequences(tokenizer, seq_len: int, count: int) -> torch.Tensor:
    """``[count, seq_len]`` token ids cut from the standard library's sources (deterministic)."""
    from pipelines.data import stdlib_documents

    ids: list[int] = []
    for _, text in stdlib_documents():
        ids.extend(tokenizer(text, add_special_tokens=False, verbose=False).input_ids)
        ids.append(tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0)
        if len(ids) >= seq_len * count:
            break
    if len(ids) < seq_len * count:
        raise SystemExit(f"the standard library holds only {len(ids)} tokens, fewer than {seq_len} × {count}")
    return torch.tensor(ids[: seq_len * count]).view(count, seq_len)


def layer_shapes(model) -> tuple[int, int, int, int]:
    cfg = model.config
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, heads, kv, dim


def main(argv: list[str] | None = None) -> dict:
    from pipelines import ledger  # here, not at the top: transformers imports a module named `kernels` (this folder's)

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="a plain HF folder, or 'smollm2' (the prepared folder)")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--sequences", type=int, default=4, help="sequences per shard (and measured batches)")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--windows", type=int, nargs="+", default=[128])
    parser.add_argument("--top-k", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto", help="auto | cuda | cpu")
    parser.add_argument("--corpus", default="stdlib", choices=["stdlib", "random"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ray", action="store_true", help="also run pipelines.precompute.run on a local Ray cluster")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    ledger.add_publish_arguments(parser)
    args = parser.parse_args(argv)

    from kvpop.files import weights_digest
    from kvpop.pretrained import load_pretrained
    from kvpop.targets import causal_attention_with_lse, future_attention_targets, teacher_pass
    from pipelines.models import smollm2_dir
    from pipelines.precompute import compute_rows
    from pipelines.store import shard_table, write_shard

    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    dtype = getattr(torch, args.dtype)
    if device.type == "cpu" and dtype != torch.float32:
        print("[bench] CPU: using float32", flush=True)
        dtype = torch.float32
    path = smollm2_dir() if args.model == "smollm2" else Path(args.model)
    model, tokenizer = load_pretrained(path, dtype=dtype, device=device)
    for p in model.parameters():
        p.requires_grad_(False)
    S, B, K = args.seq_len, args.batch_size, args.top_k
    if args.corpus == "stdlib":
        sequences = stdlib_sequences(tokenizer, S, max(args.sequences, B))
    else:
        g = torch.Generator().manual_seed(0)
        sequences = torch.randint(0, model.config.vocab_size, (max(args.sequences, B), S), generator=g)
    batch = sequences[:B].to(device)
    layers, heads, kv_heads, head_dim = layer_shapes(model)
    rows: list[dict] = []

    def record(name: str, seconds: float, peak: float | None, tokens: int, **extra) -> dict:
        row = {"measure": name, "ms": seconds * 1e3, "tokens_per_s": tokens / seconds, "peak_gib": peak, **extra}
        rows.append(row)
        return row

    # 1. the teacher without targets: its own attention (SDPA) + the same chunked top-K projection
    @torch.no_grad()
    def dense_forward():
        base = getattr(model, model.base_model_prefix)
        hidden = base(input_ids=batch, use_cache=False).last_hidden_state
        head = model.get_output_embeddings()
        for start in range(0, S, 1024):
            head(hidden[:, start:start + 1024]).float().topk(K, dim=-1)

    dense = record("dense forward + top-K", *timed(dense_forward, device, args.repeats), B * S,
                   attn=model.config._attn_implementation)
    # 2. the teacher pass: forward with LSE + transposed target pass for every window + top-K
    teacher = record("teacher pass (targets + top-K)",
                     *timed(lambda: teacher_pass(model, batch, args.windows, top_k=K), device, args.repeats), B * S,
                     windows=args.windows)
    teacher["relative_to_dense"] = teacher["ms"] / dense["ms"]

    # 3. one layer's attention forward with LSE vs its transposed target pass, on the model's shapes
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(B, heads, S, head_dim, generator=g).to(device, dtype)
    k = torch.randn(B, kv_heads, S, head_dim, generator=g).to(device, dtype)
    v = torch.randn(B, kv_heads, S, head_dim, generator=g).to(device, dtype)
    scale = head_dim ** -0.5
    with torch.no_grad():
        _, lse = causal_attention_with_lse(q, k, v, scale=scale)
        fwd = record("layer: causal attention + LSE",
                     *timed(lambda: causal_attention_with_lse(q, k, v, scale=scale), device, args.repeats), B * S)
        tgt = record(f"layer: target pass (w={args.windows[0]})",
                     *timed(lambda: future_attention_targets(q, k, args.windows[0], lse=lse, scale=scale), device,
                            args.repeats), B * S)
    tgt["relative_to_attention"] = tgt["ms"] / fwd["ms"]

    # 4. the actor's unit of work without Ray: all sequences of one shard → Parquet
    with tempfile.TemporaryDirectory() as tmp:
        shard_ids = sequences[: args.sequences].numpy()

        def one_shard():
            out = compute_rows(model, shard_ids, args.windows, top_k=K, batch_size=B)
            return write_shard(Path(tmp), 0, shard_table([f"s{i}" for i in range(len(shard_ids))], out, "bench"))

        seconds, peak = timed(one_shard, device, max(1, args.repeats // 2))
        _, size, _ = one_shard()
    record("shard: compute_rows + Parquet write", seconds, peak, len(shard_ids) * S,
           sequences=len(shard_ids), mib_per_sequence=size / len(shard_ids) / 2**20)

    if args.ray:
        rows.append(ray_stage(args, path))

    result = {
        "benchmark": "precompute",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "model": path.name, "dtype": str(dtype).replace("torch.", ""), "seq_len": S, "batch_size": B,
        "windows": args.windows, "top_k": K, "layers": layers, "heads": heads, "kv_heads": kv_heads,
        "corpus": args.corpus, "torch": torch.__version__, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "rows": rows,
    }
    print_table(result)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = "cuda" if device.type == "cuda" else "cpu"
    file = out / f"precompute_{tag}_{path.name}_S{S}.json"
    file.write_text(json.dumps(result, indent=2) + "\n")
    file.with_suffix(".md").write_text(markdown(result))
    print(f"[bench] wrote {file} and .md", flush=True)
    ledger.publish_file("precompute", file, result, args, weights_digest=weights_digest(path))
    return result


def ray_stage(args, path: Path) -> dict:
    """The real stage on a local Ray cluster (needs ray, datasets): tokens/s including Ray's overhead."""
    from pipelines import precompute
    from pipelines.config import load_config

    with tempfile.TemporaryDirectory() as home:
        overrides = [f"home={home}", f"model.path={path}", f"model.dtype={args.dtype}", "data.source=stdlib",
                     f"data.seq_len={args.seq_len}", f"data.num_sequences={args.sequences}", "data.eval_sequences=0",
                     f"budget.window={args.windows[0]}", "budget.topk=1", f"precompute.windows={args.windows}",
                     f"precompute.top_k={args.top_k}", f"precompute.sequences_per_shard={max(1, args.sequences // 2)}",
                     f"precompute.batch_size={args.batch_size}",
                     f"precompute.num_gpus_per_actor={1 if torch.cuda.is_available() else 0}"]
        cfg = load_config(REPO / "configs" / "smollm2_gpu.yaml" if torch.cuda.is_available() else None, overrides)
        t0 = time.perf_counter()
        result = precompute.run(cfg)
        seconds = time.perf_counter() - t0
    return {"measure": "stage: pipelines.precompute.run (Ray)", "ms": seconds * 1e3,
            "tokens_per_s": result.tokens_computed / seconds, "peak_gib": None, "shards": result.shards,
            "teacher_s": result.teacher_seconds}


def markdown(result: dict) -> str:
    lines = [f"# Precompute — {result['model']} ({result['dtype']}) on {result['device']}", "",
             f"S = {result['seq_len']}, batch {result['batch_size']}, windows {result['windows']}, top-K "
             f"{result['top_k']}.", "", "| measure | ms | tokens/s | peak GiB |", "|---|---|---|---|"]
    for row in result["rows"]:
        peak = f"{row['peak_gib']:.2f}" if row["peak_gib"] is not None else "-"
        lines.append(f"| {row['measure']} | {row['ms']:.1f} | {row['tokens_per_s']:.0f} | {peak} |")
    return "\n".join(lines) + "\n"


def print_table(result: dict) -> None:
    print(f"\nprecompute — {result['model']} ({result['dtype']}) on {result['device']}, S={result['seq_len']}, "
          f"batch {result['batch_size']}, windows {result['windows']}, top-K {result['top_k']}")
    print(f"{'measure':<40} {'ms':>10} {'tokens/s':>12} {'peak GiB':>9}  notes")
    for row in result["rows"]:
        notes = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                          if k not in ("measure", "ms", "tokens_per_s", "peak_gib"))
        peak = f"{row['peak_gib']:.2f}" if row["peak_gib"] is not None else "-"
        print(f"{row['measure']:<40} {row['ms']:>10.1f} {row['tokens_per_s']:>12.0f} {peak:>9}  {notes}")


if __name__ == "__main__":
    main()
