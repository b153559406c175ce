"""Native CPU expert kernels for every codec (cpu_native, kernels/native/cpu/*.c) and the `cpu`
backend.

Every codec configuration runs on every ISA path this CPU has:
* decode exactness: gemm with X = identity returns the NumPy codec's decoded matrix bit for bit
  (each output is one weight times 1 plus zeros; n = cols > 64 also crosses the driver's
  64-token pass boundary);
* gemm vs float64 "codec decode, then matmul": |err| <= 1e-5 · Σ|w·x| per output (fp32
  accumulation over <= 192 terms is far inside it; one wrong weight is ~1/cols of the sum);
* n tokens == n one-token calls, for any thread count and n = 2..9 and 70, bit for bit;
* mxfp4 on avx512bf16: token rows of bf16 values equal a NumPy emulation of that path's
  summation order bit for bit, and in a call of mixed rows each row takes its own path.
`cpu.expert_mlp` vs `reference.expert_mlp` on random banks: fp32 model to relative RMS 1e-5;
bf16 model bit-identical except rare 1-ulp bf16 flips (fp32 summation order can move a value
across a bf16 rounding boundary; at most 2% of outputs may differ and only by one ulp).
"""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import expert_banks
import numpy as np
import pytest
import torch

from mtplx_runtime.formats.ctint import CtIntCodec
from mtplx_runtime.formats.modes import MODES
from mtplx_runtime.formats.mxfp4 import decode_mxfp4
from mtplx_runtime.formats.t158 import decode_t158
from mtplx_runtime.kernels import cpu, cpu_native, reference

ROOT = Path(__file__).resolve().parent.parent
why = cpu_native.unavailable_reason()
ok = why is None
pytestmark = pytest.mark.skipif(not ok, reason=why or "")
ISAS = [name for name in cpu_native.ISAS
        if ok and cpu_native.ISAS.index(name) <= cpu_native.ISAS.index(cpu_native.best_isa())]
R, I, E, K, T = 128, 192, 8, 4, 5
SHAPES = {"gate": (I, R), "up": (I, R), "down": (R, I)}
# every bank mode with a native CPU codec (the codec table's cpu column), at each of its bits
BANK_MODES = [(m.name, b if len(m.bits) > 1 else None) for m in MODES.values() if m.cpu
              for b in m.bits]


def _bf16_bits(rng, shape, lo=0.005, hi=0.05):
    return (rng.uniform(lo, hi, shape).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _t158(rng, rows, cols):
    packed = rng.integers(0, 256, (rows, 13 * cols // 64), dtype=np.uint8)  # 243..255 too
    scales = _bf16_bits(rng, (rows, cols // 64))
    return cpu_native.t158(packed, scales), decode_t158(packed, scales)


def _mxfp4(rng, rows, cols):
    packed = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)  # every nibble, -0 too
    scale = rng.integers(112, 132, (rows, cols // 32), dtype=np.uint8)
    scale[0, 0] = 0  # E8M0 0: the subnormal 2^-127
    return cpu_native.mxfp4(packed, scale), decode_mxfp4(packed, scale)


def _ctint(bits, layout, symmetric):
    def make(rng, rows, cols):
        codec = CtIntCodec(num_bits=bits, layout=layout, symmetric=symmetric)
        lo, hi = -(1 << bits - 1), (1 << bits - 1) - 1
        q = rng.integers(lo, hi + 1, (rows, cols))
        zp = None if symmetric else rng.integers(lo, hi + 1, (rows, cols // 64))
        parts = codec.encode_codes(q, _bf16_bits(rng, (rows, cols // 64), 0.01, 3.0), zp)
        m = cpu_native.ctint(parts["weight_packed"], parts["weight_scale"],
                             parts.get("weight_zero_point"), bits=bits, layout=layout)
        return m, codec.decode(parts, (rows, cols))
    return make


CODECS = {"t158": _t158, "mxfp4": _mxfp4,
          "ct-int3": _ctint(3, "dense", True), "ct-int4": _ctint(4, "dense", True),
          "ct-int-asym3": _ctint(3, "dense", False), "ct-int-asym4": _ctint(4, "dense", False),
          "ct-int3-legacy": _ctint(3, "legacy", True),
          "ct-int-asym3-legacy": _ctint(3, "legacy", False)}


@pytest.fixture(params=ISAS)
def isa(request):
    assert cpu_native.set_isa(request.param) == request.param
    yield request.param
    cpu_native.set_isa(None)


@pytest.mark.parametrize("codec", CODECS)
def test_gemm_decodes_exactly_and_matches_float64(codec, isa):
    rng = np.random.default_rng(len(codec))
    m, W = CODECS[codec](rng, 70, 192)  # odd row count: the last row pair is a single row
    Y = cpu_native.gemm(m, np.eye(192, dtype=np.float32), threads=3)  # [192 tokens, 70]
    np.testing.assert_array_equal(Y.T, W)
    X = rng.standard_normal((3, 192)).astype(np.float32)
    ref = X.astype(np.float64) @ W.T.astype(np.float64)
    bound = 1e-5 * (np.abs(X).astype(np.float64) @ np.abs(W.T).astype(np.float64))
    assert (np.abs(cpu_native.gemm(m, X) - ref) <= bound).all()


@pytest.mark.parametrize("codec", CODECS)
def test_tokens_and_threads_do_not_change_bits(codec, isa):
    rng = np.random.default_rng(7)
    m, _ = CODECS[codec](rng, 64, 128)
    X = rng.standard_normal((5, 128)).astype(np.float32)
    want = np.stack([cpu_native.gemm(m, X[t:t + 1], threads=1)[0] for t in range(5)])
    for threads in (1, 2, 3, 64):
        np.testing.assert_array_equal(cpu_native.gemm(m, X, threads=threads), want)


@pytest.mark.parametrize("codec", CODECS)
def test_token_counts_equal_one_token_calls(codec, isa):
    # Each n picks its own path (mxfp4 avx512: a register kernel for n <= 4, decoded tiles
    # above, batches of 64 tokens); 70 rows leave a tail after every 4- and 16-row block.
    rng = np.random.default_rng(11)
    m, _ = CODECS[codec](rng, 70, 192)
    X = rng.standard_normal((70, 192)).astype(np.float32)
    one = np.stack([cpu_native.gemm(m, X[t:t + 1], threads=1)[0] for t in range(70)])
    for n in (*range(2, 10), 70):
        np.testing.assert_array_equal(cpu_native.gemm(m, X[:n], threads=2), one[:n])


def _bf16_values(a):
    """a rounded toward zero to bf16 values, kept as float32."""
    return (np.asarray(a, np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)


def _mxfp4_bf16_emulation(packed, scale, X):
    """The avx512bf16 mxfp4 path in NumPy fp32, for token rows of bf16 values. Per 128-column
    step and fp32 lane d (group L = d // 4 of the step's four), p adds 8 exact E2M1 * x
    products one at a time (vdpbf16ps: 4 shifts k, odd word first), then the lane's accumulator
    adds p times the group's scale (an FMA: the scaled product is exact here, as only a first
    step has a subnormal scale); hsum512's order at the end. Columns past cols are zeros."""
    rows, cols = packed.shape[0], 2 * packed.shape[1]
    steps = -(-cols // 128)
    pad = ((0, 0), (0, 128 * steps - cols))
    q = np.pad(decode_mxfp4(packed, np.full_like(scale, 127)), pad)  # unscaled E2M1 values
    x = np.pad(X, pad)
    s = np.pad(np.ldexp(np.float32(1), scale.astype(np.int32) - 127).astype(np.float32),
               ((0, 0), (0, 4 * steps - cols // 32)))
    lane = np.arange(16) // 4
    even = 32 * lane + 4 * (2 * (np.arange(16) % 4))  # word 8L + w holds column 32L + 4w + k
    acc = np.zeros((X.shape[0], rows, 16), np.float32)
    for st in range(steps):
        p = np.zeros_like(acc)
        for k in range(4):
            for c in (128 * st + even + 4 + k, 128 * st + even + k):  # odd word, then even
                p = p + q[None, :, c] * x[:, None, c]
        acc = acc + p * s[None, :, 4 * st + lane]
    half = acc[..., :8] + acc[..., 8:]
    quad = half[..., :4] + half[..., 4:]
    return (quad[..., 0] + quad[..., 2]) + (quad[..., 1] + quad[..., 3])


needs_bf16 = pytest.mark.skipif("avx512bf16" not in ISAS, reason="no AVX-512 BF16")


@needs_bf16
@pytest.mark.parametrize("rows,cols", [(70, 192), (9, 1088)])  # 1088: scales 16 at a time too
def test_mxfp4_bf16_rows_follow_their_summation_order(rows, cols):
    """bf16-valued token rows take the avx512bf16 path: bit for bit its NumPy emulation (which
    differs from the avx512 path's order), inside the float64 bound, tiles of 4 and a tail;
    X = identity (bf16 values too) decodes exactly."""
    rng = np.random.default_rng(21)
    m, W = _mxfp4(rng, rows, cols)  # scale[0, 0] = 0: a subnormal scale, exact here too
    X = _bf16_values(rng.standard_normal((6, cols)))
    try:
        assert cpu_native.set_isa("avx512bf16") == "avx512bf16"
        eye = cpu_native.gemm(m, np.eye(cols, dtype=np.float32), threads=2)
        Y = cpu_native.gemm(m, X, threads=2)
        assert cpu_native.set_isa("avx512") == "avx512"
        fp32_path = cpu_native.gemm(m, X, threads=2)
    finally:
        cpu_native.set_isa(None)
    np.testing.assert_array_equal(eye.T, W)
    np.testing.assert_array_equal(Y, _mxfp4_bf16_emulation(m.packed, m.scale, X))
    assert (Y != fp32_path).any()
    ref = X.astype(np.float64) @ W.T.astype(np.float64)
    bound = 1e-5 * (np.abs(X).astype(np.float64) @ np.abs(W.T).astype(np.float64))
    assert (np.abs(Y - ref) <= bound).all()


@needs_bf16
def test_mxfp4_mixed_rows_take_their_own_paths():
    """In one call, bf16 rows (the emulation) and the others (the avx512 path: fp32 inputs, and
    bf16 rows with an input too small or too large for vdpbf16ps) each get their own path's
    bits, and n tokens equal one-token calls."""
    rng = np.random.default_rng(23)
    m, _ = _mxfp4(rng, 70, 256)  # whole 128-column steps (192 above: a half step at the end)
    X = rng.standard_normal((70, 256)).astype(np.float32)
    kind = rng.integers(0, 4, 70)  # 0 fp32, 1 bf16, 2 / 3 bf16 with a 2^-120 / 2^125 input
    X[kind > 0] = _bf16_values(X[kind > 0])
    X[kind == 2, 5] = 2.0**-120
    X[kind == 3, 9] = 2.0**125
    try:
        assert cpu_native.set_isa("avx512") == "avx512"
        fp32_path = cpu_native.gemm(m, X, threads=1)
        assert cpu_native.set_isa("avx512bf16") == "avx512bf16"
        one = np.stack([cpu_native.gemm(m, X[t:t + 1], threads=1)[0] for t in range(70)])
        for n in (*range(2, 10), 70):
            np.testing.assert_array_equal(cpu_native.gemm(m, X[:n], threads=2), one[:n])
    finally:
        cpu_native.set_isa(None)
    bf16 = kind == 1
    np.testing.assert_array_equal(one[bf16], _mxfp4_bf16_emulation(m.packed, m.scale, X[bf16]))
    np.testing.assert_array_equal(one[~bf16], fp32_path[~bf16])


def _torch_expert(W, x, beta, beta_lin):
    g, u = x @ W[0].T, x @ W[1].T
    h = beta * torch.tanh(g / beta) * torch.sigmoid(g) * (beta_lin * torch.tanh(u / beta_lin))
    return h @ W[2].T


@pytest.mark.parametrize("codec", CODECS)
def test_expert_matches_float64(codec, isa):
    rng = np.random.default_rng(3)
    (g, wg), (u, wu), (d, wd) = (CODECS[codec](rng, *s) for s in ((I, R), (I, R), (R, I)))
    X = rng.standard_normal((4, R)).astype(np.float32) * 0.5
    ref = _torch_expert([torch.from_numpy(w).double() for w in (wg, wu, wd)],
                        torch.from_numpy(X).double(), 4.0, 25.0).numpy()
    out = cpu_native.expert(g, u, d, X, 4.0, 25.0, threads=2)
    rel = np.sqrt(np.mean((out - ref) ** 2)) / np.sqrt(np.mean(ref**2))
    assert rel < 1e-5, rel  # tanh/sigmoid in fp32 add ~1 ulp per activation
    one = np.stack([cpu_native.expert(g, u, d, X[t:t + 1], 4.0, 25.0)[0] for t in range(4)])
    np.testing.assert_array_equal(out, one)
    # round_model: every output is a bf16 value
    rounded = cpu_native.expert(g, u, d, X, 4.0, 25.0, round_model=True)
    assert not (rounded.view(np.uint32) & 0xFFFF).any()


@functools.cache
def make_bank(mode, bits, seed=0):
    """expert_banks.make_bank at this file's shapes, cached and read-only."""
    layout, store = expert_banks.make_bank(mode, bits, R, I, E, seed)
    store.flags.writeable = False
    return layout, store


def _routing(seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K].sort().values for _ in range(T)])
    weights = torch.rand(T, K, generator=g)
    return ids, weights, {e: E - 1 - e for e in range(E)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode,bits", BANK_MODES)
def test_cpu_expert_mlp_matches_reference(mode, bits, dtype):
    layout, store = make_bank(mode, bits)
    ids, w, slots = _routing()
    x = torch.randn(T, R, generator=torch.Generator().manual_seed(5)).to(dtype)
    want = reference.expert_mlp(x, ids, w, slots, store, layout, SHAPES)
    got = cpu.expert_mlp(x, ids, w, slots, store, layout, SHAPES)
    assert got.dtype == dtype and got.shape == want.shape
    if dtype == torch.float32:
        rel = ((got - want).norm() / want.norm()).item()
        assert rel < 1e-5, rel
    else:  # rare 1-ulp bf16 flips only
        bits_got, bits_want = got.view(torch.int16).int(), want.view(torch.int16).int()
        diff = (bits_got - bits_want).abs()
        assert diff.max() <= 1 and (diff > 0).float().mean() <= 0.02
    for t in range(T):  # the T = 1 path gives the T = 5 rows bit for bit
        one = cpu.expert_mlp(x[t:t + 1], ids[t:t + 1], w[t:t + 1], slots, store, layout, SHAPES)
        assert torch.equal(one[0], got[t])


def _per_expert(x, ids, w, slots, store, layout, out):
    """The cpu backend before `cpu_native.layer`: one `cpu_native.expert` call per expert, then
    out[tok] += y * weight in NumPy fp32, in ascending expert id."""
    xs = x.float().numpy()
    for e in [e for e in torch.unique(ids).tolist() if e >= 0]:
        m = cpu_native.record_matrices(layout, store[slots[e]])
        tok, k = (a.numpy() for a in torch.nonzero(ids == e, as_tuple=True))
        y = cpu_native.expert(m["gate"], m["up"], m["down"], xs[tok], 4.0, 25.0,
                              round_model=x.dtype == torch.bfloat16)
        out[tok] += y * w.numpy()[tok, k][:, None]
    return out


@pytest.mark.parametrize("t", [1, T])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode,bits", BANK_MODES)
def test_layer_call_equals_per_expert_calls(mode, bits, dtype, t, isa):
    """One native layer call == the per-expert calls and NumPy combine, bit for bit (-1 picks
    included; acc added into)."""
    layout, store = make_bank(mode, bits, seed=3)
    ids, w, slots = _routing(4)
    ids, w = torch.where(ids % 3 == 1, -1, ids)[:t], w[:t]
    x = torch.randn(t, R, generator=torch.Generator().manual_seed(8)).to(dtype)
    start = torch.randn(t, R, generator=torch.Generator().manual_seed(9))
    acc = start.clone()
    cpu.expert_mlp(x, ids, w, slots, store, layout, SHAPES, beta=4.0, beta_lin=25.0, acc=acc)
    want = _per_expert(x, ids, w, slots, store, layout, start.numpy().copy())
    assert not np.array_equal(want, start.numpy())
    np.testing.assert_array_equal(acc.numpy(), want)


@pytest.mark.parametrize("T,K", [(1, 16), (5, 4), (16, 16), (40, 16)])
def test_group_picks_lists_and_numpy_agree(T, K, monkeypatch):
    """kernels.cpu.group_picks sorts Python lists up to LIST_PICKS picks and NumPy above; both
    give the same groups (experts ascending, each expert's picks in token order, -1 skipped,
    an expert picked twice by one token kept twice)."""
    g = torch.Generator().manual_seed(T * K)
    ids = torch.randint(-1, 12, (T, K), generator=g)
    ids[0, :2] = 3  # one token, one expert, two picks
    weights = torch.rand(T, K, generator=g).to(torch.bfloat16)
    want_pairs = sorted((int(e), t, k) for t in range(T) for k in range(K)
                        if (e := ids[t, k]) >= 0)
    got = {}
    for limit in (0, 1 << 20):  # every call through NumPy, then every call through lists
        monkeypatch.setattr(cpu, "LIST_PICKS", limit)
        got[limit] = cpu.group_picks(ids, weights)
    for needed, offsets, tok, wt in got.values():
        assert needed == sorted({e for e, _, _ in want_pairs})
        assert offsets.dtype == tok.dtype == np.int32 and wt.dtype == np.float32
        np.testing.assert_array_equal(tok, [t for _, t, _ in want_pairs])
        np.testing.assert_array_equal(wt, [weights[t, k].float() for _, t, k in want_pairs])
        np.testing.assert_array_equal(np.diff(offsets),
                                      [sum(e == x for x, _, _ in want_pairs) for e in needed])
        assert offsets[0] == 0 and offsets[-1] == len(want_pairs)


@pytest.mark.parametrize("mode,bits", [("t158", None), ("mxfp4", None), ("ct-int", 4)])
def test_layer_pipeline_is_exact_for_any_threads(mode, bits, isa):
    """A layer call runs its experts as one task pipeline (gate/up of one expert beside the down
    of the one before, three buffer sets reused round the window). With 8 experts (every set
    reused), token counts 0 to 5, and 1, 2, 3 or 8 threads, acc gets exactly what one-expert
    calls in the same order add."""
    layout, store = make_bank(mode, bits, seed=4)
    rng = np.random.default_rng(12)
    X = rng.standard_normal((T, R)).astype(np.float32)
    counts = [3, 0, 5, 1, 2, 5, 4, 1]
    tok = [np.sort(rng.choice(T, c, replace=False)).astype(np.int32) for c in counts]
    wt = [rng.uniform(0.1, 1.0, c).astype(np.float32) for c in counts]
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    start = rng.standard_normal((T, R)).astype(np.float32)
    want = start.copy()
    for e in range(E):  # one expert per call: no pipeline overlap, one set
        cpu_native.layer(layout, [store[e]], np.array([0, counts[e]], np.int32), tok[e], wt[e],
                         X, want, 4.0, 25.0, round_model=True, threads=1)
    assert not np.array_equal(want, start)
    for threads in (1, 2, 3, 8):
        acc = start.copy()
        cpu_native.layer(layout, list(store), offsets, np.concatenate(tok), np.concatenate(wt),
                         X, acc, 4.0, 25.0, round_model=True, threads=threads)
        np.testing.assert_array_equal(acc, want, err_msg=f"{threads} threads")


@pytest.mark.parametrize("backend", [reference, cpu], ids=["reference", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_acc_windows_equal_one_call(backend, dtype):
    """Windows of experts in ascending id order, the other picks set to -1 (empty), summed
    through `acc`: bit-identical to one call (each window holds all tokens of its experts)."""
    layout, store = make_bank("ct-int", 4)
    ids, w, slots = _routing(2)
    x = torch.randn(T, R, generator=torch.Generator().manual_seed(6)).to(dtype)
    whole = backend.expert_mlp(x, ids, w, slots, store, layout, SHAPES)
    acc = torch.zeros(T, R)
    for lo, hi in ((0, 3), (3, 4), (4, E)):
        mine = (ids >= lo) & (ids < hi)
        got = backend.expert_mlp(x, torch.where(mine, ids, -1), w, slots, store, layout, SHAPES,
                                 acc=acc)
        assert got is acc and got.dtype == torch.float32
    assert torch.equal(acc.to(dtype), whole)
    slot_t = torch.where(ids >= 0, E - 1 - ids, 0)  # the [T, K] slot form skips -1 picks too
    empty = torch.where(ids < 4, ids, -1)
    assert torch.equal(backend.expert_mlp(x, empty, w, slot_t, store, layout, SHAPES),
                       backend.expert_mlp(x, empty, w, slots, store, layout, SHAPES))
    with pytest.raises(ValueError, match="acc must be a float32"):
        backend.expert_mlp(x, ids, w, slots, store, layout, SHAPES, acc=torch.zeros(T, R + 1))
    with pytest.raises(ValueError, match="acc must be a float32"):
        backend.expert_mlp(x, ids, w, slots, store, layout, SHAPES,
                           acc=torch.zeros(T, R, dtype=torch.float64))


def test_bf16_bank_falls_back_to_reference():
    layout, store = make_bank("bf16", None)
    ids, w, slots = _routing()
    x = torch.randn(T, R)
    assert torch.equal(cpu.expert_mlp(x, ids, w, slots, store, layout, SHAPES),
                       reference.expert_mlp(x, ids, w, slots, store, layout, SHAPES))


def test_bad_inputs_give_clear_errors():
    rng = np.random.default_rng(0)
    m, _ = _ctint(3, "dense", False)(rng, 64, 128)
    X = np.zeros((2, 128), np.float32)
    with pytest.raises(TypeError, match=r"float32 \[n >= 1, 128\]"):
        cpu_native.gemm(m, X.astype(np.float64))
    with pytest.raises(TypeError, match=r"float32 \[n >= 1, 128\]"):
        cpu_native.gemm(m, np.zeros((2, 64), np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        cpu_native.gemm(m, np.zeros((128, 2), np.float32).T)
    with pytest.raises(ValueError, match="C-contiguous"):
        cpu_native.ctint(np.asfortranarray(m.packed), m.scale, m.zero, bits=3)
    with pytest.raises(TypeError, match="int32"):
        cpu_native.ctint(m.packed.view(np.uint32), m.scale, m.zero, bits=3)
    with pytest.raises(ValueError, match="4-bit codes in the dense layout"):
        cpu_native.ctint(m.packed, m.scale, m.zero, bits=4)
    with pytest.raises(ValueError, match="weight_zero_point"):
        cpu_native.ctint(m.packed, m.scale, m.zero[:1].copy(), bits=3)
    with pytest.raises(ValueError, match="bits 3 or 4"):
        cpu_native.ctint(m.packed, m.scale, bits=2)
    with pytest.raises(ValueError, match="multiple of 64"):
        cpu_native.mxfp4(np.zeros((4, 16), np.uint8), np.zeros((4, 1), np.uint8))
    bad = np.full((4, 2), 0xFF, np.uint8)
    with pytest.raises(ValueError, match="E8M0 0xFF"):
        cpu_native.gemm(cpu_native.mxfp4(np.zeros((4, 32), np.uint8), bad),
                        np.zeros((1, 64), np.float32))
    g, _ = _ctint(4, "dense", True)(rng, 64, 128)
    with pytest.raises(ValueError, match="expert shapes disagree"):
        cpu_native.expert(g, g, g, X, 4.0, 25.0)
    layout, store = make_bank("t158", None)
    X, acc = np.zeros((2, R), np.float32), np.zeros((2, R), np.float32)
    one = np.array([0, 1], np.int32), np.array([0], np.int32), np.ones(1, np.float32)
    with pytest.raises(TypeError, match=r"tok_offsets: expected int32 \[3\]"):
        cpu_native.layer(layout, store[:2], *one, X, acc, 4.0, 25.0)
    with pytest.raises(ValueError, match="bad shape or parameter"):  # token 2 of T = 2
        cpu_native.layer(layout, store[:1], one[0], np.array([2], np.int32), one[2], X, acc,
                         4.0, 25.0)
    with pytest.raises(ValueError, match="acc"):
        cpu_native.layer(layout, store[:1], *one, X, acc[:1].copy(), 4.0, 25.0)
    ids, w, slots = _routing()
    with pytest.raises(KeyError, match="no slot"):
        cpu.expert_mlp(torch.zeros(T, R), ids, w, {0: 7}, store, layout, SHAPES)
    with pytest.raises(ValueError, match="want"):
        cpu.expert_mlp(torch.zeros(T, R), ids, w[:, :2], slots, store, layout, SHAPES)


def test_bench_quick_runs():
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_kernels.py"), "--quick"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "memory bandwidth" in p.stdout and "GB/s" in p.stdout
