"""Bounded prefill (METHOD §5): a prompt goes through the fixed cache in chunks, each compressed into the B slots.

Static policies: any chunk partition gives the one-pass mask's logits, and the cache's key/value memory peaks at
B slots per layer plus one layer's B + C candidates. Dynamic policies (TOVA, H2O): the chunk rule of kvpop.cache,
checked against a brute-force reference; equal to token-by-token decoding where the rule says it is.
"""
import random

import pytest
import torch

import kvpop
from kvpop import Budget
from kvpop.cache import CACHE_KWARG, KVpopLayer
from kvpop.policies import build_policy
from kvpop.retrofit import Runtime
from kvpop.scorers import build_scorer
from kvpop.scorers.base import step_through
from tests.models import tiny_model

BUDGET = Budget(3, 8, 10)
STATIC = ["kvpop:mlstm", "kvpop:mlp", "kvpop:mlstm_immediate", "streaming", "random", "oracle"]


def partition(size: int, seed: int) -> list[int]:
    """Random chunk sizes summing to ``size``: ones, small chunks and one past the end."""
    rng = random.Random(seed)
    sizes = []
    while sum(sizes) < size:
        sizes.append(rng.choice([1, 1, 2, 3, 5, 8, 13, 2 * size]))
    sizes[-1] -= sum(sizes) - size
    return sizes


def feed(model, cache, ids, sizes, mask=None):
    """Logits of feeding ``ids`` through ``cache`` in calls of ``sizes`` columns."""
    out, start = [], 0
    with torch.no_grad():
        for size in sizes:
            end = start + size
            out.append(model(input_ids=ids[:, start:end], attention_mask=None if mask is None else mask[:, :end],
                             use_cache=True, **{CACHE_KWARG: cache}).logits)
            start = end
    return torch.cat(out, dim=1)


def retrofitted(policy, budget=BUDGET, arch="llama", heads="gqa", dtype=torch.float32):
    model = tiny_model(arch, heads).to(dtype)
    name, _, scorer = policy.partition(":")
    kvpop.retrofit(model, budget, scorer=scorer or "mlp", policy=name)
    return model


def random_targets(model, batch, size, budget):
    rt = model.kvpop_runtime
    targets = torch.randn(rt.num_layers, batch, rt.num_kv_heads, size, generator=torch.Generator().manual_seed(1))
    targets[..., size - budget.window:] = float("-inf")
    return targets


# -- scorers: a chunk of calls at once equals stepping ---------------------------------------------------------------


@pytest.mark.parametrize("features", ["kv", "kv_norms", "head_recency"])
@pytest.mark.parametrize("name", ["mlp", "mlstm", "mlstm_immediate"])
def test_scorer_resume_equals_stepping(name, features):
    options = {"chunk_size": 16, "qk_dim": 16, "v_dim": 16} if name.startswith("mlstm") else {}
    options.update({"head_recency": True} if features == "head_recency" else {"features": features})
    scorer = build_scorer(name, 2, 8, 5, **options)
    if features == "head_recency":  # a decay and a growth, each of several priority units over the 40 calls
        with torch.no_grad():
            scorer.head_recency.copy_(torch.tensor([30.0, -20.0]))
    keys, values = torch.randn(3, 2, 40, 8), torch.randn(3, 2, 40, 8)
    valid = torch.ones(3, 40, dtype=torch.bool)
    valid[1, :7] = False  # left padding
    want, want_state = step_through(scorer, keys, values, scorer.init_state(3, "cpu"), valid)
    state, got, start = scorer.init_state(3, "cpu"), [], 0
    for size in [1, 8, 3, 21, 4, 3]:  # chunks shorter and longer than the window and the kernel's chunk size
        p, state = scorer.resume(keys[:, :, start:start + size], values[:, :, start:start + size], state,
                                 valid[:, start:start + size])
        got.append(p)
        start += size
    assert (torch.cat(got, -1) - want).abs().max() <= 1e-5
    assert torch.equal(state["pos"], want_state["pos"])
    for key in want_state:
        assert (state[key].float() - want_state[key].float()).abs().max() <= 1e-5, key


# -- static policies: chunked prefill is the one-pass mask -----------------------------------------------------------


@pytest.mark.parametrize("policy", STATIC)
@pytest.mark.parametrize("seed", [0, 1])
def test_chunked_prefill_equals_masked_forward(policy, seed):
    model = retrofitted(policy)
    ids = torch.randint(1, 97, (2, 44))
    sizes = partition(44, seed)
    with kvpop.oracle_priorities(model, random_targets(model, 2, 44, BUDGET)):
        with torch.no_grad():
            one_pass = model(ids, use_cache=False).logits
        chunked = feed(model, kvpop.KVpopCache(model), ids, sizes)
    assert (chunked - one_pass).abs().max() <= 1e-4, sizes


@pytest.mark.parametrize("budget", [Budget(0, 5, 7), Budget(2, 4, 0), Budget(1, 64, 3), Budget(2, 3, 1)],
                         ids=str)
@pytest.mark.parametrize("policy", ["kvpop:mlstm", "random"])
def test_chunked_prefill_edge_budgets(policy, budget):
    """No sinks, no long-range slots, a window longer than the sequence, one slot."""
    model = retrofitted(policy, budget)
    ids = torch.randint(1, 97, (2, 40))
    with torch.no_grad():
        one_pass = model(ids, use_cache=False).logits
    for seed in (2, 3):
        assert (feed(model, kvpop.KVpopCache(model), ids, partition(40, seed)) - one_pass).abs().max() <= 1e-4


@pytest.mark.parametrize("policy", ["kvpop:mlstm", "streaming"])
def test_chunked_prefill_with_left_padding_equals_masked_forward(policy):
    """Padding longer than the first chunks: a row's first real token may come several chunks in."""
    model = retrofitted(policy)
    ids = torch.randint(1, 97, (3, 36))
    mask = torch.ones(3, 36, dtype=torch.long)
    mask[0, :11], mask[2, :3] = 0, 0
    with torch.no_grad():
        one_pass = model(ids, attention_mask=mask, use_cache=False).logits
    chunked = feed(model, kvpop.KVpopCache(model), ids, [4, 4, 1, 9, 18], mask)
    real = mask.bool()
    assert (chunked - one_pass)[real].abs().max() <= 1e-4


def test_padding_after_a_rows_first_token_is_refused():
    model = retrofitted("streaming")
    ids = torch.randint(1, 97, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0  # right padding reaching into the second chunk
    with pytest.raises(ValueError, match="left padding"):
        feed(model, kvpop.KVpopCache(model), ids, [6, 6], mask)


# -- memory: B slots per layer plus one layer's B + C candidates, whatever the prompt ---------------------------------


@pytest.mark.parametrize("policy", ["kvpop:mlstm", "tova"])
def test_peak_kv_memory_is_slots_plus_one_chunk(policy):
    model = retrofitted(policy)
    rt = model.kvpop_runtime
    batch, chunk = 2, 8
    per_token = batch * rt.num_kv_heads * rt.head_dim * 2 * 4  # keys + values, float32, one layer
    bound = (rt.num_layers * BUDGET.total + BUDGET.total + chunk) * per_token
    for size in (40, 96):
        cache = kvpop.prefill(model, torch.randint(1, 97, (batch, size)), chunk=chunk)
        assert cache.peak_kv_bytes == bound, size
        assert cache.meter.held == cache.nbytes()["kv"] == rt.num_layers * BUDGET.total * per_token
    whole = kvpop.prefill(model, torch.randint(1, 97, (batch, 96)), chunk=96)  # one call: grows with the prompt
    assert whole.peak_kv_bytes == (rt.num_layers * BUDGET.total + BUDGET.total + 96) * per_token


def test_generate_prefills_in_chunks():
    model = retrofitted("kvpop:mlstm")
    rt = model.kvpop_runtime
    per_token = rt.num_kv_heads * rt.head_dim * 2 * 4
    cache = kvpop.KVpopCache(model)
    model.generate(input_ids=torch.randint(1, 97, (1, 50)), past_key_values=cache, max_new_tokens=3,
                   do_sample=False, prefill_chunk=8)
    assert cache.peak_kv_bytes == (rt.num_layers * BUDGET.total + BUDGET.total + 8) * per_token
    with pytest.raises(ValueError, match="prefill_chunk"):
        model.generate(input_ids=torch.randint(1, 97, (1, 50)), max_new_tokens=1, prefill_chunk=0)


@pytest.mark.parametrize("policy", ["kvpop:mlstm", "oracle"])
def test_generate_with_chunked_prefill_equals_token_by_token(policy):
    model = retrofitted(policy)
    prompts = torch.randint(1, 97, (2, 37))
    mask = torch.ones_like(prompts)
    mask[1, :9] = 0
    with kvpop.oracle_priorities(model, random_targets(model, 2, 60, BUDGET)):
        runs = [model.generate(input_ids=prompts, attention_mask=mask, max_new_tokens=12, do_sample=False,
                               prefill_chunk=chunk, output_logits=True, return_dict_in_generate=True)
                for chunk in (1, 5, 16)]
    for run in runs[1:]:
        assert torch.equal(run.sequences, runs[0].sequences)
        assert (torch.stack(run.logits) - torch.stack(runs[0].logits)).abs().max() <= 1e-4


# -- dynamic policies: the chunk rule --------------------------------------------------------------------------------


def chunk_rule_reference(policy, query, keys, values, sizes, scale):
    """The chunk rule of kvpop.cache, literally, per (row, KV head), with Python sets: outputs ``[B, S, Hq, D]`` and
    the final ``{position: score}`` per (row, KV head)."""
    s, w, k = policy.budget.sink, policy.budget.window, policy.budget.topk
    bsz, hq, size, dim = query.shape
    hkv = keys.shape[1]
    group = hq // hkv
    out = torch.zeros(bsz, size, hq, dim, dtype=query.dtype)
    caches = [[{} for _ in range(hkv)] for _ in range(bsz)]  # position -> score

    def best(scores, candidates):
        return set(sorted(candidates, key=lambda t: (scores[t], t))[-k:]) if k else set()

    for b in range(bsz):
        for g in range(hkv):
            cache, start = caches[b][g], 0
            for n in sizes:
                first, last = start, start + n - 1
                eligible = {t for t in cache if s <= t <= first - w}
                for t in eligible - best(cache, eligible):
                    del cache[t]
                for t in range(first, last + 1):
                    cache[t] = 0.0
                received = {t: [] for t in cache}  # per query: max over the group's heads
                for d in range(first, last + 1):
                    seen = sorted(t for t in cache if t <= d)
                    heads = []
                    for h in range(g * group, (g + 1) * group):
                        logits = torch.stack([query[b, h, d] @ keys[b, g, t] for t in seen]) * scale
                        probs = logits.softmax(0)
                        out[b, d, h] = sum(p * values[b, g, t] for p, t in zip(probs, seen))
                        heads.append(dict(zip(seen, probs.tolist())))
                    for t in cache:
                        received[t].append(max(p.get(t, 0.0) for p in heads))
                for t in cache:
                    if policy.name == "tova":
                        cache[t] = received[t][-1]
                    else:
                        cache[t] += sum(received[t])
                eligible = {t for t in cache if s <= t <= last - w}
                for t in eligible - best(cache, eligible):
                    del cache[t]
                start += n
    return out, caches


def bare_layer(policy, hq, hkv, dim):
    runtime = Runtime(policy, num_layers=1, num_heads=hq, num_kv_heads=hkv, head_dim=dim,
                      base_attn_implementation="sdpa")
    return KVpopLayer(runtime, 0, policy)


@pytest.mark.parametrize("name", ["tova", "h2o"])
@pytest.mark.parametrize("budget", [Budget(2, 3, 4), Budget(0, 2, 3), Budget(1, 3, 0)], ids=str)
def test_dynamic_chunks_follow_the_chunk_rule(name, budget):
    """Every call size, one token (a decoding step) included, against the literal rule; float64 so that no score
    tie is decided by rounding."""
    policy = build_policy(name, budget)
    bsz, hq, hkv, dim, size = 2, 4, 2, 8, 30
    g = torch.Generator().manual_seed(5)
    query, keys, values = (torch.randn(bsz, h, size, dim, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv))
    sizes = [1, 4, 1, 1, 9, 2, 1, 7, 4]
    layer, scale, outs, start = bare_layer(policy, hq, hkv, dim), dim ** -0.5, [], 0
    for n in sizes:
        sl = slice(start, start + n)
        layer.update(keys[:, :, sl], values[:, :, sl])
        outs.append(layer.attend(None, query[:, :, sl], keys[:, :, sl], values[:, :, sl], None, scale))
        start += n
    want, caches = chunk_rule_reference(policy, query, keys, values, sizes, scale)
    assert (torch.cat(outs, dim=1) - want).abs().max() <= 1e-10
    for b in range(bsz):
        for h in range(hkv):
            held = {p: v for p, v in zip(layer.slot_pos[b, h].tolist(), layer.slot_score[b, h].tolist()) if p >= 0}
            assert sorted(held) == sorted(caches[b][h])
            assert all(abs(held[t] - caches[b][h][t]) <= 1e-6 for t in held)  # scores are kept in float32


@pytest.mark.parametrize("policy", ["tova", "h2o"])
def test_dynamic_generate_with_chunked_prefill_equals_token_by_token_within_the_budget(policy):
    """Nothing is evicted inside a chunk while the prompt fits in B (21 tokens here): every chunking gives the
    token-by-token result, left-padded rows included."""
    model = retrofitted(policy, dtype=torch.float64)
    prompts = torch.randint(1, 97, (2, BUDGET.total))
    mask = torch.ones_like(prompts)
    mask[0, :6] = 0
    runs = [model.generate(input_ids=prompts, attention_mask=mask, max_new_tokens=8, do_sample=False,
                           prefill_chunk=chunk, output_logits=True, return_dict_in_generate=True)
            for chunk in (1, 5, BUDGET.total)]
    for run in runs[1:]:
        assert torch.equal(run.sequences, runs[0].sequences)
        assert (torch.stack(run.logits) - torch.stack(runs[0].logits)).abs().max() <= 1e-8


@pytest.mark.parametrize("policy", ["tova", "h2o"])
def test_dynamic_chunks_past_the_budget_differ_from_token_by_token(policy):
    """Documents where the rule departs from decoding: once tokens are evicted inside a chunk, its queries still
    see them (token-by-token decoding would not), so the prompt's last logits differ."""
    model = retrofitted(policy, dtype=torch.float64)
    prompt = torch.randint(1, 97, (1, 3 * BUDGET.total))
    logits = {chunk: model.generate(input_ids=prompt, max_new_tokens=1, do_sample=False, prefill_chunk=chunk,
                                    output_logits=True, return_dict_in_generate=True).logits[0]
              for chunk in (1, 16)}
    assert (logits[1] - logits[16]).abs().max() > 1e-6
