"""Shared test set-up: offline, quiet Ray, seeded torch, markers, and the prepared SmolLM2 folder.

Tests that need SmolLM2 use the ``smollm2_dir`` / ``smollm2`` fixtures; if the folder has not been prepared (or a file
no longer matches its recorded digest) they FAIL (never skip) with a message saying to run ``make model``.
"""
from __future__ import annotations

import os

# Before anything imports ray / transformers / huggingface_hub.
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ["RAY_DATA_DISABLE_PROGRESS_BARS"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
# Local clusters without token auth, so that a second driver (a subprocess in a test) can join the session's cluster.
os.environ["RAY_AUTH_MODE"] = "disabled"
# Each test's MLflow store is its config's own (sqlite under its home), never a server this shell points at.
os.environ.pop("MLFLOW_TRACKING_URI", None)
# A stuck Ray Data pipeline fails the test instead of hanging it.
os.environ.setdefault("RAY_DATA_EXECUTION_NO_PROGRESS_TIMEOUT_S", "300")
# Ray Train's controller polls its workers every 2 s by default, and each state change of a run (workers started,
# finished, shut down; a report for Tune) waits for the next poll: seconds of every training run's wall time. A
# poll that takes longer is not an error (a worker is declared hung only after 10 min), so a shorter interval only
# waits less. Set before the session's cluster starts, so that its workers (Tune trials) and subprocess drivers
# inherit it as well.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")
# Ray Train starts a PreemptionWatcher actor (one more Python process, ~2-4 s of the 2 cores) per training run to
# poll the nodes' drain state; a one-node local test cluster is never drained.
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")

# Under pytest-xdist (`make test`: two workers on the two cores) every process a test starts — stage CLIs, drivers,
# the Ray clusters' workers — gets its share of the cores as torch's thread count (torch reads it when imported): a
# thread spinning on a core the other worker holds made tiny-tensor work 5–50x slower here.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

SEED = 0

MARKERS = {
    "slow": "takes more than a few seconds on the 2-core CPU box",
    "ray": "starts (or joins) a local Ray cluster",
    "pretrained": "needs the prepared SmolLM2 folder (`make model`)",
}


# `make test` runs the suite on two pytest-xdist workers (`-n 2`): each worker has its own session fixtures (its own
# Ray cluster, tiny teachers and targets) and takes the next test as it finishes the last (below: what runs first, and
# the modules whose tests all run on one worker, in file order).
GROUPED_MODULES = {
    "test_infra.py": "infra/local.sh's stack: a module fixture, started once; its last test stops it",
}


def _work_unit(nodeid: str) -> str:
    """What one worker runs as a whole: a grouped module, or one test."""
    module = nodeid.split("::", 1)[0]
    return module if os.path.basename(module) in GROUPED_MODULES else nodeid


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: unknown (and unused) when pytest runs without it
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """xdist's scope scheduling with this suite's units (``_work_unit``), in collection order: its `loadgroup` mode
    would do it through ``xdist_group`` marks, but pytest-xdist 3.8 renames the test ids it groups by through an
    attribute pytest 9 no longer reads, so those marks group nothing."""
    from xdist.scheduler import LoadScopeScheduling

    class Scheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _work_unit(nodeid)

    config.option.loadscopereorder = False  # keep pytest_collection_modifyitems' order: the longest tests first
    return Scheduling(config, log)


def pytest_configure(config: pytest.Config) -> None:
    for name, doc in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The slow tests that run Ray first (the longest: whole stages), then the other slow ones, then the rest, each
    in collection order (a grouped module counts as one unit, ranked by its slowest test): on two workers the long
    tests overlap each other and the short ones fill the end, instead of one long test starting last while the
    other worker idles."""
    rank: dict[str, int] = {}
    for item in items:
        slow = item.get_closest_marker("slow") is not None
        own = 0 if slow and item.get_closest_marker("ray") else 1 if slow else 2
        unit = _work_unit(item.nodeid)
        rank[unit] = min(rank.get(unit, 2), own)
    items.sort(key=lambda item: rank[_work_unit(item.nodeid)])  # stable


@pytest.fixture(scope="session", autouse=True)
def _mlflow_schema_migrated_once(tmp_path_factory):
    """A new sqlite MLflow store runs MLflow's schema migrations (~2.5 s of a core here), and the suite's tests make
    dozens of new stores in their own homes. Each worker migrates one store for real, then every new sqlite store this
    process opens gets that store's schema (its ``sqlite3`` dump, alembic version included) replayed in ~0.02 s
    instead: the same tables, the same real sqlite store. Stores that subprocesses (CLIs, drivers, servers) open are
    migrated as usual, concurrent migrations included (tests/test_jobs.py)."""
    import contextlib
    import sqlite3

    try:
        import sqlalchemy
        from mlflow.store.db import utils
    except ImportError:  # a box without the tracking stack (a GPU machine's CUDA tests before its install): no store
        yield
        return

    template = tmp_path_factory.mktemp("mlflow-schema") / "mlflow.db"
    engine = sqlalchemy.create_engine(f"sqlite:///{template}")
    utils._initialize_tables(engine)
    engine.dispose()
    with contextlib.closing(sqlite3.connect(template)) as con:
        schema = "\n".join(con.iterdump())
    migrate = utils._initialize_tables

    def initialize(engine) -> None:
        if engine.dialect.name != "sqlite":
            return migrate(engine)
        raw = engine.raw_connection()
        try:
            raw.driver_connection.executescript(schema)
        finally:
            raw.close()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(utils, "_initialize_tables", initialize)
        yield


@pytest.fixture(autouse=True)
def _no_tracking_uri(monkeypatch) -> None:
    """Each test's MLflow store is its config's: a URI an earlier test left in $MLFLOW_TRACKING_URI (mlflow writes it
    there) would send this test's runs, and its subprocesses' runs, to that store."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Every test starts from the same RNG state."""
    random.seed(SEED)
    torch.manual_seed(SEED)
    try:
        import numpy as np
    except ImportError:  # pragma: no cover
        return
    np.random.seed(SEED)


@pytest.fixture(scope="session")
def smollm2_dir():
    """The prepared SmolLM2-135M-Instruct folder, held to the sha256 digests recorded at its conversion; fails the
    test (not skip) if it is missing, incomplete or modified."""
    from pipelines.models import is_complete, missing_message, smollm2_dir as path_of

    path = path_of()
    if not is_complete(path):
        pytest.fail(missing_message(path), pytrace=False)
    return path


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    """``(model, tokenizer)``: SmolLM2-135M-Instruct in float32 on CPU, eval mode, loaded once per session.

    Shared across tests: don't modify it in place (retrofit a copy instead).
    """
    from kvpop.pretrained import load_pretrained

    return load_pretrained(smollm2_dir)


@pytest.fixture(scope="session")
def ray_cluster():
    """ONE local Ray cluster for the whole test session (starting one costs 5–8 s and ~1 GiB here).

    4 logical CPUs on the 2-core box on purpose (docs/ENVIRONMENT.md: Train workers + Ray Data deadlock at num_cpus=2).
    Yields the GCS address, which subprocess drivers pass as ``RAY_ADDRESS`` to join the same cluster.
    """
    import ray

    started = not ray.is_initialized()
    if started:
        # never a `ray start` head running on this machine; no dashboard: no test asks the session's cluster for it
        # (a process less, ~0.05 core while the session lasts)
        ray.init(address="local", num_cpus=4, include_dashboard=False)
    yield ray.get_runtime_context().gcs_address
    if started:
        ray.shutdown()


@pytest.fixture(scope="session")
def tiny_setup(tmp_path_factory, smollm2_dir):
    """A folder with ``teacher/`` and ``other_teacher/`` (tiny random Llamas, 2 layers, 4 query / 2 KV heads, with
    SmolLM2's tokenizer) and ``docs.jsonl`` (40 random-word documents): the pipeline tests' inputs."""
    from transformers import AutoTokenizer

    from tests.models import save_tiny_teacher, write_docs

    root = tmp_path_factory.mktemp("tiny")
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    save_tiny_teacher(root / "teacher", tokenizer)
    save_tiny_teacher(root / "other_teacher", tokenizer, seed=1)
    write_docs(root / "docs.jsonl", 40)
    return root


@pytest.fixture(scope="session")
def tiny_targets(tiny_setup, tmp_path_factory, ray_cluster):
    """One uninterrupted precompute run of ``tests.pipeline_helpers.tiny_config``: ``(config, result)``."""
    from pipelines import precompute
    from tests.pipeline_helpers import tiny_config

    cfg = tiny_config(tiny_setup, tmp_path_factory.mktemp("home"))
    return cfg, precompute.run(cfg)
