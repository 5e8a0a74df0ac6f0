"""``research/learning_curves.py``'s study settings record the KL-through-the-mask options."""
from __future__ import annotations

import json


def test_a_learning_curves_study_records_its_kl_options():
    """Study settings: a study saved before ``--kl-options`` ran without the term."""
    from research import learning_curves as curves

    assert "kl_options" in curves.STUDY_ARGS and curves.SAVED_BEFORE["kl_options"] == {}
    args = curves.parse_args(["--kl-options", json.dumps({"weight": 1, "tau": 0.5})])
    assert curves.study_settings(args, "sha", 10)["kl_options"] == {"weight": 1, "tau": 0.5}
