"""Reference routed-expert kernel: decode each selected record to float with its codec's NumPy
reference, then run LatentMoE's exact torch math. The definition every other backend is tested
against; bit-identical to LatentMoE's routed sum (before the latent norm) for the same experts.

    slot bytes -> record_parts -> codec.decode (fp32) -> model dtype -> glu_mlp per expert
      -> fp32 weight multiply, summed in ascending expert id -> x.dtype

Shape legend: T tokens, R latent (3584), I expert width (3072), K top-k (16), U distinct experts.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from .. import checkpoint  # noqa: F401  (first: storage.bank alone hits an import cycle)
from ..model.layers import SITU_BETA, SITU_LINEAR_BETA, glu_mlp
from ..storage.bank import PROJECTIONS, record_parts


def record_view(storage, slot: int):
    """The record bytes of `slot`: `storage.view(slot)` for a SlotTier (it has `slot_bytes`),
    else `storage[slot]` (an array [num_slots, slot_bytes] or a list of byte buffers)."""
    return storage.view(int(slot)) if hasattr(storage, "slot_bytes") else storage[int(slot)]


def expert_slots(ids: torch.Tensor, slots) -> dict[int, int]:
    """`slots` as {expert id: slot}. Accepts that mapping itself, or a [T, K] integer tensor /
    array aligned with `ids` (every occurrence of an id must name the same slot)."""
    if isinstance(slots, Mapping):
        return {int(e): int(s) for e, s in slots.items()}
    s = torch.as_tensor(np.asarray(slots) if not torch.is_tensor(slots) else slots.cpu())
    if tuple(s.shape) != tuple(ids.shape):
        raise ValueError(f"slots {list(s.shape)} must match ids {list(ids.shape)}")
    out: dict[int, int] = {}
    for e, sl in zip(ids.cpu().reshape(-1).tolist(), s.reshape(-1).tolist()):
        if out.setdefault(int(e), int(sl)) != int(sl):
            raise ValueError(f"expert {e} is mapped to two slots ({out[e]} and {sl})")
    return out


def decode_record(buf, layout, shapes: Mapping, dtype: torch.dtype,
                  device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """One record's bytes -> {"gate", "up": [I, R], "down": [R, I]} in `dtype` (exact: every
    codec's decoded values are bf16-representable, so the cast from fp32 loses nothing)."""
    if hasattr(buf, "get") and not isinstance(buf, np.ndarray):  # cupy -> host
        buf = buf.get()
    parts = record_parts(layout, np.asarray(buf, dtype=np.uint8)[: layout.logical_bytes])
    codec = layout.codec
    return {p: torch.from_numpy(np.ascontiguousarray(
                codec.decode(parts[p], tuple(shapes[p])), dtype=np.float32)
            ).to(device=device, dtype=dtype) for p in PROJECTIONS}


def expert_mlp(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, slots, storage,
               layout, shapes: Mapping, *, beta: float = SITU_BETA,
               beta_lin: float = SITU_LINEAR_BETA) -> torch.Tensor:
    """Routed experts of one layer for T tokens: sum_k weights[t, k] * W_down SiTU-GLU(x_t).

    x: [T, R] latent activations in the model dtype (float32 or bfloat16; the math runs in it).
    ids: [T, K] int64, sorted ascending and distinct per token (`model.moe.route`).
    weights: [T, K] float32 aligned with ids.
    slots: {expert id: slot index} covering every id, or a [T, K] slot-index tensor aligned
      with ids.
    storage: the slot bytes: a SlotTier (`view(slot) -> uint8 [record bytes]`, numpy or cupy)
      or an indexable `storage[slot]` (e.g. uint8 [num_slots, slot_bytes]).
    layout: the RecordLayout of the bank mode (`storage.bank.record_layout`); its codec decodes.
    shapes: {"gate", "up": (I, R), "down": (R, I)} (`ModelConfig.expert_shapes`).
    beta, beta_lin: the SiTU-GLU constants (`cfg.activation_situ_beta`, `..._linear_beta`).
    Returns [T, R] in x.dtype on x.device. Blocks (host decode).
    """
    if x.dim() != 2 or ids.shape != weights.shape or ids.shape[0] != x.shape[0]:
        raise ValueError(f"x {list(x.shape)}, ids {list(ids.shape)}, weights "
                         f"{list(weights.shape)}: want [T, R], [T, K], [T, K]")
    by_id = expert_slots(ids, slots)
    needed = torch.unique(ids).tolist()  # [U] ascending
    missing = [e for e in needed if e not in by_id]
    if missing:
        raise KeyError(f"no slot given for experts {missing}")
    ys = {}
    for e in needed:  # each expert once over all the tokens that chose it, as LatentMoE does
        w = decode_record(record_view(storage, by_id[e]), layout, shapes, x.dtype, x.device)
        tok, k = torch.nonzero(ids == e, as_tuple=True)  # [n] each, tok distinct
        ys[e] = tok, k, glu_mlp(x[tok], w["gate"], w["up"], w["down"], beta, beta_lin)  # [n, R]
    # Combine exactly as LatentMoE: each y_e -> fp32, times its fp32 weight, added in ascending
    # expert id (index_add_ of distinct tokens = per-token left-to-right fp32 sum).
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, R]
    for e in needed:
        tok, k, y = ys[e]
        acc.index_add_(0, tok, y.float() * weights[tok, k].unsqueeze(-1))
    return acc.to(x.dtype)
