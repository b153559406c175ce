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


def read_trace(path: str | Path) -> tuple[dict, Iterator[dict]]:
    """(header, token lines) of a trace file; checks the format string, drops a partial tail."""
    fh = open(path, encoding="utf-8")
    header = json.loads(fh.readline())
    if header.get("format") != TRACE_FORMAT:
        fh.close()
        raise ValueError(f"{path}: format {header.get('format')!r}, expected {TRACE_FORMAT!r}")

    def lines() -> Iterator[dict]:
        with fh:
            for raw in fh:
                if not raw.endswith("\n"):
                    return  # partial last line after a crash
                yield json.loads(raw)

    return header, lines()
