"""Router and LatentMoE (FORMAT.md "Router", "LatentMoE"): hand-computed examples, a naive per-token
loop, and the resident expert provider over the tiny fixtures of every codec."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mtplx_runtime.checkpoint import open_checkpoint
from mtplx_runtime.fixtures.tiny import make_tiny
from mtplx_runtime.model.layers import glu_mlp, rms_norm
from mtplx_runtime.model.load import load_residents, sub
from mtplx_runtime.model.moe import ExpertWeights, LatentMoE, ResidentExpertProvider, route

MOE = "block_sparse_moe."
LAYOUTS = ("mxfp4", "w3", "t158", "bf16")  # every routed-expert codec make_tiny writes


def logit(s: float) -> float:
    return math.log(s / (1 - s))


# ---- router ----

SCORES = [0.5, 0.75, 0.25, 0.9, 0.1, 0.6]  # sigmoid scores of experts 0..5 for x = [1]
W_ROUTER = torch.tensor([[logit(s)] for s in SCORES])  # [6, 1]: logits = the column
BIAS = torch.tensor([0.0, 0.0, 0.7, 0.0, 0.0, 0.0])  # lifts expert 2 from 0.25 to 0.95


def test_router_hand_example_bias_selects_but_does_not_weight():
    x = torch.tensor([[1.0]])
    ids, w = route(x, W_ROUTER, torch.zeros(6), 2)
    assert ids.tolist() == [[1, 3]] and ids.dtype == torch.int64  # 0.75 and 0.9, id order
    np.testing.assert_allclose(w.numpy(), [[0.75 / 1.65, 0.9 / 1.65]], rtol=1e-6)
    ids, w = route(x, W_ROUTER, BIAS, 2)
    assert ids.tolist() == [[2, 3]]  # 0.95 and 0.9 after the bias
    assert w.dtype == torch.float32
    np.testing.assert_allclose(w.numpy(), [[0.25 / 1.15, 0.9 / 1.15]], rtol=1e-6)  # unbiased
    _, w = route(x, W_ROUTER, BIAS, 2, renormalize=False, scaling=2.5)
    np.testing.assert_allclose(w.numpy(), [[0.25 * 2.5, 0.9 * 2.5]], rtol=1e-6)
    _, w = route(x, W_ROUTER, BIAS, 2, scaling=2.5)
    np.testing.assert_allclose(w.numpy(), [[2.5 * 0.25 / 1.15, 2.5 * 0.9 / 1.15]], rtol=1e-6)


def test_router_renorm_epsilon_keeps_vanishing_scores_finite():
    w_router = torch.full((4, 1), -200.0)  # sigmoid underflows to 0 in fp32
    ids, w = route(torch.tensor([[1.0]]), w_router, torch.tensor([0.0, 1.0, 2.0, 0.0]), 2)
    assert ids.tolist() == [[1, 2]]
    assert torch.isfinite(w).all() and (w == 0).all()  # 0 / (0 + 1e-20)


def test_router_bf16_input_runs_in_fp32_and_sorts():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(7, 32, generator=g).to(torch.bfloat16)
    w_router = torch.randn(16, 32, generator=g).to(torch.bfloat16)
    bias = torch.randn(16, generator=g) * 0.1
    ids, w = route(x, w_router, bias, 4)
    ids32, w32 = route(x.float(), w_router.float(), bias, 4)
    assert torch.equal(ids, ids32) and torch.equal(w, w32) and w.dtype == torch.float32
    assert torch.equal(ids, ids.sort(-1).values)
    torch.testing.assert_close(w.sum(-1), torch.ones(7))
    # per token, the selection is the top-4 of the biased scores (no ties in random data)
    s = torch.sigmoid(x.float() @ w_router.float().T)
    for t in range(7):
        order = sorted(range(16), key=lambda e: -float(s[t, e] + bias[e]))[:4]
        assert ids[t].tolist() == sorted(order)
        picked = s[t, ids[t]]
        torch.testing.assert_close(w[t], picked / picked.sum(), rtol=1e-6, atol=0)


# ---- LatentMoE against hand values and a naive loop ----


class DictProvider(ResidentExpertProvider):
    """Experts from a dict; records every expert the block asked for, in the order asked."""

    def __init__(self, experts: dict[int, ExpertWeights]):
        self.requests = []
        super().__init__(lambda layer, e: experts[e], torch.float32)

    def experts(self, layer, ids):
        self.requests.append((layer, list(ids)))
        return super().experts(layer, ids)


def small_cfg(**kw):
    base = dict(hidden_size=2, num_experts=3, num_experts_per_token=2, routed_expert_hidden_size=2,
                moe_intermediate_size=1, num_shared_experts=1, latent_moe_use_norm=True,
                routed_scaling_factor=1.0, moe_renormalize=True, activation_situ_beta=4.0,
                activation_situ_linear_beta=25.0, rms_norm_eps=1e-5)
    return SimpleNamespace(**{**base, **kw})


def situ(g, u):
    return 4 * math.tanh(g / 4) / (1 + math.exp(-g)) * 25 * math.tanh(u / 25)


def test_latent_moe_hand_example():
    """D = R = 2, I = 1, three experts, one token x = [1, 0]; identity latent projections."""
    cfg = small_cfg()
    eye = torch.eye(2)
    a, b = [0.5, 1.0, 2.0], [1.0, -2.0, 3.0]  # expert e: gate = [a_e, 0], up = [b_e, 0]
    c = [[1.0, 2.0], [3.0, -1.0], [0.5, 0.25]]  # expert e: down column [c_e0, c_e1]
    experts = {e: ExpertWeights(torch.tensor([[a[e], 0.0]]), torch.tensor([[b[e], 0.0]]),
                                torch.tensor([[c[e][0]], [c[e][1]]])) for e in range(3)}
    weights = {
        "gate.weight": torch.tensor([[0.0, 9.0], [logit(0.75), 9.0], [logit(0.25), 9.0]]),
        "gate.e_score_correction_bias": torch.tensor([0.0, 0.0, 0.6]),  # picks 1 and 2
        "routed_expert_down_proj.weight": eye,
        "routed_expert_norm.weight": torch.tensor([1.0, 2.0]),
        "routed_expert_up_proj.weight": eye,
        "shared_experts.gate_proj.weight": torch.tensor([[1.0, 0.0]]),
        "shared_experts.up_proj.weight": torch.tensor([[1.0, 0.0]]),
        "shared_experts.down_proj.weight": torch.tensor([[1.0], [0.0]]),
    }
    prov = DictProvider(experts)
    moe = LatentMoE(cfg, 7, weights, prov)
    out = moe.forward(torch.tensor([[1.0, 0.0]]))
    assert prov.requests == [(7, [1, 2])] and moe.last_ids.tolist() == [[1, 2]]
    w1, w2 = 0.75 / 1.0, 0.25 / 1.0  # unbiased scores 0.75, 0.25 renormalised (sum 1)
    s = [w1 * situ(a[1], b[1]) * c[1][i] + w2 * situ(a[2], b[2]) * c[2][i] for i in range(2)]
    inv = 1 / math.sqrt((s[0] ** 2 + s[1] ** 2) / 2 + 1e-5)
    want = [s[0] * inv * 1.0 + situ(1.0, 1.0), s[1] * inv * 2.0]
    np.testing.assert_allclose(out.double().numpy(), [want], rtol=2e-6)


def random_block(cfg, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    D, R, I, E = cfg.hidden_size, cfg.routed_expert_hidden_size, cfg.moe_intermediate_size, \
        cfg.num_experts
    S = I * cfg.num_shared_experts

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    weights = {
        "gate.weight": rnd(E, D), "gate.e_score_correction_bias": torch.randn(E, generator=g),
        "routed_expert_down_proj.weight": rnd(R, D, scale=D ** -0.5),
        "routed_expert_norm.weight": rnd(R, scale=0.2) + 1,
        "routed_expert_up_proj.weight": rnd(D, R, scale=R ** -0.5),
        "shared_experts.gate_proj.weight": rnd(S, D, scale=D ** -0.5),
        "shared_experts.up_proj.weight": rnd(S, D, scale=D ** -0.5),
        "shared_experts.down_proj.weight": rnd(D, S, scale=S ** -0.5),
    }
    experts = {e: ExpertWeights(rnd(I, R, scale=R ** -0.5), rnd(I, R, scale=R ** -0.5),
                                rnd(R, I, scale=I ** -0.5)) for e in range(E)}
    return weights, experts, rnd(11, D)


def naive_moe(cfg, weights, experts, x):
    """FORMAT.md "LatentMoE", one token and one selected expert at a time, in sorted-id order."""
    rows = []
    for t in range(x.shape[0]):
        xt = x[t:t + 1]  # [1, D]
        ids, w = route(xt, weights["gate.weight"], weights["gate.e_score_correction_bias"],
                       cfg.num_experts_per_token, cfg.moe_renormalize, cfg.routed_scaling_factor)
        r = F.linear(xt, weights["routed_expert_down_proj.weight"])
        acc = torch.zeros(r.shape)
        for k, e in enumerate(ids[0].tolist()):
            ew = experts[e]
            y = glu_mlp(r, ew.gate, ew.up, ew.down)  # model dtype
            acc = acc + y.float() * w[0, k]
        m = rms_norm(acc.to(x.dtype), weights["routed_expert_norm.weight"], cfg.rms_norm_eps)
        shared = glu_mlp(xt, weights["shared_experts.gate_proj.weight"],
                         weights["shared_experts.up_proj.weight"],
                         weights["shared_experts.down_proj.weight"])
        rows.append(F.linear(m, weights["routed_expert_up_proj.weight"]) + shared)
    return torch.cat(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_latent_moe_equals_naive_per_token_loop(dtype):
    cfg = small_cfg(hidden_size=48, routed_expert_hidden_size=24, moe_intermediate_size=32,
                    num_experts=8, num_experts_per_token=3, num_shared_experts=2,
                    routed_scaling_factor=2.5)
    weights, experts, x = random_block(cfg, dtype, seed=6)
    prov = DictProvider(experts)
    moe = LatentMoE(cfg, 3, weights, prov)
    out = moe.forward(x)
    assert out.dtype == dtype and out.shape == x.shape
    (layer, asked), = prov.requests  # one request: the distinct ids, ascending
    assert layer == 3 and asked == sorted(set(moe.last_ids.flatten().tolist()))
    # GEMMs over a row subset may round differently from one-row GEMMs (BLAS blocking), so
    # this compares at the dtype's tolerance; the combine order is checked exactly below
    torch.testing.assert_close(out, naive_moe(cfg, weights, experts, x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_latent_moe_combine_is_the_sorted_fp32_sum(dtype):
    """Every GEMM exact (integer weights, expert width 1, identity latents, no norm, no shared
    MLP), so the output is exactly cast(Σ_k fp32(y_k) · w_k) summed left to right by id."""
    D, E, K, T = 6, 8, 4, 5
    cfg = small_cfg(hidden_size=D, routed_expert_hidden_size=D, moe_intermediate_size=1,
                    num_experts=E, num_experts_per_token=K, num_shared_experts=0,
                    latent_moe_use_norm=False)
    g = torch.Generator().manual_seed(9)
    ints = lambda *s: torch.randint(-3, 4, s, generator=g).float().to(dtype)  # noqa: E731
    experts = {e: ExpertWeights(ints(1, D) / 4, ints(1, D) / 4, ints(D, 1)) for e in range(E)}
    weights = {"gate.weight": torch.randn(E, D, generator=g).to(dtype),
               "gate.e_score_correction_bias": torch.zeros(E),
               "routed_expert_down_proj.weight": torch.eye(D, dtype=dtype),
               "routed_expert_up_proj.weight": torch.eye(D, dtype=dtype)}
    x = ints(T, D)
    moe = LatentMoE(cfg, 1, weights, DictProvider(experts))
    out = moe.forward(x)
    ids, w = route(x, weights["gate.weight"], weights["gate.e_score_correction_bias"], K)

    def combine(order, acc_dtype):
        want = torch.zeros(T, D, dtype=acc_dtype)
        for t in range(T):
            for k in order:
                ew = experts[int(ids[t, k])]
                y = glu_mlp(x[t:t + 1], ew.gate, ew.up, ew.down)[0]  # [D] model dtype
                want[t] = want[t] + (y.float() * w[t, k]).to(acc_dtype)
        return want.to(dtype)

    torch.testing.assert_close(out, combine(range(K), torch.float32), rtol=0, atol=0)
    # the test has teeth: reversing the fp32 order or accumulating in bf16 changes the bits
    if dtype == torch.float32:
        assert not torch.equal(out, combine(reversed(range(K)), torch.float32))
    else:
        assert not torch.equal(out, combine(range(K), torch.bfloat16))


# ---- resident provider over the tiny fixtures (all codecs) ----


@pytest.fixture(scope="module")
def tiny_ckpts(tmp_path_factory):
    out = {}
    for codec in LAYOUTS:
        info = make_tiny(tmp_path_factory.mktemp(codec), codec, seed=0)
        out[codec] = open_checkpoint(info.path)
    yield out
    for ckpt in out.values():
        ckpt.close()


@pytest.mark.parametrize("codec", LAYOUTS)
def test_resident_provider_matches_decode(tiny_ckpts, codec):
    ckpt = tiny_ckpts[codec]
    cfg = ckpt.config
    for dtype in (torch.float32, torch.bfloat16):
        prov = ResidentExpertProvider(ckpt, dtype)
        for layer in (cfg.moe_layers[0], cfg.moe_layers[-1]):
            got = prov.experts(layer, [0, 5, 7])
            assert sorted(got) == [0, 5, 7]
            for e, ew in got.items():
                dec = ckpt.expert(layer, e).decode()
                for proj in ("gate", "up", "down"):
                    t = getattr(ew, proj)
                    assert t.dtype == dtype and tuple(t.shape) == cfg.expert_shapes[proj]
                    # exact: decoded values are bf16-representable for every codec ("Numerics")
                    np.testing.assert_array_equal(t.float().numpy(), dec[proj])
            assert prov.experts(layer, [5])[5] is got[5]  # decoded once, then cached


def test_latent_moe_on_tiny_t158_layer(tiny_ckpts):
    ckpt = tiny_ckpts["t158"]
    cfg = ckpt.config
    for dtype in (torch.float32, torch.bfloat16):
        _, layers = load_residents(ckpt, dtype)
        weights = sub(layers[1], MOE)
        assert weights["gate.e_score_correction_bias"].dtype == torch.float32
        prov = ResidentExpertProvider(ckpt, dtype)
        moe = LatentMoE(cfg, 1, weights, prov)
        x = rms_norm(torch.randn(9, cfg.hidden_size, generator=torch.Generator().manual_seed(8))
                     .to(dtype), layers[1]["post_attention_layernorm.weight"], cfg.rms_norm_eps)
        out = moe.forward(x)
        assert out.dtype == dtype and out.shape == (9, cfg.hidden_size)
        assert torch.isfinite(out).all() and out.abs().max() > 0
        assert moe.last_ids.shape == (9, cfg.num_experts_per_token)
        experts = prov.experts(1, range(cfg.num_experts))
        torch.testing.assert_close(out, naive_moe(cfg, weights, experts, x))
