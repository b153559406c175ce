"""Line budget (house style): every module under ~400 lines, the package under ~5k for v1.

Usage: python tools/linecount.py [--max-module 450] [--max-total 5000]
Prints one line per module over 300 lines and a total; exits 1 past a budget. Tests run it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def count(path: Path) -> int:
    """Non-blank lines: blank lines cost nothing to read."""
    return sum(1 for line in path.read_text().splitlines() if line.strip())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-module", type=int, default=450)
    p.add_argument("--max-total", type=int, default=5000)
    args = p.parse_args(argv)
    counts = {f.relative_to(ROOT): count(f) for f in sorted((ROOT / "mtplx_runtime").rglob("*.py"))}
    total = sum(counts.values())
    over = {f: n for f, n in counts.items() if n > args.max_module}
    for f, n in counts.items():
        if n > 300:
            print(f"{n:5d}  {f}{'  OVER BUDGET' if f in over else ''}")
    print(f"{total:5d}  total in {len(counts)} modules (budget {args.max_total})")
    return 1 if over or total > args.max_total else 0


if __name__ == "__main__":
    sys.exit(main())
