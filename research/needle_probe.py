"""Does a policy keep a needle? Greedy exact match on recall prompts under each policy, the oracle ranked by METHOD
§2's mean future attention (``query_power`` 1) and by a power mean (``--query-powers``), next to dense, streaming,
TOVA and the trained scorer — the probe behind ``precompute.query_power`` (docs/METHOD.md §2).

    python research/needle_probe.py --checkpoint /tmp/ckpt/final_model --total 512 \\
        --cells niah_single:1024:0.1 niah_single:1024:0.5 --samples 6 --out research/results   # ~8 min on 2 CPU cores

Writes ``needle_probe_<device>.json`` + ``.md`` (hits / samples per cell and policy; exact intervals are the reader's:
the counts are small).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="a retrofitted model folder (kvpop.save_retrofitted)")
    p.add_argument("--total", type=int, default=512, help="budget B (sink and window from the checkpoint)")
    p.add_argument("--cells", nargs="+", default=["niah_single:1024:0.1"], help="task:context:depth")
    p.add_argument("--samples", type=int, default=6)
    p.add_argument("--policies", nargs="+", default=["streaming", "tova", "kvpop", "oracle"])
    p.add_argument("--query-powers", type=float, nargs="+", default=[1.0, 16.0], help="the oracle's target β")
    p.add_argument("--out", default=str(REPO / "research" / "results"))
    args = p.parse_args(argv)
    import torch
    from transformers import AutoTokenizer

    import kvpop
    from kvpop import Budget
    from benchmarks.naming import device_name, result_stem
    from kvpop import evaluation as runner
    from pipelines.recall import TaskSpec, generate_samples, score_text

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tok = AutoTokenizer.from_pretrained(args.checkpoint, local_files_only=True)
    model, _ = kvpop.load_retrofitted(args.checkpoint, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    model = model.to(device).eval()
    base = json.loads((Path(args.checkpoint) / "kvpop.json").read_text())["budget"]
    budget = Budget.from_total(args.total, sink=base["sink"], window=base["window"])
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    rows = []
    for cell in args.cells:
        task, context, depth = cell.split(":")
        samples = generate_samples(TaskSpec(task, int(context), float(depth), args.samples, 0), tok)
        prompts = [s.prompt_ids for s in samples]
        # one call for the policies without targets (dense runs in every call: once here), one per oracle β
        plain = [runner.Setting(name, budget) for name in args.policies if name != "oracle"]
        runs = [(None, plain, {})] if plain else []
        if "oracle" in args.policies:
            runs += [(f"oracle β={b:g}", [runner.Setting("oracle", budget)], {"query_power": b})
                     for b in args.query_powers]
        hits = {}
        t0 = time.perf_counter()
        for label, settings, options in runs:
            found = runner.generation_items(model, prompts, settings, max_new_tokens=12, eos_id=tok.eos_token_id,
                                            pad_id=pad, batch_size=len(prompts), forced=None, target_options=options)
            for r in found:
                name = r["policy"] if label is None or r["policy"] == "dense" else label
                text = tok.decode(r["tokens"], skip_special_tokens=True)
                hits.setdefault(name, []).append(bool(score_text(samples[r["item"]], text)))
        row = {"cell": cell, "B": budget.total, "budget": str(budget), "seconds": time.perf_counter() - t0,
               "hits": {k: sum(v[:len(samples)]) for k, v in hits.items()}, "samples": len(samples)}
        rows.append(row)
        print(f"{cell} B={budget.total}: " + ", ".join(f"{k} {v}/{len(samples)}" for k, v in row["hits"].items())
              + f" ({row['seconds']:.0f} s)", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = result_stem("needle_probe", device_name(device))
    (out / f"{stem}.json").write_text(json.dumps({"checkpoint": args.checkpoint, "device": str(device),
                                                  "torch": torch.__version__, "rows": rows}, indent=1))
    names = list(rows[0]["hits"]) if rows else []
    md = [f"# Needle probe ({device}, {Path(args.checkpoint).name}, B = {args.total})", "",
          "Greedy exact match, hits / samples; dense counted once per cell (its first run).", "",
          "| cell | " + " | ".join(names) + " |", "|---|" + "---|" * len(names),
          *[f"| {r['cell']} | " + " | ".join(f"{r['hits'].get(n, 0)}/{r['samples']}" for n in names) + " |"
            for r in rows], ""]
    (out / f"{stem}.md").write_text("\n".join(md))
    print(f"wrote {out / stem}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
