"""Reading Kimi K3 checkpoints: config, lazily opened shards, routed experts and residents."""

from .config import ConfigError, ModelConfig
from .layouts import ExpertRecord, ProjectionRecord
from .reader import Checkpoint, open_checkpoint
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

