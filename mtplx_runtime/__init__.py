"""mtplx_runtime: run Kimi K3 with routed experts streamed from disk.

Public surface: `load_model(path, device="cpu", dtype="float32")` -> the reference model
(`model.logits(token_ids)`, `prefill`/`decode` with an explicit per-sequence state), and
`open_checkpoint(path)` for reading any supported K3 checkpoint. torch is imported only when a
model is loaded, so `import mtplx_runtime` stays light.
"""

from __future__ import annotations

__all__ = ["load_model", "open_checkpoint"]
__version__ = "0.1.0"


def load_model(path, device: str = "cpu", dtype: str = "float32"):
    """Load a K3 checkpoint (any layout the reader accepts) as the reference model."""
    from .model.kimi_k3 import load_model as _load

    return _load(path, device=device, dtype=dtype)


def open_checkpoint(path):
    """Open and validate a K3 checkpoint directory (headers only)."""
    from .checkpoint import open_checkpoint as _open

    return _open(path)
