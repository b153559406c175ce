"""open_checkpoint: an HF-style Kimi K3 or DeepSeek-V3 family checkpoint directory, validated at
open, read lazily.

    config.json + index (or one model.safetensors) -> shard headers -> expert layout -> residents

A streaming artifact (FORMAT.md "Streaming artifact") keeps its resident tensors in shards like a
checkpoint but its routed experts in bank parts: `artifact.open` opens it through this reader with
an `experts` layout of its own. Without one, a directory holding an expert manifest, or bank
parts, `*.partial` files or build journals without it (an unfinished build), is refused.

At open only headers are read: the index is checked against the shard headers, the routed-expert
layout is detected and checked against the config (layouts.py), and the resident text tensors are
checked (residents.py). Shards stay open; tensors and experts are read on demand with pread.
Every file is opened inside the directory: one that resolves outside it (a symlink, or a
symlinked directory on the way) is refused, except a Hugging Face cache snapshot's links into
its `blobs/` (`files.open_regular` with a root).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..formats import Codec
from .config import ConfigError, ModelConfig, load_json
from .deepseek_config import MODEL_TYPES as DEEPSEEK_TYPES
from .deepseek_config import DeepseekV3Config
from .layouts import ExpertLayout, ExpertRecord, detect_expert_layout
from .residents import check_residents
from .safetensors_io import CheckpointError, SafetensorsFile, TensorInfo

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MANIFEST = "expert-manifest.json"
# Files a `mtplx build-manifest` run leaves before it writes the manifest (publication marker).
_BUILD_LEFTOVERS = ("experts-*-layer-*", "*.partial", "*.journal.jsonl", "build-receipt.json")


class Checkpoint:
    """A validated, open checkpoint. Reads are positional (pread), so threads may read at once;
    close() only when no read is in flight."""

    def __init__(self, path: Path, config: ModelConfig, shards: list[SafetensorsFile],
                 where: dict[str, SafetensorsFile], experts: ExpertLayout | None = None,
                 resident_dtype: str = "bf16"):
        self.path = path
        self.config = config
        self._shards = shards
        self._where = where  # tensor name -> the shard holding it
        self._experts = experts or detect_expert_layout(config, where, str(path))
        # "mxfp4" | "w3" | "t158" | "bf16"; "bank-{mode}" for a streaming artifact
        self.layout: str = self._experts.name
        self.codec: Codec = self._experts.codec
        # "bf16" (as published) or an artifact's quantized residents (FORMAT.md "Quantized
        # residents"): the stored tensors are checked against that form of the table.
        self.resident_dtype = resident_dtype
        check_residents(config, where, str(path), resident_dtype)

    @property
    def expert_layout(self) -> ExpertLayout:
        """Where the routed experts are read from (a BankExpertLayout for an artifact)."""
        return self._experts

    def tensor_names(self) -> list[str]:
        return sorted(self._where)

    def has_tensor(self, name: str) -> bool:
        return name in self._where

    def tensor_info(self, name: str) -> TensorInfo:
        """Header entry (safetensors dtype tag, shape, absolute file extent) of one tensor."""
        return self._shard(name).tensors[name]

    def tensor(self, name: str) -> np.ndarray:
        """The whole tensor as a fresh array, BF16 as uint16 bits. Meant for residents: a t158
        stacked expert tensor is a whole layer's experts; use `expert()` for those."""
        return self._shard(name).read(name)

    def expert(self, layer: int, expert: int) -> ExpertRecord:
        """Routed expert `expert` of MoE layer `layer` (0-based model index). Blocks on I/O."""
        self.config.check_expert_key(layer, expert)
        return self._experts.read(layer, expert)

    def shard_fds(self) -> dict[str, int]:
        """{shard file name: the descriptor its tensors are read through}, for checks that
        must see the bytes the reads will see (artifact.integrity)."""
        return {shard.path.name: shard.fileno() for shard in self._shards}

    def _shard(self, name: str) -> SafetensorsFile:
        try:
            return self._where[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor {name!r}") from None

    def close(self) -> None:
        for shard in self._shards:
            shard.close()
        self._experts.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_checkpoint(path: str | os.PathLike, *, experts=None,
                    resident_dtype: str = "bf16") -> Checkpoint:
    """Open and validate a checkpoint directory; errors are CheckpointError naming the file.

    `experts`: for models whose routed experts live outside the shards (a streaming artifact:
    `artifact.open.open_artifact` passes it), a function `(config, {tensor: shard}) ->
    ExpertLayout`. Without it a directory holding an expert manifest, or an unfinished build of
    one, is refused with a message saying how to open it. `resident_dtype`: the form of the
    resident tensors (an artifact's manifest says; a checkpoint's are bf16)."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a checkpoint directory")
    if experts is None:
        _refuse_artifact(root)
    config = load_config(root / CONFIG, root=root)
    shards: list[SafetensorsFile] = []
    layout = None
    try:
        weight_map = _read_index(root)
        names = sorted(set(weight_map.values())) if weight_map is not None else [SINGLE]
        for name in names:
            if not (root / name).is_file():
                raise CheckpointError(f"{root / INDEX}: shard {name!r} is missing from {root}")
            shards.append(SafetensorsFile(root / name, root=root))
        where = _locate(shards, weight_map, root)
        layout = experts(config, where) if experts is not None else None
        return Checkpoint(root, config, shards, where, layout, resident_dtype)
    except BaseException:
        for shard in shards:
            shard.close()
        if layout is not None:
            layout.close()
        raise


def load_config(path: str | os.PathLike, *,
                root: str | os.PathLike | None = None) -> ModelConfig | DeepseekV3Config:
    """The model config in `path` (a config.json): the DeepSeek-V3 family (DeepSeek-V3/R1,
    Kimi K2) by its `model_type`, else Kimi K3. `root`: the model directory it must not leave.
    ConfigError naming the file."""
    path = Path(path)
    d = load_json(path, root=root)
    try:
        if isinstance(d, dict) and d.get("model_type") in DEEPSEEK_TYPES:
            return DeepseekV3Config.from_dict(d)
        return ModelConfig.from_dict(d)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def _refuse_artifact(root: Path) -> None:
    """A streaming artifact is opened through `artifact.open`; build leftovers without the
    manifest (which a finished build writes last) are an unfinished artifact."""
    if (root / MANIFEST).exists() or (root / MANIFEST).is_symlink():
        raise CheckpointError(f"{root}: a streaming artifact ({MANIFEST}): open it with "
                              f"mtplx_runtime.artifact.open.open_source or mtplx_runtime.load")
    leftovers = sorted({p.name for pattern in _BUILD_LEFTOVERS for p in root.glob(pattern)})
    if leftovers:
        shown = ", ".join(leftovers[:4]) + (", ..." if len(leftovers) > 4 else "")
        raise CheckpointError(f"{root}: unfinished streaming artifact: it holds build output "
                              f"({shown}) but no {MANIFEST}, which a finished build writes last; "
                              f"rerun `mtplx build-manifest` to finish it")


def _read_index(root: Path) -> dict[str, str] | None:
    """The index's weight_map, or None for a single-file checkpoint."""
    index = root / INDEX
    if not index.exists():
        if not (root / SINGLE).exists():
            raise CheckpointError(f"{root}: neither {INDEX} nor {SINGLE} is present")
        return None
    data = load_json(index, root=root)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(v, str) for v in weight_map.values()
    ):
        raise CheckpointError(f"{index}: weight_map must map tensor names to shard file names")
    for shard in set(weight_map.values()):
        # A path with directories (or "..") would read files outside the checkpoint.
        if shard in ("", ".", "..") or Path(shard).name != shard:
            raise CheckpointError(f"{index}: shard name {shard!r} is not a plain file name")
    return weight_map


def _locate(shards: list[SafetensorsFile], weight_map: dict[str, str] | None,
            root: Path) -> dict[str, SafetensorsFile]:
    """Tensor name -> shard, after checking that the headers and the index agree exactly."""
    where: dict[str, SafetensorsFile] = {}
    for shard in shards:
        for name in shard.tensors:
            if name in where:
                raise CheckpointError(f"{root}: tensor {name!r} is in two shards: "
                                      f"{where[name].path.name} and {shard.path.name}")
            where[name] = shard
    if weight_map is None:
        return where
    for name, shard_name in weight_map.items():
        holder = where.get(name)
        if holder is None or holder.path.name != shard_name:
            raise CheckpointError(f"{root / shard_name}: tensor {name!r}, which {INDEX} places "
                                  f"in this shard, is not in it")
    for name, shard in where.items():
        if name not in weight_map:
            raise CheckpointError(f"{shard.path}: tensor {name!r} is not listed in {INDEX}")
    return where
