"""The studies' command lines render their help too (tests/test_cli_help.py's scan, over research/)."""
from __future__ import annotations

from tests.test_cli_help import BARE_PERCENT, _help_literals


def test_no_study_option_help_has_a_bare_percent_sign():
    helps = list(_help_literals(("research",)))
    assert len(helps) > 100  # the scan sees the studies' command lines
    bad = [f"{path}:{line}: {text!r}" for path, line, text in helps if BARE_PERCENT.search(text.replace("%%", ""))]
    assert not bad, "escape % as %% in argparse help:\n" + "\n".join(bad)
