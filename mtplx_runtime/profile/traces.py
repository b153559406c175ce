"""Route traces in memory: read ours, import plain per-token lists, generate synthetic ones.

    route-trace JSONL | plain text | .npy | synth:KIND,... -> Trace (routes [N, L, K]) -> replay

A `Trace` holds one row per token per forward, in execution order, for every MoE layer: N lines,
L layers, K ids (ascending; -1 pads a short row of an imported trace). The plain format (FORMAT.md
"Plain route lists") lets traces from other engines be profiled; the synthetic generators
(uniform, Zipf, temporal locality, and `k3`: temporal with defaults calibrated to K3's published
LRU hit rate, BENCHMARKS.md "A synthetic K3 route trace") feed tests, benchmarks and what-if
runs. All of them are decode lines.

Every size an input declares (experts, top-k, layers, tokens, an array's shape) is bounded
before anything is allocated: by the config's own bounds (experts <= 65,536, layers <= 1,024),
by what the file holds, and by the memory this machine has (the routes may take an eighth of
it: profiling makes a few arrays of their size). A synthetic spec is also bounded in the work
it asks for. Refusals are TraceErrors naming the source and the key.
"""

from __future__ import annotations

import json
import math
import os
import tokenize
from array import array
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..checkpoint.config import MAX_EXPERTS, MAX_LAYERS
from ..engine.trace import TRACE_FORMAT, TraceError, read_trace
from ..files import memory_available_bytes, open_regular

# What `load` accepts, for error messages that tell a user what a trace should be.
SOURCES = ("mtplx-route-trace-v1 JSONL, a plain route list (UTF-8 text), an integer .npy "
           "[tokens, layers, top_k] or a synth: spec")
SYNTH_SPEC = ("synth:uniform|zipf|temporal|k3,tokens=N,layers=L,experts=E,top_k=K,alpha=A,"
              "locality=P,seed=S")
_SYNTH_KEYS = {"tokens": int, "layers": int, "experts": int, "top_k": int, "alpha": float,
               "locality": float, "seed": int}
NPY_MAGIC = b"\x93NUMPY"
NPY_MAX_HEADER = 1 << 16
# Profiling a trace makes a few arrays of its routes' size (int64 keys, sorted copies, replay
# state): the routes may take this share of the memory available, no more.
MEMORY_SHARE = 8
# Synthetic traces: at most this many tokens (the temporal kinds loop over them in Python) and
# this many random draws (tokens x layers x experts; about a minute on one core).
MAX_SYNTH_TOKENS = 1 << 20
MAX_SYNTH_DRAWS = 1 << 31
MAX_PLAIN_LINE = 64 * 2**20  # one line of a plain route list
# synth:k3's skew and locality: the profiler's LRU replay at 33 slots per layer then hits 32.6 %,
# the rate published for K3 t158 (calibration table: BENCHMARKS.md "A synthetic K3 route trace").
K3_ALPHA, K3_LOCALITY = 0.5, 0.285


@dataclass
class Trace:
    """One recorded (or generated) run. routes: int32 [N, L, K]; decode: bool [N] (False for a
    prefill line); t: int64 [N] positions; predicted: {(layer, depth): (line idx [P], ids
    [P] lists)} from the recorder's lookahead guesses; record_bytes from the header or None."""

    layers: list[int]
    experts: int
    top_k: int
    routes: np.ndarray
    decode: np.ndarray
    t: np.ndarray
    predicted: dict = field(default_factory=dict)
    record_bytes: int | None = None
    model: str = ""
    name: str = ""

    @property
    def n_lines(self) -> int:
        return int(self.routes.shape[0])

    def forwards(self, prefill_chunk: int = 64) -> list[tuple[bool, int, int]]:
        """(decode?, first line, line count) per forward: a decode line is one forward; a run of
        prefill lines is cut into chunks of `prefill_chunk` positions from its first `t`, the
        way `generate.prefill` splits a prompt."""
        out: list[tuple[bool, int, int]] = []
        i, n = 0, self.n_lines
        while i < n:
            if self.decode[i]:
                out.append((True, i, 1))
                i += 1
                continue
            t0, j = int(self.t[i]), i
            chunk = (int(self.t[i]) - t0) // prefill_chunk
            while j < n and not self.decode[j] and (int(self.t[j]) - t0) // prefill_chunk == chunk:
                j += 1
            out.append((False, i, j - i))
            i = j
        return out


def _budget() -> int:
    """Bytes of routes this machine can hold while they are profiled."""
    return memory_available_bytes() // MEMORY_SHARE


def _too_big(where: str, what: str, nbytes: int, budget: int) -> TraceError:
    return TraceError(f"{where}: {what} need {nbytes / 2**20:,.1f} MiB; profiling may use "
                      f"{budget / 2**20:,.1f} MiB for routes (1/{MEMORY_SHARE} of the memory "
                      "available)")


def read_route_trace(path: str | Path) -> Trace:
    """Our `mtplx-route-trace-v1` JSONL (FORMAT.md "Route traces"); drops a partial tail."""
    header, lines = read_trace(path)
    layers = [int(x) for x in header["layers"]]
    keys = [str(la) for la in layers]
    experts, k = int(header["experts"]), int(header["top_k"])
    budget = _budget()
    if len(layers) * experts * 8 > budget:  # the profiler's per-layer counts [L, E]
        raise _too_big(f"{path}:1", f"{len(layers)} layers x experts {experts}",
                       len(layers) * experts * 8, budget)
    line_bytes = len(layers) * k * 4
    rows, decode, ts, predicted = [], [], [], {}
    for i, obj in enumerate(lines):
        if (i + 1) * line_bytes > budget:  # checked as lines arrive: the file says how many
            raise _too_big(f"{path}:{i + 2}", f"{i + 1} lines x {len(layers)} layers x top_k "
                           f"{k}", (i + 1) * line_bytes, budget)
        row = np.full((len(layers), k), -1, np.int32)  # [L, K], short rows padded
        r = obj["routes"]
        for j, key in enumerate(keys):
            row[j, :len(r[key])] = sorted(r[key])
        rows.append(row)
        decode.append(obj.get("phase") == "decode")
        ts.append(int(obj["t"]))
        for la, by_depth in (obj.get("predicted") or {}).items():
            for d, ids in by_depth.items():
                idx, got = predicted.setdefault((int(la), int(d)), ([], []))
                idx.append(i)
                got.append([int(e) for e in ids])
    if not rows:
        raise TraceError(f"{path}: no token lines after the header")
    return Trace(layers, experts, k, np.stack(rows), np.array(decode, bool),
                 np.array(ts, np.int64), {key: (np.array(v[0]), v[1])
                                          for key, v in predicted.items()},
                 header.get("record_bytes"), str(header.get("model", "")), str(path))


def read_plain(path: str | Path) -> Trace:
    """The plain import format: one token per line, layers separated by ';', ids by spaces or
    commas; '#' lines are comments, except `# layers=...` and `# experts=...` settings. Ids
    are kept packed (4 bytes each) while the file is read."""
    layers, experts, nl, n = None, None, None, 0
    ids, lens = array("i"), array("I")  # every id in file order; ids per (line, layer)
    budget = _budget()
    fh = open(open_regular(path, error=TraceError, what="route list"), encoding="utf-8")
    with fh:
        try:
            while raw := fh.readline(MAX_PLAIN_LINE + 1):
                n += 1
                if len(raw) > MAX_PLAIN_LINE:
                    raise ValueError(f"longer than {MAX_PLAIN_LINE} characters")
                line = raw.strip()
                if line.startswith("#"):
                    for word in line[1:].split():
                        name, _, val = word.partition("=")
                        if name == "layers" and val:
                            layers = [_plain_int(x, MAX_LAYERS, "a layer index")
                                      for x in val.split(",")]
                        elif name == "experts" and val:
                            experts = _plain_int(val, MAX_EXPERTS + 1, "experts")
                    continue
                if not line:
                    continue
                parts = line.split(";")
                if nl is None and len(parts) > MAX_LAYERS:
                    raise ValueError(f"{len(parts)} layers, more than {MAX_LAYERS}")
                if nl is not None and len(parts) != nl:
                    raise ValueError(f"every line must list the same number of layers ({nl})")
                nl = len(parts)
                for part in parts:
                    got = [_plain_int(x, MAX_EXPERTS, "an expert id")
                           for x in part.replace(",", " ").split()]
                    ids.extend(got)
                    lens.append(len(got))
                if 4 * (len(ids) + len(lens)) > budget:
                    raise MemoryError
        except UnicodeDecodeError:
            raise TraceError(f"{path}:{n + 1}: not UTF-8 text; expected {SOURCES}") from None
        except ValueError as e:
            raise TraceError(f"{path}:{n}: {e}; expected a plain route list (ids separated by "
                             "spaces or commas, layers by ';')") from None
        except MemoryError:
            raise _too_big(f"{path}:{n}", "the ids read so far", 4 * (len(ids) + len(lens)),
                           budget) from None
    if nl is None:
        raise TraceError(f"{path}: no route lines")
    if experts == 0:
        raise TraceError(f"{path}: `# experts=0`; a layer has at least one expert")
    layers = layers or list(range(nl))
    if len(layers) != nl or len(set(layers)) != nl:
        raise TraceError(f"{path}: `# layers=` names {len(layers)} layers, lines have {nl} "
                         "(distinct indices)")
    count = np.frombuffer(lens, np.uint32).astype(np.int64)  # [N * L]
    top_k = int(count.max())
    if top_k == 0:
        raise TraceError(f"{path}: no expert ids")
    rows = len(count) // nl
    if rows * nl * top_k * 4 > budget:
        raise _too_big(str(path), f"{rows} lines x {nl} layers x top_k {top_k}",
                       rows * nl * top_k * 4, budget)
    routes = np.full((rows * nl, top_k), -1, np.int32)
    starts = np.cumsum(count) - count
    cell = np.repeat(np.arange(len(count)), count)  # [ids]: the (line, layer) of each id
    routes[cell, np.arange(len(ids)) - starts[cell]] = np.frombuffer(ids, np.int32)
    routes = np.sort(routes, axis=-1).reshape(rows, nl, top_k)
    repeats = (routes[..., 1:] == routes[..., :-1]) & (routes[..., 1:] >= 0)  # [N, L, K-1]
    if repeats.any():
        bad = np.argwhere(repeats)[0]
        raise TraceError(f"{path}: route line {bad[0] + 1}, layer {layers[bad[1]]} repeats "
                         f"expert id {routes[tuple(bad)]}")
    return _from_array(routes, layers, experts, str(path))


def _plain_int(x: str, below: int, what: str) -> int:
    """A 0-based integer of a plain route list, below `below`."""
    if not (x.isascii() and x.isdigit() and len(x) <= 9 and int(x) < below):
        raise ValueError(f"{x[:40]!r} is not a 0-based integer below {below} ({what})")
    return int(x)


def _from_array(routes: np.ndarray, layers=None, experts=None, name="") -> Trace:
    n, nl, k = routes.shape
    top = int(routes.max()) + 1 if routes.size else 1
    if experts is not None and top > experts:
        raise TraceError(f"{name}: expert id {top - 1} >= experts {experts}")
    return Trace(list(layers) if layers is not None else list(range(nl)), experts or top, k,
                 np.sort(routes.astype(np.int32), axis=-1), np.ones(n, bool),
                 np.arange(n, dtype=np.int64), name=name)


def load(source: str) -> Trace:
    """A trace from a path (our JSONL, a plain text file, an int .npy [N, L, K]) or a
    `synth:KIND,key=value,...` spec (see `synthetic`). Bad input: TraceError naming the source."""
    if source.startswith("synth:"):
        return _synth(source)
    p = Path(source)
    if p.suffix == ".npy":
        return read_npy(p)
    with os.fdopen(open_regular(p, error=TraceError, what="route trace"), "rb") as fh:
        first = fh.readline(1 << 20)
        sniff = first + fh.read(4096)
    if b"\0" in sniff:  # UTF-8 text never holds NUL: an image, an archive, a .npy renamed
        raise TraceError(f"{p}: a binary file, not a route trace; expected {SOURCES}")
    try:
        head = json.loads(first)
    except (ValueError, RecursionError):
        head = None
    if isinstance(head, dict):  # a JSON header: our reader names what is wrong with it
        return read_route_trace(p)
    return read_plain(p)


def _synth(spec: str) -> Trace:
    """`synth:KIND,key=value,...` -> `synthetic(KIND, ...)`; the trace is named by the spec."""
    kind, *opts = spec[6:].split(",")
    kw = {}
    for o in opts:
        name, eq, val = o.partition("=")
        key = name.strip().replace("-", "_")
        if key not in _SYNTH_KEYS or not eq:
            raise TraceError(f"{spec[:200]}: unknown option {o[:40]!r}; expected {SYNTH_SPEC}")
        try:
            kw[key] = _SYNTH_KEYS[key](val) if len(val) <= 40 else None
        except ValueError:
            kw[key] = None
        if kw[key] is None:
            what = "an integer" if _SYNTH_KEYS[key] is int else "a number"
            raise TraceError(f"{spec[:200]}: {key}={val[:40]!r} is not {what}; expected "
                             f"{SYNTH_SPEC}")
    try:
        trace = synthetic(kind.strip(), **kw)
    except TraceError as e:
        raise TraceError(f"{spec[:200]}: {e}; expected {SYNTH_SPEC}") from None
    trace.name = spec
    return trace


def read_npy(path: str | Path) -> Trace:
    """An integer .npy [tokens, layers, top_k] of 0-based expert ids (-1 pads a short row),
    layers 0..L-1, all decode lines. The header is parsed and its shape checked against the
    file's size and this machine's memory before the data is read. Anything else is a
    TraceError naming the file."""
    want = "expected an integer .npy array [tokens, layers, top_k] of expert ids"
    with os.fdopen(open_regular(path, error=TraceError, what="route array"), "rb") as fh:
        if fh.read(len(NPY_MAGIC)) != NPY_MAGIC:
            raise TraceError(f"{path}: not a NumPy .npy file; {want}")
        fh.seek(0)
        try:
            version = np.lib.format.read_magic(fh)
            read = {(1, 0): np.lib.format.read_array_header_1_0,
                    (2, 0): np.lib.format.read_array_header_2_0}.get(version)
            if read is None:
                raise ValueError(f"format version {version}")
            shape, fortran, dtype = read(fh, max_header_size=NPY_MAX_HEADER)
        except (ValueError, TypeError, SyntaxError, RecursionError, tokenize.TokenError) as e:
            # numpy parses the header dict with ast and tokenize: any of their errors
            raise TraceError(f"{path}: unreadable .npy header ({str(e)[:200]}); {want}"
                             ) from None
        if dtype.kind not in "iu" or len(shape) != 3 or 0 in shape:
            raise TraceError(f"{path}: {dtype} array of shape {shape}; {want}")
        nbytes = math.prod(shape) * dtype.itemsize
        left = os.fstat(fh.fileno()).st_size - fh.tell()
        if nbytes != left:
            raise TraceError(f"{path}: the header's {dtype}{list(shape)} needs {nbytes} bytes "
                             f"of data, the file holds {left}; {want}")
        budget = _budget()
        if math.prod(shape) * 8 > budget:  # sorted as int64 below
            raise _too_big(str(path), f"shape {list(shape)}", math.prod(shape) * 8, budget)
        data = fh.read(nbytes)
        if len(data) != nbytes:  # the file shrank after fstat
            raise TraceError(f"{path}: truncated while read; {want}")
    routes = np.frombuffer(data, dtype).reshape(shape, order="F" if fortran else "C")
    if routes.min() < -1 or routes.max() >= MAX_EXPERTS or routes.max() < 0:
        raise TraceError(f"{path}: ids must be in 0..{MAX_EXPERTS - 1} (-1 pads a short row) "
                         f"with at least one id; {want}")
    if shape[1] > MAX_LAYERS:
        raise TraceError(f"{path}: {shape[1]} layers, more than {MAX_LAYERS}; {want}")
    ids = np.sort(routes.astype(np.int64), axis=-1)
    if ((ids[..., 1:] == ids[..., :-1]) & (ids[..., 1:] >= 0)).any():
        raise TraceError(f"{path}: a row repeats an expert id; {want}")
    return _from_array(ids, name=str(path))


# ---- synthetic traces ----------------------------------------------------------------------

def synthetic(kind: str, tokens: int = 1000, layers: int = 92, experts: int = 896,
              top_k: int = 16, alpha: float | None = None, locality: float | None = None,
              seed: int = 0) -> Trace:
    """Decode-only trace [tokens, layers, top_k] of distinct ids per row.

    kind 'uniform': every expert equally likely. 'zipf': expert popularity ~ rank**-alpha, the
    ranking shuffled per layer. 'temporal': Zipf, plus each of the previous token's experts is
    kept with probability `locality` (so consecutive tokens share about locality * K experts).
    'k3': 'temporal' with alpha and locality defaulting to K3_ALPHA / K3_LOCALITY (calibrated at
    K3 geometry, the default one); the others default to alpha 1, locality 0.5.
    Rows are drawn without replacement with the Gumbel top-k trick, in float32."""
    if kind not in ("uniform", "zipf", "temporal", "k3"):
        raise TraceError(f"synthetic kind must be uniform, zipf, temporal or k3, got {kind!r}")
    if alpha is None:
        alpha = K3_ALPHA if kind == "k3" else 1.0
    if locality is None:
        locality = K3_LOCALITY if kind == "k3" else 0.5
    if min(tokens, layers, experts) < 1 or not 0 < top_k <= experts:
        raise TraceError(f"need tokens, layers, experts >= 1 and 0 < top_k <= experts, got "
                         f"{tokens}, {layers}, {experts}, {top_k}")
    for key, v, hi in (("tokens", tokens, MAX_SYNTH_TOKENS), ("layers", layers, MAX_LAYERS),
                       ("experts", experts, MAX_EXPERTS)):
        if v > hi:
            raise TraceError(f"{key}={v} exceeds {hi}")
    if tokens * layers * experts > MAX_SYNTH_DRAWS:  # the work: one draw per expert per step
        raise TraceError(f"tokens x layers x experts = {tokens * layers * experts:,} random "
                         f"draws, more than {MAX_SYNTH_DRAWS:,} (about a minute): ask for "
                         "fewer tokens")
    budget = _budget()
    if tokens * layers * top_k * 4 > budget:
        raise _too_big("synth", f"tokens {tokens} x layers {layers} x top_k {top_k}",
                       tokens * layers * top_k * 4, budget)
    if not (0 <= locality <= 1 and math.isfinite(alpha) and seed >= 0):
        raise TraceError(f"need 0 <= locality <= 1, a finite alpha and seed >= 0, got "
                         f"{locality}, {alpha}, {seed}")
    rng = np.random.default_rng(seed)
    logp = np.zeros((layers, experts), np.float32)  # [L, E]
    if kind != "uniform":
        ranks = np.argsort(rng.random((layers, experts)), axis=1) + 1
        logp = (-alpha * np.log(ranks)).astype(np.float32)
    out = np.empty((tokens, layers, top_k), np.int32)
    if kind in ("temporal", "k3"):
        prev = None
        for i in range(tokens):
            score = logp - np.log(-np.log(rng.random((layers, experts), np.float32) + 1e-12))
            if prev is not None:  # keep each previous expert with probability `locality`
                keep = rng.random(prev.shape) < locality
                old = np.take_along_axis(score, prev, axis=1)
                np.put_along_axis(score, prev, np.where(keep, np.inf, old), axis=1)
            prev = np.argpartition(-score, top_k - 1, axis=1)[:, :top_k]
            out[i] = prev
    else:
        step = max(1, (1 << 22) // (layers * experts))
        for i in range(0, tokens, step):
            n = min(step, tokens - i)
            g = rng.random((n, layers, experts), np.float32)
            score = logp - np.log(-np.log(g + 1e-12))  # [n, L, E]
            out[i:i + n] = np.argpartition(-score, top_k - 1, axis=2)[:, :, :top_k]
    return _from_array(out, list(range(1, layers + 1)), experts,
                       f"synth:{kind},tokens={tokens}")


def write_route_trace(trace: Trace, path: str | Path) -> None:
    """Write `trace` in our JSONL format (decode lines only carry `predicted`)."""
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(json.dumps({"format": TRACE_FORMAT, "model": trace.model, "layers":
                             trace.layers, "experts": trace.experts, "top_k": trace.top_k,
                             "record_bytes": trace.record_bytes}) + "\n")
        keys = [str(la) for la in trace.layers]
        for i in range(trace.n_lines):
            routes = {k: [int(e) for e in row if e >= 0] for k, row in zip(keys, trace.routes[i])}
            fh.write(json.dumps({"t": int(trace.t[i]), "phase": "decode" if trace.decode[i]
                                 else "prefill", "routes": routes}, separators=(",", ":")) + "\n")
