"""Stable LatentMoE: the sigmoid router and the routed/shared expert block (FORMAT.md "Router",
"LatentMoE").

    x -> route -> provider.hint (lookahead) -> latent down -> provider.run_experts (routed sum)
      -> latent RMSNorm -> latent up -> + SharedMLP(x)

The block never knows where expert bytes come from: an `ExpertProvider` computes the routed sum
of the experts its tokens selected (resident weights here; offload/provider.py streams them
through a cache). Each needed expert runs once over all the tokens that chose it.

Shape legend: T tokens, D hidden (7168), R latent (3584), I expert width (3072), E experts (896),
K top-k (16), U distinct experts selected by the T tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F

from ..kernels.reference import (
    SITU_BETA,
    SITU_LINEAR_BETA,
    ExpertWeights,
    expert_weights,
    routed_sum,
)
from .layers import GluMLP, rms_norm
from .quant import linear

__all__ = ["ExpertProvider", "ExpertWeights", "LatentMoE", "ResidentExpertProvider", "predict",
           "route"]

RENORM_EPS = 1e-20  # added to the weight sum before dividing (FORMAT.md "Router")


def route(x: torch.Tensor, w_router: torch.Tensor, bias: torch.Tensor, top_k: int,
          renormalize: bool = True, scaling: float = 1.0,
          forced_ids: torch.Tensor | None = None, n_group: int = 1,
          topk_group: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid top-k router with a selection-only correction bias (FORMAT.md "Router").

    x: [T, D] normed MoE input (any float dtype); w_router: [E, D]; bias: [E]
    (`e_score_correction_bias`). Returns (ids [T, K] int64, sorted ascending per token;
    weights [T, K] float32 aligned with ids). Everything is fp32 (FORMAT.md "Numerics"). The
    bias only picks the experts; the weights are the unbiased sigmoid scores, renormalised over
    the K picks. `forced_ids` [T, K] imposes a selection (a replayed route, or fp32 routing under
    a bf16 model when comparing precisions); the weights still come from this router's scores.
    `n_group` > 1: the picks come from the `topk_group` groups of E / n_group consecutive experts
    whose two best biased scores sum highest (FORMAT.md "Group-limited routing").
    """
    logits = F.linear(x.float(), w_router.float())  # [T, E] fp32
    scores = torch.sigmoid(logits)  # [T, E]
    if forced_ids is not None:
        picked = forced_ids.to(device=scores.device, dtype=torch.long)  # [T, K]
    else:
        choice = scores + bias.float()  # [T, E]
        if n_group > 1:
            choice = _limit_groups(choice, n_group, topk_group)
        picked = torch.topk(choice, top_k, dim=-1, sorted=False).indices  # [T, K]
    # Sorting by id fixes the fp32 combine order whatever topk's backend order (FORMAT.md
    # "Numerics").
    ids = torch.sort(picked, dim=-1).values  # [T, K]
    weights = scores.gather(-1, ids)  # [T, K] unbiased
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + RENORM_EPS)
    return ids, weights * scaling


def _limit_groups(choice: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """`choice` [T, E] with every expert outside the token's `topk_group` best groups set to
    -inf; a group's score is the sum of its two highest biased scores."""
    T, E = choice.shape
    grouped = choice.view(T, n_group, E // n_group)  # [T, G, E/G]
    group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, G]
    kept = torch.topk(group_scores, topk_group, dim=-1, sorted=False).indices  # [T, topk_group]
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)  # [T, G]
    return grouped.masked_fill(~mask.unsqueeze(-1), float("-inf")).view(T, E)


def predict(x: torch.Tensor, later: Sequence[LatentMoE]) -> dict[int, torch.Tensor]:
    """Lookahead: route `x` [T, D] (this layer's normed MoE input) through each later layer's
    router, {layer: ids [T, K]} (exactly `route` with that router: ids sorted ascending). A later
    router applied to the current hidden state recovers most of its real top-k (ARCHITECTURE.md
    "Lookahead"); the provider prefetches the guesses."""
    # A config without group fields has one group (K3 has them, at 1).
    return {m.layer: route(x, m.router, m.bias, m.cfg.num_experts_per_token,
                           n_group=getattr(m.cfg, "num_expert_group", 1),
                           topk_group=getattr(m.cfg, "topk_group", 1))[0]
            for m in later}


class ExpertProvider(Protocol):
    """Where routed experts come from and who computes their sum: the one thing LatentMoE asks
    (structural: offload/provider.py implements it without importing the model).

    `run_experts(layer, r [T, R], ids [T, K], weights [T, K]) -> [T, R]` in r.dtype: the routed
    sum sum_k weights[t, k] * expert_{ids[t, k]}(r_t) with the reference's fp32 combine order.
    `hint(layer, actual ids [T, K], predicted {later layer: ids [T, K]})` comes right after
    routing, before `run_experts` and before the block's own compute: a streaming provider
    scores earlier guesses, prefetches the new ones and may start reading this layer's experts.
    `lookahead`: how many later MoE layers the provider wants guesses for (the block predicts
    only in one-token decode steps). `begin_forward(tokens)`: the model starts a forward of
    `tokens` tokens (a streaming provider holds its warm start for a prompt).
    """

    lookahead: int

    def begin_forward(self, tokens: int) -> None: ...

    def hint(self, layer: int, actual: torch.Tensor, predicted: Mapping[int, torch.Tensor]
             ) -> None: ...

    def run_experts(self, layer: int, r: torch.Tensor, ids: torch.Tensor,
                    weights: torch.Tensor) -> torch.Tensor: ...


class ResidentExpertProvider:
    """Every expert decoded once to the model dtype and kept in memory; the sum is the reference
    kernel's (`kernels.reference.routed_sum`).

    `source`: an open Checkpoint (experts decoded through its reference codec) or a function
    `(layer, expert) -> ExpertWeights`. Decoding is lazy (first request of an (layer, expert)
    pair) unless `preload` is set; decoded values of every codec are exactly representable in
    bf16, so the cast to the model dtype is exact. `cfg` gives the SiTU-GLU constants (default:
    the checkpoint's config, else K3's). Meant for tiny models and tests, not the 1.4 TB bank.
    """

    def __init__(self, source, dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
                 preload: bool = False, cfg=None):
        if callable(source):
            self._load = source
        else:
            ckpt = source
            cfg = cfg if cfg is not None else ckpt.config
            self._load = lambda layer, e: expert_weights(
                ckpt.expert(layer, e).decode(), dtype, device)  # float32 numpy -> dtype
        self.dtype, self.device = dtype, device
        self._beta = dict(beta=cfg.activation_situ_beta if cfg is not None else SITU_BETA,
                          beta_lin=(cfg.activation_situ_linear_beta if cfg is not None
                                    else SITU_LINEAR_BETA))
        self._cache: dict[tuple[int, int], ExpertWeights] = {}
        if preload:
            for layer in cfg.moe_layers:
                self.experts(layer, range(cfg.num_experts))

    lookahead = 0  # every expert is in memory: nothing to prefetch

    def hint(self, layer: int, actual: torch.Tensor, predicted: Mapping[int, torch.Tensor]
             ) -> None:
        pass

    def experts(self, layer: int, ids: Sequence[int]) -> dict[int, ExpertWeights]:
        """Weights of experts `ids` of MoE layer `layer` (0-based), decoded on first use."""
        out = {}
        for e in ids:
            key = (layer, int(e))
            if key not in self._cache:
                self._cache[key] = self._load(*key)
            out[int(e)] = self._cache[key]
        return out

    def begin_forward(self, tokens: int) -> None:
        pass  # nothing streams: nothing to hold

    def run_experts(self, layer: int, r: torch.Tensor, ids: torch.Tensor,
                    weights: torch.Tensor) -> torch.Tensor:
        needed = [e for e in torch.unique(ids).tolist() if e >= 0]  # [U] ascending
        return routed_sum(r, ids, weights, self.experts(layer, needed), **self._beta)


class LatentMoE:
    """One MoE layer (FORMAT.md "LatentMoE"). `weights` are keyed by the suffix after
    `layers.{l}.block_sparse_moe.`: gate.weight [E, D], gate.e_score_correction_bias [E] (F32),
    routed_expert_down_proj.weight [R, D], routed_expert_norm.weight [R],
    routed_expert_up_proj.weight [D, R], shared_experts.{gate,up,down}_proj.weight.
    All but the bias are in the model dtype. `last_ids` [T, K] holds the latest routing;
    setting `forced_ids` [T, K] makes the next forwards use that selection instead (`route`).
    """

    def __init__(self, cfg, layer: int, weights: Mapping[str, torch.Tensor],
                 provider: ExpertProvider):
        self.cfg, self.layer, self.provider = cfg, layer, provider
        self.router = weights["gate.weight"]  # [E, D]
        self.bias = weights["gate.e_score_correction_bias"]  # [E] fp32
        self.down_lat = weights["routed_expert_down_proj.weight"]  # [R, D]
        self.up_lat = weights["routed_expert_up_proj.weight"]  # [D, R]
        self.norm = weights.get("routed_expert_norm.weight") if cfg.latent_moe_use_norm else None
        if cfg.latent_moe_use_norm and self.norm is None:
            raise KeyError("routed_expert_norm.weight is required when latent_moe_use_norm")
        shared = {k[len("shared_experts."):]: v for k, v in weights.items()
                  if k.startswith("shared_experts.")}
        self.shared = GluMLP(shared, cfg) if cfg.num_shared_experts > 0 else None
        self.last_ids: torch.Tensor | None = None
        self.last_weights: torch.Tensor | None = None
        self.forced_ids: torch.Tensor | None = None
        self.later: list[LatentMoE] = []  # the later MoE blocks, in order (set by KimiK3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, D] post_attention_layernorm output, model dtype -> [T, D] model dtype."""
        cfg = self.cfg
        ids, w = route(x, self.router, self.bias, cfg.num_experts_per_token,
                       cfg.moe_renormalize, cfg.routed_scaling_factor,
                       self.forced_ids)  # [T, K] each
        self.last_ids, self.last_weights = ids, w
        # Lookahead guesses for later layers go out before this layer's experts compute.
        depth = self.provider.lookahead if x.shape[0] == 1 else 0
        self.provider.hint(self.layer, ids, predict(x, self.later[:depth]) if depth else {})
        r = linear(x, self.down_lat)  # [T, R]
        # Before the routed sum: computed while a streaming provider's reads land.
        shared = self.shared.forward(x) if self.shared is not None else None  # full-width input
        routed = self.provider.run_experts(self.layer, r, ids, w)  # [T, R]
        if self.norm is not None:
            routed = rms_norm(routed, self.norm, cfg.rms_norm_eps)
        out = linear(routed, self.up_lat)  # [T, D]
        if shared is not None:
            out = out + shared
        return out

    __call__ = forward
