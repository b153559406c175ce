"""The optional extras (`gpu`, `server`, `profile`, `gguf`) and the command that installs one, in
the form that fits how this copy of the package was installed: from a checkout (editable, or on
PYTHONPATH) `pip install -e '/path/to/checkout[server]'`, otherwise (a wheel)
`pip install 'mtplx_runtime[server]'`. Hints that name a missing extra use `install_hint`.
"""

from __future__ import annotations

import shlex
from pathlib import Path

DISTRIBUTION = "mtplx_runtime"


def checkout() -> Path | None:
    """The source tree this package runs from (it has the project's pyproject.toml), or None
    for an installed wheel."""
    root = Path(__file__).resolve().parent.parent
    return root if (root / "pyproject.toml").is_file() else None


def install_hint(extra: str) -> str:
    """The pip command that adds `extra` to this installation."""
    root = checkout()
    if root is not None:
        return f"pip install -e {shlex.quote(f'{root}[{extra}]')}"
    return f"pip install {shlex.quote(f'{DISTRIBUTION}[{extra}]')}"
