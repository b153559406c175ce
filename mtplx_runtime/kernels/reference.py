"""Reference routed-expert kernel: decode each selected record to float with its codec's NumPy
reference, then run LatentMoE's exact torch math. The definition every other backend is tested
against; bit-identical to LatentMoE's routed sum (before the latent norm) for the same experts.

    slot bytes -> record_parts -> codec.decode (fp32) -> model dtype -> glu_mlp per expert
      -> fp32 weight multiply, summed in ascending expert id -> x.dtype

Shape legend: T tokens, R latent (3584), I expert width (3072), K top-k (16), U distinct experts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..formats.record import PROJECTIONS, record_parts

DEVICE = "cpu"  # slot bytes are decoded on the host (results land on x's device)
SITU_BETA = 4.0  # SiTU-GLU constants (FORMAT.md "SiTU-GLU")
SITU_LINEAR_BETA = 25.0


def _soft_clamp(v: torch.Tensor, beta: float) -> torch.Tensor:
    """β·tanh(v/β); at β = +inf its limit, v itself (FORMAT.md "SiLU-GLU")."""
    return v if math.isinf(beta) else beta * torch.tanh(v / beta)


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float = SITU_BETA,
             beta_lin: float = SITU_LINEAR_BETA) -> torch.Tensor:
    """`SiTU(gate) ⊙ β_lin·tanh(up/β_lin)` (FORMAT.md "SiTU-GLU"), computed in fp32 and cast to
    gate's dtype.

    SiTU(g) = β·tanh(g/β)·σ(g). gate, up: [..., I] in the model dtype -> [..., I]. β = β_lin =
    +inf is the limit `g·σ(g) ⊙ u`: SiLU-GLU, the DeepSeek-V3 family's activation (FORMAT.md
    "SiLU-GLU").
    """
    g, u = gate.float(), up.float()  # fp32 island: the reference's SituAndMul upcasts here
    h = _soft_clamp(g, beta) * torch.sigmoid(g) * _soft_clamp(u, beta_lin)
    return h.to(gate.dtype)


def glu_mlp(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
            beta: float = SITU_BETA, beta_lin: float = SITU_LINEAR_BETA) -> torch.Tensor:
    """SiTU-GLU MLP `W_down · situ_glu(W_gate x, W_up x)`.

    x: [T, Din]; w_gate, w_up: [I, Din]; w_down: [Dout, I]; all in the model dtype -> [T, Dout].
    The three GEMMs run in the model dtype (bf16 GEMM in a bf16 model, FORMAT.md "Numerics").
    """
    h = situ_glu(F.linear(x, w_gate), F.linear(x, w_up), beta, beta_lin)  # [T, I]
    return F.linear(h, w_down)  # [T, Dout]


@dataclass(frozen=True, slots=True)
class ExpertWeights:
    """One routed expert in the model dtype: gate, up [I, R]; down [R, I] (w1, w3, w2)."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


def expert_weights(arrays: Mapping, dtype: torch.dtype,
                   device: torch.device | str = "cpu") -> ExpertWeights:
    """Decoded float arrays {"gate", "up", "down"} -> ExpertWeights in `dtype` (exact: every
    codec's decoded values are bf16-representable, so the cast from fp32 loses nothing)."""
    t = {p: torch.from_numpy(np.ascontiguousarray(arrays[p], dtype=np.float32))
         .to(device=device, dtype=dtype) for p in PROJECTIONS}
    return ExpertWeights(t["gate"], t["up"], t["down"])


def record_view(storage, slot: int):
    """The record bytes of `slot`: `storage.view(slot)` for a SlotTier (it has `slot_bytes`),
    else `storage[slot]` (an array [num_slots, slot_bytes] or a list of byte buffers)."""
    return storage.view(int(slot)) if hasattr(storage, "slot_bytes") else storage[int(slot)]


def expert_slots(ids: torch.Tensor, slots) -> dict[int, int]:
    """`slots` as {expert id: slot}. Accepts that mapping itself, or a [T, K] integer tensor /
    array aligned with `ids` (every occurrence of an id must name the same slot; entries of
    empty picks, id < 0, are ignored)."""
    if isinstance(slots, Mapping):
        return {int(e): int(s) for e, s in slots.items()}
    s = torch.as_tensor(np.asarray(slots) if not torch.is_tensor(slots) else slots.cpu())
    if tuple(s.shape) != tuple(ids.shape):
        raise ValueError(f"slots {list(s.shape)} must match ids {list(ids.shape)}")
    out: dict[int, int] = {}
    for e, sl in zip(ids.cpu().reshape(-1).tolist(), s.reshape(-1).tolist()):
        if e < 0:  # an empty pick has no slot
            continue
        if out.setdefault(int(e), int(sl)) != int(sl):
            raise ValueError(f"expert {e} is mapped to two slots ({out[e]} and {sl})")
    return out


def decode_record(buf, layout, shapes: Mapping, dtype: torch.dtype,
                  device: torch.device | str = "cpu") -> ExpertWeights:
    """One record's bytes -> ExpertWeights (gate, up [I, R]; down [R, I]) in `dtype`: the mode
    codec's NumPy reference decode, then `expert_weights`."""
    if hasattr(buf, "get") and not isinstance(buf, np.ndarray):  # cupy -> host
        buf = buf.get()
    parts = record_parts(layout, np.asarray(buf, dtype=np.uint8)[: layout.logical_bytes])
    codec = layout.codec
    return expert_weights({p: codec.decode(parts[p], tuple(shapes[p])) for p in PROJECTIONS},
                          dtype, device)


def check_acc(acc: torch.Tensor | None, x: torch.Tensor) -> None:
    """`acc` must be None or an fp32 [T, R] tensor on x's device (it is added into in place)."""
    if acc is not None and (not torch.is_tensor(acc) or acc.dtype != torch.float32
                            or acc.shape != x.shape or acc.device != x.device):
        raise ValueError(f"acc must be a float32 tensor {list(x.shape)} on {x.device}, got "
                         f"{getattr(acc, 'dtype', type(acc).__name__)} "
                         f"{list(getattr(acc, 'shape', []))}")


def expert_mlp(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, slots, storage,
               layout, shapes: Mapping, *, beta: float = SITU_BETA,
               beta_lin: float = SITU_LINEAR_BETA,
               acc: torch.Tensor | None = None) -> torch.Tensor:
    """Routed experts of one layer for T tokens: sum_k weights[t, k] * W_down SiTU-GLU(x_t).

    x: [T, R] latent activations in the model dtype (float32 or bfloat16; the math runs in it).
    ids: [T, K] int64, sorted ascending and distinct per token (`model.moe.route`); an id of -1
      is an empty pick, skipped (how a caller runs one window of experts: picks of the others
      become -1).
    weights: [T, K] float32 aligned with ids.
    slots: {expert id: slot index} covering every id, or a [T, K] slot-index tensor aligned
      with ids.
    storage: the slot bytes: a SlotTier (`view(slot) -> uint8 [record bytes]`, numpy or cupy)
      or an indexable `storage[slot]` (e.g. uint8 [num_slots, slot_bytes]).
    layout: the RecordLayout of the bank mode (`formats.record.record_layout`); its codec decodes.
    shapes: {"gate", "up": (I, R), "down": (R, I)} (`ModelConfig.expert_shapes`).
    beta, beta_lin: the SiTU-GLU constants (`cfg.activation_situ_beta`, `..._linear_beta`).
    acc: None, or an fp32 [T, R] running sum: the routed products are added into it in
      ascending expert id and it is returned as is (fp32, not cast). Successive calls over
      windows of experts in ascending id order (the other picks -1) sum in the same fp32 order
      as one call, bit for bit, when each window holds every (token, k) occurrence of its
      experts (the torch GEMM of one expert depends on how many tokens it gets).
    Returns [T, R] in x.dtype on x.device (acc itself when given). Blocks (host decode).
    """
    if x.dim() != 2 or ids.shape != weights.shape or ids.shape[0] != x.shape[0]:
        raise ValueError(f"x {list(x.shape)}, ids {list(ids.shape)}, weights "
                         f"{list(weights.shape)}: want [T, R], [T, K], [T, K]")
    check_acc(acc, x)
    by_id = expert_slots(ids, slots)
    needed = [e for e in torch.unique(ids).tolist() if e >= 0]  # [U] ascending
    missing = [e for e in needed if e not in by_id]
    if missing:
        raise KeyError(f"no slot given for experts {missing}")
    experts = {e: decode_record(record_view(storage, by_id[e]), layout, shapes, x.dtype, x.device)
               for e in needed}
    return routed_sum(x, ids, weights, experts, beta=beta, beta_lin=beta_lin, acc=acc)


def routed_sum(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
               experts: Mapping[int, ExpertWeights], *, beta: float = SITU_BETA,
               beta_lin: float = SITU_LINEAR_BETA,
               acc: torch.Tensor | None = None) -> torch.Tensor:
    """`expert_mlp` on experts already decoded: {expert id: ExpertWeights} covering every id >= 0
    of `ids`. Same arguments, order and result otherwise (this is LatentMoE's routed sum).

    Each needed expert runs once over all the tokens that chose it; the products combine in fp32
    in ascending expert id: each y_e -> fp32, times its fp32 weight, index_add_ of distinct tokens
    (= the per-token left-to-right fp32 sum, whatever the batch; FORMAT.md "LatentMoE").
    """
    check_acc(acc, x)
    needed = [e for e in torch.unique(ids).tolist() if e >= 0]  # [U] ascending
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device) if acc is None else acc
    for e in needed:
        w = experts[e]
        tok, k = torch.nonzero(ids == e, as_tuple=True)  # [n] each, tok distinct
        y = glu_mlp(x[tok], w.gate, w.up, w.down, beta, beta_lin)  # [n, R]
        out.index_add_(0, tok, y.float() * weights[tok, k].unsqueeze(-1))
    return out if acc is not None else out.to(x.dtype)


def unsupported(layout) -> str | None:
    """Why this backend cannot run `layout`'s bank mode; None: the reference runs every mode."""
    return None
