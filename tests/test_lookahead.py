"""Residual-stream lookahead: predict == route() with the later routers; scoring counters."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mtplx_runtime.model.moe import predict, route
from mtplx_runtime.offload.lookahead import LookaheadScore, predicted_keys


def make_blocks(depth, d=16, e=8, k=2, seed=0):
    """Stand-ins for later LatentMoE blocks: what `predict` reads of them."""
    g = torch.Generator().manual_seed(seed)
    cfg = SimpleNamespace(num_experts_per_token=k)
    return [SimpleNamespace(layer=3 + j, cfg=cfg,
                            router=torch.randn(e, d, generator=g).to(torch.bfloat16),
                            bias=torch.randn(e, generator=g) * 0.1) for j in range(depth)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_predict_equals_route_with_each_later_router(dtype):
    hidden = torch.randn(5, 16, generator=torch.Generator().manual_seed(1)).to(dtype)  # [T, D]
    blocks = make_blocks(3)
    preds = predict(hidden, blocks)
    assert list(preds) == [3, 4, 5]
    for m in blocks:
        want, _ = route(hidden, m.router, m.bias, 2)
        assert preds[m.layer].shape == (5, 2) and preds[m.layer].dtype == torch.int64
        assert torch.equal(preds[m.layer], want)
    assert not torch.equal(preds[3], preds[4])  # teeth: each block's own router


def test_predicted_keys_depth_first_and_distinct():
    preds = [torch.tensor([[0, 1], [1, 2]]), torch.tensor([[3, 4], [3, 4]])]
    assert predicted_keys([3, 4], preds) == [(3, 0), (3, 1), (3, 2), (4, 3), (4, 4)]


def test_score_counters_on_a_hand_made_example():
    s = LookaheadScore()
    # At layer 2: guesses for layer 3 (depth 1) and layer 4 (depth 2), two tokens, top-2.
    s.add_predictions([3, 4], [torch.tensor([[0, 1], [1, 2]]), torch.tensor([[3, 4], [3, 4]])])
    s.add_actual(2, torch.tensor([[0, 1], [0, 1]]))  # nothing filed for layer 2: no-op
    s.add_actual(3, torch.tensor([[1, 2], [2, 5]]))
    # At layer 3: guess for layer 4 at depth 1, exactly right.
    s.add_predictions([4], [torch.tensor([[4, 6], [4, 7]])])
    s.add_actual(4, torch.tensor([[4, 6], [4, 7]]))
    out = s.summary()
    assert list(out) == [1, 2]
    d1, d2 = out[1], out[2]
    # depth 1: layer 3 union pred {0,1,2} vs actual {1,2,5} -> 2 hits; layer 4 perfect, 3 of 3.
    assert (d1["pairs"], d1["predicted"], d1["actual"], d1["hits"]) == (2, 6, 6, 5)
    assert d1["recall"] == pytest.approx(5 / 6) and d1["precision"] == pytest.approx(5 / 6)
    # per token: layer 3 gives 1 + 1 of 4 slots, layer 4 gives 4 of 4.
    assert (d1["token_hits"], d1["token_slots"]) == (6, 8)
    assert d1["overlap"] == pytest.approx(6 / 8)
    # depth 2: pred {3,4} vs actual {4,6,7} -> 1 hit; per token 1 + 1 of 4.
    assert (d2["predicted"], d2["actual"], d2["hits"]) == (2, 3, 1)
    assert d2["recall"] == pytest.approx(1 / 3) and d2["precision"] == pytest.approx(1 / 2)
    assert d2["overlap"] == pytest.approx(0.5)

    other = LookaheadScore()
    other.add_predictions([9], [torch.tensor([[1, 2], [1, 2]])])
    other.add_actual(9, torch.tensor([[1, 3], [1, 3]]))
    s.merge([other])
    assert s.summary()[1]["pairs"] == 3 and s.summary()[1]["hits"] == 6


def test_score_pending_until_actual_and_clear():
    s = LookaheadScore()
    s.add_predictions([7], [torch.tensor([[1, 2]])])
    assert s.summary() == {}
    s.clear_pending()
    s.add_actual(7, torch.tensor([[1, 2]]))
    assert s.summary() == {}
