"""Evaluation that can tell policies apart, on the GPU (issue 11), through the project's own evaluation stage.

SmolLM2-135M-Instruct at S = 4096 with the trained scorer of ``configs/smollm2_quality.yaml``: every policy at
CR 75 / 87.5 / 93.75 / 96.9 %, with 95 % bootstrap intervals over items and paired differences. Parts, each timed
and announced as it starts and ends:

1. ``model`` — the preset's precompute and train stages (both resume: a trained scorer costs nothing), or
   ``--checkpoint``;
2. ``calibrate`` — dense greedy exact match on every recall cell (task × context × depth); cells with dense >=
   ``--min-dense`` are the headline cells, and the evaluation runs the tasks, contexts and depths that have one (all
   of them, said so, if none has);
3. ``evaluate`` — ``pipelines.evaluate.run``: ``--sequences`` held-out sequences (TOVA / H2O on the first
   ``--dynamic-sequences``), the recall cells, ``--prompts`` long generations of ``--tokens`` tokens;
4. ``write`` — ``results/eval_<device>[_<tag>].json`` (summary, calibration, sizes, seconds, checks) and ``.md``.

Checks: the harness discriminates (oracle − streaming recall exact match resolved above 0 at some CR); the held-out
sequences a 0.005 top-1 difference needs, from the measured paired SD of kvpop − streaming.

Examples::

    python research/eval_h200.py                                    # the H200 run
    python research/eval_h200.py --config configs/default.yaml --checkpoint .kvpop/runs/<run>/final_model \\
        --sequences 4 --batch 2 --crs 0.75 --contexts 128 --depths 0.2 --task-samples 2 --prompts 2 --tokens 8 \\
        --min-dense 0 --tag cpu-smoke --out /tmp/eval-smoke                # a small CPU check
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

CRS = (0.75, 0.875, 0.9375, 0.96875)


def say(text: str) -> None:
    print(f"[eval_h200 {time.strftime('%H:%M:%S')}] {text}", flush=True)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(REPO / "configs" / "smollm2_quality.yaml"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more config overrides")
    p.add_argument("--checkpoint", default="", help="a trained retrofitted model (skips precompute and train)")
    p.add_argument("--sequences", type=int, default=None, help="held-out sequences (default: the preset's; another "
                   "count changes the data hash, so precompute and train run again)")
    p.add_argument("--batch", type=int, default=32, help="held-out sequences per teacher-forced batch")
    p.add_argument("--dynamic-sequences", type=int, default=32, help="TOVA / H2O on the first N (0 = all)")
    p.add_argument("--crs", type=float, nargs="+", default=list(CRS))
    p.add_argument("--tasks", nargs="+", default=None, help="recall tasks (default: every task)")
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5])
    p.add_argument("--task-samples", type=int, default=8, help="per cell")
    p.add_argument("--min-dense", type=float, default=0.9)
    p.add_argument("--prompts", type=int, default=32, help="long-generation prompts (0 = none)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per long generation (prompts are ~70-200 tokens: "
                   "at 512, CR 75 %% never evicts)")
    p.add_argument("--generation-batch", type=int, default=64, help="prompts per generation batch (batched by length)")
    p.add_argument("--resamples", type=int, default=4000)
    p.add_argument("--tag", default="")
    p.add_argument("--out", default=str(REPO / "research" / "results"))
    return p.parse_args(argv)


def overrides(args, tasks, contexts, depths) -> list[str]:
    def as_list(values):
        return "[" + ",".join(str(v) for v in values) + "]"

    sets = [*args.set, f"eval.compression_ratios={as_list(args.crs)}", "eval.budgets=[]",
            f"eval.batch_size={args.batch}", f"eval.dynamic_sequences={args.dynamic_sequences}",
            f"eval.tasks={as_list(tasks)}", f"eval.task_contexts={as_list(contexts)}",
            f"eval.task_depths={as_list(depths)}", f"eval.task_samples={args.task_samples}",
            f"eval.task_min_dense={args.min_dense}", f"eval.generation_prompts={args.prompts}",
            f"eval.generation_tokens={args.tokens}", f"eval.generation_batch_size={args.generation_batch}",
            f"eval.resamples={args.resamples}"]
    if args.sequences is not None:
        sets.append(f"data.eval_sequences={args.sequences}")
    if args.checkpoint:
        sets.append(f"eval.checkpoint={Path(args.checkpoint).resolve()}")
    return sets


def calibrate(cfg, path, tasks, device) -> list[dict]:
    """Dense greedy exact match per recall cell (the evaluation's own sample generator and scorer)."""
    from kvpop import evaluation as runner
    from kvpop.retrofit import saved_model_config
    from pipelines import eval_parts
    from pipelines.data import load_tokenizer

    tokenizer = eval_parts.checkpoint_tokenizer(path) or load_tokenizer(cfg)
    context = saved_model_config(path).get("max_position_embeddings")
    samples = eval_parts.recall_samples(cfg, tokenizer, context)
    model, reference = eval_parts.load_models(cfg, path, device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    records = runner.generation_items(model, [s.prompt_ids for s in samples], [], forced=None, pad_id=pad,
                                      max_new_tokens=cfg.eval.max_new_tokens, eos_id=tokenizer.eos_token_id,
                                      batch_size=cfg.eval.generation_batch_size, reference=reference)
    scored = eval_parts.recall_records(records, samples, tokenizer, cfg.eval.task_min_dense)
    cells: dict[tuple, list[float]] = {}
    for r in scored:
        cells.setdefault((r["task"], r["context"], r["depth"]), []).append(r["exact"])
    del model, reference
    return [{"task": t, "context": c, "depth": d, "dense_exact": sum(v) / len(v), "n": len(v)}
            for (t, c, d), v in sorted(cells.items())]


def checks(summary: dict) -> tuple[list[str], dict]:
    from pipelines import stats

    lines, facts = [], {}
    recall = [d for d in summary["differences"] if d["policy"] == "oracle" and d["vs"] == "streaming"
              and d["metric"] == "recall_exact"]
    found = [d for d in recall if d["resolved"] and d["estimate"] > 0]
    facts["discriminates"] = bool(found)
    for d in recall:
        lines.append(f"oracle - streaming recall exact match at B = {d['B']}: {d['estimate']:+.3f} "
                     f"[{d['lo']:+.3f}, {d['hi']:+.3f}] over {d['n']} samples"
                     f"{' (resolved)' if d['resolved'] else ''}")
    lines.append("the harness discriminates (an oracle - streaming recall interval excludes 0 at some CR): "
                 + ("YES" if found else "NO"))
    facts["sequences_for_0.005_top1"] = {}
    for d in summary["differences"]:
        if d["policy"] == "kvpop" and d["vs"] == "streaming" and d["metric"] == "top1_agreement":
            need = stats.items_needed(d["sd"], 0.005)
            facts["sequences_for_0.005_top1"][d["B"]] = need
            lines.append(f"B = {d['B']}: paired SD of kvpop - streaming top-1 {d['sd']:.4f} over {d['n']} sequences "
                         f"-> a 0.005 difference needs ~{need:.0f} sequences")
    return lines, facts


def main(argv=None) -> int:
    args = parse(argv)
    import torch

    from pipelines import evaluate, precompute, train
    from pipelines.config import load_config
    from benchmarks.naming import device_name, result_stem
    from pipelines.recall import TASKS

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = device_name(device)
    tasks = args.tasks or list(TASKS)
    seconds = {}
    cfg = load_config(args.config, overrides(args, tasks, args.contexts, args.depths))
    say(f"device {name}; config {args.config}; S = {cfg.data.seq_len}; {cfg.data.eval_sequences} held-out "
        f"sequences; CRs {args.crs}")

    say("part model: start")
    t0 = time.perf_counter()
    if not args.checkpoint:
        precompute.run(cfg)
        train.run(cfg)
    path = evaluate.trained_model_path(cfg)
    seconds["model"] = time.perf_counter() - t0
    say(f"part model: {path} ({seconds['model']:.0f} s)")

    calibration, chosen = [], (tasks, args.contexts, args.depths)
    if args.task_samples:
        say(f"part calibrate: start ({len(tasks)} tasks x {len(args.contexts)} contexts x {len(args.depths)} depths"
            f" x {args.task_samples} samples, dense)")
        t0 = time.perf_counter()
        calibration = calibrate(cfg, path, tasks, device)
        good = [c for c in calibration if c["dense_exact"] >= args.min_dense]
        if good:
            chosen = tuple(sorted({c[key] for c in good}, key=order.index) for key, order in
                           (("task", tasks), ("context", args.contexts), ("depth", args.depths)))
        seconds["calibrate"] = time.perf_counter() - t0
        for c in calibration:
            say(f"  {c['task']} context {c['context']} depth {c['depth']:g}: dense {c['dense_exact']:.2f} "
                f"({c['n']} samples)")
        say(f"part calibrate: {len(good)} of {len(calibration)} cells with dense >= {args.min_dense}; evaluating "
            f"tasks {chosen[0]}, contexts {chosen[1]}, depths {chosen[2]} ({seconds['calibrate']:.0f} s)")
        cfg = load_config(args.config, overrides(args, *chosen))

    say("part evaluate: start")
    t0 = time.perf_counter()
    result = evaluate.run(cfg)
    seconds["evaluate"] = time.perf_counter() - t0
    seconds["evaluate_parts"] = result.seconds
    say(f"part evaluate: {result.output_dir} ({seconds['evaluate']:.0f} s; parts "
        + ", ".join(f"{k} {v:.0f} s" for k, v in result.seconds.items()) + ")")

    lines, facts = checks(result.summary)
    for line in lines:
        say(line)
    metrics = json.loads((result.output_dir / "metrics.json").read_text())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = result_stem("eval", name, args.tag)
    record = {"device": name, "config": Path(args.config).name, "overrides": overrides(args, *chosen),
              "torch": torch.__version__, "seq_len": cfg.data.seq_len, "eval_dir": str(result.output_dir),
              "mlflow_run": result.run_id, "calibration": calibration, "recall_evaluated": chosen,
              "seconds": seconds, "checks": lines, "facts": facts, **metrics}
    (out / f"{stem}.json").write_text(json.dumps(record, indent=1, default=float))
    from pipelines import report

    labels = {(x["policy"], x["B"]): x["budget"] for x in metrics["labels"]}
    tables = report.format_report(metrics["summary"], metrics["budgets"], labels=labels,
                                  unreachable=metrics["unreachable"], evicting=metrics.get("generation_evicting"),
                                  markdown=True)
    md = [f"# Evaluation with intervals ({name}, {Path(args.config).name})", "",
          f"S = {cfg.data.seq_len}; {cfg.data.eval_sequences} held-out sequences (TOVA / H2O on "
          f"{min(args.dynamic_sequences or cfg.data.eval_sequences, cfg.data.eval_sequences)}); recall: tasks {', '.join(chosen[0])}, contexts {chosen[1]}, depths "
          f"{chosen[2]}, {args.task_samples} samples per cell; long generation: {args.prompts} prompts x "
          f"{args.tokens} tokens. Seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in seconds.items()
                                                         if isinstance(v, float)) + ".", "",
          "## Calibration (dense greedy exact match per cell)", "",
          *[f"- {c['task']} context {c['context']} depth {c['depth']:g}: {c['dense_exact']:.2f} ({c['n']})"
            for c in calibration], "", "## Checks", "", *[f"- {line}" for line in lines], "",
          "## Results", "", tables, ""]
    (out / f"{stem}.md").write_text("\n".join(md))
    say(f"wrote {out / stem}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
