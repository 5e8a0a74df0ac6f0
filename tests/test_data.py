"""pipelines.data: sources → tokenizer → fixed-length sequences, split by document, cached. No Ray here."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from pipelines import data
from pipelines.config import REPO_ROOT, ConfigError, load_config
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
    ("hub", "is not a local file or folder, and a hub dataset name is read only from the local Hugging Face cache"),
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


# ----------------------------------------------------------------------------------------------- the training mix
@pytest.fixture
def mix_corpus(tmp_path):
    path = tmp_path / "other.jsonl"
    write_docs(path, 30, seed=11, min_words=40, max_words=90)
    return path


def test_a_mix_appends_the_mix_corpus_own_training_split_and_never_its_held_out_documents(tmp_path, corpus,
                                                                                           mix_corpus, tokenizer):
    cfg = _cfg(tmp_path, corpus[0], f"data.mix_source={mix_corpus}", "data.mix_sequences=3")
    plain = _cfg(tmp_path, corpus[0])
    alone = _cfg(tmp_path, mix_corpus, "data.num_sequences=5")  # the mix corpus built on its own, a larger pool
    train = data.load_sequences(cfg, "train", tokenizer)
    own = data.load_sequences(plain, "train", tokenizer)
    theirs = {split: data.load_sequences(alone, split, tokenizer) for split in data.SPLITS}
    assert train[:6] == own  # the source's training split first, unchanged
    assert [r["input_ids"] for r in train[6:]] == [r["input_ids"] for r in theirs["train"][:3]]
    assert [r["docs"] for r in train[6:]] == [r["docs"] for r in theirs["train"][:3]]
    assert [r["id"] for r in train[6:]] == ["mix-train-000000", "mix-train-000001", "mix-train-000002"]
    assert len({r["id"] for r in train}) == len(train)
    held_out = {d for r in theirs["eval"] for d in r["docs"]}
    assert held_out and held_out.isdisjoint(d for r in train[6:] for d in r["docs"])
    assert data.load_sequences(cfg, "eval", tokenizer) == data.load_sequences(plain, "eval", tokenizer)
    assert data.mix_config(cfg).data == dataclasses.replace(alone.data, num_sequences=3)
    # read back from its own cache, which differs from the plain config's
    assert data.sequences_dir(cfg, tokenizer) != data.sequences_dir(plain, tokenizer)
    assert data.load_sequences(cfg, "train", tokenizer) == train


def test_the_mix_is_keyed_by_its_content_and_size(tmp_path, corpus, mix_corpus, tokenizer):
    cfg = _cfg(tmp_path, corpus[0], f"data.mix_source={mix_corpus}", "data.mix_sequences=3")
    fp = data.data_fingerprint(cfg, tokenizer)
    assert data.data_fingerprint(_cfg(tmp_path, corpus[0], f"data.mix_source={mix_corpus}",
                                      "data.mix_sequences=2"), tokenizer) != fp
    moved = tmp_path / "elsewhere" / mix_corpus.name
    moved.parent.mkdir()
    moved.write_bytes(mix_corpus.read_bytes())
    assert data.data_fingerprint(_cfg(tmp_path, corpus[0], f"data.mix_source={moved}", "data.mix_sequences=3"),
                                 tokenizer) == fp  # the same documents elsewhere: the same cache
    write_docs(moved, 30, seed=12)
    assert data.data_fingerprint(_cfg(tmp_path, corpus[0], f"data.mix_source={moved}", "data.mix_sequences=3"),
                                 tokenizer) != fp


def test_relative_sources_are_read_from_the_commands_directory_in_every_process(tmp_path, corpus, mix_corpus,
                                                                                tokenizer, monkeypatch):
    """A relative corpus path is relative to where the command ran: ``$KVPOP_WORKDIR`` (what the driver hands its
    Ray workers: Ray Train runs them in folders of its own), else the cwd; the config keeps the path as written, and
    the cache is the one of the same files spelled absolute."""
    from pipelines.config import WORKDIR_ENV, config_path, env_home

    monkeypatch.delenv(WORKDIR_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    cfg = _cfg(tmp_path, corpus[0].name, f"data.mix_source={mix_corpus.name}", "data.mix_sequences=3")
    assert (cfg.data.source, cfg.data.mix_source) == (corpus[0].name, mix_corpus.name)
    assert env_home(cfg)[WORKDIR_ENV] == str(tmp_path)  # what the workers are told
    absolute = _cfg(tmp_path, corpus[0], f"data.mix_source={mix_corpus}", "data.mix_sequences=3")
    fp = data.data_fingerprint(absolute, tokenizer)
    assert data.data_fingerprint(cfg, tokenizer) == fp
    # a worker that runs in another directory: lost without the driver's, found with it
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    with pytest.raises(ConfigError, match="does not exist"):
        data.data_fingerprint(cfg, tokenizer)
    monkeypatch.setenv(WORKDIR_ENV, str(tmp_path))
    assert data.data_fingerprint(cfg, tokenizer) == fp
    assert data.load_sequences(cfg, "train", tokenizer) == data.load_sequences(absolute, "train", tokenizer)
    assert config_path("a/b") == tmp_path / "a" / "b" and config_path(mix_corpus) == mix_corpus
    assert config_path("~/a") == Path.home() / "a"


def test_an_unset_mix_keeps_every_key_of_an_existing_config(tmp_path, corpus, tokenizer):
    """Computed from the config with the mix fields absent (the formula and the keys before they existed)."""
    from pipelines import records
    from pipelines.config import fingerprint
    from pipelines.identity import tokenizer_digest

    cfg = _cfg(tmp_path, corpus[0])
    assert cfg == _cfg(tmp_path, corpus[0], "data.mix_source=null", "data.mix_sequences=0")
    d = cfg.data
    old_formula = fingerprint("kvpop.sequences", data.DATA_FORMAT_VERSION, data.source_identity(cfg), d.text_field,
                              d.id_field, d.split, d.seq_len, d.num_sequences, d.eval_sequences, d.packing, d.seed,
                              tokenizer_digest(tokenizer))
    assert data.data_fingerprint(cfg, tokenizer) == old_formula
    without = {k: v for k, v in dataclasses.asdict(d).items() if k not in ("recall_mix", "mix_source", "mix_sequences")}
    assert fingerprint(d) == fingerprint(without)
    # the keys (and so the output paths) recorded before the mix existed, of the default and a GPU preset
    for preset, keys in [(None, ("d542729fc5eab609", "88b77ff0c28d9e54", "b9fe1770e582e013")),
                         (REPO_ROOT / "tests" / "fixtures" / "gpu_preset_before_mix.yaml",
                          ("63c59da8cffcb1a3", "792bc93dfeb74515", "10bda3d0572738c4"))]:
        old = load_config(preset, ["home=/tmp/h", "model.path=/nowhere/teacher"])
        assert (records.precompute_key(old), records.train_key(old), records.evaluate_key(old)) == keys, preset


@pytest.mark.parametrize("extra, message", [
    (["data.mix_sequences=3"], "data.mix_source and data.mix_sequences go together"),
    (["data.mix_source=MIX"], "data.mix_source and data.mix_sequences go together"),
    (["data.mix_source=MIX", "data.mix_sequences=-1"], "data.mix_source and data.mix_sequences go together"),
    (["data.mix_source=SOURCE", "data.mix_sequences=3"], "is data.source itself"),
])
def test_a_bad_mix_is_refused_in_one_line(tmp_path, corpus, mix_corpus, extra, message):
    extra = [e.replace("MIX", str(mix_corpus)).replace("SOURCE", str(corpus[0])) for e in extra]
    with pytest.raises(ConfigError, match=message) as err:
        _cfg(tmp_path, corpus[0], *extra)
    assert "\n" not in str(err.value)


def test_a_mix_corpus_too_small_or_missing_names_the_mix(tmp_path, corpus, mix_corpus, tokenizer):
    cfg = _cfg(tmp_path, corpus[0], f"data.mix_source={mix_corpus}", "data.mix_sequences=500")
    with pytest.raises(ConfigError, match="data.mix_source yields only .* lower data.mix_sequences") as err:
        data.load_sequences(cfg, "train", tokenizer)
    assert "\n" not in str(err.value)
    missing = _cfg(tmp_path, corpus[0], f"data.mix_source={tmp_path / 'nope.jsonl'}", "data.mix_sequences=2")
    with pytest.raises(ConfigError, match="data.mix_source .*nope.jsonl' does not exist"):
        data.check_inputs(missing)
    with pytest.raises(ConfigError, match="data.mix_source .*nope.jsonl' does not exist"):
        data.data_fingerprint(missing, tokenizer)
