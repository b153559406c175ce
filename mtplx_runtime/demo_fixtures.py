"""`mtplx demo --codecs`: one tiny K3 fixture per expert codec and what each holds.

Each fixture is built deterministically on first run into the cache directory and read back
through the checkpoint reader; the table shows bytes per expert (tiny and at full K3 geometry)
and proves every routed expert decodes exactly to the weights it was drawn from.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

# (label, make_tiny codec, extra make_tiny arguments, layout description)
VARIANTS = [
    ("t158", "t158", {}, "t158 normal: 6 stacked tensors/layer"),
    ("mxfp4", "mxfp4", {}, "official MXFP4 (ct mxfp4-pack-quantized)"),
    ("w3-legacy", "w3", {"w3_layout": "legacy"}, "W3A16 g64, 10 codes/int32 (ct 0.17)"),
    ("w3-dense", "w3", {"w3_layout": "dense"}, "W3A16 g64, 32 codes/3 words (ct>=0.18)"),
    ("bf16", "bf16", {}, "unquantized BF16 experts"),
]

# Full-size K3 routed-expert shapes (k3-model.md §3.6), to show what each codec costs at scale.
K3_SHAPES = {"gate": (3072, 3584), "up": (3072, 3584), "down": (3584, 3072)}


def fixture(root: Path, label: str, codec: str, extra: dict, seed: int, rebuild: bool):
    """(TinyInfo, built?) of the fixture `label`, built under `root` unless already there."""
    from .fixtures.tiny import TinyInfo, make_tiny

    out = root / f"tiny-{label}-seed{seed}"
    if rebuild or not (out / "fixture.json").exists():
        shutil.rmtree(out, ignore_errors=True)
        return make_tiny(out, codec, seed=seed, **extra), True
    return TinyInfo.load(out), False


def check_experts(info, ckpt) -> tuple[int, int, float]:
    """Decode every routed expert through the reader; (exact, total, worst |diff|)."""
    exact = total = 0
    worst = 0.0
    for layer in ckpt.config.moe_layers:
        for e in range(ckpt.config.num_experts):
            got, want = ckpt.expert(layer, e).decode(), info.expert_weights(layer, e)
            diff = max(float(np.max(np.abs(got[p] - want[p]))) for p in want)
            worst = max(worst, diff)
            exact += diff == 0.0
            total += 1
    return exact, total, worst


def codec_table(root: Path, seed: int, rebuild: bool, out) -> bool:
    """Print one row per codec to `out`; True when every expert decoded exactly."""
    from .checkpoint import open_checkpoint

    rows = []
    for label, codec, extra, layout in VARIANTS:
        info, built = fixture(root, label, codec, extra, seed, rebuild)
        ckpt = open_checkpoint(info.path)
        shapes = ckpt.config.expert_shapes
        tiny_bytes = sum(ckpt.codec.projection_bytes(s) for s in shapes.values())
        weights = sum(r * c for r, c in shapes.values())
        k3_bytes = sum(ckpt.codec.projection_bytes(s) for s in K3_SHAPES.values())
        exact, total, worst = check_experts(info, ckpt)
        check = (f"exact {exact}/{total}" if exact == total
                 else f"FAIL {exact}/{total} max|d|={worst:g}")
        rows.append((label, layout, f"{tiny_bytes:,}", f"{8 * tiny_bytes / weights:.3f}",
                     f"{k3_bytes:,}", check, "built" if built else "cached"))
    widths = (10, 42, 9, 7, 12, 14, 6)
    head = ("codec", "on-disk layout", "B/expert", "bits/w", "K3 B/expert", "decode check",
            "fixture")
    for r in (head, *rows):
        print("  ".join(str(v).ljust(w) if i < 2 or i > 4 else str(v).rjust(w)
                        for i, (v, w) in enumerate(zip(r, widths))).rstrip(), file=out)
    print("B/expert: bytes of one routed expert (gate+up+down) in the tiny model; K3 B/expert: "
          "the same codec\nat full K3 geometry (3584 -> 3072 -> 3584). decode check: every "
          "expert read back through the\ncheckpoint reader equals the weights it was drawn "
          "from.", file=out)
    return all(r[5].startswith("exact") for r in rows)
