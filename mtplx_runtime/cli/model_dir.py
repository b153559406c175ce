"""The model directory argument, one form for every subcommand that takes one: `--model DIR`
(`-m DIR`, as llama.cpp spells it) or a positional `DIR`, whichever the user types (`generate`,
`chat`, `serve`, `logits`, `plan`, `inspect`, `verify`, `build-manifest`). `resolve` runs after
parsing, checks that the directory exists and leaves the path in `args.<dest>`."""

from __future__ import annotations

import argparse
from pathlib import Path

_POSITIONAL = "_model_dir_positional"


def add_model_dir(p: argparse.ArgumentParser, help: str, *, dest: str = "model",
                  path: bool = False) -> None:
    """`--model DIR` and a positional `DIR` for the same value; one of them is required."""
    # SUPPRESS: an absent form leaves no attribute, so neither overwrites the other and help
    # shows no "(default: ...)" for a required value. No `type=`: argparse would apply it to
    # the SUPPRESS marker of an absent positional; `resolve` converts instead.
    p.add_argument(_POSITIONAL, nargs="?", default=argparse.SUPPRESS, metavar="DIR",
                   help=f"{help} (or --model DIR)")
    p.add_argument("-m", "--model", dest=dest, default=argparse.SUPPRESS, metavar="DIR",
                   help=f"{help} (or as the positional DIR)")
    p.set_defaults(_model_dir_dest=dest, _model_dir_path=path)


def resolve(args: argparse.Namespace) -> str | None:
    """Merge the two forms into `args.<dest>`; the error text when neither or two different
    directories were given (None when fine, or when the subcommand takes no model)."""
    dest = getattr(args, "_model_dir_dest", None)
    if dest is None:
        return None
    flag, pos = getattr(args, dest, None), getattr(args, _POSITIONAL, None)
    if flag is not None and pos is not None and flag != pos:
        return f"two model directories given ({pos} and --model {flag}): give one"
    if flag is None and pos is None:
        return "the model directory is required: --model DIR (or DIR)"
    value = flag if flag is not None else pos
    if not Path(value).is_dir():
        what = "is not a directory" if Path(value).exists() else "does not exist"
        # mlx-lm spells --max-tokens -m; here -m is the model, as in llama.cpp
        hint = (" (-m is --model here; the reply length is -n/--max-tokens)"
                if value.isdecimal() else "")
        return f"the model directory {value} {what}{hint}"
    setattr(args, dest, Path(value) if args._model_dir_path else value)
    return None
