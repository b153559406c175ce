"""KDA layer (FORMAT.md "KDA") against fla-core's naive oracle, and the layer's
prefill-then-decode continuity in fp32 and bf16. fla is imported inside tests only."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mtplx_runtime.checkpoint import open_checkpoint
from mtplx_runtime.fixtures.tiny import make_tiny, tiny_config
from mtplx_runtime.model.kda import (
    KDALayer,
    KDAState,
    gated_rmsnorm,
    kda_chunked,
    kda_gate,
    kda_recurrent,
    l2norm,
    short_conv,
)

H, K = 4, 16


def _inputs(T, seed=0, with_state=True):
    """Random delta-rule inputs in the oracle's convention: l2-normed q/k, log-decay, σ(β)."""
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(T, H, K, generator=gen))  # [T, H, K]
    k = l2norm(torch.randn(T, H, K, generator=gen))  # [T, H, K]
    v = torch.randn(T, H, K, generator=gen)  # [T, H, V]
    # Strong decays (down to -5) exercise the overflow-prone part of the chunked form.
    g = -5.0 * torch.sigmoid(2 * torch.randn(T, H, K, generator=gen))  # [T, H, K]
    beta = torch.sigmoid(torch.randn(T, H, generator=gen))  # [T, H]
    S0 = torch.randn(H, K, K, generator=gen) if with_state else None  # [H, K, V]
    return q, k, v, g, beta, S0


def _fla(fn, q, k, v, g, beta, S0, **kw):
    o, S = fn(q[None], k[None], v[None], g[None], beta[None], scale=K ** -0.5,
              initial_state=None if S0 is None else S0[None], output_final_state=True, **kw)
    return o[0], S[0]


def test_gate_matches_fla():
    from fla.ops.kda.gate import naive_kda_lowerbound_gate

    gen = torch.Generator().manual_seed(1)
    raw = 3 * torch.randn(7, H, K, generator=gen)  # [T, H, K] f_b(f_a(x)) output
    A_log = torch.randn(H, generator=gen)
    dt_bias = torch.randn(H * K, generator=gen)
    want = naive_kda_lowerbound_gate(raw, A_log, dt_bias, lower_bound=-5.0)
    got = kda_gate(raw + dt_bias.view(H, K), A_log, -5.0)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert got.max() <= 0 and got.min() >= -5


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("T", [1, 5, 64, 100, 128, 130])
def test_recurrent_and_chunked_match_fla(T, with_state):
    from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda

    q, k, v, g, beta, S0 = _inputs(T, seed=T, with_state=with_state)
    S0_copy = None if S0 is None else S0.clone()
    o_want, S_want = _fla(naive_recurrent_kda, q, k, v, g, beta, S0)
    # Our functions take q already scaled (step 5).
    o_r, S_r = kda_recurrent(q * K ** -0.5, k, v, g, beta, S0)
    o_c, S_c = kda_chunked(q * K ** -0.5, k, v, g, beta, S0)
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(o_r, o_want, **tol)
    torch.testing.assert_close(S_r, S_want, **tol)
    torch.testing.assert_close(o_c, o_r, **tol)
    torch.testing.assert_close(S_c, S_r, **tol)
    if T % 64 == 0:
        o_fc, S_fc = _fla(naive_chunk_kda, q, k, v, g, beta, S0, chunk_size=64)
        torch.testing.assert_close(o_c, o_fc, **tol)
        torch.testing.assert_close(S_c, S_fc, **tol)
    if S0 is not None:
        assert torch.equal(S0, S0_copy)  # neither form updates its input state in place


def test_chunk_size_does_not_matter():
    q, k, v, g, beta, S0 = _inputs(37, seed=3)
    o_a, S_a = kda_chunked(q, k, v, g, beta, S0, chunk=64)
    o_b, S_b = kda_chunked(q, k, v, g, beta, S0, chunk=8)
    torch.testing.assert_close(o_a, o_b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(S_a, S_b, rtol=1e-5, atol=1e-5)


def test_short_conv_matches_conv1d_and_streams():
    gen = torch.Generator().manual_seed(2)
    T, C = 11, 24
    x = torch.randn(T, C, generator=gen)  # [T, C]
    w = torch.randn(C, 1, 4, generator=gen)  # [C, 1, W]
    want = F.silu(F.conv1d(x.T[None], w, padding=3, groups=C)[0, :, :T]).T  # [T, C]
    got, hist = short_conv(x, w[:, 0])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(hist, x[-3:])
    # Token by token (and a 2-token piece, shorter than the history) with the carried history.
    h, pieces = None, []
    for sl in [slice(0, 1), slice(1, 3), *[slice(t, t + 1) for t in range(3, T)]]:
        y, h = short_conv(x[sl], w[:, 0], h)
        pieces.append(y)
    torch.testing.assert_close(torch.cat(pieces), want, rtol=1e-6, atol=1e-6)


def test_gated_rmsnorm():
    gen = torch.Generator().manual_seed(4)
    o, gate, w = torch.randn(3, H, K, generator=gen), torch.randn(3, H, K, generator=gen), \
        torch.randn(K, generator=gen)
    want = F.rms_norm(o, (K,), w, eps=1e-5) * torch.sigmoid(gate)
    torch.testing.assert_close(gated_rmsnorm(o, gate, w), want, rtol=1e-5, atol=1e-6)


def _random_weights(cfg, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    D, C, W = cfg.hidden_size, cfg.kda_num_heads * cfg.kda_head_dim, cfg.kda_short_conv_kernel_size
    Hh, Kk = cfg.kda_num_heads, cfg.kda_head_dim

    def lin(o, i):
        return (torch.randn(o, i, generator=gen) / i ** 0.5).to(dtype)

    w = {f"{x}_proj.weight": lin(C, D) for x in "qkv"}
    w |= {f"{x}_conv1d.weight": torch.randn(C, 1, W, generator=gen) / 2 for x in "qkv"}
    a_log = torch.zeros(128)
    a_log[:Hh] = torch.randn(Hh, generator=gen)  # padded 1-D as in the checkpoint
    w |= {
        "f_a_proj.weight": lin(Kk, D), "f_b_proj.weight": lin(C, Kk), "b_proj.weight": lin(Hh, D),
        "A_log": a_log, "dt_bias": torch.randn(C, generator=gen),
        "g_proj.weight": lin(C, D), "o_norm.weight": 1 + 0.1 * torch.randn(Kk, generator=gen),
        "o_proj.weight": lin(D, C),
    }
    return w


def _prefill_then_decode(layer, cfg, x, T0, dtype):
    state = KDAState.zeros(cfg, dtype)
    outs = [layer(x[:T0], state, mode="chunk")]
    for t in range(T0, x.shape[0]):
        outs.append(layer(x[t:t + 1], state, mode="recurrent"))
    return torch.cat(outs), state


@pytest.mark.parametrize("T0,N", [(70, 5), (3, 4)])
def test_layer_prefill_then_decode_fp32(T0, N):
    cfg = tiny_config()
    layer = KDALayer(cfg, _random_weights(cfg, torch.float32))
    x = torch.randn(T0 + N, cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    full_state = KDAState.zeros(cfg)
    full = layer(x, full_state)  # [T, D]
    split, state = _prefill_then_decode(layer, cfg, x, T0, torch.float32)
    assert full.shape == x.shape and full.dtype == torch.float32
    torch.testing.assert_close(split, full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state.S, full_state.S, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state.conv, full_state.conv)
    torch.testing.assert_close(layer(x, None, mode="recurrent"), full, rtol=1e-5, atol=1e-5)


def test_layer_bf16_close_to_fp32():
    cfg = tiny_config()
    w32 = _random_weights(cfg, torch.float32)
    w16 = {n: (t.to(torch.bfloat16) if t.dim() == 2 else t) for n, t in w32.items()}
    x = torch.randn(40, cfg.hidden_size, generator=torch.Generator().manual_seed(6))
    ref = KDALayer(cfg, w32)(x)
    layer = KDALayer(cfg, w16)
    xb = x.to(torch.bfloat16)
    full = layer(xb)
    split, state = _prefill_then_decode(layer, cfg, xb, 33, torch.bfloat16)
    assert full.dtype == split.dtype == torch.bfloat16 and state.conv.dtype == torch.bfloat16
    assert state.S.dtype == torch.float32
    assert torch.isfinite(full).all() and torch.isfinite(split).all()
    scale = ref.abs().max().item()
    assert (full.float() - ref).abs().max().item() < 0.05 * scale
    assert (split.float() - full.float()).abs().max().item() < 0.02 * scale


def test_layer_loads_tiny_fixture(tmp_path):
    info = make_tiny(tmp_path, "bf16")
    cfg = info.config
    assert cfg.is_kda_layer(0)
    prefix = "language_model.model.layers.0.self_attn."
    weights = {}
    with open_checkpoint(tmp_path) as ck:
        for name in ck.tensor_names():
            if name.startswith(prefix):
                a = ck.tensor(name)
                t = (torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
                     if a.dtype == np.uint16 else torch.from_numpy(a.copy()))
                weights[name[len(prefix):]] = t
    layer = KDALayer(cfg, weights)
    assert layer.dtype == torch.bfloat16 and layer.A_log.shape == (cfg.kda_num_heads,)
    x = torch.randn(9, cfg.hidden_size, generator=torch.Generator().manual_seed(7))
    xb = x.to(torch.bfloat16)
    full = layer(xb)
    split, _ = _prefill_then_decode(layer, cfg, xb, 6, torch.bfloat16)
    assert full.shape == (9, cfg.hidden_size) and torch.isfinite(full).all()
    scale = full.float().abs().max().item()
    assert scale > 0
    assert (split.float() - full.float()).abs().max().item() < 0.02 * scale
