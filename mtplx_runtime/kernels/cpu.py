"""`cpu` backend: `expert_mlp` on packed record bytes with the native C kernels (same API as
`reference`).

Shape legend: T tokens, K experts per token, R latent width (3584), I expert width (3072).

t158 records run through `cpu_t158.expert_mlp` (fused trit decode, gate/up GEMVs, SiTU-GLU in
fp32, down GEMV) one token at a time: decode (T = 1) is the hot path, a prefill chunk loops over
its tokens. Each expert's output is rounded to the model dtype and combined exactly as the
reference does (fp32, ascending expert id). Modes without a native kernel yet (mxfp4, ct-int,
bf16) go through the reference path, so selecting this backend never fails on a codec.
Against `reference` the results differ by fp32 summation order inside each dot product.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from ..model.layers import SITU_BETA, SITU_LINEAR_BETA
from . import cpu_t158, reference

NATIVE_MODES = frozenset({"t158"})


def unavailable_reason() -> str | None:
    ok, why = cpu_t158.available()
    return None if ok else why


def expert_mlp(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, slots, storage,
               layout, shapes: Mapping, *, beta: float = SITU_BETA,
               beta_lin: float = SITU_LINEAR_BETA) -> torch.Tensor:
    """See `reference.expert_mlp` (same arguments and result). Blocks; x must be on the CPU."""
    if layout.mode not in NATIVE_MODES:
        return reference.expert_mlp(x, ids, weights, slots, storage, layout, shapes,
                                    beta=beta, beta_lin=beta_lin)
    if x.dim() != 2 or ids.shape != weights.shape or ids.shape[0] != x.shape[0]:
        raise ValueError(f"x {list(x.shape)}, ids {list(ids.shape)}, weights "
                         f"{list(weights.shape)}: want [T, R], [T, K], [T, K]")
    from ..storage.bank import record_parts

    by_id = reference.expert_slots(ids, slots)
    xs = x.float().numpy()  # [T, R] fp32: the kernel computes in fp32
    acc = torch.zeros(x.shape, dtype=torch.float32)  # [T, R]
    for e in torch.unique(ids).tolist():  # ascending: the reference combine order
        parts = record_parts(layout, np.asarray(reference.record_view(storage, by_id[e])))
        proj = {p: (parts[p]["packed"], parts[p]["scales"]) for p in ("gate", "up", "down")}
        tok, k = torch.nonzero(ids == e, as_tuple=True)  # [n] each, tok distinct
        y = np.stack([cpu_t158.expert_mlp(proj["gate"], proj["up"], proj["down"],
                                          np.ascontiguousarray(xs[t]), beta, beta_lin)
                      for t in tok.tolist()])  # [n, R]
        y = torch.from_numpy(y).to(x.dtype)  # y_e in the model dtype, as LatentMoE has it
        acc.index_add_(0, tok, y.float() * weights[tok, k].unsqueeze(-1))
    return acc.to(x.dtype)
