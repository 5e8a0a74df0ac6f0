"""``research/more_references.py`` on CPU at a tiny size (the learning-curves tests' 2-layer random Llama, S = 64):
a study's TOVA / H2O measured on more of its held-out sequences equal what a study measuring them there from the
start records, a re-run measures nothing, and other text under a corpus's name is refused in one line."""
from __future__ import annotations

import json

import pytest

from research import learning_curves as curves
from research import more_references as more
from research.tests.test_learning_curves import TOKENS_PER_STEP, argv, home  # noqa: F401  (home: the module's KVPOP_HOME)

pytestmark = pytest.mark.pretrained  # SmolLM2's tokenizer (tiny_setup)


def _text(records, policy=None) -> dict:
    return {(r["policy"], r["B"], r["item"]): (r["kl"], r["top1_agreement"]) for r in records
            if r["part"] == "text" and (policy is None or r["policy"] == policy)}


@pytest.fixture(scope="module")
def studies(tiny_setup, home, tmp_path_factory):
    """The same study twice, TOVA and H2O on the first 1 and on all 3 held-out sequences, with another corpus."""
    from tests.models import write_docs

    root = tmp_path_factory.mktemp("studies")
    other = root / "other.jsonl"
    write_docs(other, 30, seed=7, min_words=40, max_words=90)
    out = {}
    for n in (1, 3):
        assert curves.main(argv(tiny_setup, root / f"d{n}", "--checkpoints", str(TOKENS_PER_STEP), "--eval-sources",
                                str(other), "--heuristics", "tova", "h2o", "--dynamic-sequences", str(n))) == 0
        out[n] = root / f"d{n}" / "learning_curves_t.json"
    return (out[1], out[3]), other


def test_more_sequences_equal_a_study_that_measured_them(tiny_setup, home, studies, tmp_path, capsys):
    (few, every), other = studies
    training = str(tiny_setup / "docs.jsonl")
    out = tmp_path / "ext.json"
    assert more.main(["--study", str(few), "--corpora", training, str(other), "--policies", "tova", "h2o",
                      "--sequences", "3", "--batch", "2", "--device", "cpu", "--out", str(out)]) == 0
    ext, full = json.loads(out.read_text()), json.loads(every.read_text())
    for name in (training, str(other)):
        mine, theirs = more.corpus_records(ext)[name], more.corpus_records(full)[name]
        for policy in ("tova", "h2o", "streaming", "oracle"):
            a, b = _text(mine, policy), _text(theirs, policy)
            assert sorted(a) == sorted(b) and len({k[2] for k in a}) == 3, (name, policy)
            for key in a:
                assert a[key] == pytest.approx(b[key], abs=1e-5), (name, key)
        assert ext["more_references"]["added"][name] == {"tova": 2, "h2o": 2}
    # the summaries are the study's own over the records it has now
    B = full["meta"]["budgets"][0]["B"]
    entry = curves._find(ext["corpora"][str(other)]["references"]["summary"]["metrics"], metric="kl", B=B,
                         policy="tova")
    assert entry["n"] == 3
    md = out.with_suffix(".md").read_text()
    assert f"| {other} | tova | {B} | 3 (2) |" in md

    capsys.readouterr()  # a re-run measures nothing
    assert more.main(["--study", str(few), "--corpora", str(other), "--policies", "tova", "--sequences", "3",
                      "--device", "cpu", "--out", str(out)]) == 0
    assert "nothing to measure" in capsys.readouterr().out
    assert json.loads(out.read_text())["more_references"]["added"] == ext["more_references"]["added"]


def test_other_text_or_bad_input_is_one_line(tiny_setup, home, studies, tmp_path, capsys, monkeypatch):
    import importlib

    from tests.models import write_docs

    # the CLI process sets HF_DATASETS_DISABLE_PROGRESS_BARS before datasets is imported; here it may be already
    monkeypatch.setattr(importlib.import_module("datasets.utils.tqdm"), "_hf_datasets_progress_bars_disabled", True)

    (few, _), other = studies

    def refused(*extra, out=tmp_path / "bad.json") -> str:
        capsys.readouterr()
        assert more.main(["--study", str(few), "--device", "cpu", "--out", str(out), *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        return err

    rebuilt = tmp_path / "rebuilt.jsonl"  # the same name's text read from another file: other documents
    write_docs(rebuilt, 30, seed=8, min_words=40, max_words=90)
    err = refused("--corpora", str(other), "--source-file", f"{other}={rebuilt}", "--sequences", "3")
    assert "other held-out sequences" in err and str(other) in err  # the study's digests, before the model loads
    old = tmp_path / "old.json"  # a study saved before the digests: streaming measured here tells
    old.write_text(json.dumps({**(study := json.loads(few.read_text())), "meta": {
        k: v for k, v in study["meta"].items() if k != "heldout_sha256"}}))
    capsys.readouterr()
    assert more.main(["--study", str(old), "--corpora", str(other), "--source-file", f"{other}={rebuilt}",
                      "--sequences", "3", "--device", "cpu", "--out", str(tmp_path / "bad.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the model's loading bar
    assert err.startswith("kvpop more_references: error: corpus") and "streaming here differs" in err, err
    assert not (tmp_path / "bad.json").exists()
    copy = tmp_path / "copy.jsonl"  # the training corpus's own text under another file name: accepted
    copy.write_bytes((tiny_setup / "docs.jsonl").read_bytes())
    training = str(tiny_setup / "docs.jsonl")
    assert more.main(["--study", str(old), "--corpora", training, "--source-file", f"{training}={copy}",
                      "--sequences", "2", "--device", "cpu", "--out", str(tmp_path / "copy.json")]) == 0
    assert json.loads((tmp_path / "copy.json").read_text())["more_references"]["added"] == {training: {"tova": 1}}
    assert "has no corpus" in refused("--corpora", "nowhere", "--sequences", "3")
    assert "--sequences must be 1 … 3" in refused("--corpora", str(other), "--sequences", "9")
    stray = tmp_path / "stray.json"
    stray.write_text(json.dumps({**json.loads(few.read_text()), "more_references": {"study": "another.json"}}))
    assert "extends another study" in refused("--corpora", str(other), "--sequences", "3", out=stray)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        more.main(["--study", str(few), "--corpora", str(other), "--source-file", "x=y", "--sequences", "3",
                   "--out", str(tmp_path / "o.json")])
    assert exit_info.value.code == 2 and "--source-file" in capsys.readouterr().err
