"""Ctrl-C and SIGTERM on the real commands, in real processes: a signal's handling lives
between processes (the terminal, the shell, the client), so none of this is faked.

Ctrl-C is typed into a pseudo-terminal (`Terminal`): the child runs as a shell would run it, in
its own session with the terminal as its controlling terminal, so the `\\x03` written there
becomes SIGINT from the terminal driver, echo and all. The server is driven with the openai
client; the tiny random K3 keeps every process to a few seconds.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from mtplx_runtime.fixtures.tiny import make_tiny

PROMPT = "The expert cache reads ahead of the router"
TIMEOUT = 60
# Run the command with the pseudo-terminal (its stdin) as the controlling terminal, as a shell's
# job would; start_new_session made the child a session leader, which that needs.
_CONTROLLING_TTY = ("import fcntl, os, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
                    "os.execv(sys.argv[1], sys.argv[1:])")


class Terminal:
    """`python -m mtplx_runtime ARGV` on a new pseudo-terminal; `out` is all it printed
    (stdout and stderr, line ends as written: the terminal's \\r\\n becomes \\n)."""

    def __init__(self, *argv: str):
        master, slave = os.openpty()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _CONTROLLING_TTY, sys.executable, "-m", "mtplx_runtime",
             *argv], stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
        os.close(slave)
        self.fd, self._raw = master, b""

    @property
    def out(self) -> str:
        return self._raw.replace(b"\r\n", b"\n").decode("utf-8", "replace")

    def _read(self, timeout: float) -> bool:
        """Read what is there within `timeout` s; False once the terminal closed."""
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return True
        try:
            chunk = os.read(self.fd, 65536)
        except OSError:  # EIO: every process holding the terminal has exited
            return False
        self._raw += chunk
        return bool(chunk)

    def expect(self, pattern: str) -> re.Match:
        """Read until `pattern` matches the output (fails after TIMEOUT s or at the end)."""
        deadline = time.monotonic() + TIMEOUT
        while not (m := re.search(pattern, self.out)):
            assert time.monotonic() < deadline and self._read(0.1), self.out
        return m

    def ctrl_c(self) -> None:
        os.write(self.fd, b"\x03")

    def wait(self) -> int:
        """Read to the end; the exit status."""
        deadline = time.monotonic() + TIMEOUT
        while self._read(0.1):
            assert time.monotonic() < deadline, self.out
        return self.proc.wait(TIMEOUT)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.fd)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("signals") / "t158", "t158").path


@pytest.fixture(scope="module")
def art(tiny, tmp_path_factory):
    from mtplx_runtime.artifact.build import build_artifact

    out = tmp_path_factory.mktemp("signals-art") / "art"
    build_artifact(tiny, out, progress=False)
    return out


# A Ctrl-C that lands while `mtplx` starts: the child sends itself SIGINT just as a module
# begins to import (torch while the flags are parsed; the model's code while it loads).
_INTERRUPT_AT_IMPORT = """
import os, signal, sys

class Interrupt:
    def find_spec(self, name, path=None, target=None):
        if name == sys.argv[1]:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, Interrupt())
from mtplx_runtime.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize("module,argv", [
    ("numpy", ["generate", "--prompt", "hi"]),  # the first import `mtplx` makes past the stdlib
    ("torch", ["generate", "--prompt", "hi"]),
    ("torch", ["serve", "--port", "0"]),
    ("torch", ["chat"]),
    ("torch", ["inspect"]),
    ("mtplx_runtime.model.kimi_k3", ["generate", "--prompt", "hi"]),
])
def test_ctrl_c_while_starting_is_one_line_and_130(tiny, module, argv):
    r = subprocess.run([sys.executable, "-c", _INTERRUPT_AT_IMPORT, module, *argv, str(tiny)],
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert (r.returncode, r.stderr) == (130, f"mtplx {argv[0]}: interrupted\n"), r.stderr


def test_ctrl_c_in_generate_ends_the_line_and_prints_the_stats(tiny):
    term = Terminal("generate", str(tiny), "--prompt", PROMPT, "--dtype", "float32",
                    "--max-tokens", "3000")
    try:
        term.expect(r"\S")  # text is streaming
        term.ctrl_c()
        assert term.wait() == 130
    finally:
        term.close()
    out = term.out
    text, _, stats = out.rpartition("\nmtplx generate: ")  # the stats start their own line
    m = re.fullmatch(r"prompt \d+ tok, generated (\d+) tok; .*; stop: Ctrl-C\n", stats)
    assert m and 0 < int(m[1]) < 3000, out
    assert "Traceback" not in out and "interrupted" not in out


def _health(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=TIMEOUT) as r:
        return json.loads(r.read())


def _serve(art) -> tuple[Terminal, int]:
    term = Terminal("serve", str(art), "--dtype", "float32", "--port", "0",
                    "--served-model-name", "tiny", "--temperature", "0")
    port = int(term.expect(r"mtplx serve: tiny on http://127\.0\.0\.1:(\d+)/v1\n")[1])
    return term, port


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_stopping_serve_aborts_streams_and_answers_the_queue_503(art, how):
    """A stream under way ends with finish_reason "abort", a queued request gets 503 with
    Retry-After, the server exits (130 after Ctrl-C, 0 after SIGTERM) with one line."""
    openai = pytest.importorskip("openai")
    term, port = _serve(art)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               max_retries=0, timeout=TIMEOUT)
        stream = iter(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3000,
                                                stop=["never-appears-\x00"], stream=True))
        next(stream)
        queued: dict = {}

        def wait_in_queue():
            try:
                client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4)
            except openai.APIStatusError as e:
                queued["error"] = e

        waiter = threading.Thread(target=wait_in_queue)
        waiter.start()
        deadline = time.monotonic() + TIMEOUT
        while _health(port)["queue_depth"] < 1:
            assert time.monotonic() < deadline, "the second request never queued"
            time.sleep(0.02)
        term.ctrl_c() if how == "ctrl-c" else term.proc.send_signal(signal.SIGTERM)
        rest = list(stream)
        waiter.join(TIMEOUT)
        assert term.wait() == (130 if how == "ctrl-c" else 0)
    finally:
        term.close()
    assert rest[-1].choices[0].finish_reason == "abort" and len(rest) < 2999
    e = queued["error"]
    assert e.status_code == 503 and e.response.headers["retry-after"] == "30"
    assert e.body["code"] == "server_shutting_down"
    after = term.out.split("/v1\n", 1)[1].replace("^C", "")
    name = "SIGINT" if how == "ctrl-c" else "SIGTERM"
    assert after.startswith(f"mtplx serve: {name}: stopping; requests in flight are aborted")
    assert after.count("\n") == 1, after  # one line, no traceback


def test_a_second_ctrl_c_quits_serve_at_once(art):
    openai = pytest.importorskip("openai")
    term, port = _serve(art)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               max_retries=0, timeout=TIMEOUT)
        stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3000,
                                           stop=["never-appears-\x00"], stream=True)
        next(iter(stream))
        term.ctrl_c()
        term.expect("stopping")  # the first was handled (when the second lands varies)
        term.ctrl_c()
        assert term.wait() == 130
        stream.close()
    finally:
        term.close()
    after = term.out.split("/v1\n", 1)[1].replace("^C", "")
    assert after.count("\n") <= 1 and "Traceback" not in after, after


# A server whose app never finishes its answer (as a client that stopped reading a stream
# would hold it): the first SIGINT must still end the process within the deadline, quietly.
_HANGING_APP = """
import asyncio, sys
from mtplx_runtime.cli.serve import listen_socket, make_server

async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        return await send({"type": "lifespan.shutdown.complete"})
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"begun", "more_body": True})
    await asyncio.Event().wait()  # never sends the rest

sock = listen_socket("127.0.0.1", 0)
print(sock.getsockname()[1], flush=True)
server = make_server(app, port=sock.getsockname()[1], shutdown_s=float(sys.argv[1]),
                     on_stop=lambda signum: print("stopping", signum, flush=True))
server.run(sockets=[sock])
print("returned", server.stop_signal, flush=True)
"""


@pytest.mark.parametrize("signals,code,out", [
    ([signal.SIGINT], 0, "stopping 2\nreturned 2\n"),  # the deadline (1 s) drops the answer
    ([signal.SIGTERM, signal.SIGINT], 130, "stopping 15\n"),  # the second quits at once
])
def test_a_hung_answer_is_dropped_at_the_deadline_or_the_second_signal(signals, code, out):
    import socket

    deadline_s = "1" if len(signals) == 1 else str(10 * TIMEOUT)  # the second must not wait
    proc = subprocess.Popen([sys.executable, "-c", _HANGING_APP, deadline_s],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as s:
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            got = b""
            while b"begun" not in got:
                got += s.recv(65536)
            proc.send_signal(signals[0])
            assert proc.stdout.readline() == f"stopping {signals[0]}\n"
            for signum in signals[1:]:
                proc.send_signal(signum)
            rest, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert (proc.returncode, f"stopping {signals[0]}\n" + rest, err) == (code, out, "")
