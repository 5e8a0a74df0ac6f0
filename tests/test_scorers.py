"""Scorers (METHOD §4): step() == forward(), read horizons, left padding, gradients, state size, registry."""
import pytest
import torch

from kvpop.scorers import SCORERS, build_scorer

NAMES = ["mlp", "mlstm", "mlstm_immediate"]
# (batch, KV heads, head dim, window, mLSTM heads per KV head); window 150 > every sequence length below
CASES = [(2, 2, 16, 1, 1), (1, 3, 8, 5, 2), (2, 1, 32, 16, 1), (2, 2, 16, 150, 2)]
TOL = 1e-5


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: with 2 intra-op threads on a 2-core box that is busy with other work, spinning threads made
    this file 50x slower (197 s instead of 4 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make(name, H, D, W, num_heads=1, seed=0):
    torch.manual_seed(seed)
    overrides = {"num_heads": num_heads, "qk_dim": 16, "v_dim": 16} if name.startswith("mlstm") else {}
    scorer = build_scorer(name, H, D, W, **overrides)
    with torch.no_grad():  # like a trained scorer: biases are zero at init, which would hide leaks of padding
        for pname, param in scorer.named_parameters():
            if pname.endswith("bias"):
                param.add_(0.5 * torch.randn_like(param))
    return scorer


def kv(B, H, S, D, seed=1):
    g = torch.Generator().manual_seed(seed)
    # keys and values at different scales, as in real layers (the scorer normalises them)
    return torch.randn(B, H, S, D, generator=g) * 5.0, torch.randn(B, H, S, D, generator=g) * 0.2


def run_steps(scorer, keys, values, state, start, valid=None):
    """Step tokens start..S-1; returns {call τ: priority of token τ - window}."""
    out = {}
    for tau in range(start, keys.shape[2]):
        out[tau], state = scorer.step(keys[:, :, tau], values[:, :, tau], state,
                                      None if valid is None else valid[:, tau])
    return out, state


def assert_steps_match(out, p, window, rows=slice(None)):
    for tau, priority in out.items():
        assert torch.isfinite(priority).all()
        if tau >= window:
            torch.testing.assert_close(priority[rows], p[rows][:, :, tau - window], atol=TOL, rtol=TOL)


@pytest.mark.parametrize("S", [64, 100])
@pytest.mark.parametrize("B,H,D,W,NH", CASES)
@pytest.mark.parametrize("name", NAMES)
def test_step_matches_forward(name, B, H, D, W, NH, S):
    scorer = make(name, H, D, W, NH)
    keys, values = kv(B, H, S, D)
    with torch.no_grad():
        p = scorer(keys, values)
        assert p.shape == (B, H, S) and p.dtype == torch.float32 and torch.isfinite(p).all()
        assert p.std() > 0.1  # the random init already spreads the priorities

        out, _ = run_steps(scorer, keys, values, scorer.init_state(B, "cpu"), 0)
        assert_steps_match(out, p, W)

        # prefill P tokens with forward(), then decode: the same priorities across the boundary
        for P in (1, 37):
            p_prefix, state = scorer(keys[:, :, :P], values[:, :, :P], return_state=True)
            torch.testing.assert_close(p_prefix[..., :max(P - W, 0)], p[..., :max(P - W, 0)], atol=TOL, rtol=TOL)
            _, stepped = run_steps(scorer, keys[:, :, :P], values[:, :, :P], scorer.init_state(B, "cpu"), 0)
            assert state.keys() == stepped.keys()
            for key in state:
                torch.testing.assert_close(state[key], stepped[key], atol=TOL, rtol=TOL)
            out, _ = run_steps(scorer, keys, values, state, P)
            assert_steps_match(out, p, W)


@pytest.mark.parametrize("W", [5, 16])
def test_delayed_read_horizon(W):
    """mlstm: p[t] sees tokens up to t + window, never later."""
    S, t = 100, 40
    scorer = make("mlstm", 2, 16, W, num_heads=2)
    keys, values = kv(2, 2, S, 16)
    with torch.no_grad():
        p = scorer(keys, values)
        for u in (t + W + 1, t + W + 30):  # change every token from u on: p[..., :u - W] must not move
            k2, v2 = keys.clone(), values.clone()
            k2[:, :, u:] = torch.randn_like(k2[:, :, u:])
            v2[:, :, u:] = torch.randn_like(v2[:, :, u:])
            torch.testing.assert_close(scorer(k2, v2)[..., :u - W], p[..., :u - W], atol=1e-6, rtol=0)
        for u in (t + 1, t + W // 2, t + W):  # change one token inside (t, t + window]: p[t] must move
            k2, v2 = keys.clone(), values.clone()
            k2[:, :, u] = torch.randn_like(k2[:, :, u])
            v2[:, :, u] = torch.randn_like(v2[:, :, u])
            assert ((scorer(k2, v2)[..., t] - p[..., t]).abs() > 1e-4).all()


@pytest.mark.parametrize("name", ["mlp", "mlstm_immediate"])
def test_immediate_scorers_are_causal(name):
    """mlp, mlstm_immediate: p[t] ignores everything after t."""
    S, W = 100, 8
    scorer = make(name, 2, 16, W)
    keys, values = kv(2, 2, S, 16)
    with torch.no_grad():
        p = scorer(keys, values)
        for u in (1, 50, 99):
            k2, v2 = keys.clone(), values.clone()
            k2[:, :, u:] = torch.randn_like(k2[:, :, u:])
            v2[:, :, u:] = torch.randn_like(v2[:, :, u:])
            torch.testing.assert_close(scorer(k2, v2)[..., :u], p[..., :u], atol=1e-6, rtol=0)


@pytest.mark.parametrize("W", [1, 6, 150])
@pytest.mark.parametrize("name", NAMES)
def test_left_padding_is_ignored(name, W):
    """A row with `pad` invalid tokens in front scores its real tokens as the unpadded row alone."""
    H, D, S = 2, 16, 90
    scorer = make(name, H, D, W, num_heads=2)
    keys, values = kv(2, H, S, D)
    pads = (0, 13)  # row 1 keeps its last S - 13 tokens, behind 13 tokens of garbage
    valid = torch.ones(2, S, dtype=torch.bool)
    valid[1, :pads[1]] = False
    keys[1, :, :pads[1]] = 1e3 * torch.randn(H, pads[1], D)
    values[1, :, :pads[1]] = float("nan")  # masked, never multiplied: cannot leak
    with torch.no_grad():
        p = scorer(keys, values, valid)
        assert torch.isfinite(p).all()
        for row, pad in enumerate(pads):
            alone = scorer(keys[row:row + 1, :, pad:], values[row:row + 1, :, pad:])
            torch.testing.assert_close(p[row:row + 1, :, pad:], alone, atol=TOL, rtol=TOL)

        # decoding, with and without a padded prefill: the same as forward on the padded batch
        out, _ = run_steps(scorer, keys, values, scorer.init_state(2, "cpu"), 0, valid)
        assert_steps_match(out, p, W)
        _, state = scorer(keys[:, :, :20], values[:, :, :20], valid[:, :20], return_state=True)
        out, _ = run_steps(scorer, keys, values, state, 20, valid)
        assert_steps_match(out, p, W)


@pytest.mark.parametrize("name", NAMES)
def test_gradients_reach_parameters_not_inputs(name):
    scorer = make(name, 2, 16, 4, num_heads=2)
    keys, values = kv(2, 2, 70, 16)
    keys, values = keys.bfloat16().requires_grad_(), values.bfloat16().requires_grad_()  # a bf16 model
    p = scorer(keys, values)
    assert p.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the model's autocast does not reach the scorer
        torch.testing.assert_close(scorer(keys, values), p, atol=TOL, rtol=TOL)
    (p * torch.randn_like(p)).sum().backward()
    assert keys.grad is None and values.grad is None
    for pname, param in scorer.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), pname
        assert param.grad.abs().sum() > 0, pname


@pytest.mark.parametrize("name", NAMES)
def test_state_size_is_constant(name):
    B, H, D, W = 2, 3, 8, 7
    scorer = make(name, H, D, W, num_heads=2)
    nbytes = lambda state: sum(t.numel() * t.element_size() for t in state.values())
    expected = scorer.state_nbytes(B)
    keys, values = kv(B, H, 60, D)
    with torch.no_grad():
        state = scorer.init_state(B, "cpu")
        assert nbytes(state) == expected
        for tau in range(60):
            _, state = scorer.step(keys[:, :, tau], values[:, :, tau], state)
            if tau in (0, 6, 7, 59):
                assert nbytes(state) == expected
        for S in (3, 60):
            _, state = scorer(keys[:, :, :S], values[:, :, :S], return_state=True)
            assert nbytes(state) == expected
            # and no state tensor keeps a larger buffer (e.g. all chunk states of the kernel) alive
            assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in state.values())
    assert all(t.shape[0] == B for t in state.values())  # batch first: a cache can index / reorder it
    assert scorer.state_nbytes(2 * B) == 2 * expected


def test_registry_and_configs():
    assert sorted(SCORERS) == sorted(NAMES)
    with pytest.raises(ValueError, match="known scorers.*mlstm"):
        build_scorer("lstm", 2, 16, 4)
    with pytest.raises(ValueError, match="unknown MLPConfig field"):
        build_scorer("mlp", 2, 16, 4, qk_dim=8)
    with pytest.raises(ValueError):
        build_scorer("mlp", 2, 16, 0)
    for name in NAMES:
        scorer = build_scorer(name, 2, 16, 4, norm_eps=1e-5)
        again = build_scorer(**scorer.config_dict())
        assert type(again) is type(scorer) and again.config == scorer.config and again.window == 4
        again.load_state_dict(scorer.state_dict())  # same parameter layout
    assert build_scorer("mlstm", 2, 16, 4, qk_dim=8).config.qk_dim == 8


@pytest.mark.parametrize("name", NAMES)
def test_head_recency_adds_a_learned_per_head_decay_on_every_path(name):
    """``head_recency=True`` (METHOD §4): the scorer's output plus λ_h · t, one λ_h = head_recency[h] / 256 per KV
    head — zero at init (the scorer without it), the same in forward(), step() and a prefill + decode, and trained
    by the loss like every other parameter."""
    from kvpop.scorers.base import HEAD_RECENCY_UNIT

    B, H, D, W, S = 2, 3, 8, 5, 40
    plain = make(name, H, D, W, num_heads=2)
    overrides = {"num_heads": 2, "qk_dim": 16, "v_dim": 16} if name.startswith("mlstm") else {}
    aged = build_scorer(name, H, D, W, head_recency=True, **overrides)
    missing = aged.load_state_dict(plain.state_dict(), strict=False).missing_keys
    assert missing == ["head_recency"] and build_scorer(**aged.config_dict()).config.head_recency
    keys, values = kv(B, H, S, D)
    with torch.no_grad():
        torch.testing.assert_close(aged(keys, values), plain(keys, values), atol=0, rtol=0)
        aged.head_recency.copy_(torch.tensor([25.6, -12.8, 0.0]))
        p = aged(keys, values)
        rate = torch.tensor([25.6, -12.8, 0.0]) / HEAD_RECENCY_UNIT
        torch.testing.assert_close(p, plain(keys, values) + rate[None, :, None] * torch.arange(S).float(),
                                   atol=TOL, rtol=TOL)
        out, _ = run_steps(aged, keys, values, aged.init_state(B, "cpu"), 0)
        assert_steps_match(out, p, W)
        _, state = aged(keys[:, :, :17], values[:, :, :17], return_state=True)
        out, _ = run_steps(aged, keys, values, state, 17)
        assert_steps_match(out, p, W)
    loss = aged(keys, values)[:, 0].mul(torch.linspace(-1, 1, S)).sum()
    loss.backward()
    assert aged.head_recency.grad[0] != 0 and aged.head_recency.grad[1:].abs().sum() == 0
