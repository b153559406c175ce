"""Ctrl-C on the real commands, in real processes: a signal's handling lives
between processes (the terminal, the shell, the client), so none of this is faked.

Ctrl-C is typed into a pseudo-terminal (`Terminal`): the child runs as a shell would run it, in
its own session with the terminal as its controlling terminal, so the `\\x03` written there
becomes SIGINT from the terminal driver, echo and all. The tiny random K3 keeps every process to a
few seconds.
"""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import time

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

