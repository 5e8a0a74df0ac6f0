"""Can a saved scorer be made safe on text it never saw by adding the recency term at evaluation — priority = scorer
+ λ·t (METHOD §3), which ranks like streaming as λ grows — and what does each λ cost on its own corpus?
Teacher-forced KL and top-1 agreement against the dense model, per held-out sequence, with paired bootstrap
intervals against streaming and against the scorer alone (λ = its saved one), at the scorer's budget or another.

    python research/recency_blend.py --checkpoint DIR --sources champ stdlib --sequences 16 \\
        --recency 0.001 0.003 0.01 [--topk K]

``DIR``: a scorer folder (``kvpop.json`` + ``kvpop_scorers.safetensors``, its base model from ``--model``);
``--topk`` evaluates at s + w + K instead of its own budget (e.g. a scorer trained at B = 512 at B = 256). Streaming
keeps the same B. One record per (corpus, sequence, rule) goes to ``<out>/recency_blend_<tag>_items.jsonl`` as it is
measured; a re-run skips what is there (records of another checkpoint or budget are refused in one line before
anything loads). ``--recall-tasks``: the recall cells too (the evaluation stage's recall part). ``--references-from
STUDY.json``: a learning-curves study of the same held-out sequences (a record carries its sequence's id) lends its
TOVA, H2O and oracle records — each rule minus TOVA / H2O, and the KL gap to the oracle it closes. ``--oracle``: the
oracle (the teacher's targets of ``--query-power`` as priorities) with and without each λ as rules too — does the
reference itself gain from a decay? ``--anchors SHARE …``: each λ also with anchor slots (METHOD §1) — that share of
the long-range slots ranked by the scorer + the scorer's own λ plus each ``--anchor-recency`` instead (rule
``kvpop+λ@aSHARE[+λa]``), so that a token the scorer rates highly survives the decay that ranks the other slots;
each such rule is also paired with ``kvpop+λ``, what the anchors cost or add. Choose λ on some corpora and read it on
one it was not chosen on. ``--streaming-layers L …``: every kvpop rule with those layers a streaming cache of the
same B (METHOD §4's per-layer calibration, ``kvpop.set_streaming_layers``), to be chosen on training text. Writes
``<out>/recency_blend_<tag>.{json,md}``.

``--summarize`` writes the result from the records already committed under the tag (no model, nothing measured; a
missing record is one line). ``--reference-source NAME=THEIRS`` pairs corpus ``NAME`` with the study's records of
``THEIRS`` — the same held-out text under another file name (a rebuilt file): accepted only where streaming's records
here equal the study's on every sequence both have, which deterministic evaluation gives only for the same tokens.
"""
from __future__ import annotations

import json
import math
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def parse_args(argv=None):
    # a bad command line: one line and exit code 2; the CLI process's environment
    from jobs._cli import bare_parser, name_pairs

    p = bare_parser("recency_blend", __doc__.split("\n\n")[0])
    p.prog = "research/recency_blend.py"
    p.add_argument("--checkpoint", required=True, help="a scorer folder (kvpop.json + kvpop_scorers.safetensors)")
    p.add_argument("--model", default="smollm2", help="its base: smollm2 or a local HF folder")
    p.add_argument("--sources", nargs="+", default=["champ", "stdlib"], help="held-out corpora (data.source values)")
    p.add_argument("--sequences", type=int, default=16, help="held-out sequences per corpus")
    p.add_argument("--recency", type=float, nargs="+", required=True, help="λ values added to the scorer's own")
    p.add_argument("--anchors", type=float, nargs="*", default=[], help="anchor shares of the topk slots: each λ "
                   "rule also with anchor slots (rules kvpop+λ@aSHARE[+λa])")
    p.add_argument("--anchor-recency", type=float, nargs="+", default=[0.0], help="the anchors' λ added to the "
                   "scorer's own (default 0: the scorer alone ranks them)")
    p.add_argument("--topk", type=int, default=None, help="long-range slots to evaluate at (default: the scorer's)")
    p.add_argument("--streaming-layers", type=int, nargs="*", default=None, metavar="LAYER", help="every kvpop rule "
                   "with these layers a streaming cache of the same B (kvpop.set_streaming_layers; default: the "
                   "checkpoint's own); the records carry them, so another set needs another --tag")
    p.add_argument("--recall-tasks", nargs="*", default=[], help="recall tasks (pipelines.recall names; none: no "
                   "recall part), at the first corpus's config")
    p.add_argument("--recall-contexts", type=int, nargs="+", default=[2048])
    p.add_argument("--recall-depths", type=float, nargs="+", default=[0.1, 0.5])
    p.add_argument("--recall-samples", type=int, default=8, help="samples per (task, context, depth) cell")
    p.add_argument("--recall-min-dense", type=float, default=0.9, help="headline cells: dense exact match >= this")
    p.add_argument("--references-from", metavar="JSON", default="", help="a finished learning-curves study on the "
                   "same held-out sequences: its TOVA, H2O and oracle records there are paired with these by sequence")
    p.add_argument("--reference-source", action="append", default=[], metavar="NAME=THEIRS", help="pair corpus NAME "
                   "with the --references-from study's corpus THEIRS (checked: streaming identical on every sequence)")
    p.add_argument("--summarize", action="store_true", help="only write the result of the committed records (no "
                   "model, nothing measured)")
    p.add_argument("--oracle", action="store_true", help="also the oracle and the oracle + each λ (rules oracle, "
                   "oracle+λ; held-out text only): the teacher's targets as priorities, computed here per sequence")
    p.add_argument("--oracle-recency", type=float, nargs="*", default=None, metavar="λ", help="with --oracle: the λ "
                   "of its oracle+λ rules (default: each --recency λ; none given: the oracle alone — on the H200 each "
                   "rule costs ~1 s an item)")
    p.add_argument("--query-power", type=float, default=16.0, help="β of the oracle's targets (the committed "
                   "scorers': 16)")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--device", default="cpu")
    p.add_argument("--tag", default="cpu")
    p.add_argument("--out", default=str(REPO / "research" / "results"))
    args = p.parse_args(argv)
    if args.oracle_recency is not None and (not args.oracle or any(x < 0 for x in args.oracle_recency)):
        p.error("--oracle-recency takes λ >= 0 and needs --oracle")
    if args.sequences < 1 or any(x < 0 for x in args.recency) or (args.topk is not None and args.topk < 0) or \
            args.recall_samples < 1:
        p.error("--sequences and --recall-samples must be >= 1, --recency values and --topk >= 0")
    if args.streaming_layers is not None and any(x < 0 for x in args.streaming_layers):
        p.error(f"--streaming-layers are layer indices >= 0, got {args.streaming_layers}")
    if any(not 0 < x <= 1 for x in args.anchors) or any(x < 0 for x in args.anchor_recency):
        p.error("--anchors are shares in (0, 1], --anchor-recency values >= 0")
    pairs, bad = name_pairs(args.reference_source, args.sources)
    if bad or (args.reference_source and not args.references_from):
        p.error(f"--reference-source takes NAME=THEIRS with NAME one of --sources, and --references-from; got {bad}")
    args.reference_source = pairs
    return args


def rule_name(policy: str, recency: float, anchors: float = 0.0, anchor_recency: float = 0.0) -> str:
    """``policy+λ``, with anchor slots ``policy+λ@aSHARE`` or ``policy+λ@aSHARE+λa`` (:func:`rule_setting` reads it
    back)."""
    name = f"{policy}+{recency:g}"
    if anchors:
        name += f"@a{anchors:g}" + (f"+{anchor_recency:g}" if anchor_recency else "")
    return name


def rule_setting(rule: str, budget, own: float):
    """The evaluation setting of ``rule`` at ``budget``: its policy ranked with its base λ (``own``, the scorer's, for
    kvpop) plus the λ it names, and its anchor slots ranked with ``own`` plus theirs."""
    from kvpop.evaluation import Setting

    head, _, anchored = rule.partition("@")
    policy, _, added = head.partition("+")
    base = own if policy == "kvpop" else 0.0
    if not anchored:
        return Setting(policy, budget, base + float(added or 0))
    share, _, anchor_added = anchored.removeprefix("a").partition("+")
    return Setting(policy, budget, base + float(added or 0), float(share), base + float(anchor_added or 0))


def rules_of(args) -> list[str]:
    """streaming, the scorer alone, and the scorer with each added λ (in the given order, without repeats), each λ
    with each anchor share and anchor λ; with ``--oracle`` the oracle alone and with each λ (``--oracle-recency``'s,
    else each added λ) after them."""
    added = [x for x in args.recency if x > 0]
    anchored = [rule_name("kvpop", x, share, xa) for x in added for share in args.anchors for xa in args.anchor_recency]
    oracle_added = added if args.oracle_recency is None else [x for x in args.oracle_recency if x > 0]
    oracle = ["oracle", *(rule_name("oracle", x) for x in oracle_added)] if args.oracle else []
    return list(dict.fromkeys(["streaming", "kvpop", *(rule_name("kvpop", x) for x in added), *anchored, *oracle]))


def measure_recall(model, args, budget: dict, tokenizer, path: Path, identity: dict, rules: list[str],
                   setting_of) -> list[dict]:
    """Every rule's greedy answers to the recall samples not yet in ``path`` (the evaluation stage's recall part),
    appended per rule: exact match and the gold answer's log-probability per sample (dense's kept once, as the rule
    ``dense``); ``headline``: the sample's cell is one where dense reaches ``--recall-min-dense``. ``setting_of``:
    a rule's evaluation setting."""
    import kvpop
    from research.learning_curves import corpus_config, evaluate_records
    from research.scorer_records import committed
    from kvpop.pretrained import read_model_config
    from pipelines.eval_parts import recall_samples

    def as_list(values):
        return "[" + ",".join(str(v) for v in values) + "]"

    cfg = corpus_config(args.model, args.sources[0], args.seq_len, budget, 1.0, 1, more=[
        f"eval.tasks={as_list(args.recall_tasks)}", f"eval.task_contexts={as_list(args.recall_contexts)}",
        f"eval.task_depths={as_list(args.recall_depths)}", f"eval.task_samples={args.recall_samples}",
        "eval.generation_prompts=0"])
    samples = recall_samples(cfg, tokenizer, read_model_config(cfg.model.resolved_path()).get(
        "max_position_embeddings"))
    inputs = {"tokenizer": tokenizer, "sequences": [], "budgets": [kvpop.Budget(**budget)], "samples": samples,
              "problems": [], "prompts": []}
    done = committed(path, identity, "recall records")
    have = {(r["rule"], r["item"]) for r in done}
    keep = ("item", "task", "context", "depth", "exact", "logprob", "text")
    with path.open("a") as sink:
        for rule, missing in recall_to_measure(samples, have, rules).items():
            setting = setting_of(rule)
            found = [r for r in evaluate_records(cfg, {**inputs, "samples": missing}, model, [setting])
                     if r["part"] == "recall"]
            for name, policy in ((rule, setting.policy), ("dense", "dense")):
                # dense answers with every rule: kept once per sample
                rows = [r for r in found if r["policy"] == policy and (name, r["item"]) not in have]
                for r in rows:
                    record = {**identity, "rule": name, **{k: r[k] for k in keep}}
                    sink.write(json.dumps(record) + "\n")
                    done.append(record)
                    have.add((name, r["item"]))
                if rows:
                    print(f"[recency_blend] recall {name}: exact {sum(r['exact'] for r in rows) / len(rows):.3f} "
                          f"({len(rows)} new samples)", flush=True)
            sink.flush()
    return headline(of_the_recall_run(done, args), args.recall_min_dense)


def recall_to_measure(samples: list, have: set[tuple[str, str]], rules: list[str]) -> dict[str, list]:
    """{rule: its samples not yet in ``have`` ((rule, sample id) pairs)}, for the rules lacking any — so a re-run with
    more samples, depths or tasks measures exactly what is new."""
    out = {rule: [s for s in samples if (rule, s.id) not in have] for rule in rules}
    return {rule: missing for rule, missing in out.items() if missing}


def of_the_recall_run(done: list[dict], args) -> list[dict]:
    """The recall records this run reports: its tasks, contexts and depths, samples ``0 … --recall-samples - 1`` (the
    sample's index ends its id, :func:`pipelines.recall.base.build_sample`); a records file may hold more."""
    return [r for r in done if r["task"] in args.recall_tasks and r["context"] in args.recall_contexts
            and r["depth"] in args.recall_depths and int(r["item"].rsplit("/", 1)[1]) < args.recall_samples]


def headline(done: list[dict], min_dense: float) -> list[dict]:
    """The recall records, each marked ``headline`` where dense's exact match in its cell is at least ``min_dense``."""
    cells: dict[tuple, list[float]] = {}
    for r in done:
        if r["rule"] == "dense":
            cells.setdefault((r["task"], r["context"], r["depth"]), []).append(r["exact"])
    good = {cell for cell, hits in cells.items() if sum(hits) / len(hits) >= min_dense}
    return [{**r, "headline": (r["task"], r["context"], r["depth"]) in good} for r in done]


def alone(rule: str) -> str:
    """What a rule is compared with besides streaming: the oracle for oracle + λ, the same λ without anchors for an
    anchored rule, else the scorer alone."""
    if "@" in rule:
        return rule.partition("@")[0]
    return "oracle" if rule.startswith("oracle+") else "kvpop"


def means_and_pairs(by_rule: dict[str, dict], metrics, rules: list[str]) -> dict:
    """Over the items every rule in ``by_rule`` ({rule: {item: record}}) has: each rule's mean of each metric, and
    each of ``rules[1:]`` minus streaming and minus :func:`alone`'s rule, paired."""
    from research.bootstrap import paired_bootstrap

    items = sorted(set.intersection(*(set(v) for v in by_rule.values())))
    out = {"items": items}
    for metric in metrics:
        out[metric] = {rule: sum(by_rule[rule][i][metric] for i in items) / len(items) if items else None
                       for rule in by_rule}
        for rule in rules[1:]:
            for base in ("streaming", alone(rule)):
                if rule != base:
                    out[f"{metric}:{rule}-{base}"] = paired_bootstrap([by_rule[rule][i][metric] for i in items],
                                                                      [by_rule[base][i][metric] for i in items])
    return out


def summarize(records: list[dict], sources: list[str], rules: list[str]) -> dict:
    """Per corpus, :func:`means_and_pairs` of KL and top-1 over the sequences every rule has; with the oracle among
    the rules (``--oracle``), each kvpop rule's share of the streaming → oracle KL gap (``gap:<rule>``) too."""
    from pipelines.stats import gap_closed

    out = {}
    for source in sources:
        by_rule = {rule: {r["item"]: r for r in records if r["source"] == source and r["rule"] == rule}
                   for rule in rules}
        cell = out[source] = means_and_pairs(by_rule, ("kl", "top1"), rules)
        if "oracle" in rules and len(cell["items"]) > 1:
            kl = {rule: [by_rule[rule][i]["kl"] for i in cell["items"]] for rule in rules}
            for rule in (r for r in rules if r.startswith("kvpop")):
                g = gap_closed(kl[rule], kl["streaming"], kl["oracle"])
                cell[f"gap:{rule}"] = {"mean": g.estimate, "low": g.lo, "high": g.hi, "n": g.n}
    return out


def summarize_recall(records: list[dict], rules: list[str]) -> dict:
    """Over the headline samples (dense's too): :func:`means_and_pairs` of exact match and gold log-probability, and
    each rule's exact match as a share of dense's (``share:<rule>``: mean over mean, paired bootstrap interval, read
    against :data:`pipelines.report.RECALL_LINE`); ``cells``: every cell's exact match per rule, headline or not (the
    cells a rule loses are reported too)."""
    from pipelines.stats import bootstrap_for

    def share_of(hits: list[float], dense: list[float]) -> dict:
        share = bootstrap_for(len(dense)).ratio(hits, dense)
        return {"mean": share.estimate, "low": share.lo, "high": share.hi, "n": share.n}

    if not records:
        return {}
    rules = ["dense", *rules]
    out = means_and_pairs({rule: {r["item"]: r for r in records if r["rule"] == rule and r["headline"]}
                           for rule in rules}, ("exact", "logprob"), rules[1:])
    by_item = {(r["rule"], r["item"]): r["exact"] for r in records}
    if out["items"]:
        dense = [by_item["dense", i] for i in out["items"]]
        for rule in rules[1:]:
            out[f"share:{rule}"] = share_of([by_item[rule, i] for i in out["items"]], dense)
    cells: dict[str, dict] = {}
    for r in sorted(records, key=lambda r: (r["task"], r["context"], r["depth"])):
        cell = cells.setdefault(f"{r['task']} c{r['context']} d{r['depth']:g}", {"headline": r["headline"]})
        cell.setdefault(r["rule"], {})[r["item"]] = r["exact"]
    out["cells"] = {}
    for name, cell in cells.items():
        headline_cell = cell.pop("headline")
        out["cells"][name] = entry = {"headline": headline_cell}
        for rule, hits in cell.items():
            entry[rule] = {"mean": sum(hits.values()) / len(hits), "n": len(hits)}
            both = sorted(set(hits) & set(cell.get("dense", {})))
            if rule != "dense" and both:
                entry[rule]["share"] = share_of([hits[i] for i in both], [cell["dense"][i] for i in both])
    return out


REFERENCE_POLICIES = ("streaming", "tova", "h2o", "oracle")


def study_references(path: Path, sources: list[str], B: int, aliases: dict | None = None
                     ) -> dict[str, dict[str, dict[str, dict]]]:
    """Per corpus of ``sources`` that the study at ``path`` evaluated: ``{policy: {sequence id: record}}`` of its
    text records at total budget ``B`` (streaming, TOVA, H2O, the oracle); ``aliases``: {source: the study's name for
    the same corpus}. ValueError if it is not a study."""
    from research.learning_curves import reference_records

    try:
        measured = reference_records(json.loads(Path(path).read_text()))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"--references-from {path}: not a learning-curves study ({type(err).__name__}: {err})") \
            from None
    out = {}
    for source in sources:
        rows = [r for r in measured.get((aliases or {}).get(source, source), []) if r["part"] == "text" and
                r.get("B") == B]
        if rows:
            out[source] = {policy: {r["item"]: r for r in rows if r["policy"] == policy}
                           for policy in REFERENCE_POLICIES}
    return out


def check_aliased_references(records: list[dict], references: dict, aliases: dict) -> None:
    """One line (ValueError) unless, for each aliased corpus, streaming's records here equal the study's on every
    sequence both have (KL and top-1 to 1e-6; at least one): the same tokens under another file name."""
    for source in aliases:
        theirs = references.get(source, {}).get("streaming", {})
        mine = {r["id"]: r for r in records if r["source"] == source and r["rule"] == "streaming" and "id" in r}
        both = sorted(set(mine) & set(theirs))
        off = max((abs(mine[i][m] - theirs[i][t]) for i in both for m, t in (("kl", "kl"), ("top1", "top1_agreement"))),
                  default=None)
        if off is None or off > 1e-6:
            raise ValueError(f"--reference-source {source}={aliases[source]}: streaming here and there differ "
                             f"({'no sequence in common' if off is None else f'by up to {off:.2e}'} over "
                             f"{len(both)} sequences): not the same held-out text")


def check_reference_heldout(args, configs, tokenizer) -> None:
    """One line (ConfigError) when a corpus's held-out sequences here are not those the ``--references-from`` study
    recorded under the same name (its ``meta.heldout_sha256``, over as many sequences as here; older studies have
    none): pairing by sequence id would pair other texts — a rebuilt local file, another Python's stdlib."""
    if not args.references_from:
        return
    from research.learning_curves import check_heldout, heldout_digest
    from pipelines.data import load_sequences

    meta = json.loads(Path(args.references_from).read_text())["meta"]
    saved = {name: digest for name, digest in (meta.get("heldout_sha256") or {}).items()}
    for source, theirs in args.reference_source.items():  # an aliased corpus: its digest is the study's name's
        if theirs in saved:
            saved[source] = saved[theirs]
    if not saved or meta.get("study", {}).get("eval_sequences") != args.sequences:
        return
    digests = {cfg.data.source: heldout_digest(load_sequences(cfg, "eval", tokenizer)) for cfg in configs
               if cfg.data.source in saved}
    check_heldout(f"--references-from {args.references_from}", saved, digests)


HINDSIGHT = "gap:best-λ"  # versus_references' ceiling of the decayed rules chosen per sequence


def decayed_rules(rules: list[str]) -> list[str]:
    """The plain ``kvpop+λ`` rules (no anchors) among ``rules``."""
    return [r for r in rules if r.startswith("kvpop+") and "@" not in r]


def versus_references(records: list[dict], references: dict, rules: list[str]) -> dict:
    """Per corpus: each rule minus TOVA / H2O (paired over the sequences both have, by id), the fraction of the
    streaming → oracle KL gap it closes (streaming here, the oracle there), and how far this run's streaming is from
    the study's on the same sequences (precision and device: the pairing's own noise). With two or more decayed rules,
    also ``HINDSIGHT``: the gap closed when each sequence takes the λ that is best for it (chosen on its own KL, so a
    ceiling for any rule that picks one of these λ per sequence, not a rule)."""
    from research.bootstrap import paired_bootstrap
    from pipelines.stats import gap_closed

    metric_there = {"kl": "kl", "top1": "top1_agreement"}
    out = {}
    for source, theirs in references.items():
        mine = {rule: {r["id"]: r for r in records if r["source"] == source and r["rule"] == rule and "id" in r}
                for rule in rules}
        cell = out[source] = {}
        both = sorted(set(mine["streaming"]) & set(theirs["streaming"]))
        cell["streaming_here_minus_there"] = {
            m: (sum(mine["streaming"][i][m] - theirs["streaming"][i][metric_there[m]] for i in both) / len(both)
                if both else None) for m in metric_there}
        for rule in rules:
            for policy in ("tova", "h2o"):
                ids = sorted(set(mine[rule]) & set(theirs[policy]))
                for m, there in metric_there.items():
                    cell[f"{m}:{rule}-{policy}"] = paired_bootstrap([mine[rule][i][m] for i in ids],
                                                                    [theirs[policy][i][there] for i in ids])
            ids = sorted(set(mine[rule]) & set(mine["streaming"]) & set(theirs["oracle"]))
            if len(ids) > 1:
                g = gap_closed([mine[rule][i]["kl"] for i in ids], [mine["streaming"][i]["kl"] for i in ids],
                               [theirs["oracle"][i]["kl"] for i in ids])
                cell[f"gap:{rule}"] = {"mean": g.estimate, "low": g.lo, "high": g.hi, "n": g.n}
        decayed = decayed_rules(rules)
        ids = sorted(set(mine["streaming"]) & set(theirs["oracle"]).intersection(*(mine[r] for r in decayed)))
        if len(decayed) > 1 and len(ids) > 1:
            g = gap_closed([min(mine[r][i]["kl"] for r in decayed) for i in ids],
                           [mine["streaming"][i]["kl"] for i in ids], [theirs["oracle"][i]["kl"] for i in ids])
            cell[HINDSIGHT] = {"mean": g.estimate, "low": g.lo, "high": g.hi, "n": g.n, "rules": decayed}
    return out


def cell_entry(entry: dict) -> str:
    """One rule's recall in one cell: exact match (samples), and its share of dense's where dense answered there."""
    text = f"{entry['mean']:.3f} ({entry['n']})"
    share = entry.get("share")
    if share is None or not math.isfinite(share["mean"]):
        return text
    if not (math.isfinite(share["low"]) and math.isfinite(share["high"])):
        return f"{text}; {share['mean']:.2f} × dense"
    return f"{text}; {share['mean']:.2f} [{share['low']:.2f}, {share['high']:.2f}] × dense"


def render(result: dict) -> str:
    from research.bootstrap import format_interval
    from pipelines.report import RECALL_LINE, versus_line

    rules = result["rules"]
    layers = result.get("streaming_layers")
    lines = [f"# Recency blend: {result['checkpoint']} at {result['budget']}" +
             (f", streaming layers {layers}" if layers else ""), "",
             "Teacher-forced against the dense model over positions ≥ B, one value per held-out sequence; "
             "kvpop+λ ranks by the scorer's output + λ·t (λ added to the scorer's own, METHOD §3). Means over the "
             "sequences every rule has; 95 % paired bootstrap intervals (* where they exclude 0). KL: lower is "
             "better; top-1: higher.", "",
             "| corpus | n | metric | rule | mean | − streaming | − kvpop (oracle + λ: − oracle; anchored: − the λ "
             "without anchors) | KL gap closed (--oracle) |",
             "|---|---|---|---|---|---|---|---|"]
    for source, cell in result["summary"].items():
        if not cell["items"]:
            continue
        for metric in ("kl", "top1"):
            for rule in rules:
                diffs = [cell.get(f"{metric}:{rule}-{base}") for base in ("streaming", alone(rule))]
                gap = cell.get(f"gap:{rule}") if metric == "kl" else None
                lines.append(f"| {source} | {len(cell['items'])} | {metric} | {rule} | {cell[metric][rule]:.4f} | " +
                             " | ".join(format_interval(d, 4) if d else "–" for d in diffs) + " | " +
                             (f"{gap['mean']:.2f} [{gap['low']:.2f}, {gap['high']:.2f}]" if gap else "–") + " |")
    versus = result.get("versus_references") or {}
    if versus:
        lines += ["", f"Against the references of `{result['args']['references_from']}` on the same sequences (TOVA / "
                  "H2O: the sequences it ran them on; KL gap closed: streaming here → the oracle there):", "",
                  "| corpus | rule | KL − TOVA | KL − H2O | top-1 − TOVA | top-1 − H2O | KL gap closed |",
                  "|---|---|---|---|---|---|---|"]
        for source, cell in versus.items():
            for rule in rules[1:]:
                gap = cell.get(f"gap:{rule}")
                lines.append(f"| {source} | {rule} | " + " | ".join(
                    format_interval(cell[f"{m}:{rule}-{p}"], 4) + f" (n {cell[f'{m}:{rule}-{p}']['n']})"
                    for m in ("kl", "top1") for p in ("tova", "h2o")) + " | " +
                    (f"{gap['mean']:.2f} [{gap['low']:.2f}, {gap['high']:.2f}]" if gap else "–") + " |")
            best = cell.get(HINDSIGHT)
            if best:
                lines.append(f"| {source} | best of {', '.join(best['rules'])} per sequence (hindsight: a ceiling, "
                             f"not a rule; n {best['n']}) | | | | | {best['mean']:.2f} [{best['low']:.2f}, "
                             f"{best['high']:.2f}] |")
            off = cell["streaming_here_minus_there"]
            if off["kl"] is not None:
                lines.append(f"| {source} | (streaming here − there) | {off['kl']:+.4f} | | {off['top1']:+.4f} | | |")
    recall = result.get("recall") or {}
    if recall.get("items"):
        lines += ["", f"Recall, headline cells (dense ≥ {result['args']['recall_min_dense']}; {len(recall['items'])} "
                  "samples): exact match and the gold answer's log-probability, 95 % paired intervals.", "",
                  "| metric | rule | mean | − streaming | − kvpop (anchored: − the λ without anchors) |",
                  "|---|---|---|---|---|"]
        for metric in ("exact", "logprob"):
            for rule in [r for r in ["dense", *rules] if r in recall[metric]]:  # the oracle rules: text only
                diffs = [recall.get(f"{metric}:{rule}-{base}") for base in ("streaming", alone(rule))]
                lines.append(f"| {metric} | {rule} | {recall[metric][rule]:.3f} | " +
                             " | ".join(format_interval(d, 3) if d else "–" for d in diffs) + " |")
        shares = [(rule, recall[f"share:{rule}"]) for rule in rules if f"share:{rule}" in recall]
        if shares:
            lines += ["", "Exact match as a share of dense's on the same headline samples (mean over mean, 95 % paired "
                      f"bootstrap interval; ≥ {RECALL_LINE:g} × dense resolved where the low end is ≥ {RECALL_LINE:g}):",
                      "", f"| rule | share of dense | resolved ≥ {RECALL_LINE:g} × dense |", "|---|---|---|"]
            lines += [f"| {rule} | {s['mean']:.3f} [{s['low']:.3f}, {s['high']:.3f}] | "
                      f"{versus_line(s['low'], s['high'])} |" for rule, s in shares]
    cells = recall.get("cells") or {}
    if cells:
        shown = [r for r in ["dense", *rules] if any(r in c for c in cells.values())]
        lines += ["", "Recall, every cell (exact match (samples); × dense: the share of dense's with its 95 % paired "
                  "interval; headline: dense ≥ "
                  f"{result['args']['recall_min_dense']}):", "", "| cell | headline | " + " | ".join(shown) + " |",
                  "|---|---|" + "---|" * len(shown)]
        lines += [f"| {name} | {'yes' if c['headline'] else 'no'} | " +
                  " | ".join(cell_entry(c[r]) if r in c else "–" for r in shown) + " |" for name, c in cells.items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    import kvpop
    from research.learning_curves import load_saved_scorer
    from research.scorer_records import measure, open_records
    from kvpop import Budget
    from kvpop.evaluation import Setting, forced_logits, teacher_targets
    from kvpop.pretrained import read_model_config
    from pipelines.config import ConfigError
    from pipelines.data import load_tokenizer

    try:
        meta, configs, budget, records_path, identity = open_records(
            args, "recency_blend", args.topk, streaming_layers=args.streaming_layers)
        references = (study_references(Path(args.references_from), args.sources, Budget(**budget).total,
                                       args.reference_source) if args.references_from else {})
    except (ConfigError, ValueError) as err:
        print(f"recency_blend: {err}", file=sys.stderr)
        return 2
    out = Path(args.out)
    own = float(meta.get("recency", 0.0))
    rules = rules_of(args)
    recall_rules = [r for r in rules if not r.startswith("oracle")]  # the oracle rules: held-out text only
    recall_path = out / f"recency_blend_{args.tag}_recall.jsonl"
    if args.summarize:
        try:
            records = committed_records(args, records_path, identity, rules)
            recall = committed_recall(args, recall_path, identity, recall_rules) if args.recall_tasks else []
            check_aliased_references(records, references, args.reference_source)
        except (ConfigError, ValueError) as err:
            print(f"recency_blend: {err}", file=sys.stderr)
            return 2
        return report(args, out, budget, own, rules, records, recall, recall_rules, references)
    tokenizer = load_tokenizer(configs[0])
    try:
        check_reference_heldout(args, configs, tokenizer)
    except ConfigError as err:
        print(f"recency_blend: {err}", file=sys.stderr)
        return 2
    if args.streaming_layers is not None:  # refused before the model loads
        layers = read_model_config(configs[0].model.resolved_path()).get("num_hidden_layers")
        bad = sorted(x for x in args.streaming_layers if layers is not None and x >= layers)
        if bad:
            print(f"recency_blend: --streaming-layers: the model has layers 0 … {layers - 1}, got {bad}",
                  file=sys.stderr)
            return 2
    model = load_saved_scorer(args.checkpoint, meta, configs[0], args.device)
    if args.streaming_layers is not None:
        kvpop.set_streaming_layers(model, args.streaming_layers)

    def setting_of(rule, at=Budget(**budget)) -> Setting:
        return rule_setting(rule, at, own)

    targets = {}  # the oracle's priorities of the sequence being measured (one teacher pass for its oracle rules)

    def logits_of(rule, ids, at, start):
        setting = setting_of(rule, at)
        if setting.policy == "oracle" and targets.get("ids") is not ids:  # the model is dense between rules
            targets.update(ids=ids, table=teacher_targets(model, ids, [at.window], query_power=args.query_power)[
                at.window])
        table = targets["table"] if setting.policy == "oracle" else None
        return forced_logits(model, setting, ids, targets=table, start=start)

    out.mkdir(parents=True, exist_ok=True)
    records = measure(model, args, {**meta, "budget": budget}, tokenizer, records_path, identity, lambda item: rules,
                      logits_of, "recency_blend")
    recall = (measure_recall(model, args, budget, tokenizer, recall_path, identity, recall_rules, setting_of)
              if args.recall_tasks else [])
    try:
        check_aliased_references(records, references, args.reference_source)
    except ValueError as err:
        print(f"recency_blend: {err}", file=sys.stderr)
        return 2
    return report(args, out, budget, own, rules, records, recall, recall_rules, references)


def committed_records(args, records_path: Path, identity: dict, rules: list[str]) -> list[dict]:
    """``--summarize``: the committed records, every (corpus, sequence, rule) there or one line (ConfigError)."""
    from research.scorer_records import committed
    from pipelines.config import ConfigError

    records = committed(records_path, identity, "records")
    have = {(r["source"], r["item"], r["rule"]) for r in records}
    missing = [(s, i, r) for s in args.sources for i in range(args.sequences) for r in rules if (s, i, r) not in have]
    if missing:
        source, item, rule = missing[0]
        raise ConfigError(f"{records_path} lacks {len(missing)} records (first: {source} item {item} {rule}): measure "
                          f"them (without --summarize)")
    return records


def committed_recall(args, path: Path, identity: dict, rules: list[str]) -> list[dict]:
    """``--summarize``: the committed recall records (:func:`headline` marked), every rule's there or one line."""
    from research.scorer_records import committed
    from pipelines.config import ConfigError

    done = of_the_recall_run(committed(path, identity, "recall records"), args)
    cells = len(args.recall_tasks) * len(args.recall_contexts) * len(args.recall_depths) * args.recall_samples
    count = Counter(d["rule"] for d in done)
    missing = [r for r in ["dense", *rules] if count[r] < cells]
    if missing:
        raise ConfigError(f"{path} lacks recall records of {', '.join(missing)} ({cells} samples asked): measure them "
                          f"(without --summarize)")
    return headline(done, args.recall_min_dense)


def of_the_run(records: list[dict], sources: list[str], sequences: int) -> list[dict]:
    """The records this run reports: its corpora's first ``sequences`` items. A records file may hold more (an earlier
    run with a larger ``--sequences``); reporting them too would compare rules measured on more items with rules
    measured on fewer, each against the references on its own items."""
    return [r for r in records if r["source"] in sources and r["item"] < sequences]


def report(args, out: Path, budget: dict, own: float, rules, records, recall, recall_rules, references) -> int:
    from research.scorer_records import write_result
    from kvpop import Budget

    records = of_the_run(records, args.sources, args.sequences)
    result = {"checkpoint": str(Path(args.checkpoint)), "budget": str(Budget(**budget)), "own_recency": own,
              "streaming_layers": args.streaming_layers, "rules": rules,
              "args": vars(args), "summary": summarize(records, args.sources, rules),
              "recall": summarize_recall(recall, recall_rules),
              "versus_references": versus_references(records, references, rules)}
    out.mkdir(parents=True, exist_ok=True)
    write_result(out, f"recency_blend_{args.tag}", result, render(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
