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


def test_teacher_pass_on_a_real_decoder_matches_its_own_attention():
    """Targets from the teacher pass equal the brute force on the model's own q, k; logits equal the plain forward."""
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
    out = teacher_pass(model, ids, windows=[3, 8], top_k=10)
    assert out["targets"][3].shape == (2, 2, 2, 40)  # layers, B, Hkv, S
    for window in (3, 8):
        for layer, (q, k, scale) in captured.items():
            ref = future_attention_targets_dense(q, k, window, scale=scale)
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
