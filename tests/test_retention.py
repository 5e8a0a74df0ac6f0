"""The retention rule (METHOD §1) against a brute force that applies it query by query."""
import random
import subprocess
import sys

import pytest
import torch

import kvpop
from kvpop import Budget
from kvpop.retention import (anchored_eviction_positions, eviction_positions, kept_counts,
                             prefix_kth_largest, ranks_newer_wins, visible, visible_anchored, visible_from_eviction,
                             with_recency)


def brute_force_mask(priority: list[float], budget: Budget) -> torch.Tensor:
    """Retained sets query by query: sinks, window, and the topk best eligible by (priority, position)."""
    size, (s, w, k) = len(priority), (budget.sink, budget.window, budget.topk)
    mask = torch.zeros(size, size, dtype=torch.bool)
    for d in range(size):
        eligible = sorted(range(s, d - w + 1), key=lambda t: (priority[t], t), reverse=True)
        keep = set(eligible[:k])
        for t in range(d + 1):
            mask[d, t] = t < s or t > d - w or t in keep
    return mask


def brute_force_eviction(mask: torch.Tensor) -> torch.Tensor:
    size = mask.shape[0]
    e = torch.full((size,), size, dtype=torch.long)
    for t in range(size):
        gone = [d for d in range(t, size) if not mask[d, t]]
        if gone:
            e[t] = gone[0]
            assert not mask[gone[0]:, t].any(), "an evicted token came back"
    return e


def random_cases(n, seed=0):
    rng = random.Random(seed)
    edge = [Budget(0, 1, 0), Budget(0, 3, 2), Budget(2, 1, 0), Budget(1, 50, 3), Budget(3, 2, 40), Budget(0, 1, 1)]
    for i in range(n):
        size = rng.choice([1, 2, 3, rng.randint(4, 48)])
        budget = edge[i] if i < len(edge) else Budget(rng.randint(0, 5), rng.randint(1, 12), rng.randint(0, 9))
        ties = i % 2 == 0
        yield size, budget, ties


@pytest.mark.parametrize("size,budget,ties", list(random_cases(60)))
def test_eviction_positions_match_brute_force(size, budget, ties):
    torch.manual_seed(size * 1000 + budget.total)
    lead = (2, 3)
    priority = torch.randint(0, 3, (*lead, size)).float() if ties else torch.randn(*lead, size)
    e = eviction_positions(priority, budget)
    assert e.shape == priority.shape and e.dtype == torch.long
    dense = visible(priority, budget)
    from_e = visible_from_eviction(e, budget)
    for idx in [(i, j) for i in range(lead[0]) for j in range(lead[1])]:
        mask = brute_force_mask(priority[idx].tolist(), budget)
        assert torch.equal(e[idx], brute_force_eviction(mask))
        assert torch.equal(dense[idx], mask)
        assert torch.equal(from_e[idx], mask)
    assert (kept_counts(e, budget) <= budget.total).all()


def test_edge_budgets():
    p = torch.randn(4, 20)
    assert (eviction_positions(p, Budget(0, 25, 3)) == 20).all(), "window >= S: nothing is ever evicted"
    assert (eviction_positions(p, Budget(20, 1, 0)) == 20).all(), "all sinks"
    e = eviction_positions(p, Budget(2, 3, 0))  # StreamingLLM: evicted when leaving the window
    assert torch.equal(e[:, 2:], (torch.arange(2, 20) + 3).clamp(max=20).expand(4, -1))
    e_all = eviction_positions(p, Budget(0, 1, 19))  # room for everything
    assert (e_all == 20).all()
    assert eviction_positions(torch.zeros(1), Budget(0, 1, 0)).tolist() == [1]


def test_all_ties_keep_the_newest():
    e = eviction_positions(torch.zeros(12), Budget(1, 2, 3))
    mask = visible_from_eviction(e, Budget(1, 2, 3))
    kept_last = mask[-1].nonzero().flatten().tolist()
    assert kept_last == [0, 7, 8, 9, 10, 11]  # sink, the 3 newest eligible (<= 9), window {10, 11}


def test_rejects_bad_priorities():
    with pytest.raises(ValueError, match="NaN"):
        eviction_positions(torch.tensor([0.0, float("nan")]), Budget(0, 1, 1))
    with pytest.raises(ValueError, match="float"):
        eviction_positions(torch.tensor([1, 2]), Budget(0, 1, 1))
    with pytest.raises(ValueError):
        eviction_positions(torch.zeros(3, 0), Budget(0, 1, 1))


def test_infinite_priorities_are_ranked():
    p = torch.tensor([0.0, float("-inf"), 1.0, float("inf"), float("-inf"), 0.5, 0.0, 0.0])
    b = Budget(0, 1, 2)
    assert torch.equal(visible_from_eviction(eviction_positions(p, b), b), brute_force_mask(p.tolist(), b))


def test_prefix_kth_largest_matches_sorting():
    torch.manual_seed(1)
    for n, k in [(1, 1), (5, 1), (33, 4), (64, 64), (100, 7)]:
        rank = torch.stack([torch.randperm(n) for _ in range(3)])
        theta = prefix_kth_largest(rank, k)
        for row in range(3):
            for j in range(n):
                prefix = sorted(rank[row, : j + 1].tolist(), reverse=True)
                assert theta[row, j].item() == (prefix[k - 1] if len(prefix) >= k else -1)


def test_ranks_break_ties_by_position():
    rank, order = ranks_newer_wins(torch.tensor([1.0, 0.0, 1.0, 0.0]))
    assert rank.tolist() == [2, 0, 3, 1] and order.tolist() == [1, 3, 0, 2]


def test_recency_term():
    p = torch.zeros(5)
    assert torch.equal(with_recency(p, 0.5), torch.arange(5) * 0.5)
    with pytest.raises(ValueError):
        with_recency(p, -1.0)
    # a cache's slots: the tokens' own positions; the policies rank by the same function
    positions = torch.tensor([[0, 7, 3, 12, 5]])
    assert torch.equal(with_recency(p[None], 0.5, positions), positions * 0.5)
    assert torch.equal(kvpop.build_policy("kvpop", Budget(1, 2, 3), recency=0.5).ranked(p[None], positions),
                       positions * 0.5)


def test_no_quadratic_memory_at_131k():
    """At S = 131072 an S×S bool would need 17 GB: the whole computation must stay in O(S) memory."""
    code = (
        "import resource, torch\n"
        "from kvpop import Budget\nfrom kvpop.retention import eviction_positions\n"
        "p = torch.randn(131072)\nbase = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "e = eviction_positions(p, Budget(4, 128, 2048))\n"
        "grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base\n"
        "assert int((e < 131072).sum()) > 0\nprint(grew)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    grew_mib = int(out.stdout.strip()) / 1024
    assert grew_mib < 512, f"peak RSS grew by {grew_mib:.0f} MiB"


@pytest.mark.parametrize("seed", range(20))
def test_positions_subset_equals_full_sequence(seed):
    """A cache's candidates (retained at P-1, plus everything after) give the eviction positions of the full row."""
    rng = random.Random(seed)
    size = rng.randint(2, 40)
    budget = Budget(rng.randint(0, 3), rng.randint(1, 6), rng.randint(0, 5))
    priority = torch.randint(0, 3, (size,)).float() if seed % 2 else torch.randn(size)
    full = eviction_positions(priority, budget)
    start = rng.randint(1, size)
    mask = visible_from_eviction(full, budget)
    kept = [t for t in range(start) if mask[start - 1, t]]
    keep_idx = torch.tensor(kept + list(range(start, size)), dtype=torch.long)
    sub = eviction_positions(priority[keep_idx], budget, positions=keep_idx)
    never = int(keep_idx.max()) + 1
    assert torch.equal(sub, full[keep_idx].clamp(max=never))


def test_left_padding_as_negative_positions():
    torch.manual_seed(0)
    budget = Budget(2, 3, 4)
    priority = torch.randn(30)
    pads = 5
    padded = torch.cat([torch.randn(pads), priority])
    positions = torch.arange(-pads, 30)
    e = eviction_positions(padded, budget, positions=positions)
    assert torch.equal(e[pads:], eviction_positions(priority, budget))
    assert (e[:pads] == 30).all()


# ---------------------------------------------------------------------------------------------- anchor slots
def brute_force_anchored(raw: list[float], budget: Budget, anchors: int, recency: float, anchor_recency: float):
    """Query by query: ``topk - anchors`` slots for the best by raw + recency·t, ``anchors`` for the best by raw +
    anchor_recency·t (each by (priority, position)), a token kept if either holds it."""
    size, (s, w, k) = len(raw), (budget.sink, budget.window, budget.topk)
    mask = torch.zeros(size, size, dtype=torch.bool)
    for d in range(size):
        eligible = range(s, d - w + 1)
        main = sorted(eligible, key=lambda t: (raw[t] + recency * t, t), reverse=True)[:k - anchors]
        anchor = sorted(eligible, key=lambda t: (raw[t] + anchor_recency * t, t), reverse=True)[:anchors]
        for t in range(d + 1):
            mask[d, t] = t < s or t > d - w or t in main or t in anchor
    return mask


def anchored_cases(n, seed=0):
    rng = random.Random(seed)
    edge = [(Budget(0, 1, 0), 0), (Budget(0, 3, 2), 2), (Budget(2, 1, 1), 1), (Budget(1, 50, 3), 1),
            (Budget(3, 2, 40), 20), (Budget(0, 1, 4), 0), (Budget(0, 2, 5), 5)]
    for i in range(n):
        size = rng.choice([1, 2, rng.randint(4, 40)])
        if i < len(edge):
            budget, anchors = edge[i]
        else:
            budget = Budget(rng.randint(0, 4), rng.randint(1, 10), rng.randint(0, 8))
            anchors = rng.randint(0, budget.topk)
        # binary-fraction λ on integer priorities: every priority exact, so ties are real ties in both paths
        recency, anchor_recency = rng.choice([(0.5, 0.0), (0.0, 0.25), (0.25, 0.25), (0.0, 0.0), (1.0, 0.125)])
        yield size, budget, anchors, recency, anchor_recency, i % 2 == 0


@pytest.mark.parametrize("size,budget,anchors,recency,anchor_recency,ties", list(anchored_cases(50)))
def test_anchored_eviction_positions_match_brute_force(size, budget, anchors, recency, anchor_recency, ties):
    torch.manual_seed(size * 100 + budget.total + anchors)
    raw = torch.randint(0, 3, (2, size)).float() if ties else torch.randn(2, size)
    ranked, anchor = with_recency(raw, recency), with_recency(raw, anchor_recency)
    e = anchored_eviction_positions(ranked, anchor, budget, anchors)
    dense = visible_anchored(ranked, anchor, budget, anchors)
    for row in range(2):
        mask = brute_force_anchored(raw[row].tolist(), budget, anchors, recency, anchor_recency)
        assert torch.equal(e[row], brute_force_eviction(mask)), "an evicted token must never come back"
        assert torch.equal(visible_from_eviction(e[row], budget), mask)
        assert torch.equal(dense[row], mask)
    assert (kept_counts(e, budget) <= budget.total).all()


def test_anchor_slots_keep_an_old_strong_token_a_decay_drops():
    """The point of the anchors: with a recency term a strong old token is outranked by newer weak ones; one anchor
    slot ranked without it keeps the old token, while the other slots still follow the decay."""
    raw = torch.zeros(40)
    raw[3] = 5.0  # a needle
    budget = Budget(1, 4, 3)
    decayed = eviction_positions(with_recency(raw, 1.0), budget)
    assert decayed[3] < 40  # recency 1.0 per token: five tokens later the needle has lost
    anchored = anchored_eviction_positions(with_recency(raw, 1.0), raw, budget, 1)
    assert anchored[3] == 40
    kept = visible_from_eviction(anchored, budget)[-1].nonzero().flatten().tolist()
    assert kept == [0, 3, 34, 35, 36, 37, 38, 39]  # sink, the needle, the 2 newest eligible, the window


def test_anchored_edge_budgets():
    ranked, anchor = torch.randn(3, 20), torch.randn(3, 20)
    budget = Budget(2, 3, 5)
    assert torch.equal(anchored_eviction_positions(ranked, None, budget, 0), eviction_positions(ranked, budget))
    # all slots anchors: the rule of one pool on the anchors' priority
    assert torch.equal(anchored_eviction_positions(ranked, anchor, budget, 5), eviction_positions(anchor, budget))
    assert (anchored_eviction_positions(ranked, anchor, Budget(0, 25, 3), 2) == 20).all(), "window >= S: never"
    with pytest.raises(ValueError, match="anchors"):
        anchored_eviction_positions(ranked, anchor, budget, 6)
    with pytest.raises(ValueError, match="anchor_share"):
        kvpop.build_policy("kvpop", budget, anchor_share=1.5)
    policy = kvpop.build_policy("kvpop", Budget(4, 8, 63), anchor_share=0.25)
    assert policy.anchors == 15  # floor(0.25 * 63)
    assert kvpop.build_policy("streaming", Budget(4, 8, 63), anchor_share=0.25).anchors == 0  # no long-range slots
    assert kvpop.build_policy("tova", Budget(4, 8, 63), anchor_share=0.25).anchors == 0  # ranks no static priority


@pytest.mark.parametrize("seed", range(12))
def test_anchored_positions_subset_equals_full_sequence(seed):
    """The cache's chunks rank candidates (retained at P-1, plus everything after): they must give the full row's e."""
    rng = random.Random(seed)
    size = rng.randint(2, 40)
    budget = Budget(rng.randint(0, 3), rng.randint(1, 6), rng.randint(1, 6))
    anchors = rng.randint(1, budget.topk)
    ranked = torch.randint(0, 3, (size,)).float() if seed % 2 else torch.randn(size)
    anchor = torch.randint(0, 3, (size,)).float() if seed % 2 else torch.randn(size)
    full = anchored_eviction_positions(ranked, anchor, budget, anchors)
    start = rng.randint(1, size)
    mask = visible_from_eviction(full, budget)
    keep_idx = torch.tensor([t for t in range(start) if mask[start - 1, t]] + list(range(start, size)))
    sub = anchored_eviction_positions(ranked[keep_idx], anchor[keep_idx], budget, anchors, positions=keep_idx)
    assert torch.equal(sub, full[keep_idx].clamp(max=int(keep_idx.max()) + 1))


# ---------------------------------------------------------------------------------------------- per-head budgets
def head_cases(n, seed=0):
    """Rows of one tensor at different topk (sink and window shared, METHOD §7): heads at the floor (k = 0), heads
    holding every eligible token (k >= S), ties, S = 1 and window >= S."""
    rng = random.Random(seed)
    fixed = [(20, 1, 1, [0, 3, 25]), (1, 0, 1, [0, 1, 2]), (12, 2, 15, [0, 1, 4]), (30, 0, 2, [0, 0, 0]),
             (30, 3, 4, [40, 40, 40])]
    for i in range(n):
        if i < len(fixed):
            yield (*fixed[i], i % 2 == 0)
            continue
        size = rng.randint(2, 40)
        yield size, rng.randint(0, 4), rng.randint(1, 10), [rng.choice([0, 1, rng.randint(0, 12), size])
                                                             for _ in range(3)], i % 2 == 0


@pytest.mark.parametrize("size,sink,window,topks,ties", list(head_cases(24)))
def test_per_head_eviction_positions_match_brute_force(size, sink, window, topks, ties):
    """Every row at its own topk, one vectorised pass, against the rule applied query by query per head."""
    torch.manual_seed(size * 31 + sum(topks))
    topk = torch.tensor(topks)
    priority = torch.randint(0, 3, (2, len(topks), size)).float() if ties else torch.randn(2, len(topks), size)
    shared = Budget(sink, window, 7)  # its topk must not matter: the rows' own do
    e = eviction_positions(priority, shared, topk=topk)
    dense = visible(priority, shared, topk=topk)
    for b in range(2):
        for h, k in enumerate(topks):
            own = Budget(sink, window, k)
            mask = brute_force_mask(priority[b, h].tolist(), own)
            assert torch.equal(e[b, h], brute_force_eviction(mask)), (b, h, k)
            assert torch.equal(dense[b, h], mask)
            assert torch.equal(e[b, h], eviction_positions(priority[b, h], own))
            assert int(visible_from_eviction(e[b, h], own)[-1].sum()) <= min(own.total, size)


def test_per_head_floor_and_everything():
    """k = 0: a token leaves as it leaves the window; k >= S: nothing is evicted."""
    p = torch.randn(1, 2, 20)
    e = eviction_positions(p, Budget(2, 3, 5), topk=torch.tensor([0, 20]))
    assert torch.equal(e[0, 0, 2:], (torch.arange(2, 20) + 3).clamp(max=20))
    assert (e[0, 1] == 20).all()


def test_per_head_topk_with_positions_subset():
    """A cache's candidates at per-head budgets give the eviction positions of the full rows."""
    torch.manual_seed(3)
    size, budget, topk = 30, Budget(2, 4, 0), torch.tensor([0, 3, 9])
    priority = torch.randint(0, 4, (3, size)).float()
    full = eviction_positions(priority, budget, topk=topk)
    start = 17
    for h in range(3):
        mask = visible_from_eviction(full[h], budget)
        keep_idx = torch.tensor([t for t in range(start) if mask[start - 1, t]] + list(range(start, size)))
        sub = eviction_positions(priority[h][keep_idx], budget, positions=keep_idx, topk=topk[h])
        assert torch.equal(sub, full[h][keep_idx].clamp(max=int(keep_idx.max()) + 1))


def test_per_row_prefix_kth_largest_matches_sorting():
    torch.manual_seed(2)
    rank = torch.stack([torch.randperm(17) for _ in range(4)])
    ks = torch.tensor([1, 5, 17, 30])
    theta = prefix_kth_largest(rank, ks)
    for row, k in enumerate(ks.tolist()):
        assert torch.equal(theta[row], prefix_kth_largest(rank[row], k))


def test_per_head_topk_refuses_bad_values():
    p = torch.randn(2, 3, 10)
    with pytest.raises(ValueError, match=">= 0"):
        eviction_positions(p, Budget(0, 1, 1), topk=torch.tensor([1, -1, 2]))
    with pytest.raises(ValueError, match="broadcast"):
        eviction_positions(p, Budget(0, 1, 1), topk=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="integer"):
        eviction_positions(p, Budget(0, 1, 1), topk=torch.tensor([1.0, 2.0, 3.0]))
