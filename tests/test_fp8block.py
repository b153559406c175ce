"""fp8-block (FORMAT.md "fp8-block"): the e4m3 table, the encoder and the reference decode against
independent implementations (torch's float8_e4m3fn conversion, transformers' dequantizing
loader), the reader's rejections, the config check and the sizes FORMAT.md states."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mtplx_runtime.formats import FormatError, get_codec
from mtplx_runtime.formats.fp8block import (
    E4M3_VALUES,
    decode_fp8_block,
    e4m3_codes,
    encode_fp8_block,
    parse_quantization_config,
    scale_shape,
)
from mtplx_runtime.formats.modes import quantization_for
from mtplx_runtime.formats.record import padded_layout, record_components

DEEPSEEK_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                   "weight_block_size": [128, 128]}
DEEPSEEK_EXPERT = {"gate": (2048, 7168), "up": (2048, 7168), "down": (7168, 2048)}


def _torch_values(codes: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(codes)).view(torch.float8_e4m3fn).float()


def _random_parts(rng, rows, cols):
    """e4m3 codes without the NaN pair, and positive scales over a wide range."""
    codes = rng.integers(0, 256, (rows, cols), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E
    exps = rng.uniform(-30, 20, scale_shape((rows, cols)))
    scale = (rng.uniform(1, 2, exps.shape) * 2.0**exps).astype(np.float32)
    return codes, scale


def test_e4m3_table_is_torchs():
    want = _torch_values(np.arange(256, dtype=np.uint8)).numpy()
    np.testing.assert_array_equal(E4M3_VALUES, want)  # NaN at the same places
    assert np.isnan(E4M3_VALUES[[0x7F, 0xFF]]).all() and E4M3_VALUES[0x7E] == 448
    assert E4M3_VALUES[1] == 2.0**-9 and np.signbit(E4M3_VALUES[0x80])


def test_encoder_rounds_like_torchs_cast():
    rng = np.random.default_rng(0)
    grid = E4M3_VALUES[:0x7F].astype(np.float64)
    ties = (grid[:-1] + grid[1:]) / 2  # every midpoint: ties go to the even code
    x = np.concatenate([grid, ties, -ties, rng.standard_normal(4000) * 50,
                        rng.standard_normal(1000) * 0.01, [449, 464, 465, 1e30, -1e30, -0.0,
                                                           -1e-9, 2.0**-10]]).astype(np.float32)
    want = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    np.testing.assert_array_equal(e4m3_codes(x), want)


@pytest.mark.parametrize("shape", [(1, 1), (70, 200), (129, 257), (256, 384), (300, 128)])
def test_decode_matches_torch(shape):
    rng = np.random.default_rng(shape[0] * shape[1])
    codes, scale = _random_parts(rng, *shape)
    s = torch.from_numpy(scale).repeat_interleave(128, 0).repeat_interleave(128, 1)
    want = (_torch_values(codes) * s[:shape[0], :shape[1]]).to(torch.bfloat16).float()
    got = decode_fp8_block(codes, scale)
    assert got.dtype == np.float32 and got.shape == shape
    np.testing.assert_array_equal(got, want.numpy())


def test_decode_matches_transformers_loader():
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    rng = np.random.default_rng(1)
    codes, scale = _random_parts(rng, 256, 384)  # whole blocks: the loader needs them
    want = Fp8Dequantize(None)._dequantize_one(
        torch.from_numpy(codes).view(torch.float8_e4m3fn), torch.from_numpy(scale),
        output_dtype=torch.bfloat16)
    np.testing.assert_array_equal(decode_fp8_block(codes, scale), want.float().numpy())


def test_codec_round_trip():
    rng = np.random.default_rng(2)
    codec = get_codec("fp8-block")
    w = (rng.standard_normal((200, 300)) * 0.05).astype(np.float32)
    w[:128, :128] = 0  # an all-zero block: scale 1, every code 0
    parts = codec.encode(w)
    assert [c.name for c in codec.components(w.shape)] == list(parts)
    assert parts["weight_scale_inv"][0, 0] == 1 and not parts["weight"][:128, :128].any()
    back = codec.decode(parts, w.shape)
    scale = np.repeat(np.repeat(parts["weight_scale_inv"], 128, 0), 128, 1)[:200, :300]
    # e4m3 keeps 4 significant bits (half a step: 1/16 relative) down to 2^-6, then steps of
    # 2^-9; bf16 adds 1/512 of the product
    assert (np.abs(back - w) <= np.abs(w) / 16 * (1 + 2**-8) + scale * 2.0**-10 + 1e-12).all()
    np.testing.assert_array_equal(codec.encode(back)["weight"], parts["weight"])


@pytest.mark.parametrize("code", [0x7F, 0xFF])
def test_rejects_nan_codes(code):
    codes, scale = _random_parts(np.random.default_rng(3), 130, 130)
    codes[129, 5] = code
    with pytest.raises(FormatError, match=rf"weight\[129, 5\] is 0x{code:02X}, an e4m3 NaN"):
        decode_fp8_block(codes, scale)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 1e36, -1e36])
def test_rejects_bad_scales(bad):
    codes, scale = _random_parts(np.random.default_rng(4), 130, 130)
    scale[1, 0] = bad
    with pytest.raises(FormatError, match=r"weight_scale_inv\[1, 0\]"):
        decode_fp8_block(codes, scale)
    scale[1, 0] = 2.0**118  # large, but 448 x it is finite in bf16
    assert np.isfinite(decode_fp8_block(codes, scale)).all()


def test_rejects_bad_shapes_and_dtypes():
    codes, scale = _random_parts(np.random.default_rng(5), 130, 260)
    for s in (scale[:1], scale[:, :2], np.zeros((2, 4), np.float32), scale.astype(np.float64)):
        with pytest.raises(FormatError, match="weight_scale_inv"):
            decode_fp8_block(codes, s)
    with pytest.raises(FormatError, match="uint8"):
        decode_fp8_block(codes.astype(np.int8), scale)
    with pytest.raises(FormatError, match="NaN or Inf"):
        encode_fp8_block(np.full((2, 2), np.nan, np.float32))


def test_quantization_config():
    assert parse_quantization_config(DEEPSEEK_CONFIG) == (128, 128)
    assert parse_quantization_config({k: v for k, v in DEEPSEEK_CONFIG.items()
                                      if k != "activation_scheme"}) == (128, 128)
    for key, value in (("quant_method", "compressed-tensors"), ("fmt", "e5m2"),
                       ("weight_block_size", [64, 128]), ("activation_scheme", "static")):
        with pytest.raises(FormatError, match=key):
            parse_quantization_config({**DEEPSEEK_CONFIG, key: value})


def test_deepseek_expert_sizes():
    comps = record_components("fp8-block", DEEPSEEK_EXPERT)
    assert [(c[0], c[1], c[2]) for c in comps[:2]] == [
        ("gate_proj.weight", "F8_E4M3", (2048, 7168)),
        ("gate_proj.weight_scale_inv", "F32", (16, 56))]
    assert comps[5][2] == (56, 16)
    assert sum(c[3] for c in comps) == 44_050_944
    assert sum(c[3] for c in padded_layout(comps)) == 44_052_480
    assert quantization_for("fp8-block") == {"bits": 8, "group_size": 128, "mode": "fp8-block"}
