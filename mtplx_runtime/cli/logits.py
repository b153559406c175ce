"""`mtplx logits`: full causal forward of a token list, logits saved as a float32 .npy [T, V]."""

from __future__ import annotations

import argparse
import io
import sys

from ..files import atomic_write
from .common import add_dtype, add_resident_dtype
from .model_dir import add_model_dir


def _token_list(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--tokens wants comma-separated ids, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("--tokens is empty")
    return ids


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_dir(p, "checkpoint directory")
    add_dtype(p, "model dtype (float32 for exact comparisons); the saved logits are float32 "
                 "either way")
    add_resident_dtype(p)
    p.add_argument("--tokens", required=True, type=_token_list, help="comma-separated token ids")
    p.add_argument("--out", required=True, help="output .npy file")


def main(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from ..engine.runtime import load_model

    try:
        model = load_model(args.model, dtype=args.dtype, resident_dtype=args.resident_dtype)
    except ValueError as e:  # e.g. int8 residents with a float32 model
        print(f"mtplx logits: error: {e}", file=sys.stderr)
        return 2
    vocab = model.cfg.vocab_size
    bad = [t for t in args.tokens if not 0 <= t < vocab]
    if bad:
        print(f"mtplx logits: error: token ids {bad[:5]} are outside the vocabulary "
              f"0..{vocab - 1}", file=sys.stderr)
        return 2
    logits = model.logits(args.tokens).to(torch.float32).numpy()
    npy = io.BytesIO()
    np.save(npy, logits)
    # np.save's own naming (".npy" added when missing), written in one step
    atomic_write(args.out if str(args.out).endswith(".npy") else f"{args.out}.npy",
                 npy.getbuffer())
    top = logits[-1].argmax()
    print(f"logits {list(logits.shape)} ({args.dtype}) -> {args.out}; next-token argmax {top}")
    return 0
