"""The CLI: every subcommand's --help works without a GPU, errors are messages, not tracebacks."""

import subprocess
import sys
from pathlib import Path

import pytest

from mtplx_runtime.cli import SUBCOMMANDS, main

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_every_subcommand_has_help(name, capsys):
    with pytest.raises(SystemExit) as e:
        main([name, "--help"])
    assert e.value.code == 0
    assert "usage: mtplx " + name in capsys.readouterr().out


def test_python_dash_m_is_the_same_cli():
    out = subprocess.run([sys.executable, "-m", "mtplx_runtime", "--help"], capture_output=True,
                         text=True, check=True).stdout
    for name in SUBCOMMANDS:
        assert name in out


def test_bad_checkpoint_is_a_one_line_error(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mtplx inspect: error:") and "Traceback" not in err


def test_line_budget():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "linecount.py")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_demo_builds_then_reuses_fixtures(tmp_path, capsys):
    assert main(["demo", "--cache-dir", str(tmp_path)]) == 0
    first = capsys.readouterr().out
    for label in ("t158", "mxfp4", "w3-legacy", "w3-dense", "bf16"):
        row = next(line for line in first.splitlines() if line.startswith(label + " "))
        assert "exact 40/40" in row and row.endswith("built"), row
    assert "7,741,440" in first and "14,270,464" in first and "13,418,496" in first
    cont = {line.split()[0]: line.split("]")[0] for line in first.splitlines()
            if line.startswith("  ") and "tok/s" in line}
    assert set(cont) == {"t158", "mxfp4", "w3-legacy", "w3-dense", "bf16"}
    assert cont["w3-legacy"].split("[")[1] == cont["w3-dense"].split("[")[1]
    assert main(["demo", "--cache-dir", str(tmp_path)]) == 0
    second = capsys.readouterr().out
    assert second.count("cached") == 5 and "FAIL" not in second


def test_inspect_reports_layout_and_sizes(tmp_path, capsys):
    from mtplx_runtime.fixtures.tiny import make_tiny

    make_tiny(tmp_path / "t", "t158", seed=3)
    assert main(["inspect", str(tmp_path / "t"), "--decode", "2"]) == 0
    out = capsys.readouterr().out
    assert "layout        t158" in out
    assert "5,760 (1.875 bits/weight)" in out  # 3 projections of 128x64 at 15 B per 64 weights
    assert out.count("finite True") == 6  # 2 experts x 3 projections
