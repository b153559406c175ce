"""Exact W3 -> W4 recode (FORMAT.md "W4 recode"): tensor level against compressed-tensors
0.20.1's 4-bit packer and decompress, and `mtplx recode-w4` on a tiny hand-made checkpoint."""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("compressed_tensors")  # the oracle (a test extra), as tests/test_ctint.py
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from test_ctint import (
    EXAMPLE_Q,
    EXAMPLE_WORDS,
    GOLDEN,
    ct_decompress,
    qc_020,
    random_codes,
    random_scale_bits,
    u32,
)

from mtplx_runtime.checkpoint import recode_w4
from mtplx_runtime.checkpoint.safetensors_io import (
    CheckpointError,
    SafetensorsFile,
    write_safetensors,
)
from mtplx_runtime.cli import recode_w4 as recode_w4_cli
from mtplx_runtime.formats import get_codec
from mtplx_runtime.formats.base import f32_to_bf16_bits
from mtplx_runtime.formats.ctint import (
    parse_quantization_config,
    recode_packed_w3_to_w4,
    recode_zero_point_w3_to_w4,
    weight_shape_tensor,
)

# --- tensor level ---------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["dense", "legacy"])
def test_worked_example(layout):
    words = np.array([EXAMPLE_WORDS[layout]], np.uint32).view(np.int32)
    assert u32(recode_packed_w3_to_w4(words, 64, layout)) == EXAMPLE_WORDS["w4"]
    assert (pack_to_int32(torch.from_numpy(EXAMPLE_Q), 4).numpy()
            == recode_packed_w3_to_w4(words, 64, layout)).all()


@pytest.mark.parametrize("layout", ["dense", "legacy"])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("shape", [(4, 64), (16, 3584), (24, 3072)])
def test_recode_equals_ct_w4(layout, symmetric, shape):
    rows, cols = shape
    rng = np.random.default_rng(rows + cols + symmetric)
    q = random_codes(rng, shape, 3)
    zp = None if symmetric else random_codes(rng, (rows, cols // 64), 3)
    w3 = get_codec("ct-int", num_bits=3, layout=layout, symmetric=symmetric)
    src = w3.encode_codes(q, random_scale_bits(rng, rows, cols // 64), zp)
    w4 = {"weight_packed": recode_packed_w3_to_w4(src["weight_packed"], cols, layout),
          "weight_scale": src["weight_scale"]}
    assert w4["weight_packed"].shape == (rows, cols // 8)
    assert (w4["weight_packed"] == pack_to_int32(torch.from_numpy(q), 4).numpy()).all()
    if not symmetric:
        w4["weight_zero_point"] = recode_zero_point_w3_to_w4(src["weight_zero_point"], rows, layout)
        theirs = pack_to_int32(torch.from_numpy(zp), 4, packed_dim=0).numpy()
        assert w4["weight_zero_point"].shape == (-(-rows // 8), cols // 64)
        assert (w4["weight_zero_point"] == theirs).all()
    # ct 0.20.1's 4-bit decompress of the recode equals the 3-bit source dequant, bit for bit.
    ct4 = ct_decompress(w4, shape, 4, symmetric)
    assert (ct4 == f32_to_bf16_bits(w3.decode(src, shape))).all()
    if layout == "dense":  # ct can read only the dense 3-bit layout
        assert (ct4 == ct_decompress(src, shape, 3, symmetric)).all()


@pytest.mark.parametrize("case", ["sym_5x3072", "sym_2x3584", "asym_64x128"])
def test_recode_legacy_golden(case):
    """From words written by ct 0.17.1 itself: ct 0.20.1's 4-bit decompress of our W4 recode
    equals 0.17.1's own 3-bit decompress."""
    f = SafetensorsFile(GOLDEN)
    rows, cols, symmetric, _ = json.loads(f.metadata["cases"])[case]
    get = lambda k: f.read(f"{case}.{k}")  # noqa: E731
    w4 = {"weight_packed": recode_packed_w3_to_w4(get("weight_packed"), cols, "legacy"),
          "weight_scale": get("weight_scale")}
    if not symmetric:
        zp = recode_zero_point_w3_to_w4(get("weight_zero_point"), rows, "legacy")
        w4["weight_zero_point"] = zp
    assert (ct_decompress(w4, (rows, cols), 4, symmetric) == get("decompressed")).all()


# --- checkpoint level -----------------------------------------------------------------------------

SHAPES = {"w1": (64, 128), "w3": (64, 128), "w2": (128, 64)}  # [rows, cols]: I=64, H=128


def expert_prefix(layer: int, expert: int, proj: str) -> str:
    return f"language_model.model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}"


def make_w3_checkpoint(root: Path, layout="dense", symmetric=True, qc_in_text=False, seed=0):
    """2 MoE layers x 2 experts in two shards + index, a BF16 embedding, an F32 norm, a
    tokenizer file and a sub-folder. One expert's scale sits in the other shard."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True)
    codec = get_codec("ct-int", num_bits=3, layout=layout, symmetric=symmetric)
    shards: dict[str, dict] = {"model-00001-of-00002.safetensors": {},
                               "model-00002-of-00002.safetensors": {}}
    first, second = shards.values()
    first["language_model.model.embed_tokens.weight"] = (
        "BF16", rng.integers(0, 2**16, (16, 128)).astype(np.uint16))
    second["language_model.model.norm.weight"] = ("F32", rng.random(128, np.float32))
    for layer, out in ((1, first), (2, second)):
        for expert in (0, 1):
            for proj, (rows, cols) in SHAPES.items():
                p = expert_prefix(layer, expert, proj)
                zp = None if symmetric else random_codes(rng, (rows, cols // 64), 3)
                parts = codec.encode_codes(random_codes(rng, (rows, cols), 3),
                                           random_scale_bits(rng, rows, cols // 64), zp)
                for name, spec in zip(parts, codec.components((rows, cols)), strict=True):
                    out[f"{p}.{name}"] = (spec.st_dtype, parts[name])
                out[f"{p}.weight_shape"] = ("I64", weight_shape_tensor((rows, cols)))
    moved = expert_prefix(2, 1, "w2") + ".weight_scale"
    first[moved] = second.pop(moved)
    for name, tensors in shards.items():
        write_safetensors(root / name, tensors, {"format": "pt"})
    weight_map = {t: name for name, tensors in shards.items() for t in tensors}
    index = {"metadata": {"total_size": 123}, "weight_map": dict(sorted(weight_map.items()))}
    (root / recode_w4.INDEX).write_text(json.dumps(index, indent=2))
    qc = qc_020(symmetric=symmetric)
    qc["version"] = "0.20.1" if layout == "dense" else "0.17.1"
    cfg = {"model_type": "kimi_k3", "text_config": {"hidden_size": 128}}
    (cfg["text_config"] if qc_in_text else cfg)["quantization_config"] = qc
    (root / "config.json").write_text(json.dumps(cfg, indent=2))
    (root / "tokenizer_config.json").write_text('{"bos": "<s>"}\n')
    (root / "extra").mkdir()
    (root / "extra" / "notes.txt").write_bytes(b"\x00kept byte for byte\xff")
    return root


def tensors_of(root: Path) -> dict[str, tuple[str, SafetensorsFile]]:
    index = json.loads((root / recode_w4.INDEX).read_text())
    files = {n: SafetensorsFile(root / n) for n in set(index["weight_map"].values())}
    return {t: (n, files[n]) for t, n in index["weight_map"].items()}


@pytest.mark.parametrize("layout,symmetric,qc_in_text", [
    ("dense", True, False), ("legacy", False, True), ("dense", False, False),
])
def test_recode_checkpoint(tmp_path, capsys, layout, symmetric, qc_in_text):
    src = make_w3_checkpoint(tmp_path / "src", layout, symmetric, qc_in_text)
    report = recode_w4.recode_checkpoint(src, tmp_path / "dst")
    dst = tmp_path / "dst"
    n_recoded = 12 * (1 if symmetric else 2)
    assert (report.layout, report.shards, report.recoded) == (layout, 2, n_recoded)
    assert "[2/2] model-00002-of-00002.safetensors: " in capsys.readouterr().err
    before, after = tensors_of(src), tensors_of(dst)
    assert sorted(before) == sorted(after)
    for name, (shard, f) in before.items():
        shard2, g = after[name]
        assert shard2 == shard and g.metadata == f.metadata == {"format": "pt"}
        if name.endswith((".weight_packed", ".weight_zero_point")):
            assert g.info(name).dtype == "I32"
            continue
        assert g.info(name).dtype == f.info(name).dtype and g.info(name).shape == f.info(name).shape
        assert g.read_bytes(name) == f.read_bytes(name), name
    w3 = get_codec("ct-int", num_bits=3, layout=layout, symmetric=symmetric)
    w4 = get_codec("ct-int", num_bits=4, symmetric=symmetric)
    for layer in (1, 2):
        for proj, shape in SHAPES.items():
            p = expert_prefix(layer, 1, proj)
            names = [f"{p}.{c.name}" for c in w3.components(shape)]
            src_parts, dst_parts = ({n.rsplit(".", 1)[1]: t[n][1].read(n) for n in names}
                                    for t in (before, after))
            w4.check_parts(dst_parts, shape)
            assert (w4.decode(dst_parts, shape) == w3.decode(src_parts, shape)).all()
            assert (ct_decompress(dst_parts, shape, 4, symmetric)
                    == f32_to_bf16_bits(w3.decode(src_parts, shape))).all()
    index = json.loads((dst / recode_w4.INDEX).read_text())
    old_index = json.loads((src / recode_w4.INDEX).read_text())
    assert index["weight_map"] == old_index["weight_map"]
    assert index["metadata"]["total_size"] == sum(f.info(t).nbytes for t, (_, f) in after.items())
    old_cfg, cfg = (json.loads((d / "config.json").read_text()) for d in (src, dst))
    holder = lambda c: c["text_config"] if qc_in_text else c  # noqa: E731
    qc = holder(cfg)["quantization_config"]
    assert parse_quantization_config(qc).num_bits == 4 and qc["version"] == "0.20.1"
    expect = copy.deepcopy(old_cfg)
    holder(expect)["quantization_config"]["version"] = "0.20.1"
    holder(expect)["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 4
    assert cfg == expect
    for rel in ("tokenizer_config.json", "extra/notes.txt"):
        assert (dst / rel).read_bytes() == (src / rel).read_bytes()
    assert not list(dst.glob("*.partial"))


def test_single_file_checkpoint_and_cli(tmp_path, capsys):
    root = tmp_path / "one"
    root.mkdir()
    codec = get_codec("ct-int", num_bits=3)
    rng = np.random.default_rng(1)
    parts = codec.encode_codes(random_codes(rng, (8, 64), 3), random_scale_bits(rng, 8, 1))
    write_safetensors(root / "model.safetensors", {
        "x.weight_packed": ("I32", parts["weight_packed"]),
        "x.weight_scale": ("BF16", parts["weight_scale"]),
        "x.weight_shape": ("I64", weight_shape_tensor((8, 64))),
        "y.weight": ("BF16", np.arange(6, dtype=np.uint16)),
    })
    (root / "config.json").write_text(json.dumps({"quantization_config": qc_020()}))
    parser = argparse.ArgumentParser()
    recode_w4_cli.add_args(parser)
    assert recode_w4_cli.main(parser.parse_args([str(root), str(tmp_path / "out")])) == 0
    assert "1 shards, 1 tensors recoded from the dense 3-bit layout" in capsys.readouterr().err
    for flag in ("--no-progress", "--quiet"):  # one spelling across subcommands, either works
        assert parser.parse_args([str(root), "dst", flag]).quiet is True
    out = SafetensorsFile(tmp_path / "out" / "model.safetensors")
    assert out.read("x.weight_packed").shape == (8, 8)
    assert out.read_bytes("y.weight") == np.arange(6, dtype=np.uint16).tobytes()
    assert not (tmp_path / "out" / recode_w4.INDEX).exists()


def _edit_config(root: Path, edit) -> None:
    cfg = json.loads((root / "config.json").read_text())
    edit(cfg)
    (root / "config.json").write_text(json.dumps(cfg))


def _set_bits(cfg):
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 4


def _replace_tensor(root: Path, shard: str, name: str, dtype: str, arr: np.ndarray) -> None:
    f = SafetensorsFile(root / shard)
    tensors = {t: (f.info(t).dtype, f.read(t)) for t in f.tensors}
    tensors[name] = (dtype, arr)
    write_safetensors(root / shard, tensors, f.metadata)
    index = json.loads((root / recode_w4.INDEX).read_text())
    index["weight_map"][name] = shard
    (root / recode_w4.INDEX).write_text(json.dumps(index))


SHARD1 = "model-00001-of-00002.safetensors"
P0 = expert_prefix(1, 0, "w1")
PACKED = P0 + ".weight_packed"


@pytest.mark.parametrize("breaks,match", [
    (lambda r: (r / "model-00002-of-00002.safetensors").unlink(), "model-00002-of-00002.*missing"),
    (lambda r: _edit_config(r, _set_bits), "num_bits is 4; recode-w4 needs a 3-bit source"),
    (lambda r: _edit_config(r, lambda c: c.pop("quantization_config")), "no quantization_config"),
    (lambda r: _edit_config(r, lambda c: c["quantization_config"].update(sparsity_config={"a": 1})),
     "config.json: .*sparsity_config"),
    (lambda r: (_edit_config(r, lambda c: c["quantization_config"].pop("version")),
                _replace_tensor(r, SHARD1, PACKED, "I32", np.zeros((64, 13), np.int32))),
     "mixed 3-bit layouts"),
    (lambda r: _replace_tensor(r, SHARD1, PACKED, "I32", np.zeros((64, 20), np.int32)),
     f"{SHARD1}: {PACKED}: .*fits neither"),
    (lambda r: _replace_tensor(r, SHARD1, P0 + ".weight_shape", "I64", np.array([64, 256])),
     "fits neither"),
    (lambda r: _replace_tensor(r, SHARD1, P0 + ".weight_shape", "I64", np.array([63, 128])),
     "weight_shape says \\[63, 128\\]"),
    (lambda r: _replace_tensor(r, SHARD1, P0 + ".weight_zero_point", "I32",
                               np.zeros((3, 2), np.int32)),
     "symmetric config but a weight_zero_point"),
    (lambda r: _edit_config(r, lambda c: c["quantization_config"].update(version="0.17.1")),
     "override"),
])
def test_recode_refuses(tmp_path, breaks, match):
    src = make_w3_checkpoint(tmp_path / "src")
    breaks(src)
    with pytest.raises(CheckpointError, match=match):
        recode_w4.recode_checkpoint(src, tmp_path / "dst", progress=False)
    assert not (tmp_path / "dst").exists()  # every check runs before anything is written


def test_layout_override_and_existing_dst(tmp_path):
    src = make_w3_checkpoint(tmp_path / "src", layout="legacy")
    _edit_config(src, lambda c: c["quantization_config"].update(version="0.20.1"))
    with pytest.raises(CheckpointError, match="override"):
        recode_w4.recode_checkpoint(src, tmp_path / "a", progress=False)
    report = recode_w4.recode_checkpoint(src, tmp_path / "a", progress=False, layout="legacy")
    assert report.layout == "legacy"
    with pytest.raises(CheckpointError, match="not empty; refusing to overwrite"):
        recode_w4.recode_checkpoint(src, tmp_path / "a", progress=False, layout="legacy")
    (tmp_path / "empty").mkdir()
    recode_w4.recode_checkpoint(src, tmp_path / "empty", progress=False, layout="legacy")


def test_asymmetric_needs_zero_points(tmp_path):
    src = make_w3_checkpoint(tmp_path / "src", symmetric=False)
    f = SafetensorsFile(src / SHARD1)
    zp_name = P0 + ".weight_zero_point"
    tensors = {t: (f.info(t).dtype, f.read(t)) for t in f.tensors if t != zp_name}
    write_safetensors(src / SHARD1, tensors, f.metadata)
    index = json.loads((src / recode_w4.INDEX).read_text())
    del index["weight_map"][zp_name]
    (src / recode_w4.INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="weight_zero_point is missing"):
        recode_w4.recode_checkpoint(src, tmp_path / "dst", progress=False)


def test_index_disagreeing_with_shard(tmp_path):
    src = make_w3_checkpoint(tmp_path / "src")
    index = json.loads((src / recode_w4.INDEX).read_text())
    index["weight_map"]["ghost.weight"] = SHARD1
    (src / recode_w4.INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="disagree.*ghost.weight"):
        recode_w4.recode_checkpoint(src, tmp_path / "dst", progress=False)


def test_refuses_dst_inside_src(tmp_path):
    src = make_w3_checkpoint(tmp_path / "src")
    with pytest.raises(CheckpointError, match="inside the source"):
        recode_w4.recode_checkpoint(src, src / "w4", progress=False)
