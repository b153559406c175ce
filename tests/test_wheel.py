"""A non-editable install works: build a wheel of the project (offline, from a copy of the tree so
nothing is written into the checkout), install it into a temporary directory, and run
`python -m mtplx_runtime demo --kernels cpu` from outside the repo with only that directory on
the path. The demo must import the installed package, build the CPU kernel library from the
sources the wheel ships (into the user cache, not into the install) and run with it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Not part of a build: version control, environments, caches and earlier build outputs.
IGNORE = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__",
                                ".pytest_cache", ".ruff_cache", ".hypothesis", ".mtplx-cache")


def _run(cmd, *, both: bool = False, **kw):
    """stdout of a command that must succeed; (stdout, stderr) with `both`."""
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)
    assert p.returncode == 0, f"{' '.join(map(str, cmd))}\n{p.stdout}\n{p.stderr}"
    return (p.stdout, p.stderr) if both else p.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(site, wheel): the wheel built from a copy of the tree, installed into `site`."""
    if shutil.which(os.environ.get("CC", "gcc")) is None:
        pytest.skip("no C compiler: the cpu kernels cannot be built")
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=IGNORE)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
          "--no-index", "-q", "-w", str(tmp / "dist"), str(src)])
    (wheel,) = (tmp / "dist").glob("mtplx_runtime-*.whl")
    site = tmp / "site"
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
          "--target", str(site), str(wheel)])
    return site, wheel


def test_wheel_ships_the_kernel_sources(installed):
    _, wheel = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in (ROOT / "mtplx_runtime" / "kernels" / "native").rglob("*"):
        if f.is_file() and "__pycache__" not in f.parts:
            assert f.relative_to(ROOT).as_posix() in names, f


def test_installed_demo_runs_with_cpu_kernels(installed, tmp_path):
    site, _ = installed
    run_dir, cache = tmp_path / "run", tmp_path / "xdg"
    run_dir.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "MTPLX_KERNELS", "MTPLX_NATIVE_DIR", "MTPLX_CPU_ISA")}
    env.update(PYTHONPATH=str(site), PYTHONNOUSERSITE="1", XDG_CACHE_HOME=str(cache))
    before = {p for p in ROOT.rglob("*") if ".git" not in p.parts}

    probe = ("import mtplx_runtime, mtplx_runtime.kernels.cpu_build as b; "
             "print(mtplx_runtime.__file__); print(b.SRC_DIR)")
    module, src_dir = _run([sys.executable, "-c", probe], cwd=run_dir, env=env).split()
    assert Path(module).is_relative_to(site), module
    assert Path(src_dir) == site / "mtplx_runtime" / "kernels" / "native" / "cpu"

    out, err = _run([sys.executable, "-m", "mtplx_runtime", "demo", "--kernels", "cpu",
                     "--cache-dir", str(tmp_path / "demo"), "--max-tokens", "4"],
                    cwd=run_dir, env=env, both=True)
    assert "kernels cpu" in out, out
    # The first run says what takes its time (the build, the kernel compile), once; the text
    # points to nothing a wheel lacks (the repository's .md files).
    assert "mtplx: compiling the native CPU kernels, once" in err, err
    assert "mtplx demo: building " in err and ".md" not in out, (out, err)
    # The library was built from the installed sources into the user cache, not the install.
    assert len(list((cache / "mtplx" / "native").glob("mtplx_cpu-*.so"))) == 1
    assert not list(site.rglob("*.so"))
    assert {p for p in ROOT.rglob("*") if ".git" not in p.parts} == before


def test_installed_wheel_finds_its_presets_and_names_its_extras(installed, tmp_path):
    """A wheel ships the presets (`--config NAME` works outside a checkout) and its hints name
    `pip install 'mtplx_runtime[extra]'`, not a checkout's `pip install -e .[extra]`."""
    site, _ = installed
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(site), PYTHONNOUSERSITE="1")
    probe = ("from mtplx_runtime.engine import presets; from mtplx_runtime.extras import "
             "install_hint; print(presets.load('k3-t158-h200').kernels); "
             "print(install_hint('server'))")
    out = _run([sys.executable, "-c", probe], cwd=tmp_path, env=env).splitlines()
    assert out == ["cuda", "pip install 'mtplx_runtime[server]'"]
    names = set(zipfile.ZipFile(installed[1]).namelist())
    for f in (ROOT / "mtplx_runtime" / "configs").glob("*.toml"):
        assert f.relative_to(ROOT).as_posix() in names, f
