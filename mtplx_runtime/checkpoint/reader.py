"""open_checkpoint: an HF-style Kimi K3 checkpoint directory, validated at open, read lazily.

    config.json + index (or one model.safetensors) -> shard headers -> expert layout -> residents

A streaming artifact (FORMAT.md "Streaming artifact") is a checkpoint whose routed experts live in
bank parts named by `expert-manifest.json`: the manifest is loaded (digest and structure checked),
its resident tensors must be exactly where the safetensors headers put them, and experts are read
by bank_experts.py. Bank parts, `*.partial` files or build journals without the manifest are an
unfinished build and are refused.

At open only headers are read: the index is checked against the shard headers, the routed-expert
layout is detected and checked against the config (layouts.py), and the resident text tensors are
checked (residents.py). Shards stay open; tensors and experts are read on demand with pread.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..artifact.open import BankExpertLayout
from ..formats import Codec
from .config import ModelConfig, load_json
from .layouts import ExpertLayout, ExpertRecord, detect_expert_layout, is_expert_tensor
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
                 where: dict[str, SafetensorsFile], experts: ExpertLayout | None = None):
        self.path = path
        self.config = config
        self._shards = shards
        self._where = where  # tensor name -> the shard holding it
        self._experts = experts or detect_expert_layout(config, where, str(path))
        # "mxfp4" | "w3" | "t158" | "bf16"; "bank-{mode}" for a streaming artifact
        self.layout: str = self._experts.name
        self.codec: Codec = self._experts.codec
        # The streaming artifact's manifest (storage.manifest.Manifest); None for a checkpoint.
        self.manifest = experts.manifest if isinstance(experts, BankExpertLayout) else None
        check_residents(config, where, str(path))

    def record_location(self, layer: int, expert: int) -> tuple[Path, int, int, str | None]:
        """Streaming artifacts only: (bank part path, absolute offset, length, sha256 or None)
        of one expert record, for readers that move the bytes themselves."""
        if not isinstance(self._experts, BankExpertLayout):
            raise TypeError(f"{self.path}: not a streaming artifact (layout {self.layout}); "
                            f"only bank records have a location")
        self.config.check_expert_key(layer, expert)
        return self._experts.record_location(layer, expert)

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

    def _shard(self, name: str) -> SafetensorsFile:
        try:
            return self._where[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor {name!r}") from None

    def close(self) -> None:
        for shard in self._shards:
            shard.close()
        if isinstance(self._experts, BankExpertLayout):
            self._experts.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_checkpoint(path: str | os.PathLike, *, verify_sha256: bool = False) -> Checkpoint:
    """Open and validate a checkpoint directory or streaming artifact; errors are CheckpointError
    naming the file. `verify_sha256`: artifacts only, hash every expert record on read."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a checkpoint directory")
    manifest = _artifact_manifest(root)
    config = ModelConfig.from_file(root / CONFIG)
    shards: list[SafetensorsFile] = []
    experts = None
    try:
        weight_map = _read_index(root)
        names = sorted(set(weight_map.values())) if weight_map is not None else [SINGLE]
        for name in names:
            if not (root / name).is_file():
                raise CheckpointError(f"{root / INDEX}: shard {name!r} is missing from {root}")
            shards.append(SafetensorsFile(root / name))
        where = _locate(shards, weight_map, root)
        if manifest is not None:
            _check_manifest_residents(manifest, where, root)
            experts = BankExpertLayout(config, root, manifest, verify_sha256=verify_sha256)
        return Checkpoint(root, config, shards, where, experts)
    except BaseException:
        for shard in shards:
            shard.close()
        if experts is not None:
            experts.close()
        raise


def _artifact_manifest(root: Path):
    """The loaded manifest of a streaming artifact, None for a plain checkpoint; refuses an
    unfinished artifact (build leftovers without the manifest, which is published last)."""
    path = root / MANIFEST
    if path.exists() or path.is_symlink():
        from ..artifact.manifest import load_manifest

        return load_manifest(path)  # ManifestError is a CheckpointError
    leftovers = sorted({p.name for pattern in _BUILD_LEFTOVERS for p in root.glob(pattern)})
    if leftovers:
        shown = ", ".join(leftovers[:4]) + (", ..." if len(leftovers) > 4 else "")
        raise CheckpointError(f"{root}: unfinished streaming artifact: it holds build output "
                              f"({shown}) but no {MANIFEST}, which a finished build writes last; "
                              f"rerun `mtplx build-manifest` to finish it")
    return None


def _check_manifest_residents(manifest, where: dict[str, SafetensorsFile], root: Path) -> None:
    """Each manifest resident tensor is where the shard headers put it (same shard, absolute
    extent, dtype, shape); no routed-expert tensor sits beside the bank."""
    for t in manifest.resident_tensors:
        holder = where.get(t.tensor)
        if holder is None or holder.path.name != t.shard:
            raise CheckpointError(f"{root / MANIFEST}: resident tensor {t.tensor!r} is not in "
                                  f"{t.shard} according to {INDEX}")
        info = holder.tensors[t.tensor]
        if (info.start, info.nbytes, info.dtype, info.shape) != (t.offset, t.length, t.dtype,
                                                                  tuple(t.shape)):
            raise CheckpointError(
                f"{holder.path}: tensor {t.tensor!r} is {info.dtype}{list(info.shape)} at "
                f"[{info.start}, {info.end}), {MANIFEST} says {t.dtype}{list(t.shape)} at "
                f"[{t.offset}, {t.offset + t.length})")
    for name, shard in where.items():
        if is_expert_tensor(name):
            raise CheckpointError(f"{shard.path}: routed-expert tensor {name!r} beside the "
                                  f"bank parts of a streaming artifact")


def _read_index(root: Path) -> dict[str, str] | None:
    """The index's weight_map, or None for a single-file checkpoint."""
    index = root / INDEX
    if not index.exists():
        if not (root / SINGLE).exists():
            raise CheckpointError(f"{root}: neither {INDEX} nor {SINGLE} is present")
        return None
    data = load_json(index)
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
