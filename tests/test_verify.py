"""`verify_artifact` and `mtplx verify` (FORMAT.md "Verifying and reading") on a tiny artifact built
by hand: random bank bytes laid out per `descriptor_for`, a resident shard, an index, our writer."""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest

from mtplx_runtime.artifact import verify
from mtplx_runtime.artifact.descriptor import descriptor_for, validate_descriptor
from mtplx_runtime.artifact.manifest import (
    EMPTY_SHA256,
    MANIFEST_NAME,
    Manifest,
    Record,
    ResidentTensor,
    Segment,
    Shard,
    Sidecar,
    SidecarPart,
    write_manifest,
)
from mtplx_runtime.artifact.open import BankExpertLayout
from mtplx_runtime.checkpoint.safetensors_io import write_safetensors
from mtplx_runtime.cli import main as cli_main
from mtplx_runtime.fixtures.tiny import tiny_config
from mtplx_runtime.formats.record import padded_layout, tensor_name

RES = "resident-00001-of-00001.safetensors"


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def build(root, mode="t158", bits=None, group=None):
    cfg = tiny_config()
    desc = descriptor_for(cfg, mode, bits, model_key="tiny-test", group_size=group)
    rng = np.random.default_rng(0)
    rb = sum(c[3] for c in padded_layout(list(desc.components)))
    n = len(desc.layers)
    records, parts, shards = [], [], []
    for pi, layer in enumerate(desc.layers):
        name = f"experts-{mode}-layer-{layer:03d}-of-{n:03d}.bin"
        data = rng.integers(0, 256, desc.experts * rb, dtype=np.uint8).tobytes()
        (root / name).write_bytes(data)
        parts.append(SidecarPart(name, len(data), sha(data)))
        for e in range(desc.experts):
            off, segs = e * rb, []
            for comp, dtype, shape, length in padded_layout(list(desc.components)):
                tensor = "" if comp == "pad" else tensor_name(layer, e, *comp.split("_proj."))
                segs.append(Segment(comp, tensor, name, off, length, dtype, tuple(shape)))
                off += length
            records.append(Record(layer, e, rb, segs, sha(data[e * rb:(e + 1) * rb]), e * rb,
                                  rb, pi))
    write_safetensors(root / RES, {"model.norm.weight": ("BF16", np.ones(64, np.uint16)),
                                   "lm_head.weight": ("BF16", np.zeros((4, 64), np.uint16))})
    raw = (root / RES).read_bytes()
    hb = 8 + int.from_bytes(raw[:8], "little")
    residents = [ResidentTensor("lm_head.weight", RES, hb, 512, "BF16", (4, 64)),
                 ResidentTensor("model.norm.weight", RES, hb + 512, 128, "BF16", (64,))]
    shards.append(Shard(RES, len(raw), hb, sha(raw[:hb]), sha(raw)))
    shards += [Shard(p.file, p.size, 0, EMPTY_SHA256, p.sha256, "sidecar") for p in parts]
    (root / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 640},
         "weight_map": {"lm_head.weight": RES, "model.norm.weight": RES}}))
    (root / "config.json").write_text(json.dumps(cfg.to_flat_dict()))
    routed = len(records) * rb
    m = Manifest("mtplx-expert-manifest-v1", "tiny-test", "local", "0", dict(desc.quantization),
                 {"tensor_bytes": 640 + routed, "resident_tensor_bytes": 640,
                  "routed_expert_bytes": routed, "shard_count": len(shards),
                  "record_count": len(records)},
                 shards, residents, records, Sidecar(4096, parts))
    validate_descriptor(m, desc)
    write_manifest(m, root / MANIFEST_NAME)
    return m


def run_cli(root, *flags):
    return cli_main(["verify", str(root), *flags])


@pytest.mark.parametrize("mode, bits, group", [
    ("t158", None, None), ("mxfp4", None, None), ("ct-int", 3, None), ("ct-int-asym", 4, None),
    ("bf16", None, None), ("ct-int", 4, 32), ("fp8-block", None, None)])
def test_clean_artifact_passes(tmp_path, capsys, mode, bits, group):
    m = build(tmp_path, mode, bits, group)
    assert m.quantization["group_size"] == group or group is None
    rep = verify.verify_artifact(tmp_path, records=True, shard_hashes=True)
    assert rep.ok, rep.problems
    assert rep.records_checked == 40
    assert run_cli(tmp_path, "--records", "--shard-hashes") == 0
    out = capsys.readouterr().out
    assert "OK" in out and "were not re-hashed" not in out
    assert run_cli(tmp_path) == 0  # without --records it says what it did not check
    assert "records were not re-hashed" in capsys.readouterr().out
    if group is not None:  # the bank reads back with its group's codec
        bank = BankExpertLayout(tiny_config(), tmp_path, m)
        assert bank.codec.group_size == group
        rows, cols = tiny_config().expert_shapes["gate"]
        rec = bank.read(m.records[0].layer, 0).projections["gate"]
        assert rec.parts["weight_scale"].shape == (rows, cols // group)
        with np.errstate(over="ignore"):  # random scale bits: some products overflow
            assert rec.decode().shape == (rows, cols)


@pytest.mark.parametrize("where", ["first", "last", "middle", "pad"])
def test_flipped_byte_named_by_record(tmp_path, capsys, where):
    m = build(tmp_path)
    r = m.records[13]  # layer 2, expert 5
    pos = {"first": 0, "last": r.logical_bytes - 1, "middle": r.logical_bytes // 3,
           "pad": r.segments[1].length + 1}[where]
    path = tmp_path / r.segments[0].shard
    with open(path, "r+b") as f:
        f.seek(r.sidecar_offset + pos)
        b = f.read(1)
        f.seek(r.sidecar_offset + pos)
        f.write(bytes([b[0] ^ 0x40]))
    assert verify.verify_artifact(tmp_path).ok  # sizes still right: only --records sees it
    assert run_cli(tmp_path, "--records") == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{r.segments[0].shard}: record layer 2 expert 5: sha256 mismatch")
    assert "1 problem(s)" in out[-1]


def test_records_matching_their_sha256_get_record_hash_of_the_bytes_the_reader_reads(tmp_path):
    """`record_hash` sees each verified record's bytes exactly as the read-time check will (the
    part's extent [sidecar_offset, + sidecar_length)), and a damaged record gets no value."""
    m = build(tmp_path)
    bad = m.records[13]
    path = tmp_path / bad.segments[0].shard
    with open(path, "r+b") as f:
        f.seek(bad.sidecar_offset + 7)
        b = f.read(1)
        f.seek(bad.sidecar_offset + 7)
        f.write(bytes([b[0] ^ 0x40]))
    rep = verify.verify_artifact(tmp_path, records=True, record_hash=sha)
    assert rep.manifest is not None and len(rep.problems) == 1
    assert sorted(rep.record_hashes) == [i for i in range(len(m.records)) if i != 13]
    for i, h in rep.record_hashes.items():
        r = m.records[i]
        with open(tmp_path / r.segments[0].shard, "rb") as f:
            f.seek(r.sidecar_offset)
            assert h == sha(f.read(r.sidecar_length)) == r.sha256
    assert verify.verify_artifact(tmp_path, records=True).record_hashes == {}  # none asked for


def test_damaged_files_reported(tmp_path, capsys):
    m = build(tmp_path)
    parts = [p.file for p in m.sidecar.parts]
    with open(tmp_path / parts[0], "r+b") as f:
        f.truncate(m.sidecar.parts[0].size - 1)
    os.unlink(tmp_path / parts[1])
    raw = bytearray((tmp_path / RES).read_bytes())
    raw[10] = ord("X") if raw[10] != ord("X") else ord("Y")  # inside the JSON header
    (tmp_path / RES).write_bytes(bytes(raw))
    write_safetensors(tmp_path / "stray.safetensors", {"x": ("U8", np.zeros(1, np.uint8))})
    assert run_cli(tmp_path, "--records") == 1
    out = capsys.readouterr().out
    assert f"{parts[0]}: size" in out and "truncated" in out
    assert f"{parts[1]}: missing" in out
    assert f"{RES}: " in out and ("header changed" in out or "bad safetensors header" in out)
    assert "stray.safetensors: *.safetensors file not listed" in out
    assert f"{parts[1]}: record layer 2 expert 0: unreadable" in out


def test_bad_manifest_is_one_problem(tmp_path):
    build(tmp_path)
    path = tmp_path / MANIFEST_NAME
    path.write_bytes(path.read_bytes().replace(b'"expert":3', b'"expert":4', 1))
    rep = verify.verify_artifact(tmp_path)
    assert len(rep.problems) == 1
    assert "records duplicate" in rep.problems[0]


def test_index_metadata_not_an_object_is_a_problem_not_a_crash(tmp_path):
    build(tmp_path)
    index = tmp_path / verify.INDEX_NAME
    d = json.loads(index.read_bytes())
    index.write_text(json.dumps({**d, "metadata": []}))
    rep = verify.verify_artifact(tmp_path)
    assert rep.problems == [f"{verify.INDEX_NAME}: metadata is not a JSON object"]
