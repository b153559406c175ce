"""RMSNorm, SiTU-GLU and the AttnRes mix against slow per-element references (FORMAT.md
"RMSNorm", "SiTU-GLU", "Attention Residuals"), in float32 and bfloat16; the bf16 references
round exactly where "Numerics" says."""

import math

import numpy as np
import pytest
import torch

from mtplx_runtime.model.layers import GluMLP, attn_res_mix, glu_mlp, rms_norm, situ_glu

F32 = np.float32


def bf16_round(a) -> np.ndarray:
    """float32 -> nearest bf16 (ties to even), returned as float32 values (finite inputs)."""
    u = np.asarray(a, dtype=F32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(F32)


def to_np(t: torch.Tensor) -> np.ndarray:
    return t.float().numpy()


def bf16_ulp(v: np.ndarray) -> np.ndarray:
    """Spacing of bf16 numbers at |v| (8 significant bits)."""
    e = np.floor(np.log2(np.maximum(np.abs(v), 1e-30)))
    return np.exp2(e - 7)


# ---- RMSNorm ----


def rms_norm_ref(x: np.ndarray, w: np.ndarray, eps: float, bf16: bool) -> np.ndarray:
    """One row, one element at a time: fp32 statistics, cast, then the weight multiply."""
    out = np.empty_like(x, dtype=F32)
    for t in range(x.shape[0]):
        ss = F32(0)
        for d in range(x.shape[1]):
            ss = F32(ss + F32(x[t, d]) * F32(x[t, d]))
        inv = F32(1.0 / math.sqrt(float(F32(ss / F32(x.shape[1]))) + eps))
        for d in range(x.shape[1]):
            y = F32(x[t, d] * inv)
            if bf16:
                # cast to bf16 first; the bf16 x bf16 product is exact in fp32, then rounds once
                out[t, d] = bf16_round(F32(bf16_round(y) * F32(w[d])))
            else:
                out[t, d] = F32(y * F32(w[d]))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_per_element_reference(dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(5, 24, generator=g) * 3).to(dtype)
    w = (1 + torch.randn(24, generator=g) * 0.5).to(dtype)
    out = rms_norm(x, w, 1e-5)
    assert out.dtype == dtype
    ref = rms_norm_ref(to_np(x), to_np(w), 1e-5, dtype == torch.bfloat16)
    if dtype == torch.float32:
        np.testing.assert_allclose(to_np(out), ref, rtol=2e-6, atol=1e-7)
    else:
        # the fp32 statistics may differ by an ulp from the reference's summation order, which
        # moves a bf16 result by at most one ulp
        err = np.abs(to_np(out) - ref)
        assert np.all(err <= bf16_ulp(ref) * 1.0001)
        assert np.mean(err == 0) > 0.95


def test_rms_norm_bf16_casts_before_the_weight():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 64, generator=g).to(torch.bfloat16)
    w = (1 + torch.randn(64, generator=g) * 0.3).to(torch.bfloat16)
    out = to_np(rms_norm(x, w, 1e-5))
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)
    cast_first = to_np(w * y.to(torch.bfloat16))
    multiply_first = to_np((w.float() * y).to(torch.bfloat16))
    np.testing.assert_array_equal(out, cast_first)
    assert np.any(out != multiply_first)  # the order is observable, so the test has teeth


def test_rms_norm_hand_values():
    x = torch.tensor([[3.0, 4.0]])  # mean square 12.5
    w = torch.tensor([2.0, 0.5])
    inv = 1 / math.sqrt(12.5 + 1e-6)
    np.testing.assert_allclose(to_np(rms_norm(x, w, 1e-6)), [[6 * inv, 2 * inv]], rtol=1e-6)


# ---- SiTU-GLU ----


def situ_ref(g: float, u: float, beta=4.0, beta_lin=25.0) -> float:
    return beta * math.tanh(g / beta) / (1 + math.exp(-g)) * beta_lin * math.tanh(u / beta_lin)


def test_situ_hand_points():
    assert situ_ref(0.0, 1.0) == 0.0
    # saturation: SiTU -> β for large g; u' -> β_lin for large u
    pts = [(0.0, 1.0), (1.0, 1.0), (-1.0, 2.0), (2.5, -3.0), (100.0, 1000.0), (-50.0, 5.0),
           (8.0, 25.0), (0.125, -0.5)]
    g = torch.tensor([p[0] for p in pts])
    u = torch.tensor([p[1] for p in pts])
    got = situ_glu(g, u).tolist()
    for (gi, ui), v in zip(pts, got):
        assert v == pytest.approx(situ_ref(gi, ui), rel=2e-6, abs=1e-30)
    assert got[4] == pytest.approx(4.0 * 25.0, rel=1e-6)
    # explicit numbers: SiTU(1) = 4 tanh(1/4) σ(1); u'(1) = 25 tanh(1/25)
    assert got[1] == pytest.approx(4 * 0.24491866240370913 * 0.7310585786300049
                                   * 25 * 0.039978680311840524, rel=2e-6)


def test_situ_bf16_is_one_rounding_of_the_fp32_island():
    g = torch.Generator().manual_seed(3)
    gate = (torch.randn(4096, generator=g) * 4).to(torch.bfloat16)
    up = (torch.randn(4096, generator=g) * 4).to(torch.bfloat16)
    out = situ_glu(gate, up)
    assert out.dtype == torch.bfloat16
    exact = np.array([situ_ref(a, b) for a, b in zip(gate.float().tolist(), up.float().tolist())])
    bound = 0.5 * bf16_ulp(exact) * 1.01 + 1e-30  # one rounding of a ~fp32-exact value

    def ok(t):
        return np.abs(to_np(t).astype(np.float64) - exact) <= bound

    assert ok(out).all()
    # doing the activation in bf16 throughout breaks the one-rounding bound somewhere
    b = 4.0
    all_bf16 = (b * torch.tanh(gate / b) * torch.sigmoid(gate)) * (25 * torch.tanh(up / 25))
    assert not ok(all_bf16).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_glu_mlp_class_matches_function(dtype):
    g = torch.Generator().manual_seed(4)
    w = {"gate_proj.weight": torch.randn(16, 8, generator=g).to(dtype),
         "up_proj.weight": torch.randn(16, 8, generator=g).to(dtype),
         "down_proj.weight": torch.randn(8, 16, generator=g).to(dtype)}
    x = torch.randn(3, 8, generator=g).to(dtype)
    out = GluMLP(w).forward(x)
    assert out.dtype == dtype and out.shape == (3, 8)
    ref = glu_mlp(x, w["gate_proj.weight"], w["up_proj.weight"], w["down_proj.weight"])
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    # hand check of one output in fp32: down · (situ(gate x) ⊙ u'(up x))
    if dtype == torch.float32:
        xs, wd = x[0].double(), w["down_proj.weight"].double()
        gv = (w["gate_proj.weight"].double() @ xs).tolist()
        uv = (w["up_proj.weight"].double() @ xs).tolist()
        h = torch.tensor([situ_ref(a, b) for a, b in zip(gv, uv)], dtype=torch.float64)
        np.testing.assert_allclose(out[0].double().numpy(), (wd @ h).numpy(), rtol=1e-4,
                                   atol=1e-4)


# ---- AttnRes mix ----


def mix_ref(partial, bank, w_norm, w_proj, eps=1e-5):
    """Per token, per entry, in float64: the formula of FORMAT.md "Attention Residuals" with no
    vectorisation."""
    p = partial.double().numpy()
    bs = [b.double().numpy() for b in bank]
    w = w_norm.double().numpy().reshape(-1) * w_proj.double().numpy().reshape(-1)
    out = np.empty_like(p)
    for t in range(p.shape[0]):
        vals = [b[t] for b in bs] + [p[t]]  # bank first, live sum last
        scores = []
        for v in vals:
            k = v / math.sqrt(float(np.mean(v * v)) + eps)
            scores.append(sum(float(k[d]) * float(w[d]) for d in range(len(v))))
        m = max(scores)
        ex = [math.exp(s - m) for s in scores]
        alpha = [e / sum(ex) for e in ex]
        out[t] = sum(a * v for a, v in zip(alpha, vals))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [0, 1, 2, 3])
def test_attn_res_mix_matches_per_token_loop(dtype, n):
    g = torch.Generator().manual_seed(10 + n)
    T, D = 4, 32
    bank = [(torch.randn(T, D, generator=g) * (1 + i)).to(dtype) for i in range(n)]
    partial = (torch.randn(T, D, generator=g) * 2).to(dtype)
    w_norm = (1 + 0.3 * torch.randn(D, generator=g)).to(dtype)
    w_proj = (0.5 * torch.randn(1, D, generator=g)).to(dtype)
    snapshot = [b.clone() for b in bank] + [partial.clone()]
    out = attn_res_mix(partial, bank, w_norm, w_proj)
    assert out.dtype == dtype and out.shape == (T, D)
    assert out.data_ptr() != partial.data_ptr()  # fresh buffer
    for before, after in zip(snapshot, bank + [partial]):
        torch.testing.assert_close(before, after, rtol=0, atol=0)
    ref = mix_ref(partial, bank, w_norm, w_proj)
    if n == 0:
        torch.testing.assert_close(out, partial, rtol=0, atol=0)  # softmax over one entry
    elif dtype == torch.float32:
        np.testing.assert_allclose(to_np(out), ref, rtol=1e-5, atol=1e-5)
    else:
        # fp32 island: one rounding of an fp32-accurate value, so within half a bf16 ulp (+slack)
        err = np.abs(to_np(out).astype(np.float64) - ref)
        assert np.all(err <= 0.5 * bf16_ulp(ref) * 1.01 + 1e-6)


def test_attn_res_mix_hand_example():
    # two entries with rms 1: both K_i = V_i; w = w_n ⊙ w_p = [1, 0] -> both score 1 -> α = 1/2
    bank = [torch.tensor([[1.0, 1.0]])]
    partial = torch.tensor([[1.0, -1.0]])
    out = attn_res_mix(partial, bank, torch.tensor([2.0, 3.0]), torch.tensor([[0.5, 0.0]]))
    torch.testing.assert_close(out, torch.tensor([[1.0, 0.0]]), rtol=0, atol=1e-7)
    # w = [0, 1]: scores +1 (bank) and -1 (live) -> α = σ(2), σ(-2)
    out = attn_res_mix(partial, bank, torch.tensor([1.0, 1.0]), torch.tensor([0.0, 1.0]))
    a = 1 / (1 + math.exp(-2 / math.sqrt(1 + 1e-5)))
    torch.testing.assert_close(out, torch.tensor([[1.0, 2 * a - 1]]), rtol=1e-6, atol=1e-7)
