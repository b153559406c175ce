"""Whole-model CPU benchmark: a 2-layer Kimi K3 at real widths with random resident weights.

Layer 0 is KDA + the dense SiTU MLP (33792), layer 1 is MLA + LatentMoE (latent 3584, expert
width 3072, shared 6144) with `--experts` routed experts held in memory; embeddings and lm_head
are full size (163840 x 7168). Weights are random, generated in torch straight in the model
dtype from `resident_tensor_specs` (2-D: N(0, 1/sqrt(fan_in)); norm weights 1; F32 tensors as
the specs say), so nothing is read from disk.

Per configuration it measures prefill of `--prefill` tokens twice (`prefill_first_s` includes
one-time costs, `prefill_s` is the second run), then `--decode-steps` single-token decode steps
after one warm-up step (median), and splits each decode step into the KDA attention, dense MLP,
MLA attention, MoE block (shared MLP separately), lm_head and the rest (embedding,
AttnRes mixes, norms). `decode_gbps` is the resident bytes one decode token touches (everything
but the embedding table and unselected experts) divided by the median decode time.

`--resident-dtype bf16,int8,int4` runs the same model with its large resident matrices quantized
(`model.quant`, the rule of FORMAT.md "Quantized residents"; experts stay bf16): each dtype's
line comes right after the others' for the same threads and top-k, so they compare side by side.

Usage: python tools/bench_model.py [--dtype bfloat16] [--experts 16] [--topk 16,4]
                                   [--prefill 16] [--decode-steps 5] [--threads 2]
                                   [--resident-dtype bf16,int8,int4]
`--topk` and `--threads` take comma lists; each combination prints one line and shares the
weights. Memory is about 9 GB at 16 experts in bfloat16 (float32 doubles it).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import platform
import resource
import statistics
import sys
import time
from collections import defaultdict

import torch

from mtplx_runtime.checkpoint import ModelConfig
from mtplx_runtime.checkpoint.residents import resident_tensor_specs
from mtplx_runtime.formats.resident_layouts import RESIDENT_DTYPES, quantizable
from mtplx_runtime.model.kimi_k3 import KimiK3
from mtplx_runtime.model.load import group_residents, model_dtype
from mtplx_runtime.model.moe import ExpertWeights, ResidentExpertProvider
from mtplx_runtime.model.quant import linear, quantize

# FORMAT.md "Geometry", cut to two layers: 1-based layer 1 is KDA (dense MLP), layer 2 MLA (MoE).
K3_TWO_LAYERS = dict(
    vocab_size=163840, hidden_size=7168, num_hidden_layers=2, intermediate_size=33792,
    first_k_dense_replace=1, num_experts=16, num_experts_per_token=16,
    moe_intermediate_size=3072, routed_expert_hidden_size=3584, num_shared_experts=2,
    latent_moe_use_norm=True, routed_scaling_factor=1.0, moe_renormalize=True,
    num_attention_heads=96, num_key_value_heads=96, q_lora_rank=1536, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, mla_use_output_gate=True,
    kda_num_heads=96, kda_head_dim=128, kda_short_conv_kernel_size=4, kda_gate_lower_bound=-5.0,
    kda_use_full_rank_gate=True, kda_layers=(1,), full_attn_layers=(2,), attn_res_block_size=12,
    activation_situ_beta=4.0, activation_situ_linear_beta=25.0, rms_norm_eps=1e-5,
    bos_token_id=163584, eos_token_id=163586, pad_token_id=163839, tie_word_embeddings=False,
)


def random_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator
                  ) -> torch.Tensor:
    """One resident tensor: norms 1, A_log log(1..16), biases 0, the rest N(0, 1/sqrt(fan_in))."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype)
    if name.endswith("A_log"):
        return torch.linspace(0.0, math.log(16.0), shape[0]).to(dtype)
    if name.endswith(("dt_bias", "e_score_correction_bias")):
        return torch.zeros(shape, dtype=dtype)
    return torch.empty(shape, dtype=dtype).normal_(0.0, shape[-1] ** -0.5, generator=gen)


def random_residents(cfg: ModelConfig, dtype: torch.dtype, gen: torch.Generator):
    """(top, layers) in the layout of `model/load.py`: BF16 specs -> `dtype`, F32 stays F32."""
    return group_residents(cfg, lambda name, spec: random_tensor(
        name, spec.shape, dtype if spec.dtype == "BF16" else torch.float32, gen))


class DictExpertProvider(ResidentExpertProvider):
    """Every routed expert resident in a dict keyed by (layer, expert)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, gen: torch.Generator):
        self.weights: dict[tuple[int, int], ExpertWeights] = {}
        for layer in cfg.moe_layers:
            for e in range(cfg.num_experts):
                mats = {p: random_tensor(p, shape, dtype, gen)
                        for p, shape in cfg.expert_shapes.items()}
                self.weights[(layer, e)] = ExpertWeights(mats["gate"], mats["up"], mats["down"])
        super().__init__(lambda layer, e: self.weights[(layer, e)], dtype, cfg=cfg)


class Timers:
    """Wall time per label, wrapping instance methods; `laps` holds the current step's times."""

    def __init__(self):
        self.laps: dict[str, float] = defaultdict(float)

    def wrap(self, obj, label: str) -> None:
        fn = obj.forward

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.laps[label] += time.perf_counter() - t0
            return out

        obj.forward = timed  # DecoderLayer calls `.forward`, so the instance attribute wins


def nbytes(t) -> int:
    """Bytes of a tensor or a quantized resident (model.quant)."""
    return t.nbytes


def quantized(cfg: ModelConfig, top, layers, resident_dtype: str):
    """(top, layers) with the quantizable matrices in `resident_dtype`; the rest shared."""
    if resident_dtype == "bf16":
        return top, layers
    specs = resident_tensor_specs(cfg)
    names = {"lm_head.weight": "language_model.lm_head.weight"}

    def q(name: str, t):
        spec = specs[name]
        return quantize(t, resident_dtype) if quantizable(name, spec.shape, spec.dtype) else t

    prefix = "language_model.model."
    new_top = {k: q(names.get(k, prefix + k), t) for k, t in top.items()}
    new_layers = [{k: q(f"{prefix}layers.{i}.{k}", t) for k, t in w.items()}
                  for i, w in enumerate(layers)]
    return new_top, new_layers


def decode_bytes(cfg: ModelConfig, top, layers, provider: DictExpertProvider, topk: int) -> int:
    """Resident bytes one decode token reads: all but the embedding table and unused experts."""
    total = sum(nbytes(t) for k, t in top.items() if k != "embed_tokens.weight")
    total += sum(nbytes(t) for w in layers for t in w.values())
    per_expert = sum(nbytes(t) for t in dataclasses.astuple(provider.weights[(1, 0)]))
    return total + min(topk, cfg.num_experts) * per_expert * len(cfg.moe_layers)


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux: KiB


def run_one(cfg, top, layers, provider, dtype, args, threads: int) -> dict[str, float]:
    torch.set_num_threads(threads)
    model = KimiK3.from_weights(cfg, top, layers, provider, dtype)
    kda, mla = model.layers[0], model.layers[1]
    timers = Timers()
    timers.wrap(kda.attn, "kda_attn")
    timers.wrap(kda.mlp, "dense_mlp")
    timers.wrap(mla.attn, "mla_attn")
    timers.wrap(mla.mlp, "moe")
    timers.wrap(mla.mlp.shared, "moe_shared")
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (args.prefill + args.decode_steps + 1,), generator=gen)
    prefill = []
    for _ in range(2):  # the first prefill also pays one-time costs (allocator, oneDNN setup)
        state = model.new_state()
        t0 = time.perf_counter()
        model.prefill(ids[: args.prefill], state)
        prefill.append(time.perf_counter() - t0)
    steps = []
    for i in range(args.decode_steps + 1):  # step 0 warms up the one-token paths
        timers.laps.clear()
        t0 = time.perf_counter()
        model.decode(int(ids[args.prefill + i]), state)
        total = time.perf_counter() - t0
        if i:
            steps.append({"total": total, **timers.laps})
    # lm_head is inline in KimiK3.forward; time the same GEMV on its own.
    h = torch.randn(1, cfg.hidden_size, generator=gen).to(dtype)
    head = []
    with torch.inference_mode():
        for _ in range(args.decode_steps):
            t0 = time.perf_counter()
            linear(h, top["lm_head.weight"])
            head.append(time.perf_counter() - t0)
    med = {k: statistics.median(s[k] for s in steps) * 1e3 for k in steps[0]}
    med["lm_head"] = statistics.median(head) * 1e3
    med["other"] = med["total"] - sum(med[k] for k in
                                       ("kda_attn", "dense_mlp", "mla_attn", "moe", "lm_head"))
    med["prefill_first_s"], med["prefill_s"] = prefill
    return med


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--experts", type=int, default=16, help="routed experts in the MoE layer")
    p.add_argument("--topk", default="16", help="comma list of top-k values (<= --experts)")
    p.add_argument("--prefill", type=int, default=16, help="prompt tokens")
    p.add_argument("--decode-steps", type=int, default=5, help="timed decode steps (median)")
    p.add_argument("--threads", default=str(torch.get_num_threads()), help="comma list")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resident-dtype", default="bf16",
                   help=f"comma list of {'/'.join(RESIDENT_DTYPES)} (bfloat16 model only)")
    args = p.parse_args(argv)
    resident_dtypes = args.resident_dtype.split(",")
    if any(d not in RESIDENT_DTYPES for d in resident_dtypes):
        p.error(f"--resident-dtype takes {', '.join(RESIDENT_DTYPES)}, not {args.resident_dtype}")
    if resident_dtypes != ["bf16"] and args.dtype != "bfloat16":
        p.error("quantized residents need --dtype bfloat16")
    topks = [int(k) for k in args.topk.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    if args.decode_steps < 1 or args.prefill < 1:
        p.error("--prefill and --decode-steps must be at least 1")
    if max(topks) > args.experts:
        p.error(f"--topk {max(topks)} exceeds --experts {args.experts}")

    dtype = model_dtype(args.dtype)
    base = ModelConfig(**{**K3_TWO_LAYERS, "num_experts": args.experts,
                          "num_experts_per_token": max(topks)})
    torch.set_num_threads(max(threads))
    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    top, layers = random_residents(base, dtype, gen)
    provider = DictExpertProvider(base, dtype, gen)
    variants = {d: quantized(base, top, layers, d) for d in resident_dtypes}
    build_s = time.perf_counter() - t0
    weights_gb = (sum(nbytes(t) for t in top.values())
                  + sum(nbytes(t) for w in layers for t in w.values())
                  + sum(nbytes(t) for ew in provider.weights.values()
                        for t in dataclasses.astuple(ew))) / 1e9
    print(f"# bench_model torch={torch.__version__} python={platform.python_version()} "
          f"cpu_threads_available={torch.get_num_threads()} machine={platform.machine()} "
          f"weights_gb={weights_gb:.2f} build_s={build_s:.1f}", flush=True)
    for n_threads, topk, rd in ((n, k, d) for n in threads for k in topks
                                for d in resident_dtypes):
        cfg = dataclasses.replace(base, num_experts_per_token=topk)
        v_top, v_layers = variants[rd]
        m = run_one(cfg, v_top, v_layers, provider, dtype, args, n_threads)
        touched = decode_bytes(cfg, v_top, v_layers, provider, topk)
        gbps = touched / (m["total"] / 1e3) / 1e9
        print(f"dtype={args.dtype} resident_dtype={rd} threads={n_threads} layers=2 "
              f"experts={args.experts} "
              f"topk={topk} prefill_tokens={args.prefill} "
              f"prefill_first_s={m['prefill_first_s']:.2f} "
              f"prefill_s={m['prefill_s']:.2f} "
              f"decode_ms_per_token={m['total']:.0f} kda_attn_ms={m['kda_attn']:.0f} "
              f"dense_mlp_ms={m['dense_mlp']:.0f} mla_attn_ms={m['mla_attn']:.0f} "
              f"moe_ms={m['moe']:.0f} moe_shared_ms={m['moe_shared']:.0f} "
              f"lm_head_ms={m['lm_head']:.0f} other_ms={m['other']:.0f} "
              f"decode_gbps={gbps:.1f} decode_gb={touched / 1e9:.2f} "
              f"peak_rss_gb={peak_rss_gb():.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
