"""CPU t158 kernels (kernels/native/cpu/t158.c, through cpu_native) vs "decode_t158 then matmul"
in float64 (FORMAT.md "t158"), and the native build cache (cpu_build). The other codecs and the
n-token API for every codec: tests/test_cpu_kernels.py."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from mtplx_runtime.formats.t158 import decode_t158
from mtplx_runtime.kernels import cpu_build, cpu_native

why = cpu_native.unavailable_reason()
ok = why is None
pytestmark = pytest.mark.skipif(not ok, reason=why or "")
ISAS = [name for name in cpu_native.ISAS
        if ok and cpu_native.ISAS.index(name) <= cpu_native.ISAS.index(cpu_native.best_isa())]


def gemv(packed, scales, x, threads=None):
    return cpu_native.gemm(cpu_native.t158(packed, scales), x[None], threads=threads)[0]


def _random_t158(rng, rows: int, cols: int):
    """Random bytes over the full 0..255 range (243..255 and byte 12 digit 4 included)."""
    groups = cols // 64
    packed = rng.integers(0, 256, (rows, 13 * groups), dtype=np.uint8)
    packed[0, :13] = 255  # a byte above 242 in every position, byte 12 included
    packed[-1, 12::13] = 162  # 2*81: only digit 4 set; decodes as four -1 trits
    scales = (rng.uniform(0.005, 0.05, (rows, groups)).astype(np.float32)
              .view(np.uint32) >> 16).astype(np.uint16)
    return packed, scales


def _gate(y: np.ndarray, ref: np.ndarray) -> None:
    rel = np.sqrt(np.mean((y - ref) ** 2)) / max(np.sqrt(np.mean(ref**2)), 1e-30)
    assert rel < 1e-6, rel
    assert np.abs(y - ref).max() <= 1e-5 * max(np.abs(ref).max(), 1e-30) + 1e-30


@pytest.fixture
def restore_isa():
    yield
    cpu_native.set_isa(None)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows,cols", [(1, 64), (7, 128), (33, 640), (257, 3584)])
def test_gemv_matches_decode_matmul(isa, rows, cols, restore_isa):
    rng = np.random.default_rng(rows * 1000 + cols)
    packed, scales = _random_t158(rng, rows, cols)
    x = rng.standard_normal(cols).astype(np.float32)
    ref = decode_t158(packed, scales).astype(np.float64) @ x.astype(np.float64)
    assert cpu_native.set_isa(isa) == isa
    for threads in (1, 2, 3, 8, 64):
        _gate(gemv(packed, scales, x, threads=threads).astype(np.float64), ref)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", [16 * 5 + 5, 16 * 9 + 3])
def test_k3_width_odd_rows_threads_and_tokens_bitwise(isa, rows, restore_isa):
    """K3's 3584 inputs (G = 56) and rows = 16k + tail: the avx512 (t16f) path runs 32 rows per
    pass and pads what is left, so every row takes the same code whatever the chunking. n = 11
    crosses its 8-token table batch and 144+ rows its 128-row tile; any thread count and the
    n-token call give the one-token, one-thread results bit for bit, within float64 tolerance."""
    rng = np.random.default_rng(rows)
    cols = 3584
    packed, scales = _random_t158(rng, rows, cols)
    X = rng.standard_normal((11, cols)).astype(np.float32)
    assert cpu_native.set_isa(isa) == isa
    m = cpu_native.t158(packed, scales)
    want = np.stack([cpu_native.gemm(m, X[t:t + 1], threads=1)[0] for t in range(11)])
    ref = X.astype(np.float64) @ decode_t158(packed, scales).astype(np.float64).T
    for t in range(11):
        _gate(want[t].astype(np.float64), ref[t])
    for threads in (1, 2, 3, 5, 7):
        np.testing.assert_array_equal(cpu_native.gemm(m, X, threads=threads), want)
        np.testing.assert_array_equal(cpu_native.gemm(m, X[:1], threads=threads)[0], want[0])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", [256, 256 + 5])
def test_every_byte_in_every_position_decodes_exactly(isa, rows, restore_isa):
    """Each byte value 0..255 (243..255 and byte 12's digit 4 included) at each of the 13
    positions: X = identity returns the decoded matrix bit for bit (one weight times 1)."""
    r = np.arange(rows)[:, None]
    packed = ((r * 7 + 29 * np.arange(26)[None]) % 256).astype(np.uint8)  # 2 groups
    scales = (np.full((rows, 2), 0.0234, np.float32).view(np.uint32) >> 16).astype(np.uint16)
    scales[1::3, 1] = 0xBF80  # -1.0
    assert cpu_native.set_isa(isa) == isa
    for j in range(13):  # every value at every position across the rows
        assert len(np.unique(packed[:256, j])) == 256
    Y = cpu_native.gemm(cpu_native.t158(packed, scales), np.eye(128, dtype=np.float32),
                        threads=3)
    np.testing.assert_array_equal(Y.T, decode_t158(packed, scales))


def test_many_groups(restore_isa):
    """G = 1025 groups (65600 inputs): past the kernel lab port's G <= 1024 stack buffer; the
    runtime's t16f path keeps its scales in the driver's scratch, so no limit and no fallback."""
    rng = np.random.default_rng(9)
    packed, scales = _random_t158(rng, 21, 64 * 1025)
    x = rng.standard_normal(64 * 1025).astype(np.float32)
    ref = decode_t158(packed, scales).astype(np.float64) @ x.astype(np.float64)
    for isa in ISAS:
        cpu_native.set_isa(isa)
        y = gemv(packed, scales, x, threads=2).astype(np.float64)
        # fp32 chains of ~8k terms: every path lands near 1e-6 here (t16f 1.2e-6), so 5x that
        rel = np.sqrt(np.mean((y - ref) ** 2)) / np.sqrt(np.mean(ref**2))
        assert rel < 5e-6, rel
        assert np.abs(y - ref).max() <= 5e-6 * np.abs(ref).max()
        np.testing.assert_array_equal(y, gemv(packed, scales, x, threads=1))


def test_byte12_digit4_ignored(restore_isa):
    rng = np.random.default_rng(5)
    packed, scales = _random_t158(rng, 4, 128)
    x = rng.standard_normal(128).astype(np.float32)
    flipped = packed.copy()
    flipped[:, 12::13] = flipped[:, 12::13] % 81 + 81  # set digit 4 to 1, keep digits 0..3
    for isa in ISAS:
        cpu_native.set_isa(isa)
        a = gemv(packed, scales, x, threads=1)
        b = gemv(flipped, scales, x, threads=1)
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(decode_t158(packed, scales), decode_t158(flipped, scales))


def test_checks_inputs():
    packed, scales = _random_t158(np.random.default_rng(1), 4, 128)
    x = np.zeros(128, np.float32)
    with pytest.raises(TypeError, match="float32"):
        gemv(packed, scales, x.astype(np.float64))
    with pytest.raises(TypeError, match=r"float32 \[n >= 1, 128\]"):
        gemv(packed, scales, np.zeros(64, np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        gemv(np.asfortranarray(packed), scales, x)
    with pytest.raises(ValueError, match="does not match"):
        gemv(packed[:, :13].copy(), scales, x)
    with pytest.raises(TypeError, match="uint16"):
        gemv(packed, scales.view(np.int16), x)


@pytest.mark.parametrize("isa", ISAS)
def test_expert_mlp_matches_torch(isa, restore_isa):
    rng = np.random.default_rng(11)
    hidden, inter = 192, 320
    gate, up = _random_t158(rng, inter, hidden), _random_t158(rng, inter, hidden)
    down = _random_t158(rng, hidden, inter)
    x = rng.standard_normal(hidden).astype(np.float32)
    beta, beta_lin = 4.0, 25.0
    w = [torch.from_numpy(decode_t158(*p)).double() for p in (gate, up, down)]
    xt = torch.from_numpy(x).double()
    g, u = w[0] @ xt, w[1] @ xt
    h = beta * torch.tanh(g / beta) * torch.sigmoid(g) * (beta_lin * torch.tanh(u / beta_lin))
    ref = (w[2] @ h).numpy()
    cpu_native.set_isa(isa)
    for threads in (1, 2, 5):
        out = cpu_native.expert(cpu_native.t158(*gate), cpu_native.t158(*up),
                                cpu_native.t158(*down), x[None], beta, beta_lin,
                                threads=threads)[0]
        rel = np.sqrt(np.mean((out - ref) ** 2)) / np.sqrt(np.mean(ref**2))
        assert rel < 1e-5, rel  # tanh/sigmoid in fp32 add ~1 ulp per activation
        assert np.abs(out - ref).max() <= 1e-4 * np.abs(ref).max()


def test_thread_pool_handoffs_fork_and_concurrent_callers():
    """The pool's spin-then-block hand-off (native/cpu/thread_pool.c): regions that hand out
    fewer chunks than there are workers (so idle workers skip generations), calls after the pool
    has gone to sleep, concurrent callers (ctypes drops the GIL) and a forked child (no workers
    inherited) all give the one-thread bits."""
    import select
    import threading
    import time

    rng = np.random.default_rng(5)
    m = cpu_native.t158(*_random_t158(rng, 300, 640))
    X = rng.standard_normal((3, 640)).astype(np.float32)
    want = cpu_native.gemm(m, X, threads=1)
    for threads in (8, 2, 3, 8, 2, 5, 2):  # grow the pool, then use a part of it
        np.testing.assert_array_equal(cpu_native.gemm(m, X, threads=threads), want)
    time.sleep(0.05)  # past the spin window: every worker blocks on the condition variable
    np.testing.assert_array_equal(cpu_native.gemm(m, X, threads=8), want)

    errors = []

    def caller(threads):
        try:
            for _ in range(30):
                np.testing.assert_array_equal(cpu_native.gemm(m, X, threads=threads), want)
        except Exception as exc:  # reported below: a thread cannot fail the test itself
            errors.append(exc)

    callers = [threading.Thread(target=caller, args=(t,)) for t in (2, 3, 4)]
    for c in callers:
        c.start()
    for c in callers:
        c.join()
    assert not errors, errors

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: a fresh pool; report through the pipe, never return into pytest
        ok_child = False
        try:
            ok_child = np.array_equal(cpu_native.gemm(m, X, threads=4), want)
        finally:
            os.write(w, b"1" if ok_child else b"0")
            os._exit(0)
    os.close(w)
    if not select.select([r], [], [], 60)[0]:  # a lost wake-up would hang the child
        os.kill(pid, 9)
    got = os.read(r, 1) if select.select([r], [], [], 0)[0] else b"timeout"
    os.close(r)
    os.waitpid(pid, 0)
    assert got == b"1"


def test_env_forces_lower_isa(tmp_path):
    code = ("from mtplx_runtime.kernels import cpu_native as k; "
            "print(k.isa(), k.unavailable_reason())")
    for name in ("scalar", "avx2"):
        if name not in ISAS:
            continue
        env = dict(os.environ, MTPLX_CPU_ISA=name)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, check=True).stdout.split()
        assert out == [name, "None"]  # the forced path, and the library loaded


def _copy_sources(dst):
    dst.mkdir()
    for f in cpu_build.SRC_DIR.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_build_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MTPLX_NATIVE_DIR", str(tmp_path / "cache"))
    srcdir = _copy_sources(tmp_path / "src")
    src = srcdir / "t158.c"
    first = cpu_build.build(srcdir)
    mtime = first.stat().st_mtime_ns
    calls = []
    real_run = subprocess.run

    def spy(cmd, **kw):
        calls.append(cmd)
        return real_run(cmd, **kw)

    monkeypatch.setattr(subprocess, "run", spy)
    assert cpu_build.build(srcdir) == first and first.stat().st_mtime_ns == mtime
    assert not [c for c in calls if "-shared" in c]  # only `gcc --version`, no compile
    src.write_text(src.read_text() + "\n/* changed */\n")
    second = cpu_build.build(srcdir)
    assert second != first and second.is_file()
    assert [c for c in calls if "-shared" in c]
    assert not list((tmp_path / "cache").glob("*.tmp"))


def test_build_error_names_command(tmp_path, monkeypatch):
    monkeypatch.setenv("MTPLX_NATIVE_DIR", str(tmp_path / "cache"))
    srcdir = tmp_path / "src"
    srcdir.mkdir()
    (srcdir / "broken.c").write_text("int f( {\n")
    with pytest.raises(cpu_build.BuildError, match=r"-shared.*broken\.c[\s\S]*error"):
        cpu_build.build(srcdir)
    assert not list((tmp_path / "cache").glob("*"))


def test_header_edit_changes_library_key(tmp_path, monkeypatch):
    """The sources include native/cpu/*.h, so a header edit must build a new library."""
    srcdir = _copy_sources(tmp_path / "src")
    monkeypatch.setattr(cpu_build, "SRC_DIR", srcdir)
    before = cpu_build.library_path()
    header = srcdir / "cpu_common.h"
    header.write_text(header.read_text() + "\n/* changed */\n")
    assert cpu_build.library_path() != before


def test_checksum_and_glu_link_without_the_driver(tmp_path):
    """The ISA switch lives in isa.c, so the record checksum and SiTU-GLU build into a library
    of their own with every symbol resolved: neither needs the expert driver (expert.c)."""
    srcs = [cpu_build.SRC_DIR / f for f in ("checksum.c", "glu.c", "isa.c")]
    cmd = [cpu_build.compiler(), *cpu_build.FLAGS, "-Wl,--no-undefined", f"-I{cpu_build.SRC_DIR}",
           "-o", str(tmp_path / "part.so"), *map(str, srcs), *cpu_build.LIBS]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
