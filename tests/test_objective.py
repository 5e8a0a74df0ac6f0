"""kvpop.objective: L = KL_topK + β·L_ret against a per-position reference, and the student's forward."""
import math

import pytest
import torch

import kvpop
from kvpop import Budget
from kvpop.objective import Objective, student_forward
from kvpop.parameters import trainable_parameters
from tests.models import tiny_model
from tests.test_losses import reference_terms

BUDGETS = [Budget(2, 3, 4), Budget(0, 1, 1), Budget(1, 2, 0), Budget(3, 4, 30), Budget(0, 5, 40)]


def reference(student, teacher, logits, values, indices, budget, recency, beta, tau):
    """Per position and per row, in plain Python: the recency term added by hand, KL over positions d >= B."""
    terms = []
    for row_s, row_t in zip(student.reshape(-1, student.shape[-1]).tolist(),
                            teacher.reshape(-1, teacher.shape[-1]).tolist()):
        ranked_teacher = [y + recency * t for t, y in enumerate(row_t)]
        terms += reference_terms(row_s, ranked_teacher, budget, tau)
    ret = sum(t[0] for t in terms) / len(terms) if terms else 0.0
    acc = sum((t[2] >= 0) == (t[1] > 0) for t in terms) / len(terms) if terms else 0.0
    kls = []
    for b in range(logits.shape[0]):
        for d in range(budget.total, logits.shape[1]):
            p = [math.exp(v) for v in values[b, d].tolist()]
            q = [math.exp(logits[b, d, i].item()) for i in indices[b, d].tolist()]
            p, q = [x / sum(p) for x in p], [x / sum(q) for x in q]
            kls.append(sum(pi * math.log(pi / qi) for pi, qi in zip(p, q)))
    kl = sum(kls) / len(kls) if kls else 0.0
    return {"loss": kl + beta * ret, "ret_loss": ret, "kl": kl, "boundary_acc": acc}


def random_inputs(ties: bool):
    """``(student, teacher, logits, values, indices)``: priorities ``[2, 2, 2, 24]`` (the teacher's in {0, 1, 2}
    with ``ties``), logits over 11 tokens and their top 4."""
    layers, batch, heads, size, vocab, k = 2, 2, 2, 24, 11, 4
    teacher = (torch.randint(0, 3, (layers, batch, heads, size)).double() if ties
               else torch.randn(layers, batch, heads, size).double())
    student = torch.randn(layers, batch, heads, size).double()
    logits = torch.randn(batch, size, vocab).double()
    values, indices = torch.randn(batch, size, vocab).double().topk(k, dim=-1)
    return student, teacher, logits, values, indices


@pytest.mark.parametrize("budget", BUDGETS, ids=str)
@pytest.mark.parametrize("ties", [False, True])
def test_objective_matches_a_per_position_reference(budget, ties):
    torch.manual_seed(budget.total)
    student, teacher, logits, values, indices = random_inputs(ties)
    recency, beta, tau = (0.5 if ties else 0.0), 0.3, 0.7
    got = Objective(budget, recency, beta=beta, tau=tau)(student, teacher, logits, values, indices)
    want = reference(student, teacher, logits, values, indices, budget, recency, beta, tau)
    for key in want:
        assert got[key].item() == pytest.approx(want[key], abs=1e-5), key


EXTRA = [(Budget(2, 3, 4), (1, 9)), (Budget(0, 1, 1), (4, 1, 4)), (Budget(1, 2, 0), (3,)), (Budget(3, 4, 30), (2,)),
         (Budget(0, 30, 2), (5,)), (Budget(2, 2, 3), (60,))]  # topk 0, s 0, w >= S, repeats, a k past S


@pytest.mark.parametrize("budget,extra", EXTRA, ids=str)
@pytest.mark.parametrize("ties", [False, True])
def test_extra_topks_average_the_boundary_losses_of_every_budget(budget, extra, ties):
    """``L_ret`` with ``extra_topks`` is the mean of the per-position reference's boundary loss at ``budget`` and at
    each other long-range size once (a budget without decisions counts 0); the KL and ``boundary_acc`` stay
    ``budget``'s."""
    torch.manual_seed(budget.total + len(extra))
    student, teacher, logits, values, indices = random_inputs(ties)
    recency, beta, tau = (0.5 if ties else 0.0), 0.3, 0.7
    got = Objective(budget, recency, beta=beta, tau=tau, extra_topks=extra)(student, teacher, logits, values, indices)
    sizes = [budget.topk] + [x for i, x in enumerate(extra) if x != budget.topk and x not in extra[:i]]
    parts = [reference(student, teacher, logits, values, indices, Budget(budget.sink, budget.window, x), recency,
                       beta, tau)["ret_loss"] for x in sizes]
    want = reference(student, teacher, logits, values, indices, budget, recency, beta, tau)
    want_ret = sum(parts) / len(parts)
    assert got["ret_loss"].item() == pytest.approx(want_ret, abs=1e-5)
    assert got["loss"].item() == pytest.approx(want["kl"] + beta * want_ret, abs=1e-5)
    for key in ("kl", "boundary_acc"):
        assert got[key].item() == pytest.approx(want[key], abs=1e-5), key


def test_student_forward_trains_the_scorers_with_the_models_budget_and_recency():
    model = tiny_model("llama", "gqa")
    kvpop.retrofit(model, Budget(2, 4, 6), scorer="mlstm", recency=0.05)
    params = trainable_parameters(model, "scorer_only")
    objective = Objective.for_model(model, beta=0.5)
    assert (objective.budget, objective.recency, objective.beta) == (Budget(2, 4, 6), 0.05, 0.5)
    ids = torch.randint(1, 97, (2, 32))
    logits, student = student_forward(model, ids)
    assert logits.shape == (2, 32, 97) and student.shape == (2, 2, 2, 32)
    values, indices = torch.randn(2, 32, 97).topk(5, dim=-1)
    out = objective(student, torch.randn(2, 2, 2, 32), logits, values, indices)
    out["loss"].backward()
    assert all(p.grad is not None for p in params["scorers"])
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    assert 0 <= out["boundary_acc"].item() <= 1 and out["kl"].item() > 0


def test_objective_refuses_bad_settings():
    with pytest.raises(ValueError, match="tau > 0"):
        Objective(Budget(1, 1, 1), tau=0)
    with pytest.raises(ValueError, match="weight"):
        Objective(Budget(1, 1, 1), weight="loud")
    for bad in ((0,), (2, -1), (True,)):
        with pytest.raises(ValueError, match="extra_topks must be long-range sizes >= 1"):
            Objective(Budget(1, 1, 1), extra_topks=bad)
    model = tiny_model("llama", "gqa")
    kvpop.retrofit(model, None, scorer=None, policy="dense")
    with pytest.raises(ValueError, match="no budget"):
        Objective.for_model(model)
    anchored = kvpop.retrofit(tiny_model("llama", "gqa"), Budget(1, 2, 8), scorer="mlp", anchor_share=0.5)
    with pytest.raises(ValueError, match="4 anchor slots .* the retention loss does not model"):
        Objective.for_model(anchored)  # training decides one top-k pool: anchors are set at evaluation
