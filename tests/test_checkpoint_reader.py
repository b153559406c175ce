"""open_checkpoint on hand-built tiny checkpoints: every layout reads, every hostile input is
refused with a message that names the file or tensor at fault."""

import json
import os

import numpy as np
import pytest
from ckpt_helpers import (
    LAYOUTS,
    MXFP4_QC,
    build,
    checkpoint_tensors,
    replace,
    tiny_config,
    w3_qc,
    write_checkpoint,
)

from mtplx_runtime.checkpoint import CheckpointError, ExpertRecord, open_checkpoint
from mtplx_runtime.checkpoint.safetensors_io import write_safetensors

EXPERT = "language_model.model.layers.{}.block_sparse_moe.experts.{}.{}.{}"
INDEX = "model.safetensors.index.json"


def _shard_of(root, name) -> str:
    return json.loads((root / INDEX).read_text())["weight_map"][name]


def _expected_parts(tensors, layout, layer, e):
    """The arrays written for expert (layer, e), keyed like ExpertRecord projections/parts."""
    out = {}
    for proj, off in {"gate": "w1", "up": "w3", "down": "w2"}.items():
        if layout == "t158":
            p = f"model.layers.{layer}.mlp.switch_mlp.{proj}_proj."
            out[proj] = {c: tensors[p + c][1][e] for c in ("packed", "scales")}
        else:
            p = EXPERT.format(layer, e, off, "")
            out[proj] = {n[len(p):]: a for n, (_, a) in tensors.items()
                         if n.startswith(p) and not n.endswith("weight_shape")}
    return out


@pytest.mark.parametrize("shards", [0, 3])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_reads(tmp_path, layout, shards):
    root, cfg, tensors = build(tmp_path, layout, shards=shards)
    with open_checkpoint(root) as ck:
        assert ck.layout == layout and ck.config == cfg
        assert ck.codec.name == {"w3": "ct-int"}.get(layout, layout)
        rec = ck.expert(4, 7)
        assert isinstance(rec, ExpertRecord) and (rec.layer, rec.expert) == (4, 7)
        want = _expected_parts(tensors, layout, 4, 7)
        for proj, p in rec.projections.items():
            assert p.shape == cfg.expert_shapes[proj]
            assert p.parts.keys() == want[proj].keys()
            for k, a in p.parts.items():
                np.testing.assert_array_equal(a, want[proj][k])
        decoded = rec.decode()
        assert {k: (v.dtype, v.shape) for k, v in decoded.items()} == {
            k: (np.float32, s) for k, s in cfg.expert_shapes.items()}
        name = "language_model.model.embed_tokens.weight"
        assert ck.has_tensor(name) and ck.tensor(name).shape == (512, 128)
        assert ck.tensor_info(name).dtype == "BF16"
        assert ck.tensor_names() == sorted(tensors)


def test_flat_config_for_per_expert_layout_and_official_for_t158(tmp_path):
    assert open_checkpoint(build(tmp_path / "a", "mxfp4", form="flat")[0]).layout == "mxfp4"
    assert open_checkpoint(build(tmp_path / "b", "t158", form="official")[0]).layout == "t158"


def test_t158_reads_only_the_expert_slice(tmp_path, monkeypatch):
    root, cfg, tensors = build(tmp_path, "t158", shards=0)
    ck = open_checkpoint(root)
    stacked_bytes = sum(a.nbytes for n, (_, a) in tensors.items() if "switch_mlp" in n) // 5
    reads = []
    real_pread = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, off: reads.append(n) or real_pread(fd, n, off))
    rec = ck.expert(2, 3)
    per_expert = sum(a.nbytes for p in rec.projections.values() for a in p.parts.values())
    assert len(reads) == 6 and sum(reads) == per_expert == stacked_bytes // cfg.num_experts
    np.testing.assert_array_equal(
        rec.projections["down"].parts["packed"],
        tensors["model.layers.2.mlp.switch_mlp.down_proj.packed"][1][3])


@pytest.mark.parametrize("prefix, mlp, scales", [
    ("language_model.model.layers", "mlp", "U16"),
    ("model.layers", "block_sparse_moe", "BF16"),
])
def test_t158_accepted_name_and_dtype_variants(tmp_path, prefix, mlp, scales):
    cfg = tiny_config()
    tensors = checkpoint_tensors(cfg, "t158", t158_prefix=prefix, t158_mlp=mlp, t158_scales=scales)
    write_checkpoint(tmp_path, cfg, tensors, form="flat")
    scales = open_checkpoint(tmp_path).expert(5, 0).projections["gate"].parts["scales"]
    assert scales.dtype == np.uint16


def test_t158_two_spellings_of_one_tensor(tmp_path):
    cfg = tiny_config()
    tensors = checkpoint_tensors(cfg, "t158")
    tensors["model.layers.1.block_sparse_moe.switch_mlp.up_proj.packed"] = (
        tensors["model.layers.1.mlp.switch_mlp.up_proj.packed"])
    write_checkpoint(tmp_path, cfg, tensors, form="flat")
    with pytest.raises(CheckpointError, match="two spellings of one tensor"):
        open_checkpoint(tmp_path)


def test_w3_legacy_layout_and_version(tmp_path):
    cfg = tiny_config(quantization_config=w3_qc(version="0.17.1"))
    write_checkpoint(tmp_path, cfg, checkpoint_tensors(cfg, "w3", legacy=True))
    ck = open_checkpoint(tmp_path)
    assert (ck.codec.num_bits, ck.codec.layout) == (3, "legacy")
    assert ck.expert(1, 0).projections["down"].parts["weight_packed"].shape == (64, 13)


def test_w3_version_contradicting_width(tmp_path):
    cfg = tiny_config(quantization_config=w3_qc(version="0.17.1"))
    write_checkpoint(tmp_path, cfg, checkpoint_tensors(cfg, "w3"))
    with pytest.raises(CheckpointError, match=r"weight_packed'.*dense layout, but compressed-tens"):
        open_checkpoint(tmp_path)


def test_w3_mixed_packing_layouts(tmp_path):
    cfg = tiny_config(quantization_config=w3_qc(version=None))  # width alone decides
    tensors = checkpoint_tensors(cfg, "w3")
    legacy = checkpoint_tensors(cfg, "w3", legacy=True)
    name = EXPERT.format(3, 2, "w2", "weight_packed")
    tensors[name] = legacy[name]
    write_checkpoint(tmp_path, cfg, tensors)
    with pytest.raises(CheckpointError, match=f"one packing layout per checkpoint.*{name}"):
        open_checkpoint(tmp_path)


def test_w3_weight_shape_checked_at_read(tmp_path):
    cfg = tiny_config("w3")
    tensors = checkpoint_tensors(cfg, "w3")
    name = EXPERT.format(2, 1, "w1", "weight_shape")
    tensors[name] = ("I64", np.array([128, 128], np.int64))
    write_checkpoint(tmp_path, cfg, tensors)
    ck = open_checkpoint(tmp_path)
    ck.expert(2, 0)
    with pytest.raises(CheckpointError, match=rf"{_shard_of(tmp_path, name)}: tensor '{name}' "
                                              r"holds \[128, 128\].*\[128, 64\]"):
        ck.expert(2, 1)


def test_w4_recoded_reads(tmp_path):
    cfg = tiny_config(quantization_config=w3_qc(num_bits=4))
    tensors = checkpoint_tensors(cfg, "w3")
    for name, (dtype, a) in list(tensors.items()):
        if name.endswith("weight_packed"):  # 8 codes per word: cols/8 words
            tensors[name] = (dtype, np.zeros((a.shape[0], cfg.expert_shapes[
                "down" if ".w2." in name else "gate"][1] // 8), np.int32))
    write_checkpoint(tmp_path, cfg, tensors)
    ck = open_checkpoint(tmp_path)
    assert ck.codec.num_bits == 4
    assert ck.expert(1, 1).decode()["up"].shape == (128, 64)


def test_w3_asymmetric_requires_zero_points(tmp_path):
    cfg = tiny_config(quantization_config=w3_qc(symmetric=False))
    write_checkpoint(tmp_path, cfg, checkpoint_tensors(cfg, "w3"))
    with pytest.raises(CheckpointError, match=r"incomplete expert set.*lacks w1\.weight_zero_p"):
        open_checkpoint(tmp_path)


def test_w3_symmetric_rejects_zero_points(tmp_path):
    cfg = tiny_config("w3")
    tensors = checkpoint_tensors(cfg, "w3")
    name = EXPERT.format(1, 0, "w1", "weight_zero_point")
    tensors[name] = ("I32", np.zeros((12, 1), np.int32))
    write_checkpoint(tmp_path, cfg, tensors)
    with pytest.raises(CheckpointError, match=f"'{name}' does not belong to the w3 expert layout"):
        open_checkpoint(tmp_path)


def test_w3_g_idx_is_passed_and_applied(tmp_path):
    cfg = tiny_config("w3")
    tensors = checkpoint_tensors(cfg, "w3")
    name = EXPERT.format(1, 0, "w2", "weight_g_idx")
    g_idx = np.repeat([1, 0], 64).astype(np.int32)  # the two 64-column groups swapped
    tensors[name] = ("I32", g_idx)
    tensors[EXPERT.format(1, 0, "w2", "weight_scale")][1][:, 1] = 0x4000  # bf16 2.0 for group 1
    write_checkpoint(tmp_path, cfg, tensors)
    down = open_checkpoint(tmp_path).expert(1, 0).projections["down"]
    np.testing.assert_array_equal(down.parts["weight_g_idx"], g_idx)
    q, _ = down.codec.codes(down.parts, down.shape)
    np.testing.assert_array_equal(down.decode(), q * np.repeat([2.0, 1.0], 64))


def test_expert_arguments(tmp_path):
    ck = open_checkpoint(build(tmp_path, "bf16")[0])
    with pytest.raises(ValueError, match="layer 0 is not an MoE layer"):
        ck.expert(0, 0)
    with pytest.raises(ValueError, match="expert 8 is outside 0..7"):
        ck.expert(1, 8)
    with pytest.raises(KeyError, match="no tensor 'nope'"):
        ck.tensor("nope")


# ---- hostile inputs: each error names the file and/or tensor at fault ----


def test_missing_shard(tmp_path):
    root = build(tmp_path, "mxfp4")[0]
    (root / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match=rf"{INDEX}: shard 'model-00002-of-00003.safetensors'"
                                              " is missing"):
        open_checkpoint(root)


def test_tensor_missing_from_its_shard(tmp_path):
    root, cfg, tensors = build(tmp_path, "mxfp4")
    name = "language_model.model.norm.weight"
    shard = _shard_of(root, name)
    del tensors[name]
    write_checkpoint(root, cfg, tensors)
    index = json.loads((root / INDEX).read_text())
    index["weight_map"][name] = shard
    (root / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"{shard}: tensor '{name}', which {INDEX} places"):
        open_checkpoint(root)


def test_tensor_in_two_shards(tmp_path):
    root, cfg, tensors = build(tmp_path, "mxfp4", shards=0)
    name = EXPERT.format(2, 2, "w3", "weight_scale")
    write_safetensors(root / "extra.safetensors", {name: tensors[name]})
    weight_map = dict.fromkeys(tensors, "model.safetensors")
    index = {"weight_map": {**weight_map, name: "extra.safetensors"}}
    (root / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"'{name}' is in two shards: extra.safetensors and "
                                              "model.safetensors"):
        open_checkpoint(root)


def test_tensor_not_in_index(tmp_path):
    root = build(tmp_path, "bf16")[0]
    index = json.loads((root / INDEX).read_text())
    name = "language_model.model.norm.weight"
    shard = index["weight_map"].pop(name)
    (root / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"{shard}: tensor '{name}' is not listed in {INDEX}"):
        open_checkpoint(root)


@pytest.mark.parametrize("bad", ["../model.safetensors", "sub/x.safetensors", ""])
def test_shard_name_outside_the_directory(tmp_path, bad):
    root = build(tmp_path, "bf16")[0]
    index = json.loads((root / INDEX).read_text())
    index["weight_map"]["language_model.model.norm.weight"] = bad
    (root / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="is not a plain file name"):
        open_checkpoint(root)


def test_bad_index_and_missing_files(tmp_path):
    root = build(tmp_path, "bf16")[0]
    (root / INDEX).write_text('{"weight_map": {"a": 1}}')
    with pytest.raises(CheckpointError, match="weight_map must map tensor names to shard"):
        open_checkpoint(root)
    (root / INDEX).write_text('{"weight_map": {}, "weight_map": {}}')
    with pytest.raises(CheckpointError, match=f"{INDEX}: not valid JSON: duplicate key"):
        open_checkpoint(root)
    (root / INDEX).unlink()
    with pytest.raises(CheckpointError, match=f"neither {INDEX} nor model.safetensors"):
        open_checkpoint(root)
    (root / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json: file not found"):
        open_checkpoint(root)
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        open_checkpoint(root / "config.json")


@pytest.mark.parametrize("layout, name, bad, message", [
    ("mxfp4", EXPERT.format(3, 4, "w2", "weight_packed"), ("U8", (64, 32)),
     r"is U8\[64, 32\], expected U8\[64, 64\]"),
    ("mxfp4", EXPERT.format(3, 4, "w1", "weight_scale"), ("I8", (128, 2)),
     r"is I8\[128, 2\], expected U8\[128, 2\]"),
    ("w3", EXPERT.format(5, 0, "w3", "weight_scale"), ("F32", (128, 1)),
     r"is F32\[128, 1\], expected BF16\[128, 1\]"),
    ("t158", "model.layers.2.mlp.switch_mlp.up_proj.scales", ("F32", (8, 128, 1)),
     r"is F32\[8, 128, 1\], expected BF16\|U16\[8, 128, 1\]"),
    ("bf16", "language_model.model.layers.4.block_sparse_moe.gate.weight", ("BF16", (8, 64)),
     r"is BF16\[8, 64\], the config requires BF16\[8, 128\]"),
    ("bf16", "language_model.model.layers.0.self_attn.dt_bias", ("BF16", (64,)),
     r"is BF16\[64\], the config requires F32\[64\]"),
])
def test_wrong_shape_or_dtype(tmp_path, layout, name, bad, message):
    cfg = tiny_config(layout)
    tensors = checkpoint_tensors(cfg, layout)
    dtype, shape = bad
    tensors[name] = (dtype, np.zeros(shape, {"U8": np.uint8, "I8": np.int8, "F32": np.float32,
                                             "BF16": np.uint16}[dtype]))
    write_checkpoint(tmp_path, cfg, tensors, form="flat" if layout == "t158" else "official")
    with pytest.raises(CheckpointError, match=rf"{_shard_of(tmp_path, name)}: tensor '{name}' "
                                              + message):
        open_checkpoint(tmp_path)


@pytest.mark.parametrize("shape, ok", [((128,), True), ((1, 1, 4, 1), True), ((4,), True),
                                       ((2, 64), False), ((96,), False)])
def test_a_log_shapes(tmp_path, shape, ok):
    cfg = tiny_config("bf16")
    tensors = checkpoint_tensors(cfg, "bf16")
    name = "language_model.model.layers.1.self_attn.A_log"
    tensors[name] = ("F32", np.zeros(shape, np.float32))
    write_checkpoint(tmp_path, cfg, tensors)
    if ok:
        open_checkpoint(tmp_path)
    else:
        with pytest.raises(CheckpointError, match=f"tensor '{name}' is F32"):
            open_checkpoint(tmp_path)


def test_config_with_more_experts_than_present(tmp_path):
    cfg, written = tiny_config("mxfp4"), tiny_config("mxfp4", num_experts=16)
    write_checkpoint(tmp_path, written, checkpoint_tensors(cfg, "mxfp4"),
                     config_dict=written.to_official_dict())
    with pytest.raises(CheckpointError, match=r"40 of 80 experts absent or incomplete: layer 1 "
                                              r"experts 8-15 absent; layer 2 experts 8-15 absent"):
        open_checkpoint(tmp_path)


def test_config_with_fewer_experts_than_present(tmp_path):
    cfg = tiny_config("bf16")
    write_checkpoint(tmp_path, cfg, checkpoint_tensors(cfg, "bf16"),
                     config_dict=replace(cfg, num_experts=4).to_official_dict())
    with pytest.raises(CheckpointError, match=r"experts\.4\..*is for expert 4, but the config has "
                                              "num_experts 4"):
        open_checkpoint(tmp_path)


def test_config_hidden_size_mismatch(tmp_path):
    cfg = tiny_config("t158")
    write_checkpoint(tmp_path, cfg, checkpoint_tensors(cfg, "t158"),
                     config_dict=replace(cfg, hidden_size=256).to_flat_dict())
    with pytest.raises(CheckpointError, match=r"embed_tokens.weight' is BF16\[512, 128\], the "
                                              r"config requires BF16\[512, 256\]"):
        open_checkpoint(tmp_path)


def test_config_expert_width_mismatch(tmp_path):
    cfg = tiny_config("t158")
    write_checkpoint(tmp_path, cfg, checkpoint_tensors(cfg, "t158"),
                     config_dict=replace(cfg, moe_intermediate_size=192).to_flat_dict())
    with pytest.raises(CheckpointError, match=r"gate_proj.packed' is U8\[8, 128, 13\], expected "
                                              r"U8\[8, 192, 13\]"):
        open_checkpoint(tmp_path)


def test_config_expert_shape_the_codec_cannot_hold(tmp_path):
    cfg = tiny_config("t158")
    write_checkpoint(tmp_path, cfg, checkpoint_tensors(cfg, "t158"),
                     config_dict=replace(cfg, routed_expert_hidden_size=96).to_flat_dict())
    with pytest.raises(CheckpointError, match="expert shapes .* do not fit the t158 codec"):
        open_checkpoint(tmp_path)


def test_experts_on_a_dense_layer(tmp_path):
    cfg = tiny_config("bf16")
    tensors = checkpoint_tensors(cfg, "bf16")
    name = EXPERT.format(0, 0, "w1", "weight")
    tensors[name] = ("BF16", np.zeros((128, 64), np.uint16))
    write_checkpoint(tmp_path, cfg, tensors)
    with pytest.raises(CheckpointError, match=f"'{name}' is for layer 0, which is not an MoE"):
        open_checkpoint(tmp_path)


def test_incomplete_expert_set(tmp_path):
    cfg = tiny_config("mxfp4")
    tensors = checkpoint_tensors(cfg, "mxfp4")
    del tensors[EXPERT.format(3, 5, "w2", "weight_scale")]
    for e in (0, 6, 7):
        prefix = f"language_model.model.layers.2.block_sparse_moe.experts.{e}."
        tensors = {n: t for n, t in tensors.items() if not n.startswith(prefix)}
    for suffix in ("weight_packed", "weight_scale"):
        del tensors[EXPERT.format(5, 7, "w3", suffix)]
    write_checkpoint(tmp_path, cfg, tensors)
    with pytest.raises(CheckpointError, match=r"incomplete expert set, 5 of 40 experts absent or "
                       r"incomplete: layer 2 experts 0, 6-7 absent; layer 3 expert 5 lacks "
                       r"w2.weight_scale; layer 5 expert 7 lacks w3.weight_packed, "
                       r"w3.weight_scale"):
        open_checkpoint(tmp_path)


def test_t158_incomplete(tmp_path):
    cfg = tiny_config()
    tensors = checkpoint_tensors(cfg, "t158")
    del tensors["model.layers.4.mlp.switch_mlp.down_proj.scales"]
    write_checkpoint(tmp_path, cfg, tensors, form="flat")
    with pytest.raises(CheckpointError, match=r"1 of 5 layers absent or incomplete: layer 4 lacks "
                                              r"down_proj.scales"):
        open_checkpoint(tmp_path)


def test_missing_resident(tmp_path):
    cfg = tiny_config("bf16")
    tensors = checkpoint_tensors(cfg, "bf16")
    del tensors["language_model.lm_head.weight"]
    write_checkpoint(tmp_path, cfg, tensors)
    with pytest.raises(CheckpointError, match="1 required tensors are missing: language_model.lm"):
        open_checkpoint(tmp_path)
    tied = replace(cfg, tie_word_embeddings=True)
    write_checkpoint(tmp_path, tied, tensors)
    assert open_checkpoint(tmp_path).config.tie_word_embeddings


@pytest.mark.parametrize("other", ["bf16", "t158", "w3"])
def test_mixed_expert_layouts(tmp_path, other):
    cfg = tiny_config("mxfp4")
    tensors = checkpoint_tensors(cfg, "mxfp4")
    extra = checkpoint_tensors(cfg, other)
    name = next(n for n in sorted(extra) if "switch_mlp" in n or ".experts." in n)
    tensors[name] = extra[name]
    write_checkpoint(tmp_path, cfg, tensors)
    with pytest.raises(CheckpointError, match=f"mixed routed-expert layouts: .*{other} \\({name}"):
        open_checkpoint(tmp_path)


def test_no_expert_tensors(tmp_path):
    cfg = tiny_config()
    tensors = {n: t for n, t in checkpoint_tensors(cfg, "bf16").items() if ".experts." not in n}
    write_checkpoint(tmp_path, cfg, tensors, shards=0)
    with pytest.raises(CheckpointError, match="no routed-expert tensors of a known layout"):
        open_checkpoint(tmp_path)


@pytest.mark.parametrize("layout, qc, message", [
    ("mxfp4", None, "quantization_config format is not 'mxfp4-pack-quantized'"),
    ("mxfp4", w3_qc(), "quantization_config format is not 'mxfp4-pack-quantized'"),
    ("w3", None, "I32 weight_packed\\) but the config has no quantization_config"),
    ("w3", MXFP4_QC, "quantization_config: .*format is 'mxfp4-pack-quantized'"),
    ("bf16", MXFP4_QC, "quantization_config \\('mxfp4-pack-quantized'\\) but the routed experts"),
    ("t158", w3_qc(), "quantization_config \\('pack-quantized'\\) but the routed experts are t158"),
])
def test_config_quantization_contradicts_tensors(tmp_path, layout, qc, message):
    cfg = tiny_config(layout)
    write_checkpoint(tmp_path, cfg, checkpoint_tensors(cfg, layout),
                     config_dict=replace(cfg, quantization_config=qc).to_official_dict())
    with pytest.raises(CheckpointError, match=message):
        open_checkpoint(tmp_path)


def test_kimi_linear_config_is_refused(tmp_path):
    root, cfg, _ = build(tmp_path, "t158")
    d = cfg.to_flat_dict()
    del d["routed_expert_hidden_size"], d["attn_res_block_size"]
    (root / "config.json").write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match="config.json: this is Kimi-Linear, not Kimi K3"):
        open_checkpoint(root)


def _corrupt(path, how):
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    if how == "truncated":
        return path.write_bytes(raw[:-100])
    if how == "header_too_large":
        return path.write_bytes((10**9).to_bytes(8, "little") + raw[8:])
    if how == "header_not_json":
        return path.write_bytes(raw[:8] + b"{" * n + raw[8 + n:])
    if how == "duplicate_keys":
        text = raw[8:8 + n].decode().rstrip()
        first = next(iter(header))
        dup = text[:-1] + f',"{first}":' + json.dumps(header[first]) + "}"
    else:  # overlapping data_offsets: the second tensor starts inside the first
        a, b = sorted(header, key=lambda k: header[k]["data_offsets"][0])[:2]
        header[b]["data_offsets"] = [x - 2 for x in header[b]["data_offsets"]]
        dup = json.dumps(header, separators=(",", ":"))
    new = dup.encode() + b" " * (-len(dup) % 8)
    path.write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + n:])


@pytest.mark.parametrize("how, message", [
    ("truncated", "truncated"),
    ("header_too_large", "header length 1000000000 exceeds"),
    ("header_not_json", "header is not valid JSON"),
    ("duplicate_keys", "header is not valid JSON: duplicate key"),
    ("overlapping", "overlaps another tensor"),
])
def test_corrupt_shard(tmp_path, how, message):
    root = build(tmp_path, "mxfp4")[0]
    shard = root / "model-00003-of-00003.safetensors"
    _corrupt(shard, how)
    with pytest.raises(CheckpointError, match=f"{shard}: .*{message}"):
        open_checkpoint(root)
