"""Quantized residents stored by `mtplx build-manifest --resident-dtype` (FORMAT.md "Quantized
residents"): the artifact holds exactly the tensors load-time quantization of a bf16 artifact
computes (every quantized tensor, values and scales, bit for bit; logits equal), in the stated
layout; the manifest says which dtype, loading reads it as stored, the memory plan sizes it
without being told, the shards pass the same integrity checks, and a resident that disagrees
with the table, or another dtype asked of it, is a clear error."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch

from mtplx_runtime import load, load_model
from mtplx_runtime.artifact.build import build_artifact
from mtplx_runtime.artifact.integrity import IntegrityError
from mtplx_runtime.artifact.journal import BuildError
from mtplx_runtime.artifact.manifest import (
    MANIFEST_NAME,
    ManifestError,
    ResidentTensor,
    load_manifest,
    parse_manifest_bytes,
    write_manifest,
)
from mtplx_runtime.checkpoint import CheckpointError, ModelConfig, resident_tensor_specs
from mtplx_runtime.checkpoint.safetensors_io import SafetensorsFile, write_safetensors
from mtplx_runtime.cli import main as cli
from mtplx_runtime.engine.plan import PlanError, make_plan
from mtplx_runtime.fixtures.tiny import make_tiny
from mtplx_runtime.formats.resident_layouts import GROUP, quantizable
from mtplx_runtime.model.quant import (
    Fp8Weight,
    Int4Packed,
    Int4Weight,
    Int8Weight,
    quantize_fp8,
    quantize_int4,
)

IDS = [1, 5, 9, 2, 7, 3, 11, 4]
DTYPES = ("int8", "int4", "fp8")


@pytest.fixture(scope="module")
def arts(tmp_path_factory):
    """The tiny K3 (matrices of every kind: int4 packed for torch's kernel, int4 in the stated
    layout for rows % 16 != 0, int8 for inputs not a multiple of 32) built four ways; int4
    through the CLI."""
    root = tmp_path_factory.mktemp("qbuild")
    src = root / "src"
    make_tiny(src, "bf16")
    out = {"src": src}
    for d in ("bf16", "int8", "fp8"):
        out[d] = root / d
        build_artifact(src, out[d], resident_dtype=d, progress=False)
    out["int4"] = root / "int4"
    assert cli(["build-manifest", str(src), str(out["int4"]), "--resident-dtype", "int4",
                "--no-progress"]) == 0
    return out


def weights(model):
    """Every resident weight of a model by name."""
    out = {f"top.{k}": v for k, v in model.top.items()}
    for i, layer in enumerate(model.layers):
        out.update({f"{i}.{k}": v for k, v in layer.w.items()})
    return out


def same(a, b) -> bool:
    """Same kind and bit-identical tensors (codes, scales, zeros, or the packed layout)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    names = ("packed_q", "scale_zero") if isinstance(a, Int4Packed) else ("q", "scale", "zero")
    return all(torch.equal(getattr(a, n), getattr(b, n)) for n in names if hasattr(a, n))


@pytest.mark.parametrize("dtype", DTYPES)
def test_built_residents_equal_load_time_quantization_bit_for_bit(arts, dtype):
    at_load = load_model(arts["bf16"], dtype="bfloat16", resident_dtype=dtype)
    stored = load_model(arts[dtype], dtype="bfloat16")  # as stored: nothing to tell it
    wa, wb = weights(at_load), weights(stored)
    assert wa.keys() == wb.keys()
    bad = [k for k in wa if not same(wa[k], wb[k])]
    assert not bad
    kinds = {type(w) for w in wb.values()}
    want = {"int8": {Int8Weight}, "int4": {Int8Weight, Int4Weight, Int4Packed},
            "fp8": {Fp8Weight}}[dtype]
    assert want <= kinds  # every layout took part
    assert torch.equal(at_load.logits(IDS), stored.logits(IDS))


@pytest.mark.parametrize("dtype", DTYPES)
def test_streamed_load_reads_the_stored_residents_through_the_integrity_check(arts, dtype):
    ref = load_model(arts["bf16"], dtype="bfloat16", resident_dtype=dtype).logits(IDS)
    with load(arts[dtype], kernels="reference", cache_slots=(8, 0), tokenizer=False) as rt:
        assert rt.model.logits(IDS).equal(ref)


def test_the_shards_hold_the_stated_layout_and_the_manifest_says_which(arts):
    specs = resident_tensor_specs(ModelConfig.from_file(arts["bf16"] / "config.json"))
    plain = stored_tensors_of(arts["bf16"])
    assert load_manifest(arts["bf16"] / MANIFEST_NAME).resident_dtype == "bf16"
    assert b"resident_dtype" not in (arts["bf16"] / MANIFEST_NAME).read_bytes()  # default: absent
    for dtype in DTYPES:
        m = load_manifest(arts[dtype] / MANIFEST_NAME)
        assert m.resident_dtype == dtype
        got = stored_tensors_of(arts[dtype])
        for name, s in specs.items():
            if not quantizable(name, s.shape, s.dtype):
                assert got[name][0] == plain[name][0], name  # kept byte for byte
                assert got[name][1].tobytes() == plain[name][1].tobytes(), name
                assert name + "_scale" not in got
                continue
            (n, k), codes, scale = s.shape, got[name], got[name + "_scale"]
            if dtype == "fp8":
                assert (codes[0], codes[1].shape, scale[0], scale[1].shape) == \
                    ("F8_E4M3", (n, k), "F32", (n,))
            elif dtype == "int8" or k % GROUP:
                assert (codes[0], codes[1].shape, scale[0], scale[1].shape) == \
                    ("I8", (n, k), "BF16", (n,))
                assert name + "_zero" not in got
            else:
                zero = got[name + "_zero"]
                assert (codes[0], codes[1].shape, scale[1].shape, zero[0], zero[1].shape) == \
                    ("U8", (n, k // 2), (k // GROUP, n), "BF16", (k // GROUP, n))
        assert m.artifact["resident_tensor_bytes"] < \
            load_manifest(arts["bf16"] / MANIFEST_NAME).artifact["resident_tensor_bytes"]


def test_int4_codes_are_the_reference_nibbles(arts):
    """The stored int4 tensors dequantize by FORMAT.md's formula (even k in the low nibble,
    (q - 8) · scale + zero) to the load-time Int4Weight's own reference dequantization."""
    tensors = stored_tensors_of(arts["int4"])
    w_bf16 = load_model(arts["bf16"], dtype="bfloat16").top["lm_head.weight"]
    name = "language_model.lm_head.weight"
    q = tensors[name][1]
    codes = np.stack([q & 0x0F, q >> 4], axis=-1).reshape(q.shape[0], -1).astype(np.float32)
    f32 = lambda bits: (bits.astype(np.uint32) << 16).view(np.float32)  # noqa: E731
    scale, zero = f32(tensors[name + "_scale"][1]).T, f32(tensors[name + "_zero"][1]).T
    n, k = codes.shape
    w = (codes.reshape(n, k // GROUP, GROUP) - 8) * scale[..., None] + zero[..., None]
    want = quantize_int4(w_bf16).dequantize()  # the reference, fp32 rounded once to bf16
    assert torch.equal(torch.from_numpy(w.reshape(n, k)).to(torch.bfloat16), want)


def test_fp8_codes_are_the_stated_bytes(arts):
    """The stored F8_E4M3 bytes and F32 scales are the load-time encoder's, and dequantize by
    FORMAT.md's formula (q · scale in fp32, rounded once to bf16) to its reference."""
    tensors = stored_tensors_of(arts["fp8"])
    w_bf16 = load_model(arts["bf16"], dtype="bfloat16").top["lm_head.weight"]
    name = "language_model.lm_head.weight"
    want = quantize_fp8(w_bf16)
    q = torch.from_numpy(tensors[name][1]).view(torch.float8_e4m3fn)
    scale = torch.from_numpy(tensors[name + "_scale"][1])
    assert torch.equal(q.view(torch.uint8), want.q.view(torch.uint8))
    assert torch.equal(scale, want.scale)
    assert torch.equal((q.float() * scale[:, None]).to(torch.bfloat16), want.dequantize())


def test_another_resident_dtype_than_built_is_a_clear_error(arts):
    for asked in ("bf16", "int4"):
        with pytest.raises(ValueError, match=r"holds int8 residents .* cannot load them as"):
            load_model(arts["int8"], dtype="bfloat16", resident_dtype=asked)
    assert isinstance(load_model(arts["int8"], dtype="bfloat16", resident_dtype="int8").top[
        "lm_head.weight"], Int8Weight)
    with pytest.raises(ValueError, match="bfloat16"):
        load_model(arts["int8"], dtype="float32")
    with pytest.raises(PlanError, match="holds int4 residents"):
        make_plan(arts["int4"], memory_budget="8GiB", resident_dtype="int8")


def test_plan_sizes_a_quantized_artifact_without_being_told(arts, capsys):
    for dtype in DTYPES:
        built = make_plan(arts[dtype], memory_budget="8GiB")
        at_load = make_plan(arts["bf16"], memory_budget="8GiB", resident_dtype=dtype)
        assert built.resident_dtype == dtype
        assert built.items["residents"] == at_load.items["residents"]
        assert built.items["residents"] < make_plan(arts["bf16"], memory_budget="8GiB").items[
            "residents"]
        held = sum(w.nbytes for w in weights(load_model(arts[dtype], dtype="bfloat16")).values())
        assert held == built.items["residents"]  # what the plan counts is what loads
    assert cli(["plan", "--model", str(arts["int4"]), "--memory-budget", "8GiB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["resident_dtype"] == "int4"


def test_a_rerun_after_the_residents_keeps_them_and_another_dtype_is_refused(arts, tmp_path):
    """A build stopped after its resident shards (no receipt, no manifest yet) resumes: the
    same command re-encodes the same bytes and finishes with the same manifest; another
    resident dtype meets shards it would write differently and stops."""
    art = copy_artifact(arts["int8"], tmp_path / "art")
    digest = load_manifest(art / MANIFEST_NAME).manifest_sha256
    for name in (MANIFEST_NAME, "build-receipt.json"):
        (art / name).unlink()
    with pytest.raises(BuildError, match="exists with different content"):
        build_artifact(arts["src"], art, resident_dtype="int4", progress=False)
    report = build_artifact(arts["src"], art, resident_dtype="int8", progress=False)
    assert report.manifest_sha256 == digest


def test_a_gguf_source_builds_quantized_residents_too(tmp_path):
    pytest.importorskip("gguf")
    from mtplx_runtime.fixtures.tiny_gguf import make_tiny_gguf

    make_tiny_gguf(tmp_path / "src", seed=3)
    for d in ("bf16", "int4"):
        build_artifact(tmp_path / "src", tmp_path / d, resident_dtype=d, progress=False)
    at_load = load_model(tmp_path / "bf16", dtype="bfloat16", resident_dtype="int4")
    stored = load_model(tmp_path / "int4", dtype="bfloat16")
    assert all(same(a, b) for a, b in zip(weights(at_load).values(), weights(stored).values(),
                                          strict=True))
    assert torch.equal(at_load.logits(IDS), stored.logits(IDS))


def test_inspect_counts_the_stored_tensors(arts, capsys):
    for dtype in ("bf16", "int8"):
        assert cli(["inspect", str(arts[dtype])]) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("resident"))
        size = sum(p.stat().st_size for p in arts[dtype].glob("resident-*.safetensors"))
        n = int(line.split()[1].replace(",", ""))
        assert 0.95 * size < n <= size  # the tensors' bytes: the shards less their headers
        assert ("(int8 matrices)" in line) == (dtype == "int8")


def test_extending_with_another_resident_dtype_is_refused(arts):
    with pytest.raises(BuildError, match="int8 residents and this build writes bf16"):
        build_artifact(arts["src"], arts["int8"], progress=False)
    with pytest.raises(BuildError, match="resident dtype"):
        build_artifact(arts["src"], arts["int8"].parent / "x", resident_dtype="fp4",
                       progress=False)


def test_verify_and_the_shard_hash_cover_quantized_shards(arts, tmp_path):
    assert cli(["verify", str(arts["int4"]), "--shard-hashes"]) == 0
    art = copy_artifact(arts["int8"], tmp_path / "art")
    shard = next(p for p in art.glob("resident-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1  # the last tensor's last byte: a code or a scale
    shard.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="hashes to"):
        load(art, kernels="reference", cache_slots=(8, 0), tokenizer=False)


def test_manifest_resident_dtype_value_rules(arts):
    m = load_manifest(arts["int8"] / MANIFEST_NAME)
    for bad in ("fp4", 8, None):
        d = m.to_dict()
        d.pop("manifest_sha256")
        d["resident_dtype"] = bad
        with pytest.raises(ManifestError, match="resident_dtype"):
            parse_manifest_bytes(json.dumps(d).encode(), require_digest=False)
    d = load_manifest(arts["bf16"] / MANIFEST_NAME).to_dict()
    d["resident_dtype"] = "bf16"  # the default written out: same digest as without it
    assert parse_manifest_bytes(json.dumps(d).encode()).resident_dtype == "bf16"


# ---- residents that disagree with the table for the manifest's dtype ----


def test_manifest_dtype_that_disagrees_with_the_shards_is_refused(arts, tmp_path):
    art = copy_artifact(arts["int8"], tmp_path / "a")
    set_resident_dtype(art, "int4")
    with pytest.raises(CheckpointError, match=r"_zero.*int4 residents"):
        load_model(art, dtype="bfloat16")
    art = copy_artifact(arts["int8"], tmp_path / "b")
    set_resident_dtype(art, "bf16")
    with pytest.raises(CheckpointError, match=r"weight_scale' is not used by the config"):
        load_model(art, dtype="bfloat16")


@pytest.mark.parametrize("what", ["scale shape", "codes dtype"])
def test_a_stored_tensor_of_the_wrong_shape_or_dtype_is_refused(arts, tmp_path, what):
    art = copy_artifact(arts["int8"], tmp_path / "art")
    name = "language_model.model.layers.0.self_attn.q_proj.weight"

    def edit(tensors):
        if name not in tensors:
            return
        if what == "scale shape":
            dt, a = tensors[name + "_scale"]
            tensors[name + "_scale"] = (dt, a[:-1])
        else:
            tensors[name] = ("U8", tensors[name][1].view(np.uint8))

    rewrite_residents(art, edit)
    want = (r"weight_scale' is BF16\[\d+\], the config with int8 residents requires BF16"
            if what == "scale shape" else r"q_proj.weight' is U8\[.*requires I8")
    with pytest.raises(CheckpointError, match=want):
        load_model(art, dtype="bfloat16")


# ---- helpers ----


def stored_tensors_of(art) -> dict[str, tuple[str, np.ndarray]]:
    out = {}
    for p in sorted(art.glob("resident-*.safetensors")):
        with SafetensorsFile(p) as f:
            out.update({n: (f.tensors[n].dtype, f.read(n)) for n in f.tensors})
    return out


def copy_artifact(src, dst):
    """A copy of an artifact (bank parts hard-linked: tests here never write them)."""
    dst.mkdir()
    for p in src.iterdir():
        if p.name.startswith("experts-"):
            (dst / p.name).hardlink_to(p)
        elif p.is_file():
            (dst / p.name).write_bytes(p.read_bytes())
    return dst


def set_resident_dtype(art, dtype: str) -> None:
    m = load_manifest(art / MANIFEST_NAME)
    m.resident_dtype = dtype
    write_manifest(m, art / MANIFEST_NAME)


def rewrite_residents(art, edit) -> None:
    """Rewrite the resident shards with `edit({name: (dtype, array)})` applied, and the manifest
    to match them (extents, shard sizes and hashes, totals), as a writer that made those tensors
    would: only the table check can object."""
    m = load_manifest(art / MANIFEST_NAME)
    tensors = {}
    for s in m.shards:
        if s.kind == "safetensors":
            with SafetensorsFile(art / s.name) as f:
                tensors[s.name] = {n: (f.tensors[n].dtype, f.read(n)) for n in f.tensors}
    for group in tensors.values():
        edit(group)
    residents = []
    for s in m.shards:
        if s.kind != "safetensors":
            continue
        write_safetensors(art / s.name, tensors[s.name])
        raw = (art / s.name).read_bytes()
        s.header_bytes = 8 + int.from_bytes(raw[:8], "little")
        s.header_sha256 = hashlib.sha256(raw[:s.header_bytes]).hexdigest()
        s.size, s.sha256 = len(raw), hashlib.sha256(raw).hexdigest()
        with SafetensorsFile(art / s.name) as f:
            residents += [ResidentTensor(n, s.name, i.start, i.nbytes, i.dtype, tuple(i.shape))
                          for n, i in f.tensors.items()]
    m.resident_tensors = sorted(residents, key=lambda t: t.tensor)
    res = sum(t.length for t in residents)
    m.artifact["tensor_bytes"] += res - m.artifact["resident_tensor_bytes"]
    m.artifact["resident_tensor_bytes"] = res
    write_manifest(m, art / MANIFEST_NAME)
