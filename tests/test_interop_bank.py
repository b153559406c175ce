"""A t158 bank from another writer: records 4 KiB-aligned as manifest v1 requires, but each
record's components back to back without our writer's per-component padding, and a model key of
its own. The reader takes the record layout from the manifest (FORMAT.md "Bank parts", rule 17),
so the same weights give the same tokens as our padded bank, and kernels that cannot address an
unaligned component say so at load."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from k3_manifest_writer import serialize

import mtplx_runtime
from mtplx_runtime.artifact.build import build_artifact
from mtplx_runtime.artifact.manifest import MANIFEST_NAME, ManifestError, load_manifest
from mtplx_runtime.checkpoint.safetensors_io import CheckpointError
from mtplx_runtime.cli import main as cli_main
from mtplx_runtime.engine.generate import generate
from mtplx_runtime.fixtures.tiny import make_tiny
from mtplx_runtime.formats.record import layout_of
from mtplx_runtime.kernels import cpu, cuda

PROMPT = [5, 6, 7, 8]
PAGE = 4096


def repack_unpadded(src: Path, dst: Path, model_key: str = "another-writer-tiny-t158",
                    keep_pads: frozenset[int] = frozenset()) -> dict:
    """Another writer's artifact from ours, with plain json and hashlib: every record (but those
    whose index is in `keep_pads`) rewritten with its pad segments dropped (components back to
    back), records at 4 KiB-aligned offsets (a gap after each), fresh record, part and manifest
    digests. Returns the manifest dict."""
    dst.mkdir()
    m = json.loads((src / MANIFEST_NAME).read_text())
    banks = {p["file"] for p in m["sidecar"]["parts"]}
    for f in src.iterdir():
        if f.name not in banks and f.name != MANIFEST_NAME and not f.name.endswith(
                (".journal.jsonl", "build-receipt.json")):
            shutil.copy(f, dst / f.name)
    out = {p["file"]: bytearray() for p in m["sidecar"]["parts"]}
    for i, r in enumerate(m["records"]):
        part = m["sidecar"]["parts"][r.get("part", 0)]
        old = (src / part["file"]).read_bytes()
        buf = out[part["file"]]
        buf.extend(bytes(-len(buf) % PAGE))  # the record starts 4 KiB-aligned
        start, kept = len(buf), []
        for s in r["segments"]:
            if s["component"] != "pad" or i in keep_pads:  # copy from the old offset, move
                kept.append(dict(s, offset=len(buf)))
                buf.extend(old[s["offset"]:s["offset"] + s["length"]])
        r["segments"], r["sidecar_offset"] = kept, start
        r["logical_bytes"] = r["sidecar_length"] = len(buf) - start
        r["sha256"] = hashlib.sha256(bytes(buf[start:])).hexdigest()
    for p in m["sidecar"]["parts"]:
        data = bytes(out[p["file"]])
        (dst / p["file"]).write_bytes(data)
        p["size"], p["sha256"] = len(data), hashlib.sha256(data).hexdigest()
        for sh in m["shards"]:
            if sh["name"] == p["file"]:
                sh["size"], sh["sha256"] = p["size"], p["sha256"]
    a = m["artifact"]
    a["routed_expert_bytes"] = sum(r["logical_bytes"] for r in m["records"])
    a["tensor_bytes"] = a["resident_tensor_bytes"] + a["routed_expert_bytes"]
    m["model_key"] = model_key
    m.pop("manifest_sha256", None)
    (dst / MANIFEST_NAME).write_bytes(serialize(m)[0])
    return m


@pytest.fixture(scope="module")
def banks(tmp_path_factory):
    """(our padded artifact, the same weights as another writer's unpadded one)."""
    root = tmp_path_factory.mktemp("interop")
    make_tiny(root / "src", "t158")
    build_artifact(root / "src", root / "ours", codec="keep", progress=False)
    repack_unpadded(root / "ours", root / "theirs")
    return root / "ours", root / "theirs"


def tokens(art, kernels):
    with mtplx_runtime.load(art, dtype="float32", kernels=kernels, cache_slots=(4, 0),
                            tokenizer=False) as rt:
        return generate(rt.model, PROMPT, max_tokens=6)[0]


def test_the_unpadded_bank_is_what_the_test_says(banks):
    ours, theirs = banks
    r = load_manifest(theirs / MANIFEST_NAME).records[0]
    assert all(s.component != "pad" for s in r.segments)
    assert r.logical_bytes % PAGE and r.sidecar_offset % PAGE == 0
    assert [s.offset - r.segments[0].offset for s in r.segments][1] == r.segments[0].length
    padded = load_manifest(ours / MANIFEST_NAME).records[0].segments
    assert any(s.component == "pad" for s in padded)


@pytest.mark.parametrize("kernels", ["reference", "cpu"])
def test_another_writers_unpadded_bank_gives_the_same_tokens(banks, kernels):
    ours, theirs = banks
    if kernels == "cpu" and cpu.unavailable_reason():
        pytest.skip(cpu.unavailable_reason())
    assert tokens(theirs, kernels) == tokens(ours, kernels)


def test_verify_accepts_the_unpadded_bank_and_rehashes_its_records(banks, capsys):
    assert cli_main(["verify", str(banks[1]), "--records", "--shard-hashes"]) == 0
    out = capsys.readouterr().out
    assert "40 records" in out and "problem" not in out.lower(), out


def test_records_of_one_artifact_share_one_layout(banks, tmp_path):
    """Rule 17: padded and unpadded records mixed in one bank are refused, naming the record."""
    m = repack_unpadded(banks[0], tmp_path / "mixed", keep_pads=frozenset({1}))
    assert [len(r["segments"]) for r in m["records"][:3]] == [6, 12, 6]
    mixed = tmp_path / "mixed"
    with pytest.raises((ManifestError, CheckpointError), match=r"expert 1\).*one layout"):
        mtplx_runtime.load(mixed, dtype="float32", kernels="reference", cache_slots=(4, 0),
                           tokenizer=False)


def test_kernels_that_address_components_in_place_refuse_unaligned_ones():
    odd = layout_of("t158", 2, [("gate_proj.packed", "U8", (1, 13), 13),
                                ("gate_proj.scales", "U16", (1, 1), 2),
                                ("up_proj.packed", "U8", (1, 13), 13),
                                ("up_proj.scales", "U16", (1, 1), 2),
                                ("down_proj.packed", "U8", (1, 13), 13),
                                ("down_proj.scales", "U16", (1, 1), 2)])
    assert "gate_proj.scales (U16)" in cpu.unsupported(odd) and "offset 13" in cpu.unsupported(odd)
    assert "16-byte aligned" in cuda.unsupported(odd)
    # 1024 columns: 208 packed bytes and 16 scales (32 bytes) per row, all 16-byte aligned
    even = layout_of("t158", 2, [(s.component, s.dtype, (1, 16 * s.shape[1]), 16 * s.length)
                                 for s in odd.segments])
    # aligned now; CUDA still refuses this toy's one-row projections (16-row MMA tiles)
    assert cpu.unsupported(even) is None and "aligned" not in cuda.unsupported(even)
