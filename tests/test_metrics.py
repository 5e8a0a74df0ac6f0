"""kvpop.metrics against direct per-position references."""
import math

import pytest
import torch

from kvpop.metrics import compare_logits, first_divergence, mean_over_sequences, merge, per_sequence, summarize


def reference(policy, dense, ids, start):
    """Plain loops over rows and positions, fp64."""
    agree = kl = acc = acc_dense = 0.0
    n = labelled = 0
    batch, size, _ = policy.shape
    for b in range(batch):
        for d in range(start, size):
            p = torch.softmax(dense[b, d].double(), -1)
            q = torch.softmax(policy[b, d].double(), -1)
            kl += float(sum(p[v] * (math.log(p[v]) - math.log(q[v])) for v in range(p.shape[0])))
            agree += float(policy[b, d].argmax() == dense[b, d].argmax())
            n += 1
            if d + 1 < size:
                acc += float(policy[b, d].argmax() == ids[b, d + 1])
                acc_dense += float(dense[b, d].argmax() == ids[b, d + 1])
                labelled += 1
    return {"top1_agreement": agree / n, "kl": kl / n, "token_acc": acc / labelled,
            "token_acc_dense": acc_dense / labelled, "positions": n, "labelled": labelled}


def random_case(batch=2, size=13, vocab=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(batch, size, vocab, generator=g) * 2
    policy = dense + torch.randn(batch, size, vocab, generator=g)
    ids = torch.randint(0, vocab, (batch, size), generator=g)
    hit = torch.rand(batch, size - 1, generator=g) < 0.5  # some right predictions: accuracies are not trivially 0
    ids[:, 1:] = torch.where(hit, dense[:, :-1].argmax(-1), ids[:, 1:])
    return policy, dense, ids


@pytest.mark.parametrize("start", [0, 4, 11])
@pytest.mark.parametrize("chunk", [3, 256])
def test_matches_reference(start, chunk):
    policy, dense, ids = random_case()
    got = summarize(compare_logits(policy, dense, ids, start=start, chunk=chunk))
    ref = reference(policy, dense, ids, start)
    for key in ("top1_agreement", "token_acc", "token_acc_dense", "positions", "labelled"):
        assert got[key] == pytest.approx(ref[key], abs=1e-9), key
    assert got["kl"] == pytest.approx(ref["kl"], rel=1e-5, abs=1e-7)
    assert 0 < ref["token_acc_dense"] <= 1


def test_identical_logits_agree_fully():
    _, dense, ids = random_case()
    got = summarize(compare_logits(dense.clone(), dense, ids, start=2))
    assert got["top1_agreement"] == 1.0
    assert abs(got["kl"]) < 1e-6
    assert got["token_acc"] == got["token_acc_dense"]


def test_sequences_aggregate_token_weighted():
    policy, dense, ids = random_case(batch=3, size=9)
    whole = summarize(compare_logits(policy, dense, ids, start=3))
    parts = [compare_logits(policy[i:i + 1], dense[i:i + 1], ids[i:i + 1], start=3) for i in range(3)]
    merged = summarize(parts)
    for key in whole:
        assert merged[key] == pytest.approx(whole[key], rel=1e-6)
    assert merge(parts)["positions"] == 3 * 6
    per_seq = mean_over_sequences([summarize(p) for p in parts])
    assert per_seq["kl"] == pytest.approx(sum(summarize(p)["kl"] for p in parts) / 3)


def test_two_dim_input_valid_mask_and_no_positions():
    policy, dense, ids = random_case(batch=1, size=10)
    flat = summarize(compare_logits(policy[0], dense[0], ids[0], start=1))
    batched = summarize(compare_logits(policy, dense, ids, start=1))
    assert flat == pytest.approx(batched)
    valid = torch.ones(1, 10, dtype=torch.bool)
    valid[0, :4] = False  # like left padding: positions 0..3 do not count, nor do labels at them
    masked = summarize(compare_logits(policy, dense, ids, valid=valid))
    assert masked == pytest.approx(summarize(compare_logits(policy, dense, ids, start=4)))
    none = summarize(compare_logits(policy, dense, ids, start=10))
    assert none["positions"] == 0 and math.isnan(none["kl"]) and math.isnan(none["token_acc"])
    no_ids = summarize(compare_logits(policy, dense, None, start=0))
    assert no_ids["labelled"] == 0 and math.isnan(no_ids["token_acc"]) and no_ids["top1_agreement"] > 0


def test_shape_errors():
    policy, dense, ids = random_case()
    with pytest.raises(ValueError, match="differ"):
        compare_logits(policy[:, :-1], dense, ids)
    with pytest.raises(ValueError, match="input_ids"):
        compare_logits(policy, dense, ids[:, :-1])


@pytest.mark.parametrize("start", [0, 5, 11])
def test_per_sequence_equals_the_reference_row_by_row(start):
    policy, dense, ids = random_case(batch=3, size=13, seed=1)
    rows = per_sequence(policy, dense, ids, start=start, chunk=4)
    assert len(rows) == 3
    for b, row in enumerate(rows):
        ref = reference(policy[b:b + 1], dense[b:b + 1], ids[b:b + 1], start)
        for key in ("top1_agreement", "token_acc", "token_acc_dense", "positions", "labelled"):
            assert row[key] == pytest.approx(ref[key], abs=1e-9), (b, key)
        assert row["kl"] == pytest.approx(ref["kl"], rel=1e-5, abs=1e-7)
    assert len({row["kl"] for row in rows}) == 3  # really one value per row, not the batch mean repeated
    empty = per_sequence(policy, dense, ids, start=13)
    assert all(r["positions"] == 0 and math.isnan(r["top1_agreement"]) for r in empty)


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) == 3
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([7], [1]) == 0
    assert first_divergence([1, 2], [1, 2, 3]) == 2  # one stopped (EOS) where the other went on
    assert first_divergence(torch.tensor([4, 4, 9]), [4, 4, 8, 1]) == 2
    assert first_divergence([], [1]) == 0
