"""fp8 residents and the kernel selection of quantized residents (model/quant.py, FORMAT.md
"Quantized residents"): the e4m3 encoder against a by-definition rounding, the one table of which
kernel a (kind, device, capability, shape) gets, the rowwise `_scaled_mm` path (torch's CPU
`_scaled_mm` runs it here) against an fp64 product of the same quantized operands and against
the reference, the CPU fallback said once, and the fast path on a GPU where one is present."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from test_quant import bf16  # the same random bf16 matrices as the int8/int4 tests

from mtplx_runtime import load_model
from mtplx_runtime.cli import main as cli
from mtplx_runtime.cli.demo import TRAINED
from mtplx_runtime.engine.generate import generate
from mtplx_runtime.engine.tokenizer import load_tokenizer
from mtplx_runtime.formats.resident_layouts import FP8_MAX, quantized_bytes, stored_tensors
from mtplx_runtime.formats.resident_quant import encode_fp8
from mtplx_runtime.model import quant
from mtplx_runtime.model.quant import (
    GEMV,
    REFERENCE,
    Fp8Weight,
    kernel_for,
    linear,
    quantize,
    quantize_fp8,
    scaled_mm_rowwise,
)


def e4m3(v: float) -> float:
    """float8_e4m3fn round-to-nearest-even by definition: 3 mantissa bits, exponent >= -6
    (below it the subnormal step 2^-9), |v| <= 448 (the caller clamps)."""
    if v == 0:
        return 0.0
    e = max(math.floor(math.log2(abs(v))), -6)
    step = 2.0 ** (e - 3)
    return round(v / step) * step  # Python's round is half-to-even


def test_fp8_encoder_by_definition():
    w = bf16(12, 40, seed=1, scale=0.05)
    w[4] = 0  # a zero row
    w[7, :5] = torch.tensor([1e-6, -3e-7, 2.0, 0.0, -2.0])  # subnormal codes beside the max
    q, scale = encode_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (12,)
    assert scale[4] == 1 and not q[4].float().any()
    w32 = w.float()
    for n in range(12):
        if n != 4:
            assert scale[n] == w32[n].abs().max() / FP8_MAX  # in fp32
        for k in range(40):
            v = (w32[n, k] / scale[n]).clamp(-FP8_MAX, FP8_MAX).item()  # fp32 quotient
            assert q[n, k].item() == e4m3(v), (n, k)
    assert torch.all(q.float().abs().amax(1)[torch.arange(12) != 4] == FP8_MAX)
    # the reference dequantization: q · scale in fp32, rounded once to bf16
    want = (q.float() * scale[:, None]).to(torch.bfloat16)
    assert torch.equal(quantize_fp8(w).dequantize(), want)


def test_fp8_layout_sizes_and_stored_tensors():
    assert stored_tensors("m.weight", (64, 96), "BF16", "fp8") == {
        "m.weight": ("F8_E4M3", (64, 96)), "m.weight_scale": ("F32", (64,))}
    assert quantized_bytes((64, 96), "fp8") == 64 * 96 + 4 * 64 == quantize_fp8(
        bf16(64, 96)).nbytes
    # the rule is dtype-independent: the router, kv_b and F32 tensors are never stored as fp8
    for name, dt in (("l.block_sparse_moe.gate.weight", "BF16"), ("l.kv_b_proj.weight", "BF16"),
                     ("l.q_conv1d.weight", "F32")):
        assert stored_tensors(name, (64, 96), dt, "fp8") == {name: (dt, (64, 96))}
    assert isinstance(quantize(bf16(24, 40), "fp8"), Fp8Weight)  # every shape: no fallback


def _all(op, device_type):
    return True


@pytest.mark.parametrize("kind,device,cap,shape,want", [
    ("int8", "cpu", None, (64, 96), "int8pack_cpu"),
    ("int8", "cpu", None, (64, 24), REFERENCE),  # torch's CPU kernel misreads K % 16 != 0
    ("int8", "cuda", (9, 0), (64, 24), "int8pack_cuda"),  # the CUDA kernel takes any K
    ("int8", "cuda", (7, 0), (7168, 2048), "int8pack_cuda"),
    ("int4", "cpu", None, (64, 96), "int4pack_cpu"),
    ("int4", "cpu", None, (24, 96), REFERENCE),
    ("int4", "cuda", (9, 0), (24, 96), "int4pack_cuda"),  # CUDA tiles rows by 8
    ("int4", "cuda", (9, 0), (20, 96), REFERENCE),
    ("int4", "cuda", (7, 5), (7168, 2048), REFERENCE),  # no bf16 mma.sync before sm_80
    ("fp8", "cpu", None, (7168, 2048), REFERENCE),
    ("fp8", "cuda", (8, 6), (7168, 2048), REFERENCE),  # no fp8 tensor cores before sm_89
    ("fp8", "cuda", (8, 9), (7168, 2048), "scaled_mm"),
    ("fp8", "cuda", (9, 0), (100, 96), REFERENCE),  # _scaled_mm wants N, K % 16 == 0
    ("fp8", "cuda", (9, 0), (96, 100), REFERENCE),
    ("fp8", "mps", None, (64, 96), REFERENCE),
])
def test_the_kernel_table(kind, device, cap, shape, want):
    name, why = kernel_for(kind, device, cap, shape, registered=_all)
    assert name == want and bool(why) == (want == REFERENCE)


@pytest.mark.parametrize("kind,device,shape,tokens,gemv,want", [
    ("int8", "cuda", (7168, 2048), 1, True, GEMV),
    ("int8", "cuda", (7168, 2048), 32, True, GEMV),
    ("int8", "cuda", (7168, 2048), 33, True, "int8pack_cuda"),  # more rows: torch's kernel
    ("int8", "cuda", (7168, 2048), None, True, "int8pack_cuda"),  # any number of rows
    ("int8", "cuda", (7168, 2048), 1, False, "int8pack_cuda"),  # no cupy: no GEMV
    ("int8", "cuda", (100, 96), 1, True, "int8pack_cuda"),  # N % 16: the GEMV refuses
    ("fp8", "cuda", (7168, 2048), 5, True, GEMV),
    ("fp8", "cuda", (64, 24), 1, True, REFERENCE),  # K % 16: neither the GEMV nor _scaled_mm
    ("int4", "cuda", (7168, 2048), 1, True, GEMV),
    ("int4", "cuda", (7168, 2048), 40, True, REFERENCE),  # held for the GEMV: dequantize
    ("int4", "cuda", (7168, 2048), 40, False, "int4pack_cuda"),
    ("int4", "cuda", (7168, 48), 1, True, "int4pack_cuda"),  # K % 32: tinygemm keeps it
    ("int8", "cpu", (64, 96), 1, True, "int8pack_cpu"),  # the GEMV is CUDA only
])
def test_the_gemv_takes_a_few_rows(kind, device, shape, tokens, gemv, want):
    name, why = kernel_for(kind, device, (9, 0), shape, registered=_all, tokens=tokens,
                           gemv=gemv)
    assert name == want and bool(why) == (want == REFERENCE)


def test_a_torch_without_the_op_computes_through_the_reference():
    name, why = kernel_for("int4", "cuda", (9, 0), (64, 96), registered=lambda op, d: False)
    assert name == REFERENCE and "_weight_int4pack_mm" in why and torch.__version__ in why
    # this CPU build: int8/int4 CPU kernels exist, CUDA ones do not
    assert kernel_for("int8", "cpu", None, (64, 96))[0] == "int8pack_cpu"
    if not torch.cuda.is_available():
        assert kernel_for("int8", "cuda", (9, 0), (64, 96))[0] == REFERENCE
    with pytest.raises(ValueError, match="quantized kind"):
        kernel_for("int2", "cpu", None, (64, 96))


def test_fp8_on_the_cpu_is_the_reference_said_once(caplog, monkeypatch):
    quant._say_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="mtplx_runtime.model.quant"):
        a, b = quantize_fp8(bf16(64, 96, seed=2)), quantize_fp8(bf16(32, 64, seed=3))
    said = [r for r in caplog.records if "fp8 residents on cpu" in r.getMessage()]
    assert len(said) == 1 and "reference dequantization" in said[0].getMessage()
    assert a.kernel == b.kernel == REFERENCE and not a.fast()
    # the reference dequantizes a block of rows at a time; blocks change nothing
    monkeypatch.setattr(quant, "_BLOCK", 96 * 10)  # 10-row blocks: 7 of them, the last short
    x = bf16(5, 96, seed=4)
    assert torch.equal(linear(x, a), F.linear(x, a.dequantize()))


def _dequantized(q, scale):
    return q.double() * scale.double()[:, None]


CPU_SCALED_MM = quant._registered("_scaled_mm", "cpu")


@pytest.mark.skipif(not CPU_SCALED_MM, reason=f"torch {torch.__version__} has no CPU _scaled_mm")
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_rowwise_scaled_mm_is_the_product_of_the_quantized_operands(tokens):
    """The fast path's arithmetic, run through torch's CPU `_scaled_mm`: per-row e4m3 x times the
    e4m3 weights with both scales, accumulated in fp32 and rounded to bf16 once: within a bf16
    dot product's bound of the fp64 product of exactly those operands. A transposed, missing or
    squared scale moves results by far more."""
    w, x = quantize_fp8(bf16(96, 256, seed=5)), bf16(tokens, 256, seed=6, scale=3.0)
    y = scaled_mm_rowwise(x, w.q, w.scale)
    assert y.dtype == torch.bfloat16 and y.shape == (tokens, 96)
    xq, sx = encode_fp8(x)
    a, b = _dequantized(xq, sx), _dequantized(w.q, w.scale)
    assert torch.all((y.double() - a @ b.T).abs() <= (a.abs() @ b.abs().T) * 2 ** -8)


# fp8 fast path vs the reference (x @ dequantize(w)ᵀ in bf16): rounding x to e4m3 moves each
# x_k by at most 2^-4 |x_k| (half an e4m3 step) or 2^-10 s_x (subnormals); plus the reference's
# bf16 rounding of w and both products' bf16 rounding: the bound below (FORMAT.md). In the mean
# it is far smaller: rel-RMS measured 0.027-0.030 on these N(0, 1) matrices; a bug (a wrong
# scale, an unquantized x fed to the fp8 kernel) is O(1).
FP8_ACT_REL_RMS = 0.04


def fp8_bound(x, w):
    """|fast - reference| bound per output, [T, N] (float64)."""
    xd, wd = x.double(), w.dequantize().double()
    sx = xd.abs().amax(1, keepdim=True) / FP8_MAX
    return (2 ** -4 + 2 ** -7) * (xd.abs() @ wd.abs().T) + 2 ** -10 * sx * wd.abs().sum(1)


def check_fp8_fast(x, w, y):
    ref = x.double() @ w.dequantize().double().T
    assert torch.all((y.double() - ref).abs() <= fp8_bound(x, w))
    assert (y.double() - ref).norm() / ref.norm() < FP8_ACT_REL_RMS


@pytest.mark.skipif(not CPU_SCALED_MM, reason=f"torch {torch.__version__} has no CPU _scaled_mm")
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_rowwise_scaled_mm_against_the_reference_within_the_stated_bound(tokens):
    w, x = quantize_fp8(bf16(1024, 256, seed=7)), bf16(tokens, 256, seed=8)
    check_fp8_fast(x, w, scaled_mm_rowwise(x, w.q, w.scale))


def _cuda_fp8() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    if torch.cuda.get_device_capability() < (8, 9):
        return f"compute capability {torch.cuda.get_device_capability()} has no fp8"
    return None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0),
                    reason="int8/int4 CUDA kernels: no CUDA device of compute capability >= 8.0")
@pytest.mark.parametrize("tokens", [1, 5, 40])
@pytest.mark.parametrize("dtype,kernel", [("int8", "int8pack_cuda"), ("int4", "int4pack_cuda")])
def test_int8_int4_kernels_on_the_gpu(dtype, kernel, tokens):
    """The kernel a call gets (the project's GEMV up to 32 rows where cupy runs; torch's CUDA
    weight-only matmuls, the int4 one after the nibble swap and tiling of `Int4Weight.packed`,
    or int4's dequantization where the GEMV holds it) against the reference, within a bf16 dot
    product's bound."""
    op = quant.KERNEL_OPS[kernel]
    if not quant._registered(op, "cuda"):
        pytest.skip(f"torch {torch.__version__} has no CUDA {op}: the reference runs instead")
    w = bf16(2048, 7168, seed=13).cuda()
    held = quantize(w, dtype)
    cap = torch.cuda.get_device_capability()
    got = kernel_for(dtype, "cuda", cap, (2048, 7168), tokens=tokens)[0]
    if quant.gemv_runs():
        assert got == (quant.GEMV if tokens <= 32 else kernel if dtype == "int8" else REFERENCE)
    else:
        assert held.kernel == kernel and got == kernel
    stated = quant.quantize_int8(w) if dtype == "int8" else quant.quantize_int4(w)
    x = bf16(tokens, 7168, seed=14).cuda()
    deq = stated.dequantize().double()
    y = linear(x, held).double()
    assert torch.all((y - x.double() @ deq.T).abs() <= (x.double().abs() @ deq.abs().T) * 2 ** -8)


@pytest.mark.cuda
@pytest.mark.parametrize("tokens", [1, 5, 32])
@pytest.mark.parametrize("shape", [(16384, 7168), (2048, 7168), (7168, 2048), (48, 160)])
@pytest.mark.parametrize("dtype", ["int8", "fp8", "int4"])
def test_the_gemv_on_the_gpu(dtype, shape, tokens):
    """The residents' GEMV (kernels/cuda_residents.py) against the reference dequantization:
    bf16 inputs, fp32 sums, so within a bf16 dot product's bound for every kind (fp8 too: the
    GEMV does not round x to e4m3), at a wide lm_head (the column split), K3 widths and a small
    odd shape; every output written (the output starts as NaN garbage)."""
    from mtplx_runtime.kernels import cuda_residents

    if cuda_residents.unavailable_reason() is not None:
        pytest.skip(cuda_residents.unavailable_reason())
    n, k = shape
    if dtype == "int4" and k % 32:
        pytest.skip("int4 needs whole groups of 32")
    w = bf16(n, k, seed=15).cuda()
    stated = {"int8": quant.quantize_int8, "fp8": quant.quantize_fp8,
              "int4": quant.quantize_int4}[dtype](w)
    args = (stated.q, stated.scale, getattr(stated, "zero", None))
    x = bf16(tokens, k, seed=16).cuda()
    y = cuda_residents.gemv(dtype, *args, x).double()
    assert y.shape == (tokens, n) and not torch.isnan(y).any()
    deq = stated.dequantize().double()
    ref = x.double() @ deq.T
    assert torch.all((y - ref).abs() <= (x.double().abs() @ deq.abs().T) * 2 ** -8)
    assert torch.equal(cuda_residents.gemv(dtype, *args, x).double(), y)  # deterministic


@pytest.mark.cuda
@pytest.mark.skipif(_cuda_fp8() is not None, reason=f"fp8 fast path: {_cuda_fp8()}")
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_fp8_fast_path_on_the_gpu(tokens):
    w = quantize_fp8(bf16(2048, 7168, seed=9).cuda())
    assert w.kernel == "scaled_mm" and w.fast()
    x = bf16(tokens, 7168, seed=10).cuda()
    check_fp8_fast(x, w, linear(x, w))
    refused = quantize_fp8(bf16(100, 96, seed=11).cuda())  # N % 16 != 0
    assert refused.kernel == REFERENCE
    x = bf16(tokens, 96, seed=12).cuda()
    assert torch.equal(linear(x, refused), F.linear(x, refused.dequantize()))


def test_the_cli_takes_fp8(capsys):
    prompt = "In the beginning"
    assert cli(["generate", "--model", str(TRAINED), "--prompt", prompt, "--max-tokens", "4",
                "--resident-dtype", "fp8"]) == 0
    tok = load_tokenizer(TRAINED)
    model = load_model(TRAINED, dtype="bfloat16", resident_dtype="fp8")
    assert isinstance(model.top["lm_head.weight"], Fp8Weight)
    ids, _ = generate(model, tok.encode(prompt), max_tokens=4)
    assert capsys.readouterr().out == tok.decode(ids) + "\n"
    assert cli(["plan", "--model", str(TRAINED), "--memory-budget", "8GiB", "--json",
                "--resident-dtype", "fp8"]) == 0
    assert '"resident_dtype": "fp8"' in capsys.readouterr().out
