"""pipelines.legacy_tasks: the old generated tasks behind the recall interface (specs, gold answers, scoring)."""
import pytest
import torch

from pipelines import legacy_tasks as L


def test_bad_specs_are_clear_errors():
    with pytest.raises(ValueError, match="unknown task 'sorting'; known: kv_retrieval"):
        L.TaskSpec("sorting", 256, 0.1, 2)
    with pytest.raises(ValueError, match="depth must be in \\[0, 1\\]"):
        L.TaskSpec("kv_retrieval", 256, 1.5, 2)
    with pytest.raises(ValueError, match=">= 64 tokens"):
        L.TaskSpec("kv_retrieval", 10, 0.1, 2)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)


@pytest.mark.pretrained
def test_samples_gold_answers_and_scores(tokenizer):
    samples = [s for task in L.TASKS for s in L.generate_samples(L.TaskSpec(task, 128, 0.2, 2, seed=1), tokenizer)]
    assert len({s.id for s in samples}) == 6 and samples == [
        s for task in L.TASKS for s in L.generate_samples(L.TaskSpec(task, 128, 0.2, 2, seed=1), tokenizer)]
    for s in samples:
        assert len(s.prompt_ids) >= 128
        gold = tokenizer.decode(s.answer_ids)
        assert L.score_text(s, gold), (s.task, gold)  # the gold continuation is scored right
        assert not L.score_text(s, " 0")
    with pytest.raises(ValueError, match="does not fit the model's context of 100"):
        L.generate_samples(L.TaskSpec("kv_retrieval", 128, 0.2, 1), tokenizer, max_context=100)
    # teacher-forced gold scores against a direct computation on random logits
    sample = samples[0]
    n, a = len(sample.prompt_ids), len(sample.answer_ids)
    logits = torch.randn(n + a, 50)
    gold = torch.tensor(sample.answer_ids) % 50
    sample = L.RecallSample(sample.id, sample.task, 128, 0.2, sample.prompt_ids, sample.answer, tuple(gold.tolist()))
    logits[n - 1, gold[0]] = 10.0  # the first gold token is the greedy choice
    got = L.gold_logprob_and_rank(logits, sample)
    logp = torch.log_softmax(logits, -1)
    assert got["logprob"] == pytest.approx(float(sum(logp[n - 1 + j, gold[j]] for j in range(a))), rel=1e-5)
    assert got["first_rank"] == 1 and got["first_token_hit"]
    assert got["all_top1"] == all(int(logits[n - 1 + j].argmax()) == int(gold[j]) for j in range(a))
    assert L.gold_logprob_and_rank(logits[n - 1:], sample, start=n - 1) == got  # only the rows that predict it
    logits[n - 1, gold[0]] = -10.0
    assert L.gold_logprob_and_rank(logits, sample)["first_rank"] == 50
    with pytest.raises(ValueError, match="prompt \\+ answer"):
        L.gold_logprob_and_rank(logits[:-2], sample)
