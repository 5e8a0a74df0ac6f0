"""Ray stages: each is `run(config) -> result`, callable from jobs and tests."""
