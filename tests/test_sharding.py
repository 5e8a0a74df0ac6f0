"""kvpop.sharding (FSDP2 plan) and kvpop.checkpointing (DCP round trip) on CPU: gloo, world size 1."""
import copy
import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

import kvpop
from kvpop import Budget, checkpointing
from kvpop.objective import Objective, student_forward
from kvpop.parameters import trainable_parameters
from kvpop.sharding import checkpoint_layers, decoder_layers, shard
from tests.models import tiny_model


@pytest.fixture
def process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _student(mode="scorer_only", seed=0):
    """Scorers initialised from ``seed``; the base too in distill mode (scorer-only keeps one frozen base)."""
    model = tiny_model("llama", "gqa", seed=seed if mode == "distill" else 0)
    torch.manual_seed(seed)
    kvpop.retrofit(model, Budget(2, 4, 6), scorer="mlstm", recency=0.01)
    model.train()
    return model, trainable_parameters(model, mode)


def _loss(model, ids, targets, values, indices):
    logits, student = student_forward(model, ids)
    return Objective.for_model(model)(student, targets, logits, values, indices)["loss"]


def _batch():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 97, (2, 32), generator=gen)
    values, indices = torch.randn(2, 32, 97, generator=gen).topk(5, dim=-1)
    return ids, torch.randn(2, 2, 2, 32, generator=gen), values, indices


@pytest.mark.parametrize("mode", ["scorer_only", "distill"])
def test_sharded_model_computes_what_the_plain_one_does(process_group, mode):
    plain, _ = _student(mode)
    sharded = shard(copy.deepcopy(plain))
    params = trainable_parameters(sharded, mode)  # the DTensors now
    assert all(isinstance(m, FSDPModule) for m in [*kvpop.scorers(sharded), *decoder_layers(sharded), sharded])
    batch = _batch()
    want, got = _loss(plain, *batch), _loss(sharded, *batch)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    want.backward()
    got.backward()
    plain_grads = [p.grad for p in trainable_parameters(plain, mode)["scorers"]]
    sharded_grads = [p.grad.full_tensor() for p in params["scorers"]]
    for a, b in zip(plain_grads, sharded_grads):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("mode", ["scorer_only", "distill"])
def test_checkpointed_layers_compose_with_the_plan(process_group, mode):
    """Activation checkpointing (:func:`checkpoint_layers`, then the plan): the sharded model's loss and gradients as
    without it, and each layer replayed in the backward — in scorer-only mode too, where no gradient reaches a
    layer's output and the replay itself must gather the layer's parameters. Names and state dict unchanged."""
    plain, _ = _student(mode)
    checkpointed = checkpoint_layers(copy.deepcopy(plain))
    assert list(checkpointed.state_dict()) == list(plain.state_dict())
    models = {"plain": shard(plain), "checkpointed": shard(checkpointed)}
    calls = []
    for layer in decoder_layers(checkpointed):
        layer.self_attn.register_forward_pre_hook(lambda *_: calls.append(1))
    grads = {}
    for name, model in models.items():
        params = trainable_parameters(model, mode)
        loss = _loss(model, *_batch())
        loss.backward()
        grads[name] = [loss.detach(), *(p.grad.full_tensor() for p in params["scorers"] + params["base"])]
    assert len(calls) == 2 * len(decoder_layers(checkpointed))
    assert len(grads["checkpointed"]) == len(grads["plain"]) > 1
    for got, want in zip(grads["checkpointed"], grads["plain"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def _optimizer(params):
    return torch.optim.AdamW([{"params": params["scorers"], "lr": 1e-2},
                              *([{"params": params["base"], "lr": 1e-3}] if params["base"] else [])])


def _train_one_step(model, params):
    optimizer = _optimizer(params)
    _loss(model, *_batch()).backward()
    optimizer.step()
    return optimizer


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("mode", ["scorer_only", "distill"])
def test_checkpoint_round_trip(tmp_path, request, sharded, mode):
    if sharded:
        request.getfixturevalue("process_group")
    model, params = _student(mode)
    if sharded:
        shard(model)
        params = trainable_parameters(model, mode)
    optimizer = _train_one_step(model, params)
    checkpointing.save(model, optimizer, tmp_path / "ckpt", step=7, trainable_only=mode == "scorer_only")

    fresh, fresh_params = _student(mode, seed=3)  # other initial weights: the trained ones come from the checkpoint
    if sharded:
        shard(fresh)
        fresh_params = trainable_parameters(fresh, mode)
    fresh_optimizer = _optimizer(fresh_params)
    step = checkpointing.load(fresh, fresh_optimizer, tmp_path / "ckpt", trainable_only=mode == "scorer_only")
    assert step == 7
    want = checkpointing.training_state(model, optimizer, trainable_only=mode == "scorer_only")
    got = checkpointing.training_state(fresh, fresh_optimizer, trainable_only=mode == "scorer_only")
    assert want["model"].keys() == got["model"].keys()
    for key in want["model"]:
        a, b = want["model"][key], got["model"][key]
        torch.testing.assert_close(b.full_tensor() if sharded else b, a.full_tensor() if sharded else a)
    assert want["optim"]["state"].keys() == got["optim"]["state"].keys()
    # the full state gathers to plain names that load into an unsharded model
    full = checkpointing.full_model_state(fresh)
    plain, _ = _student(mode, seed=5)
    result = plain.load_state_dict(full, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    torch.testing.assert_close(plain(_batch()[0], use_cache=False).logits,
                               model(_batch()[0], use_cache=False).logits, rtol=1e-5, atol=1e-5)


def test_a_damaged_checkpoint_is_refused_before_it_is_unpickled(tmp_path):
    model, params = _student("scorer_only")
    optimizer = _train_one_step(model, params)
    folder = tmp_path / "ckpt"
    checkpointing.save(model, optimizer, folder, step=3, trainable_only=True)
    checkpointing.verify(folder)
    manifest = json.loads((folder / "kvpop_manifest.0.json").read_text())
    assert manifest["world_size"] == 1 and {".metadata", "kvpop_step.json"} < set(manifest["files"])
    assert any(name.endswith(".distcp") for name in manifest["files"])

    def damaged(change) -> str:
        copy = tmp_path / f"copy{len(list(tmp_path.iterdir()))}"
        shutil.copytree(folder, copy)
        change(copy)
        fresh, fresh_params = _student("scorer_only", seed=3)
        with pytest.raises(checkpointing.CheckpointError) as err:
            checkpointing.load(fresh, _optimizer(fresh_params), copy, trainable_only=True)
        message = str(err.value)
        assert str(copy) in message and "\n" not in message
        return message

    distcp = next(name for name in manifest["files"] if name.endswith(".distcp"))
    assert "truncated" in damaged(lambda f: os.truncate(f / distcp, (f / distcp).stat().st_size // 2))
    assert "truncated" in damaged(lambda f: os.truncate(f / ".metadata", 10))

    def flip_a_byte(f):
        data = bytearray((f / distcp).read_bytes())
        data[-1] ^= 0xFF
        (f / distcp).write_bytes(bytes(data))

    assert "sha256" in damaged(flip_a_byte)
    assert ".metadata is missing" in damaged(lambda f: (f / ".metadata").unlink())
    assert "kvpop_manifest.0.json" in damaged(lambda f: (f / "kvpop_manifest.0.json").unlink())

    def second_rank_missing(f):
        info = json.loads((f / "kvpop_manifest.0.json").read_text())
        (f / "kvpop_manifest.0.json").write_text(json.dumps({**info, "world_size": 2}))

    assert "kvpop_manifest.1.json" in damaged(second_rank_missing)
