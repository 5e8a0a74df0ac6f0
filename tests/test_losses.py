"""Losses (METHOD §3) against direct per-position references."""
import math
import random

import pytest
import torch
import torch.nn.functional as F

from kvpop import Budget
from kvpop.losses import boundary_agreement, boundary_decisions, boundary_loss, topk_kl


def reference_terms(student, teacher, budget, tau):
    """Sort the eligible prefix at every query position: O(S² log S) per row."""
    size, (s, w, k) = len(teacher), (budget.sink, budget.window, budget.topk)
    terms = []
    for d in range(size):
        t_new = d - w
        if t_new < s or k < 1 or t_new - s + 1 <= k:
            continue
        others = sorted(range(s, t_new), key=lambda t: (teacher[t], t), reverse=True)
        t_bnd = others[k - 1]
        z = 1.0 if (teacher[t_new], t_new) > (teacher[t_bnd], t_bnd) else -1.0
        margin = student[t_new] - student[t_bnd]
        terms.append((F.softplus(torch.tensor(-z * margin / tau, dtype=torch.float64)).item(), z, margin,
                      abs(teacher[t_new] - teacher[t_bnd]), abs(math.exp(teacher[t_new]) - math.exp(teacher[t_bnd]))))
    return terms


def cases(n, seed=0):
    rng = random.Random(seed)
    fixed = [(30, Budget(0, 1, 1)), (30, Budget(0, 1, 0)), (1, Budget(0, 1, 1)), (10, Budget(0, 12, 2)),
             (25, Budget(3, 4, 30)), (40, Budget(0, 1, 39))]
    yield from fixed
    for _ in range(n):
        yield rng.randint(2, 60), Budget(rng.randint(0, 4), rng.randint(1, 10), rng.randint(0, 8))


@pytest.mark.parametrize("size,budget", list(cases(30)))
@pytest.mark.parametrize("ties", [False, True])
def test_boundary_loss_matches_reference(size, budget, ties):
    torch.manual_seed(size + 7 * budget.total)
    lead = (2, 3)
    teacher = torch.randint(0, 3, (*lead, size)).double() if ties else torch.randn(*lead, size).double()
    student = torch.randn(*lead, size).double()
    tau = 0.7
    all_terms = []
    for i in range(lead[0]):
        for j in range(lead[1]):
            all_terms += reference_terms(student[i, j].tolist(), teacher[i, j].tolist(), budget, tau)
    loss = boundary_loss(student, teacher, budget, tau=tau)
    weighted = boundary_loss(student, teacher, budget, tau=tau, weight="margin")
    by_mass = boundary_loss(student, teacher, budget, tau=tau, weight="mass")
    dec = boundary_decisions(teacher, budget)
    agree = boundary_agreement(student, dec)
    if not all_terms:
        assert loss.item() == 0.0 and not torch.isnan(loss) and weighted.item() == 0.0 and by_mass.item() == 0.0
        return
    expected_mass = sum(t[0] * t[4] for t in all_terms) / len(all_terms)
    assert abs(by_mass.item() - expected_mass) <= 1e-6
    expected = sum(t[0] for t in all_terms) / len(all_terms)
    assert abs(loss.item() - expected) <= 1e-6
    expected_w = sum(t[0] * t[3] for t in all_terms) / len(all_terms)
    assert abs(weighted.item() - expected_w) <= 1e-6
    expected_agree = sum((t[2] >= 0) == (t[1] > 0) for t in all_terms) / len(all_terms)
    assert abs(agree.item() - expected_agree) <= 1e-6


def test_boundary_loss_gradient_and_descent():
    torch.manual_seed(0)
    teacher = torch.randn(2, 64)
    student = torch.zeros(2, 64, requires_grad=True)
    budget = Budget(2, 4, 8)
    opt = torch.optim.SGD([student], lr=5.0)
    first = None
    for _ in range(50):
        loss = boundary_loss(student, teacher, budget)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5 * first
    assert boundary_agreement(student, boundary_decisions(teacher, budget)) > 0.9


def test_boundary_loss_validates():
    with pytest.raises(ValueError, match="shape"):
        boundary_loss(torch.zeros(3), torch.zeros(4), Budget(0, 1, 1))
    with pytest.raises(ValueError, match="tau"):
        boundary_loss(torch.zeros(3), torch.zeros(3), Budget(0, 1, 1), tau=0)


def test_topk_kl_reference_and_zero():
    torch.manual_seed(0)
    student = torch.randn(2, 5, 50)
    teacher_full = torch.randn(2, 5, 50)
    vals, idx = teacher_full.topk(8, dim=-1)
    kl = topk_kl(student, vals, idx)
    p = vals.log_softmax(-1)
    q = student.gather(-1, idx).log_softmax(-1)
    assert torch.allclose(kl, (p.exp() * (p - q)).sum(-1).mean(), atol=1e-6)
    assert topk_kl(teacher_full, vals, idx).abs().item() < 1e-6
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[0, 1] = True
    assert torch.allclose(topk_kl(student, vals, idx, mask=mask), (p.exp() * (p - q)).sum(-1)[0, 1], atol=1e-6)
    with pytest.raises(ValueError):
        topk_kl(student, vals, idx[..., :4])


@pytest.mark.parametrize("size, sink, window, topks", [
    (40, 4, 8, (16, 3, 30, 1, 60)),  # the recipe's shape: k past the eligible count (no decision), k = 1
    (33, 0, 5, (7, 0, 2)),  # no sink; a k = 0 budget makes no decision
    (12, 2, 12, (3, 5)),  # window >= S: no position decides
    (9, 9, 1, (2,)),  # sink = S: nothing eligible
    (1, 0, 1, (1, 4)),
])
def test_decisions_at_several_budgets_equal_the_budgets_one_by_one(size, sink, window, topks):
    """One ranking and one descent over every budget's rows (a k per row) = :func:`boundary_decisions` per budget,
    exactly, with ties in the teacher; and the loss averaged over them is the per-k loop's, bit for bit."""
    from kvpop.losses import boundary_decisions_at, retention_loss

    gen = torch.Generator().manual_seed(size + sink)
    teacher = torch.randint(0, 4, (3, 2, size), generator=gen).float()  # many ties: newer wins them
    student = torch.randn(3, 2, size, generator=gen, requires_grad=True)
    budgets = [Budget(sink, window, k) for k in topks]
    together = boundary_decisions_at(teacher, budgets)
    for budget, dec in zip(budgets, together, strict=True):
        alone = boundary_decisions(teacher, budget)
        for field in ("t_new", "t_bnd", "keep", "valid"):
            assert torch.equal(getattr(dec, field), getattr(alone, field)), (budget, field)

    main, extra = budgets[0], [b.topk for b in budgets[1:]]
    batched = retention_loss(student, teacher, main, topks=extra, weight="margin")
    (grad,) = torch.autograd.grad(batched, student)
    per_k = torch.stack([boundary_loss(student, teacher, b, weight="margin")
                         for b in [main] + [Budget(sink, window, k) for k in dict.fromkeys(extra) if k != main.topk]])
    assert torch.equal(batched, per_k.mean())
    assert torch.equal(grad, torch.autograd.grad(per_k.mean(), student)[0])
    assert torch.isfinite(grad).all()


def test_a_loss_without_decisions_is_zero_with_a_graph_and_no_host_read():
    student = torch.randn(2, 10, requires_grad=True)
    loss = boundary_loss(student, torch.randn(2, 10), Budget(2, 10, 3))  # window >= S: nothing decides
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert torch.equal(student.grad, torch.zeros_like(student))
