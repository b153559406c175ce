"""Generation: sampling, chunked prefill, generate_step, route traces, `generate`/`chat` CLIs.

All on the tiny t158 fixture with resident experts, float32 (exact greedy comparisons).
"""

from __future__ import annotations

import io
import json
import re

import pytest
import torch

from mtplx_runtime import load_model
from mtplx_runtime.cli import SUBCOMMANDS
from mtplx_runtime.cli import main as cli_main
from mtplx_runtime.engine.generate import (
    GenerationStats,
    NonFiniteLogits,
    generate,
    generate_step,
    prefill,
    sample,
)
from mtplx_runtime.engine.tokenizer import load_tokenizer
from mtplx_runtime.engine.trace import TRACE_FORMAT, RouteTrace, moe_blocks, read_trace
from mtplx_runtime.fixtures.tiny import make_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("gen") / "t158"
    make_tiny(d, "t158")
    return d


@pytest.fixture(scope="module")
def model(tiny):
    return load_model(tiny, dtype="float32")


@pytest.fixture(scope="module")
def tok(tiny):
    return load_tokenizer(tiny)


PROMPT = "The expert cache reads ahead of the router"


def _manual_greedy(model, ids, n, chunk=None, on_forward=None):
    state = model.new_state()
    logits = model.prefill(ids, state)[-1] if chunk is None else prefill(model, state, ids,
                                                                          chunk, on_forward)
    out = []
    for _ in range(n):
        out.append(int(torch.argmax(logits.float())))
        pos = state.tokens
        logits = model.decode(out[-1], state)
        if on_forward is not None:
            on_forward("decode", pos, 1)
    return out


# ---- sample ------------------------------------------------------------------------------------

def test_sample_greedy_is_argmax():
    logits = torch.tensor([0.1, 3.0, -1.0, 2.9])
    assert sample(logits) == 1
    assert sample(logits.to(torch.bfloat16), temperature=0.0, top_k=1) == 1


def test_sample_is_deterministic_with_a_seed():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(1))

    def draws(seed):
        g = torch.Generator().manual_seed(seed)
        return [sample(logits, temperature=1.0, generator=g) for _ in range(50)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


def test_top_k_and_top_p_restrict_the_support():
    # probabilities 0.5, 0.25, 0.125, 0.0625, ... (log-spaced logits)
    logits = torch.tensor([-float(i) * 0.6931471805599453 for i in range(8)])
    g = torch.Generator().manual_seed(0)
    seen_k = {sample(logits, temperature=1.0, top_k=2, generator=g) for _ in range(400)}
    assert seen_k == {0, 1}
    # top_p 0.7: 0.5 < 0.7 so id 1 is needed; 0.75 >= 0.7 so id 2 is not
    seen_p = {sample(logits, temperature=1.0, top_p=0.7, generator=g) for _ in range(400)}
    assert seen_p == {0, 1}
    seen_p1 = {sample(logits, temperature=1.0, top_p=0.4, generator=g) for _ in range(50)}
    assert seen_p1 == {0}  # the best id is always kept
    # top-k then top-p: of ids {0,1,2} renormalised (4/7, 2/7, 1/7), p 0.6 keeps {0, 1}
    seen_kp = {sample(logits, temperature=1.0, top_k=3, top_p=0.6, generator=g)
               for _ in range(400)}
    assert seen_kp == {0, 1}
    # a high temperature flattens: all 8 ids show up
    seen_t = {sample(logits, temperature=50.0, generator=g) for _ in range(800)}
    assert seen_t == set(range(8))


def test_sample_rejects_bad_arguments():
    for kw in ({"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": -1},
               {"temperature": float("nan")}, {"temperature": float("inf")},
               {"top_p": float("nan")}):
        with pytest.raises(ValueError):
            sample(torch.zeros(4), **kw)


@pytest.mark.parametrize("kw", [{"temperature": 1e-300}, {"temperature": 5e-324},
                                {"temperature": 1e-38}, {"temperature": 1e-30},
                                {"temperature": 1.0, "top_p": 1e-300},
                                {"temperature": 1e-300, "top_p": 1e-300, "top_k": 3}])
def test_vanishing_temperature_or_top_p_samples_as_greedy(kw):
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(3)) * 20
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(dtype)
        best = sample(x)
        g = torch.Generator().manual_seed(0)
        assert [sample(x, generator=g, **kw) for _ in range(20)] == [best] * 20


def test_non_finite_logits_stop_generation():
    class Broken:  # finite prefill logits, then a NaN at decode position 2
        def new_state(self):
            return type("S", (), {"tokens": 0})()

        def prefill(self, ids, state):
            state.tokens += len(ids)
            out = torch.zeros(len(ids), 10)
            out[:, 1] = 1
            return out

        def decode(self, t, state):
            out = self.prefill([t], state)[0]
            out[4] = float("nan") if state.tokens == 3 else 0
            return out

    g = generate_step(Broken(), [5, 6], max_tokens=5)
    assert next(g) == 1
    with pytest.raises(NonFiniteLogits, match="decode at position 2"):
        next(g)

    class Inf(Broken):
        def prefill(self, ids, state):
            return super().prefill(ids, state) / 0  # +inf, and NaN where 0 / 0

    with pytest.raises(NonFiniteLogits, match="non-finite logits .* in prefill"):
        generate(Inf(), [5, 6], max_tokens=3)


# ---- generate_step -----------------------------------------------------------------------------

def test_greedy_generate_step_equals_manual_loop(model, tok):
    ids = tok.encode(PROMPT)
    stats = GenerationStats()
    got = list(generate_step(model, ids, max_tokens=10, stats=stats))
    assert got == _manual_greedy(model, ids, 10)
    assert stats.generated_tokens == 10 and stats.decode_forwards == 9
    assert stats.stop_reason == "length" and stats.prompt_tokens == len(ids)
    assert stats.prefill_tok_s > 0 and stats.decode_tok_s > 0 and stats.ttft_s > 0
    assert "tok/s" in stats.summary()


def test_generator_returns_its_stats():
    class Fake:  # a model whose logits always favour (last id + 1)
        def new_state(self):
            return type("S", (), {"tokens": 0})()

        def prefill(self, ids, state):
            state.tokens += len(ids)
            return torch.nn.functional.one_hot(torch.tensor(ids) + 1, 10).float()

        def decode(self, t, state):
            return self.prefill([t], state)[0]

    g = generate_step(Fake(), [2], max_tokens=5)
    assert next(g) == 3
    with pytest.raises(StopIteration) as e:
        while True:
            next(g)
    assert isinstance(e.value.value, GenerationStats) and e.value.value.generated_tokens == 5
    ids, stats = generate(Fake(), [2], max_tokens=10, stop_ids=[6])
    assert ids == [3, 4, 5] and stats.stop_reason == "stop" and stats.stop_id == 6
    assert generate(Fake(), [2], max_tokens=0)[0] == []


def test_chunked_prefill_gives_the_same_tokens(model, tok):
    ids = tok.encode(PROMPT + " and the prefetcher moves bytes")
    assert len(ids) > 6
    a = list(generate_step(model, ids, max_tokens=8, prefill_chunk=3))
    b = list(generate_step(model, ids, max_tokens=8, prefill_chunk=64))
    assert a == b


def test_stop_ids_stop_generation(model, tok):
    ids = tok.encode(PROMPT)
    free = list(generate_step(model, ids, max_tokens=8))
    stop = free[3]
    first = free.index(stop)
    stats = GenerationStats()
    got = list(generate_step(model, ids, max_tokens=8, stop_ids={stop}, stats=stats))
    assert got == free[:first] and stop not in got
    assert stats.stop_reason == "stop" and stats.stop_id == stop


def test_sampled_generation_is_seeded(model, tok):
    ids = tok.encode(PROMPT)
    kw = dict(max_tokens=8, temperature=1.0, top_k=50, top_p=0.9)
    assert list(generate_step(model, ids, seed=3, **kw)) == \
        list(generate_step(model, ids, seed=3, **kw))


def test_sampling_without_a_seed_is_fresh_and_the_stats_seed_repeats_it(model, tok):
    ids = tok.encode(PROMPT)
    kw = dict(max_tokens=8, temperature=1.0)
    runs = [generate(model, ids, **kw) for _ in range(2)]
    (a, sa), (b, sb) = runs
    assert sa.seed != sb.seed and a != b  # a fresh seed each run, not a fixed default
    assert f"; seed {sa.seed}" in sa.summary()
    assert generate(model, ids, seed=sa.seed, **kw)[0] == a  # the printed seed repeats it
    greedy, sg = generate(model, ids, max_tokens=8, seed=5)
    assert sg.seed is None and "seed" not in sg.summary()  # greedy draws nothing
    assert generate(model, ids, max_tokens=8)[0] == greedy


class _FixedLogits:
    """A model whose logits are always `row` (penalties alone change what is picked)."""

    def __init__(self, row):
        self.row = torch.tensor(row)

    def new_state(self):
        return type("S", (), {"tokens": 0})()

    def prefill(self, ids, state):
        state.tokens += len(ids)
        return self.row.expand(len(ids), -1).clone()

    def decode(self, t, state):
        return self.prefill([t], state)[0]


@pytest.mark.parametrize("fp,pp", [(0.6, 0.0), (0.0, 1.1), (0.3, 0.5), (-0.5, 0.2)])
def test_penalties_follow_openai(fp, pp):
    """logit - count * frequency_penalty - (count > 0) * presence_penalty over the ids generated
    so far (not the prompt), before greedy or sampled choice: checked against that formula."""
    from collections import Counter

    row = [3.0, 2.6, 2.2, 1.0, -1.0]
    got, _ = generate(_FixedLogits(row), [0, 0, 1], max_tokens=12, frequency_penalty=fp,
                      presence_penalty=pp)
    want, counts = [], Counter()
    for _ in range(12):
        scores = [x - counts[i] * fp - (counts[i] > 0) * pp for i, x in enumerate(row)]
        want.append(max(range(len(row)), key=lambda i: (scores[i], -i)))
        counts[want[-1]] += 1
    assert got == want
    assert fp < 0 or len(set(want)) > 1  # a positive penalty moves greedy off its favourite


# ---- route trace -------------------------------------------------------------------------------

def test_trace_lists_k_experts_per_moe_layer_per_token(model, tok, tmp_path):
    ids = tok.encode(PROMPT)
    path = tmp_path / "routes.jsonl"
    with RouteTrace(path, model, model_name="tiny", record_bytes=123) as trace:
        got = list(generate_step(model, ids, max_tokens=5, prefill_chunk=4, trace=trace))
    # the same computation by hand, capturing last_ids after each forward
    want = []

    def capture(phase, pos, n):
        for i in range(n):
            want.append((pos + i, phase, {b.layer: b.last_ids[i].tolist()
                                          for b in moe_blocks(model)}))

    assert _manual_greedy(model, ids, 4, chunk=4, on_forward=capture) == got[:4]
    header, lines = read_trace(path)
    lines = list(lines)
    cfg = model.cfg
    assert header == {"format": TRACE_FORMAT, "model": "tiny", "layers": list(cfg.moe_layers),
                      "experts": cfg.num_experts, "top_k": cfg.num_experts_per_token,
                      "record_bytes": 123}
    assert len(lines) == len(ids) + 4  # no forward for the last generated token
    assert [ln["t"] for ln in lines] == list(range(len(ids) + 4))
    assert [ln["phase"] for ln in lines] == ["prefill"] * len(ids) + ["decode"] * 4
    for ln, (t, phase, routes) in zip(lines, want, strict=True):
        assert ln["t"] == t and ln["phase"] == phase and "predicted" not in ln
        assert set(ln["routes"]) == {str(layer) for layer in cfg.moe_layers}
        for layer, experts in ln["routes"].items():
            assert len(experts) == cfg.num_experts_per_token == len(set(experts))
            assert experts == sorted(experts) and experts == routes[int(layer)]


def test_trace_records_provider_predictions(model, tmp_path):
    blocks = moe_blocks(model)
    saved = blocks[0].provider

    class Guessing:
        lookahead = 0

        def __init__(self, inner):
            self.inner = inner
            self.last_predictions = {blocks[-1].layer: {1: torch.tensor([0, 1])}}

        def begin_forward(self, tokens):
            pass

        def hint(self, layer, actual, predicted):
            pass

        def run_experts(self, layer, r, ids, weights):
            return self.inner.run_experts(layer, r, ids, weights)

    for b in blocks:
        b.provider = Guessing(saved)
    try:
        with RouteTrace(tmp_path / "p.jsonl", model) as trace:
            list(generate_step(model, [5, 6, 7], max_tokens=2, trace=trace))
    finally:
        for b in blocks:
            b.provider = saved
    _, lines = read_trace(tmp_path / "p.jsonl")
    lines = list(lines)
    assert [ln["phase"] for ln in lines] == ["prefill"] * 3 + ["decode"]
    assert all("predicted" not in ln for ln in lines[:3])  # guesses are made in decode only
    assert lines[3]["predicted"] == {str(blocks[-1].layer): {"1": [0, 1]}}


# ---- CLI ---------------------------------------------------------------------------------------

@pytest.fixture
def cli(monkeypatch):
    monkeypatch.setitem(SUBCOMMANDS, "generate", ("mtplx_runtime.cli.generate", "generate"))
    monkeypatch.setitem(SUBCOMMANDS, "chat", ("mtplx_runtime.cli.chat", "chat"))
    return cli_main


def test_cli_generate_streams_text_and_stats(cli, tiny, model, tok, tmp_path, capsys):
    trace = tmp_path / "cli.jsonl"
    assert cli(["generate", "--model", str(tiny), "--prompt", PROMPT, "--dtype", "float32",
                "--max-tokens", "6", "--trace-routes", str(trace)]) == 0
    out, err = capsys.readouterr()
    want = _manual_greedy(model, tok.encode(PROMPT), 6)
    assert out == tok.decode(want, skip_special=True) + "\n"
    assert "generated 6 tok" in err and "decode" in err and "tok/s" in err
    header, lines = read_trace(trace)
    assert header["record_bytes"] > 0 and len(list(lines)) == len(tok.encode(PROMPT)) + 5


def test_cli_prompt_from_file_and_stdin_equals_inline(cli, tiny, tmp_path, monkeypatch, capsys):
    flags = ["generate", "--model", str(tiny), "--dtype", "float32", "--max-tokens", "4"]
    assert cli([*flags, "--prompt", PROMPT]) == 0
    inline = capsys.readouterr().out
    (tmp_path / "p.txt").write_text(PROMPT, encoding="utf-8")
    assert cli([*flags, "--prompt-file", str(tmp_path / "p.txt")]) == 0
    assert capsys.readouterr().out == inline
    monkeypatch.setattr("sys.stdin", io.StringIO(PROMPT))
    assert cli([*flags, "--prompt", "-"]) == 0
    assert capsys.readouterr().out == inline
    assert cli([*flags, "--prompt-file", str(tmp_path / "missing.txt")]) == 2
    err = capsys.readouterr().err
    assert "--prompt-file" in err and "missing.txt" in err
    with pytest.raises(SystemExit):  # one prompt source only
        cli([*flags, "--prompt", "x", "--prompt-file", str(tmp_path / "p.txt")])


def test_cli_generate_chat_mode(cli, tiny, capsys):
    assert cli(["generate", "--model", str(tiny), "--prompt", "hello", "--chat",
                "--max-tokens", "5", "--thinking"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("<think>\n") and "[reply:" in err and "tok/s" in err
    # The reply hit its token limit inside the think channel: said, with what to raise.
    assert ("mtplx generate: reply cut at 5 tokens (--max-tokens) inside the think channel, so "
            "no answer yet: raise --max-tokens or pass --no-thinking for a longer reply") in err
    assert cli(["generate", "--model", str(tiny), "--prompt", "hello", "--chat",
                "--no-thinking", "--max-tokens", "3"]) == 0
    assert not capsys.readouterr().out.startswith("<think>")


def test_cli_bad_streaming_requests_are_one_line_errors(cli, tiny, capsys):
    rc = cli(["generate", "--model", str(tiny), "--prompt", "x", "--memory-budget", "1GiB"])
    assert rc == 2  # a plain checkpoint (or a build without streaming.py)
    assert "mtplx generate: error:" in capsys.readouterr().err
    assert cli(["generate", "--model", str(tiny), "--prompt", "x", "--top-p", "0"]) == 2
    for bad in ("nan", "inf", "-1"):  # NaN passes `< 0`: it must still be a one-line error
        assert cli(["generate", "--model", str(tiny), "--prompt", "x", "--temperature", bad]) == 2
        assert "--temperature must be >= 0" in capsys.readouterr().err
    capsys.readouterr()
    assert cli(["generate", "--model", str(tiny), "--prompt", "x", "--read-depth", "0"]) == 2
    assert "--read-depth must be >= 1, got 0" in capsys.readouterr().err
    assert cli(["generate", "--model", str(tiny), "--prompt", "x", "--decode-depth", "0"]) == 2
    assert "--decode-depth must be >= 1, got 0" in capsys.readouterr().err
    rc = cli(["generate", "--model", str(tiny), "--prompt", "x", "--kernels", "cpu"])
    assert rc == 2 and "kernels 'cpu' run on streamed experts" in capsys.readouterr().err


def _poison(checkpoint, name: str) -> None:
    """Overwrite tensor `name` (BF16) in its safetensors shard with NaNs, in place."""
    import struct

    for f in checkpoint.glob("*.safetensors"):
        with open(f, "r+b") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
            if name in header:
                assert header[name]["dtype"] == "BF16"
                begin, end = header[name]["data_offsets"]
                fh.seek(8 + n + begin)
                fh.write(b"\xc0\x7f" * ((end - begin) // 2))  # bf16 quiet NaN
                return
    raise AssertionError(f"{name} not in {checkpoint}")


def test_cli_generate_corrupt_model_is_an_error(cli, tmp_path, monkeypatch, capsys):
    bad = tmp_path / "bad"
    make_tiny(bad, "t158")
    _poison(bad, "language_model.model.norm.weight")
    rc = cli(["generate", "--model", str(bad), "--prompt", PROMPT, "--max-tokens", "4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1, err
    assert err[-1].startswith("mtplx generate: error: the model produced non-finite logits")
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    assert cli(["chat", "--model", str(bad), "--max-tokens", "4"]) == 1  # chat too, no traceback
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "mtplx chat: error: the model produced non-finite logits")


def test_cli_streamed_generation_matches_resident(cli, tiny, model, tok, tmp_path, capsys,
                                                   monkeypatch):
    pytest.importorskip("mtplx_runtime.offload.provider")
    from mtplx_runtime.artifact.build import build_artifact

    art = tmp_path / "art"
    build_artifact(tiny, art, codec="keep", progress=False)
    assert cli(["generate", "--model", str(art), "--prompt", PROMPT, "--dtype", "float32",
                "--max-tokens", "6", "--memory-budget", "2GiB", "--lookahead", "1",
                "--kernels", "reference", "--read-depth", "1"]) == 0
    out, err = capsys.readouterr()
    assert out == tok.decode(_manual_greedy(model, tok.encode(PROMPT), 6), skip_special=True) + "\n"
    assert "cache hit rate" in err and "kernels reference" in err
    assert "CUDA unavailable" not in err  # an explicit choice is not a fallback
    # The native CPU kernels give the same greedy text, in the default bf16 model too.
    for dtype in ("float32", "bfloat16"):
        texts = []
        for kernels in ("reference", "cpu"):
            assert cli(["generate", "--model", str(art), "--prompt", PROMPT, "--dtype", dtype,
                        "--max-tokens", "8", "--kernels", kernels]) == 0
            texts.append(capsys.readouterr().out)
        assert texts[0] == texts[1] and texts[0].strip(), (dtype, texts)
    from mtplx_runtime.kernels import cuda

    if cuda.unavailable_reason():  # no GPU here: auto says so once; asking for CUDA is an error
        monkeypatch.delenv("MTPLX_KERNELS", raising=False)
        assert cli(["generate", "--model", str(art), "--prompt", "x", "--max-tokens", "1"]) == 0
        err = capsys.readouterr().err
        assert err.count("mtplx: expert kernels: cpu (CUDA unavailable: ") == 1, err
        rc = cli(["generate", "--model", str(art), "--prompt", "x", "--kernels", "cuda"])
        err = capsys.readouterr().err
        assert rc == 2 and "kernel backend 'cuda' requested but unavailable" in err, err
    rc = cli(["generate", "--model", str(art), "--prompt", "x", "--memory-budget", "1KiB"])
    assert rc == 2 and "minimum" in capsys.readouterr().err


def test_cli_context_is_enforced_truncated_or_shortens_the_reply(cli, tiny, model, tok, capsys):
    """--context bounds prompt + reply (the memory plan reserves state for that many): a prompt
    that does not fit is refused, or with --truncate cut from the left, and a reply that would
    run past it is shortened, each said on stderr."""
    ids = tok.encode(PROMPT)
    flags = ["generate", "--model", str(tiny), "--prompt", PROMPT, "--dtype", "float32"]
    n = len(ids)
    assert n >= 4
    assert cli([*flags, "--context", str(n), "--max-tokens", "3"]) == 2
    err = capsys.readouterr().err
    assert f"the prompt has {n} tokens and --context is {n}" in err and "--truncate" in err
    assert err.count("\n") == 1

    assert cli([*flags, "--context", str(n), "--max-tokens", "2", "--truncate"]) == 0
    out, err = capsys.readouterr()
    assert f"prompt cut from {n} to its last {n - 2} tokens" in err
    want = generate(model, ids[-(n - 2):], max_tokens=2)[0]
    assert out == tok.decode(want, skip_special=True) + "\n"

    assert cli([*flags, "--context", str(n + 2), "--max-tokens", "5"]) == 0
    out, err = capsys.readouterr()
    assert "reply limited to 2 tokens" in err and "generated 2 tok" in err


def test_cli_device_slots_show_cache_misses_on_a_small_model(cli, tiny, model, tok, tmp_path,
                                                             capsys):
    """--device-slots sizes the cache per MoE layer directly: one slot misses, all experts hit
    after their first read, and both give the resident model's tokens."""
    from mtplx_runtime.artifact.build import build_artifact

    art = tmp_path / "art"
    build_artifact(tiny, art, codec="keep", progress=False)
    want = tok.decode(_manual_greedy(model, tok.encode(PROMPT), 6), skip_special=True) + "\n"
    flags = ["generate", "--model", str(art), "--prompt", PROMPT, "--dtype", "float32",
             "--max-tokens", "6", "--kernels", "reference"]
    rates = []
    for slots in ("1", str(model.cfg.num_experts)):
        assert cli([*flags, "--device-slots", slots]) == 0
        out, err = capsys.readouterr()
        assert out == want
        rates.append(float(err.split("cache hit rate ")[1].split("%")[0]))
    assert rates[0] < rates[1]
    assert cli([*flags, "--device-slots", "2", "--memory-budget", "1GiB"]) == 2
    assert "not both" in capsys.readouterr().err
    assert cli([*flags, "--host-slots", "2"]) == 2
    assert "--host-slots needs --device-slots" in capsys.readouterr().err


def test_prefill_progress_lines_for_a_long_prompt(cli, tiny, model, tok, monkeypatch, capsys):
    """A long prompt says how its prefill goes (stderr), at most every few seconds and at the
    end; the route trace still sees every forward; the text is unchanged."""
    import io

    from mtplx_runtime.cli import common as gen

    ticks = iter(range(0, 1000, 3))  # each forward "takes" 3 s on a fake clock
    err = io.StringIO()
    seen = []

    class Inner:
        def on_forward(self, model, phase, first, n):
            seen.append((phase, first, n))

    hook = gen.PrefillProgress(20, err, inner=Inner(), every_s=5.0, clock=lambda: next(ticks))
    for first in range(0, 20, 4):
        hook.on_forward(model, "prefill", first, 4)
    hook.on_forward(model, "decode", 20, 1)
    lines = err.getvalue().splitlines()
    # clock: start 0; forwards at 3 (4 done), 6 (8: 6 >= 5 -> line), 9, 12 (16: line), 15 (end)
    assert lines == [f"mtplx: prefill {n}/20 tokens (1 tok/s)" for n in (8, 16, 20)]
    assert seen[-1] == ("decode", 20, 1) and len(seen) == 6

    monkeypatch.setattr(gen, "PROGRESS_MIN_TOKENS", 4)
    assert cli(["generate", "--model", str(tiny), "--prompt", PROMPT, "--dtype", "float32",
                "--max-tokens", "3", "--prefill-chunk", "2"]) == 0
    out, err_text = capsys.readouterr()
    n = len(tok.encode(PROMPT))
    assert f"mtplx: prefill {n:,}/{n:,} tokens" in err_text
    assert out == tok.decode(_manual_greedy(model, tok.encode(PROMPT), 3), skip_special=True) + "\n"


def test_cli_generate_prints_a_fresh_seed_that_repeats_the_run(cli, tiny, capsys):
    flags = ["generate", "--model", str(tiny), "--prompt", PROMPT, "--dtype", "float32",
             "--max-tokens", "8", "--temperature", "1"]
    runs = []
    for _ in range(2):
        assert cli(flags) == 0
        out, err = capsys.readouterr()
        runs.append((out, int(re.search(r"; seed (\d+)", err)[1])))
    assert runs[0] != runs[1]
    assert cli([*flags, "--seed", str(runs[0][1])]) == 0
    out, err = capsys.readouterr()
    assert (out, f"; seed {runs[0][1]}" in err) == (runs[0][0], True)


def test_cli_generate_skips_special_tokens_unless_kept(cli, tiny, model, tok, capsys):
    ids = _manual_greedy(model, tok.encode(PROMPT), 3)
    assert "<|reserved_token_" in tok.decode(ids)  # this reply holds a special id
    flags = ["generate", "--model", str(tiny), "--prompt", PROMPT, "--dtype", "float32",
             "--max-tokens", "3"]
    assert cli(flags) == 0
    assert capsys.readouterr().out == tok.decode(ids, skip_special=True) + "\n"
    assert cli([*flags, "--keep-special-tokens"]) == 0
    assert capsys.readouterr().out == tok.decode(ids) + "\n"
