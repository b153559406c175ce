"""Routed-expert layouts: detect the one a checkpoint uses, validate it, read one expert.

Detection looks only at tensor names and header dtypes (FORMAT.md "Checkpoint layouts the
reader accepts"):
  * mxfp4 / w3 / bf16: one tensor per component per expert projection, official names
    `language_model.model.layers.{L}.block_sparse_moe.experts.{e}.{w1|w3|w2}.{suffix}` (K3) or
    `model.layers.{L}.mlp.experts.{e}.{gate_proj|up_proj|down_proj}.{suffix}` (the DeepSeek-V3
    family); `weight` -> bf16, `weight_packed` U8 -> mxfp4, `weight_packed` I32 -> w3
    (compressed-tensors);
  * t158: six expert-leading stacked tensors per layer.
Exactly one layout per checkpoint. Shapes and dtypes come from the codec's component specs for the
config-derived expert shapes, so a tensor that disagrees with the config is named at open time.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ..formats import Codec, ComponentSpec, FormatError, get_codec
from ..formats.ctint import detect_layout, parse_quantization_config
from ..formats.fp8block import parse_quantization_config as parse_fp8_config
from .config import ModelConfig
from .deepseek_config import DeepseekV3Config
from .safetensors_io import CheckpointError, SafetensorsFile

# Official projection names -> ours (w1 = gate, w3 = up, w2 = down).
PROJECTIONS = {"w1": "gate", "w3": "up", "w2": "down"}
T158_PROJECTIONS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}

_PER_EXPERT = re.compile(
    r"language_model\.model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.(\w+)"
)
DEEPSEEK_PROJECTIONS = T158_PROJECTIONS  # transformers' projection names, as t158's
_DEEPSEEK_EXPERT = re.compile(
    r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(\w+)")
# The published t158 names are unconfirmed: accept an optional `language_model.`
# prefix and `block_sparse_moe` in place of `mlp`.
_STACKED = re.compile(
    r"(?:language_model\.)?model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.switch_mlp\."
    r"(gate_proj|up_proj|down_proj)\.(packed|scales)"
)
_MAX_LISTED = 8  # how many offenders an error message spells out


@dataclass(frozen=True, slots=True)
class ExpertNaming:
    """How a family names per-expert tensors: `pattern` groups (layer, expert, stored projection,
    suffix); `prefix` formats `{layer}`, `{expert}`, `{proj}` into a projection's name + ".";
    `projections` maps stored projection names to ours (gate, up, down)."""

    pattern: re.Pattern
    prefix: str
    projections: dict[str, str]


K3_NAMING = ExpertNaming(
    _PER_EXPERT, "language_model.model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}.",
    PROJECTIONS)
DEEPSEEK_NAMING = ExpertNaming(
    _DEEPSEEK_EXPERT, "model.layers.{layer}.mlp.experts.{expert}.{proj}.", DEEPSEEK_PROJECTIONS)


def expert_naming(cfg) -> ExpertNaming:
    """The per-expert naming of `cfg`'s family."""
    return DEEPSEEK_NAMING if isinstance(cfg, DeepseekV3Config) else K3_NAMING


def is_expert_tensor(name: str) -> bool:
    """Whether `name` is a routed-expert tensor of a layout detect_expert_layout knows."""
    return bool(_PER_EXPERT.fullmatch(name) or _STACKED.fullmatch(name)
                or _DEEPSEEK_EXPERT.fullmatch(name))


def mtp_layer(cfg, layer: int) -> bool:
    """Whether `layer` is one of the multi-token-prediction modules stored after the last layer
    (`num_nextn_predict_layers` of them): kept in published checkpoints, never run."""
    return cfg.num_hidden_layers <= layer < cfg.num_hidden_layers + cfg.num_nextn_predict_layers


@dataclass(frozen=True, slots=True)
class ProjectionRecord:
    """One expert projection as stored: codec components of a `[rows, cols]` matrix."""

    codec: Codec
    shape: tuple[int, int]
    parts: dict[str, np.ndarray]

    def decode(self) -> np.ndarray:
        """float32 `[rows, cols]` via the codec's reference decode."""
        return self.codec.decode(self.parts, self.shape)


@dataclass(frozen=True, slots=True)
class ExpertRecord:
    """One routed expert: `projections` keyed "gate", "up", "down"; `layer` is 0-based."""

    layer: int
    expert: int
    projections: dict[str, ProjectionRecord]

    def decode(self) -> dict[str, np.ndarray]:
        return {p: rec.decode() for p, rec in self.projections.items()}


class ExpertLayout(ABC):
    name: str  # "mxfp4" | "w3" | "t158" | "bf16" | "fp8"
    codec: Codec

    @abstractmethod
    def read(self, layer: int, expert: int) -> ExpertRecord:
        """Read one expert's bytes (blocking) into an ExpertRecord."""

    def close(self) -> None:  # noqa: B027 (a deliberate no-op default, not an abstract method)
        """Release what the layout holds open itself (shards belong to the Checkpoint)."""


def _fail(shard: SafetensorsFile, name: str, why: str) -> CheckpointError:
    return CheckpointError(f"{shard.path}: tensor {name!r} {why}")


def _check_tensor(shard: SafetensorsFile, name: str, dtypes: set[str], shape: tuple) -> None:
    info = shard.tensors[name]
    if info.dtype not in dtypes or info.shape != tuple(shape):
        want = "|".join(sorted(dtypes))
        raise _fail(shard, name, f"is {info.dtype}{list(info.shape)}, expected {want}{list(shape)}")


def _check_in_config(cfg: ModelConfig, shard: SafetensorsFile, name: str, layer: int, expert: int):
    if layer >= cfg.num_hidden_layers or not cfg.is_moe_layer(layer):
        moe = f"{cfg.first_k_dense_replace}..{cfg.num_hidden_layers - 1}"
        raise _fail(shard, name, f"is for layer {layer}, which is not an MoE layer of the config "
                                 f"(MoE layers {moe})")
    if expert >= cfg.num_experts:
        raise _fail(shard, name, f"is for expert {expert}, but the config has num_experts "
                                 f"{cfg.num_experts}")


def _expert_specs(codec: Codec, cfg: ModelConfig, root: str) -> dict[str, list[ComponentSpec]]:
    """Component specs per projection; an expert shape the codec cannot hold is a config error."""
    try:
        return {p: codec.components(s) for p, s in cfg.expert_shapes.items()}
    except FormatError as e:
        raise CheckpointError(f"{root}: the config's expert shapes {cfg.expert_shapes} do not fit "
                              f"the {codec.name} codec: {e}") from None


def _incomplete(root: str, unit: str, bad: int, total: int, entries: list[str]) -> CheckpointError:
    shown = "; ".join(entries[:_MAX_LISTED]) + ("; ..." if len(entries) > _MAX_LISTED else "")
    return CheckpointError(f"{root}: incomplete expert set, {bad} of {total} {unit} absent or "
                           f"incomplete: {shown}")


def _ranges(ids: list[int]) -> str:
    """Sorted ids as ranges: [8, 9, 10, 12] -> "8-10, 12"."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in runs)


class PerExpertLayout(ExpertLayout):
    """mxfp4, w3 and bf16: each component of each expert projection is its own tensor."""

    def __init__(self, name: str, codec: Codec, cfg: ModelConfig,
                 where: Mapping[str, SafetensorsFile], groups: dict, root: str):
        self.name, self.codec, self._cfg, self._where = name, codec, cfg, where
        self._naming = expert_naming(cfg)
        self._specs = _expert_specs(codec, cfg, root)
        # suffix -> (safetensors dtype, shape) of every tensor a projection may have, and the
        # suffixes it must have. w3 also stores the unpacked shape (required) and, from
        # ct <= 0.18 with actorder "group", the column-to-group map (optional).
        self._allowed: dict[str, dict[str, tuple[str, tuple]]] = {}
        self._required: dict[str, list[str]] = {}
        for proj, (_, cols) in cfg.expert_shapes.items():
            allowed = {c.name: (c.st_dtype, c.shape) for c in self._specs[proj]}
            self._required[proj] = list(allowed)
            if name == "w3":
                allowed["weight_shape"] = ("I64", (2,))
                allowed["weight_g_idx"] = ("I32", (cols,))
                self._required[proj].append("weight_shape")
            self._allowed[proj] = allowed
        self._validate(groups, root)

    def _validate(self, groups: dict, root: str) -> None:
        """Check every expected projection, consuming `groups`; leftovers are outside the config."""
        cfg = self._cfg
        n_required = sum(len(r) for r in self._required.values())
        entries, bad = [], 0
        for layer in cfg.moe_layers:
            absent = []
            for e in range(cfg.num_experts):
                gaps = []
                for off, proj in self._naming.projections.items():
                    have = groups.pop((layer, e, off), {})
                    self._check_group(have, proj)
                    gaps += [f"{off}.{s}" for s in self._required[proj] if s not in have]
                if len(gaps) == n_required:
                    absent.append(e)
                elif gaps:
                    entries.append(f"layer {layer} expert {e} lacks {', '.join(gaps)}")
                bad += bool(gaps)
            if absent:
                entries.append(f"layer {layer} experts {_ranges(absent)} absent")
        # Whatever is left names a layer or expert the config does not have.
        for (layer, e, _), have in groups.items():
            name = next(iter(have.values()))
            _check_in_config(cfg, self._where[name], name, layer, e)
        if entries:
            total = len(cfg.moe_layers) * cfg.num_experts
            raise _incomplete(root, "experts", bad, total, entries)

    def _check_group(self, have: dict[str, str], proj: str) -> None:
        allowed = self._allowed[proj]
        for suffix, name in have.items():
            if suffix not in allowed:
                raise _fail(self._where[name], name,
                            f"does not belong to the {self.name} expert layout "
                            f"(expected suffixes: {', '.join(allowed)})")
            st_dtype, shape = allowed[suffix]
            _check_tensor(self._where[name], name, {st_dtype}, shape)

    def read(self, layer: int, expert: int) -> ExpertRecord:
        projections = {}
        for off, proj in self._naming.projections.items():
            prefix = self._naming.prefix.format(layer=layer, expert=expert, proj=off)
            shape = self._cfg.expert_shapes[proj]
            parts = {c.name: self._where[prefix + c.name].read(prefix + c.name)
                     for c in self._specs[proj]}
            if self.name == "w3":
                self._read_w3_extras(prefix, shape, parts)
            projections[proj] = ProjectionRecord(self.codec, shape, parts)
        return ExpertRecord(layer, expert, projections)

    def _read_w3_extras(self, prefix: str, shape: tuple[int, int], parts: dict) -> None:
        name = prefix + "weight_shape"
        stored = tuple(int(x) for x in self._where[name].read(name))
        # Checked at read time, not open: it is 16 bytes per tensor x 247k tensors at full size.
        if stored != shape:
            raise _fail(self._where[name], name, f"holds {list(stored)}, the config's expert "
                                                 f"shape is {list(shape)}")
        g_idx = prefix + "weight_g_idx"
        if g_idx in self._where:
            parts["weight_g_idx"] = self._where[g_idx].read(g_idx)


class StackedT158Layout(ExpertLayout):
    """t158 non-streaming: per layer and projection, `packed` (E, rows, 13*cols/64) U8 and
    `scales` (E, rows, cols/64) U16 or BF16; expert e is the e-th contiguous slice."""

    name = "t158"

    def __init__(self, cfg: ModelConfig, where: Mapping[str, SafetensorsFile],
                 stacked: dict, root: str):
        self.codec, self._cfg, self._where = get_codec("t158"), cfg, where
        self._specs = _expert_specs(self.codec, cfg, root)
        self._names: dict[tuple[int, str, str], str] = {}
        entries = []
        for layer in cfg.moe_layers:
            gaps = []
            for proj in T158_PROJECTIONS.values():
                for c in self._specs[proj]:
                    name = stacked.pop((layer, proj, c.name), None)
                    if name is None:
                        gaps.append(f"{proj}_proj.{c.name}")
                        continue
                    # Both tags carry the same bf16 bits; the published tag is unconfirmed.
                    dtypes = {"U16", "BF16"} if c.st_dtype == "U16" else {c.st_dtype}
                    _check_tensor(where[name], name, dtypes, (cfg.num_experts, *c.shape))
                    self._names[layer, proj, c.name] = name
            if gaps:
                entries.append(f"layer {layer} lacks {', '.join(gaps)}")
        for (layer, _, _), name in stacked.items():
            _check_in_config(cfg, where[name], name, layer, 0)
        if entries:
            raise _incomplete(root, "layers", len(entries), len(cfg.moe_layers), entries)

    def read(self, layer: int, expert: int) -> ExpertRecord:
        projections = {}
        for proj, shape in self._cfg.expert_shapes.items():
            parts = {}
            for c in self._specs[proj]:
                name = self._names[layer, proj, c.name]
                shard = self._where[name]
                # Only this expert's slice leaves the disk; the stacked tensor is GBs at full size.
                data = shard.read_range(name, expert * c.nbytes, c.nbytes)
                parts[c.name] = np.frombuffer(data, dtype=c.dtype).reshape(c.shape).copy()
            projections[proj] = ProjectionRecord(self.codec, shape, parts)
        return ExpertRecord(layer, expert, projections)


def _kind(shard: SafetensorsFile, name: str, suffix: str) -> str | None:
    """The layout one per-expert tensor implies, or None for a suffix that implies none."""
    if suffix == "weight":  # BF16, or FP8 e4m3 beside its block scales (fp8-block)
        return "fp8" if shard.tensors[name].dtype == "F8_E4M3" else "bf16"
    if suffix != "weight_packed":
        return None
    dtype = shard.tensors[name].dtype
    if dtype not in ("U8", "I32"):
        raise _fail(shard, name, f"is {dtype}: weight_packed must be U8 (MXFP4) or I32 "
                                 f"(compressed-tensors int)")
    return "mxfp4" if dtype == "U8" else "w3"


def detect_expert_layout(cfg: ModelConfig, where: Mapping[str, SafetensorsFile],
                         root: str) -> ExpertLayout:
    """Find, validate and return the checkpoint's single routed-expert layout."""
    groups: dict[tuple[int, int, str], dict[str, str]] = {}
    stacked: dict[tuple[int, str, str], str] = {}
    examples: dict[str, str] = {}  # layout -> first tensor implying it
    per_expert = expert_naming(cfg).pattern
    for name, shard in where.items():
        if m := _STACKED.fullmatch(name):
            key = (int(m[1]), T158_PROJECTIONS[m[2]], m[3])
            if key in stacked:
                raise _fail(shard, name, f"and {stacked[key]!r} are two spellings of one tensor")
            stacked[key] = name
            examples.setdefault("t158", name)
        elif m := per_expert.fullmatch(name):
            if mtp_layer(cfg, int(m[1])):
                continue  # an MTP module's experts: not part of the model that runs
            groups.setdefault((int(m[1]), int(m[2]), m[3]), {})[m[4]] = name
            if kind := _kind(shard, name, m[4]):
                examples.setdefault(kind, name)
    if len(examples) > 1:
        shown = ", ".join(f"{k} ({v})" for k, v in sorted(examples.items()))
        raise CheckpointError(f"{root}: mixed routed-expert layouts: {shown}")
    if not examples:
        raise CheckpointError(f"{root}: no routed-expert tensors of a known layout "
                              f"(mxfp4, w3, t158, bf16, fp8)")
    (kind,) = examples
    qc = cfg.quantization_config
    if kind == "t158":
        if groups:  # e.g. stray `.weight_scale` tensors beside stacked ones
            name = next(iter(next(iter(groups.values())).values()))
            raise _fail(where[name], name, "is a per-expert tensor in a t158 stacked checkpoint")
        _require_no_quantization(qc, kind, root)
        return StackedT158Layout(cfg, where, stacked, root)
    if kind == "mxfp4":
        _require_mxfp4_config(qc, root)
        codec = get_codec("mxfp4")
    elif kind == "bf16":
        _require_no_quantization(qc, kind, root)
        codec = get_codec("bf16")
    elif kind == "fp8":
        try:
            parse_fp8_config(qc if qc is not None else {})
        except FormatError as e:
            raise CheckpointError(f"{root}: experts are FP8 (F8_E4M3 weight) but the config's "
                                  f"{e}") from None
        codec = get_codec("fp8-block")
    else:
        codec = _w3_codec(cfg, where, groups, root)
    return PerExpertLayout(kind, codec, cfg, where, groups, root)


def _require_no_quantization(qc: dict | None, kind: str, root: str) -> None:
    if qc is not None:
        raise CheckpointError(f"{root}: config has a quantization_config "
                              f"({qc.get('format')!r}) but the routed experts are {kind}")


def _require_mxfp4_config(qc: dict | None, root: str) -> None:
    groups = (qc or {}).get("config_groups") or {}
    formats = {qc.get("format")} if qc else set()
    formats |= {g.get("format") for g in groups.values() if isinstance(g, dict)}
    if "mxfp4-pack-quantized" not in formats:
        raise CheckpointError(f"{root}: experts are MXFP4 (U8 weight_packed) but the config's "
                              f"quantization_config format is not 'mxfp4-pack-quantized'")


def _w3_codec(cfg: ModelConfig, where: Mapping[str, SafetensorsFile], groups: dict,
              root: str) -> Codec:
    """compressed-tensors int experts: scheme from the config, one packing layout from widths."""
    if cfg.quantization_config is None:
        raise CheckpointError(f"{root}: experts are compressed-tensors int (I32 weight_packed) "
                              f"but the config has no quantization_config")
    try:
        scheme = parse_quantization_config(cfg.quantization_config)
    except FormatError as e:
        raise CheckpointError(f"{root}: quantization_config: {e}") from None
    if scheme.num_bits != 3:  # 2/4/8-bit packings are the same in every ct version
        return get_codec("ct-int", num_bits=scheme.num_bits, symmetric=scheme.symmetric,
                         group_size=scheme.group_size)
    layouts: dict[str, str] = {}  # layout -> first tensor in it
    seen: dict[tuple[int, int], str] = {}  # (width, cols) -> layout; widths repeat 247k times
    for (_, _, off), have in groups.items():
        name = have.get("weight_packed")
        if name is None:
            continue
        shard = where[name]
        proj = expert_naming(cfg).projections[off]
        width, cols = shard.tensors[name].shape[-1], cfg.expert_shapes[proj][1]
        if (width, cols) not in seen:
            try:
                seen[width, cols] = detect_layout(width, cols, scheme.version)
            except FormatError as e:
                raise _fail(shard, name, f"cannot be read: {e}") from None
        layouts.setdefault(seen[width, cols], name)
    if len(layouts) > 1:
        shown = ", ".join(f"{k} ({v})" for k, v in sorted(layouts.items()))
        raise CheckpointError(f"{root}: one packing layout per checkpoint, found {shown}")
    (layout,) = layouts
    return get_codec("ct-int", num_bits=3, layout=layout, symmetric=scheme.symmetric,
                     group_size=scheme.group_size)
