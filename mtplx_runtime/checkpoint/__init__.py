"""Reading Kimi K3 checkpoints: config, lazily opened shards, routed experts and residents."""

from .config import ConfigError, ModelConfig
from .layouts import ExpertRecord, ProjectionRecord
from .residents import resident_tensor_specs
from .safetensors_io import CheckpointError

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "ConfigError",
    "ExpertRecord",
    "ModelConfig",
    "ProjectionRecord",
    "open_checkpoint",
    "resident_tensor_specs",
]


def __getattr__(name: str):
    # The reader reaches storage.bank (streaming artifacts), and storage.manifest imports
    # this package's safetensors_io: loading the reader on first use keeps either side
    # importable first.
    if name in ("Checkpoint", "open_checkpoint"):
        from . import reader

        return getattr(reader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
