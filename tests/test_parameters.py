"""kvpop.parameters: scorer-only vs distill selection, by module structure (not by parameter names)."""
import pytest
import torch
from torch import nn

import kvpop
from kvpop import Budget
from kvpop.parameters import trainable_parameters
from tests.models import tiny_model


def _retrofitted():
    model = tiny_model("qwen3", "gqa")
    kvpop.retrofit(model, Budget(2, 4, 6), scorer="mlp")
    return model


def test_scorer_only_freezes_the_base_and_distill_trains_everything():
    model = _retrofitted()
    scorer_ids = {id(p) for p in kvpop.scorers(model).parameters()}
    only = kvpop.trainable_parameters(model, "scorer_only")  # exported by the package
    assert {id(p) for p in only["scorers"]} == scorer_ids and only["base"] == []
    assert {id(p) for p in model.parameters() if p.requires_grad} == scorer_ids
    both = trainable_parameters(model, "distill")
    assert {id(p) for p in both["scorers"]} == scorer_ids
    assert {id(p) for p in both["base"]} == {id(p) for p in model.parameters()} - scorer_ids
    assert all(p.requires_grad for p in model.parameters())
    assert trainable_parameters(model, "scorer_only")["base"] == []  # back again
    assert not any(p.requires_grad for p in both["base"])


def test_selection_follows_the_modules_not_the_names():
    model = _retrofitted()
    model.model.kvpop_scorer = nn.Linear(2, 2)  # a base module whose name looks like a scorer's
    only = trainable_parameters(model, "scorer_only")
    assert all(p is not model.model.kvpop_scorer.weight for p in only["scorers"])
    assert not model.model.kvpop_scorer.weight.requires_grad


def test_errors():
    model = tiny_model("llama", "gqa")
    kvpop.retrofit(model, Budget(1, 2, 3), scorer=None, policy="streaming")
    with pytest.raises(ValueError, match="no scorers"):
        trainable_parameters(model, "scorer_only")
    with pytest.raises(ValueError, match="mode must be one of"):
        trainable_parameters(_retrofitted(), "everything")
    torch.manual_seed(0)
