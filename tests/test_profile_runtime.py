"""Exact replay: a route trace recorded by a streamed run (lookahead off), replayed through a
real ExpertCache with the provider's call sequence, reproduces the runtime's DEVICE-tier
counters per layer, prefill (transient slots) included. Lookahead reads are not modelled.
bench_decode's replayed routes: the replay it prints equals the run's hit rate at lookahead 0;
its guesses reach the prefetcher at lookahead 1."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from mtplx_runtime import load_model
from mtplx_runtime.artifact.build import build_artifact
from mtplx_runtime.engine.generate import generate_step
from mtplx_runtime.engine.trace import RouteTrace
from mtplx_runtime.fixtures.tiny import make_tiny
from mtplx_runtime.kernels import select_backend
from mtplx_runtime.offload.provider import StreamingExpertProvider
from mtplx_runtime.profile import load, replay_runtime, synthetic

PROMPT = [3, 17, 42, 99, 7, 250, 31, 64, 5, 120, 77, 11]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    root = tmp_path_factory.mktemp("profrt")
    make_tiny(root / "src", "t158")
    build_artifact(root / "src", root / "art", codec="keep", progress=False)
    return root


@pytest.mark.parametrize("policy,slots,host", [("lru", 3, 0), ("freq", 3, 0), ("lru", 2, 2)])
def test_replay_reproduces_runtime_counters(artifact, tmp_path, policy, slots, host):
    model = load_model(artifact / "src")
    n_moe = len(model.cfg.moe_layers)
    probe = StreamingExpertProvider(artifact / "art", model.cfg, model.dtype, compute_bytes=1,
                                    lookahead=0)
    stride = probe.cache.tier("compute").slot_bytes
    probe.close()
    provider = StreamingExpertProvider(artifact / "art", model.cfg, model.dtype,
                                       compute_bytes=slots * n_moe * stride,
                                       host_bytes=host * n_moe * stride, policy=policy,
                                       lookahead=0)
    model.use_provider(provider)
    path = tmp_path / "t.jsonl"
    with RouteTrace(path, model) as tr:
        list(generate_step(model, PROMPT, max_tokens=16, prefill_chunk=5, trace=tr))
    want = provider.stats()["cache"]
    cap = provider.cache.capacity()
    provider.close()
    cache = replay_runtime(load(str(path)), policy=policy, compute_slots=cap["compute"],
                           host_slots=cap["host"], transient_slots=cap["transient"],
                           prefill_chunk=5)
    got = cache.stats()
    for layer, tiers in want.items():
        for tier in ("compute", "host", "transient"):
            for k in ("lookups", "hits", "misses", "evictions", "promotions", "demotions"):
                assert got[layer][tier][k] == tiers[tier][k], (layer, tier, k)


def bench_decode():
    path = Path(__file__).resolve().parents[1] / "tools" / "bench_decode.py"
    spec = importlib.util.spec_from_file_location("bench_decode", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("lookahead,policy", [(0, "lru"), (1, "lru"), (1, "freq")])
def test_bench_decode_replayed_routes(artifact, lookahead, policy):
    """A synth:k3 trace at the tiny model's geometry through bench_decode's run: the exact LRU
    replay it prints equals the run's hit rate at lookahead 0; at lookahead 1 guesses of recall
    1 are the true next-layer routes, so the run scores them at recall 1 and none is wasted
    (each is used on landing or promoted while reading, whatever the timing), under the LRU
    cache and under `--cache-policy freq`."""
    bench = bench_decode()
    art = artifact / "art"
    cfg = load_model(artifact / "src").cfg
    n_moe, experts, top_k = len(cfg.moe_layers), cfg.num_experts, cfg.num_experts_per_token
    tokens, slots = 12, 3
    trace = synthetic("k3", tokens=tokens, layers=n_moe, experts=experts, top_k=top_k, seed=1)
    routes = trace.routes.astype(np.int64)  # [N, L, K]: the tiny model's own top-k, no bundles
    guesses, how = bench.trace_guesses(trace, n_moe, experts, tokens, 1.0, top_k=top_k)
    assert how == "synth:1"
    assert all(g == routes[i, j].tolist() for (i, j), g in guesses.items())
    r = bench.run_config(art, bench.part_paths(art), lookahead, slots, tokens,
                         select_backend("reference"), False, routes, guesses,
                         cache_policy=policy)
    np.testing.assert_array_equal(r["routes"], routes)
    assert r["prefill_routes"].shape == (2, n_moe, top_k)
    lru, belady = bench.replay_hit_rates(r["prefill_routes"], r["routes"], experts, slots)
    assert 0.0 < belady <= 1.0
    if lookahead == 0:  # (the replay is LRU's)
        assert r["hit_rate"] == lru
        assert (r["spec_reads"], r["guess_recall"], r["prefetch_recall"]) == (0, 0.0, 0.0)
    else:
        assert r["guess_recall"] == 1.0 and r["spec_reads"] > 0 and r["wasted_reads"] == 0
        assert r["prefetch_recall"] > 0.0 and r["late_reads"] <= r["spec_reads"]
