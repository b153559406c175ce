"""StreamingExpertProvider's GPU decode path (`kernels` with DEVICE "cuda") on a fake CUDA backend
and fake streams (tests/fake_cuda.py), on the CPU: the same logits and tokens as resident
experts, bit for bit; one moe_layer launch per MoE layer and no host wait in a decode step whose
layers hold every expert, exactly one host wait per layer with an expert outside the slots;
`experts` never decodes a slot's (repacked) bytes on the host."""

import pytest
import torch
from fake_cuda import FakeStreams, backend

from mtplx_runtime import load_model
from mtplx_runtime.artifact.build import build_artifact
from mtplx_runtime.fixtures.tiny import make_tiny
from mtplx_runtime.offload.provider import StreamingExpertProvider

PROMPT = [3, 17, 42, 99, 7, 250, 31, 64, 5, 120, 77, 11]
STEPS = 6
T_OUT = 30.0


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """{codec: (source dir, artifact dir, resident logits, resident greedy tokens)}."""
    root = tmp_path_factory.mktemp("gpudecode")
    out = {}
    for codec in ("t158", "bf16"):
        src, art = root / codec, root / f"{codec}-art"
        make_tiny(src, codec)
        build_artifact(src, art, codec="keep", progress=False)
        out[codec] = (src, art, *resident(src))
    return out


def on_fake_gpu(src, art, slots_per_layer=None, **kw):
    """A model of `src` streaming from `art` on the fake GPU: (model, provider, streams).
    slots_per_layer None: room for every expert."""
    model = load_model(src)
    cfg = model.cfg
    streams = FakeStreams()
    probe = StreamingExpertProvider(art, cfg, model.dtype, compute_bytes=1, kernels="reference")
    stride = -(-probe.stride_bytes // 4096) * 4096
    probe.close()
    slots = cfg.num_experts if slots_per_layer is None else slots_per_layer
    provider = StreamingExpertProvider(art, cfg, model.dtype,
                                       compute_bytes=slots * len(cfg.moe_layers) * stride,
                                       kernels=backend(streams), streams=streams, **kw)
    model.use_provider(provider)
    return model, provider, streams


def steps(model, streams, provider, tokens):
    """Decode `tokens` one by one with the GPU "busy" (no event ready unless waited for):
    [(logits, host waits, launches)] per step."""
    state = model.new_state()
    model.prefill(PROMPT, state)
    out = []
    streams.ready = False
    for tok in tokens:
        w0, n0 = streams.host_waits, provider.launches
        logits = model.decode(tok, state)
        out.append((logits, streams.host_waits - w0, provider.launches - n0))
    streams.ready = True
    return out


def resident(src):
    """Prefill PROMPT then STEPS greedy decode steps on resident experts: (logits, tokens)."""
    model = load_model(src)
    state = model.new_state()
    logits = [model.prefill(PROMPT, state)]
    tokens = []
    for _ in range(STEPS):
        tokens.append(int(torch.argmax(logits[-1][-1] if logits[-1].dim() == 2 else logits[-1])))
        logits.append(model.decode(tokens[-1], state))
    return logits, tokens


@pytest.mark.parametrize("codec", ["t158", "bf16"])
@pytest.mark.parametrize("lookahead", [0, 1])
def test_streamed_on_the_gpu_path_equals_resident(built, codec, lookahead):
    src, art, want_logits, tokens = built[codec]
    model, provider, streams = on_fake_gpu(src, art, slots_per_layer=3, lookahead=lookahead)
    with provider:
        state = model.new_state()
        assert torch.equal(model.prefill(PROMPT, state), want_logits[0])
        for tok, want in zip(tokens, want_logits[1:], strict=True):
            assert torch.equal(model.decode(tok, state), want)
        st = provider.stats()
    assert st["device"]["launches"] == provider.launches > 0
    assert st["totals"]["compute"]["lookups"] > 0 and st["totals"]["compute"]["misses"] > 0


def test_all_cached_decode_launches_once_per_layer_and_never_waits(built):
    src, art, want_logits, tokens = built["t158"]
    model, provider, streams = on_fake_gpu(src, art)
    n_moe = len(model.cfg.moe_layers)
    with provider:
        keys = [(la, e) for la in model.cfg.moe_layers for e in range(model.cfg.num_experts)]
        provider.prefetcher.wait(provider.prefetcher.demand(keys), timeout=T_OUT)
        assert all(provider.table.fully_resident(la) for la in model.cfg.moe_layers)
        got = steps(model, streams, provider, tokens)
        for (logits, waits, launches), want in zip(got, want_logits[1:], strict=True):
            assert waits == 0 and launches == n_moe
            assert torch.equal(logits, want)
        before = provider.cache.totals()["compute"]["hits"]
        st = provider.stats()  # accounts the routes computed without a wait
    # every route accounted as its lookup would have been: the prompt's experts, then each pick
    decode = n_moe * STEPS * model.cfg.num_experts_per_token
    assert st["totals"]["compute"]["hits"] - before == st["prefill_dedup"]["unique"] + decode
    assert st["totals"]["compute"]["misses"] == 0


def test_a_layer_with_a_missing_expert_waits_exactly_once(built):
    src, art, want_logits, tokens = built["bf16"]
    model, provider, streams = on_fake_gpu(src, art, slots_per_layer=3, lookahead=1)
    n_moe = len(model.cfg.moe_layers)
    with provider:
        got = steps(model, streams, provider, tokens)
        for (logits, waits, _), want in zip(got, want_logits[1:], strict=True):
            assert waits == n_moe  # no layer holds all its experts in 3 slots
            assert torch.equal(logits, want)


def test_experts_never_decodes_repacked_slot_bytes(built):
    """The fake backend's repack inverts each record in its slot: `experts` must read the bank
    (the weights a host-slot provider decodes) and leave the cache alone."""
    src, art, _, _ = built["t158"]
    model, provider, streams = on_fake_gpu(src, art)
    layer = model.cfg.moe_layers[0]
    with provider:
        provider.prefetcher.wait(provider.prefetcher.demand([(layer, 0), (layer, 1)]),
                                 timeout=T_OUT)
        streams.run_copies(10**9)  # the repacks ran
        lookups = provider.cache.totals()["compute"]["lookups"]
        got = provider.experts(layer, [1, 0])
        assert provider.cache.totals()["compute"]["lookups"] == lookups
    with StreamingExpertProvider(art, model.cfg, model.dtype, compute_bytes=1 << 24,
                                 kernels="reference") as host:
        ref = host.experts(layer, [0, 1])
    for e in (0, 1):
        for name in ("gate", "up", "down"):
            assert torch.equal(getattr(got[e], name), getattr(ref[e], name))


def test_bench_decode_without_a_gpu_says_why_in_one_line(monkeypatch, capsys):
    import importlib.util
    from pathlib import Path

    import mtplx_runtime.kernels as kernels

    path = Path(__file__).resolve().parents[1] / "tools" / "bench_decode.py"
    spec = importlib.util.spec_from_file_location("bench_decode", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(kernels, "_cuda", lambda: (None, "no CUDA device here"))
    assert mod.main(["--kernels", "cuda"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == ("bench_decode.py: error: kernel backend 'cuda' requested but "
                                 "unavailable: no CUDA device here\n")
