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
