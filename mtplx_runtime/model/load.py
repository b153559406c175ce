"""Resident weights: checkpoint tensors -> torch tensors in the model dtype, grouped per layer.

The one place where checkpoint names meet the model (mlx-lm's `sanitize()`): BF16 tensors become
the model dtype (float32 or bfloat16, exact either way), as do an fp8 checkpoint's FP8 matrices,
dequantized by the fp8-block decode; F32 tensors (KDA conv, A_log, dt_bias,
o_norm, router correction bias; FORMAT.md "Resident tensors") stay float32 because the
precision contract computes with them in fp32. Quantized residents (FORMAT.md "Quantized
residents") are computed at load from bf16 ones, or read as stored from an artifact built with
`--resident-dtype`: the same tensors either way.
"""

from __future__ import annotations

import numpy as np
import torch

from ..checkpoint import Checkpoint, resident_tensor_specs
from ..checkpoint.residents import SCALE_INV, naming
from ..formats.base import stored_to_torch
from ..formats.fp8block import decode_fp8_block
from ..formats.resident_layouts import (
    RESIDENT_DTYPES,
    quantizable,
    resolve_resident_dtype,
    stored_tensors,
)
from .quant import held, quantize

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def model_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {name!r}") from None


def to_torch(array: np.ndarray, st_dtype: str, dtype: torch.dtype, device: str) -> torch.Tensor:
    """One stored tensor as torch: BF16 bits -> `dtype`, F32 kept float32."""
    if st_dtype == "BF16":
        return stored_to_torch(array, st_dtype).to(device=device, dtype=dtype)
    if st_dtype == "F32":
        return stored_to_torch(array, st_dtype).to(device=device)
    raise ValueError(f"resident tensors are BF16 or F32, not {st_dtype}")


def group_residents(cfg, make):
    """(global tensors by short name, per-layer dicts by suffix after `layers.{l}.`) with
    `make(name, spec)` giving each resident tensor of `resident_tensor_specs(cfg)`."""
    top: dict[str, torch.Tensor] = {}
    layers: list[dict[str, torch.Tensor]] = [{} for _ in range(cfg.num_hidden_layers)]
    backbone, lm_head = naming(cfg)
    for name, spec in resident_tensor_specs(cfg).items():
        t = make(name, spec)
        if name == lm_head:
            top["lm_head.weight"] = t
            continue
        short = name[len(backbone):]
        if short.startswith("layers."):
            _, layer, suffix = short.split(".", 2)
            layers[int(layer)][suffix] = t
        else:
            top[short] = t
    if cfg.tie_word_embeddings:
        top["lm_head.weight"] = top["embed_tokens.weight"]
    return top, layers


def check_resident_dtype(resident_dtype: str | None, dtype: torch.dtype) -> None:
    """int8/int4/fp8 residents compute through bf16 matmuls: they need a bfloat16 model. None (as
    the model stores them) is checked once the model's own dtype is known."""
    if resident_dtype is None:
        return
    if resident_dtype not in RESIDENT_DTYPES:
        raise ValueError(f"resident dtype must be one of {', '.join(RESIDENT_DTYPES)}, "
                         f"not {resident_dtype!r}")
    if resident_dtype != "bf16" and dtype != torch.bfloat16:
        raise ValueError(f"--resident-dtype {resident_dtype} needs a bfloat16 model "
                         f"(dtype bfloat16), not {dtype}")


def load_residents(ckpt: Checkpoint, dtype: torch.dtype, device: str = "cpu",
                   resident_dtype: str | None = None):
    """The checkpoint's residents grouped by `group_residents`, in the model dtype. The matrices
    of `formats.resident_layouts.quantizable` are read as stored by an artifact built with
    `--resident-dtype` (then `resident_dtype` must be None or that dtype), or, from bf16 ones,
    quantized one at a time as they load when `resident_dtype` is int8/int4/fp8 (peak: the
    quantized total + one bf16 tensor + one row block). None: as the model stores them."""
    stored = ckpt.resident_dtype
    resident_dtype = resolve_resident_dtype(resident_dtype, stored, ckpt.path)
    check_resident_dtype(resident_dtype, dtype)

    def make(name, spec):
        if stored != "bf16" and quantizable(name, spec.shape, spec.dtype):
            return held(*(_stored(ckpt, n, st, device)
                          for n, (st, _) in stored_tensors(name, spec.shape, spec.dtype,
                                                          stored).items()))
        st_dtype = ckpt.tensor_info(name).dtype
        if st_dtype == "F8_E4M3":  # an fp8 checkpoint's matrix (the reader checked its scales)
            w = decode_fp8_block(ckpt.tensor(name), ckpt.tensor(name + SCALE_INV))
            t = torch.from_numpy(w).to(device=device, dtype=dtype)  # bf16 values: exact
        else:
            # As stored: the reader accepts a few tensors in either of two dtypes (the
            # DeepSeek-V3 family's correction bias, F32 or BF16).
            t = to_torch(ckpt.tensor(name), st_dtype, dtype, device)
        if resident_dtype != "bf16" and quantizable(name, spec.shape, spec.dtype):
            return quantize(t, resident_dtype)
        return t

    return group_residents(ckpt.config, make)


def _stored(ckpt: Checkpoint, name: str, st_dtype: str, device: str) -> torch.Tensor:
    """One stored tensor of a quantized matrix as is: I8/U8 codes, F8_E4M3 codes (read as their
    bytes), BF16 scales and zeros, F32 scales (the checkpoint reader checked dtype and shape
    against the table at open)."""
    return stored_to_torch(ckpt.tensor(name), st_dtype).to(device)


def sub(weights: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The entries under `prefix` with the prefix removed (e.g. "self_attn.")."""
    return {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
