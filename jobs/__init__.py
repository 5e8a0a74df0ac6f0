"""Thin CLIs: parse -> config -> pipelines.<stage>.run (e.g. `python -m jobs.pipeline`)."""
