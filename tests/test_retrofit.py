"""retrofit / save / load, and the errors a user sees when something does not fit."""
import json
import shutil

import pytest
import torch
from torch import nn

import kvpop
from kvpop import Budget
from kvpop.files import tensors_digest, weights_digest
from kvpop.retrofit import saved_model_config
from tests.models import tiny_model


def test_save_and_load_round_trip(tmp_path):
    model = tiny_model("qwen3", "gqa")
    kvpop.retrofit(model, Budget(2, 6, 9), scorer="mlstm", recency=0.01)
    with torch.no_grad():
        for p in kvpop.scorers(model).parameters():
            p.add_(torch.randn_like(p) * 0.1)  # not the init: the weights must really travel
    ids = torch.randint(1, 97, (2, 40))
    with torch.no_grad():
        before = model(ids, use_cache=False).logits
    kvpop.save_retrofitted(model, tmp_path / "m")
    meta = json.loads((tmp_path / "m" / "kvpop.json").read_text())
    assert meta["budget"] == {"sink": 2, "window": 6, "topk": 9} and meta["scorer"]["name"] == "mlstm"
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert "kvpop" not in json.dumps(config), "the base folder must load without KVpop"
    loaded, _ = kvpop.load_retrofitted(tmp_path / "m")
    with torch.no_grad():
        after = loaded(ids, use_cache=False).logits
    assert torch.equal(before, after)
    assert loaded.kvpop_runtime.policy.recency == 0.01
    # the base weights alone load with plain transformers
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "m", local_files_only=True)
    assert not any("kvpop" in k for k in base.state_dict())


def test_budget_larger_than_context():
    model = tiny_model("llama", "gqa")
    with pytest.raises(ValueError, match="more than the model's context of 1024"):
        kvpop.retrofit(model, Budget(4, 100, 1000), scorer="mlstm")


def test_architecture_without_findable_kv_heads():
    class Weird(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = type("C", (), {"num_hidden_layers": 2})()
            self.proj = nn.Linear(4, 4)

    with pytest.raises(ValueError, match="could not find one self-attention module per layer"):
        kvpop.retrofit(Weird(), Budget(1, 2, 3), scorer="mlp")


def test_mismatched_scorer_checkpoint(tmp_path):
    small = tiny_model("llama", "gqa")
    kvpop.retrofit(small, Budget(2, 6, 9), scorer="mlstm")
    kvpop.save_retrofitted(small, tmp_path / "gqa")
    other = tiny_model("llama", "mha")
    kvpop.retrofit(other, Budget(2, 6, 9), scorer="mlstm")
    with pytest.raises(ValueError, match="trained for .*num_kv_heads.*2.*retrain"):
        kvpop.load_scorers(other, tmp_path / "gqa")
    mlp = tiny_model("llama", "gqa")
    kvpop.retrofit(mlp, Budget(2, 6, 9), scorer="mlp")
    with pytest.raises(ValueError, match="retrofit with scorer='mlstm'"):
        kvpop.load_scorers(mlp, tmp_path / "gqa")


def test_policy_errors():
    model = tiny_model("llama", "gqa")
    with pytest.raises(ValueError, match="unknown policy"):
        kvpop.retrofit(model, Budget(1, 2, 3), scorer="mlp", policy="nope")
    with pytest.raises(ValueError, match="needs a scorer"):
        kvpop.retrofit(model, Budget(1, 2, 3), scorer=None, policy="kvpop")
    kvpop.retrofit(model, Budget(1, 2, 3), scorer="mlp")
    with pytest.raises(ValueError, match="already retrofitted"):
        kvpop.retrofit(model, Budget(1, 2, 3), scorer="mlp")
    with pytest.raises(ValueError, match="needs scorers trained for it"):
        kvpop.set_policy(model, "kvpop", Budget(1, 5, 3))
    with pytest.raises(RuntimeError, match="oracle policy needs the teacher's targets"):
        kvpop.set_policy(model, "oracle", Budget(1, 2, 3))
        model(torch.randint(1, 97, (1, 12)), use_cache=False)


def test_streaming_takes_the_long_range_slots_as_window():
    policy = kvpop.build_policy("streaming", Budget(4, 60, 64))
    assert policy.budget == Budget(4, 124, 0)


def test_collect_priorities_carry_grad_to_the_scorers():
    model = tiny_model("llama", "gqa")
    kvpop.retrofit(model, Budget(2, 4, 6), scorer="mlstm")
    ids = torch.randint(1, 97, (2, 30))
    with kvpop.collect_priorities(model) as prios:
        model(ids, use_cache=False)
    assert sorted(prios) == [0, 1] and prios[0].shape == (2, 2, 30)
    sum(p.sum() for p in prios.values()).backward()
    assert all(p.grad is not None for p in kvpop.scorers(model).parameters())
    base = [p for n, p in model.named_parameters() if "kvpop_scorer" not in n]
    assert all(p.grad is None for p in base), "scorer inputs must be detached"


def test_padding_in_the_middle_is_refused():
    model = tiny_model("llama", "gqa")
    kvpop.retrofit(model, Budget(2, 4, 6), scorer="mlp")
    mask = torch.ones(1, 10, dtype=torch.long)
    mask[0, 5] = 0
    with pytest.raises(ValueError, match="contiguous"):
        model(torch.randint(1, 97, (1, 10)), attention_mask=mask, use_cache=False)


def test_set_policy_keeps_the_recency_term():
    model = tiny_model("llama", "gqa")
    kvpop.retrofit(model, Budget(1, 2, 3), scorer="mlp", recency=0.05)
    assert kvpop.set_policy(model, "oracle", Budget(1, 2, 5)).recency == 0.05
    assert kvpop.set_policy(model, "kvpop", Budget(1, 2, 5), recency=0.0).recency == 0.0


def test_scorer_only_folder_names_its_base_by_identity_and_loads_on_a_given_base(tmp_path):
    base = tiny_model("llama", "gqa")
    base.save_pretrained(tmp_path / "base")
    model = tiny_model("llama", "gqa")  # the same weights (seed 0), trained scorers on top
    kvpop.retrofit(model, Budget(2, 6, 9), scorer="mlp", recency=0.01)
    with torch.no_grad():
        for p in kvpop.scorers(model).parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ids = torch.randint(1, 97, (2, 40))
    with torch.no_grad():
        before = model(ids, use_cache=False).logits
    kvpop.save_retrofitted(model, tmp_path / "m", base=tmp_path / "base")
    assert not list((tmp_path / "m").glob("model*.safetensors")), "no second copy of the base weights"
    meta = json.loads((tmp_path / "m" / "kvpop.json").read_text())
    assert meta["format_version"] == 2 and "path" not in meta["base"]
    assert str(tmp_path) not in (tmp_path / "m" / "kvpop.json").read_text(), "no path of this machine"
    assert meta["base"] == {"name": "base", "model_type": "llama", "architectures": ["LlamaForCausalLM"],
                            "tensors_sha256": tensors_digest(tmp_path / "base"),
                            "weights_sha256": weights_digest(tmp_path / "base")}
    with pytest.raises(FileNotFoundError, match=r"holds scorers only, for base base \(tensors sha256 [0-9a-f]{16}…\)"):
        kvpop.load_retrofitted(tmp_path / "m")
    # moved to "another machine": any folder with the same tensors is the base
    (tmp_path / "base").rename(tmp_path / "moved")
    loaded, _ = kvpop.load_retrofitted(tmp_path / "m", base=tmp_path / "moved")
    with torch.no_grad():
        assert torch.equal(loaded(ids, use_cache=False).logits, before)
    # the model's HF config is the base's (what evaluation reads for the context length), no weights loaded
    assert saved_model_config(tmp_path / "m", tmp_path / "moved") == \
        json.loads((tmp_path / "moved" / "config.json").read_text())
    kvpop.save_retrofitted(model, tmp_path / "full")
    assert saved_model_config(tmp_path / "full")["max_position_embeddings"] == model.config.max_position_embeddings
    with pytest.raises(FileNotFoundError, match="its base model folder .*nowhere is missing"):
        kvpop.load_retrofitted(tmp_path / "m", base=tmp_path / "nowhere")
    tiny_model("llama", "gqa", seed=1).save_pretrained(tmp_path / "other")
    expected, found = tensors_digest(tmp_path / "moved")[:16], tensors_digest(tmp_path / "other")[:16]
    with pytest.raises(ValueError, match=f"expected tensors sha256 {expected}… \\(base\\), found {found}…"):
        kvpop.load_retrofitted(tmp_path / "m", base=tmp_path / "other")


def test_a_base_rewritten_with_the_same_tensors_still_matches(tmp_path):
    """Another transformers version may write other safetensors metadata, another tensor order, another sharding
    and another config.json: the tensors' digest stays; any changed value changes it."""
    from safetensors.torch import load_file, save_file

    base = tiny_model("llama", "gqa")
    base.save_pretrained(tmp_path / "base")
    state = load_file(str(tmp_path / "base" / "model.safetensors"))
    names = sorted(state)
    converted = tmp_path / "converted"
    converted.mkdir()
    half = len(names) // 2  # two shards, reversed order, other metadata
    save_file({n: state[n] for n in reversed(names[:half])}, str(converted / "model-00001-of-00002.safetensors"),
              metadata={"format": "pt", "converted_by": "another version"})
    save_file({n: state[n] for n in names[half:]}, str(converted / "model-00002-of-00002.safetensors"))
    shard = {n: f"model-0000{1 if i < half else 2}-of-00002.safetensors" for i, n in enumerate(names)}
    (converted / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": shard}))
    config = json.loads((tmp_path / "base" / "config.json").read_text())
    (converted / "config.json").write_text(json.dumps({**config, "transformers_version": "0.0.1"}, indent=4))
    assert weights_digest(converted) != weights_digest(tmp_path / "base")  # the file bytes differ ...
    assert tensors_digest(converted) == tensors_digest(tmp_path / "base")  # ... the tensors do not
    changed = dict(state)
    first = names[0]
    changed[first] = changed[first].clone()
    changed[first].view(-1)[0] += 1e-3
    save_file(changed, str(tmp_path / "changed.safetensors"))
    (tmp_path / "one").mkdir()
    (tmp_path / "changed.safetensors").rename(tmp_path / "one" / "model.safetensors")
    assert tensors_digest(tmp_path / "one") != tensors_digest(tmp_path / "base")
    retyped = {n: v.to(torch.bfloat16) for n, v in state.items()}  # the same values in another dtype: another base
    (tmp_path / "bf16").mkdir()
    save_file(retyped, str(tmp_path / "bf16" / "model.safetensors"))
    assert tensors_digest(tmp_path / "bf16") != tensors_digest(tmp_path / "base")

    model = tiny_model("llama", "gqa")
    kvpop.retrofit(model, Budget(2, 6, 9), scorer="mlp")
    kvpop.save_retrofitted(model, tmp_path / "m", base=tmp_path / "base")
    assert kvpop.load_retrofitted(tmp_path / "m", base=converted)[0] is not None


def test_a_folder_written_before_the_identity_still_loads(tmp_path):
    """Committed scorers name their base by ``path`` + the files' ``weights_sha256``: read from the recorded path, or
    a given base whose files digest the same."""
    tiny_model("llama", "gqa").save_pretrained(tmp_path / "base")
    model = tiny_model("llama", "gqa")
    kvpop.retrofit(model, Budget(2, 6, 9), scorer="mlp")
    kvpop.save_retrofitted(model, tmp_path / "m", base=tmp_path / "base")
    meta = json.loads((tmp_path / "m" / "kvpop.json").read_text())
    meta["base"] = {"path": str(tmp_path / "base"), "weights_sha256": weights_digest(tmp_path / "base")}
    (tmp_path / "m" / "kvpop.json").write_text(json.dumps(meta))
    assert kvpop.load_retrofitted(tmp_path / "m")[0] is not None
    assert saved_model_config(tmp_path / "m")["model_type"] == "llama"
    shutil.copytree(tmp_path / "base", tmp_path / "copy")
    assert kvpop.load_retrofitted(tmp_path / "m", base=tmp_path / "copy")[0] is not None
    tiny_model("llama", "gqa", seed=1).save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match=f"expected weights sha256 {weights_digest(tmp_path / 'base')[:16]}…"):
        kvpop.load_retrofitted(tmp_path / "m", base=tmp_path / "other")
