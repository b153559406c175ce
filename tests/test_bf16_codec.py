"""bf16 passthrough codec: round-to-nearest-even against torch's own bfloat16 cast, exact decode,
and rejection of values bf16 cannot hold."""

import numpy as np
import pytest
import torch

from mtplx_runtime.formats import FormatError, get_codec
from mtplx_runtime.formats.bf16 import BF16Codec

F32 = np.float32


def from_bits(u32: list[int]) -> np.ndarray:
    return np.array(u32, dtype=np.uint32).view(F32).reshape(1, -1)


def test_round_to_nearest_even_on_the_bits():
    w = from_bits([0x3F808000, 0x3F818000, 0x3F808001, 0x3F80FFFF, 0x80000001, 0x7F7F7FFF])
    # tie -> even (down), tie -> even (up), above tie -> up, carry, -tiny -> -0, largest finite
    expected = [0x3F80, 0x3F82, 0x3F81, 0x3F81, 0x8000, 0x7F7F]
    assert BF16Codec().encode(w)["weight"].tolist() == [expected]


def test_encode_matches_torch_bfloat16_cast():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((64, 96)) * 2.0 ** rng.uniform(-140, 120, (64, 96))).astype(F32)
    w[0, :4] = [0.0, -0.0, 2.0**-149, -(2.0**-130)]
    ours = BF16Codec().encode(w)["weight"]
    theirs = torch.from_numpy(w).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(ours, theirs)


def test_every_finite_pattern_round_trips():
    codec = get_codec("bf16")
    patterns = np.arange(1 << 16, dtype=np.uint16)
    finite = patterns[(patterns & 0x7F80) != 0x7F80].reshape(-1, 2)  # 65,024 patterns
    decoded = codec.decode({"weight": finite}, finite.shape)
    np.testing.assert_array_equal(decoded.view(np.uint32), finite.astype(np.uint32) << 16)
    np.testing.assert_array_equal(codec.encode(decoded)["weight"], finite)  # -0.0 included


@pytest.mark.parametrize(
    "weight, match",
    [
        (np.array([[1.0, np.nan]], F32), "NaN or Inf"),
        (np.array([[np.inf, 0.0]], F32), "NaN or Inf"),
        (from_bits([0x7F7F8000]), "rounds to Inf"),  # finite in float32, Inf in bf16
        (np.zeros(4, F32), "2-D"),
    ],
)
def test_encoder_rejects(weight, match):
    with pytest.raises(FormatError, match=match):
        BF16Codec().encode(weight)


def test_components_and_part_checks():
    codec = get_codec("bf16")
    assert isinstance(codec, BF16Codec)
    [spec] = codec.components((3072, 3584))
    assert (spec.name, spec.shape, spec.st_dtype, spec.nbytes) == (
        "weight", (3072, 3584), "BF16", 2 * 3072 * 3584
    )
    assert codec.bits_per_weight((4, 8)) == 16
    with pytest.raises(FormatError, match="expected uint16"):
        codec.decode({"weight": np.zeros((2, 3), F32)}, (2, 3))
    with pytest.raises(FormatError, match="missing"):
        codec.decode({}, (2, 3))
