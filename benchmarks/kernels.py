"""Kernel benchmarks (issue 6 §2–3, issue 4's precompute cost): FlexAttention paths on one layer's shapes.

1. correctness: the compiled, block-sparse retention attention vs the chunked dense-mask reference;
2. targets: the transposed target pass vs the teacher's causal forward (time, peak memory) vs S;
3. training step: KVpop-masked forward + backward vs causal FlexAttention at 16k, block-structure cost apart;
4. precompute: ``kvpop.targets.teacher_pass`` on a SmolLM2-shaped model at S = 8192 (tokens/s, peak memory,
   share of the target pass).

    python -m benchmarks.kernels --preset h200 --out benchmarks/results/kernels_h200.json
    python -m benchmarks.kernels --preset cpu-tiny
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kvpop import Budget

PRESETS = {
    "h200": dict(dtype="bfloat16", heads=(16, 8), head_dim=128, target_lengths=[16384, 65536],
                 train_length=16384, budget=(4, 128, 1916), reps=5, precompute_length=8192, precompute_batch=1,
                 check_length=2048),
    "cpu-tiny": dict(dtype="float32", heads=(4, 2), head_dim=16, target_lengths=[256], train_length=256,
                     budget=(2, 16, 46), reps=1, precompute_length=128, precompute_batch=1, check_length=200),
}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, reps):
    fn()  # warm-up / compile
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(reps):
        out = fn()
    _sync(device)
    seconds = (time.perf_counter() - start) / reps
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return seconds, peak, out


def retention_inputs(bsz, hq, hkv, size, dim, budget, device, dtype, pad=0):
    from kvpop.retention import eviction_positions

    positions = (torch.arange(size, device=device)[None, :] - torch.tensor([0, pad][:bsz], device=device)[:, None])
    evict = eviction_positions(torch.randn(bsz, hkv, size, device=device), budget, positions=positions[:, None, :])
    q = torch.randn(bsz, hq, size, dim, device=device, dtype=dtype)
    k = torch.randn(bsz, hkv, size, dim, device=device, dtype=dtype)
    v = torch.randn(bsz, hkv, size, dim, device=device, dtype=dtype)
    return q, k, v, positions, evict, positions >= 0


def check_correctness(p, device, dtype):
    from kvpop.attention import retention_attention

    hq, hkv = p["heads"]
    budget = Budget(*p["budget"])
    rows = []
    for pad in (0, 300):
        q, k, v, pos, evict, valid = retention_inputs(2, hq, hkv, p["check_length"], p["head_dim"],
                                                      Budget(budget.sink, budget.window, 200), device, dtype, pad)
        kw = dict(q_pos=pos, kv_pos=pos[:, None], kv_evict=evict, kv_valid=valid[:, None],
                  budget=Budget(budget.sink, budget.window, 200), scale=p["head_dim"] ** -0.5)
        fast = retention_attention(q, k, v, backend="flex", **kw).float()
        ref = retention_attention(q.float(), k.float(), v.float(), backend="chunked", **kw)
        rows.append({"pad": pad, "max_abs_err": (fast - ref).abs().max().item()})
    return rows


def bench_targets(p, device, dtype):
    from kvpop.targets import causal_attention_with_lse, future_attention_targets

    hq, hkv = p["heads"]
    rows = []
    for size in p["target_lengths"]:
        q = torch.randn(1, hq, size, p["head_dim"], device=device, dtype=dtype)
        k = torch.randn(1, hkv, size, p["head_dim"], device=device, dtype=dtype)
        v = torch.randn_like(k)
        scale = p["head_dim"] ** -0.5
        t_fwd, m_fwd, (_, lse) = timed(lambda: causal_attention_with_lse(q, k, v, scale=scale), device, p["reps"])
        t_tgt, m_tgt, _ = timed(lambda: future_attention_targets(q, k, p["budget"][1], lse=lse, scale=scale),
                                device, p["reps"])
        rows.append({"S": size, "forward_ms": 1e3 * t_fwd, "targets_ms": 1e3 * t_tgt, "ratio": t_tgt / t_fwd,
                     "forward_peak_gib": m_fwd, "targets_peak_gib": m_tgt})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def bench_train_step(p, device, dtype):
    from torch.nn.attention.flex_attention import create_block_mask

    from kvpop.attention import flex
    from kvpop.retention import eviction_positions

    hq, hkv = p["heads"]
    size, budget = p["train_length"], Budget(*p["budget"])
    q = torch.randn(1, hq, size, p["head_dim"], device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(1, hkv, size, p["head_dim"], device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(1, hkv, size, p["head_dim"], device=device, dtype=dtype, requires_grad=True)
    prio = torch.randn(1, hkv, size, device=device)

    def causal_mod(b, h, qi, ki):
        return ki <= qi

    t_causal_mask, _, causal_bm = timed(lambda: create_block_mask(causal_mod, None, None, size, size, device=device,
                                                                  _compile=device.type == "cuda"), device, p["reps"])

    def structure():  # what a layer of the training forward builds: its eviction positions + the shared structure
        import copy

        from kvpop.attention import _causal_structure, _contiguous_mask_mod
        evict = eviction_positions(prio, budget)
        block_mask = copy.copy(_causal_structure(size, str(device)))
        block_mask.mask_mod = _contiguous_mask_mod(evict, budget.sink, budget.window, hq // hkv)
        return block_mask

    t_evict, _, _ = timed(lambda: eviction_positions(prio, budget), device, p["reps"])
    t_struct, _, kv_bm = timed(structure, device, p["reps"])

    def step(bm):
        def run():
            out = flex(q, k, v, block_mask=bm, enable_gqa=True)
            out.float().sum().backward()
            return out
        return run

    t_c, m_c, _ = timed(step(causal_bm), device, p["reps"])
    t_k, m_k, _ = timed(step(kv_bm), device, p["reps"])
    density = (kv_bm.kv_num_blocks.sum() + kv_bm.full_kv_num_blocks.sum()).item() / max(
        1, (causal_bm.kv_num_blocks.sum() + causal_bm.full_kv_num_blocks.sum()).item())
    row = {"S": size, "budget": list(p["budget"]), "causal_fwd_bwd_ms": 1e3 * t_c, "kvpop_fwd_bwd_ms": 1e3 * t_k,
           "ratio": t_k / t_c, "eviction_positions_ms": 1e3 * t_evict, "block_structure_ms": 1e3 * t_struct,
           "causal_create_block_mask_ms": 1e3 * t_causal_mask, "block_density_vs_causal": density,
           "causal_peak_gib": m_c, "kvpop_peak_gib": m_k}
    print(json.dumps(row), flush=True)
    return row


def bench_precompute(p, device, dtype):
    """teacher_pass on SmolLM2-135M's shape (random weights: throughput does not depend on the values)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvpop.targets import teacher_pass

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=max(8192, p[
                             "precompute_length"]), tie_word_embeddings=True, attn_implementation="sdpa")
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    ids = torch.randint(0, 49152, (p["precompute_batch"], p["precompute_length"]), device=device)
    with torch.no_grad():
        t_fwd, m_fwd, _ = timed(lambda: model.model(input_ids=ids).last_hidden_state, device, p["reps"])
        t_pass, m_pass, _ = timed(lambda: teacher_pass(model, ids, windows=[128], top_k=256), device, p["reps"])
    tokens = ids.numel()
    row = {"S": p["precompute_length"], "batch": p["precompute_batch"], "sdpa_forward_ms": 1e3 * t_fwd,
           "teacher_pass_ms": 1e3 * t_pass, "tokens_per_s": tokens / t_pass, "teacher_pass_peak_gib": m_pass,
           "sdpa_forward_peak_gib": m_fwd, "pass_over_forward": t_pass / t_fwd}
    print(json.dumps(row), flush=True)
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="h200")
    parser.add_argument("--out", default="")
    parser.add_argument("--only", nargs="*", default=["correctness", "targets", "train", "precompute"])
    args = parser.parse_args(argv)
    p = PRESETS[args.preset]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, p["dtype"])
    torch._dynamo.config.cache_size_limit = 64
    result = {"preset": args.preset, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "dtype": p["dtype"]}
    out = Path(args.out) if args.out else None
    steps = {"correctness": lambda: check_correctness(p, device, dtype), "targets": lambda: bench_targets(p, device, dtype),
             "train": lambda: bench_train_step(p, device, dtype),
             "precompute": lambda: bench_precompute(p, device, dtype)}
    for name in args.only:
        start = time.perf_counter()
        try:
            result[name] = steps[name]()
        except Exception as err:  # keep the other measurements
            result[name] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
        print(f"{name}: {time.perf_counter() - start:.1f} s", json.dumps(result[name])[:400], flush=True)
        if out:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
