"""Quantized resident layouts without torch: which resident tensors `--resident-dtype`
quantizes, how many bytes each then takes, and which tensors an artifact built with
`--resident-dtype` stores in its place (FORMAT.md "Quantized residents").

formats/resident_quant.py encodes these layouts, model/quant.py computes with them; the checkpoint
reader checks stored tensors and engine/plan.py sizes memory from them, so `mtplx plan` needs no
torch.
"""

from __future__ import annotations

import math

__all__ = ["FP8_MAX", "GROUP", "RESIDENT_DTYPES", "quantizable", "quantized_bytes",
           "quantized_kind", "resolve_resident_dtype", "stored_tensors"]

RESIDENT_DTYPES = ("bf16", "int8", "int4", "fp8")
GROUP = 32  # int4 group along the input dim: 1 bf16 scale + 1 bf16 zero per 32 weights
FP8_MAX = 448.0  # largest finite float8_e4m3fn: fp8 scales map a row's max|w| to it
# 2-D bf16 tensors kept as stored: the embedding table (a lookup, not a matmul), the AttnRes
# mixes (`*_res_proj`, [1, D] vectors), the router (K3's and the DeepSeek-V3 family's), and
# kv_b_proj, which absorbed MLA attention slices per head as a tensor (model/mla.py w_uk / w_uv).
_KEEP_SUFFIXES = ("embed_tokens.weight", "_res_proj.weight", "block_sparse_moe.gate.weight",
                  "mlp.gate.weight", "kv_b_proj.weight")


def quantizable(name: str, shape: tuple[int, ...], st_dtype: str) -> bool:
    """The rule: every BF16 2-D tensor but the embedding table, the AttnRes projections, the
    router and kv_b_proj; 1-D and F32 tensors never."""
    return st_dtype == "BF16" and len(shape) == 2 and not name.endswith(_KEEP_SUFFIXES)


def quantized_kind(shape: tuple[int, ...], dtype: str) -> str:
    """The layout a quantizable [N, K] matrix takes in `dtype`: int4 falls back to int8 where K
    is not a multiple of GROUP; int8 and fp8 take every shape."""
    if dtype not in RESIDENT_DTYPES[1:]:
        raise ValueError(f"quantized dtype must be int8, int4 or fp8, not {dtype!r}")
    if dtype == "int4" and shape[1] % GROUP:
        return "int8"
    return dtype


def stored_tensors(name: str, shape: tuple[int, ...], st_dtype: str,
                   resident_dtype: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{stored name: (safetensors dtype, shape)} that an artifact built with `resident_dtype`
    holds for resident `name` (FORMAT.md "Quantized residents"): the tensor itself unless it is
    quantized; int8 `name` I8 [N, K] + `name_scale` BF16 [N]; int4 `name` U8 [N, K/2] (even k
    in the low nibble) + `name_scale` and `name_zero` BF16 [K/GROUP, N]; fp8 `name` F8_E4M3
    [N, K] + `name_scale` F32 [N]."""
    if resident_dtype not in RESIDENT_DTYPES:
        raise ValueError(f"resident dtype must be one of {', '.join(RESIDENT_DTYPES)}, not "
                         f"{resident_dtype!r}")
    if resident_dtype == "bf16" or not quantizable(name, shape, st_dtype):
        return {name: (st_dtype, tuple(shape))}
    rows, k = shape
    kind = quantized_kind(shape, resident_dtype)
    if kind == "int8":
        return {name: ("I8", (rows, k)), name + "_scale": ("BF16", (rows,))}
    if kind == "fp8":
        return {name: ("F8_E4M3", (rows, k)), name + "_scale": ("F32", (rows,))}
    groups = (k // GROUP, rows)
    return {name: ("U8", (rows, k // 2)), name + "_scale": ("BF16", groups),
            name + "_zero": ("BF16", groups)}


def resolve_resident_dtype(requested: str | None, stored: str, where: object) -> str:
    """The dtype residents load in: `stored` when none is asked for; a bf16 model quantizes at
    load to any; a quantized artifact loads only as what it stores (its bf16 values are gone).
    ValueError names `where` otherwise."""
    if requested is None or requested == stored:
        return stored
    if requested not in RESIDENT_DTYPES:
        raise ValueError(f"resident dtype must be one of {', '.join(RESIDENT_DTYPES)}, not "
                         f"{requested!r}")
    if stored == "bf16":
        return requested
    raise ValueError(f"{where}: holds {stored} residents (built with --resident-dtype {stored}) "
                     f"and cannot load them as {requested}: leave --resident-dtype unset (or "
                     f"{stored}), or build an artifact from the bf16 checkpoint for {requested}")


def quantized_bytes(shape: tuple[int, ...], dtype: str) -> int:
    """Bytes of one quantizable [N, K] matrix in `dtype` ("int8" | "int4" | "fp8"): int8 is
    N·K + 2N (bf16 scale per row); int4 N·K/2 + 4 per group of GROUP (bf16 scale and zero), or
    int8 where K is not a multiple of GROUP; fp8 N·K + 4N (fp32 scale per row)."""
    rows, k = shape
    kind = quantized_kind(shape, dtype)
    if kind == "int8":
        return math.prod(shape) + 2 * rows
    if kind == "fp8":
        return math.prod(shape) + 4 * rows
    return math.prod(shape) // 2 + 4 * rows * (k // GROUP)
