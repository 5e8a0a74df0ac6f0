"""kvpop.evaluation on tiny random Llamas: padding changes nothing, generation matches transformers' generate, and
the item records hold what they claim (a budget that covers everything equals dense)."""
import contextlib
import copy
import math

import pytest
import torch
from transformers import DynamicCache

import kvpop
from kvpop import Budget
from kvpop import evaluation as EV
from kvpop.cache import CACHE_KWARG
from kvpop.decode import padded_positions
from tests.models import tiny_model

BUDGET = Budget(2, 4, 6)
ALL = ("dense", "streaming", "tova", "h2o", "random", "oracle", "kvpop")


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from threads, and 2 threads on a busy 2-core box run ~50x slower (spin-waits)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    return kvpop.retrofit(tiny_model("llama", "gqa"), BUDGET, scorer="mlp")


def setting(name, budget=BUDGET):
    return EV.Setting(name) if name == "dense" else EV.Setting(name, budget)


def prompts(lengths=(9, 14, 20), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 97, (n,), generator=g).tolist() for n in lengths]


def targets_of(model, rows, window=BUDGET.window):
    device = next(model.parameters()).device
    return [EV.teacher_targets(model, torch.tensor([r], device=device), [window])[window][:, 0] for r in rows]


@pytest.mark.parametrize("name", ALL)
def test_left_padded_forcing_equals_each_row_alone(model, name):
    rows = prompts()
    ids, mask, _ = EV.left_pad(rows, pad_id=0)
    table = EV.oracle_table(targets_of(model, rows), ids.shape[1]) if name == "oracle" else None
    batched = EV.forced_logits(model, setting(name), ids, mask=mask, targets=table)
    for i, row in enumerate(rows):
        alone = EV.sequence_logits(model, setting(name), row)  # the oracle computes its own targets
        torch.testing.assert_close(batched[i, ids.shape[1] - len(row):], alone, atol=2e-5, rtol=1e-4)
    start = ids.shape[1] - 5
    tail = EV.forced_logits(model, setting(name), ids, mask=mask, targets=table, start=start)
    torch.testing.assert_close(tail, batched[:, start:], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ALL)
def test_greedy_equals_transformers_generate_alone_and_batched(model, name):
    rows = prompts()
    targets = targets_of(model, rows) if name == "oracle" else None
    batched = EV.greedy(model, setting(name), rows, max_new_tokens=7, targets=targets)
    assert [len(t) for t in batched] == [7, 7, 7]
    for i, row in enumerate(rows):
        alone = EV.greedy(model, setting(name), [row], max_new_tokens=7, targets=None if targets is None
                          else [targets[i]])
        assert alone[0] == batched[i]
        with EV.applied(model, setting(name)):
            if name == "oracle":
                with kvpop.oracle_priorities(model, EV.oracle_table([targets[i]], len(row) + 7)):
                    ref = model.generate(torch.tensor([row]), max_new_tokens=7, do_sample=False, pad_token_id=0)
            else:
                ref = model.generate(torch.tensor([row]), max_new_tokens=7, do_sample=False, pad_token_id=0)
        assert ref[0, len(row):].tolist() == batched[i], (name, i)
    assert model.kvpop_runtime.policy.name == "kvpop"  # restored


def test_teacher_forced_items():
    model = kvpop.retrofit(tiny_model("llama", "gqa"), BUDGET, scorer="mlp")
    seqs = [torch.randint(1, 97, (24,)) for _ in range(3)]
    small, large = Budget(2, 4, 6), Budget(2, 4, 10)
    runs = EV.settings(ALL, [large, small])
    records = EV.teacher_forced_items(model, seqs, runs, batch_size=2, dynamic_limit=2)
    keys = {(r["policy"], r["B"]) for r in records}
    assert keys == {(p, b) for p in ALL for b in (16, 12)}
    for r in records:
        assert r["positions"] == 24 - r["B"] and r["labelled"] == 23 - r["B"]
        expected = [0, 1] if r["policy"] in ("tova", "h2o") else [0, 1, 2]
        assert r["item"] in expected
        if r["policy"] == "dense":
            assert r["top1_agreement"] == 1.0 and abs(r["kl"]) < 1e-6 and r["budget"] == "full"
        else:
            assert r["kl"] > 0
    assert sum(r["policy"] == "tova" for r in records) == 4  # two sequences at two budgets
    streaming = next(r for r in records if r["policy"] == "streaming" and r["B"] == 12)
    assert streaming["budget"] == "s2-w10-k0"
    # a budget that covers the whole sequence is dense, for every policy
    whole = EV.teacher_forced_items(model, seqs, EV.settings(ALL, [Budget(2, 4, 18)]), metric_start=0)
    for r in whole:
        assert r["top1_agreement"] == 1.0 and abs(r["kl"]) < 1e-6, r["policy"]


@torch.no_grad()
def after_prompt(model, name, prompt, continuation, table=None):
    """Reference for a continuation teacher-forced after a prompt, one row, in plain steps: the prompt in one cache
    call (as generate() takes a short prompt), then one call per token. ``[len(continuation), V]``."""
    if name == "dense":
        return EV.sequence_logits(model, EV.Setting("dense"), prompt + continuation)[len(prompt) - 1:-1]
    with EV.applied(model, setting(name)), (kvpop.oracle_priorities(model, table) if table is not None
                                            else contextlib.nullcontext()):
        cache = kvpop.KVpopCache(model)
        out = [model(torch.tensor([prompt]), use_cache=True, **{CACHE_KWARG: cache}).logits[0, -1]]
        for token in continuation[:-1]:
            out.append(model(torch.tensor([[token]]), use_cache=True, **{CACHE_KWARG: cache}).logits[0, -1])
    return torch.stack(out)


def test_generation_items_dense_continuation_and_gold_scoring():
    model = kvpop.retrofit(tiny_model("llama", "gqa"), BUDGET, scorer="mlp")
    rows = prompts((12, 17))
    runs = EV.settings(ALL, [BUDGET])
    records = EV.generation_items(model, rows, runs, max_new_tokens=8, eos_id=None, batch_size=2)
    dense = {r["item"]: r for r in records if r["policy"] == "dense"}
    assert set(dense) == {0, 1} and all(r["B"] is None and r["divergence"] == 8 for r in dense.values())
    assert all(abs(r["kl"]) < 1e-6 and r["top1_agreement"] == 1.0 for r in dense.values())
    for r in records:
        assert 0 <= r["divergence"] <= len(r["tokens"]) == 8
        assert r["divergence"] == next(i for i in range(9) if i == 8 or r["tokens"][i] != dense[r["item"]]["tokens"][i])
    # KL on dense's continuation: the same as teacher-forcing it after the prompt one row at a time (the oracle
    # with the targets of exactly those tokens)
    for r in records:
        if r["policy"] == "dense":
            continue
        prompt, continuation = rows[r["item"]], dense[r["item"]]["tokens"]
        table = EV.oracle_table(targets_of(model, [prompt + continuation]), 20) if r["policy"] == "oracle" else None
        pol = after_prompt(model, r["policy"], prompt, continuation, table)
        den = after_prompt(model, "dense", prompt, continuation)
        want = kvpop.metrics.per_sequence(pol, den)[0]
        assert r["kl"] == pytest.approx(want["kl"], rel=1e-4, abs=1e-6), r["policy"]
        assert r["top1_agreement"] == pytest.approx(want["top1_agreement"])
    # gold continuations of unequal length, scored on the policy's logits that predict them
    gold = [[5, 6, 7], [8]]
    seen = []

    def score(logits, index):
        seen.append((index, logits.shape[0]))
        return {"gold_logprob": float(torch.log_softmax(logits.float(), -1)[torch.arange(len(gold[index])),
                                                                            torch.tensor(gold[index])].sum())}

    scored = EV.generation_items(model, rows, EV.settings(["dense", "streaming", "tova", "oracle"], [BUDGET]),
                                 max_new_tokens=3, eos_id=None, forced=gold, score=score)
    assert sorted(set(seen)) == [(0, 3), (1, 1)]
    dense_answers = {r["item"]: r["tokens"] for r in scored if r["policy"] == "dense"}
    for r in scored:
        prompt, answer = rows[r["item"]], gold[r["item"]]
        known = prompt + dense_answers[r["item"]]  # the oracle's targets: prompt + dense's continuation
        table = EV.oracle_table(targets_of(model, [known]), 20) if r["policy"] == "oracle" else None
        logits = after_prompt(model, r["policy"], prompt, answer, table)
        want = torch.log_softmax(logits, -1)[torch.arange(len(answer)), torch.tensor(answer)].sum()
        assert r["gold_logprob"] == pytest.approx(float(want), rel=1e-4)


def test_settings_and_errors(model):
    runs = EV.settings(["kvpop", "dense", "streaming"], [Budget(2, 4, 10), BUDGET])
    assert [s.key for s in runs] == ["dense", "kvpop.B16", "streaming.B16", "kvpop.B12", "streaming.B12"]
    assert runs[2].effective == Budget(2, 14, 0) and not runs[2].dynamic
    assert EV.Setting("tova", BUDGET).dynamic and EV.Setting("h2o", BUDGET).dynamic
    with pytest.raises(ValueError, match="unknown policy"):
        EV.Setting("lru", BUDGET)
    with pytest.raises(ValueError, match="needs a budget"):
        EV.Setting("kvpop")
    with pytest.raises(ValueError, match="oracle needs"):
        EV.forced_logits(model, EV.Setting("oracle", BUDGET), torch.ones(1, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="retrofitted"):
        with EV.applied(tiny_model("llama", "gqa"), EV.Setting("kvpop", BUDGET)):
            pass
    assert EV.cut_at_eos([4, 2, 9, 2], 2) == [4, 2] and EV.cut_at_eos([4, 5], 2) == [4, 5]
    assert EV.cut_at_eos([4, 5], None) == [4, 5]


def test_a_settings_recency_ranks_that_row_only_and_is_restored():
    """``Setting.recency`` (eval.recency's rows): kvpop + λ·t for that row, the model's own term back afterwards; a λ
    that outweighs every score is streaming at the same B (newest-wins in the long-range slots), λ = the model's own
    is the plain row, and ``settings(kvpop_recency=)`` touches only the kvpop rows."""
    model = kvpop.retrofit(tiny_model("llama", "gqa"), BUDGET, scorer="mlp", recency=0.25)
    seqs = [torch.randint(1, 97, (24,), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    runs = EV.settings(["streaming", "oracle", "kvpop"], [BUDGET], kvpop_recency=1e6)
    assert [(s.policy, s.recency) for s in runs] == [("streaming", None), ("oracle", None), ("kvpop", 1e6)]
    rows = {r["policy"]: r for r in EV.teacher_forced_items(model, seqs, runs, metric_start=0) if r["item"] == 1}
    assert rows["kvpop"]["kl"] == pytest.approx(rows["streaming"]["kl"], abs=1e-6)
    assert rows["kvpop"]["top1_agreement"] == rows["streaming"]["top1_agreement"]
    assert model.kvpop_runtime.policy.recency == 0.25  # restored after the rows
    own = EV.teacher_forced_items(model, seqs, [EV.Setting("kvpop", BUDGET)], metric_start=0)
    same = EV.teacher_forced_items(model, seqs, [EV.Setting("kvpop", BUDGET, 0.25)], metric_start=0)
    other = EV.teacher_forced_items(model, seqs, [EV.Setting("kvpop", BUDGET, 0.0)], metric_start=0)
    assert [r["kl"] for r in own] == [r["kl"] for r in same] != [r["kl"] for r in other]
    with pytest.raises(ValueError, match="recency must be >= 0"):
        EV.Setting("kvpop", BUDGET, -0.1)
    with pytest.raises(ValueError, match="needs a ranked policy"):
        EV.Setting("dense", None, 0.1)


def test_plain_reference_model_runs_dense():
    base = tiny_model("llama", "gqa")
    model = kvpop.retrofit(copy.deepcopy(base), BUDGET, scorer="mlp")
    rows = prompts((10,))
    assert EV.greedy(base, EV.Setting("dense"), rows, max_new_tokens=4) == \
        EV.greedy(model, EV.Setting("dense"), rows, max_new_tokens=4)
    records = EV.generation_items(model, rows, EV.settings(["dense", "kvpop"], [BUDGET]), max_new_tokens=4,
                                  eos_id=None, reference=base)
    assert {r["policy"] for r in records} == {"dense", "kvpop"}
    assert not any(math.isnan(r["kl"]) for r in records)


@torch.no_grad()
def eager_forced(model, name, ids, mask):
    """The eager reference of a setting's teacher-forced logits on a left-padded batch: the fixed cache, the whole
    batch in one call; dense, which has no fixed cache, through transformers' DynamicCache one column at a time, as
    generate() decodes it."""
    with EV.applied(model, setting(name)):
        if name != "dense":
            return kvpop.teacher_forced_logits(model, ids, prefill=ids.shape[1], attention_mask=mask)
        cache, positions = DynamicCache(config=model.config), padded_positions(mask)
        return torch.cat([model(input_ids=ids[:, c:c + 1], attention_mask=mask[:, :c + 1],
                                position_ids=positions[:, c:c + 1], use_cache=True, **{CACHE_KWARG: cache}).logits
                          for c in range(ids.shape[1])], dim=1)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA graphs need a GPU"))])
@pytest.mark.parametrize("name", ALL)
def test_graphed_paths_equal_the_eager_ones(name, device):
    """On CUDA, dynamic teacher forcing and every fixed-budget generation step through one captured graph: the
    same logits (to float tolerance) and tokens as the eager cache path and transformers' generate. On CPU the same
    comparisons hold without graphs: a static policy's masked forward against the cache, and the batched greedy
    loop against generate() alone."""
    model = kvpop.retrofit(tiny_model("llama", "gqa"), BUDGET, scorer="mlp").to(device)
    rows = prompts()
    ids, mask, _ = EV.left_pad(rows, pad_id=0, device=device)
    targets = targets_of(model, rows) if name == "oracle" else None
    table = EV.oracle_table(targets, ids.shape[1]) if name == "oracle" else None
    got = EV.forced_logits(model, setting(name), ids, mask=mask, targets=table, start=3)
    with kvpop.oracle_priorities(model, table) if table is not None else contextlib.nullcontext():
        eager = eager_forced(model, name, ids, mask)[:, 3:]
    torch.testing.assert_close(got, eager, atol=1e-4, rtol=1e-3)
    batched = EV.greedy(model, setting(name), rows, max_new_tokens=6, targets=targets)
    for i, row in enumerate(rows):
        with EV.applied(model, setting(name)), (kvpop.oracle_priorities(
                model, EV.oracle_table([targets[i]], len(row) + 6)) if name == "oracle" else contextlib.nullcontext()):
            ref = model.generate(torch.tensor([row], device=device), max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert ref[0, len(row):].tolist() == batched[i], (name, i)


def test_no_flexattention_kernel_per_prompt_or_step(model, monkeypatch):
    """Compiled FlexAttention builds one kernel per shape (seconds each on CUDA), so the evaluation may call it only
    where shapes repeat: with every "auto" backend resolved to flex (as on CUDA), generation over prompts of five
    lengths under every policy calls it for whole-sequence passes only (dense's prefill: one shape per batch), never
    for a decoding step, a cache's chunk or a row's oracle targets (an H200 session once compiled one per step)."""
    import kvpop.attention as attention
    import kvpop.targets as targets

    shapes = []
    eager = attention.flex

    def recorded(query, key, value, **kwargs):
        shapes.append((tuple(query.shape), tuple(key.shape)))
        return eager(query, key, value, **kwargs)

    original = attention.retention_attention

    def as_on_cuda(*args, backend="auto", **kwargs):
        return original(*args, backend="flex" if backend == "auto" else backend, **kwargs)

    monkeypatch.setattr(attention, "flex", recorded)
    monkeypatch.setattr(targets, "flex", recorded)
    monkeypatch.setattr(targets, "_resolve", lambda backend, x: "flex" if backend == "auto" else backend)
    for module in (attention, kvpop.dms_cache):
        monkeypatch.setattr(module, "retention_attention", as_on_cuda)
    # a KVpop cache's chunk takes FlexAttention on CUDA only at its fixed chunk size (one compiled shape)
    monkeypatch.setattr(kvpop.cache.KVpopLayer, "_fused", lambda self, query, chunk: chunk == self.prefill_chunk)
    rows = prompts(lengths=(9, 14, 20, 23, 31))
    runs = [setting(name) for name in ALL]
    EV.generation_items(model, rows, runs, max_new_tokens=6, eos_id=None, batch_size=3)
    assert shapes, "the patch no longer reaches FlexAttention: the test checks nothing"
    assert all(q[2] == k[2] for q, k in shapes), sorted(set(shapes))
    assert len(set(shapes)) <= 2, sorted(set(shapes))  # two batches, one dense prefill each


def test_the_oracle_ranks_by_the_configured_target_definition(monkeypatch):
    """``target_options`` (METHOD §2: ``group_reduce``, ``query_power``) reach the oracle's targets in teacher forcing,
    in generation (row by row, chunked) and from the evaluation stage's config; β = 8 targets are the teacher pass's
    and not the mean's."""
    import types

    from kvpop.targets import teacher_pass
    from pipelines.config import load_config
    from pipelines.eval_parts import evaluate_items

    model = kvpop.retrofit(tiny_model("llama", "gqa"), BUDGET, scorer="mlp")
    ids = torch.randint(1, 97, (2, 24))
    powered = EV.teacher_targets(model, ids, [4], group_reduce="mean", query_power=8.0)[4]
    torch.testing.assert_close(powered, teacher_pass(model, ids, [4], top_k=1, group_reduce="mean",
                                                     query_power=8.0)["targets"][4], rtol=0, atol=0)
    finite = torch.isfinite(powered)
    assert (powered[finite] - EV.teacher_targets(model, ids, [4])[4][finite]).abs().max() > 0.1

    calls, original = [], EV.teacher_targets

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(EV, "teacher_targets", spy)
    options = {"group_reduce": "mean", "query_power": 8.0}
    runs = [setting("oracle")]
    EV.teacher_forced_items(model, list(ids), runs, target_options=options)
    EV.generation_items(model, prompts(), runs, max_new_tokens=3, eos_id=None, target_options=options)
    assert calls and all({k: c.get(k) for k in options} == options for c in calls), calls
    assert calls[-1]["backend"] == "chunked"  # generation's rows, one length each

    calls.clear()
    cfg = load_config(None, ["model.path=/nowhere", "precompute.group_reduce=mean", "precompute.query_power=8"])
    inputs = {"tokenizer": types.SimpleNamespace(pad_token_id=0, eos_token_id=None), "budgets": [BUDGET],
              "sequences": [{"id": "a", "input_ids": ids[0].tolist()}], "samples": [], "problems": [], "prompts": []}
    evaluate_items(cfg, inputs, model, progress=False, runs=runs)
    assert calls and all({k: c.get(k) for k in options} == options for c in calls), calls


def test_evicting_share_counts_the_steps_that_read_past_the_budget():
    def brute(lengths, tokens, total):  # step j reads prompt + j generated tokens: past the budget when L + j > B
        return sum(n + j > total for n in lengths for j in range(tokens)) / (len(lengths) * tokens)

    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        lengths = torch.randint(1, 40, (int(torch.randint(1, 5, (1,), generator=gen)),), generator=gen).tolist()
        tokens, total = (int(torch.randint(0, 30, (1,), generator=gen)) for _ in range(2))
        assert EV.evicting_share(lengths, tokens, total) == pytest.approx(brute(lengths, tokens, total) if tokens
                                                                          else 0.0)
    assert EV.evicting_share([100, 200], 512, 1024) == 0.0  # the H200 run's CR 75 %: nothing ever evicted
    assert EV.evicting_share([10], 4, 10) == 0.75  # steps 1-3 read 11-13 tokens: past B = 10
    assert EV.evicting_share([11], 4, 10) == 1.0 and EV.evicting_share([], 4, 10) == 0.0
