"""``research/layer_recency.py`` on CPU at a tiny size (the learning-curves tests' saved 2-layer scorer, S = 64): the
search only keeps moves that lower the KL, reports the KL its λ give, and saves a scorer whose priorities are the
plain scorer's + λ_l · t in each layer."""
from __future__ import annotations

import json

import pytest
import torch

from research import layer_recency as lr
from research import learning_curves as curves
from research.tests.test_learning_curves import home, saved  # noqa: F401  (the module's KVPOP_HOME, a saved study)

pytestmark = pytest.mark.pretrained  # SmolLM2's tokenizer (tiny_setup)


def _argv(tiny_setup, checkpoint, out, *extra) -> list[str]:
    return ["--checkpoint", str(checkpoint), "--model", str(tiny_setup / "teacher"), "--source",
            str(tiny_setup / "docs.jsonl"), "--seq-len", "64", "--sequences", "2", "--batch", "2", "--grid", "0",
            "0.05", "0.5", "--start", "0.05", "--device", "cpu", "--tag", "t", "--out", str(out), *extra]


def test_the_search_lowers_the_kl_and_the_saved_scorer_ranks_with_it(tiny_setup, home, saved, tmp_path):
    import kvpop
    from pipelines.data import load_sequences, load_tokenizer

    checkpoint = next(saved.glob("step-*"))
    assert lr.main(_argv(tiny_setup, checkpoint, tmp_path)) == 0
    result = json.loads((tmp_path / "layer_recency_t.json").read_text())
    layers = len(result["lambdas"])
    assert layers == 2 and set(result["lambdas"]) <= {0.0, 0.05, 0.5}
    assert result["evaluations"] == 1 + layers * 2  # the start, then each other grid value in each layer
    kls = [result["start_kl"]] + [m["kl"] for m in result["moves"]]
    assert all(b < a for a, b in zip(kls, kls[1:])) and result["kl"] == kls[-1]

    # the reported KL is what those λ give, measured afresh
    meta = json.loads((checkpoint / "kvpop.json").read_text())
    cfg = curves.corpus_config(str(tiny_setup / "teacher"), str(tiny_setup / "docs.jsonl"), 64, meta["budget"], 1.0,
                               1, train_sequences=4)
    rows = load_sequences(cfg, "train", load_tokenizer(cfg))[:2]
    ids = torch.tensor([r["input_ids"] for r in rows])
    model = lr.load_with_layer_recency(checkpoint, meta, cfg, "cpu")
    with torch.no_grad():
        assert lr.Calibration(model, ids, 2).kl(result["lambdas"]) == pytest.approx(result["kl"], rel=1e-6)

    # the saved scorer = the plain one + λ_l · t, layer by layer
    folder = tmp_path / "layer_recency_t_scorer"
    saved_meta = json.loads((folder / "kvpop.json").read_text())
    assert saved_meta["scorer"]["head_recency"] is True
    calibrated = kvpop.scorers(curves.load_saved_scorer(folder, saved_meta, cfg, "cpu"))
    plain = kvpop.scorers(curves.load_saved_scorer(checkpoint, meta, cfg, "cpu"))
    assert len(calibrated) == layers
    generator = torch.Generator().manual_seed(0)
    t = torch.arange(64, dtype=torch.float32)
    for layer, value in enumerate(result["lambdas"]):  # the same keys and values into both layers' scorers
        shape = (2, plain[layer].num_kv_heads, 64, plain[layer].head_dim)
        keys, values = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
        with torch.no_grad():
            torch.testing.assert_close(calibrated[layer](keys, values), plain[layer](keys, values) + value * t,
                                       rtol=0, atol=1e-4)
    assert "| per layer (below) |" in (tmp_path / "layer_recency_t.md").read_text()


def test_coordinate_descent_keeps_only_improving_moves():
    # a separable KL with its minimum at (0.002, 0, 0.005): one sweep from 0.001 reaches it
    target = [0.002, 0.0, 0.005]
    calls = []

    def kl(lambdas):
        calls.append(list(lambdas))
        return sum((a - b) ** 2 for a, b in zip(lambdas, target))

    found = lr.coordinate_descent(kl, 3, [0.0, 0.001, 0.002, 0.005], 0.001, 1)
    assert found["lambdas"] == target and found["kl"] == 0.0
    assert len(calls) == 1 + 3 * 3
    assert [m["to"] for m in found["moves"]] == [0.002, 0.0, 0.002, 0.005]  # layer 2 passes 0.002 on its way
    flat = lr.coordinate_descent(lambda lambdas: 1.0, 2, [0.0, 0.1], 0.1, 2)
    assert flat["moves"] == [] and flat["lambdas"] == [0.1, 0.1]  # ties are not moves


def test_bad_input_is_one_line(tiny_setup, home, saved, tmp_path, capsys):
    checkpoint = next(saved.glob("step-*"))
    capsys.readouterr()
    assert lr.main(_argv(tiny_setup, checkpoint, tmp_path, "--sequences", "500")) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("kvpop layer_recency: error:") and "yields only" in err, err
    assert lr.main(_argv(tiny_setup, tmp_path, tmp_path)) == 2
    assert "no kvpop.json" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        lr.main(_argv(tiny_setup, checkpoint, tmp_path, "--grid", "-0.1"))
    assert exit_info.value.code == 2
