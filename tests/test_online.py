"""Online targets (kvpop.online): the same targets as the precompute stage, the scorers' real inputs, a training step."""
import copy

import pytest
import torch

import kvpop
from kvpop import Budget
from kvpop.diagnostics import attention_model, diagnose_model
from kvpop.online import dense_priorities, online_targets, scorer_only_step, student_priorities
from kvpop.targets import future_attention_targets_dense, teacher_pass
from tests.models import tiny_model
from tests.test_scorers import one_thread  # noqa: F401  (autouse: tiny models on one thread)

S = 48


def retrofitted(budget=Budget(2, 6, 8), scorer="mlstm", **options):
    base = tiny_model("llama", "gqa", layers=2)
    model = kvpop.retrofit(copy.deepcopy(base), budget, scorer=scorer,
                           scorer_options={"qk_dim": 16, "v_dim": 16, **options} if scorer == "mlstm" else options)
    return base, model


def test_online_targets_equal_the_precomputed_ones():
    from pipelines.precompute import compute_rows
    from pipelines.store import target_column

    base, model = retrofitted()
    ids = torch.randint(0, 97, (2, S))
    online = online_targets(model, ids, keep=("queries", "keys"))
    stored = compute_rows(base, ids.numpy(), [6], top_k=4)[target_column(6)]  # [B, L, Hkv, S]
    torch.testing.assert_close(online["targets"], torch.from_numpy(stored).permute(1, 0, 2, 3), atol=1e-5, rtol=0)
    for layer in range(2):  # and against the fp64 brute force on the queries and keys the pass saw
        brute = future_attention_targets_dense(online["queries"][layer], online["keys"][layer], 6)
        finite = torch.isfinite(brute)
        assert torch.equal(finite, torch.isfinite(online["targets"][layer]))
        torch.testing.assert_close(online["targets"][layer][finite], brute[finite], atol=1e-5, rtol=0)
    assert model.config._attn_implementation == "kvpop"  # restored after the pass


def test_dense_features_are_what_a_never_evicting_student_sees():
    """With room for every token the sparse forward is the dense one: the scorers' inputs must be identical."""
    _, model = retrofitted(Budget(2, 6, S))
    kvpop.set_policy(model, "kvpop", Budget(2, 6, S), recency=0.05)
    ids = torch.randint(0, 97, (2, S))
    online = online_targets(model, ids, keep=("keys", "values"))
    with torch.no_grad():
        dense = dense_priorities(model, online["keys"], online["values"])
        student = student_priorities(model, ids)
    torch.testing.assert_close(dense, student, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("features", ["dense", "student"])
def test_scorer_only_step_trains_only_the_scorers(features):
    _, model = retrofitted(scorer="mlp")
    for name, param in model.named_parameters():
        param.requires_grad_(".kvpop_scorer." in name)
    ids = torch.randint(0, 97, (2, S))
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.05)
    first = None
    for _ in range(15):
        out = scorer_only_step(model, ids, features=features, balance=True, topks=[4])
        first = first if first is not None else out["loss"].item()
        optimizer.zero_grad()
        out["loss"].backward()
        optimizer.step()
    assert out["loss"].item() < first
    assert out["student"].shape == out["targets"].shape == (2, 2, 2, S)
    assert all(p.grad is None for n, p in model.named_parameters() if ".kvpop_scorer." not in n)


def test_diagnose_model_runs_on_both_feature_sources():
    _, model = retrofitted()
    ids = torch.randint(0, 97, (3, S))
    for features in ("student", "dense"):
        report = diagnose_model(model, ids, topks=[4, 8], features=features, batch_size=2)
        assert list(report["budgets"]) == ["s2-w6-k8", "s2-w6-k4"]
        dec = report["budgets"]["s2-w6-k8"]["decisions"]
        assert dec["scorer"]["agreement"].shape == (2, 3, 2)
        assert (dec["oracle"]["agreement"] == 1).all()


def test_attention_model_matches_the_eager_attention():
    """The dense model's own attention weights (HF eager, output_attentions) masked by each rule's per-query set
    (``visible``): the same shares as :func:`attention_model`, per layer, sequence and query head; streaming
    loses nothing in its own band. (The output error is held to its brute force in test_diagnostics.)"""
    from kvpop.retention import visible, with_recency
    from kvpop.retrofit import runtime_of

    base, model = retrofitted()
    ids = torch.randint(0, 97, (3, S))
    budget = Budget(2, 6, 8)
    found = attention_model(model, ids, topks=[3], batch_size=2)
    assert list(found) == ["s2-w6-k8", "s2-w6-k3"]
    base.config._attn_implementation = "eager"
    with torch.no_grad():
        attentions = base(input_ids=ids, output_attentions=True).attentions  # per layer [B, H, S, S]
    targets = online_targets(model, ids)["targets"].double()
    priorities = {"scorer": student_priorities(model, ids).double(),
                  "oracle": with_recency(targets, runtime_of(model).policy.recency),
                  "newest": torch.arange(S, dtype=torch.float64).expand(targets.shape)}
    for rule, priority in priorities.items():
        for layer, probs in enumerate(attentions):
            for b in (budget, Budget(2, 6, 3)):
                keep = visible(priority[layer], b).repeat_interleave(2, dim=1)  # [B, Hkv, S, S] -> query heads
                lost = torch.where(keep, 0.0, probs.double()).sum(-1)[..., b.total:].mean(-1)
                torch.testing.assert_close(found[str(b)][rule]["lost"][layer].double(), lost, atol=1e-5, rtol=0)
    assert (found["s2-w6-k3"]["scorer"]["output_change"] > 0).all()
    for b in found.values():
        torch.testing.assert_close(b["newest"]["lost"], b["newest"]["lost_far"], atol=1e-6, rtol=0)
        for parts in b.values():
            assert ((parts["lost_far"] <= parts["lost"] + 1e-6) & (parts["lost"] <= 1 + 1e-6)).all()


def test_bad_use_is_refused():
    base = tiny_model("llama", "gqa", layers=2)
    ids = torch.randint(0, 97, (1, S))
    with pytest.raises(ValueError, match="not retrofitted"):
        online_targets(base, ids)
    plain = kvpop.retrofit(copy.deepcopy(base), Budget(2, 6, 8), scorer=None, policy="streaming")
    with pytest.raises(ValueError, match="kvpop policy"):
        online_targets(plain, ids)
    _, model = retrofitted()
    with pytest.raises(ValueError, match="features"):
        scorer_only_step(model, ids, features="sparse")
    kvpop.set_policy(model, "kvpop", model.kvpop_runtime.policy.budget, anchor_share=1.0)
    with pytest.raises(ValueError, match="anchor slots"):
        scorer_only_step(model, ids)
    kvpop.set_policy(model, "kvpop", model.kvpop_runtime.policy.budget, anchor_share=0.0)
    with pytest.raises(ValueError, match="keep may name"):
        teacher_pass(model, ids, [6], keep=("logits",))


def test_query_power_reaches_the_online_targets():
    """``query_power`` (METHOD §2) reaches the targets a scorer-only step trains on and those the precompute stage
    stores: the brute force's power mean."""
    from pipelines.precompute import compute_rows
    from pipelines.store import target_column

    base, model = retrofitted(scorer="mlp")
    ids = torch.randint(0, 97, (2, S))
    online = online_targets(model, ids, query_power=8.0, keep=("queries", "keys"))
    stored = compute_rows(base, ids.numpy(), [6], top_k=4, query_power=8.0)[target_column(6)]  # the precompute's
    torch.testing.assert_close(online["targets"], torch.from_numpy(stored).permute(1, 0, 2, 3), atol=1e-5, rtol=0)
    for layer in range(2):
        brute = future_attention_targets_dense(online["queries"][layer], online["keys"][layer], 6, query_power=8.0)
        finite = torch.isfinite(brute)
        torch.testing.assert_close(online["targets"][layer][finite], brute[finite], atol=1e-5, rtol=0)
    step = scorer_only_step(model, ids, query_power=8.0)
    torch.testing.assert_close(step["targets"], online["targets"], atol=0, rtol=0)
    assert not torch.equal(scorer_only_step(model, ids)["targets"], online["targets"])
