"""The window_attention policy (kvpop/policies/window_attention.py): its priorities against a brute force, the cache's
step-by-step priorities against the one-pass ones, edge budgets end to end, and its refusals."""
import math

import pytest
import torch

import kvpop
from kvpop import Budget
from kvpop.policies import LayerView, build_policy
from kvpop.policies.window_attention import window_mass
from tests.models import tiny_model


def brute_priorities(q, k, sink, window, scale, length=None):
    """``[Hkv, S]`` for one unpadded row, one query at a time in float64: p[g, t] = log max over the group's heads of
    the mean over the queries d in [t, t + window) of d's softmax over {t' < sink} ∪ (d - window, d], at t."""
    hq, size, _ = q.shape
    hkv = k.shape[0]
    group = hq // hkv
    length = size if length is None else length
    mass = torch.zeros(hq, size, dtype=torch.float64)
    for h in range(hq):
        for d in range(length):
            seen = [t for t in range(d + 1) if t < sink or t > d - window]
            scores = torch.tensor([float(q[h, d].double() @ k[h // group, t].double()) * scale for t in seen])
            probs = scores.softmax(0)
            for t, p in zip(seen, probs):
                if t > d - window:
                    mass[h, t] += p
    out = torch.empty(hkv, size)
    for g in range(hkv):
        for t in range(size):
            best = max(float(mass[h, t]) for h in range(g * group, (g + 1) * group)) / window
            out[g, t] = math.log(max(best, 1e-300))
    return out


def group_log(mass, hkv, window):
    b, hq, n = mass.shape
    return mass.view(b, hkv, hq // hkv, n).amax(2).div(window).clamp_min(1e-300).log().float()


@pytest.mark.parametrize("sink,window", [(2, 5), (0, 3), (3, 1), (1, 40)])  # s = 0, w = 1, w >= S
def test_window_mass_matches_the_brute_force(sink, window):
    g = torch.Generator().manual_seed(sink * 10 + window)
    q = torch.randn(1, 6, 17, 8, generator=g)
    k = torch.randn(1, 2, 17, 8, generator=g)
    k[:, :, 9] = k[:, :, 4]  # a repeated key: equal scores for two tokens
    valid = torch.ones(1, 17, dtype=torch.bool)
    pos = torch.arange(17)[None]
    mass = window_mass(q, k, valid, pos, sink, window, scale=0.3, budget_bytes=8 * 6 * 17 * 5)  # blocks of 5 rows
    expected = brute_priorities(q[0], k[0], sink, window, 0.3)
    assert torch.allclose(group_log(mass, 2, window)[0], expected, atol=1e-6)


def test_left_padding_gives_each_row_its_own_priorities():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 12, 8, generator=g)
    k = torch.randn(2, 2, 12, 8, generator=g)
    valid = torch.ones(2, 12, dtype=torch.bool)
    valid[1, :3] = False
    pos = torch.arange(12).expand(2, 12) - torch.tensor([[0], [3]])
    mass = window_mass(q, k, valid, pos, 2, 4, scale=0.25)
    got = group_log(mass, 2, 4)
    assert torch.allclose(got[1, :, 3:], brute_priorities(q[1, :, 3:], k[1, :, 3:], 2, 4, 0.25), atol=1e-6)
    assert (mass[1, :, :3] == 0).all()  # padding receives nothing


def test_banded_blocks_equal_the_full_rows():
    """Unpadded rows score each query block against the keys it can see only; padded batches against every key:
    the same mass (a padded second row sends the first through the full path)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 300, 8, generator=g)
    k = torch.randn(2, 2, 300, 8, generator=g)
    pos = torch.arange(300).expand(2, -1)
    banded = window_mass(q[:1], k[:1], torch.ones(1, 300, dtype=torch.bool), pos[:1], 3, 32, scale=0.3,
                         budget_bytes=1 << 16)
    valid = torch.ones(2, 300, dtype=torch.bool)
    valid[1, :5] = False
    full = window_mass(q, k, valid, pos - torch.tensor([[0], [5]]), 3, 32, scale=0.3, budget_bytes=1 << 16)
    assert torch.allclose(banded[0], full[0], rtol=1e-12, atol=1e-12)


def test_cache_steps_give_the_one_pass_priorities():
    """The leaving token's priority at each step (the policy's state: sinks and window keys, running mass) equals
    the one-pass priority of that token, for every token that leaves the window."""
    budget = Budget(2, 5, 4)
    policy = build_policy("window_attention", budget)
    g = torch.Generator().manual_seed(2)
    size, hq, hkv = 23, 6, 3
    q = torch.randn(1, hq, size, 8, generator=g)
    k = torch.randn(1, hkv, size, 8, generator=g)
    layer = LayerView(0, None, None, q, 0.35)
    valid, positions = torch.ones(1, size, dtype=torch.bool), torch.arange(size)[None, None]
    one_pass = policy.sequence_priorities(layer, k, k, valid, positions)
    state = None
    for d in range(size):
        step_layer = LayerView(0, None, None, q[:, :, d:d + 1], 0.35)
        raw, state = policy.step(step_layer, k[:, :, d], k[:, :, d], torch.ones(1, dtype=torch.bool),
                                 torch.tensor([d]), state)
        t = d - budget.window
        if t >= budget.sink:
            assert torch.allclose(raw, one_pass[..., t], atol=1e-6), t
    chunked, _ = policy.resume(LayerView(0, None, None, q, 0.35), k, k, torch.ones(1, size, dtype=torch.bool),
                               torch.arange(size)[None, None], None)
    leaving = torch.arange(size) - budget.window
    assert torch.allclose(chunked[..., leaving >= budget.sink], one_pass[..., leaving[leaving >= budget.sink]],
                          atol=1e-6)


def _logits(model, ids, policy, budget):
    kvpop.set_policy(model, policy, budget)
    with torch.no_grad():
        return model(ids, use_cache=False).logits


def test_edge_budgets_end_to_end():
    model = tiny_model("llama", "gqa")
    ids = torch.randint(1, 97, (2, 40))
    with torch.no_grad():
        dense = model(ids).logits
    kvpop.retrofit(model, Budget(2, 6, 0), scorer=None, policy="window_attention")
    # k = 0: only sinks and the window, whatever the priorities: the streaming cache of that window
    assert torch.equal(_logits(model, ids, "window_attention", Budget(2, 6, 0)),
                       _logits(model, ids, "streaming", Budget(2, 6, 0)))
    # w >= S: nothing ever leaves the window: dense
    assert (_logits(model, ids, "window_attention", Budget(0, 48, 4)) - dense).abs().max() <= 1e-5
    # s = 0 and a real eviction: the fixed cache decodes what the one-pass forward computes
    kvpop.set_policy(model, "window_attention", Budget(0, 5, 6))
    with torch.no_grad():
        one_pass = model(ids, use_cache=False).logits
    assert (kvpop.teacher_forced_logits(model, ids, prefill=11) - one_pass).abs().max() <= 1e-4
    assert (one_pass[:, 20:] - dense[:, 20:]).abs().max() > 1e-2  # it does evict


def test_it_keeps_what_the_window_attended_to():
    """A token every query of its window attends to strongly outranks the others of its age."""
    budget = Budget(1, 4, 2)
    policy = build_policy("window_attention", budget)
    size = 16
    k = torch.zeros(1, 1, size, 4)
    k[0, 0, :, 0] = torch.linspace(-1, 1, size)
    k[0, 0, 7] = torch.tensor([0.0, 0.0, 0.0, 5.0])
    q = torch.zeros(1, 2, size, 4)
    q[..., 3] = 2.0  # every query looks for token 7's direction
    prio = policy.sequence_priorities(LayerView(0, None, None, q, 1.0), k, k, torch.ones(1, size, dtype=torch.bool),
                                      torch.arange(size)[None, None])
    assert prio[0, 0, 7] > prio[0, 0, torch.arange(size) != 7][:-budget.window].max()


def test_refusals():
    policy = build_policy("window_attention", Budget(1, 4, 2))
    k = torch.zeros(1, 1, 8, 4)
    valid, pos = torch.ones(1, 8, dtype=torch.bool), torch.arange(8)[None, None]
    with pytest.raises(RuntimeError, match="reads the layer's queries"):
        policy.sequence_priorities(LayerView(0, None, None), k, k, valid, pos)
    with pytest.raises(ValueError, match="needs every token's query"):
        policy.sequence_priorities(LayerView(0, None, None, torch.zeros(1, 2, 1, 4), 1.0), k, k, valid, pos)


# ----------------------------------------------------------------------------- the window attention prior of kvpop


def test_prior_adds_window_attention_to_the_scorers_output():
    model = tiny_model("llama", "gqa")
    budget = Budget(2, 6, 8)
    kvpop.retrofit(model, budget, scorer="mlstm")
    ids = torch.randint(1, 97, (2, 40))
    with kvpop.collect_priorities(model) as plain, torch.no_grad():
        model(ids, use_cache=False)
    kvpop.set_window_attention_prior(model)
    with kvpop.collect_priorities(model) as both, torch.no_grad():
        model(ids, use_cache=False)
    kvpop.set_policy(model, "window_attention", budget)
    with kvpop.collect_priorities(model) as prior, torch.no_grad():
        model(ids, use_cache=False)
    # layer 0 sees the same inputs under every policy; later layers see different evictions, hence other keys
    assert torch.allclose(both[0], plain[0] + prior[0], atol=1e-5)
    assert not torch.allclose(both[0], plain[0], atol=1e-3)


def test_prior_in_online_training_priorities():
    from kvpop.online import dense_priorities, online_targets, scorer_only_step
    from kvpop.policies.window_attention import window_attention_priorities
    from kvpop.retrofit import attention_modules

    model = tiny_model("llama", "gqa")
    budget = Budget(2, 6, 8)
    kvpop.retrofit(model, budget, scorer="mlstm")
    ids = torch.randint(1, 97, (2, 40))
    online = online_targets(model, ids, keep=("queries", "keys", "values"))
    plain = dense_priorities(model, online["keys"], online["values"])
    kvpop.set_window_attention_prior(model)
    with pytest.raises(ValueError, match="pass each layer's queries"):
        dense_priorities(model, online["keys"], online["values"])
    both = dense_priorities(model, online["keys"], online["values"], online["queries"])
    valid, positions = torch.ones(2, 40, dtype=torch.bool), torch.arange(40).expand(2, -1)
    for i, module in enumerate(attention_modules(model)):
        extra = window_attention_priorities(online["queries"][i], online["keys"][i], valid, positions, budget,
                                            scale=module.scaling)
        assert torch.allclose(both[i], plain[i] + extra, atol=1e-5)
    out = scorer_only_step(model, ids)  # keeps the queries itself
    assert torch.allclose(out["student"], both, atol=1e-5) and out["loss"].requires_grad


def test_prior_is_saved_and_refused_without_scorers(tmp_path):
    model = tiny_model("llama", "gqa")
    kvpop.retrofit(model, Budget(2, 6, 8), scorer="mlp")
    kvpop.set_window_attention_prior(model)
    kvpop.save_retrofitted(model, tmp_path / "saved")
    loaded, _ = kvpop.load_retrofitted(tmp_path / "saved")
    assert loaded.kvpop_runtime.window_attention_prior is True
    with pytest.raises(ValueError, match="on or off"):
        kvpop.set_window_attention_prior(model, 1)
    bare = tiny_model("llama", "gqa")
    kvpop.retrofit(bare, Budget(2, 6, 8), scorer=None, policy="streaming")
    with pytest.raises(ValueError, match="this model has none"):
        kvpop.set_window_attention_prior(bare)


def test_a_chunk_at_once_equals_its_steps():
    """``resume`` in one pass gives each call's priority and the state the token-by-token steps give, across chunks
    of several sizes with a left-padded row (the cache's chunked prefill)."""
    budget = Budget(2, 5, 4)
    policy = build_policy("window_attention", budget)
    g = torch.Generator().manual_seed(4)
    size, hq, hkv = 30, 6, 3
    q = torch.randn(2, hq, size, 8, generator=g)
    k = torch.randn(2, hkv, size, 8, generator=g)
    valid = torch.ones(2, size, dtype=torch.bool)
    valid[1, :3] = False
    positions = (torch.arange(size)[None] - torch.tensor([[0], [3]]))[:, None]
    chunked, stepped, state, steps = [], [], None, None
    for a, b in ((0, 7), (7, 8), (8, 19), (19, 30)):
        layer = LayerView(0, None, None, q[:, :, a:b], 0.3)
        raw, state = policy.resume(layer, k[:, :, a:b], k[:, :, a:b], valid[:, a:b], positions[..., a:b], state)
        chunked.append(raw)
        for i in range(a, b):
            one = LayerView(0, None, None, q[:, :, i:i + 1], 0.3)
            raw, steps = policy.step(one, k[:, :, i], k[:, :, i], valid[:, i], positions[:, 0, i].clamp(min=0), steps)
            stepped.append(raw)
    chunked, stepped = torch.cat(chunked, -1), torch.stack(stepped, -1)
    leaves = positions[:, 0] - budget.window >= budget.sink  # the calls whose priority is read
    assert torch.allclose(chunked.transpose(1, 2)[leaves], stepped.transpose(1, 2)[leaves], atol=1e-9)
    assert torch.equal(state["pos"], steps["pos"])
    assert torch.allclose(state["keys"], steps["keys"]) and torch.allclose(state["mass"], steps["mass"], atol=1e-12)
