"""The trained small K3 shipped in the package (tools/train_tiny.py; README "The trained tiny
K3"): its weights stream bit-identically to resident, its held-out perplexity stays at the
recorded figure (a regression check of the loader and kernels), its tokenizer is K3's and chat
runs on it; the training provider is t158 forward / straight-through backward, and the training
script itself runs two steps of a toy model."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mtplx_runtime import load, load_model
from mtplx_runtime.artifact.build import build_artifact
from mtplx_runtime.checkpoint import open_checkpoint
from mtplx_runtime.cli import main as cli
from mtplx_runtime.cli.demo import PROMPT, TRAINED
from mtplx_runtime.engine.generate import generate
from mtplx_runtime.engine.tokenizer import load_tokenizer
from mtplx_runtime.formats.t158 import ternarize_t158_torch
from mtplx_runtime.kernels.reference import ExpertWeights, routed_sum

ROOT = Path(__file__).resolve().parents[1]
EXCERPT = ROOT / "tests" / "data" / "kjv-heldout.txt"
ROUTES = ROOT / "tests" / "data" / "kjv-routes.jsonl"  # tools/record_routes.py on the excerpt
# README "The trained tiny K3": the shipped model's perplexity on the excerpt is within 1 % of
# training.json's figure. Float reordering across machines moves it by ~1e-5; a wrong scale,
# dropped norm or misread tensor moves it by far more.
PPL_BOUND = 0.01


def tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def train_tiny():
    return tool("train_tiny")


@pytest.fixture(scope="module")
def meta() -> dict:
    return json.loads((TRAINED / "training.json").read_text())


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    """The streaming artifact built from the shipped checkpoint, as `make demo` builds it."""
    out = tmp_path_factory.mktemp("trained") / "stream"
    build_artifact(TRAINED, out, progress=False)
    return out


def test_shipped_checkpoint_is_k3_shaped_small_and_ternary():
    files = [f for f in TRAINED.iterdir() if f.is_file()]
    assert sum(f.stat().st_size for f in files) < 25 * 2**20
    ckpt = open_checkpoint(TRAINED)
    cfg = ckpt.config
    assert ckpt.codec.name == "t158"
    assert [cfg.is_kda_layer(i) for i in range(cfg.num_hidden_layers)] == \
        [i % 4 != 3 and i != cfg.num_hidden_layers - 1 for i in range(cfg.num_hidden_layers)]
    assert cfg.moe_layers == list(range(1, cfg.num_hidden_layers))
    # A routed expert holds at most {-s, 0, +s} per group of 64 inputs: ternary, not float.
    w = ckpt.expert(cfg.moe_layers[-1], cfg.num_experts - 1).decode()["down"]
    groups = w.reshape(w.shape[0], -1, 64)
    assert max(len(np.unique(np.abs(g))) for g in groups.reshape(-1, 64)) <= 2
    assert (groups == 0).any() and (groups != 0).any()


def test_heldout_perplexity_matches_the_recorded_figure(meta):
    text = EXCERPT.read_text(encoding="utf-8")
    assert hashlib.sha256(text.encode()).hexdigest() == meta["excerpt"]["sha256"]
    tok = load_tokenizer(TRAINED)
    ids = np.array(tok.encode(text))
    assert len(ids) == meta["excerpt"]["tokens"]
    ppl = train_tiny().perplexity(load_model(TRAINED, dtype="float32"), ids,
                                  meta["excerpt"]["window"])
    recorded = meta["excerpt"]["ppl_t158_checkpoint"]
    assert abs(ppl / recorded - 1) < PPL_BOUND, (ppl, recorded)


@pytest.mark.parametrize("kernels", ["reference", "cpu"])
def test_streams_like_the_resident_model(artifact, kernels):
    tok = load_tokenizer(artifact)
    prompt = tok.encode(PROMPT)
    resident = load_model(TRAINED, dtype="float32")
    want_logits = resident.logits(prompt)
    want, _ = generate(resident, prompt, max_tokens=12)
    # 8 + 4 slots per layer of 64 experts: misses and evictions on every token.
    with load(artifact, dtype="float32", kernels=kernels, lookahead=2, cache_slots=(8, 4)) as rt:
        logits = rt.model.logits(prompt)
        got, _ = generate(rt.model, prompt, max_tokens=12)
        totals = rt.provider.stats()["totals"]
    assert totals["compute"]["misses"] > 0 and totals["host"]["misses"] > 0
    assert got == want
    if kernels == "reference":  # the definition: bit for bit
        assert torch.equal(logits, want_logits)
    else:  # native kernels sum in another order (README "Expert kernels")
        assert (logits - want_logits).abs().max() <= 1e-4 * want_logits.abs().max()


def test_tokenizer_is_k3s_format_and_chat_runs(meta, monkeypatch, capsys):
    cfg_json = json.loads((TRAINED / "tokenizer_config.json").read_text())
    assert "pat_str" not in cfg_json  # K3's own pre-tokenizer
    tok = load_tokenizer(TRAINED)
    text = EXCERPT.read_text(encoding="utf-8")
    assert tok.decode(tok.encode(text)) == text
    cfg = open_checkpoint(TRAINED).config
    assert tok.special("<|end_of_msg|>") == cfg.eos_token_id == tok.vocab_size - 256 + 2
    monkeypatch.setattr("sys.stdin", io.StringIO("Who made the heaven?\n/stats\n"))
    assert cli(["chat", "--model", str(TRAINED), "--max-tokens", "6", "--dtype", "float32",
                "--no-thinking"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() and "mtplx chat: last turn: prompt" in err and "generated 6 tok" in err


def test_training_experts_are_t158_forward_and_straight_through_backward():
    tt = train_tiny()
    cfg = tt.model_config(300, toy=True)
    E, I, R = cfg.num_experts, cfg.moe_intermediate_size, cfg.routed_expert_hidden_size
    gen = torch.Generator().manual_seed(0)
    params = {1: {"gate": torch.randn(E, I, R, generator=gen), "up": torch.randn(E, I, R,
                  generator=gen), "down": torch.randn(E, R, I, generator=gen)}}
    for t in params[1].values():
        t.requires_grad_(True)
    T, K = 16, cfg.num_experts_per_token
    r = torch.randn(T, R, generator=gen)
    ids = torch.sort(torch.rand(T, E, generator=gen).topk(K).indices, -1).values
    w = torch.rand(T, K, generator=gen)
    provider = tt.QATExperts(cfg, params)
    out = provider.run_experts(1, r, ids, w)
    out.square().sum().backward()
    ternary = {k: ternarize_t158_torch(v).requires_grad_(True) for k, v in params[1].items()}
    experts = {e: ExpertWeights(ternary["gate"][e], ternary["up"][e], ternary["down"][e])
               for e in torch.unique(ids).tolist()}
    ref = routed_sum(r, ids, w, experts)
    ref.square().sum().backward()
    assert torch.equal(out, ref)  # the forward sees exactly the stored t158 values
    for k in params[1]:  # d/dw = d/d(ternary w): straight through
        assert torch.equal(params[1][k].grad, ternary[k].grad), k
    assert torch.equal(provider.loads[1], torch.bincount(ids.flatten(), minlength=E).float())
    provider.quantize = False
    provider.refresh()
    floats = {e: ExpertWeights(*(params[1][k][e] for k in ("gate", "up", "down")))
              for e in torch.unique(ids).tolist()}
    assert torch.equal(provider.run_experts(1, r, ids, w), routed_sum(r, ids, w, floats))


def test_training_script_runs_two_steps_of_a_toy_model(tmp_path):
    # A corpus in the bible dump's format, one verse per chapter so the 1-in-20 split holds out
    # enough chapters.
    lines = [v for v in EXCERPT.read_text(encoding="utf-8").splitlines() if v.strip()]
    (tmp_path / "kjv.txt").write_text("".join(f"Tst{i + 1}:1 {v}\n" for i, v in
                                              enumerate(lines)))
    out, rate = tmp_path / "ckpt", 0.01
    p = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "train_tiny.py"), "--toy", "--corpus",
         str(tmp_path / "kjv.txt"), "--out", str(out), "--ranks", "300", "--steps", "2",
         "--seq", "64", "--eval-every", "1", "--eval-tokens", "128", "--excerpt-tokens", "128",
         "--bias-rate", str(rate), "--excerpt", str(tmp_path / "excerpt.txt")],
        capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    log = p.stdout + p.stderr
    assert "step     1  loss" in log and "step     2  loss" in log and "held-out ppl" in log
    meta = json.loads((out / "training.json").read_text())
    assert [h["step"] for h in meta["history"]] == [1, 2]
    assert all(math.isfinite(h["train_loss"]) for h in meta["history"])
    # The balancer moved every router bias by +-rate per step: k * rate with |k| <= 2, not all 0.
    ckpt = open_checkpoint(out)
    biases = np.concatenate([ckpt.tensor(f"language_model.model.layers.{layer}.block_sparse_moe."
                                         "gate.e_score_correction_bias")
                             for layer in ckpt.config.moe_layers])
    steps = biases / rate
    assert np.allclose(steps, np.round(steps), atol=1e-4) and np.abs(steps).max() <= 2 + 1e-4
    assert (np.abs(steps) > 0.5).any()
    # The exported checkpoint is what was measured: its excerpt figure recomputed from the files.
    tok = load_tokenizer(out)
    ids = np.array(tok.encode((tmp_path / "excerpt.txt").read_text(encoding="utf-8")))
    got = train_tiny().perplexity(load_model(out, dtype="float32"), ids, 64)
    assert got == pytest.approx(meta["excerpt"]["ppl_t158_checkpoint"], rel=1e-4)
    # bf16 rounding of the trunk is all that separates it from the trained model's figure.
    ppl = meta["heldout_ppl"]
    assert ppl["t158_checkpoint"] == pytest.approx(ppl["t158_training"], rel=0.05)


def test_shipped_trace_is_the_trained_models_and_routes_skewed():
    from mtplx_runtime.profile import load as load_trace
    from mtplx_runtime.profile import profile, synthetic

    trace = load_trace(str(ROUTES))
    cfg = open_checkpoint(TRAINED).config
    assert (trace.layers, trace.experts, trace.top_k) == (cfg.moe_layers, cfg.num_experts,
                                                          cfg.num_experts_per_token)
    assert {depth for _, depth in trace.predicted} == {1, 2, 3}
    # Its first routes are the model's own on the excerpt's first tokens.
    tok = load_tokenizer(TRAINED)
    ids = tok.encode(EXCERPT.read_text(encoding="utf-8"))[:4]
    model = load_model(TRAINED, dtype="float32")
    state = model.new_state()
    for pos, t in enumerate(ids):
        model.decode(t, state)
        got = [moe.last_ids[0].tolist() for moe in model.moe_blocks()]
        assert got == trace.routes[pos].tolist(), pos
    # Trained routes are more cacheable than uniform random ones of the same shape, and a later
    # layer's router on this layer's hidden state guesses far more of its experts than chance.
    n = int(trace.decode.sum())
    uniform = synthetic("uniform", tokens=n, layers=len(trace.layers), experts=trace.experts,
                        top_k=trace.top_k, seed=0)
    cap = cfg.num_experts // 4 * len(trace.layers)  # a quarter of each layer's experts
    trained = profile(trace, ["lru"], [cap], workers=1)[0][0]  # [lru, belady] rows
    random_ = profile(uniform, ["lru"], [cap], workers=1)[0][0]
    assert trained.policy == random_.policy == "lru"
    assert trained.hit_rate > random_.hit_rate, (trained.hit_rate, random_.hit_rate)
    j = {layer: i for i, layer in enumerate(trace.layers)}
    hit = total = 0
    for (layer, depth), (lines, guesses) in trace.predicted.items():
        if depth == 1:
            for line, guess in zip(lines.tolist(), guesses):
                hit += len(set(guess) & set(trace.routes[line, j[layer]].tolist()))
                total += trace.top_k
    assert hit / total > 3 * trace.top_k / trace.experts, hit / total


def test_bench_decode_replays_the_trace_as_expert_bundles():
    from mtplx_runtime.engine.trace import read_trace
    from mtplx_runtime.profile import load as load_trace

    bench = tool("bench_decode")
    header, lines = read_trace(ROUTES)
    lines = list(lines)  # all decode lines
    decode = [line["routes"] for line in lines if line["phase"] == "decode"]
    layers, experts = len(header["layers"]) + 1, 896  # one more than the trace: wraps around
    trace = load_trace(str(ROUTES))
    routes = bench.slice_routes(trace, layers, experts)
    assert routes.shape == (len(decode), layers, 16)
    stride, bundle = experts // header["experts"], 16 // header["top_k"]
    for step, want in zip(routes[:50], decode):
        for j, row in enumerate(step.tolist()):
            assert row == sorted(set(row))
            assert all(i % stride < bundle for i in row)
            layer = str(header["layers"][j % len(header["layers"])])
            assert sorted({i // stride for i in row}) == want[layer]
    # The trace's own depth-1 guesses, bundled the same way; none for the wrapped first layer.
    guesses, how = bench.trace_guesses(trace, layers, experts, 50, None)
    assert how == "trace" and {j for _, j in guesses} == set(range(1, layers - 1))
    for (i, j), ids in guesses.items():
        want = lines[i]["predicted"][str(header["layers"][j])]["1"]
        assert ids == sorted(e * stride + b for e in want for b in range(bundle))
