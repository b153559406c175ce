"""Route traces: which experts every MoE layer picked for every token, as JSON lines.

    generate_step -> forward -> RouteTrace.on_forward -> LatentMoE.last_ids [T, K] -> one line/token

The profiler replays these files through cache policies (LRU, LFU, Belady) offline, so a trace
is recorded once per prompt and never needs the model again.

Format `mtplx-route-trace-v1` (UTF-8 JSON lines, one JSON object per line):

* Line 1, the header: `{"format": "mtplx-route-trace-v1", "model": str, "layers": [int...],
  "experts": E, "top_k": K, "record_bytes": int | null}`. `layers` are the 0-based model indices
  of the MoE layers, ascending; `record_bytes` is the logical bytes of one expert record (null
  when unknown), so a replay can turn hit rates into bytes read.
* Then one line per token per forward, in execution order:
  `{"t": int, "phase": "prefill" | "decode", "routes": {"<layer>": [ids...]},
  "predicted": {"<layer>": {"<depth>": [ids...]}}}`. `t` is the token's 0-based position in the
  sequence; a prefill chunk of n tokens writes n lines with consecutive `t`. `routes` has every
  layer of the header, each exactly K distinct expert ids in ascending order (the ids `moe.route`
  returns). Keys are JSON strings of the integers.
* `predicted` is present only on decode lines and only when the expert provider exposes
  lookahead guesses: an attribute `last_predictions` mapping layer -> {depth: ids [T, K'] or
  [K']}, the guesses made for that layer during this forward (`lookahead.predict` on the hidden
  state `depth` MoE layers earlier). Layers never guessed are absent. Readers MUST ignore
  unknown keys. A file MAY end without a final newline after a crash; readers drop a partial
  last line.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from ..checkpoint.config import MAX_EXPERTS, MAX_LAYERS, short_repr
from ..files import InputError, open_regular

TRACE_FORMAT = "mtplx-route-trace-v1"


def moe_blocks(model) -> list:
    """The model's LatentMoE blocks (those with routing), in layer order."""
    return [layer.mlp for layer in model.layers if hasattr(layer.mlp, "last_ids")]


def _rows(ids, n: int) -> list[list[int]]:
    """n per-token id lists from ids [n, K] (one row each) or [K] (shared by all tokens); any
    other row count is read as one set shared by all tokens (its union, ascending)."""
    rows = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    if rows and isinstance(rows[0], list):
        if len(rows) == n:
            return [[int(e) for e in r] for r in rows]
        rows = sorted({int(e) for r in rows for e in r})
    return [[int(e) for e in rows]] * n


class RouteTrace:
    """Writes a route trace for one model to `path` (see the module docstring).

    Use as a context manager or call `close()`; every line is flushed as written so a crash
    keeps what was recorded. `on_forward` is the hook `generate.generate_step(trace=...)` calls.
    """

    def __init__(self, path: str | Path, model, *, model_name: str = "",
                 record_bytes: int | None = None):
        blocks = moe_blocks(model)
        self.layers = [b.layer for b in blocks]
        self.path = Path(path)
        self._fh = open(self.path, "w", encoding="utf-8")
        self.lines = 0
        header = {"format": TRACE_FORMAT, "model": model_name, "layers": self.layers,
                  "experts": int(model.cfg.num_experts),
                  "top_k": int(model.cfg.num_experts_per_token),
                  "record_bytes": None if record_bytes is None else int(record_bytes)}
        self._write(header)

    def _write(self, obj: dict) -> None:
        self._fh.write(json.dumps(obj, separators=(",", ":")) + "\n")
        self._fh.flush()

    def on_forward(self, model, phase: str, first_position: int, n_tokens: int) -> None:
        """Record the route of the forward just run: n_tokens lines from `first_position`."""
        routes, predicted = {}, {}
        for block in moe_blocks(model):
            ids = block.last_ids  # [T, K] int64, ascending per token
            if ids is None or ids.shape[0] != n_tokens:
                raise ValueError(f"layer {block.layer}: last_ids does not hold this forward's "
                                 f"{n_tokens} tokens")
            routes[block.layer] = _rows(ids.cpu(), n_tokens)
            # The provider guesses only during one-token forwards (prefill reads transiently).
            guesses = getattr(block.provider, "last_predictions", None) if phase == "decode" \
                else None
            if guesses and block.layer in guesses:
                predicted[block.layer] = {d: _rows(v, n_tokens)
                                          for d, v in sorted(guesses[block.layer].items())}
        for i in range(n_tokens):
            line = {"t": first_position + i, "phase": phase,
                    "routes": {str(layer): r[i] for layer, r in routes.items()}}
            if predicted:
                line["predicted"] = {str(layer): {str(d): r[i] for d, r in by_depth.items()}
                                     for layer, by_depth in predicted.items()}
            self._write(line)
            self.lines += 1

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()

    def __enter__(self) -> RouteTrace:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TraceError(InputError):
    """A route-trace file that is not `mtplx-route-trace-v1`; the message names the file and
    line."""


MAX_TRACE_LINE = 64 * 2**20  # one token line; a longer one is hostile
MAX_TRACE_ID = 1 << 24  # lookahead depths
# Layer indices and expert counts within the config's own bounds: a header may not ask a reader
# for more than a model could have (the profiler allocates [layers, experts] counts).


def _int(v: object, lo: int = 0, hi: int = MAX_TRACE_ID) -> bool:
    return type(v) is int and lo <= v <= hi


def _ids(v: object, experts: int) -> bool:
    return type(v) is list and all(type(e) is int and 0 <= e < experts for e in v) \
        and len(set(v)) == len(v)


def _json_line(raw: str, where: str) -> object:
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except ValueError as e:
        raise TraceError(f"{where}: not valid JSON: {e}") from None
    except RecursionError:
        raise TraceError(f"{where}: not valid JSON: nested too deeply") from None


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def check_header(header: object, where: str) -> dict:
    """The header line's fields (FORMAT.md "Route traces"), else TraceError."""
    if not isinstance(header, dict):
        raise TraceError(f"{where}: the header is not a JSON object")
    if header.get("format") != TRACE_FORMAT:
        raise TraceError(f"{where}: format {header.get('format')!r}, expected {TRACE_FORMAT!r}")
    layers, experts, k = header.get("layers"), header.get("experts"), header.get("top_k")
    if type(layers) is not list or not all(_int(x, 0, MAX_LAYERS - 1) for x in layers) \
            or len(set(layers)) != len(layers):
        raise TraceError(f"{where}: header layers must be distinct layer indices in "
                         f"0..{MAX_LAYERS - 1}")
    if not _int(experts, 1, MAX_EXPERTS) or not _int(k, 1, experts):
        raise TraceError(f"{where}: header needs 1 <= experts <= {MAX_EXPERTS} and "
                         f"1 <= top_k <= experts, got experts {short_repr(experts)}, top_k "
                         f"{short_repr(k)}")
    rb = header.get("record_bytes")
    if rb is not None and not _int(rb, 1, 1 << 48):
        raise TraceError(f"{where}: header record_bytes must be a positive integer or null")
    if not isinstance(header.get("model", ""), str):
        raise TraceError(f"{where}: header model must be a string")
    return header


def check_line(obj: object, header: dict, where: str) -> dict:
    """One token line: `t`, `phase`, `routes` for every header layer (at most top_k distinct
    ids below experts each), optional `predicted`; unknown keys ignored. Else TraceError."""
    experts, k = header["experts"], header["top_k"]
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: not a JSON object")
    if not _int(obj.get("t"), 0, 1 << 62) or obj.get("phase") not in ("prefill", "decode"):
        raise TraceError(f"{where}: needs an integer t >= 0 and phase prefill or decode")
    routes = obj.get("routes")
    if not isinstance(routes, dict):
        raise TraceError(f"{where}: routes is not a JSON object")
    for layer in header["layers"]:
        ids = routes.get(str(layer))
        if not _ids(ids, experts) or len(ids) > k:
            raise TraceError(f"{where}: routes of layer {layer} must be at most {k} distinct "
                             f"ids in 0..{experts - 1}")
    predicted = obj.get("predicted", {})
    if not isinstance(predicted, dict):
        raise TraceError(f"{where}: predicted is not a JSON object")
    for la, by_depth in predicted.items():
        if not (la.isdecimal() and len(la) <= 9 and isinstance(by_depth, dict)) or not all(
                d.isdecimal() and len(d) <= 9 and _ids(ids, experts)
                for d, ids in by_depth.items()):
            raise TraceError(f"{where}: predicted must map layer -> depth -> distinct ids in "
                             f"0..{experts - 1}")
    return obj


def read_trace(path: str | Path) -> tuple[dict, Iterator[dict]]:
    """(header, token lines) of a trace file; drops a partial tail. The file must be a regular
    file (opened without blocking); a malformed header or line is a TraceError naming the line."""
    fd = open_regular(path, error=TraceError, what="route trace")
    fh = open(fd, encoding="utf-8", errors="strict")
    try:
        first = fh.readline(MAX_TRACE_LINE + 1)
        header = check_header(_json_line(first, f"{path}:1"), f"{path}:1")
    except UnicodeDecodeError as e:
        fh.close()
        raise TraceError(f"{path}:1: not UTF-8: {e}") from None
    except BaseException:
        fh.close()
        raise

    def lines() -> Iterator[dict]:
        with fh:
            n = 1
            while True:
                n += 1
                try:
                    raw = fh.readline(MAX_TRACE_LINE + 1)
                except UnicodeDecodeError as e:
                    raise TraceError(f"{path}:{n}: not UTF-8: {e}") from None
                if not raw.endswith("\n"):
                    if len(raw) > MAX_TRACE_LINE:
                        raise TraceError(f"{path}:{n}: longer than {MAX_TRACE_LINE} characters")
                    return  # end of file, or a partial last line after a crash
                yield check_line(_json_line(raw, f"{path}:{n}"), header, f"{path}:{n}")

    return header, lines()
