"""Router oracle (FORMAT.md "Router"): our `route` against transformers'
`DeepseekV3TopkRouter`, the same "noaux_tc" sigmoid router K3 inherits.

Mapping: our `w_router` [E, D] is the oracle's `weight`, our `bias` its
`e_score_correction_bias`; K3 sets n_group = topk_group = 1 (the group stage keeps every
expert), norm_topk_prob = True and routed_scaling_factor = 1.0.

What differs in K3 / in our implementation, and how the comparison allows for it:
* ids: the oracle returns `topk(sorted=False)` order; ours are sorted ascending by expert id
  (fixes the fp32 combine order). Compared as sets per token, weights aligned by id.
* renormalisation: K3 divides by (Σw + 1e-20); transformers' DeepseekV3 has the
  same +1e-20, so the weights agree to fp32 rounding (ulps, from the summation order).
* DeepSeek-V3 itself uses n_group 8 / topk_group 4 and scaling 2.5; K3 does not ("Geometry").
"""

import pytest
import torch

from mtplx_runtime.model.moe import route

ds = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3",
                         reason="transformers with DeepseekV3 is not installed")
DeepseekV3Config = pytest.importorskip("transformers").DeepseekV3Config


def oracle(w_router, bias, top_k, scaling=1.0):
    """transformers' DeepseekV3TopkRouter with K3's router settings and our weights."""
    n_exp, hidden = w_router.shape
    cfg = DeepseekV3Config(hidden_size=hidden, n_routed_experts=n_exp, num_experts_per_tok=top_k,
                           n_group=1, topk_group=1, norm_topk_prob=True,
                           routed_scaling_factor=scaling, num_hidden_layers=1)
    gate = ds.DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        gate.weight.copy_(w_router.float())
        gate.e_score_correction_bias.copy_(bias.float())
    return gate


def run_oracle(gate, x):
    with torch.no_grad():
        _, w, ids = gate(x)
    return ids, w


def assert_same_routing(ids, w, ref_ids, ref_w, rtol=1e-6):
    """Same expert set per token; weights equal after aligning by expert id."""
    order = torch.argsort(ref_ids, dim=-1)
    ref_ids_sorted = ref_ids.gather(-1, order)
    ref_w_sorted = ref_w.gather(-1, order)
    assert torch.equal(ids, ref_ids_sorted), "selected expert sets differ"
    assert torch.equal(ids, torch.sort(ids, dim=-1).values), "our ids must be sorted by id"
    assert w.dtype == torch.float32
    torch.testing.assert_close(w, ref_w_sorted, rtol=rtol, atol=1e-7)


@pytest.mark.parametrize("n_exp,top_k,hidden,dtype", [
    (8, 2, 128, torch.float32),       # the tiny fixture's router
    (64, 16, 96, torch.float32),      # K3's top-16
    (896, 16, 64, torch.bfloat16),    # K3's expert count; bf16 input and weight cast to fp32
])
def test_route_matches_deepseek_v3_router(n_exp, top_k, hidden, dtype):
    g = torch.Generator().manual_seed(n_exp + top_k)
    x = torch.randn(33, hidden, generator=g).to(dtype)
    w_router = (torch.randn(n_exp, hidden, generator=g) * hidden ** -0.5).to(dtype)
    bias = torch.randn(n_exp, generator=g) * 0.02
    ids, w = route(x, w_router, bias, top_k, renormalize=True, scaling=1.0)
    ref_ids, ref_w = run_oracle(oracle(w_router, bias, top_k), x.float())
    assert_same_routing(ids, w, ref_ids, ref_w)
    torch.testing.assert_close(w.sum(-1), torch.ones(x.shape[0]), rtol=1e-6, atol=1e-6)


def test_bias_changes_selection_same_as_oracle():
    """A large correction bias must move the selection (not the weights' formula) identically."""
    g = torch.Generator().manual_seed(7)
    n_exp, top_k, hidden = 16, 4, 32
    x = torch.randn(64, hidden, generator=g)
    w_router = torch.randn(n_exp, hidden, generator=g) * hidden ** -0.5
    bias = torch.zeros(n_exp)
    bias[[3, 11]] = 1.0  # > any sigmoid gap: experts 3 and 11 are in every top-4
    ids0, _ = route(x, w_router, torch.zeros(n_exp), top_k)
    ids, w = route(x, w_router, bias, top_k)
    assert not torch.equal(ids0, ids), "the bias should change the selection"
    assert bool((ids == 3).any(-1).all()) and bool((ids == 11).any(-1).all())
    ref_ids, ref_w = run_oracle(oracle(w_router, bias, top_k), x)
    assert_same_routing(ids, w, ref_ids, ref_w)
    # The weights are the unbiased sigmoid scores of the picks, renormalised (Router step 4).
    s = torch.sigmoid(x @ w_router.T).gather(-1, ids)
    torch.testing.assert_close(w, s / (s.sum(-1, keepdim=True) + 1e-20))


def test_scaling_and_no_renormalise_match_oracle_formula():
    """Non-K3 settings still follow the same formula (K3 uses scaling 1.0, renormalise on)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(10, 24, generator=g)
    w_router = torch.randn(8, 24, generator=g) * 0.2
    bias = torch.randn(8, generator=g) * 0.05
    ids, w = route(x, w_router, bias, 2, renormalize=True, scaling=2.446)
    ref_ids, ref_w = run_oracle(oracle(w_router, bias, 2, scaling=2.446), x)
    assert_same_routing(ids, w, ref_ids, ref_w)
