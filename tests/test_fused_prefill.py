"""The fused bounded prefill (kvpop.cache): per chunk one attention over the B slots + the chunk, the scorer's
chunkwise form, the next B slots selected for every head at once, static shapes for torch.compile on CUDA.

Each chunk size, the fused path (FlexAttention over the candidates, taken on CUDA at the cache's chunk size; here on
CPU by forcing it, with eager FlexAttention) and the any-shape path (SDPA over query blocks) must give the one masked
forward's logits (METHOD §5) and leave in the slots exactly the tokens the mask retains at the last query.
"""
import pytest
import torch

import kvpop
from kvpop import Budget
from kvpop.attention import retention_attention
from kvpop.cache import CACHE_KWARG, KVpopLayer
from kvpop.decode import chunk_bounds
from kvpop.policies import build_policy
from kvpop.policies.base import LayerView
from kvpop.retention import anchored_eviction_positions, eviction_positions, retained
from kvpop.retrofit import Runtime
from tests.models import tiny_model

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

BUDGET = Budget(3, 8, 10)  # B = 21
SIZE = 44
ANCHORS = {"recency": 0.1, "anchor_share": 0.5, "anchor_recency": 0.0}
POLICIES = ["kvpop:mlstm", "kvpop:mlp", "kvpop:mlstm_immediate", "kvpop+prior:mlstm", "kvpop+anchors:mlstm",
            "streaming", "random", "oracle", "oracle+ties"]
# chunks shorter than the window and not dividing S, the window, B, longer than B and not dividing S, the whole prompt
CHUNKS = [3, 8, 21, 30, SIZE]
# The two paths share every step but the attention call, and eager FlexAttention on CPU costs ~1 s a test: the
# any-shape path takes every case, the fused one the cases that reach distinct bookkeeping (the mLSTM's chunkwise
# resume, two pools with anchor slots, ties decided by the tie rule; streaming for left padding).
FUSED_POLICIES = ["kvpop:mlstm", "kvpop+anchors:mlstm", "oracle+ties"]


def cases(any_shape, fused):
    """``(policy, path)`` pairs for ``@pytest.mark.parametrize(..., indirect=["path"])``."""
    return [(policy, "any-shape") for policy in any_shape] + [(policy, "fused") for policy in fused]


def retrofitted(policy, budget=BUDGET, seed=0):
    model = tiny_model("llama", "gqa", seed=seed)
    name, _, scorer = policy.partition(":")
    base, _, variant = name.partition("+")
    kvpop.retrofit(model, budget, scorer=scorer or "mlp", policy=base, **(ANCHORS if variant == "anchors" else {}))
    kvpop.set_window_attention_prior(model, variant == "prior")
    return model


def oracle_targets(model, batch, ties: bool):
    """Random targets; with ``ties`` three values only, so that most rankings are decided by the tie rule."""
    rt = model.kvpop_runtime
    g = torch.Generator().manual_seed(1)
    targets = (torch.randint(0, 3, (rt.num_layers, batch, rt.num_kv_heads, SIZE), generator=g).float() if ties
               else torch.randn(rt.num_layers, batch, rt.num_kv_heads, SIZE, generator=g))
    targets[..., SIZE - model.kvpop_runtime.policy.budget.window:] = float("-inf")
    return targets


def chunked_logits(model, ids, chunk, mask=None):
    """Logits of the prompt fed as :func:`kvpop.prefill` cuts it (the first chunk takes the remainder), with the
    cache's fused-path size set to ``chunk``; returns ``(logits, cache)``."""
    cache = kvpop.KVpopCache(model)
    cache.prefill_chunk = chunk
    bounds = chunk_bounds(0, ids.shape[1], chunk)
    out = []
    with torch.no_grad():
        for start, end in zip(bounds[:-1], bounds[1:]):
            out.append(model(input_ids=ids[:, start:end], use_cache=True,
                             attention_mask=None if mask is None else mask[:, :end], **{CACHE_KWARG: cache}).logits)
    return torch.cat(out, dim=1), cache


def one_pass(model, ids, mask=None):
    with kvpop.collect_priorities(model) as prios, torch.no_grad():
        logits = model(ids, attention_mask=mask, use_cache=False).logits
    return logits, prios


def assert_holds_retained_set(model, cache, prios):
    """Every (row, KV head)'s slots hold exactly what the mask retains at the last query (unpadded rows)."""
    policy = model.kvpop_runtime.policy
    positions = torch.arange(SIZE)
    for layer_idx, layer in enumerate(cache.layers):
        ranked = prios[layer_idx].float()
        anchor = policy.anchor_ranked(ranked - policy.recency * positions, positions) if policy.anchors else None
        evict = anchored_eviction_positions(ranked, anchor, policy.budget, policy.anchors)
        expect = retained(torch.tensor(SIZE - 1), positions, evict, policy.budget)
        for b in range(layer.slot_pos.shape[0]):
            for h in range(layer.slot_pos.shape[1]):
                held = sorted(p for p in layer.slot_pos[b, h].tolist() if p >= 0)
                assert held == expect[b, h].nonzero().flatten().tolist(), (layer_idx, b, h)


@pytest.fixture(params=["any-shape", "fused"])
def path(request, monkeypatch):
    """``fused``: the CUDA path forced on CPU (FlexAttention eager over the candidates, block structure included)."""
    if request.param == "fused":
        monkeypatch.setattr(KVpopLayer, "_fused", lambda self, query, chunk: chunk == self.prefill_chunk)
    return request.param


@pytest.mark.parametrize("policy,path", cases(POLICIES, FUSED_POLICIES), indirect=["path"])
def test_every_chunk_size_equals_the_masked_forward(policy, path):
    model = retrofitted(policy)
    ids = torch.randint(1, 97, (2, SIZE), generator=torch.Generator().manual_seed(2))
    with kvpop.oracle_priorities(model, oracle_targets(model, 2, ties=policy.endswith("ties"))):
        want, prios = one_pass(model, ids)
        for chunk in CHUNKS:
            got, cache = chunked_logits(model, ids, chunk)
            assert (got - want).abs().max() <= 1e-4, chunk
            assert_holds_retained_set(model, cache, prios)


@pytest.mark.parametrize("budget", [Budget(0, 5, 7), Budget(2, 4, 0), Budget(1, 64, 3), Budget(2, 3, 1),
                                    Budget(0, 1, 0)], ids=str)
@pytest.mark.parametrize("policy,path", cases(["kvpop:mlstm", "oracle+ties"], ["oracle+ties"]), indirect=["path"])
def test_edge_budgets(policy, budget, path):
    """No sinks, no long-range slots (k = 0), a window longer than the sequence (w >= S), one long-range slot, a
    budget of one token. The fused path at one chunk size (chunks shorter than the window: the test above)."""
    model = retrofitted(policy, budget)
    ids = torch.randint(1, 97, (2, SIZE), generator=torch.Generator().manual_seed(3))
    with kvpop.oracle_priorities(model, oracle_targets(model, 2, ties=True)):
        want, prios = one_pass(model, ids)
        for chunk in (3, 7, SIZE) if path == "any-shape" else (7,):
            got, cache = chunked_logits(model, ids, chunk)
            assert (got - want).abs().max() <= 1e-4, chunk
            assert_holds_retained_set(model, cache, prios)


@pytest.mark.parametrize("policy,path", cases(["kvpop:mlstm", "streaming"], ["streaming"]), indirect=["path"])
def test_left_padding(policy, path):
    """Padding longer than the first chunks (a row's first token several chunks in), through fixed-size chunks."""
    model = retrofitted(policy)
    ids = torch.randint(1, 97, (3, 36), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(3, 36, dtype=torch.long)
    mask[0, :17], mask[2, :3] = 0, 0
    with torch.no_grad():
        want = model(ids, attention_mask=mask, use_cache=False).logits
    for chunk in (4, 9):
        got, _ = chunked_logits(model, ids, chunk, mask)
        assert (got - want)[mask.bool()].abs().max() <= 1e-4, chunk


def assert_blocks_cover(q_pos, kv_pos, kv_evict, kv_valid, budget, blocks):
    """FlexAttention's block lists (partial counts, indices, full counts, indices) against the dense mask: every
    visible pair lies in a listed block, every block listed as full is visible throughout."""
    from kvpop.attention import BLOCK

    counts, indices, full_counts, full_indices = blocks
    group = counts.shape[1] // kv_pos.shape[1]
    dense = kv_valid[:, :, None, :] & retained(q_pos[:, None, :, None], kv_pos[:, :, None, :], kv_evict[:, :, None, :],
                                               budget)
    for b in range(counts.shape[0]):
        for h in range(counts.shape[1]):
            for i in range(counts.shape[2]):
                tiles = dense[b, h // group, i * BLOCK:(i + 1) * BLOCK].split(BLOCK, dim=-1)
                listed = set(indices[b, h, i, :counts[b, h, i]].tolist())
                full = set(full_indices[b, h, i, :full_counts[b, h, i]].tolist())
                assert not listed & full
                assert all(j in listed | full for j, tile in enumerate(tiles) if tile.any()), (b, h, i)
                assert all(tiles[j].all() for j in full), (b, h, i)


@pytest.mark.parametrize("policy", ["random", "oracle+ties"])
def test_one_layer_at_flex_block_scale(policy, path, monkeypatch):
    """One bare cache layer at sizes where FlexAttention's 128-token blocks are full, partial and empty (B = 208,
    chunks of 256 after a first one of 232), against one masked attention over the whole sequence."""
    budget, size, chunk, hq, hkv, dim = Budget(4, 64, 140), 1000, 256, 4, 2, 8
    g = torch.Generator().manual_seed(6)
    targets = torch.randint(0, 3, (1, 1, hkv, size), generator=g).float()  # three values: ties everywhere
    runtime = Runtime(build_policy(policy.partition("+")[0], budget), num_layers=1, num_heads=hq, num_kv_heads=hkv,
                      head_dim=dim, base_attn_implementation="sdpa", oracle=targets)
    layer = KVpopLayer(runtime, 0, runtime.policy)
    layer.prefill_chunk = chunk
    query, keys, values = (torch.randn(1, h, size, dim, generator=g) for h in (hq, hkv, hkv))
    import kvpop.cache

    attention, structures = kvpop.cache.candidate_attention, []

    def recorded(*args, **kwargs):
        structures.append(kwargs)
        return attention(*args, **kwargs)

    monkeypatch.setattr(kvpop.cache, "candidate_attention", recorded)
    outs, bounds = [], chunk_bounds(0, size, chunk)
    for start, end in zip(bounds[:-1], bounds[1:]):
        sl = slice(start, end)
        layer.update(keys[:, :, sl], values[:, :, sl])
        outs.append(layer.attend(None, query[:, :, sl], keys[:, :, sl], values[:, :, sl], None, dim ** -0.5))
    positions = torch.arange(size)
    raw = runtime.policy.priorities_at(LayerView(0, None, runtime), positions[None, None], hkv)
    evict = eviction_positions(runtime.policy.ranked(raw, positions), budget)
    want = retention_attention(query, keys, values, q_pos=positions[None], kv_pos=positions[None, None], kv_evict=evict,
                               kv_valid=torch.ones(1, 1, size, dtype=torch.bool), budget=budget, scale=dim ** -0.5,
                               backend="chunked")
    assert (torch.cat(outs, dim=1) - want).abs().max() <= 1e-5
    expect = retained(torch.tensor(size - 1), positions, evict, budget)
    for h in range(hkv):
        assert sorted(p for p in layer.slot_pos[0, h].tolist() if p >= 0) == expect[0, h].nonzero().flatten().tolist()
    fused = [k for k in structures if k["block_indices"] is not None]
    assert len(fused) == (3 if path == "fused" else 0)  # the first chunk (232 columns) takes the any-shape path
    for k in fused:
        assert_blocks_cover(k["q_pos"], k["kv_pos"], k["kv_evict"], k["kv_valid"], budget, k["block_indices"])


def test_padding_is_checked_once_per_forward_and_still_refused(monkeypatch):
    """The left-padding check waits for the device, so one layer of a forward makes it for all; a bad mask is still
    refused, also on a cache that another forward checked with the same mask object."""
    calls = []
    check = KVpopLayer._check_left_padding

    def counted(self, valid_cols, valid):
        calls.append(self.layer_idx)
        return check(self, valid_cols, valid)

    monkeypatch.setattr(KVpopLayer, "_check_left_padding", counted)
    model = retrofitted("streaming")
    ids = torch.randint(1, 97, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    chunked_logits(model, ids, 6, mask)
    assert calls == [0, 1, 0, 1] and model.kvpop_runtime.checked_padding[0] is not None
    mask[1, 8:] = 0  # right padding reaching into the second chunk
    with pytest.raises(ValueError, match="left padding"):
        chunked_logits(model, ids, 6, mask)


def test_compile_prefill_falls_back_to_eager_on_cpu(monkeypatch):
    """On CPU ``compile_prefill`` compiles nothing (torch.compile is never called) and gives the eager result."""
    model = retrofitted("kvpop:mlstm")
    ids = torch.randint(1, 97, (2, SIZE))
    eager, _ = chunked_logits(model, ids, 8)

    def refuse(*args, **kwargs):
        raise AssertionError("torch.compile called on CPU")

    monkeypatch.setattr(torch, "compile", refuse)
    model.kvpop_runtime.compile_prefill = True
    compiled, _ = chunked_logits(model, ids, 8)
    assert torch.equal(compiled, eager)
    cache = kvpop.prefill(model, ids, chunk=8)
    assert cache.prefill_chunk == 8


def test_a_shape_that_fails_to_compile_runs_eagerly_with_a_warning(monkeypatch):
    """``Runtime.compile_prefill``'s bookkeeping: where torch.compile fails at some shapes (an inductor error), those
    shapes run the function eagerly from then on (one warning each); other shapes still try the compiled one."""
    from torch._inductor.exc import InductorError

    from kvpop.cache import _compiled

    attempts = []

    def failing_compile(fn, **kwargs):
        def run(*args, **kw):
            attempts.append(tuple(args[0].shape))
            raise InductorError(TypeError("list indices must be integers or slices, not NoneType"), None)
        return run

    monkeypatch.setattr(torch, "compile", failing_compile)

    def double(x, *, plus):
        return x * 2 + plus

    run = _compiled(double)
    with pytest.warns(RuntimeWarning, match="torch.compile failed for double .*InductorError.*running it eagerly"):
        assert torch.equal(run(torch.ones(3), plus=1), torch.full((3,), 3.0))
    assert torch.equal(run(torch.ones(3), plus=0), torch.full((3,), 2.0))  # that shape: eager, not retried
    with pytest.warns(RuntimeWarning):
        run(torch.ones(2, 2), plus=0)
    assert attempts == [(3,), (2, 2)]


def _cache_state(cache):
    """Every tensor a layer holds (None where a policy keeps none), the scorer's state by name."""
    return [(layer.keys, layer.values, layer.slot_pos, layer.slot_prio, layer.slot_anchor, layer.slot_score,
             layer.seen, *(t for _, t in sorted((layer.scorer_state or {}).items()))) for layer in cache.layers]


def test_graphed_prefill_runs_as_the_eager_one_where_it_cannot_replay():
    """``prefill(graphed=True)`` replays chunks only on CUDA, without a padding mask, with a static policy's fixed
    slots (:func:`kvpop.decode.graphable`); elsewhere (here: CPU; a dynamic policy) it is the eager prefill."""
    from kvpop.decode import graphable

    from kvpop.decode import ChunkGraph

    for policy in ("kvpop:mlstm", "tova"):
        model = retrofitted(policy)
        ids = torch.randint(1, 97, (2, SIZE))
        eager = kvpop.prefill(model, ids, chunk=8)
        kept = ChunkGraph()
        for graphed in (kvpop.prefill(model, ids, chunk=8, graphed=True),
                        kvpop.prefill(model, ids, chunk=8, graphed=kept)):
            assert not graphable(graphed, ids, None)
            assert graphed.get_seq_length() == eager.get_seq_length() == SIZE
            for want, got in zip(_cache_state(eager), _cache_state(graphed)):
                assert all(w is g is None or torch.equal(w, g) for w, g in zip(want, got))
        assert kept.decoder is None  # nothing captured, nothing kept


def test_copying_a_cache_state_makes_it_that_cache():
    """What a kept chunk graph replays on (:class:`kvpop.decode.ChunkGraph`): a cache given another prompt's state
    in place holds every tensor of it, its columns, and continues as it does."""
    from kvpop.decode import cache_tensors, copy_cache_state

    model = retrofitted("kvpop+anchors:mlstm")
    first, second = (torch.randint(1, 97, (2, SIZE), generator=torch.Generator().manual_seed(s)) for s in (1, 2))
    target = kvpop.prefill(model, first, chunk=8)
    source = kvpop.prefill(model, second[:, :SIZE - 6], chunk=8)
    buffers = [t.data_ptr() for t in cache_tensors(target)]
    copy_cache_state(source, target)
    assert [t.data_ptr() for t in cache_tensors(target)] == buffers  # in place: a graph's memory stays valid
    assert all(torch.equal(a, b) for a, b in zip(cache_tensors(source), cache_tensors(target), strict=True))
    assert target.get_seq_length() == source.get_seq_length() == SIZE - 6
    with torch.no_grad():
        logits = [model(input_ids=second[:, SIZE - 6:], use_cache=True, **{CACHE_KWARG: cache}).logits
                  for cache in (source, target)]
    assert torch.equal(logits[0], logits[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("policy", ["kvpop:mlstm", "kvpop+anchors:mlstm", "oracle+ties"])
def test_graphed_prefill_on_cuda_equals_the_fused_prefill(policy):
    """The full chunks after the first replayed as one captured CUDA graph (compiled bookkeeping inside) leave the
    cache of launching every chunk from Python: the same slots, priorities, scorer state and next-token logits."""
    from kvpop.cache import CACHE_KWARG as KWARG
    from kvpop.decode import graphable

    model = retrofitted(policy).cuda()
    model.kvpop_runtime.compile_prefill = True
    ids = torch.randint(1, 97, (2, SIZE), device="cuda")
    targets = oracle_targets(model, 2, ties=policy.endswith("ties")).cuda()
    with kvpop.oracle_priorities(model, targets):
        eager = kvpop.prefill(model, ids, chunk=8)
        graphed = kvpop.prefill(model, ids, chunk=8, graphed=True)
        assert graphable(graphed, ids, None) and graphed.get_seq_length() == eager.get_seq_length() == SIZE
        for want, got in zip(_cache_state(eager), _cache_state(graphed)):
            for w, g in zip(want, got):
                # evicted slots hold -inf priorities in both: equal, which a difference would call NaN
                assert (w is g is None) or torch.testing.assert_close(g.float(), w.float(), rtol=0, atol=1e-5) is None
        token, position = ids[:, :1], torch.full((2, 1), SIZE, device="cuda")
        with torch.no_grad():
            logits = [model(input_ids=token, position_ids=position, use_cache=True, **{KWARG: cache}).logits
                      for cache in (eager, graphed)]
    assert (logits[0] - logits[1]).abs().max() <= 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("policy", ["kvpop:mlstm", "oracle+ties"])
def test_on_cuda_a_kept_chunk_graph_replays_later_prompts_as_their_own_prefill(policy):
    """:class:`kvpop.decode.ChunkGraph`: the second prompt's prefill replays the first one's graph (no capture) and
    leaves its cache as its own graphed prefill does; the first prompt's cache is left as it was; a new oracle
    block (other targets) recaptures."""
    from kvpop.decode import ChunkGraph, cache_tensors

    model = retrofitted(policy).cuda()
    model.kvpop_runtime.compile_prefill = True
    prompts = [torch.randint(1, 97, (2, SIZE), device="cuda", generator=torch.Generator("cuda").manual_seed(s))
               for s in (1, 2)]
    targets = oracle_targets(model, 2, ties=policy.endswith("ties")).cuda()
    kept = ChunkGraph()
    with kvpop.oracle_priorities(model, targets):
        first = kvpop.prefill(model, prompts[0], chunk=8, graphed=kept)
        before = [t.clone() for t in cache_tensors(first)]
        graph = kept.decoder.graph
        second = kvpop.prefill(model, prompts[1], chunk=8, graphed=kept)
        assert kept.decoder.graph is graph  # replayed, not captured again
        alone = kvpop.prefill(model, prompts[1], chunk=8, graphed=True)
    assert all(torch.equal(a, b) for a, b in zip(before, cache_tensors(first), strict=True))
    for want, got in zip(cache_tensors(alone), cache_tensors(second), strict=True):
        torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=1e-5)
    assert second.get_seq_length() == SIZE
    with kvpop.oracle_priorities(model, targets.clone()):
        kvpop.prefill(model, prompts[1], chunk=8, graphed=kept)
    assert kept.decoder.graph is not graph  # other targets' tensor: captured again


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused, compiled prefill runs on CUDA")
@pytest.mark.parametrize("policy", ["kvpop:mlstm", "kvpop+anchors:mlstm", "oracle+ties"])
def test_fused_compiled_prefill_on_cuda_equals_the_masked_forward(policy):
    """fp32 on CUDA: FlexAttention over the candidates with the bookkeeping compiled, chunk sizes 8 (and the
    remainder, any-shape) and 16, against the one-pass mask; the fused chunks never wait on the host."""
    model = retrofitted(policy).cuda()
    model.kvpop_runtime.compile_prefill = True
    ids = torch.randint(1, 97, (2, SIZE), device="cuda")
    targets = oracle_targets(model, 2, ties=policy.endswith("ties")).cuda()
    chunk_step = KVpopLayer._chunk

    def no_sync(self, *args):
        if not self._fused(args[1], args[1].shape[2]):
            return chunk_step(self, *args)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return chunk_step(self, *args)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    with kvpop.oracle_priorities(model, targets):
        want, prios = one_pass(model, ids)
        for chunk in (8, 16):
            chunked_logits(model, ids, chunk)  # compiles
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(KVpopLayer, "_chunk", no_sync)
                got, cache = chunked_logits(model, ids, chunk)
            assert (got - want).abs().max() <= 1e-4, chunk
            assert_holds_retained_set(model, cache, {k: v.cpu() for k, v in prios.items()})
