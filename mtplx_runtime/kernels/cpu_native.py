"""The native CPU expert kernels (`native/cpu/*.c`, built by `cpu_build` into one library,
`mtplx_cpu`) through ctypes.

    m = ctint(packed, scale, zero, bits=3)      # or t158, mxfp4, fp8_block, record_matrices
    Y = gemm(m, X)                              # Y[n, rows] = X[n, cols] · Wᵀ
    out = expert(gate, up, down, X, beta, beta_lin, round_model=False)   # [n, R]
    layer(layout, records, offsets, index, weight, X, acc, beta, beta_lin)  # acc[T, R] +=
    h = xxh3(view, seed)                        # the fast record checksum (offload/digests.py)

One library serves every codec (C ABI: native/cpu/mtplx_cpu.h): each entry point takes the codec's
index in CODECS (the codec table's cpu column, in the order of the library's C enum, checked by name
at load) as its first argument; it has one thread pool and one ISA switch. The weights stay packed:
a call reads each matrix once for all n token rows of X. `isa()` names the SIMD path ("avx512bf16",
"avx512", "avx2" or "scalar"), the best this CPU supports unless `MTPLX_CPU_ISA` or `set_isa` asks
for a lower one; the choice applies to every codec ("avx512bf16" differs from "avx512" only for
mxfp4 token rows of bf16 values). Arrays are checked for dtype, C-contiguity and shape before any
call (TypeError for a wrong type or dtype, ValueError for layout and shape), because the C code
trusts its pointers.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from dataclasses import dataclass

import numpy as np

from ..formats.fp8block import scale_shape
from ..formats.modes import MODES, cpu_codecs
from . import cpu_build

ISAS = ("scalar", "avx2", "avx512", "avx512bf16")
CODECS = cpu_codecs()  # the codec table's cpu column; index = the C codec enum (mtplx_cpu.h)
LAYOUTS = ("dense", "legacy")
BLOCK = 64  # the C driver decodes 64 columns at a time: cols must be a multiple
_ERRORS = {-1: "bad shape or parameter", -2: "out of memory",
           -3: "an invalid scale (mxfp4: weight_scale holds E8M0 0xFF (NaN); fp8-block: a "
               "weight_scale_inv is not finite or overflows bf16 at 448x), which the codec's "
               "decoder rejects",
           -4: "an fp8-block weight holds the e4m3 NaN code 0x7F or 0xFF, which the decoder "
               "rejects (the outputs of the call are void)"}
_lock = threading.Lock()
_lib: list[ctypes.CDLL] = []  # the loaded library, once
_error: list[str] = []  # why it did not load, once
_vp, _i, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


def _forced_isa() -> int:
    forced = os.environ.get("MTPLX_CPU_ISA", "").strip().lower()
    if forced and forced not in ISAS:
        raise ValueError(f"MTPLX_CPU_ISA={forced!r}; expected one of {', '.join(ISAS)}")
    return ISAS.index(forced) if forced else -1


def _load() -> ctypes.CDLL:
    """The kernel library, built on first use; a failure is remembered and re-raised."""
    with _lock:
        if _lib:
            return _lib[0]
        if _error:
            raise RuntimeError(_error[0])
        try:
            lib = ctypes.CDLL(str(cpu_build.build()))
            lib.mtplx_cpu_codec_name.restype = ctypes.c_char_p
            names = [lib.mtplx_cpu_codec_name(i) for i in range(len(CODECS) + 1)]
            if names != [c.encode() for c in CODECS] + [None]:
                raise OSError(f"codec table {names} does not match {CODECS}")
        except (cpu_build.BuildError, OSError) as exc:
            _error.append(f"CPU kernel library unavailable: {exc}")
            raise RuntimeError(_error[0]) from exc
        lib.mtplx_cpu_gemm.argtypes = [_i, _vp, _vp, _vp, _i, _i, _i, _i, _i, _vp, _i, _vp, _i]
        lib.mtplx_cpu_expert.argtypes = [_i, _vp, _i, _i, _i, _i, _i, _vp, _i, _vp, _f, _f, _i,
                                         _i]
        lib.mtplx_cpu_layer.argtypes = [_i, _vp, _i, _vp, _vp, _vp, _i, _i, _i, _i, _i, _vp, _i,
                                        _vp, _f, _f, _i, _i]
        lib.mtplx_cpu_set_isa.argtypes = [_i]
        lib.mtplx_cpu_situ_glu.argtypes = [_vp, _vp, _vp, _i, _f, _f, _i]
        lib.mtplx_cpu_xxh3_64.argtypes = [_vp, ctypes.c_size_t, ctypes.c_uint64]
        lib.mtplx_cpu_xxh3_64.restype = ctypes.c_uint64
        lib.mtplx_cpu_set_isa(_forced_isa())
        _lib.append(lib)
        return lib


def unavailable_reason() -> str | None:
    """None when the library builds and loads, else the reason."""
    try:
        _load()
    except RuntimeError as exc:
        return str(exc)
    return None


def isa() -> str:
    """The path in use: one of ISAS."""
    return ISAS[_load().mtplx_cpu_get_isa()]


def best_isa() -> str:
    """The best path this CPU supports."""
    return ISAS[_load().mtplx_cpu_best_isa()]


def set_isa(name: str | None) -> str:
    """Use `name` (clamped to what the CPU supports; None = best) for every codec; returns the
    path now in use."""
    return ISAS[_load().mtplx_cpu_set_isa(-1 if name is None else ISAS.index(name))]


def xxh3(data, seed: int = 0) -> int:
    """XXH3-64 with `seed` (xxHash's XXH3_64bits_withSeed; 0 is plain XXH3-64, default secret)
    of the bytes of `data` (bytes-like, C-contiguous; read in place, no copy) as an unsigned
    64-bit int, on the `isa()` path. The call releases the GIL (ctypes), so reader threads hash
    at once."""
    if not 0 <= seed < 1 << 64:  # ctypes would wrap it silently
        raise ValueError(f"xxh3: seed {seed} is not an unsigned 64-bit int")
    view = memoryview(data)
    if not view.c_contiguous:
        raise ValueError("xxh3: data must be C-contiguous")
    arr = np.frombuffer(view.cast("B") if view.ndim != 1 or view.format != "B" else view,
                        dtype=np.uint8)
    return _load().mtplx_cpu_xxh3_64(arr.ctypes.data if arr.size else None, arr.size, seed)


def default_threads() -> int:
    """$MTPLX_CPU_THREADS if set, else the CPUs this process may run on."""
    env = os.environ.get("MTPLX_CPU_THREADS", "").strip()
    if env:
        return max(1, int(env))
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


@dataclass(frozen=True)
class Matrix:
    """One packed matrix [rows, cols] as its codec stores it; build it with `t158`, `mxfp4`,
    `ctint` or `record_matrices`, which check the arrays."""

    codec: str
    rows: int
    cols: int
    packed: np.ndarray
    scale: np.ndarray
    zero: np.ndarray | None = None
    bits: int = 0
    group: int = 0  # ct-int: columns per scale (64 or 32); 0 for the codecs whose group is fixed
    layout: str = "dense"

    def pointers(self) -> tuple[int, int, int | None]:
        return (self.packed.ctypes.data, self.scale.ctypes.data,
                None if self.zero is None else self.zero.ctypes.data)


def _array(a, dtype, what: str) -> np.ndarray:
    if not isinstance(a, np.ndarray) or a.dtype != dtype or a.ndim != 2:
        raise TypeError(f"{what}: expected a 2-D {np.dtype(dtype)} ndarray, got "
                        f"{getattr(a, 'dtype', type(a).__name__)} {getattr(a, 'shape', '')}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{what}: array must be C-contiguous")
    return a


def _cols(groups: int, per_group: int, what: str) -> int:
    cols = groups * per_group
    if cols == 0 or cols % BLOCK:
        raise ValueError(f"{what}: {cols} columns; the CPU kernels need a positive multiple of "
                         f"{BLOCK}")
    return cols


def t158(packed: np.ndarray, scales: np.ndarray) -> Matrix:
    """t158: packed uint8 [rows, 13G], scales uint16 (bf16 bits) [rows, G]; cols = 64G."""
    _array(packed, np.uint8, "t158 packed")
    rows, groups = _array(scales, np.uint16, "t158 scales").shape
    if packed.shape != (rows, 13 * groups):
        raise ValueError(f"t158: packed {packed.shape} does not match scales {scales.shape}")
    return Matrix("t158", rows, _cols(groups, 64, "t158"), packed, scales)


def mxfp4(packed: np.ndarray, scale: np.ndarray) -> Matrix:
    """mxfp4: weight_packed uint8 [rows, cols/2], weight_scale uint8 (E8M0) [rows, cols/32]."""
    _array(packed, np.uint8, "mxfp4 weight_packed")
    rows, groups = _array(scale, np.uint8, "mxfp4 weight_scale").shape
    if packed.shape != (rows, 16 * groups):
        raise ValueError(f"mxfp4: weight_packed {packed.shape} does not match weight_scale "
                         f"{scale.shape}")
    return Matrix("mxfp4", rows, _cols(groups, 32, "mxfp4"), packed, scale)


def ctint(packed: np.ndarray, scale: np.ndarray, zero: np.ndarray | None = None, *, bits: int,
          layout: str = "dense", group_size: int = 64) -> Matrix:
    """ct-int: weight_packed int32 [rows, W], weight_scale uint16 (bf16 bits) [rows, G],
    weight_zero_point int32 [Wz, G] or None (symmetric), G = cols / group_size. bits 3 or 4;
    group_size 64 or 32; layout "dense" or "legacy" (3-bit ct 0.17 packing; banks always hold
    dense)."""
    from ..formats.ctint import packed_width

    row = MODES["ct-int"]
    if bits not in row.bits or layout not in LAYOUTS or group_size not in row.groups:
        raise ValueError(f"ct-int: bits {bits!r} / layout {layout!r} / group_size {group_size!r};"
                         f" the CPU kernels take bits {' or '.join(map(str, row.bits))}, a layout "
                         f"in {LAYOUTS} and group_size {' or '.join(map(str, row.groups))}")
    _array(packed, np.int32, "ct-int weight_packed")
    rows, groups = _array(scale, np.uint16, "ct-int weight_scale").shape
    cols = _cols(groups, group_size, "ct-int")
    if packed.shape != (rows, packed_width(cols, bits, layout)):
        raise ValueError(f"ct-int: weight_packed {packed.shape} does not hold {rows} rows of "
                         f"{cols} {bits}-bit codes in the {layout} layout")
    if zero is not None and _array(zero, np.int32, "ct-int weight_zero_point").shape != (
            packed_width(rows, bits, layout), groups):
        raise ValueError(f"ct-int: weight_zero_point {zero.shape} does not fit {rows} rows and "
                         f"{groups} groups")
    return Matrix("ct-int", rows, cols, packed, scale, zero, bits, group_size, layout)


def fp8_block(weight: np.ndarray, scale_inv: np.ndarray) -> Matrix:
    """fp8-block: weight uint8 (e4m3 bytes) [rows, cols], weight_scale_inv float32
    [ceil(rows/128), ceil(cols/128)]; cols a multiple of 64."""
    rows, cols = _array(weight, np.uint8, "fp8-block weight").shape
    _cols(cols, 1, "fp8-block")
    if _array(scale_inv, np.float32, "fp8-block weight_scale_inv").shape != scale_shape(
            (rows, cols)):
        raise ValueError(f"fp8-block: weight_scale_inv {scale_inv.shape} does not hold one scale "
                         f"per 128 x 128 block of weight {weight.shape}")
    return Matrix("fp8-block", rows, cols, weight, scale_inv)


# A native codec's Matrix from one projection's components in record order (the codec table's
# `parts`) and the record's RecordLayout (its bits and group size).
_FROM_PARTS = {"t158": lambda parts, layout: t158(*parts),
               "mxfp4": lambda parts, layout: mxfp4(*parts),
               "ct-int": lambda parts, layout: ctint(
                   *parts, bits=layout.bits,
                   group_size=layout.group_size or MODES[layout.mode].group_size),
               "fp8-block": lambda parts, layout: fp8_block(*parts)}


def record_matrices(layout, buf) -> dict[str, Matrix]:
    """{"gate", "up", "down": Matrix} viewing one bank record's bytes in place (no copy).

    `layout` is the record's `formats.record.RecordLayout`; `buf` its bytes (uint8 array or
    buffer). Modes: those with a cpu codec in the codec table (ct-int: the dense layout, as banks
    store it)."""
    from ..checkpoint.safetensors_io import ST_DTYPES

    row = MODES.get(layout.mode)
    if row is None or row.cpu is None:
        raise ValueError(f"no CPU kernel for bank mode {layout.mode!r}")
    raw = np.ascontiguousarray(np.asarray(buf, dtype=np.uint8).reshape(-1))
    if raw.size < layout.logical_bytes:
        raise ValueError(f"record holds {raw.size} bytes, its layout {layout.logical_bytes}")
    parts: dict[str, dict[str, np.ndarray]] = {}
    for s in layout.segments:
        if s.proj is not None:
            seg = raw[s.offset:s.offset + s.length]
            parts.setdefault(s.proj, {})[s.part] = seg.view(ST_DTYPES[s.dtype]).reshape(s.shape)
    return {proj: _FROM_PARTS[row.cpu]([p[x] for x in row.parts], layout)
            for proj, p in parts.items()}


def _tokens(X, cols: int, what: str) -> np.ndarray:
    if not isinstance(X, np.ndarray) or X.dtype != np.float32 or X.ndim != 2 \
            or X.shape[1] != cols or X.shape[0] == 0:
        raise TypeError(f"{what}: expected float32 [n >= 1, {cols}], got "
                        f"{getattr(X, 'dtype', type(X).__name__)} {getattr(X, 'shape', '')}")
    if not X.flags.c_contiguous:
        raise ValueError(f"{what}: array must be C-contiguous")
    return X


def _raise(rc: int, fn: str) -> None:
    if rc:
        raise (ValueError if rc in (-1, -3, -4) else RuntimeError)(
            f"{fn} failed: {_ERRORS.get(rc, f'code {rc}')}")


def gemm(m: Matrix, X: np.ndarray, threads: int | None = None) -> np.ndarray:
    """Y[n, rows] = X[n, cols] · Wᵀ in fp32 (X float32 [n, cols]); the weights are read once."""
    _tokens(X, m.cols, "X")
    Y = np.empty((X.shape[0], m.rows), np.float32)
    rc = _load().mtplx_cpu_gemm(
        CODECS.index(m.codec), *m.pointers(), m.rows, m.cols, m.bits, m.group,
        LAYOUTS.index(m.layout), X.ctypes.data, X.shape[0], Y.ctypes.data,
        threads or default_threads())
    _raise(rc, f"{m.codec} gemm")
    return Y


def expert(gate: Matrix, up: Matrix, down: Matrix, X: np.ndarray, beta: float, beta_lin: float,
           *, round_model: bool = False, threads: int | None = None) -> np.ndarray:
    """One SiTU-GLU expert for every token row of X float32 [n, R]: down · SiTU-GLU(gate x,
    up x) -> float32 [n, R]. round_model=True rounds as a bf16 model does (gate/up outputs, the
    activation and the output to bf16); False is an fp32 model."""
    I, R = gate.rows, gate.cols
    if not (up.rows, up.cols) == (I, R) == (down.cols, down.rows):
        raise ValueError(f"expert shapes disagree: gate [{I},{R}] up [{up.rows},{up.cols}] "
                         f"down [{down.rows},{down.cols}]")
    if len({(m.codec, m.bits, m.group, m.layout) for m in (gate, up, down)}) != 1:
        raise ValueError("gate, up and down must share one codec, bit width, group and layout")
    _tokens(X, R, "X")
    out = np.empty((X.shape[0], R), np.float32)
    mats = (ctypes.c_void_p * 9)(*(p for m in (gate, up, down) for p in m.pointers()))
    rc = _load().mtplx_cpu_expert(
        CODECS.index(gate.codec), mats, R, I, gate.bits, gate.group, LAYOUTS.index(gate.layout),
        X.ctypes.data, X.shape[0], out.ctypes.data, beta, beta_lin, int(round_model),
        threads or default_threads())
    _raise(rc, f"{gate.codec} expert")
    return out


@dataclass(frozen=True)
class RecordPlan:
    """Where a record of one bank layout keeps its matrices: codec, gate's [I, R], the ct-int
    bit width and group size, and the byte offsets of {gate, up, down} x {packed, scale, zero}
    (None: no zero point) from the record start."""

    codec: str
    shape: tuple[int, int]
    bits: int
    group: int
    offsets: tuple[int | None, ...]


def situ_glu(g: np.ndarray, u: np.ndarray, beta: float, beta_lin: float, *,
             round_model: bool = False) -> np.ndarray:
    """SiTU-GLU of float32 g and u (same shape) as the expert calls compute it: fp32 from the
    library's own exp and tanh, the same bits on every ISA path."""
    for what, a in (("g", g), ("u", u)):
        if not isinstance(a, np.ndarray) or a.dtype != np.float32:
            raise TypeError(f"{what}: expected a float32 ndarray, got "
                            f"{getattr(a, 'dtype', type(a).__name__)}")
    g, u = np.ascontiguousarray(g), np.ascontiguousarray(u)
    if g.shape != u.shape:
        raise ValueError(f"g {g.shape} and u {u.shape} must have one shape")
    h = np.empty_like(g)
    _raise(_load().mtplx_cpu_situ_glu(g.ctypes.data, u.ctypes.data, h.ctypes.data, g.size, beta,
                                      beta_lin, int(round_model)), "situ_glu")
    return h


@functools.cache
def record_plan(layout) -> RecordPlan:
    """The RecordPlan of `layout` (a `formats.record.RecordLayout`), found once by viewing a blank
    record with `record_matrices`, so the layer call needs no per-record views (~11 us each)."""
    blank = np.zeros(layout.logical_bytes, np.uint8)
    m = record_matrices(layout, blank)
    base = blank.ctypes.data
    offsets = tuple(None if p is None else p - base
                    for proj in ("gate", "up", "down") for p in m[proj].pointers())
    g = m["gate"]
    return RecordPlan(g.codec, (g.rows, g.cols), g.bits, g.group, offsets)


def _vector(a, dtype, n: int, what: str) -> np.ndarray:
    if not isinstance(a, np.ndarray) or a.dtype != dtype or a.shape != (n,):
        raise TypeError(f"{what}: expected {np.dtype(dtype)} [{n}], got "
                        f"{getattr(a, 'dtype', type(a).__name__)} {getattr(a, 'shape', '')}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{what}: array must be C-contiguous")
    return a


def layer(layout, records, tok_offsets: np.ndarray, tok_index: np.ndarray,
          tok_weight: np.ndarray, X: np.ndarray, acc: np.ndarray, beta: float, beta_lin: float,
          *, round_model: bool = False, threads: int | None = None) -> None:
    """A window of experts in one native call, added into acc float32 [T, R] in place.

    records: the record bytes (uint8 arrays or buffers of `layout`) of the experts, in the order
    they are combined (ascending expert id). Expert i runs once over its tokens tok_index[j] for
    j in [tok_offsets[i], tok_offsets[i + 1]) (rows of X float32 [T, R]), then
    acc[tok_index[j]] += y_j * tok_weight[j] in fp32, expert after expert: `expert` per expert
    followed by that combine, bit for bit. tok_offsets int32 [len(records) + 1] from 0;
    tok_index int32 and tok_weight float32 [tok_offsets[-1]]."""
    plan = record_plan(layout)
    I, R = plan.shape
    T = _tokens(X, R, "X").shape[0]
    if _array(acc, np.float32, "acc").shape != (T, R):
        raise ValueError(f"acc {acc.shape} must be [{T}, {R}] like X")
    n = len(records)
    _vector(tok_offsets, np.int32, n + 1, "tok_offsets")
    if tok_offsets[0] != 0:
        raise ValueError("tok_offsets must start at 0")
    _vector(tok_index, np.int32, int(tok_offsets[-1]), "tok_index")
    _vector(tok_weight, np.float32, int(tok_offsets[-1]), "tok_weight")
    raws, ptrs = [], []  # raws keeps any contiguous copy alive through the call
    for buf in records:
        raw = np.ascontiguousarray(np.asarray(buf, dtype=np.uint8).reshape(-1))
        if raw.size < layout.logical_bytes:
            raise ValueError(f"record holds {raw.size} bytes, its layout {layout.logical_bytes}")
        raws.append(raw)
        base = raw.ctypes.data
        ptrs += [None if o is None else base + o for o in plan.offsets]
    rc = _load().mtplx_cpu_layer(
        CODECS.index(plan.codec), (ctypes.c_void_p * len(ptrs))(*ptrs), n,
        tok_offsets.ctypes.data, tok_index.ctypes.data, tok_weight.ctypes.data, R, I, plan.bits,
        plan.group, 0, X.ctypes.data, T, acc.ctypes.data,  # 0: the dense layout of banks
        beta, beta_lin, int(round_model), threads or default_threads())
    _raise(rc, f"{plan.codec} layer")
