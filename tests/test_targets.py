"""Future-attention targets (METHOD §2) against an fp64 brute force."""
import pytest
import torch

from kvpop.targets import (causal_attention_with_lse, causal_lse, future_attention_targets,
                           future_attention_targets_dense)

SHAPES = [  # B, Hq, Hkv, S, D, window
    (2, 4, 2, 37, 16, 3),  # GQA
    (1, 3, 3, 20, 8, 1),  # MHA, window 1
    (1, 6, 1, 64, 16, 5),  # MQA
    (1, 2, 1, 1, 8, 1),  # S = 1: no token has a deciding query
    (2, 4, 2, 30, 16, 40),  # window >= S
    (1, 2, 2, 130, 32, 7),  # longer than one chunk of rows in a small budget
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("backend", ["flex", "chunked"])
@pytest.mark.parametrize("group_reduce", ["max", "mean", "sum"])
def test_targets_match_fp64_brute_force(shape, backend, group_reduce):
    b, hq, hkv, size, dim, window = shape
    torch.manual_seed(sum(shape))
    q, k = torch.randn(b, hq, size, dim) * 1.5, torch.randn(b, hkv, size, dim) * 1.5
    ref = future_attention_targets_dense(q, k, window, group_reduce=group_reduce)
    y = future_attention_targets(q, k, window, backend=backend, group_reduce=group_reduce)
    assert y.dtype == torch.float32 and y.shape == (b, hkv, size)
    finite = torch.isfinite(ref)
    assert torch.equal(finite, torch.isfinite(y))
    pos = torch.arange(size)
    assert torch.equal(finite.any((0, 1)), size - pos - window > 0)  # -inf exactly where no deciding query
    if finite.any():
        assert (y[finite] - ref[finite]).abs().max() <= 1e-5


def test_given_lse_is_used_and_causal_lse_is_exact():
    torch.manual_seed(0)
    q, k = torch.randn(1, 4, 50, 16), torch.randn(1, 2, 50, 16)
    lse = causal_lse(q, k)
    keys = k.repeat_interleave(2, dim=1).double()
    a = torch.einsum("bhqd,bhkd->bhqk", q.double(), keys) / 4.0
    a = a.masked_fill(torch.ones(50, 50, dtype=torch.bool).triu(1), float("-inf"))
    assert (lse.double() - a.logsumexp(-1)).abs().max() < 1e-5
    for backend in ["flex", "chunked"]:
        assert torch.allclose(causal_lse(q, k, backend=backend), lse, atol=1e-5)
    y = future_attention_targets(q, k, 4, lse=lse)
    shifted = future_attention_targets(q, k, 4, lse=lse + 1.0)  # an LSE one higher divides every P by e
    finite = torch.isfinite(y)
    assert torch.allclose(shifted[finite], y[finite] - 1.0, atol=1e-5)


def test_custom_scale():
    torch.manual_seed(0)
    q, k = torch.randn(1, 2, 24, 8), torch.randn(1, 1, 24, 8)
    ref = future_attention_targets_dense(q, k, 2, scale=0.3)
    y = future_attention_targets(q, k, 2, scale=0.3)
    finite = torch.isfinite(ref)
    assert (y[finite] - ref[finite]).abs().max() <= 1e-5


def test_rejects_bad_shapes():
    q = torch.randn(1, 4, 10, 8)
    with pytest.raises(ValueError, match="grouped"):
        future_attention_targets(q, torch.randn(1, 3, 10, 8), 1)
    with pytest.raises(ValueError, match="disagree"):
        future_attention_targets(q, torch.randn(1, 2, 11, 8), 1)
    with pytest.raises(ValueError, match="window"):
        future_attention_targets(q, torch.randn(1, 2, 10, 8), 0)
    with pytest.raises(ValueError, match="lse"):
        future_attention_targets(q, torch.randn(1, 2, 10, 8), 1, lse=torch.zeros(1, 4, 9))


@pytest.mark.parametrize("power", [1.0, 8.0])
def test_teacher_pass_on_a_real_decoder_matches_its_own_attention(power):
    """Targets from the teacher pass (the mean and a power mean over the deciding queries) equal the brute force on
    the model's own q, k; logits equal the plain forward."""
    from kvpop.targets import teacher_pass
    from tests.models import tiny_model

    model = tiny_model("qwen3", "gqa")
    ids = torch.randint(1, 97, (2, 40))
    captured = {}

    def capture(module, query, key, value, attention_mask, scaling=None, **kwargs):  # record q, k after RoPE/norms
        captured[module.layer_idx] = (query.clone(), key.clone(), scaling)
        return sdpa(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward as sdpa
    AttentionInterface.register("capture_for_test", capture)
    model.config._attn_implementation = "capture_for_test"
    with torch.no_grad():
        logits = model(ids).logits
    model.config._attn_implementation = "sdpa"
    out = teacher_pass(model, ids, windows=[3, 8], top_k=10, query_power=power)
    assert out["targets"][3].shape == (2, 2, 2, 40)  # layers, B, Hkv, S
    for window in (3, 8):
        for layer, (q, k, scale) in captured.items():
            ref = future_attention_targets_dense(q, k, window, scale=scale, query_power=power)
            got = out["targets"][window][layer]
            finite = torch.isfinite(ref)
            assert torch.equal(finite, torch.isfinite(got))
            assert (got[finite] - ref[finite]).abs().max() <= 1e-5
    top = logits.topk(10, dim=-1)
    assert torch.allclose(out["topk_values"], top.values, atol=1e-4)
    assert torch.equal(out["topk_indices"], top.indices)
    assert model.config._attn_implementation == "sdpa"  # restored


@pytest.mark.parametrize("backend", ["flex", "chunked"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)])
def test_causal_attention_with_lse_matches_a_dense_reference(backend, heads):
    """The teacher's forward (output and natural-log LSE) on both backends against an fp64 softmax over the causal
    S×S scores, MHA / GQA / MQA."""
    torch.manual_seed(0)
    hq, hkv = heads
    q, k, v = torch.randn(2, hq, 24, 16), torch.randn(2, hkv, 24, 16), torch.randn(2, hkv, 24, 16)
    out, lse = causal_attention_with_lse(q, k, v, scale=0.25, backend=backend)
    group = hq // hkv
    kk, vv = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = (q.double() @ kk.transpose(-1, -2)) * 0.25
    scores = scores.masked_fill(torch.ones(24, 24, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse.double(), scores.logsumexp(-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double(), scores.softmax(-1) @ vv, atol=1e-5, rtol=1e-5)


POWER_SHAPES = [  # B, Hq, Hkv, S, D, window
    (2, 4, 2, 37, 16, 3),  # GQA
    (1, 3, 3, 20, 8, 1),  # MHA, window 1
    (2, 4, 2, 30, 16, 40),  # window >= S: all -inf
    (1, 2, 2, 130, 32, 7),  # more than one chunk of rows
]


def _with_ties(shape):
    """Random q, k with repeated keys (tied scores) and repeated queries (tied rows of P)."""
    b, hq, hkv, size, dim, _ = shape
    torch.manual_seed(sum(shape))
    q, k = torch.randn(b, hq, size, dim) * 1.5, torch.randn(b, hkv, size, dim) * 1.5
    k[:, :, 4:9] = k[:, :, 3:4]
    q[:, :, 12:16] = q[:, :, 11:12]
    return q, k


@pytest.mark.parametrize("shape", POWER_SHAPES)
@pytest.mark.parametrize("backend", ["flex", "chunked"])
@pytest.mark.parametrize("power", [1, 2.0, 8.0])
@pytest.mark.parametrize("group_reduce", ["max", "sum"])
def test_query_power_matches_fp64_brute_force(shape, backend, power, group_reduce):
    """The power mean over the deciding queries (METHOD §2) on both backends against the fp64 brute force."""
    q, k = _with_ties(shape)
    window, size = shape[-1], shape[3]
    ref = future_attention_targets_dense(q, k, window, group_reduce=group_reduce, query_power=power)
    y = future_attention_targets(q, k, window, backend=backend, group_reduce=group_reduce, query_power=power)
    finite = torch.isfinite(ref)
    assert torch.equal(finite, torch.isfinite(y))
    assert torch.equal(finite.any((0, 1)), size - torch.arange(size) - window > 0)
    if finite.any():
        assert (y[finite] - ref[finite]).abs().max() <= 1e-5


@pytest.mark.parametrize("backend", ["flex", "chunked"])
def test_query_power_one_is_the_mean_bit_for_bit(backend):
    """β = 1 is METHOD's mean exactly: the same bits as the target without the option, and as the mean's formula."""
    q, k = _with_ties((1, 4, 2, 40, 16, 3))
    lse = causal_lse(q, k, backend="chunked")
    y = future_attention_targets(q, k, 3, lse=lse, backend=backend, query_power=1.0)
    assert torch.equal(y, future_attention_targets(q, k, 3, lse=lse, backend=backend))
    if backend == "chunked":  # the pre-option formula, spelled out: log Σ exp(a - LSE) - log N, max over the group
        pos = torch.arange(40)
        scores = torch.einsum("bhtd,bhqd->bhtq", k.repeat_interleave(2, 1), q) * 0.25 - lse[:, :, None, :]
        log_mass = scores.masked_fill(pos[None, :] < pos[:, None] + 3, float("-inf")).logsumexp(-1)
        old = (log_mass - torch.log((40 - pos - 3).clamp(min=1).float())).view(1, 2, 2, 40).amax(2)
        assert torch.equal(y, old)


def test_large_query_power_approaches_the_max_over_deciding_queries():
    """``max_d P · N^(-1/β) <= m_β <= max_d P``: at β = 64 the target is within ``log N / 64`` of ``log max_d P``."""
    b, hq, hkv, size, dim, window = 1, 2, 1, 20, 8, 2
    torch.manual_seed(1)
    q, k = torch.randn(b, hq, size, dim) * 2, torch.randn(b, hkv, size, dim) * 2
    a = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double().repeat_interleave(2, 1)) / dim ** 0.5
    pos = torch.arange(size)
    prob = a.masked_fill(pos[None, :] > pos[:, None], float("-inf")).softmax(-1)
    decides = pos[:, None] >= pos[None, :] + window
    log_max = (prob * decides).amax(-2).amax(1).log()  # [b, t]: max over the group's heads and deciding queries
    y = future_attention_targets(q, k, window, backend="chunked", query_power=64.0)[:, 0].double()
    count = (size - pos - window).double()
    finite = count > 0
    gap = log_max[:, finite] - y[:, finite]
    assert (gap >= -1e-5).all() and (gap <= count[finite].log() / 64 + 1e-5).all()
    assert (gap <= 0.05).all()  # log 18 / 64 = 0.045: the max over the deciding queries, to that tolerance
    mean = future_attention_targets(q, k, window, backend="chunked")[:, 0].double()
    assert (log_max[:, finite] - mean[:, finite]).max() > 1.0  # where the mean is far from it


@pytest.mark.parametrize("power", [0.5, 0, -1, float("nan"), float("inf"), True, "2"])
def test_bad_query_power_is_refused(power):
    q, k = torch.randn(1, 2, 10, 8), torch.randn(1, 1, 10, 8)
    for fn in (future_attention_targets, future_attention_targets_dense):
        with pytest.raises(ValueError, match="query_power must be a finite number >= 1"):
            fn(q, k, 2, query_power=power)
