"""The DeepSeek-V3 family (DeepSeek-V3/R1, Kimi K2): embeddings -> L decoder layers (MLA with
decoupled RoPE, dense SiLU MLP or DeepSeekMoE) -> norm -> head.

Shape legend: T tokens, D hidden (7168), V vocab (129280 / 163840), H heads (128 / 64),
P rope head dim (64), I expert width (2048), E experts (256 / 384), K top-k (8).

    tokens -> embed -> [h + MLA(norm h) ; h + MLP|MoE(norm h)] x L -> norm -> lm_head -> logits

What differs from K3 (FORMAT.md "The DeepSeek-V3 family"): every layer is MLA, and its query and
shared key "rope" parts are rotated by position (YaRN frequencies, pairs interleaved as stored)
before the key enters the latent cache; no output gate; a plain pre-norm residual stream instead
of Attention Residuals; routed experts at the hidden width (no latent projection), SiLU-GLU
everywhere, group-limited routing. Shared with K3: the MLA cache and both attention forms
(model/mla.py), the router (model/moe.route), the expert-provider protocol and the kernels.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from ..checkpoint.deepseek_config import DeepseekV3Config, RopeScaling
from .causal_lm import CausalLM, SequenceState
from .layers import GluMLP, rms_norm
from .load import sub
from .mla import MLACache, MLALayer
from .moe import ExpertProvider, predict, route
from .quant import linear


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude factor `0.1·mscale·ln(scale) + 1` (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(rope: RopeScaling, dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq fp32 [dim/2], attention factor) of FORMAT.md "Rotary embedding (YaRN)",
    computed as transformers' DeepSeek-V3 rotary embedding computes them."""
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)  # [dim/2]
    if rope.kind == "default":
        return 1.0 / pos_freqs, 1.0
    if rope.attention_factor is not None:
        factor = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        factor = yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor,
                                                                     rope.mscale_all_dim)
    else:
        factor = yarn_mscale(rope.factor)

    def correction_dim(rotations: float) -> float:  # the dim whose wavelength fits `rotations`
        return (dim * math.log(rope.original_max_position_embeddings
                               / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # [dim/2] 1: the original frequency (high ones), 0: divided by the factor
    inv = 1.0 / (rope.factor * pos_freqs) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv, float(factor)


def softmax_scale(cfg: DeepseekV3Config) -> float:
    """(nope + rope)^-1/2, times mscale(factor, mscale_all_dim)^2 under YaRN (FORMAT.md "MLA with
    RoPE")."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    rope = cfg.rope
    if rope.kind == "yarn" and rope.mscale_all_dim:
        m = yarn_mscale(rope.factor, rope.mscale_all_dim)
        scale = scale * m * m
    return scale


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool
           ) -> torch.Tensor:
    """x [T, ..., P] rotated by position: pairs (x[2i], x[2i+1]) when `interleave`, else
    (x[i], x[i + P/2]), each by its angle; cos, sin [T, P/2] in x.dtype. The result lists the
    pairs' first members, then their second ones (so queries and keys agree; dot products do not
    depend on the order)."""
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleave else x.chunk(2, dim=-1)
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    cos, sin = cos.view(shape), sin.view(shape)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class RopeMLALayer(MLALayer):
    """MLA of the DeepSeek-V3 family: K3's latent attention (same weights but no output gate,
    same cache and forms) with the query's and the shared key's rope parts rotated by position.
    The cache holds the rotated key, so the absorbed form needs no positions."""

    def __init__(self, cfg: DeepseekV3Config, weights: dict[str, torch.Tensor]):
        super().__init__(cfg, weights)
        self.scale = softmax_scale(cfg)
        self.inv_freq, self.attention_factor = rope_frequencies(cfg.rope, self.P)
        self.interleave = cfg.rope_interleave

    def position(self, q_pe: torch.Tensor, k_pe: torch.Tensor, start: int):
        """Rotate q_pe [T, H, P] and k_pe [T, P] to positions start..start+T-1."""
        T = k_pe.shape[0]
        pos = torch.arange(start, start + T, dtype=torch.float32, device=k_pe.device)
        freqs = pos[:, None] * self.inv_freq.to(k_pe.device)  # [T, P/2] fp32
        # cos/sin are formed in fp32 and rounded once to the model dtype, as transformers does.
        cos = (freqs.cos() * self.attention_factor).to(k_pe.dtype)
        sin = (freqs.sin() * self.attention_factor).to(k_pe.dtype)
        return (rotate(q_pe, cos, sin, self.interleave), rotate(k_pe, cos, sin, self.interleave))


class DeepseekMoE:
    """One MoE layer (FORMAT.md "DeepSeekMoE"): group-limited sigmoid routing, routed experts at
    the hidden width through the provider, plus one shared SiLU MLP. `weights` are keyed by the
    suffix after `layers.{l}.mlp.`; the routing attributes (`router`, `bias`, `cfg`, `layer`,
    `last_ids`, `forced_ids`, `later`) are LatentMoE's, so lookahead and route traces work
    alike."""

    def __init__(self, cfg: DeepseekV3Config, layer: int, weights: Mapping[str, torch.Tensor],
                 provider: ExpertProvider):
        self.cfg, self.layer, self.provider = cfg, layer, provider
        self.router = weights["gate.weight"]  # [E, D]
        self.bias = weights["gate.e_score_correction_bias"]  # [E]
        self.shared = (GluMLP(sub(weights, "shared_experts."), cfg)
                       if cfg.num_shared_experts else None)
        self.last_ids: torch.Tensor | None = None
        self.last_weights: torch.Tensor | None = None
        self.forced_ids: torch.Tensor | None = None
        self.later: list[DeepseekMoE] = []  # the later MoE blocks, in order (set by the model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, D] post_attention_layernorm output, model dtype -> [T, D] model dtype."""
        cfg = self.cfg
        ids, w = route(x, self.router, self.bias, cfg.num_experts_per_token, cfg.moe_renormalize,
                       cfg.routed_scaling_factor, self.forced_ids, cfg.num_expert_group,
                       cfg.topk_group)  # [T, K] each
        self.last_ids, self.last_weights = ids, w
        depth = self.provider.lookahead if x.shape[0] == 1 else 0
        self.provider.hint(self.layer, ids, predict(x, self.later[:depth]) if depth else {})
        shared = self.shared.forward(x) if self.shared is not None else None
        out = self.provider.run_experts(self.layer, x, ids, w)  # [T, D]
        return out if shared is None else out + shared

    __call__ = forward


class DecoderLayer:
    """Pre-norm residual layer: h + MLA(norm h), then + MLP or MoE of its norm."""

    def __init__(self, cfg: DeepseekV3Config, index: int, w: dict[str, torch.Tensor],
                 provider: ExpertProvider):
        self.index, self.cfg = index, cfg
        self.input_norm = w["input_layernorm.weight"]
        self.post_norm = w["post_attention_layernorm.weight"]
        self.attn = RopeMLALayer(cfg, sub(w, "self_attn."))
        self.mlp = (DeepseekMoE(cfg, index, sub(w, "mlp."), provider) if cfg.is_moe_layer(index)
                    else GluMLP(sub(w, "mlp."), cfg))

    def forward(self, h: torch.Tensor, cache: MLACache | None) -> torch.Tensor:
        eps = self.cfg.rms_norm_eps
        h = h + self.attn.forward(rms_norm(h, self.input_norm, eps), cache)
        return h + self.mlp.forward(rms_norm(h, self.post_norm, eps))


class DeepseekV3(CausalLM):
    """The reference DeepSeek-V3 family text model on CPU (or any torch device), float32 or
    bfloat16; the interface of every family (`CausalLM`: new_state, prefill, decode, logits,
    moe_blocks, use_provider)."""

    @classmethod
    def from_weights(cls, cfg: DeepseekV3Config, top: dict[str, torch.Tensor],
                     layer_weights: list[dict[str, torch.Tensor]], provider: ExpertProvider,
                     dtype: torch.dtype) -> DeepseekV3:
        """Every layer from resident weights (`load.load_residents`) and an expert provider."""
        return cls(cfg, top, [DecoderLayer(cfg, i, w, provider)
                              for i, w in enumerate(layer_weights)], dtype)

    def moe_blocks(self) -> list[DeepseekMoE]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, DeepseekMoE)]

    def new_state(self) -> SequenceState:
        device = self.top["embed_tokens.weight"].device
        return SequenceState([MLACache.empty(self.cfg, self.dtype, device) for _ in self.layers])

    def run(self, token_ids: torch.Tensor, state: SequenceState | None) -> torch.Tensor:
        """Logits [T, V], outside inference mode. `state` None: a fresh sequence, not kept."""
        self.begin_forward(int(token_ids.numel()))
        embed = self.top["embed_tokens.weight"]
        h = embed[token_ids.to(embed.device)]  # [T, D]
        caches = [None] * len(self.layers) if state is None else state.layers
        for layer, cache in zip(self.layers, caches):
            h = layer.forward(h, cache)
        h = rms_norm(h, self.top["norm.weight"], self.cfg.rms_norm_eps)
        if state is not None:
            state.tokens += int(token_ids.numel())
        return linear(h, self.top["lm_head.weight"])  # [T, V] in the model dtype
