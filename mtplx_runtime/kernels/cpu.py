"""`cpu` backend: `expert_mlp` on packed record bytes with the native C kernels (same API as
`reference`).

Shape legend: T tokens, K experts per token, R latent width (3584), I expert width (3072).

Native modes: t158, mxfp4, ct-int and ct-int-asym (3 or 4 bits, the dense layout banks hold),
through `cpu_native.expert`. Each needed expert runs once over all the tokens that chose it (one
multi-token call: its weights are read from memory once per layer, which is what prefill needs;
decode is the n = 1 case). The kernel mirrors the model dtype: in a bf16 model gate·x, up·x, the
SiTU-GLU output and down·h are rounded to bf16 as the reference's bf16 GEMMs round them; in an
fp32 model nothing is rounded. The products are combined exactly as the reference does (fp32,
times the routing weight, index_add_ in ascending expert id).

bf16 banks (and a model dtype other than float32/bfloat16) go through `reference.expert_mlp`:
a bf16 weight needs no decode, so there is no packed format for a CPU kernel to work on.
Against `reference` the results differ only by fp32 summation order inside each dot product
(and, in a bf16 model, by the rare bf16 rounding that order flips).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..model.layers import SITU_BETA, SITU_LINEAR_BETA
from . import cpu_native, reference

DEVICE = "cpu"  # inputs and slot bytes in host memory
NATIVE_MODES = frozenset({"t158", "mxfp4", "ct-int", "ct-int-asym"})
_MODEL_DTYPES = (torch.float32, torch.bfloat16)


def unavailable_reason() -> str | None:
    ok, why = cpu_native.available()
    return None if ok else why


def expert_mlp(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, slots, storage,
               layout, shapes: Mapping, *, beta: float = SITU_BETA,
               beta_lin: float = SITU_LINEAR_BETA,
               acc: torch.Tensor | None = None) -> torch.Tensor:
    """See `reference.expert_mlp` (same arguments, `acc` included, and result). Blocks; x must
    be on the CPU."""
    if layout.mode not in NATIVE_MODES or x.dtype not in _MODEL_DTYPES:
        return reference.expert_mlp(x, ids, weights, slots, storage, layout, shapes,
                                    beta=beta, beta_lin=beta_lin, acc=acc)
    if x.dim() != 2 or ids.shape != weights.shape or ids.shape[0] != x.shape[0]:
        raise ValueError(f"x {list(x.shape)}, ids {list(ids.shape)}, weights "
                         f"{list(weights.shape)}: want [T, R], [T, K], [T, K]")
    if x.device.type != "cpu":
        raise ValueError(f"the cpu backend needs x on the CPU, got {x.device}")
    reference.check_acc(acc, x)
    by_id = reference.expert_slots(ids, slots)
    needed = [e for e in torch.unique(ids).tolist() if e >= 0]  # ascending; -1: empty pick
    missing = [e for e in needed if e not in by_id]
    if missing:
        raise KeyError(f"no slot given for experts {missing}")
    xs = x.float().contiguous().numpy()  # [T, R] fp32 (exact for bf16 x): the kernels' input
    out = torch.zeros(x.shape, dtype=torch.float32) if acc is None else acc  # [T, R]
    # The combine runs in NumPy on out's memory: the same fp32 multiply and add per element as
    # the reference's index_add_, without waking torch's intra-op thread pool for a [n, R] add
    # between two native calls (measured: tens of ms per expert on a loaded 2-core host).
    out_np = out.numpy() if out.is_contiguous() else None
    wts = weights.float().numpy() if out_np is not None else None
    for e in needed:
        m = cpu_native.record_matrices(layout, reference.record_view(storage, by_id[e]))
        if (m["gate"].rows, m["gate"].cols) != tuple(shapes["gate"]):
            raise ValueError(f"record shapes {m['gate'].rows}x{m['gate'].cols} do not match "
                             f"shapes {shapes['gate']}")
        tok, k = torch.nonzero(ids == e, as_tuple=True)  # [n] each, tok distinct
        y = cpu_native.expert(m["gate"], m["up"], m["down"], xs[tok.numpy()],
                              beta, beta_lin, round_model=x.dtype == torch.bfloat16)  # [n, R]
        if out_np is not None:  # tok distinct: out[tok] += is one add per element
            tk, kk = tok.numpy(), k.numpy()
            out_np[tk] += y * wts[tk, kk][:, None]
        else:
            out.index_add_(0, tok, torch.from_numpy(y) * weights[tok, k].unsqueeze(-1))
    return out if acc is not None else out.to(x.dtype)
