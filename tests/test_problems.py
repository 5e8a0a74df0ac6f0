"""pipelines.problems: final-answer extraction and matching; held-out problems first, numeric ones first."""
import pytest

from pipelines import problems as P


def test_extract_answer():
    assert P.extract_answer("so it is \\boxed{42}.") == "42"
    assert P.extract_answer("first \\boxed{1} then \\boxed{\\frac{3}{4}} done") == "\\frac{3}{4}"  # last, nested
    assert P.extract_answer("The total is 1,234 apples, or 7 boxes") == "7"  # no box: the last number
    assert P.extract_answer("value -3.5") == "-3.5"
    assert P.extract_answer("\\boxed{12") == "12"  # an unclosed box: the last number
    assert P.extract_answer("no digits here") is None


def test_same_answer():
    assert P.same_answer("252", " 252.") and P.same_answer("1,234", "1234") and P.same_answer("0.5", ".5")
    assert P.same_answer("$76$", "76") and not P.same_answer("76", "77")
    assert P.same_answer("2^(n-1)", "2^(n - 1)") and not P.same_answer("2^(n-1)", "2^n")
    assert not P.same_answer(None, "1") and not P.same_answer("1", None)


def test_load_problems_order():
    problems = P.load_problems(270)
    ids = [p.id for p in problems]
    assert len(set(ids)) == 270 and P.load_problems(270) == problems  # deterministic
    numeric = [p.numeric for p in problems]
    assert numeric == sorted(numeric, reverse=True)  # numeric answers first
    seen_doc = f"{ids[0]}/GPT-3.5|0-Shot"
    again = P.load_problems(270, training_docs=[seen_doc])
    assert again[-1].id == ids[0] and again[-1].seen_in_training and not any(p.seen_in_training for p in again[:-1])
    assert P.load_problems(5, seed=1) != P.load_problems(5, seed=0)
    with pytest.raises(ValueError, match="only 270 problems"):
        P.load_problems(271)


@pytest.mark.pretrained
def test_prompt_is_the_chat_template(smollm2_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    problem = P.load_problems(1)[0]
    ids = P.prompt_ids(problem, tokenizer)
    text = tokenizer.decode(ids)
    assert problem.text in text and "\\boxed{}" in text and text.rstrip().endswith("assistant")
