"""``kvpop.retrofit.rewindow_scorer_folder``: a saved scorer folder at another window holds the same weights, loads at
its new budget, and ranks exactly like those weights retrofitted at that window from scratch (and not like the old
window: the window is when a token is read, so the priorities move). Refusals are one line."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import kvpop
from kvpop import Budget
from kvpop.retrofit import rewindow_scorer_folder, runtime_of, save_retrofitted
from tests.models import tiny_model


def _saved(tmp_path, budget=Budget(2, 8, 6), scorer="mlstm"):
    base = tmp_path / "base"
    tiny_model("llama", "gqa").save_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, local_files_only=True)
    kvpop.retrofit(model, budget, scorer=scorer)
    torch.manual_seed(3)
    with torch.no_grad():
        for p in kvpop.scorers(model).parameters():
            p.add_(0.1 * torch.randn_like(p))
    return save_retrofitted(model, tmp_path / "saved", base=base), base


def _priorities(model, ids):
    with kvpop.collect_priorities(model) as prios, torch.no_grad():
        model(ids, use_cache=False)
    return torch.stack([prios[i] for i in sorted(prios)])


@pytest.mark.parametrize("scorer", ["mlstm", "mlp"])
def test_the_rewindowed_folder_ranks_like_its_weights_retrofitted_at_the_new_window(tmp_path, scorer):
    saved, base = _saved(tmp_path, scorer=scorer)
    out = rewindow_scorer_folder(saved, tmp_path / "w3", Budget(1, 3, 5))
    meta = json.loads((out / "kvpop.json").read_text())
    assert meta["budget"] == {"sink": 1, "window": 3, "topk": 5} and meta["scorer_window"] == 3
    old = json.loads((saved / "kvpop.json").read_text())
    assert {k: v for k, v in meta.items() if k not in ("budget", "scorer_window")} == \
        {k: v for k, v in old.items() if k not in ("budget", "scorer_window")}
    assert load_file(str(out / "kvpop_scorers.safetensors")).keys() == \
        load_file(str(saved / "kvpop_scorers.safetensors")).keys()

    moved, _ = kvpop.load_retrofitted(out, base=base)
    assert runtime_of(moved).policy.budget == Budget(1, 3, 5)
    assert all(s.window == 3 for s in kvpop.scorers(moved))
    fresh = AutoModelForCausalLM.from_pretrained(base, local_files_only=True)
    kvpop.retrofit(fresh, Budget(1, 3, 5), scorer=scorer)
    kvpop.load_scorers(fresh, saved)
    ids = torch.randint(1, 97, (2, 40), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_priorities(moved, ids), _priorities(fresh, ids), rtol=0, atol=0)
    original, _ = kvpop.load_retrofitted(saved, base=base)
    if scorer == "mlstm":  # the delayed scorer reads token t at t + window: another window, other priorities
        assert not torch.allclose(_priorities(moved, ids), _priorities(original, ids))


def test_refusals_are_one_line(tmp_path):
    saved, base = _saved(tmp_path)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("")
    with pytest.raises(ValueError, match="not an empty folder"):
        rewindow_scorer_folder(saved, tmp_path / "busy", Budget(1, 3, 5))
    full = AutoModelForCausalLM.from_pretrained(base, local_files_only=True)
    kvpop.retrofit(full, Budget(2, 8, 6), scorer="mlstm")
    save_retrofitted(full, tmp_path / "full")
    with pytest.raises(ValueError, match="not a scorer-only folder"):
        rewindow_scorer_folder(tmp_path / "full", tmp_path / "w1", Budget(1, 3, 5))
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "kvpop.json").write_text((saved / "kvpop.json").read_text())
    with pytest.raises(ValueError, match="missing"):
        rewindow_scorer_folder(tmp_path / "noweights", tmp_path / "w2", Budget(1, 3, 5))
