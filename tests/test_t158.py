"""t158 codec: golden bytes from the spec, bit-exactness against a slow per-group transcription of
the MTPLX reference encoder, round trips, hostile bytes, the torch decode, and the torch
ternarizer that quantization-aware training uses."""


import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from mtplx_runtime.formats import FormatError, get_codec
from mtplx_runtime.formats.t158 import (
    T158Codec,
    decode_t158,
    decode_t158_torch,
    encode_t158,
    group_sum_f32,
    ternarize_t158_torch,
)

F32 = np.float32


def encode_group_ref(g: np.ndarray) -> tuple[bytes, int]:
    """The published encoder for one contiguous 64-vector, one step at a time (FORMAT.md "t158")."""
    m = np.mean(np.abs(g))  # float32, numpy's own summation order
    tau = F32(0.7) * m
    q = np.where(g > tau, 2, np.where(g < -tau, 0, 1))
    n = int(np.count_nonzero(q != 1))
    if n:
        a = np.sum(np.where(q != 1, np.abs(g), F32(0)))
        s = F32(np.float64(a) / np.float64(n))
    else:
        s = m
    u = int(F32(s).view(np.uint32))
    bits = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    slots = [int(c) for c in q] + [0]
    return bytes(sum(slots[5 * j + k] * 3**k for k in range(5)) for j in range(13)), bits


def pack_codes_ref(codes: np.ndarray) -> np.ndarray:
    """codes `[rows, G, 64]` in {0,1,2} -> packed `[rows, 13G]` with Python ints."""
    rows, groups, _ = codes.shape
    out = np.zeros((rows, groups, 13), dtype=np.uint8)
    for r in range(rows):
        for g in range(groups):
            slots = [int(c) for c in codes[r, g]] + [0]
            out[r, g] = [sum(slots[5 * j + k] * 3**k for k in range(5)) for j in range(13)]
    return out.reshape(rows, -1)


def bits(x) -> np.ndarray:
    return np.asarray(x).view(np.uint32)


def test_worked_example_bytes():  # FORMAT.md "t158"
    w = np.full(64, 0.10, dtype=F32)
    w[:5] = [0.30, -0.05, -0.40, 0.00, 0.12]
    w[63] = -0.20
    m = group_sum_f32(np.abs(w)[None])[0] / F32(64)
    assert m == F32(0.10734376) and F32(0.7) * m == F32(0.07514063)

    packed, scales = encode_t158(w[None])
    assert packed.tobytes() == bytes.fromhex("C2" + "F2" * 11 + "1A")
    assert scales.astype("<u2").tobytes() == b"\xe1\x3d"  # 0x3DE1, low byte first on disk

    s = F32(0.10986328125)  # bf16 0x3DE1 exactly
    expected = np.full(64, s, dtype=F32)
    expected[[1, 3]] = 0
    expected[[2, 63]] = -s
    np.testing.assert_array_equal(decode_t158(packed, scales)[0], expected)


def test_constant_and_zero_groups():  # FORMAT.md "t158", edge cases
    packed, scales = encode_t158(np.full((1, 64), 0.5, dtype=F32))
    assert packed.tobytes() == bytes([0xF2] * 12 + [0x50]) and scales[0, 0] == 0x3F00
    assert (decode_t158(packed, scales) == 0.5).all()

    packed, scales = encode_t158(np.zeros((1, 64), dtype=F32))
    assert packed.tobytes() == bytes([0x79] * 12 + [0x28]) and scales[0, 0] == 0x0000
    assert (decode_t158(packed, scales) == 0).all()


def test_ties_at_threshold_are_zero_trits():
    # w = +-c with c == tau exactly (found by search, precondition asserted): both are zero trits.
    c = np.array(0x3E373529, dtype=np.uint32).view(F32)
    w = np.zeros(64, dtype=F32)
    w[0], w[1], w[2:18] = c, -c, 1.0
    assert F32(0.7) * (group_sum_f32(np.abs(w)[None])[0] / F32(64)) == c
    packed, scales = encode_t158(w[None])
    decoded = decode_t158(packed, scales)[0]
    assert decoded[0] == 0 and decoded[1] == 0 and (decoded[2:18] == 1.0).all()
    assert (packed.tobytes(), int(scales[0, 0])) == encode_group_ref(w)


def near_threshold_groups(rng: np.random.Generator, n: int) -> np.ndarray:
    """Groups with one value at (or an ulp from) +-tau: a fixed point of w_k = +-0.7 * mean|w|."""
    groups = rng.standard_normal((n, 64)).astype(F32)
    for g in groups:
        k, sign = rng.integers(64), rng.choice([-1, 1])
        for _ in range(6):
            g[k] = sign * (F32(0.7) * np.mean(np.abs(g)))
    return groups


def near_bf16_tie_groups(rng: np.random.Generator, n: int) -> np.ndarray:
    """Groups whose scale a / n lands within float rounding of a bf16 rounding midpoint."""
    groups = rng.standard_normal((n, 64)).astype(F32)
    for g in groups:
        keep = np.abs(g) > F32(0.7) * np.mean(np.abs(g))
        count, a = int(keep.sum()), float(np.sum(np.where(keep, np.abs(g), F32(0))))
        u = int(F32(a / count).view(np.uint32))
        mid = float(np.array((u & 0xFFFF0000) | 0x8000, dtype=np.uint32).view(F32))
        k = np.flatnonzero(keep)[np.argmax(np.abs(g[keep]))]  # largest: its code cannot flip
        g[k] = np.sign(g[k]) * F32(abs(g[k]) + (mid * count - a))
    return groups


def test_encoder_matches_reference_transcription():
    # The two constructed families make the summation order and the double rounding visible: with
    # a plain sequential sum, float64 sums or truncating bf16 rounding, hundreds of groups differ.
    rng = np.random.default_rng(158)
    n = 96
    families = [
        rng.standard_normal((n, 64)),
        rng.standard_t(2, (n, 64)),  # heavy tails: few large trits
        rng.uniform(-1, 1, (n, 64)) * (rng.random((n, 64)) < 0.2),  # mostly zeros
        rng.integers(-8, 9, (n, 64)) / 16,  # coarse grid: many equal values
        rng.standard_normal((n, 64)) * np.exp(rng.uniform(-90, 80, (n, 1))),  # tiny .. huge
        rng.standard_normal((n, 64)) * np.exp(rng.uniform(-20, 20, (n, 64))),  # mixed magnitudes
        near_threshold_groups(rng, 2 * n),
        near_bf16_tie_groups(rng, 2 * n),
    ]
    groups = np.concatenate(families).astype(F32)  # [960, 64]
    packed, scales = encode_t158(groups.reshape(-1, 256))  # 4 groups per row
    packed, scales = packed.reshape(-1, 13), scales.reshape(-1)
    for i, g in enumerate(groups):
        assert (packed[i].tobytes(), int(scales[i])) == encode_group_ref(g), f"group {i}"


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(F32, st.tuples(st.integers(1, 8), st.just(64)),
                  elements=st.floats(-(2.0**100), 2.0**100, width=32)))
def test_group_sum_is_numpy_float32_sum(x):
    # Our explicit 8-accumulator order equals numpy's float32 sum on this numpy, row-wise and
    # one contiguous vector at a time (the two ways the published encoder calls it).
    ours = group_sum_f32(x)
    np.testing.assert_array_equal(bits(ours), bits(np.sum(x, axis=1)))
    np.testing.assert_array_equal(bits(ours), bits(np.array([np.sum(row) for row in x])))


def _codes_and_scales(rng: np.random.Generator, rows: int, groups: int):
    """Random valid codes with positive finite bf16 scales; all-zero groups get scale 0."""
    codes = rng.integers(0, 3, (rows, groups, 64))
    codes[rng.random((rows, groups)) < 0.2] = 1
    sparse = rng.random((rows, groups)) < 0.3
    codes[sparse] = np.where(rng.random((int(sparse.sum()), 64)) < 0.9, 1, codes[sparse])
    # Exponent field <= 246 keeps 64 * s finite; bf16 subnormals (field 0) are included.
    scales = rng.integers(1, 0x7B80, (rows, groups)).astype(np.uint16)
    scales[(codes == 1).all(-1)] = 0
    return codes, scales


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_decode_then_encode_reproduces_bytes(seed):
    # A group decoded from valid codes holds only +-s and 0 with s a bf16, so m, tau, the kept sum
    # and a / n are all exact and the encoder must give the same codes and scale back.
    codes, scales = _codes_and_scales(np.random.default_rng(seed), 3, 4)
    packed = pack_codes_ref(codes)
    p2, s2 = encode_t158(decode_t158(packed, scales))
    np.testing.assert_array_equal(p2, packed)
    np.testing.assert_array_equal(s2, scales)


def test_every_byte_decodes_by_floor_mod():
    # Row b has all 13 bytes = b, scale 1.0: bytes 243..255 and digit 4 of byte 12 included.
    packed = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 13, axis=1)
    scales = np.full((256, 1), 0x3F80, dtype=np.uint16)
    expected = np.array(
        [[(b // 3 ** (i % 5)) % 3 - 1 for i in range(64)] for b in range(256)], dtype=F32
    )
    np.testing.assert_array_equal(decode_t158(packed, scales), expected)
    assert (decode_t158(packed[243:244], scales[:1]) == -1).all()  # 243 = five codes 0

    # Digit 4 of byte 12 (the padding slot) is ignored.
    rng = np.random.default_rng(1)
    base = rng.integers(0, 243, (8, 13)).astype(np.uint8)
    base[:, 12] %= 81
    scales = rng.integers(0, 0x7F80, (8, 1)).astype(np.uint16)
    for pad in (1, 2):
        alt = base.copy()
        alt[:, 12] += 81 * pad
        np.testing.assert_array_equal(decode_t158(alt, scales), decode_t158(base, scales))


def test_random_bytes_decode_deterministically_and_torch_matches():
    rng = np.random.default_rng(7)
    packed = rng.integers(0, 256, (2, 5, 13 * 6), dtype=np.uint8)  # [E, rows, 13G]
    scales = rng.integers(0, 1 << 16, (2, 5, 6), dtype=np.uint16)  # NaN/Inf/negative included
    first = decode_t158(packed, scales)
    assert first.shape == (2, 5, 384) and first.dtype == F32
    np.testing.assert_array_equal(bits(decode_t158(packed, scales)), bits(first))
    np.testing.assert_array_equal(bits(decode_t158(packed[1], scales[1])), bits(first[1]))
    for scales_t in (torch.from_numpy(scales), torch.from_numpy(scales.view(np.int16))):
        out = decode_t158_torch(torch.from_numpy(packed), scales_t)
        assert out.dtype == torch.float32
        np.testing.assert_array_equal(bits(out.numpy()), bits(first))


def test_torch_decode_all_scale_patterns():
    scales = np.arange(1 << 16, dtype=np.uint16).reshape(1024, 64)
    packed = np.random.default_rng(3).integers(0, 256, (1024, 64 * 13), dtype=np.uint8)
    out = decode_t158_torch(torch.from_numpy(packed), torch.from_numpy(scales))
    np.testing.assert_array_equal(bits(out.numpy()), bits(decode_t158(packed, scales)))


@pytest.mark.parametrize(
    "weight, match",
    [
        (np.zeros((2, 96), F32), "multiple of the group size"),
        (np.zeros(64, F32), "2-D"),
        (np.where(np.arange(64) == 5, np.nan, 0).astype(F32)[None], "NaN or Inf"),
        (np.where(np.arange(64) == 5, -np.inf, 0).astype(F32)[None], "NaN or Inf"),
        (np.full((1, 64), 3e38, F32), "overflows bf16"),
    ],
)
def test_encoder_rejects(weight, match):
    with pytest.raises(FormatError, match=match):
        encode_t158(weight)


def test_decoder_rejects_mismatched_parts():
    with pytest.raises(FormatError, match="does not match"):
        decode_t158(np.zeros((2, 26), np.uint8), np.zeros((2, 3), np.uint16))
    with pytest.raises(FormatError, match="uint16"):
        decode_t158(np.zeros((2, 13), np.uint8), np.zeros((2, 1), np.float32))
    with pytest.raises(FormatError, match="does not match"):
        decode_t158_torch(
            torch.zeros(3, 13, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.int16)
        )


def test_codec_k3_geometry_and_parts():  # FORMAT.md "Bank parts"
    codec = get_codec("t158")
    assert isinstance(codec, T158Codec)
    gate = codec.components((3072, 3584))
    assert [(c.name, c.shape, c.st_dtype, c.nbytes) for c in gate] == [
        ("packed", (3072, 728), "U8", 2_236_416),
        ("scales", (3072, 56), "U16", 344_064),
    ]
    assert [c.shape for c in codec.components((3584, 3072))] == [(3584, 624), (3584, 48)]
    record_bytes = 2 * codec.projection_bytes((3072, 3584)) + codec.projection_bytes((3584, 3072))
    assert record_bytes == 7_741_440
    assert codec.bits_per_weight((3072, 3584)) == 1.875

    w = np.random.default_rng(0).standard_normal((4, 128)).astype(F32)
    parts = codec.encode(w)
    assert list(parts) == ["packed", "scales"]
    np.testing.assert_array_equal(codec.decode(parts, (4, 128)), decode_t158(*encode_t158(w)))
    with pytest.raises(FormatError, match="scales"):
        codec.decode({**parts, "scales": parts["scales"].view(np.int16)}, (4, 128))




def test_torch_ternarizer_is_encode_then_decode():
    # Training sees exactly the values the encoder will store (tools/train_tiny.py), including
    # at threshold ties and bf16 rounding midpoints, where a different summation order flips them.
    rng = np.random.default_rng(7)
    w = np.concatenate([
        rng.standard_normal((64, 64)).astype(F32) * F32(0.03),
        near_threshold_groups(rng, 64), near_bf16_tie_groups(rng, 64),
        np.zeros((1, 64), F32), np.full((1, 64), 0.5, F32),
    ]).reshape(-1, 128)  # 97 rows of two groups
    want = decode_t158(*encode_t158(w))
    got = ternarize_t158_torch(torch.from_numpy(w))
    assert got.dtype == torch.float32 and got.shape == w.shape
    np.testing.assert_array_equal(got.numpy(), want)
    # Leading dims (an expert stack [E, rows, cols]) ternarize group by group, like a 2-D matrix.
    stacked = torch.from_numpy(w[:96].reshape(3, 32, 128))
    np.testing.assert_array_equal(ternarize_t158_torch(stacked).reshape(96, 128).numpy(),
                                  want[:96])
