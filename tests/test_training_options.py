"""The retention objective's options (class balance, several budgets, random pairs) and the scorers' feature sets,
against direct references."""
import math
import random

import pytest
import torch
import torch.nn.functional as F

from kvpop import Budget
from kvpop.losses import (boundary_decisions, boundary_loss, check_retention_options, class_balance_weights,
                          random_pair_loss, retention_loss)
from kvpop.scorers import build_scorer
from tests.test_losses import reference_terms


def cases(n, seed=0):
    rng = random.Random(seed)
    yield from [(30, Budget(0, 1, 1)), (30, Budget(0, 1, 0)), (10, Budget(0, 12, 2)), (25, Budget(3, 4, 30))]
    for _ in range(n):
        yield rng.randint(2, 50), Budget(rng.randint(0, 4), rng.randint(1, 10), rng.randint(0, 8))


@pytest.mark.parametrize("size,budget", list(cases(12)))
@pytest.mark.parametrize("ties", [False, True])
def test_balanced_boundary_loss_matches_reference(size, budget, ties):
    torch.manual_seed(size + 3 * budget.total)
    teacher = torch.randint(0, 3, (2, 3, size)).double() if ties else torch.randn(2, 3, size).double()
    student = torch.randn(2, 3, size).double()
    total, count = 0.0, 0
    for i in range(2):
        for j in range(3):
            terms = reference_terms(student[i, j].tolist(), teacher[i, j].tolist(), budget, 0.5)
            n, keeps = len(terms), sum(t[1] > 0 for t in terms)
            for loss, z, *_ in terms:
                both = 0 < keeps < n
                weight = (n / (2 * keeps) if z > 0 else n / (2 * (n - keeps))) if both else 1.0
                total += weight * loss
            count += n
    got = boundary_loss(student, teacher, budget, tau=0.5, balance=True)
    assert abs(got.item() - (total / count if count else 0.0)) <= 1e-6


def test_class_balance_gives_each_class_half_the_weight():
    torch.manual_seed(0)
    dec = boundary_decisions(torch.randn(4, 200), Budget(2, 8, 10))
    w = class_balance_weights(dec)
    for row in range(4):
        valid, keep = dec.valid[row], dec.keep[row]
        kept_weight = w[row][valid & keep].sum()
        evicted_weight = w[row][valid & ~keep].sum()
        assert torch.isclose(kept_weight, evicted_weight) and torch.isclose(kept_weight + evicted_weight,
                                                                            valid.sum().double())


def test_random_pair_loss_matches_reference_on_its_own_draws():
    """Same generator state, then the reference re-derives each pair's label from the teacher's order."""
    torch.manual_seed(1)
    size, budget, pairs = 40, Budget(3, 5, 4), 3
    teacher = torch.randint(0, 4, (2, size)).double()  # ties: the newer token wins
    student = torch.randn(2, size).double()
    got = random_pair_loss(student, teacher, budget, pairs=pairs, tau=0.7, generator=torch.Generator().manual_seed(5))
    draw = torch.rand(2, size - budget.window - budget.sink - 1, pairs, generator=torch.Generator().manual_seed(5))
    terms = []
    for row in range(2):
        for j, t_new in enumerate(range(budget.sink + 1, size - budget.window)):
            for m in range(pairs):
                u = budget.sink + int(draw[row, j, m].item() * (t_new - budget.sink))
                assert budget.sink <= u < t_new
                z = 1.0 if (teacher[row, t_new], t_new) > (teacher[row, u], u) else -1.0
                margin = (student[row, t_new] - student[row, u]).item()
                terms.append(F.softplus(torch.tensor(-z * margin / 0.7, dtype=torch.float64)).item())
    assert abs(got.item() - sum(terms) / len(terms)) <= 1e-9
    assert random_pair_loss(student[:, :6], teacher[:, :6], budget, pairs=2).item() == 0.0  # no pair: 0, no NaN


def test_retention_loss_averages_its_parts():
    torch.manual_seed(2)
    teacher, student = torch.randn(3, 90), torch.randn(3, 90, requires_grad=True)
    budget = Budget(2, 6, 8)
    plain = retention_loss(student, teacher, budget)
    assert torch.equal(plain, boundary_loss(student, teacher, budget))
    multi = retention_loss(student, teacher, budget, topks=[8, 4, 16], tau=2.0, weight="margin")
    parts = [boundary_loss(student, teacher, Budget(2, 6, k), tau=2.0, weight="margin") for k in (8, 4, 16)]
    assert torch.isclose(multi, torch.stack(parts).mean())
    with_pairs = retention_loss(student, teacher, budget, random_pairs=2, generator=torch.Generator().manual_seed(0))
    pairs = random_pair_loss(student, teacher, budget, pairs=2, generator=torch.Generator().manual_seed(0))
    assert torch.isclose(with_pairs, (boundary_loss(student, teacher, budget) + pairs) / 2)
    with_pairs.backward()
    assert student.grad is not None and torch.isfinite(student.grad).all()


def test_balanced_multi_budget_training_separates_the_classes():
    """Descent on the balanced objective at two budgets reaches a high balanced accuracy at both."""
    from kvpop.diagnostics import decision_metrics

    torch.manual_seed(3)
    teacher = torch.randn(2, 120)
    student = torch.zeros(2, 120, requires_grad=True)
    budget = Budget(2, 4, 10)
    opt = torch.optim.Adam([student], lr=0.1)
    for _ in range(150):
        loss = retention_loss(student, teacher, budget, balance=True, topks=[20])
        opt.zero_grad()
        loss.backward()
        opt.step()
    for k in (10, 20):
        metrics = decision_metrics(student.detach(), teacher, Budget(2, 4, k))
        assert metrics["balanced_accuracy"].min() > 0.9


@pytest.mark.parametrize("name", ["mlp", "mlstm"])
def test_norm_features_see_the_scale_that_the_plain_features_lose(name):
    torch.manual_seed(0)
    options = {"qk_dim": 16, "v_dim": 16} if name == "mlstm" else {}
    plain = build_scorer(name, 2, 8, 4, **options)
    normed = build_scorer(name, 2, 8, 4, features="kv_norms", **options)
    assert normed.in_features == plain.in_features + 2 == 18
    keys, values = torch.randn(1, 2, 64, 8), torch.randn(1, 2, 64, 8)
    scaled = keys * torch.linspace(0.1, 10, 64)[:, None]  # the same directions, other norms
    with torch.no_grad():
        assert torch.allclose(plain(keys, values), plain(scaled, values), atol=1e-4)  # eps of the norm only
        assert not torch.allclose(normed(keys, values), normed(scaled, values), atol=1e-3)
        x = normed.features(scaled, values, None)
        norms = scaled.square().mean(-1).add(normed.config.norm_eps).sqrt().log()
        torch.testing.assert_close(x[..., 16], norms)
    assert build_scorer(**normed.config_dict()).config.features == "kv_norms"  # round-trips
    with pytest.raises(ValueError, match="features must be one of"):
        build_scorer(name, 2, 8, 4, features="kv_position", **options)


def test_norm_features_keep_the_step_contract():
    """step() == forward() with the extra features, for the delayed mLSTM (the ring buffers carry them)."""
    from tests.test_scorers import assert_steps_match, kv, run_steps

    torch.manual_seed(0)
    scorer = build_scorer("mlstm", 2, 16, 5, features="kv_norms", qk_dim=16, v_dim=16)
    keys, values = kv(2, 2, 40, 16)
    with torch.no_grad():
        p = scorer(keys, values)
        out, _ = run_steps(scorer, keys, values, scorer.init_state(2, "cpu"), 0)
    assert_steps_match(out, p, 5)
    assert not math.isnan(p.sum().item())


def test_retention_options_from_a_config_are_checked():
    assert check_retention_options({"weight": "none", "topks": [8, 16]}) == {"weight": None, "topks": [8, 16]}
    for bad, match in (({"lambda": 1}, "unknown retention loss option"), ({"tau": 0}, "tau"),
                       ({"weight": "huber"}, "weight"), ({"balance": 1}, "balance"), ({"topks": [0]}, "topks"),
                       ({"topks": 8}, "topks"), ({"random_pairs": -1}, "random_pairs")):
        with pytest.raises(ValueError, match=match):
            check_retention_options(bad)
