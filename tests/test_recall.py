"""pipelines.recall: deterministic prompts of the requested length with the needle at the requested depth, answers
recomputed from the prompt text alone, the two scorings against brute force, and the harness end to end on a tiny
model whose dense attention retrieves the needle (streaming cannot, the oracle can)."""
import collections
import hashlib
import json
import math
import re

import pytest
import torch

import kvpop
from kvpop import Budget
from pipelines import recall as R
from pipelines.recall.calibration import calibrate, greedy_generate_fn
from pipelines.recall.haystack import WORDS

pytestmark = pytest.mark.pretrained  # SmolLM2's tokenizer (and chat template) sizes the prompts
POSITIONAL = [name for name, family in R.TASKS.items() if family.positional]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)


def digest(samples) -> str:
    return hashlib.sha256(json.dumps([[s.prompt_ids, s.answer_ids] for s in samples]).encode()).hexdigest()


def solve(text: str, task: str) -> str:
    """The answer from the decoded prompt alone, without the generator's bookkeeping."""
    body, question = text.rsplit("<|im_start|>user", 1)[1].rsplit("\n\n", 1)
    if task.startswith("niah"):
        key = re.search(r"magic number for (\S+) mentioned", question).group(1)
        values = re.findall(rf"The special magic number for {re.escape(key)} is: (\d+)\.", body)
        assert len(values) == 1 and len(re.findall(r"magic number for", body)) == R.TASKS[task].keys
        return values[0]
    if task.startswith("variable_tracking"):
        env = dict(re.findall(r"VAR (\w+) = (?:VAR )?(\w+)\.", body))
        var, hops = re.search(r"value of VAR (\w+)\?", question).group(1), 0
        while not env[var].isdigit():
            var, hops = env[var], hops + 1
        assert hops == R.TASKS[task].hops
        return env[var]
    if task == "common_words":
        words = body.split("\n\n", 1)[1].split(", ")
        (first, count), (_, runner_up) = collections.Counter(w.strip() for w in words[:-1]).most_common(2)
        assert count > runner_up + 5
        return " " + first
    raise AssertionError(task)


def test_bad_specs_are_one_clear_error_each(tokenizer):
    with pytest.raises(ValueError, match=r"unknown recall task 'sorting'; known: niah_single, .*common_words"):
        R.TaskSpec("sorting", 1024)
    for depth in (-0.1, 1.5, math.nan):
        with pytest.raises(ValueError, match=r"depth must be in \[0, 1\]"):
            R.TaskSpec("niah_single", 1024, depth)
    spec = R.TaskSpec("niah_single", 9000)
    with pytest.raises(ValueError, match="context 9000 is longer than the model's context of 8192"):
        R.generate_samples(spec, tokenizer, max_context=8192)
    with pytest.raises(ValueError, match="samples must be >= 1"):
        R.TaskSpec("niah_single", 1024, samples=0)
    with pytest.raises(ValueError, match="context 40 is too short"):
        R.generate_samples(R.TaskSpec("niah_single", 40, samples=1), tokenizer)


def test_deterministic_and_pinned(tokenizer):
    spec = R.TaskSpec("niah_multikey_4", 512, 0.25, samples=3, seed=7)
    first, again = R.generate_samples(spec, tokenizer), R.generate_samples(spec, tokenizer)
    assert first == again and digest(first) == digest(again)
    # a different machine, Python version or tokenizer shows up here
    assert digest(first) == "7c89f317ced4f160d6aaa6c8a39a72e180626497ce26cd4c7b1282a77acd1898"
    assert len({tuple(s.prompt_ids) for s in first}) == 3
    other = R.generate_samples(R.TaskSpec("niah_multikey_4", 512, 0.25, samples=3, seed=8), tokenizer)
    assert {s.answer for s in other}.isdisjoint({s.answer for s in first})
    # one index holds the same facts in every cell of the grid (paired cells)
    moved = R.generate_samples(R.TaskSpec("niah_multikey_4", 1024, 0.75, samples=3, seed=7), tokenizer)
    assert [s.answer for s in moved] == [s.answer for s in first]


@pytest.mark.parametrize("task", list(R.TASKS))
def test_length_depth_and_answer(tokenizer, task):
    for context in (1024, 2048):
        for depth in (0.0, 0.35, 1.0):
            for sample in R.generate_samples(R.TaskSpec(task, context, depth, samples=2, seed=1), tokenizer):
                size = len(sample.prompt_ids)
                assert 0.99 * context <= size <= context, (size, context)
                text = tokenizer.decode(sample.prompt_ids)
                assert solve(text, task) == sample.answer
                full = tokenizer(text + sample.answer, add_special_tokens=False).input_ids
                assert full == sample.prompt_ids + sample.answer_ids
                start, end = sample.needle_token_start, sample.needle_token_end
                assert sample.answer.strip() in tokenizer.decode(sample.prompt_ids[start:end])
                filler = sample.haystack_token_end - sample.haystack_token_start
                if R.TASKS[task].positional:  # the share of the rest of the haystack before the needle is the depth,
                    #                           up to one filler unit and the distractors that precede it
                    where = (start - sample.haystack_token_start) / (filler - (end - start))
                    assert abs(where - depth) <= 0.05, (where, depth)
                    # what follows the needle is the rest of the filler, then the question: far from the end
                    assert size - end >= (1 - depth - 0.05) * (filler - (end - start))
                else:  # the answer's occurrences lie within depth +- spread of the list
                    spread = R.TASKS[task].spread
                    first, last = ((i - sample.haystack_token_start) / filler for i in (start, end))
                    assert depth - spread - 0.03 <= first <= last <= depth + spread + 0.03, (first, last, depth)


def test_words_are_single_tokens(tokenizer):
    for word in WORDS:
        assert len(tokenizer(" " + word, add_special_tokens=False).input_ids) == 1, word


def test_score_text():
    sample = R.RecallSample("x", "niah_single", 10, 0.5, 0, 0, [1, 2], "4820371", [5], 0, 1, 0, 2)
    assert R.score_text(sample, "4820371.")
    assert R.score_text(sample, " 4820371 is the number")
    assert R.score_text(sample, "4820371")
    assert not R.score_text(sample, "48203710")
    assert not R.score_text(sample, "The number is 4820371")
    assert not R.score_text(sample, "")
    word = R.RecallSample("y", "common_words", 10, 0.5, 0, 0, [1, 2], " apple", [5], 0, 1, 0, 2)
    assert R.score_text(word, " Apple.") and not R.score_text(word, " apples")


def brute_force_gold(logits, prompt_ids, answer_ids):
    logprob, ranks = 0.0, []
    for i, gold in enumerate(answer_ids):
        row = [float(v) for v in logits[len(prompt_ids) - 1 + i]]
        top = max(row)
        logprob += row[gold] - (top + math.log(sum(math.exp(v - top) for v in row)))
        ranks.append(1 + sum(v > row[gold] for v in row))
    return logprob, ranks


def test_gold_logprob_and_rank_against_brute_force():
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        vocab, prompt, answer = 11, int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(1, 5, (1,),
                                                                                                   generator=g))
        # small integers: ties everywhere, including with the gold token and at the top
        logits = torch.randint(-3, 3, (prompt + answer + trial % 2, vocab), generator=g).float()
        prompt_ids = torch.randint(0, vocab, (prompt,), generator=g).tolist()
        answer_ids = torch.randint(0, vocab, (answer,), generator=g).tolist()
        sample = R.RecallSample("t", "niah_single", 10, 0.5, 0, 0, prompt_ids, "", answer_ids, 0, 1, 0, 2)
        if trial % 3 == 0:
            got = R.gold_logprob_and_rank(logits[None], sample)
        elif trial % 3 == 1:  # only the rows from the last prompt position on, as logits_to_keep gives them
            got = R.gold_logprob_and_rank(logits[prompt - 1:], sample, start=prompt - 1)
        else:
            got = R.gold_logprob_and_rank(logits, sample)
        logprob, ranks = brute_force_gold(logits, prompt_ids, answer_ids)
        assert got["logprob"] == pytest.approx(logprob, abs=1e-5)
        assert got["mean_logprob"] == pytest.approx(logprob / answer, abs=1e-5)
        assert got["ranks"] == ranks and got["first_rank"] == ranks[0]
        assert got["first_token_hit"] == (ranks[0] == 1) and got["all_top1"] == all(r == 1 for r in ranks)
    with pytest.raises(ValueError, match="need the logits"):
        R.gold_logprob_and_rank(torch.zeros(2, 11), sample)
    with pytest.raises(ValueError, match="need the logits"):  # rows start after the last prompt position
        R.gold_logprob_and_rank(torch.zeros(20, 11), sample, start=len(sample.prompt_ids))
    with pytest.raises(ValueError, match="scores one sample"):
        R.gold_logprob_and_rank(torch.zeros(2, 9, 11), sample)


# ---------------------------------------------------------------------------------------------------- end to end
BUDGET = Budget(4, 32, 16)  # streaming: 4 sinks + the last 44 tokens; the needle sits >= 100 tokens back
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def needle_model(tokenizer):
    """The hand-set induction model over the niah prompts' real token ids, and those prompts (2 per depth)."""
    from tests.models import induction_model

    samples = [s for depth in (0.1, 0.5) for s in
               R.generate_samples(R.TaskSpec("niah_single", 256, depth, samples=2, seed=1), tokenizer)]
    digits = set(tokenizer.convert_tokens_to_ids([str(d) for d in range(10)]))
    space = tokenizer(" 1", add_special_tokens=False).input_ids[0]  # digits follow a lone space token
    model = induction_model(len(tokenizer), {i for s in samples for i in s.prompt_ids + s.answer_ids},
                            triggers=digits | {space}, sinks={tokenizer.bos_token_id})
    kvpop.retrofit(model, None, scorer=None, policy="dense")
    return model, samples


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def oracle_table(model, sample, window):
    """The dense teacher's future-attention targets over the prompt and its gold answer (the dense continuation),
    padded with -inf (never kept) to the generated length."""
    from kvpop.targets import teacher_pass

    targets = teacher_pass(model, torch.tensor([sample.prompt_ids + sample.answer_ids]), [window], top_k=1)
    targets = targets["targets"][window]
    table = torch.full((*targets.shape[:3], len(sample.prompt_ids) + NEW_TOKENS), float("-inf"))
    table[..., :targets.shape[-1]] = targets
    return table


def test_streaming_loses_the_needle_the_oracle_keeps_it(tokenizer, needle_model, one_thread):
    model, samples = needle_model
    generate = greedy_generate_fn(tokenizer, NEW_TOKENS)
    for sample in samples:  # far outside streaming's window
        assert len(sample.prompt_ids) - sample.needle_token_end > BUDGET.total

    kvpop.set_policy(model, "dense")
    assert all(R.score_text(s, t) for s, t in zip(samples, generate(model, [s.prompt_ids for s in samples])))
    with torch.no_grad():
        dense = [R.gold_logprob_and_rank(model(torch.tensor([s.prompt_ids + s.answer_ids])).logits, s)
                 for s in samples]
    assert all(g["all_top1"] for g in dense)

    kvpop.set_policy(model, "streaming", BUDGET)
    texts = generate(model, [s.prompt_ids for s in samples])
    assert not any(R.score_text(s, t) for s, t in zip(samples, texts)), texts
    with torch.no_grad():
        streaming = [R.gold_logprob_and_rank(model(torch.tensor([s.prompt_ids + s.answer_ids]),
                                                   use_cache=False).logits, s) for s in samples]
    assert not any(g["first_token_hit"] for g in streaming)
    assert all(g["logprob"] < d["logprob"] - 10 for g, d in zip(streaming, dense))

    kvpop.set_policy(model, "oracle", BUDGET)
    for sample in samples:
        with kvpop.oracle_priorities(model, oracle_table(model, sample, BUDGET.window)):
            assert R.score_text(sample, generate(model, [sample.prompt_ids])[0])

    # control: the same streaming budget retrieves a needle inside its window
    near = R.generate_samples(R.TaskSpec("niah_single", 256, 1.0, samples=2, seed=1), tokenizer)
    kvpop.set_policy(model, "streaming", Budget(4, 96, 0))
    assert all(len(s.prompt_ids) - s.needle_token_start < 96 for s in near)
    assert all(R.score_text(s, t) for s, t in zip(near, generate(model, [s.prompt_ids for s in near])))


def test_calibrate_measures_dense_and_restores_the_policy(tokenizer, needle_model, one_thread):
    model, _ = needle_model
    kvpop.set_policy(model, "streaming", BUDGET)
    specs = [R.TaskSpec("niah_single", 256, 0.3, samples=2, seed=1)]
    rows = calibrate(model, tokenizer, specs, generate_fn=greedy_generate_fn(tokenizer, NEW_TOKENS))
    assert model.kvpop_runtime.policy.name == "streaming"
    (row,) = rows
    assert (row["task"], row["context"], row["depth"], row["samples"]) == ("niah_single", 256, 0.3, 2)
    assert row["exact"] == 1.0 and row["all_top1"] == 1.0 and row["first_token_hit"] == 1.0 and row["usable"]
    assert [item["exact"] for item in row["items"]] == [True, True]
    batched = calibrate(model, tokenizer, specs, generate_fn=greedy_generate_fn(tokenizer, NEW_TOKENS, batch_size=2),
                        batch_size=2)  # left-padded generation, right-padded teacher forcing: the same scores
    for one, two in zip(row["items"], batched[0]["items"]):
        assert {**two, "logprob": pytest.approx(one["logprob"], abs=1e-4)} == one
    with pytest.raises(ValueError, match="longer than the model's context of 1024"):
        calibrate(model, tokenizer, [R.TaskSpec("niah_single", 2048)], generate_fn=None)


# ---------------------------------------------------------------------------------------------------- the CLI
def test_calibrate_cli_writes_once_and_refuses_bad_specs(tokenizer, tmp_path, capsys, one_thread):
    from jobs.calibrate import main
    from tests.models import save_tiny_teacher

    save_tiny_teacher(tmp_path / "model", tokenizer)  # a random tiny Llama: dense accuracy is whatever it is
    args = ["--set", f"model.path={tmp_path / 'model'}", "--set", f"home={tmp_path / 'home'}",
            "--tasks", "niah_single,common_words", "--contexts", "160", "--depths", "0.5", "--samples", "1",
            "--max-new-tokens", "3"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "niah_single" in printed and "common_words" in printed and "cells usable" in printed
    (written,) = (tmp_path / "home" / "calibration").glob("*/calibration.json")
    rows = json.loads(written.read_text())["rows"]
    assert [(r["task"], r["context"], r["depth"], r["samples"]) for r in rows] == [
        ("niah_single", 160, 0.5, 1), ("common_words", 160, 0.5, 1)]
    assert main(args) == 0 and f"found in {written.parent}" in capsys.readouterr().out

    def exit_code(argv):
        try:
            return main(argv)
        except SystemExit as stop:  # argparse's own errors exit from inside, with the same contract
            return stop.code

    for bad, message in ((["--depths", "1.5"], "depth must be in [0, 1]"),
                         (["--tasks", "sorting"], "unknown recall task 'sorting'"),
                         (["--contexts", "4096"], "longer than the model's context of 1024"),
                         (["--contexts", "x"], "comma-separated list of int")):
        assert exit_code(args + bad) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
