"""``python -m jobs.corpus``: a documentation package (or a folder of reST sources) -> a jsonl corpus that the data
stage reads, byte for byte the same each time; bad input is one line, exit code 2, nothing written."""
from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from jobs.corpus import cli
from pipelines.config import load_config
from pipelines.data import load_documents


def _sources(root):
    sources = root / "_sources"
    for path, text in [("library/json.rst.txt", ":mod:`json` --- JSON encoder and decoder\n\nText.\n"),
                       ("contents.rst.txt", "Documentation contents\n"), ("empty.rst.txt", "  \n"),
                       ("translations/zh_CN/index.rst.txt", "translated\n"),
                       ("admin-guide/translations/x.rst.txt", "kept: not the top-level subfolder\n")]:
        (sources / path).parent.mkdir(parents=True, exist_ok=True)
        (sources / path).write_text(text)
    (sources / "conf.py").write_text("not a source\n")
    return sources


def test_a_source_folder_becomes_a_corpus_the_data_stage_reads(tmp_path, capsys):
    sources = _sources(tmp_path)
    out = tmp_path / "data" / "docs.jsonl"
    assert cli(["--sources", str(sources), "--exclude", "translations", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["admin-guide/translations/x.rst.txt", "contents.rst.txt",
                                       "library/json.rst.txt"]  # by path; empty and excluded ones dropped
    docs = load_documents(load_config(None, [f"data.source={out}", "data.id_field=id"]))
    assert [text for _, text in docs] == [r["text"] for r in rows]
    first = out.read_bytes()
    assert cli(["--sources", str(sources), "--exclude", "translations", "--out", str(out)]) == 0
    assert out.read_bytes() == first
    assert "3 documents" in capsys.readouterr().out


@pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="needs Debian's dpkg-deb")
def test_a_debian_package_is_unpacked_and_read(tmp_path):
    root = tmp_path / "pkg"
    shutil.copytree(_sources(tmp_path), root / "usr/share/doc/linux-doc-6.1/html/_sources")
    (root / "DEBIAN").mkdir()
    (root / "DEBIAN" / "control").write_text("Package: linux-doc-test\nVersion: 1\nArchitecture: all\n"
                                             "Maintainer: nobody <n@example.org>\nDescription: test\n")
    deb = tmp_path / "linux-doc-test_1_all.deb"
    subprocess.run(["dpkg-deb", "--build", "--root-owner-group", str(root), str(deb)], check=True,
                   capture_output=True)
    out = tmp_path / "kernel.jsonl"
    assert cli(["--deb", str(deb), "--exclude", "translations", "--out", str(out)]) == 0
    from_folder = tmp_path / "folder.jsonl"
    assert cli(["--sources", str(tmp_path / "_sources"), "--exclude", "translations", "--out", str(from_folder)]) == 0
    assert out.read_bytes() == from_folder.read_bytes()


def test_bad_input_is_one_line_and_exit_2_with_nothing_written(tmp_path, capsys):
    sources = _sources(tmp_path)
    empty = tmp_path / "none"
    (empty / "translations").mkdir(parents=True)
    (empty / "translations" / "a.rst.txt").write_text("x\n")
    not_deb = tmp_path / "linux-doc.deb"
    not_deb.write_text("not a package")
    out = tmp_path / "out" / "x.jsonl"
    for argv, message in [(["--sources", str(tmp_path / "nowhere"), "--out", str(out)], "no such folder"),
                          (["--sources", str(sources), "--out", str(tmp_path / "x.json")], "give a .jsonl path"),
                          (["--deb", str(tmp_path / "linux-doc-6.1.deb"), "--out", str(out)], "no such file"),
                          (["--sources", str(empty), "--exclude", "translations", "--out", str(out)],
                           "outside translations"),
                          *([(["--deb", str(not_deb), "--out", str(out)], "could not unpack")]
                            if shutil.which("dpkg-deb") else []),
                          (["--out", str(out)], "one of the arguments --deb --sources is required")]:
        capsys.readouterr()
        try:
            code = cli(argv)
        except SystemExit as exit_:  # argparse's own refusal
            code = exit_.code
        assert code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, (argv, err)
        assert not (tmp_path / "out").exists() and not (tmp_path / "x.json").exists()
