"""mtplx_runtime: run Kimi K3 with routed experts streamed from disk.

Public surface:
- `load(path, LoadOptions(...))` or `load(path, dtype=..., memory_budget=..., kernels=...)` ->
  `Runtime` (model, tokenizer, expert provider, memory plan): the one door every entry point
  loads through; experts stream from a streaming artifact's bank through the expert cache, or
  stay resident for a checkpoint; `LoadOptions` holds and checks every choice;
- `load_model(path, device="cpu", dtype="float32")` -> the reference model with every expert
  resident (`model.logits(token_ids)`, `prefill`/`decode` with an explicit per-sequence state).
torch is imported only when a model is loaded, so `import mtplx_runtime` stays light.
"""

from __future__ import annotations

__all__ = ["LoadOptions", "Runtime", "load", "load_model"]
__version__ = "0.1.0"


def load(path, options=None, /, **choices):
    """`engine.runtime.load`: see its docstring, and `LoadOptions` for the choices."""
    from .engine.runtime import load as _load

    return _load(path, options, **choices)


def load_model(path, device: str = "cpu", dtype: str = "float32", resident_dtype=None):
    """Load a K3 checkpoint or artifact (any layout the reader accepts) as the reference model,
    every routed expert resident."""
    from .engine.runtime import load_model as _load_model

    return _load_model(path, device=device, dtype=dtype, resident_dtype=resident_dtype)


def __getattr__(name: str):
    if name == "Runtime":  # the class, without importing torch at package import
        from .engine.runtime import Runtime

        return Runtime
    if name == "LoadOptions":
        from .engine.options import LoadOptions

        return LoadOptions
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
