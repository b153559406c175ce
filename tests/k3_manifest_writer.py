"""An independent writer of the published Kimi K3 t158 streaming manifest, straight from
FORMAT.md "Bank parts" and "Manifest file": plain dicts and `json`, none of mtplx_runtime's code, so
the loader is checked against the spec rather than against itself."""

from __future__ import annotations

import hashlib
import json

RECORD_BYTES = 7_741_440
PART_BYTES = 896 * RECORD_BYTES  # 6,936,330,240
SEGMENTS = [  # K3 t158 record: component, dtype, shape, length
    ("gate_proj.packed", "U8", [3072, 728], 2_236_416),
    ("gate_proj.scales", "U16", [3072, 56], 344_064),
    ("up_proj.packed", "U8", [3072, 728], 2_236_416),
    ("up_proj.scales", "U16", [3072, 56], 344_064),
    ("down_proj.packed", "U8", [3584, 624], 2_236_416),
    ("down_proj.scales", "U16", [3584, 48], 344_064),
]
RESIDENT_BYTES = 113_509_540_864
EMPTY = hashlib.sha256(b"").hexdigest()


def fake_hex(*key: object) -> str:
    return hashlib.sha256(repr(key).encode()).hexdigest()


def k3_manifest_dict(layers: int = 92) -> dict:
    """The K3 manifest for routed layers 1..`layers` (92 = the published one), without digest."""
    half = RESIDENT_BYTES // 2  # two BF16 language_model tensors in two resident shards
    residents, shards = [], []
    for i, name in enumerate(["language_model.lm_head.weight",
                              "language_model.model.embed_tokens.weight"]):
        shard = f"resident-{i + 1:05d}-of-00096.safetensors"
        header = 8 + 128
        residents.append({"tensor": name, "shard": shard, "offset": header, "length": half,
                          "dtype": "BF16", "shape": [half // 2]})
        shards.append({"name": shard, "size": header + half, "header_bytes": header,
                       "header_sha256": fake_hex("h", i), "sha256": fake_hex("f", i)})
    shards.append({"name": "resident-00096-of-00096.safetensors", "size": 4096 + 8 + 120,
                   "header_bytes": 128, "header_sha256": fake_hex("h", 96),
                   "sha256": fake_hex("f", 96), "kind": "preserved-safetensors"})
    parts, records = [], []
    for layer in range(1, layers + 1):
        part = f"experts-t158-layer-{layer:03d}-of-092.bin"
        digest = fake_hex("part", layer)
        parts.append({"file": part, "size": PART_BYTES, "sha256": digest})
        shards.append({"name": part, "size": PART_BYTES, "header_bytes": 0,
                       "header_sha256": EMPTY, "sha256": digest, "kind": "sidecar"})
        for e in range(896):
            off, segs = e * RECORD_BYTES, []
            for comp, dtype, shape, length in SEGMENTS:
                segs.append({"component": comp,
                             "tensor": f"model.layers.{layer}.mlp.switch_mlp.experts.{e}.{comp}",
                             "shard": part, "offset": off, "length": length, "dtype": dtype,
                             "shape": shape})
                off += length
            rec = {"layer": layer, "expert": e, "logical_bytes": RECORD_BYTES, "segments": segs,
                   "sha256": fake_hex(layer, e), "sidecar_offset": e * RECORD_BYTES,
                   "sidecar_length": RECORD_BYTES}
            if layer - 1:  # part omitted when 0
                rec["part"] = layer - 1
            records.append(rec)
    routed = len(records) * RECORD_BYTES
    return {
        "format": "mtplx-expert-manifest-v1",
        "model_key": "kimi-k3-q1t",
        "source_repo": "GrEarl/Kimi-K3-GGUF",
        "source_revision": "0169245d3ea1473a3f9f03bca821d855df5fb2a3",
        "quantization": {"bits": 2, "group_size": 64, "mode": "t158"},
        "artifact": {"tensor_bytes": RESIDENT_BYTES + routed,
                     "resident_tensor_bytes": RESIDENT_BYTES, "routed_expert_bytes": routed,
                     "shard_count": len(shards), "record_count": len(records)},
        "shards": shards,
        "resident_tensors": residents,
        "records": records,
        "sidecar": {"alignment": 4096, "parts": parts},
    }


def canonical(d: dict) -> bytes:
    """Canonical JSON of the manifest digest."""
    return json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def serialize(d: dict) -> tuple[bytes, str]:
    """(file bytes, digest): canonical JSON with manifest_sha256, then one newline."""
    body = canonical(d)
    digest = hashlib.sha256(body).hexdigest()
    # Sorted keys put manifest_sha256 between "format" and "model_key" at the top level.
    k = body.index(b'"model_key":')
    return body[:k] + b'"manifest_sha256":"%s",' % digest.encode() + body[k:] + b"\n", digest
