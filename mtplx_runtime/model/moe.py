"""Stable LatentMoE (k3-model.md §4.5-4.6): the sigmoid router and the routed/shared expert block.

    x -> route -> provider.experts(layer, needed ids) -> latent down -> experts -> combine
      -> latent RMSNorm -> latent up -> + SharedMLP(x)

The block never knows where expert bytes come from: it asks an `ExpertProvider` for the
experts its tokens selected (resident decode here; later a streaming cache). Each needed expert
runs once over all the tokens that chose it.

Shape legend: T tokens, D hidden (7168), R latent (3584), I expert width (3072), E experts (896),
K top-k (16), U distinct experts selected by the T tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from .layers import GluMLP, glu_mlp, rms_norm

RENORM_EPS = 1e-20  # §4.5 step 4: added to the weight sum before dividing


def route(x: torch.Tensor, w_router: torch.Tensor, bias: torch.Tensor, top_k: int,
          renormalize: bool = True, scaling: float = 1.0,
          forced_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid top-k router with a selection-only correction bias (§4.5).

    x: [T, D] normed MoE input (any float dtype); w_router: [E, D]; bias: [E]
    (`e_score_correction_bias`, F32). Returns (ids [T, K] int64, sorted ascending per token;
    weights [T, K] float32 aligned with ids). Everything is fp32 (§6). The bias only picks the
    experts; the weights are the unbiased sigmoid scores, renormalised over the K picks.
    `forced_ids` [T, K] imposes a selection (a replayed route, or fp32 routing under a bf16
    model when comparing precisions); the weights still come from this router's scores.
    """
    logits = F.linear(x.float(), w_router.float())  # [T, E] fp32
    scores = torch.sigmoid(logits)  # [T, E]
    if forced_ids is not None:
        picked = forced_ids.to(device=scores.device, dtype=torch.long)  # [T, K]
    else:
        picked = torch.topk(scores + bias.float(), top_k, dim=-1, sorted=False).indices  # [T, K]
    # Sorting by id fixes the fp32 combine order independent of topk's backend order (§6).
    ids = torch.sort(picked, dim=-1).values  # [T, K]
    weights = scores.gather(-1, ids)  # [T, K] unbiased
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + RENORM_EPS)
    return ids, weights * scaling


@dataclass(frozen=True, slots=True)
class ExpertWeights:
    """One routed expert in the model dtype: gate, up [I, R]; down [R, I] (w1, w3, w2)."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


class ExpertProvider(Protocol):
    """Where routed experts come from. The MoE block asks only for the ids it needs.

    Optional streaming methods, used when present (mtplx_runtime/streaming.py):
    `hint(layer, hidden [T, D], ids [T, K])` right after routing (lookahead for later layers,
    scoring of earlier guesses), and
    `run_experts(layer, r [T, R], ids [T, K], weights [T, K]) -> [T, R]`, which replaces
    the block's own expert loop: the provider runs a kernel backend (mtplx_runtime/kernels)
    straight on its cached record bytes and returns the combined routed sum in r.dtype.
    """

    def experts(self, layer: int, ids: Sequence[int]) -> Mapping[int, ExpertWeights]:
        """Weights of experts `ids` (distinct) of MoE layer `layer` (0-based). May block on I/O."""
        ...


class ResidentExpertProvider:
    """Every expert decoded once through the checkpoint's reference codec and kept in memory.

    Decoding is lazy (first request of an (layer, expert) pair) unless `preload` is set; decoded
    values of every codec are exactly representable in bf16 (§6, t158-and-streaming §2), so the
    cast to the model dtype is exact. Meant for tiny models and tests, not the full 1.4 TB bank.
    """

    def __init__(self, ckpt, dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
                 preload: bool = False):
        self._ckpt, self.dtype, self.device = ckpt, dtype, device
        self._cache: dict[tuple[int, int], ExpertWeights] = {}
        if preload:
            cfg = ckpt.config
            for layer in cfg.moe_layers:
                self.experts(layer, range(cfg.num_experts))

    def experts(self, layer: int, ids: Sequence[int]) -> Mapping[int, ExpertWeights]:
        out = {}
        for e in ids:
            key = (layer, int(e))
            if key not in self._cache:
                self._cache[key] = self._decode(*key)
            out[int(e)] = self._cache[key]
        return out

    def _decode(self, layer: int, expert: int) -> ExpertWeights:
        dec = self._ckpt.expert(layer, expert).decode()  # {"gate","up","down"}: float32 numpy
        t = {p: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))
             .to(device=self.device, dtype=self.dtype) for p, a in dec.items()}
        return ExpertWeights(t["gate"], t["up"], t["down"])


class LatentMoE:
    """One MoE layer (§4.6). `weights` are keyed by the suffix after
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, D] post_attention_layernorm output, model dtype -> [T, D] model dtype."""
        cfg = self.cfg
        ids, w = route(x, self.router, self.bias, cfg.num_experts_per_token,
                       cfg.moe_renormalize, cfg.routed_scaling_factor,
                       self.forced_ids)  # [T, K] each
        self.last_ids, self.last_weights = ids, w
        hint = getattr(self.provider, "hint", None)
        if hint is not None:  # lookahead for later layers goes out before this layer computes
            hint(self.layer, x, ids)
        r = F.linear(x, self.down_lat)  # [T, R]
        run = getattr(self.provider, "run_experts", None)
        if run is not None:  # a kernel backend computes the sum straight from the cache slots
            routed = run(self.layer, r, ids, w)  # [T, R]
        else:
            routed = self._routed_sum(r, ids, w)  # [T, R]
        if self.norm is not None:
            routed = rms_norm(routed, self.norm, cfg.rms_norm_eps)
        out = F.linear(routed, self.up_lat)  # [T, D]
        if self.shared is not None:
            out = out + self.shared.forward(x)  # shared MLP sees the full-width input
        return out

    def _routed_sum(self, r: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """sum_k w[t, k] * expert_k(r_t) from decoded ExpertWeights: r [T, R] -> [T, R] r.dtype."""
        cfg = self.cfg
        needed = torch.unique(ids).tolist()  # [U] ascending
        experts = self.provider.experts(self.layer, needed)
        # Combine (§4.6 step 3): each bf16 y_e -> fp32, × its fp32 weight, summed in fp32.
        # Experts combine in ascending id and each token's ids are sorted and distinct, so every
        # token's products land in acc in sorted-id order: the same left-to-right fp32 sum as a
        # per-token loop (0 + a is exact), whatever the batch.
        acc = torch.zeros(r.shape, dtype=torch.float32, device=r.device)  # [T, R]
        for e in needed:
            ew = experts[e]
            tok, slot = torch.nonzero(ids == e, as_tuple=True)  # [n] each, tok distinct
            y = glu_mlp(r[tok], ew.gate, ew.up, ew.down, cfg.activation_situ_beta,
                        cfg.activation_situ_linear_beta)  # [n, R]
            acc.index_add_(0, tok, y.float() * w[tok, slot].unsqueeze(-1))
        return acc.to(r.dtype)

    __call__ = forward
