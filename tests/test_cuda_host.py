"""The CUDA kernels' per-lane code on the CPU (kernels/native/codecs.cuh through
tests/cuda_host/harness.cc, built with the system C++ compiler): device layouts (t158 and ct-int3
repacks), loads, dequant, the k order of the staged activations and the MMA fragment layout,
driven tile by tile, chunk by chunk as gemv.cuh drives them, against the codecs' NumPy decode.
A wrong offset, nibble, table entry, PRMT selector or scale is a wrong product here, without a
GPU. What this cannot see (thread and block indexing, shared memory, barriers) the GPU tests
check: tests/test_cuda_kernels.py, `-m cuda`.

Shapes: K3's (one 16-row tile of gate [.., 3584] and down [.., 3072]) and odd ones whose last
column chunk is partial (t158 and ct-int3 chunks hold 256 columns, the 4-bit ones 128, int8/fp8
and fp8-block 64), so the byte-by-byte t158 path and lanes without columns run too; fp8-block also
over several 128 x 128 scale blocks, partial ones included.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from mtplx_runtime.formats import get_codec
from mtplx_runtime.formats.record import mode_codec
from mtplx_runtime.formats.resident_quant import encode_fp8, encode_int4, encode_int8

ROOT = Path(__file__).resolve().parent.parent
NATIVE = ROOT / "mtplx_runtime" / "kernels" / "native"
CODEC_ID = {"t158": 0, "mxfp4": 1, "ct-int3": 2, "ct-int4": 3, "int8": 4, "fp8": 5, "int4": 6,
            "ct-int4-g32": 7, "fp8-block": 8}
EXPERT_CODECS = ["t158", "mxfp4", "ct-int3", "ct-int4", "ct-int4-g32", "fp8-block"]
SHAPES = [(16, 3584), (16, 3072), (48, 192), (32, 832), (16, 64)]


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    out = tmp_path_factory.mktemp("cuda_host") / "harness.so"
    subprocess.run([cxx, "-O2", "-std=c++17", "-shared", "-fPIC", "-Wall", "-Werror",
                    "-Wno-unknown-pragmas", f"-I{NATIVE}",
                    str(ROOT / "tests" / "cuda_host" / "harness.cc"), "-o", str(out)],
                   check=True, capture_output=True, text=True)
    so = ctypes.CDLL(str(out))
    so.mtplx_emulate.restype = ctypes.c_int
    so.mtplx_prmt.restype = so.mtplx_bf16x2_fma.restype = ctypes.c_uint32
    for f in (so.mtplx_prmt, so.mtplx_bf16x2_fma):
        f.argtypes = [ctypes.c_uint32] * 3
    return so


def ptr(a: np.ndarray | None):
    return None if a is None else a.ctypes.data_as(ctypes.c_void_p)


def emulate(lib, codec, packed, scale, zero, rows, cols, x, parts):
    x = np.ascontiguousarray(x, np.float32)
    y = np.full((x.shape[0], rows), np.nan, np.float32)  # every output must be written
    rc = lib.mtplx_emulate(CODEC_ID[codec], ptr(packed), ptr(scale), ptr(zero), rows, cols,
                           ptr(x), x.shape[0], parts, ptr(y))
    assert rc == 0
    return y


def bf16_values(a: np.ndarray) -> np.ndarray:
    return torch.from_numpy(a).to(torch.bfloat16).float().numpy()


def device_parts(lib, codec, parts, rows, cols):
    """(packed, scale) of one expert matrix as the device slot holds it (after the repack)."""
    if codec == "t158":
        packed, scale = (np.ascontiguousarray(parts[k]) for k in ("packed", "scales"))
        out_p, out_s = np.zeros_like(packed), np.zeros_like(scale)
        lib.mtplx_t158_repack(ptr(packed), ptr(scale), ptr(out_p), ptr(out_s), rows, cols)
        return out_p, out_s
    if codec == "fp8-block":
        return (np.ascontiguousarray(parts[k]) for k in ("weight", "weight_scale_inv"))
    packed = np.ascontiguousarray(parts["weight_packed"]).copy()
    if codec == "ct-int3":
        lib.mtplx_ctint3_repack(ptr(packed), rows, cols)
    return packed, np.ascontiguousarray(parts["weight_scale"])


def expert_codec(codec):
    if codec == "ct-int4-g32":
        return mode_codec("ct-int", 4, 32)
    return mode_codec("ct-int", int(codec[-1])) if codec.startswith("ct-int") else get_codec(codec)


def kernel_weights(lib, codec, packed, scale, rows, cols):
    """float64 [rows, cols]: the weights the kernel's A fragments hold, read back through the
    MMA with unit activation vectors (one product per sum: exact), 32 columns a call."""
    w = np.zeros((rows, cols))
    for c0 in range(0, cols, 32):
        n = min(32, cols - c0)
        x = np.zeros((n, cols), np.float32)
        x[np.arange(n), c0 + np.arange(n)] = 1.0
        w[:, c0:c0 + n] = emulate(lib, codec, packed, scale, None, rows, cols, x, 1).T
    return w


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{r}x{c}" for r, c in SHAPES])
@pytest.mark.parametrize("codec", EXPERT_CODECS)
def test_expert_matrices_match_the_codec_decode(lib, codec, shape):
    """fp32 activations as three bf16 terms: within fp32 rounding of the float64 product with the
    reference decode; bf16 activations (one term): the same bound. Columns outside a partial
    chunk contribute nothing (NaN-free zeros)."""
    rows, cols = shape
    rng = np.random.default_rng(rows * 7 + cols)
    c = expert_codec(codec)
    parts = c.encode((rng.standard_normal(shape) * 0.05).astype(np.float32))
    w = c.decode(parts, shape).astype(np.float64)  # [rows, cols]
    packed, scale = device_parts(lib, codec, parts, rows, cols)
    for T, parts_n in ((1, 3), (5, 3), (13, 1), (32, 1)):
        x = rng.standard_normal((T, cols)).astype(np.float32)
        if parts_n == 1:
            x = bf16_values(x)
        y = emulate(lib, codec, packed, scale, None, rows, cols, x, parts_n)
        want = x.astype(np.float64) @ w.T
        err = np.abs(y - want).max() / np.abs(want).max()
        assert err < 2e-6, (T, parts_n, err)


@pytest.mark.parametrize("codec,shape", [("fp8-block", (272, 400)), ("fp8-block", (16, 7168)),
                                         ("ct-int4-g32", (32, 2048)), ("ct-int4", (32, 832))])
def test_kernel_weights_are_the_reference_decode_bit_for_bit(lib, codec, shape):
    """The folded weights equal the codec's decode exactly: fp8-block's bf16_rne(e4m3 * s) with
    the fp32 scale of each 128 x 128 block (272 rows: three row blocks, the last partial; 400
    columns: a partial column block and a partial chunk), ct-int4's q * s per group of 32 or 64
    columns. Blocks and groups get scales a factor 2^k apart, so reading a neighbour's scale, or
    scaling the sums instead of rounding each weight, changes the values."""
    rows, cols = shape
    rng = np.random.default_rng(rows + cols)
    c = expert_codec(codec)
    group = 128 if codec == "fp8-block" else c.group_size
    spread = 2.0 ** rng.integers(-3, 4, (-(-rows // 128) if codec == "fp8-block" else rows,
                                         -(-cols // group)))
    if codec == "fp8-block":
        spread = np.repeat(spread, 128, axis=0)[:rows]
    spread = np.repeat(spread, group, axis=1)[:, :cols]
    parts = c.encode((rng.standard_normal(shape) * 0.05 * spread).astype(np.float32))
    want = c.decode(parts, shape).astype(np.float64)
    packed, scale = device_parts(lib, codec, parts, rows, cols)
    np.testing.assert_array_equal(kernel_weights(lib, codec, packed, scale, rows, cols), want)


def test_t158_bytes_243_and_up_and_the_padding_digit(lib):
    """Every byte value, digit 4 of byte 12 included (it must not count): random bytes decode
    as FORMAT.md's formula says, through the table, on a 16 x 128 matrix."""
    rows, cols = 16, 128
    rng = np.random.default_rng(3)
    packed = rng.integers(0, 256, (rows, 13 * cols // 64), dtype=np.uint8)
    packed[:, 12] = 255  # digit 4 of 255 is 0 (255 = 243 + 12), digits 0..3 of 12: 0 1 1 0
    scales = np.full((rows, cols // 64), 0x3F80, np.uint16)  # 1.0
    w = get_codec("t158").decode({"packed": packed, "scales": scales}, (rows, cols))
    dp, ds = device_parts(lib, "t158", {"packed": packed, "scales": scales}, rows, cols)
    x = bf16_values(rng.standard_normal((3, cols)).astype(np.float32))
    y = emulate(lib, "t158", dp, ds, None, rows, cols, x, 1)
    np.testing.assert_allclose(y, x.astype(np.float64) @ w.T.astype(np.float64), rtol=0,
                               atol=1e-5)


def test_t158_table_is_the_digits(lib):
    out = np.zeros(512, np.uint32)
    lib.mtplx_t158_lut(ptr(out))
    hb = {0: 0xC0, 1: 0x00, 2: 0x40}  # bf16 high bytes of -2, 0, +2
    for v in range(256):
        d = [(v // 3 ** k) % 3 for k in range(5)]
        assert out[2 * v] == sum(hb[d[k]] << 8 * k for k in range(4)), v
        assert out[2 * v + 1] == hb[d[4]], v


def test_ptx_emulations(lib):
    """PRMT picks bytes by selector nibble; the bf16x2 fma rounds the exact a * b + c once to
    nearest-even, per half, subnormals kept (what fma.rn.bf16x2 does)."""
    assert lib.mtplx_prmt(0x33221100, 0x77665544, 0x1505) == 0x11550055
    assert lib.mtplx_prmt(0x33221100, 0x77665544, 0x7340) == 0x77334400
    one, three, half_ulp = 0x3F80, 0x4040, 0x3B80  # 1.0, 3.0, 2^-8
    pair = lambda lo, hi: lo | hi << 16  # noqa: E731
    # 1 + 2^-8 is a tie between 1 and 1 + 2^-7: to even (1.0); 3 * 1 + 0 = 3 exactly
    assert lib.mtplx_bf16x2_fma(pair(one, three), pair(one, one), pair(half_ulp, 0)) == \
        pair(one, three)
    # the bf16 subnormal 2^-127 (0x0040) times 2^126 is 0.5 (0x3F00), exactly
    assert lib.mtplx_bf16x2_fma(0x0040, 0x7E80, 0x8000) == 0x3F00


def test_ctint3_repack_keeps_every_code(lib):
    """The repacked words hold code 2p in the low and 2p + 1 in the high half of the pair fields
    (one group, codes 0..63 = s mod 8), read back as the kernel reads them."""
    codes = (np.arange(64) * 5 + 3) % 8
    c = mode_codec("ct-int", 3)
    parts = c.encode_codes(codes[None].astype(np.int32) - 4, np.full((1, 1), 0x3F80, np.uint16))
    words = np.ascontiguousarray(parts["weight_packed"]).copy()
    lib.mtplx_ctint3_repack(ptr(words), 1, 64)
    w = words.view(np.uint32)[0]
    for p in range(30):
        f = (int(w[p // 5]) >> (3 * (p % 5))) & 0x00070007
        assert (f & 0xFFFF, f >> 16) == (codes[2 * p], codes[2 * p + 1]), p
    for p, base in ((30, 0), (31, 3)):
        lo = sum(((int(w[base + b]) >> 15) & 1) << b for b in range(3))
        hi = sum(((int(w[base + b]) >> 31) & 1) << b for b in range(3))
        assert (lo, hi) == (codes[2 * p], codes[2 * p + 1]), p


RESIDENT_SHAPES = [(16, 7168), (32, 2048), (48, 96), (16, 160)]


@pytest.mark.parametrize("shape", RESIDENT_SHAPES, ids=[f"{r}x{c}" for r, c in RESIDENT_SHAPES])
@pytest.mark.parametrize("kind", ["int8", "fp8", "int4"])
def test_resident_matrices(lib, kind, shape):
    """int8 and fp8: the fp32 sums of q * x (the kernel scales each row after); int4: scale and
    zero folded into the weights, bit for bit the reference dequantization's values."""
    rows, cols = shape
    if kind == "int4" and cols % 32:
        pytest.skip("int4 needs whole groups of 32")
    g = torch.Generator().manual_seed(rows + cols)
    wt = (torch.randn(rows, cols, generator=g) * 0.02).to(torch.bfloat16)
    x = torch.randn(7, cols, generator=g).to(torch.bfloat16).float().numpy()
    zero = None
    if kind == "int8":
        q, _ = encode_int8(wt)
        packed, w = q.numpy().view(np.uint8), q.double().numpy()
    elif kind == "fp8":
        q, _ = encode_fp8(wt)
        packed, w = q.view(torch.uint8).numpy(), q.double().numpy()
    else:
        q, s, z = encode_int4(wt)
        from mtplx_runtime.model.quant import Int4Weight

        packed, zero = q.numpy(), z.view(torch.uint16).numpy()
        w = Int4Weight(q, s, z).dequantize().double().numpy()
        scale = s.view(torch.uint16).numpy()
    scale_arg = np.zeros(1, np.uint8) if kind != "int4" else scale
    y = emulate(lib, kind, np.ascontiguousarray(packed), scale_arg, zero, rows, cols, x, 1)
    want = x.astype(np.float64) @ w.T
    err = np.abs(y - want).max() / np.abs(want).max()
    assert err < 2e-6, err
