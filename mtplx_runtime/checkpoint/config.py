"""Kimi K3 text-model configuration: the fields the runtime needs, validated once.

Two on-disk forms carry the same numbers (FORMAT.md "Checkpoint layouts the reader accepts"):
  * official: top-level `model_type "kimi_k3"` with a nested `text_config` (`"kimi_linear"`);
  * flattened: the text config alone, `model_type "kimi_linear"` (the t158 artifacts).
`kimi_linear` is also Kimi-Linear-48B's type, whose math differs, so a flattened config is taken
as K3 only when it carries the three K3-only fields; we never dispatch on `model_type` alone.
Layer lists keep the file's 1-based numbering; every helper takes 0-based layer indices.
"""

from __future__ import annotations

import json
import math
import os
import reprlib
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

from ..files import read_regular
from .safetensors_io import CheckpointError, no_duplicate_keys

# config.json, the index and tokenizer JSON files are small; a larger one is hostile.
MAX_JSON_BYTES = 64 * 2**20


class ConfigError(CheckpointError):
    """A config that is not a valid Kimi K3 text config."""


# linear_attn_config key -> ModelConfig field (KDA settings and the two layer lists).
_LINEAR_ATTN = {
    "num_heads": "kda_num_heads",
    "head_dim": "kda_head_dim",
    "short_conv_kernel_size": "kda_short_conv_kernel_size",
    "gate_lower_bound": "kda_gate_lower_bound",
    "use_full_rank_gate": "kda_use_full_rank_gate",
    "kda_layers": "kda_layers",
    "full_attn_layers": "full_attn_layers",
}
# Official configs keep these at the top level; text_config values win where both exist.
_TOP_LEVEL = ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings")
# A flattened kimi_linear config is K3 only with all of these (FORMAT.md "Geometry").
_K3_MARKERS = (
    "routed_expert_hidden_size", "attn_res_block_size", "linear_attn_config.gate_lower_bound"
)

# Upper bounds of the integer fields (lower bound 1; 0 for the two marked in __post_init__):
# generous next to K3's values (FORMAT.md "Geometry"), small enough that nothing derived from
# them (layer lists, tensor tables, shapes) is unbounded.
MAX_LAYERS = 1024
MAX_EXPERTS = 1 << 16
_INT_BOUNDS = {
    "vocab_size": 1 << 24, "hidden_size": 1 << 20, "num_hidden_layers": MAX_LAYERS,
    "intermediate_size": 1 << 22, "num_experts": MAX_EXPERTS, "num_experts_per_token": MAX_EXPERTS,
    "moe_intermediate_size": 1 << 20, "routed_expert_hidden_size": 1 << 20,
    "num_shared_experts": 256, "num_attention_heads": 1 << 12, "num_key_value_heads": 1 << 12,
    "q_lora_rank": 1 << 20, "kv_lora_rank": 1 << 20, "qk_nope_head_dim": 1 << 12,
    "qk_rope_head_dim": 1 << 12, "v_head_dim": 1 << 12, "kda_num_heads": 1 << 12,
    "kda_head_dim": 1 << 12, "kda_short_conv_kernel_size": 64,
    "attn_res_block_size": MAX_LAYERS, "max_position_embeddings": 1 << 40,
}
MIN_GATE_LOWER_BOUND = -1000.0

_TYPE_OK = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "tuple[int, ...]": lambda v: isinstance(v, tuple)
    and all(isinstance(x, int) and not isinstance(x, bool) for x in v),
    "dict | None": lambda v: v is None or isinstance(v, dict),
}


class MoELayers:
    """Layer helpers both families' configs share (0-based layer indices): layers from
    `first_k_dense_replace` on are MoE (`moe_layer_freq` 1), each with `num_experts` experts."""

    __slots__ = ()

    def _check_index(self, layer: int) -> None:
        if not 0 <= layer < self.num_hidden_layers:
            raise ValueError(f"layer {layer} is outside 0..{self.num_hidden_layers - 1}")

    def is_moe_layer(self, layer: int) -> bool:
        self._check_index(layer)
        return layer >= self.first_k_dense_replace

    def check_expert_key(self, layer: int, expert: int) -> None:
        """ValueError unless `layer` is an MoE layer and `expert` one of its experts."""
        if not (0 <= layer < self.num_hidden_layers and self.is_moe_layer(layer)):
            raise ValueError(f"layer {layer} is not an MoE layer (MoE layers "
                             f"{self.first_k_dense_replace}..{self.num_hidden_layers - 1})")
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is outside 0..{self.num_experts - 1}")

    @property
    def moe_layers(self) -> list[int]:
        return list(range(self.first_k_dense_replace, self.num_hidden_layers))


@dataclass(frozen=True, slots=True)
class ModelConfig(MoELayers):
    """K3 text config (FORMAT.md "Geometry"). Fields without defaults are required in the file."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int  # dense MLP of layers < first_k_dense_replace
    first_k_dense_replace: int
    num_experts: int
    num_experts_per_token: int
    moe_intermediate_size: int  # routed expert FFN width
    routed_expert_hidden_size: int  # latent width the routed experts run in
    num_shared_experts: int  # one SiTU MLP of width num_shared_experts * moe_intermediate_size
    latent_moe_use_norm: bool
    routed_scaling_factor: float
    moe_renormalize: bool
    num_attention_heads: int  # MLA
    num_key_value_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int  # weights exist; no rotation is applied
    v_head_dim: int
    mla_use_output_gate: bool
    kda_num_heads: int
    kda_head_dim: int
    kda_short_conv_kernel_size: int
    kda_gate_lower_bound: float
    kda_use_full_rank_gate: bool
    kda_layers: tuple[int, ...]  # 1-based
    full_attn_layers: tuple[int, ...]  # 1-based (MLA)
    attn_res_block_size: int
    activation_situ_beta: float
    activation_situ_linear_beta: float
    rms_norm_eps: float
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int
    # Required: HF's class default is True, K3's value is False; guessing would tie lm_head.
    tie_word_embeddings: bool
    # Settings the runtime implements in exactly one way; absent means K3's value.
    moe_layer_freq: int = 1
    num_expert_group: int = 1
    topk_group: int = 1
    hidden_act: str = "situ"
    moe_router_activation_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    mla_use_nope: bool = True
    num_nextn_predict_layers: int = 0
    max_position_embeddings: int = 1_048_576
    quantization_config: dict | None = None  # raw block, read by the checkpoint reader

    family = "kimi-k3"  # names the model in artifact keys and messages

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not _TYPE_OK[f.type](v):
                raise ConfigError(f"{f.name} = {short_repr(v)} is not of type {f.type}")
        for name, hi in _INT_BOUNDS.items():
            v = getattr(self, name)
            lo = 0 if name in ("qk_rope_head_dim", "num_shared_experts") else 1
            if v < lo:
                raise ConfigError(f"{name} must be {'>= 0' if lo == 0 else 'positive'}, got {v}")
            if v > hi:
                raise ConfigError(f"{name} = {v} exceeds {hi}, the most this runtime accepts")
        for name, hi in (("rms_norm_eps", 1.0), ("routed_scaling_factor", 1e6),
                         ("activation_situ_beta", 1e6), ("activation_situ_linear_beta", 1e6)):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ConfigError(f"{name} must be finite and positive, got {v}")
            if v > hi:
                raise ConfigError(f"{name} = {v} exceeds {hi}")
        lb = self.kda_gate_lower_bound
        if not math.isfinite(lb):
            raise ConfigError(f"kda_gate_lower_bound must be finite, got {lb}")
        # The decay gate g = lower_bound * sigmoid(...) must lie in (lower_bound, 0]
        # (FORMAT.md "KDA", step 3): a positive bound grows the state without limit (NaN logits),
        # and below MIN_GATE_LOWER_BOUND exp(g) is 0 long before, so the value means nothing more.
        if not MIN_GATE_LOWER_BOUND <= lb < 0:
            raise ConfigError(f"kda_gate_lower_bound = {lb} must be in "
                              f"[{MIN_GATE_LOWER_BOUND}, 0) (linear_attn_config.gate_lower_bound)")
        if self.num_experts_per_token > self.num_experts:
            raise ConfigError(
                f"num_experts_per_token {self.num_experts_per_token} exceeds num_experts "
                f"{self.num_experts}"
            )
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ConfigError(
                f"first_k_dense_replace {self.first_k_dense_replace} is outside "
                f"0..num_hidden_layers ({self.num_hidden_layers})"
            )
        # MLA expands one latent into per-head K/V (kv_b_proj has num_attention_heads blocks).
        if self.num_key_value_heads != self.num_attention_heads:
            raise ConfigError(
                f"num_key_value_heads {self.num_key_value_heads} must equal num_attention_heads "
                f"{self.num_attention_heads} (MLA)"
            )
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if not 0 <= getattr(self, name) < self.vocab_size:
                raise ConfigError(f"{name} {getattr(self, name)} is outside 0..vocab_size-1")
        self._check_layer_lists()
        self._check_supported()

    def _check_layer_lists(self) -> None:
        # Linear in the list lengths, which are bounded by num_hidden_layers (itself bounded).
        n = self.num_hidden_layers
        for name in ("kda_layers", "full_attn_layers"):
            if len(getattr(self, name)) > n:
                raise ConfigError(f"{name} has {len(getattr(self, name))} entries, more than "
                                  f"num_hidden_layers ({n})")
        kda, full = set(self.kda_layers), set(self.full_attn_layers)
        both = sorted(kda & full)
        if both:
            raise ConfigError(
                f"layers {both} (1-based) are in both kda_layers and full_attn_layers"
            )
        listed = list(self.kda_layers) + list(self.full_attn_layers)
        seen: set[int] = set()
        dupes = sorted({x for x in listed if x in seen or seen.add(x)})
        if dupes:
            raise ConfigError(f"layers {dupes} (1-based) are listed twice")
        outside = sorted(x for x in listed if not 1 <= x <= n)
        if outside:
            raise ConfigError(f"layers {outside} are outside 1..{n} (the lists are 1-based)")
        missing = sorted(set(range(1, n + 1)) - set(listed))
        if missing:
            raise ConfigError(
                f"layers {missing} (1-based) are in neither kda_layers nor full_attn_layers"
            )

    def _check_supported(self) -> None:
        # Each of these selects different math or tensors that the runtime does not implement.
        expected = {
            "hidden_act": "situ",
            "moe_router_activation_func": "sigmoid",
            "topk_method": "noaux_tc",
            "moe_layer_freq": 1,
            "num_expert_group": 1,
            "topk_group": 1,
            "mla_use_nope": True,
            "kda_use_full_rank_gate": True,
            "num_nextn_predict_layers": 0,
        }
        for name, want in expected.items():
            if getattr(self, name) != want:
                raise ConfigError(
                    f"{name} = {getattr(self, name)!r} is not supported (Kimi K3 uses {want!r})"
                )

    # ---- derived layout helpers (0-based layer indices; the MoE ones: MoELayers) ----

    def is_kda_layer(self, layer: int) -> bool:
        """True for KDA layers, False for MLA layers (`ℓ+1 ∈ kda_layers`, FORMAT.md "Geometry")."""
        self._check_index(layer)
        return layer + 1 in self.kda_layers

    @property
    def expert_shapes(self) -> dict[str, tuple[int, int]]:
        """Logical `[rows, cols]` of one routed expert's projections."""
        inner, latent = self.moe_intermediate_size, self.routed_expert_hidden_size
        return {"gate": (inner, latent), "up": (inner, latent), "down": (latent, inner)}

    @property
    def attn_res_block_starts(self) -> list[int]:
        """Layers that open an AttnRes block: `ℓ % attn_res_block_size == 0` (FORMAT.md
        "Attention Residuals")."""
        return list(range(0, self.num_hidden_layers, self.attn_res_block_size))

    # ---- dict forms ----

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        """Parse an official (nested) or flattened K3 config; unknown keys are ignored."""
        if not isinstance(d, dict):
            raise ConfigError("config is not a JSON object")
        text = _k3_text_config(d)
        lac = text.get("linear_attn_config", {})
        if not isinstance(lac, dict):
            raise ConfigError("linear_attn_config is not a JSON object")
        lac_key = {f: k for k, f in _LINEAR_ATTN.items()}
        values: dict[str, object] = {"quantization_config": _quantization_config(d, text)}
        missing = []
        for f in fields(cls):
            if f.name == "quantization_config":
                continue
            src, key = (lac, lac_key[f.name]) if f.name in lac_key else (text, f.name)
            if key not in src:
                if f.default is MISSING:
                    missing.append(f"linear_attn_config.{key}" if src is lac else key)
                continue
            v = src[key]
            # JSON has lists and no int/float distinction; normalise before the type checks.
            if f.type == "tuple[int, ...]" and isinstance(v, list):
                v = tuple(v)
            elif f.type == "float" and _TYPE_OK["float"](v):
                try:
                    v = float(v)
                except OverflowError:  # an integer beyond the float range
                    raise ConfigError(f"{key} = {v} is out of range") from None
            values[f.name] = v
        if missing:
            raise ConfigError(f"missing required fields: {', '.join(missing)}")
        return cls(**values)

    @classmethod
    def from_file(cls, path: str | os.PathLike, *,
                  root: str | os.PathLike | None = None) -> ModelConfig:
        """`config.json` at `path`; `root`: the model directory it must not leave."""
        path = Path(path)
        try:
            return cls.from_dict(load_json(path, root=root))
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    def _text_dict(self) -> dict:
        def value(name: str) -> object:
            v = getattr(self, name)
            return list(v) if isinstance(v, tuple) else v

        lac_fields = set(_LINEAR_ATTN.values())
        d = {
            f.name: value(f.name)
            for f in fields(self)
            if f.name not in lac_fields and f.name != "quantization_config"
        }
        d["linear_attn_config"] = {k: value(f) for k, f in _LINEAR_ATTN.items()}
        d["model_type"] = "kimi_linear"
        return d

    def to_flat_dict(self) -> dict:
        """The flattened `kimi_linear` form of the t158 artifacts (FORMAT.md "Checkpoint
        layouts the reader accepts")."""
        d = self._text_dict()
        if self.quantization_config is not None:
            d["quantization_config"] = self.quantization_config
        return d

    def to_official_dict(self) -> dict:
        """The published nested form; quantization_config at the top level, as HF writes it."""
        d: dict = {
            "model_type": "kimi_k3",
            "architectures": ["KimiK3ForConditionalGeneration"],
            **{k: getattr(self, k) for k in _TOP_LEVEL},
            "text_config": self._text_dict(),
        }
        if self.quantization_config is not None:
            d["quantization_config"] = self.quantization_config
        return d


def _k3_text_config(d: dict) -> dict:
    """The text-config mapping of an official or flattened K3 config, after identifying it."""
    if "text_config" in d:
        if d.get("model_type") != "kimi_k3":
            raise ConfigError(
                f"nested text_config under model_type {short_repr(d.get('model_type'))}; "
                "expected 'kimi_k3'"
            )
        text = d["text_config"]
        if not isinstance(text, dict) or text.get("model_type") != "kimi_linear":
            raise ConfigError("text_config must be an object with model_type 'kimi_linear'")
        return {**{k: d[k] for k in _TOP_LEVEL if k in d}, **text}
    if d.get("model_type") not in ("kimi_linear", "kimi_k3"):
        raise ConfigError(f"model_type {short_repr(d.get('model_type'))} is not a Kimi K3 config")
    lac = d.get("linear_attn_config")
    present = {
        "routed_expert_hidden_size": "routed_expert_hidden_size" in d,
        "attn_res_block_size": "attn_res_block_size" in d,
        "linear_attn_config.gate_lower_bound": isinstance(lac, dict) and "gate_lower_bound" in lac,
    }
    absent = [m for m in _K3_MARKERS if not present[m]]
    if absent:
        raise ConfigError(
            f"this is Kimi-Linear, not Kimi K3: a flattened kimi_linear config is K3 only with "
            f"{', '.join(_K3_MARKERS)}; missing {', '.join(absent)}"
        )
    return d


def _quantization_config(d: dict, text: dict) -> dict | None:
    """The quantization block, at the top level or inside text_config (both only if equal)."""
    top, inner = d.get("quantization_config"), text.get("quantization_config")
    if top is not None and inner is not None and top != inner:
        raise ConfigError("quantization_config differs between the top level and text_config")
    qc = top if top is not None else inner
    if qc is not None and not isinstance(qc, dict):
        raise ConfigError("quantization_config is not a JSON object")
    return qc




def load_json(path: Path, *, root: str | os.PathLike | None = None,
              error: type[Exception] = CheckpointError) -> object:
    """Read a JSON file (a regular file of at most MAX_JSON_BYTES, opened without blocking,
    inside the directory `root` when given), rejecting duplicate keys and NaN/Infinity; errors
    are `error` naming the file."""
    raw = read_regular(path, limit=MAX_JSON_BYTES, root=root, error=error, what="JSON file")
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicate_keys,
                          parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError) as e:
        raise error(f"{path}: not valid JSON: {e}") from None
    except RecursionError:
        raise error(f"{path}: not valid JSON: nested too deeply") from None


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 80, 80


def short_repr(v: object) -> str:
    """A bounded repr for error messages (a hostile value may be huge or deeply nested)."""
    return _REPR.repr(v)


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")
