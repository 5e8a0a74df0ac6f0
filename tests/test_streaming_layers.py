"""kvpop.set_streaming_layers: the chosen layers keep the newest tokens (a streaming cache of the same B), the others
rank by their scorers — in the masked forward and the fixed cache alike; saved with the model; chosen on text by
kvpop.diagnostics.streaming_layers."""
import json

import pytest
import torch

import kvpop
from kvpop import Budget
from kvpop.diagnostics import attention_model, layer_output_errors, streaming_layers
from kvpop.retention import visible
from tests.models import ARCHS, HEADS, tiny_model
from tests.test_scorers import one_thread  # noqa: F401  (autouse: tiny models on one thread)

S = 48
BUDGET = Budget(3, 8, 10)
EDGES = [BUDGET, Budget(0, 8, 10), Budget(3, 8, 0), Budget(2, 60, 5)]  # s = 0, k = 0, w >= S


def retrofitted(arch="llama", heads="gqa", scorer="mlp", budget=BUDGET, layers=3):
    return kvpop.retrofit(tiny_model(arch, heads, layers=layers), budget, scorer=scorer)


def ranked(model, ids):
    """Each layer's priorities as the policy ranks them, from one masked forward."""
    with kvpop.collect_priorities(model) as store, torch.no_grad():
        model(ids, use_cache=False)
    return [store[i] for i in range(len(store))]


@pytest.mark.parametrize("budget", EDGES, ids=str)
def test_every_layer_streaming_is_the_streaming_policy(budget):
    model = retrofitted(budget=budget)
    ids = torch.randint(1, 97, (2, S))
    kvpop.set_streaming_layers(model, range(3))
    with torch.no_grad():
        mine = model(ids, use_cache=False).logits
        kvpop.set_policy(model, "streaming", budget)
        streaming = model(ids, use_cache=False).logits
    torch.testing.assert_close(mine, streaming, atol=1e-6, rtol=0)


@pytest.mark.parametrize("budget", EDGES, ids=str)
def test_a_streaming_layer_keeps_the_newest_and_the_others_their_scorers_choice(budget):
    """Per layer, the tokens each query sees (the rule applied directly, :func:`visible`): a streaming layer's are
    the sinks and the ``window + topk`` newest; the layers before it rank exactly as without streaming layers (the
    ones after see other hidden states)."""
    model = retrofitted(budget=budget)
    ids = torch.randint(1, 97, (2, S))
    scorers_everywhere = ranked(model, ids)
    kvpop.set_streaming_layers(model, [2])
    mine = ranked(model, ids)
    newest = Budget(budget.sink, budget.window + budget.topk, 0)
    assert torch.equal(visible(mine[2], budget), visible(torch.zeros(2, 2, S), newest).expand(2, 2, S, S))
    for layer in (0, 1):
        assert torch.equal(mine[layer], scorers_everywhere[layer])
    if budget.topk and budget.sink + budget.window + budget.topk < S:  # the streaming layer really changed something
        assert not torch.equal(visible(scorers_everywhere[2], budget), visible(mine[2], budget))


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("scorer", ["mlstm", "mlp"])
def test_decode_equals_masked_forward_with_streaming_layers(arch, heads, scorer):
    model = retrofitted(arch, heads, scorer)
    kvpop.set_streaming_layers(model, [0, 2])
    ids = torch.randint(1, 97, (2, S))
    with torch.no_grad():
        one_pass = model(ids, use_cache=False).logits
    for options in ({}, {"prefill": 29}, {"prefill": 13, "chunk": 6}):
        assert (kvpop.teacher_forced_logits(model, ids, **options) - one_pass).abs().max() <= 1e-4


def test_streaming_layers_are_saved_with_the_model(tmp_path):
    model = retrofitted()
    kvpop.set_streaming_layers(model, [2, 0])
    ids = torch.randint(1, 97, (1, S))
    with torch.no_grad():
        before = model(ids, use_cache=False).logits
    kvpop.save_retrofitted(model, tmp_path / "m")
    assert json.loads((tmp_path / "m" / "kvpop.json").read_text())["streaming_layers"] == [0, 2]
    loaded, _ = kvpop.load_retrofitted(tmp_path / "m")
    assert loaded.kvpop_runtime.streaming_layers == {0, 2}
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, use_cache=False).logits, before, atol=1e-6, rtol=0)
    meta = json.loads((tmp_path / "m" / "kvpop.json").read_text())
    del meta["streaming_layers"]  # a folder saved before streaming layers existed: its scorers everywhere
    (tmp_path / "m" / "kvpop.json").write_text(json.dumps(meta))
    assert kvpop.load_retrofitted(tmp_path / "m")[0].kvpop_runtime.streaming_layers == frozenset()


def test_bad_streaming_layers_are_refused():
    model = retrofitted()
    for bad in ([3], [-1], [True], ["1"]):
        with pytest.raises(ValueError, match="layer indices 0 … 2"):
            kvpop.set_streaming_layers(model, bad)
    plain = kvpop.retrofit(tiny_model(layers=3), BUDGET, scorer=None, policy="streaming")
    with pytest.raises(ValueError, match="has none"):
        kvpop.set_streaming_layers(plain, [0])
    with pytest.raises(ValueError, match="kvpop policy"):
        streaming_layers(plain, torch.randint(1, 97, (1, S)))
    with pytest.raises(ValueError, match="S > B = 21"):
        streaming_layers(model, torch.randint(1, 97, (1, 21)))


def test_the_calibration_picks_the_layers_where_the_scorer_costs_more_output_than_streaming():
    model = retrofitted(scorer="mlstm", layers=4)
    ids = torch.randint(1, 97, (2, S))
    found = attention_model(model, ids)
    errors = layer_output_errors(found)[str(BUDGET)]
    for rule in ("scorer", "newest"):  # Σ|o_rule - o| / Σ|o| of each layer over its sequences, queries and heads
        parts = found[str(BUDGET)][rule]
        for layer in range(4):
            expect = parts["output_change"][layer].double().sum() / parts["output_norm"][layer].double().sum()
            assert errors[rule][layer] == pytest.approx(expect.item(), rel=1e-9)
    chosen = streaming_layers(model, ids, batch_size=1)
    assert chosen["scorer"] == pytest.approx(errors["scorer"], rel=1e-6)
    assert chosen["streaming"] == pytest.approx(errors["newest"], rel=1e-6)
    assert chosen["layers"] == [i for i in range(4) if errors["scorer"][i] > errors["newest"][i]]
    kvpop.set_streaming_layers(model, range(4))  # the scorers are measured, not the streaming layers in place
    again = streaming_layers(model, ids)
    assert again["layers"] == chosen["layers"] and again["scorer"] == pytest.approx(chosen["scorer"], rel=1e-6)
    assert model.kvpop_runtime.streaming_layers == frozenset(range(4))
