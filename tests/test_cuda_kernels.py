"""CUDA routed-expert kernels. On the CPU: `cuda.route` (the device-side grouping of a prefill's
pairs, torch ops that run on CPU tensors too) and tools/gpu_check.py's no-GPU exit. Opt-in on a
GPU (`-m cuda`, auto-skipped without cupy or a device): cuda vs reference.expert_mlp for every
codec at T = 1, 5, 24, 40, 64 and 512 (the decode grouping up to 32 tokens, `route` above) in fp32
and bf16, at an odd geometry and at K3's; the device interface `moe_layer` with a slot table and
a workspace, captured in a CUDA graph; decode vs routed grouping; the acc keyword; windows of
experts with empty picks. tests/test_cuda_host.py checks the kernels' per-lane code on the CPU.

GPU geometry: R = 2112 (8.25 slices of 256 columns: partial chunks in gate/up), I = 192 (a
partial slice for down); E = 8 experts, K = 4, so at T = 40 each expert has about 20 tokens (a
pass of up to 32) and at T = 512 about 256 (eight passes).
Tolerances (relative to the reference's RMS / max): fp32 RMS 1e-5, max 1e-4; bf16 RMS 1e-2, max
5e-2 (an fp32 reorder can flip a bf16 rounding of a gate/up/h/y element: 2^-8 each).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import expert_banks
import numpy as np
import pytest
import torch

from mtplx_runtime.formats.record import align_up
from mtplx_runtime.kernels import cuda, reference

ROOT = Path(__file__).resolve().parent.parent
R, I, E, K = 2112, 192, 8, 4  # latent, expert width, experts, top-k
SHAPES = {"gate": (I, R), "up": (I, R), "down": (R, I)}
K3 = {"gate": (3072, 3584), "up": (3072, 3584), "down": (3584, 3072)}
# (mode, bits, group size; None: the mode's default): every row of the codec table's cuda column
CODECS = [("t158", None, None), ("mxfp4", None, None), ("ct-int", 3, None), ("ct-int", 4, None),
          ("ct-int", 4, 32), ("fp8-block", None, None)]
CODEC_IDS = ["t158", "mxfp4", "ctint3", "ctint4", "ctint4g32", "fp8block"]
TOL = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (1e-2, 5e-2)}  # (RMS, max) relative


# ---- CPU: the device-side grouping -----------------------------------------------------------

def check_route(ids: torch.Tensor, slot_of: torch.Tensor) -> None:
    pairs, start, items = cuda.route(ids, slot_of)
    T, k = ids.shape
    assert pairs.dtype == start.dtype == torch.int32 and start.shape == (T * k + 2,)
    flat = ids.reshape(-1)
    slot = {p: int(slot_of[e]) for p, e in enumerate(flat.tolist()) if e >= 0 and slot_of[e] >= 0}
    used = sorted(set(slot.values()))
    assert items == min(T * k, len(slot_of)) and len(used) <= items
    for j in range(items):
        run = pairs[start[j]:start[j + 1]].tolist()
        if j >= len(used):
            assert run == []  # items past the experts used are empty
            continue
        # item j: every pair of the j-th slot in ascending order, tokens ascending
        assert run == sorted(p for p, s in slot.items() if s == used[j]), j
    assert sorted(pairs[:int(start[len(used)])].tolist()) == sorted(slot)


def test_route_worked_example():
    ids = torch.tensor([[7, 2], [2, 5], [7, -1], [2, 6]])  # [T, K]; expert 6 has no slot
    slot_of = torch.tensor([-1, -1, 1, -1, -1, 0, -1, 4], dtype=torch.int32)
    pairs, start, items = cuda.route(ids, slot_of)
    # slot 0 (expert 5): pair 3; slot 1 (expert 2): pairs 1, 2, 6; slot 4 (expert 7): 0, 4
    assert pairs[:6].tolist() == [3, 1, 2, 6, 0, 4]
    assert items == 8 and start[:items + 1].tolist() == [0, 1, 4, 6, 6, 6, 6, 6, 6]
    check_route(ids, slot_of)


@pytest.mark.parametrize("T,k,experts", [(1, 16, 896), (40, 4, 8), (64, 16, 64), (33, 3, 5),
                                         (7, 2, 3)])
def test_route_invariants(T, k, experts):
    g = torch.Generator().manual_seed(T * 1000 + k)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k].sort().values for _ in range(T)])
    ids[torch.rand(T, k, generator=g) < 0.1] = -1  # empty picks
    slot_of = torch.randperm(experts, generator=g).to(torch.int32)
    slot_of[torch.rand(experts, generator=g) < 0.2] = -1  # absent experts
    check_route(ids, slot_of)


def test_gpu_check_without_gpu_exits_2_cleanly():
    if cuda.unavailable_reason() is None:
        pytest.skip("a GPU is present: run tools/gpu_check.py itself")
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stdout.startswith("gpu_check: no GPU: ") and "Traceback" not in p.stderr, p.stdout


# ---- GPU: cuda vs reference ------------------------------------------------------------------

def device_tier(layout, store):
    """A device SlotTier holding `store`'s records (slot s = store[s]), each prepared."""
    import cupy

    from mtplx_runtime.offload.slots import SlotTier

    tier = SlotTier("dev", layout.logical_bytes, len(store) * align_up(layout.logical_bytes),
                    device="cuda")
    for s in range(len(store)):
        tier.view(s)[...] = cupy.asarray(store[s])
    cupy.cuda.Device().synchronize()  # the bytes have landed: repack runs on its own stream
    for s in range(len(store)):
        cuda.repack(layout, tier.view(s))
    return tier


def routing(T, seed=1, experts=E, k=K, cols=R):
    """x [T, cols] (fp32), ids [T, k] ascending distinct, weights [T, k] fp32."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k].sort().values for _ in range(T)])
    return torch.randn(T, cols, generator=g), ids, torch.rand(T, k, generator=g)


def assert_near(got, want, dtype):
    got, want = got.detach().cpu().float(), want.detach().cpu().float()
    rms, mx = TOL[dtype]
    rel = ((got - want).norm() / want.norm()).item()
    worst = ((got - want).abs().max() / want.abs().max()).item()
    assert rel < rms and worst < mx, f"relative RMS {rel:.2e} (< {rms}), max {worst:.2e} (< {mx})"


@pytest.fixture(scope="module")
def banks():
    if cuda.unavailable_reason() is not None:
        pytest.skip(cuda.unavailable_reason())
    out = {}
    for m, b, g in CODECS:
        layout, store = expert_banks.make_bank(m, b, R, I, E, seed=0, scale=0.1, group=g)
        out[(m, b, g)] = (layout, store, device_tier(layout, store))
    return out


SLOTS = {e: E - 1 - e for e in range(E)}  # expert e in slot E-1-e (expert_banks)


@pytest.mark.cuda
@pytest.mark.parametrize("T", [1, 5, 24, 40, 64, 512])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode,bits,group", CODECS, ids=CODEC_IDS)
def test_cuda_matches_reference(banks, mode, bits, group, dtype, T):
    layout, store, tier = banks[(mode, bits, group)]
    x, ids, w = routing(T)
    x = x.to(dtype)
    want = reference.expert_mlp(x, ids, w, SLOTS, store, layout, SHAPES)
    for slots in ((E - 1 - ids).cuda(), SLOTS):  # a [T, K] slot tensor, a mapping
        got = cuda.expert_mlp(x.cuda(), ids.cuda(), w.cuda(), slots, tier, layout, SHAPES)
        assert got.dtype == dtype and got.shape == (T, R) and got.is_cuda
        assert_near(got, want, dtype)


def random_record(layout, rng):
    """One valid record of random codes: random packed bytes (every byte or nibble decodes),
    scales drawn from a narrow positive range (no Inf or NaN): no encoder run at K3 size."""
    from mtplx_runtime.formats.record import record_bytes

    parts = {}
    for seg in layout.segments:
        if seg.proj is None:
            continue
        if seg.part == "weight_scale_inv":  # fp8-block: fp32 1e-4 .. 1e-3
            a = (np.float32(1e-4) + rng.random(seg.shape, np.float32) * np.float32(9e-4))
        elif seg.part in ("scales", "weight_scale"):
            if layout.mode == "mxfp4":  # E8M0: 2^-9 .. 2^-5
                a = rng.integers(118, 123, seg.shape, dtype=np.uint8)
            else:  # bf16 bits of 0.004 .. 0.03
                a = (np.float32(0.004) + rng.random(seg.shape, np.float32) * 0.026)
                a = (a.view(np.uint32) >> 16).astype(np.uint16)
        elif seg.part == "weight":  # fp8-block: any e4m3 byte but the NaNs 0x7F, 0xFF
            a = rng.integers(0, 255, seg.shape, dtype=np.uint8)
            a[(a & 0x7F) == 0x7F] = 0x7E
        else:
            a = rng.integers(0, 256, (seg.length,), dtype=np.uint8).view(
                np.dtype(seg.dtype.replace("U8", "u1").replace("I32", "<i4"))).reshape(seg.shape)
        parts.setdefault(seg.proj, {})[seg.part] = a
    return np.frombuffer(record_bytes(layout, parts), np.uint8)


@pytest.fixture(scope="module")
def k3_banks():
    """Per codec: 2 K3-shaped experts of random codes in device slots (expert e in slot 1 - e),
    and their reference decode per dtype (made once: decoding K3 matrices is the slow part)."""
    from types import SimpleNamespace

    from mtplx_runtime.formats.record import record_layout

    if cuda.unavailable_reason() is not None:
        pytest.skip(cuda.unavailable_reason())
    rng = np.random.default_rng(2)
    out = {}
    for m, b, g in CODECS:
        layout = record_layout(SimpleNamespace(expert_shapes=K3), m, b, g)
        store = np.stack([random_record(layout, rng) for _ in range(2)])
        experts = {e: reference.decode_record(store[1 - e], layout, K3, torch.float32)
                   for e in range(2)}
        decoded = {torch.float32: experts, torch.bfloat16: {  # codec values are bf16-exact
            e: reference.ExpertWeights(*(t.to(torch.bfloat16) for t in (w.gate, w.up, w.down)))
            for e, w in experts.items()}}
        out[(m, b, g)] = (layout, device_tier(layout, store), decoded)
    return out


@pytest.mark.cuda
@pytest.mark.parametrize("T", [1, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode,bits,group", CODECS, ids=CODEC_IDS)
def test_k3_geometry(k3_banks, mode, bits, group, dtype, T):
    """K3's expert shapes (whole chunks and slices everywhere: the 8- and 16-byte load paths),
    2 experts, both picked by every token (T = 40: passes of 32 and 8 tokens)."""
    layout, tier, decoded = k3_banks[(mode, bits, group)]
    x, ids, w = routing(T, seed=3, experts=2, k=2, cols=3584)
    x = x.to(dtype)
    want = reference.routed_sum(x, ids, w, decoded[dtype])
    got = cuda.expert_mlp(x.cuda(), ids.cuda(), w.cuda(), {0: 1, 1: 0}, tier, layout, K3)
    assert_near(got, want, dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode,bits,group", CODECS, ids=CODEC_IDS)
def test_decode_and_routed_grouping_agree(banks, mode, bits, group, dtype, monkeypatch):
    """The same experts, tokens and passes either way: bit-identical sums."""
    layout, _, tier = banks[(mode, bits, group)]
    x, ids, w = routing(5, seed=2)
    args = (x.to(dtype).cuda(), ids.cuda(), w.cuda(), SLOTS, tier, layout, SHAPES)
    decode = cuda.expert_mlp(*args, acc=torch.zeros(5, R, device="cuda"))
    monkeypatch.setattr(cuda, "DECODE_MAX_T", 0)  # route() and the routed kernels at T = 5
    routed = cuda.expert_mlp(*args, acc=torch.zeros(5, R, device="cuda"))
    assert torch.equal(decode, routed)


@pytest.mark.cuda
@pytest.mark.parametrize("T", [1, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_acc_keyword(banks, dtype, T):
    layout, store, tier = banks[("mxfp4", None, None)]
    x, ids, w = routing(T, seed=3)
    args = (x.to(dtype).cuda(), ids.cuda(), w.cuda(), (E - 1 - ids).cuda(), tier, layout, SHAPES)
    routed = cuda.expert_mlp(*args, acc=torch.zeros(T, R, device="cuda"))  # fp32 sum from 0
    assert routed.dtype == torch.float32
    want = reference.expert_mlp(x.to(dtype), ids, w, (E - 1 - ids), store, layout, SHAPES)
    assert_near(routed, want, dtype)
    acc0 = torch.randn(T, R, generator=torch.Generator().manual_seed(4)) * 10
    acc = acc0.cuda()
    got = cuda.expert_mlp(*args, acc=acc)
    assert got is acc and got.dtype == torch.float32  # written in place, returned un-cast
    # Same contract as the reference: the sum starts from acc0, then adds k ascending.
    want = reference.expert_mlp(x.to(dtype), ids, w, (E - 1 - ids), store, layout, SHAPES,
                                acc=acc0.clone())
    assert_near(got - acc0.cuda(), want - acc0, dtype)  # the routed part, at its own scale
    if dtype == torch.float32:  # bf16: a flipped y rounding is within assert_near, not this
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5,
                                   atol=1e-5 * want.abs().max().item())


@pytest.mark.cuda
@pytest.mark.parametrize("T", [1, 40])
def test_windows_of_experts_with_empty_picks(banks, T):
    """The streaming provider's windows: picks outside a window are -1 (skipped); two windows
    summed through acc equal one call (decode and routed grouping alike)."""
    layout, _, tier = banks[("t158", None, None)]
    x, ids, w = routing(T, seed=5)
    full = cuda.expert_mlp(x.cuda(), ids.cuda(), w.cuda(), SLOTS, tier, layout, SHAPES,
                           acc=torch.zeros(T, R, device="cuda"))
    acc = torch.zeros(T, R, device="cuda")
    for lo, hi in ((0, E // 2), (E // 2, E)):
        part = torch.where((ids >= lo) & (ids < hi), ids, -1)
        cuda.expert_mlp(x.cuda(), part.cuda(), w.cuda(), SLOTS, tier, layout, SHAPES, acc=acc)
    torch.testing.assert_close(acc, full, rtol=1e-6, atol=1e-6 * full.abs().max().item())


@pytest.mark.cuda
def test_missing_slot_is_a_key_error(banks):
    layout, _, tier = banks[("t158", None, None)]
    x, ids, w = routing(2, seed=6)
    with pytest.raises(KeyError, match="no slot given"):
        cuda.expert_mlp(x.cuda(), ids.cuda(), w.cuda(), {0: 7}, tier, layout, SHAPES)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode,bits,group", CODECS, ids=CODEC_IDS)
def test_moe_layer_in_a_cuda_graph(banks, mode, bits, group, dtype):
    """The device interface: slot table, workspace, no host sync; a captured decode step replays
    to the eager result for new inputs copied into the same buffers (the block counters reset
    themselves between launches)."""
    layout, store, tier = banks[(mode, bits, group)]
    base, stride = cuda._slot_base(tier)
    slot_of = torch.tensor([SLOTS[e] for e in range(E)], dtype=torch.int32, device="cuda")
    T = 3
    ws = cuda.workspace(T, K, SHAPES, dtype, "cuda")
    x, ids, w = (torch.empty(T, R, dtype=dtype, device="cuda"),
                 torch.empty(T, K, dtype=torch.int64, device="cuda"),
                 torch.empty(T, K, device="cuda"))
    out = torch.empty(T, R, device="cuda")

    def step():
        cuda.moe_layer(x, ids, w, slot_of, base, stride, layout, SHAPES, ws, out)

    def load(seed):
        xs, i, ws_ = routing(T, seed=seed)
        x.copy_(xs.to(dtype)), ids.copy_(i), w.copy_(ws_)
        return xs.to(dtype), i, ws_

    load(7)
    step()  # warm-up: compiles and loads the module outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in (8, 9):
        xs, i, ws_ = load(seed)
        graph.replay()
        torch.cuda.synchronize()
        want = reference.expert_mlp(xs, i, ws_, SLOTS, store, layout, SHAPES, acc=torch.zeros(T, R))
        assert_near(out, want, dtype)
        eager = out.clone()
        step()
        assert torch.equal(out, eager)
