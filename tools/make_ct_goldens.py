"""Write tests/golden/ct0171_w3_legacy.safetensors with the REAL compressed-tensors 0.17.1.

ct >= 0.18 packs 3-bit weights in the dense layout and cannot write the legacy one
(FORMAT.md "ct-int"), so the legacy goldens come from the last release that wrote it. For each
case the file holds the inputs (`codes` I8 [rows, cols], `weight_scale` BF16 [rows, G], and for
asymmetric cases `zero_point_codes` I8 [rows, G]; `weight_g_idx` I32 [cols] for the act-order
case), what 0.17.1's `pack_to_int32` made of them (`weight_packed`, `weight_zero_point`,
`weight_shape`), and its own `PackedQuantizationCompressor.decompress` output (`decompressed`
BF16). As a self-check, 0.17.1's full `compress` of that output must give the same words back.

Rerun (about 2 minutes, needs only PyPI; the repository's own .venv is not touched):

    python3 -m venv /tmp/ct0171
    /tmp/ct0171/bin/pip install torch==2.13.0
    /tmp/ct0171/bin/pip install compressed-tensors==0.17.1 psutil
    /tmp/ct0171/bin/python tools/make_ct_goldens.py

(ct 0.17.1 imports psutil without declaring it.) The output is deterministic: a rerun must
leave `git diff` empty.
"""

from __future__ import annotations

import json
from pathlib import Path

import compressed_tensors
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

OUT = Path(__file__).resolve().parents[1] / "tests" / "golden" / "ct0171_w3_legacy.safetensors"

# The one-group worked example of FORMAT.md "ct-int" (scale 0.01 -> BF16 0.010009765625).
EXAMPLE = [
    -2, -4, -3, -1, -4, -4, -4, 1, 1, -1, -2, -1, -3, -3, -2, 1,
    3, 2, -4, 0, 0, 1, 3, 2, -4, -2, -3, -2, 2, -2, -2, 3,
    0, -3, -1, -2, 1, -4, 2, -3, 1, -2, -4, -1, 2, 3, -4, -1,
    -3, -1, 3, -4, 1, 0, 2, -3, 1, 3, 2, 0, 0, 3, 2, -4,
]

# name: (rows, cols, symmetric, act-order g_idx). 3072 and 3584 are K3's widths (legacy rows end
# with 2 and 4 codes); 64 rows make the packed zero point differ between layouts (7 vs 6 words).
CASES = {
    "sym_4x64": (4, 64, True, False),
    "sym_5x3072": (5, 3072, True, False),
    "sym_2x3584": (2, 3584, True, False),
    "asym_16x384": (16, 384, False, False),
    "asym_64x128": (64, 128, False, False),
    "gidx_8x256": (8, 256, True, True),
}


def scheme(symmetric: bool, act_order: bool) -> QuantizationScheme:
    args = QuantizationArgs(num_bits=3, type="int", symmetric=symmetric, strategy="group",
                            group_size=64, actorder="group" if act_order else None)
    return QuantizationScheme(targets=["Linear"], weights=args)


def make_case(gen: torch.Generator, rows: int, cols: int, symmetric: bool, act_order: bool):
    codes = torch.randint(-4, 4, (rows, cols), generator=gen, dtype=torch.int8)
    # Scales spread over several binades so the BF16 products round in interesting places.
    scale = torch.exp2(torch.rand(rows, cols // 64, generator=gen) * -12).to(torch.bfloat16)
    return codes, scale, (
        None if symmetric else torch.randint(-4, 4, scale.shape, generator=gen, dtype=torch.int8)
    ), (
        torch.randperm(cols, generator=gen).to(torch.int32) // 64 if act_order else None
    )


def golden(name: str, codes, scale, zp, g_idx, sch: QuantizationScheme) -> dict[str, torch.Tensor]:
    rows, cols = codes.shape
    packed = {
        "weight_packed": pack_to_int32(codes, 3),
        "weight_scale": scale,
        "weight_shape": torch.tensor([rows, cols], dtype=torch.int64),
    }
    if zp is not None:
        packed["weight_zero_point"] = pack_to_int32(zp, 3, packed_dim=0)
    if g_idx is not None:
        packed["weight_g_idx"] = g_idx
    weight = PackedQuantizationCompressor.decompress(packed, sch)["weight"]
    assert weight.dtype == torch.bfloat16 and weight.shape == codes.shape
    # The full compress path of 0.17.1 must turn that weight back into the same words.
    again = {"weight": weight, "weight_scale": scale}
    if zp is not None:
        again["weight_zero_point"] = zp
    if g_idx is not None:
        again["weight_g_idx"] = g_idx
    back = PackedQuantizationCompressor.compress(again, sch)
    for key in ("weight_packed", "weight_zero_point"):
        if key in packed:
            assert torch.equal(back[key], packed[key]), f"{name}: compress gave other {key}"
    out = {f"{name}.{k}": v.contiguous() for k, v in packed.items()}
    out[f"{name}.codes"] = codes
    out[f"{name}.decompressed"] = weight.contiguous()
    if zp is not None:
        out[f"{name}.zero_point_codes"] = zp
    return out


ST_DTYPES = {torch.int8: "I8", torch.int32: "I32", torch.int64: "I64", torch.bfloat16: "BF16"}


def save(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """A safetensors file with a sorted header: the Rust writer orders `__metadata__` at random,
    which would make every rerun a diff."""
    header: dict[str, object] = {"__metadata__": metadata}
    blobs, off = [], 0
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()  # little-endian host
        header[name] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    head = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    head += b" " * (-len(head) % 8)  # 8-aligned data section, as the library writes it
    path.write_bytes(len(head).to_bytes(8, "little") + head + b"".join(blobs))


def main() -> None:
    assert compressed_tensors.__version__ == "0.17.1", compressed_tensors.__version__
    gen = torch.Generator().manual_seed(20260917)
    tensors: dict[str, torch.Tensor] = {}
    example = torch.tensor([EXAMPLE], dtype=torch.int8)
    tensors |= golden("example_1x64", example, torch.full((1, 1), 0.01).to(torch.bfloat16),
                      None, None, scheme(True, False))
    for name, (rows, cols, symmetric, act_order) in CASES.items():
        codes, scale, zp, g_idx = make_case(gen, rows, cols, symmetric, act_order)
        tensors |= golden(name, codes, scale, zp, g_idx, scheme(symmetric, act_order))
    meta = {
        "compressed_tensors": compressed_tensors.__version__,
        "torch": torch.__version__,
        "layout": "legacy",
        "generator": "tools/make_ct_goldens.py",
        "cases": json.dumps({"example_1x64": [1, 64, True, False], **CASES}),
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    save(OUT, tensors, meta)
    print(f"wrote {OUT} ({OUT.stat().st_size:,} bytes, {len(tensors)} tensors)")


if __name__ == "__main__":
    main()
