"""mxfp4 codec: golden nibbles from the spec table, and compressed-tensors 0.20.1 as the oracle for
both directions (its MXFP4A16 quantizer and its registered "mxfp4-pack-quantized" compressor)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mtplx_runtime.formats import FormatError, get_codec
from mtplx_runtime.formats.mxfp4 import MXFP4Codec, decode_mxfp4, decode_mxfp4_torch, encode_mxfp4

F32 = np.float32
SPEC_TABLE = [0, 0.5, 1, 1.5, 2, 3, 4, 6]  # FORMAT.md "mxfp4", codes 0..7; 8..15 are the negatives


@pytest.fixture(scope="module")
def ct():
    """compress(w) / decompress(packed, scale) through the real library, on CPU tensors."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

    scheme = preset_name_to_scheme("MXFP4A16", ["Linear"])
    compressor = BaseCompressor.get_value_from_registry("mxfp4-pack-quantized")

    def compress(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # Per-group min/max -> calculate_qparams -> generate_mx_scales: the qparams an observer
        # hands to the compressor (float32 scale 2^(e-127)).
        wt = torch.from_numpy(w)
        scale, _ = compute_dynamic_scales_and_zp(wt, scheme.weights, module=None)
        out = compressor.compress({"weight": wt, "weight_scale": scale}, scheme)
        return out["weight_packed"].numpy(), out["weight_scale"].numpy()

    def decompress(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
        parts = {"weight_packed": torch.from_numpy(packed), "weight_scale": torch.from_numpy(scale)}
        return compressor.decompress(parts, scheme)["weight"].float().numpy()  # bf16 -> exact f32

    return SimpleNamespace(compress=compress, decompress=decompress)


def bits(x) -> np.ndarray:
    return np.asarray(x).view(np.uint32)


def random_codes(rng: np.random.Generator, rows: int, cols: int, max_e: int = 254):
    packed = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    scale = rng.integers(0, max_e + 1, (rows, cols // 32), dtype=np.uint8)
    scale[0, :2] = [0, max_e]  # always include both ends of the exponent range
    return packed, scale


def test_nibble_table_and_layout():  # FORMAT.md "mxfp4"
    packed = np.zeros((1, 16), np.uint8)
    packed[0, :8] = [hi << 4 | lo for lo, hi in zip(range(0, 16, 2), range(1, 16, 2))]
    decoded = decode_mxfp4(packed, np.array([[127]], np.uint8))[0]
    np.testing.assert_array_equal(decoded[:16], SPEC_TABLE + [-v for v in SPEC_TABLE])
    assert np.signbit(decoded[8]) and not np.signbit(decoded[0])  # nibble 8 is -0
    # 0x9F: low nibble F = -6 (column 0), high nibble 9 = -0.5 (column 1); scale 2^(126-127).
    packed[0, 0] = 0x9F
    assert decode_mxfp4(packed, np.array([[126]], np.uint8))[0, :2].tolist() == [-3.0, -0.25]
    assert decode_mxfp4(packed, np.array([[0]], np.uint8))[0, 0] == -6 * 2.0**-127


def test_encode_golden_rounding():
    w = np.zeros((1, 32), F32)
    w[0, :13] = [6, 3, -0.5, 0.25, 0.75, -0.1, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, -0.0]
    packed, scale = encode_mxfp4(w)
    nibbles = np.stack([packed & 0xF, packed >> 4], -1).reshape(-1)
    # Ties to even on the E2M1 grid; a small negative becomes -0 (8); -0.0 becomes +0.
    assert nibbles[:13].tolist() == [7, 5, 9, 0, 2, 8, 2, 4, 4, 6, 6, 7, 0]
    assert scale.tolist() == [[127]]
    # The scale exponent follows amax rounded to a power of two (up from mantissa 1.75).
    for amax, e in [(7.0, 128), (6.99, 127), (0.5, 124), (2.0**-127, 0), (0.0, 0)]:
        assert encode_mxfp4(np.full((1, 32), amax, F32))[1][0, 0] == e, amax


def test_decode_matches_compressed_tensors(ct):
    packed, scale = random_codes(np.random.default_rng(0), 64, 256)  # E8M0 0..254, all nibbles
    ours = decode_mxfp4(packed, scale)
    np.testing.assert_array_equal(bits(ours), bits(ct.decompress(packed, scale)))
    np.testing.assert_array_equal(
        bits(decode_mxfp4_torch(torch.from_numpy(packed), torch.from_numpy(scale)).numpy()),
        bits(ours),
    )


def hostile_weights(rng: np.random.Generator) -> np.ndarray:
    """[64, 256] float32: groups of very different magnitude plus hand-made edge groups."""
    w = rng.standard_normal((64, 8, 32)) * 2.0 ** rng.uniform(-140, 124, (64, 8, 1))
    w[0, 0] = 0.0
    w[0, 1] = -0.0
    w[0, 2] = rng.choice([-1, 1], 32) * 2.0**-149  # subnormals only: scale clamps at e = 0
    w[0, 3] = 1.75 * 2.0**5 * rng.random(32)  # amax on the round-up edge ...
    w[0, 3, 0] = 1.75 * 2.0**5
    w[0, 4] = np.nextafter(F32(1.75), F32(0)) * 2.0**5 * rng.random(32)  # ... and just below it
    w[0, 4, 0] = np.nextafter(F32(1.75), F32(0)) * 2.0**5
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]) * 2.0**-3  # exact E2M1 midpoints
    w[0, 5] = np.resize(ties, 32) * rng.choice([-1, 1], 32)
    w[0, 6] = -(rng.random(32) * 1e-3)  # mostly rounds to -0
    w[0, 6, 0] = 1.0
    return w.astype(F32).reshape(64, 256)


def test_encode_matches_compressed_tensors(ct):
    w = hostile_weights(np.random.default_rng(1))
    packed, scale = encode_mxfp4(w)
    ct_packed, ct_scale = ct.compress(w)
    np.testing.assert_array_equal(scale, ct_scale)
    np.testing.assert_array_equal(packed, ct_packed)


def test_representable_weights_round_trip(ct):
    # E2M1 x 2^(e-127) values come back unchanged (as values: a -0 nibble re-encodes as +0), and
    # our bytes for them are the library's (its canonical scale may differ from the source's).
    packed, scale = random_codes(np.random.default_rng(2), 32, 128, max_e=250)  # no overflow
    w = decode_mxfp4(packed, scale)
    p2, s2 = encode_mxfp4(w)
    assert (decode_mxfp4(p2, s2) == w).all()
    ct_packed, ct_scale = ct.compress(w)
    np.testing.assert_array_equal(p2, ct_packed)
    np.testing.assert_array_equal(s2, ct_scale)


def test_torch_decode_batched_and_deterministic():
    rng = np.random.default_rng(3)
    packed = rng.integers(0, 256, (3, 4, 48), dtype=np.uint8)  # [E, rows, cols/2]
    scale = rng.integers(0, 255, (3, 4, 3), dtype=np.uint8)
    ours = decode_mxfp4(packed, scale)
    assert ours.shape == (3, 4, 96)
    np.testing.assert_array_equal(bits(ours[2]), bits(decode_mxfp4(packed[2], scale[2])))
    out = decode_mxfp4_torch(torch.from_numpy(packed), torch.from_numpy(scale))
    assert out.dtype == torch.float32
    np.testing.assert_array_equal(bits(out.numpy()), bits(ours))


def test_e8m0_nan_is_rejected():
    packed = np.zeros((2, 16), np.uint8)
    scale = np.array([[127], [0xFF]], np.uint8)
    with pytest.raises(FormatError, match="0xFF"):
        decode_mxfp4(packed, scale)
    with pytest.raises(FormatError, match="0xFF"):
        decode_mxfp4_torch(torch.from_numpy(packed), torch.from_numpy(scale))
    with pytest.raises(FormatError, match="0xFF"):
        MXFP4Codec().decode({"weight_packed": packed, "weight_scale": scale}, (2, 32))


@pytest.mark.parametrize(
    "weight, match",
    [
        (np.zeros((2, 48), F32), "multiple of the group size"),
        (np.zeros(32, F32), "2-D"),
        (np.full((1, 32), np.nan, F32), "NaN or Inf"),
        (np.full((1, 32), 1.75 * 2.0**127, F32), "E8M0 0xFF"),
    ],
)
def test_encoder_rejects(weight, match):
    with pytest.raises(FormatError, match=match):
        encode_mxfp4(weight)


def test_decoder_rejects_mismatched_parts():
    with pytest.raises(FormatError, match="does not match"):
        decode_mxfp4(np.zeros((2, 16), np.uint8), np.zeros((2, 2), np.uint8))
    with pytest.raises(FormatError, match="uint8"):
        decode_mxfp4(np.zeros((2, 16), np.uint8), np.zeros((2, 1), np.int8))


def test_codec_k3_geometry_and_parts():  # FORMAT.md "mxfp4"
    codec = get_codec("mxfp4")
    assert isinstance(codec, MXFP4Codec)
    gate = codec.components((3072, 3584))
    assert [(c.name, c.shape, c.st_dtype) for c in gate] == [
        ("weight_packed", (3072, 1792), "U8"),
        ("weight_scale", (3072, 112), "U8"),
    ]
    assert [c.shape for c in codec.components((3584, 3072))] == [(3584, 1536), (3584, 96)]
    expert_bytes = 2 * codec.projection_bytes((3072, 3584)) + codec.projection_bytes((3584, 3072))
    assert expert_bytes == 17_547_264
    assert codec.bits_per_weight((3072, 3584)) == 4.25

    w = hostile_weights(np.random.default_rng(4))
    parts = codec.encode(w)
    assert list(parts) == ["weight_packed", "weight_scale"]
    expected = decode_mxfp4(*encode_mxfp4(w))
    np.testing.assert_array_equal(bits(codec.decode(parts, w.shape)), bits(expected))
