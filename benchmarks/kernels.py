"""Kernel benchmarks (issue 6 §2–3, issue 4's precompute cost): FlexAttention paths on one layer's shapes.

1. correctness: the compiled, block-sparse retention attention and the compact path (per-query-block gathered keys,
   forward and gradients) vs the chunked dense-mask reference;
2. targets: the transposed target pass vs the teacher's causal forward (time, peak memory) vs S;
3. training step: KVpop-masked forward + backward (block-sparse over the causal structure, and compact) vs causal
   FlexAttention at 16k, block-structure / index-building cost apart;
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
    # target shapes (query heads, KV heads, head_dim, S): Qwen3-0.6B's attention, and SmolLM2-135M's (the teacher
    # the quality benchmark precomputes with)
    "h200": dict(dtype="bfloat16", heads=(16, 8), head_dim=128,
                 target_shapes=[(16, 8, 128, 16384), (16, 8, 128, 65536), (9, 3, 64, 8192), (9, 3, 64, 32768)],
                 train_length=16384, budget=(4, 128, 1916), reps=5, precompute_length=8192, precompute_batch=1,
                 check_length=2048),
    "cpu-tiny": dict(dtype="float32", heads=(4, 2), head_dim=16, target_shapes=[(4, 2, 16, 256)], train_length=256,
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
        if pad == 0:
            rows.append(_check_compact(q, k, v, evict, kw))
    return rows


def _check_compact(q, k, v, evict, kw):
    """The compact path (flex on CUDA; its SDPA kernel on CPU, where flex has no backward) vs chunked, with grads."""
    from kvpop.attention import compact_retention_attention, retention_attention

    kernel = "flex" if q.is_cuda else "sdpa"
    upstream = torch.randn(q.shape[0], q.shape[2], q.shape[1], q.shape[3], device=q.device)

    def out_and_grads(inputs, attend):
        inputs = [x.detach().requires_grad_() for x in inputs]
        out = attend(*inputs)
        return [out.float(), *torch.autograd.grad((out.float() * upstream).sum(), inputs)]

    fast = out_and_grads((q, k, v), lambda *x: compact_retention_attention(
        *x, evict, kw["budget"], scale=kw["scale"], kernel=kernel))
    ref = out_and_grads((q.float(), k.float(), v.float()), lambda *x: retention_attention(*x, backend="chunked", **kw))
    out_err, *grad_errs = ((a.float() - b).abs().max().item() for a, b in zip(fast, ref))
    return {"pad": 0, "path": f"compact ({kernel})", "max_abs_err": out_err,
            **{f"{name}_max_abs_err": err for name, err in zip(("dq", "dk", "dv"), grad_errs)}}


def bench_targets(p, device, dtype):
    """The target pass vs the causal forward it follows, plus two probes of where its time goes (CUDA):
    without the LSE score_mod (not a valid target: the mod's cost), and carrying ``exp(-LSE)`` in the value instead
    of subtracting it in a score_mod (same targets up to bf16 rounding of the output)."""
    from kvpop.targets import causal_attention_with_lse, future_attention_targets

    rows = []
    for hq, hkv, dim, size in p["target_shapes"]:
        q = torch.randn(1, hq, size, dim, device=device, dtype=dtype)
        k = torch.randn(1, hkv, size, dim, device=device, dtype=dtype)
        v = torch.randn_like(k)
        scale = dim ** -0.5
        window = p["budget"][1]
        t_fwd, m_fwd, (_, lse) = timed(lambda: causal_attention_with_lse(q, k, v, scale=scale), device, p["reps"])
        t_tgt, m_tgt, y = timed(lambda: future_attention_targets(q, k, window, lse=lse, scale=scale),
                                device, p["reps"])
        row = {"heads": [hq, hkv], "head_dim": dim, "S": size, "forward_ms": 1e3 * t_fwd, "targets_ms": 1e3 * t_tgt,
               "ratio": t_tgt / t_fwd, "forward_peak_gib": m_fwd, "targets_peak_gib": m_tgt}
        if device.type == "cuda":
            row.update(_target_probes(q, k, lse, window, scale, y, t_fwd, p["reps"], device))
        rows.append(row)
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _target_probes(q, k, lse, window, scale, reference, t_fwd, reps, device):
    from kvpop.targets import _compiled_flex, _future_block_mask
    from torch.nn.attention.flex_attention import AuxRequest

    _, hq, size, _ = q.shape
    group = hq // k.shape[1]
    rows_in = k.repeat_interleave(group, dim=1)
    block_mask = _future_block_mask(size, window, str(q.device))
    narrow = q.new_zeros(1, hq, size, 16)
    flex = _compiled_flex()

    def no_mod():
        return flex(rows_in, q, narrow, block_mask=block_mask, scale=scale, return_aux=AuxRequest(lse=True))[1].lse

    def lse_in_value():  # Σ_d exp(s_td - lse_d) = out_t · exp(rowLSE_t) with v_d = exp(-lse_d)
        value = narrow.clone()
        value[..., 0] = torch.exp(-lse).to(q.dtype)
        out, aux = flex(rows_in, q, value, block_mask=block_mask, scale=scale, return_aux=AuxRequest(lse=True))
        log_mass = out[..., 0].float().log() + aux.lse.float()
        count = (size - torch.arange(size, device=q.device) - window).clamp(min=1).float()
        y = (log_mass - count.log()).view(1, -1, group, size).amax(2)
        return torch.where(torch.isfinite(reference), y, reference)

    t_nomod, _, _ = timed(no_mod, device, reps)
    t_value, m_value, y_value = timed(lse_in_value, device, reps)
    finite = torch.isfinite(reference)
    return {"no_score_mod_ms": 1e3 * t_nomod, "no_score_mod_ratio": t_nomod / t_fwd,
            "lse_in_value_ms": 1e3 * t_value, "lse_in_value_ratio": t_value / t_fwd, "lse_in_value_peak_gib": m_value,
            "lse_in_value_max_abs_diff": (y_value - reference)[finite].abs().max().item()}


def bench_train_step(p, device, dtype):
    from torch.nn.attention.flex_attention import create_block_mask

    from kvpop.attention import compact_layout, compact_retention_attention, flex
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

    evict = eviction_positions(prio, budget)
    kernel = "flex" if device.type == "cuda" else "sdpa"

    def compact_step():  # a layer's whole work: index lists, gather, attention, backward through the gather
        out = compact_retention_attention(q, k, v, evict, budget, scale=p["head_dim"] ** -0.5, kernel=kernel)
        out.float().sum().backward()
        return out

    t_index, _, layout = timed(lambda: compact_layout(evict, budget), device, p["reps"])
    t_p, m_p, _ = timed(compact_step, device, p["reps"])
    if device.type == "cuda":
        t_c, m_c, _ = timed(step(causal_bm), device, p["reps"])
        t_k, m_k, _ = timed(step(kv_bm), device, p["reps"])
    else:
        print("cpu: FlexAttention has no backward here: causal / KVpop-masked flex steps skipped, the compact path "
              "timed through its SDPA kernel", flush=True)
        t_c = m_c = t_k = m_k = None
    ms = lambda t: None if t is None else 1e3 * t  # noqa: E731
    listed = lambda bm: sum(int(n.sum()) for n in (bm.kv_num_blocks, bm.full_kv_num_blocks) if n is not None)  # noqa
    density = listed(kv_bm) / max(1, listed(causal_bm))  # (a structure without full blocks has none listed)
    row = {"S": size, "budget": list(p["budget"]), "causal_fwd_bwd_ms": ms(t_c), "kvpop_fwd_bwd_ms": ms(t_k),
           "ratio": t_k / t_c if t_c else None, "eviction_positions_ms": 1e3 * t_evict,
           "block_structure_ms": 1e3 * t_struct, "causal_create_block_mask_ms": 1e3 * t_causal_mask,
           "block_density_vs_causal": density, "causal_peak_gib": m_c, "kvpop_peak_gib": m_k,
           "kvpop_compact_kernel": kernel, "kvpop_compact_fwd_bwd_ms": 1e3 * t_p,
           "compact_ratio": t_p / t_c if t_c else None, "compact_index_ms": 1e3 * t_index,
           "compact_length": layout.index.shape[-1], "compact_peak_gib": m_p,
           "compact_gathered_kv_gib": 2 * layout.index.numel() * p["head_dim"] * q.element_size() / 2**30}
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


def _num(value, digits=2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _row(*cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def markdown(result: dict) -> str:
    """The measured sections as tables (what `--out` writes next to the JSON as .md)."""
    lines = [f"# Kernels on {result['device']} ({result['dtype']}, torch {result['torch']})", ""]
    if result.get("note"):
        lines += [f"Note: {result['note']}.", ""]
    if isinstance(result.get("correctness"), list):
        lines += ["## Correctness vs the fp32 chunked reference", "",
                  _row("path", "left padding", "max abs err (out / dq / dk / dv)"), "|---|---|---|"]
        for r in result["correctness"]:
            errs = [r.get(k) for k in ("max_abs_err", "dq_max_abs_err", "dk_max_abs_err", "dv_max_abs_err")]
            errs = " / ".join(_num(e, 4) for e in errs if e is not None)
            lines.append(_row(r.get("path", "masked flex"), r["pad"], errs))
        lines.append("")
    if isinstance(result.get("targets"), list):
        lines += ["## Target pass vs causal forward + LSE", "",
                  _row("heads", "head_dim", "S", "forward ms", "targets ms", "ratio", "no score_mod ms (ratio)",
                       "LSE in value ms (ratio)"), "|---|---|---|---|---|---|---|---|"]
        for r in result["targets"]:
            def probe(key, r=r):
                return f"{_num(r[key + '_ms'])} ({_num(r[key + '_ratio'])})" if key + "_ms" in r else "-"
            lines.append(_row("/".join(map(str, r.get("heads", []))), r.get("head_dim", ""), r["S"],
                              _num(r["forward_ms"]), _num(r["targets_ms"]), _num(r["ratio"]), probe("no_score_mod"),
                              probe("lse_in_value")))
        lines.append("")
    train = result.get("train")
    if isinstance(train, dict) and "S" in train:
        lines += [f"## Training step, S = {train['S']}, budget {tuple(train['budget'])}", "",
                  _row("path", "fwd + bwd ms", "vs causal", "peak GiB"), "|---|---|---|---|",
                  _row("causal FlexAttention", _num(train["causal_fwd_bwd_ms"]), "1.00",
                       _num(train["causal_peak_gib"])),
                  _row("KVpop-masked (default)", _num(train["kvpop_fwd_bwd_ms"]), _num(train["ratio"]),
                       _num(train["kvpop_peak_gib"])),
                  _row(f"KVpop compact ({train.get('kvpop_compact_kernel')})",
                       _num(train.get("kvpop_compact_fwd_bwd_ms")), _num(train.get("compact_ratio")),
                       _num(train.get("compact_peak_gib"))), "",
                  f"Per layer: eviction positions {_num(train['eviction_positions_ms'])} ms, eviction positions + "
                  f"block structure {_num(train['block_structure_ms'])} ms, compact index lists "
                  f"{_num(train.get('compact_index_ms'))} ms (L = {train.get('compact_length')}); compiled causal "
                  f"create_block_mask {_num(train['causal_create_block_mask_ms'])} ms.", ""]
    pre = result.get("precompute")
    if isinstance(pre, dict) and "S" in pre:
        lines += [f"## Teacher pass, SmolLM2's shape, S = {pre['S']}", "",
                  f"teacher_pass {_num(pre['teacher_pass_ms'])} ms ({pre['tokens_per_s']:.0f} tokens/s, peak "
                  f"{_num(pre['teacher_pass_peak_gib'])} GiB) vs SDPA forward {_num(pre['sdpa_forward_ms'])} ms: "
                  f"{_num(pre['pass_over_forward'])}×", ""]
    return "\n".join(lines)


def main(argv=None):
    from pipelines import ledger  # here, not at the top: transformers imports a module named `kernels` (this folder's)

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="h200")
    parser.add_argument("--out", default="")
    parser.add_argument("--only", nargs="*", default=["correctness", "targets", "train", "precompute"])
    parser.add_argument("--render", metavar="JSON", help="print (and write as .md) the tables of a result file")
    ledger.add_publish_arguments(parser)
    args = parser.parse_args(argv)
    if args.render:
        result = json.loads(Path(args.render).read_text())
        Path(args.render).with_suffix(".md").write_text(markdown(result))
        print(markdown(result))
        return result
    p = PRESETS[args.preset]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, p["dtype"])
    torch._dynamo.config.cache_size_limit = 64
    result = {"preset": args.preset, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "dtype": p["dtype"]}
    out = Path(args.out) if args.out else None
    steps = {"correctness": lambda: check_correctness(p, device, dtype),
             "targets": lambda: bench_targets(p, device, dtype), "train": lambda: bench_train_step(p, device, dtype),
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
            out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    if out:
        ledger.publish_file("kernels", out, result, args)
    return result


if __name__ == "__main__":
    main()
