"""Decode benchmark (issues 3 and 6): per-token latency and peak memory vs context length, dense vs streaming vs KVpop.

Each context length is reached by a real prefill (dense: transformers' DynamicCache + SDPA; streaming / KVpop: the
fixed cache's bounded prefill, ``kvpop.prefill``), then a few hundred decode steps are timed. KVpop and streaming are
timed both eagerly and as a replayed CUDA graph of the whole step (kvpop.decode.GraphedDecoder); dense is timed as users
run it (eager, DynamicCache) and at its best in stock transformers (a StaticCache step replayed as a CUDA graph).
The bandwidth floor of a step is (weights + cache bytes it must read) ÷ the measured device copy bandwidth.

    python -m benchmarks.decode --preset h200 --out benchmarks/results/decode_h200.json
    python -m benchmarks.decode --preset cpu-tiny          # a smoke run on CPU
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

PRESETS = {
    # Qwen3-0.6B's shape (28 layers, 16 query / 8 KV heads, head_dim 128), random weights, bf16
    "h200": dict(model=dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                            num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=140000),
                 dtype="bfloat16", lengths=[8192, 32768, 131072], batches=[1, 8], steps=200, eager_steps=20,
                 budget=(4, 256, 1788)),
    "cpu-tiny": dict(model=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=16, vocab_size=257, max_position_embeddings=4096),
                     dtype="float32", lengths=[256, 512], batches=[1, 2], steps=8, eager_steps=4,
                     budget=(2, 16, 46)),
}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device, gib: float = 2.0) -> float:
    """Measured device-to-device copy bandwidth in bytes/s (read + write counted once each)."""
    n = int(gib * (1 << 30)) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    _sync(device)
    start = time.perf_counter()
    reps = 10
    for _ in range(reps):
        dst.copy_(src)
    _sync(device)
    seconds = (time.perf_counter() - start) / reps
    del src, dst
    return 2 * n * 2 / seconds


def build_model(spec, dtype, device):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**spec, tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(dtype).eval()
    return model


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def time_steps(step, n, device) -> float:
    _sync(device)
    start = time.perf_counter()
    for _ in range(n):
        step()
    _sync(device)
    return (time.perf_counter() - start) / n


@torch.no_grad()
def run_config(model, policy, length, batch, args, device, bandwidth):
    import kvpop
    from kvpop.cache import CACHE_KWARG
    from transformers import DynamicCache

    cfg = model.config
    per_token_kv = cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2 * model.dtype.itemsize
    ids = torch.randint(0, cfg.vocab_size, (batch, length), device=device)
    step_ids = torch.randint(0, cfg.vocab_size, (batch, 1), device=device)
    if device.type == "cuda":
        import gc
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    row = {"policy": policy, "context": length, "batch": batch,
           "baseline_gib": torch.cuda.memory_allocated() / 2**30 if device.type == "cuda" else float("nan")}
    _sync(device)
    t0 = time.perf_counter()
    if policy == "dense":
        cache = DynamicCache(config=cfg)
        model(input_ids=ids, use_cache=True, logits_to_keep=1, **{CACHE_KWARG: cache})
    else:  # bounded prefill: chunks of Runtime.prefill_chunk columns, each compressed into the B slots
        kvpop.set_policy(model, policy, kvpop.Budget(*args["budget"]))
        cache = kvpop.prefill(model, ids)
    _sync(device)
    row["prefill_s"] = time.perf_counter() - t0
    if device.type == "cuda":
        row["prefill_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
    position = torch.full((batch, 1), length, device=device)

    def eager():
        model(input_ids=step_ids, position_ids=position, use_cache=True, logits_to_keep=1, **{CACHE_KWARG: cache})
        position.add_(1)

    row["eager_ms"] = 1e3 * time_steps(eager, args["eager_steps"], device)
    if policy != "dense" and device.type == "cuda":
        try:
            graphed = kvpop.decode.GraphedDecoder(model, cache)
            graphed(step_ids, position)  # capture + one step
            position.add_(1)

            def replay():
                graphed(step_ids, position)
                position.add_(1)

            row["graph_ms"] = 1e3 * time_steps(replay, args["steps"], device)
        except Exception as err:  # keep the eager numbers
            row["graph_error"] = f"{type(err).__name__}: {str(err)[:200]}"
            row["eager_ms"] = 1e3 * time_steps(eager, args["steps"], device)
    else:
        row["eager_ms"] = 1e3 * time_steps(eager, args["steps"], device)
    if device.type == "cuda":
        row["decode_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        row["allocated_gib"] = torch.cuda.memory_allocated() / 2**30
    if policy == "dense":
        cache_bytes = per_token_kv * cache.get_seq_length() * batch
        if device.type == "cuda":
            try:
                row["graph_ms"] = dense_graph_ms(model, cache, step_ids, args["steps"], device)
            except Exception as err:  # keep the eager numbers
                row["graph_error"] = f"{type(err).__name__}: {str(err)[:200]}"
    else:
        sizes = cache.nbytes()
        row["cache_bytes"] = sizes
        cache_bytes = sum(sizes.values())
    row["cache_gib"] = cache_bytes / 2**30
    floor_s = (weight_bytes(model) + cache_bytes) / bandwidth
    row["floor_ms"] = 1e3 * floor_s
    best = row.get("graph_ms", row["eager_ms"])
    row["x_floor"] = best / row["floor_ms"]
    return row


def dense_graph_ms(model, dynamic_cache, step_ids, steps, device) -> float:
    """Dense decoding at its best in stock transformers: the prefilled keys/values moved into a ``StaticCache``
    (in-place updates at a device-side length), one step captured as a CUDA graph and replayed. Reads the whole
    preallocated cache each step, like any dense kernel over ``length`` tokens."""
    from transformers import StaticCache

    from kvpop.cache import CACHE_KWARG
    from kvpop.decode import capture_graph

    length = dynamic_cache.get_seq_length()  # the prefill and the eager steps already taken
    static = StaticCache(config=model.config, max_cache_len=length + steps + 8)
    for layer, dense in zip(static.layers, dynamic_cache.layers):
        layer.update(dense.keys, dense.values)
        dense.keys = dense.values = None  # one copy of a 131k-token cache at a time
    ids = step_ids.clone()
    position = torch.full_like(ids, length)
    cache_position = torch.full((1,), length, device=device, dtype=torch.long)

    def forward():
        return model(input_ids=ids, position_ids=position, cache_position=cache_position, use_cache=True,
                     logits_to_keep=1, **{CACHE_KWARG: static}).logits

    warmup = 2

    def past_warmup():  # the warm-up wrote slots length, length + 1: capture the step after them
        position.add_(warmup)
        cache_position.add_(warmup)

    graph, _ = capture_graph(forward, warmup=warmup, restore=past_warmup)

    def replay():
        graph.replay()
        position.add_(1)
        cache_position.add_(1)

    return 1e3 * time_steps(replay, steps, device)


def main(argv=None):
    from pipelines import ledger  # here, not at the top: transformers imports a module named `kernels` (this folder's)

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="h200")
    parser.add_argument("--out", default="")
    parser.add_argument("--lengths", type=int, nargs="*")
    parser.add_argument("--batches", type=int, nargs="*")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--time-limit", type=float, default=1e9, help="stop starting new configs after this (s)")
    parser.add_argument("--policies", nargs="*", default=["kvpop", "dense", "streaming"])
    parser.add_argument("--no-compile", action="store_true", help="graph the uncompiled decoding step")
    parser.add_argument("--isolate", action="store_true",
                        help="run each configuration in a fresh process: peak memory without earlier configurations' "
                             "leftovers (compile workspaces, allocator caches)")
    ledger.add_publish_arguments(parser)
    args = parser.parse_args(argv)
    preset = dict(PRESETS[args.preset])
    for key in ("lengths", "batches", "steps"):
        if getattr(args, key):
            preset[key] = getattr(args, key)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, preset["dtype"])
    started = time.perf_counter()
    import kvpop
    model = build_model(preset["model"], dtype, device)
    bandwidth = copy_bandwidth(device, 2.0 if device.type == "cuda" else 0.05)
    result = {"preset": args.preset, "device": torch.cuda.get_device_name() if device.type == "cuda" else
              platform.processor(), "torch": torch.__version__, "dtype": preset["dtype"], "budget": preset["budget"],
              "model": preset["model"], "weights_gib": weight_bytes(model) / 2**30,
              "copy_bandwidth_gbs": bandwidth / 1e9, "rows": []}
    out = Path(args.out) if args.out else None
    # the configurations that decide the targets first (a time limit may cut the tail); dense runs the stock
    # transformers path (SDPA + DynamicCache) on the same weights by switching the attention implementation back
    kvpop.retrofit(model, kvpop.Budget(*preset["budget"]), scorer="mlstm")
    model.kvpop_runtime.compile_decode = device.type == "cuda" and not args.no_compile
    result["compiled_decode_step"] = model.kvpop_runtime.compile_decode
    lengths = sorted(preset["lengths"], key=lambda n: (n != max(preset["lengths"]), n))
    plan = [(p, length, batch) for batch in sorted(preset["batches"]) for length in lengths
            for p in ("kvpop", "dense") if p in args.policies]
    if "streaming" in args.policies:
        plan += [("streaming", length, batch) for batch in sorted(preset["batches"]) for length in lengths]
    if args.isolate:
        return _isolated(args, plan, result, out, started)
    for policy, length, batch in plan:
        model.config._attn_implementation = "sdpa" if policy == "dense" else "kvpop"
        if time.perf_counter() - started > args.time_limit:
            result["rows"].append({"policy": policy, "context": length, "batch": batch, "skipped": "time limit"})
            continue
        try:
            row = run_config(model, policy, length, batch, preset, device, bandwidth)
        except torch.OutOfMemoryError as err:
            row = {"policy": policy, "context": length, "batch": batch, "oom": str(err).splitlines()[0][:160]}
            torch.cuda.empty_cache()
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        if out:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=2))
    return _finish(result, out, args)


def _finish(result, out, args):
    from pipelines import ledger

    print(table(result))
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        out.with_suffix(".md").write_text(table(result) + "\n")
        ledger.publish_file("decode", out, result, args)
    return result


def _isolated(args, plan, result, out, started):
    """Each (policy, context, batch) in its own ``python decode.py`` process; rows gathered into one result."""
    import subprocess
    import sys
    import tempfile

    for policy, length, batch in plan:
        if time.perf_counter() - started > args.time_limit:
            result["rows"].append({"policy": policy, "context": length, "batch": batch, "skipped": "time limit"})
            continue
        with tempfile.TemporaryDirectory() as tmp:
            child = Path(tmp) / "row.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--preset", args.preset, "--lengths", str(length),
                   "--batches", str(batch), "--policies", policy, "--out", str(child), "--no-publish"]
            cmd += (["--steps", str(args.steps)] if args.steps else []) + (["--no-compile"] if args.no_compile else [])
            proc = subprocess.run(cmd, capture_output=True, text=True)
            rows = json.loads(child.read_text())["rows"] if child.is_file() else []
        if not rows:
            rows = [{"policy": policy, "context": length, "batch": batch,
                     "error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]}]
        result["rows"] += rows
        print(json.dumps(rows[-1]), flush=True)
        if out:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=2))
    result["isolated"] = True
    return _finish(result, out, args)


def table(result) -> str:
    lines = [f"Decode on {result['device']} ({result['dtype']}, budget {tuple(result['budget'])}, weights "
             f"{result['weights_gib']:.2f} GiB, copy bandwidth {result['copy_bandwidth_gbs']:.0f} GB/s)", "",
             "| policy | context | batch | prefill s | eager ms/tok | graph ms/tok | floor ms | × floor | "
             "decode peak GiB | cache GiB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "oom" in r or "skipped" in r or "error" in r:
            lines.append(f"| {r['policy']} | {r['context']} | {r['batch']} | "
                         f"{r.get('oom', r.get('skipped', r.get('error')))} |"
                         " | | | | | |")
            continue
        lines.append(f"| {r['policy']} | {r['context']} | {r['batch']} | {r['prefill_s']:.2f} | {r['eager_ms']:.2f} | "
                     f"{r.get('graph_ms', float('nan')):.2f} | {r['floor_ms']:.3f} | {r['x_floor']:.1f} | "
                     f"{r.get('decode_peak_gib', float('nan')):.2f} | {r['cache_gib']:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
