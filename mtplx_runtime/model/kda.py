"""Kimi Delta Attention (KDA): the linear-attention layer of 69 of K3's 93 layers
(FORMAT.md "KDA").

A plain-torch reference: every step of FORMAT.md "KDA" is one small function so each can be checked
against fla-core's naive oracle. Dtypes follow FORMAT.md "Numerics": in a bf16 model every linear is
a bf16 GEMM and conv, gate, β, l2norm, recurrence and the gated norm are fp32 islands; in an fp32
model everything is fp32. The decode state (FORMAT.md "Decode state") is the last kernel-1
pre-conv inputs of q, k, v plus an fp32 [H, K, V] matrix per head.

  x -> q/k/v proj -> short conv + SiLU -> l2norm -> delta rule (chunked | recurrent)
    -> gated o_norm (σ(g_proj x)) -> o_proj

Shape legend: T tokens, D hidden (7168), H KDA heads (96), K key width per head (128),
V value width per head (= K), C = H·K channels (12288), W conv kernel width (4),
L tokens in one chunk (≤ 64).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..checkpoint.config import ModelConfig
from .quant import linear

_WEIGHT_NAMES = (
    "q_proj.weight", "k_proj.weight", "v_proj.weight",
    "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight",
    "f_a_proj.weight", "f_b_proj.weight", "b_proj.weight",
    "A_log", "dt_bias", "g_proj.weight", "o_norm.weight", "o_proj.weight",
)


# ---- the math of FORMAT.md "KDA", one step per function ----


def short_conv(x: torch.Tensor, w: torch.Tensor, history: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv (no bias) + SiLU, step 2.

    x [T, C] (model dtype), w [C, W] fp32 (`w[:, W-1]` multiplies the current token),
    history [W-1, C] = the W-1 pre-conv inputs before x (zeros at sequence start; None = zeros).
    Returns (y [T, C] in x's dtype, new_history [W-1, C] in x's dtype). Computed in fp32.
    """
    W = w.shape[1]
    if history is None:
        history = x.new_zeros(W - 1, x.shape[1])
    xx = torch.cat([history.to(x.dtype), x], dim=0)  # [W-1+T, C]
    xf = xx.float()
    T = x.shape[0]
    y = sum(w[:, j].float() * xf[j:j + T] for j in range(W))  # [T, C] fp32
    return F.silu(y).to(x.dtype), xx[-(W - 1):].clone()


def kda_gate(z: torch.Tensor, A_log: torch.Tensor, lower_bound: float) -> torch.Tensor:
    """K3's bounded log-decay, step 3: `g = lower_bound · σ(exp(A_log[h]) · z)`.

    z [T, H, K] fp32 with dt_bias already added; A_log [H] fp32 (the used heads only).
    Returns g [T, H, K] fp32 in (lower_bound, 0]; saturation to exactly 0 or lower_bound is fine.
    """
    return lower_bound * torch.sigmoid(A_log.float().exp()[:, None] * z.float())  # [T, H, K]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(Σ x² + eps) over the last axis, fp32, step 5 (ε inside the root, as fla)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, S0: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token delta rule, step 6 (the decode form).

    q, k [T, H, K] fp32, already l2-normalized (q also scaled by K^-1/2); v [T, H, V];
    g [T, H, K] log-decay; beta [T, H] post-sigmoid; S0 [H, K, V] or None (zeros).
    Returns (o [T, H, V] fp32, S [H, K, V] fp32). S0 is not modified.
    """
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    T, H, K = k.shape
    S = q.new_zeros(H, K, v.shape[-1]) if S0 is None else S0.float().clone()  # [H, K, V]
    o = v.new_zeros(v.shape)  # [T, H, V]
    for t in range(T):
        S = S * g[t].exp()[:, :, None]  # decay row c of S by exp(g[c])
        e = v[t] - torch.einsum("hk,hkv->hv", k[t], S)  # [H, V] prediction error
        S = S + beta[t][:, None, None] * k[t][:, :, None] * e[:, None, :]  # delta-rule write
        o[t] = torch.einsum("hk,hkv->hv", q[t], S)  # read after the write
    return o, S


def _chunk_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of L tokens, head-major: q, k, g [H, L, K]; v [H, L, V]; beta [H, L]; S [H, K, V].

    With Γ_i = Σ_{s≤i} g_s (in-chunk cumulative decay) and u_j = β_j·e_j the write of token j,
      S_i = e^{Γ_i} ⊙ S + Σ_{j≤i} (e^{Γ_i−Γ_j} ⊙ k_j) u_jᵀ,
      u_j = β_j (v_j − Sᵀ(e^{Γ_j} ⊙ k_j) − Σ_{m<j} A_jm u_m),  A_jm = Σ_c k_j k_m e^{Γ_j−Γ_m},
    i.e. (I + diag(β) A) U = diag(β)(V − K_Γ S): one unit-lower-triangular solve per head.
    """
    L = k.shape[1]
    G = g.cumsum(1)  # [H, L, K]
    # Pairwise e^{Γ_i−Γ_j}, masked to j ≤ i BEFORE exp: Γ_i−Γ_j > 0 above the diagonal can reach
    # 5·64 = 320 and overflow fp32, so e^{Γ_i}·e^{−Γ_j} is never formed.
    causal = torch.ones(L, L, dtype=torch.bool, device=k.device).tril()  # [L, L] j ≤ i
    diff = G[:, :, None, :] - G[:, None, :, :]  # [H, L, L, K]
    decay = diff.masked_fill(~causal[None, :, :, None], float("-inf")).exp()  # [H, L, L, K]
    A = torch.einsum("hic,hijc,hjc->hij", k, decay, k).tril(-1)  # [H, L, L] strict
    Aqk = torch.einsum("hic,hijc,hjc->hij", q, decay, k)  # [H, L, L] incl. diagonal
    eye = torch.eye(L, dtype=k.dtype, device=k.device)
    Tm = eye + beta[:, :, None] * A  # [H, L, L] unit lower triangular
    rhs = beta[:, :, None] * (v - (G.exp() * k) @ S)  # [H, L, V]
    U = torch.linalg.solve_triangular(Tm, rhs, upper=False, unitriangular=True)  # [H, L, V]
    o = (q * G.exp()) @ S + Aqk @ U  # [H, L, V]
    G_end = G[:, -1:, :]  # [H, 1, K]
    S = G_end.transpose(1, 2).exp() * S + ((G_end - G).exp() * k).transpose(1, 2) @ U
    return o, S


def kda_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, S0: torch.Tensor | None = None, chunk: int = 64
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked (WY) delta rule for prefill; same arguments and results as `kda_recurrent`.

    Any T: the last chunk is simply shorter (equivalent to zero-padding with g = 0, β = 0,
    which leaves the state untouched). Equal to the recurrent form up to fp32 rounding.
    """
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    T, H, K = k.shape
    S = q.new_zeros(H, K, v.shape[-1]) if S0 is None else S0.float().clone()  # [H, K, V]
    outs = []
    for s in range(0, T, chunk):
        sl = slice(s, min(s + chunk, T))
        o, S = _chunk_step(q[sl].transpose(0, 1), k[sl].transpose(0, 1), v[sl].transpose(0, 1),
                           g[sl].transpose(0, 1), beta[sl].transpose(0, 1), S)
        outs.append(o.transpose(0, 1))  # [L, H, V]
    o = torch.cat(outs, 0) if outs else v.new_zeros(v.shape)  # [T, H, V]
    return o, S


def gated_rmsnorm(o: torch.Tensor, gate: torch.Tensor, w: torch.Tensor, eps: float = 1e-5
                  ) -> torch.Tensor:
    """Step 7: `(o · rsqrt(mean(o²) + eps) · w) · σ(gate)` per head, fp32 inside.

    o, gate [T, H, V] (model dtype); w [V] fp32 shared by all heads. Returns [T, H, V] in o's
    dtype (fla FusedRMSNormGated, activation "sigmoid": one cast at the end, unlike KimiRMSNorm).
    """
    of = o.float()
    y = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps) * w.float()
    return (y * torch.sigmoid(gate.float())).to(o.dtype)


# ---- decode state and the layer ----


@dataclass(slots=True)
class KDAState:
    """Per-sequence KDA decode state (FORMAT.md "Decode state"), static shapes, updated in place by
    KDALayer.forward.

    conv [3, W-1, C] model dtype: last W-1 pre-conv inputs of q, k, v (in that order).
    S [H, K, V] fp32 recurrent state.
    """

    conv: torch.Tensor
    S: torch.Tensor

    @classmethod
    def zeros(cls, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu") -> KDAState:
        H, K, W = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_short_conv_kernel_size
        return cls(conv=torch.zeros(3, W - 1, H * K, dtype=dtype, device=device),
                   S=torch.zeros(H, K, K, dtype=torch.float32, device=device))


class KDALayer:
    """One KDA layer (FORMAT.md "KDA" steps 1-8). `weights` keys are the names after
    `...self_attn.`.

    Linear weights set the model dtype (float32 or bfloat16); conv, A_log, dt_bias and o_norm
    are kept fp32 whatever they arrive as (checkpoints store them F32).
    """

    def __init__(self, cfg: ModelConfig, weights: Mapping[str, torch.Tensor]):
        missing = [n for n in _WEIGHT_NAMES if n not in weights]
        if missing:
            raise KeyError(f"KDA weights missing: {missing}")
        H, K, D = cfg.kda_num_heads, cfg.kda_head_dim, cfg.hidden_size
        W, C = cfg.kda_short_conv_kernel_size, cfg.kda_num_heads * cfg.kda_head_dim
        self.H, self.K, self.W = H, K, W
        self.lower_bound = cfg.kda_gate_lower_bound
        self.eps = cfg.rms_norm_eps  # o_norm ε (1e-5 in K3, FORMAT.md "RMSNorm")
        self.dtype = weights["q_proj.weight"].dtype
        expect = {
            "q_proj.weight": (C, D), "k_proj.weight": (C, D), "v_proj.weight": (C, D),
            "f_a_proj.weight": (K, D), "f_b_proj.weight": (C, K), "b_proj.weight": (H, D),
            "g_proj.weight": (C, D), "o_proj.weight": (D, C),
        }
        for name, shape in expect.items():
            t = weights[name]
            if tuple(t.shape) != shape or t.dtype != self.dtype:
                raise ValueError(f"{name}: {tuple(t.shape)} {t.dtype}, expected {shape} "
                                 f"{self.dtype}")
            setattr(self, name.split(".")[0], t)
        # Conv weights [C, 1, W] -> [C, W]; fp32 islands per FORMAT.md "Numerics".
        self.conv_w = [weights[f"{x}_conv1d.weight"].float().reshape(C, W) for x in "qkv"]
        a_log = weights["A_log"].float().reshape(-1)
        if a_log.numel() < H:
            raise ValueError(f"A_log has {a_log.numel()} entries, need {H}")
        self.A_log = a_log[:H]  # [H]; entries past H are the zero padding
        self.dt_bias = weights["dt_bias"].float().reshape(H, K)  # index h·K + c
        self.o_norm = weights["o_norm.weight"].float().reshape(K)
        # Tokens per chunk of the chunked form (FORMAT.md "KDA": 64). Any size is the same math
        # up to fp32 rounding; training sets 16, where backward through the chunks is cheapest.
        self.chunk = 64

    def forward(self, x: torch.Tensor, state: KDAState | None = None, mode: str = "chunk"
                ) -> torch.Tensor:
        """x [T, D] model dtype -> [T, D] model dtype. `state` (if given) is read and updated in
        place, so prefill in "chunk" mode followed by one-token "recurrent" calls continues
        exactly. Without a state the sequence starts from zeros and nothing is kept."""
        if x.dtype != self.dtype:
            raise TypeError(f"x is {x.dtype}, layer weights are {self.dtype}")
        if mode not in ("chunk", "recurrent"):
            raise ValueError(f"mode must be 'chunk' or 'recurrent', got {mode!r}")
        T, H, K = x.shape[0], self.H, self.K
        # Steps 1-2: projections (model-dtype GEMMs), then fp32 conv + SiLU back to model dtype.
        qkv = []
        for i, w_proj in enumerate((self.q_proj, self.k_proj, self.v_proj)):
            hist = None if state is None else state.conv[i]
            y, new_hist = short_conv(linear(x, w_proj), self.conv_w[i], hist)  # [T, C]
            if state is not None:
                state.conv[i].copy_(new_hist)
            qkv.append(y.view(T, H, K))
        q, k, v = qkv  # [T, H, K] model dtype
        # Step 3: bf16 low-rank path with bf16 intermediate; the bias add is fp32.
        z = linear(linear(x, self.f_a_proj), self.f_b_proj).float().view(T, H, K)
        g = kda_gate(z + self.dt_bias, self.A_log, self.lower_bound)  # [T, H, K] fp32
        # Step 4.
        beta = torch.sigmoid(linear(x, self.b_proj).float())  # [T, H] fp32
        # Step 5: fp32 l2norm with ε inside the root, then the K^-1/2 query scale.
        q = l2norm(q) * K ** -0.5  # [T, H, K] fp32
        k = l2norm(k)  # [T, H, K] fp32
        # Step 6.
        S0 = None if state is None else state.S
        if mode == "chunk":
            o, S = kda_chunked(q, k, v.float(), g, beta, S0, self.chunk)  # [T, H, V], [H, K, V]
        else:
            o, S = kda_recurrent(q, k, v.float(), g, beta, S0)
        if state is not None:
            state.S.copy_(S)
        o = o.to(self.dtype)  # the reference kernels emit o in the model dtype
        # Steps 7-8.
        gate = linear(x, self.g_proj).view(T, H, K)  # [T, H, V]
        y = gated_rmsnorm(o, gate, self.o_norm, self.eps)  # [T, H, V] model dtype
        return linear(y.reshape(T, H * K), self.o_proj)  # [T, D]

    __call__ = forward
