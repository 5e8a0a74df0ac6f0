"""pipelines.store: header and manifest records, the commit rules, the one-writer lock, and directories written
before the store had its own module (schema v1 as the precompute stage wrote it then) still read. No Ray here."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from pipelines import store

IDENTITY = {"kind": "kvpop.targets", "schema_version": store.SCHEMA_VERSION,
            "teacher": {"name": "t", "weights_sha256": "a" * 64, "dtype": "float32"}, "data": "d" * 16,
            "split": "train", "seq_len": 6, "windows": [2], "top_k": 3, "group_reduce": "max",
            "sequences_per_shard": 2, "num_layers": 1, "num_kv_heads": 2, "vocab_size": 11}


def _rows(n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"input_ids": rng.integers(0, 11, (n, 6)).astype(np.int32),
            "targets_w2": rng.standard_normal((n, 1, 2, 6)).astype(np.float32),
            "topk_values": rng.standard_normal((n, 6, 3)).astype(np.float32),
            "topk_indices": rng.integers(0, 11, (n, 6, 3)).astype(np.int32)}


def _header(ids=(("s0", "s1"), ("s2",))) -> store.Header:
    plan = tuple(store.ShardPlan(i, store.shard_name(i), tuple(shard)) for i, shard in enumerate(ids))
    return store.Header(IDENTITY, "k" * 16, plan, "/models/t", ("id", "input_ids", "targets_w2", "topk_values",
                                                                "topk_indices"), "2026-12-01T00:00:00")


def _write(folder, header: store.Header) -> None:
    with store.writing(folder, header) as writer:
        for entry in header.plan:
            name, size, digest = store.write_shard(folder, entry.shard, store.shard_table(
                entry.ids, _rows(len(entry.ids), entry.shard), header.key))
            writer.commit(store.ShardRecord(entry.shard, name, len(entry.ids), entry.ids, size, digest))


def test_a_written_directory_reads_back_verified(tmp_path):
    _write(tmp_path, _header())
    targets = store.open_targets(tmp_path, expect={"seq_len": 6, "top_k": 3}, windows=[2])
    assert targets.ids == ["s0", "s1", "s2"] and targets.num_rows == 3 and targets.key == "k" * 16
    table = targets.read_table(["topk_indices"])
    np.testing.assert_array_equal(table.column("topk_indices").combine_chunks().to_numpy_ndarray()[2],
                                  _rows(1, 1)["topk_indices"][0])
    assert store.Header.read(tmp_path) == _header()


def test_a_directory_written_before_the_store_module_is_still_read(tmp_path):
    """The JSON exactly as the old precompute stage wrote it (plain dicts, its own key order)."""
    header = _header()
    rows = {}
    for entry in header.plan:
        name, size, digest = store.write_shard(tmp_path, entry.shard, store.shard_table(
            entry.ids, _rows(len(entry.ids), entry.shard), header.key))
        rows[entry.shard] = {"shard": entry.shard, "file": name, "rows": len(entry.ids), "ids": list(entry.ids),
                             "bytes": size, "sha256": digest, "teacher_s": 1.5, "write_s": 0.1, "host": "h:1",
                             "time": "2026-11-30T10:00:00"}
    old_header = {"identity": IDENTITY, "key": header.key,
                  "plan": [{"shard": e.shard, "file": e.file, "ids": list(e.ids)} for e in header.plan],
                  "model_path": header.model_path, "columns": list(header.columns), "created": header.created}
    (tmp_path / store.HEADER).write_text(json.dumps(old_header, indent=1))
    (tmp_path / store.MANIFEST).write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows.values()))
    targets = store.open_targets(tmp_path, windows=[2])
    assert targets.header == header and targets.records[0].teacher_s == 1.5
    # and a writer resuming it keeps it as it is
    with store.writing(tmp_path, header) as writer:
        assert store.committed_shards(writer.folder, writer.header.plan) == {0, 1}


def test_a_torn_manifest_line_is_not_committed_and_is_cut_by_the_next_writer(tmp_path):
    _write(tmp_path, _header())
    manifest = tmp_path / store.MANIFEST
    whole = manifest.read_text()
    manifest.write_text(whole + '{"shard": 1, "fi')
    assert sorted(store.read_manifest(tmp_path)) == [0, 1]
    with store.writing(tmp_path, _header()):
        assert manifest.read_text() == whole


@pytest.mark.parametrize("content", ["[1, 2", "[1, 2]", "{}", '{"identity": 3, "key": "k", "plan": 4}', "\x00\xff"])
def test_a_garbage_header_is_one_line_for_readers_and_writers(tmp_path, content):
    (tmp_path / store.HEADER).write_text(content)
    for attempt in (lambda: store.open_targets(tmp_path), lambda: store.writing(tmp_path, _header()).__enter__()):
        with pytest.raises(store.TargetsError, match="is not a target header") as err:
            attempt()
        assert "\n" not in str(err.value)
    assert (tmp_path / store.HEADER).read_text() == content  # nothing rewritten


def test_another_configurations_header_is_refused(tmp_path):
    _write(tmp_path, _header())
    with pytest.raises(store.TargetsError, match="holds targets of another configuration"):
        with store.writing(tmp_path, _header(ids=(("x",),))):
            pass


def test_a_second_writer_is_refused_at_once(tmp_path):
    with store.writing(tmp_path, _header()):
        with pytest.raises(store.TargetsError, match="another precompute is writing") as err:
            with store.writing(tmp_path, _header()):
                pass
        assert "\n" not in str(err.value)
    with store.writing(tmp_path, _header()):  # released with the first writer
        pass


def test_identity_fields_are_checked_one_by_one(tmp_path):
    _write(tmp_path, _header())
    cases = [({"teacher": {**IDENTITY["teacher"], "weights_sha256": "b" * 64}}, "another teacher"),
             ({"teacher": {**IDENTITY["teacher"], "dtype": "bfloat16"}}, "another model.dtype \\('float32'"),
             ({"seq_len": 8}, "sequences of 6 tokens"), ({"top_k": 4}, "another precompute.top_k \\(3, this config: 4\\)"),
             ({"group_reduce": "mean"}, "another precompute.group_reduce"), ({"data": "e" * 16}, "another data")]
    for expect, message in cases:
        with pytest.raises(store.TargetsError, match=message):
            store.open_targets(tmp_path, expect=expect)
    with pytest.raises(store.TargetsError, match="not budget.window=4"):
        store.open_targets(tmp_path, windows=[4])
    # query_power (METHOD §2) came later: a directory without it holds β = 1 targets, refused to a β = 8 reader
    with pytest.raises(store.TargetsError, match="another precompute.query_power \\(1.0, this config: 8.0\\)"):
        store.open_targets(tmp_path, expect={"query_power": 8.0})
    store.open_targets(tmp_path, expect={"query_power": 1.0})
    # the name of the teacher's folder is not its identity
    store.open_targets(tmp_path, expect={"teacher": {**IDENTITY["teacher"], "name": "moved"}})


def test_targets_of_another_query_power_are_refused(tmp_path):
    """Targets made with β = 8 are another target set: a reader whose config has the default β = 1 (stated in its
    training identity though left out of its directory's) refuses them, one with β = 8 reads them."""
    _write(tmp_path, dataclasses.replace(_header(), identity={**IDENTITY, "query_power": 8.0}))
    with pytest.raises(store.TargetsError, match="another precompute.query_power \\(8.0, this config: 1.0\\)"):
        store.open_targets(tmp_path, expect={"query_power": 1.0})
    store.open_targets(tmp_path, expect={"query_power": 8.0})


def test_training_identity_states_the_default_query_power(tmp_path, monkeypatch):
    from pipelines.config import load_config

    monkeypatch.setattr(store, "target_identity", lambda cfg, tokenizer=None: {
        "top_k": cfg.precompute.top_k, "windows": [2], **cfg.precompute.optional_settings()})
    plain = load_config(None, [f"home={tmp_path}"])
    assert "query_power" not in store.target_identity(plain)  # the directory key of β = 1 targets is unchanged
    assert store.training_identity(plain) == {"top_k": plain.precompute.top_k, "query_power": 1.0}
    powered = load_config(None, [f"home={tmp_path}", "precompute.query_power=8"])
    assert store.training_identity(powered)["query_power"] == 8.0
