"""Quantized resident layouts without torch: which resident tensors `--resident-dtype`
quantizes and how many bytes each then takes (FORMAT.md "Quantized residents").

model/quant.py computes with these layouts; engine/plan.py sizes memory from them, so `mtplx
plan` needs no torch.
"""

from __future__ import annotations

import math

__all__ = ["GROUP", "RESIDENT_DTYPES", "quantizable", "quantized_bytes"]

RESIDENT_DTYPES = ("bf16", "int8", "int4")
GROUP = 32  # int4 group along the input dim: 1 bf16 scale + 1 bf16 zero per 32 weights
# 2-D bf16 tensors kept as stored: the embedding table (a lookup, not a matmul), the AttnRes
# mixes (`*_res_proj`, [1, D] vectors), the router, and kv_b_proj, which absorbed MLA attention
# slices per head as a tensor (model/mla.py w_uk / w_uv).
_KEEP_SUFFIXES = ("embed_tokens.weight", "_res_proj.weight", "block_sparse_moe.gate.weight",
                  "kv_b_proj.weight")


def quantizable(name: str, shape: tuple[int, ...], st_dtype: str) -> bool:
    """The rule: every BF16 2-D tensor but the embedding table, the AttnRes projections, the
    router and kv_b_proj; 1-D and F32 tensors never."""
    return st_dtype == "BF16" and len(shape) == 2 and not name.endswith(_KEEP_SUFFIXES)


def quantized_bytes(shape: tuple[int, ...], dtype: str) -> int:
    """Bytes of one quantizable [N, K] matrix in `dtype` ("int8" | "int4"): int8 is N·K + 2N
    (bf16 scale per row); int4 N·K/2 + 4 per group of GROUP (bf16 scale and zero), or int8
    where K is not a multiple of GROUP."""
    if dtype not in ("int8", "int4"):
        raise ValueError(f"quantized dtype must be int8 or int4, not {dtype!r}")
    rows, k = shape
    if dtype == "int8" or k % GROUP:
        return math.prod(shape) + 2 * rows
    return math.prod(shape) // 2 + 4 * rows * (k // GROUP)
