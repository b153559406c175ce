"""Gated NoPE MLA and its compressed cache (FORMAT.md "MLA").

Oracles: the two computation forms against each other, incremental decode against one full
forward, a direct recomputation of the cached rows, and transformers' Kimi-Linear MLA
(`KimiLinearAttention`) as an outside implementation of the same attention.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from mtplx_runtime.checkpoint import open_checkpoint
from mtplx_runtime.fixtures.tiny import make_tiny, tiny_config
from mtplx_runtime.model.layers import rms_norm
from mtplx_runtime.model.mla import (
    GATE_NAME,
    KEY_BUCKET,
    MLA_NORM_EPS,
    WEIGHT_NAMES,
    MLACache,
    MLALayer,
    cache_values_per_token,
    causal_mask,
    softmax_masked,
)

CFG = tiny_config()  # 4 heads, q_lora 24, kv_lora 16, nope 16, rope 8, v 16, hidden 128


def random_weights(cfg, dtype=torch.float32, seed=0) -> dict[str, torch.Tensor]:
    """Random MLA weights, ~unit-variance activations; norms away from 1 so they matter."""
    g = torch.Generator().manual_seed(seed)
    H, N, P, V, C = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                     cfg.v_head_dim, cfg.kv_lora_rank)
    D, Q = cfg.hidden_size, cfg.q_lora_rank

    def lin(o, i, gain=1.0):
        return torch.randn(o, i, generator=g) * gain / i**0.5

    w = {
        "q_a_proj.weight": lin(Q, D),
        "q_a_layernorm.weight": 1 + 0.3 * torch.randn(Q, generator=g),
        "q_b_proj.weight": lin(H * (N + P), Q, 2.0),  # gain 2: peakier attention, a sharper test
        "kv_a_proj_with_mqa.weight": lin(C + P, D, 2.0),
        "kv_a_layernorm.weight": 1 + 0.3 * torch.randn(C, generator=g),
        "kv_b_proj.weight": lin(H * (N + V), C),
        GATE_NAME: lin(H * V, D),
        "o_proj.weight": lin(D, H * V),
    }
    return {k: v.to(dtype) for k, v in w.items()}


def rand_x(t, seed=1, dtype=torch.float32):
    return torch.randn(t, CFG.hidden_size, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("prefix,t", [(0, 1), (0, 7), (5, 1), (5, 13), (12, 20)])
def test_absorbed_equals_expanded(prefix, t):
    layer = MLALayer(CFG, random_weights(CFG))
    x = rand_x(prefix + t)
    outs = []
    for absorbed in (False, True):
        cache = MLACache.empty(CFG, torch.float32, capacity=4)  # also exercises doubling
        if prefix:
            layer.forward(x[:prefix], cache)
        outs.append(layer.forward(x[prefix:], cache, absorbed=absorbed))
        assert cache.len == prefix + t
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=2e-6)
    assert outs[0].abs().max() > 0.1  # not trivially small


def test_prefill_then_decode_equals_full_forward():
    layer = MLALayer(CFG, random_weights(CFG))
    T, N = 9, 6
    x = rand_x(T + N)
    full = layer.forward(x, None)  # expanded, throwaway cache
    cache = MLACache.empty(CFG, torch.float32, capacity=2)
    steps = [layer.forward(x[:T], cache)]
    steps += [layer.forward(x[T + i: T + i + 1], cache) for i in range(N)]  # absorbed (default)
    torch.testing.assert_close(torch.cat(steps), full, rtol=0, atol=1e-5)
    assert cache.len == T + N and cache.capacity == 16


def test_bfloat16_close_to_float32():
    w32 = random_weights(CFG)
    # Round the weights to bf16 first so only activation rounding differs between the two runs.
    w16 = {k: v.to(torch.bfloat16) for k, v in w32.items()}
    ref = MLALayer(CFG, {k: v.float() for k, v in w16.items()})
    layer = MLALayer(CFG, w16)
    x = rand_x(14).to(torch.bfloat16)
    want = ref.forward(x.float())
    for absorbed in (False, True):
        cache = MLACache.empty(CFG, torch.bfloat16)
        got = torch.cat([layer.forward(x[:10], cache, absorbed=absorbed)]
                        + [layer.forward(x[i: i + 1], cache, absorbed=absorbed)
                           for i in range(10, 14)])
        assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
        assert cache.buf.dtype == torch.bfloat16
        err = (got.float() - want).norm() / want.norm()
        assert err < 3e-2, err


def test_cache_rows_are_normed_latent_and_raw_k_pe():
    w = random_weights(CFG)
    layer = MLALayer(CFG, w)
    x = rand_x(6)
    cache = MLACache.empty(CFG, torch.float32)
    layer.forward(x[:4], cache)
    layer.forward(x[4:5], cache)
    layer.forward(x[5:], cache, absorbed=False)
    # Same chunks as the forward calls, so the GEMM rounds identically and k_pe can match exactly.
    kv = torch.cat([torch.nn.functional.linear(c, w["kv_a_proj_with_mqa.weight"])
                    for c in (x[:4], x[4:5], x[5:])])  # [T, C + P]
    C = CFG.kv_lora_rank
    c_kv = kv[:, :C].double()
    c_bar = c_kv / torch.sqrt(c_kv.pow(2).mean(-1, keepdim=True) + 1e-6) * w[
        "kv_a_layernorm.weight"].double()
    torch.testing.assert_close(cache.latent.double(), c_bar, rtol=0, atol=1e-5)
    torch.testing.assert_close(cache.k_pe, kv[:, C:], rtol=0, atol=0)  # not normed, not rotated
    torch.testing.assert_close(cache.rows, torch.cat([cache.latent, cache.k_pe], -1))
    assert MLA_NORM_EPS == 1e-6
    # The eps is really 1e-6: on a near-zero latent 1e-5 and 1e-6 give visibly different c̄.
    small = torch.full((1, C), 1e-3)
    ones = torch.ones(C)
    assert not torch.allclose(rms_norm(small, ones, 1e-6), rms_norm(small, ones, 1e-5), atol=1e-3)
    assert cache.buf.shape[1] == cache_values_per_token(CFG) == 24


def test_cache_width_at_k3_dims():
    k3 = dataclasses.replace(CFG, kv_lora_rank=512, qk_rope_head_dim=64, num_attention_heads=96,
                             num_key_value_heads=96)
    assert cache_values_per_token(k3) == 576
    assert MLACache.empty(k3, torch.bfloat16, capacity=3).buf.shape == (3, 576)
    per_token = MLACache.empty(k3, torch.bfloat16, capacity=1).buf.nbytes
    assert 24 * per_token == 27_648  # K3: 24 MLA layers, bf16 (FORMAT.md "MLA")


def test_static_cache_and_trim():
    layer = MLALayer(CFG, random_weights(CFG))
    x = rand_x(5)
    cache = MLACache.empty(CFG, torch.float32, capacity=4, grow=False)
    layer.forward(x[:4], cache)
    with pytest.raises(ValueError, match="full"):
        layer.forward(x[4:], cache)
    cache = MLACache.empty(CFG, torch.float32)
    layer.forward(x[:3], cache)
    before = cache.rows.clone()
    layer.forward(x[3:], cache)
    cache.trim(3)  # rejected tokens go; the rest is untouched
    torch.testing.assert_close(cache.rows, before, rtol=0, atol=0)


def test_weight_checks():
    w = random_weights(CFG)
    with pytest.raises(KeyError):
        MLALayer(CFG, {k: v for k, v in w.items() if k != GATE_NAME})
    bad = dict(w, **{"kv_b_proj.weight": w["kv_b_proj.weight"][:-1]})
    with pytest.raises(ValueError, match="kv_b_proj"):
        MLALayer(CFG, bad)
    no_gate = dataclasses.replace(CFG, mla_use_output_gate=False)
    MLALayer(no_gate, {k: v for k, v in w.items() if k != GATE_NAME})


# --- outside check: transformers' Kimi-Linear MLA -----------------------------------------------


def hf_mla(cfg, w):
    """transformers' `KimiLinearAttention` with our weights; o_proj replaced by the identity.

    Kimi-Linear has no output gate, so its o_proj input is exactly our pre-gate `attend` output;
    the gate and o_proj are checked separately by recomputing them by hand. Only the attention
    module is built: it is pure torch, so fla (installed here) is never reached.
    """
    kl = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig

    hc = KimiLinearConfig(
        hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, mla_use_nope=True,
    )
    hc._attn_implementation = "eager"
    attn = kl.KimiLinearAttention(hc, layer_idx=0).eval()
    assert attn.q_a_layernorm.variance_epsilon == attn.kv_a_layernorm.variance_epsilon == 1e-6
    attn.load_state_dict({k: v for k, v in w.items() if k != GATE_NAME})
    attn.o_proj = torch.nn.Identity()
    return attn


def hf_run(attn, x, cache, past):
    """Run [T, D] through the HF module with an explicit causal mask over past + T keys."""
    T = x.shape[0]
    allowed = torch.arange(past + T)[None, :] <= torch.arange(past, past + T)[:, None]
    mask = torch.zeros(T, past + T).masked_fill(~allowed, float("-inf"))[None, None]
    with torch.no_grad():
        out, _ = attn(x[None], mask, cache=cache)
    return out[0]


def test_matches_transformers_kimi_linear_mla():
    from transformers.cache_utils import DynamicCache

    w = random_weights(CFG, seed=3)
    layer = MLALayer(CFG, w)
    attn = hf_mla(CFG, w)
    x = rand_x(16, seed=4)
    T = 11

    # Full causal forward, no cache on either side.
    want = hf_run(attn, x, None, 0)
    for absorbed in (False, True):
        torch.testing.assert_close(layer.attend(x, None, absorbed), want, rtol=0, atol=2e-6)

    # Cache semantics: HF's DynamicCache holds the same compressed (c̄, k_pe) that we hold;
    # prefill T then 1-token decode steps must match its incremental outputs and its full pass.
    hf_cache = DynamicCache()
    ours = MLACache.empty(CFG, torch.float32)
    got_hf = [hf_run(attn, x[:T], hf_cache, 0)]
    got = [layer.attend(x[:T], ours)]
    for i in range(T, 16):
        got_hf.append(hf_run(attn, x[i: i + 1], hf_cache, i))
        got.append(layer.attend(x[i: i + 1], ours))
    torch.testing.assert_close(torch.cat(got_hf), want, rtol=0, atol=2e-6)
    torch.testing.assert_close(torch.cat(got), want, rtol=0, atol=2e-6)
    hf_latent = hf_cache.layers[0].keys[0, 0]  # [S, C]: kv_nope after kv_a_layernorm
    hf_k_pe = hf_cache.layers[0].values[0, 0]  # [S, P]: k_rot, untouched
    torch.testing.assert_close(ours.latent, hf_latent, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.k_pe, hf_k_pe, rtol=0, atol=1e-6)

    # The K3 output gate on top: o_proj(attn ⊙ σ(W_g x)).
    gated = (want * torch.sigmoid(x @ w[GATE_NAME].T)) @ w["o_proj.weight"].T
    torch.testing.assert_close(layer.forward(x), gated, rtol=0, atol=2e-6)


def test_bf16_expanded_is_bitwise_transformers_eager():
    """Eager numerics (FORMAT.md "Numerics"): QKᵀ bf16, × scale bf16, softmax fp32 -> bf16,
    PV bf16, as HF eager."""
    w = {k: v.to(torch.bfloat16) for k, v in random_weights(CFG, seed=3).items()}
    attn = hf_mla(CFG, w).to(torch.bfloat16)
    x = rand_x(16, seed=4, dtype=torch.bfloat16)
    T = x.shape[0]
    allowed = torch.arange(T)[None, :] <= torch.arange(T)[:, None]
    mask = torch.zeros(T, T, dtype=torch.bfloat16).masked_fill(~allowed, float("-inf"))
    with torch.no_grad():
        want = attn(x[None], mask[None, None])[0][0]
    assert torch.equal(MLALayer(CFG, w).attend(x, None, absorbed=False), want)


# --- the real tiny fixture ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_fixture_layer3(tmp_path, dtype):
    make_tiny(tmp_path / "tiny", "bf16")
    ckpt = open_checkpoint(tmp_path / "tiny")
    cfg = ckpt.config
    assert not cfg.is_kda_layer(3)
    prefix = "language_model.model.layers.3.self_attn."
    w = {}
    for name in WEIGHT_NAMES + (GATE_NAME,):
        bits = np.ascontiguousarray(ckpt.tensor(prefix + name))
        w[name] = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).to(dtype)
    layer = MLALayer(cfg, w)
    x = rand_x(8, seed=5, dtype=dtype)
    cache = MLACache.empty(cfg, dtype)
    out = torch.cat([layer.forward(x[:5], cache)]
                    + [layer.forward(x[i: i + 1], cache) for i in range(5, 8)])
    assert out.shape == (8, cfg.hidden_size) and out.dtype == dtype
    assert torch.isfinite(out).all() and out.abs().max() > 0
    full = layer.forward(x, None)
    tol = 1e-5 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(out.float(), full.float(), rtol=0, atol=tol)


def _absorbed_unpadded(layer, q_nope, q_pe, cache, allowed):
    """The absorbed form over exactly the live rows (the definition before key padding)."""
    q_lat = torch.einsum("thn,hnc->htc", q_nope, layer.w_uk)
    q = torch.cat([q_lat, q_pe.transpose(0, 1)], -1)
    p = softmax_masked((q @ cache.rows.T) * layer.scale, allowed)
    return torch.einsum("htc,hvc->thv", p @ cache.latent, layer.w_uv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_absorbed_key_padding_is_bit_identical(dtype):
    # In bf16 _absorbed pads the key count to KEY_BUCKET (one oneDNN kernel shape per bucket, not
    # per token); the padded columns must change no bit, before or after a trim left stale rows.
    # (float32 does not pad: the same check then holds trivially.)
    layer = MLALayer(CFG, random_weights(CFG, dtype))
    x = rand_x(KEY_BUCKET + 40, dtype=dtype)
    cache = MLACache.empty(CFG, dtype, capacity=8)
    layer.forward(x[:1], cache)
    for i in range(1, len(x)):
        if i == KEY_BUCKET + 20:
            cache.trim(i - 5)  # rows past len were written: padding must weigh them zero
        t = x[i:i + 1]
        q_nope, q_pe, latent, k_pe = layer.project(t)
        cache.append(latent, k_pe)
        allowed = causal_mask(1, cache.len, "cpu")
        got = layer._absorbed(q_nope, q_pe, cache, allowed)
        assert torch.equal(got, _absorbed_unpadded(layer, q_nope, q_pe, cache, allowed)), i
