"""`cpu` backend: `expert_mlp` on packed record bytes with the native C kernels (same API as
`reference`).

Shape legend: T tokens, K experts per token, R latent width (3584), I expert width (3072).

Native modes (the codec table's cpu column): t158, mxfp4, ct-int and ct-int-asym (3 or 4 bits, the
dense layout banks hold), in one `cpu_native.layer` call per window (the per-expert Python loop it
replaces cost 40-60 us an expert). Each needed expert runs once over all the tokens that chose it
(its weights are read from memory once per layer, which is what prefill needs; decode is the n = 1
case). The kernel mirrors the model dtype: in a bf16 model gate·x, up·x, the SiTU-GLU output and
down·h are rounded to bf16 as the reference's bf16 GEMMs round them; in an fp32 model nothing is
rounded. The products are combined exactly as the reference does (fp32, times the routing weight,
added in ascending expert id).

bf16 banks (and a model dtype other than float32/bfloat16) go through `reference.expert_mlp`:
a bf16 weight needs no decode, so there is no packed format for a CPU kernel to work on.
Against `reference` the results differ only by fp32 summation order inside each dot product
(and, in a bf16 model, by the rare bf16 rounding that order flips).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from ..formats.modes import native_modes
from ..formats.record import first_misaligned
from . import cpu_native, reference
from .reference import SITU_BETA, SITU_LINEAR_BETA

DEVICE = "cpu"  # inputs and slot bytes in host memory
NATIVE_MODES = native_modes("cpu")  # the codec table's modes with a native CPU codec
_MODEL_DTYPES = (torch.float32, torch.bfloat16)


def unavailable_reason() -> str | None:
    """None when the native library loads, else why not."""
    return cpu_native.unavailable_reason()


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
    needed, offsets, tok_index, tok_weight = group_picks(ids, weights)
    missing = [e for e in needed if e not in by_id]
    if missing:
        raise KeyError(f"no slot given for experts {missing}")
    out = torch.zeros(x.shape, dtype=torch.float32) if acc is None else acc  # [T, R]
    if needed:
        I, R = cpu_native.record_plan(layout).shape
        if (I, R) != tuple(shapes["gate"]):
            raise ValueError(f"record shapes {I}x{R} do not match shapes {shapes['gate']}")
        # The native call adds into C-contiguous fp32 memory: a strided acc goes through a copy
        # (the same adds, so the same bits).
        dst = out if out.is_contiguous() else out.contiguous()
        records = [reference.record_view(storage, by_id[e]) for e in needed]
        cpu_native.layer(layout, records, offsets, tok_index, tok_weight,
                         x.float().contiguous().numpy(),  # exact for bf16 x: the kernels' input
                         dst.numpy(), beta, beta_lin, round_model=x.dtype == torch.bfloat16)
        if dst is not out:
            out.copy_(dst)
    return out if acc is not None else out.to(x.dtype)


# Up to this many picks (T * K) group_picks sorts Python lists: right after a layer's weights
# have streamed through the caches, a handful of NumPy calls cost ~0.4 ms against ~0.2 ms for
# the lists (benchmarks log, "On a Xeon with AVX-512"); above it NumPy's sort
# wins.
LIST_PICKS = 256


def group_picks(ids: torch.Tensor, weights: torch.Tensor
                ) -> tuple[list[int], np.ndarray, np.ndarray, np.ndarray]:
    """The picks of ids [T, K] (-1: empty) grouped by expert for `cpu_native.layer`: (experts in
    ascending id, int32 offsets [len + 1] from 0, int32 token of each pick, float32 weight of each
    pick), each expert's picks in token order."""
    K = ids.shape[1]
    if ids.numel() <= LIST_PICKS:
        flat, wl = ids.reshape(-1).tolist(), weights.float().reshape(-1).tolist()
        picks = sorted((e, i) for i, e in enumerate(flat) if e >= 0)  # by id, then token
        needed, offsets = [], [0]
        for e, _ in picks:
            if not needed or needed[-1] != e:
                needed.append(e)
                offsets.append(offsets[-1])
            offsets[-1] += 1
        return (needed, np.array(offsets, np.int32),
                np.array([i // K for _, i in picks], np.int32),
                np.array([wl[i] for _, i in picks], np.float32))
    flat = ids.cpu().reshape(-1).numpy()  # [T*K]
    picks = np.flatnonzero(flat >= 0)
    picks = picks[np.argsort(flat[picks], kind="stable")]  # by expert id, then token
    needed, counts = np.unique(flat[picks], return_counts=True)  # ascending
    offsets = np.zeros(len(needed) + 1, np.int32)
    np.cumsum(counts, out=offsets[1:])
    wts = weights.float().cpu().reshape(-1).numpy()
    return needed.tolist(), offsets, (picks // K).astype(np.int32), wts[picks]


def unsupported(layout) -> str | None:
    """Why this backend cannot run `layout`'s records: every mode runs (bf16 banks fall back to
    the reference decode inside `expert_mlp`), but the C code reads each component in place as
    its dtype, so every component must start at a multiple of its element size, and it decodes
    64 columns at a time, so a native mode's projections need a multiple of 64 columns."""
    s = first_misaligned(layout)
    if s is not None:
        return (f"the cpu kernels read {s.component} ({s.dtype}) in place, but it starts at "
                f"record offset {s.offset}, not a multiple of its element size; use the "
                "reference backend (--kernels reference) or rebuild the bank with "
                "`mtplx build-manifest` (which aligns every component)")
    if layout.mode in NATIVE_MODES:
        try:
            cpu_native.record_plan(layout)
        except ValueError as e:
            return (f"the cpu kernels cannot run these {layout.mode} records ({e}); use the "
                    "reference backend (--kernels reference)")
    return None
