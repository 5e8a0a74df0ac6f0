"""``research/rewindow_scorer.py``: the command line over ``kvpop.retrofit.rewindow_scorer_folder``."""
from __future__ import annotations

from tests.test_rewindow import _saved


def test_the_cli_writes_and_refuses_in_one_line(tmp_path, capsys):
    from research.rewindow_scorer import main

    saved, _ = _saved(tmp_path)
    assert main([str(saved), str(tmp_path / "w"), "--sink", "1", "--window", "3", "--topk", "5"]) == 0
    capsys.readouterr()
    assert main([str(saved), str(tmp_path / "w"), "--sink", "1", "--window", "3", "--topk", "5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rewindow_scorer: ") and "\n" not in err
