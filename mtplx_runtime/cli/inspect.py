"""`mtplx inspect DIR`: what a K3 checkpoint holds, read from headers only (no weights loaded).

Prints the architecture, the routed-expert layout and codec, bytes per expert at this
checkpoint's geometry, and how the bytes split between resident tensors and routed experts.
`--decode E` additionally decodes E experts (spread over the MoE layers) as a smoke check.
"""

from __future__ import annotations

import argparse

import numpy as np

from .model_dir import add_model_dir


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_dir(p, "checkpoint directory (config.json + safetensors shards)")
    p.add_argument("--decode", type=int, default=0, metavar="E",
                   help="decode E experts spread over the MoE layers and report their statistics")


def _gb(n: int) -> str:
    return f"{n / 1e9:,.2f} GB" if n >= 1e8 else f"{n:,} B"


def describe(ckpt) -> list[tuple[str, str]]:
    from ..checkpoint.residents import stored_specs

    cfg = ckpt.config
    n = cfg.num_hidden_layers
    kda = sum(cfg.is_kda_layer(i) for i in range(n))
    moe = cfg.moe_layers
    g = cfg.expert_shapes["gate"]
    expert_bytes = sum(ckpt.codec.projection_bytes(s) for s in cfg.expert_shapes.values())
    weights = sum(r * c for r, c in cfg.expert_shapes.values())
    # An artifact built with --resident-dtype stores codes and scales in place of the matrices.
    residents = [m for m in stored_specs(cfg, ckpt.resident_dtype) if ckpt.has_tensor(m)]
    quantized = "" if ckpt.resident_dtype == "bf16" else f" ({ckpt.resident_dtype} matrices)"
    resident_bytes = sum(ckpt.tensor_info(m).nbytes for m in residents)
    routed = expert_bytes * len(moe) * cfg.num_experts
    return [
        ("checkpoint", str(ckpt.path)),
        ("layers", f"{n} ({kda} KDA, {n - kda} MLA); MoE layers {moe[0]}..{moe[-1]} ({len(moe)})"),
        ("hidden", f"{cfg.hidden_size}, vocab {cfg.vocab_size}"),
        ("experts", f"{cfg.num_experts} routed per MoE layer, top-{cfg.num_experts_per_token}, "
                    f"{g[1]} -> {g[0]} -> {g[1]}, {cfg.num_shared_experts} shared"),
        ("layout", layout_text(ckpt.layout, ckpt.codec)),
        ("bytes/expert", f"{expert_bytes:,} ({8 * expert_bytes / weights:.3f} bits/weight)"),
        ("routed", f"{_gb(routed)} in {len(moe) * cfg.num_experts:,} experts"),
        ("resident", f"{_gb(resident_bytes)} in {len(residents):,} tensors{quantized}"),
    ]


def layout_text(layout: str, codec) -> str:
    """The expert layout in words that match the rest of the tools: a compressed-tensors int
    checkpoint (reader layout "w3": `make-tiny --codec w3`, or a W4 from recode-w4) names its
    bit width and the bank mode build-manifest keeps it as (FORMAT.md "Bank parts")."""
    bits = getattr(codec, "num_bits", None)
    if bits is None:
        return f"{layout}: {codec!r}"
    sym = codec.symmetric
    return (f"compressed-tensors int W{bits} ({codec.layout} packing, "
            f"{'symmetric' if sym else 'asymmetric'}, group {codec.group_size}); "
            f"build-manifest keeps it as bank mode ct-int{'' if sym else '-asym'} bits {bits}")


def main(args: argparse.Namespace) -> int:
    from ..artifact.open import open_source

    with open_source(args.model) as ckpt:
        for key, value in describe(ckpt):
            print(f"{key:<13} {value}")
        cfg = ckpt.config
        picks = np.linspace(0, len(cfg.moe_layers) * cfg.num_experts - 1, args.decode).astype(int)
        for k in picks if args.decode > 0 else []:
            layer, e = cfg.moe_layers[k // cfg.num_experts], int(k % cfg.num_experts)
            for proj, w in ckpt.expert(layer, e).decode().items():
                print(f"expert {layer:>3}/{e:<4} {proj:<5} {list(w.shape)} mean {w.mean():+.4g} "
                      f"std {w.std():.4g} finite {bool(np.isfinite(w).all())}")
    return 0
