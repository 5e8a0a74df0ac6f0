"""Trained baselines in the evaluation harness (issue 13): ``eval.baselines`` rows on the same items, DMS at the
budget of its mean retained tokens (against a brute-force search), KVpop's paired differences to them."""
import json

import pytest
import torch

import kvpop
from kvpop import Budget
from kvpop.dms import matched_total, retained_per_query
from kvpop.evaluation import dms_occupancy
from pipelines import evaluate as E
from pipelines.config import ConfigError, config_from_dict
from tests.models import tiny_model
from tests.test_evaluate import setup, tokenizer  # noqa: F401  (the tiny evaluation setup)
from tests.test_evaluation import one_thread  # noqa: F401  (autouse: one torch thread here too)

SEQ = 48


def _dms(vocab: int, budget=Budget(2, 8, 0), seed: int = 3):
    """A tiny DMS model with random gates (about half the decided tokens evicted)."""
    model = kvpop.retrofit(tiny_model("llama", "gqa", vocab=vocab), budget, scorer="dms", policy="dms",
                           scorer_options={"scale": 1.0, "offset": 0.0})
    generator = torch.Generator().manual_seed(seed)
    for gate in kvpop.scorers(model):
        gate.proj.weight.data.normal_(generator=generator)
    return model


def _brute_force_matched(counts: torch.Tensor, floor: int) -> int:
    """The smallest B >= floor whose rounded mean occupancy over the queries d >= B is B."""
    size = counts.shape[-1]
    for total in range(floor, size):
        if int(round(float(counts[..., total:].float().mean()))) == total:
            return total
    return size - 1


@pytest.mark.parametrize("seed, window, offset", [(0, 4, 0.0), (1, 8, -2.0), (2, 3, 3.0), (3, 16, 0.0)])
def test_matched_budget_is_the_smallest_fixed_point_of_mean_occupancy(seed, window, offset):
    torch.manual_seed(seed)
    size, sink = 64, 2
    decisions = [torch.where(torch.arange(size) < size - 1, torch.randn(3, 2, size) + offset, float("-inf"))
                 for _ in range(2)]
    decisions = [torch.where(torch.arange(size) < sink, float("-inf"), z) for z in decisions]
    counts = retained_per_query(decisions, window)
    total = matched_total(counts, sink + window)
    assert total == _brute_force_matched(counts, sink + window)
    assert abs(float(counts[..., total:].float().mean()) - total) <= 0.5 + 1e-6 or total == size - 1


def test_matched_budget_edges():
    keep_all = torch.arange(10).expand(1, 1, 1, 10) + 1  # dense: d + 1 tokens at query d
    assert matched_total(keep_all, 4) == 9  # never matched below S: the last query
    evict_all = torch.clamp(torch.arange(10) + 1, max=6).expand(1, 1, 1, 10)  # sink + window = 6, the floor
    assert matched_total(evict_all, 6) == 6


def test_dms_occupancy_matches_the_hard_mask(tokenizer):  # noqa: F811
    model = _dms(len(tokenizer))
    sequences = [torch.randint(3, 2000, (SEQ,)) for _ in range(3)]
    occupancy = dms_occupancy(model, sequences, batch_size=2)
    with kvpop.collect_priorities(model) as collected, torch.no_grad():
        model(torch.stack(sequences), use_cache=False)
    counts = retained_per_query([collected[i] for i in range(2)], 8)[..., occupancy["B"]:]
    assert occupancy["peak"] == int(counts.max()) and occupancy["mean"] == pytest.approx(float(counts.float().mean()))
    assert 10 <= occupancy["B"] < SEQ and len(occupancy["mean_per_head"]) == 2
    # capped DMS at a given B: its occupancy under the cap over the same queries, never above it
    cap = occupancy["peak"] - 2
    kvpop.set_policy(model, "dms", Budget(2, 8, 0), cap=cap)
    capped = dms_occupancy(model, sequences, batch_size=2, start=occupancy["B"])
    with kvpop.collect_priorities(model) as collected, torch.no_grad():
        model(torch.stack(sequences), use_cache=False)
    held = retained_per_query([collected[i] for i in range(2)], 8, sink=2, cap=cap)[..., occupancy["B"]:]
    assert capped["B"] == occupancy["B"] and capped["peak"] == int(held.max()) == cap
    assert capped["mean"] == pytest.approx(float(held.float().mean())) and capped["mean"] < occupancy["mean"]
    kvpop.set_policy(model, "streaming", Budget(2, 8, 0))
    with pytest.raises(ValueError, match="hard dms policy"):
        dms_occupancy(model, sequences)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the graphed generation path needs CUDA")
def test_dms_generation_on_cuda_steps_eagerly_and_matches_cpu():
    """DMS's cache grows (not graph-capturable): on CUDA its decoding steps run eagerly, with CPU's logits."""
    from kvpop.evaluation import Setting, continue_prompts

    model = _dms(97).eval()
    setting = Setting("dms", Budget(2, 8, 0))
    prompts, forced = [[5, 6, 7] * 9, [8, 9] * 7], [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
    cpu = continue_prompts(model, setting, prompts, max_new_tokens=6, forced=forced)
    gpu = continue_prompts(model.cuda(), setting, prompts, max_new_tokens=6, forced=forced)
    torch.testing.assert_close(gpu.forced.cpu(), cpu.forced, atol=1e-3, rtol=1e-3)


@pytest.mark.pretrained
def test_trained_baselines_are_rows_on_the_same_items(setup, tokenizer, tmp_path):  # noqa: F811
    cfg, checkpoint = setup
    streaming_plus = kvpop.retrofit(tiny_model("llama", "gqa", vocab=len(tokenizer)), Budget(2, 8, 14),
                                    scorer=None, policy="streaming")
    with torch.no_grad():  # a base adapted to its mask: other weights than the teacher's
        for p in streaming_plus.parameters():
            p.add_(0.01 * torch.randn_like(p))
    kvpop.save_retrofitted(streaming_plus, tmp_path / "streaming_plus", tokenizer)
    kvpop.save_retrofitted(_dms(len(tokenizer)), tmp_path / "dms", tokenizer)
    tree = cfg.to_dict()
    tree["eval"].update(baselines={"streaming_plus": str(tmp_path / "streaming_plus"), "dms": str(tmp_path / "dms")},
                        policies=["dense", "streaming", "kvpop"], generation_prompts=1, task_depths=[0.5])
    result = E.run(config_from_dict(tree), progress=False)
    out = result.output_dir
    records = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    summary = json.loads((out / "metrics.json").read_text())["summary"]
    occupancy = summary["occupancy"]["dms"]
    matched = occupancy["B"]
    budgets = sorted({r["B"] for r in records if r["part"] == "text"}, reverse=True)
    assert matched in budgets and set(budgets) >= {24, 12}  # every policy also runs at DMS's matched budget
    for part in ("text", "recall", "generation"):
        items = {r["item"] for r in records if r["part"] == part and r["policy"] == "kvpop"}
        for name in ("streaming_plus", "dms"):
            rows = [r for r in records if r["part"] == part and r["policy"] == name]
            assert rows and {r["item"] for r in rows} == items, (part, name)
        assert {r["B"] for r in records if r["part"] == part and r["policy"] == "dms"} == {matched}
        assert {r["B"] for r in records if r["part"] == part and r["policy"] == "streaming_plus"} == set(budgets)
    text_dms = [r for r in records if r["part"] == "text" and r["policy"] == "dms"]
    assert all(r["positions"] == SEQ - matched for r in text_dms)  # the positions kvpop counts at the same B
    assert not any(r["policy"] == "dense" and r.get("B") == matched and r["part"] != "text"
                   for r in records if r["part"] == "generation")
    differences = {(d["policy"], d["vs"], d["B"]) for d in summary["differences"]}
    assert ("kvpop", "dms", matched) in differences and ("dms", "streaming", matched) in differences
    assert ("kvpop", "streaming_plus", 24) in differences
    assert f"peak {occupancy['peak']}" in result.text and "kvpop vs dms" in result.text
    config = json.loads((out / "config.json").read_text())
    assert set(config["baselines"]) == {"streaming_plus", "dms"}


def test_bad_baselines_are_clear_errors(setup, tmp_path):  # noqa: F811
    cfg, _ = setup
    tree = cfg.to_dict()
    for baselines, message in (({"kvpop": "/x"}, "also in eval.policies"), ({"streaming+": "/x"}, "row name"),
                               ({"dms": ""}, "must be a model folder")):
        tree["eval"]["baselines"] = baselines
        with pytest.raises(ConfigError, match=message):
            config_from_dict(tree)
    tree["eval"]["baselines"] = {"dms": str(tmp_path / "nothing")}
    with pytest.raises(ConfigError, match="eval.baselines.dms: .* is not a folder written by kvpop.save_retrofitted"):
        E.plan(config_from_dict(tree))
