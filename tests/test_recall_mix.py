"""data.recall_mix: facts and a question planted into training sequences only (pipelines/planted.py, data.py)."""
from __future__ import annotations

import dataclasses
import math
import random
import re

import pytest

from pipelines import data, planted, records
from pipelines.config import ConfigError, fingerprint, load_config
from pipelines.identity import tokenizer_digest
from pipelines.recall import haystack
from tests.models import write_docs

pytestmark = pytest.mark.pretrained  # the SmolLM2 tokenizer

SEQ_LEN = 128  # about the shortest S that holds three facts and a question with SmolLM2's tokenizer


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)


@pytest.fixture(scope="module")
def planter(tokenizer):
    return planted.Planter(tokenizer, SEQ_LEN)


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "docs.jsonl"
    write_docs(path, 40)
    return path


def _cfg(tmp_path, source, *extra):
    return load_config(None, [f"home={tmp_path / 'home'}", f"data.source={source}", f"data.seq_len={SEQ_LEN}",
                              "data.num_sequences=6", "data.eval_sequences=2", "budget.window=8", "budget.topk=16",
                              "precompute.windows=[8]", *extra])


def _find(ids: list[int], piece: list[int]) -> list[int]:
    return [i for i in range(len(ids) - len(piece) + 1) if ids[i:i + len(piece)] == piece]


def _question(planter: planted.Planter, template, name: str, place: str) -> list[int]:
    return planter.questions[template, name] + planter.places[place] + planter.answer_end


def _parse(planter: planted.Planter, ids: list[int]) -> dict:
    """The planted question (its template, name, place, start) and every fact of its template (start, name, place)."""
    (template, name, place), = [(t, n, p) for t, n in planter.questions for p in planter.places
                                if ids[-len(_question(planter, t, n, p)):] == _question(planter, t, n, p)]
    facts = [(start, n, p) for n in planted.NAMES for p, place_ids in planter.places.items()
             for start in _find(ids, planter.facts[template, n] + place_ids + planter.fact_end)]
    return {"template": template, "name": name, "place": place,
            "question_start": len(ids) - len(_question(planter, template, name, place)), "facts": sorted(facts)}


def _corpus_left(planter: planted.Planter, ids: list[int], found: dict) -> list[int]:
    """``ids`` without the planted facts and question."""
    planted_at = set(range(found["question_start"], len(ids)))
    for start, name, place in found["facts"]:
        length = len(planter.facts[found["template"], name] + planter.places[place] + planter.fact_end)
        planted_at |= set(range(start, start + length))
    return [t for i, t in enumerate(ids) if i not in planted_at]


def test_recall_mix_zero_keeps_the_sequences_and_every_key(tmp_path, corpus, tokenizer):
    cfg = _cfg(tmp_path, corpus)
    assert cfg == _cfg(tmp_path, corpus, "data.recall_mix=0")
    d = cfg.data
    old_formula = fingerprint("kvpop.sequences", data.DATA_FORMAT_VERSION, data.source_identity(cfg), d.text_field,
                              d.id_field, d.split, d.seq_len, d.num_sequences, d.eval_sequences, d.packing, d.seed,
                              tokenizer_digest(tokenizer))
    assert data.data_fingerprint(cfg, tokenizer) == old_formula
    # the records' keys hash the data section whole: without the settings that came later (recall_mix, the data
    # mix) at their default
    without = {k: v for k, v in dataclasses.asdict(d).items() if k not in d.OPTIONAL}
    assert fingerprint(d) == fingerprint(without) != fingerprint(dataclasses.replace(d, recall_mix=0.5))
    assert records.precompute_key(cfg) == fingerprint("precompute", cfg.model, without, [8], cfg.precompute.top_k,
                                                      cfg.precompute.group_reduce, cfg.precompute.sequences_per_shard)
    built = data.build_sequences(data.load_documents(cfg), tokenizer, seq_len=SEQ_LEN, num_train=6, num_eval=2)
    for split in data.SPLITS:
        assert data.load_sequences(cfg, split, tokenizer) == built[split]


def test_recall_mix_plants_a_fraction_of_the_training_sequences_only(tmp_path, corpus, tokenizer, planter):
    plain_cfg = _cfg(tmp_path, corpus)
    cfg = _cfg(tmp_path, corpus, "data.recall_mix=0.5")
    assert data.data_fingerprint(cfg, tokenizer) != data.data_fingerprint(plain_cfg, tokenizer)
    plain = data.load_sequences(plain_cfg, "train", tokenizer)
    train = data.load_sequences(cfg, "train", tokenizer)
    assert data.load_sequences(cfg, "eval", tokenizer) == data.load_sequences(plain_cfg, "eval", tokenizer)
    again = data.plant_recall(plain, tokenizer, fraction=0.5, seed=0)
    assert again == train  # deterministic: a fresh build plants the same
    changed = [i for i, (a, b) in enumerate(zip(plain, train)) if a != b]
    assert len(changed) == round(0.5 * 6)
    assert all(len(s["input_ids"]) == SEQ_LEN for s in train)
    first, last = math.ceil(0.05 * SEQ_LEN), SEQ_LEN // 2
    for i in changed:
        before, after = plain[i], train[i]
        found = _parse(planter, after["input_ids"])
        assert after["docs"] == before["docs"] + [f"planted:{found['name']}"]
        assert 1 <= len(found["facts"]) <= planted.MAX_FACTS
        assert len({n for _, n, _ in found["facts"]}) == len(found["facts"])
        asked = [start for start, n, p in found["facts"] if (n, p) == (found["name"], found["place"])]
        assert len(asked) == 1  # the answer's tokens: in the asked fact and at the very end
        assert all(first <= start <= last for start, _, _ in found["facts"])
        left = _corpus_left(planter, after["input_ids"], found)
        assert left == before["input_ids"][:len(left)]  # only the corpus tail before the question is dropped
    assert all(not s["docs"][-1].startswith("planted:") for i, s in enumerate(train) if i not in changed)


def test_every_draw_fits_its_span_and_keeps_the_length(planter):
    corpus_ids = list(range(100_000, 100_000 + SEQ_LEN))  # ids no planted piece uses
    counts = set()
    for seed in range(200):
        ids, name = planter.plant(corpus_ids, random.Random(seed))
        found = _parse(planter, ids)
        assert len(ids) == SEQ_LEN and found["name"] == name
        assert all(planter.first <= start <= planter.last for start, _, _ in found["facts"])
        left = _corpus_left(planter, ids, found)
        assert [t for t in ids if t >= 100_000] == left == corpus_ids[:len(left)]
        counts.add(len(found["facts"]))
    assert counts == set(range(1, planted.MAX_FACTS + 1))


@pytest.mark.parametrize("value", [-0.1, 1.5])
def test_recall_mix_outside_zero_to_one_is_one_clear_error(tmp_path, value):
    with pytest.raises(ConfigError, match=r"data.recall_mix must be in \[0, 1\]") as err:
        load_config(None, [f"home={tmp_path}", f"data.recall_mix={value}"])
    assert "\n" not in str(err.value)


def test_too_short_sequences_are_one_clear_error(tmp_path, corpus, tokenizer):
    cfg = load_config(None, [f"home={tmp_path / 'home'}", f"data.source={corpus}", "data.seq_len=64",
                             "data.num_sequences=6", "data.eval_sequences=2", "budget.window=8", "budget.topk=16",
                             "precompute.windows=[8]", "data.recall_mix=1"])
    with pytest.raises(ConfigError, match="data.seq_len=64 is too short"):
        data.load_sequences(cfg, "train", tokenizer)
    assert not list((tmp_path / "home").rglob("meta.json"))


def test_planted_vocabulary_is_disjoint_from_the_recall_tasks():
    assert len(set(planted.NAMES)) == len(planted.NAMES) >= 40
    assert len(set(planted.PLACES)) == len(planted.PLACES) >= 40
    assert not set(planted.NAMES) & set(planted.PLACES)
    recall_words = set(haystack.WORDS) | set(haystack.ADJECTIVES)
    texts = [*planted.NAMES, *planted.PLACES, planted.FACT, planted.FACT_END, planted.QUESTION, planted.ANSWER_END,
             *(part for template in planted.TEMPLATES for part in template)]
    words = {w.lower() for text in texts for w in re.findall(r"[A-Za-z]+", text)}
    assert not words & recall_words
    assert not any(ch.isdigit() for text in texts for ch in text)
    assert not words & {"magic", "special", "number", "memorize", "memorise", "var", "value", "quiz"}
