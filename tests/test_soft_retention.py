"""KL through the mask (METHOD §3): the relaxed retention and the loss it carries to the scorers.

Held to independent references: the cutoffs to a per-query sort of the eligible priorities (ties and the edge budgets
``k = 0``, ``s = 0``, ``w >= S``, ``k >= S`` included), the attention to a dense softmax over explicit scores with the
``log sigmoid`` bias (values and the gradient into the priorities, chunked and flex), and the relaxation's limit
``tau -> 0`` to the hard rule — attention and a whole retrofitted model's logits alike.
"""
import copy

import pytest
import torch

import kvpop
from kvpop import Budget
from kvpop.attention import NEVER, SoftRetention, retention_attention, soft_temperature
from kvpop.objective import KLThroughMask
from kvpop.online import scorer_only_step
from kvpop.retention import eviction_positions, soft_cutoffs, soft_retention_bias, visible
from kvpop.retrofit import runtime_of, soft_retention
from tests.models import tiny_model
from tests.test_scorers import one_thread  # noqa: F401  (autouse: tiny models on one thread)

EDGE_BUDGETS = [Budget(2, 5, 6), Budget(0, 3, 4), Budget(3, 50, 5), Budget(2, 5, 0), Budget(0, 1, 1),
                Budget(1, 4, 64)]


def brute_cutoffs(priority: torch.Tensor, budget: Budget) -> torch.Tensor:
    """Per row and query: sort the eligible priorities, take the midpoint of the k-th and (k+1)-th largest."""
    rows, size = priority.shape
    out = torch.full((rows, size), float("-inf"), dtype=priority.dtype)
    s, w, k = budget.sink, budget.window, budget.topk
    for r in range(rows):
        for d in range(size):
            eligible = sorted((priority[r, t].item() for t in range(s, d - w + 1)), reverse=True)
            if k == 0:
                out[r, d] = float("inf") if eligible else float("-inf")
            elif len(eligible) > k:
                out[r, d] = (eligible[k - 1] + eligible[k]) / 2
    return out


@pytest.mark.parametrize("budget", EDGE_BUDGETS, ids=str)
@pytest.mark.parametrize("ties", [False, True])
def test_cutoffs_equal_a_per_query_sort(budget, ties):
    generator = torch.Generator().manual_seed(hash((str(budget), ties)) % 2 ** 31)
    priority = torch.randn(4, 40, generator=generator, dtype=torch.float64)
    if ties:
        priority = (priority * 2).round() / 2  # few distinct values: many ties at the cutoff
    assert torch.equal(soft_cutoffs(priority, budget), brute_cutoffs(priority, budget))


@pytest.mark.parametrize("budget", [b for b in EDGE_BUDGETS if b.topk > 0], ids=str)
def test_kept_tokens_lie_above_the_cutoff_and_evicted_below(budget):
    priority = torch.randn(3, 40, generator=torch.Generator().manual_seed(1), dtype=torch.float64)  # no ties
    cutoffs, mask = soft_cutoffs(priority, budget), visible(priority, budget)
    for d in range(40):
        eligible = torch.arange(budget.sink, max(budget.sink, d - budget.window + 1))
        if len(eligible) > budget.topk:
            assert torch.equal(priority[:, eligible] > cutoffs[:, d:d + 1], mask[:, d, eligible])


def _inputs(budget, size=64, seed=0, dtype=torch.float64, heads=(4, 2), dim=8):
    generator = torch.Generator().manual_seed(seed)
    hq, hkv = heads
    q = torch.randn(2, hq, size, dim, generator=generator, dtype=dtype)
    k, v = (torch.randn(2, hkv, size, dim, generator=generator, dtype=dtype) for _ in range(2))
    ranked = torch.randn(2, hkv, size, generator=generator, dtype=dtype).requires_grad_()
    return q, k, v, ranked


def _attend(q, k, v, budget, *, soft=None, evict=None, backend="chunked"):
    size = q.shape[2]
    positions = torch.arange(size, device=q.device)  # on the GPU too: compiled flex cannot index a CPU tensor
    evict = torch.full(k.shape[:3], NEVER, device=q.device) if evict is None else evict
    return retention_attention(q, k, v, q_pos=positions.expand(q.shape[0], size), kv_pos=positions[None, None],
                               kv_evict=evict, kv_valid=torch.ones(1, 1, size, dtype=torch.bool, device=q.device),
                               budget=budget, scale=q.shape[-1] ** -0.5, backend=backend, soft=soft)


def _dense_reference(q, k, v, ranked, cutoffs, budget, tau):
    group = q.shape[1] // k.shape[1]
    bias = soft_retention_bias(ranked, cutoffs, budget, tau).repeat_interleave(group, dim=1)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(group, dim=1)) * q.shape[-1] ** -0.5 + bias
    return torch.einsum("bhqk,bhkd->bhqd", scores.softmax(-1), v.repeat_interleave(group, dim=1)).transpose(1, 2)


@pytest.mark.parametrize("budget", [Budget(2, 8, 10), Budget(0, 4, 3), Budget(3, 80, 5)], ids=str)
@pytest.mark.parametrize("backend", ["chunked", "flex"])
def test_soft_attention_equals_dense_scores_with_the_log_sigmoid_bias(budget, backend):
    """Values and the gradient into the priorities (flex: eager on CPU, float32)."""
    dtype = torch.float64 if backend == "chunked" else torch.float32
    q, k, v, ranked = _inputs(budget, dtype=dtype)
    cutoffs = soft_cutoffs(ranked.detach(), budget)
    for tau in (0.3, 2.0):
        out = _attend(q, k, v, budget, soft=SoftRetention(ranked, cutoffs, tau), backend=backend)
        ref = _dense_reference(q, k, v, ranked, cutoffs, budget, tau)
        tol = 1e-12 if dtype == torch.float64 else 2e-5
        torch.testing.assert_close(out, ref, atol=tol, rtol=0)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=dtype)
        grad, = torch.autograd.grad((out * weights).sum(), ranked)
        expected, = torch.autograd.grad((ref * weights).sum(), ranked)
        evicts = q.shape[2] - budget.window - budget.sink > budget.topk  # else (w >= S) no token is ever gated
        assert torch.isfinite(grad).all() and (grad.abs().max() > 0) == evicts
        torch.testing.assert_close(grad, expected, atol=tol * 10, rtol=0)


@pytest.mark.parametrize("budget", [Budget(2, 8, 10), Budget(0, 4, 3), Budget(3, 80, 5)], ids=str)
def test_soft_attention_tends_to_the_hard_rule(budget):
    q, k, v, ranked = _inputs(budget)
    ranked = ranked.detach()
    soft = _attend(q, k, v, budget, soft=SoftRetention(ranked, soft_cutoffs(ranked, budget), 1e-6))
    hard = _attend(q, k, v, budget, evict=eviction_positions(ranked, budget))
    torch.testing.assert_close(soft, hard, atol=1e-12, rtol=0)


def test_soft_attention_is_refused_where_it_is_undefined():
    budget = Budget(2, 8, 10)
    q, k, v, ranked = _inputs(budget)
    soft = SoftRetention(ranked, soft_cutoffs(ranked.detach(), budget), 0.5)
    valid = torch.ones(1, 1, 64, dtype=torch.bool)
    valid[..., 0] = False  # a padded row
    with pytest.raises(ValueError, match="unpadded whole sequences"):
        retention_attention(q, k, v, q_pos=torch.arange(64)[None], kv_pos=torch.arange(64)[None, None],
                            kv_evict=torch.full((1, 1, 64), NEVER), kv_valid=valid, budget=budget, scale=1.0,
                            soft=soft)
    with pytest.raises(ValueError, match="compact backend"):
        _attend(q, k, v, budget, soft=soft, backend="compact")
    with pytest.raises(ValueError, match="two relaxations"):
        retention_attention(q, k, v, q_pos=torch.arange(64)[None], kv_pos=torch.arange(64)[None, None],
                            kv_evict=torch.full((1, 1, 64), NEVER), kv_valid=torch.ones(1, 1, 64, dtype=torch.bool),
                            budget=budget, scale=1.0, soft=soft, log_keep=torch.zeros(2, 2, 64))


def retrofitted(budget=Budget(2, 6, 8), layers=2):
    model = kvpop.retrofit(tiny_model("llama", "gqa", layers=layers), budget, scorer="mlstm",
                           scorer_options={"qk_dim": 16, "v_dim": 16})
    for name, param in model.named_parameters():
        param.requires_grad_(".kvpop_scorer." in name)
    return model


def test_a_retrofitted_model_under_soft_retention_tends_to_its_hard_forward():
    """Every layer's relaxed mask at a tiny temperature is the hard one (scorer priorities are continuous: no ties),
    the streaming layers keep the hard mask, and the runtime is restored after the block."""
    model = retrofitted(layers=3)
    kvpop.set_streaming_layers(model, [1])
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hard = model(input_ids=ids, use_cache=False).logits
        with soft_retention(model, 1e-7):
            soft = model(input_ids=ids, use_cache=False).logits
        with soft_retention(model, 1.0):
            relaxed = model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(soft, hard, atol=1e-5, rtol=0)
    assert (relaxed - hard).abs().max() > 1e-3  # the relaxation is not the hard rule at tau = 1
    assert runtime_of(model).soft_tau is None


def test_a_relaxed_forward_ranks_with_the_recency_it_is_given_and_restores_the_policy():
    """``soft_retention(..., recency=λ)``: the relaxed forward of a λ = 0 model equals that of the same model whose
    policy carries λ (at a tiny temperature: its hard forward at λ, which differs from λ = 0's); the policy is the
    model's own again after the block."""
    model = retrofitted(layers=2)
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(5))
    own = runtime_of(model).policy
    with torch.no_grad():
        plain = model(input_ids=ids, use_cache=False).logits
        with soft_retention(model, 0.5, recency=0.3):
            swapped = model(input_ids=ids, use_cache=False).logits
        with soft_retention(model, 1e-7, recency=0.3):
            sharp = model(input_ids=ids, use_cache=False).logits
        assert runtime_of(model).policy is own
        kvpop.set_policy(model, "kvpop", own.budget, recency=0.3)
        decayed = model(input_ids=ids, use_cache=False).logits
        with soft_retention(model, 0.5):
            carried = model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(swapped, carried, atol=1e-6, rtol=0)
    torch.testing.assert_close(sharp, decayed, atol=1e-5, rtol=0)
    assert (decayed - plain).abs().max() > 1e-3  # λ = 0.3 changes what is kept at this size


def test_soft_retention_is_refused_where_it_is_undefined():
    model = retrofitted()
    for tau in (0, -1.0, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="tau must be"):
            with soft_retention(model, tau):
                pass
    for recency in (-0.1, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="recency must be a finite number >= 0"):
            with soft_retention(model, 1.0, recency=recency):
                pass
    kvpop.set_policy(model, "tova", Budget(2, 6, 8))
    with pytest.raises(ValueError, match="static policy"):
        with soft_retention(model, 1.0):
            pass
    kvpop.set_policy(model, "kvpop", Budget(2, 6, 8))
    with soft_retention(model, 1.0), pytest.raises(ValueError, match="unpadded whole sequences"):
        model(input_ids=torch.randint(0, 97, (2, 40)), attention_mask=torch.ones(2, 40).index_fill(1,
              torch.tensor([0]), 0).long(), use_cache=False)


def test_the_kl_reaches_the_scorers_through_the_mask_and_training_lowers_it():
    """Scorer-only: the base gets no gradient, every layer's scorer does; a few steps on the KL alone lower it."""
    model = retrofitted()
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(2))
    policy = runtime_of(model).policy
    kvpop.set_policy(model, "dense")  # the frozen base's own logits are the teacher's
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    kvpop.set_policy(model, policy)
    top = logits.topk(16, dim=-1)
    term = KLThroughMask(weight=1.0, tau=0.5, top_k=16, relative=True)
    first = term(model, ids, top.values, top.indices)
    first.backward()
    for layer, scorer in enumerate(kvpop.scorers(model)):
        assert any(p.grad is not None and p.grad.abs().max() > 0 for p in scorer.parameters()), layer
    assert all(p.grad is None for n, p in model.named_parameters() if ".kvpop_scorer." not in n)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.05)
    for _ in range(20):
        optimizer.zero_grad()
        loss = term(model, ids, top.values, top.indices)
        loss.backward()
        optimizer.step()
    assert loss.item() < first.item()


def test_scorer_only_step_adds_the_weighted_kl():
    model = retrofitted()
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(4))
    plain = scorer_only_step(model, ids)
    term = KLThroughMask(weight=0.7, tau=0.5, top_k=8)
    both = scorer_only_step(model, ids, kl=term)
    assert "kl" not in plain and both["kl"].item() > 0
    torch.testing.assert_close(both["loss"], plain["loss"] + 0.7 * both["kl"], atol=1e-6, rtol=0)


def test_a_relative_temperature_makes_the_relaxation_blind_to_the_priorities_scale():
    """``soft_temperature(..., relative=True)``: scaling every priority (and so every cutoff) by a positive factor
    leaves the relaxed attention unchanged; with an absolute temperature it sharpens the gates."""
    budget = Budget(2, 8, 10)
    q, k, v, ranked = _inputs(budget)
    ranked = ranked.detach()

    def relaxed(priority, relative):
        tau = soft_temperature(priority, 0.5, relative)
        return _attend(q, k, v, budget, soft=SoftRetention(priority, soft_cutoffs(priority, budget), tau))

    torch.testing.assert_close(relaxed(ranked * 7, True), relaxed(ranked, True), atol=1e-12, rtol=0)
    assert (relaxed(ranked * 7, False) - relaxed(ranked, False)).abs().max() > 1e-3
    assert soft_temperature(ranked, 0.5, False) == 0.5
    torch.testing.assert_close(soft_temperature(ranked, 0.5, True), 0.5 * ranked.std(-1, keepdim=True))


def test_kl_options_are_checked_in_one_line():
    assert KLThroughMask.from_options({}) is None and KLThroughMask.from_options(None) is None
    assert KLThroughMask.from_options({"weight": 2, "tau": 0.25}) == KLThroughMask(2, 0.25, 64)
    assert KLThroughMask.from_options({"relative": True}).relative
    assert KLThroughMask.from_options({"recency": 0.003}).recency == 0.003 and KLThroughMask().recency is None
    for bad in (-1, float("nan"), float("inf"), "0.1", True):
        with pytest.raises(ValueError, match="recency >= 0"):
            KLThroughMask.from_options({"recency": bad})
    with pytest.raises(ValueError, match="relative is true or false"):
        KLThroughMask.from_options({"relative": "yes"})
    for bad in ({"weight": 0}, {"tau": -1}, {"top_k": 0}, {"top_k": 1.5}):
        with pytest.raises(ValueError, match="weight > 0, tau > 0 and top_k >= 1"):
            KLThroughMask.from_options(bad)
    with pytest.raises(ValueError, match="weight, tau, top_k, relative and recency"):
        KLThroughMask.from_options({"temperature": 1})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled FlexAttention needs CUDA")
def test_cuda_compiled_soft_attention_equals_the_chunked_one():
    """The compiled flex kernel with the captured priorities' gradient, bf16, against the chunked fp32 path."""
    budget = Budget(4, 256, 252)
    q, k, v, ranked = _inputs(budget, size=2048, dtype=torch.float32, heads=(9, 3), dim=64)  # flex: head_dim >= 16
    q, k, v = (x.cuda().requires_grad_() for x in (q, k, v))  # as in training (flex's backward wants them)
    ranked = ranked.detach().cuda().mul(3).requires_grad_()
    cutoffs = soft_cutoffs(ranked.detach(), budget)
    soft = SoftRetention(ranked, cutoffs, 0.5)
    out = _attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), budget, soft=soft, backend="flex").float()
    ref = _attend(q, k, v, budget, soft=soft, backend="chunked")
    assert (out - ref).abs().max() < 0.02
    weights = torch.randn_like(ref)
    grad, = torch.autograd.grad((out * weights).sum(), ranked)
    expected, = torch.autograd.grad((ref * weights).sum(), ranked)
    assert (grad - expected).abs().max() <= 0.05 * expected.abs().max()


def test_soft_cutoffs_per_head_budgets():
    """Per-row topk (METHOD §7): each row's cutoffs are those of its own uniform budget."""
    torch.manual_seed(4)
    ranked = torch.randint(0, 4, (2, 3, 24)).float()
    budget, topk = Budget(2, 3, 5), torch.tensor([0, 4, 30])
    cut = soft_cutoffs(ranked, budget, topk=topk)
    for h, k in enumerate(topk.tolist()):
        assert torch.equal(cut[:, h], soft_cutoffs(ranked[:, h], Budget(2, 3, k)))
