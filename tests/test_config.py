"""ModelConfig: both config forms, K3 identification, validation, derived layout helpers."""

import json

import pytest
from ckpt_helpers import TINY, tiny_config, w3_qc
from hypothesis import given, settings
from hypothesis import strategies as st

from mtplx_runtime.checkpoint import CheckpointError, ModelConfig, resident_tensor_specs
from mtplx_runtime.checkpoint.config import ConfigError

MLA_1BASED = list(range(4, 93, 4)) + [93]


def k3_official() -> dict:
    """The published config's text fields (FORMAT.md "Geometry"), in the official nested form."""
    text = {
        "model_type": "kimi_linear", "vocab_size": 163840, "hidden_size": 7168,
        "num_hidden_layers": 93, "intermediate_size": 33792, "first_k_dense_replace": 1,
        "moe_layer_freq": 1, "num_experts": 896, "num_experts_per_token": 16,
        "moe_intermediate_size": 3072, "routed_expert_hidden_size": 3584,
        "latent_moe_use_norm": True, "num_shared_experts": 2,
        "moe_router_activation_func": "sigmoid", "topk_method": "noaux_tc",
        "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
        "moe_renormalize": True, "routed_scaling_factor": 1.0, "num_attention_heads": 96,
        "num_key_value_heads": 96, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "mla_use_nope": True, "mla_use_output_gate": True,
        "linear_attn_config": {
            "num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4,
            "use_full_rank_gate": True, "gate_lower_bound": -5.0,
            "full_attn_layers": MLA_1BASED,
            "kda_layers": [x for x in range(1, 94) if x not in MLA_1BASED],
        },
        "attn_res_block_size": 12, "hidden_act": "situ", "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 1048576, "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False, "auto_map": {"AutoConfig": "x"},
    }
    return {
        "model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
        "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
        "media_placeholder_token_id": 163605, "tie_word_embeddings": False,
        "text_config": text, "vision_config": {"num_hidden_layers": 27},
        "quantization_config": {"format": "mxfp4-pack-quantized"},
    }


def k3_flat() -> dict:
    """The flattened form of the t158 artifacts (no quantization_config)."""
    d = k3_official()
    flat = dict(d["text_config"])
    flat.update({k: d[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")})
    return flat


def test_full_size_k3_both_forms():
    official, flat = ModelConfig.from_dict(k3_official()), ModelConfig.from_dict(k3_flat())
    assert official.quantization_config == {"format": "mxfp4-pack-quantized"}
    assert flat.quantization_config is None
    assert official.hidden_size == 7168 and official.activation_situ_linear_beta == 25.0
    mla = [layer for layer in range(93) if not official.is_kda_layer(layer)]
    assert len(mla) == 24 and mla[:2] == [3, 7] and mla[-2:] == [91, 92]
    assert official.moe_layers == list(range(1, 93)) and not official.is_moe_layer(0)
    assert official.expert_shapes == {
        "gate": (3072, 3584), "up": (3072, 3584), "down": (3584, 3072)}
    assert official.attn_res_block_starts == [0, 12, 24, 36, 48, 60, 72, 84]
    specs = resident_tensor_specs(official)
    # FORMAT.md "Resident tensors": 2,460 non-expert text tensors, 506 of them F32.
    assert len(specs) == 2460 and sum(s.dtype == "F32" for s in specs.values()) == 506
    assert specs["language_model.model.layers.0.self_attn.A_log"].shape == (128,)


@pytest.mark.parametrize("form", ["official", "flat"])
def test_round_trip(form, tmp_path):
    cfg = tiny_config("w3")
    d = cfg.to_official_dict() if form == "official" else cfg.to_flat_dict()
    assert ModelConfig.from_dict(d) == cfg
    path = tmp_path / "config.json"
    path.write_text(json.dumps(d))
    assert ModelConfig.from_file(path) == cfg


def test_official_dict_shape():
    d = tiny_config("w3").to_official_dict()
    assert d["model_type"] == "kimi_k3" and d["text_config"]["model_type"] == "kimi_linear"
    assert d["text_config"]["linear_attn_config"]["kda_layers"] == [1, 2, 3, 5]
    assert d["quantization_config"] == w3_qc() and "quantization_config" not in d["text_config"]


def test_unknown_keys_ignored():
    d = tiny_config().to_flat_dict()
    d.update(rope_theta=1e6, something_new={"a": 1})
    d["linear_attn_config"]["extra"] = 3
    assert ModelConfig.from_dict(d) == tiny_config()


def test_kimi_linear_flat_config_is_rejected():
    d = tiny_config().to_flat_dict()
    for key in ("routed_expert_hidden_size", "attn_res_block_size"):
        d.pop(key)
    d["linear_attn_config"].pop("gate_lower_bound")
    with pytest.raises(ConfigError, match="Kimi-Linear, not Kimi K3.*missing routed_expert_hidden"):
        ModelConfig.from_dict(d)


@pytest.mark.parametrize("marker", ["routed_expert_hidden_size", "attn_res_block_size", "gate"])
def test_one_missing_marker_is_enough_to_reject(marker):
    d = tiny_config().to_flat_dict()
    if marker == "gate":
        d["linear_attn_config"].pop("gate_lower_bound")
    else:
        d.pop(marker)
    with pytest.raises(ConfigError, match="Kimi-Linear"):
        ModelConfig.from_dict(d)


def test_model_type_checks():
    d = tiny_config().to_official_dict()
    with pytest.raises(ConfigError, match="expected 'kimi_k3'"):
        ModelConfig.from_dict({**d, "model_type": "kimi_linear"})
    with pytest.raises(ConfigError, match="model_type 'kimi_linear'"):
        ModelConfig.from_dict({**d, "text_config": {**d["text_config"], "model_type": "kimi_k3"}})
    with pytest.raises(ConfigError, match="'llama' is not a Kimi K3"):
        ModelConfig.from_dict({**tiny_config().to_flat_dict(), "model_type": "llama"})
    with pytest.raises(ConfigError, match="not a JSON object"):
        ModelConfig.from_dict([1, 2])


def test_quantization_config_lookup():
    base = tiny_config().to_official_dict()
    inner = {**base, "text_config": {**base["text_config"], "quantization_config": w3_qc()}}
    assert ModelConfig.from_dict(inner).quantization_config == w3_qc()
    both = {**inner, "quantization_config": w3_qc()}
    assert ModelConfig.from_dict(both).quantization_config == w3_qc()
    with pytest.raises(ConfigError, match="differs between the top level and text_config"):
        ModelConfig.from_dict({**inner, "quantization_config": w3_qc(num_bits=4)})
    with pytest.raises(ConfigError, match="quantization_config is not a JSON object"):
        ModelConfig.from_dict({**base, "quantization_config": "w3"})


def test_missing_required_fields_are_all_listed():
    d = tiny_config().to_flat_dict()
    del d["hidden_size"], d["tie_word_embeddings"], d["linear_attn_config"]["head_dim"]
    with pytest.raises(ConfigError, match="hidden_size, .*linear_attn_config.head_dim.*tie_word"):
        ModelConfig.from_dict(d)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"kda_layers": (1, 2, 3)}, r"layers \[5\] \(1-based\) are in neither"),
        ({"kda_layers": (1, 2, 3, 4, 5)}, r"layers \[4\] .* in both"),
        ({"kda_layers": (1, 2, 3, 5, 5)}, r"layers \[5\] .* listed twice"),
        ({"kda_layers": (0, 1, 2, 3, 5)}, r"layers \[0\] are outside 1..6"),
        ({"full_attn_layers": (4, 6, 7)}, r"layers \[7\] are outside"),
        ({"num_experts_per_token": 9}, "num_experts_per_token 9 exceeds num_experts 8"),
        ({"hidden_size": 0}, "hidden_size must be positive"),
        ({"num_shared_experts": -1}, "num_shared_experts must be >= 0"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps must be finite and positive"),
        ({"kda_gate_lower_bound": float("-inf")}, "kda_gate_lower_bound must be finite"),
        ({"first_k_dense_replace": 7}, "first_k_dense_replace 7 is outside"),
        ({"num_key_value_heads": 2}, "must equal num_attention_heads"),
        ({"eos_token_id": 512}, "eos_token_id 512 is outside"),
        ({"hidden_size": True}, "hidden_size = True is not of type int"),
        ({"kda_layers": [1, 2, 3, 5]}, "kda_layers .* is not of type tuple"),
        ({"hidden_act": "silu"}, "hidden_act = 'silu' is not supported"),
        ({"num_expert_group": 2}, "num_expert_group = 2 is not supported"),
        ({"mla_use_nope": False}, "mla_use_nope = False is not supported"),
        ({"kda_use_full_rank_gate": False}, "kda_use_full_rank_gate = False is not supported"),
        ({"num_nextn_predict_layers": 1}, "num_nextn_predict_layers = 1 is not supported"),
    ],
)
def test_validation(change, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**{**TINY, **change})


def test_from_dict_type_errors_name_the_field():
    d = tiny_config().to_flat_dict()
    d["num_experts"] = "8"
    with pytest.raises(ConfigError, match="num_experts = '8'"):
        ModelConfig.from_dict(d)


def test_from_file_names_the_file(tmp_path):
    path = tmp_path / "config.json"
    d = tiny_config().to_flat_dict()
    d["num_experts_per_token"] = 99
    path.write_text(json.dumps(d))
    with pytest.raises(ConfigError, match=f"{path}: num_experts_per_token 99"):
        ModelConfig.from_file(path)
    path.write_text('{"model_type": "kimi_linear", "model_type": "kimi_k3"}')
    with pytest.raises(CheckpointError, match=f"{path}: not valid JSON: duplicate key"):
        ModelConfig.from_file(path)
    path.write_text("{not json")
    with pytest.raises(CheckpointError, match=f"{path}: not valid JSON"):
        ModelConfig.from_file(path)
    with pytest.raises(CheckpointError, match="nothing.json: file not found"):
        ModelConfig.from_file(tmp_path / "nothing.json")


def test_layer_helpers():
    cfg = tiny_config()
    assert [cfg.is_kda_layer(layer) for layer in range(6)] == [True, True, True, False, True, False]
    assert cfg.moe_layers == [1, 2, 3, 4, 5]
    assert cfg.attn_res_block_starts == [0, 2, 4]
    assert cfg.expert_shapes["down"] == (64, 128)
    with pytest.raises(ValueError, match="layer 6 is outside 0..5"):
        cfg.is_kda_layer(6)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 40), data=st.data())
def test_any_layer_partition_round_trips(n, data):
    mla = data.draw(st.sets(st.integers(1, n)))
    cfg = tiny_config(num_hidden_layers=n, first_k_dense_replace=min(1, n),
                      full_attn_layers=tuple(sorted(mla)),
                      kda_layers=tuple(x for x in range(1, n + 1) if x not in mla))
    assert ModelConfig.from_dict(cfg.to_official_dict()) == cfg
    assert ModelConfig.from_dict(cfg.to_flat_dict()) == cfg
    mla_0based = [layer for layer in range(n) if not cfg.is_kda_layer(layer)]
    assert mla_0based == [x - 1 for x in sorted(mla)]
