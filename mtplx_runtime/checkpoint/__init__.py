"""Reading Kimi K3 and DeepSeek-V3 family checkpoints: config, lazily opened shards, routed experts
and residents."""

from .config import ConfigError, ModelConfig
from .deepseek_config import DeepseekV3Config
from .layouts import ExpertRecord, ProjectionRecord
from .reader import Checkpoint, load_config, open_checkpoint
from .residents import resident_tensor_specs
from .safetensors_io import CheckpointError

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "ConfigError",
    "DeepseekV3Config",
    "ExpertRecord",
    "ModelConfig",
    "load_config",
    "ProjectionRecord",
    "open_checkpoint",
    "resident_tensor_specs",
]

