"""`mtplx demo`: the README's main command on the embedded default model.

For now the default model is the set of tiny K3 fixtures: one per expert codec, built
deterministically on first run into a cache directory, then read back through the checkpoint
reader. The table shows what each holds and proves every routed expert decodes exactly to the
weights it was drawn from. Later stages turn this into streamed generation.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

# (label, make_tiny codec, extra make_tiny arguments, layout description)
VARIANTS = [
    ("t158", "t158", {}, "t158 normal: 6 stacked tensors/layer"),
    ("mxfp4", "mxfp4", {}, "official MXFP4 (ct mxfp4-pack-quantized)"),
    ("w3-legacy", "w3", {"w3_layout": "legacy"}, "W3A16 g64, 10 codes/int32 (ct 0.17)"),
    ("w3-dense", "w3", {"w3_layout": "dense"}, "W3A16 g64, 32 codes/3 words (ct>=0.18)"),
    ("bf16", "bf16", {}, "unquantized BF16 experts"),
]

# Full-size K3 routed-expert shapes (k3-model.md §3.6), to show what each codec costs at scale.
K3_SHAPES = {"gate": (3072, 3584), "up": (3072, 3584), "down": (3584, 3072)}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache-dir", default=".mtplx-cache", help="where fixtures are built (reused)")
    p.add_argument("--seed", type=int, default=0, help="fixture seed")
    p.add_argument("--rebuild", action="store_true", help="rebuild the fixtures even if present")
    p.add_argument("--prompt", default="The expert cache reads ahead of the router",
                   help="prompt for the greedy continuation")
    p.add_argument("--max-tokens", type=int, default=12, help="tokens to continue greedily")


def _fixture(root: Path, label: str, codec: str, extra: dict, seed: int, rebuild: bool):
    from .fixtures.tiny import TinyInfo, make_tiny

    out = root / f"tiny-{label}-seed{seed}"
    stamp = out / "fixture.json"
    if rebuild or not stamp.exists():
        if out.exists():
            import shutil

            shutil.rmtree(out)
        return make_tiny(out, codec, seed=seed, **extra), True
    return TinyInfo.load(out), False


def _check(info, ckpt) -> tuple[int, int, float]:
    """Decode every routed expert through the reader; compare with the drawn weights."""
    exact = total = 0
    worst = 0.0
    for layer in ckpt.config.moe_layers:
        for e in range(ckpt.config.num_experts):
            got, want = ckpt.expert(layer, e).decode(), info.expert_weights(layer, e)
            diff = max(float(np.max(np.abs(got[p] - want[p]))) for p in want)
            worst = max(worst, diff)
            exact += diff == 0.0
            total += 1
    return exact, total, worst


def main(args: argparse.Namespace) -> int:
    from .checkpoint import open_checkpoint

    root = Path(args.cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    rows, first = [], None
    t0 = time.perf_counter()
    for label, codec, extra, layout in VARIANTS:
        info, built = _fixture(root, label, codec, extra, args.seed, args.rebuild)
        ckpt = open_checkpoint(info.path)
        cfg = ckpt.config
        first = first or cfg
        shapes = cfg.expert_shapes
        tiny_bytes = sum(ckpt.codec.projection_bytes(s) for s in shapes.values())
        weights = sum(r * c for r, c in shapes.values())
        k3_bytes = sum(ckpt.codec.projection_bytes(s) for s in K3_SHAPES.values())
        exact, total, worst = _check(info, ckpt)
        check = (f"exact {exact}/{total}" if exact == total
                 else f"FAIL {exact}/{total} max|d|={worst:g}")
        rows.append((label, layout, total, tiny_bytes, 8 * tiny_bytes / weights, k3_bytes, check,
                     "built" if built else "cached"))
    elapsed = time.perf_counter() - t0

    cfg = first
    n_kda = sum(cfg.is_kda_layer(i) for i in range(cfg.num_hidden_layers))
    g = cfg.expert_shapes["gate"]
    print(f"mtplx_runtime demo: tiny Kimi K3 fixtures (seed {args.seed}) in {root}/")
    print(
        f"tiny model: {cfg.num_hidden_layers} layers ({n_kda} KDA, {cfg.num_hidden_layers - n_kda}"
        f" MLA), hidden {cfg.hidden_size}, {len(cfg.moe_layers)} MoE layers x {cfg.num_experts}"
        f" routed experts (top-{cfg.num_experts_per_token}), expert {g[1]} -> {g[0]} -> {g[1]}"
    )
    print()
    head = ("codec", "on-disk layout", "experts", "B/expert", "bits/w", "K3 B/expert",
            "decode check", "fixture")
    widths = (10, 42, 8, 9, 7, 12, 14, 6)
    fmt = lambda r: "  ".join(str(v).ljust(w) if i < 2 or i > 5 else str(v).rjust(w)  # noqa: E731
                              for i, (v, w) in enumerate(zip(r, widths)))
    print(fmt(head).rstrip())
    for label, layout, total, tb, bpw, k3b, check, state in rows:
        row = (label, layout, total, f"{tb:,}", f"{bpw:.3f}", f"{k3b:,}", check, state)
        print(fmt(row).rstrip())
    print()
    print("B/expert: bytes of one routed expert (gate+up+down) in the tiny model; K3 B/expert: the")
    print("same codec at full K3 geometry (3584 -> 3072 -> 3584). decode check: every expert read")
    print("back through the checkpoint reader equals the weights it was drawn from. "
          f"({elapsed:.1f} s)")
    print()
    _continue(root, args)
    ok = all(r[6].startswith("exact") for r in rows)
    return 0 if ok else 1


def greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy continuation: one prefill, then one-token decode steps on the same state."""
    state = model.new_state()
    logits = model.prefill(prompt, state)[-1]
    out = []
    for _ in range(max_tokens):
        out.append(int(logits.argmax()))
        logits = model.decode(out[-1], state)
    return out


def _continue(root: Path, args: argparse.Namespace) -> None:
    from .model.kimi_k3 import load_model
    from .tokenizer import load_tokenizer

    dirs = {label: root / f"tiny-{label}-seed{args.seed}" for label, *_ in VARIANTS}
    tok = load_tokenizer(dirs["t158"])
    prompt = tok.encode(args.prompt)
    print("greedy continuation, float32 reference model (one prefill, then decode steps; "
          "\u00b7 = a special id):")
    print(f"  prompt {args.prompt!r} -> {prompt}")
    for label, path in dirs.items():
        model = load_model(path, dtype="float32")
        t0 = time.perf_counter()
        ids = greedy(model, prompt, args.max_tokens)
        tok_s = (len(prompt) + args.max_tokens) / (time.perf_counter() - t0)
        # Reserved special ids have random embeddings in the tiny model; show them compactly.
        text = "".join("\u00b7" if tok.is_special(i) else tok.decode([i]) for i in ids)
        print(f"  {label:<10} {ids}  {text[:40]!r}  "
              f"({tok_s:.0f} tok/s, experts decoded on first use)")
    print("The tiny weights are random, so the text is noise; the codecs draw different experts,"
          " so their\ncontinuations differ (both W3 layouts hold the same codes and agree).")

