"""The CPU library's SiTU-GLU (native/cpu/glu.c): its own exp and tanh in fp32, so every ISA path
gives the same bits, and within a few ulp of float64 math, as torch's formula is."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mtplx_runtime.kernels import cpu_native

why = cpu_native.unavailable_reason()
pytestmark = pytest.mark.skipif(why is not None, reason=why or "")
ISAS = [name for name in cpu_native.ISAS if why is None
        and cpu_native.ISAS.index(name) <= cpu_native.ISAS.index(cpu_native.best_isa())]
BETA, BETA_LIN = 4.0, 25.0


@pytest.fixture(autouse=True)
def restore_isa():
    yield
    cpu_native.set_isa(None)


def _glu(g, u, isa, round_model=False):
    cpu_native.set_isa(isa)
    return cpu_native.situ_glu(g, u, BETA, BETA_LIN, round_model=round_model)


def _inputs():
    """Wide random values, every branch edge (tanh's switch at |y| = 0.4: g = 1.6, u = 10; the exp
    clamps at -87 and 88), special values, and a length that is no multiple of 16."""
    rng = np.random.default_rng(3)
    edges = np.array([0.0, -0.0, 1e-30, -1e-30, 1e-6, 1.6, -1.6, 1.5999999, 1.6000001, 10.0,
                      -10.0, 9.999999, 87.0, -87.0, 88.0, 100.0, -100.0, 176.0, -400.0, 3e38,
                      -3e38, np.inf, -np.inf, np.nan], np.float32)
    g = np.concatenate([rng.standard_normal(4001) * 6, rng.uniform(-200, 200, 2000), edges,
                        np.roll(edges, 5)]).astype(np.float32)
    u = np.concatenate([rng.standard_normal(4001) * 40, rng.uniform(-500, 500, 2000),
                        np.roll(edges, 7), edges]).astype(np.float32)
    return g, u


def _float64(g, u):
    gd, ud = g.astype(np.float64), u.astype(np.float64)
    with np.errstate(over="ignore"):
        return BETA * np.tanh(gd / BETA) / (1 + np.exp(-gd)) * BETA_LIN * np.tanh(ud / BETA_LIN)


@pytest.mark.parametrize("round_model", [False, True])
def test_every_isa_gives_the_scalar_bits(round_model):
    g, u = _inputs()
    want = _glu(g, u, "scalar", round_model)
    nan = np.isnan(want)
    np.testing.assert_array_equal(nan, np.isnan(g) | np.isnan(u))  # NaN in, NaN out; no other
    for isa in ISAS:
        got = _glu(g, u, isa, round_model)
        np.testing.assert_array_equal(np.isnan(got), nan, err_msg=isa)
        np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32),
                                      err_msg=isa)


def _ulps(got, ref):
    return np.abs(got.astype(np.float64) - ref) / np.spacing(np.abs(ref).astype(np.float32))


def test_within_a_few_ulp_of_float64_like_torch():
    g, u = _inputs()
    ref = _float64(g, u)
    # below 1e-30 (g < -60 or so: sigmoid ~ e^g) only an absolute bound holds: exp's clamp at 88
    # makes sigmoid(g < -88) 6e-39, not e^g (torch is off by millions of ulp there too)
    normal = np.isfinite(ref) & (np.abs(ref) >= 1e-30)
    gt, ut = torch.from_numpy(g), torch.from_numpy(u)
    torch_h = (BETA * torch.tanh(gt / BETA) * torch.sigmoid(gt)
               * (BETA_LIN * torch.tanh(ut / BETA_LIN))).numpy()
    torch_worst = _ulps(torch_h[normal], ref[normal]).max()
    for isa in ISAS:
        err = _ulps(_glu(g, u, isa)[normal], ref[normal])
        assert err.max() <= 6, (isa, err.max(), torch_worst)
    tiny = np.isfinite(ref) & ~normal
    assert tiny.any()
    assert np.abs(_glu(g, u, ISAS[-1])[tiny] - ref[tiny]).max() <= 1e-36


def test_each_factor_alone_within_three_ulp():
    """g = 60 makes tanh(g / beta) sigmoid(g) exactly 1, so h = beta beta_lin tanh(u / beta_lin);
    u = 2000 makes the u factor 25 exactly, so h = 25 beta tanh(g / beta) sigmoid(g)."""
    rng = np.random.default_rng(5)
    x = np.concatenate([rng.standard_normal(3000) * 12, rng.uniform(-1e-3, 1e-3, 500),
                        np.linspace(-60, 60, 2001)]).astype(np.float32)
    xd = x.astype(np.float64)
    flat = np.full_like(x, 60.0), np.full_like(x, 2000.0)
    ref_u = BETA * BETA_LIN * np.tanh(xd / BETA_LIN)
    ref_g = BETA_LIN * BETA * np.tanh(xd / BETA) / (1 + np.exp(-xd))
    for isa in ISAS:
        for got, ref in ((_glu(flat[0], x, isa), ref_u), (_glu(x, flat[1], isa), ref_g)):
            keep = np.abs(ref) >= 1e-30
            assert _ulps(got[keep], ref[keep]).max() <= 3, isa


def test_special_values():
    g = np.array([np.nan, 0.0, 1.0, np.inf, -np.inf, 3.0], np.float32)
    u = np.array([1.0, 1.0, np.nan, 2.0, 2.0, 0.0], np.float32)
    for isa in ISAS:
        h = _glu(g, u, isa)
        assert np.isnan(h[0]) and np.isnan(h[2]), isa
        assert h[1] == 0 and h[5] == 0, isa  # tanh(0) = 0 on either side
        want_inf = np.float32(BETA * BETA_LIN * np.tanh(2.0 / BETA_LIN))  # tanh, sigmoid -> 1
        assert abs(h[3] - want_inf) <= 4 * np.spacing(want_inf), isa
        assert abs(h[4]) <= 1e-36, isa  # sigmoid(-inf) = 0, but for the clamp


def test_bad_arguments():
    g = np.zeros(4, np.float32)
    with pytest.raises(TypeError, match="float32"):
        cpu_native.situ_glu(g.astype(np.float64), g, BETA, BETA_LIN)
    with pytest.raises(ValueError, match="one shape"):
        cpu_native.situ_glu(g, g[:3], BETA, BETA_LIN)
