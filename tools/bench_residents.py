"""Quality of quantized residents against bf16: the trained tiny K3 and the random tiny fixture.

    model (bf16) -- same prompt/text -- model (int8 | int4 | fp8 residents, model/quant.py)
      -> logit rel-L2 = ||l_q - l_bf16|| / ||l_bf16|| over every position, top-1 agreement,
         held-out perplexity (trained model: the excerpt of tests/data/kjv-heldout.txt in windows
         of --window tokens), greedy continuation (tokens equal before the first difference)

One line per (model, resident dtype); the bf16 line is the baseline (rel-L2 0, agreement 1).
Experts are resident and unchanged (they are not resident tensors); only the trunk moves.
fp8 computes here through the reference (weight-only, what a CPU runs); `fp8-rowwise` is the
GPU fast path's arithmetic (x rounded to e4m3 per row too, `quant.scaled_mm_rowwise`) through
torch's CPU `_scaled_mm`, for every matrix that kernel takes.

    python tools/bench_residents.py [--tokens 1024] [--window 64] [--greedy 48]
        [--dtypes bf16,int8,int4,fp8,fp8-rowwise] [--models kimi-k3-tiny-kjv,tiny-random]
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from train_tiny import perplexity  # tools/ is on sys.path when this script runs

from mtplx_runtime import load_model
from mtplx_runtime.cli.demo import PROMPT, TRAINED
from mtplx_runtime.engine.generate import generate
from mtplx_runtime.engine.tokenizer import load_tokenizer
from mtplx_runtime.fixtures.tiny import make_tiny
from mtplx_runtime.formats.resident_layouts import RESIDENT_DTYPES
from mtplx_runtime.model.quant import Fp8Weight, shape_refusal

EXCERPT = Path(__file__).resolve().parents[1] / "tests" / "data" / "kjv-heldout.txt"


ROWWISE = "fp8-rowwise"
MODELS = ("kimi-k3-tiny-kjv", "tiny-random")


def rowwise(model) -> int:
    """Make every fp8 matrix `_scaled_mm` takes compute through it (the GPU path's arithmetic on
    the CPU); the number switched."""
    weights = list(model.top.values()) + [w for layer in model.layers for w in layer.w.values()]
    fp8 = [w for w in weights if isinstance(w, Fp8Weight)
           and not shape_refusal("scaled_mm", tuple(w.shape))]
    for w in fp8:
        w.kernel = "scaled_mm"
    return len(fp8)


def compare(name: str, root: Path, ids: np.ndarray, prompt: list[int], args) -> None:
    base = load_model(root, dtype="bfloat16")
    ref = base.logits(ids[: args.logit_tokens]).float()
    ref_text, _ = generate(base, prompt, max_tokens=args.greedy)
    for dtype in args.dtypes:
        model = base if dtype == "bf16" else load_model(
            root, dtype="bfloat16", resident_dtype="fp8" if dtype == ROWWISE else dtype)
        if dtype == ROWWISE:
            rowwise(model)
        got = model.logits(ids[: args.logit_tokens]).float()
        rel = float((got - ref).norm() / ref.norm())
        top1 = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
        ppl = perplexity(model, ids, args.window)
        text, _ = generate(model, prompt, max_tokens=args.greedy)
        same = next((i for i, (a, b) in enumerate(zip(text, ref_text)) if a != b),
                    min(len(text), len(ref_text)))
        print(f"model={name} resident_dtype={dtype} logit_rel_l2={rel:.4f} top1_agree={top1:.4f} "
              f"ppl={ppl:.3f} ppl_tokens={len(ids)} greedy_same_prefix={same}/{args.greedy}",
              flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096, help="held-out tokens for perplexity")
    p.add_argument("--logit-tokens", type=int, default=512, help="positions compared (logits)")
    p.add_argument("--window", type=int, default=64, help="perplexity window")
    p.add_argument("--greedy", type=int, default=48, help="greedy tokens compared")
    p.add_argument("--dtypes", default=",".join(RESIDENT_DTYPES + (ROWWISE,)),
                   help="resident dtypes compared with bf16 (comma-separated)")
    p.add_argument("--models", default=",".join(MODELS), help="models (comma-separated)")
    args = p.parse_args(argv)
    args.dtypes = args.dtypes.split(",")
    models = args.models.split(",")
    bad = set(args.dtypes) - set(RESIDENT_DTYPES + (ROWWISE,)) or set(models) - set(MODELS)
    if bad:
        p.error(f"unknown: {', '.join(sorted(bad))}")
    torch.manual_seed(0)
    print(f"# bench_residents torch={torch.__version__} python={platform.python_version()} "
          f"threads={torch.get_num_threads()} dtypes={','.join(args.dtypes)}", flush=True)
    tok = load_tokenizer(TRAINED)
    ids = np.array(tok.encode(EXCERPT.read_text(encoding="utf-8")))[: args.tokens]
    if MODELS[0] in models:
        compare(MODELS[0], TRAINED, ids, tok.encode(PROMPT), args)
    if MODELS[1] not in models:
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        info = make_tiny(Path(tmp) / "tiny", codec="bf16")
        cfg = info.config
        rng = np.random.default_rng(0)
        rand = rng.integers(0, cfg.vocab_size, size=min(args.tokens, 512))
        compare(MODELS[1], Path(tmp) / "tiny", rand, rand[:8].tolist(), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
