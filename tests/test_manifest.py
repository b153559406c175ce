"""Manifest v1 (FORMAT.md "Manifest file", "Manifest rules"): the published K3 manifest at full size
from an independent writer, round trips, and a hostile set rejected with clear messages."""

from __future__ import annotations

import copy
import gc
import json
import os

import pytest
from k3_manifest_writer import k3_manifest_dict, serialize

from mtplx_runtime.artifact.descriptor import (
    K3_T158_DESCRIPTOR,
    K3_T158_RECORD_BYTES,
    validate_descriptor,
)
from mtplx_runtime.artifact.manifest import (
    MAX_MANIFEST_BYTES,
    Manifest,
    ManifestError,
    load_manifest,
    parse_manifest_bytes,
    write_manifest,
)
from mtplx_runtime.formats.record import padded_layout, record_components

K3_SHAPES = {"gate": (3072, 3584), "up": (3072, 3584), "down": (3584, 3072)}


def test_full_size_k3_manifest_is_accepted():
    was = gc.isenabled()
    gc.disable()  # the independent writer builds ~600k acyclic dicts
    try:
        raw, digest = serialize(k3_manifest_dict())
    finally:
        if was:
            gc.enable()
    assert len(raw) < MAX_MANIFEST_BYTES
    m = parse_manifest_bytes(raw)
    assert m.manifest_sha256 == digest
    assert len(m.records) == 82_432 and len(m.sidecar.parts) == 92
    validate_descriptor(m, K3_T158_DESCRIPTOR)


def test_k3_descriptor_matches_spec_table():
    k3 = K3_T158_DESCRIPTOR
    assert sum(c[3] for c in padded_layout(list(k3.components))) == K3_T158_RECORD_BYTES
    assert len(k3.layers) * k3.experts * K3_T158_RECORD_BYTES == 638_142_382_080
    comps = [(c, d, tuple(s), n) for c, d, s, n in record_components("t158", K3_SHAPES)]
    assert tuple(comps) == K3_T158_DESCRIPTOR.components
    assert padded_layout(comps) == comps  # K3 needs no padding


def small() -> dict:
    return k3_manifest_dict(layers=2)


def test_round_trip_and_digest_match_independent_writer(tmp_path):
    d = small()
    raw, digest = serialize(d)
    m = Manifest.from_dict(copy.deepcopy(d))
    assert m.to_dict() == d
    assert m.compute_sha256() == digest
    path = tmp_path / "expert-manifest.json"
    assert write_manifest(m, path) == digest
    assert path.read_bytes() == raw
    assert load_manifest(path).manifest_sha256 == digest
    with pytest.raises(ManifestError, match="records 2 layers x 896|92 layers"):
        validate_descriptor(load_manifest(path), K3_T158_DESCRIPTOR)


def test_explicit_defaults_are_dropped_before_hashing():
    d = small()
    _, digest = serialize(d)
    d["records"][0]["part"] = 0
    d["shards"][0]["kind"] = "safetensors"
    raw = json.dumps({**d, "manifest_sha256": digest}, indent=2).encode()  # non-canonical layout
    assert parse_manifest_bytes(raw).manifest_sha256 == digest


def reject(d: dict, match: str, *, digest: bool = True) -> None:
    raw = serialize(d)[0] if digest else json.dumps(d).encode()
    with pytest.raises(ManifestError, match=match):
        parse_manifest_bytes(raw)


def seg(d, r=0, s=0):
    return d["records"][r]["segments"][s]


@pytest.mark.parametrize("name, match", [
    ("../etc/passwd", "not normalized"),
    ("/abs/part.bin", "absolute path"),
    ("a\\b.bin", "backslash"),
    ("./part.bin", "not normalized"),
    ("a//b.bin", "not normalized"),
])
def test_bad_file_names(name, match):
    d = small()
    d["shards"][3]["name"] = name
    reject(d, match)
    d = small()
    seg(d)["shard"] = name
    reject(d, match)


def test_hostile_structures():
    cases = []
    d = small(); d["records"][1]["sidecar_offset"] = 0; cases.append((d, "overlaps"))  # noqa: E702
    d = small(); d["records"][1]["sidecar_offset"] = 4097; cases.append((d, "not a multiple"))  # noqa: E702,E501
    d = small(); d["records"][895]["sidecar_offset"] = 896 * K3_T158_RECORD_BYTES  # noqa: E702
    cases.append((d, "straddle"))
    d = small(); d["records"][0]["bogus"] = 1; cases.append((d, r"unknown key\(s\) \['bogus'\]"))  # noqa: E702,E501
    d = small(); d["extra"] = 1; cases.append((d, "unknown key"))  # noqa: E702
    d = small(); d["records"][0]["layer"] = True; cases.append((d, "got a boolean"))  # noqa: E702
    d = small(); seg(d)["length"] = 1.0 * seg(d)["length"]; cases.append((d, "JSON integer"))  # noqa: E702,E501
    d = small(); seg(d)["shape"] = [3072, 727]; cases.append((d, r"!= U8 x \[3072, 727\]"))  # noqa: E702,E501
    d = small(); d["records"][0], d["records"][1] = d["records"][1], d["records"][0]  # noqa: E702
    cases.append((d, "not sorted"))
    d = small(); d["records"][1] = copy.deepcopy(d["records"][0]); cases.append((d, "duplicate"))  # noqa: E702,E501
    d = small(); d["artifact"]["record_count"] += 1; cases.append((d, "record_count"))  # noqa: E702
    d = small(); d["artifact"]["shard_count"] -= 1; cases.append((d, "shard_count"))  # noqa: E702
    d = small(); d["format"] = "mtplx-expert-manifest-v2"; cases.append((d, "format"))  # noqa: E702
    d = small(); seg(d, 0, 1)["component"] = "gate_proj.packed"; cases.append((d, "components"))  # noqa: E702,E501
    d = small(); d["quantization"]["bits"] = 4; cases.append((d, "invalid for mode"))  # noqa: E702
    d = small(); d["shards"][2]["kind"] = "safetensors"; cases.append((d, "authoritative|not referenced"))  # noqa: E702,E501
    for d, match in cases:
        reject(d, match)


def test_duplicate_keys_and_digest_rules():
    d = small()
    raw, digest = serialize(d)
    dup = raw.replace(b'"layer":1,', b'"layer":1,"layer":1,', 1)
    with pytest.raises(ManifestError, match="duplicate key 'layer'"):
        parse_manifest_bytes(dup)
    wrong = raw.replace(digest.encode(), b"0" * 64)
    with pytest.raises(ManifestError, match="manifest_sha256 mismatch"):
        parse_manifest_bytes(wrong)
    with pytest.raises(ManifestError, match="manifest_sha256 is missing"):
        parse_manifest_bytes(json.dumps(d).encode())
    assert parse_manifest_bytes(json.dumps(d).encode(), require_digest=False)
    tampered = raw.replace(b'"expert":5,', b'"expert":5 ,', 1)  # layout change only: still ok
    assert parse_manifest_bytes(tampered).manifest_sha256 == digest


def test_file_rules(tmp_path):
    raw, _ = serialize(small())
    real = tmp_path / "real.json"
    real.write_bytes(raw)
    link = tmp_path / "expert-manifest.json"
    os.symlink(real, link)
    with pytest.raises(ManifestError, match="symlink"):
        load_manifest(link)
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(MAX_MANIFEST_BYTES + 1)  # sparse
    with pytest.raises(ManifestError, match="size cap"):
        load_manifest(big)
    with pytest.raises(ManifestError, match="not a regular file"):
        load_manifest(tmp_path)
    with pytest.raises(ManifestError, match="not valid JSON"):
        parse_manifest_bytes(raw[:-1000])


def test_lone_surrogate_and_null_digest_are_manifest_errors():
    raw, _ = serialize(small())
    bad = raw.replace(b'"model_key":"', b'"model_key":"\\ud800', 1)
    with pytest.raises(ManifestError, match="not encodable as UTF-8"):
        parse_manifest_bytes(bad)
    d = {**small(), "manifest_sha256": None}
    with pytest.raises(ManifestError, match="manifest_sha256 must be 64 lowercase hex"):
        parse_manifest_bytes(json.dumps(d).encode(), require_digest=False)
