"""Small reference blocks of K3: RMSNorm and the AttnRes mix (FORMAT.md "RMSNorm", "Attention
Residuals"); SiTU-GLU is the kernels' reference, re-exported here.

Each op follows the precision contract (FORMAT.md "Numerics"): the model dtype (float32 or bfloat16)
flows between ops, and every op the reference computes in fp32 (norm statistics, the SiTU
activation, the whole AttnRes mix) runs on an explicit fp32 island that is cast back once, where the
reference casts. With a float32 model every cast is a no-op, so the same code is the float32
reference.

Shape legend: T tokens, D width of the normed / mixed vector (hidden 7168, latent 3584, ...),
I MLP width, N = n + 1 AttnRes entries (n banked blocks plus the live partial sum).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..kernels.reference import SITU_BETA, SITU_LINEAR_BETA, glu_mlp, situ_glu
from .quant import linear

__all__ = ["ATTN_RES_EPS", "GluMLP", "SITU_BETA", "SITU_LINEAR_BETA", "attn_res_mix", "glu_mlp",
           "rms_norm", "situ_glu"]

ATTN_RES_EPS = 1e-5  # fixed, not a config field (FORMAT.md "Attention Residuals")


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """KimiRMSNorm over the last dim (FORMAT.md "RMSNorm"):
    `w ⊙ cast_to_x.dtype(x₃₂ · rsqrt(mean(x₃₂²) + ε))`.

    x: [..., D] float32 or bfloat16; w: [D]. The cast back to x's dtype happens *before* the
    weight multiply, so in a bf16 model the multiply is bf16 × bf16 (one rounding of the exact
    product). Result dtype is torch's promotion of (x.dtype, w.dtype), as in the reference.
    """
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)  # [..., D] fp32
    return w * y.to(x.dtype)


class GluMLP:
    """A SiTU-GLU MLP from `{gate_proj,up_proj,down_proj}.weight`: the dense layer-0 MLP
    and the MoE shared experts (FORMAT.md "LatentMoE"; width num_shared_experts ×
    moe_intermediate_size). The weights are bf16 tensors or quantized residents (model/quant).

    `cfg` only supplies the two activation betas (any object with `activation_situ_beta` and
    `activation_situ_linear_beta`; None means K3's 4 and 25).
    """

    def __init__(self, weights: Mapping[str, torch.Tensor], cfg=None):
        self.gate = weights["gate_proj.weight"]  # [I, D]
        self.up = weights["up_proj.weight"]  # [I, D]
        self.down = weights["down_proj.weight"]  # [D, I]
        self.beta = cfg.activation_situ_beta if cfg is not None else SITU_BETA
        self.beta_lin = cfg.activation_situ_linear_beta if cfg is not None else SITU_LINEAR_BETA

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, D] model dtype -> [T, D]; the same ops as `glu_mlp` for tensor weights."""
        h = situ_glu(linear(x, self.gate), linear(x, self.up), self.beta, self.beta_lin)  # [T, I]
        return linear(h, self.down)

    __call__ = forward


def attn_res_mix(partial: torch.Tensor, bank: Sequence[torch.Tensor], w_norm: torch.Tensor,
                 w_proj: torch.Tensor, eps: float = ATTN_RES_EPS) -> torch.Tensor:
    """The Attention-Residuals mix (FORMAT.md "Attention Residuals"), per token, vectorised over
    the leading dims.

    partial: [T, D] live block sum; bank: n tensors [T, D] (may be empty, then the result equals
    `partial`); w_norm: [D] (`*_res_norm.weight`); w_proj: [1, D] or [D] (`*_res_proj.weight`).
    Returns a fresh [T, D] tensor in partial's dtype; the inputs are never written ([WASTE]'s
    in-place final mix aliased the live sum).

    Entry order is bank first, live sum last. Everything between the input and the final cast is
    fp32: the learned-weight-free RMS normalisation (not cast back), the scores against
    `w_norm ⊙ w_proj`, the softmax over the N = n + 1 entries and the weighted sum.
    """
    v = torch.stack([b.float() for b in bank] + [partial.float()])  # [N, T, D] fp32
    k = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)  # [N, T, D] no learned weight
    # The product of two bf16 values is exact in fp32, so forming it first loses nothing.
    w = w_norm.float().reshape(-1) * w_proj.float().reshape(-1)  # [D]
    scores = (k * w).sum(-1)  # [N, T]
    alpha = torch.softmax(scores, dim=0)  # [N, T] over the entries, per token
    mix = (alpha.unsqueeze(-1) * v).sum(0)  # [T, D] fp32
    return mix.to(partial.dtype)
