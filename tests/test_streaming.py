"""StreamingExpertProvider: streamed experts through a cache of a few slots give bit-identical
logits and greedy tokens to resident experts, for every tiny codec, with lookahead on, off and
deliberately wrong; counters add up; close leaves no threads; a broken bank part fails loudly."""

import random
import threading
import time
from concurrent.futures import Future

import pytest
import torch

from mtplx_runtime import load_model
from mtplx_runtime.artifact.build import build_artifact
from mtplx_runtime.fixtures.tiny import make_tiny
from mtplx_runtime.offload.prefetch import PrefetchError
from mtplx_runtime.offload.provider import (
    GUESS_MIN_PAIRS,
    GUESS_MIN_PRECISION,
    StreamingExpertProvider,
)

LAYOUTS = ("mxfp4", "w3", "t158", "bf16")
PROMPT = [3, 17, 42, 99, 7, 250, 31, 64, 5, 120, 77, 11]
STEPS = 12
SLOTS_PER_LAYER = 3


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """{codec: (source dir, artifact dir, resident logits, resident greedy tokens)}."""
    root = tmp_path_factory.mktemp("stream")
    out = {}
    for codec in LAYOUTS:
        src, art = root / codec, root / f"{codec}-art"
        make_tiny(src, codec)
        build_artifact(src, art, codec="keep", progress=False)
        model = load_model(src)
        out[codec] = (src, art, *run(model))
    return out


def run(model):
    """Prefill PROMPT then STEPS greedy decode steps: (list of logits tensors, tokens)."""
    state = model.new_state()
    logits = [model.prefill(PROMPT, state)]
    tokens = []
    for _ in range(STEPS):
        tok = int(torch.argmax(logits[-1][-1] if logits[-1].dim() == 2 else logits[-1]))
        tokens.append(tok)
        logits.append(model.decode(tok, state))
    return logits, tokens


def streamed(src, art, **kw):
    """A model of `src` with a StreamingExpertProvider over `art` attached; kernels default to
    the reference backend, whose sums are bit-identical to the resident model's."""
    kw.setdefault("kernels", "reference")
    model = load_model(src)
    n_moe = len(model.cfg.moe_layers)
    probe = StreamingExpertProvider(art, model.cfg, model.dtype, compute_bytes=1, lookahead=0,
                                    kernels="reference")
    stride = probe.stride_bytes
    probe.close()
    kw.setdefault("lookahead", 0)
    provider = StreamingExpertProvider(art, model.cfg, model.dtype,
                                       compute_bytes=SLOTS_PER_LAYER * n_moe * stride, **kw)
    model.use_provider(provider)
    return model, provider


def check_same(got, want):
    (g_logits, g_tokens), (w_logits, w_tokens) = got, want
    assert g_tokens == w_tokens
    for g, w in zip(g_logits, w_logits, strict=True):
        assert torch.equal(g, w)


def check_counters(provider):
    st = provider.stats()
    for tiers in st["cache"].values():
        c = tiers["compute"]
        assert c["hits"] + c["misses"] == c["lookups"]
    dev = st["totals"]["compute"]
    assert dev["lookups"] > 0 and dev["misses"] > 0
    assert st["prefetch"]["failed_reads"] == 0
    assert st["stall_ms"] >= 0.0 and st["prefetch"]["stall_ms"] >= 0.0
    # Kernel time ran (host slots), and only part of it can have overlapped reads.
    assert st["kernel_ms"] > 0.0 and 0.0 <= st["kernel_overlap_ms"] <= st["kernel_ms"] + 1e-6
    assert provider.prefetcher.busy_seconds() * 1e3 >= st["prefetch"]["busy_ms"] > 0.0
    assert dev["bytes_read"] > 0
    assert st["prefill_dedup"]["factor"] >= 1.0
    return st


@pytest.mark.parametrize("codec", LAYOUTS)
@pytest.mark.parametrize("lookahead", [0, 1, 2])
def test_streamed_equals_resident(built, codec, lookahead):
    src, art, want_logits, want_tokens = built[codec]
    model, provider = streamed(src, art, lookahead=lookahead)
    with provider:
        got = run(model)
        check_same(got, (want_logits, want_tokens))
        st = check_counters(provider)
    if lookahead:
        assert set(st["lookahead"]) == set(range(1, lookahead + 1))
        assert st["prefetch"]["spec_issued"] > 0
    print(f"{codec} lookahead={lookahead}: hit rate {st['hit_rate']:.3f}, "
          f"dedup {st['prefill_dedup']['factor']:.2f}, lookahead "
          f"{ {d: round(v['recall'], 3) for d, v in st['lookahead'].items()} }")


@pytest.mark.parametrize("codec", ["t158", "mxfp4"])
def test_wrong_predictor_is_still_exact(built, codec):
    src, art, want_logits, want_tokens = built[codec]
    model, provider = streamed(src, art, lookahead=2)
    rng = random.Random(0)
    n_exp = model.cfg.num_experts

    def wrong_hint(layer, actual, predicted):
        keys = [(la, rng.randrange(n_exp)) for la in predicted for _ in range(3)]
        provider.prefetcher.cancel_stale(set(keys))
        return provider.prefetcher.speculate(keys)

    provider.hint = wrong_hint
    with provider:
        check_same(run(model), (want_logits, want_tokens))
        st = check_counters(provider)
    assert st["prefetch"]["spec_issued"] > 0


def test_host_tier_and_global_scope_exact(built):
    src, art, want_logits, want_tokens = built["t158"]
    model, provider = streamed(src, art, lookahead=1, scope="global",
                               host_bytes=8 * 49152)
    with provider:
        check_same(run(model), (want_logits, want_tokens))
        check_counters(provider)


def test_experts_contract_and_dedup(built):
    src, art, *_ = built["bf16"]
    model, provider = streamed(src, art)
    with provider:
        resident = load_model(src).layers[1].mlp.provider
        got = provider.experts(1, [0, 3, 5])
        want = resident.experts(1, [0, 3, 5])
        for e in (0, 3, 5):
            for p in ("gate", "up", "down"):
                assert torch.equal(getattr(got[e], p), getattr(want[e], p))
        # A 4-token prefill over experts 0, 3, 5 (cached) and 7 (read): 8 uses of 4 records.
        ids = torch.tensor([[0, 3], [5, 7], [0, 7], [3, 5]])
        r = torch.randn(4, model.cfg.routed_expert_hidden_size)
        provider.run_experts(1, r, ids, torch.ones(4, 2))
        assert provider.cache.where((1, 7)).transient  # a prefill miss takes a transient slot
        assert provider.stats()["prefill_dedup"] == {"uses": 8, "unique": 4, "factor": 2.0}


def test_close_leaves_no_threads(built):
    src, art, *_ = built["t158"]
    before = threading.active_count()
    model, provider = streamed(src, art, lookahead=2)
    run(model)
    provider.close()
    provider.close()  # idempotent
    deadline = time.monotonic() + 5.0
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() <= before
    with pytest.raises(RuntimeError, match="closed"):
        provider.experts(1, [0])


def test_truncated_part_fails_the_forward(built, tmp_path):
    import shutil

    src, art0, *_ = built["t158"]
    art = tmp_path / "art"
    shutil.copytree(art0, art)
    model, provider = streamed(src, art, lookahead=1, timeout_s=10.0)
    with provider:
        run(model)  # every part file is open now
        part = art / provider.manifest.sidecar.parts[-1].file
        with open(part, "r+b") as f:
            f.truncate(0)
        with pytest.raises(PrefetchError, match=part.name):  # a hang: TimeoutError at 10 s
            model.logits(PROMPT + PROMPT)  # prefill needs nearly every expert of every layer


def test_guess_landing_before_demand_counts_as_hit(built):
    src, art, *_ = built["t158"]
    model, provider = streamed(src, art, lookahead=1)
    with provider:
        assert provider.prefetcher.speculate([(2, 6)]) == [(2, 6)]
        deadline = time.monotonic() + 5.0
        while provider.cache.is_loading((2, 6)) and time.monotonic() < deadline:
            time.sleep(0.01)
        # The guess committed after a caller's lookup: demand hands back the resident slot.
        fut = provider.prefetcher.demand([(2, 6)])[(2, 6)]
        assert fut.done() and fut.result().key == (2, 6)
        assert provider.prefetcher.stats.spec_used == 1
        assert list(provider.experts(2, [6])) == [6]


@pytest.mark.parametrize("transient_records", [1, 2, 0])
def test_prefill_windows_are_exact(built, transient_records):
    """A prefill needing more experts than the transient pool holds runs in windows of
    ascending ids into one fp32 sum: bit-identical to the resident model (reference kernels)."""
    src, art, want_logits, want_tokens = built["t158"]
    probe = StreamingExpertProvider(art, load_model(src).cfg, compute_bytes=1, lookahead=0,
                                    kernels="reference")
    stride = probe.stride_bytes
    probe.close()
    model, provider = streamed(src, art, transient_bytes=transient_records * stride)
    with provider:
        assert provider.cache.capacity()["transient"] == transient_records
        check_same(run(model), (want_logits, want_tokens))
        if transient_records:  # the whole prompt's experts never fit: several windows ran
            assert provider.stats()["prefill_dedup"]["unique"] > transient_records


def test_ct_int_group_32_streams_exactly(tmp_path):
    """A W3 source with one scale per 32 columns (FORMAT.md "ct-int"; Kimi K2 Thinking's group)
    builds a ct-int group-32 bank that streams to the resident model's logits bit for bit on the
    reference backend and to its greedy tokens on the cpu kernels."""
    from mtplx_runtime.kernels import cpu

    src, art = tmp_path / "src", tmp_path / "art"
    make_tiny(src, "w3", w3_layout="dense", w3_group=32)
    assert build_artifact(src, art, codec="keep", progress=False).mode == "ct-int"
    want_logits, want_tokens = run(load_model(src))
    model, provider = streamed(src, art, lookahead=1)
    with provider:
        assert provider.layout.group_size == 32
        check_same(run(model), (want_logits, want_tokens))
    if cpu.unavailable_reason() is None:
        model, provider = streamed(src, art, lookahead=1, kernels="cpu")
        with provider:
            logits, tokens = run(model)
        assert tokens == want_tokens
        for g, w in zip(logits, want_logits, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-4 * float(w.abs().max()))


@pytest.mark.parametrize("codec", LAYOUTS)
def test_cpu_kernels_same_greedy_text(built, codec):
    """`--kernels cpu`: the native kernels on the packed slot bytes pick the same greedy tokens
    as the reference backend; logits agree to fp32 summation-order noise."""
    from mtplx_runtime.kernels import cpu

    if cpu.unavailable_reason():
        pytest.skip(cpu.unavailable_reason())
    src, art, want_logits, want_tokens = built[codec]
    model, provider = streamed(src, art, lookahead=1, kernels="cpu")
    with provider:
        assert provider.kernels is cpu
        logits, tokens = run(model)
        check_counters(provider)
    assert tokens == want_tokens
    for g, w in zip(logits, want_logits, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-4 * float(w.abs().max()))


def test_unknown_kernels_is_a_clear_error(built):
    src, art, *_ = built["t158"]
    with pytest.raises(ValueError, match="unknown kernel backend 'gpu'"):
        streamed(src, art, kernels="gpu")


def test_kernels_that_cannot_run_the_bank_are_refused_at_load(built, monkeypatch):
    """A backend reporting a bank mode it has no kernel for fails at construction with its
    reason, not at the first forward (the cuda backend does so for ct-int-asym and bf16)."""
    from types import SimpleNamespace

    from mtplx_runtime.formats.record import record_layout
    from mtplx_runtime.kernels import cuda, reference

    shapes = SimpleNamespace(expert_shapes={"gate": (128, 64), "up": (128, 64),
                                            "down": (64, 128)})
    assert cuda.unsupported(record_layout(shapes, "t158")) is None
    assert cuda.unsupported(record_layout(shapes, "ct-int", 4)) is None
    assert "ct-int-asym" in cuda.unsupported(record_layout(shapes, "ct-int-asym", 3))
    src, art, *_ = built["bf16"]
    monkeypatch.setattr(reference, "unsupported", cuda.unsupported, raising=False)
    with pytest.raises(ValueError, match="no CUDA kernel for bank mode 'bf16'"):
        streamed(src, art)


class _ReorderingReader:
    """Wraps the reader of the provider's fill pipeline: each read runs for real, but lands
    after a delay that shrinks with its submission index, so the reads of a window tend to land
    in reverse order. The assertions hold for any landing order; this only makes the unusual
    ones likely."""

    def __init__(self, reader, span: int = 8, step_s: float = 0.002):
        self.reader, self.span, self.step_s = reader, span, step_s
        self.parts = getattr(reader, "parts", None)
        self.order: list[tuple[int, int]] = []
        self._n = 0
        self._lock = threading.Lock()

    def read_into(self, part, offset, length, buf):
        with self._lock:
            i, self._n = self._n, self._n + 1
        inner = self.reader.read_into(part, offset, length, buf)
        out: Future = Future()
        out.set_running_or_notify_cancel()

        def land():
            time.sleep(self.step_s * (self.span - i % self.span))
            try:
                n = inner.result()
            except BaseException as e:
                out.set_exception(e)
                return
            with self._lock:
                self.order.append((part, offset))
            out.set_result(n)

        threading.Thread(target=land, daemon=True).start()
        return out

    def close(self):
        self.reader.close()


@pytest.mark.parametrize("codec", LAYOUTS)
@pytest.mark.parametrize("lookahead", [0, 1])
def test_decode_computes_experts_as_they_land_and_stays_exact(built, codec, lookahead):
    """In decode each expert computes when its read lands, in whatever order; its product goes
    to its own row and the rows add in ascending expert id, so the logits equal the resident
    model's bit for bit (reference backend) whatever the landing order."""
    src, art, want_logits, want_tokens = built[codec]
    model, provider = streamed(src, art, lookahead=lookahead)
    with provider:
        provider.fill.reader = _ReorderingReader(provider.fill.reader)
        check_same(run(model), (want_logits, want_tokens))
        assert provider.fill.reader.order  # the wrapped reader did the reads


def test_decode_keeps_its_reads_to_the_decode_depth(built):
    """A prompt's windows read at the read depth; a one-token forward keeps at most
    decode_depth reads in flight, its misses and guesses together, and stays exact."""
    src, art, want_logits, want_tokens = built["t158"]
    model, provider = streamed(src, art, lookahead=1, read_depth=8, decode_depth=2)
    with provider:
        assert provider.decode_depth == 2
        provider.fill.reader = _ReorderingReader(provider.fill.reader)
        state = model.new_state()
        logits = [model.prefill(PROMPT, state)]
        stats = provider.prefetcher.stats
        assert stats.peak_inflight_reads > 2  # the prompt's windows went deeper
        stats.peak_inflight_reads, tokens = 0, []
        for _ in range(STEPS):
            tokens.append(int(torch.argmax(logits[-1][-1] if logits[-1].dim() == 2
                                           else logits[-1])))
            logits.append(model.decode(tokens[-1], state))
        assert 0 < stats.peak_inflight_reads <= 2 and stats.demand_reads > STEPS
        check_same((logits, tokens), (want_logits, want_tokens))
    with pytest.raises(ValueError, match="decode_depth must be >= 1"):
        streamed(src, art, decode_depth=0)


def test_guesses_are_read_only_while_they_prove_right(built):
    """A lookahead depth's guesses are scored from the start but read only once GUESS_MIN_PAIRS
    layers show a precision of GUESS_MIN_PRECISION, and no longer once it falls below."""
    src, art, *_ = built["t158"]
    model, provider = streamed(src, art, lookahead=1)
    first, second = model.cfg.moe_layers[:2]
    k, n = model.cfg.num_experts_per_token, model.cfg.num_experts
    route = torch.arange(k).unsqueeze(0)  # [1, K]: the second layer always takes experts 0..K-1
    wrong = torch.arange(n - k, n).unsqueeze(0)
    read = [(second, e) for e in range(k)]

    def step(guess) -> list:
        kept = provider.hint(first, route, {second: guess})  # what run_experts would read
        provider.hint(second, route, {})  # scores the guess
        return kept
    with provider:
        assert provider.stats()["guessing_depths"] == []
        for _ in range(GUESS_MIN_PAIRS):  # right, but not yet proven
            assert step(route) == []
        assert provider.guessing_depths(1) == {1} and step(route) == read
        wrong_steps = 0
        while provider.score.by_depth[1].precision >= GUESS_MIN_PRECISION:
            assert step(wrong) == [(second, e) for e in range(n - k, n)]  # still trusted
            wrong_steps += 1
        assert wrong_steps == GUESS_MIN_PAIRS + 2 and step(route) == []  # no longer read...
        assert provider.score.by_depth[1].pairs == 2 * GUESS_MIN_PAIRS + 4  # ...still scored
        # that last right guess, scored, lifts the precision back to 10 / 20: read again
        assert provider.stats()["guessing_depths"] == [1] and step(route) == read


def test_guesses_are_read_after_the_layers_misses(built):
    """The guesses a layer's hint keeps go to the prefetcher after that layer's misses, so they
    never take a place in the decode depth ahead of them."""
    src, art, want_logits, want_tokens = built["t158"]
    model, provider = streamed(src, art, lookahead=1)
    calls: list[str] = []
    demand, speculate = provider.prefetcher.demand, provider.prefetcher.speculate
    provider.prefetcher.demand = lambda keys, *a: calls.append("demand") or demand(keys, *a)
    provider.prefetcher.speculate = lambda keys, *a: calls.append("guess") or speculate(keys, *a)
    with provider:
        check_same(run(model), (want_logits, want_tokens))
        assert "guess" in calls
        assert all(calls[i - 1] == "demand" for i, c in enumerate(calls) if c == "guess")


def test_a_one_token_hint_starts_the_layers_reads_before_its_compute(built):
    """In a one-token step the hint demands the layer's misses, then the block computes its
    shared expert while they land, then run_experts takes the reads already started (no second
    demand); the logits stay the resident model's bit for bit. A hint whose run_experts never
    comes releases its window's pins at the next hint."""
    src, art, want_logits, want_tokens = built["t158"]
    model, provider = streamed(src, art, lookahead=0)
    calls: list[tuple[str, int]] = []
    demand, run_experts = provider.prefetcher.demand, provider.run_experts
    provider.prefetcher.demand = lambda keys, *a: (
        calls.append(("demand", keys[0][0] if keys else -1)) or demand(keys, *a))
    provider.run_experts = lambda layer, *a: (
        calls.append(("run", layer)) or run_experts(layer, *a))
    for moe in model.moe_blocks():
        moe.shared.forward = lambda x, f=moe.shared.forward, layer=moe.layer: (
            calls.append(("shared", layer)) or f(x))
    with provider:
        state = model.new_state()
        logits = [model.prefill(PROMPT, state)]
        tokens: list[int] = []
        steps = []
        for _ in range(STEPS):
            tokens.append(int(torch.argmax(logits[-1][-1] if logits[-1].dim() == 2
                                           else logits[-1])))
            calls.clear()
            logits.append(model.decode(tokens[-1], state))
            steps.append(list(calls))
        check_same((logits, tokens), (want_logits, want_tokens))
        started = 0
        for step in steps:
            for layer in model.cfg.moe_layers:
                mine = [c for c, at in step if at == layer]
                # one window per layer here (the route fits the layer's slots); a miss-free
                # window demands nothing and is logged with layer -1
                assert mine in (["demand", "shared", "run"], ["shared", "run"]), step
                started += mine[0] == "demand"
        assert started >= STEPS  # misses were read in most steps, every time from the hint
        first, second = model.cfg.moe_layers[:2]
        route = torch.arange(model.cfg.num_experts_per_token).unsqueeze(0)
        provider.hint(first, route, {})
        held = [k for k, e in provider.cache._entries.items() if e.pins]
        assert held and all(k[0] == first for k in held)
        provider.hint(second, route, {})  # the first layer's run_experts never came
        assert not any(e.pins for k, e in provider.cache._entries.items() if k[0] == first)
        assert any(e.pins for k, e in provider.cache._entries.items() if k[0] == second)
    # close released the window the prefetcher held for the second hint
    assert not any(e.pins for e in provider.cache._entries.values())


def test_a_backend_repack_lays_out_every_record_it_reads(built):
    """A kernel backend with its own record layout defines `repack(layout, buf)`: the fill
    applies it once to every record read, after the check and before the slot is a hit, so the
    backend's kernels only ever see repacked bytes (here: a XOR the kernels undo; the logits stay
    the resident model's bit for bit)."""
    from types import ModuleType

    import numpy as np

    from mtplx_runtime.kernels import reference

    src, art, want_logits, want_tokens = built["t158"]
    repacked: list[int] = []
    backend = ModuleType("xor_backend")
    backend.__dict__.update({k: v for k, v in vars(reference).items() if not k.startswith("__")})

    def repack(layout, buf):
        repacked.append(buf.nbytes)
        np.bitwise_xor(buf, 0x5A, out=buf)

    def expert_mlp(x, ids, weights, slots, storage, layout, *a, **kw):
        plain = {e: np.bitwise_xor(buf, 0x5A) for e, buf in storage.items()}
        return reference.expert_mlp(x, ids, weights, slots, plain, layout, *a, **kw)

    backend.repack, backend.expert_mlp = repack, expert_mlp
    model, provider = streamed(src, art, kernels=backend)  # lookahead 0: every read waited for
    with provider:
        check_same(run(model), (want_logits, want_tokens))
        assert len(repacked) == provider.stats()["prefetch"]["demand_reads"] > 0
