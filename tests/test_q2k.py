"""Q2_K reference decode (formats/q2k.py, FORMAT.md "q2k"): bit-exact against gguf-py's dequantizer
on random blocks, a hand-computed block, and the codec surface."""

import numpy as np
import pytest

from mtplx_runtime.formats import FormatError
from mtplx_runtime.formats.q2k import BLOCK_BYTES, Q2KCodec, dequantize_q2k, q2k_row_bytes

gguf = pytest.importorskip("gguf")
F32 = np.float32


def _blocks(rng, n, d, dmin):
    b = rng.integers(0, 256, (n, BLOCK_BYTES), dtype=np.uint8)
    b[:, 80:82] = np.asarray(d, dtype="<f2").reshape(n, 1).view(np.uint8)
    b[:, 82:84] = np.asarray(dmin, dtype="<f2").reshape(n, 1).view(np.uint8)
    return b


def _oracle(blocks: np.ndarray) -> np.ndarray:
    return gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q2_K).reshape(-1)


def test_bit_exact_against_gguf_on_random_blocks():
    rng = np.random.default_rng(0)
    n = 4096
    # d/dmin over the whole finite fp16 range: signed, subnormal, zero, the largest (65504).
    bits = rng.integers(0, 1 << 16, (n, 2), dtype=np.uint16)
    bits[(bits & 0x7C00) == 0x7C00] &= 0xBBFF  # Inf/NaN exponent -> finite
    bits[:4] = [[0x0001, 0x8001], [0x0000, 0x8000], [0x7BFF, 0xFBFF], [0x03FF, 0x3C00]]
    dd = bits.view("<f2")
    b = _blocks(rng, n, dd[:, 0], dd[:, 1])
    ours, theirs = dequantize_q2k(b), _oracle(b)
    assert np.isfinite(ours).all()
    # Compare bit patterns: -0.0 vs +0.0 and every rounding must agree.
    np.testing.assert_array_equal(ours.view(np.uint32), theirs.view(np.uint32))


def test_only_the_subtraction_rounds():
    # d * sc * q is exact in fp32 (11 + 4 + 2 significand bits), so FMA and separate
    # multiply-subtract agree; the subtraction is the single rounding.
    b = np.zeros((1, BLOCK_BYTES), np.uint8)
    b[0, :16] = 0x1F  # scale 15, min 1
    b[0, 16:80] = 0xFF  # q = 3 everywhere
    b[0, 80:82] = np.array([1.0], "<f2").view(np.uint8)
    b[0, 82:84] = np.array([2.0**-24], "<f2").view(np.uint8)  # smallest fp16 subnormal
    vals = dequantize_q2k(b)
    assert vals.dtype == F32
    assert (vals == F32(45.0) - F32(2.0**-24)).all() and (vals == 45.0).all()
    np.testing.assert_array_equal(vals, _oracle(b))


def test_hand_computed_block():
    b = np.zeros(BLOCK_BYTES, np.uint8)
    b[:16] = 0x21  # every sub-block: scale code 1, min code 2
    b[15] = 0xF3  # sub-block 15: scale 3, min 15
    b[16 + 0] = 0b11_10_01_00  # qs[0]: values 0, 32, 64, 96 get q = 0, 1, 2, 3
    b[16 + 63] = 0b11_00_00_00  # qs[63] >> 6: value 255 (h 1, shift 6, lane 31) gets q = 3
    b[80:82] = np.array([0.5], "<f2").view(np.uint8)
    b[82:84] = np.array([0.25], "<f2").view(np.uint8)
    v = dequantize_q2k(b)
    # value = d*sc*q - dmin*m = 0.5*1*q - 0.25*2 for sub-blocks 0..14
    assert v[[0, 32, 64, 96]].tolist() == [-0.5, 0.0, 0.5, 1.0]
    assert v[1] == -0.5 and v[128] == -0.5  # q = 0 elsewhere in those lanes
    assert v[255] == 0.5 * 3 * 3 - 0.25 * 15  # 0.75, sub-block 15
    assert v[254] == -3.75  # sub-block 15, q = 0
    np.testing.assert_array_equal(v, _oracle(b[None]))


def test_codec_surface():
    codec = Q2KCodec()
    (spec,) = codec.components((3, 512))
    assert (spec.name, spec.dtype, spec.shape, spec.st_dtype) == ("weight", np.uint8,
                                                                   (3, 168), "U8")
    assert q2k_row_bytes(3584) == 14 * 84 and codec.bits_per_weight((3072, 3584)) == 2.625
    rng = np.random.default_rng(1)
    w = _blocks(rng, 6, [0.01] * 6, [0.02] * 6).reshape(3, 168)
    out = codec.decode({"weight": w}, (3, 512))
    assert out.shape == (3, 512) and out.dtype == F32
    np.testing.assert_array_equal(out.reshape(-1), _oracle(w))
    with pytest.raises(FormatError, match="multiple of 256"):
        codec.components((4, 200))
    with pytest.raises(FormatError, match="weight"):
        codec.decode({"weight": w[:, :84]}, (3, 512))
    with pytest.raises(NotImplementedError, match="read-only"):
        codec.encode(np.zeros((1, 256), F32))
    with pytest.raises(FormatError, match="84-byte"):
        dequantize_q2k(np.zeros(85, np.uint8))
