"""Quality of quantized residents against bf16: the trained tiny K3 and the random tiny fixture.

    model (bf16 residents) -- same prompt/text -- model (int8 | int4 residents, model/quant.py)
      -> logit rel-L2 = ||l_q - l_bf16|| / ||l_bf16|| over every position, top-1 agreement,
         held-out perplexity (trained model: the excerpt of tests/data/kjv-heldout.txt in windows
         of --window tokens), greedy continuation (tokens equal before the first difference)

One line per (model, resident dtype); the bf16 line is the baseline (rel-L2 0, agreement 1).
Experts are resident and unchanged (they are not resident tensors); only the trunk moves.

    python tools/bench_residents.py [--tokens 1024] [--window 64] [--greedy 48]
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
from mtplx_runtime.formats.residents import RESIDENT_DTYPES

EXCERPT = Path(__file__).resolve().parents[1] / "tests" / "data" / "kjv-heldout.txt"


def compare(name: str, root: Path, ids: np.ndarray, prompt: list[int], args) -> None:
    base = load_model(root, dtype="bfloat16")
    ref = base.logits(ids[: args.logit_tokens]).float()
    ref_text, _ = generate(base, prompt, max_tokens=args.greedy)
    for dtype in RESIDENT_DTYPES:
        model = base if dtype == "bf16" else load_model(root, dtype="bfloat16",
                                                        resident_dtype=dtype)
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
    args = p.parse_args(argv)
    torch.manual_seed(0)
    print(f"# bench_residents torch={torch.__version__} python={platform.python_version()} "
          f"threads={torch.get_num_threads()} dtypes={','.join(RESIDENT_DTYPES)}", flush=True)
    tok = load_tokenizer(TRAINED)
    ids = np.array(tok.encode(EXCERPT.read_text(encoding="utf-8")))[: args.tokens]
    compare("kimi-k3-tiny-kjv", TRAINED, ids, tok.encode(PROMPT), args)
    with tempfile.TemporaryDirectory() as tmp:
        info = make_tiny(Path(tmp) / "tiny", codec="bf16")
        cfg = info.config
        rng = np.random.default_rng(0)
        rand = rng.integers(0, cfg.vocab_size, size=min(args.tokens, 512))
        compare("tiny-random", Path(tmp) / "tiny", rand, rand[:8].tolist(), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
