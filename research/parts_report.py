"""The report of an evaluation a GPU session cut short: what its ``<key>.parts`` folder finished, without the models.

``pipelines.evaluate.parts_summary`` reads every finished part (a trained baseline's as rows of its own name) and
bootstraps them as the complete evaluation would; this writes ``<out>/<name>.json`` (summary + the parts read) and
``.md``. Example (the fourth session's recipe evaluation at CR 93.75 %, cut before its last part)::

    mkdir -p /tmp/raw4 && tar xzf research/results/raw_h200_session4.tgz -C /tmp/raw4
    python research/parts_report.py /tmp/raw4/raw4/recipe_cr0.9375_champ.parts --seq-len 4096 \\
        --name baselines_h200_recipe_cr0.9375_parts --note "champ held-out; kvpop_distill's generation part missing"
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("parts", help="a <key>.parts folder of $KVPOP_HOME/eval")
    p.add_argument("--seq-len", type=int, required=True, help="the held-out sequences' length (CR = 1 - B / S)")
    p.add_argument("--name", required=True, help="file stem of the result")
    p.add_argument("--note", default="", help="one line said above the report")
    p.add_argument("--out", default=str(REPO / "research" / "results"))
    args = p.parse_args(argv)

    from pipelines.config import ConfigError
    from pipelines.evaluate import parts_summary

    folder = Path(args.parts)
    try:
        summary, text = parts_summary(folder, args.seq_len, markdown=True)
    except ConfigError as err:
        print(f"parts_report: {err}", file=sys.stderr)
        return 2
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    parts = sorted(f.stem for f in folder.glob("*.json"))
    (out / f"{args.name}.json").write_text(json.dumps({"parts": parts, "note": args.note, "seq_len": args.seq_len,
                                                       "summary": summary}, indent=1, default=float))
    (out / f"{args.name}.md").write_text(f"# {args.name}\n\n{args.note}\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
