"""pipelines.data: sources → tokenizer → fixed-length sequences, split by document, cached. No Ray here."""
from __future__ import annotations

import json

import pytest

from pipelines import data
from pipelines.config import ConfigError, load_config
from tests.models import write_docs

pytestmark = pytest.mark.pretrained  # the SmolLM2 tokenizer


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "docs.jsonl"
    rows = write_docs(path, 40)
    return path, rows


def _cfg(tmp_path, source, *extra):
    return load_config(None, [f"home={tmp_path / 'home'}", f"data.source={source}", "data.seq_len=64",
                              "data.num_sequences=6", "data.eval_sequences=2", "budget.window=8", "budget.topk=16",
                              "precompute.windows=[8]", *extra])


def test_sequences_have_fixed_length_stable_ids_and_disjoint_documents(tmp_path, corpus, tokenizer):
    cfg = _cfg(tmp_path, corpus[0], "data.id_field=doc")
    train = data.load_sequences(cfg, "train", tokenizer)
    held = data.load_sequences(cfg, "eval", tokenizer)
    assert [s["id"] for s in train] == [f"train-{i:06d}" for i in range(6)]
    assert [s["id"] for s in held] == ["eval-000000", "eval-000001"]
    assert all(len(s["input_ids"]) == 64 for s in train + held)
    train_docs = {d for s in train for d in s["docs"]}
    assert train_docs.isdisjoint({d for s in held for d in s["docs"]})
    assert train_docs <= {r["doc"] for r in corpus[1]}
    # packing: the documents are joined with EOS, so the EOS token occurs inside sequences
    assert any(tokenizer.eos_token_id in s["input_ids"] for s in train)


def test_cache_is_read_back_without_touching_the_source(tmp_path, corpus, tokenizer, monkeypatch):
    cfg = _cfg(tmp_path, corpus[0])
    first = data.load_sequences(cfg, "train", tokenizer)
    assert (data.sequences_dir(cfg, tokenizer) / "meta.json").is_file()
    monkeypatch.setattr(data, "load_documents", lambda cfg: pytest.fail("the cache should have been used"))
    assert data.load_sequences(cfg, "train", tokenizer) == first


def test_each_split_only_depends_on_its_own_size(tmp_path, corpus, tokenizer):
    base = data.load_sequences(_cfg(tmp_path, corpus[0]), "train", tokenizer)
    more_eval = data.load_sequences(_cfg(tmp_path, corpus[0], "data.eval_sequences=3"), "train", tokenizer)
    fewer = data.load_sequences(_cfg(tmp_path, corpus[0], "data.num_sequences=4"), "train", tokenizer)
    assert [s["input_ids"] for s in more_eval] == [s["input_ids"] for s in base]
    assert [s["input_ids"] for s in fewer] == [s["input_ids"] for s in base[:4]]
    other_seed = data.load_sequences(_cfg(tmp_path, corpus[0], "data.seed=1"), "train", tokenizer)
    assert [s["input_ids"] for s in other_seed] != [s["input_ids"] for s in base]


def test_truncation_keeps_the_first_tokens_of_long_documents(tmp_path, tokenizer):
    path = tmp_path / "long.jsonl"
    write_docs(path, 30, min_words=70, max_words=90)
    cfg = _cfg(tmp_path, path, "data.packing=false", "data.id_field=doc")
    rows = {json.loads(line)["doc"]: json.loads(line)["text"] for line in path.read_text().splitlines()}
    for seq in data.load_sequences(cfg, "train", tokenizer):
        (doc,) = seq["docs"]
        assert seq["input_ids"] == tokenizer(rows[doc], add_special_tokens=False).input_ids[:64]


def test_parquet_and_save_to_disk_sources_give_the_same_sequences(tmp_path, corpus, tokenizer):
    import datasets

    table = datasets.Dataset.from_list(corpus[1])
    table.to_parquet(str(tmp_path / "docs.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    want = data.load_sequences(_cfg(tmp_path, corpus[0], "data.id_field=doc"), "train", tokenizer)
    for source in (tmp_path / "docs.parquet", tmp_path / "saved"):
        got = data.load_sequences(_cfg(tmp_path, source, "data.id_field=doc"), "train", tokenizer)
        assert got == want


def test_champ_corpus_is_the_default(tmp_path, tokenizer):
    cfg = load_config(None, [f"home={tmp_path}", "data.num_sequences=2", "data.eval_sequences=1"])
    assert cfg.data.source == "champ"
    train = data.load_sequences(cfg, "train", tokenizer)
    held = data.load_sequences(cfg, "eval", tokenizer)
    assert len(train) == 2 and len(held) == 1 and len(train[0]["input_ids"]) == cfg.data.seq_len
    assert all("/" in d for s in train for d in s["docs"])  # "<problem>/<transcript>"
    assert {d for s in train for d in s["docs"]}.isdisjoint({d for s in held for d in s["docs"]})


@pytest.mark.parametrize("case, message", [
    ("missing", "does not exist"),
    ("no_text", "has no column 'text'"),
    ("empty", "no documents"),
    ("too_small", "fewer than the"),
    ("hub", "could not be loaded from the Hugging Face hub"),
])
def test_bad_sources_fail_with_one_clear_error(tmp_path, tokenizer, case, message):
    extra = []
    if case == "missing":
        source = tmp_path / "nope.jsonl"
    elif case == "no_text":
        source = tmp_path / "x.jsonl"
        source.write_text(json.dumps({"body": "hello"}) + "\n")
    elif case == "empty":
        source = tmp_path / "empty.jsonl"
        source.write_text(json.dumps({"text": ""}) + "\n")
    elif case == "too_small":
        source = tmp_path / "small.jsonl"
        write_docs(source, 3)
    else:
        source = "someorg/surely-not-a-dataset"
    cfg = _cfg(tmp_path, source, *extra)
    with pytest.raises(ConfigError, match=message):
        data.load_sequences(cfg, "train", tokenizer)
    assert not (tmp_path / "home" / "data").exists() or not any((tmp_path / "home" / "data").rglob("meta.json"))
