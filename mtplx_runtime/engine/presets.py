"""Deployment presets: named TOML files of flag values (`--config NAME|PATH`).

    NAME -> mtplx_runtime/configs/NAME.toml (package data), or PATH -> that file
        -> tomllib -> Preset (every key known, typed and in range) -> defaults of a parser

A preset's keys are the dest names of the flags they stand for (`memory_budget` for
`--memory-budget`), which for the load flags are `engine.options.LoadOptions`' fields: those
are checked by LoadOptions itself, the sampling and serving keys here. `parse_args` makes them
the parser's defaults before parsing, so a flag given on the command line wins over the preset
and the preset wins over the built-in default. A key the command has no flag for (`lookahead`
for `mtplx plan`, which plans without streaming) is left unused; a key no command knows is an
error.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from dataclasses import dataclass, fields
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser as a package (pyproject's marker)
    import tomli as tomllib

from ..files import InputError, read_regular
from ..formats.resident_layouts import RESIDENT_DTYPES
from .options import CACHE_POLICIES, DTYPES, KERNELS, LoadOptions, OptionError

# Shipped as package data, so a wheel install finds the presets by name as a checkout does.
CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
# Keys that are LoadOptions fields (checked there; sizes kept as the strings the flags take).
LOAD_KEYS = ("memory_budget", "host_budget", "context", "prefill_chunk", "dtype",
             "resident_dtype", "cache_policy", "lookahead", "kernels", "read_depth",
             "decode_depth")
SIZES = ("memory_budget", "host_budget")
CHOICES = {"dtype": DTYPES, "resident_dtype": RESIDENT_DTYPES, "cache_policy": CACHE_POLICIES,
           "kernels": KERNELS}
# The other keys: sampling, the plan's batch, the server's limits (lowest value, None: any).
INTS = {"batch": 1, "max_tokens": 0, "top_k": 0, "seed": None, "max_queue": 1,
        "max_connections": 1, "max_body_bytes": 1}
FLOATS = ("temperature", "top_p")
MAX_PRESET_BYTES = 1 << 20  # a preset is a few lines of TOML


class PresetError(InputError):
    """A preset that cannot be found, read or used; the message names the file and the key."""


@dataclass(slots=True)
class Preset:
    """One preset file's values; None = not set by the preset."""

    path: Path
    memory_budget: str | None = None  # byte sizes as the flags take them, e.g. "128GiB"
    host_budget: str | None = None
    context: int | None = None
    prefill_chunk: int | None = None
    dtype: str | None = None
    resident_dtype: str | None = None
    cache_policy: str | None = None
    lookahead: int | None = None
    kernels: str | None = None
    read_depth: int | None = None
    decode_depth: int | None = None
    batch: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    max_queue: int | None = None
    max_connections: int | None = None
    max_body_bytes: int | None = None

    def __post_init__(self) -> None:
        load = {k: getattr(self, k) for k in LOAD_KEYS if getattr(self, k) is not None}
        try:
            LoadOptions(**load)
        except OptionError as e:
            raise PresetError(f"{self.path}: {e.field} = {load[e.field]!r}: {e.why}") from None
        for key in SIZES:
            if getattr(self, key) is not None:
                setattr(self, key, str(getattr(self, key)))
        for key in KEYS:
            v = getattr(self, key)
            if v is not None and key not in LOAD_KEYS:
                setattr(self, key, _checked(self.path, key, v))

    @property
    def name(self) -> str:
        return self.path.stem

    def values(self) -> dict[str, object]:
        """{key: value} of the keys the preset sets, in field order."""
        return {k: getattr(self, k) for k in KEYS if getattr(self, k) is not None}


KEYS = tuple(f.name for f in fields(Preset) if f.name != "path")


def _checked(path: Path, key: str, v):
    """A sampling or serving key's value as its flag holds it (floats as float); PresetError if
    bad."""
    def bad(why: str) -> PresetError:
        return PresetError(f"{path}: {key} = {v!r}: {why}")

    if key in INTS:
        if isinstance(v, bool) or not isinstance(v, int):
            raise bad("expected an integer")
        if INTS[key] is not None and v < INTS[key]:
            raise bad(f"must be >= {INTS[key]}")
        return v
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad("expected a number")
    if key == "temperature" and not v >= 0 or key == "top_p" and not 0 < v <= 1:
        raise bad("temperature must be >= 0" if key == "temperature" else "must be in (0, 1]")
    return float(v)


def available() -> list[str]:
    """Names of the presets in CONFIG_DIR."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.toml"))


def find(ref: str | Path) -> Path:
    """The file of a preset NAME (in CONFIG_DIR) or PATH (anything with a / or a .toml end)."""
    text = str(ref)
    if "/" in text or text.endswith(".toml"):
        path = Path(text).expanduser()
        if not path.is_file():
            raise PresetError(f"{path}: no such preset file")
        return path
    path = CONFIG_DIR / f"{text}.toml"
    if not path.is_file():
        names = ", ".join(available())
        raise PresetError(f"no preset named {text!r} in {CONFIG_DIR} (there: {names}); give a "
                          "NAME from there or a PATH to a .toml file")
    return path


def load(ref: str | Path) -> Preset:
    """Find, parse and validate a preset; PresetError names the file (and the key)."""
    path = find(ref)
    raw = read_regular(path, limit=MAX_PRESET_BYTES, error=PresetError, what="preset")
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise PresetError(f"{path}: not UTF-8 text (byte {e.start}); TOML is UTF-8") from None
    except tomllib.TOMLDecodeError as e:
        raise PresetError(f"{path}: not valid TOML: {e}") from None
    except RecursionError:
        raise PresetError(f"{path}: not valid TOML: nested too deeply") from None
    for key in data:
        if key not in KEYS:
            raise PresetError(f"{path}: unknown key {key!r} (a preset sets: {', '.join(KEYS)})")
    return Preset(path, **data)


def add_config_arg(p: argparse.ArgumentParser) -> None:
    """The `--config NAME|PATH` flag; `parse_args` gives it its effect."""
    names = ", ".join(available())
    p.add_argument("--config", default=None, metavar="NAME|PATH",
                   help=f"deployment preset: a shipped one's name ({names}) or a .toml file; "
                        "flags given here win over its values")


def apply(preset: Preset, parser: argparse.ArgumentParser, prog: str) -> list[str]:
    """Make the preset's values the defaults of `parser`'s flags (a required flag the preset
    sets is no longer required); returns the keys `parser` has no flag for."""
    actions = {a.dest: a for a in parser._actions}
    unused = []
    for key, value in preset.values().items():
        action = actions.get(key)
        if action is None:
            unused.append(key)
            continue
        if action.choices is not None and value not in action.choices:
            raise PresetError(f"{preset.path}: {key} = {value!r} is not a choice of {prog} "
                              f"({', '.join(map(str, action.choices))})")
        parser.set_defaults(**{key: value})
        action.required = False
    return unused


def unrecognized(parser: argparse.ArgumentParser, extra: list[str]) -> str:
    """The error for arguments `parser` does not take, with the closest flag of each unknown
    option (`--max-token` -> `--max-tokens`)."""
    flags = [s for a in parser._actions for s in a.option_strings]
    hints = []
    for arg in extra:
        word = arg.split("=", 1)[0]
        close = difflib.get_close_matches(word, flags, n=1) if word.startswith("-") else []
        if close:
            hints.append(f"{word}: did you mean {close[0]}?")
    return (f"unrecognized arguments: {' '.join(extra)}" + ("; " + "; ".join(hints) if hints
                                                             else ""))


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None = None, *,
               owner: argparse.ArgumentParser | None = None, owner_argv: list[str] | None = None,
               prog: str | None = None) -> argparse.Namespace:
    """`parser.parse_args(argv)` with `--config` applied first.

    owner: the (sub)parser that has `--config` (default: parser) and owner_argv the part of argv
    it parses (default: argv). The preset is found by a first look at owner_argv for `--config`,
    applied to owner's defaults, then argv is parsed as usual, so explicit flags win. Raises
    PresetError; argparse's own errors exit as usual."""
    argv = sys.argv[1:] if argv is None else list(argv)
    owner = parser if owner is None else owner
    ref = None
    if any(a.dest == "config" for a in owner._actions):
        pre = argparse.ArgumentParser(add_help=False, exit_on_error=False)
        pre.add_argument("--config")
        try:
            ref = pre.parse_known_args(argv if owner_argv is None else owner_argv)[0].config
        except argparse.ArgumentError:
            ref = None  # e.g. --config without a value: the real parse says so
        if ref is not None:
            apply(load(ref), owner, prog or owner.prog)
    args, extra = parser.parse_known_args(argv)
    if extra:  # named by the (sub)command they were given to, with its usage
        owner.error(unrecognized(owner, extra))
    if getattr(args, "config", None) != ref:  # the first look and the parse disagree
        raise PresetError("could not tell --config on this command line; write it in full")
    return args
