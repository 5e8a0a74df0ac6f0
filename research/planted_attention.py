"""Does a planted question make the teacher's future attention reach the planted fact? (``data.recall_mix``)

For ``--samples`` corpus sequences of ``--seq-len`` champ tokens, plant facts and a question with
:class:`pipelines.planted.Planter` (exactly as the data stage does), then compute the teacher's targets (METHOD §2, the
scorers' window, ``--query-power``) for the planted sequence and for a *control*: the same facts, with the question
replaced by the corpus tokens that were there. Per (layer, KV head), the rank of the asked fact's answer token (its
first token in the fact) among the tokens that leave the window before the end; the share of (layer, head) pairs
where it ranks within ``--topk`` long-range slots, i.e. where the oracle at that budget keeps it. Writes
``planted_attention_<device>.json`` + ``.md``.

    python research/planted_attention.py --samples 8 --seq-len 512 --window 64 --topk 32 128   # ~1 min on 2 cores
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--topk", type=int, nargs="+", default=[32, 128])
    p.add_argument("--query-power", type=float, default=16.0)
    p.add_argument("--out", default=str(REPO / "research" / "results"))
    args = p.parse_args(argv)
    import torch
    from transformers import AutoTokenizer

    from benchmarks.naming import device_name, result_stem
    from kvpop.pretrained import load_pretrained
    from kvpop.targets import teacher_pass
    from pipelines.data import champ_documents
    from pipelines.models import smollm2_dir
    from pipelines.planted import Planter

    t0 = time.perf_counter()
    folder = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model, _ = load_pretrained(folder)
    model.eval()
    planter = Planter(tokenizer, args.seq_len)
    docs = champ_documents()
    rows = []
    for sample in range(args.samples):
        rng = random.Random(sample)
        text = "\n\n".join(t for _, t in rng.sample(docs, 4))
        corpus = tokenizer(text, add_special_tokens=False)["input_ids"][:args.seq_len]
        ids, name = planter.plant(corpus, rng)
        end = len(planter.answer_end)
        place = next(p for p, t in planter.places.items() if ids[-end - len(t):-end] == t)
        answer = planter.places[place]
        at = next(i for i in range(len(ids)) if ids[i:i + len(answer)] == answer)  # the fact's, before the question
        asked = len(next(q for (_, n), q in planter.questions.items() if n == name)) + len(answer) + end
        control = ids[:-asked] + corpus[-asked:]
        row = {"sample": sample, "name": name, "place": place, "position": at}
        for label, seq in (("planted", ids), ("control", control)):
            targets = teacher_pass(model, torch.tensor([seq]), [args.window], top_k=0,
                                   query_power=args.query_power)["targets"][args.window][:, 0]  # [layers, Hkv, S]
            candidates = targets[..., :args.seq_len - args.window]
            rank = (candidates > candidates[..., at:at + 1]).sum(-1).flatten().tolist()
            row[label] = {"median_rank": statistics.median(rank),
                          **{f"kept_top{k}": sum(r < k for r in rank) / len(rank) for k in args.topk}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    device = device_name(torch.device("cpu"))
    summary = {label: {key: statistics.mean(r[label][key] for r in rows) for key in rows[0][label]}
               for label in ("planted", "control")}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = result_stem("planted_attention", device, "")
    record = {"args": vars(args), "rows": rows, "summary": summary, "seconds": time.perf_counter() - t0}
    keys = list(rows[0]["planted"])
    md = [f"# Planted facts and the teacher's future attention ({device})", "",
          f"SmolLM2-135M-Instruct fp32, champ text, S = {args.seq_len}, window {args.window}, β = {args.query_power}; "
          f"{args.samples} samples (seeds 0..{args.samples - 1}); per (layer, KV head) the rank of the asked fact's "
          f"answer token among the tokens that leave the window; kept_topK = share of (layer, head) pairs where it is "
          f"within K long-range slots. Control: the same facts without the question.", "",
          "| sample | name | fact at | " + " | ".join(f"planted {k} | control {k}" for k in keys) + " |",
          "|---" * (3 + 2 * len(keys)) + "|"]
    for r in rows:
        md.append(f"| {r['sample']} | {r['name']} | {r['position']} | " + " | ".join(
            f"{r['planted'][k]:.2f} | {r['control'][k]:.2f}" for k in keys) + " |")
    md.append("| mean | | | " + " | ".join(f"{summary['planted'][k]:.2f} | {summary['control'][k]:.2f}"
                                          for k in keys) + " |")
    lower = sum(r["planted"]["median_rank"] < r["control"]["median_rank"] for r in rows)
    md += ["", f"The question moves the fact up (a lower median rank than its control) in {lower} of {len(rows)} "
           f"samples."]
    record["planted_ranks_lower"] = lower
    (out / f"{stem}.json").write_text(json.dumps(record, indent=1))
    (out / f"{stem}.md").write_text("\n".join(md) + "\n")
    print(f"wrote {out / stem}.json and .md ({record['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
