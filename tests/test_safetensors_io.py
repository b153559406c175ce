"""The lazy safetensors reader/writer: interop with the safetensors library and malformed files.

Checkpoint-level hostile inputs (missing shards, wrong shapes) are in test_checkpoint_reader.py;
this file covers the container itself.
"""

import json
import os

import numpy as np
import pytest
import safetensors.numpy
import torch
from safetensors.torch import save_file

from mtplx_runtime.checkpoint.safetensors_io import (
    CheckpointError,
    SafetensorsFile,
    write_safetensors,
)


def _raw(path, header: dict, data: bytes, pad=True):
    raw = json.dumps(header).encode()
    if pad:
        raw += b" " * (-len(raw) % 8)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    return path


def test_written_file_loads_in_safetensors_library(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {
        "a.f32": ("F32", rng.standard_normal((3, 5)).astype(np.float32)),
        "b.i32": ("I32", rng.integers(-9, 9, (7,), dtype=np.int32)),
        "c.u8": ("U8", rng.integers(0, 255, (2, 2, 3), dtype=np.uint8)),
    }
    p = tmp_path / "x.safetensors"
    write_safetensors(p, arrays, metadata={"format": "pt"})
    loaded = safetensors.numpy.load_file(str(p))
    assert set(loaded) == set(arrays)
    for k, (_, a) in arrays.items():
        np.testing.assert_array_equal(loaded[k], a)
    with SafetensorsFile(p) as f:
        assert f.metadata == {"format": "pt"}
        np.testing.assert_array_equal(f.read("b.i32"), arrays["b.i32"][1])
    assert [p.name for p in tmp_path.iterdir()] == ["x.safetensors"]  # no temporary file left


def test_reads_library_written_bf16_as_bits(tmp_path):
    t = torch.tensor([[1.0, -2.5], [0.15625, 3.0e-3]], dtype=torch.bfloat16)
    p = tmp_path / "bf.safetensors"
    save_file({"w": t}, str(p))
    with SafetensorsFile(p) as f:
        bits = f.read("w")
        assert f.info("w").dtype == "BF16" and bits.dtype == np.uint16
        np.testing.assert_array_equal(bits, t.view(torch.int16).numpy().view(np.uint16))


def test_reading_one_tensor_reads_only_its_bytes(tmp_path, monkeypatch):
    p = tmp_path / "big.safetensors"
    write_safetensors(p, {"small": ("U8", np.arange(16, dtype=np.uint8)),
                          "zbig": ("U8", np.zeros(1 << 20, dtype=np.uint8))})
    sizes = []
    real = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, off: sizes.append(n) or real(fd, n, off))
    with SafetensorsFile(p) as f:
        assert f.read("small").tolist() == list(range(16))
    assert max(sizes) < 4096  # the 8-byte length, the header, the 16-byte tensor


def _entry(dtype="F32", shape=(2,), offsets=(0, 8), **extra):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets), **extra}


@pytest.mark.parametrize(
    "header,data,needle",
    [
        ({"t": _entry()}, b"\0" * 12, "trailing bytes"),
        ({"t": _entry(offsets=(4, 12))}, b"\0" * 12, "hole"),
        ({"t": _entry(), "u": _entry("U8", (4,), (4, 8))}, b"\0" * 8, "overlaps"),
        ({"t": _entry(shape=(3,))}, b"\0" * 8, "needs 12 bytes"),
        ({"t": _entry("Q4")}, b"\0" * 8, "unknown dtype"),
        ({"t": _entry(shape=(-2,))}, b"\0" * 8, "bad shape"),
        ({"t": _entry(x=1)}, b"\0" * 8, "exactly"),
        ({"t": _entry(shape=(4,), offsets=(0, 16))}, b"\0" * 8, "truncated"),
        ({"__metadata__": {"k": 1}}, b"", "__metadata__"),
        ([1, 2], b"", "not a JSON object"),
    ],
)
def test_malformed_files_name_the_file(tmp_path, header, data, needle):
    p = _raw(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(CheckpointError, match=needle) as e:
        SafetensorsFile(p)
    assert str(p) in str(e.value)


def test_header_limits_and_garbage(tmp_path):
    p = tmp_path / "h.safetensors"
    p.write_bytes((200_000_000).to_bytes(8, "little") + b"{}")
    with pytest.raises(CheckpointError, match="exceeds"):
        SafetensorsFile(p)
    p.write_bytes((64).to_bytes(8, "little") + b"{}")
    with pytest.raises(CheckpointError, match="truncated"):
        SafetensorsFile(p)
    p.write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="truncated"):
        SafetensorsFile(p)
    p.write_bytes((8).to_bytes(8, "little") + b"\xff\xfe{}    ")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        SafetensorsFile(p)
    one = b'{"dtype":"U8","shape":[1],"data_offsets":[0,1]}'
    raw = b'{"a":' + one + b',"a":' + one + b"}"
    p.write_bytes(len(raw).to_bytes(8, "little") + raw + b"\0")
    with pytest.raises(CheckpointError, match="duplicate key"):
        SafetensorsFile(p)
    with pytest.raises(CheckpointError, match="file not found"):
        SafetensorsFile(tmp_path / "absent.safetensors")


def test_file_shrinking_after_open_is_a_clear_error(tmp_path):
    p = tmp_path / "s.safetensors"
    write_safetensors(p, {"t": ("U8", np.arange(64, dtype=np.uint8))})
    with SafetensorsFile(p) as f:
        os.truncate(p, os.path.getsize(p) - 10)
        with pytest.raises(CheckpointError, match="short read"):
            f.read("t")
