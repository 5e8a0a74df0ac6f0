"""Thin CLIs: parse -> config -> pipelines.<stage>.run (e.g. `python -m jobs.pipeline`).

Importing this package prepares the process before any CLI module imports torch, transformers or datasets (Python
imports the package first): offline for the Hugging Face libraries (``pipelines/offline.py``: set any later, it is
ignored), and a Ctrl-C that lands while those imports run is one line, like one in a stage (``jobs/_cli.py``).
"""
import os
import sys

import pipelines  # noqa: F401  (importing the package sets the offline variables: pipelines/__init__.py)

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")  # stderr: the stage's own progress and errors


def _one_line_interrupt(kind, value, traceback):
    if issubclass(kind, KeyboardInterrupt):
        print("kvpop: interrupted", file=sys.stderr)
    else:
        sys.__excepthook__(kind, value, traceback)


sys.excepthook = _one_line_interrupt
