"""The one short device validation: run it first on any machine with a GPU (about 3 min).

    python tools/gpu_check.py [--skip-timing] [--skip-generate] [--skip-decode]

Steps, each reported on its own lines, then one summary line:
  env       device, CUDA / cupy / torch / kvikio versions, kvikio GDS or compat (POSIX) mode
  compile   every kernels/native/*.cu through cupy RawModule (NVRTC; the modules in parallel
            subprocesses, which fill cupy's disk cache), each entry point loaded; registers, and
            FAIL on local memory
  tests     pytest -q -m cuda on the test files that have cuda tests (cuda vs kernels/reference
            for every codec at T = 1, 5, 24, 40, 64, 512 in fp32 and bf16, K3 geometry, the
            device interface in a CUDA graph, the residents' GEMV: tests/test_cuda_kernels.py,
            tests/test_quant_fp8.py)
  residents each quantized resident dtype (model/quant.py kernel_for: the GEMV up to 32 rows,
            torch's kernels above) vs its reference dequantization at T = 1, 5, 40 on K3 shapes
            and on one the kernels refuse, within the stated bound; then bf16 vs int8 vs int4 vs
            fp8 at T = 1 on a 16384 x 7168 matrix, one line per dtype
  timing    K3 geometry (R 3584, I 3072, 896 experts top-16 in device slots of random bytes) per
            codec: decode T = 1, 8 as ms per layer, GB/s over the packed bytes of the experts
            touched and % of the measured device copy bandwidth (goal: T = 1 >= 70 %, T = 8
            >= 50 %); prefill T = 64, 512, 4096 as % of the roofline max(bytes / copy rate,
            FLOPs / 790 TFLOP/s) (goal >= 50 %). Each line gives the kernels' time (a CUDA graph
            of moe_layer replayed, CUDA events) and the whole call's (moe_layer from Python, the
            same events around back-to-back calls) side by side; goals are reported, not enforced
  generate  `mtplx generate --kernels cuda` vs `--kernels reference` on a tiny streamed model
  decode    tools/bench_decode.py --kernels cuda on a small K3-geometry slice (2 MoE layers of
            DECODE_EXPERTS real-size t158 experts, DECODE_SLOTS slots per layer, cold drive):
            its lines as they come (tok/s against its bounds, host_ms_per_token)
Exit status: 0 all passed, 1 any failure (a kernel mismatch included), 2 no GPU (nothing run).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import traceback
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]  # the working tree's package and check_cuda

from check_cuda import expected_kernels  # noqa: E402  (after the path fix)

from mtplx_runtime.kernels import cuda  # noqa: E402  (imports no cupy)
from mtplx_runtime.offload.device_io import gds_status  # noqa: E402  (imports no kvikio)

K3 = {"gate": (3072, 3584), "up": (3072, 3584), "down": (3584, 3072)}
K3_EXPERTS, K3_TOPK = 896, 16
# (mode, bits, group size; None: the mode's default): the codec table's cuda column
CODECS = [("t158", None, None), ("mxfp4", None, None), ("ct-int", 3, None), ("ct-int", 4, None),
          ("ct-int", 4, 32), ("fp8-block", None, None)]
DECODE_T, PREFILL_T = (1, 8), (64, 512, 4096)
MATMUL_FLOPS = 790e12  # bf16 dense, measured on these H200s (device notes): the compute roofline
NO_GPU = 2
DECODE_EXPERTS, DECODE_SLOTS, DECODE_TOKENS = 128, 32, 32


def _first(*getters):
    """The first getter's value that does not raise, else the last error as text."""
    err = None
    for get in getters:
        try:
            return get()
        except Exception as e:  # API differences between kvikio releases
            err = e
    return f"unknown ({type(err).__name__})"


def kvikio_line() -> str:
    """kvikio's version and mode, and whether expert reads use it (offload/device_io.gds_status:
    only where cuFile reports GDS; the staged path otherwise)."""
    try:
        import kvikio
        import kvikio.defaults as d
    except Exception as e:
        return f"kvikio: not available ({type(e).__name__}: {e}); expert reads are staged"
    mode = _first(lambda: d.get("compat_mode"), lambda: d.compat_mode())
    gds, why = gds_status()
    return (f"kvikio {getattr(kvikio, '__version__', '?')}: compat_mode={mode} -> "
            + ("GDS reads for unverified records" if gds else f"staged reads ({why})"))


def env() -> bool:
    import cupy

    rt = cupy.cuda.runtime
    major, minor = torch.cuda.get_device_capability(0)
    print(f"device: {torch.cuda.get_device_name(0)} sm_{major}{minor}, "
          f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
    print(f"cuda: driver {rt.driverGetVersion()}, runtime {rt.runtimeGetVersion()}, "
          f"nvrtc {'.'.join(map(str, cupy.cuda.nvrtc.getVersion()))}")
    print(f"cupy {cupy.__version__}; torch {torch.__version__} (cuda {torch.version.cuda})")
    print(kvikio_line())
    return True


def compile_all() -> bool:
    sources = sorted(cuda.NATIVE.glob("*.cu"))
    t0 = time.perf_counter()
    # NVRTC compiles one module on one core: compile them side by side into cupy's disk cache
    warm = [subprocess.Popen([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                              "from mtplx_runtime.kernels import cuda; cuda.module(sys.argv[2])",
                              str(ROOT), src.name], stderr=subprocess.PIPE, text=True)
            for src in sources]
    for p, src in zip(warm, sources):
        if p.wait(timeout=300):
            print(f"compile {src.name}: FAIL\n{p.stderr.read()[-3000:]}")
            return False
    print(f"compile: {len(sources)} modules in {time.perf_counter() - t0:.0f}s (parallel)")
    ok = True
    for src in sources:
        mod = cuda.module(src.name)
        regs = []
        for name in sorted(expected_kernels(src)):
            fn = mod.get_function(name)
            bad = fn.local_size_bytes > 0  # a spill, or a register array indexed at run time
            regs.append(f"{name} {fn.num_regs}r" + (f" FAIL: {fn.local_size_bytes} B local"
                                                    if bad else ""))
            ok &= not bad
        print(f"compile {src.name}: " + ", ".join(regs))
    return ok


def tests() -> bool:
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                   if "pytest.mark.cuda" in p.read_text())
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", *files], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    tail = [ln for ln in p.stdout.splitlines() if ln.strip()][-1:] or ["(no output)"]
    if p.returncode:
        print(p.stdout[-8000:] + p.stderr[-2000:])
    print(f"pytest -m cuda ({len(files)} files): {tail[0]}")
    return p.returncode == 0 and "passed" in tail[0]


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device-to-device memcpy GB/s, counting read + write bytes (best of 5)."""
    a = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(6):  # the first is a warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * nbytes / best / 1e9


def _events_ms(fn, iters: int) -> float:
    """Mean ms per call of `iters` back-to-back calls, between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def time_call(fn, iters: int) -> tuple[float, float]:
    """(kernels ms, call ms): `fn` captured in a CUDA graph and replayed (the device's time, no
    launch gaps), and `fn` itself called back to back (its host work included when the host is
    the slower side). A capture that fails is said, and the call's time stands in."""
    fn()  # warm-up: compiles, allocates
    torch.cuda.synchronize()
    call = _events_ms(fn, iters)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        return _events_ms(graph.replay, iters), call
    except Exception as e:  # reported, then timed without the graph
        print(f"  (CUDA graph capture failed: {type(e).__name__}: {e}; kernels = call time)")
        torch.cuda.synchronize()
        return call, call


def expert_bank(mode, bits, group, slots):
    """(layout, tier, packed bytes per expert): `slots` K3 experts of random bytes in device
    slots, prepared for the kernels (the repack of t158 and ct-int3 runs on every slot)."""
    from mtplx_runtime.formats.record import align_up, record_layout
    from mtplx_runtime.offload.slots import SlotTier

    layout = record_layout(SimpleNamespace(expert_shapes=K3), mode, bits, group)
    packed = sum(s.length for s in layout.segments if s.part in cuda.COMPONENTS[mode])
    tier = SlotTier("bench", layout.logical_bytes, slots * align_up(layout.logical_bytes),
                    device="cuda")
    torch.as_tensor(tier.data, device="cuda").random_(0, 256)  # values do not change the time
    torch.cuda.synchronize()  # landed: repack runs on a stream of its own
    for s in range(slots):
        cuda.repack(layout, tier.view(s))
    return layout, tier, packed


def timing() -> bool:
    copy = copy_bandwidth()
    print(f"copy bandwidth: {copy:.0f} GB/s (1 GiB device-to-device copy, read + write)")
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    slot_of = torch.arange(K3_EXPERTS, dtype=torch.int32, device=dev)
    R, I = K3["down"]  # noqa: E741 (the legend's names)
    for mode, bits, group in CODECS:
        layout, tier, packed = expert_bank(mode, bits, group, K3_EXPERTS)
        base, stride = cuda._slot_base(tier)
        name = f"{mode}{bits or ''}{f'-g{group}' if group else ''}"
        for T in DECODE_T + PREFILL_T:
            ids = torch.rand(T, K3_EXPERTS, generator=g, device=dev).topk(K3_TOPK).indices
            ids = ids.sort(dim=1).values  # [T, K] distinct, ascending
            w = torch.rand(T, K3_TOPK, generator=g, device=dev)
            x = torch.randn(T, R, generator=g, device=dev).to(torch.bfloat16)
            ws = cuda.workspace(T, K3_TOPK, K3, torch.bfloat16, dev)
            out = torch.empty(T, R, device=dev)
            fn = partial(cuda.moe_layer, x, ids, w, slot_of, base, stride, layout, K3, ws, out)
            kernels, call = time_call(fn, 20 if T <= 512 else 5)
            moved = len(torch.unique(ids)) * packed  # each touched expert read once
            times = f"kernels {kernels:.3f} ms (graph), call {call:.3f} ms"
            if T in DECODE_T:
                gbs = moved / kernels / 1e6
                goal = 70 if T == 1 else 50
                print(f"timing {name} T={T}: {times}; {gbs:.0f} GB/s over {moved / 1e6:.0f} MB "
                      f"packed, {100 * gbs / copy:.0f}% of copy (goal >= {goal}%)")
            else:
                flops = 2 * T * K3_TOPK * 3 * I * R
                roof = max(moved / copy / 1e6, flops / MATMUL_FLOPS * 1e3)  # ms
                print(f"prefill {name} T={T}: {times}; roofline {roof:.3f} ms (max of "
                      f"{moved / 1e9:.2f} GB / copy, {flops / 1e12:.2f} TFLOP / 790 TF/s), "
                      f"{100 * roof / kernels:.0f}% of roofline (goal >= 50%)")
            del ws, out
        del tier
        torch.cuda.empty_cache()
    return True


# residents: [N, K] matrices at K3's widths (D 7168, R 3584), and [100, 96], which the GEMV
# (N % 16), int4's torch kernel (N % 8) and fp8's (N % 16) refuse, so they must take the
# reference there without failing.
RESIDENT_SHAPES = [(7168, 2048), (2048, 7168), (3584, 7168), (100, 96)]
RESIDENT_TIMING_SHAPE = (16384, 7168)


def _resident_error(dtype: str, x: torch.Tensor, w: torch.Tensor, quant) -> tuple[float, float]:
    """(max |fast - reference| / bound, rel-RMS vs reference) of one quantized matrix at x.
    Reference: x times the reference dequantization, in fp64. Bound: a bf16 dot product's 2^-8
    of sum |x||w| for int8/int4 and the GEMV (tests/test_quant.py); for fp8 through
    `_scaled_mm` the rowwise path also rounds x to e4m3 (tests/test_quant_fp8.py `fp8_bound`)."""
    held = quant.quantize(w, dtype)
    stated = {"int8": quant.quantize_int8, "fp8": quant.quantize_fp8}.get(dtype)
    if stated is None:  # int4: the stated layout, or int8 where K % 32 != 0 (quantized_kind)
        stated = quant.quantize_int8 if w.shape[1] % 32 else quant.quantize_int4
    deq = stated(w).dequantize().double()
    y = quant.linear(x, held).double()
    ref = x.double() @ deq.T
    sums = x.double().abs() @ deq.abs().T
    cap = torch.cuda.get_device_capability(0)
    kernel = quant.kernel_for(dtype, "cuda", cap, tuple(w.shape), tokens=x.shape[0])[0]
    if dtype == "fp8" and kernel == "scaled_mm":
        sx = x.double().abs().amax(1, keepdim=True) / 448
        bound = (2 ** -4 + 2 ** -7) * sums + 2 ** -10 * sx * deq.abs().sum(1)
    else:
        bound = sums * 2 ** -8
    return float(((y - ref).abs() / bound).max()), float((y - ref).norm() / ref.norm())


def residents() -> bool:
    from mtplx_runtime.model import quant

    cap = torch.cuda.get_device_capability(0)
    g = torch.Generator(device="cpu").manual_seed(0)
    ok = True
    for dtype in ("int8", "int4", "fp8"):
        for n, k in RESIDENT_SHAPES:
            w = (torch.randn(n, k, generator=g) * 0.02).to("cuda", torch.bfloat16)
            kind = "int8" if dtype == "int4" and k % 32 else dtype
            kernels = [quant.kernel_for(kind, "cuda", cap, (n, k), tokens=T)[0] for T in (1, 40)]
            worst, rms = 0.0, 0.0
            for T in (1, 5, 40):
                x = torch.randn(T, k, generator=g).to("cuda", torch.bfloat16)
                e, r = _resident_error(dtype, x, w, quant)
                worst, rms = max(worst, e), max(rms, r)
            # fp8-rowwise rel-RMS measured 0.027-0.030 on N(0, 1) data (CPU _scaled_mm)
            good = worst <= 1 and (rms < 0.04 if "scaled_mm" in kernels else rms < 2 ** -7)
            ok &= good
            print(f"residents {dtype} [{n}, {k}] kernel T=1 {kernels[0]}, T=40 {kernels[1]}: "
                  f"max err/bound {worst:.3f}, rel-rms vs reference {rms:.5f}: "
                  f"{'ok' if good else 'FAIL'}")
    n, k = RESIDENT_TIMING_SHAPE
    w = (torch.randn(n, k, generator=g) * 0.02).to("cuda", torch.bfloat16)
    x = torch.randn(1, k, generator=g).to("cuda", torch.bfloat16)
    base = None
    for dtype in ("bf16", "int8", "int4", "fp8"):
        held = quant.quantize(w, dtype)
        nbytes = w.nbytes if dtype == "bf16" else held.nbytes
        kernels, call = time_call(partial(quant.linear, x, held), 50)
        base = base or kernels
        name = "F.linear" if dtype == "bf16" else quant.kernel_for(dtype, "cuda", cap, (n, k),
                                                                    tokens=1)[0]
        print(f"residents timing {dtype} [{n}, {k}] T=1: kernels {kernels:.4f} ms (graph), "
              f"call {call:.4f} ms, {nbytes / kernels / 1e6:.0f} GB/s over {nbytes / 1e6:.0f} MB "
              f"held, kernel={name}, {base / kernels:.2f}x bf16")
        del held
    return ok


def generate() -> bool:
    cli = [sys.executable, "-m", "mtplx_runtime"]
    with tempfile.TemporaryDirectory() as d:
        src, art = f"{d}/tiny", f"{d}/art"  # a streaming artifact: --memory-budget needs one
        for cmd in (["make-tiny", "--codec", "t158", src],
                    ["build-manifest", "--no-progress", src, art]):
            subprocess.run(cli + cmd, check=True, cwd=ROOT, capture_output=True)
        out = {}
        for k in ("cuda", "reference"):
            p = subprocess.run(cli + ["generate", "--model", art, "--prompt", "The capital of",
                                      "--max-tokens", "8", "--temperature", "0", "--dtype",
                                      "float32", "--memory-budget", "2GiB", "--kernels", k],
                               cwd=ROOT, capture_output=True, text=True, timeout=120)
            if p.returncode:
                print(f"generate --kernels {k}: rc {p.returncode}\n{p.stderr[-3000:]}")
                return False
            out[k] = p.stdout
    same = out["cuda"] == out["reference"]
    print(f"generate: cuda {out['cuda']!r} vs reference {out['reference']!r}: "
          + ("identical" if same else "differ (fp32 sum order can flip a near-tie; look)"))
    return True


def decode() -> bool:
    with tempfile.TemporaryDirectory(dir="/work" if Path("/work").is_dir() else None) as d:
        cmd = [sys.executable, str(ROOT / "tools" / "bench_decode.py"), "--kernels", "cuda",
               "--layers", "2", "--experts", str(DECODE_EXPERTS), "--tokens", str(DECODE_TOKENS),
               "--slots-per-layer", str(DECODE_SLOTS), "--depths", "4,16", "--sample-mib", "64",
               "--dir", d]
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    for line in p.stdout.splitlines():
        print(f"decode {line}")
    if p.returncode:
        print(f"decode: rc {p.returncode}\n{p.stderr[-3000:]}")
    return p.returncode == 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--skip-generate", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    args = ap.parse_args(argv)
    why = cuda.unavailable_reason()
    if why is None and not torch.cuda.is_available():
        why = f"torch {torch.__version__} sees no CUDA device"
    if why:
        print(f"gpu_check: no GPU: {why}; nothing checked (exit {NO_GPU})")
        return NO_GPU
    steps = [("env", env), ("compile", compile_all), ("tests", tests), ("residents", residents)]
    steps += [] if args.skip_timing else [("timing", timing)]
    steps += [] if args.skip_generate else [("generate", generate)]
    steps += [] if args.skip_decode else [("decode", decode)]
    results, t_all = [], time.perf_counter()
    for name, step in steps:
        t0 = time.perf_counter()
        try:
            ok = step()
        except Exception:
            traceback.print_exc()
            ok = False
        results.append(f"{name} {'ok' if ok else 'FAIL'} {time.perf_counter() - t0:.0f}s")
    failed = any(r.split()[1] == "FAIL" for r in results)
    print(f"gpu_check: {'FAIL' if failed else 'PASS'} in {time.perf_counter() - t_all:.0f}s: "
          + ", ".join(results))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
