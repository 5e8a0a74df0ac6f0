"""The block structure derived from the retention tensors never hides a visible pair and marks full blocks right.

(Eager FlexAttention on CPU ignores the block structure, so it is checked here directly; the GPU benchmark
compares the compiled kernel with a dense reference.)
"""
import pytest
import torch

from kvpop import Budget
from kvpop.attention import BLOCK, retention_block_mask
from kvpop.retention import eviction_positions, retained


@pytest.mark.parametrize("size,budget", [(300, Budget(4, 20, 30)), (520, Budget(0, 130, 10)), (256, Budget(2, 1, 0)),
                                         (390, Budget(140, 8, 5)), (130, Budget(1, 200, 5))])
def test_block_structure_covers_the_mask(size, budget):
    torch.manual_seed(size)
    bsz, hkv, group = 2, 2, 2
    pos = torch.arange(size)
    pads = torch.tensor([0, 37])
    positions = pos[None, :] - pads[:, None]  # row 1 is left-padded
    valid = positions >= 0
    prio = torch.randint(0, 5, (bsz, hkv, size)).float()
    evict = eviction_positions(prio, budget, positions=positions[:, None, :])
    bm = retention_block_mask(positions, positions[:, None].expand(bsz, hkv, size).contiguous(), evict,
                              valid[:, None].expand(bsz, hkv, size).contiguous(), budget, hkv * group)
    dense = valid[:, None, None, :] & retained(positions[:, None, :, None], positions[:, None, None, :],
                                               evict[:, :, None, :], budget)  # [B, Hkv, S, S]
    nq = nk = (size + BLOCK - 1) // BLOCK
    listed = torch.zeros(bsz, hkv * group, nq, nk, dtype=torch.bool)
    full = torch.zeros_like(listed)
    for b in range(bsz):
        for h in range(hkv * group):
            for i in range(nq):
                n = int(bm.kv_num_blocks[b, h, i])
                listed[b, h, i, bm.kv_indices[b, h, i, :n].long()] = True
                nf = int(bm.full_kv_num_blocks[b, h, i])
                full[b, h, i, bm.full_kv_indices[b, h, i, :nf].long()] = True
    assert not (listed & full).any()
    for b in range(bsz):
        for h in range(hkv * group):
            mask = dense[b, h // group]
            for i in range(nq):
                for j in range(nk):
                    tile = mask[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
                    if tile.any():
                        assert listed[b, h, i, j] or full[b, h, i, j], (b, h, i, j)
                    if full[b, h, i, j]:
                        assert tile.all(), (b, h, i, j)
    assert (listed | full).sum() < nq * nk * bsz * hkv * group or size <= BLOCK  # something was skipped


@pytest.mark.parametrize("backend", ["flex", "chunked"])
def test_backends_match_a_dense_reference(backend):
    from kvpop.attention import retention_attention

    torch.manual_seed(0)
    bsz, hq, hkv, size, dim = 2, 4, 2, 70, 16
    budget = Budget(2, 5, 7)
    positions = torch.arange(size)[None, :] - torch.tensor([0, 9])[:, None]
    valid = positions >= 0
    evict = eviction_positions(torch.randn(bsz, hkv, size), budget, positions=positions[:, None, :])
    q, k, v = torch.randn(bsz, hq, size, dim), torch.randn(bsz, hkv, size, dim), torch.randn(bsz, hkv, size, dim)
    out = retention_attention(q, k, v, q_pos=positions, kv_pos=positions[:, None], kv_evict=evict,
                              kv_valid=valid[:, None], budget=budget, scale=0.25, backend=backend)
    mask = valid[:, None, None, :] & retained(positions[:, None, :, None], positions[:, None, None, :],
                                              evict[:, :, None, :], budget)
    mask = mask.repeat_interleave(2, dim=1)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(2, dim=1)) * 0.25
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1).nan_to_num()
    ref = torch.einsum("bhqk,bhkd->bhqd", probs, v.repeat_interleave(2, dim=1)).transpose(1, 2)
    assert out.shape == (bsz, size, hq, dim)
    assert (out - ref).abs().max() < 1e-5
    assert out[1, :9].abs().max() == 0  # padding queries see nothing


def test_contiguous_flex_path_matches_chunked():
    """Unpadded whole sequences take the one-gather mask_mod; it must agree with the general mask."""
    from kvpop.attention import retention_attention

    torch.manual_seed(1)
    bsz, hq, hkv, size, dim = 2, 4, 2, 90, 16
    budget = Budget(3, 6, 9)
    positions = torch.arange(size).expand(bsz, size)
    evict = eviction_positions(torch.randn(bsz, hkv, size), budget)
    q, k, v = torch.randn(bsz, hq, size, dim), torch.randn(bsz, hkv, size, dim), torch.randn(bsz, hkv, size, dim)
    kw = dict(q_pos=positions, kv_pos=positions[:, None], kv_evict=evict,
              kv_valid=torch.ones(bsz, 1, size, dtype=torch.bool), budget=budget, scale=0.25)
    flex_out = retention_attention(q, k, v, backend="flex", **kw)
    chunked = retention_attention(q, k, v, backend="chunked", **kw)
    assert (flex_out - chunked).abs().max() < 1e-5
