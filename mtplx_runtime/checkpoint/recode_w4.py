"""`mtplx recode-w4 SRC DST`: rewrite a compressed-tensors W3A16 g64 checkpoint as a standard
W4A16 g64 one, exactly and losslessly, so stock vLLM loads it (FORMAT.md "W4 recode").

  config + index + shard headers -> plan (layout detected per tensor, every check done before a
  byte is written) -> per shard: recode weight_packed / weight_zero_point, copy the rest
  byte-identical -> other files copied -> index (new total_size) -> config (num_bits 4, last)

Shard file names, tensor names and shard `__metadata__` are kept; each shard is written
atomically. Peak memory is the recoded tensors of one shard (copied tensors are memory-mapped).
A failure after planning (disk full, a bug) leaves a partial DST: delete it and rerun.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..files import atomic_write
from ..formats.base import FormatError
from ..formats.ctint import (
    detect_layout,
    packed_width,
    parse_quantization_config,
    recode_packed_w3_to_w4,
    recode_zero_point_w3_to_w4,
    unpack_codes,
)
from .config import load_json
from .safetensors_io import (
    ST_DTYPES,
    CheckpointError,
    SafetensorsFile,
    TensorInfo,
    write_safetensors,
)

# The ct release whose 4-bit packing the output follows; 4-bit packing is the same in all.
W4_CT_VERSION = "0.20.1"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
PACKED, SHAPE, SCALE, ZP = ".weight_packed", ".weight_shape", ".weight_scale", ".weight_zero_point"


@dataclass(slots=True)
class RecodeReport:
    layout: str  # the 3-bit layout of the source ("dense" or "legacy")
    shards: int = 0
    recoded: int = 0  # tensors rewritten (weight_packed and weight_zero_point)
    copied: int = 0  # tensors copied byte-identical
    bytes_in: int = 0  # tensor bytes read from the source shards
    bytes_out: int = 0  # tensor bytes written to the output shards

    def add(self, recoded: int, copied: int, bytes_in: int, bytes_out: int) -> None:
        """Count one finished shard."""
        self.shards += 1
        self.recoded, self.copied = self.recoded + recoded, self.copied + copied
        self.bytes_in, self.bytes_out = self.bytes_in + bytes_in, self.bytes_out + bytes_out


def _qc_holders(cfg: object, path: Path) -> list[dict]:
    """The dicts holding `quantization_config`: the top level and/or `text_config`."""
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    holders = [d for d in (cfg, cfg.get("text_config")) if isinstance(d, dict)
               and d.get("quantization_config") is not None]
    if not holders:
        raise CheckpointError(f"{path}: no quantization_config (top level or text_config)")
    if len(holders) == 2 and holders[0]["quantization_config"] != holders[1]["quantization_config"]:
        raise CheckpointError(f"{path}: quantization_config differs in text_config")
    return holders


def _open_shards(src: Path) -> tuple[dict | None, dict[str, SafetensorsFile], dict[str, str]]:
    """(index or None, shard name -> open file, tensor name -> shard name), cross-checked."""
    if (src / INDEX).exists():
        index = load_json(src / INDEX, root=src)
        where = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(where, dict) or not where:
            raise CheckpointError(f"{src / INDEX}: no weight_map")
        names = sorted(set(where.values()))
        missing = [n for n in names if not (src / n).is_file()]
        if missing:
            raise CheckpointError(f"{src / INDEX}: shard(s) {missing} in weight_map are missing")
    elif (src / SINGLE).is_file():
        index, names, where = None, [SINGLE], None
    else:
        raise CheckpointError(f"{src}: neither {INDEX} nor {SINGLE} found")
    files = {n: SafetensorsFile(src / n, root=src) for n in names}
    if where is None:
        where = {t: SINGLE for t in files[SINGLE].tensors}
    mapped: dict[str, set[str]] = {n: set() for n in files}
    for t, n in where.items():
        mapped[n].add(t)
    for n, f in files.items():
        if mapped[n] != set(f.tensors):
            odd = sorted(mapped[n] ^ set(f.tensors))[:3]
            raise CheckpointError(f"{f.path}: tensors disagree with {INDEX}, e.g. {odd}")
    return index, files, where


def _plan(files: dict[str, SafetensorsFile], where: dict[str, str], symmetric: bool, group: int,
          version: str | None, override: str | None) -> tuple[dict[str, tuple[int, int]], str]:
    """Check every quantised projection (one scale per `group` columns); return
    ({prefix: (rows, cols)}, the one 3-bit layout)."""

    def info(name: str) -> TensorInfo | None:
        return files[where[name]].info(name) if name in where else None

    def fail(name: str, why: str) -> CheckpointError:
        return CheckpointError(f"{files[where[name]].path}: {name}: {why}")

    plans: dict[str, tuple[int, int]] = {}
    first: dict[str, str] = {}  # layout -> first tensor seen in it
    for name in where:
        if not name.endswith(PACKED):
            continue
        p = name[: -len(PACKED)]
        packed, shape, scale, zp = info(name), info(p + SHAPE), info(p + SCALE), info(p + ZP)
        if shape is None or shape.dtype != "I64" or shape.shape != (2,):
            raise fail(name, f"needs a sibling {p + SHAPE} of I64 [2] to know its column count")
        if p + ".weight" in where:
            raise fail(name, f"both weight_packed and {p}.weight exist")
        rows, cols = (int(v) for v in files[where[p + SHAPE]].read(p + SHAPE))
        if packed.dtype != "I32" or len(packed.shape) != 2 or packed.shape[0] != rows:
            got = f"{packed.dtype}{list(packed.shape)}"
            raise fail(name, f"is {got}, but weight_shape says [{rows}, {cols}]")
        try:
            layout = detect_layout(packed.shape[1], cols, version, override=override)
        except FormatError as e:
            raise fail(name, str(e)) from None
        first.setdefault(layout, name)
        if len(first) > 1:
            raise fail(name, f"mixed 3-bit layouts in one checkpoint: {first}")
        if cols % group or scale is None or scale.shape != (rows, cols // group):
            got = "missing" if scale is None else list(scale.shape)
            raise fail(name, f"weight_scale is {got}, expected [{rows}, {cols / group:g}]")
        if symmetric and zp is not None:
            raise fail(name, "symmetric config but a weight_zero_point exists")
        if not symmetric:
            want = (packed_width(rows, 3, layout), cols // group)
            if zp is None or zp.dtype != "I32" or zp.shape != want:
                got = "missing" if zp is None else f"{zp.dtype}{list(zp.shape)}"
                raise fail(name, f"weight_zero_point is {got}, expected I32{list(want)}")
        plans[p] = (rows, cols)
    if not plans:
        raise CheckpointError("no tensor ending in .weight_packed: nothing to recode")
    return plans, next(iter(first))


def _lazy(f: SafetensorsFile, t: TensorInfo) -> np.ndarray:
    """A tensor to copy, memory-mapped so a shard is never held in memory twice."""
    if t.nbytes == 0:
        return np.empty(t.shape, ST_DTYPES[t.dtype])
    return np.memmap(f.path, ST_DTYPES[t.dtype], mode="r", offset=t.start, shape=t.shape)


def _recode(name: str, words: np.ndarray, n: int, layout: str, zero_point: bool) -> np.ndarray:
    """Recode one tensor and validate it: its W4 codes are the W3 codes + 4.
    `n` is cols for weight_packed and rows for weight_zero_point (packed along dim 0)."""
    if zero_point:
        w4 = recode_zero_point_w3_to_w4(words, n, layout)
        src, out = words.T, w4.T
    else:
        w4 = recode_packed_w3_to_w4(words, n, layout)
        src, out = words, w4
    want = unpack_codes(src, 3, layout, n) + np.uint8(4)
    if not np.array_equal(unpack_codes(out, 4, "dense", n), want):
        raise RuntimeError(f"{name}: W4 codes differ from the W3 source codes (a recode bug)")
    return w4


def _write_json(path: Path, obj: object) -> None:
    atomic_write(path, (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode())


def recode_checkpoint(src_dir: str | os.PathLike, dst_dir: str | os.PathLike, *,
                      progress: bool = True, layout: str | None = None) -> RecodeReport:
    """Recode the W3 checkpoint in `src_dir` into the new directory `dst_dir` (blocking).

    `layout` overrides the 3-bit layout detection's version cross-check, for hand-made
    checkpoints whose `quantization_config.version` is wrong. Raises CheckpointError (naming the
    file) on anything it cannot recode exactly; nothing is written until all checks pass.
    """
    src, dst = Path(src_dir), Path(dst_dir)
    if not src.is_dir():
        raise CheckpointError(f"{src}: not a directory")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise CheckpointError(f"{dst}: already exists and is not empty; refusing to overwrite")
    if dst.resolve().is_relative_to(src.resolve()):
        raise CheckpointError(f"{dst}: must not lie inside the source folder {src}")
    cfg_path = src / "config.json"
    cfg = load_json(cfg_path, root=src)
    holders = _qc_holders(cfg, cfg_path)
    try:
        scheme = parse_quantization_config(holders[0]["quantization_config"])
    except FormatError as e:
        raise CheckpointError(f"{cfg_path}: {e}") from None
    if scheme.num_bits != 3:
        raise CheckpointError(
            f"{cfg_path}: num_bits is {scheme.num_bits}; recode-w4 needs a 3-bit source"
        )
    index, files, where = _open_shards(src)
    try:
        plans, src_layout = _plan(files, where, scheme.symmetric, scheme.group_size,
                                  scheme.version, layout)
        dst.mkdir(parents=True, exist_ok=True)
        report = RecodeReport(src_layout)
        for i, (shard, f) in enumerate(files.items(), 1):
            recoded, copied, n_in, n_out = _recode_shard(f, dst / shard, plans, src_layout)
            report.add(recoded, copied, n_in, n_out)
            if progress:
                print(f"recode-w4: [{i}/{len(files)}] {shard}: {recoded} tensors recoded, "
                      f"{copied} copied, {n_in:,} -> {n_out:,} B", file=sys.stderr)
    finally:
        for f in files.values():
            f.close()
    _copy_others(src, dst, skip={"config.json", INDEX, *files})
    if index is not None:
        new_index = dict(index)
        new_index["metadata"] = {**(index.get("metadata") or {}), "total_size": report.bytes_out}
        _write_json(dst / INDEX, new_index)
    new_cfg = copy.deepcopy(cfg)
    for holder in _qc_holders(new_cfg, cfg_path):
        qc = holder["quantization_config"]
        # parse_quantization_config made every group agree, so every group may cover experts.
        for group in qc["config_groups"].values():
            group["weights"]["num_bits"] = 4
        qc["version"] = W4_CT_VERSION
    _write_json(dst / "config.json", new_cfg)
    return report


def _recode_shard(f: SafetensorsFile, out: Path, plans: dict[str, tuple[int, int]],
                  layout: str) -> tuple[int, int, int, int]:
    """Write one output shard; returns (tensors recoded, tensors copied, bytes in, bytes out)."""
    tensors: dict[str, tuple[str, np.ndarray]] = {}
    recoded = 0
    for name, t in f.tensors.items():
        prefix, _, last = name.rpartition(".")
        if prefix in plans and "." + last in (PACKED, ZP):
            rows, cols = plans[prefix]
            zero_point = "." + last == ZP
            words = f.read(name)
            tensors[name] = ("I32", _recode(name, words, rows if zero_point else cols, layout,
                                            zero_point))
            recoded += 1
        else:
            tensors[name] = (t.dtype, _lazy(f, t))
    write_safetensors(out, tensors, f.metadata)
    n_in = sum(t.nbytes for t in f.tensors.values())
    return recoded, len(tensors) - recoded, n_in, sum(a.nbytes for _, a in tensors.values())


def _copy_others(src: Path, dst: Path, skip: set[str]) -> None:
    """Tokenizer, generation config, code, ...: copied byte-identical (symlinks followed)."""
    for entry in sorted(src.iterdir()):
        if entry.name in skip:
            continue
        if entry.is_dir():
            shutil.copytree(entry, dst / entry.name)
        else:
            shutil.copy2(entry, dst / entry.name)
