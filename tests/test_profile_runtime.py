"""Exact replay: a route trace recorded by a streamed run (lookahead off), replayed through a
real ExpertCache with the provider's call sequence, reproduces the runtime's DEVICE-tier
counters per layer, prefill (transient slots) included. Lookahead reads are not modelled."""

import pytest

from mtplx_runtime import load_model
from mtplx_runtime.artifact.build import build_artifact
from mtplx_runtime.engine.generate import generate_step
from mtplx_runtime.engine.trace import RouteTrace
from mtplx_runtime.fixtures.tiny import make_tiny
from mtplx_runtime.offload.provider import StreamingExpertProvider
from mtplx_runtime.profile import load, replay_runtime

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
