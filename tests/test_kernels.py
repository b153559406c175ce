"""Kernel API: reference vs LatentMoE bit for bit, backend selection, the CUDA sources' compile
check (when nvcc is on PATH) and, opt-in on a GPU, cuda vs reference."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import expert_banks
import pytest
import torch

from mtplx_runtime import kernels
from mtplx_runtime.formats.record import PROJECTIONS
from mtplx_runtime.kernels import reference
from mtplx_runtime.model.moe import LatentMoE, ResidentExpertProvider

ROOT = Path(__file__).resolve().parent.parent
R, I, E, K, T = 64, 128, 8, 4, 5  # latent, expert width, experts, top-k, tokens
SHAPES = {"gate": (I, R), "up": (I, R), "down": (R, I)}
MODES = [("t158", None), ("mxfp4", None), ("ct-int", 3), ("ct-int", 4), ("fp8-block", None),
         ("ct-int-asym", 3), ("bf16", None)]
CUDA_MODES = MODES[:5]  # the ones the codec table's cuda column runs


def make_bank(mode, bits, seed=0):
    return expert_banks.make_bank(mode, bits, R, I, E, seed)


def bank_provider(layout, store, dtype):
    """Resident experts decoded from the bank records in `store` (expert e in slot E-1-e)."""
    return ResidentExpertProvider(
        lambda layer, e: reference.decode_record(store[E - 1 - e], layout, SHAPES, dtype), dtype)


def moe_layer(provider, dtype):
    """A LatentMoE whose latent projections are identities and with no norm or shared experts,
    so its output is exactly the routed sum (identity GEMMs are exact in any dtype)."""
    cfg = SimpleNamespace(num_experts_per_token=K, moe_renormalize=True,
                          routed_scaling_factor=2.5, activation_situ_beta=4.0,
                          activation_situ_linear_beta=25.0, latent_moe_use_norm=False,
                          num_shared_experts=0, rms_norm_eps=1e-5)
    g = torch.Generator().manual_seed(3)
    weights = {"gate.weight": torch.randn(E, R, generator=g).to(dtype),
               "gate.e_score_correction_bias": torch.zeros(E),
               "routed_expert_down_proj.weight": torch.eye(R, dtype=dtype),
               "routed_expert_up_proj.weight": torch.eye(R, dtype=dtype)}
    return LatentMoE(cfg, 1, weights, provider)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode,bits", MODES)
def test_reference_matches_latent_moe_bit_exact(mode, bits, dtype):
    layout, store = make_bank(mode, bits)
    moe = moe_layer(bank_provider(layout, store, dtype), dtype)
    x = torch.randn(T, R, generator=torch.Generator().manual_seed(5)).to(dtype)
    want = moe.forward(x)
    ids, w = moe.last_ids, moe.last_weights
    assert len(torch.unique(ids)) > K  # several experts, some shared between tokens
    by_id = {e: E - 1 - e for e in range(E)}
    got = reference.expert_mlp(x, ids, w, by_id, store, layout, SHAPES)
    assert got.dtype == dtype and torch.equal(got, want)
    slot_t = (E - 1 - ids).to(torch.int32)  # [T, K] form of the same slots
    assert torch.equal(reference.expert_mlp(x, ids, w, slot_t, store, layout, SHAPES), want)
    # teeth: a different combine weight changes the bits
    assert not torch.equal(reference.expert_mlp(x, ids, w * 1.01, by_id, store, layout, SHAPES),
                           want)


def test_reference_rejects_bad_slots():
    layout, store = make_bank("t158", None)
    ids = torch.tensor([[0, 1]])
    w = torch.ones(1, 2)
    x = torch.zeros(1, R)
    with pytest.raises(KeyError, match="no slot"):
        reference.expert_mlp(x, ids, w, {0: 7}, store, layout, SHAPES)
    with pytest.raises(ValueError, match="two slots"):
        reference.expert_mlp(torch.zeros(2, R), torch.tensor([[0, 1], [0, 2]]),
                             torch.ones(2, 2), torch.tensor([[7, 6], [5, 4]]), store, layout,
                             SHAPES)


def test_select_backend(monkeypatch):
    monkeypatch.delenv(kernels.ENV, raising=False)
    assert kernels.select_backend("reference") is reference
    monkeypatch.setenv(kernels.ENV, "reference")
    assert kernels.select_backend() is reference
    with pytest.raises(ValueError, match="unknown kernel backend"):
        kernels.select_backend("tpu")
    monkeypatch.setenv(kernels.ENV, "tpu")
    with pytest.raises(ValueError, match="MTPLX_KERNELS"):
        kernels.select_backend()
    monkeypatch.delenv(kernels.ENV)
    auto = kernels.select_backend()
    assert auto.__name__.rsplit(".", 1)[-1] in kernels.BACKENDS
    assert hasattr(auto, "expert_mlp")


def test_cuda_requested_without_gpu_is_a_clear_error(monkeypatch):
    from mtplx_runtime.kernels import cuda

    monkeypatch.setattr(cuda, "unavailable_reason", lambda: "cupy is not installed")
    with pytest.raises(RuntimeError, match="'cuda' requested but unavailable: cupy is not"):
        kernels.select_backend("cuda")
    monkeypatch.setenv(kernels.ENV, "cuda")
    with pytest.raises(RuntimeError, match="cupy is not installed"):
        kernels.select_backend()
    monkeypatch.setenv(kernels.ENV, "auto")
    assert kernels.select_backend() is not cuda  # auto degrades instead
    with pytest.raises(RuntimeError, match="CUDA kernels unavailable"):
        cuda.expert_mlp(torch.zeros(1, R), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1),
                        {0: 0}, None, None, SHAPES)


def test_cuda_module_imports_without_cupy():
    code = ("import sys; sys.modules['cupy'] = None; import mtplx_runtime.kernels.cuda as c; "
            "r = c.unavailable_reason(); assert r and 'cupy' in r, r; print('ok')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr


def test_cuda_offsets_and_modes():
    from mtplx_runtime.kernels import cuda

    for mode, bits in CUDA_MODES:
        layout, _ = make_bank(mode, bits)
        cuda.kernel_key(layout)
        off = cuda.segment_offsets(layout)
        assert sorted(off) == sorted(f"{p}.{c}" for p in PROJECTIONS for c in ("packed", "scale"))
    for mode, bits in MODES[len(CUDA_MODES):]:
        with pytest.raises(NotImplementedError, match="no CUDA kernel"):
            cuda.kernel_key(make_bank(mode, bits)[0])


def test_cuda_refuses_fp8_block_widths_off_16():
    """A lane loads 16 whole columns of an fp8-block row (a 16-byte load): a projection of 200
    columns is refused at load, with the component named."""
    from mtplx_runtime.formats.record import record_layout
    from mtplx_runtime.kernels import cuda

    shapes = {"gate": (128, 200), "up": (128, 200), "down": (208, 128)}
    layout = record_layout(SimpleNamespace(expert_shapes=shapes), "fp8-block")
    assert "columns of every projection in multiples of 16; gate_proj.weight has 200" in \
        cuda.unsupported(layout)
    shapes = {"gate": (128, 208), "up": (128, 208), "down": (208, 128)}
    assert cuda.unsupported(record_layout(SimpleNamespace(expert_shapes=shapes), "fp8-block")) \
        is None


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_native_sources_compile_without_spills():
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "check_cuda.py")],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    sources = list((ROOT / "mtplx_runtime" / "kernels" / "native").glob("*.cu"))
    assert len(lines) == 2 * len(sources) and all(" ok: " in ln for ln in lines)


def test_parse_ptxas():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from check_cuda import parse_ptxas
    finally:
        sys.path.pop(0)
    text = ("ptxas info    : Compiling entry function 'k1' for 'sm_80'\n"
            "ptxas info    : Function properties for k1\n"
            "    16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
            "ptxas info    : Used 40 registers, used 1 barriers\n")
    assert parse_ptxas(text) == {"k1": {"registers": 40, "spill_bytes": 12, "stack_bytes": 16}}


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode,bits", CUDA_MODES)
def test_cuda_matches_reference(mode, bits, dtype):
    from mtplx_runtime.kernels import cuda
    from mtplx_runtime.offload.slots import SlotTier

    if cuda.unavailable_reason() is not None:
        pytest.skip(cuda.unavailable_reason())
    import cupy

    layout, store = make_bank(mode, bits)
    slot_bytes = -(-layout.logical_bytes // 4096) * 4096  # slots are 4 KiB-aligned
    tier = SlotTier("dev", layout.logical_bytes, E * slot_bytes, device="cuda")
    for s in range(E):
        tier.view(s)[...] = cupy.asarray(store[s])
    cupy.cuda.Device().synchronize()  # landed; then what the device reader does with a record
    for s in range(E):
        cuda.repack(layout, tier.view(s))
    moe = moe_layer(bank_provider(layout, store, dtype), dtype)
    x = torch.randn(T, R, generator=torch.Generator().manual_seed(5)).to(dtype)
    moe.forward(x)
    ids, w = moe.last_ids, moe.last_weights
    want = reference.expert_mlp(x, ids, w, {e: E - 1 - e for e in range(E)},
                                store, layout, SHAPES)
    got = cuda.expert_mlp(x.cuda(), ids.cuda(), w.cuda(), (E - 1 - ids).cuda(), tier, layout,
                          SHAPES)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.cpu().float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode,bits", [("t158", None), ("mxfp4", None)])
def test_cpu_matches_reference(mode, bits, dtype):
    """Native modes: fp32 sums in another order than the reference, so relative RMS below 1e-5
    (fp32) or within bf16 rounding of each expert output (bf16). bf16 banks have no packed
    format to compute on and must come back bit-identical through the reference path."""
    from mtplx_runtime.kernels import cpu

    if cpu.unavailable_reason():
        pytest.skip(cpu.unavailable_reason())
    layout, store = make_bank(mode, bits)
    moe = moe_layer(bank_provider(layout, store, dtype), dtype)
    x = torch.randn(T, R, generator=torch.Generator().manual_seed(5)).to(dtype)
    moe.forward(x)
    slots = {e: E - 1 - e for e in range(E)}
    want = reference.expert_mlp(x, moe.last_ids, moe.last_weights, slots, store, layout, SHAPES)
    got = cpu.expert_mlp(x, moe.last_ids, moe.last_weights, slots, store, layout, SHAPES)
    assert got.dtype == dtype and got.shape == want.shape
    if mode not in cpu.NATIVE_MODES:
        assert torch.equal(got, want)
        return
    rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert rel < (1e-5 if dtype == torch.float32 else 1e-2), rel
