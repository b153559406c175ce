"""The non-expert ("resident") text tensors a K3 checkpoint must hold, and their check.

`resident_tensor_specs(cfg)` is the one table of names, shapes and dtypes (FORMAT.md
"Resident tensors"); the reader checks checkpoints against it and the fixture writer writes from it.
Tensors outside the text model (vision tower, mm_projector) are ignored; a text tensor
(`language_model.model.*`, `language_model.lm_head.*`) that is neither in the table nor a routed
expert is an error: the config would silently ignore weights the checkpoint holds (e.g.
`num_shared_experts: 0` beside shared-expert tensors; FORMAT.md "What the readers validate").

`A_log`: written 1-D with the head count padded up to a multiple of 128
(the published 128 entries for 96 heads, tail zero). Its stored rank is unconfirmed and the
reference allocates it unpadded, so the reader accepts any shape with a single non-unit axis
whose length is the padded or the plain head count; only the first `kda_num_heads` are used.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import NamedTuple

from ..formats.fp8block import scale_shape as fp8_scale_shape
from ..formats.resident_layouts import stored_tensors
from .config import ModelConfig
from .deepseek_config import DeepseekV3Config
from .layouts import is_expert_tensor, mtp_layer
from .safetensors_io import CheckpointError, SafetensorsFile

BACKBONE = "language_model.model."
LM_HEAD = "language_model.lm_head.weight"
DEEPSEEK_BACKBONE = "model."
DEEPSEEK_LM_HEAD = "lm_head.weight"
SCALE_INV = "_scale_inv"  # an FP8 matrix `X.weight`'s block scales: `X.weight_scale_inv`
_FP8_KEEP = ("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight")  # BF16 in fp8 ckpts
_LAYER = re.compile(r"layers\.(\d{1,9})\.")
# Which config key decides whether a tensor exists (for the "ignored tensor" message).
_DECIDED_BY = (("shared_experts.", "num_shared_experts"), ("lm_head.", "tie_word_embeddings"),
               ("routed_expert_norm.", "latent_moe_use_norm"),
               ("self_attn.g_proj.", "mla_use_output_gate / linear_attn_config.kda_layers"),
               ("block_sparse_moe.", "first_k_dense_replace"),
               ("mlp.", "first_k_dense_replace"),
               ("self_attn.", "linear_attn_config.kda_layers / full_attn_layers"))


class ResidentSpec(NamedTuple):
    shape: tuple[int, ...]
    dtype: str  # safetensors tag: "BF16" or "F32"


def naming(cfg) -> tuple[str, str]:
    """(backbone prefix, lm_head tensor name) of `cfg`'s family: K3's text model lives under
    `language_model.`, the DeepSeek-V3 family's at the top level."""
    if isinstance(cfg, DeepseekV3Config):
        return DEEPSEEK_BACKBONE, DEEPSEEK_LM_HEAD
    return BACKBONE, LM_HEAD


def a_log_entries(cfg: ModelConfig) -> int:
    """Stored length of `A_log`: the KDA head count padded up to a multiple of 128."""
    return -(-cfg.kda_num_heads // 128) * 128


def resident_tensor_specs(cfg) -> dict[str, ResidentSpec]:
    """Full tensor name -> expected shape and dtype of every required non-expert text tensor."""
    if isinstance(cfg, DeepseekV3Config):
        return _deepseek_v3_specs(cfg)
    D, V = cfg.hidden_size, cfg.vocab_size
    bf16 = lambda *shape: ResidentSpec(tuple(shape), "BF16")  # noqa: E731
    f32 = lambda *shape: ResidentSpec(tuple(shape), "F32")  # noqa: E731
    specs = {
        BACKBONE + "embed_tokens.weight": bf16(V, D),
        BACKBONE + "norm.weight": bf16(D),
        BACKBONE + "output_attn_res_norm.weight": bf16(D),
        BACKBONE + "output_attn_res_proj.weight": bf16(1, D),
    }
    if not cfg.tie_word_embeddings:
        specs[LM_HEAD] = bf16(V, D)

    kda_heads, kda_d = cfg.kda_num_heads, cfg.kda_head_dim
    kda_w = kda_heads * kda_d  # KDA projection width (12288 in K3)
    mla_heads = cfg.num_attention_heads
    q_head = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    kv_head = cfg.qk_nope_head_dim + cfg.v_head_dim
    mla_out = mla_heads * cfg.v_head_dim
    shared_w = cfg.num_shared_experts * cfg.moe_intermediate_size
    R = cfg.routed_expert_hidden_size

    for layer in range(cfg.num_hidden_layers):
        p = f"{BACKBONE}layers.{layer}."
        for norm in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm",
                     "mlp_res_norm"):
            specs[f"{p}{norm}.weight"] = bf16(D)
        specs[f"{p}self_attention_res_proj.weight"] = bf16(1, D)
        specs[f"{p}mlp_res_proj.weight"] = bf16(1, D)

        a = p + "self_attn."
        if cfg.is_kda_layer(layer):
            for x in "qkv":
                specs[f"{a}{x}_proj.weight"] = bf16(kda_w, D)
                specs[f"{a}{x}_conv1d.weight"] = f32(kda_w, 1, cfg.kda_short_conv_kernel_size)
            specs[a + "f_a_proj.weight"] = bf16(kda_d, D)
            specs[a + "f_b_proj.weight"] = bf16(kda_w, kda_d)
            specs[a + "b_proj.weight"] = bf16(kda_heads, D)
            specs[a + "A_log"] = f32(a_log_entries(cfg))
            specs[a + "dt_bias"] = f32(kda_w)
            specs[a + "g_proj.weight"] = bf16(kda_w, D)  # full-rank output gate
            specs[a + "o_norm.weight"] = f32(kda_d)
            specs[a + "o_proj.weight"] = bf16(D, kda_w)
        else:
            specs[a + "q_a_proj.weight"] = bf16(cfg.q_lora_rank, D)
            specs[a + "q_a_layernorm.weight"] = bf16(cfg.q_lora_rank)
            specs[a + "q_b_proj.weight"] = bf16(mla_heads * q_head, cfg.q_lora_rank)
            specs[a + "kv_a_proj_with_mqa.weight"] = bf16(
                cfg.kv_lora_rank + cfg.qk_rope_head_dim, D
            )
            specs[a + "kv_a_layernorm.weight"] = bf16(cfg.kv_lora_rank)
            specs[a + "kv_b_proj.weight"] = bf16(mla_heads * kv_head, cfg.kv_lora_rank)
            if cfg.mla_use_output_gate:
                specs[a + "g_proj.weight"] = bf16(mla_out, D)
            specs[a + "o_proj.weight"] = bf16(D, mla_out)

        if not cfg.is_moe_layer(layer):
            m, inner = p + "mlp.", cfg.intermediate_size
            specs[m + "gate_proj.weight"] = bf16(inner, D)
            specs[m + "up_proj.weight"] = bf16(inner, D)
            specs[m + "down_proj.weight"] = bf16(D, inner)
            continue
        m = p + "block_sparse_moe."
        specs[m + "gate.weight"] = bf16(cfg.num_experts, D)
        specs[m + "gate.e_score_correction_bias"] = f32(cfg.num_experts)
        specs[m + "routed_expert_down_proj.weight"] = bf16(R, D)
        if cfg.latent_moe_use_norm:
            specs[m + "routed_expert_norm.weight"] = bf16(R)
        specs[m + "routed_expert_up_proj.weight"] = bf16(D, R)
        if shared_w:
            specs[m + "shared_experts.gate_proj.weight"] = bf16(shared_w, D)
            specs[m + "shared_experts.up_proj.weight"] = bf16(shared_w, D)
            specs[m + "shared_experts.down_proj.weight"] = bf16(D, shared_w)
    return specs


def _deepseek_v3_specs(cfg: DeepseekV3Config) -> dict[str, ResidentSpec]:
    """The DeepSeek-V3 family's table (FORMAT.md "DeepSeek-V3 family tensors"): BF16, the
    router's correction bias F32 (BF16 is accepted too: `check_residents`)."""
    D, V, H = cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads
    bf16 = lambda *shape: ResidentSpec(tuple(shape), "BF16")  # noqa: E731
    specs = {"model.embed_tokens.weight": bf16(V, D), "model.norm.weight": bf16(D)}
    if not cfg.tie_word_embeddings:
        specs[DEEPSEEK_LM_HEAD] = bf16(V, D)
    q_head, kv_head = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, \
        cfg.qk_nope_head_dim + cfg.v_head_dim
    shared = cfg.num_shared_experts * cfg.moe_intermediate_size
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        specs[p + "input_layernorm.weight"] = bf16(D)
        specs[p + "post_attention_layernorm.weight"] = bf16(D)
        a = p + "self_attn."
        specs[a + "q_a_proj.weight"] = bf16(cfg.q_lora_rank, D)
        specs[a + "q_a_layernorm.weight"] = bf16(cfg.q_lora_rank)
        specs[a + "q_b_proj.weight"] = bf16(H * q_head, cfg.q_lora_rank)
        specs[a + "kv_a_proj_with_mqa.weight"] = bf16(cfg.kv_lora_rank + cfg.qk_rope_head_dim, D)
        specs[a + "kv_a_layernorm.weight"] = bf16(cfg.kv_lora_rank)
        specs[a + "kv_b_proj.weight"] = bf16(H * kv_head, cfg.kv_lora_rank)
        specs[a + "o_proj.weight"] = bf16(D, H * cfg.v_head_dim)
        m = p + "mlp."
        if not cfg.is_moe_layer(layer):
            specs[m + "gate_proj.weight"] = bf16(cfg.intermediate_size, D)
            specs[m + "up_proj.weight"] = bf16(cfg.intermediate_size, D)
            specs[m + "down_proj.weight"] = bf16(D, cfg.intermediate_size)
            continue
        specs[m + "gate.weight"] = bf16(cfg.num_experts, D)
        specs[m + "gate.e_score_correction_bias"] = ResidentSpec((cfg.num_experts,), "F32")
        if shared:
            specs[m + "shared_experts.gate_proj.weight"] = bf16(shared, D)
            specs[m + "shared_experts.up_proj.weight"] = bf16(shared, D)
            specs[m + "shared_experts.down_proj.weight"] = bf16(D, shared)
    return specs


def _a_log_shape_ok(shape: tuple[int, ...], cfg: ModelConfig) -> bool:
    axes = [n for n in shape if n != 1]
    return len(axes) == 1 and axes[0] in (a_log_entries(cfg), cfg.kda_num_heads)


def stored_specs(cfg: ModelConfig, resident_dtype: str = "bf16") -> dict[str, ResidentSpec]:
    """The resident table as stored by an artifact built with `resident_dtype`: each quantized
    matrix replaced by its stated tensors (FORMAT.md "Quantized residents")."""
    out = {}
    for name, spec in resident_tensor_specs(cfg).items():
        for n, (dtype, shape) in stored_tensors(name, spec.shape, spec.dtype,
                                                resident_dtype).items():
            out[n] = ResidentSpec(shape, dtype)
    return out


def check_residents(
    cfg: ModelConfig, where: Mapping[str, SafetensorsFile], root: str,
    resident_dtype: str = "bf16",
) -> None:
    """Raise CheckpointError naming the tensor (and its file) unless every resident matches the
    table for `resident_dtype` (bf16: as published; int8/int4: an artifact's quantized form)."""
    specs = stored_specs(cfg, resident_dtype)
    needs = "the config requires" if resident_dtype == "bf16" else \
        f"the config with {resident_dtype} residents requires"
    backbone, lm_head = naming(cfg)
    text = (backbone, lm_head.rsplit(".", 1)[0] + ".")
    # FP8 matrices of an fp8 checkpoint: each one's block scales beside it
    fp8 = {n: n + SCALE_INV for n, spec in specs.items()
           if n in where and fp8_resident(cfg, n, spec) and where[n].tensors[n].dtype == "F8_E4M3"}
    scales = set(fp8.values())
    for name, shard in where.items():
        if (name.startswith(text) and name not in specs and name not in scales
                and not is_expert_tensor(name) and not unused_tensor(cfg, name)):
            raise CheckpointError(f"{shard.path}: tensor {name!r} is not used by the config "
                                  f"({_decided_by(name, cfg)}); a config that ignores weights "
                                  f"the checkpoint holds is refused")
    missing = [name for name in specs if name not in where]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        shown = ", ".join(missing[:5]) + more
        raise CheckpointError(f"{root}: {len(missing)} required tensors are missing: {shown}"
                              + ("" if resident_dtype == "bf16" else
                                 f" (the artifact stores {resident_dtype} residents)"))
    for name, spec in specs.items():
        shard = where[name]
        info = shard.tensors[name]
        if name in fp8:
            _check_fp8(name, spec, where, root)
            continue
        if name.endswith(".A_log"):
            shape_ok = _a_log_shape_ok(info.shape, cfg)
        else:
            shape_ok = info.shape == spec.shape
        # The DeepSeek-V3 family's correction bias is F32 as published, BF16 as a bf16 model
        # saves its buffers; both carry the values the router adds.
        dtypes = {"F32", "BF16"} if name.endswith(".e_score_correction_bias") else {spec.dtype}
        if info.dtype not in dtypes or not shape_ok:
            raise CheckpointError(
                f"{shard.path}: tensor {name!r} is {info.dtype}{list(info.shape)}, {needs} "
                f"{spec.dtype}{list(spec.shape)}"
            )


def fp8_resident(cfg, name: str, spec: ResidentSpec) -> bool:
    """Whether `name` may be stored as FP8 e4m3 with block scales (`name` + "_scale_inv"): in a
    DeepSeek-V3 family checkpoint whose `quantization_config` is fp8, every 2-D BF16 matrix but
    the embedding, the head and the router (FORMAT.md "DeepSeek-V3 family layouts")."""
    qc = getattr(cfg, "quantization_config", None) or {}
    return (isinstance(cfg, DeepseekV3Config) and qc.get("quant_method") == "fp8"
            and spec.dtype == "BF16" and len(spec.shape) == 2 and not name.endswith(_FP8_KEEP))


def _check_fp8(name: str, spec: ResidentSpec, where: Mapping[str, SafetensorsFile],
               root: str) -> None:
    """An FP8 resident: F8_E4M3 of the table's shape, its F32 block scales of the fp8-block
    shape (formats/fp8block.py)."""
    shard, scale = where[name], name + SCALE_INV
    if shard.tensors[name].shape != spec.shape:
        raise CheckpointError(f"{shard.path}: tensor {name!r} is F8_E4M3"
                              f"{list(shard.tensors[name].shape)}, the config requires "
                              f"{list(spec.shape)}")
    want = fp8_scale_shape(spec.shape)
    if scale not in where:
        raise CheckpointError(f"{root}: FP8 tensor {name!r} has no {scale!r} beside it")
    info = where[scale].tensors[scale]
    if info.dtype != "F32" or info.shape != want:
        raise CheckpointError(f"{where[scale].path}: tensor {scale!r} is {info.dtype}"
                              f"{list(info.shape)}, its FP8 weight needs F32{list(want)}")


def unused_tensor(cfg, name: str) -> bool:
    """Whether `name` is a text tensor a family's published checkpoints hold and its model never
    runs: the DeepSeek-V3 family's multi-token-prediction modules (layers past the last)."""
    backbone, _ = naming(cfg)
    m = _LAYER.match(name, len(backbone)) if name.startswith(backbone) else None
    return bool(m) and mtp_layer(cfg, int(m[1]))


def _decided_by(name: str, cfg: ModelConfig) -> str:
    m = _LAYER.search(name)
    if m and int(m[1]) >= cfg.num_hidden_layers:
        return f"num_hidden_layers is {cfg.num_hidden_layers}"
    for part, key in _DECIDED_BY:
        if part in name:
            return f"see {key}"
    return f"no such tensor in a {cfg.family} text model"
