"""compressed-tensors pack-quantized int codec (FORMAT.md "ct-int"): worked examples, the real
compressed-tensors 0.20.1 as oracle for dense 3-bit and 2/4/8-bit, goldens from 0.17.1 for the
legacy 3-bit layout (tools/make_ct_goldens.py), layout detection, config reading."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

# the oracle is a test extra: where it is missing (a GPU machine running `pytest -m cuda`), this
# module is skipped at collection instead of failing it
pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
from compressed_tensors.quantization.utils import calculate_qparams
from hypothesis import given, settings
from hypothesis import strategies as st

from mtplx_runtime.checkpoint.safetensors_io import SafetensorsFile
from mtplx_runtime.formats import FormatError, get_codec
from mtplx_runtime.formats.base import f32_to_bf16_bits
from mtplx_runtime.formats.ctint import (
    CtScheme,
    code_offset,
    dequantize,
    detect_layout,
    pack_codes,
    pack_zero_points,
    packed_width,
    parse_quantization_config,
    quantize,
    unpack_codes,
    unpack_zero_points,
    weight_shape_tensor,
)
from mtplx_runtime.formats.record import padded_layout, record_components

GOLDEN = Path(__file__).parent / "golden" / "ct0171_w3_legacy.safetensors"

# The worked example: one 64-weight row, scale 0.01 -> BF16 0.010009765625.
EXAMPLE_Q = np.array([
    -2, -4, -3, -1, -4, -4, -4, 1, 1, -1, -2, -1, -3, -3, -2, 1,
    3, 2, -4, 0, 0, 1, 3, 2, -4, -2, -3, -2, 2, -2, -2, 3,
    0, -3, -1, -2, 1, -4, 2, -3, 1, -2, -4, -1, 2, 3, -4, -1,
    -3, -1, 3, -4, 1, 0, 2, -3, 1, 3, 2, 0, 0, 3, 2, -4,
], dtype=np.int8)[None]
EXAMPLE_WORDS = {
    "dense": [0x9DA00642, 0xC837A896, 0xE96450DE, 0x153854CC, 0x51D963E6, 0x1BC9BD3A],
    "legacy": [0x1DA00642, 0x20DEA25A, 0x16450DEC, 0x0E15333A, 0x1963E615, 0x26F4E947, 0x000001BC],
    "w4": [0x94447546, 0x96557679, 0xAB9884AB, 0xB66A6564,
           0x5A496758, 0x74BA7469, 0x5A894B75, 0x4AB88AB9],
}
EXAMPLE_SCALE = f32_to_bf16_bits(np.full((1, 1), 0.01, np.float32))


def u32(words: np.ndarray) -> list[int]:
    return [int(x) for x in np.asarray(words).view(np.uint32).ravel()]


def bits_of(t: torch.Tensor) -> np.ndarray:
    """A torch BF16 tensor as uint16 bits (how this package carries BF16)."""
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def bf16_tensor(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16)


def ct_scheme(num_bits: int, symmetric: bool, group_size: int = 64) -> QuantizationScheme:
    args = QuantizationArgs(num_bits=num_bits, type="int", symmetric=symmetric, strategy="group",
                            group_size=group_size)
    return QuantizationScheme(targets=["Linear"], weights=args)


def ct_decompress(parts: dict, shape, num_bits: int, symmetric: bool, g_idx=None,
                  group_size: int = 64) -> np.ndarray:
    """compressed-tensors' own decompress of our components -> BF16 bits."""
    sd = {
        "weight_packed": torch.from_numpy(parts["weight_packed"]),
        "weight_scale": bf16_tensor(parts["weight_scale"]),
        "weight_shape": torch.from_numpy(weight_shape_tensor(shape)),
    }
    if not symmetric:
        sd["weight_zero_point"] = torch.from_numpy(parts["weight_zero_point"])
    if g_idx is not None:
        sd["weight_g_idx"] = torch.from_numpy(g_idx)
    out = PackedQuantizationCompressor.decompress(sd, ct_scheme(num_bits, symmetric, group_size))
    return bits_of(out["weight"])


def random_codes(rng, shape, num_bits):
    off = code_offset(num_bits)
    return rng.integers(-off, off, shape).astype(np.int8)


def random_scale_bits(rng, rows, groups):
    return f32_to_bf16_bits(np.exp2(rng.uniform(-14, 2, (rows, groups))).astype(np.float32))


# --- worked examples (zero points, 2/4/8-bit packings, one 64-weight row) ------------------------

@pytest.mark.parametrize("layout", ["dense", "legacy"])
def test_worked_example_3bit(layout):
    words = pack_codes(EXAMPLE_Q + 4, 3, layout)
    assert words.dtype == np.int32 and u32(words) == EXAMPLE_WORDS[layout]
    assert (unpack_codes(words, 3, layout, 64).astype(np.int8) - 4 == EXAMPLE_Q).all()
    codec = get_codec("ct-int", num_bits=3, layout=layout)
    parts = codec.encode_codes(EXAMPLE_Q, EXAMPLE_SCALE)
    w = codec.decode(parts, (1, 64))
    assert w.dtype == np.float32 and (w == EXAMPLE_Q * np.float32(0.010009765625)).all()
    assert w[0, 0] == np.float32(-0.02001953125)  # code 0: q = -2
    assert w[0, 42] == np.float32(-0.0400390625)


def test_worked_example_w4_and_ct_agrees():
    words = pack_codes(EXAMPLE_Q + 8, 4)
    assert u32(words) == EXAMPLE_WORDS["w4"]
    assert u32(pack_to_int32(torch.from_numpy(EXAMPLE_Q), 4).numpy()) == EXAMPLE_WORDS["w4"]
    assert u32(pack_to_int32(torch.from_numpy(EXAMPLE_Q), 3).numpy()) == EXAMPLE_WORDS["dense"]
    parts3 = {"weight_packed": np.array([EXAMPLE_WORDS["dense"]], np.uint32).view(np.int32),
              "weight_scale": EXAMPLE_SCALE}
    parts4 = {"weight_packed": words, "weight_scale": EXAMPLE_SCALE}
    assert (ct_decompress(parts4, (1, 64), 4, True)
            == ct_decompress(parts3, (1, 64), 3, True)).all()


def test_8bit_example():
    words = pack_codes(np.array([[1, 2, -128, 127]]) + 128, 8)
    assert u32(words) == [0xFF008281] and int(words[0, 0]) == -16_743_807


@pytest.mark.parametrize("layout", ["dense", "legacy"])
def test_zero_point_example(layout):
    zp = np.array([[-1, 0], [0, 0], [0, -1], [0, 0]])  # [rows 4, G 2]
    words = pack_zero_points(zp + 4, 3, layout)
    assert words.tolist() == [[2339, 2276]]
    assert (unpack_zero_points(words, 3, layout, 4).astype(int) - 4 == zp).all()


@pytest.mark.parametrize("cols,dense,legacy,w4", [
    (64, 6, 7, 8), (2048, 192, 205, 256), (3072, 288, 308, 384), (3584, 336, 359, 448),
    (7168, 672, 717, 896), (37, 4, 4, 5),
])
def test_widths(cols, dense, legacy, w4):
    assert packed_width(cols, 3, "dense") == dense
    assert packed_width(cols, 3, "legacy") == legacy
    assert packed_width(cols, 4) == w4 and packed_width(cols, 4, "legacy") == w4


def test_k3_expert_bytes():
    """Bytes per expert (3 x packed + 3 x scale) in each layout."""
    shapes = [(3072, 3584), (3072, 3584), (3584, 3072)]
    for bits, layout, want in ((3, "dense", 13_418_496), (3, "legacy", 14_270_464),
                               (4, "dense", 17_547_264)):
        codec = get_codec("ct-int", num_bits=bits, layout=layout)
        assert sum(codec.projection_bytes(s) for s in shapes) == want
    asym = get_codec("ct-int", num_bits=3, layout="legacy", symmetric=False)
    zp = {c.name: c.shape for c in asym.components((3584, 3072))}["weight_zero_point"]
    assert zp == (359, 48)


def test_kimi_k2_thinking_expert_bytes():
    """W4 group 32 (FORMAT.md "ct-int" sizes): a whole number of pages per component, so the bank
    record has no padding."""
    shapes = {"gate": (2048, 7168), "up": (2048, 7168), "down": (7168, 2048)}
    comps = record_components("ct-int", shapes, 4, 32)
    assert [c[2] for c in comps[:2]] == [(2048, 896), (2048, 224)] and comps[5][2] == (7168, 64)
    assert sum(c[3] for c in comps) == sum(c[3] for c in padded_layout(comps)) == 24_772_608


# --- compressed-tensors 0.20.1 as oracle --------------------------------------------------------

@pytest.mark.parametrize("num_bits", [2, 3, 4, 8])
@pytest.mark.parametrize("shape", [(3, 37), (4, 64), (7, 100), (5, 3584), (2, 3072)])
def test_pack_matches_ct(num_bits, shape):
    rng = np.random.default_rng(num_bits * 1000 + shape[1])
    q = random_codes(rng, shape, num_bits)
    ours = pack_codes(q.astype(np.int32) + code_offset(num_bits), num_bits)
    theirs = pack_to_int32(torch.from_numpy(q), num_bits).numpy()
    assert ours.shape == theirs.shape and (ours == theirs).all()
    back = unpack_from_int32(torch.from_numpy(ours), num_bits, torch.Size(shape)).numpy()
    assert (back == q).all()
    assert (unpack_codes(theirs, num_bits, "dense", shape[1]).astype(np.int16)
            - code_offset(num_bits) == q).all()
    zp_theirs = pack_to_int32(torch.from_numpy(q), num_bits, packed_dim=0).numpy()
    ours_zp = pack_zero_points(q.astype(np.int32) + code_offset(num_bits), num_bits)
    assert (ours_zp == zp_theirs).all()


@pytest.mark.parametrize("group", [64, 32])
@pytest.mark.parametrize("num_bits", [3, 4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_decode_matches_ct_decompress(num_bits, symmetric, group):
    rng = np.random.default_rng(7 * num_bits + symmetric + group)
    rows, cols = 24, 384
    codec = get_codec("ct-int", num_bits=num_bits, layout="dense", symmetric=symmetric,
                      group_size=group)
    q = random_codes(rng, (rows, cols), num_bits)
    zp = None if symmetric else random_codes(rng, (rows, cols // group), num_bits)
    parts = codec.encode_codes(q, random_scale_bits(rng, rows, cols // group), zp)
    codec.check_parts(parts, (rows, cols))
    ours = codec.decode(parts, (rows, cols))
    theirs = ct_decompress(parts, (rows, cols), num_bits, symmetric, group_size=group)
    assert (f32_to_bf16_bits(ours) == theirs).all()
    q2, zp2 = codec.codes(parts, (rows, cols))
    assert (q2 == q).all() and (zp2 is None if symmetric else (zp2 == zp).all())


@pytest.mark.parametrize("group", [64, 32])
@pytest.mark.parametrize("num_bits", [3, 4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_encode_matches_ct_quantizer(num_bits, symmetric, group):
    """Our quantiser (FORMAT.md "ct-int") equals ct's calculate_qparams + quantize + compress on
    BF16 weights (including an all-zero and an all-positive group); fixtures should still come from
    ct."""
    gen = torch.Generator().manual_seed(num_bits * 2 + symmetric + group)
    w = torch.randn(32, 256, generator=gen) * torch.exp2(torch.rand(32, 1, generator=gen) * -10)
    w[0, :64], w[1, :64] = 0, torch.rand(64, generator=gen)
    w = w.to(torch.bfloat16)
    args = ct_scheme(num_bits, symmetric, group).weights
    groups = w.reshape(32, 256 // group, group)
    scale, zp = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
    q = ct_quantize(w, scale, zp, args, dtype=torch.int8)
    ours_q, ours_scale, ours_zp = quantize(w.float().numpy(), num_bits, symmetric, group)
    assert (ours_q == q.numpy()).all() and (ours_scale == bits_of(scale)).all()
    assert ours_zp is None if symmetric else (ours_zp == zp.numpy()).all()
    sd = {"weight": w, "weight_scale": scale, "weight_zero_point": zp}
    theirs = PackedQuantizationCompressor.compress(sd, ct_scheme(num_bits, symmetric, group))
    ours = get_codec("ct-int", num_bits=num_bits, symmetric=symmetric,
                     group_size=group).encode(w.float().numpy())
    assert set(ours) | {"weight_shape"} == set(theirs)
    for name, arr in ours.items():
        want = bits_of(theirs[name]) if name == "weight_scale" else theirs[name].numpy()
        assert (arr == want).all(), name


# --- legacy layout: goldens from compressed-tensors 0.17.1 ---------------------------------------

def golden_cases():
    f = SafetensorsFile(GOLDEN)
    assert f.metadata["compressed_tensors"] == "0.17.1" and f.metadata["layout"] == "legacy"
    cases = json.loads(f.metadata["cases"])
    return f, cases


@pytest.mark.parametrize("case", list(json.loads(SafetensorsFile(GOLDEN).metadata["cases"])))
def test_legacy_golden(case):
    f, cases = golden_cases()
    rows, cols, symmetric, act_order = cases[case]
    get = lambda k: f.read(f"{case}.{k}")  # noqa: E731
    q, words = get("codes"), get("weight_packed")
    assert tuple(get("weight_shape")) == (rows, cols)
    assert detect_layout(words.shape[1], cols, "0.17.1") == "legacy"
    assert (pack_codes(q.astype(np.int32) + 4, 3, "legacy") == words).all()
    assert (unpack_codes(words, 3, "legacy", cols).astype(np.int8) - 4 == q).all()
    zp = None
    if not symmetric:
        zp = get("zero_point_codes")
        zp_words = pack_zero_points(zp.astype(np.int32) + 4, 3, "legacy")
        assert (zp_words == get("weight_zero_point")).all()
        codec = get_codec("ct-int", num_bits=3, layout="legacy", symmetric=False)
        parts = {k: get(k) for k in ("weight_packed", "weight_scale", "weight_zero_point")}
        assert (f32_to_bf16_bits(codec.decode(parts, (rows, cols))) == get("decompressed")).all()
    g_idx = get("weight_g_idx") if act_order else None
    w = dequantize(q, get("weight_scale"), zp, g_idx)
    assert (f32_to_bf16_bits(w) == get("decompressed")).all()
    if case == "example_1x64":
        assert u32(words) == EXAMPLE_WORDS["legacy"]


def test_ct_020_misdecodes_legacy_words():
    """Current ct decodes every 3-bit tensor as dense, silently. This is why the runtime
    never hands a checkpoint to the installed compressed-tensors to decode."""
    f, _ = golden_cases()
    words = torch.from_numpy(f.read("example_1x64.weight_packed"))
    wrong = unpack_from_int32(words, 3, torch.Size((1, 64))).numpy() != EXAMPLE_Q
    assert wrong.sum() == 52
    parts = {k: f.read(f"sym_2x3584.{k}") for k in ("weight_packed", "weight_scale")}
    bad = ct_decompress(parts, (2, 3584), 3, True)  # returns quietly, right shape, wrong values
    assert bad.shape == (2, 3584) and (bad != f.read("sym_2x3584.decompressed")).mean() > 0.5


def test_ct_020_ignores_g_idx():
    """ct 0.20.1 removed actorder "group" and its decompress ignores `weight_g_idx`: only
    our `dequantize` (or ct <= 0.18) gives an act-order checkpoint its weights."""
    f, _ = golden_cases()
    q = f.read("gidx_8x256.codes")
    parts = {"weight_packed": pack_codes(q.astype(np.int32) + 4, 3),
             "weight_scale": f.read("gidx_8x256.weight_scale")}
    ignored = ct_decompress(parts, (8, 256), 3, True, g_idx=f.read("gidx_8x256.weight_g_idx"))
    assert (ignored == f32_to_bf16_bits(dequantize(q, parts["weight_scale"]))).all()
    assert (ignored != f.read("gidx_8x256.decompressed")).any()


# --- layout detection ----------------------------------------------------------------------------

@pytest.mark.parametrize("width,cols,version,want", [
    (336, 3584, None, "dense"), (359, 3584, None, "legacy"),
    (288, 3072, "0.20.1", "dense"), (308, 3072, "0.17.1", "legacy"),
    (2, 20, "0.17.1", "legacy"), (2, 20, "0.18.0", "dense"),   # ambiguous: version decides
    (2, 20, "0.18.1.dev12+gabc1234", "dense"), (2, 20, "0.12.2", "legacy"),
])
def test_detect_layout(width, cols, version, want):
    assert detect_layout(width, cols, version) == want


@pytest.mark.parametrize("width,cols,version,match", [
    (2, 20, None, "ambiguous"),
    (300, 3584, None, "neither"), (300, 3584, "0.20.1", "neither"),
    (336, 3584, "0.17.1", "override"), (359, 3584, "0.20.1", "override"),
    (336, 3584, "not a version", "not a version"),
])
def test_detect_layout_errors(width, cols, version, match):
    with pytest.raises(FormatError, match=match):
        detect_layout(width, cols, version)


def test_detect_layout_override():
    assert detect_layout(359, 3584, "0.20.1", override="legacy") == "legacy"
    assert detect_layout(2, 20, None, override="dense") == "dense"
    with pytest.raises(FormatError, match="cannot be in the dense"):
        detect_layout(359, 3584, override="dense")
    with pytest.raises(FormatError):
        detect_layout(336, 3584, override="packed")


def test_widths_coincide_only_for_small_cols():
    same = [c for c in range(1, 20_000)
            if packed_width(c, 3, "dense") == packed_width(c, 3, "legacy")]
    assert max(same) <= 150 and not [c for c in same if c % 32 == 0]


# --- quantization_config -------------------------------------------------------------------------

def qc_020(**weights) -> dict:
    """The block ct 0.20.1 writes for W3A16 g64, with `weights` overrides."""
    return {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "quantization_status": "compressed", "version": "0.20.1",
        "config_groups": {"group_0": {
            "format": "pack-quantized", "targets": ["Linear"],
            "weights": {"num_bits": 3, "type": "int", "symmetric": True, "strategy": "group",
                        "group_size": 64, "dynamic": False, "observer": "minmax", **weights},
            "input_activations": None, "output_activations": None}},
        "ignore": ["lm_head"], "global_compression_ratio": None, "kv_cache_scheme": None,
        "moe_sparsity_config": None, "sparsity_config": {}, "transform_config": {},
    }


def test_parse_quantization_config():
    assert parse_quantization_config(qc_020()) == CtScheme(3, True, 64, None, "0.20.1")
    qc = qc_020(symmetric=False, actorder="group")
    del qc["version"], qc["config_groups"]["group_0"]["format"]  # falls back to the top level
    assert parse_quantization_config(qc) == CtScheme(3, False, 64, "group", None)
    assert parse_quantization_config(qc_020(num_bits=4)).num_bits == 4
    assert parse_quantization_config(qc_020(num_bits=8), allowed_bits=(8,)).num_bits == 8
    qc = qc_020()
    qc["config_groups"]["group_1"] = dict(qc["config_groups"]["group_0"], targets=["re:.*mlp.*"])
    assert parse_quantization_config(qc).num_bits == 3  # agreeing groups are fine
    qc = qc_020(num_bits=4, group_size=32)  # Kimi K2 Thinking's experts: W4A16 symmetric g32
    del qc["version"]
    assert parse_quantization_config(qc) == CtScheme(4, True, 32, None, None)


def _mutate(path: str, value):
    def f(qc):
        *keys, last = path.split("/")
        d = qc
        for k in keys:
            d = d[k]
        d[last] = value
    return f


G0 = "config_groups/group_0"


@pytest.mark.parametrize("mutate,match", [
    (_mutate("quant_method", "gptq"), "quant_method"),
    (_mutate("quantization_status", "frozen"), "quantization_status"),
    (_mutate(f"{G0}/format", "naive-quantized"), "format"),
    (_mutate(f"{G0}/weights/type", "float"), "type"),
    (_mutate(f"{G0}/weights/strategy", "channel"), "strategy"),
    (_mutate(f"{G0}/weights/group_size", 128), "group_size"),
    (_mutate(f"{G0}/weights/group_size", None), "group_size"),
    (_mutate("config_groups/group_1", {"weights": dict(qc_020()["config_groups"]["group_0"][
        "weights"], group_size=32), "format": "pack-quantized"}), "disagree"),
    (_mutate(f"{G0}/weights/num_bits", 2), "num_bits"),
    (_mutate(f"{G0}/weights/dynamic", True), "dynamic"),
    (_mutate(f"{G0}/input_activations", {"num_bits": 8}), "input_activations"),
    (_mutate("transform_config", {"config_groups": {"u": {}}}), "transform_config"),
    (_mutate("sparsity_config", {"format": "sparse-24-bitmask"}), "sparsity_config"),
    (_mutate("config_groups", {}), "config_groups"),
    (_mutate("config_groups/group_1", {"weights": dict(qc_020()["config_groups"]["group_0"][
        "weights"], symmetric=False), "format": "pack-quantized"}), "disagree"),
    (_mutate("version", "0.2O.1"), "not a version"),
    (_mutate(f"{G0}/weights", None), "no weights"),
])
def test_parse_quantization_config_rejects(mutate, match):
    qc = qc_020()
    mutate(qc)
    with pytest.raises(FormatError, match=match):
        parse_quantization_config(qc)


# --- codec, dequantize, hostile input ------------------------------------------------------------

def test_dequantize_g_idx_rules():
    rng = np.random.default_rng(3)
    q, s = random_codes(rng, (2, 128), 3), random_scale_bits(rng, 2, 2)
    swap = np.r_[np.ones(64), np.zeros(64)].astype(np.int32)  # columns 0-63 use group 1
    w = dequantize(q, s, g_idx=swap)
    assert (w[:, :64] == dequantize(q[:, :64], s[:, 1:])).all()
    assert (dequantize(q, s, g_idx=np.full(128, -1)) == dequantize(q, s)).all()  # ct: unset
    with pytest.raises(FormatError, match="exactly 64"):
        dequantize(q, s, g_idx=np.zeros(128, np.int32))


def test_rejects_bad_input():
    with pytest.raises(FormatError, match="lie in"):
        pack_codes(np.array([[8]]), 3)
    with pytest.raises(FormatError, match="words per row"):
        unpack_codes(np.zeros((1, 7), np.int32), 3, "dense", 64)
    with pytest.raises(FormatError, match="int32"):
        unpack_codes(np.zeros((1, 6), np.int64), 3, "dense", 64)
    with pytest.raises(FormatError, match="num_bits"):
        get_codec("ct-int", num_bits=5)
    with pytest.raises(FormatError, match="layout"):
        pack_codes(np.zeros((1, 4), np.uint8), 3, "sparse")
    codec = get_codec("ct-int", symmetric=False)
    with pytest.raises(FormatError, match="zero points"):
        codec.encode_codes(np.zeros((1, 64), np.int8), np.zeros((1, 1), np.uint16))
    with pytest.raises(FormatError, match="missing"):
        codec.decode({"weight_packed": np.zeros((1, 6), np.int32)}, (1, 64))
    with pytest.raises(FormatError, match="multiple"):
        codec.components((4, 100))
    with pytest.raises(FormatError, match="group_size 48"):
        get_codec("ct-int", group_size=48)


def test_large_matrix_round_trips():
    u = np.random.default_rng(0).integers(0, 8, (3072, 3584)).astype(np.uint8)
    for layout in ("dense", "legacy"):
        assert (unpack_codes(pack_codes(u, 3, layout), 3, layout, 3584) == u).all()


# --- properties ----------------------------------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(st.sampled_from([(2, "dense"), (3, "dense"), (3, "legacy"), (4, "dense"), (8, "dense")]),
       st.integers(1, 5), st.integers(1, 300), st.integers(0, 2**32 - 1))
def test_round_trip(bits_layout, rows, n, seed):
    bits, layout = bits_layout
    u = np.random.default_rng(seed).integers(0, 1 << bits, (rows, n)).astype(np.uint8)
    words = pack_codes(u, bits, layout)
    assert words.shape == (rows, packed_width(n, bits, layout)) and words.dtype == np.int32
    assert (unpack_codes(words, bits, layout, n) == u).all()
    assert (unpack_zero_points(pack_zero_points(u.T, bits, layout), bits, layout, n) == u.T).all()
    # Padding is zero bits: repacking with a trailing zero code changes nothing but the width.
    longer = pack_codes(np.pad(u, ((0, 0), (0, 1))), bits, layout)
    assert (longer[:, : words.shape[1]] == words).all()


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([2, 3, 4, 8]), st.integers(1, 4), st.integers(1, 200),
       st.integers(0, 2**32 - 1))
def test_dense_equals_ct(bits, rows, n, seed):
    q = random_codes(np.random.default_rng(seed), (rows, n), bits)
    theirs = pack_to_int32(torch.from_numpy(q), bits).numpy()
    assert (pack_codes(q.astype(np.int32) + code_offset(bits), bits) == theirs).all()
