"""Running a case under a memory limit and a hang guard (tests/test_fuzz.py, test_hostile.py).

`bounded()` lowers RLIMIT_DATA to what the process holds now plus CASE_MEMORY_BYTES, so a
reader that allocates what a small file declares fails with MemoryError (no documented error)
instead of taking the machine, and arms a generous timeout: SIGALRM raises CaseHung in the main
thread, and if a native call never returns, faulthandler ends the run with every thread's
stack. Neither is a speed assertion."""

from __future__ import annotations

import contextlib
import faulthandler
import resource
import signal
import sys

CASE_MEMORY_BYTES = 2 << 30  # far above what any valid input of the tests needs (a few MB)
CASE_TIMEOUT_S = 120  # a hang guard: every case takes milliseconds to seconds


class CaseHung(Exception):
    """A case still running after CASE_TIMEOUT_S."""


def _data_bytes() -> int:
    """This process's data segment and private mappings now (what RLIMIT_DATA counts)."""
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmData:"))


def _hung(signum, frame):
    raise CaseHung(f"a case ran longer than {CASE_TIMEOUT_S} s")


@contextlib.contextmanager
def bounded(memory_bytes: int = CASE_MEMORY_BYTES, timeout_s: float = CASE_TIMEOUT_S):
    """Run the body under the memory limit and the timeout (call it from the main thread)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = _data_bytes() + memory_bytes
    resource.setrlimit(resource.RLIMIT_DATA,
                       (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    old = signal.signal(signal.SIGALRM, _hung)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    faulthandler.dump_traceback_later(4 * timeout_s, exit=True, file=sys.__stderr__)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
