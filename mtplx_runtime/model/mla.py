"""Gated NoPE MLA with its compressed per-sequence cache (FORMAT.md "MLA").

Each token is cached once as the 576-wide row `[c̄ (512, post-norm) ‖ k_pe (64, raw)]`; per-head
keys and values are derived from it at attention time, in one of two algebraically equal forms:
  * expanded: K/V per cached token through kv_b_proj, then eager numerics (FORMAT.md
    "Numerics");
  * absorbed: W_UK folded into the query and W_UV into the output, so attention is MQA over the
    cached rows themselves (cheap decode: nothing per cached token but one dot product).
No positional encoding of any kind: the "rope" parts are plain learned features.

    x -> q_a -> norm -> q_b -> q;  x -> kv_a -> [c̄ ‖ k_pe] -> cache;  attend ⊙ σ(W_g x) -> o_proj

Shape legend: T new tokens, S cached tokens incl. the new ones, D hidden (7168), H heads (96),
N nope head dim (128), P "rope" head dim (64), V value head dim (128), C kv_lora (512),
Q q_lora (1536).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..checkpoint.config import ModelConfig
from .layers import rms_norm
from .quant import linear

MLA_NORM_EPS = 1e-6  # q_a/kv_a norms take KimiRMSNorm's class default, not rms_norm_eps ("RMSNorm")
WEIGHT_NAMES = ("q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight",
                "kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight",
                "o_proj.weight")
GATE_NAME = "g_proj.weight"


KEY_BUCKET = 128  # absorbed attention's key count is padded to a multiple of this (_absorbed)


def causal_mask(t: int, s: int, device: torch.device | str) -> torch.Tensor:
    """[T, S] bool, True where new token i (absolute position s-t+i) may see cached token j."""
    q_pos = torch.arange(s - t, s, device=device)[:, None]
    return torch.arange(s, device=device)[None, :] <= q_pos


def softmax_masked(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Softmax over the last axis in fp32, cast back to the scores' dtype (eager numerics)."""
    p = scores.float().masked_fill(~allowed, float("-inf")).softmax(-1)
    return p.to(scores.dtype)


class MLACache:
    """Compressed MLA cache of one sequence for one layer: rows `[c̄ ‖ k_pe]`, model dtype.

    Storage is one [capacity, C + P] buffer so the absorbed form reads keys with one matmul.
    `append` grows it by doubling (amortised O(1), reallocation at powers of two). A caller that
    needs static shapes (graph-captured decode) passes capacity = max length and `grow=False`;
    appending past it is then an error, never a silent reallocation.
    """

    def __init__(self, buf: torch.Tensor, kv_lora_rank: int, grow: bool = True):
        self.buf = buf  # [capacity, C + P]
        self.kv_lora_rank = kv_lora_rank
        self.grow = grow
        self.len = 0

    @classmethod
    def empty(cls, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu",
              capacity: int = 256, grow: bool = True) -> MLACache:
        width = cfg.kv_lora_rank + cfg.qk_rope_head_dim  # 576 in K3
        return cls(torch.zeros(max(capacity, 1), width, dtype=dtype, device=device),
                   cfg.kv_lora_rank, grow)

    @property
    def capacity(self) -> int:
        return self.buf.shape[0]

    @property
    def rows(self) -> torch.Tensor:
        """[S, C + P] view of the live rows."""
        return self.buf[: self.len]

    @property
    def latent(self) -> torch.Tensor:
        """[S, C] c̄, post-norm (view)."""
        return self.buf[: self.len, : self.kv_lora_rank]

    @property
    def k_pe(self) -> torch.Tensor:
        """[S, P] shared key part, neither normalised nor rotated (view)."""
        return self.buf[: self.len, self.kv_lora_rank:]

    def append(self, latent: torch.Tensor, k_pe: torch.Tensor) -> None:
        """Append T rows: latent [T, C], k_pe [T, P], both already in the cache dtype."""
        t = latent.shape[0]
        need = self.len + t
        if need > self.capacity:
            if not self.grow:
                raise ValueError(f"MLA cache full: {self.len} + {t} > capacity {self.capacity}")
            cap = self.capacity
            while cap < need:
                cap *= 2
            buf = self.buf.new_zeros(cap, self.buf.shape[1])
            buf[: self.len] = self.buf[: self.len]
            self.buf = buf
        self.buf[self.len: need, : self.kv_lora_rank] = latent
        self.buf[self.len: need, self.kv_lora_rank:] = k_pe
        self.len = need

    def trim(self, length: int) -> None:
        """Drop rows past `length` (rejected speculative tokens; MLA is trimmable)."""
        if not 0 <= length <= self.len:
            raise ValueError(f"cannot trim a cache of {self.len} rows to {length}")
        self.buf[length: self.len] = 0  # padded attention reads rows past len (zero weight)
        self.len = length


class MLALayer:
    """One gated NoPE MLA layer. Weights: suffixes after `layers.{l}.self_attn.`, model dtype.

    `forward(x [T, D], cache, absorbed)` -> [T, D]; the new tokens attend causally to the cache
    and to themselves, and their rows are appended to the cache (a throwaway cache is used when
    `cache` is None). `absorbed=None` picks the absorbed form for T == 1 (decode), else expanded.
    """

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor]):
        self.H, self.N, self.P = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.V, self.C = cfg.v_head_dim, cfg.kv_lora_rank
        self.cfg = cfg
        self.scale = (self.N + self.P) ** -0.5  # 192^-1/2: over the full query/key width
        names = WEIGHT_NAMES + ((GATE_NAME,) if cfg.mla_use_output_gate else ())
        missing = [n for n in names if n not in weights]
        if missing:
            raise KeyError(f"MLA weights missing: {missing}")
        w = {n: weights[n] for n in names}
        D, H = cfg.hidden_size, self.H
        want = {
            "q_a_proj.weight": (cfg.q_lora_rank, D),
            "q_a_layernorm.weight": (cfg.q_lora_rank,),
            "q_b_proj.weight": (H * (self.N + self.P), cfg.q_lora_rank),
            "kv_a_proj_with_mqa.weight": (self.C + self.P, D),
            "kv_a_layernorm.weight": (self.C,),
            "kv_b_proj.weight": (H * (self.N + self.V), self.C),
            "o_proj.weight": (D, H * self.V),
            GATE_NAME: (H * self.V, D),
        }
        dtypes = {t.dtype for t in w.values()}
        if len(dtypes) != 1:
            raise ValueError(f"MLA weights must share one dtype, got {dtypes}")
        self.dtype = dtypes.pop()
        for n, t in w.items():
            if tuple(t.shape) != want[n]:
                raise ValueError(f"{n}: shape {tuple(t.shape)}, expected {want[n]}")
        self.q_a, self.q_norm, self.q_b = (w["q_a_proj.weight"], w["q_a_layernorm.weight"],
                                           w["q_b_proj.weight"])
        self.kv_a, self.kv_norm, self.kv_b = (w["kv_a_proj_with_mqa.weight"],
                                              w["kv_a_layernorm.weight"], w["kv_b_proj.weight"])
        self.g, self.o = w.get(GATE_NAME), w["o_proj.weight"]
        kv_b = self.kv_b.view(H, self.N + self.V, self.C)  # head h: N k_nope rows then V v rows
        self.w_uk = kv_b[:, : self.N]  # [H, N, C]
        self.w_uv = kv_b[:, self.N:]  # [H, V, C]

    def project(self, x: torch.Tensor):
        """x [T, D] -> q_nope [T, H, N], q_pe [T, H, P], c̄ [T, C], k_pe [T, P] (MLA steps 1-2)."""
        T = x.shape[0]
        q = linear(rms_norm(linear(x, self.q_a), self.q_norm, MLA_NORM_EPS), self.q_b)
        q = q.view(T, self.H, self.N + self.P)  # [T, H, N + P]
        kv = linear(x, self.kv_a)  # [T, C + P]
        latent = rms_norm(kv[:, : self.C], self.kv_norm, MLA_NORM_EPS)  # [T, C]
        return q[..., : self.N], q[..., self.N:], latent, kv[:, self.C:]

    def position(self, q_pe: torch.Tensor, k_pe: torch.Tensor, start: int):
        """The "rope" parts as attention uses them, for tokens at positions start, start+1, ...:
        K3 encodes no position, so unchanged (the DeepSeek-V3 family rotates them here)."""
        return q_pe, k_pe

    def attend(self, x: torch.Tensor, cache: MLACache | None = None,
               absorbed: bool | None = None) -> torch.Tensor:
        """Pre-gate attention output concat_h(attn_h): x [T, D] -> [T, H * V]; appends to cache."""
        if x.dtype != self.dtype:
            raise TypeError(f"x is {x.dtype}, MLA weights are {self.dtype}")
        T = x.shape[0]
        if cache is None:
            cache = MLACache.empty(self.cfg, self.dtype, x.device, capacity=T)
        elif cache.buf.dtype != self.dtype:
            raise TypeError(f"cache is {cache.buf.dtype}, MLA weights are {self.dtype}")
        q_nope, q_pe, latent, k_pe = self.project(x)
        q_pe, k_pe = self.position(q_pe, k_pe, cache.len)
        cache.append(latent, k_pe)  # before attending: each new token sees itself
        allowed = causal_mask(T, cache.len, x.device)  # [T, S]
        if absorbed is None:
            absorbed = T == 1
        fn = self._absorbed if absorbed else self._expanded
        return fn(q_nope, q_pe, cache, allowed).reshape(T, self.H * self.V)

    def forward(self, x: torch.Tensor, cache: MLACache | None = None,
                absorbed: bool | None = None) -> torch.Tensor:
        """x [T, D] (input_layernorm output, model dtype) -> [T, D]."""
        a = self.attend(x, cache, absorbed)  # [T, H * V]
        if self.g is not None:
            a = a * torch.sigmoid(linear(x, self.g))  # model dtype, no fp32 island (MLA step 5)
        return linear(a, self.o)

    __call__ = forward

    def _expanded(self, q_nope, q_pe, cache: MLACache, allowed) -> torch.Tensor:
        """Per-head K/V from every cached c̄, eager numerics. Returns [T, H, V]."""
        S = cache.len
        kv = F.linear(cache.latent, self.kv_b).view(S, self.H, self.N + self.V)  # [S, H, N + V]
        k_pe = cache.k_pe[:, None, :].expand(S, self.H, self.P)  # [S, H, P], shared by heads
        k = torch.cat([kv[..., : self.N], k_pe], -1).transpose(0, 1)  # [H, S, N + P]
        v = kv[..., self.N:].transpose(0, 1)  # [H, S, V]
        q = torch.cat([q_nope, q_pe], -1).transpose(0, 1)  # [H, T, N + P]
        scores = (q @ k.transpose(1, 2)) * self.scale  # [H, T, S]; QKᵀ then × scale, model dtype
        p = softmax_masked(scores, allowed)  # [H, T, S]
        return (p @ v).transpose(0, 1)  # [T, H, V]

    def _absorbed(self, q_nope, q_pe, cache: MLACache, allowed) -> torch.Tensor:
        """MQA over the cached [c̄ ‖ k_pe] rows with W_UK/W_UV folded in (absorbed form). Returns
        [T, H, V].

        Same algebra as `_expanded`, different rounding: q_nope·(W_UK c̄) = (W_UKᵀ q_nope)·c̄.
        """
        q_lat = torch.einsum("thn,hnc->htc", q_nope, self.w_uk)  # [H, T, C]
        q = torch.cat([q_lat, q_pe.transpose(0, 1)], -1)  # [H, T, C + P]
        # In bf16 both matmuls run over the cache rows padded to a multiple of KEY_BUCKET: its
        # oneDNN kernels are kept per matmul shape, and one new shape per decoded token grew the
        # process ~1.2 MiB a token (BENCHMARKS.md "bench_memory"). Extra key columns are sliced
        # off before the softmax and meet zero probabilities after it: bit-identical (tested).
        # fp32 goes through other GEMMs, which do not grow and whose sum order moves with S.
        S = cache.len
        bucket = KEY_BUCKET if q.dtype == torch.bfloat16 else 1
        S_pad = min(cache.capacity, -(-S // bucket) * bucket)
        scores = (q @ cache.buf[:S_pad].T)[..., :S] * self.scale  # [H, T, S]; one key head
        p = softmax_masked(scores, allowed)  # [H, T, S]
        p = F.pad(p, (0, S_pad - S))  # [H, T, S_pad], zeros past S
        o_lat = p @ cache.buf[:S_pad, : self.C]  # [H, T, C]; values are c̄ itself before W_UV
        return torch.einsum("htc,hvc->thv", o_lat, self.w_uv)  # [T, H, V]


def cache_values_per_token(cfg: ModelConfig) -> int:
    """Cached values per token per MLA layer: kv_lora + rope (576 in K3)."""
    return cfg.kv_lora_rank + cfg.qk_rope_head_dim
