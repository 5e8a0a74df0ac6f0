"""``research/learning_curves.py`` on CPU at a tiny size (a 2-layer random Llama with SmolLM2's tokenizer, S = 64):
per-item records and intervals at every checkpoint, and a study saved, resumed and continued that trains exactly as
one uninterrupted run."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from research import learning_curves as curves
from pipelines import stats

pytestmark = pytest.mark.pretrained  # SmolLM2's tokenizer (tiny_setup)

TOKENS_PER_STEP = 2 * 64


def argv(setup, out, *extra) -> list[str]:
    """A tiny study: 2 sequences of 64 tokens per step from a pool of 5 (an epoch ends inside a batch), 3 held-out
    sequences, budget s2-w8-k16, evaluated at B = 32; the loss draws random pairs (its generator is state too)."""
    return ["--model", str(setup / "teacher"), "--source", str(setup / "docs.jsonl"), "--device", "cpu",
            "--seq-len", "64", "--batch", "2", "--train-sequences", "5", "--eval-sequences", "3", "--eval-batch", "3",
            "--sink", "2", "--window", "8", "--topk", "16", "--eval-crs", "0.5", "--warmup", "3",
            "--loss-options", '{"random_pairs": 2}', "--heuristics", "--recall-samples", "0", "--resamples", "200",
            "--out", str(out), "--tag", "t", *extra]


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """One KVPOP_HOME for the module: the data stage's sequence cache is built once."""
    path = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVPOP_HOME", str(path))
        yield path


@pytest.fixture(scope="module")
def saved(tiny_setup, home, tmp_path_factory):
    """A first session of 5 steps (checkpoints at 2 and 5 steps), its state saved: the folder."""
    root = tmp_path_factory.mktemp("first")
    assert curves.main(argv(tiny_setup, root / "out", "--checkpoints", str(2 * TOKENS_PER_STEP),
                            str(5 * TOKENS_PER_STEP), "--save-state", str(root / "state"))) == 0
    return root / "state"


def _step_files(state) -> dict[str, torch.Tensor]:
    manifest = json.loads((state / "state.json").read_text())
    folder = state / manifest["model"]
    out = dict(load_file(str(folder / "kvpop_scorers.safetensors")))
    for shard in manifest["shards"]:
        out.update({f"optimizer.{k}": v for k, v in load_file(str(folder / shard)).items()})
    return out


def test_resumed_study_trains_as_one_run(tiny_setup, home, saved, tmp_path):
    resumed = tmp_path / "resumed"
    shutil.copytree(saved, resumed)
    assert curves.main(argv(tiny_setup, tmp_path / "b", "--checkpoints", str(9 * TOKENS_PER_STEP),
                            "--resume", str(resumed))) == 0
    assert curves.main(argv(tiny_setup, tmp_path / "c", "--checkpoints", str(2 * TOKENS_PER_STEP),
                            str(5 * TOKENS_PER_STEP), str(9 * TOKENS_PER_STEP),
                            "--save-state", str(tmp_path / "one"))) == 0

    split, one = _step_files(resumed), _step_files(tmp_path / "one")
    assert sorted(split) == sorted(one) and any(k.endswith("exp_avg_sq") for k in split)
    for key in one:
        torch.testing.assert_close(split[key], one[key], rtol=0, atol=1e-6, msg=key)
    a, b = (json.loads((folder / "state.json").read_text()) for folder in (resumed, tmp_path / "one"))
    assert a["progress"]["step"] == b["progress"]["step"] == 9
    assert a["progress"]["order"] == b["progress"]["order"] and a["progress"]["losses"] == b["progress"]["losses"]

    result = json.loads((tmp_path / "b" / "learning_curves_t.json").read_text())
    assert [p["tokens"] for p in result["points"]] == [0, 2 * TOKENS_PER_STEP, 5 * TOKENS_PER_STEP,
                                                      9 * TOKENS_PER_STEP]  # the earlier points, then the new one
    assert [(s["first_step"], s["last_step"]) for s in result["meta"]["sessions"]] == [(0, 5), (5, 9)]
    continuous = json.loads((tmp_path / "c" / "learning_curves_t.json").read_text())
    kl = lambda r: sorted((x["item"], x["kl"]) for x in r["points"][-1]["records"])  # noqa: E731
    assert kl(result) == kl(continuous)
    markdown = (tmp_path / "b" / "learning_curves_t.md").read_text()
    assert all(f"| {curves.tokens_label(p['tokens'])} |" in markdown for p in result["points"])


def test_bad_resume_is_one_line(tiny_setup, home, saved, tmp_path, capsys):
    def fails(state, *extra) -> str:
        capsys.readouterr()
        assert curves.main(argv(tiny_setup, tmp_path / "out", "--resume", str(state), *extra)) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        return err

    later = str(9 * TOKENS_PER_STEP)
    assert "--seq-len 48 (saved 64)" in fails(saved, "--seq-len", "48", "--checkpoints", later)
    assert "--window-attention-prior True (saved False)" in fails(saved, "--window-attention-prior", "--checkpoints",
                                                                   later)
    message = fails(saved, "--scorer", "mlp", "--loss-options", "{}", "--checkpoints", later)
    assert "--scorer mlp (saved mlstm)" in message and '--loss-options {} (saved {"random_pairs": 2})' in message
    assert "--query-power 8.0 (saved 1.0)" in fails(saved, "--query-power", "8", "--checkpoints", later)
    assert '--kl-options {"weight": 1} (saved {})' in fails(saved, "--kl-options", '{"weight": 1}', "--checkpoints",
                                                             later)
    assert "--kl-options: KLThroughMask needs weight > 0" in fails(saved, "--kl-options", '{"tau": 0}',
                                                                    "--checkpoints", later)
    assert "--kl-options: KL-through-the-mask options are weight, tau, top_k, relative and recency" in fails(
        saved, "--kl-options", '{"beta": 1}', "--checkpoints", later)
    assert "--query-power: query_power must be a finite number >= 1" in fails(saved, "--query-power", "0.5",
                                                                               "--checkpoints", later)
    assert "training tokens already seen" in fails(saved, "--checkpoints", str(5 * TOKENS_PER_STEP))
    assert "no state.json" in fails(tmp_path, "--checkpoints", later)
    broken = tmp_path / "broken"
    shutil.copytree(saved, broken)
    manifest = json.loads((broken / "state.json").read_text())
    (broken / manifest["model"] / manifest["shards"][0]).write_bytes(b"cut off")
    assert "differs from the state's record" in fails(broken, "--checkpoints", later)


def test_every_checkpoint_has_items_intervals_and_paired_differences(tiny_setup, home, tmp_path):
    out = tmp_path / "out"
    assert curves.main(argv(tiny_setup, out, "--checkpoints", str(TOKENS_PER_STEP), str(2 * TOKENS_PER_STEP),
                            "--heuristics", "tova", "window_attention", "--dynamic-sequences", "2", "--recall-tasks",
                            "niah_single",
                            "--recall-contexts", "128", "--recall-depths", "0.2", "--recall-samples", "2",
                            "--recall-min-dense", "0")) == 0
    result = json.loads((out / "learning_curves_t.json").read_text())
    refs = result["references"]["records"]
    B = result["meta"]["budgets"][0]["B"]

    def values(records, policy, field, part="text"):
        return {r["item"]: r[field] for r in records if r["policy"] == policy and r["part"] == part and r["B"] == B}

    assert len(values(refs, "streaming", "kl")) == len(values(refs, "oracle", "kl")) == 3
    assert len(values(refs, "tova", "top1_agreement")) == 2  # --dynamic-sequences
    assert len(values(refs, "window_attention", "top1_agreement")) == 3  # static: every sequence
    assert len(values(refs, "dense", "exact", "recall")) == 0  # dense's recall records carry B = None
    assert len([r for r in refs if r["policy"] == "dense" and r["part"] == "recall"]) == 2
    markdown = (out / "learning_curves_t.md").read_text()
    digits = {name: d for name, _, d in curves.TEXT_METRICS + curves.RECALL_METRICS}
    assert len(result["points"]) == 3
    for point in result["points"]:
        records, summary = point["records"], point["summary"]
        for field, name in (("kl", "kl"), ("top1_agreement", "top1_agreement"), ("exact", "recall_exact"),
                            ("logprob", "recall_gold_logprob")):
            part = "text" if name in ("kl", "top1_agreement") else "recall"
            mine = values(records, "kvpop", field, part)
            assert len(mine) == (3 if part == "text" else 2)
            entry = curves._find(summary["metrics"], metric=name, B=B)
            interval = stats.mean_interval([round(v, 6) for v in mine.values()], resamples=200)
            assert entry["estimate"] == pytest.approx(np.mean(list(mine.values())), abs=1e-6)
            assert (entry["lo"], entry["hi"]) == pytest.approx((interval.lo, interval.hi))
            heuristics = {h: values(refs, h, field, part) for h in ("streaming", "tova", "window_attention")}
            heuristics = {h: v for h, v in heuristics.items() if v}
            sign = -1 if name == "kl" else 1
            best = max(heuristics, key=lambda h: sign * np.mean(list(heuristics[h].values())))
            for vs, baseline in (("streaming", "streaming"), ("best_heuristic", best)):
                d = curves._find(summary["differences"], metric=name, B=B, vs=vs)
                assert d["baseline"] == baseline
                items = sorted(set(mine) & set(heuristics[baseline]))
                ref = stats.paired_difference([round(mine[i], 6) for i in items],
                                              [round(heuristics[baseline][i], 6) for i in items], resamples=200)
                assert (d["n"], d["estimate"], d["resolved"]) == (len(items), pytest.approx(ref.estimate),
                                                                  ref.resolved)
                text = curves._difference(d, digits[name] + 1)
                assert ("not resolved" in text) == (not d["resolved"]) or text == "(= streaming)"
                assert ("above" in text or "below" in text) == (d["resolved"] and text != "(= streaming)")
                assert text in markdown
        assert {g["metric"] for g in summary["gap_closed"]} == {"kl", "top1_agreement"}
    assert "| − streaming | − tova | − window_attention | gap closed |" in markdown  # no H2O column: not run
    assert (out / "learning_curves_t.png").stat().st_size > 0
    assert (out / "learning_curves_t_layers.png").stat().st_size > 0  # per-layer balanced accuracy


def test_another_corpus_is_evaluated_at_every_point_against_its_own_references(tiny_setup, home, tmp_path, capsys):
    from tests.models import write_docs

    other = tmp_path / "other.jsonl"
    write_docs(other, 30, seed=7, min_words=40, max_words=90)
    out = tmp_path / "out"
    assert curves.main(argv(tiny_setup, out, "--checkpoints", str(TOKENS_PER_STEP), "--eval-sources",
                            str(other))) == 0
    result = json.loads((out / "learning_curves_t.json").read_text())
    B = result["meta"]["budgets"][0]["B"]
    refs = result["corpora"][str(other)]["references"]["records"]
    other_items = {r["item"] for r in refs if r["part"] == "text"}
    assert len(other_items) == 3
    streaming_kl = [sorted(r["kl"] for r in records if r["policy"] == "streaming")
                    for records in (refs, result["references"]["records"])]
    assert streaming_kl[0] != streaming_kl[1]  # another corpus's sequences (item names restart per corpus)
    assert {r["policy"] for r in refs} == {"streaming", "oracle"}
    markdown = (out / "learning_curves_t.md").read_text()
    assert f"## `{other}` (never trained on), held-out text at B = {B}" in markdown
    assert f"## `{other}` (never trained on): keep/evict decisions at s2-w8-k16" in markdown
    assert len(result["points"]) == 2
    for point in result["points"]:
        corpus = point["corpora"][str(other)]
        mine = {r["item"]: r["kl"] for r in corpus["records"] if r["policy"] == "kvpop" and r["part"] == "text"}
        assert set(mine) == other_items
        entry = curves._find(corpus["summary"]["metrics"], metric="kl", B=B)
        assert entry["estimate"] == pytest.approx(np.mean(list(mine.values())), abs=1e-6)
        d = curves._find(corpus["summary"]["differences"], metric="kl", B=B, vs="streaming")
        streaming = {r["item"]: r["kl"] for r in refs if r["policy"] == "streaming" and r["B"] == B}
        ref = stats.paired_difference([round(mine[i], 6) for i in sorted(mine)],
                                      [round(streaming[i], 6) for i in sorted(mine)], resamples=200)
        assert (d["n"], d["estimate"]) == (3, pytest.approx(ref.estimate))
        assert curves._difference(d, 5) in markdown
        decisions = corpus["diagnostics"]["budgets"]["s2-w8-k16"]["scorer"]
        main = point["diagnostics"]["budgets"]["s2-w8-k16"]["scorer"]
        assert 0 <= decisions["agreement"] <= 1 and decisions["agreement"] != main["agreement"]  # other sequences
    capsys.readouterr()
    assert curves.main(argv(tiny_setup, out, "--eval-sources", str(tiny_setup / "docs.jsonl"))) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is the training corpus" in err, err


def test_references_of_a_finished_study_are_reused_only_where_measured_alike(tiny_setup, home, tmp_path, capsys):
    """``--references-from``: a run on the same items reuses the saved streaming / TOVA / oracle records of the very
    same budgets (on every corpus) and measures the rest; the records it reuses are the ones a fresh run measures."""
    from tests.models import write_docs

    other = tmp_path / "other.jsonl"
    write_docs(other, 30, seed=7, min_words=40, max_words=90)
    common = ["--checkpoints", str(TOKENS_PER_STEP), "--eval-sources", str(other), "--heuristics", "tova",
              "--dynamic-sequences", "2"]

    def study(name, *extra) -> dict:
        assert curves.main(argv(tiny_setup, tmp_path / name, *common, *extra)) == 0
        return json.loads((tmp_path / name / "learning_curves_t.json").read_text())

    def text(records) -> dict:
        return {(r["policy"], r["budget"], r["item"]): (r["kl"], r["top1_agreement"]) for r in records
                if r["part"] == "text"}

    first = study("first")
    saved = tmp_path / "first" / "learning_curves_t.json"
    # another window at the same B: streaming's budget is unchanged, TOVA's and the oracle's are not
    narrow = study("narrow", "--window", "4", "--references-from", str(saved))
    fresh = study("fresh", "--window", "4")
    assert narrow["references"]["reused_from"]["settings"] == ["streaming@s2-w30-k0"]
    for run, ref in ((narrow, fresh), (narrow, first)):
        assert {k: v for k, v in text(run["references"]["records"]).items() if k[0] == "streaming"} == \
            {k: v for k, v in text(ref["references"]["records"]).items() if k[0] == "streaming"}
    assert text(narrow["references"]["records"]) == text(fresh["references"]["records"])  # TOVA, oracle measured
    assert text(narrow["corpora"][str(other)]["references"]["records"]) == \
        text(fresh["corpora"][str(other)]["references"]["records"])
    # the same budget and β, another learning rate: everything reused, nothing measured
    again = study("again", "--lr", "0.01", "--references-from", str(saved))
    assert again["references"]["reused_from"]["settings"] == ["oracle@s2-w8-k22", "streaming@s2-w30-k0",
                                                              "tova@s2-w8-k22"]
    assert text(again["references"]["records"]) == text(first["references"]["records"])
    assert "reused from" in (tmp_path / "again" / "learning_curves_t.md").read_text()
    # other targets: the oracle is measured again
    beta = study("beta", "--query-power", "4", "--references-from", str(saved))
    assert "oracle@s2-w8-k22" not in beta["references"]["reused_from"]["settings"]
    # a corpus the saved study did not evaluate: measured here, the others' records still reused
    third = tmp_path / "third.jsonl"
    write_docs(third, 30, seed=9, min_words=40, max_words=90)
    more = study("more", "--eval-sources", str(other), str(third), "--references-from", str(saved))
    assert more["references"]["reused_from"]["corpora"] == {str(other): again["references"]["reused_from"]["settings"],
                                                            str(third): []}
    assert text(more["corpora"][str(other)]["references"]["records"]) == \
        text(first["corpora"][str(other)]["references"]["records"])
    measured = more["corpora"][str(third)]["references"]["records"]
    items = {r["item"] for r in measured}
    assert len(items) == 3 and {r["policy"] for r in measured} == {"streaming", "tova", "oracle"}
    assert {r["item"] for r in measured if r["policy"] == "tova"} == set(sorted(items)[:2])  # --dynamic-sequences 2
    assert f"on `{third}`: none" in (tmp_path / "more" / "learning_curves_t.md").read_text()
    capsys.readouterr()
    assert curves.main(argv(tiny_setup, tmp_path / "bad", *common, "--eval-sequences", "2", "--references-from",
                            str(saved))) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "eval_sequences 2 (there 3)" in err, err


def test_other_heldout_text_under_the_same_name_is_refused(tiny_setup, home, tmp_path, capsys, monkeypatch):
    """A corpus rebuilt under the same name (a local file rewritten, the stdlib of another Python) has other held-out
    sequences: ``--references-from`` and ``--resume`` refuse it in one line naming it; the same text is accepted."""
    import importlib

    from tests.models import write_docs

    # the CLI process sets HF_DATASETS_DISABLE_PROGRESS_BARS before datasets is imported; here it may be already
    monkeypatch.setattr(importlib.import_module("datasets.utils.tqdm"), "_hf_datasets_progress_bars_disabled", True)
    other = tmp_path / "other.jsonl"
    write_docs(other, 30, seed=7, min_words=40, max_words=90)
    common = ["--checkpoints", str(TOKENS_PER_STEP), "--eval-sources", str(other)]
    assert curves.main(argv(tiny_setup, tmp_path / "first", *common, "--save-state", str(tmp_path / "state"))) == 0
    saved = tmp_path / "first" / "learning_curves_t.json"
    digests = json.loads(saved.read_text())["meta"]["heldout_sha256"]
    assert set(digests) == {str(tiny_setup / "docs.jsonl"), str(other)} and len(set(digests.values())) == 2
    assert curves.main(argv(tiny_setup, tmp_path / "same", *common, "--references-from", str(saved))) == 0

    write_docs(other, 30, seed=8, min_words=40, max_words=90)  # the same name, other documents

    def refused(*extra) -> str:
        capsys.readouterr()
        assert curves.main(argv(tiny_setup, tmp_path / "changed", "--eval-sources", str(other), *extra)) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "other held-out sequences" in err and str(other) in err, err
        assert str(tiny_setup / "docs.jsonl") + " (" not in err  # the training corpus is unchanged
        return err

    assert "--references-from" in refused("--checkpoints", str(TOKENS_PER_STEP), "--references-from", str(saved))
    assert "--resume" in refused("--checkpoints", str(2 * TOKENS_PER_STEP), "--resume", str(tmp_path / "state"))
    assert not (tmp_path / "changed" / "learning_curves_t.json").exists()


def test_recency_blend_rules_take_the_oracle_recency_apart():
    """``--oracle-recency`` names the oracle+λ rules (default: each ``--recency`` λ; none given: the oracle alone);
    without ``--oracle`` or with a negative λ it is refused (exit 2)."""
    from research import recency_blend

    base = ["--checkpoint", "x", "--recency", "0.002", "0.003", "--oracle"]
    kvpop = ["streaming", "kvpop", "kvpop+0.002", "kvpop+0.003"]
    assert recency_blend.rules_of(recency_blend.parse_args(base)) == [*kvpop, "oracle", "oracle+0.002", "oracle+0.003"]
    assert recency_blend.rules_of(recency_blend.parse_args([*base, "--oracle-recency"])) == [*kvpop, "oracle"]
    assert recency_blend.rules_of(recency_blend.parse_args([*base, "--oracle-recency", "0.001"])) == [
        *kvpop, "oracle", "oracle+0.001"]
    for bad in (["--checkpoint", "x", "--recency", "0.002", "--oracle-recency", "0.001"], [*base, "--oracle-recency",
                                                                                           "-0.001"]):
        with pytest.raises(SystemExit) as exit_:
            recency_blend.parse_args(bad)
        assert exit_.value.code == 2


def test_recency_blend_of_a_saved_scorer_spans_the_scorer_to_streaming(tiny_setup, home, saved, tmp_path, capsys,
                                                                       monkeypatch):
    """``research/recency_blend.py``: λ = 0 is the scorer's own ranking, a λ that outweighs every score keeps the
    newest tokens — streaming's kept set, so streaming's numbers; a re-run measures nothing again; records of another
    budget are refused in one line."""
    import importlib

    from research import recency_blend

    manifest = json.loads((saved / "state.json").read_text())
    common = ["--checkpoint", str(saved / manifest["model"]), "--model", str(tiny_setup / "teacher"), "--sources",
              str(tiny_setup / "docs.jsonl"), "--sequences", "3", "--seq-len", "64", "--out", str(tmp_path),
              "--tag", "t"]
    recall = ["--recall-tasks", "niah_single", "--recall-contexts", "128", "--recall-depths", "0.2",
              "--recall-samples", "2", "--recall-min-dense", "0"]
    assert recency_blend.main([*common, "--recency", "0.01", "1e6", *recall]) == 0
    items = tmp_path / "recency_blend_t_items.jsonl"
    records = [json.loads(line) for line in items.read_text().splitlines()]
    by = {(r["rule"], r["item"]): r for r in records}
    assert sorted({r["rule"] for r in records}) == ["kvpop", "kvpop+0.01", "kvpop+1e+06", "streaming"]
    for item in range(3):
        assert by["kvpop+1e+06", item]["kl"] == pytest.approx(by["streaming", item]["kl"], abs=1e-5)
    assert any(abs(by["kvpop", i]["kl"] - by["streaming", i]["kl"]) > 1e-4 for i in range(3))  # the scorer's own
    result = json.loads((tmp_path / "recency_blend_t.json").read_text())
    cell = result["summary"][str(tiny_setup / "docs.jsonl")]
    assert cell["kl:kvpop+1e+06-streaming"]["mean"] == pytest.approx(0, abs=1e-5)
    assert "| kvpop+0.01 |" in (tmp_path / "recency_blend_t.md").read_text()
    answers = [json.loads(line) for line in (tmp_path / "recency_blend_t_recall.jsonl").read_text().splitlines()]
    by = {(r["rule"], r["item"]): r for r in answers}
    assert sorted({r["rule"] for r in answers}) == ["dense", "kvpop", "kvpop+0.01", "kvpop+1e+06", "streaming"]
    assert len(answers) == 5 * 2  # dense kept once
    for item in {r["item"] for r in answers}:
        assert by["kvpop+1e+06", item]["logprob"] == pytest.approx(by["streaming", item]["logprob"], abs=1e-4)
        assert by["kvpop+1e+06", item]["text"] == by["streaming", item]["text"]
    assert result["recall"]["logprob:kvpop+1e+06-streaming"]["mean"] == pytest.approx(0, abs=1e-4)
    assert recency_blend.main([*common, "--recency", "0.01", "1e6", *recall]) == 0
    assert len(items.read_text().splitlines()) == len(records)  # all there: nothing measured again
    # against the scorer's own study (the same held-out sequences), at the B it evaluated (s2-w8-k22)
    study = saved.parent / "out" / "learning_curves_t.json"
    assert recency_blend.main([*common[:-1], "at32", "--topk", "22", "--recency", "1e6", "--references-from",
                               str(study)]) == 0
    versus = json.loads((tmp_path / "recency_blend_at32.json").read_text())["versus_references"]
    cell = versus[str(tiny_setup / "docs.jsonl")]
    assert cell["streaming_here_minus_there"]["kl"] == pytest.approx(0, abs=1e-5)  # paired by sequence id
    last = json.loads(study.read_text())["points"][-1]["summary"]["gap_closed"]
    theirs = next(g for g in last if g["metric"] == "kl")
    assert cell["gap:kvpop"]["mean"] == pytest.approx(theirs["estimate"], abs=1e-3)
    assert cell["gap:kvpop+1e+06"]["mean"] == pytest.approx(0, abs=1e-3)
    assert cell["kl:kvpop-tova"]["n"] == 0  # the study ran no TOVA
    assert "streaming here − there" in (tmp_path / "recency_blend_at32.md").read_text()
    # --oracle: the oracle computed here is the study's (all of its gap), and one that outweighs every target streaming
    assert recency_blend.main([*common[:-1], "or32", "--topk", "22", "--recency", "1e6", "--oracle", "--query-power",
                               "1", "--references-from", str(study), *recall]) == 0
    oracle = json.loads((tmp_path / "recency_blend_or32.json").read_text())
    assert oracle["rules"] == ["streaming", "kvpop", "kvpop+1e+06", "oracle", "oracle+1e+06"]
    # recall has no oracle rules (the oracle's targets are of the held-out text): its table leaves them out
    assert sorted(oracle["recall"]["exact"]) == ["dense", "kvpop", "kvpop+1e+06", "streaming"]
    assert "| exact | kvpop+1e+06 |" in (tmp_path / "recency_blend_or32.md").read_text()
    cell = oracle["versus_references"][str(tiny_setup / "docs.jsonl")]
    assert cell["gap:oracle"]["mean"] == pytest.approx(1, abs=1e-3)
    assert cell["gap:oracle+1e+06"]["mean"] == pytest.approx(0, abs=1e-3)
    kl = oracle["summary"][str(tiny_setup / "docs.jsonl")]
    assert kl["kl:oracle+1e+06-oracle"]["mean"] == pytest.approx(kl["kl"]["streaming"] - kl["kl"]["oracle"], abs=1e-5)
    # the gap against the oracle measured here: the same as against the study's (its oracle on the same sequences)
    assert kl["gap:kvpop"]["mean"] == pytest.approx(cell["gap:kvpop"]["mean"], abs=1e-3)
    assert kl["gap:kvpop+1e+06"]["mean"] == pytest.approx(0, abs=1e-3)
    assert len((tmp_path / "recency_blend_t_recall.jsonl").read_text().splitlines()) == len(answers)
    # --anchors: every slot an anchor (share 1) ranked by the scorer alone is the scorer, whatever the decay; half of
    # them leaves the other half streaming's, so the rule lies apart from both
    assert recency_blend.main([*common[:-1], "an", "--recency", "1e6", "--anchors", "1", "0.5", *recall]) == 0
    anchored = json.loads((tmp_path / "recency_blend_an.json").read_text())
    assert anchored["rules"] == ["streaming", "kvpop", "kvpop+1e+06", "kvpop+1e+06@a1", "kvpop+1e+06@a0.5"]
    by = {(r["rule"], r["item"]): r for r in map(json.loads, (tmp_path / "recency_blend_an_items.jsonl").open())}
    for item in range(3):
        assert by["kvpop+1e+06@a1", item]["kl"] == pytest.approx(by["kvpop", item]["kl"], abs=1e-5)
    assert any(abs(by["kvpop+1e+06@a0.5", i]["kl"] - by[rule, i]["kl"]) > 1e-5 for i in range(3)
               for rule in ("kvpop", "streaming"))
    cell = anchored["summary"][str(tiny_setup / "docs.jsonl")]
    assert cell["kl:kvpop+1e+06@a1-kvpop+1e+06"]["mean"] == pytest.approx(
        cell["kl"]["kvpop"] - cell["kl"]["kvpop+1e+06"], abs=1e-5)  # paired with the same λ without anchors
    assert anchored["recall"]["logprob:kvpop+1e+06@a1-kvpop+1e+06"]["mean"] == pytest.approx(
        anchored["recall"]["logprob"]["kvpop"] - anchored["recall"]["logprob"]["kvpop+1e+06"], abs=1e-4)
    assert "| kvpop+1e+06@a0.5 |" in (tmp_path / "recency_blend_an.md").read_text()
    # --summarize: the same result from the committed records alone; a rule never measured is one line
    assert recency_blend.main([*common[:-1], "an", "--recency", "1e6", "--anchors", "1", "0.5", *recall,
                               "--summarize"]) == 0
    again = json.loads((tmp_path / "recency_blend_an.json").read_text())
    assert again["summary"] == anchored["summary"] and again["recall"] == anchored["recall"]
    capsys.readouterr()
    assert recency_blend.main([*common[:-1], "an", "--recency", "0.5", "--summarize"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "measure them (without --summarize)" in err, err
    # --reference-source: the study's corpus under another name pairs by id where streaming is identical there
    docs = str(tiny_setup / "docs.jsonl")
    renamed = json.loads(study.read_text())
    renamed["meta"]["study"]["source"] = "renamed"
    renamed["meta"]["heldout_sha256"] = {"renamed": renamed["meta"]["heldout_sha256"][docs]}
    (tmp_path / "renamed.json").write_text(json.dumps(renamed))
    aliased = [*common[:-1], "at32", "--topk", "22", "--recency", "1e6", "--references-from",
               str(tmp_path / "renamed.json"), "--reference-source", f"{docs}=renamed"]
    assert recency_blend.main([*aliased, "--summarize"]) == 0
    cell = json.loads((tmp_path / "recency_blend_at32.json").read_text())["versus_references"][docs]
    assert cell["gap:kvpop"]["mean"] == pytest.approx(theirs["estimate"], abs=1e-3)
    for record in renamed["references"]["records"]:
        record["kl"] += 0.01  # other text: streaming is not the same there
    (tmp_path / "renamed.json").write_text(json.dumps(renamed))
    capsys.readouterr()
    assert recency_blend.main([*aliased, "--summarize"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not the same held-out text" in err, err
    # a study whose held-out text under this corpus's name was another: refused in one line, before the model loads
    other = json.loads(study.read_text())
    other["meta"]["heldout_sha256"] = {name: "0" * 64 for name in other["meta"]["heldout_sha256"]}
    (tmp_path / "other_study.json").write_text(json.dumps(other))
    # the CLI process sets HF_DATASETS_DISABLE_PROGRESS_BARS before datasets is imported; here it may be already
    monkeypatch.setattr(importlib.import_module("datasets.utils.tqdm"), "_hf_datasets_progress_bars_disabled", True)
    capsys.readouterr()
    assert recency_blend.main([*common[:-1], "ot", "--recency", "1e6", "--references-from",
                               str(tmp_path / "other_study.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "other held-out sequences under the same corpus name" in err, err
    assert not (tmp_path / "recency_blend_ot_items.jsonl").exists()
    # --streaming-layers: every layer streaming makes each kvpop rule streaming's kept set, whatever its λ; the
    # records carry the layers (a tag measured without them is refused), a layer the model lacks is one line
    layers = json.loads((tiny_setup / "teacher" / "config.json").read_text())["num_hidden_layers"]
    assert recency_blend.main([*common[:-1], "sl", "--recency", "0.01", "--streaming-layers",
                               *map(str, range(layers))]) == 0
    by = {(r["rule"], r["item"]): r for r in map(json.loads, (tmp_path / "recency_blend_sl_items.jsonl").open())}
    assert all(r["streaming_layers"] == list(range(layers)) for r in by.values())
    for item in range(3):
        for rule in ("kvpop", "kvpop+0.01"):
            assert by[rule, item]["kl"] == pytest.approx(by["streaming", item]["kl"], abs=1e-5)
    assert "streaming layers [0" in (tmp_path / "recency_blend_sl.md").read_text()
    # a checkpoint saved with streaming layers is loaded with them (the default of --streaming-layers)
    import shutil

    from research.learning_curves import load_saved_scorer
    from research.scorer_records import saved_scorer
    from kvpop.retrofit import runtime_of

    calibrated = tmp_path / "calibrated"
    shutil.copytree(saved / manifest["model"], calibrated)
    meta = json.loads((calibrated / "kvpop.json").read_text())
    (calibrated / "kvpop.json").write_text(json.dumps({**meta, "streaming_layers": [layers - 1]}))
    meta, configs = saved_scorer(calibrated, str(tiny_setup / "teacher"), [str(tiny_setup / "docs.jsonl")], 64, 3)
    assert runtime_of(load_saved_scorer(calibrated, meta, configs[0])).streaming_layers == {layers - 1}
    for extra, message in ((["--tag", "t", "--streaming-layers", "0"], "use another --tag"),
                           (["--tag", "sl2", "--streaming-layers", str(layers)], "--streaming-layers")):
        capsys.readouterr()
        assert recency_blend.main([*common[:-2], *extra, "--recency", "0.01"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err
    capsys.readouterr()
    assert recency_blend.main([*common, "--recency", "0.01", "--topk", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "use another --tag" in err, err


def test_transfer_diagnostics_of_a_saved_scorer_per_corpus(tiny_setup, home, saved, tmp_path, capsys):
    """``research/transfer_diagnostics.py`` on a study's saved scorer: the training corpus's numbers are the study's
    own diagnostics of the same sequences; another corpus gets its own; a folder without a scorer is one line."""
    from research import transfer_diagnostics as transfer
    from tests.models import write_docs

    manifest = json.loads((saved / "state.json").read_text())
    other = tmp_path / "other.jsonl"
    write_docs(other, 30, seed=7, min_words=40, max_words=90)
    common = ["--model", str(tiny_setup / "teacher"), "--seq-len", "64", "--sequences", "3", "--batch", "3",
              "--out", str(tmp_path), "--tag", "t"]
    assert transfer.main(["--checkpoint", str(saved / manifest["model"]), "--sources", str(tiny_setup / "docs.jsonl"),
                          str(other), "--topks", "4", *common]) == 0
    result = json.loads((tmp_path / "transfer_diagnostics_t.json").read_text())
    mine, theirs = (result["sources"][str(src)]["budgets"]["s2-w8-k16"]["scorer"]
                    for src in (tiny_setup / "docs.jsonl", other))
    study = manifest["result"]["points"][-1]["diagnostics"]["budgets"]["s2-w8-k16"]["scorer"]
    assert mine["agreement"] == pytest.approx(study["agreement"], abs=1e-5)  # same scorer, same held-out sequences
    assert theirs["agreement"] != pytest.approx(mine["agreement"], abs=1e-5)
    assert (tmp_path / "transfer_diagnostics_t_layers.png").stat().st_size > 0
    for found in result["sources"].values():  # the attention each rule evicts, at both budgets, per sequence
        assert sorted(found["attention"]) == ["s2-w8-k16", "s2-w8-k4"]
        for rules in found["attention"].values():
            assert sorted(rules) == ["newest", "oldest", "oracle", "random", "scorer"]
            assert len(rules["scorer"]["lost_per_sequence"]) == 3
            assert rules["newest"]["lost_near"] == pytest.approx(0, abs=1e-6)  # streaming keeps its own band
    report = (tmp_path / "transfer_diagnostics_t.md").read_text()
    assert report.count("| s2-w8-k4 |") == 2 and "under each rule's evictions" in report
    assert transfer.main(["--checkpoint", str(saved / manifest["model"]), "--sources", str(other), "--no-decisions",
                          *common]) == 0  # the attention view alone: the same numbers
    alone = json.loads((tmp_path / "transfer_diagnostics_t.json").read_text())["sources"][str(other)]
    assert "budgets" not in alone
    assert alone["attention"]["s2-w8-k16"]["scorer"]["output_error"] == pytest.approx(
        result["sources"][str(other)]["attention"]["s2-w8-k16"]["scorer"]["output_error"], abs=1e-6)
    capsys.readouterr()
    assert transfer.main(["--checkpoint", str(tmp_path), "--sources", str(other), *common]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no kvpop.json" in err, err


def test_streaming_layers_benchmark_calibrates_on_training_text_scores_held_out_and_resumes(tiny_setup, home, saved,
                                                                                               tmp_path, capsys):
    """``research/streaming_layers.py`` on a study's saved scorer: the layers it calibrates are
    :func:`kvpop.diagnostics.streaming_layers`'s on the training split; every layer streaming scores exactly as
    streaming; a re-run measures nothing again; other layers on the same records are refused in one line."""
    from research import streaming_layers as bench
    from research.learning_curves import corpus_config
    from kvpop.diagnostics import streaming_layers
    from pipelines.data import load_sequences, load_tokenizer

    checkpoint = saved / json.loads((saved / "state.json").read_text())["model"]
    docs = str(tiny_setup / "docs.jsonl")
    common = ["--checkpoint", str(checkpoint), "--model", str(tiny_setup / "teacher"), "--seq-len", "64",
              "--sources", docs, "--sequences", "3", "--dynamic-sequences", "1", "--out", str(tmp_path)]
    assert bench.main([*common, "--calibrate-source", docs, "--calibrate-sequences", "2", "--tag", "cal"]) == 0
    result = json.loads((tmp_path / "streaming_layers_cal.json").read_text())
    meta = json.loads((checkpoint / "kvpop.json").read_text())
    cfg = corpus_config(str(tiny_setup / "teacher"), docs, 64, meta["budget"], 1.0, 1, train_sequences=2)
    ids = torch.tensor([r["input_ids"] for r in load_sequences(cfg, "train", load_tokenizer(cfg))[:2]])
    model = curves.load_saved_scorer(checkpoint, meta, cfg)
    assert result["layers"] == streaming_layers(model, ids)["layers"] == result["calibration"]["layers"]
    records = (tmp_path / "streaming_layers_cal_items.jsonl").read_text().splitlines()
    assert len(records) == 3 * 3 + 2  # three static rules per sequence, TOVA and H2O on the first
    calibration = (tmp_path / "streaming_layers_cal_calibration.json").read_text()
    assert bench.main([*common, "--calibrate-source", docs, "--calibrate-sequences", "2", "--tag", "cal"]) == 0
    assert (tmp_path / "streaming_layers_cal_items.jsonl").read_text().splitlines() == records  # nothing re-measured
    assert (tmp_path / "streaming_layers_cal_calibration.json").read_text() == calibration  # nor re-calibrated
    capsys.readouterr()
    assert bench.main([*common, "--calibrate-source", docs, "--calibrate-sequences", "1", "--tag", "cal"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "holds a calibration of checkpoint" in err and "sequences 2" in err, err

    every = f"0-{model.kvpop_runtime.num_layers - 1}"
    assert bench.main([*common, "--layers", every, "--tag", "all"]) == 0
    cell = json.loads((tmp_path / "streaming_layers_all.json").read_text())["summary"][docs]
    assert cell["items"] == [0, 1, 2] and cell["dynamic_items"] == [0]
    assert cell["kl"]["kvpop+streaming_layers"] == pytest.approx(cell["kl"]["streaming"], abs=1e-6)
    assert cell["kl"]["kvpop"] != pytest.approx(cell["kl"]["streaming"], abs=1e-6)
    assert cell["kl:kvpop+streaming_layers-streaming"]["mean"] == pytest.approx(0, abs=1e-6)
    assert cell["kl:kvpop+streaming_layers-tova"]["n"] == 1
    assert "| top1 |" in (tmp_path / "streaming_layers_all.md").read_text()
    capsys.readouterr()
    assert bench.main([*common, "--layers", "0", "--tag", "all"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "holds records of checkpoint" in err and "layers [0, 1" in err, err
    assert bench.main([*common, "--layers", "0", "--checkpoint", str(tmp_path)]) == 2
    assert "no kvpop.json" in capsys.readouterr().err


def test_a_study_on_the_window_attention_prior_trains_and_saves_it(tiny_setup, home, tmp_path):
    """``--window-attention-prior``: the scorers train on top of the prior and the saved folder carries it, so the
    evaluation of the saved scorer ranks as training did."""
    out = tmp_path / "out"
    assert curves.main(argv(tiny_setup, out, "--checkpoints", str(TOKENS_PER_STEP), "--window-attention-prior",
                            "--heuristics", "window_attention", "--save-state", str(tmp_path / "state"))) == 0
    manifest = json.loads((tmp_path / "state" / "state.json").read_text())
    meta = json.loads((tmp_path / "state" / manifest["model"] / "kvpop.json").read_text())
    assert meta["window_attention_prior"] is True and manifest["study"]["window_attention_prior"] is True
    assert "on the window attention prior" in (out / "learning_curves_t.md").read_text()
    result = json.loads((out / "learning_curves_t.json").read_text())
    kvpop_kl = {r["item"]: r["kl"] for r in result["points"][-1]["records"] if r["part"] == "text"}
    wa_kl = {r["item"]: r["kl"] for r in result["references"]["records"]
             if r["policy"] == "window_attention" and r["part"] == "text"}
    assert len(kvpop_kl) == len(wa_kl) == 3 and kvpop_kl != wa_kl  # the scorer adds to the prior


def test_window_attention_benchmark_scores_held_out_and_resumes(tiny_setup, home, saved, tmp_path, capsys):
    """``research/window_attention.py`` on a study's saved scorer: four static rules per sequence and TOVA / H2O
    on the first, each record equal to the policy's own teacher-forced metrics; a re-run measures nothing again;
    another checkpoint's records and a folder without ``kvpop.json`` are refused in one line."""
    import kvpop
    from research import window_attention as bench
    from research.learning_curves import corpus_config
    from kvpop.evaluation import Setting, teacher_forced_items
    from pipelines.data import load_sequences, load_tokenizer

    checkpoint = saved / json.loads((saved / "state.json").read_text())["model"]
    docs = str(tiny_setup / "docs.jsonl")
    common = ["--model", str(tiny_setup / "teacher"), "--seq-len", "64", "--sources", docs, "--sequences", "3",
              "--dynamic-sequences", "1", "--out", str(tmp_path), "--tag", "t"]
    assert bench.main(["--checkpoint", str(checkpoint), *common]) == 0
    records = (tmp_path / "window_attention_t_items.jsonl").read_text().splitlines()
    assert len(records) == 3 * 4 + 2
    meta = json.loads((checkpoint / "kvpop.json").read_text())
    cfg = corpus_config(str(tiny_setup / "teacher"), docs, 64, meta["budget"], 1.0, 3)
    rows = load_sequences(cfg, "eval", load_tokenizer(cfg))[:3]
    model = curves.load_saved_scorer(checkpoint, meta, cfg)
    setting = Setting("window_attention", kvpop.Budget(**meta["budget"]))
    expected = teacher_forced_items(model, [torch.tensor(r["input_ids"]) for r in rows], [Setting("dense"), setting])
    found = {r["item"]: r for r in map(json.loads, records) if r["rule"] == "window_attention"}
    for e in (e for e in expected if e["policy"] == "window_attention"):
        assert found[e["item"]]["kl"] == pytest.approx(e["kl"], abs=1e-5)
    cell = json.loads((tmp_path / "window_attention_t.json").read_text())["summary"][docs]
    assert cell["items"] == [0, 1, 2] and cell["dynamic_items"] == [0]
    assert cell["kl"]["window_attention"] != pytest.approx(cell["kl"]["streaming"], abs=1e-6)
    assert cell["kl:window_attention-tova"]["n"] == 1 and cell["kl:window_attention-streaming"]["n"] == 3
    assert "| top1 |" in (tmp_path / "window_attention_t.md").read_text()
    assert bench.main(["--checkpoint", str(checkpoint), *common]) == 0
    assert (tmp_path / "window_attention_t_items.jsonl").read_text().splitlines() == records  # nothing re-measured
    other = shutil.copytree(checkpoint, tmp_path / "other")
    capsys.readouterr()
    assert bench.main(["--checkpoint", str(other), *common]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "holds records of checkpoint" in err, err
    assert bench.main(["--checkpoint", str(tmp_path), *common]) == 2
    assert "no kvpop.json" in capsys.readouterr().err


def test_shards_stay_under_the_limit_and_round_trip(tmp_path):
    generator = torch.Generator().manual_seed(0)
    tensors = {f"layer.{i}.exp_avg": torch.randn(i + 1, 7, generator=generator) for i in range(12)}
    names = curves.write_shards(tmp_path, "optimizer", tensors, limit=200)
    assert len(names) > 1
    back = {}
    for name in names:
        part = load_file(str(tmp_path / name))
        assert sum(t.numel() * t.element_size() for t in part.values()) <= 200 or len(part) == 1
        back.update(part)
    assert sorted(back) == sorted(tensors) and all(torch.equal(back[k], tensors[k]) for k in tensors)


def test_epoch_order_resumes_where_it_stopped():
    one = curves.EpochOrder(5, seed=3)
    drawn = [one.take(2) for _ in range(7)]
    for epoch in range(2):  # every epoch is a permutation of the pool
        assert sorted(sum(drawn, [])[5 * epoch:5 * epoch + 5]) == list(range(5))
    first = curves.EpochOrder(5, seed=3)
    for _ in range(3):
        first.take(2)
    second = curves.EpochOrder(5, seed=99)
    second.load(json.loads(json.dumps(first.state())))
    assert [second.take(2) for _ in range(4)] == drawn[3:]


def test_a_study_saved_before_query_power_resumes_at_beta_one(tmp_path):
    """Studies saved before ``--query-power`` existed trained on the mean (β = 1): they resume with it, not another."""
    from pipelines.config import ConfigError

    saved = {"seq_len": 64}
    curves.check_resume(tmp_path, saved, {"seq_len": 64, "query_power": 1.0})
    with pytest.raises(ConfigError, match="--query-power 8.0 \\(saved 1.0\\)"):
        curves.check_resume(tmp_path, saved, {"seq_len": 64, "query_power": 8.0})


def test_a_mixed_in_corpus_joins_the_pool_with_its_training_split_only(tiny_setup, home, tmp_path, capsys):
    """``--mix-source``: its training sequences follow the training corpus's in the pool, its held-out ones never
    enter it; the held-out items (and so the references) stay the training corpus's; bad pairings are one line."""
    from pipelines.data import load_sequences, mix_config
    from tests.models import write_docs

    mixed = tmp_path / "mixed.jsonl"
    write_docs(mixed, 30, seed=11, min_words=40, max_words=90)
    out = tmp_path / "out"
    args = curves.parse_args(argv(tiny_setup, out, "--checkpoints", str(TOKENS_PER_STEP), "--mix-source", str(mixed),
                                  "--mix-sequences", "3"))
    study = curves.open_study(args)
    train_ids, heldout = curves.load_data(study.cfg, study.tokenizer, study.training)
    own = load_sequences(study.cfg, "train", study.tokenizer)
    # the mix corpus as the study built it before the pipeline's data mix existed (its own config)
    alone = curves.corpus_config(args.model, str(mixed), args.seq_len, curves.training_budget(args), args.query_power,
                                 args.eval_sequences, args.seed, 3)
    assert mix_config(study.training).data == alone.data and study.cfg.data.mix_source is None
    theirs = {split: load_sequences(alone, split, study.tokenizer) for split in ("train", "eval")}
    pool = [row.tolist() for row in train_ids]
    assert pool == [r["input_ids"] for r in own] + [r["input_ids"] for r in theirs["train"]]
    assert (len(own), len(theirs["train"])) == (5, 3)
    assert not {tuple(r["input_ids"]) for r in theirs["eval"]} & {tuple(row) for row in pool}
    assert [r["input_ids"] for r in heldout] == [r["input_ids"] for r in load_sequences(study.cfg, "eval",
                                                                                         study.tokenizer)]
    assert curves.main(argv(tiny_setup, out, "--checkpoints", str(TOKENS_PER_STEP), "--mix-source", str(mixed),
                            "--mix-sequences", "3")) == 0
    result = json.loads((out / "learning_curves_t.json").read_text())
    assert result["meta"]["train_sequences"] == 8 and result["meta"]["study"]["mix_sequences"] == 3
    assert f"a pool of 8 (3 of them from `{mixed}`)" in (out / "learning_curves_t.md").read_text()
    capsys.readouterr()
    for extra, message in [(["--mix-source", str(mixed)], "go together"),
                           (["--mix-sequences", "3"], "go together"),
                           (["--mix-source", str(mixed), "--mix-sequences", "3", "--eval-sources", str(mixed)],
                            "one of --eval-sources")]:
        assert curves.main(argv(tiny_setup, out, *extra)) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err


def test_planted_recall_enters_the_training_pool_only_and_is_part_of_the_study(tiny_setup, home, tmp_path, capsys):
    """``--recall-mix``: that share of the training corpus's sequences carry planted facts (data.recall_mix), the
    held-out ones are the unplanted study's, a resume must keep the share, and a share outside [0, 1] is one line."""
    from pipelines.config import ConfigError
    from pipelines.data import load_sequences

    long = ["--seq-len", "256", "--checkpoints", str(2 * 256)]
    plain = curves.open_study(curves.parse_args(argv(tiny_setup, tmp_path / "a", *long)))
    args = curves.parse_args(argv(tiny_setup, tmp_path / "b", *long, "--recall-mix", "0.4"))
    study = curves.open_study(args)
    assert study.cfg.data.recall_mix == 0.4 and plain.cfg.data.recall_mix == 0.0
    train_ids, heldout = curves.load_data(study.cfg, study.tokenizer, study.training)
    plain_ids, plain_heldout = curves.load_data(plain.cfg, plain.tokenizer, plain.training)
    rows = load_sequences(study.cfg, "train", study.tokenizer)
    planted = [i for i, r in enumerate(rows) if any(d.startswith("planted:") for d in r["docs"])]
    assert len(planted) == 2 and len(rows) == 5  # round(0.4 * 5)
    changed = [i for i in range(5) if train_ids[i].tolist() != plain_ids[i].tolist()]
    assert changed == planted
    assert [r["input_ids"] for r in heldout] == [r["input_ids"] for r in plain_heldout]
    settings = curves.study_settings(args, "sha", 5)
    assert settings["recall_mix"] == 0.4
    with pytest.raises(ConfigError, match="--recall-mix 0.0 \\(saved 0.4\\)"):
        curves.check_resume(tmp_path, settings, {**settings, "recall_mix": 0.0})
    curves.check_resume(tmp_path, {"seq_len": 256}, {"seq_len": 256, "recall_mix": 0.0})  # saved before it existed
    # the unplanted study's references are this one's: the same held-out items (the next GPU parts rely on it)
    assert curves.main(argv(tiny_setup, tmp_path / "a", *long)) == 0
    assert curves.main(argv(tiny_setup, tmp_path / "b", *long, "--recall-mix", "0.4", "--references-from",
                            str(tmp_path / "a" / "learning_curves_t.json"))) == 0
    report = (tmp_path / "b" / "learning_curves_t.md").read_text()
    assert "40% of the training corpus's with planted facts" in report and "reused from" in report
    capsys.readouterr()
    for value in ("-0.1", "1.5"):
        assert curves.main(argv(tiny_setup, tmp_path / "c", *long, "--recall-mix", value)) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "--recall-mix must be in [0, 1]" in err, err


def test_a_learned_per_head_recency_trains_and_is_reported(tiny_setup, home, tmp_path):
    """``--scorer-options '{"head_recency": true}'``: the per-head recency terms (METHOD §4) start at 0 and the
    retention loss moves them; the saved scorer carries them and the study reports the learned λ per layer."""
    assert curves.main(argv(tiny_setup, tmp_path / "out", "--checkpoints", str(4 * TOKENS_PER_STEP),
                            "--scorer-options", '{"head_recency": true}', "--save-state", str(tmp_path / "st"))) == 0
    learned = {k: v for k, v in _step_files(tmp_path / "st").items() if k.endswith("head_recency")}
    assert learned and all(v.abs().max() > 0 for v in learned.values())
    result = json.loads((tmp_path / "out" / "learning_curves_t.json").read_text())
    rates = result["points"][-1]["head_recency"]
    assert len(rates) == len(learned) and all(len(row) == v.numel() for row, v in zip(rates, learned.values()))


def test_a_study_with_kl_through_the_mask_trains_and_logs_the_kl(tiny_setup, home, tmp_path):
    """``--kl-options``: each step adds the relaxed forward's KL (kvpop.objective.KLThroughMask); the state keeps it
    per step beside the losses, and the scorers differ from the same study without it."""
    common = ["--checkpoints", str(3 * TOKENS_PER_STEP)]
    assert curves.main(argv(tiny_setup, tmp_path / "kl", *common, "--kl-options", '{"weight": 1, "tau": 0.5}',
                            "--save-state", str(tmp_path / "kl_state"))) == 0
    assert curves.main(argv(tiny_setup, tmp_path / "plain", *common, "--save-state", str(tmp_path / "plain_state"))) \
        == 0
    progress = json.loads((tmp_path / "kl_state" / "state.json").read_text())["progress"]
    assert len(progress["kls"]) == 3 and all(k > 0 for k in progress["kls"])
    assert json.loads((tmp_path / "plain_state" / "state.json").read_text())["progress"]["kls"] == []
    kl, plain = _step_files(tmp_path / "kl_state"), _step_files(tmp_path / "plain_state")
    assert any(not torch.equal(kl[name], plain[name]) for name in kl if not name.startswith("optimizer."))


def test_a_study_can_start_from_saved_scorers(tiny_setup, home, saved, tmp_path, capsys):
    """``--init-from``: at lr 0 the study's scorers stay the saved ones and its points measure exactly what the saved
    study's last point did; the weights' digest is a study setting (a resume without it is refused); a folder that is
    not a scorer folder, of another window or of other scorers is one line and exit 2."""
    folder = saved / json.loads((saved / "state.json").read_text())["model"]
    assert curves.main(argv(tiny_setup, tmp_path / "out", "--checkpoints", str(TOKENS_PER_STEP), "--lr", "0",
                            "--init-from", str(folder), "--save-state", str(tmp_path / "st"))) == 0
    mine = _step_files(tmp_path / "st")
    for name, value in load_file(str(folder / "kvpop_scorers.safetensors")).items():
        torch.testing.assert_close(mine[name], value, rtol=0, atol=0, msg=name)
    fine_tuned = json.loads((tmp_path / "out" / "learning_curves_t.json").read_text())
    first = json.loads((saved.parent / "out" / "learning_curves_t.json").read_text())
    kl = lambda point: sorted((x["item"], x["policy"], x["budget"], x["kl"]) for x in point["records"])  # noqa: E731
    assert kl(fine_tuned["points"][0]) == kl(fine_tuned["points"][-1]) == kl(first["points"][-1])
    assert kl(first["points"][0]) != kl(first["points"][-1])  # the saved study did move its scorers
    assert fine_tuned["meta"]["study"]["init_from"] != first["meta"]["study"].get("init_from") is None

    def fails(*extra) -> str:
        capsys.readouterr()
        assert curves.main(argv(tiny_setup, tmp_path / "bad", "--checkpoints", str(TOKENS_PER_STEP), *extra)) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        return err

    assert "not a saved scorer folder" in fails("--init-from", str(tmp_path))
    assert "trained at window 8" in fails("--init-from", str(folder), "--window", "6")
    assert "start from scorers of the same scorer and options" in fails("--init-from", str(folder), "--scorer", "mlp")
    assert "--init-from None (saved " in fails("--resume", str(tmp_path / "st"), "--checkpoints",
                                               str(3 * TOKENS_PER_STEP))
