"""A saved scorer at another protected window: the same weights, read when a token leaves a window of ``--window``.

CR 93.75 % at S = 4096 is B = 256, which a scorer trained at window 256 cannot reach (s + w + k = 256 leaves it no
long-range slot). Its weights have nothing of the window's size (:func:`kvpop.retrofit.rewindow_scorer_folder`), so
they can run at a shorter window: scored earlier, with less of the near future seen. That is a policy of its own, to
be measured (``recency_blend.py --checkpoint OUT``) or fine-tuned at the new window (``--init-from OUT``). Bad input
is one line and exit code 2.

    python research/rewindow_scorer.py SRC/step-0000184 OUT --sink 4 --window 128 --topk 124
"""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def main(argv=None) -> int:
    from jobs._cli import bare_parser
    from kvpop import Budget
    from kvpop.retrofit import rewindow_scorer_folder

    p = bare_parser("rewindow_scorer", __doc__)
    p.prog = "research/rewindow_scorer.py"
    p.add_argument("source", help="a scorer-only folder (kvpop.json + kvpop_scorers.safetensors)")
    p.add_argument("out", help="a new (or empty) folder")
    p.add_argument("--sink", type=int, required=True)
    p.add_argument("--window", type=int, required=True)
    p.add_argument("--topk", type=int, required=True)
    args = p.parse_args(argv)
    try:
        out = rewindow_scorer_folder(args.source, args.out, Budget(args.sink, args.window, args.topk))
    except (ValueError, FileNotFoundError) as err:
        print(f"rewindow_scorer: {err}", file=sys.stderr)
        return 2
    print(f"rewindow_scorer: {out} holds {args.source}'s scorers at s{args.sink}-w{args.window}-k{args.topk}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
