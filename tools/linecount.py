"""Lines of code per module of mtplx_runtime, largest first, and the total: a report, no budget.

Blank lines, comment-only lines and docstrings are not counted. Module size is not a rule (the
house rule is one seam per module); this only shows where the code is.
Usage: python tools/linecount.py. Always exits 0.
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def count(path: Path) -> int:
    """Lines holding code: not blank, not only a comment, not part of a docstring."""
    text = path.read_text()
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        first = body[0] if isinstance(body, list) and body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                and isinstance(first.value.value, str):
            docstrings.update(range(first.lineno, first.end_lineno + 1))
    code: set[int] = set()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENDMARKER}
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type not in skip:
            code.update(range(tok.start[0], tok.end[0] + 1))
    return len(code - docstrings)


def main() -> int:
    counts = {f.relative_to(ROOT): count(f) for f in sorted((ROOT / "mtplx_runtime").rglob("*.py"))}
    for f, n in sorted(counts.items(), key=lambda kv: (-kv[1], str(kv[0]))):
        print(f"{n:5d}  {f}")
    print(f"{sum(counts.values()):5d}  total in {len(counts)} modules")
    return 0


if __name__ == "__main__":
    sys.exit(main())
