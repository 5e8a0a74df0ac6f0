"""The method under per-head budgets (METHOD §7, issue 43 item 2): masks, losses, cache, save/load, invariants.

Every rule is held to a reference that applies the uniform rule head by head at that head's own budget: the mask to
an attention function that builds each head's mask with :func:`kvpop.retention.visible` (the brute-force rule), the
loss to per-head uniform losses, the cache to the mask (decode ≡ masked forward) and to its exact byte count.
"""
import random

import pytest
import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

import kvpop
from kvpop import Budget
from kvpop.allocation import Allocation, AllocationError
from kvpop.retention import visible
from tests.models import HEADS, tiny_model

SINK, WINDOW = 2, 5
PROVENANCE = {"calibration_sha256": "c" * 64, "weights_sha256": "a" * 64, "utility": "oracle"}


def random_allocation(layers: int, heads: int, *, mean_topk: int = 6, seq_len: int = 48, seed: int = 0,
                      mode: str = "per_head") -> Allocation:
    """Budgets summing to ``layers · heads · (SINK + WINDOW + mean_topk)``, with a head at the floor (topk 0) and a
    head holding every token of a ``seq_len`` sequence when there are at least two heads to move slots between."""
    rng = random.Random(seed)
    rows = layers if mode == "per_head" else 1
    cols = heads if mode == "per_head" else layers
    n, total = rows * cols, rows * cols * mean_topk
    ks = [0] * n
    if n >= 2:
        ks[1] = min(seq_len, total)  # everything: k >= S - SINK - WINDOW eligible tokens (when the total allows)
    left = total - sum(ks)
    for _ in range(left):  # the rest at random over the other entries (the first stays at the floor)
        ks[rng.randrange(2, n) if n > 2 else (1 if n == 2 else 0)] += 1
    rng.shuffle(ks)
    if mode == "per_head":
        grid = [[SINK + WINDOW + ks[l * heads + h] for h in range(heads)] for l in range(layers)]
    else:
        grid = [[SINK + WINDOW + ks[l]] * heads for l in range(layers)]
    return Allocation(budgets=tuple(tuple(r) for r in grid), mean_budget=SINK + WINDOW + mean_topk, sink=SINK,
                      window=WINDOW, seq_len=max(max(r) for r in grid), mode=mode, provenance=PROVENANCE)


def oracle_targets(model, batch: int, size: int, seed: int = 0, ties: bool = True):
    g = torch.Generator().manual_seed(seed)
    rt = model.kvpop_runtime
    shape = (len(rt.evicting_layers), batch, rt.num_kv_heads, size)
    return torch.randint(0, 4, shape, generator=g).float() if ties else torch.randn(shape, generator=g)


# ---------------------------------------------------------------------------------------------- 1. masks
def _reference_attention(targets, allocation):
    """An attention function that masks each KV head with the brute-force rule (:func:`visible`) at its own budget,
    ranked by the oracle ``targets [L, B, Hkv, S]``: independent of eviction positions and of KVpop's backends."""
    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        layer, group = module.layer_idx, query.shape[1] // key.shape[1]
        prio = torch.nan_to_num(targets[layer].float(), neginf=-1e30)
        topk = torch.tensor(allocation.head_topk()[layer])
        mask = visible(prio, Budget(SINK, WINDOW, 0), topk=topk).repeat_interleave(group, 1)  # [B, Hq, S, S]
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key.repeat_interleave(group, 1), value.repeat_interleave(group, 1), attn_mask=mask, scale=scaling)
        return out.transpose(1, 2), None
    return attend


@pytest.mark.parametrize("heads", list(HEADS))
def test_masked_forward_is_each_heads_own_rule(heads):
    """The one-pass forward under an allocation (a head at the floor, a head holding everything, ties) equals
    attention masked head by head by the brute-force rule at each head's budget."""
    model = tiny_model("llama", heads)
    reference = tiny_model("llama", heads)
    hkv = model.config.num_key_value_heads
    allocation = random_allocation(2, hkv, mean_topk=40 // hkv, seq_len=40, seed=len(heads))
    assert min(min(r) for r in allocation.budgets) == SINK + WINDOW  # a head at the floor
    assert max(max(r) for r in allocation.budgets) >= 40  # a head holding all 40 tokens
    kvpop.retrofit(model, None, scorer=None, policy="oracle", allocation=allocation)
    ids = torch.randint(1, 97, (2, 40))
    targets = oracle_targets(model, 2, 40)
    AttentionInterface.register("headwise_reference", _reference_attention(targets, allocation))
    AttentionMaskInterface.register("headwise_reference", lambda *a, attention_mask=None, **k: attention_mask)
    reference.config._attn_implementation = "headwise_reference"
    with kvpop.oracle_priorities(model, targets), torch.no_grad():
        got = model(ids, use_cache=False).logits
    with torch.no_grad():
        want = reference(ids, use_cache=False).logits
    assert (got - want).abs().max() <= 1e-5
    with kvpop.oracle_priorities(model, targets), torch.no_grad():  # and the allocation matters
        kvpop.set_policy(model, "oracle", allocation.budget)
        uniform = model(ids, use_cache=False).logits
    assert (uniform - want).abs().max() > 1e-3


def test_an_allocation_of_equal_budgets_is_the_uniform_policy():
    model = tiny_model("qwen3", "gqa")
    uniform = Budget(SINK, WINDOW, 6)
    flat = Allocation(budgets=((13, 13), (13, 13)), mean_budget=13, sink=SINK, window=WINDOW, seq_len=64,
                      mode="per_layer", provenance=PROVENANCE)
    kvpop.retrofit(model, uniform, scorer="mlp")
    ids = torch.randint(1, 97, (2, 40))
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
        kvpop.set_policy(model, "kvpop", uniform, allocation=flat)
        got = model(ids, use_cache=False).logits
    assert torch.equal(got, want)


def test_bad_allocations_are_refused_in_one_line():
    model = tiny_model("llama", "gqa")
    alloc = random_allocation(2, 2)
    with pytest.raises(AllocationError, match="redistributes s2-w5-k6 .*not s2-w5-k7"):
        kvpop.retrofit(model, Budget(SINK, WINDOW, 7), scorer="mlp", allocation=alloc)
    with pytest.raises(AllocationError, match="for 3 layers × 2 KV heads, this model has 2 evicting layers × 2"):
        kvpop.retrofit(model, None, scorer="mlp", allocation=random_allocation(3, 2))
    with pytest.raises(AllocationError, match="1 KV heads, this model has 2 evicting layers × 2"):
        kvpop.retrofit(model, None, scorer="mlp", allocation=random_allocation(2, 1))
    kvpop.retrofit(model, None, scorer="mlp", allocation=alloc)
    with pytest.raises(ValueError, match="streaming has none to move"):
        kvpop.set_policy(model, "streaming", None, allocation=alloc)
    with pytest.raises(ValueError, match="tova has none to move"):
        kvpop.set_policy(model, "tova", None, allocation=alloc)
    with pytest.raises(AllocationError, match="anchor slots"):
        kvpop.set_policy(model, "kvpop", None, allocation=alloc, anchor_share=0.5)
    with pytest.raises(ValueError, match="sum to 5, not layers × kv_heads × budget.topk = 4 × 1"):
        kvpop.build_policy("oracle", Budget(SINK, WINDOW, 1), head_topk=((0, 1), (2, 2)))
    with pytest.raises(AllocationError, match="below sink \\+ window"):
        Allocation(budgets=((6, 8), (7, 7)), mean_budget=7, sink=SINK, window=WINDOW, seq_len=48, mode="per_head",
                   provenance=PROVENANCE)
    with pytest.raises(AllocationError, match="sum to 29, not"):
        Allocation(budgets=((7, 8), (7, 7)), mean_budget=7, sink=SINK, window=WINDOW, seq_len=48, mode="per_head",
                   provenance=PROVENANCE)


# ---------------------------------------------------------------------------------------------- 2. losses
def test_boundary_loss_at_each_heads_own_cutoff():
    """Per-head budgets: the loss is the mean over every head's decisions at its own cutoff — the per-head uniform
    losses' terms pooled — and a head at the floor makes no decision."""
    from kvpop.losses import boundary_decisions, boundary_loss

    torch.manual_seed(0)
    teacher = torch.randint(0, 4, (2, 3, 4, 30)).double()  # [L, B, Hkv, S], ties
    student = torch.randn_like(teacher, requires_grad=True)
    grid = torch.tensor([[0, 3, 9, 40], [5, 1, 0, 2]])
    budget = Budget(SINK, WINDOW, 7)
    dec = boundary_decisions(teacher, budget, grid[:, None, :])
    loss = boundary_loss(student, teacher, budget, tau=0.5, topk=grid[:, None, :])
    total, count = 0.0, 0
    for layer in range(2):
        for head in range(4):
            own = Budget(SINK, WINDOW, int(grid[layer, head]))
            ref = boundary_decisions(teacher[layer, :, head], own)
            assert torch.equal(dec.valid[layer, :, head], ref.valid)
            assert torch.equal(dec.keep[layer, :, head], ref.keep)
            assert torch.equal(torch.where(ref.valid, dec.t_bnd[layer, :, head], 0), torch.where(ref.valid, ref.t_bnd, 0))
            n = int(ref.valid.sum())
            if n:
                total += boundary_loss(student[layer, :, head], teacher[layer, :, head], own, tau=0.5).item() * n
                count += n
    assert not dec.valid[0, :, 0].any() and not dec.valid[1, :, 2].any()  # heads at the floor
    assert abs(loss.item() - total / count) <= 1e-9
    loss.backward()
    assert student.grad[0, :, 0].abs().sum() == 0 and student.grad[0, :, 1].abs().sum() > 0


def test_objective_trains_the_allocated_heads():
    """``Objective.for_model`` takes the allocation from the model's policy; the KL counts from the smallest head's
    budget on; extra uniform long-range sizes are refused beside an allocation."""
    from kvpop.objective import Objective, evicting, student_forward

    model = tiny_model("llama", "gqa")
    alloc = random_allocation(2, 2, seed=3)
    kvpop.retrofit(model, None, scorer="mlp", allocation=alloc)
    objective = Objective.for_model(model)
    assert objective.head_topk == alloc.head_topk() and objective.budget == alloc.budget
    ids = torch.randint(1, 97, (2, 36))
    logits, student = student_forward(model, ids)
    targets = torch.randn_like(student)
    terms = objective.ranking(student, targets)
    uniform = Objective(alloc.budget).ranking(student, targets)
    assert terms["ret_loss"].item() != pytest.approx(uniform["ret_loss"].item())
    terms["ret_loss"].backward()
    assert all(p.grad is not None for p in kvpop.scorers(model).parameters())
    first = evicting(logits, alloc.budget, alloc.head_topk())[0].long().argmax().item()
    assert first == SINK + WINDOW + min(min(r) for r in alloc.head_topk())
    with pytest.raises(ValueError, match="extra_topks are uniform budgets"):
        Objective.for_model(model, extra_topks=(3,))


# ---------------------------------------------------------------------------------------------- 3-4. cache, invariants
def headwise_model(arch, heads, policy, *, seed=0, mode="per_head", layers=2, mean_topk=6, seq_len=48):
    model = tiny_model(arch, heads, layers=layers)
    allocation = random_allocation(layers, model.config.num_key_value_heads, mean_topk=mean_topk, seed=seed,
                                   mode=mode, seq_len=seq_len)
    name, _, scorer = policy.partition(":")
    kvpop.retrofit(model, None, scorer=scorer or ("mlp" if name == "kvpop" else None), policy=name,
                   allocation=allocation)
    return model, allocation


INVARIANT_POLICIES = ["kvpop:mlstm", "kvpop:mlp", "oracle", "random", "window_attention"]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("policy", INVARIANT_POLICIES)
def test_decode_equals_masked_forward(arch, heads, policy):
    """METHOD §5 under a random allocation (a head at the floor, a head holding all 48 tokens when the layout has two
    heads to move slots between): token by token, prefill then decode, and chunked prefill, to 1e-4 in fp32."""
    model, _ = headwise_model(arch, heads, policy, seed=len(arch) + len(heads), mean_topk=24)
    ids = torch.randint(1, 97, (2, 48))
    with kvpop.oracle_priorities(model, oracle_targets(model, 2, 48)):
        with torch.no_grad():
            one_pass = model(ids, use_cache=False).logits
        stepwise = kvpop.teacher_forced_logits(model, ids)
        prefill_then_decode = kvpop.teacher_forced_logits(model, ids, prefill=29)
        chunked = kvpop.teacher_forced_logits(model, ids, prefill=13, chunk=6)
    assert (stepwise - one_pass).abs().max() <= 1e-4
    assert (prefill_then_decode - one_pass).abs().max() <= 1e-4
    assert (chunked - one_pass).abs().max() <= 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled FlexAttention needs a GPU")
@pytest.mark.parametrize("heads", ["gqa", "mha"])
def test_on_cuda_the_flex_mask_is_the_cpus_and_decodes_exactly(heads):
    """Per-head budgets on CUDA: the compiled flex mask over heads of mixed budgets (a head at the floor, one holding
    every token) gives the CPU's logits, and decoding through the cache (prefill, chunks, steps) the masked forward."""
    model, _ = headwise_model("qwen3", heads, "kvpop:mlstm", seed=7, mean_topk=120, seq_len=300)
    ids = torch.randint(1, 97, (2, 300))
    with torch.no_grad():
        cpu = model(ids, use_cache=False).logits
        model.cuda()
        one_pass = model(ids.cuda(), use_cache=False).logits
    assert (one_pass.cpu() - cpu).abs().max() <= 2e-3
    for options in ({"prefill": 200}, {"prefill": 100, "chunk": 64}):
        assert (kvpop.teacher_forced_logits(model, ids.cuda(), **options) - one_pass).abs().max() <= 1e-3, options


@pytest.mark.parametrize("mode", ["per_head", "per_layer"])
def test_cache_holds_exactly_each_heads_retained_set(mode):
    """After a chunked prefill and decoding on, every head's slots hold exactly what the mask retains at the last
    query at that head's budget (:func:`visible`, the brute-force rule); per-layer allocations need no parts."""
    from kvpop.headwise_cache import HeadwiseLayer

    model, allocation = headwise_model("llama", "mha", "kvpop:mlp", mode=mode, seed=7)
    ids = torch.randint(1, 97, (1, 40))
    with kvpop.collect_priorities(model) as prios, torch.no_grad():
        model(ids, use_cache=False)
    cache = kvpop.KVpopCache(model)
    with torch.no_grad():
        kvpop.prefill(model, ids[:, :33], cache=cache, chunk=9)
        for i in range(33, 40):
            model(ids[:, i:i + 1], past_key_values=cache, use_cache=True)
    assert any(isinstance(layer, HeadwiseLayer) for layer in cache.layers) == (mode == "per_head")
    for layer_idx, layer in enumerate(cache.layers):
        topk = torch.tensor(allocation.head_topk()[layer_idx])
        expect = visible(prios[layer_idx].float(), Budget(SINK, WINDOW, 0), topk=topk)[0, :, -1]  # [Hkv, 40]
        parts = layer.parts if isinstance(layer, HeadwiseLayer) else [(torch.arange(len(topk)), None, layer)]
        for heads, _, part in parts:
            for i, h in enumerate(heads.tolist()):
                held = sorted(p for p in part.slot_pos[0, i].tolist() if p >= 0)
                assert held == expect[h].nonzero().flatten().tolist(), (layer_idx, h)
                assert part.slot_pos.shape[-1] == allocation.budgets[layer_idx][h]


def test_memory_is_exactly_the_sum_of_the_budgets_and_flat():
    """K/V bytes = Σ budgets × head_dim × 2 × dtype size × rows, exactly, after 40 or 200 generated tokens; the
    same as the uniform cache of the mean budget (and ``kv_slots``), where padding to each layer's largest head would
    hold more."""
    from kvpop.cache import kv_slots

    model, allocation = headwise_model("llama", "mha", "kvpop:mlstm", layers=3, seed=2)
    prompt = torch.randint(1, 97, (2, 30))

    def held_after(new_tokens):
        cache = kvpop.KVpopCache(model)
        model.generate(input_ids=prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                       past_key_values=cache, prefill_chunk=8)
        return cache.nbytes(), cache.peak_kv_bytes

    (short, peak_short), (long, peak_long) = held_after(40), held_after(200)
    assert short == long and peak_short == peak_long
    rt, batch, dtype_size = model.kvpop_runtime, 2, 4
    per_slot = rt.head_dim * 2 * dtype_size * batch
    assert short["kv"] == sum(map(sum, allocation.budgets)) * per_slot
    assert short["kv"] == kv_slots(rt) * rt.num_kv_heads * per_slot
    padded = sum(max(layer) * len(layer) for layer in allocation.budgets) * per_slot
    assert short["kv"] < padded
    # peak: every slot plus the largest part's candidates of one 8-column chunk
    assert short["kv"] < peak_short <= short["kv"] + max(max(layer) + 8 for layer in allocation.budgets) * \
        rt.num_kv_heads * per_slot


def test_generate_batches_with_left_padding_and_repeats_rows():
    """generate() under per-head budgets: a left-padded batch gives each row's tokens alone (bounded prefill in
    chunks); a repeated cache continues like the row it copies."""
    from kvpop.cache import CACHE_KWARG

    model, _ = headwise_model("qwen3", "gqa", "kvpop:mlstm", seed=4)
    prompts = [torch.randint(1, 97, (n,)) for n in (5, 23, 14)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    batch = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False, prefill_chunk=4)
    for i, prompt in enumerate(prompts):
        alone = model.generate(input_ids=prompt[None], max_new_tokens=20, do_sample=False, prefill_chunk=4)
        assert torch.equal(batch[i, width:], alone[0, len(prompt):]), f"row {i} differs"
    one = kvpop.prefill(model, torch.randint(1, 97, (1, 30)), chunk=8)
    many = one.repeated(3)
    assert many.nbytes() == {key: 3 * value for key, value in one.nbytes().items()}
    step = torch.randint(1, 97, (1, 5))
    with torch.no_grad():
        rows = torch.cat([model(input_ids=step[:, i:i + 1].expand(3, 1), use_cache=True,
                                **{CACHE_KWARG: many}).logits for i in range(5)], dim=1)
        alone = torch.cat([model(input_ids=step[:, i:i + 1], use_cache=True, **{CACHE_KWARG: one}).logits
                           for i in range(5)], dim=1)
    assert (rows - alone.expand(3, -1, -1)).abs().max() <= 1e-5


def test_save_and_load_with_the_allocation(tmp_path):
    """A scorer-only folder under per-head budgets saves its allocation beside; loading gives the same logits, and
    refuses in one line an allocation of another shape, of another base, or that does not sum."""
    import dataclasses
    import json

    from kvpop.allocation import ALLOCATION_FILE
    from kvpop.files import weights_digest

    model = tiny_model("llama", "gqa")
    model.save_pretrained(tmp_path / "base")
    allocation = random_allocation(2, 2, seed=5)
    ours = dataclasses.replace(allocation, provenance={**PROVENANCE, "weights_sha256": weights_digest(tmp_path / "base")})
    kvpop.retrofit(model, ours.budget, scorer="mlstm", allocation=ours)
    with torch.no_grad():
        for p in kvpop.scorers(model).parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ids = torch.randint(1, 97, (2, 40))
    with torch.no_grad():
        before = model(ids, use_cache=False).logits
    kvpop.save_retrofitted(model, tmp_path / "m", base=tmp_path / "base")
    meta = json.loads((tmp_path / "m" / "kvpop.json").read_text())
    assert meta["allocation"] == {"file": ALLOCATION_FILE, "mode": "per_head", "mean_budget": ours.mean_budget}
    loaded, _ = kvpop.load_retrofitted(tmp_path / "m", base=tmp_path / "base")
    assert loaded.kvpop_runtime.policy.head_topk == ours.head_topk() and loaded.kvpop_runtime.allocation == ours
    with torch.no_grad():
        assert torch.equal(loaded(ids, use_cache=False).logits, before)
    assert (kvpop.teacher_forced_logits(loaded, ids, prefill=11, chunk=7) - before).abs().max() <= 1e-4

    kvpop.set_policy(model, "kvpop", ours.budget)  # uniform: kvpop.json as it was before allocations existed
    kvpop.save_retrofitted(model, tmp_path / "uniform", base=tmp_path / "base")
    assert "allocation" not in json.loads((tmp_path / "uniform" / "kvpop.json").read_text())
    assert not (tmp_path / "uniform" / ALLOCATION_FILE).exists()
    kvpop.set_policy(model, "kvpop", allocation=allocation)  # made for another base: not saved beside this one
    with pytest.raises(AllocationError, match="another base model"):
        kvpop.save_retrofitted(model, tmp_path / "other", base=tmp_path / "base")
    saved = json.loads((tmp_path / "m" / ALLOCATION_FILE).read_text())
    for change, message in ((lambda a: a["budgets"].append([a["mean_budget"]] * 2), "for 3 layers"),
                            (lambda a: a["provenance"].update(weights_sha256="b" * 64), "another base model"),
                            (lambda a: a["budgets"][0].__setitem__(0, a["budgets"][0][0] + 1), "sum to")):
        edited = json.loads(json.dumps(saved))
        change(edited)
        (tmp_path / "m" / ALLOCATION_FILE).write_text(json.dumps(edited))
        with pytest.raises(AllocationError, match=message):
            kvpop.load_retrofitted(tmp_path / "m", base=tmp_path / "base")


@pytest.mark.parametrize("arch", ["gemma2", "qwen2_window"])
def test_hybrid_models_allocate_over_their_global_layers(arch):
    """A model's own local layers keep their window (kvpop.local_layers): the allocation covers the global layers
    only, and decode ≡ masked forward holds."""
    from kvpop.headwise_cache import HeadwiseLayer

    model = tiny_model(arch, "mha")
    allocation = random_allocation(2, model.config.num_key_value_heads, mean_topk=10, seed=1)
    kvpop.retrofit(model, None, scorer="mlp", allocation=allocation)
    assert len(model.kvpop_runtime.evicting_layers) == 2
    ids = torch.randint(1, 97, (2, 40))
    with torch.no_grad():
        one_pass = model(ids, use_cache=False).logits
    assert (kvpop.teacher_forced_logits(model, ids, prefill=13, chunk=5) - one_pass).abs().max() <= 1e-4
    layers = kvpop.KVpopCache(model).layers
    assert [i for i, layer in enumerate(layers) if isinstance(layer, HeadwiseLayer)] == \
        list(model.kvpop_runtime.evicting_layers)
