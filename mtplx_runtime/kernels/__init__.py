"""Routed-expert kernels: one function family, the same signature on every backend.

    backend = select_backend()          # once, at load
    y = backend.expert_mlp(x, ids, weights, slots, storage, layout, shapes, beta=, beta_lin=,
                           acc=None)

`reference.expert_mlp` states the contract. Two parts of it serve windowed callers (the
streaming provider, when a layer's experts do not all fit in slots at once): an id of -1 is an
empty pick, skipped, and `acc` (fp32 [T, R]) carries the running sum from one window to the
next in the reference's order.

Every backend module also names its `DEVICE` ("cpu" or "cuda"): where the expert slots and the
activations it is given must live; a backend that cannot run every bank mode has
`unsupported(layout) -> reason | None`, which callers check at load.

Backends: `reference` (codec decode to float + torch matmul: the definition), `cpu` (native C
library), `cuda` (native/*.cu through cupy). Choice: the `name` argument, else the environment
variable MTPLX_KERNELS (read at call time, never at import), else auto: cuda when cupy sees a GPU,
else cpu when its native library loads, else reference. Auto-fallback logs one line saying why.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType

BACKENDS = ("reference", "cpu", "cuda")
ENV = "MTPLX_KERNELS"
log = logging.getLogger(__name__)


def _cuda() -> tuple[ModuleType | None, str | None]:
    from . import cuda

    why = cuda.unavailable_reason()
    return (None, why) if why else (cuda, None)


def _cpu() -> tuple[ModuleType | None, str | None]:
    from . import cpu

    why = cpu.unavailable_reason()
    return (None, why) if why else (cpu, None)


def name_of(backend: ModuleType) -> str:
    """"reference", "cpu" or "cuda": the name `select_backend` takes for this backend module."""
    return backend.__name__.rsplit(".", 1)[-1]


def select_backend(name: str | None = None) -> ModuleType:
    """The kernel module for `name` ("reference" | "cpu" | "cuda" | None = env, then auto).

    Raises ValueError for an unknown name and RuntimeError, naming the reason, when an explicitly
    requested backend cannot run (e.g. "cuda" without cupy or without a GPU).
    """
    name = name or os.environ.get(ENV) or None
    if name == "auto":
        name = None
    if name is not None and name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; choose one of {', '.join(BACKENDS)} "
                         f"(argument or ${ENV})")
    if name == "reference":
        from . import reference

        return reference
    if name is not None:
        mod, why = _cuda() if name == "cuda" else _cpu()
        if mod is None:
            raise RuntimeError(f"kernel backend {name!r} requested but unavailable: {why}")
        return mod
    mod, why_cuda = _cuda()
    if mod is not None:
        return mod
    mod, why_cpu = _cpu()
    if mod is not None:
        log.info("kernels: cpu backend (cuda unavailable: %s)", why_cuda)
        return mod
    from . import reference

    log.info("kernels: reference backend (cuda unavailable: %s; cpu unavailable: %s)",
             why_cuda, why_cpu)
    return reference
