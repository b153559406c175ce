"""The GGUF Q2_K source reader (checkpoint/gguf_source.py, FORMAT.md "q2k") on the tiny GGUF
fixture: residents and experts against gguf-py's own reader and dequantizer, one pread per
projection, and hostile files rejected with errors naming the file."""

import json
import os
import shutil
import struct

import numpy as np
import pytest

from mtplx_runtime.checkpoint import CheckpointError, resident_tensor_specs
from mtplx_runtime.checkpoint import gguf_source as gs
from mtplx_runtime.checkpoint.gguf_source import open_gguf_source
from mtplx_runtime.fixtures.tiny_gguf import make_tiny_gguf, tiny_gguf_config
from mtplx_runtime.fixtures.tiny_weights import trunk_tensors
from mtplx_runtime.formats.q2k import Q2KCodec

gguf = pytest.importorskip("gguf")

FILE1, FILE2 = "tiny-k3-00001-of-00002.gguf", "tiny-k3-00002-of-00002.gguf"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_gguf(tmp_path_factory.mktemp("tiny_gguf"), seed=3)


@pytest.fixture
def copy(tiny, tmp_path):
    out = tmp_path / "src"
    shutil.copytree(tiny.path, out)
    return out


def _patch_entry(path, name: str, dims=None, gtype=None, new_name: str | None = None):
    """Rewrite one tensor-info entry of a GGUF header in place (same byte length)."""
    raw = bytearray(path.read_bytes())
    key = struct.pack("<Q", len(name)) + name.encode()
    at = raw.index(key) + len(key)
    if new_name is not None:
        assert len(new_name) == len(name)
        raw[at - len(name):at] = new_name.encode()
    ndims = struct.unpack_from("<I", raw, at)[0]
    if dims is not None:
        assert len(dims) == ndims
        struct.pack_into(f"<{ndims}Q", raw, at + 4, *dims)
    if gtype is not None:
        struct.pack_into("<I", raw, at + 4 + 8 * ndims, gtype)
    path.write_bytes(bytes(raw))


def test_opens_with_the_checkpoint_surface(tiny):
    cfg = tiny_gguf_config()
    with open_gguf_source(tiny.path) as src:
        assert src.layout == "q2k" and isinstance(src.codec, Q2KCodec)
        assert src.config == cfg and src.path == tiny.path
        assert [p.name for p in src.source_files()] == [FILE1, FILE2]
        specs = resident_tensor_specs(cfg)
        assert src.tensor_names() == sorted(specs)
        trunk = trunk_tensors(cfg, tiny.seed)
        for name, (dtype, arr) in trunk.items():
            info = src.tensor_info(name)
            assert (info.name, info.dtype, info.shape) == (name, dtype, arr.shape)
            np.testing.assert_array_equal(src.tensor(name), arr)
        # Offsets and GGUF dims as gguf-py's reader sees them (shape = dims reversed).
        for path in src.source_files():
            for t in gguf.GGUFReader(path).tensors:
                if t.tensor_type == gguf.GGMLQuantizationType.Q2_K:
                    continue
                info = src.tensor_info(t.name)
                assert info.start == t.data_offset and info.end == t.data_offset + t.n_bytes
                assert info.shape == tuple(reversed(t.shape.tolist()))
        with pytest.raises(KeyError, match="no resident tensor"):
            src.tensor("blk.1.ffn_gate_exps.weight")
        with pytest.raises(ValueError, match="not an MoE layer"):
            src.expert(0, 0)
        with pytest.raises(ValueError, match="outside"):
            src.expert(1, cfg.num_experts)
        assert len(src.resident_descriptor_sha256()) == 64


def test_every_expert_matches_gguf_dequantization(tiny):
    cfg = tiny.config
    with open_gguf_source(tiny.path) as src:
        for path in src.source_files():
            for t in gguf.GGUFReader(path).tensors:
                if t.tensor_type != gguf.GGMLQuantizationType.Q2_K:
                    continue
                layer, proj = int(t.name.split(".")[1]), t.name.split("_")[1]
                whole = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
                assert whole.shape == (cfg.num_experts, *cfg.expert_shapes[proj])
                for e in range(cfg.num_experts):
                    rec = src.expert(layer, e)
                    got = rec.decode()[proj]
                    np.testing.assert_array_equal(got.view(np.uint32), whole[e].view(np.uint32))
                    f, start, n = src.expert_extent(layer, e, proj)
                    assert f == path and n == t.n_bytes // cfg.num_experts
                    assert start == t.data_offset + e * n
                    assert rec.projections[proj].parts["weight"].tobytes() == \
                        np.asarray(t.data[e]).tobytes()


def test_one_pread_per_projection(tiny, monkeypatch):
    calls = []
    real = os.pread
    monkeypatch.setattr(gs.os, "pread", lambda fd, n, off: calls.append(n) or real(fd, n, off))
    with open_gguf_source(tiny.path) as src:
        calls.clear()
        src.expert(2, 5)
        assert calls == [256 * 256 // 256 * 84] * 3


def test_deterministic(tiny, tmp_path):
    again = make_tiny_gguf(tmp_path / "again", seed=tiny.seed)
    for a, b in zip(tiny.files, again.files):
        assert a.read_bytes() == b.read_bytes()
    assert (tiny.path / "config.json").read_bytes() == (again.path / "config.json").read_bytes()


def test_missing_shard(copy):
    (copy / FILE2).unlink()
    with pytest.raises(CheckpointError, match=f"missing: {FILE2}"):
        open_gguf_source(copy)


def test_swapped_shards_fail_split_check(copy):
    (copy / FILE1).rename(copy / "tmp")
    (copy / FILE2).rename(copy / FILE1)
    (copy / "tmp").rename(copy / FILE2)
    with pytest.raises(CheckpointError, match=f"{FILE1}: split.no 1"):
        open_gguf_source(copy)


def test_stray_gguf_file(copy):
    shutil.copy(copy / FILE1, copy / "extra.gguf")
    with pytest.raises(CheckpointError, match="extra.gguf: not named like a split GGUF shard"):
        open_gguf_source(copy)


def test_wrong_tensor_type(copy):
    _patch_entry(copy / FILE1, "blk.1.ffn_up_exps.weight", gtype=1)  # F16
    with pytest.raises(CheckpointError, match=f"{FILE1}: tensor 'blk.1.ffn_up_exps.weight' "
                                              f"has GGML type 1"):
        open_gguf_source(copy)


def test_wrong_dims_vs_config(copy):
    _patch_entry(copy / FILE2, "blk.4.ffn_down_exps.weight", dims=(256, 512, 4))  # same bytes
    with pytest.raises(CheckpointError, match=f"{FILE2}: tensor 'blk.4.ffn_down_exps.weight' has "
                                              r"GGUF dims \[256, 512, 4\]"):
        open_gguf_source(copy)


def test_config_disagreeing_with_experts(copy):
    d = json.loads((copy / "config.json").read_text())
    d["text_config"]["moe_intermediate_size"] = 512
    (copy / "config.json").write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match=r"\.gguf: tensor 'blk\.\d\.ffn_\w+_exps\.weight' "
                                              r"has GGUF dims"):
        open_gguf_source(copy)


def test_expert_name_outside_the_config(copy):
    _patch_entry(copy / FILE2, "blk.5.ffn_gate_exps.weight", new_name="blk.7.ffn_gate_exps.weight")
    with pytest.raises(CheckpointError, match=f"{FILE2}: tensor 'blk.7.ffn_gate_exps.weight' is "
                                              f"for layer 7"):
        open_gguf_source(copy)


def test_q2k_tensor_that_is_not_an_expert(copy):
    _patch_entry(copy / FILE1, "blk.2.ffn_up_exps.weight", new_name="blk.2.ffn_up_expz.weight")
    with pytest.raises(CheckpointError, match=f"{FILE1}: tensor 'blk.2.ffn_up_expz.weight' is "
                                              f"Q2_K but is not a routed expert"):
        open_gguf_source(copy)


def test_truncated_file(copy):
    path = copy / FILE2
    os.truncate(path, path.stat().st_size - 100)
    with pytest.raises(CheckpointError, match=f"{FILE2}: truncated: tensor"):
        open_gguf_source(copy)
    os.truncate(path, 40)
    with pytest.raises(CheckpointError, match=f"{FILE2}: truncated header"):
        open_gguf_source(copy)


def test_bad_magic_and_version(copy):
    raw = bytearray((copy / FILE1).read_bytes())
    (copy / FILE1).write_bytes(b"GGUX" + raw[4:])
    with pytest.raises(CheckpointError, match=f"{FILE1}: not a GGUF file"):
        open_gguf_source(copy)
    (copy / FILE1).write_bytes(raw[:4] + struct.pack("<I", 2) + raw[8:])
    with pytest.raises(CheckpointError, match=f"{FILE1}: GGUF version 2"):
        open_gguf_source(copy)


def test_overlapping_tensors(copy):
    # Point the second tensor of file 1 at the first one's offset.
    t0, t1 = gguf.GGUFReader(copy / FILE1).tensors[:2]
    raw = bytearray((copy / FILE1).read_bytes())
    key = struct.pack("<Q", len(t1.name)) + t1.name.encode()
    at = raw.index(key) + len(key) + 4 + 8 * len(t1.shape) + 4
    struct.pack_into("<Q", raw, at, struct.unpack_from("<Q", raw, at)[0] - 32 * (
        (t0.n_bytes + 31) // 32))
    (copy / FILE1).write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=f"{FILE1}: tensor .* overlaps"):
        open_gguf_source(copy)
