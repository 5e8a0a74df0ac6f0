"""The test tiers: ``tests/`` is the product's suite (``make test`` = ``pytest tests``); ``research/tests/`` tests the
studies in ``research/`` and is collected only with ``--run-research`` (``pytest research/tests --run-research``, or
``pytest --run-research`` for both tiers). Without the option the research folder is not collected at all, even when
named on the command line, so a plain run never pays for the studies."""
from __future__ import annotations

from pathlib import Path

import pytest

RESEARCH = Path(__file__).resolve().parent / "research"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-research", action="store_true", default=False,
                     help="also collect research/tests (the studies' tests; not part of `make test`)")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if config.getoption("--run-research"):
        return None
    return True if collection_path.resolve().is_relative_to(RESEARCH) else None
