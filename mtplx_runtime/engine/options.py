"""How to load a model: one options object for `load()`, the presets and the command line.

    LoadOptions(**choices) -> __post_init__ (every choice checked, here only) -> load(path, options)
    preset TOML keys / `mtplx` flags (--memory-budget = memory_budget) -> the same fields

The choice tuples (dtypes, kernels, cache policies, resident dtypes) are gathered here, each from
the one place that defines it; the command line takes them as `choices`, the presets check
against them, and a bad value is an `OptionError` naming the field, which each front end turns
into its own words (a flag, a preset key and file). Nothing here imports torch: presets and
`--help` use it before any model loads.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from ..formats.resident_layouts import RESIDENT_DTYPES
from ..kernels import BACKENDS
from ..offload.bank_reader import DEFAULT_DECODE_DEPTH, DEFAULT_READ_DEPTH
from ..offload.policy import POLICIES
from .plan import PlanError, parse_bytes

DTYPES = ("bfloat16", "float32")  # compute dtype of the model
KERNELS = ("auto", *BACKENDS)  # auto: cuda with a GPU, else cpu, else reference
CACHE_POLICIES = tuple(POLICIES)  # the expert cache's policies: lru, freq


class OptionError(ValueError):
    """A load option out of its range or of the wrong type: `field why`. `why` may name other
    fields as `{0}`, `{1}` (`others`), so that a front end can name every field its own way
    (`named(flag_of)`: a command's flags; a preset names its key and file)."""

    def __init__(self, field: str, why: str, *others: str):
        self.field, self.why_template, self.others = field, why, others
        super().__init__(self.named(str))

    @property
    def why(self) -> str:
        return self._why(str)

    def _why(self, name_of: Callable[[str], str]) -> str:
        # Only a message naming other fields is a template (values may hold braces).
        w = self.why_template
        return w.format(*map(name_of, self.others)) if self.others else w

    def named(self, name_of: Callable[[str], str]) -> str:
        """The message with every field named by `name_of(field)`."""
        return f"{name_of(self.field)} {self._why(name_of)}"


def _int(field: str, v, low: int | None) -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        raise OptionError(field, f"expected an integer, got {v!r}")
    if low is not None and v < low:
        raise OptionError(field, f"must be >= {low}, got {v}")


def _choice(field: str, v, choices: tuple[str, ...]) -> None:
    if v not in choices:
        raise OptionError(field, f"must be one of {', '.join(map(repr, choices))}, got {v!r}")


def _size(field: str, v) -> int:
    try:
        return parse_bytes(v)
    except PlanError as e:
        raise OptionError(field, f"must be a byte size such as 24GiB: {e}") from None


@dataclass(slots=True)
class LoadOptions:
    """Every choice `load()` takes; checked once, here, at construction (OptionError).

    Streaming (a streaming artifact, or `memory_budget` / `cache_slots` given): `memory_budget`
    (bytes or "24GiB"; None: MemAvailable) and `host_budget` are split by the memory plan for
    `context` tokens (None: the longest the budget affords) and `prefill_chunk`; `cache_slots =
    (compute, host)` per MoE layer sizes the cache instead. `kernels`: a name of KERNELS, a
    kernel module, or None ($MTPLX_KERNELS, else auto). `cache_policy`, `lookahead` (MoE
    layers ahead, 0 = off), `read_depth` (reads in flight), `decode_depth` (of those, while one
    token decodes), `verify` (read-time integrity checks), `warm` ('auto', 'off' or a file)
    with `warm_progress(line)`. Always: `dtype` of the model,
    `resident_dtype` (None: as stored; int8/int4/fp8 need bfloat16), `tokenizer` (False: logits
    only), `device` (None: cuda with the cuda kernels, else cpu)."""

    dtype: str = "bfloat16"
    resident_dtype: str | None = None
    memory_budget: int | str | None = None
    host_budget: int | str = 0
    cache_slots: tuple[int, int] | None = None
    context: int | None = None
    prefill_chunk: int = 64
    kernels: str | ModuleType | None = None
    cache_policy: str = "lru"
    lookahead: int = 1
    read_depth: int = DEFAULT_READ_DEPTH
    decode_depth: int = DEFAULT_DECODE_DEPTH
    verify: bool = True
    warm: str | os.PathLike = "off"
    warm_progress: Callable[[str], None] | None = None
    tokenizer: bool = True
    device: str | None = None

    def __post_init__(self) -> None:
        _choice("dtype", self.dtype, DTYPES)
        if self.resident_dtype is not None:
            _choice("resident_dtype", self.resident_dtype, RESIDENT_DTYPES)
            if self.resident_dtype != "bf16" and self.dtype != "bfloat16":
                raise OptionError("resident_dtype", f"{self.resident_dtype} needs a bfloat16 "
                                  f"model ({{0}} bfloat16), not {self.dtype}", "dtype")
        if self.memory_budget is not None:
            _size("memory_budget", self.memory_budget)
        _size("host_budget", self.host_budget)
        if self.cache_slots is not None:
            if not isinstance(self.cache_slots, tuple) or len(self.cache_slots) != 2:
                raise OptionError("cache_slots", f"must be (compute, host) slots per layer, got "
                                                 f"{self.cache_slots!r}")
            _int("cache_slots", self.cache_slots[0], 1)
            _int("cache_slots", self.cache_slots[1], 0)
            if self.memory_budget is not None:
                raise OptionError("cache_slots", "or {0} sizes the cache: give one, not both",
                                  "memory_budget")
        if self.context is not None:
            _int("context", self.context, 1)
        _int("prefill_chunk", self.prefill_chunk, 1)
        if not isinstance(self.kernels, ModuleType) and self.kernels is not None:
            _choice("kernels", self.kernels, KERNELS)
        _choice("cache_policy", self.cache_policy, CACHE_POLICIES)
        _int("lookahead", self.lookahead, 0)
        _int("read_depth", self.read_depth, 1)
        _int("decode_depth", self.decode_depth, 1)
        for name in ("verify", "tokenizer"):
            if not isinstance(getattr(self, name), bool):
                raise OptionError(name, f"must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.warm, (str, os.PathLike)):
            raise OptionError("warm", f"must be 'auto', 'off' or a file's path, got "
                                      f"{self.warm!r}")
