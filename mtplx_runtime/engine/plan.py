"""Memory plan: how a memory budget splits into fixed items and expert-cache slots.

    model dir (manifest + config, or a plain checkpoint) + kernel backend -> ModelFacts
        -> fixed items (residents, KDA state, MLA cache, workspace, I/O buffers, prefill pool,
           reserve, kernel headroom) -> what is left / record stride = compute-tier slots;
           host budget / stride = host slots

Every item is computed from the config, the record geometry and the kernel backend, never from
this process, so `mtplx plan` and `load` agree and the same arithmetic checks the full-size K3
on any machine (FORMAT.md "Decode state", "Bank parts"). The one measured figure is the runtime
baseline (interpreter, torch, this package, threads: BENCHMARKS.md "bench_memory"). The budget
must hold the minimum working set: the fixed items plus one layer's top-k records (a decode
step); a prefill chunk needs no more, because the provider runs a layer's experts in windows
that fit the slots there are. Below it `plan_for` raises `PlanError` naming the minimum, its
parts and the flag that lowers each.

Conventions the runtime must keep for the plan to hold (the plan itself allocates nothing):
* MLA caches are allocated with capacity = `context`, `grow=False` (the growing cache doubles);
* the provider's transient pool is `transient_slots` records (prefill windows through it, or
  through the compute tier when it is 0), and only decoding backends decode experts, at most
  one window (`decoded_experts`) at a time;
* reads land in the slots on the host; a GPU run stages each of `read_depth` reads in flight
  through one record-sized host buffer (offload/device_io.py).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Protocol

from ..artifact.manifest import DTYPE_BYTES, MANIFEST_NAME, load_manifest
from ..checkpoint import DeepseekV3Config, load_config
from ..checkpoint.config import ModelConfig, load_json
from ..checkpoint.layouts import is_expert_tensor
from ..checkpoint.residents import resident_tensor_specs
from ..checkpoint.safetensors_io import SafetensorsFile
from ..formats.base import FormatError
from ..formats.ctint import parse_quantization_config
from ..formats.fp8block import parse_quantization_config as parse_fp8_config
from ..formats.record import align_up, record_layout
from ..formats.resident_layouts import (
    RESIDENT_DTYPES,
    quantizable,
    quantized_bytes,
    resolve_resident_dtype,
)
from ..kernels import BACKENDS
from ..offload.bank_reader import DEFAULT_READ_DEPTH

DTYPE_SIZES = {"float32": 4, "bfloat16": 2}
ACT_BYTES = 4  # workspace activations are estimated in fp32 (the reference's fp32 islands)
# What a streamed run holds besides the plan's items: interpreter, torch, this package, the
# native kernels, reader / prefetch / torch threads and their malloc arenas. Measured on Linux
# x86-64 (torch 2.13 CPU, 2 cores): 247-264 MiB at four budgets of a K3-geometry slice, 32 to
# 1,000 tokens at contexts 256 and 2,048, rounded up by about a tenth (BENCHMARKS.md
# "bench_memory"; tools/bench_memory.py re-measures it). A constant, not this process's RSS: a
# long-lived process may hold other models, and `mtplx plan` must agree with `load`. A GPU
# run's CUDA context is not measured yet: the same figure stands in for it.
RUNTIME_BASELINE_BYTES = 288 * 2**20
# Of the torch-held items (residents, state, workspace), for allocator fragmentation. Expert
# slots are one mmap per tier and fragment nothing, so the fraction never touches them.
RESERVE_FRACTION = 0.05
# Room a host budget leaves for what a memory cgroup charges beside the process's RSS (page
# cache of the libraries and files it reads, page tables, slab): 140-143 MiB measured from a
# cold page cache at every budget of a K3-geometry slice (bench_memory --drop-caches), rounded
# up by about a tenth. Planned up to the limit instead, page faults reclaim: decode slowed 1.3x
# and a warm fill 4x (BENCHMARKS.md "bench_peers"). GPU budgets have no page cache: none there.
KERNEL_HEADROOM_BYTES = 160 * 2**20
DEFAULT_CONTEXT = 4096  # tokens, when nothing else decides
# An afforded context (afforded_context) grows in powers of two up to here, and only while the
# expert cache keeps this share of its slots and its uncached records grow by at most the same
# factor's inverse: long contexts where memory has room, never bought by starving the cache (a
# cache that holds the whole bank gives up no record for context; one that holds 99 % gives up
# few, since each one lost there is a miss on every use). The ceiling keeps a reply that never
# stops (max_tokens = the rest of the context) from running for hours.
CONTEXT_CEILING = 32768
CONTEXT_KEEP_SLOTS = 0.9
MAX_AUTO_CHUNK = 256
INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"  # a checkpoint's tensors
_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9,
          "GB": 10**9, "T": 10**12, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
          "TIB": 2**40}
ITEMS = ("residents", "kda_state", "mla_cache", "workspace", "io_buffers", "prefill_pool",
         "reserve", "headroom")
LABELS = {"residents": "resident tensors", "kda_state": "KDA state",
          "mla_cache": "MLA latent cache", "workspace": "workspace", "io_buffers": "I/O buffers",
          "prefill_pool": "prefill pool", "reserve": "runtime reserve",
          "headroom": "kernel headroom",
          "working_set": "expert working set"}
# What lowers each part of the minimum, in the user's terms (`mtplx plan`, the PlanError).
LOWERED_BY = {
    "residents": "fixed by the model; --resident-dtype int8/int4/fp8 shrinks them, --dtype "
                 "float32 doubles the BF16 ones",
    "kda_state": "grows with --batch",
    "mla_cache": "grows with --context",
    "workspace": "grows with --prefill-chunk; the reference kernels add decoded experts",
    "io_buffers": "GPU staging: one record per read in flight (the read depth)",
    "prefill_pool": "the reference kernels' prefill window; --kernels cpu needs none",
    "reserve": "fixed: the measured runtime baseline + 5% of residents, state and workspace",
    "headroom": "fixed: page cache and kernel memory a memory limit counts beside the RSS",
    "working_set": "one layer's top-k records; fixed by the bank's codec",
}


class PlanError(ValueError):
    """The budget cannot hold the minimum working set (or a plan argument is invalid)."""


def parse_bytes(text: str | int) -> int:
    """"8GiB", "512MiB", "1.5GB", "123456" -> bytes. Binary units KiB..TiB, decimal KB..TB."""
    if isinstance(text, bool) or not isinstance(text, (int, str)):
        raise PlanError(f"not a byte size: {text!r}")
    s = str(text).strip().replace("_", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ").strip()
    unit = s[len(num):].strip().upper()
    if unit not in _UNITS:
        raise PlanError(f"unknown unit {unit!r} in {text!r}; use B, KiB, MiB, GiB, TiB, KB, MB, "
                        "GB or TB")
    if num.isdigit():  # exact integer arithmetic for whole numbers
        return int(num) * _UNITS[unit]
    try:
        n = float(num) * _UNITS[unit]
    except ValueError:
        raise PlanError(f"not a byte size: {text!r} (write e.g. 8GiB, 512MiB, 1.5GB)") from None
    if not math.isfinite(n) or n < 0:
        raise PlanError(f"byte size must be finite and >= 0, got {text!r}")
    if n != int(n):
        raise PlanError(f"{text!r} is not a whole number of bytes")
    return int(n)


def fmt_bytes(n: int) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def mem_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (the default budget of a streaming artifact)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    raise PlanError("cannot read MemAvailable from /proc/meminfo; give a memory budget")


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What the plan needs from a model: config, record geometry and stored residents."""

    cfg: ModelConfig
    mode: str  # record codec mode, e.g. "t158"
    record_bytes: int  # logical bytes of one record (uniform across the bank)
    routed_layers: tuple[int, ...]  # 0-based MoE layers whose experts stream
    # (tensor, dtype, bytes) as stored, but a quantized matrix as its bf16 original: resident_bytes
    # sizes quantized matrices from the resident table
    residents: tuple[tuple[str, str, int], ...]
    source: str  # "manifest" | "checkpoint" (config + tensor names) | "config" (config alone)
    resident_dtype: str = "bf16"  # what the model stores (an artifact's --resident-dtype)
    source_bytes: int | None = None  # the checkpoint's tensor bytes (its index's total_size)
    bits: int | None = None  # a ct-int bank's bit width
    group_size: int | None = None  # a ct-int bank's scale group (None: the mode's default)

    @property
    def geometry(self) -> Geometry:
        return geometry_of(self.cfg)


class Geometry(Protocol):
    """What the plan needs of a model family, from its config: a second family (its own config
    class) supplies one of these and registers it in GEOMETRIES; nothing else in the plan knows
    the family. Sizes in bytes; `dtype` is the model dtype ("bfloat16" | "float32")."""

    experts: int  # routed experts per MoE layer
    top_k: int
    routed_layers: tuple[int, ...]  # 0-based MoE layers whose experts stream
    max_positions: int
    embedding: str  # the resident read one row per token (every other is read whole)

    def resident_specs(self) -> dict:  # name -> checkpoint.residents.ResidentSpec (stored form)
        ...

    def record_bytes(self, mode: str, bits: int | None,
                     group_size: int | None = None) -> int:  # one expert in a bank mode
        ...

    def expert_weights(self) -> int:  # weights of one routed expert, all projections
        ...

    def state_bytes(self, dtype: str, batch: int) -> int:  # recurrent state, all sequences
        ...

    def cache_token_bytes(self, dtype: str) -> int:  # attention cache per token of context
        ...

    def workspace_bytes(self, dtype: str, tokens: int, context: int, decoded_experts: int,
                        grouped: bool) -> int:  # one step's live activations
        ...


class _Geometry:
    """The members every family's geometry reads alike from its config (`self.cfg`)."""

    __slots__ = ()

    @property
    def experts(self) -> int:
        return self.cfg.num_experts

    @property
    def top_k(self) -> int:
        return self.cfg.num_experts_per_token

    @property
    def routed_layers(self) -> tuple[int, ...]:
        return tuple(self.cfg.moe_layers)

    @property
    def max_positions(self) -> int:
        return self.cfg.max_position_embeddings

    def resident_specs(self) -> dict:
        return resident_tensor_specs(self.cfg)

    def record_bytes(self, mode: str, bits: int | None, group_size: int | None = None) -> int:
        return record_layout(self.cfg, mode, bits, group_size).logical_bytes

    def expert_weights(self) -> int:
        return sum(r * c for r, c in self.cfg.expert_shapes.values())

    def cache_token_bytes(self, dtype: str) -> int:
        return mla_token_bytes(self.cfg, dtype)

    def workspace_bytes(self, dtype: str, tokens: int, context: int, decoded_experts: int,
                        grouped: bool) -> int:
        return workspace_bytes(self.cfg, dtype, tokens, context, decoded_experts, grouped)


@dataclass(frozen=True, slots=True)
class K3Geometry(_Geometry):
    """Kimi K3's geometry (and its tiny fixtures'): KDA recurrent state, MLA latent cache,
    LatentMoE experts (FORMAT.md "Geometry", "Decode state")."""

    cfg: ModelConfig
    embedding: str = "language_model.model.embed_tokens.weight"

    def state_bytes(self, dtype: str, batch: int) -> int:
        return kda_state_bytes(self.cfg, dtype, batch)


@dataclass(frozen=True, slots=True)
class DeepseekV3Geometry(_Geometry):
    """The DeepSeek-V3 family's geometry (FORMAT.md "The DeepSeek-V3 family"): every layer MLA
    (its latent cache holds the rotated keys), no recurrent state, no AttnRes bank, routed
    experts at the hidden width."""

    cfg: DeepseekV3Config
    embedding: str = "model.embed_tokens.weight"

    def state_bytes(self, dtype: str, batch: int) -> int:
        return 0


# config class -> its Geometry
GEOMETRIES: dict[type, type] = {ModelConfig: K3Geometry, DeepseekV3Config: DeepseekV3Geometry}


def geometry_of(cfg) -> Geometry:
    try:
        return GEOMETRIES[type(cfg)](cfg)
    except KeyError:
        raise PlanError(f"no plan geometry for a {type(cfg).__name__}") from None


def facts_from_config(cfg: ModelConfig, mode: str = "t158", bits: int | None = None,
                      group_size: int | None = None) -> ModelFacts:
    """Facts without any file: residents from the resident table, records from the layout
    (`group_size` None: the mode's default)."""
    g = geometry_of(cfg)
    residents = tuple((name, s.dtype, math.prod(s.shape) * DTYPE_BYTES[s.dtype])
                      for name, s in g.resident_specs().items())
    ct_int = mode.startswith("ct-int")
    return ModelFacts(cfg, mode, g.record_bytes(mode, bits, group_size), g.routed_layers,
                      residents, "config", bits=bits if ct_int else None,
                      group_size=group_size if ct_int else None)


def bank_mode(root: Path, cfg: ModelConfig) -> tuple[str, int | None, int | None, str]:
    """(mode, bits, group size, what told) of the bank `mtplx build-manifest --bank-codec keep`
    would write for the checkpoint at `root`, from its config's quantization_config, else (t158
    and bf16 have none) from its tensor names: the index's weight_map, or the one shard's
    header. The shards themselves need not be there."""
    qc = cfg.quantization_config
    if qc is not None and qc.get("quant_method") == "fp8":  # DeepSeek's FP8 block checkpoints
        try:
            parse_fp8_config(qc)
        except FormatError as e:
            raise PlanError(f"{root / 'config.json'}: quantization_config: {e}") from None
        return "fp8-block", None, None, "config"
    if qc is not None:
        groups = qc.get("config_groups") or {}
        formats = {qc.get("format")} | {g.get("format") for g in groups.values()
                                        if isinstance(g, dict)}
        if "mxfp4-pack-quantized" in formats:
            return "mxfp4", None, None, "config"
        try:
            scheme = parse_quantization_config(qc)
        except FormatError as e:
            raise PlanError(f"{root / 'config.json'}: quantization_config: {e}") from None
        return (("ct-int" if scheme.symmetric else "ct-int-asym"), scheme.num_bits,
                scheme.group_size, "config")
    names = tensor_names(root)
    if names is None:
        raise PlanError(f"{root}: config.json has no quantization_config, so the routed experts "
                        f"are t158 or bf16, and only the tensor names tell which: put "
                        f"{INDEX} beside it, or pass --bank-codec t158 to plan a t158 build")
    experts = [n for n in names if is_expert_tensor(n)]
    if not experts:
        raise PlanError(f"{root}: no routed-expert tensors among the {len(names)} names of "
                        f"{INDEX if (root / INDEX).is_file() else SINGLE}")
    # Stacked t158 tensors end in .packed / .scales; a per-expert .weight is bf16.
    return ("bf16" if any(n.endswith(".weight") for n in experts) else "t158"), None, None, \
        "checkpoint"


def tensor_names(root: Path) -> list[str] | None:
    """The checkpoint's tensor names from its index (or its one shard's header); None when
    neither is there."""
    if (root / INDEX).is_file():
        index = load_json(root / INDEX, error=PlanError)
        wm = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wm, dict):
            raise PlanError(f"{root / INDEX}: no weight_map object")
        return list(wm)
    if (root / SINGLE).is_file():
        with SafetensorsFile(root / SINGLE) as f:
            return list(f.tensors)
    return None


def source_bytes(root: Path) -> int | None:
    """The checkpoint's tensor bytes: its index's metadata.total_size, else the shards that are
    there; None when neither says."""
    if (root / INDEX).is_file():
        index = load_json(root / INDEX, error=PlanError)
        meta = index.get("metadata") if isinstance(index, dict) else None
        total = meta.get("total_size") if isinstance(meta, dict) else None
        if isinstance(total, int) and not isinstance(total, bool) and total > 0:
            return total
    shards = [p.stat().st_size for p in root.glob("*.safetensors") if p.is_file()]
    return sum(shards) or None


def facts_from_dir(model_dir: str | Path, manifest=None, bank_codec: str | None = None,
                   config=None) -> ModelFacts:
    """A streaming artifact (its manifest and config.json), or a checkpoint from its config.json
    (plus the tensor names when the config cannot tell t158 from bf16): no shard needs to be
    there, so a machine can be sized before the download. `manifest`, `config`: the artifact's
    manifest and config when the caller has them loaded already; `bank_codec` "t158": plan a
    checkpoint's t158 build (`mtplx build-manifest --bank-codec t158`) instead of its own codec
    ("keep", None)."""
    root = Path(model_dir)
    if bank_codec not in (None, "keep", "t158"):
        raise PlanError(f"bank codec must be keep or t158, not {bank_codec!r}")
    if (root / MANIFEST_NAME).is_file() and bank_codec == "t158":
        raise PlanError(f"{root}: a streaming artifact's bank is built already; --bank-codec "
                        "plans a checkpoint's build")
    if not (root / MANIFEST_NAME).is_file():
        if not (root / "config.json").is_file():
            if not root.is_dir():
                raise PlanError(f"{root}: no such directory")
            return _facts_from_source(root, bank_codec)  # a GGUF source: its config is inside
        cfg = load_config(root / "config.json", root=root)
        mode, bits, group, told = ("t158", None, None, "config") if bank_codec == "t158" else \
            bank_mode(root, cfg)
        return replace(facts_from_config(cfg, mode, bits, group), source=told,
                       source_bytes=source_bytes(root))
    cfg = config if config is not None else load_config(root / "config.json", root=root)
    m = manifest if manifest is not None else load_manifest(root / MANIFEST_NAME)
    sizes = {r.logical_bytes for r in m.records}
    if len(sizes) != 1:
        raise PlanError(f"{root}: records of {len(sizes)} sizes; the plan needs one record size")
    # Only the tensors the model loads count; a stored length beats the table (A_log padding),
    # but a matrix stored in another dtype (an fp8 checkpoint's FP8 one) loads as the table's.
    wanted = geometry_of(cfg).resident_specs()
    stored = {t.tensor: (t.dtype, t.length) for t in m.resident_tensors}
    quantized = m.resident_dtype != "bf16"
    residents = tuple(
        (name, s.dtype, math.prod(s.shape) * DTYPE_BYTES[s.dtype])
        if name not in stored or stored[name][0] != s.dtype
        or (quantized and quantizable(name, s.shape, s.dtype))
        else (name, *stored[name]) for name, s in wanted.items())
    mode = m.quantization["mode"]
    ct_int = mode.startswith("ct-int")
    return ModelFacts(cfg, mode, sizes.pop(), tuple(sorted({r.layer for r in m.records})),
                      residents, "manifest", m.resident_dtype,
                      bits=m.quantization.get("bits") if ct_int else None,
                      group_size=m.quantization.get("group_size") if ct_int else None)


def _facts_from_source(root: Path, bank_codec: str | None) -> ModelFacts:
    """Facts of a source without config.json (a GGUF K3), opened through its reader."""
    from ..artifact.build import ExpertSource
    from ..artifact.open import open_source

    with open_source(root) as ckpt:
        src = ExpertSource(ckpt, bank_codec or "keep")
        facts = facts_from_config(ckpt.config, src.mode, src.bits, src.group_size)
    return replace(facts, source="checkpoint", source_bytes=source_bytes(root))


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """Bytes per item; `sum(items) + compute_slots * record_stride + slack_bytes ==
    memory_budget`. Host-tier slots come from `host_budget` alone. Neither tier gets more slots
    than the bank has records; bytes beyond that stay slack (unused)."""

    memory_budget: int
    host_budget: int
    dtype: str
    context: int
    batch: int
    prefill_chunk: int
    resident_dtype: str  # bf16 | int8 | int4 | fp8 (FORMAT.md "Quantized residents")
    mode: str
    source: str
    kernels: str  # the expert kernel backend planned for: reference | cpu | cuda
    record_bytes: int
    record_stride: int  # record_bytes rounded up to 4 KiB: one slot
    routed_layers: int
    experts_per_layer: int
    top_k: int
    working_set_records: int  # records a decode step needs at once: one layer's top-k
    decoded_experts: int  # experts decoded (model dtype) at once: 0 for packed-byte kernels
    read_depth: int  # reads in flight at once
    transient_slots: int = 0  # the provider's prefill pool, records (`items["prefill_pool"]`)
    items: dict[str, int] = field(default_factory=dict)  # ITEMS order
    compute_slots: int = 0
    host_slots: int = 0
    slack_bytes: int = 0
    host_slack_bytes: int = 0
    minimum_budget: int = 0  # smallest memory_budget that plans at prefill chunk minimum_chunk
    minimum_chunk: int = 1
    minimum_parts: dict[str, int] = field(default_factory=dict)  # the minimum, part by part
    runtime_baseline: int = RUNTIME_BASELINE_BYTES  # inside `items["reserve"]`

    @property
    def minimum_dominant(self) -> str:
        """The largest part of the minimum budget."""
        return max(self.minimum_parts, key=self.minimum_parts.get) if self.minimum_parts else ""

    @property
    def fixed_bytes(self) -> int:
        return sum(self.items.values())

    @property
    def planned_peak_bytes(self) -> int:
        """The process's RSS once every planned slot is in use: the budget less slack and the
        kernel headroom (page cache and kernel memory fill that, not the process)."""
        return self.memory_budget - self.slack_bytes - self.items["headroom"]

    @property
    def slots_per_layer(self) -> int:
        return self.compute_slots // self.routed_layers

    @property
    def host_slots_per_layer(self) -> int:
        return self.host_slots // self.routed_layers

    @property
    def total_records(self) -> int:
        return self.routed_layers * self.experts_per_layer

    @property
    def cacheable_share(self) -> float:
        return min(1.0, (self.compute_slots + self.host_slots) / self.total_records)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(fixed_bytes=self.fixed_bytes, slots_per_layer=self.slots_per_layer,
                 host_slots_per_layer=self.host_slots_per_layer,
                 total_records=self.total_records, cacheable_share=self.cacheable_share,
                 minimum_dominant=self.minimum_dominant,
                 planned_peak_bytes=self.planned_peak_bytes)
        return d


def resident_bytes(facts: ModelFacts, dtype: str, resident_dtype: str | None = None) -> int:
    """BF16 residents load in the model dtype (double in float32), or quantized where
    `resident_dtype` int8/int4/fp8 takes them (None: as the model stores them); F32 ones stay
    F32."""
    resident_dtype = resident_dtype or facts.resident_dtype
    size = DTYPE_SIZES[dtype]
    specs = facts.geometry.resident_specs() if resident_dtype != "bf16" else {}
    total = 0
    for name, st, n in facts.residents:
        if name in specs and quantizable(name, specs[name].shape, st):
            total += quantized_bytes(specs[name].shape, resident_dtype)
        else:
            total += n // 2 * size if st == "BF16" else n
    return total


def kda_state_bytes(cfg: ModelConfig, dtype: str, batch: int = 1) -> int:
    """fp32 recurrent [H, K, K] + conv history [3, W-1, H*K] in the model dtype, per layer
    (FORMAT.md "Decode state")."""
    n_kda = sum(cfg.is_kda_layer(i) for i in range(cfg.num_hidden_layers))
    h, k, w = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_short_conv_kernel_size
    per_layer = h * k * k * 4 + 3 * (w - 1) * h * k * DTYPE_SIZES[dtype]
    return n_kda * per_layer * batch


def mla_token_bytes(cfg: ModelConfig, dtype: str) -> int:
    """[c̄ ‖ k_pe] = kv_lora_rank + rope values per token per MLA layer (FORMAT.md "MLA")."""
    n_mla = sum(not cfg.is_kda_layer(i) for i in range(cfg.num_hidden_layers))
    return n_mla * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * DTYPE_SIZES[dtype]


def workspace_bytes(cfg: ModelConfig, dtype: str, tokens: int, context: int,
                    decoded_experts: int, grouped: bool = False) -> int:
    """Estimate of one step's live activations for `tokens` (chunk x batch) tokens, fp32, plus
    `decoded_experts` experts decoded to the model dtype. Conservative: the terms are summed.
    `grouped`: the routed experts' intermediates are held for every (token, k) pair at once (the
    CUDA grouped GEMM's h [T*K, I]); the host backends run one expert's tokens at a time."""
    t, d = tokens, cfg.hidden_size
    blocks = len(cfg.attn_res_block_starts)
    stream = (blocks + 4) * t * d  # AttnRes bank + running sum + mixed input + normed input
    kda_w = cfg.kda_num_heads * cfg.kda_head_dim
    mla_head = 2 * cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim
    attn = max(10 * t * kda_w,  # q, k, v, g, beta, gates and their convolved copies
               t * cfg.num_attention_heads * (mla_head + 2 * context))  # q/k/v + scores, probs
    inner, shared = cfg.moe_intermediate_size, cfg.num_shared_experts * cfg.moe_intermediate_size
    routed = (cfg.num_experts_per_token if grouped else 1) * inner
    mlp = 3 * t * max(cfg.intermediate_size if cfg.first_k_dense_replace else 0, shared, routed)
    logits = t * cfg.vocab_size
    expert = 3 * inner * cfg.routed_expert_hidden_size * DTYPE_SIZES[dtype]
    return (stream + attn + mlp + logits) * ACT_BYTES + decoded_experts * expert


def prefill_window(top_k: int) -> int:
    """Records in the provider's prefill pool when it has one: its default, max(top-k, 4)."""
    return max(top_k, 4)


def decodes_experts(kernels: str, mode: str) -> bool:
    """Whether backend `kernels` decodes whole experts to the model dtype before its matmuls
    (the reference always; the cpu kernels for bank modes they have no native kernel for); the
    packed-byte kernels read the slots in place."""
    if kernels != "cpu":
        return kernels == "reference"
    # Here, not at the top: kernels.cpu imports torch, which flag parsing (through the presets)
    # and a plan for another backend must not wait for.
    from ..kernels.cpu import NATIVE_MODES

    return mode not in NATIVE_MODES


def plan_for(facts: ModelFacts, *, memory_budget: int | str, host_budget: int | str = 0,
             context: int = 4096, dtype: str = "bfloat16", resident_dtype: str | None = None,
             batch: int = 1,
             prefill_chunk: int | None = None, kernels: str = "cpu",
             read_depth: int = DEFAULT_READ_DEPTH, reserve_fraction: float = RESERVE_FRACTION,
             runtime_baseline: int = RUNTIME_BASELINE_BYTES) -> MemoryPlan:
    """The plan for `facts` inside `memory_budget` (bytes or a size string), run by backend
    `kernels` ('reference' | 'cpu' | 'cuda'). Raises PlanError.

    prefill_chunk None picks the largest power of two <= 256 that fits and keeps at least 3/4
    of chunk 1's compute slots (the minimum reported is then chunk 1's); read_depth: reads in
    flight (the reader's threads); runtime_baseline: what the process holds besides the items;
    resident_dtype None: as the model stores them (`facts.resident_dtype`)."""
    budget, host = parse_bytes(memory_budget), parse_bytes(host_budget)
    try:
        resident_dtype = resolve_resident_dtype(resident_dtype, facts.resident_dtype,
                                                "the artifact")
    except ValueError as e:
        raise PlanError(str(e)) from None
    if dtype not in DTYPE_SIZES:
        raise PlanError(f"dtype must be one of {', '.join(DTYPE_SIZES)}, not {dtype!r}")
    if resident_dtype not in RESIDENT_DTYPES:
        raise PlanError(f"resident dtype must be one of {', '.join(RESIDENT_DTYPES)}, not "
                        f"{resident_dtype!r}")
    if resident_dtype != "bf16" and dtype != "bfloat16":
        raise PlanError(f"--resident-dtype {resident_dtype} needs --dtype bfloat16")
    if kernels not in BACKENDS:
        raise PlanError(f"kernels must be one of {', '.join(BACKENDS)}, not {kernels!r}")
    if context < 1 or batch < 1 or read_depth < 1:
        raise PlanError(f"context, batch and read_depth must be >= 1, got {context}, {batch} "
                        f"and {read_depth}")
    if not 0 <= reserve_fraction < 1 or runtime_baseline < 0:
        raise PlanError("reserve_fraction must be in [0, 1) and runtime_baseline >= 0")
    if not facts.routed_layers:
        raise PlanError("the model has no routed layers to stream")
    args = (facts, budget, host, context, dtype, resident_dtype, batch, kernels, read_depth,
            reserve_fraction, runtime_baseline)
    if prefill_chunk is not None:
        if prefill_chunk < 1:
            raise PlanError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        return _plan(*args, prefill_chunk, strict=True)
    first = best = _plan(*args, 1, strict=True)
    chunk = 2
    while chunk <= MAX_AUTO_CHUNK:
        p = _plan(*args, chunk, strict=False)
        if p is None or 4 * p.compute_slots < 3 * first.compute_slots:  # keep 3/4 of the cache
            break
        best, chunk = p, chunk * 2
    # The floor to report is chunk 1's: any budget above it plans (with a smaller chunk).
    return replace(best, minimum_budget=first.minimum_budget, minimum_chunk=1,
                   minimum_parts=first.minimum_parts)


def _plan(facts, budget, host, context, dtype, resident_dtype, batch, kernels, read_depth, frac,
          baseline, chunk, *, strict):
    g = facts.geometry
    k, n_exp = g.top_k, g.experts
    stride = align_up(facts.record_bytes)
    total = len(facts.routed_layers) * n_exp
    window = prefill_window(k)
    decodes, on_gpu = decodes_experts(kernels, facts.mode), kernels == "cuda"
    # A decoding backend keeps its prefill pool at every budget: the pool bounds how many
    # experts one prefill window decodes at once (through the compute tier it would be all the
    # layer's slots). Packed-byte kernels get one only from spare slots (below).
    pool = window if decodes else 0
    items = {
        "residents": resident_bytes(facts, dtype, resident_dtype),
        "kda_state": g.state_bytes(dtype, batch),
        "mla_cache": g.cache_token_bytes(dtype) * context * batch,
        "workspace": g.workspace_bytes(dtype, chunk * batch, context,
                                       window if decodes else 0, on_gpu),
        # On the host reads land in the slots; the GPU reader stages each read in flight.
        "io_buffers": read_depth * stride if on_gpu else 0,
        "prefill_pool": pool * stride,
    }
    torch_held = items["residents"] + items["kda_state"] + items["mla_cache"] + items["workspace"]
    items["reserve"] = baseline + int(torch_held * frac)
    items["headroom"] = 0 if on_gpu else KERNEL_HEADROOM_BYTES
    parts = dict(items, working_set=k * stride)
    minimum = sum(parts.values())
    left = budget - sum(items.values())
    spare = max(0, left // stride)
    if not decodes and not on_gpu and spare < total:
        # Slots beyond one decode step's go first to a prefill pool (up to one window), so a
        # prompt does not evict the decode experts; none at the minimum (prefill then windows
        # through the compute tier). Near the whole bank the pool gives way: a tier that misses
        # at most a window's records prefills through itself (a prompt can evict only what it
        # misses, and a pool would cost the cache that many records for good); between one and
        # two windows short it shrinks a slot per slot of budget, so more budget never gives
        # fewer compute slots.
        pool = min(window, max(0, spare - k), max(0, total - spare - window))
        items["prefill_pool"] = pool * stride
        left -= pool * stride
        spare -= pool
    slots = min(total, spare)  # more slots than records would never be used
    host_slots = min(total - slots, host // stride)
    if slots < k:
        if not strict:
            return None
        raise PlanError(
            f"memory budget {fmt_bytes(budget)} cannot hold the minimum working set: at least "
            f"{fmt_bytes(minimum)} ({minimum:,} B) for {facts.mode} records of {stride:,} B, "
            f"top-{k} of one layer at once, prefill chunk {chunk}, context {context}, {dtype}, "
            f"{kernels} kernels; largest first: {minimum_reasons(parts)}")
    return MemoryPlan(
        memory_budget=budget, host_budget=host, dtype=dtype, context=context, batch=batch,
        prefill_chunk=chunk, resident_dtype=resident_dtype, mode=facts.mode,
        source=facts.source, kernels=kernels,
        record_bytes=facts.record_bytes, record_stride=stride,
        routed_layers=len(facts.routed_layers), experts_per_layer=n_exp, top_k=k,
        working_set_records=k, decoded_experts=window if decodes else 0, read_depth=read_depth,
        transient_slots=pool, items=items, compute_slots=slots, host_slots=host_slots,
        slack_bytes=left - slots * stride, host_slack_bytes=host - host_slots * stride,
        minimum_budget=minimum, minimum_chunk=chunk, minimum_parts=parts,
        runtime_baseline=baseline)


@dataclass(frozen=True, slots=True)
class ArtifactSize:
    """The streaming artifact's bytes on NVMe (FORMAT.md "Bank parts"): every routed record in a
    4 KiB-aligned slot of its layer's bank part, plus the resident shards' tensors in the form
    the build stores them (their headers and the config files add a few MB)."""

    bank_bytes: int
    resident_bytes: int
    records: int
    record_stride: int
    resident_dtype: str
    source_bytes: int | None  # the checkpoint it is built from (its index's total_size)

    @property
    def total_bytes(self) -> int:
        return self.bank_bytes + self.resident_bytes


def artifact_size(facts: ModelFacts, resident_dtype: str | None = None) -> ArtifactSize:
    """The NVMe bytes of `facts`' artifact, its residents stored as `resident_dtype` (None: as
    the model stores them; `mtplx build-manifest --resident-dtype` quantizes them)."""
    rd = resident_dtype or facts.resident_dtype
    stride = align_up(facts.record_bytes)
    records = len(facts.routed_layers) * facts.geometry.experts
    # A bf16 model's residents in memory are the stored bytes (BF16 as is, F32 kept F32).
    return ArtifactSize(records * stride, resident_bytes(facts, "bfloat16", rd), records, stride,
                        rd, facts.source_bytes)


def format_artifact_size(a: ArtifactSize) -> str:
    def size(n: int) -> str:  # drives are sold in decimal units, memory in binary ones
        return f"{n / 1e9:,.1f} GB" if n >= 10**8 else fmt_bytes(n)

    src = "" if a.source_bytes is None else \
        f"; the checkpoint it is built from: {size(a.source_bytes)}"
    return (f"artifact on NVMe: {size(a.total_bytes)} = bank parts {size(a.bank_bytes)} "
            f"({a.records:,} records in {a.record_stride:,}-B slots) + resident shards "
            f"{size(a.resident_bytes)} ({a.resident_dtype}){src}")


def minimum_reasons(parts: dict[str, int], sep: str = "; ") -> str:
    """The parts of a minimum budget, largest first, each with what lowers it (zero parts left
    out): what `mtplx plan` and the PlanError print."""
    ranked = sorted(((n, v) for n, v in parts.items() if v), key=lambda nv: -nv[1])
    return sep.join(f"{LABELS[n]} {fmt_bytes(v)}: {LOWERED_BY[n]}" for n, v in ranked)


def afforded_context(facts: ModelFacts, *, memory_budget: int | str, **kwargs) -> int:
    """The longest context, a power of two from DEFAULT_CONTEXT up to CONTEXT_CEILING (and the
    model's max positions), whose plan keeps CONTEXT_KEEP_SLOTS of the compute slots the
    DEFAULT_CONTEXT plan gets and leaves at most 1 / CONTEXT_KEEP_SLOTS times its uncached
    records uncached. Raises PlanError when even DEFAULT_CONTEXT does not plan."""
    base = plan_for(facts, memory_budget=memory_budget, context=DEFAULT_CONTEXT, **kwargs)
    base_uncached = base.total_records - base.compute_slots
    best, ctx = DEFAULT_CONTEXT, 2 * DEFAULT_CONTEXT
    while ctx <= min(CONTEXT_CEILING, facts.geometry.max_positions):
        try:
            p = plan_for(facts, memory_budget=memory_budget, context=ctx, **kwargs)
        except PlanError:
            break
        if (p.compute_slots < CONTEXT_KEEP_SLOTS * base.compute_slots
                or (p.total_records - p.compute_slots) * CONTEXT_KEEP_SLOTS > base_uncached):
            break
        best, ctx = ctx, 2 * ctx
    return best


def make_plan(model_dir: str | Path, *, memory_budget: int | str, manifest=None,
              **kwargs) -> MemoryPlan:
    """`plan_for(facts_from_dir(model_dir, manifest), ...)`: the plan for an artifact or
    checkpoint."""
    return plan_for(facts_from_dir(model_dir, manifest), memory_budget=memory_budget, **kwargs)


def format_plan(plan: MemoryPlan) -> str:
    """A readable table: items with units, slots per tier and per layer, the minimum budget and
    what it is made of, largest first, with the flag that lowers each part."""
    p = plan
    decoded = (f"{p.decoded_experts} decoded experts" if p.decoded_experts
               else f"no decoded experts ({p.kernels} kernels read the slots)")
    io_note = (f"{p.read_depth} reads in flight x {p.record_stride:,} B staging"
               if p.items["io_buffers"] else f"none: {p.read_depth} reads in flight land in slots")
    notes = {
        "residents": (f"{p.dtype} (F32 tensors stay F32)" if p.resident_dtype == "bf16" else
                      f"{p.resident_dtype} matrices, the rest {p.dtype} (F32 stays F32)"),
        "kda_state": "fp32 recurrent + conv history, all KDA layers",
        "mla_cache": f"{p.context} tokens x batch {p.batch}",
        "workspace": f"activations, chunk {p.prefill_chunk}; {decoded}",
        "io_buffers": io_note,
        "prefill_pool": f"{p.transient_slots} transient slots (prefill windows through them)"
                        if p.transient_slots else "none: prefill windows through the compute tier",
        "reserve": f"runtime baseline {fmt_bytes(p.runtime_baseline)} + "
                   f"{RESERVE_FRACTION:.0%} of residents, state and workspace",
        "headroom": "page cache and kernel memory beside the RSS, so a hard limit never "
                    "reclaims" if p.items["headroom"] else "none on a GPU",
    }
    # A model without recurrent layers (the DeepSeek-V3 family: MLA only) has no KDA row.
    rows = [(LABELS[n], p.items[n], notes[n]) for n in ITEMS
            if n != "kda_state" or p.items[n]]
    rows += [("compute-tier slots", p.compute_slots * p.record_stride,
              f"{p.compute_slots} slots x {p.record_stride:,} B"),
             ("slack", p.slack_bytes, "unused")]
    out = [f"memory plan: {p.mode} records of {p.record_bytes:,} B from {p.source}, "
           f"{p.routed_layers} routed layers x {p.experts_per_layer} experts, top-{p.top_k}, "
           f"{p.kernels} kernels",
           f"{'item':<20}{'bytes':>20}{'':>12}  note"]
    for name, n, note in rows:
        out.append(f"{name:<20}{n:>20,}{fmt_bytes(n):>12}  {note}")
    out.append(f"{'memory budget':<20}{p.memory_budget:>20,}{fmt_bytes(p.memory_budget):>12}")
    out.append(f"host-tier slots: {p.host_slots} ({fmt_bytes(p.host_slots * p.record_stride)} "
               f"of host budget {fmt_bytes(p.host_budget)})")
    out.append(f"slots per layer: device {p.slots_per_layer}, host {p.host_slots_per_layer}; "
               f"working set {p.working_set_records} records per layer")
    out.append(f"cacheable: {p.compute_slots + p.host_slots} of {p.total_records} experts "
               f"({100 * p.cacheable_share:.1f}%)")
    out.append(f"minimum budget: {fmt_bytes(p.minimum_budget)} ({p.minimum_budget:,} B) at "
               f"prefill chunk {p.minimum_chunk}, largest part first:")
    out.append("  " + minimum_reasons(p.minimum_parts, "\n  "))
    return "\n".join(out)
