"""Kimi K3: embeddings -> 93 decoder layers (KDA or MLA, dense MLP or LatentMoE, AttnRes) -> head.

Shape legend: T tokens, D hidden (7168), V vocab (163840), B banked AttnRes blocks (<= 8).

    tokens -> embed -> [AttnRes mix -> norm -> attn -> AttnRes mix -> norm -> MLP/MoE] x L
           -> final AttnRes mix -> norm -> lm_head -> logits

The whole model follows FORMAT.md "Attention Residuals" and "Decode state". Per-sequence state (KDA
recurrent + conv state, MLA latent cache) lives in `SequenceState`, so `prefill` then `decode` steps
continue exactly where a full forward would be. Routed experts come from an `ExpertProvider`; the
model never knows where their bytes live."""

from __future__ import annotations

import torch

from ..checkpoint import ModelConfig
from .causal_lm import CausalLM, SequenceState
from .kda import KDALayer, KDAState
from .layers import GluMLP, attn_res_mix, rms_norm
from .load import sub
from .mla import MLACache, MLALayer
from .moe import ExpertProvider, LatentMoE
from .quant import linear

__all__ = ["DecoderLayer", "KimiK3", "SequenceState", "build_decoder_layer"]


class DecoderLayer:
    """One layer (FORMAT.md "Attention Residuals"): AttnRes-mixed inputs feed the norms; the
    running sum never sees them.

    `attn` is a KDALayer or MLALayer, `mlp` a GluMLP or LatentMoE; `w` holds the layer's norm
    and AttnRes weights by suffix (e.g. "input_layernorm.weight").
    """

    def __init__(self, cfg: ModelConfig, index: int, w: dict[str, torch.Tensor], attn, mlp,
                 kda: bool):
        self.index, self.cfg, self.w = index, cfg, w
        self.attn, self.mlp, self.kda = attn, mlp, kda
        self.starts_block = index % cfg.attn_res_block_size == 0

    def forward(self, h: torch.Tensor, bank: list[torch.Tensor],
                state: KDAState | MLACache | None) -> torch.Tensor:
        """h [T, D] -> [T, D]; `bank` gains this layer's block start; `state` None: no state
        kept (a throwaway MLA cache, a zero KDA start)."""
        w, eps = self.w, self.cfg.rms_norm_eps
        p = h  # [T, D] running sum of the current block
        a_in = (attn_res_mix(p, bank, w["self_attention_res_norm.weight"],
                             w["self_attention_res_proj.weight"]) if bank else h)
        if self.starts_block:
            bank.append(p)  # the raw prefix sum, not a_in
            p = None
        x = rms_norm(a_in, w["input_layernorm.weight"], eps)
        # Prefill runs the chunked form, one-token decode the recurrent one (FORMAT.md "KDA").
        if self.kda:
            a = self.attn.forward(x, state, mode="recurrent" if x.shape[0] == 1 else "chunk")
        else:
            a = self.attn.forward(x, state)
        p = a if p is None else p + a
        m_in = attn_res_mix(p, bank, w["mlp_res_norm.weight"], w["mlp_res_proj.weight"])
        m = self.mlp.forward(rms_norm(m_in, w["post_attention_layernorm.weight"], eps))
        return p + m


def build_decoder_layer(cfg: ModelConfig, index: int, w: dict[str, torch.Tensor],
                        provider: ExpertProvider) -> DecoderLayer:
    """The layer's blocks from its resident weights (suffixes after `layers.{index}.`)."""
    kda = cfg.is_kda_layer(index)
    attn_w = sub(w, "self_attn.")
    attn = KDALayer(cfg, attn_w) if kda else MLALayer(cfg, attn_w)
    if cfg.is_moe_layer(index):
        mlp = LatentMoE(cfg, index, sub(w, "block_sparse_moe."), provider)
    else:
        mlp = GluMLP(sub(w, "mlp."), cfg)
    return DecoderLayer(cfg, index, w, attn, mlp, kda)


class KimiK3(CausalLM):
    """The reference K3 text model on CPU (or any torch device), float32 or bfloat16."""

    @classmethod
    def from_weights(cls, cfg: ModelConfig, top: dict[str, torch.Tensor],
                     layer_weights: list[dict[str, torch.Tensor]], provider: ExpertProvider,
                     dtype: torch.dtype) -> KimiK3:
        """Every layer from resident weights (`load.load_residents`) and an expert provider."""
        layers = [build_decoder_layer(cfg, i, w, provider) for i, w in enumerate(layer_weights)]
        return cls(cfg, top, layers, dtype)

    def moe_blocks(self) -> list[LatentMoE]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, LatentMoE)]

    def new_state(self) -> SequenceState:
        device = self.top["embed_tokens.weight"].device
        return SequenceState([
            KDAState.zeros(self.cfg, self.dtype, device) if layer.kda
            else MLACache.empty(self.cfg, self.dtype, device)
            for layer in self.layers
        ])

    def run(self, token_ids: torch.Tensor, state: SequenceState | None) -> torch.Tensor:
        """`forward` outside inference mode, so autograd sees it (tools/train_tiny.py trains
        through this very code). `state` None: a fresh sequence whose state is not kept."""
        self.begin_forward(int(token_ids.numel()))
        embed = self.top["embed_tokens.weight"]
        h = embed[token_ids.to(embed.device)]  # [T, D] plain lookup, no scaling
        bank: list[torch.Tensor] = []  # AttnRes blocks of these tokens; never crosses tokens
        states = [None] * len(self.layers) if state is None else state.layers
        for layer, layer_state in zip(self.layers, states):
            h = layer.forward(h, bank, layer_state)
        # A fresh buffer: an in-place final mix aliases the live sum (FORMAT.md "Attention
        # Residuals").
        h = attn_res_mix(h, bank, self.top["output_attn_res_norm.weight"],
                         self.top["output_attn_res_proj.weight"])
        h = rms_norm(h, self.top["norm.weight"], self.cfg.rms_norm_eps)
        if state is not None:
            state.tokens += int(token_ids.numel())
        return linear(h, self.top["lm_head.weight"])  # [T, V] in the model dtype
