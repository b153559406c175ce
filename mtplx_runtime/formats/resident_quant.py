"""The int8, int4 and fp8 encoders of quantized resident matrices (FORMAT.md "Quantized
residents"): a bf16 torch matrix -> the stated tensors, the same bytes whether a model quantizes
at load or `mtplx build-manifest --resident-dtype` stores them.

    bf16 [N, K] --encode_int8--> q int8 [N, K], scale bf16 [N]
                --encode_int4--> q uint8 [N, K/2] (0..15, even k low), scale, zero bf16 [K/32, N]
                --encode_fp8---> q float8_e4m3fn [N, K], scale fp32 [N]

Rows are encoded in blocks so a whole lm_head (163840 x 7168: 4.7 GB per fp32 copy) never exists
in fp32. model/quant.py wraps the tensors in the weights a model computes with.
"""

from __future__ import annotations

import numpy as np
import torch

from .base import stored_to_torch
from .resident_layouts import FP8_MAX, GROUP, quantized_kind

__all__ = ["encode_fp8", "encode_int4", "encode_int8", "encode_stored"]

# Rows are quantized in blocks of this many weights: the fp32 temporaries of one block, not of a
# whole lm_head, bound the transient memory of a load or a build.
_BLOCK = 1 << 22


def _row_blocks(w: torch.Tensor):
    step = max(1, _BLOCK // w.shape[1])
    for r in range(0, w.shape[0], step):
        yield r, w[r:r + step].float()


def encode_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 [N, K] -> (q int8 [N, K], scale bf16 [N]): scale = max|w_n| / 127 rounded to bf16,
    q = round(w / scale) clamped to ±127 (a zero row gets scale 1 and q 0)."""
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    scale = torch.empty(w.shape[0], dtype=torch.bfloat16, device=w.device)
    for r, w32 in _row_blocks(w):
        amax = w32.abs().amax(dim=1)
        s = torch.where(amax > 0, amax / 127, torch.ones_like(amax)).to(torch.bfloat16)
        q[r:r + len(w32)] = torch.round(w32 / s.float()[:, None]).clamp(-127, 127)
        scale[r:r + len(w32)] = s
    return q, scale


def encode_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 (or fp32) [N, K] -> (q float8_e4m3fn [N, K], scale fp32 [N]): scale = max|w_n| /
    FP8_MAX in fp32, q = w / scale clamped to ±FP8_MAX and rounded to e4m3 (nearest even; the
    clamp makes how a device's cast treats values past 448 irrelevant); a zero row gets scale 1
    and q 0. model/quant.py also quantizes activations per row with it (the fp8 fast path)."""
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
    for r, w32 in _row_blocks(w):
        amax = w32.abs().amax(dim=1)
        s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        q[r:r + len(w32)] = (w32 / s[:, None]).clamp(-FP8_MAX, FP8_MAX)
        scale[r:r + len(w32)] = s
    return q, scale


def encode_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 [N, K] (K % GROUP == 0) -> (q uint8 [N, K/2], scale bf16 [K/GROUP, N], zero bf16
    [K/GROUP, N]): per group, scale = (max - min) / 15 and zero = min + 8 · scale (both rounded
    to bf16), q = round((w - zero) / scale) + 8 in 0..15, two per byte, even k in the low
    nibble. A group of one repeated value c uses scale |c| / 8 (1 for c = 0), so c dequantizes
    exactly."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"int4 needs the input width to be a multiple of {GROUP}, not {k}")
    packed = torch.empty(n, k // 2, dtype=torch.uint8, device=w.device)
    scale = torch.empty(n, k // GROUP, dtype=torch.bfloat16, device=w.device)
    zero = torch.empty_like(scale)
    for r, w32 in _row_blocks(w):
        rows = slice(r, r + len(w32))
        g = w32.view(len(w32), k // GROUP, GROUP)
        lo, hi = g.amin(-1), g.amax(-1)
        # A constant group c keeps c exactly: scale |c| / 8 puts it at q = 0 (zero = c + |c|).
        flat = torch.where(lo != 0, lo.abs() / 8, torch.ones_like(lo))
        scale[rows] = torch.where(hi > lo, (hi - lo) / 15, flat)
        zero[rows] = lo + 8 * scale[rows].float()
        q = torch.round((g - zero[rows].float()[..., None]) / scale[rows].float()[..., None]) + 8
        q = q.clamp(0, 15).to(torch.uint8).view(len(w32), k)
        packed[rows] = q[:, 0::2] | (q[:, 1::2] << 4)
    return packed, scale.t().contiguous(), zero.t().contiguous()


def encode_stored(name: str, bits: np.ndarray, resident_dtype: str) -> dict[str, np.ndarray]:
    """One quantizable BF16 matrix, given as its uint16 bit patterns [N, K], as the tensors
    `formats.resident_layouts.stored_tensors` names: {name: int8 or uint8 codes (fp8: the
    e4m3 bytes), name_scale (and name_zero for int4): uint16 bf16 bits (fp8: float32)}."""
    w = stored_to_torch(bits, "BF16")
    kind = quantized_kind(tuple(w.shape), resident_dtype)
    if kind == "int8":
        q, scale = encode_int8(w)
        return {name: q.numpy(), name + "_scale": _bits(scale)}
    if kind == "fp8":
        q, scale = encode_fp8(w)
        return {name: q.view(torch.uint8).numpy(), name + "_scale": scale.numpy()}
    q, scale, zero = encode_int4(w)
    return {name: q.numpy(), name + "_scale": _bits(scale), name + "_zero": _bits(zero)}


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16)
