"""A model's own sliding-window layers stay themselves (kvpop.local_layers, METHOD §1): Gemma 2 / 3, Mistral with a
window and Qwen2 with ``use_sliding_window``, tiny and random, built in memory."""
import pytest
import torch

import kvpop
from kvpop import Budget
from kvpop.cache import kv_slots
from kvpop.local_layers import UnsupportedAttention, evicting_layers, layer_windows
from kvpop.objective import Objective, student_forward
from kvpop.retrofit import scoring_modules
from kvpop.targets import teacher_pass
from tests.models import ARCHS, LOCAL_ARCHS, LOCAL_WINDOW, dms_model, tiny_model
from tests.test_cache import left_padded

EVICTING = Budget(2, 4, 6)  # B = 12 < S: the global layers evict
SEQ = 40  # longer than the local window (8) and the budget


def _own_windows(model) -> list:
    """The window each layer's own forward passes to its attention, as transformers' modeling code sets it (read from
    the modules, not through kvpop.local_layers)."""
    windows = []
    for layer in model.model.layers:
        attn = layer.self_attn
        if model.config.model_type == "mistral":
            windows.append(model.config.sliding_window)
        else:
            windows.append(getattr(attn, "sliding_window", None))
    return windows


@pytest.mark.parametrize("arch", list(LOCAL_ARCHS) + list(ARCHS))
def test_layer_windows_read_the_config_as_transformers_does(arch):
    model = tiny_model(arch, "gqa")
    assert list(layer_windows(model.config)) == _own_windows(model)
    assert evicting_layers(model.config) == tuple(i for i, w in enumerate(_own_windows(model)) if w is None)
    if arch in LOCAL_ARCHS:
        assert LOCAL_WINDOW in _own_windows(model)


@pytest.mark.parametrize("arch", list(LOCAL_ARCHS) + list(ARCHS))
@pytest.mark.parametrize("policy", ["kvpop", "dense"])
def test_a_budget_that_evicts_nothing_leaves_the_model_itself(arch, policy):
    model = tiny_model(arch, "gqa")
    ids = torch.randint(1, 97, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = model(ids).logits
    kvpop.retrofit(model, Budget(2, 8, SEQ), scorer="mlstm", policy=policy)
    with torch.no_grad():
        one_pass = model(ids, use_cache=False).logits
        cached = model(ids).logits  # dense: transformers' own cache; kvpop: forward with use_cache
    assert (one_pass - base).abs().max() <= 1e-5
    assert (cached - base).abs().max() <= 1e-5
    if policy == "kvpop":
        assert (kvpop.teacher_forced_logits(model, ids) - base).abs().max() <= 1e-5


@pytest.mark.parametrize("arch", list(LOCAL_ARCHS))
@pytest.mark.parametrize("policy", ["kvpop", "oracle", "streaming", "dms"])
def test_decode_and_odd_chunks_equal_the_masked_forward(arch, policy):
    if policy == "dms":  # random gates in the global layers
        model = dms_model(arch, "gqa", Budget(EVICTING.sink, EVICTING.window, 0), layers=LOCAL_ARCHS[arch][2])
    else:
        model = tiny_model(arch, "gqa")
        kvpop.retrofit(model, EVICTING, scorer="mlp", policy=policy)
    ids = torch.randint(1, 97, (2, SEQ), generator=torch.Generator().manual_seed(2))
    rt = model.kvpop_runtime
    targets = torch.randn(len(rt.evicting_layers), 2, rt.num_kv_heads, SEQ, generator=torch.Generator().manual_seed(3))
    with kvpop.oracle_priorities(model, targets):
        with torch.no_grad():
            one_pass = model(ids, use_cache=False).logits
        stepwise = kvpop.teacher_forced_logits(model, ids)
        chunked = kvpop.teacher_forced_logits(model, ids, prefill=13, chunk=7)
    assert (stepwise - one_pass).abs().max() <= 1e-4
    assert (chunked - one_pass).abs().max() <= 1e-4


@pytest.mark.parametrize("arch", ["gemma2", "qwen2_window"])
@pytest.mark.parametrize("policy", ["tova", "h2o"])
def test_dynamic_policies_leave_the_model_itself_without_eviction_and_prefill_like_steps(arch, policy):
    model = tiny_model(arch, "gqa")
    ids = torch.randint(1, 97, (2, SEQ), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        base = model(ids).logits
    kvpop.retrofit(model, Budget(2, 8, SEQ), scorer=None, policy=policy)
    assert (kvpop.teacher_forced_logits(model, ids) - base).abs().max() <= 1e-5
    kvpop.set_policy(model, policy, EVICTING)
    stepwise = kvpop.teacher_forced_logits(model, ids)
    assert (stepwise - base).abs().max() > 1e-3  # the global layers evict
    assert (kvpop.teacher_forced_logits(model, ids, prefill=EVICTING.total) - stepwise).abs().max() <= 1e-4


def test_the_budget_changes_global_layers_only():
    """Guard against a retrofit that does nothing: an evicting budget changes a hybrid model, and a model whose every
    layer is local (Mistral with a window) is left itself by any budget."""
    ids = torch.randint(1, 97, (1, SEQ))
    for arch, changes in (("gemma3", True), ("mistral_window", False)):
        model = tiny_model(arch, "gqa")
        with torch.no_grad():
            base = model(ids).logits
        kvpop.retrofit(model, Budget(1, 2, 1), scorer="mlp")
        with torch.no_grad():
            sparse = model(ids, use_cache=False).logits
        assert ((sparse - base).abs().max() > 1e-2) == changes, arch


@pytest.mark.parametrize("arch", list(LOCAL_ARCHS))
def test_kv_bytes_follow_the_formula_and_stay_flat(arch):
    """K/V bytes = (B × global layers + W × local layers) × Hkv × head_dim × 2 × dtype size × batch."""
    model = tiny_model(arch, "gqa")
    kvpop.retrofit(model, EVICTING, scorer="mlstm")
    windows = _own_windows(model)
    rt = model.kvpop_runtime
    prompt = torch.randint(1, 97, (2, 20))

    def held_after(new_tokens):
        cache = kvpop.KVpopCache(model)
        model.generate(input_ids=prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                       past_key_values=cache)
        for layer, window in zip(cache.layers, windows):
            assert layer.keys.shape[2] == (EVICTING.total if window is None else window)
        return cache.nbytes()["kv"], cache.peak_kv_bytes

    slots = sum(EVICTING.total if w is None else w for w in windows)
    assert kv_slots(rt) == slots
    formula = slots * rt.num_kv_heads * rt.head_dim * 2 * 4 * 2
    short, long = held_after(16), held_after(64)
    assert short[0] == long[0] == formula
    assert short[1] == long[1]  # the peak (prompt prefill's candidates) does not grow with the generated length


@pytest.mark.parametrize("arch", ["gemma2", "qwen2_window"])
def test_batched_left_padded_generate_equals_each_row_alone(arch):
    model = tiny_model(arch, "gqa")
    kvpop.retrofit(model, EVICTING, scorer="mlstm")
    prompts = [torch.randint(1, 97, (n,)) for n in (5, 21, 14)]
    ids, mask = left_padded(prompts)
    batch = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False, prefill_chunk=6)
    for i, prompt in enumerate(prompts):
        alone = model.generate(input_ids=prompt[None], max_new_tokens=20, do_sample=False, prefill_chunk=6)
        assert torch.equal(batch[i, ids.shape[1]:], alone[0, len(prompt):]), f"row {i} differs"


def test_scorers_only_on_global_layers_and_save_load_round_trip(tmp_path):
    model = tiny_model("gemma2", "gqa")
    kvpop.retrofit(model, EVICTING, scorer="mlp")
    assert [m.layer_idx for m in scoring_modules(model)] == [1, 3]
    assert len(kvpop.scorers(model)) == 2
    with torch.no_grad():
        for p in kvpop.scorers(model).parameters():
            p.normal_()
    ids = torch.randint(1, 97, (1, SEQ))
    with torch.no_grad():
        before = model(ids, use_cache=False).logits
    kvpop.save_retrofitted(model, tmp_path / "saved")
    loaded, _ = kvpop.load_retrofitted(tmp_path / "saved")
    with torch.no_grad():
        after = loaded(ids, use_cache=False).logits
    assert loaded.kvpop_runtime.layer_windows == (LOCAL_WINDOW, None, LOCAL_WINDOW, None)
    assert (after - before).abs().max() <= 1e-6


def test_targets_and_boundary_loss_cover_the_evicting_layers_only():
    model = tiny_model("gemma3", "gqa")
    ids = torch.randint(1, 97, (2, SEQ))
    with torch.no_grad():
        logits = model(ids).logits
    out = teacher_pass(model, ids, [EVICTING.window], top_k=5)
    assert out["targets"][EVICTING.window].shape == (1, 2, 2, SEQ)  # gemma3's one global layer of six
    # the teacher is the model itself, local windows included: its top-K logits are the model's
    assert (out["topk_values"] - logits.topk(5, -1).values).abs().max() <= 1e-5
    kvpop.retrofit(model, EVICTING, scorer="mlp")
    student_logits, student = student_forward(model, ids)
    assert student.shape == out["targets"][EVICTING.window].shape
    result = Objective.for_model(model)(student, out["targets"][EVICTING.window], student_logits,
                                        out["topk_values"], out["topk_indices"])
    result["loss"].backward()
    grads = [p.grad for p in kvpop.scorers(model).parameters()]
    assert all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)


def test_gemma2_final_logit_softcapping_is_in_the_teacher_logits():
    model = tiny_model("gemma2", "gqa")
    assert model.config.final_logit_softcapping is not None
    ids = torch.randint(1, 97, (1, SEQ))
    with torch.no_grad():
        logits = model(ids).logits
    out = teacher_pass(model, ids, [4], top_k=3)
    assert (out["topk_values"] - logits.topk(3, -1).values).abs().max() <= 1e-5


def _refused(model_or_config, needle):
    with pytest.raises(ValueError) as info:
        if isinstance(model_or_config, torch.nn.Module):
            kvpop.retrofit(model_or_config, EVICTING, scorer="mlp")
        else:
            layer_windows(model_or_config)
    message = str(info.value)
    assert "\n" not in message and needle in message, message
    return info.value


def test_attention_patterns_it_cannot_read_are_refused_in_one_line():
    from transformers import Gemma2Config, Llama4TextConfig, Qwen2Config

    softcapped = Gemma2Config(num_hidden_layers=2, sliding_window=8)  # Gemma 2's default attn_logit_softcapping 50
    assert isinstance(_refused(softcapped, "attention logit soft-capping"), UnsupportedAttention)
    _refused(Qwen2Config(num_hidden_layers=2, layer_types=["full_attention", "linear_attention"]), "linear_attention")
    _refused(Llama4TextConfig(num_hidden_layers=2, attention_chunk_size=16), "chunked attention")
    model = tiny_model("gemma3", "gqa")
    model.config.use_bidirectional_attention = True
    _refused(model, "bidirectional")


def test_a_layer_window_the_config_does_not_say_is_refused_at_run_time():
    """The safety net behind the config reading: a layer whose forward passes another window fails in one line."""
    model = tiny_model("qwen2_window", "gqa")
    kvpop.retrofit(model, EVICTING, scorer="mlp")
    model.model.layers[0].self_attn.sliding_window = 5
    with pytest.raises(ValueError, match="layer 0 passes sliding_window=5 but its config reads as window None"):
        model(torch.randint(1, 97, (1, 10)), use_cache=False)


@pytest.mark.slow
def test_a_job_on_a_model_it_cannot_reproduce_is_one_line_and_exit_2(tmp_path):
    import subprocess
    import sys

    from transformers import Gemma2Config, Gemma2ForCausalLM

    folder = tmp_path / "gemma2"
    Gemma2ForCausalLM(Gemma2Config(vocab_size=97, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                   sliding_window=8)).save_pretrained(folder)  # soft-capped by default
    (folder / "tokenizer_config.json").write_text("{}")
    home = tmp_path / "home"
    proc = subprocess.run([sys.executable, "-m", "jobs.precompute", "--set", f"model.path={folder}", "--set",
                           f"home={home}"], capture_output=True, text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("kvpop precompute: error: model.path") and "soft-capping" in lines[0], lines[0]
    assert not home.exists()


def test_streaming_layer_calibration_names_global_layers():
    from kvpop.diagnostics import streaming_layers

    model = tiny_model("gemma2", "gqa")
    kvpop.retrofit(model, EVICTING, scorer="mlp")
    found = streaming_layers(model, torch.randint(1, 97, (2, SEQ)))
    assert len(found["scorer"]) == len(found["streaming"]) == 2  # layers 1 and 3 hold scorers
    assert set(found["layers"]) <= {1, 3}
    kvpop.set_streaming_layers(model, found["layers"])
    with pytest.raises(ValueError, match=r"layers \[0\] are the model's own local"):
        kvpop.set_streaming_layers(model, [0, 1])
