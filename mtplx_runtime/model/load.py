"""Resident weights: checkpoint tensors -> torch tensors in the model dtype, grouped per layer.

The one place where checkpoint names meet the model (mlx-lm's `sanitize()`): BF16 tensors become
the model dtype (float32 or bfloat16, exact either way); F32 tensors (KDA conv, A_log, dt_bias,
o_norm, router correction bias; FORMAT.md "Resident tensors") stay float32 because the
precision contract computes with them in fp32.
"""

from __future__ import annotations

import numpy as np
import torch

from ..checkpoint import Checkpoint, resident_tensor_specs
from ..checkpoint.residents import BACKBONE, LM_HEAD
from ..formats.residents import RESIDENT_DTYPES, quantizable
from .quant import quantize

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def model_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {name!r}") from None


def to_torch(array: np.ndarray, st_dtype: str, dtype: torch.dtype, device: str) -> torch.Tensor:
    """One stored tensor as torch: BF16 bits -> `dtype`, F32 kept float32."""
    if st_dtype == "BF16":
        t = torch.from_numpy(np.ascontiguousarray(array).view(np.int16)).view(torch.bfloat16)
        return t.to(device=device, dtype=dtype)
    if st_dtype == "F32":
        return torch.from_numpy(np.ascontiguousarray(array)).to(device=device)
    raise ValueError(f"resident tensors are BF16 or F32, not {st_dtype}")


def group_residents(cfg, make):
    """(global tensors by short name, per-layer dicts by suffix after `layers.{l}.`) with
    `make(name, spec)` giving each resident tensor of `resident_tensor_specs(cfg)`."""
    top: dict[str, torch.Tensor] = {}
    layers: list[dict[str, torch.Tensor]] = [{} for _ in range(cfg.num_hidden_layers)]
    for name, spec in resident_tensor_specs(cfg).items():
        t = make(name, spec)
        if name == LM_HEAD:
            top["lm_head.weight"] = t
            continue
        short = name[len(BACKBONE):]
        if short.startswith("layers."):
            _, layer, suffix = short.split(".", 2)
            layers[int(layer)][suffix] = t
        else:
            top[short] = t
    if cfg.tie_word_embeddings:
        top["lm_head.weight"] = top["embed_tokens.weight"]
    return top, layers


def check_resident_dtype(resident_dtype: str, dtype: torch.dtype) -> None:
    """int8/int4 residents compute through bf16 matmuls: they need a bfloat16 model."""
    if resident_dtype not in RESIDENT_DTYPES:
        raise ValueError(f"resident dtype must be one of {', '.join(RESIDENT_DTYPES)}, "
                         f"not {resident_dtype!r}")
    if resident_dtype != "bf16" and dtype != torch.bfloat16:
        raise ValueError(f"--resident-dtype {resident_dtype} needs a bfloat16 model "
                         f"(dtype bfloat16), not {dtype}")


def load_residents(ckpt: Checkpoint, dtype: torch.dtype, device: str = "cpu",
                   resident_dtype: str = "bf16"):
    """The checkpoint's residents grouped by `group_residents`, in the model dtype; with
    `resident_dtype` int8/int4 the matrices of `formats.residents.quantizable` are quantized one
    at a time as they load (peak: the quantized total + one bf16 tensor + one row block)."""
    check_resident_dtype(resident_dtype, dtype)

    def make(name, spec):
        t = to_torch(ckpt.tensor(name), spec.dtype, dtype, device)
        if resident_dtype != "bf16" and quantizable(name, spec.shape, spec.dtype):
            return quantize(t, resident_dtype)
        return t

    return group_residents(ckpt.config, make)


def sub(weights: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The entries under `prefix` with the prefix removed (e.g. "self_attn.")."""
    return {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
