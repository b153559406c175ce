"""open_checkpoint / load_model on streaming artifacts built by `mtplx build-manifest`: experts and
logits identical to the source, unfinished or tampered artifacts refused, one read per record."""

import json
import os
import shutil

import numpy as np
import pytest
import torch

from mtplx_runtime import load_model
from mtplx_runtime.artifact.build import build_artifact
from mtplx_runtime.artifact.manifest import load_manifest, write_manifest
from mtplx_runtime.artifact.open import BankExpertLayout, RecordHashError, open_source
from mtplx_runtime.checkpoint import CheckpointError
from mtplx_runtime.fixtures.tiny import make_tiny

VARIANTS = {
    "t158": ("t158", {}),
    "mxfp4": ("mxfp4", {}),
    "w3-legacy": ("w3", {"w3_layout": "legacy"}),
    "w3-dense": ("w3", {"w3_layout": "dense"}),
    "w3-legacy-asym": ("w3", {"w3_layout": "legacy", "w3_symmetric": False}),
    "w3-dense-asym": ("w3", {"w3_layout": "dense", "w3_symmetric": False}),
    "bf16": ("bf16", {}),
}
MODES = {"t158": "t158", "mxfp4": "mxfp4", "w3-legacy": "ct-int", "w3-dense": "ct-int",
         "w3-legacy-asym": "ct-int-asym", "w3-dense-asym": "ct-int-asym", "bf16": "bf16"}
TOKENS = [3, 40, 77, 114, 151, 188, 225, 262]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """name -> (source dir, artifact dir)."""
    root = tmp_path_factory.mktemp("art")
    out = {}
    for name, (codec, kw) in VARIANTS.items():
        src = make_tiny(root / f"{name}-src", codec, seed=0, **kw).path
        build_artifact(src, root / f"{name}-art", codec="keep", progress=False)
        out[name] = (src, root / f"{name}-art")
    return out


def _copy(art, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(art, dst)
    return dst


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_experts_equal_source(built, name):
    src, art = built[name]
    with open_source(src) as s, open_source(art) as a:
        assert a.layout == f"bank-{MODES[name]}"
        assert isinstance(a.expert_layout, BankExpertLayout)
        assert not isinstance(s.expert_layout, BankExpertLayout)
        assert a.config == s.config
        for layer in a.config.moe_layers:
            for e in range(a.config.num_experts):
                got, want = a.expert(layer, e).decode(), s.expert(layer, e).decode()
                assert set(got) == {"gate", "up", "down"}
                for p in want:
                    assert got[p].dtype == np.float32
                    assert np.array_equal(got[p], want[p]), (layer, e, p)
        # Residents are the same bytes.
        for t in a.expert_layout.manifest.resident_tensors:
            assert np.array_equal(a.tensor(t.tensor), s.tensor(t.tensor))


@pytest.mark.parametrize("name", ["t158", "mxfp4", "w3-legacy-asym", "bf16"])
def test_logits_bit_identical(built, name):
    src, art = built[name]
    want = load_model(src, dtype="float32").logits(TOKENS)
    got = load_model(art, dtype="float32").logits(TOKENS)
    assert got.dtype == torch.float32
    assert torch.equal(got, want)


def test_t158_recode_of_mxfp4_loads_and_runs(built, tmp_path):
    src, _ = built["mxfp4"]
    art = tmp_path / "t158-art"
    build_artifact(src, art, codec="t158", progress=False)
    with open_source(art) as a:
        assert a.layout == "bank-t158" and a.codec.name == "t158"
        rec = a.expert(a.config.moe_layers[0], 0).decode()
        assert all(np.isfinite(v).all() for v in rec.values())
    logits = load_model(art, dtype="float32").logits(TOKENS)
    assert logits.shape[0] == len(TOKENS) and torch.isfinite(logits).all()


def test_record_location(built):
    _, art = built["t158"]
    with open_source(art) as a:
        layer = a.config.moe_layers[1]
        part, offset, length, digest = a.expert_layout.locate(layer, 3)
        m = a.expert_layout.manifest
        rec = next(r for r in m.records if (r.layer, r.expert) == (layer, 3))
        assert (art / m.sidecar.parts[part].file).is_file()
        assert length == rec.logical_bytes and digest == rec.sha256
        assert offset % 4096 == 0 and offset == rec.segments[0].offset
        assert m.sidecar.parts[part].file == rec.segments[0].shard
        with pytest.raises(KeyError):
            a.expert_layout.locate(0, 3)  # layer 0 is dense: no record


def test_one_pread_per_record(built, monkeypatch):
    _, art = built["w3-legacy-asym"]  # has pad segments
    calls = []
    real = os.pread

    def spy(fd, n, offset):
        calls.append((n, offset))
        return real(fd, n, offset)

    with open_source(art) as a:
        assert any(s.component == "pad" for s in a.expert_layout.manifest.records[0].segments)
        monkeypatch.setattr(os, "pread", spy)
        layer = a.config.moe_layers[0]
        a.expert(layer, 5)
        _, offset, length, _ = a.expert_layout.locate(layer, 5)
        assert calls == [(length, offset)]


def test_unfinished_artifact_refused(built, tmp_path):
    art = _copy(built["t158"][1], tmp_path)
    (art / "expert-manifest.json").unlink()
    with pytest.raises(CheckpointError, match="unfinished streaming artifact.*expert-manifest"):
        open_source(art)
    with pytest.raises(CheckpointError, match="unfinished"):
        load_model(art)


def test_only_partial_refused(built, tmp_path):
    src = _copy(built["t158"][0], tmp_path)  # a plain checkpoint ...
    (src / "experts-t158-layer-001-of-005.bin.partial").write_bytes(b"")  # ... mid-build
    with pytest.raises(CheckpointError, match="unfinished.*layer-001-of-005.bin.partial"):
        open_source(src)


def test_flipped_byte_detected_only_when_verifying(built, tmp_path):
    art = _copy(built["bf16"][1], tmp_path)
    with open_source(art) as a:
        layer = a.config.moe_layers[2]
        index, offset, length, _ = a.expert_layout.locate(layer, 4)
        part = art / a.expert_layout.manifest.sidecar.parts[index].file
        clean = a.expert(layer, 4).decode()
    with open(part, "r+b") as f:
        f.seek(offset + 10)
        b = f.read(1)
        f.seek(offset + 10)
        f.write(bytes([b[0] ^ 0x40]))
    with open_source(art) as a:  # no verification: the flipped value shows
        got = a.expert(layer, 4).decode()
        assert not all(np.array_equal(got[p], clean[p]) for p in clean)
        a.expert(layer, 3)  # other records fine
    with open_source(art, verify_sha256=True) as a:
        a.expert(layer, 3)
        with pytest.raises(RecordHashError, match=f"layer {layer}, expert 4"):
            a.expert(layer, 4)


def test_tampered_manifest_refused(built, tmp_path):
    art = _copy(built["mxfp4"][1], tmp_path)
    path = art / "expert-manifest.json"
    d = json.loads(path.read_text())
    d["records"][0]["sha256"] = "0" * 64  # digest no longer matches
    path.write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match="manifest_sha256"):
        open_source(art)


def test_missing_or_short_part_refused(built, tmp_path):
    art = _copy(built["t158"][1], tmp_path)
    part = sorted(art.glob("experts-*-layer-002-*.bin"))[0]
    os.truncate(part, part.stat().st_size - 4096)
    with pytest.raises(CheckpointError, match="bank part is .* bytes; the manifest says"):
        open_source(art)
    part.unlink()
    with pytest.raises(CheckpointError, match="layer-002.*: file not found"):
        open_source(art)


def test_resident_mismatch_refused(built, tmp_path):
    art = _copy(built["t158"][1], tmp_path)
    m = load_manifest(art / "expert-manifest.json")
    t = m.resident_tensors[0]
    m.resident_tensors[0] = type(t)(t.tensor, t.shard, t.offset + 2, t.length, t.dtype,
                                    t.shape)
    write_manifest(m, art / "expert-manifest.json")
    with pytest.raises(CheckpointError, match=f"tensor {t.tensor!r} is .* says"):
        open_source(art)


def test_layer_subset_artifact(built, tmp_path):
    src, _ = built["t158"]
    art = tmp_path / "sub"
    build_artifact(src, art, codec="keep", layers="2", progress=False)
    with open_source(art) as a, open_source(src) as s:
        assert np.array_equal(a.expert(2, 1).decode()["down"], s.expert(2, 1).decode()["down"])
        with pytest.raises(CheckpointError, match="no record for layer 1"):
            a.expert(1, 0)
