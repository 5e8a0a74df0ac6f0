"""DMS (kvpop.dms, kvpop.policies.dms, kvpop.dms_cache) and StreamingLLM+ (the streaming policy, base trained).

References are brute force: per-(query, token) loops for delayed eviction, an explicit softmax for the relaxed
attention, and the one-pass masked forward for the cache. Decode ≡ masked forward on every tiny architecture and
head layout is ``tests/test_invariants.py`` (policy "dms").
"""
import math

import pytest
import torch
import torch.nn.functional as F

import kvpop
from kvpop import Budget
from kvpop.attention import retention_attention
from kvpop.cache import CACHE_KWARG
from kvpop.dms import (NEVER, CompressionSchedule, capped_eviction_positions, decision_logits, dms_loss,
                       eviction_positions, keep_rates, relax, retained_counts, retained_per_query, retained_stats)
from kvpop.dms_cache import cache_stats
from kvpop.retention import retained
from tests.models import dms_model, tiny_model

BUDGET = Budget(2, 5, 0)


def hard_decisions(model, ids):
    """Each layer's hard decision logits ``[B, Hkv, S]`` from one masked forward, and its logits."""
    with kvpop.collect_priorities(model) as collected, torch.no_grad():
        logits = model(ids, use_cache=False).logits
    return [collected[i] for i in range(len(collected))], logits


# -----------------------------------------------------------------------------
# delayed eviction, exactly


def brute_force_visible(gates, sink, window, threshold=0.0):
    """``[S, S]`` (query d, token t): the gate at t + 1 decides t; an evicted t is seen by d <= t + window - 1."""
    size = gates.shape[-1]
    visible = torch.zeros(size, size, dtype=torch.bool)
    for d in range(size):
        for t in range(d + 1):
            evicted = t >= sink and t + 1 < size and float(gates[t + 1]) - threshold > 0
            visible[d, t] = (not evicted) or d <= t + window - 1
    return visible


@pytest.mark.parametrize("sink,window", [(0, 1), (0, 2), (3, 1), (2, 5), (0, 24), (1, 30)])
@pytest.mark.parametrize("mode", ["random", "ties", "all_keep", "all_evict"])
def test_delayed_eviction_matches_brute_force(sink, window, mode):
    size = 24
    gates = {"random": torch.randn(size), "ties": torch.randint(-1, 2, (size,)).float(),
             "all_keep": -torch.rand(size) - 0.1, "all_evict": torch.rand(size) + 0.1}[mode]
    threshold = 0.3 if mode == "random" else 0.0  # ties: logits exactly at the threshold are kept
    positions = torch.arange(size)
    z = decision_logits(gates[None], positions, torch.ones(1, size, dtype=torch.bool), sink=sink,
                        threshold=threshold)[0]
    evict = eviction_positions(z, positions, window)
    fast = retained(positions[:, None], positions[None, :], evict[None, :], Budget(sink, window, 0))
    reference = brute_force_visible(gates, sink, window, threshold)
    assert torch.equal(fast, reference)
    counts = retained_counts(positions, positions, evict, torch.ones(size, dtype=torch.bool))
    assert torch.equal(counts, reference.sum(-1))
    if mode == "all_keep":
        assert reference.sum() == size * (size + 1) // 2  # dense
    if mode == "all_evict":  # StreamingLLM's mask (METHOD §1 with topk = 0): sinks + window
        from kvpop.retention import eviction_positions as topk_eviction_positions

        streaming = Budget(sink, window, 0)
        assert torch.equal(reference, retained(positions[:, None], positions[None, :],
                                               topk_eviction_positions(gates[None], streaming), streaming))


def test_threshold_and_padding_in_decisions():
    gates = torch.tensor([[0.5, 2.0, -1.0, 3.0, 0.7, 9.0]])
    valid = torch.tensor([[False, True, True, True, True, True]])
    positions = torch.tensor([[-1, 0, 1, 2, 3, 4]])
    z = decision_logits(gates, positions, valid, sink=1, threshold=1.0)
    # pad, sink (position 0), t=1 decided by 3.0, t=2 by 0.7, t=3 by 9.0, the last: none yet
    torch.testing.assert_close(z, torch.tensor([[-math.inf, -math.inf, 2.0, -0.3, 8.0, -math.inf]]))


# -----------------------------------------------------------------------------
# the relaxed (training) attention


def dense_relaxed_reference(q, k, v, positions, valid, log_keep, budget, scale):
    group = q.shape[1] // k.shape[1]
    d, t = positions[:, None, :, None], positions[:, None, None, :]
    causal = valid[:, None, None, :] & (t <= d)
    past = (t >= budget.sink) & (d - t >= budget.window)
    bias = torch.where(past, log_keep[:, :, None, :], 0.0).repeat_interleave(group, 1)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(group, 1)) * scale + bias
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1).nan_to_num()
    return torch.einsum("bhqk,bhkd->bhqd", probs, v.repeat_interleave(group, 1)).transpose(1, 2)


def _relaxed_inputs(seed=0, size=40, hq=4, hkv=2, dim=8):
    torch.manual_seed(seed)
    positions = torch.arange(size)[None, :] - torch.tensor([0, 7])[:, None]  # row 1 left-padded
    valid = positions >= 0
    q, k, v = torch.randn(2, hq, size, dim), torch.randn(2, hkv, size, dim), torch.randn(2, hkv, size, dim)
    log_keep = F.logsigmoid(-torch.randn(2, hkv, size) * 3).requires_grad_()
    return q, k, v, positions, valid, log_keep


@pytest.mark.parametrize("backend", ["chunked", "flex"])
def test_relaxed_attention_matches_an_explicit_softmax(backend):
    """Both kernels against the reference; the chunked (CPU training) one also in its gradient w.r.t. log(1-α)."""
    budget = Budget(2, 5, 0)
    q, k, v, positions, valid, log_keep = _relaxed_inputs()
    kw = dict(q_pos=positions, kv_pos=positions[:, None], kv_evict=torch.full((2, 1, 40), NEVER),
              kv_valid=valid[:, None], budget=budget, scale=0.3)
    upstream = torch.randn(2, 40, 4, 8)
    ref = dense_relaxed_reference(q, k, v, positions, valid, log_keep, budget, 0.3)
    (ref_grad,) = torch.autograd.grad((ref * upstream).sum(), log_keep)
    if backend == "flex":  # eager FlexAttention on CPU: forward only
        with torch.no_grad():
            out = retention_attention(q, k, v, backend="flex", log_keep=log_keep, **kw)
        assert (out - ref).abs().max() < 1e-5
        return
    out = retention_attention(q, k, v, backend="chunked", log_keep=log_keep, **kw)
    (grad,) = torch.autograd.grad((out * upstream).sum(), log_keep)
    assert (out - ref).abs().max() < 1e-5 and out[1, :7].abs().max() == 0
    assert (grad - ref_grad).abs().max() < 1e-5 and ref_grad.abs().max() > 1e-3


def test_relaxed_gates_converge_to_the_hard_mask_as_temperature_falls():
    """Fixed decision logits, noise off: the log(1 - σ(z/τ)) bias becomes the hard delayed-eviction mask."""
    budget = Budget(1, 4, 0)
    q, k, v, positions, valid, _ = _relaxed_inputs(seed=3)
    gates = torch.randn(2, 2, 40)
    gates = gates + 0.2 * gates.sign()  # |z| >= 0.2: no decision sits at the threshold
    z = decision_logits(gates, positions[:, None, :], valid[:, None, :], sink=budget.sink)
    kw = dict(q_pos=positions, kv_pos=positions[:, None], kv_valid=valid[:, None], budget=budget, scale=0.3)
    hard = retention_attention(q, k, v, kv_evict=eviction_positions(z, positions[:, None, :], budget.window), **kw)
    errors = []
    for temperature in (1.0, 0.1, 0.01, 0.001):
        u = relax(z, temperature, noise=False)
        assert torch.equal(torch.sigmoid(u) > 0.5, z > 0)
        soft = retention_attention(q, k, v, kv_evict=torch.full_like(z, NEVER, dtype=torch.long),
                                   log_keep=F.logsigmoid(-u), **kw)
        errors.append(float((soft - hard).abs().max()))
    assert errors == sorted(errors, reverse=True) and errors[0] > 1e-2 and errors[-1] < 1e-6, errors


def test_noisy_relaxation_becomes_a_hard_sample_as_temperature_falls():
    """With noise, α at τ → 0 is the hard decision of the noisy logit: 0 or 1, evicting with probability σ(z)."""
    z = torch.tensor([-3.0, -0.5, 0.5, 3.0]).expand(20000, 4)
    alpha = torch.sigmoid(relax(z, 1e-3, noise=True))
    assert ((alpha < 1e-3) | (alpha > 1 - 1e-3)).float().mean() > 0.99
    assert (alpha.mean(0) - torch.sigmoid(z[0])).abs().max() < 0.02


# -----------------------------------------------------------------------------
# the model: masked forward, decoding, memory


def test_the_mask_is_dense_when_every_gate_keeps_and_sparse_otherwise():
    ids = torch.randint(1, 97, (1, 48))
    model = tiny_model("llama", "gqa")
    with torch.no_grad():
        dense = model(ids).logits
    kvpop.retrofit(model, BUDGET, scorer="dms", policy="dms")  # fresh gates: logit -5 everywhere, keep all
    assert (hard_decisions(model, ids)[1] - dense).abs().max() <= 1e-5
    sparse = hard_decisions(dms_model(), ids)[1]
    assert (sparse[:, :BUDGET.window] - dense[:, :BUDGET.window]).abs().max() <= 1e-5  # nothing left a window yet
    assert (sparse[:, 20:] - dense[:, 20:]).abs().max() > 1e-2


@pytest.mark.parametrize("prefill,chunk", [(0, 1), (7, 9)])
def test_cache_memory_follows_its_peak_occupancy_and_stats_match_the_mask(prefill, chunk):
    """Capacity = next power of two of the most tokens a (row, head) held after a call; bytes exactly that."""
    budget = Budget(1, 6, 0)
    model = dms_model("llama", "gqa", budget, offset=-12.0, seed=4)  # ~93% evicted
    size, batch = 100, 2
    ids = torch.randint(1, 97, (batch, size))
    decisions, _ = hard_decisions(model, ids)
    cache = kvpop.KVpopCache(model)
    bounds = sorted({0, prefill, *range(prefill + chunk, size, chunk), size})
    with torch.no_grad():
        for start, end in zip(bounds[:-1], bounds[1:]):
            model(ids[:, start:end], use_cache=True, **{CACHE_KWARG: cache})
    calls_end = torch.tensor(bounds[1:]) - 1  # the query after which each call's held set is what the cache keeps
    reference = retained_stats(decisions, budget.window)
    stats = cache_stats(cache)
    assert torch.allclose(stats["mean"].float(), reference["mean"]) and torch.equal(stats["max"], reference["max"])
    rt = model.kvpop_runtime
    expected_kv = expected_meta = 0
    for layer, z in enumerate(decisions):
        positions = torch.arange(size)
        counts = retained_counts(positions, positions.expand(z.shape), eviction_positions(z, positions,
                                                                                          budget.window),
                                 torch.ones_like(z, dtype=torch.bool))
        peak = int(counts[..., calls_end].max())
        capacity = 1 << (peak - 1).bit_length()
        assert cache.layers[layer].capacity == capacity and peak <= capacity < 2 * peak
        assert capacity < size // 2  # bounded by what is held, not by the length
        expected_kv += capacity * batch * rt.num_kv_heads * rt.head_dim * 2 * 4
        # per slot an int64 position and a bool flag; per row the position counter and the query counter; per
        # (row, head) the two int64 statistics
        expected_meta += capacity * batch * rt.num_kv_heads * 9 + batch * 16 + batch * rt.num_kv_heads * 16
    assert cache.nbytes() == {"kv": expected_kv, "metadata": expected_meta, "scorer_state": 0}


def test_batch_with_left_padding_equals_each_row_alone():
    model = dms_model("qwen3", "gqa")
    prompts = [torch.randint(1, 97, (n,)) for n in (5, 23, 14)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    batch = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    for i, prompt in enumerate(prompts):
        alone = model.generate(input_ids=prompt[None], max_new_tokens=20, do_sample=False)
        assert torch.equal(batch[i, width:], alone[0, len(prompt):]), f"row {i} differs"


def test_save_and_load_keep_the_gates(tmp_path):
    model = dms_model()
    ids = torch.randint(1, 97, (1, 30))
    before = hard_decisions(model, ids)[1]
    kvpop.save_retrofitted(model, tmp_path / "dms")
    loaded, _ = kvpop.load_retrofitted(tmp_path / "dms")
    assert loaded.kvpop_runtime.policy.name == "dms"
    assert (hard_decisions(loaded, ids)[1] - before).abs().max() <= 1e-5


# -----------------------------------------------------------------------------
# capped DMS (issue 43): at most `cap` tokens per head, the kept token of the highest logit dropped first


def brute_force_capped(gates, sink, window, cap):
    """``[S, S]`` (query d, token t) by running the capped cache literally, query by query: token ``d`` enters; an
    evicted token (its gate at ``t + 1`` > 0) leaves with its window; while more than ``cap - sink - window`` kept
    tokens are past the window, the one of the highest logit leaves (ties: the older)."""
    size = gates.shape[-1]
    z = [float(gates[t + 1]) if sink <= t and t + 1 < size else float("-inf") for t in range(size)]
    held, visible = set(), torch.zeros(size, size, dtype=torch.bool)
    for d in range(size):
        held.add(d)
        held -= {t for t in held if t >= sink and t <= d - window and z[t] > 0}
        while True:
            past = [t for t in held if sink <= t <= d - window]
            if len(past) <= cap - sink - window:
                break
            held.remove(max(past, key=lambda t: (z[t], -t)))
        assert len(held) <= cap
        visible[d, sorted(held)] = True
    return visible


@pytest.mark.parametrize("sink,window,cap", [(0, 1, 1), (0, 1, 4), (2, 3, 5), (2, 3, 9), (1, 4, 12), (0, 24, 30),
                                             (3, 2, 40)])
@pytest.mark.parametrize("mode", ["random", "ties", "all_keep", "all_evict"])
def test_capped_eviction_matches_the_literal_cache(sink, window, cap, mode):
    """Heads at the floor (cap = sink + window: streaming), caps that bind, and caps above the length (plain DMS)."""
    size = 30
    g = torch.Generator().manual_seed(sink * 100 + window * 10 + cap)
    gates = {"random": torch.randn(size, generator=g), "ties": torch.randint(-2, 2, (size,), generator=g).float(),
             "all_keep": -torch.rand(size, generator=g) - 0.1, "all_evict": torch.rand(size, generator=g) + 0.1}[mode]
    positions = torch.arange(size)
    z = decision_logits(gates[None], positions, torch.ones(1, size, dtype=torch.bool), sink=sink)[0]
    evict = capped_eviction_positions(z, positions, sink, window, cap)
    fast = retained(positions[:, None], positions[None, :], evict[None, :], Budget(sink, window, 0))
    reference = brute_force_capped(gates, sink, window, cap)
    assert torch.equal(fast, reference)
    assert torch.equal(retained_counts(positions, positions, evict, torch.ones(size, dtype=torch.bool)),
                       reference.sum(-1))
    if cap >= size:  # a cap that never binds is DMS
        assert torch.equal(fast, brute_force_visible(gates, sink, window))
    if cap == sink + window:  # no long-range slot: StreamingLLM's mask
        assert int(reference.sum(-1).max()) <= cap
        assert torch.equal(reference, retained(positions[:, None], positions[None, :], positions + window,
                                               Budget(sink, window, 0)))


@pytest.mark.parametrize("heads", ["mha", "gqa", "mqa"])
def test_capped_cache_decodes_exactly_in_its_reservation(heads):
    """Decode (steps, chunks) = the capped masked forward, with a cap that binds; the buffer is the cap from the
    start, its bytes exactly that whatever the length; occupancy never above the cap, the same as the mask's."""
    budget, cap, size = Budget(1, 6, 0), 12, 40
    model = dms_model("llama", heads, budget, offset=3.0, seed=2)  # most tokens kept: the cap binds
    # distinct tokens: the first layer's gates read embeddings, and a repeated token's equal logits would make the
    # cap's order a tie that one-pass and chunked matmuls may break apart by a rounding error
    ids = torch.stack([torch.randperm(96)[:size] + 1 for _ in range(2)])
    assert int(retained_per_query(hard_decisions(model, ids)[0], budget.window).max()) > cap
    kvpop.set_policy(model, "dms", budget, cap=cap)
    decisions, one_pass = hard_decisions(model, ids)
    counts = retained_per_query(decisions, budget.window, sink=budget.sink, cap=cap)
    assert int(counts.max()) == cap
    assert (kvpop.teacher_forced_logits(model, ids) - one_pass).abs().max() <= 1e-4
    assert (kvpop.teacher_forced_logits(model, ids, prefill=13, chunk=6) - one_pass).abs().max() <= 1e-4
    if heads != "gqa":
        return
    rt = model.kvpop_runtime
    cache = kvpop.KVpopCache(model)
    with torch.no_grad():
        for start, end in ((0, 7), *((i, i + 1) for i in range(7, size))):
            model(ids[:, start:end], use_cache=True, **{CACHE_KWARG: cache})
            assert all(layer.capacity == cap for layer in cache.layers)
            assert cache.nbytes()["kv"] == rt.num_layers * 2 * rt.num_kv_heads * cap * rt.head_dim * 2 * 4
    stats = cache_stats(cache)
    assert torch.equal(stats["max"], counts.amax(dim=(1, 3)))
    assert torch.allclose(stats["mean"].float(), counts.float().mean(dim=(1, 3)))


def test_capped_batches_with_left_padding_equal_each_row_alone():
    model = dms_model("qwen3", "gqa", offset=2.0)
    kvpop.set_policy(model, "dms", BUDGET, cap=9)
    prompts = [torch.randint(1, 97, (n,)) for n in (5, 18, 11)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    batch = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    for i, prompt in enumerate(prompts):
        alone = model.generate(input_ids=prompt[None], max_new_tokens=12, do_sample=False)
        assert torch.equal(batch[i, width:], alone[0, len(prompt):]), f"row {i} differs"


# -----------------------------------------------------------------------------
# the schedule and the objective


def test_schedule_is_linear_in_the_compression_ratio():
    schedule = CompressionSchedule(final_keep_rate=0.125, steps=100, run_steps=120)
    assert schedule.keep_rate(0) == 1.0 and schedule.compression(50) == pytest.approx(4.5)
    assert schedule.keep_rate(100) == schedule.keep_rate(120) == pytest.approx(0.125)
    assert CompressionSchedule(0.5, 0, 10).keep_rate(0) == 0.5


def test_keep_rate_is_hard_in_value_and_soft_in_gradient():
    u = torch.tensor([[[2.0, -1.0, 0.5, -math.inf]], [[-3.0, -2.0, float("-inf"), -math.inf]]], requires_grad=True)
    keep = keep_rates([u])
    assert keep.tolist() == [pytest.approx(1 / 3), 1.0]
    keep.sum().backward()
    expected = -torch.sigmoid(u.detach()) * torch.sigmoid(-u.detach()) / torch.tensor([3.0, 2.0])[:, None, None]
    assert torch.allclose(u.grad, torch.where(torch.isfinite(u.detach()), expected, 0.0))


def test_loss_adds_a_one_sided_keep_rate_penalty():
    logits, top = torch.randn(2, 6, 11), torch.randn(2, 6, 11).topk(4, dim=-1)
    schedule = CompressionSchedule(0.5, 10, 10)
    kept_all = [torch.full((2, 1, 6), -1.0)]  # every decided token kept: keep-rate 1
    loss, metrics = dms_loss(logits, top.values, top.indices, kept_all, step=10, schedule=schedule)
    assert metrics["keep_rate"] == 1.0 and metrics["keep_loss"] == pytest.approx(0.5)
    assert loss == pytest.approx(float(metrics["kl"]) + 0.5)
    _, metrics = dms_loss(logits, top.values, top.indices, [torch.full((2, 1, 6), 1.0)], step=10, schedule=schedule)
    assert metrics["keep_loss"] == 0.0  # evicting more than the target is not penalised


def test_gates_train_to_the_scheduled_keep_rate_and_still_decode_exactly():
    """A few dozen steps of distillation + keep-rate loss on random data, base frozen (the scorer-only mode)."""
    torch.manual_seed(0)
    budget = Budget(1, 8, 0)
    model = tiny_model("llama", "gqa")
    ids = torch.randint(1, 97, (4, 64))
    with torch.no_grad():
        teacher = model(ids).logits.topk(16, dim=-1)
    kvpop.retrofit(model, budget, scorer="dms", policy="dms")
    for name, param in model.named_parameters():
        param.requires_grad_(".kvpop_scorer." in name)
    optimizer = torch.optim.Adam(kvpop.scorers(model).parameters(), lr=1e-3)
    schedule = CompressionSchedule(final_keep_rate=0.5, steps=15, run_steps=30)
    kvpop.set_policy(model, "dms", budget, relaxed=True, temperature=0.1)
    for step in range(schedule.run_steps):
        with kvpop.collect_priorities(model) as collected:
            logits = model(ids, use_cache=False).logits
        loss, metrics = dms_loss(logits, teacher.values, teacher.indices, list(collected.values()), step, schedule)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert torch.isfinite(loss) and metrics["kl"] < 0.05
    kvpop.set_policy(model, "dms", budget)
    decisions, one_pass = hard_decisions(model, ids)
    assert float(keep_rates(decisions).mean()) == pytest.approx(0.5, abs=0.1)
    assert (kvpop.teacher_forced_logits(model, ids, prefill=20) - one_pass).abs().max() <= 1e-4


# -----------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize("rate", [0, 0.0, -0.5, 1.5, float("nan"), True, "0.5"])
def test_keep_rate_outside_the_unit_interval_is_refused(rate):
    with pytest.raises(ValueError, match=r"keep-rate must be in \(0, 1\]"):
        CompressionSchedule(final_keep_rate=rate, steps=10, run_steps=10)


def test_schedule_longer_than_the_run_is_refused():
    with pytest.raises(ValueError, match="anneals over 20 steps but the run has 10"):
        CompressionSchedule(final_keep_rate=0.25, steps=20, run_steps=10)


@pytest.mark.parametrize("options,match", [({"temperature": 0.0}, "temperature must be > 0"),
                                           ({"temperature": -1.0}, "temperature must be > 0"),
                                           ({"threshold": float("inf")}, "threshold must be finite"),
                                           ({"cap": 6}, "an integer >= sink \\+ window = 7"),
                                           ({"cap": 8.0}, "an integer >= sink"),
                                           ({"cap": 9, "relaxed": True}, "not of the relaxed training form")])
def test_bad_policy_options_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        kvpop.build_policy("dms", BUDGET, **options)


def test_misuse_gets_one_clear_error():
    with pytest.raises(ValueError, match="no fixed top-k slots"):
        kvpop.build_policy("dms", Budget(2, 5, 3))
    with pytest.raises(ValueError, match="unknown DMS gate option"):
        kvpop.retrofit(tiny_model(), BUDGET, scorer="dms", policy="dms", scorer_options={"tau": 1.0})
    ids = torch.randint(1, 97, (1, 12))
    no_gates = kvpop.retrofit(tiny_model(), BUDGET, scorer=None, policy="dms")
    with pytest.raises(RuntimeError, match="retrofit the model with scorer='dms'"):
        no_gates(ids, use_cache=False)
    model = dms_model()
    kvpop.set_policy(model, "dms", Budget(2, 7, 0))
    with pytest.raises(ValueError, match="trained with window 5"):
        model(ids, use_cache=False)
    kvpop.set_policy(model, "dms", BUDGET, relaxed=True)
    with pytest.raises(ValueError, match="the DMS cache runs hard decisions"):
        kvpop.teacher_forced_logits(model, ids)
    kvpop.set_policy(model, "kvpop", Budget(2, 5, 3))
    with pytest.raises(TypeError, match="is a DMS gate"):
        model(ids, use_cache=False)


# -----------------------------------------------------------------------------
# StreamingLLM+: the base model distilled under the streaming mask


def test_streaming_plus_trains_the_base_under_its_mask(tmp_path):
    model = tiny_model("qwen3", "gqa")
    ids = torch.randint(1, 97, (2, 40))
    with torch.no_grad():
        teacher = model(ids).logits.topk(16, dim=-1)
    kvpop.retrofit(model, Budget(2, 6, 0), scorer=None, policy="streaming")
    assert len(kvpop.scorers(model)) == 0
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(3):
        loss = kvpop.losses.topk_kl(model(ids, use_cache=False).logits, teacher.values, teacher.indices)
        optimizer.zero_grad()
        loss.backward()
        if not losses:  # every base weight that feeds attention or the MLP learns from the masked forward
            for name, param in model.named_parameters():
                if any(part in name for part in ("q_proj", "k_proj", "v_proj", "o_proj", "mlp", "embed_tokens")):
                    assert param.grad is not None and param.grad.abs().max() > 0, name
        optimizer.step()
        losses.append(float(loss))
    assert losses[0] > 1e-3 and losses[-1] < losses[0]
    model.eval()
    kvpop.save_retrofitted(model, tmp_path / "streaming-plus")
    loaded, _ = kvpop.load_retrofitted(tmp_path / "streaming-plus")
    with torch.no_grad():
        one_pass = loaded(ids, use_cache=False).logits
        assert (model(ids, use_cache=False).logits - one_pass).abs().max() <= 1e-5
    assert (kvpop.teacher_forced_logits(loaded, ids, prefill=11) - one_pass).abs().max() <= 1e-4


# -----------------------------------------------------------------------------
# GPU (tools/gpu/session.sh part gputests)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled FlexAttention needs a GPU")
@pytest.mark.parametrize("padded", [False, True])
def test_relaxed_flex_on_cuda_matches_chunked_with_gradients(padded):
    """The training kernel: compiled flex with the log(1 - α) score_mod, gradients into q, k, v and log(1 - α)."""
    budget = Budget(4, 64, 0)
    size, hq, hkv, dim = 700, 4, 2, 32
    torch.manual_seed(0)
    positions = (torch.arange(size)[None, :] - torch.tensor([0, 37 if padded else 0])[:, None]).cuda()
    valid = positions >= 0
    q, k, v = (torch.randn(2, h, size, dim, device="cuda", requires_grad=True) for h in (hq, hkv, hkv))
    log_keep = F.logsigmoid(-torch.randn(2, hkv, size, device="cuda") * 3).requires_grad_()
    kw = dict(q_pos=positions, kv_pos=positions[:, None], kv_evict=torch.full((2, 1, size), NEVER, device="cuda"),
              kv_valid=valid[:, None], budget=budget, scale=dim ** -0.5, log_keep=log_keep)
    upstream = torch.randn(2, size, hq, dim, device="cuda")
    results = []
    for backend in ("flex", "chunked"):
        out = retention_attention(q, k, v, backend=backend, **kw)
        results.append((out, *torch.autograd.grad((out * upstream).sum(), (q, k, v, log_keep))))
    for name, fast, ref in zip(("out", "dq", "dk", "dv", "dlog_keep"), *results):
        assert (fast - ref).abs().max() < 2e-3, name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled FlexAttention needs a GPU")
def test_dms_model_on_cuda_matches_cpu_and_decodes_exactly():
    """The whole model on CUDA (compiled flex masks): relaxed forward and gate gradients as on CPU (noise off),
    hard decoding equal to the hard masked forward."""
    ids = torch.randint(1, 97, (2, 300))
    results = []
    for device in ("cpu", "cuda"):
        model = dms_model("qwen3", "gqa", Budget(2, 16, 0)).to(device)
        kvpop.set_policy(model, "dms", Budget(2, 16, 0), relaxed=True, temperature=0.5, noise=False)
        logits = model(ids.to(device), use_cache=False).logits
        logits.float().logsumexp(-1).sum().backward()
        results.append((logits.detach().cpu(), *(g.proj.weight.grad.cpu() for g in kvpop.scorers(model))))
        if device == "cuda":
            kvpop.set_policy(model, "dms", Budget(2, 16, 0))
            _, one_pass = hard_decisions(model, ids.cuda())
            decoded = kvpop.teacher_forced_logits(model, ids.cuda(), prefill=200)
            assert (decoded - one_pass).abs().max() <= 1e-3
            kvpop.set_policy(model, "dms", Budget(2, 16, 0), cap=40)  # capped DMS: the flex mask and its cache
            distinct = torch.stack([torch.randperm(96)[:90] + 1 for _ in range(2)]).cuda()  # no tied gates
            _, one_pass = hard_decisions(model, distinct)
            for options in ({"prefill": 60}, {"prefill": 30, "chunk": 16}):
                assert (kvpop.teacher_forced_logits(model, distinct, **options) - one_pass).abs().max() <= 1e-3
    for cpu, cuda in zip(*results):
        assert (cpu - cuda).abs().max() <= 2e-3 * max(1.0, float(cpu.abs().max()))
