"""DeepSeek-V3 family configuration (DeepSeek-V3/R1, Kimi K2): the fields the runtime needs, read
from `config.json` as published and as transformers 5 writes it, validated once.

Both model types carry one architecture (FORMAT.md "The DeepSeek-V3 family"): `deepseek_v3`
(DeepSeek-V3, R1) and `kimi_k2` (Kimi K2, with `architectures: ["DeepseekV3ForCausalLM"]`).
Rotary settings come in two spellings: the published `rope_theta` + `rope_scaling` (`type`) and
transformers 5's `rope_parameters` (`rope_type`, `rope_theta` inside); both are read and, when
both are present, must agree.

Field names follow the runtime's one vocabulary (the K3 names where the concept is the same:
`num_experts`, `num_experts_per_token`, `num_expert_group`, `moe_renormalize`, ...), so the memory
plan, the bank layout and the streaming provider read either family's config alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from .config import ConfigError, MoELayers, short_repr

MODEL_TYPES = ("deepseek_v3", "kimi_k2")
ARCHITECTURE = "DeepseekV3ForCausalLM"
ROPE_TYPES = ("default", "yarn")
# HF name -> field, where the two differ (the rest keep their HF names).
_RENAMED = {
    "n_routed_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_token",
    "n_shared_experts": "num_shared_experts",
    "norm_topk_prob": "moe_renormalize",
    "n_group": "num_expert_group",
}
# Upper bounds (lower bound 1): far above V3 / K2, small enough that nothing derived is unbounded.
_INT_BOUNDS = {
    "vocab_size": 1 << 24, "hidden_size": 1 << 20, "num_hidden_layers": 1024,
    "intermediate_size": 1 << 22, "first_k_dense_replace": 1024, "num_experts": 1 << 16,
    "num_experts_per_token": 1 << 16, "moe_intermediate_size": 1 << 20, "num_shared_experts": 256,
    "num_expert_group": 1 << 16, "topk_group": 1 << 16, "num_attention_heads": 1 << 12,
    "num_key_value_heads": 1 << 12, "q_lora_rank": 1 << 20, "kv_lora_rank": 1 << 20,
    "qk_nope_head_dim": 1 << 12, "qk_rope_head_dim": 1 << 12, "v_head_dim": 1 << 12,
    "max_position_embeddings": 1 << 40, "num_nextn_predict_layers": 64,
}
_ZERO_OK = ("first_k_dense_replace", "num_shared_experts", "num_nextn_predict_layers")
# Settings that select math or tensors this runtime does not implement: (HF key, accepted).
_FIXED = {
    "hidden_act": ("silu",), "scoring_func": ("sigmoid",), "topk_method": ("noaux_tc",),
    "moe_layer_freq": (1,), "attention_bias": (False,), "pretraining_tp": (1,),
}
_ROPE_KEYS = ("type", "rope_type", "rope_theta", "factor", "original_max_position_embeddings",
              "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor",
              "truncate")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Rotary embedding of the decoupled key/query part (FORMAT.md "Rotary embedding (YaRN)").
    `kind` "default" is plain RoPE (the other fields unused); "yarn" the YaRN frequencies."""

    kind: str
    theta: float
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True, slots=True)
class DeepseekV3Config(MoELayers):
    """DeepSeek-V3 family text config (FORMAT.md "The DeepSeek-V3 family")."""

    model_type: str  # "deepseek_v3" | "kimi_k2"
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int  # dense MLP of layers < first_k_dense_replace
    first_k_dense_replace: int
    num_experts: int
    num_experts_per_token: int
    moe_intermediate_size: int  # routed expert width; shared MLP is num_shared_experts times it
    num_shared_experts: int
    routed_scaling_factor: float
    moe_renormalize: bool
    num_expert_group: int
    topk_group: int
    num_attention_heads: int
    num_key_value_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float
    rope: RopeScaling
    rope_interleave: bool  # the rope dims are stored as interleaved pairs (x0, x1), (x2, x3), ...
    max_position_embeddings: int
    tie_word_embeddings: bool
    num_nextn_predict_layers: int  # MTP modules after the last layer: stored, never run
    eos_token_ids: tuple[int, ...]
    quantization_config: dict | None = None

    # The K3 vocabulary's names for what this family does not have or does one fixed way, so
    # code written against either config reads them alike.
    latent_moe_use_norm = False
    mla_use_output_gate = False
    kda_num_heads = kda_head_dim = kda_short_conv_kernel_size = 0
    # SiLU-GLU is SiTU-GLU's limit as both betas grow without bound; the kernels take +inf to
    # mean exactly that limit (FORMAT.md "SiLU-GLU").
    activation_situ_beta = activation_situ_linear_beta = math.inf

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name in ("rope", "quantization_config", "eos_token_ids", "model_type"):
                continue
            v = getattr(self, f.name)
            want = {"int": int, "float": (int, float), "bool": bool}[f.type]
            if isinstance(v, bool) != (f.type == "bool") or not isinstance(v, want):
                raise ConfigError(f"{f.name} = {short_repr(v)} is not of type {f.type}")
        for name, hi in _INT_BOUNDS.items():
            v, lo = getattr(self, name), 0 if name in _ZERO_OK else 1
            if not lo <= v <= hi:
                raise ConfigError(f"{name} = {v} is outside {lo}..{hi}")
        for name in ("rms_norm_eps", "routed_scaling_factor"):
            v = getattr(self, name)
            if not (math.isfinite(v) and 0 < v <= (1.0 if name == "rms_norm_eps" else 1e6)):
                raise ConfigError(f"{name} must be finite and positive, got {v}")
        if self.num_experts_per_token > self.num_experts:
            raise ConfigError(f"num_experts_per_tok {self.num_experts_per_token} exceeds "
                              f"n_routed_experts {self.num_experts}")
        if self.first_k_dense_replace > self.num_hidden_layers:
            raise ConfigError(f"first_k_dense_replace {self.first_k_dense_replace} exceeds "
                              f"num_hidden_layers {self.num_hidden_layers}")
        if self.num_key_value_heads != self.num_attention_heads:
            raise ConfigError(f"num_key_value_heads {self.num_key_value_heads} must equal "
                              f"num_attention_heads {self.num_attention_heads} (MLA)")
        g, tg = self.num_expert_group, self.topk_group
        if self.num_experts % g:
            raise ConfigError(f"n_routed_experts {self.num_experts} is not a multiple of n_group "
                              f"{g}")
        if tg > g:
            raise ConfigError(f"topk_group {tg} exceeds n_group {g}")
        # A group's score is the sum of its two best experts; the groups kept must hold top-k.
        if g > 1 and (self.num_experts // g < 2 or tg * (self.num_experts // g)
                      < self.num_experts_per_token):
            raise ConfigError(f"n_group {g} / topk_group {tg} cannot select "
                              f"{self.num_experts_per_token} of {self.num_experts} experts")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim {self.qk_rope_head_dim} must be even (RoPE "
                              f"rotates pairs)")
        if not all(0 <= t < self.vocab_size for t in self.eos_token_ids):
            raise ConfigError(f"eos_token_id {list(self.eos_token_ids)} is outside "
                              f"0..vocab_size-1")

    @property
    def family(self) -> str:
        """"deepseek-v3" or "kimi-k2": names the model in artifact keys and messages."""
        return self.model_type.replace("_", "-")

    # ---- derived layout helpers (0-based layer indices; the MoE ones: MoELayers) ----

    def is_kda_layer(self, layer: int) -> bool:
        """No KDA: every layer is MLA (with RoPE)."""
        self._check_index(layer)
        return False

    @property
    def routed_expert_hidden_size(self) -> int:
        """The width the routed experts run in: the hidden width (no latent projection)."""
        return self.hidden_size

    @property
    def expert_shapes(self) -> dict[str, tuple[int, int]]:
        inner, d = self.moe_intermediate_size, self.hidden_size
        return {"gate": (inner, d), "up": (inner, d), "down": (d, inner)}

    @property
    def attn_res_block_starts(self) -> list[int]:
        return []  # no Attention Residuals

    # ---- parsing ----

    @classmethod
    def from_dict(cls, d: dict) -> DeepseekV3Config:
        """Parse a published or transformers-5 config; unknown keys are ignored."""
        if not isinstance(d, dict):
            raise ConfigError("config is not a JSON object")
        mt = d.get("model_type")
        if mt not in MODEL_TYPES:
            raise ConfigError(f"model_type {short_repr(mt)} is not a DeepSeek-V3 family config "
                              f"({', '.join(MODEL_TYPES)})")
        arch = d.get("architectures")
        if arch is not None and (not isinstance(arch, list) or ARCHITECTURE not in arch):
            raise ConfigError(f"architectures {short_repr(arch)} does not name {ARCHITECTURE}")
        for key, allowed in _FIXED.items():
            if key in d and d[key] not in allowed:
                raise ConfigError(f"{key} = {short_repr(d[key])} is not supported (the DeepSeek-V3 "
                                  f"family uses {allowed[0]!r})")
        if d.get("q_lora_rank", 0) is None:
            raise ConfigError("q_lora_rank null (a full-rank q_proj) is not supported; "
                              "DeepSeek-V3 and Kimi K2 use a low-rank query")
        required = ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size",
                    "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok",
                    "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                    "qk_rope_head_dim", "v_head_dim")
        missing = [k for k in required if k not in d]
        if missing:
            raise ConfigError(f"missing required fields: {', '.join(missing)}")
        v = {_RENAMED.get(k, k): d[k] for k in required}
        # Absent optional fields take transformers' DeepseekV3Config defaults.
        defaults = {"first_k_dense_replace": 3, "n_shared_experts": 1,
                    "routed_scaling_factor": 2.5, "norm_topk_prob": True, "n_group": 8,
                    "topk_group": 4, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
                    "tie_word_embeddings": False, "num_nextn_predict_layers": 1,
                    "rope_interleave": True}
        for key, default in defaults.items():
            val = d.get(key, default)
            v[_RENAMED.get(key, key)] = default if val is None else val
        v["num_key_value_heads"] = d.get("num_key_value_heads") or v["num_attention_heads"]
        for key in ("routed_scaling_factor", "rms_norm_eps"):
            if isinstance(v[key], int) and not isinstance(v[key], bool):
                v[key] = float(v[key])
        return cls(model_type=mt, rope=_rope(d), eos_token_ids=_eos_ids(d.get("eos_token_id")),
                   quantization_config=_quantization_config(d), **v)


def _number(src: dict, key: str, where: str, default=None, *, positive=True) -> float | None:
    val = src.get(key, default)
    if val is None:
        return None
    if isinstance(val, bool) or not isinstance(val, (int, float)) or not math.isfinite(val) \
            or (positive and val <= 0):
        raise ConfigError(f"{where}.{key} = {short_repr(val)} must be a finite positive number")
    return float(val)


def _rope(d: dict) -> RopeScaling:
    """The rotary settings from `rope_scaling` + `rope_theta` (published) or `rope_parameters`
    (transformers 5); both forms present must describe the same rotation."""
    forms = []
    for key in ("rope_scaling", "rope_parameters"):
        block = d.get(key)
        if block is None:
            continue
        if not isinstance(block, dict):
            raise ConfigError(f"{key} is not a JSON object")
        unknown = sorted(set(block) - set(_ROPE_KEYS))
        if unknown:
            raise ConfigError(f"{key} has keys this runtime does not implement: {unknown}")
        forms.append(_rope_from(block, d, key))
    if not forms:
        return RopeScaling("default", _number(d, "rope_theta", "config", 10000.0))
    if len(forms) == 2 and forms[0] != forms[1]:
        raise ConfigError("rope_scaling and rope_parameters describe different rotations")
    return forms[0]


def _rope_from(block: dict, d: dict, where: str) -> RopeScaling:
    kind = block.get("rope_type", block.get("type", "default"))
    if "type" in block and "rope_type" in block and block["type"] != block["rope_type"]:
        raise ConfigError(f"{where}: type {block['type']!r} and rope_type "
                          f"{block['rope_type']!r} differ")
    if kind not in ROPE_TYPES:
        raise ConfigError(f"{where}: rope type {short_repr(kind)} is not supported "
                          f"({', '.join(ROPE_TYPES)})")
    theta = _number(block, "rope_theta", where, None) or _number(d, "rope_theta", "config",
                                                                  10000.0)
    if kind == "default":
        return RopeScaling("default", theta)
    orig = block.get("original_max_position_embeddings", d.get("max_position_embeddings", 4096))
    if isinstance(orig, bool) or not isinstance(orig, int) or not 1 <= orig <= 1 << 40:
        raise ConfigError(f"{where}.original_max_position_embeddings = {short_repr(orig)} is not a "
                          f"positive integer")
    factor = _number(block, "factor", where, None)
    if factor is None:  # transformers derives it from the two lengths
        factor = d.get("max_position_embeddings", 4096) / orig
    truncate = block.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ConfigError(f"{where}.truncate = {short_repr(truncate)} is not a boolean")
    # transformers treats a beta of 0 (or null) as absent: `beta or default`.
    return RopeScaling(
        "yarn", theta, factor, orig,
        _number(block, "beta_fast", where, None, positive=False) or 32.0,
        _number(block, "beta_slow", where, None, positive=False) or 1.0,
        _number(block, "mscale", where, None, positive=False),
        _number(block, "mscale_all_dim", where, None, positive=False),
        _number(block, "attention_factor", where, None), truncate)


def _eos_ids(val) -> tuple[int, ...]:
    vals = [] if val is None else val if isinstance(val, list) else [val]
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in vals):
        raise ConfigError(f"eos_token_id = {short_repr(val)} is not an integer or a list of them")
    return tuple(vals)


def _quantization_config(d: dict) -> dict | None:
    qc = d.get("quantization_config")
    if qc is not None and not isinstance(qc, dict):
        raise ConfigError("quantization_config is not a JSON object")
    return qc
