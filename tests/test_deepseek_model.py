"""The DeepSeek-V3 family's blocks one at a time against transformers' DeepSeek-V3 pieces: YaRN
frequencies and the softmax scale (bit for bit), RoPE on interleaved and half-split pairs,
group-limited routing (the same experts and weights as DeepseekV3TopkRouter), and SiLU-GLU as
SiTU-GLU with both betas at +inf on every kernel backend that runs on the host."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV3Config as HFConfig  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, yarn_apply_mscale  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf  # noqa: E402

from mtplx_runtime.checkpoint.deepseek_config import RopeScaling  # noqa: E402
from mtplx_runtime.kernels import cpu, cpu_native, reference  # noqa: E402
from mtplx_runtime.model.deepseek_v3 import rope_frequencies, rotate  # noqa: E402
from mtplx_runtime.model.moe import route  # noqa: E402

INF = math.inf
ROPES = {  # (rope_scaling of the config, our RopeScaling)
    "v3": ({"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
           RopeScaling("yarn", 10000.0, 40.0, 4096, 32.0, 1.0, 1.0, 1.0)),
    # Kimi K2's betas of 1 make a ramp of zero width (transformers widens it by 0.001)
    "k2": ({"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
            "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
           RopeScaling("yarn", 10000.0, 32.0, 4096, 1.0, 1.0, 1.0, 1.0)),
    "mscale-only": ({"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512,
                     "mscale_all_dim": 0.707},
                    RopeScaling("yarn", 10000.0, 8.0, 512, mscale_all_dim=0.707)),
    "no-truncate": ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                     "truncate": False},
                    RopeScaling("yarn", 10000.0, 4.0, 1024, truncate=False)),
    "default": (None, RopeScaling("default", 10000.0)),
}


def hf_config(rope_scaling) -> HFConfig:
    return HFConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                    qk_rope_head_dim=64, qk_nope_head_dim=128, max_position_embeddings=163840,
                    rope_theta=10000.0, rope_scaling=rope_scaling)


@pytest.mark.parametrize("name", sorted(ROPES))
def test_rope_frequencies_match_transformers(name):
    scaling, ours = ROPES[name]
    cfg = hf_config(scaling)
    kind = cfg.rope_parameters["rope_type"]
    fn = hf.DeepseekV3RotaryEmbedding.compute_default_rope_parameters if kind == "default" \
        else ROPE_INIT_FUNCTIONS[kind]
    want_inv, want_factor = fn(cfg)
    got_inv, got_factor = rope_frequencies(ours, 64)
    assert torch.equal(got_inv, want_inv)
    assert got_factor == want_factor


@pytest.mark.parametrize("name", sorted(ROPES))
def test_softmax_scale_matches_transformers(name):
    from mtplx_runtime.checkpoint.deepseek_config import DeepseekV3Config
    from mtplx_runtime.model.deepseek_v3 import softmax_scale

    scaling, _ = ROPES[name]
    cfg = hf_config(scaling)
    ours = DeepseekV3Config.from_dict({**cfg.to_dict(), "model_type": "deepseek_v3",
                                       "architectures": ["DeepseekV3ForCausalLM"]})
    assert softmax_scale(ours) == yarn_apply_mscale(cfg.rope_parameters, 192 ** -0.5)


@pytest.mark.parametrize("interleave", [True, False])
def test_rotate_matches_transformers(interleave):
    g = torch.Generator().manual_seed(0)
    T, H, P = 5, 3, 8
    q, k = torch.randn(1, H, T, P, generator=g), torch.randn(1, 1, T, P, generator=g)
    inv, _ = rope_frequencies(RopeScaling("default", 10000.0), P)
    freqs = torch.arange(T, dtype=torch.float32)[:, None] * inv  # [T, P/2]
    emb = torch.cat([freqs, freqs], -1)[None]
    apply = hf.apply_rotary_pos_emb_interleave if interleave else hf.apply_rotary_pos_emb
    want_q, want_k = apply(q, k, emb.cos(), emb.sin())
    got_q = rotate(q[0].transpose(0, 1), freqs.cos(), freqs.sin(), interleave)  # [T, H, P]
    got_k = rotate(k[0, 0], freqs.cos(), freqs.sin(), interleave)  # [T, P]
    assert torch.equal(got_q, want_q[0].transpose(0, 1))
    assert torch.equal(got_k, want_k[0, 0])


@pytest.mark.parametrize("groups", [(1, 1), (4, 2), (8, 3), (4, 4)])
def test_group_limited_routing_matches_transformers(groups):
    n_group, topk_group = groups
    E, K, D, T = 32, 4, 16, 64
    cfg = HFConfig(hidden_size=D, n_routed_experts=E, num_experts_per_tok=K, n_group=n_group,
                   topk_group=topk_group, routed_scaling_factor=2.5, norm_topk_prob=True)
    router = hf.DeepseekV3TopkRouter(cfg)
    g = torch.Generator().manual_seed(n_group * 10 + topk_group)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, D, generator=g))
        router.e_score_correction_bias.copy_(0.5 * torch.randn(E, generator=g))
    x = torch.randn(T, D, generator=g)
    with torch.no_grad():
        _, want_w, want_ids = router(x)
    ids, w = route(x, router.weight, router.e_score_correction_bias, K, True, 2.5,
                   n_group=n_group, topk_group=topk_group)
    order = want_ids.argsort(-1)
    assert torch.equal(ids, want_ids.gather(-1, order))
    torch.testing.assert_close(w, want_w.gather(-1, order), rtol=1e-6, atol=0)
    if topk_group < n_group:  # groups are dropped: without that stage other experts win
        free, _ = route(x, router.weight, router.e_score_correction_bias, K)
        assert not torch.equal(free, ids)


def test_silu_glu_is_situ_at_infinite_betas():
    g = torch.Generator().manual_seed(1)
    gate, up = 4 * torch.randn(64, 96, generator=g), 4 * torch.randn(64, 96, generator=g)
    got = reference.situ_glu(gate, up, INF, INF)
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=5e-7, atol=0)  # a few ulp
    # the finite betas still give SiTU-GLU, untouched
    assert not torch.allclose(reference.situ_glu(gate, up), got)


@pytest.mark.skipif(cpu_native.unavailable_reason() is not None, reason="no native library")
def test_native_silu_glu_on_every_isa():
    g = np.random.default_rng(2)
    x, u = (4 * g.standard_normal(1000)).astype(np.float32), \
        (4 * g.standard_normal(1000)).astype(np.float32)
    want = (x.astype(np.float64) / (1 + np.exp(-x.astype(np.float64)))) * u
    old = cpu_native.isa()
    try:
        outs = []
        for isa in cpu_native.ISAS[: cpu_native.ISAS.index(cpu_native.best_isa()) + 1]:
            cpu_native.set_isa(isa)
            outs.append(cpu_native.situ_glu(x, u, INF, INF))
    finally:
        cpu_native.set_isa(old)
    for out in outs:  # the same bits on every path, a few ulp from float64
        np.testing.assert_array_equal(out, outs[0])
        np.testing.assert_allclose(out, want, rtol=4e-7, atol=1e-30)


@pytest.mark.skipif(cpu_native.unavailable_reason() is not None, reason="no native library")
def test_cpu_expert_kernel_runs_silu():
    """A ct-int bank through the native kernels at beta = +inf equals the reference's SiLU."""
    import expert_banks

    R, I, E = 64, 128, 4
    layout, store = expert_banks.make_bank("ct-int", 4, R, I, E)
    shapes = {"gate": (I, R), "up": (I, R), "down": (R, I)}
    ids = torch.tensor([[0, 2], [1, 3], [0, 3]])
    w = torch.rand(3, 2, generator=torch.Generator().manual_seed(3))
    slots = {e: E - 1 - e for e in range(E)}
    x = torch.randn(3, R, generator=torch.Generator().manual_seed(4))
    want = reference.expert_mlp(x, ids, w, slots, store, layout, shapes, beta=INF, beta_lin=INF)
    got = cpu.expert_mlp(x, ids, w, slots, store, layout, shapes, beta=INF, beta_lin=INF)
    assert float((got - want).norm() / want.norm()) < 1e-5
    situ = reference.expert_mlp(x, ids, w, slots, store, layout, shapes)
    assert float((situ - want).norm() / want.norm()) > 1e-2


def test_lookahead_guesses_use_the_group_limit(tmp_path):
    """A later layer's router applied to this state guesses its experts with the group stage
    (model/moe.predict), as that layer will route."""
    from mtplx_runtime import load_model
    from mtplx_runtime.fixtures.tiny_deepseek import make_tiny_deepseek
    from mtplx_runtime.model.moe import predict

    model = load_model(make_tiny_deepseek(tmp_path / "m", "bf16", "v3").path, dtype="float32")
    first, second = model.moe_blocks()
    assert first.later == [second]
    x = torch.randn(256, model.cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    (layer, guess), = predict(x, first.later).items()
    want, _ = route(x, second.router, second.bias, 2, n_group=4, topk_group=2)
    free, _ = route(x, second.router, second.bias, 2)
    assert layer == second.layer and torch.equal(guess, want) and not torch.equal(guess, free)
