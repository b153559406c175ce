"""DeepseekV3Config and the reader for the DeepSeek-V3 family: the published configs of
DeepSeek-V3, Kimi K2 Instruct and Kimi K2 Thinking (tests/data/published/) parse to the
published parameter counts, both rotary spellings read alike, what the runtime does not
implement is refused naming the key, and the checkpoint reader skips the MTP module, accepts the
correction bias in F32 or BF16 and refuses what the config would ignore."""

import copy
import json
import math
from pathlib import Path

import pytest

from mtplx_runtime.checkpoint import (
    CheckpointError,
    ConfigError,
    DeepseekV3Config,
    ModelConfig,
    load_config,
    open_checkpoint,
    resident_tensor_specs,
)
from mtplx_runtime.checkpoint.safetensors_io import write_safetensors
from mtplx_runtime.fixtures.tiny_deepseek import make_tiny_deepseek

PUBLISHED = Path(__file__).parent / "data" / "published"


def published(name: str) -> dict:
    return json.loads((PUBLISHED / name / "config.json").read_text())


def params(cfg) -> tuple[int, int]:
    """(total, activated per token) parameters of the model that runs (no MTP module)."""
    expert = sum(math.prod(s) for s in cfg.expert_shapes.values())
    res = sum(math.prod(s.shape) for s in resident_tensor_specs(cfg).values())
    moe = len(cfg.moe_layers)
    # the embedding is a lookup: one row per token, not counted as activated
    return (res + moe * cfg.num_experts * expert,
            res - cfg.vocab_size * cfg.hidden_size + moe * cfg.num_experts_per_token * expert)


@pytest.mark.parametrize("name,layers,experts,groups,total,active", [
    ("deepseek-v3", 61, 256, (8, 4), 671, 37),  # "671B total, 37B activated"
    ("kimi-k2-instruct", 61, 384, (1, 1), 1026, 32),  # "1T total, 32B activated"
    ("kimi-k2-thinking", 61, 384, (1, 1), 1026, 32),
])
def test_published_configs(name, layers, experts, groups, total, active):
    cfg = load_config(PUBLISHED / name / "config.json")
    assert isinstance(cfg, DeepseekV3Config)
    assert (cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_token) == (layers,
                                                                                    experts, 8)
    assert (cfg.num_expert_group, cfg.topk_group) == groups
    assert cfg.expert_shapes == {"gate": (2048, 7168), "up": (2048, 7168), "down": (7168, 2048)}
    assert cfg.moe_layers == list(range(cfg.first_k_dense_replace, layers))
    t, a = params(cfg)
    assert (round(t / 1e9), round(a / 1e9)) == (total, active)


def test_transformers_5_form_reads_as_the_published_one():
    d = published("deepseek-v3")
    t5 = {k: v for k, v in d.items() if k not in ("rope_scaling", "rope_theta")}
    rope = dict(d["rope_scaling"])
    t5["rope_parameters"] = {**rope, "rope_type": rope.pop("type"), "rope_theta": 10000.0}
    assert DeepseekV3Config.from_dict(t5) == DeepseekV3Config.from_dict(d)
    both = {**d, "rope_parameters": t5["rope_parameters"]}  # agreeing spellings: fine
    assert DeepseekV3Config.from_dict(both) == DeepseekV3Config.from_dict(d)
    both["rope_parameters"] = {**both["rope_parameters"], "factor": 8}
    with pytest.raises(ConfigError, match="describe different rotations"):
        DeepseekV3Config.from_dict(both)


def test_rope_defaults_and_refusals():
    d = published("kimi-k2-instruct")
    plain = DeepseekV3Config.from_dict({**d, "rope_scaling": None})
    assert (plain.rope.kind, plain.rope.theta) == ("default", 50000.0)
    for scaling, match in [({"type": "linear", "factor": 2.0}, "rope type 'linear'"),
                           ({**d["rope_scaling"], "low_freq_factor": 1}, "low_freq_factor"),
                           ({**d["rope_scaling"], "factor": -1}, "factor"),
                           ({**d["rope_scaling"], "truncate": "yes"}, "truncate"),
                           ([1, 2], "not a JSON object")]:
        with pytest.raises(ConfigError, match=match):
            DeepseekV3Config.from_dict({**d, "rope_scaling": scaling})


@pytest.mark.parametrize("key,value,match", [
    ("hidden_act", "gelu", "hidden_act"),
    ("scoring_func", "softmax", "scoring_func"),
    ("topk_method", "greedy", "topk_method"),
    ("moe_layer_freq", 2, "moe_layer_freq"),
    ("attention_bias", True, "attention_bias"),
    ("q_lora_rank", None, "q_lora_rank null"),
    ("num_key_value_heads", 8, "num_key_value_heads 8 must equal"),
    ("topk_group", 9, "topk_group 9 exceeds n_group 8"),
    ("n_group", 7, "not a multiple of n_group"),
    ("num_experts_per_tok", 300, "exceeds n_routed_experts"),
    ("qk_rope_head_dim", 63, "must be even"),
    ("eos_token_id", 10**7, "outside 0..vocab_size-1"),
    ("eos_token_id", "1", "not an integer"),
    ("routed_scaling_factor", float("nan"), "routed_scaling_factor"),
    ("hidden_size", True, "hidden_size"),
    ("architectures", ["LlamaForCausalLM"], "does not name DeepseekV3ForCausalLM"),
    ("quantization_config", [], "not a JSON object"),
])
def test_unsupported_values_are_refused(key, value, match):
    d = copy.deepcopy(published("deepseek-v3"))
    d[key] = value
    with pytest.raises(ConfigError, match=match):
        DeepseekV3Config.from_dict(d)


def test_group_limit_must_reach_top_k():
    d = {**published("deepseek-v3"), "n_group": 64, "topk_group": 1}  # 1 group of 4 < top-8
    with pytest.raises(ConfigError, match="cannot select 8"):
        DeepseekV3Config.from_dict(d)


def test_missing_fields_and_eos_lists(tmp_path):
    d = published("kimi-k2-thinking")
    del d["kv_lora_rank"], d["num_experts_per_tok"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError, match=r"config.json: missing required fields: "
                                          r"num_experts_per_tok, kv_lora_rank"):
        load_config(tmp_path / "config.json")
    cfg = DeepseekV3Config.from_dict({**published("kimi-k2-thinking"),
                                      "eos_token_id": [163585, 163586]})
    assert cfg.eos_token_ids == (163585, 163586)


def test_k3_configs_still_read_as_k3():
    from test_config import k3_official

    assert isinstance(ModelConfig.from_dict(k3_official()), ModelConfig)
    with pytest.raises(ConfigError, match="not a DeepSeek-V3 family config"):
        DeepseekV3Config.from_dict(k3_official())


def test_layout_helpers():
    cfg = DeepseekV3Config.from_dict(published("deepseek-v3"))
    assert not cfg.is_moe_layer(2) and cfg.is_moe_layer(3)
    assert not any(cfg.is_kda_layer(i) for i in range(61))
    cfg.check_expert_key(60, 255)
    for layer, expert in ((2, 0), (61, 0), (3, 256)):
        with pytest.raises(ValueError):
            cfg.check_expert_key(layer, expert)


# ---- the checkpoint reader ----


def test_mtp_module_is_skipped(tmp_path):
    info = make_tiny_deepseek(tmp_path / "m", "bf16", "v3")
    index = json.loads((info.path / "model.safetensors.index.json").read_text())
    assert any(n.startswith("model.layers.3.mlp.experts.") for n in index["weight_map"])
    with open_checkpoint(info.path) as ckpt:
        assert ckpt.layout == "bf16" and ckpt.config.num_nextn_predict_layers == 1


def _add_tensor(path: Path, name: str, dtype: str, array) -> None:
    """Add one tensor in a shard of its own to the checkpoint at `path`."""
    write_safetensors(path / "extra.safetensors", {name: (dtype, array)})
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"][name] = "extra.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def test_tensors_past_the_mtp_module_are_refused(tmp_path):
    import numpy as np

    info = make_tiny_deepseek(tmp_path / "m", "bf16", "v3")
    _add_tensor(info.path, "model.layers.4.input_layernorm.weight", "BF16",
                np.zeros(64, np.uint16))
    with pytest.raises(CheckpointError, match="layers.4.input_layernorm.weight' is not used"):
        open_checkpoint(info.path)


def test_correction_bias_dtypes(tmp_path):
    import numpy as np

    from mtplx_runtime.fixtures.tiny_layout import write_shards

    info = make_tiny_deepseek(tmp_path / "m", "bf16", "k2")
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    with open_checkpoint(info.path) as ckpt:
        tensors = {n: (ckpt.tensor_info(n).dtype, ckpt.tensor(n)) for n in ckpt.tensor_names()}
    for dtype, array, ok in (("BF16", np.zeros(8, np.uint16), True),
                             ("F16", np.zeros(8, np.uint16), False)):
        write_shards(info.path, {**tensors, name: (dtype, array)})
        if ok:
            open_checkpoint(info.path).close()
        else:
            with pytest.raises(CheckpointError, match="e_score_correction_bias' is F16"):
                open_checkpoint(info.path)


def test_incomplete_experts_are_named(tmp_path):
    from mtplx_runtime.fixtures.tiny_layout import write_shards

    info = make_tiny_deepseek(tmp_path / "m", "bf16", "k2")
    with open_checkpoint(info.path) as ckpt:
        tensors = {n: (ckpt.tensor_info(n).dtype, ckpt.tensor(n)) for n in ckpt.tensor_names()}
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    write_shards(info.path, tensors)
    with pytest.raises(CheckpointError, match="layer 2 expert 5 lacks up_proj.weight"):
        open_checkpoint(info.path)
