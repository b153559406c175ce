"""`mtplx serve`: the official openai client drives the server on the tiny streamed artifact.

One module-scoped server (uvicorn on uvloop in a thread, 127.0.0.1, ephemeral port, an API key);
greedy output is compared with `mtplx generate`; bad requests get 4xx with an OpenAI error body;
a raw-socket client that disconnects mid-stream frees the engine; 20 concurrent clients. Slow
clients: more servers over the same app with small limits (`_serve`) and raw sockets that
trickle request bytes, each bounded in count and time.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import re
import select
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("uvloop")

from mtplx_runtime.artifact.build import build_artifact  # noqa: E402
from mtplx_runtime.cli import main as cli_main  # noqa: E402
from mtplx_runtime.cli.serve import add_args, api_key, build, make_server  # noqa: E402
from mtplx_runtime.engine.chat import ChannelText  # noqa: E402
from mtplx_runtime.engine.generate import generate  # noqa: E402
from mtplx_runtime.fixtures.tiny import make_tiny  # noqa: E402
from mtplx_runtime.server.worker import StopFilter  # noqa: E402

KEY = "sk-test-123"
MODEL = "tiny"
PROMPT = "The expert cache reads ahead of the router"
TIMEOUT = 30


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    src = make_tiny(root / "src", "t158").path
    build_artifact(src, root / "art", progress=False)
    return root / "art"


@pytest.fixture(scope="module")
def server(art):
    parser = argparse.ArgumentParser()
    add_args(parser)
    args = parser.parse_args(
        ["--model", str(art), "--dtype", "float32", "--api-key", KEY,
         "--served-model-name", MODEL, "--context", "4096", "--max-tokens", "12",
         "--max-body-bytes", "65536", "--temperature", "0"])  # greedy unless a request says
    app, engine, rt = build(args, api_key(args))
    try:
        with _serve(app) as port:
            yield {"port": port, "engine": engine, "rt": rt, "app": app}
    finally:
        engine.close()
        rt.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server['port']}/v1", api_key=KEY,
                         max_retries=0, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def expected(art):
    """What `mtplx generate` prints for PROMPT (greedy, 12 tokens)."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert cli_main(["generate", "--model", str(art), "--prompt", PROMPT, "--dtype",
                         "float32", "--max-tokens", "12"]) == 0
    return out.getvalue()[:-1]  # the CLI ends the text with one newline


def _raw(server, method, path, body=None, headers=None, key=KEY):
    conn = http.client.HTTPConnection("127.0.0.1", server["port"], timeout=TIMEOUT)
    h = {"Content-Type": "application/json", **(headers or {})}
    if key:
        h["Authorization"] = f"Bearer {key}"
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    conn.request(method, path, body=data, headers=h)
    r = conn.getresponse()
    payload = r.read()
    conn.close()
    return r.status, payload


def test_help_and_clear_error_without_server_extra(tmp_path):
    code = ("import sys; sys.modules['uvicorn'] = sys.modules['uvloop'] = None\n"
            "from mtplx_runtime.cli import SUBCOMMANDS, main\n"
            "SUBCOMMANDS.setdefault('serve', ('mtplx_runtime.cli.serve', 'serve'))\n"
            "sys.exit(main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", code, "serve", "--help"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "--api-key" in r.stdout
    r = subprocess.run([sys.executable, "-c", code, "serve", "--model", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "server` extra" in r.stderr
    from mtplx_runtime.extras import install_hint

    assert install_hint("server") in r.stderr and len(r.stderr.splitlines()) == 1


def test_help_shows_every_default():
    from mtplx_runtime.cli import DefaultsHelp

    parser = argparse.ArgumentParser(prog="mtplx serve", formatter_class=DefaultsHelp)
    add_args(parser)
    text = parser.format_help()
    blocks = re.split(r"\n  (?=-)", text.split("\noptions:\n", 1)[1].strip())
    options = [a for a in parser._actions if a.option_strings]
    assert len(blocks) == len(options)  # one help block per option
    for block in blocks:
        if not block.startswith(("-h", "-m ")):  # --help; -m/--model is required
            assert "default" in block, block
    flat = " ".join(text.split())
    for shown in ("(default: 127.0.0.1)", "(default: 8000)", "(default: bfloat16)",
                  "(default: $MTPLX_API_KEY, else none, open to all)", "affords, 4,096 to 32,768",
                  "0 = greedy (default: 1.0)"):
        assert shown in flat
    assert re.search(r"--access-log +one line per request[^-]*\(default: off\)", text), text


def _serve_main(argv, monkeypatch):
    """`mtplx serve ARGV` in-process with the uvicorn server faked: (exit status, what happened
    in order). The real listen_socket and load_runtime run; the fake server checks that its
    socket accepts connections and records the app type it was given."""
    from mtplx_runtime.cli import common as common_cli
    from mtplx_runtime.cli import serve as serve_cli

    events = []
    real_load, real_listen = common_cli.load_runtime, serve_cli.listen_socket

    def listen(host, port):
        sock = real_listen(host, port)
        events.append(("listen", sock.getsockname()[1]))
        return sock

    def load(args):
        events.append(("load",))
        return real_load(args)

    class FakeServer:
        stop_signal = stop_time = None  # never signalled

        def __init__(self, app, **kwargs):
            self.app = app

        def run(self, sockets):
            port = sockets[0].getsockname()[1]
            with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT):
                pass  # listening: the connection waits in the backlog
            events.append(("run", port, type(self.app).__name__))

    monkeypatch.setattr(serve_cli, "listen_socket", listen)
    monkeypatch.setattr(common_cli, "load_runtime", load)
    monkeypatch.setattr(serve_cli, "make_server", FakeServer)
    return cli_main(["serve", *argv]), events


def test_serve_listens_before_loading_and_prints_the_bound_url(art, tmp_path, monkeypatch,
                                                                capfd):
    link = tmp_path / "k3-link"
    link.symlink_to(art)  # the served name is the directory as given, not the link's target
    code, events = _serve_main(["--model", str(link), "--dtype", "float32", "--port", "0",
                                "--access-log"], monkeypatch)
    err = capfd.readouterr().err
    assert code == 0, err
    port = events[0][1]
    assert port != 0 and events == [("listen", port), ("load",), ("run", port, "AccessLog")]
    assert f"mtplx serve: k3-link on http://127.0.0.1:{port}/v1\n" in err
    code, events = _serve_main(["--model", str(art), "--dtype", "float32", "--port", "0"],
                               monkeypatch)
    assert code == 0 and events[-1][2] == "App"  # no access log unless asked


def test_taken_port_fails_at_once_before_loading(art, monkeypatch, capfd):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, events = _serve_main(["--model", str(art), "--port", str(port)], monkeypatch)
    err = capfd.readouterr().err
    assert code == 2 and events == []  # never loaded the model
    assert err.startswith(f"mtplx serve: error: cannot listen on 127.0.0.1:{port}: ")
    assert "in use" in err and len(err.splitlines()) == 1 and "http://" not in err


@pytest.mark.parametrize("argv,message", [
    (["--port", "70000"], "--port must be in [0, 65535], got 70000"),
    (["--host", "203.0.113.7"], "cannot listen on 203.0.113.7:0: "),  # not this machine's
])
def test_bad_listen_address_is_one_line(art, monkeypatch, capfd, argv, message):
    code, events = _serve_main(["--model", str(art), "--port", "0", *argv], monkeypatch)
    err = capfd.readouterr().err
    assert code == 2 and events == [] and len(err.splitlines()) == 1
    assert err.startswith(f"mtplx serve: error: {message}"), err


def test_a_model_without_a_chat_format_serves_chats_without_thinking(art, capsys):
    """As `mtplx chat`: a model trained on plain text never closes a think channel nor ends a
    reply, so by default chats do not think and replies stop at 256 tokens (said once);
    --thinking and --max-tokens still choose."""
    parser = argparse.ArgumentParser()
    add_args(parser)
    for flags, thinking, max_tokens in (([], False, 256), (["--thinking"], True, 256),
                                        (["--max-tokens", "9"], False, 9)):
        app, engine, rt = build(parser.parse_args(["--model", str(art), "--dtype", "float32",
                                                   *flags]), None)
        engine.close()
        rt.close()
        assert (app.cfg.thinking, app.cfg.default_max_tokens) == (thinking, max_tokens), flags
        assert "has no chat format" in capsys.readouterr().err


def test_kernels_cuda_without_cupy_names_the_gpu_extra(art, monkeypatch, capfd):
    monkeypatch.setitem(sys.modules, "cupy", None)  # as if cupy were not installed
    code, events = _serve_main(["--model", str(art), "--port", "0", "--kernels", "cuda"],
                               monkeypatch)
    err = capfd.readouterr().err
    assert code == 2 and [e[0] for e in events] == ["listen", "load"], err
    assert err.startswith("mtplx serve: error: ") and len(err.splitlines()) == 1, err
    from mtplx_runtime.extras import install_hint

    assert "cupy is not installed" in err and install_hint("gpu") in err


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    status, body = _raw(server, "GET", "/health", key=None)
    assert status == 200 and json.loads(body)["status"] == "ok"


def test_completions_equal_generate(client, expected):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.choices[0].text == expected
    assert r.usage.completion_tokens <= 12
    chunks = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected


def test_chat_streaming_equals_non_streaming(server, client, art):
    msgs = [{"role": "user", "content": "hello"}]
    for thinking in (True, False):
        extra = {"chat_template_kwargs": {"thinking": thinking}}
        r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10,
                                           extra_body=extra)
        msg = r.choices[0].message
        reasoning = (msg.model_extra or {}).get("reasoning_content") or ""
        content, think = [], []
        for c in client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10,
                                                stream=True, extra_body=extra):
            d = c.choices[0].delta
            content.append(d.content or "")
            think.append((d.model_extra or {}).get("reasoning_content") or "")
        assert ("".join(content), "".join(think)) == (msg.content, reasoning)
        # Same as rendering + greedy generate_step in-process, split by channel.
        from mtplx_runtime.engine.chat import render_chat

        rt = server["rt"]
        ids, _ = generate(rt.model, render_chat(rt.tokenizer, msgs, thinking=thinking),
                          max_tokens=10, stop_ids=rt.tokenizer.stop_ids)
        ch = ChannelText(rt.tokenizer, thinking)
        parts = {"content": "", "reasoning": ""}
        for kind, s in [p for t in ids for p in ch.push(t)] + ch.flush():
            parts[kind] += s
        assert (msg.content, reasoning) == (parts["content"], parts["reasoning"])


def test_stop_sequence_and_sampling_params(client, expected):
    stop = expected[4:7]
    assert stop.strip(), expected
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, stop=[stop])
    assert r.choices[0].text == expected[:expected.find(stop)]
    assert r.choices[0].finish_reason == "stop"
    a, b = (client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0,
                                      top_p=0.9, seed=7).choices[0].text for _ in range(2))
    assert a == b  # seeded sampling is reproducible


def test_stop_filter_holds_back_prefixes():
    out = []
    f = StopFilter(["END"], lambda kind, s: out.append(s))
    for piece in ("abc E", "N", "x E", "ND tail"):
        f.push("content", piece)
    f.flush()
    assert "".join(out) == "abc ENx " and f.hit


def _first_stop(text: str, stops: list[str]) -> str:
    """The oracle: `text` up to the stop occurrence that ends first (of those ending at the
    same character, the longest), found by brute force."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            return text[:end - max(map(len, done))]
    return text


def _filtered(stops: list[str], pieces: list[str]) -> tuple[str, bool, list[str]]:
    out: list[str] = []
    f = StopFilter(stops, lambda kind, s: out.append(s))
    for piece in pieces:
        f.push("content", piece)
    f.flush()
    return "".join(out), f.hit, out


@settings(max_examples=400, deadline=None)
@given(st.lists(st.text("ab", min_size=1, max_size=6), min_size=1, max_size=4),
       st.lists(st.text("abc", max_size=5), max_size=12))
def test_stop_filter_matches_the_brute_force_oracle(stops, pieces):
    """Every way of cutting the text gives the oracle's answer, and nothing emitted is ever
    taken back (each emission extends the final text)."""
    text = "".join(pieces)
    got, hit, emitted = _filtered(stops, pieces)
    want = _first_stop(text, stops)
    assert (got, hit) == (want, want != text)
    assert _filtered(stops, list(text))[:2] == (got, hit)  # one character at a time
    assert _filtered(stops, [text])[:2] == (got, hit)  # all at once


def test_stop_filter_result_does_not_depend_on_the_cut():
    """"bc" ends before "abcd" does: the text stops at "bc" however it arrives (the old filter
    cut at "abcd" when both came in one piece)."""
    for pieces in (["abcd"], ["abc", "d"], ["a", "b", "c", "d"]):
        assert _filtered(["abcd", "bc"], pieces)[:2] == ("a", True)


@pytest.mark.parametrize("body,status,param", [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    ({"model": MODEL, "prompt": PROMPT, "temperature": "hot"}, 400, "temperature"),
    ({"model": MODEL, "prompt": PROMPT, "max_tokens": 1.5}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": PROMPT, "max_tokens": True}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": PROMPT, "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "prompt": {"a": 1}}, 400, "prompt"),
    ({"model": MODEL, "prompt": PROMPT, "stop": [1]}, 400, "stop"),
    ({"model": MODEL, "prompt": PROMPT, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"model": MODEL, "prompt": PROMPT, "stop": "x" * 1025}, 400, "stop"),  # over 1024 bytes
    ({"model": MODEL, "prompt": PROMPT, "stop": ["é" * 513]}, 400, "stop"),  # 1026 bytes
    ({"model": MODEL, "prompt": PROMPT, "max_tokens": 100000}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": PROMPT, "max_completion_tokens": 5000}, 400,
     "max_completion_tokens"),
    ({"model": MODEL, "prompt": PROMPT, "frequency_penalty": 2.5}, 400, "frequency_penalty"),
    ({"model": MODEL, "prompt": PROMPT, "presence_penalty": "x"}, 400, "presence_penalty"),
    ({"model": MODEL, "prompt": PROMPT, "response_format": {"type": "json_object"}}, 400,
     "response_format"),
    ({"model": MODEL, "prompt": PROMPT, "logit_bias": {"5": 100}}, 400, "logit_bias"),
    ({"model": MODEL, "prompt": PROMPT, "skip_special_tokens": "no"}, 400,
     "skip_special_tokens"),
    ({"model": MODEL, "prompt": PROMPT, "n": 2}, 400, "n"),
    ({"model": MODEL, "prompt": "word " * 5000}, 400, "prompt"),  # over the 4096 context
    ({"model": MODEL, "prompt": "x" * 70000}, 413, None),  # over --max-body-bytes
    ({"model": "gpt-4", "prompt": PROMPT}, 404, "model"),
])
def test_bad_completion_requests_get_4xx(server, body, status, param):
    got, payload = _raw(server, "POST", "/v1/completions", body)
    err = json.loads(payload)["error"]
    assert got == status, err
    assert err["message"] and err["type"] and err["param"] == param


@pytest.mark.parametrize("path,field", [("/v1/completions", "prompt"),
                                        ("/v1/chat/completions", "messages")])
def test_over_long_request_names_the_context_setting(server, path, field):
    text = "word " * 5000
    body = {"model": MODEL, "max_tokens": 12,
            field: text if field == "prompt" else [{"role": "user", "content": text}]}
    got, payload = _raw(server, "POST", path, body)
    err = json.loads(payload)["error"]
    assert got == 400 and err["code"] == "context_length_exceeded" and err["param"] == field
    tok = server["rt"].tokenizer
    if field == "prompt":
        n = len(tok.encode(text))
    else:
        from mtplx_runtime.engine.chat import render_chat

        n = len(render_chat(tok, body["messages"], thinking=server["app"].cfg.thinking))
    assert err["message"] == (
        f"the prompt has {n} tokens and max_tokens asks for 12; the server's --context is 4096 "
        "(tokens of prompt + reply): shorten the prompt, lower max_tokens, or start the server "
        "with a larger --context")


def _body_text(**fields) -> bytes:
    """A completion body with some fields written as raw JSON text (NaN, 1e999, ...)."""
    head = json.dumps({"model": MODEL, "prompt": PROMPT})[:-1]
    return (head + "".join(f', "{k}": {v}' for k, v in fields.items()) + "}").encode()


@pytest.mark.parametrize("stream", ["false", "true"])
@pytest.mark.parametrize("name,value", [
    ("temperature", "NaN"), ("temperature", "Infinity"), ("temperature", "-Infinity"),
    ("temperature", "1e999"), ("top_p", "NaN"), ("top_p", "-1e999"), ("top_p", "Infinity"),
    ("max_tokens", "NaN"), ("seed", "Infinity"),
])
def test_non_finite_numbers_are_400_before_any_stream(server, name, value, stream):
    got, payload = _raw(server, "POST", "/v1/completions",
                        _body_text(**{name: value, "stream": stream}))
    assert got == 400, payload
    err = json.loads(payload)["error"]
    assert err["param"] == name and err["type"] == "invalid_request_error", err


@pytest.mark.parametrize("fields", [
    {"temperature": "1e-300"}, {"temperature": "5e-324"}, {"temperature": "1e-30"},
    {"temperature": "1", "top_p": "1e-300"}, {"temperature": "5e-324", "top_p": "1e-300"},
])
def test_vanishing_temperature_or_top_p_is_greedy(server, fields, expected):
    got, payload = _raw(server, "POST", "/v1/completions", _body_text(max_tokens=12, **fields))
    assert got == 200, payload
    assert json.loads(payload)["choices"][0]["text"] == expected
    got, payload = _raw(server, "POST", "/v1/completions",
                        _body_text(max_tokens=12, stream="true", **fields))
    events = [json.loads(line[6:]) for line in payload.decode().splitlines()
              if line.startswith("data: {")]
    assert got == 200 and all("error" not in e for e in events), payload
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == expected


def _nested(levels: int, leaf: str = "1") -> str:
    return '{"a": ' * levels + leaf + "}" * levels


@pytest.mark.parametrize("levels", [100, 1200, 5000])
@pytest.mark.parametrize("field", ["messages", "tools"])
def test_deeply_nested_json_is_400(server, field, levels):
    msgs = '[{"role": "user", "content": "hi"}]'
    nested = "[" * levels + "]" * levels if field == "messages" else f"[{_nested(levels)}]"
    body = (f'{{"model": "{MODEL}", "messages": {msgs if field == "tools" else nested}'
            + (f', "tools": {nested}' if field == "tools" else "") + "}").encode()
    got, payload = _raw(server, "POST", "/v1/chat/completions", body)
    assert got == 400, payload[:200]
    err = json.loads(payload)["error"]
    assert err["code"] == "invalid_json" and "nested" in err["message"], err


def _nan_logits(method):
    def broken(*args, **kwargs):
        return method(*args, **kwargs) * float("nan")
    return broken


def test_non_finite_logits_are_an_error_not_empty_text(server, monkeypatch):
    model = server["rt"].model
    failed = server["engine"].counters.failed
    # At prefill: every answer, streamed or not, is a 500 with an OpenAI error body (no 200).
    monkeypatch.setattr(model, "prefill", _nan_logits(model.prefill))
    for stream in ("false", "true"):
        got, payload = _raw(server, "POST", "/v1/completions", _body_text(stream=stream))
        err = json.loads(payload)["error"]
        assert got == 500 and err["code"] == "model_error", payload
        assert "non-finite logits" in err["message"] and err["type"] == "server_error"
    got, payload = _raw(server, "POST", "/v1/chat/completions",
                        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                         "stream": True})
    assert got == 500 and json.loads(payload)["error"]["code"] == "model_error"
    monkeypatch.undo()
    # At decode, after the first token: the stream's 200 is out, so an error event ends it.
    monkeypatch.setattr(model, "decode", _nan_logits(model.decode))
    got, payload = _raw(server, "POST", "/v1/completions", _body_text(stream="true"))
    lines = [line for line in payload.decode().splitlines() if line.startswith("data: ")]
    assert got == 200 and lines[-1] == "data: [DONE]", payload
    assert json.loads(lines[-2][6:])["error"]["code"] == "model_error"
    got, payload = _raw(server, "POST", "/v1/completions", _body_text())
    assert got == 500 and json.loads(payload)["error"]["code"] == "model_error"
    assert server["engine"].counters.failed == failed + 5


def test_bad_chat_requests_and_routes(server, client):
    for body in ({"model": MODEL, "messages": "hi"},
                 {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
                 {"model": MODEL, "messages": [{"role": "user", "content": 3}]},
                 {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                  "reasoning_effort": "extreme"}):
        status, payload = _raw(server, "POST", "/v1/chat/completions", body)
        assert status == 400, payload
    assert _raw(server, "GET", "/v1/nothing")[0] == 404
    assert _raw(server, "GET", "/v1/chat/completions")[0] == 405
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user",
                                                                 "content": "x"}])
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=-1)
    assert e.value.body["param"] == "max_tokens"


def test_api_key_required(server, client):
    body = {"model": MODEL, "prompt": PROMPT}
    assert _raw(server, "POST", "/v1/completions", body, key=None)[0] == 401
    assert _raw(server, "POST", "/v1/completions", body, key="wrong")[0] == 401
    assert _raw(server, "GET", "/metrics", key=None)[0] == 401
    bad = openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0,
                        timeout=TIMEOUT)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_disconnect_mid_stream_frees_engine(server, client, expected):
    engine = server["engine"]
    cancelled = engine.counters.cancelled
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 3000, "stream": True,
                       "stop": ["never-appears-\x00"]}).encode()
    with socket.create_connection(("127.0.0.1", server["port"]), timeout=TIMEOUT) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                  + body)
        got = b""
        while got.count(b"data: ") < 2:
            chunk = s.recv(65536)
            assert chunk, got
            got += chunk
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12)
    assert r.choices[0].text == expected
    deadline = time.monotonic() + TIMEOUT
    while engine.counters.cancelled == cancelled:
        assert time.monotonic() < deadline, "the dropped generation was never cancelled"
        time.sleep(0.01)


def test_twenty_concurrent_clients(server, client, expected):
    def one(i):
        if i % 2:
            chunks = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                               stream=True)
            return "".join(c.choices[0].text for c in chunks if c.choices)
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12).choices[0].text

    with ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(one, range(20), timeout=2 * TIMEOUT))
    assert answers == [expected] * 20


def test_metrics(server):
    status, body = _raw(server, "GET", "/metrics")
    text = body.decode()
    assert status == 200
    for name in ('mtplx_cache_hit_rate{tier="compute"}', "mtplx_ssd_bytes_read_total",
                 "mtplx_prefetch_coverage", "mtplx_queue_depth", "mtplx_generated_tokens_total",
                 "mtplx_decode_tokens_per_second"):
        assert name in text
    assert server["engine"].depth == 0


def test_engine_queue_bound_and_failures_do_not_kill_it(server, caplog):
    from types import SimpleNamespace

    from mtplx_runtime.server.worker import Engine, QueueFull, Request

    gate = threading.Event()

    class Boom:  # blocks in its first call until released, then raises
        def new_state(self):
            gate.wait(TIMEOUT)
            raise RuntimeError("boom")

    rt = SimpleNamespace(tokenizer=server["rt"].tokenizer, model=Boom(), trace=None, provider=None)
    engine = Engine(rt, max_queue=1)
    try:
        first = Request(prompt_ids=[1], max_tokens=2)
        engine.submit(first)
        deadline = time.monotonic() + TIMEOUT
        while engine.running is not first:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        engine.submit(Request(prompt_ids=[1], max_tokens=2))
        with pytest.raises(QueueFull):
            engine.submit(Request(prompt_ids=[1], max_tokens=2))
        gate.set()
        while engine.counters.failed < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        gate.set()
        engine.close()
    assert engine.counters.failed == 2
    logged = [r for r in caplog.records if r.name == "mtplx_runtime.server.worker"]
    assert len(logged) == 2 and all("boom" in str(r.exc_info[1]) for r in logged)


# ---- slow and incomplete clients ---------------------------------------------------------------

@contextlib.contextmanager
def _serve(app, **limits):
    """Another uvicorn server over `app` on 127.0.0.1 with connection `limits` (make_server)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = make_server(app, host="127.0.0.1", port=sock.getsockname()[1], **limits)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + TIMEOUT
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    try:
        yield sock.getsockname()[1]
    finally:
        srv.should_exit = True
        thread.join(TIMEOUT)
        sock.close()
    assert not thread.is_alive()


LIFETIME = 4 * TIMEOUT  # the longest a trickler keeps going (a bound, not a timing)
SLOW_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow-"


class Tricklers:
    """`n` connections that each send `first` (part of a request), then one more header-name
    byte every `interval` s on a helper thread, until the server closes them, `close()`, or
    LIFETIME s. `answers[i]` is what the server sent on connection i before closing it."""

    def __init__(self, port: int, n: int, first: bytes, interval: float = 0.05):
        self.socks = []
        for _ in range(n):
            s = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
            s.sendall(first)
            self.socks.append(s)
        self.answers: dict[int, bytes] = {}
        self._got = {i: b"" for i in range(n)}
        self._stop = threading.Event()
        self._interval = interval
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        deadline = time.monotonic() + LIFETIME
        while not self._stop.is_set() and time.monotonic() < deadline:
            live = {s: i for i, s in enumerate(self.socks) if i not in self.answers}
            if not live:
                return
            readable, _, _ = select.select(list(live), [], [], self._interval)
            for s in readable:  # the server answered or closed: read up to its close
                try:
                    chunk = s.recv(65536)
                except OSError:
                    chunk = b""
                if chunk:
                    self._got[live[s]] += chunk
                else:
                    self.answers[live[s]] = self._got[live[s]]
            for s in live:
                if s not in readable:
                    with contextlib.suppress(OSError):  # closed under us: read next round
                        s.send(b"a")

    def wait(self, count: int) -> None:
        """Until the server has closed `count` of the connections (fails after TIMEOUT s)."""
        deadline = time.monotonic() + TIMEOUT
        while len(self.answers) < count:
            assert time.monotonic() < deadline and self._thread.is_alive(), \
                f"{len(self.answers)} of {len(self.socks)} closed, waiting for {count}"
            time.sleep(0.02)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(TIMEOUT)
        for s in self.socks:
            s.close()


def _is_408(answer: bytes) -> bool:
    head, _, body = answer.partition(b"\r\n\r\n")
    return (head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head.lower()
            and json.loads(body)["error"]["code"] == "request_timeout")


def test_trickling_clients_cannot_lock_out_complete_requests(server, expected):
    """30 slow heads against a cap of 16 (and deadlines far away): the longest-incomplete are
    shed with 408 so a complete request still gets its answer, never a 503."""
    with _serve(server["app"], max_connections=16, header_timeout=600, body_timeout=600) as port:
        slow = Tricklers(port, 30, SLOW_HEAD)
        try:
            slow.wait(30 - 15)  # the server holds 15 of them, one slot under the cap
            assert all(_is_408(a) for a in slow.answers.values()), slow.answers
            shed = set(slow.answers)
            assert shed == set(range(len(shed))), shed  # the oldest went first
            for _ in range(3):
                got, payload = _raw({"port": port}, "POST", "/v1/completions",
                                    {"model": MODEL, "prompt": PROMPT, "max_tokens": 12})
                assert got == 200, payload
                assert json.loads(payload)["choices"][0]["text"] == expected
            slow.wait(30 - 15 + 1)  # the first complete request took a trickler's slot
            assert all(_is_408(a) for a in slow.answers.values())
        finally:
            slow.close()


def test_slow_heads_and_bodies_get_408(server):
    """Short deadlines: 20 trickling heads, a body that stops at 9 of 1000 bytes, a partial
    second head on a keep-alive connection all get 408 and are closed; a silent connection is
    closed; a complete request meanwhile gets 200."""
    with _serve(server["app"], max_connections=64, header_timeout=1.5, body_timeout=1.5) as port:
        slow = Tricklers(port, 20, SLOW_HEAD)
        try:
            body = Tricklers(port, 1, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                             b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Type: "
                             b"application/json\r\nContent-Length: 1000\r\n\r\n{\"model\": ",
                             interval=TIMEOUT)  # sends nothing after the first 9 body bytes
            silent = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
            keep = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
            assert _raw({"port": port}, "GET", "/health")[0] == 200
            keep.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            first = keep.recv(65536)
            assert first.startswith(b"HTTP/1.1 200 "), first
            keep.sendall(b"GET /hea")  # the next request stalls mid-head
            slow.wait(20)
            body.wait(1)
            assert all(_is_408(a) for a in slow.answers.values()), slow.answers
            assert _is_408(body.answers[0]), body.answers
            assert silent.recv(65536) == b""  # nothing sent: closed without a response
            rest = b""
            while chunk := keep.recv(65536):
                rest += chunk
            assert _is_408(rest), rest
        finally:
            slow.close()
            body.close()


@pytest.mark.parametrize("flag", ["--header-timeout", "--body-timeout"])
@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_timeout_flags_are_checked(art, flag, value):
    from mtplx_runtime.cli.common import CliError

    parser = argparse.ArgumentParser()
    add_args(parser)
    with pytest.raises(CliError, match=flag):
        build(parser.parse_args(["--model", str(art), flag, value]), None)


# ---- access log ---------------------------------------------------------------------------------

LOG_LINE = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d 127\.0\.0\.1:(\d+) (\S+) (\S+) (\S+) "
                      r"\d+\.\d{3}s (\d+)B")


def _logged(lines: list[str], count: int) -> list[tuple[str, ...]]:
    """The first `count` access-log lines parsed to (method, target, status, bytes); waits (up to
    TIMEOUT s) for lines written once the app has finished (client gone, late body)."""
    deadline = time.monotonic() + TIMEOUT
    while len(lines) < count:
        assert time.monotonic() < deadline, lines
        time.sleep(0.02)
    parsed = [LOG_LINE.fullmatch(line) for line in lines[:count]]
    assert all(parsed), lines
    return [m.groups()[1:] for m in parsed]


def test_access_log_one_line_per_request(server):
    from mtplx_runtime.server.access import AccessLog

    lines: list[str] = []
    engine = server["engine"]
    with _serve(AccessLog(server["app"], lines.append), body_timeout=1.5) as port:
        at = {"port": port}
        answers = [_raw(at, "GET", "/health", key=None),
                   _raw(at, "POST", "/v1/completions", {"model": MODEL, "prompt": PROMPT}),
                   _raw(at, "POST", "/v1/completions",
                        {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "stream": True}),
                   _raw(at, "GET", "/v1/models", key="wrong"),
                   _raw(at, "GET", "/v1/no%0Awhere?x=%0A1")]
        # Each line is written before the answer's last bytes: all are in already.
        assert _logged(lines, 5) == [
            ("GET", "/health", "200", str(len(answers[0][1]))),
            ("POST", "/v1/completions", "200", str(len(answers[1][1]))),
            ("POST", "/v1/completions", "200", str(len(answers[2][1]))),
            ("GET", "/v1/models", "401", str(len(answers[3][1]))),
            ("GET", "/v1/no%0Awhere?x=%0A1", "404", str(len(answers[4][1])))]  # as sent
        assert [a[0] for a in answers] == [200, 200, 200, 401, 404]
        # A body that stops short: server/conn answers 408 and the line says so.
        with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                      + KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{")
            late = b""
            while chunk := s.recv(65536):
                late += chunk
        assert _is_408(late), late
        assert _logged(lines, 6)[5] == ("POST", "/v1/completions", "408",
                                        str(len(late.partition(b"\r\n\r\n")[2])))
        # A client that leaves before its answer: status "-", no bytes.
        body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 3000,
                           "stop": ["never-appears-\x00"]}).encode()
        with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/json\r\nAuthorization: Bearer " + KEY.encode()
                      + f"\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            deadline = time.monotonic() + TIMEOUT
            while engine.running is None:
                assert time.monotonic() < deadline, "the request never reached the engine"
                time.sleep(0.01)
        assert _logged(lines, 7)[6] == ("POST", "/v1/completions", "-", "0")
    assert all("\n" not in line for line in lines)


def test_a_request_without_max_tokens_gets_the_rest_of_the_context(server):
    """As vLLM: no max_tokens (and no server --max-tokens) means up to --context minus the
    prompt, never a silent 64-token cut; a prompt that fills the context is a 400 naming it."""
    from mtplx_runtime.server.app import ServerConfig
    from mtplx_runtime.server.params import ApiError, chat_params, completion_params

    tok = server["rt"].tokenizer
    cfg = ServerConfig(model_id=MODEL, context=200)
    n = len(tok.encode(PROMPT))
    p = completion_params({"model": MODEL, "prompt": PROMPT}, cfg, tok)
    assert p["request"]["max_tokens"] == 200 - n
    asked = completion_params({"model": MODEL, "prompt": PROMPT, "max_tokens": 3}, cfg, tok)
    assert asked["request"]["max_tokens"] == 3
    msgs = [{"role": "user", "content": PROMPT}]
    c = chat_params({"model": MODEL, "messages": msgs}, cfg, tok)
    assert c["request"]["max_tokens"] == 200 - len(c["request"]["prompt_ids"])
    with pytest.raises(ApiError, match="leaves no room for a reply") as e:
        completion_params({"model": MODEL, "prompt": PROMPT},
                          ServerConfig(model_id=MODEL, context=n), tok)
    assert e.value.status == 400


def test_a_prompt_the_tokenizer_cannot_encode_is_a_400(server):
    """The tokenizer refuses text its pattern cannot split (engine/tokenizer TokenizerError):
    the request gets a 400 naming the prompt, not a 500."""
    from mtplx_runtime.engine.tokenizer import TokenizerError
    from mtplx_runtime.server.app import ServerConfig
    from mtplx_runtime.server.params import ApiError, completion_params

    class Refusing:
        vocab_size = 10

        def encode(self, text):
            raise TokenizerError("tiktoken.model: pat_str cannot split this text")

    with pytest.raises(ApiError, match="cannot encode the prompt: .*pat_str") as e:
        completion_params({"model": MODEL, "prompt": PROMPT}, ServerConfig(model_id=MODEL),
                          Refusing())
    assert e.value.status == 400 and e.value.param == "prompt"


# ---- OpenAI defaults, sampling fields, special tokens ------------------------------------------

def test_refusals_name_the_limit(server):
    """A stop sequence over the cap, a max_tokens past --context, an unsupported
    response_format: each 400 names what to change."""
    for body, param, words in (
            ({"stop": ["ok", "x" * 1025]}, "stop", "at most 1024 bytes (UTF-8); this one has 1025"),
            ({"max_tokens": 100000}, "max_tokens", "max_tokens is 100000, more than the server's "
                                                   "--context of 4096 tokens"),
            ({"response_format": {"type": "json_schema"}}, "response_format",
             'only {"type": "text"} is supported')):
        got, payload = _raw(server, "POST", "/v1/completions",
                            {"model": MODEL, "prompt": PROMPT, **body})
        err = json.loads(payload)["error"]
        assert got == 400 and err["param"] == param and words in err["message"], err
    got, payload = _raw(server, "POST", "/v1/completions",
                        {"model": MODEL, "prompt": PROMPT, "max_tokens": 2,
                         "response_format": {"type": "text"}})
    assert got == 200, payload


def test_model_is_optional(server, expected):
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for path, field in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", chat)):
        got, payload = _raw(server, "POST", path, {**field, "max_tokens": 12})
        assert got == 200, payload
        assert json.loads(payload)["model"] == MODEL
    got, payload = _raw(server, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 12})
    assert json.loads(payload)["choices"][0]["text"] == expected


def test_openai_defaults_sample_with_a_fresh_seed_that_repeats(server):
    """Without --temperature the server samples at OpenAI's temperature 1; a request without a
    seed gets a fresh one, returned as `seed`, and sending it back repeats the answer."""
    from mtplx_runtime.server.app import App, ServerConfig

    app = App(server["engine"], ServerConfig(model_id=MODEL, api_key=KEY, context=4096))
    with _serve(app) as port:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY,
                               max_retries=0, timeout=TIMEOUT)
        runs = [client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8)
                for _ in range(2)]
        seeds = [r.model_extra["seed"] for r in runs]
        assert seeds[0] != seeds[1] and runs[0].choices[0].text != runs[1].choices[0].text
        again = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8,
                                          seed=seeds[0])
        assert again.choices[0].text == runs[0].choices[0].text
        assert again.model_extra["seed"] == seeds[0]
        chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8,
                                                seed=seeds[1], stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == \
            runs[1].choices[0].text
        assert {c.model_extra["seed"] for c in chunks} == {seeds[1]}
        greedy = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8,
                                           temperature=0)
        assert "seed" not in greedy.model_extra  # greedy draws nothing


def test_penalties_reach_the_engine(server, client):
    """frequency_penalty and presence_penalty are applied (OpenAI's formula, engine-tested in
    test_generate): the served greedy text equals generate_step's with the same penalties."""
    rt = server["rt"]
    ids = rt.tokenizer.encode(PROMPT)
    for fp, pp in ((-2.0, 0.0), (0.0, -2.0)):
        want, _ = generate(rt.model, ids, max_tokens=6, frequency_penalty=fp, presence_penalty=pp,
                           stop_ids=rt.tokenizer.stop_ids)
        plain, _ = generate(rt.model, ids, max_tokens=6, stop_ids=rt.tokenizer.stop_ids)
        assert want != plain  # the penalty changes this text
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6,
                                      frequency_penalty=fp, presence_penalty=pp)
        assert r.choices[0].text == rt.tokenizer.decode(want, skip_special=True)


def test_completions_skip_special_tokens_unless_asked(server, client):
    rt = server["rt"]
    ids, _ = generate(rt.model, rt.tokenizer.encode(PROMPT), max_tokens=3,
                      stop_ids=rt.tokenizer.stop_ids)
    kept = rt.tokenizer.decode(ids)
    assert "<|reserved_token_" in kept  # this prompt's reply starts with a special id
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
    assert r.choices[0].text == rt.tokenizer.decode(ids, skip_special=True) != kept
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3,
                                  extra_body={"skip_special_tokens": False})
    assert r.choices[0].text == kept


# ---- API key, head size, stopping -------------------------------------------------------------

def test_api_key_from_env_or_file_never_the_command_line(art, tmp_path, monkeypatch):
    from mtplx_runtime.cli.common import CliError

    parser = argparse.ArgumentParser()
    add_args(parser)

    def key(*argv):
        return api_key(parser.parse_args(["--model", str(art), *argv]))

    monkeypatch.delenv("MTPLX_API_KEY", raising=False)
    assert key() is None
    monkeypatch.setenv("MTPLX_API_KEY", "sk-env")
    assert key() == "sk-env"
    assert key("--api-key", "sk-flag") == "sk-flag"  # a flag wins over the environment
    (tmp_path / "k").write_text("sk-file \nsecond line\n")
    assert key("--api-key-file", str(tmp_path / "k")) == "sk-file"
    (tmp_path / "empty").write_text("\n")
    for argv, words in ((["--api-key-file", str(tmp_path / "empty")], "the API key is empty"),
                        (["--api-key-file", str(tmp_path / "none")], "No such file")):
        with pytest.raises(CliError, match=words):
            key(*argv)
    monkeypatch.setenv("MTPLX_API_KEY", "")
    with pytest.raises(CliError, match=r"\$MTPLX_API_KEY: the API key is empty"):
        key()
    with pytest.raises(SystemExit):  # one source on the command line
        key("--api-key", "a", "--api-key-file", str(tmp_path / "k"))


def test_serve_reads_the_api_key_file_once(art, tmp_path, monkeypatch):
    """`mtplx serve --api-key-file <(pass show k3)`: main reads the key before the model loads
    and build takes that key; a second read (the pipe is empty by then, here: the file is gone)
    would refuse the key after minutes of loading."""
    monkeypatch.delenv("MTPLX_API_KEY", raising=False)
    (tmp_path / "k").write_text("sk-once\n")
    parser = argparse.ArgumentParser()
    add_args(parser)
    args = parser.parse_args(["--model", str(art), "--dtype", "float32",
                              "--api-key-file", str(tmp_path / "k")])
    key = api_key(args)
    (tmp_path / "k").unlink()
    app, engine, rt = build(args, key)
    try:
        assert app.cfg.api_key == "sk-once"
    finally:
        engine.close()
        rt.close()


def test_api_key_compared_in_constant_time(server, monkeypatch):
    import hmac

    from mtplx_runtime.server import app as app_module

    seen, real = [], hmac.compare_digest

    def compare(a, b):
        seen.append((a, b))
        return real(a, b)

    monkeypatch.setattr(app_module.hmac, "compare_digest", compare)
    assert _raw(server, "GET", "/v1/models", key="sk-wrong")[0] == 401
    assert _raw(server, "GET", "/v1/models")[0] == 200
    assert seen == [(b"Bearer sk-wrong", f"Bearer {KEY}".encode()),
                    (f"Bearer {KEY}".encode(), f"Bearer {KEY}".encode())]


@pytest.mark.parametrize("size,status", [(15 * 1024, 200), (17 * 1024, 400), (60 * 1024, 400)])
def test_request_head_over_16_kib_is_400_even_in_one_read(server, size, status):
    head = (b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: " + b"a" * size
            + b"\r\nConnection: close\r\n\r\n")
    with socket.create_connection(("127.0.0.1", server["port"]), timeout=TIMEOUT) as s:
        s.sendall(head)  # the whole head in one write: one read on loopback
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    assert got.startswith(f"HTTP/1.1 {status} ".encode()), got[:200]


def test_a_refused_head_followed_by_more_bytes_still_gets_its_400(server):
    """The server drains what the client keeps sending after a 400 instead of closing on
    unread bytes, which would reset the connection and could destroy the 400 unread."""
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * (60 * 1024) + b"\r\n"
    with socket.create_connection(("127.0.0.1", server["port"]), timeout=TIMEOUT) as s:
        s.sendall(head + b"X-More: " + b"b" * (4 << 20))  # more than any socket buffer holds
        s.shutdown(socket.SHUT_WR)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and b"connection: close" in head, got[:300]
    assert json.loads(body)["error"]["code"] == "invalid_request"


def test_stopping_answers_a_half_sent_request_with_503(server):
    """A client still sending its body when the server stops gets 503 at once: the shutdown
    does not wait out its body deadline."""
    with _serve(server["app"], body_timeout=600) as port:
        s = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                  + KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{")
        time.sleep(0.2)  # not a timing check: lets the head reach the app before the stop
    got = b""
    while chunk := s.recv(65536):
        got += chunk
    s.close()
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 ") and b"retry-after: 30" in head.lower(), got
    assert json.loads(body)["error"]["code"] == "server_shutting_down"
