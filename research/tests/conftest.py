"""The research tier's fixtures: the product suite's own (offline environment, seeded RNGs, the prepared SmolLM2
folder, the tiny teachers), imported from ``tests/conftest.py`` so that both tiers build them one way."""
from __future__ import annotations

from tests.conftest import (  # noqa: F401  (pytest finds fixtures by name in this module)
    _seed, ray_cluster, smollm2, smollm2_dir, tiny_setup, tiny_targets,
)
from tests.conftest import pytest_configure  # noqa: F401  (the markers: slow, ray, pretrained)
