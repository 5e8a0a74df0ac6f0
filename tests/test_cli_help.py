"""Every command line's help renders: argparse %-formats each option's help, so a bare ``%`` (``"CR 87.5 %"``)
prints the parser's internals instead of the text (research/gap_frontier.py's ``--B`` did). Read from the source,
for every ``add_argument(help=...)`` literal in benchmarks/, jobs/ and pipelines/ (research/tests scans research/)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BARE_PERCENT = re.compile(r"%(?!%|\()")  # neither an escaped %% nor a %(name)s field


PRODUCT = ("benchmarks", "jobs", "pipelines")


def _help_literals(folders=PRODUCT):
    for folder in folders:
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
                    for keyword in node.keywords:
                        if keyword.arg == "help":
                            for part in ast.walk(keyword.value):
                                if isinstance(part, ast.Constant) and isinstance(part.value, str):
                                    yield path.relative_to(REPO), node.lineno, part.value


def test_no_option_help_has_a_bare_percent_sign():
    helps = list(_help_literals())
    assert len(helps) > 20  # the scan sees the command lines
    bad = [f"{path}:{line}: {text!r}" for path, line, text in helps if BARE_PERCENT.search(text.replace("%%", ""))]
    assert not bad, "escape % as %% in argparse help:\n" + "\n".join(bad)


def test_the_scan_finds_a_bare_percent_sign():
    assert BARE_PERCENT.search("CR 87.5 % at 4k") and not BARE_PERCENT.search("CR 87.5 %% at 4k".replace("%%", ""))
    assert not BARE_PERCENT.search("default %(default)s")
