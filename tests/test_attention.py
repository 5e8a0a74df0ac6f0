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


COMPACT_CASES = [  # (batch, query heads, KV heads, S, budget): GQA / MHA / MQA, S off and on the block grid
    (2, 4, 2, 300, Budget(4, 20, 30)),
    (1, 4, 4, 256, Budget(0, 1, 0)),  # no sinks, no top-k
    (2, 6, 1, 500, Budget(3, 600, 5)),  # window >= S
    (2, 4, 2, 100, Budget(3, 10, 5)),  # one query block
    (1, 2, 2, 700, Budget(2, 50, 100)),
    (1, 4, 2, 400, Budget(10, 130, 500)),  # B >= S
    (2, 4, 2, 640, Budget(0, 130, 10)),
]


def _compact_inputs(bsz, hq, hkv, size, budget, seed, dim=8, ties=False):
    torch.manual_seed(seed)
    prio = torch.randint(0, 3, (bsz, hkv, size)).float() if ties else torch.randn(bsz, hkv, size)
    evict = eviction_positions(prio, budget)
    q, k, v = (torch.randn(bsz, h, size, dim, requires_grad=True) for h in (hq, hkv, hkv))
    positions = torch.arange(size).expand(bsz, size)
    kw = dict(q_pos=positions, kv_pos=positions[:, None], kv_evict=evict,
              kv_valid=torch.ones(bsz, 1, size, dtype=torch.bool), budget=budget, scale=0.3)
    return q, k, v, evict, kw


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("bsz,hq,hkv,size,budget", COMPACT_CASES)
def test_compact_layout_gathers_exactly_what_a_block_sees(bsz, hq, hkv, size, budget, ties):
    """Each query block gathers every token one of its queries sees, ascending, within the static L slots (the
    union bound B + 127 holds, ties in priority included), and the per-slot query rows reproduce the mask."""
    from kvpop.attention import compact_layout, compact_length

    _, _, _, evict, _ = _compact_inputs(bsz, hq, hkv, size, budget, seed=size, ties=ties)
    layout = compact_layout(evict, budget)
    blocks = (size + BLOCK - 1) // BLOCK
    length = compact_length(size, budget)
    assert layout.index.shape == layout.rows.shape == (bsz * blocks, hkv, length) and length % BLOCK == 0
    assert length <= blocks * BLOCK
    query = torch.arange(blocks * BLOCK)
    token = torch.arange(size)
    for b in range(bsz):
        for g in range(hkv):
            dense = retained(query[:, None], token[None, :], evict[b, g][None, :], budget)  # [blocks·128, S]
            for i in range(blocks):
                rows = layout.rows[b * blocks + i, g]
                filled = rows != 0
                gathered = layout.index[b * blocks + i, g][filled] - (b * hkv + g) * size
                tile = dense[i * BLOCK:(i + 1) * BLOCK]
                assert torch.equal(gathered, tile.any(0).nonzero().flatten())  # exactly the union, ascending
                span = rows[filled]
                row = torch.arange(BLOCK)[:, None]
                seen = (row >= (span >> 8)) & (row < (span & 255))
                assert torch.equal(seen, tile[:, gathered])


@pytest.mark.parametrize("bsz,hq,hkv,size,budget", COMPACT_CASES)
def test_compact_path_matches_chunked_with_gradients(bsz, hq, hkv, size, budget):
    from kvpop.attention import retention_attention

    q, k, v, _, kw = _compact_inputs(bsz, hq, hkv, size, budget, seed=size + 1)
    upstream = torch.randn(bsz, size, hq, q.shape[-1])
    results = []
    for backend in ("compact", "chunked"):
        out = retention_attention(q, k, v, backend=backend, **kw)
        results.append((out, *torch.autograd.grad((out * upstream).sum(), (q, k, v))))
    assert results[0][0].shape == (bsz, size, hq, q.shape[-1])
    for name, fast, ref in zip(("out", "dq", "dk", "dv"), *results):
        assert (fast - ref).abs().max() < 1e-5, name


@pytest.mark.parametrize("bsz,hq,hkv,size,budget", [c for c in COMPACT_CASES if c[3] <= 400])
def test_compact_flex_forward_matches_chunked(bsz, hq, hkv, size, budget):
    """The mask_mod the CUDA kernel uses, through eager FlexAttention (forward only on CPU)."""
    from kvpop.attention import compact_retention_attention, retention_attention

    q, k, v, evict, kw = _compact_inputs(bsz, hq, hkv, size, budget, seed=size + 2, dim=16)
    with torch.no_grad():
        out = compact_retention_attention(q, k, v, evict, budget, scale=kw["scale"], kernel="flex")
        ref = retention_attention(q, k, v, backend="chunked", **kw)
    assert (out - ref).abs().max() < 1e-5


def test_compact_refuses_eviction_beyond_its_budget():
    """A dense policy passes 'never evicted' with a tiny budget: the compact slots would drop keys, so
    compact_layout gives None and the compact backend refuses."""
    from kvpop.attention import compact_layout, retention_attention

    size, budget = 512, Budget(0, 1, 0)
    q, k, v, _, kw = _compact_inputs(1, 2, 2, size, budget, seed=0)
    kw["kv_evict"] = torch.full((1, 1, size), 1 << 40)
    assert compact_layout(kw["kv_evict"].expand(1, 2, size), budget) is None
    with pytest.raises(ValueError, match="keep more tokens"):
        retention_attention(q, k, v, backend="compact", **kw)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled FlexAttention needs a GPU")
@pytest.mark.parametrize("size,budget", [(1000, Budget(4, 64, 200)), (2048, Budget(4, 128, 380))])
def test_compact_flex_on_cuda_matches_chunked_with_gradients(size, budget):
    """The kernel training runs on: compiled flex over the gathered slots (full blocks unmasked), fp32."""
    from kvpop.attention import retention_attention

    q, k, v, _, kw = _compact_inputs(2, 4, 2, size, budget, seed=7, dim=32)
    q, k, v = (x.detach().cuda().requires_grad_() for x in (q, k, v))
    kw = {key: (val.cuda() if torch.is_tensor(val) else val) for key, val in kw.items()}
    upstream = torch.randn(2, size, 4, 32, device="cuda")
    results = []
    for backend in ("compact", "chunked"):
        out = retention_attention(q, k, v, backend=backend, **kw)
        results.append((out, *torch.autograd.grad((out * upstream).sum(), (q, k, v))))
    for name, fast, ref in zip(("out", "dq", "dk", "dv"), *results):
        assert (fast - ref).abs().max() < 2e-3, name


@pytest.mark.parametrize("failures", [1, 2])
def test_a_flex_shape_that_fails_to_compile_falls_back_to_the_main_kernel_then_eagerly(monkeypatch, failures):
    """An inductor failure at one shape (an H100 failed to lower the short-query flex-decoding kernel) retries that
    shape with FORCE_USE_FLEX_ATTENTION, then, if that fails too, runs eager flex: the same output, one warning a
    step, and the shape remembers its route (no second compile attempt); other shapes still try the compiled one."""
    from torch._inductor.exc import InductorError
    from torch.nn.attention.flex_attention import flex_attention

    from kvpop import attention

    calls = []

    def compiled(query, key, value, kernel_options=None, **kwargs):  # stands in for torch.compile(flex_attention)
        forced = bool((kernel_options or {}).get("FORCE_USE_FLEX_ATTENTION"))
        calls.append((query.shape[-2], forced))
        if query.shape[-2] == 90 and (not forced or failures == 2):
            raise InductorError(RuntimeError("NoValidChoicesError: No choices to select"), None)
        return flex_attention(query, key, value, **kwargs)

    monkeypatch.setattr(attention, "_compiled_flex", lambda: compiled)
    monkeypatch.setattr(attention, "_FLEX_FALLBACK", {})
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 90, 16, generator=g) for _ in range(3))
    shape = (tuple(q.shape), tuple(k.shape))
    with pytest.warns(RuntimeWarning) as record:
        out = attention._compiled_flex_or_fallback(shape, q, k, v, kernel_options={"WRITE_DQ": True})
    messages = [str(w.message) for w in record if "FlexAttention failed" in str(w.message)]
    assert len(messages) == failures
    assert "running the main flex kernel" in messages[0]
    assert failures == 1 or "running eager flex_attention" in messages[1]
    assert torch.equal(out, flex_attention(q, k, v))
    assert calls == [(90, False), (90, True)]
    again = attention._compiled_flex_or_fallback(shape, q, k, v)
    assert torch.equal(again, out)
    assert calls[2:] == ([(90, True)] if failures == 1 else [])  # its route remembered: no failing compile again
    other = torch.randn(2, 4, 64, 16, generator=g)
    attention._compiled_flex_or_fallback(((2, 4, 64, 16), tuple(k.shape)), other, k, v)
    assert calls[-1] == (64, False)
