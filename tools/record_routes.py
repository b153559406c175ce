#!/usr/bin/env python3
"""Record a route trace of a model reading a text (FORMAT.md "Route traces").

Teacher-forced: the text's tokens are fed one at a time as decode steps, so every token's line
has each MoE layer's route and the lookahead guesses of depths 1..`--lookahead` (prefill would
record routes without guesses). The trace in tests/data comes from the trained model reading
held-out text (README "Profiling the expert cache"; BENCHMARKS.md "Routes of the trained tiny K3").

    MODEL (checkpoint: its streaming artifact is built in a temporary directory) -> load with
    lookahead D -> decode token by token -> RouteTrace -> OUT.jsonl

Usage: record_routes.py MODEL --text FILE --out OUT.jsonl [--tokens 3072] [--lookahead 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm

from mtplx_runtime import load
from mtplx_runtime.artifact.build import build_artifact
from mtplx_runtime.artifact.open import is_artifact
from mtplx_runtime.checkpoint.config import ModelConfig
from mtplx_runtime.engine.trace import RouteTrace


def record(artifact: Path, text: str, out: Path, tokens: int, lookahead: int,
           name: str) -> int:
    """Write the trace of the first `tokens` tokens of `text`; returns the lines written."""
    # The reference kernels and a cache holding every expert: the routes are the model's own,
    # bit-identical to the resident model, whatever the machine.
    experts = ModelConfig.from_file(artifact / "config.json").num_experts
    with load(artifact, dtype="float32", kernels="reference", lookahead=lookahead,
              cache_slots=(experts, 0)) as rt:
        ids = rt.tokenizer.encode(text)[:tokens]
        model, state = rt.model, rt.model.new_state()
        with RouteTrace(out, model, model_name=name,
                        record_bytes=rt.provider.layout.logical_bytes) as trace:
            for pos, t in enumerate(tqdm(ids, desc="tokens", mininterval=2.0)):
                model.decode(t, state)
                trace.on_forward(model, "decode", pos, 1)
            return trace.lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path, help="checkpoint or streaming artifact")
    p.add_argument("--text", type=Path, required=True, help="UTF-8 text to read")
    p.add_argument("--out", type=Path, required=True, help="trace file (JSON lines)")
    p.add_argument("--tokens", type=int, default=3072, help="tokens of the text to read")
    p.add_argument("--lookahead", type=int, default=3, help="guess depths 1..D")
    p.add_argument("--name", default=None, help="model name in the header (default: MODEL)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    text = args.text.read_text(encoding="utf-8")
    name = args.name or args.model.name
    if is_artifact(args.model):
        n = record(args.model, text, args.out, args.tokens, args.lookahead, name)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            art = Path(tmp) / "stream"
            build_artifact(args.model, art, progress=False)
            n = record(art, text, args.out, args.tokens, args.lookahead, name)
    print(f"wrote {n} decode lines to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
