"""Every storage / checkpoint / formats / profile module imports first, alone, in a fresh
interpreter: import cycles between the checkpoint reader and the bank layer once made the order
of imports matter (tests passed only because another module had been imported first)."""

import pkgutil
import subprocess
import sys

import mtplx_runtime

PACKAGES = ("checkpoint", "formats", "storage", "profile")


def test_each_module_imports_alone():
    names = [m.name for m in pkgutil.walk_packages(mtplx_runtime.__path__, "mtplx_runtime.")
             if m.name.split(".")[1] in PACKAGES]
    assert len(names) > 20
    # One interpreter per module (that is the point), all started at once to keep it quick.
    procs = {n: subprocess.Popen([sys.executable, "-c", f"import {n}"], stderr=subprocess.PIPE,
                                 text=True) for n in names}
    failed = {n: p.communicate(timeout=120)[1].strip().splitlines()[-1:]
              for n, p in procs.items() if p.wait(timeout=120) != 0}
    assert not failed, failed
