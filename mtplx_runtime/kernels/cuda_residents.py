"""CUDA GEMV of quantized residents (native/residents.cu through cupy): out [T, N] bf16 = x [T, K]
bf16 times an int8, fp8 or int4 matrix [N, K] as stored (FORMAT.md "Quantized residents"), for
the few tokens of a decode step. Tensor-core MMAs with the weights dequantized in registers and
fp32 sums; int8 and fp8 scale each row's sums, int4 folds scale and zero into its weights (the
reference's dequantized values bit for bit). model/quant.py `kernel_for` decides when it runs.

    x [T, K] --{kind}_gemv_{x1, x4} (grid N / 128 x column splits, passes of 8 or up to 32
               tokens; the last block of each 128 rows adds the splits in order)--> out [T, N]
"""

from __future__ import annotations

import numpy as np
import torch

from .cuda import (
    BLOCK_ROWS,
    THREADS,
    X1_MAX_T,
    XS_STRIDE_BYTES,
    kernel,
    stream,
    unavailable_reason,
)

SLICE = 256  # columns per staged slice (native/codecs.cuh MTPLX_SLICE): the split unit

SOURCE = "residents.cu"
KINDS = ("int8", "fp8", "int4")
MAX_T = 32  # above it torch's kernels (or the reference) compute: model/quant.py kernel_for
# Blocks to aim for: a 16384-row lm_head makes only 128 row blocks, too few loads in flight to
# stream at the memory's rate (about 4 blocks of 4 warps per SM, 132 SMs), so its columns are
# split; the sums stay deterministic (added in split order).
TARGET_BLOCKS = 528

__all__ = ["KINDS", "MAX_T", "gemv", "refusal", "unavailable_reason"]


def refusal(kind: str, shape: tuple[int, int]) -> str:
    """Why the GEMV cannot take an [N, K] matrix of `kind` ("" if it can): rows come in 16-row
    MMA tiles and every row must start 16-byte aligned (int8/fp8: K % 16; int4: whole groups of
    32, K % 32)."""
    n, k = shape
    if n % 16:
        return f"the CUDA GEMV needs N % 16 == 0 (N = {n})"
    step = 32 if kind == "int4" else 16
    if k % step:
        return f"the CUDA {kind} GEMV needs K % {step} == 0 (K = {k})"
    return ""


def gemv(kind: str, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
         x: torch.Tensor) -> torch.Tensor:
    """x [T, K] bf16 times the stored matrix -> [T, N] bf16, on x's device (torch's current
    stream, no host sync). q: int8 [N, K], float8_e4m3fn [N, K] or uint8 [N, K / 2] (int4, even
    k in the low nibble); scale: bf16 [N] (int8), fp32 [N] (fp8), bf16 [K / 32, N] (int4);
    zero: bf16 [K / 32, N] (int4 only)."""
    T, K = x.shape
    N = q.shape[0]
    if not (x.is_cuda and x.dtype == torch.bfloat16 and q.device == x.device and T >= 1
            and kind in KINDS and not refusal(kind, (N, K))):
        raise ValueError(f"gemv {kind}: x {x.dtype}{list(x.shape)} on {x.device}, q "
                         f"{q.dtype}{list(q.shape)} on {q.device}")
    x = x.contiguous()
    dev = x.device
    blocks = -(-N // BLOCK_ROWS)
    slices = -(-K // SLICE)
    per = -(-slices // max(1, min(slices, TARGET_BLOCKS // blocks)))  # slices per split
    splits = -(-slices // per)
    out = torch.empty(T, N, dtype=torch.bfloat16, device=dev)
    part = torch.empty(splits, T, N, dtype=torch.float32, device=dev)
    ntmax = 1 if T <= X1_MAX_T else 4
    smem = 8 * ntmax * XS_STRIDE_BYTES
    fn = kernel(SOURCE, f"{kind}_gemv_{'x1' if ntmax == 1 else 'x4'}", smem)
    fn((blocks, splits), (THREADS,),
       (q.data_ptr(), scale.data_ptr(), zero.data_ptr() if zero is not None else 0,
        np.int32(N), np.int32(K), x.data_ptr(), np.int32(T), out.data_ptr(), part.data_ptr(),
        _counters(blocks, dev).data_ptr(), np.int32(per)),
       shared_mem=smem, stream=stream(dev))
    return out


_COUNTERS: dict[str, torch.Tensor] = {}


def _counters(n: int, device: torch.device) -> torch.Tensor:
    """One zero counter per row block (each launch's last block resets its own), kept per
    device and grown as needed: one stream at a time uses them (the model's)."""
    c = _COUNTERS.get(str(device))
    if c is None or len(c) < n:
        c = _COUNTERS[str(device)] = torch.zeros(max(n, 128), dtype=torch.int32, device=device)
    return c
