"""Hand-built tiny K3 checkpoints for the reader tests, one per routed-expert layout.

Expert tensor shapes are written from the specs (FORMAT.md "Checkpoint layouts the reader accepts"),
not from the codecs, so the reader tests also catch a codec whose component specs drift. Contents
are random but decodable; codec correctness is tested elsewhere.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from mtplx_runtime.checkpoint import ModelConfig, resident_tensor_specs
from mtplx_runtime.checkpoint.safetensors_io import write_safetensors

ONE_BF16 = 0x3F80  # bf16 bits of 1.0
LAYOUTS = ("mxfp4", "w3", "t158", "bf16")
OFFICIAL_PROJ = {"gate": "w1", "up": "w3", "down": "w2"}

MXFP4_QC = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "format": "mxfp4-pack-quantized", "targets": ["Linear"], "input_activations": None,
        "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
                    "symmetric": True, "dynamic": False},
    }},
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "lm_head"],
}


def w3_qc(num_bits: int = 3, symmetric: bool = True, version: str | None = "0.20.1") -> dict:
    """A compressed-tensors pack-quantized block as ct writes it (FORMAT.md "ct-int")."""
    qc = {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "format": "pack-quantized", "targets": ["Linear"], "input_activations": None,
            "output_activations": None,
            "weights": {"num_bits": num_bits, "type": "int", "symmetric": symmetric,
                        "strategy": "group", "group_size": 64, "dynamic": False},
        }},
        "ignore": ["lm_head"], "sparsity_config": {}, "transform_config": {},
    }
    if version is not None:
        qc["version"] = version
    return qc


TINY = dict(
    vocab_size=512, hidden_size=128, num_hidden_layers=6, intermediate_size=256,
    first_k_dense_replace=1, num_experts=8, num_experts_per_token=2, moe_intermediate_size=128,
    routed_expert_hidden_size=64, num_shared_experts=2, latent_moe_use_norm=True,
    routed_scaling_factor=1.0, moe_renormalize=True, num_attention_heads=4,
    num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, mla_use_output_gate=True, kda_num_heads=4,
    kda_head_dim=16, kda_short_conv_kernel_size=4, kda_gate_lower_bound=-5.0,
    kda_use_full_rank_gate=True, kda_layers=(1, 2, 3, 5), full_attn_layers=(4, 6),
    attn_res_block_size=2, activation_situ_beta=4.0, activation_situ_linear_beta=25.0,
    rms_norm_eps=1e-5, bos_token_id=500, eos_token_id=501, pad_token_id=511,
    tie_word_embeddings=False,
)


def tiny_config(layout: str | None = None, **overrides) -> ModelConfig:
    """The tiny K3 config, with the quantization_config a `layout` checkpoint carries."""
    qc = {"mxfp4": MXFP4_QC, "w3": w3_qc()}.get(layout)
    return ModelConfig(**{**TINY, "quantization_config": qc, **overrides})


def _bf16_ones(*shape) -> np.ndarray:
    return np.full(shape, ONE_BF16, np.uint16)


def _projection(layout: str, rows: int, cols: int, rng, *, legacy: bool = False) -> dict:
    """suffix -> (safetensors dtype, array) of one official-name expert projection."""
    if layout == "mxfp4":
        return {"weight_packed": ("U8", rng.integers(0, 256, (rows, cols // 2), np.uint8)),
                "weight_scale": ("U8", np.full((rows, cols // 32), 127, np.uint8))}
    if layout == "w3":
        width = -(-cols // 10) if legacy else -(-3 * cols // 32)
        words = rng.integers(-2**31, 2**31, (rows, width), np.int64).astype(np.int32)
        return {"weight_packed": ("I32", words),
                "weight_scale": ("BF16", _bf16_ones(rows, cols // 64)),
                "weight_shape": ("I64", np.array([rows, cols], np.int64))}
    assert layout == "bf16"
    bits = (rng.standard_normal((rows, cols)).astype(np.float32).view(np.uint32) >> 16)
    return {"weight": ("BF16", bits.astype(np.uint16))}


def expert_tensors(cfg: ModelConfig, layout: str, seed: int = 0, *, legacy: bool = False,
                   t158_prefix: str = "model.layers", t158_mlp: str = "mlp",
                   t158_scales: str = "U16") -> dict[str, tuple[str, np.ndarray]]:
    """Every routed-expert tensor of `layout` for `cfg`."""
    rng = np.random.default_rng(seed)
    out: dict[str, tuple[str, np.ndarray]] = {}
    E = cfg.num_experts
    for layer in cfg.moe_layers:
        for proj, (rows, cols) in cfg.expert_shapes.items():
            if layout == "t158":
                p = f"{t158_prefix}.{layer}.{t158_mlp}.switch_mlp.{proj}_proj."
                # Byte values <= 80 are valid in every position of a t158 group.
                packed = rng.integers(0, 81, (E, rows, 13 * cols // 64), np.uint8)
                out[p + "packed"] = ("U8", packed)
                out[p + "scales"] = (t158_scales, _bf16_ones(E, rows, cols // 64))
                continue
            for e in range(E):
                p = (f"language_model.model.layers.{layer}.block_sparse_moe.experts.{e}."
                     f"{OFFICIAL_PROJ[proj]}.")
                for suffix, t in _projection(layout, rows, cols, rng, legacy=legacy).items():
                    out[p + suffix] = t
    return out


def resident_tensors(cfg: ModelConfig) -> dict[str, tuple[str, np.ndarray]]:
    dtypes = {"BF16": np.uint16, "F32": np.float32}
    return {name: (s.dtype, np.zeros(s.shape, dtypes[s.dtype]))
            for name, s in resident_tensor_specs(cfg).items()}


def checkpoint_tensors(cfg: ModelConfig, layout: str, **kw) -> dict[str, tuple[str, np.ndarray]]:
    return {**resident_tensors(cfg), **expert_tensors(cfg, layout, **kw)}


def write_checkpoint(root: Path, cfg: ModelConfig, tensors: dict, *, shards: int = 3,
                     form: str = "official", config_dict: dict | None = None) -> Path:
    """Write config.json, `shards` safetensors files and an index (or, with shards=0, a single
    model.safetensors). Names are spread round-robin so every shard holds experts and residents."""
    root.mkdir(parents=True, exist_ok=True)
    if config_dict is None:
        config_dict = cfg.to_official_dict() if form == "official" else cfg.to_flat_dict()
    (root / "config.json").write_text(json.dumps(config_dict, indent=2))
    if shards == 0:
        write_safetensors(root / "model.safetensors", tensors)
        return root
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        write_safetensors(root / file, part)
        weight_map.update(dict.fromkeys(part, file))
    total = sum(a.nbytes for _, a in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return root


def build(root: Path, layout: str, *, cfg: ModelConfig | None = None, shards: int = 3,
          form: str | None = None, **kw) -> tuple[Path, ModelConfig, dict]:
    """A valid checkpoint of `layout` in `root`: (root, config, tensors written)."""
    cfg = cfg or tiny_config(layout)
    tensors = checkpoint_tensors(cfg, layout, **kw)
    form = form or ("flat" if layout == "t158" else "official")
    write_checkpoint(root, cfg, tensors, shards=shards, form=form)
    return root, cfg, tensors


def replace(cfg: ModelConfig, **changes) -> ModelConfig:
    return dataclasses.replace(cfg, **changes)
