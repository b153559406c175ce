#!/usr/bin/env python3
"""Train the small Kimi K3 that `mtplx demo` streams, on the King James Bible, and write it as
an HF checkpoint with t158 routed experts (README "The trained tiny K3").

    KJV verses -> chapters, every 20th held out -> BPE (K3 tokenizer files) -> the reference
    KimiK3 built on trainable tensors -> AdamW; routed experts ternary in the forward (t158,
    straight-through) ; router bias updates -> checkpoint + training.json (perplexities)

The model is `mtplx_runtime.model.KimiK3` itself: `KimiK3.run` is its forward outside inference
mode, so every block (KDA, MLA, LatentMoE, AttnRes, SiTU) is trained through the code that runs
it. Routed experts are computed by the reference kernel's `routed_sum` on their t158 values
(`formats.t158.ternarize_t158_torch`: the encoder's threshold and scales, bit-exact), with the
gradient passed straight through to float weights, so the t158 checkpoint is the trained model.
Load balancing is K3's auxiliary-loss-free scheme: after each step every expert's selection-only
correction bias moves by `--bias-rate` towards the mean load (FORMAT.md "Router").

The corpus is the KJV text of Debian's `bible-kjv` (public domain): `--corpus FILE` takes its
dump (`bible -f -l 100000 gen1:1-rev22:21`), else the script runs `bible` itself.
Runs on CPU; `--toy` is a two-minute configuration for tests.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import regex
import torch
import torch.nn.functional as F
from tqdm import tqdm

from mtplx_runtime.checkpoint.config import ModelConfig
from mtplx_runtime.checkpoint.residents import resident_tensor_specs
from mtplx_runtime.engine.runtime import load_model
from mtplx_runtime.engine.tokenizer import K3_PAT_STR_NO_INTERSECTION, load_tokenizer
from mtplx_runtime.fixtures.tiny import generation_config
from mtplx_runtime.fixtures.tiny_layout import (
    config_files,
    expert_tensors,
    write_json,
    write_shards,
)
from mtplx_runtime.fixtures.tiny_weights import ExpertCodec
from mtplx_runtime.fixtures.tokenizer import special_id, train_ranks, write_tokenizer
from mtplx_runtime.formats import get_codec
from mtplx_runtime.formats.base import f32_to_bf16_bits
from mtplx_runtime.formats.t158 import ternarize_t158_torch
from mtplx_runtime.kernels.reference import ExpertWeights, routed_sum
from mtplx_runtime.model.kimi_k3 import KimiK3
from mtplx_runtime.model.load import group_residents

TRAINING_FORMAT = "mtplx-trained-tiny-v1"
HELDOUT_EVERY = 20  # chapter i is held out when i % 20 == 19: 5 % of the text, every book
CORPUS = {"name": "King James Version of the Bible (1611, 1769 text)",
          "package": "Debian bible-kjv-text (read with Debian bible-kjv)",
          "licence": "public domain (Crown patent in the United Kingdom only)"}
BIBLE_ARGS = ["-f", "-l", "100000", "gen1:1-rev22:21"]  # every verse, one per line
VERSE = re.compile(r"^(\d?[A-Za-z]+)(\d+):(\d+) (.*)$")  # "1Sm3:10 And the LORD came..."


# ---- the model ----


def model_config(n_ranks: int, toy: bool = False) -> ModelConfig:
    """The shipped model (hidden 256, 8 layers: KDA 0-2, 4-6 and MLA 3, 7 as in K3's pattern;
    dense layer 0; 7 LatentMoE layers of 64 experts top-4, latent 128, width 128, 2 shared;
    AttnRes blocks of 2). `toy`: the same blocks at hidden 64, 4 layers, 8 experts top-2."""
    d, layers, heads, experts, top_k = (64, 4, 2, 8, 2) if toy else (256, 8, 4, 64, 4)
    mla = (4,) if toy else (4, 8)  # 1-based: every 4th layer and the last, as K3
    return ModelConfig(
        vocab_size=n_ranks + 256,
        hidden_size=d,
        num_hidden_layers=layers,
        intermediate_size=3 * d,
        first_k_dense_replace=1,
        num_experts=experts,
        num_experts_per_token=top_k,
        moe_intermediate_size=64 if toy else 128,
        routed_expert_hidden_size=64 if toy else 128,  # t158 groups: multiples of 64
        num_shared_experts=2,
        latent_moe_use_norm=True,
        routed_scaling_factor=1.0,
        moe_renormalize=True,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        q_lora_rank=d // 2,
        kv_lora_rank=d // 4,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        mla_use_output_gate=True,
        kda_num_heads=heads,
        kda_head_dim=d // heads,
        kda_short_conv_kernel_size=4,
        kda_gate_lower_bound=-5.0,
        kda_use_full_rank_gate=True,
        kda_layers=tuple(i for i in range(1, layers + 1) if i not in mla),
        full_attn_layers=mla,
        attn_res_block_size=2,
        activation_situ_beta=4.0,
        activation_situ_linear_beta=25.0,
        rms_norm_eps=1e-5,
        bos_token_id=special_id("[BOS]", n_ranks),
        eos_token_id=special_id("<|end_of_msg|>", n_ranks),
        pad_token_id=special_id("[PAD]", n_ranks),
        tie_word_embeddings=False,
    )


OUT_PROJ = ("o_proj.weight", "down_proj.weight", "routed_expert_up_proj.weight")


def init_value(name: str, shape: tuple[int, ...], cfg: ModelConfig,
               gen: torch.Generator) -> torch.Tensor:
    """float32 initial value of one resident tensor."""
    def normal(std):
        return torch.randn(shape, generator=gen) * std

    if name.endswith("e_score_correction_bias"):
        return torch.zeros(shape)  # moved by the load balancer, never by the gradient
    if name.endswith("res_proj.weight"):
        return torch.zeros(shape)  # AttnRes starts as a uniform average of its entries
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith("A_log"):
        v = torch.zeros(shape)  # entries past the head count are padding
        v[: cfg.kda_num_heads] = torch.empty(cfg.kda_num_heads).uniform_(1, 16, generator=gen).log()
        return v
    if name.endswith("dt_bias"):
        # Slow to fast channels: logit(g / lower_bound) for g log-uniform in (-1, -0.001) is
        # the gate input giving log-decay g when A = 1 (a head's A = exp(A_log) scales it).
        g = -torch.exp(torch.empty(shape).uniform_(math.log(1e-3), 0.0, generator=gen))
        return torch.logit(g / cfg.kda_gate_lower_bound)
    if name.endswith("_conv1d.weight"):
        return torch.empty(shape).uniform_(-0.5, 0.5, generator=gen)  # torch's Conv1d bound
    if name.endswith("embed_tokens.weight"):
        return normal(1.0)
    std = shape[-1] ** -0.5
    if name.endswith(OUT_PROJ):
        std /= math.sqrt(2 * cfg.num_hidden_layers)  # residual branches start small
    return normal(std)


class QATExperts:
    """The ExpertProvider of training: each MoE layer's experts as trainable float tensors
    `{layer: {"gate" [E, I, R], "up" [E, I, R], "down" [E, R, I]}}`, computed by the reference
    kernel's `routed_sum`. With `quantize` the forward uses their t158 values and the backward
    passes the gradient straight through; `loads` counts each layer's picks for the balancer."""

    lookahead = 0  # everything is in memory

    def __init__(self, cfg: ModelConfig, params: dict[int, dict[str, torch.Tensor]],
                 quantize: bool = True):
        self.cfg, self.params, self.quantize = cfg, params, quantize
        self.loads = {layer: torch.zeros(cfg.num_experts) for layer in params}
        self.ternary: dict[int, dict[str, torch.Tensor]] = {}
        self.refresh()

    def refresh(self) -> None:
        """Ternarize every expert once per optimizer step (the costly part of the forward)."""
        self.ternary = ({layer: {k: ternarize_t158_torch(v) for k, v in p.items()}
                         for layer, p in self.params.items()} if self.quantize else {})

    def begin_forward(self, tokens: int) -> None:
        pass

    def hint(self, layer, actual, predicted) -> None:
        pass

    def run_experts(self, layer: int, r: torch.Tensor, ids: torch.Tensor,
                    weights: torch.Tensor) -> torch.Tensor:
        p = self.params[layer]
        if self.quantize:  # value of t158, gradient of identity
            p = {k: v + (self.ternary[layer][k] - v).detach() for k, v in p.items()}
        self.loads[layer] += torch.bincount(ids.flatten(), minlength=self.cfg.num_experts)
        experts = {e: ExpertWeights(p["gate"][e], p["up"][e], p["down"][e])
                   for e in torch.unique(ids).tolist()}
        return routed_sum(r, ids, weights, experts, beta=self.cfg.activation_situ_beta,
                          beta_lin=self.cfg.activation_situ_linear_beta)


def build_model(cfg: ModelConfig, seed: int):
    """(KimiK3 on trainable float32 tensors, {name: tensor} of its residents, QATExperts)."""
    gen = torch.Generator().manual_seed(seed)
    residents = {name: init_value(name, spec.shape, cfg, gen)
                 for name, spec in resident_tensor_specs(cfg).items()}
    for name, t in residents.items():
        t.requires_grad_(not name.endswith("e_score_correction_bias"))
    experts = {}
    I, R = cfg.moe_intermediate_size, cfg.routed_expert_hidden_size
    for layer in cfg.moe_layers:
        experts[layer] = {
            "gate": torch.randn(cfg.num_experts, I, R, generator=gen) * R ** -0.5,
            "up": torch.randn(cfg.num_experts, I, R, generator=gen) * R ** -0.5,
            "down": torch.randn(cfg.num_experts, R, I, generator=gen) * I ** -0.5
            / math.sqrt(2 * cfg.num_hidden_layers),
        }
        for t in experts[layer].values():
            t.requires_grad_(True)
    provider = QATExperts(cfg, experts)
    top, layers = group_residents(cfg, lambda name, spec: residents[name])
    model = KimiK3.from_weights(cfg, top, layers, provider, torch.float32)
    for layer in model.layers:
        if layer.kda:
            layer.attn.chunk = 16  # backward through 16-token chunks is ~2x cheaper than 64
    return model, residents, provider


# ---- data ----


def read_corpus(path: str | None) -> list[str]:
    """The KJV as one text per chapter: verses one per line, reference numbers dropped."""
    if path is not None:
        text = Path(path).read_text(encoding="utf-8")
    else:
        exe = shutil.which("bible")
        if exe is None:
            raise SystemExit("train_tiny: no --corpus and no `bible` program: install Debian's "
                             "bible-kjv (apt-get install bible-kjv) or pass --corpus FILE")
        text = subprocess.run([exe, *BIBLE_ARGS], check=True, capture_output=True,
                              text=True).stdout
    chapters: dict[tuple[str, str], list[str]] = {}
    for line in text.splitlines():
        m = VERSE.match(line)
        if m is None:
            if line.strip():
                raise SystemExit(f"train_tiny: not a verse line of the bible dump: {line[:60]!r}")
            continue
        chapters.setdefault((m[1], m[2]), []).append(m[4].strip())
    if not chapters:
        raise SystemExit("train_tiny: the corpus holds no verse lines")
    return ["\n".join(verses) + "\n\n" for verses in chapters.values()]


def split_chapters(chapters: list[str]) -> tuple[str, str]:
    """(train text, held-out text): every HELDOUT_EVERY-th chapter is held out."""
    held = [c for i, c in enumerate(chapters) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1]
    train = [c for i, c in enumerate(chapters) if i % HELDOUT_EVERY != HELDOUT_EVERY - 1]
    return "".join(train), "".join(held)


# ---- evaluation ----


def perplexity(model: KimiK3, ids: np.ndarray, window: int) -> float:
    """exp(mean next-token NLL) over `ids` cut into windows of `window` tokens, each a fresh
    sequence (its first token is context only). Blocks; no state is kept."""
    nll, n = 0.0, 0
    for s in range(0, len(ids) - 1, window):
        w = torch.as_tensor(ids[s:s + window], dtype=torch.long)
        if len(w) < 2:
            break
        logits = model.logits(w).float()  # [T, V]
        nll += float(F.cross_entropy(logits[:-1], w[1:], reduction="sum"))
        n += len(w) - 1
    return math.exp(nll / n)


def max_over_mean(loads: dict[int, torch.Tensor]) -> float:
    """The busiest expert's picks over the mean, averaged over layers (1.0: perfectly even)."""
    return round(float(np.mean([float(v.max() / v.mean()) for v in loads.values()])), 3)


# ---- export ----


def export(out: Path, cfg: ModelConfig, ranks: dict[bytes, int], residents, provider,
           meta: dict) -> None:
    """Write the checkpoint: BF16 trunk (F32 where K3 stores F32), t158 routed experts in the
    stacked MTPLX layout, the K3-format tokenizer and `training.json`."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    write_tokenizer(out, ranks, pat_str=None)  # K3's own pre-tokenizer
    n = len(ranks)
    write_json(out / "generation_config.json", generation_config(cfg, n))
    ec = ExpertCodec("t158")
    for name, obj in config_files(cfg, ec, special_id("<|media_pad|>", n)).items():
        write_json(out / name, obj)
    specs = resident_tensor_specs(cfg)
    trunk = {}
    for name, t in residents.items():
        a = t.detach().float().numpy()
        trunk[name] = ("BF16", f32_to_bf16_bits(a)) if specs[name].dtype == "BF16" else ("F32", a)
    codec = get_codec("t158")
    experts = {(layer, e): {k: codec.encode(p[k][e].detach().numpy()) for k in p}
               for layer, p in provider.params.items() for e in range(cfg.num_experts)}
    write_shards(out, {**trunk, **expert_tensors(ec, cfg, experts)})
    write_json(out / "training.json", meta)


# ---- training ----


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(steps - warmup, 1)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="checkpoint directory (replaced)")
    p.add_argument("--corpus", help="KJV dump (`bible -f -l 100000 gen1:1-rev22:21`); default: "
                                    "run `bible`")
    p.add_argument("--toy", action="store_true", help="toy model and vocabulary (tests)")
    p.add_argument("--ranks", type=int, default=2048, help="BPE ranks (vocab = ranks + 256)")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--seq", type=int, default=1024, help="tokens per training sequence")
    p.add_argument("--batch", type=int, default=1, help="sequences per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--bias-rate", type=float, default=5e-3,
                   help="router bias update per step (K3's aux-loss-free balancing)")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-tokens", type=int, default=8192,
                   help="held-out tokens of the running perplexity (the final one uses all)")
    p.add_argument("--seed", type=int, default=0)
    # One thread: on a shared 2-core machine torch's second thread mostly spins (~5x slower).
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--excerpt", help="also write the first --excerpt-tokens of the held-out "
                                     "text here (the tests' copy)")
    p.add_argument("--excerpt-tokens", type=int, default=4096)
    args = p.parse_args(argv)
    if args.toy:
        args.ranks = min(args.ranks, 320)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_start = time.time()

    chapters = read_corpus(args.corpus)
    train_text, held_text = split_chapters(chapters)
    corpus_sha = hashlib.sha256("".join(chapters).encode()).hexdigest()
    pieces = regex.findall(K3_PAT_STR_NO_INTERSECTION, train_text)
    ranks = train_ranks(pieces, args.ranks)
    with tempfile.TemporaryDirectory() as tok_dir:  # the tokenizer as the runtime reads it
        write_tokenizer(tok_dir, ranks, pat_str=None)
        tok = load_tokenizer(tok_dir)
    train_ids = np.array(tok.encode(train_text), dtype=np.int64)
    held_ids = np.array(tok.encode(held_text), dtype=np.int64)
    tqdm.write(f"corpus: {len(chapters)} chapters, train {len(train_text):,} chars = "
               f"{len(train_ids):,} tokens, held-out {len(held_text):,} chars = "
               f"{len(held_ids):,} tokens (BPE {len(ranks)} ranks, "
               f"{time.time() - t_start:.0f} s)")
    # The tests' excerpt is text; its figure is taken on that text re-encoded, as a test does.
    excerpt_text = tok.decode(held_ids[: args.excerpt_tokens].tolist())
    excerpt_ids = np.array(tok.encode(excerpt_text), dtype=np.int64)
    if args.excerpt:
        Path(args.excerpt).write_text(excerpt_text, encoding="utf-8")

    cfg = model_config(len(ranks), args.toy)
    model, residents, provider = build_model(cfg, args.seed)
    params = list(residents.values()) + [t for p in provider.params.values() for t in p.values()]
    trainable = [t for t in params if t.requires_grad]
    names = {id(t): n for n, t in residents.items()}
    no_decay = ("norm.weight", "res_proj.weight", "A_log", "dt_bias", "conv1d.weight")
    decay = [t for t in trainable if not names.get(id(t), "").endswith(no_decay)]
    rest = [t for t in trainable if names.get(id(t), "").endswith(no_decay)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": rest, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    n_params = sum(t.numel() for t in params)
    tqdm.write(f"model: {n_params / 1e6:.2f} M parameters, {cfg.num_hidden_layers} layers, "
               f"{len(cfg.moe_layers)} x {cfg.num_experts} experts top-"
               f"{cfg.num_experts_per_token}; {args.steps} steps of {args.batch} x {args.seq} "
               f"tokens on {args.threads} threads")

    rng = np.random.default_rng(args.seed)
    eval_ids = held_ids[: args.eval_tokens]
    history, loss_avg = [], None
    window_loads = {layer: torch.zeros(cfg.num_experts) for layer in cfg.moe_layers}
    bar = tqdm(range(args.steps), desc="train", unit="step", mininterval=2.0)
    t_train = time.time()
    for step in bar:
        lr = lr_at(step, args.steps, args.lr, args.warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for _ in range(args.batch):
            s = int(rng.integers(0, len(train_ids) - args.seq - 1))
            w = torch.as_tensor(train_ids[s:s + args.seq + 1])
            logits = model.run(w[:-1], None)  # [T, V]
            loss = F.cross_entropy(logits, w[1:])
            (loss / args.batch).backward()
            loss_sum += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        with torch.no_grad():  # K3's balancer: under-loaded experts up, over-loaded down
            for moe in model.moe_blocks():
                load = provider.loads[moe.layer]
                moe.bias += args.bias_rate * torch.sign(load.mean() - load)
                window_loads[moe.layer] += load
                load.zero_()
        provider.refresh()
        loss_avg = loss_sum / args.batch if loss_avg is None else \
            0.95 * loss_avg + 0.05 * loss_sum / args.batch
        bar.set_postfix(loss=f"{loss_avg:.3f}", lr=f"{lr:.1e}")
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            ppl = perplexity(model, eval_ids, args.seq)
            imbalance = max_over_mean(window_loads)
            history.append({"step": step + 1, "train_loss": round(loss_avg, 4),
                            "heldout_ppl_t158": round(ppl, 3), "max_load_over_mean": imbalance,
                            "seconds": round(time.time() - t_train, 1)})
            tqdm.write(f"step {step + 1:>5}  loss {loss_avg:.3f}  held-out ppl {ppl:8.2f} "
                       f"(first {len(eval_ids):,} tokens, t158 experts)  expert load max/mean "
                       f"{imbalance:.2f}  {time.time() - t_train:.0f} s")
            for load in window_loads.values():
                load.zero_()
    train_s = time.time() - t_train

    ppl_t158 = perplexity(model, held_ids, args.seq)
    provider.quantize = False
    provider.refresh()
    ppl_float = perplexity(model, held_ids, args.seq)
    meta = {
        "format": TRAINING_FORMAT,
        "corpus": {**CORPUS, "sha256": corpus_sha, "chapters": len(chapters),
                   "heldout": f"chapters i with i % {HELDOUT_EVERY} == {HELDOUT_EVERY - 1}",
                   "train_tokens": len(train_ids), "heldout_tokens": len(held_ids),
                   "heldout_chars": len(held_text)},
        "args": {k: v for k, v in vars(args).items() if k not in ("out", "corpus", "excerpt")},
        "parameters": n_params,
        "train_seconds": round(train_s, 1),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
                   f"on {args.threads} threads",
        "history": history,
        "heldout_ppl": {"float_training": round(ppl_float, 4),
                        "t158_training": round(ppl_t158, 4)},
    }
    out = Path(args.out)
    export(out, cfg, ranks, residents, provider, meta)
    # The shipped checkpoint as the runtime loads it: BF16 trunk, t158 experts decoded.
    shipped = load_model(out, dtype="float32")
    meta["heldout_ppl"]["t158_checkpoint"] = round(perplexity(shipped, held_ids, args.seq), 4)
    meta["excerpt"] = {"tokens": len(excerpt_ids), "window": args.seq,
                       "sha256": hashlib.sha256(excerpt_text.encode()).hexdigest(),
                       "ppl_t158_checkpoint": round(perplexity(shipped, excerpt_ids, args.seq), 4)}
    meta["total_seconds"] = round(time.time() - t_start, 1)
    write_json(out / "training.json", meta)
    ppl = meta["heldout_ppl"]
    print(f"held-out perplexity ({len(held_ids):,} tokens): float experts "
          f"{ppl['float_training']:.2f}, t158 experts {ppl['t158_training']:.2f}, shipped "
          f"checkpoint (bf16 trunk, t158) {ppl['t158_checkpoint']:.2f}; trained "
          f"{train_s / 60:.1f} min, wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
