"""``research/python_docs_corpus.py``: reST sources -> a jsonl corpus that the data stage reads; bad input is one
line and exit code 2."""
from __future__ import annotations

import json

from research import python_docs_corpus as corpus
from pipelines.config import load_config
from pipelines.data import load_documents


def test_sources_become_a_corpus_the_data_stage_reads(tmp_path, capsys):
    sources = tmp_path / "_sources"
    (sources / "library").mkdir(parents=True)
    (sources / "library" / "json.rst.txt").write_text(":mod:`json` --- JSON encoder and decoder\n\nText.\n")
    (sources / "contents.rst.txt").write_text("Python Documentation contents\n")
    (sources / "empty.rst.txt").write_text("  \n")
    (sources / "conf.py").write_text("not a source\n")
    out = tmp_path / "docs.jsonl"
    assert corpus.main(["--sources", str(sources), "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["contents.rst.txt", "library/json.rst.txt"]  # by path, empty ones dropped
    assert rows[1]["text"].startswith(":mod:`json`")
    docs = load_documents(load_config(None, [f"data.source={out}", "data.id_field=id"]))
    assert [text for _, text in docs] == [r["text"] for r in rows]
    first = out.read_bytes()
    assert corpus.main(["--sources", str(sources), "--out", str(out)]) == 0 and out.read_bytes() == first
    capsys.readouterr()
    for argv, message in [(["--sources", str(tmp_path / "nowhere"), "--out", str(out)], "no such folder"),
                          (["--sources", str(sources / "library" / ".."), "--out", str(tmp_path / "x.json")],
                           "give a .jsonl path"),
                          (["--deb", str(tmp_path / "python3.11-doc.deb"), "--out", str(out)], "no such file")]:
        assert corpus.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err
    empty = tmp_path / "none"
    empty.mkdir()
    assert corpus.main(["--sources", str(empty), "--out", str(out)]) == 2
    assert "no non-empty *.rst.txt" in capsys.readouterr().err


def test_exclude_leaves_out_whole_subfolders_only(tmp_path, capsys):
    sources = tmp_path / "_sources"
    for path in ["translations/zh_CN/index.rst.txt", "translations.rst.txt", "admin-guide/translations/x.rst.txt",
                 "admin-guide/index.rst.txt", "translationsx/a.rst.txt"]:
        (sources / path).parent.mkdir(parents=True, exist_ok=True)
        (sources / path).write_text(f"text of {path}\n")
    out = tmp_path / "kernel.jsonl"
    assert corpus.main(["--sources", str(sources), "--exclude", "translations", "--out", str(out)]) == 0
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    # only the top-level subfolder named goes: a file of that name, a nested folder of that name and a longer name stay
    assert ids == ["admin-guide/index.rst.txt", "admin-guide/translations/x.rst.txt", "translations.rst.txt",
                   "translationsx/a.rst.txt"]
    assert corpus.main(["--sources", str(sources), "--exclude", "admin-guide/translations", "translations",
                        "--out", str(out)]) == 0
    assert len(out.read_text().splitlines()) == 3
    capsys.readouterr()
    only = tmp_path / "only"
    (only / "translations").mkdir(parents=True)
    (only / "translations" / "a.rst.txt").write_text("x\n")
    assert corpus.main(["--sources", str(only), "--exclude", "translations", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "outside translations" in err, err
