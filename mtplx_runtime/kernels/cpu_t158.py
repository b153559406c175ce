"""t158 GEMV and K3 expert MLP on the CPU, computed on the packed bytes (FORMAT.md "t158", spec
§1.10), through the C library `native/cpu/t158_cpu.c` built by `cpu_build`.

`available()` says whether the library can be built and loaded; `isa()` names the path in use:
"avx512", "avx2" or "scalar", the best this CPU supports unless `MTPLX_CPU_ISA` (or `set_isa`)
asks for a lower one. Arrays are checked for dtype, C-contiguity and shape before any call.
"""

from __future__ import annotations

import ctypes
import os
import threading

import numpy as np

from . import cpu_build

ISAS = ("scalar", "avx2", "avx512")
GROUP = 64
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_error: str | None = None

_u8p = np.ctypeslib.ndpointer(np.uint8, flags="C_CONTIGUOUS")
_u16p = np.ctypeslib.ndpointer(np.uint16, flags="C_CONTIGUOUS")
_f32p = np.ctypeslib.ndpointer(np.float32, flags="C_CONTIGUOUS")
_i = ctypes.c_int


def _load() -> ctypes.CDLL:
    global _lib, _error
    with _lock:
        if _lib is not None:
            return _lib
        if _error is not None:
            raise RuntimeError(_error)
        try:
            lib = ctypes.CDLL(str(cpu_build.build("t158_cpu")))
        except (cpu_build.BuildError, OSError) as exc:
            _error = f"t158 CPU kernel unavailable: {exc}"
            raise RuntimeError(_error) from exc
        lib.t158_gemv_f32.argtypes = [_u8p, _u16p, _i, _i, _f32p, _f32p, _i]
        lib.t158_expert_mlp_f32.argtypes = [
            _u8p, _u16p, _u8p, _u16p, _u8p, _u16p, _i, _i, _f32p, _f32p,
            ctypes.c_float, ctypes.c_float, _i,
        ]
        for fn in (lib.t158_gemv_f32, lib.t158_expert_mlp_f32, lib.t158_set_isa,
                   lib.t158_get_isa, lib.t158_best_isa):
            fn.restype = _i
        lib.t158_set_isa.argtypes = [_i]
        forced = os.environ.get("MTPLX_CPU_ISA", "").strip().lower()
        if forced and forced not in ISAS:
            raise ValueError(f"MTPLX_CPU_ISA={forced!r}; expected one of {', '.join(ISAS)}")
        lib.t158_set_isa(ISAS.index(forced) if forced else -1)
        _lib = lib
        return lib


def available() -> tuple[bool, str]:
    """(True, path in use) or (False, why the library could not be built or loaded)."""
    try:
        _load()
    except RuntimeError as exc:
        return False, str(exc)
    return True, isa()


def isa() -> str:
    """The path in use: "avx512", "avx2" or "scalar"."""
    return ISAS[_load().t158_get_isa()]


def best_isa() -> str:
    """The best path this CPU supports."""
    return ISAS[_load().t158_best_isa()]


def set_isa(name: str | None) -> str:
    """Use `name` (clamped to what the CPU supports; None = best); returns the path now in use."""
    return ISAS[_load().t158_set_isa(-1 if name is None else ISAS.index(name))]


def default_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _check(packed: np.ndarray, scales: np.ndarray, what: str) -> tuple[int, int]:
    for arr, dt, nm in ((packed, np.uint8, "packed"), (scales, np.uint16, "scales")):
        if not isinstance(arr, np.ndarray) or arr.dtype != dt or arr.ndim != 2:
            raise TypeError(f"{what}.{nm}: expected a 2-D {np.dtype(dt)} ndarray")
        if not arr.flags.c_contiguous:
            raise ValueError(f"{what}.{nm}: array must be C-contiguous")
    rows, groups = scales.shape
    if packed.shape != (rows, 13 * groups) or groups == 0:
        raise ValueError(f"{what}: packed {packed.shape} does not match scales {scales.shape}")
    return rows, groups * GROUP


def _vec(x: np.ndarray, n: int, what: str) -> np.ndarray:
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.shape != (n,):
        raise TypeError(f"{what}: expected float32 [{n}], got {getattr(x, 'dtype', type(x))} "
                        f"{getattr(x, 'shape', '')}")
    if not x.flags.c_contiguous:
        raise ValueError(f"{what}: array must be C-contiguous")
    return x


def gemv(packed: np.ndarray, scales: np.ndarray, x: np.ndarray, threads: int | None = None,
         out: np.ndarray | None = None) -> np.ndarray:
    """y = W x for t158 W (`packed` uint8 [rows, 13G], `scales` uint16 [rows, G]); float32."""
    rows, cols = _check(packed, scales, "W")
    _vec(x, cols, "x")
    y = np.empty(rows, np.float32) if out is None else _vec(out, rows, "out")
    rc = _load().t158_gemv_f32(packed, scales, rows, cols, x, y, threads or default_threads())
    if rc:
        raise RuntimeError(f"t158_gemv_f32 failed with code {rc}")
    return y


def expert_mlp(gate: tuple[np.ndarray, np.ndarray], up: tuple[np.ndarray, np.ndarray],
               down: tuple[np.ndarray, np.ndarray], x: np.ndarray, beta: float,
               beta_lin: float, threads: int | None = None) -> np.ndarray:
    """One K3 expert: down · SiTU-GLU(gate x, up x), each weight a (packed, scales) pair."""
    i_g, r_g = _check(*gate, "gate")
    i_u, r_u = _check(*up, "up")
    r_d, i_d = _check(*down, "down")
    if not (i_g == i_u == i_d and r_g == r_u == r_d):
        raise ValueError(f"expert shapes disagree: gate [{i_g},{r_g}] up [{i_u},{r_u}] "
                         f"down [{r_d},{i_d}]")
    _vec(x, r_g, "x")
    out = np.empty(r_g, np.float32)
    rc = _load().t158_expert_mlp_f32(*gate, *up, *down, r_g, i_g, x, out, beta, beta_lin,
                                     threads or default_threads())
    if rc:
        raise RuntimeError(f"t158_expert_mlp_f32 failed with code {rc}")
    return out
