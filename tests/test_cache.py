"""The fixed-budget cache in generate(): constant memory, batching with left padding, sampling."""
import pytest
import torch

import kvpop
from kvpop import Budget
from tests.models import tiny_model

BUDGET = Budget(2, 6, 5)
ANCHORED = {"recency": 0.2, "anchor_share": 0.6, "anchor_recency": 0.0}  # 3 of 5 slots without the strong decay


def left_padded(prompts, pad=0):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    return ids, mask


@pytest.mark.parametrize("policy", ["kvpop", "streaming", "tova", "h2o"])
@pytest.mark.parametrize("prefill_chunk", [None, 4])
def test_batch_with_left_padding_equals_each_row_alone(policy, prefill_chunk):
    """Also with a prompt longer than the budget prefilled in chunks: chunks are counted back from the prompt's end,
    so a padded row is cut where it is cut alone (what makes TOVA / H2O's chunk rule batch-independent)."""
    model = tiny_model("qwen3", "gqa")
    kvpop.retrofit(model, BUDGET, scorer="mlstm", policy=policy)
    prompts = [torch.randint(1, 97, (n,)) for n in (5, 23, 14)]
    ids, mask = left_padded(prompts)
    batch = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=25, do_sample=False,
                           prefill_chunk=prefill_chunk)
    for i, prompt in enumerate(prompts):
        alone = model.generate(input_ids=prompt[None], max_new_tokens=25, do_sample=False, prefill_chunk=prefill_chunk)
        assert torch.equal(batch[i, ids.shape[1]:], alone[0, len(prompt):]), f"row {i} differs"


def test_sampling_runs_and_is_reproducible():
    model = tiny_model("llama", "gqa")
    kvpop.retrofit(model, BUDGET, scorer="mlstm")
    ids, mask = left_padded([torch.randint(1, 97, (n,)) for n in (7, 12)])
    torch.manual_seed(3)
    a = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=True, top_k=20)
    torch.manual_seed(3)
    b = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=True, top_k=20)
    assert torch.equal(a, b) and a.shape == (2, 32)


@pytest.mark.slow
@pytest.mark.parametrize("scorer", ["mlstm", "mlp"])
def test_memory_is_constant_and_exact(scorer):
    model = tiny_model("llama", "gqa", layers=3)
    kvpop.retrofit(model, BUDGET, scorer=scorer)
    prompt = torch.randint(1, 97, (2, 30))

    def held_after(new_tokens):
        cache = kvpop.KVpopCache(model)
        model.generate(input_ids=prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                       past_key_values=cache)
        assert all(layer.keys.shape[2] == BUDGET.total for layer in cache.layers)
        return cache.nbytes()

    sizes = [held_after(64), held_after(512)]
    assert sizes[0] == sizes[1]
    rt = model.kvpop_runtime
    batch, dtype_size = 2, 4
    assert sizes[0]["kv"] == BUDGET.total * rt.num_layers * rt.num_kv_heads * rt.head_dim * 2 * dtype_size * batch
    scorer_state = sum(kvpop.scorers(model)[i].state_nbytes(batch) for i in range(rt.num_layers))
    assert sizes[0]["scorer_state"] == scorer_state
    # metadata: int64 position + fp32 priority per slot, and one int64 counter per row
    assert sizes[0]["metadata"] == rt.num_layers * (BUDGET.total * rt.num_kv_heads * batch * 12 + batch * 8)
    # anchor slots: one more fp32 priority per slot (the anchors'), the same constant memory
    kvpop.set_policy(model, "kvpop", BUDGET, **ANCHORED)
    anchored = [held_after(64), held_after(512)]
    assert anchored[0] == anchored[1] and anchored[0]["kv"] == sizes[0]["kv"]
    assert anchored[0]["metadata"] == rt.num_layers * (BUDGET.total * rt.num_kv_heads * batch * 16 + batch * 8)


# here the anchors carry the decay and the other slots none: the collected (ranked) priorities are then the raw ones
@pytest.mark.parametrize("options", [{}, {"anchor_share": 0.6, "anchor_recency": 0.2}], ids=["one pool", "anchored"])
def test_cache_holds_exactly_the_retained_set(options):
    """After a prefill, and after decoding on from it, the slots hold exactly what the mask retains at the last
    query, per head."""
    from kvpop.retention import anchored_eviction_positions, retained

    model = tiny_model("llama", "gqa")
    kvpop.retrofit(model, BUDGET, scorer="mlp", **options)
    ids = torch.randint(1, 97, (1, 40))
    with kvpop.collect_priorities(model) as prios, torch.no_grad():
        model(ids, use_cache=False)
    cache = kvpop.KVpopCache(model)
    with torch.no_grad():
        model(ids[:, :33], past_key_values=cache, use_cache=True)
        for i in range(33, 40):  # decoding steps: the anchored ones empty a slot where the pools come to overlap
            model(ids[:, i:i + 1], past_key_values=cache, use_cache=True)
    policy = model.kvpop_runtime.policy
    for layer_idx, layer in enumerate(cache.layers):
        raw = prios[layer_idx].float()
        e = anchored_eviction_positions(raw, policy.anchor_ranked(raw, torch.arange(40)), BUDGET, policy.anchors)
        expect = retained(torch.tensor(39), torch.arange(40), e, BUDGET)  # [1, Hkv, 40]
        for h in range(layer.slot_pos.shape[1]):
            held = sorted(p for p in layer.slot_pos[0, h].tolist() if p >= 0)
            assert held == expect[0, h].nonzero().flatten().tolist()


def test_repeated_rows_continue_like_the_row_they_copy():
    """One prefill, many continuations: the copies decode as the original does, which is left as it was."""
    from kvpop.cache import CACHE_KWARG

    model = tiny_model("llama", "gqa")
    kvpop.retrofit(model, BUDGET, scorer="mlstm")
    one = kvpop.prefill(model, torch.randint(1, 97, (1, 30)), chunk=8)
    many = one.repeated(3)
    assert many.nbytes() == {key: 3 * value for key, value in one.nbytes().items()}
    assert one.get_seq_length() == many.get_seq_length() == 30
    ids = torch.randint(1, 97, (1, 6))
    with torch.no_grad():
        rows = torch.cat([model(input_ids=ids[:, i:i + 1].expand(3, 1), use_cache=True, **{CACHE_KWARG: many}).logits
                          for i in range(6)], dim=1)
        alone = torch.cat([model(input_ids=ids[:, i:i + 1], use_cache=True, **{CACHE_KWARG: one}).logits
                           for i in range(6)], dim=1)
    assert (rows - alone).abs().max() <= 1e-5


def test_dense_policy_keeps_transformers_cache():
    model = tiny_model("llama", "gqa")
    ids = torch.randint(1, 97, (1, 10))
    plain = model.generate(input_ids=ids, max_new_tokens=12, do_sample=False)
    kvpop.retrofit(model, None, scorer=None, policy="dense")
    assert torch.equal(model.generate(input_ids=ids, max_new_tokens=12, do_sample=False), plain)
    with pytest.raises(ValueError, match="DynamicCache"):
        kvpop.KVpopCache(model)


def test_crop_is_refused():
    model = tiny_model("llama", "gqa")
    kvpop.retrofit(model, BUDGET, scorer="mlp")
    cache = kvpop.KVpopCache(model)
    with torch.no_grad():
        model(torch.randint(1, 97, (1, 12)), past_key_values=cache, use_cache=True)
    with pytest.raises(NotImplementedError, match="cropped"):
        cache.crop(-1)


def test_graphed_teacher_forcing_refuses_what_it_cannot_replay():
    model = tiny_model("llama", "gqa")
    kvpop.retrofit(model, BUDGET, scorer="mlstm", policy="tova")
    with pytest.raises(ValueError, match="CUDA"):
        kvpop.teacher_forced_logits(model, torch.randint(1, 97, (1, 8)), graphed=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("policy", ["tova", "h2o", "kvpop", "streaming", "kvpop+anchors"])
@pytest.mark.parametrize("prefill", [1, 9])
def test_graphed_teacher_forcing_equals_eager_steps(policy, prefill):
    """One captured step replayed over the sequence gives the logits of launching every step from Python."""
    model = tiny_model("qwen3", "gqa", layers=3).cuda()
    name, _, anchored = policy.partition("+")
    kvpop.retrofit(model, BUDGET, scorer="mlstm", policy=name, **(ANCHORED if anchored else {}))
    ids = torch.randint(1, 97, (3, 60), device="cuda")
    eager = kvpop.teacher_forced_logits(model, ids, prefill=prefill)
    graphed = kvpop.teacher_forced_logits(model, ids, prefill=prefill, graphed=True)
    assert (graphed.float() - eager.float()).abs().max().item() <= 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graphed_decoder_without_snapshot_keeps_its_warmup_steps():
    """``snapshot=False`` (benchmarks at the memory limit): the warm-up steps stay in the cache, so the first call's
    logits are those of feeding its token warmup + 1 times."""
    from kvpop.cache import CACHE_KWARG
    from kvpop.decode import GraphedDecoder

    model = tiny_model("qwen3", "gqa", layers=2).cuda()
    kvpop.retrofit(model, BUDGET, scorer="mlstm")
    ids = torch.randint(1, 97, (2, 30), device="cuda")
    token, position = torch.randint(1, 97, (2, 1), device="cuda"), torch.full((2, 1), 30, device="cuda")
    eager, graphed = kvpop.prefill(model, ids), kvpop.prefill(model, ids)
    got = GraphedDecoder(model, graphed, warmup=2, snapshot=False)(token, position)
    with torch.no_grad():
        for _ in range(3):
            want = model(input_ids=token, position_ids=position, use_cache=True, **{CACHE_KWARG: eager}).logits
    assert (got.float() - want.float()).abs().max().item() <= 1e-4
    assert graphed.get_seq_length() == eager.get_seq_length() == 33


PADDED = [("kvpop", "mlp", 0.0), ("kvpop", "mlstm", 0.0), ("kvpop", "mlp", 0.5), ("kvpop", "mlstm", 0.5),
          ("random", None, 0.0), ("streaming", None, 0.0), ("oracle", None, 0.0), ("oracle", None, 0.5),
          ("kvpop", "mlstm", "anchored"), ("oracle", None, "anchored")]


@pytest.mark.parametrize("policy, scorer, recency", PADDED, ids=[f"{p}-{s}-r{r}" for p, s, r in PADDED])
def test_left_padded_rows_decode_as_each_row_alone(policy, scorer, recency):
    """Decode ≡ masked forward, row by row (METHOD §5): through the cache, a left-padded row — its prompt in one call
    or in chunks (its padding longer than several chunks), then decoded by ``generate`` — gives the logits of the row
    alone in one masked forward. Positions count real tokens (``kvpop.decode.padded_positions``): counting columns
    shifts a padded row's RoPE, which attention does not see but a scorer, reading the rotated keys, does."""
    budget, new = Budget(2, 4, 6), 6
    model = tiny_model("llama", "gqa")
    options = ANCHORED if recency == "anchored" else {"recency": recency}  # anchored: the oracle's ties in two pools
    kvpop.retrofit(model, budget, scorer=scorer, policy=policy, **options)
    prompts = [torch.randint(1, 97, (n,)) for n in (5, 14, 23)]  # within B, past it; 18 columns of padding
    ids, mask = left_padded(prompts)
    rt = model.kvpop_runtime
    # oracle targets by real position, with many ties; every row's own table when alone
    targets = torch.randint(0, 4, (rt.num_layers, len(prompts), rt.num_kv_heads, 23 + new)).float()

    def alone(i, row):
        with torch.no_grad(), kvpop.oracle_priorities(model, targets[:, i:i + 1]):
            return model(row[None], use_cache=False).logits[0]

    with kvpop.oracle_priorities(model, targets):
        forced = {"one call": kvpop.teacher_forced_logits(model, ids, prefill=ids.shape[1], attention_mask=mask),
                  "chunks": kvpop.teacher_forced_logits(model, ids, prefill=3, chunk=4, attention_mask=mask)}
        generated = {chunk: model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                                           prefill_chunk=chunk, output_logits=True, return_dict_in_generate=True)
                     for chunk in (None, 4)}
    for i, prompt in enumerate(prompts):
        want = alone(i, prompt)
        for how, logits in forced.items():
            assert (logits[i, ids.shape[1] - len(prompt):] - want).abs().max() <= 1e-4, (how, i)
        for chunk, out in generated.items():
            row = torch.cat([prompt, out.sequences[i, ids.shape[1]:]])
            steps = torch.stack(out.logits, dim=1)[i]  # the logits each decoding step chose its token from
            assert (steps - alone(i, row)[len(prompt) - 1:-1]).abs().max() <= 1e-4, (chunk, i)
