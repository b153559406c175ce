"""The DeepSeek-V3 family against transformers' own DeepseekV3ForCausalLM (fp32, CPU): tiny
checkpoints written by its `save_pretrained` (random weights, bf16 on disk), both routings (one
expert group as Kimi K2, four groups with two kept as DeepSeek-V3), YaRN RoPE with interleaved
pairs. Our model loads them resident (`load_model`) and streamed from an artifact that
`build_artifact` (mtplx build-manifest) made, through a cache smaller than the experts: logits
within rel-L2 1e-4 of transformers' with every argmax equal, greedy continuations equal, and
the streamed model equal to the resident one bit for bit with the reference kernels.

The K2 routing's checkpoint is rewritten to the published config form (model_type kimi_k2,
`rope_scaling` + `rope_theta`); the V3 one keeps transformers 5's form (`rope_parameters`), so
both spellings are read.
"""

import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM  # noqa: E402

from mtplx_runtime import load, load_model  # noqa: E402
from mtplx_runtime.artifact.build import build_artifact  # noqa: E402
from mtplx_runtime.engine.generate import generate  # noqa: E402

ROUTINGS = {"k2": (1, 1), "v3": (4, 2)}  # (n_group, topk_group)
TOKENS = [5, 17, 200, 3, 99, 42, 7, 250, 31, 64, 128, 11, 90, 1, 77, 8, 160, 222, 13, 45]
NEW_TOKENS = 8


def hf_config(n_group: int, topk_group: int) -> DeepseekV3Config:
    return DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, num_experts_per_tok=2, n_group=n_group, topk_group=topk_group,
        routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
        v_head_dim=16, qk_nope_head_dim=16, first_k_dense_replace=1, norm_topk_prob=True,
        initializer_range=0.1, max_position_embeddings=256, rope_theta=10000.0,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})


def published_form(path) -> None:
    """Rewrite a transformers-5 config.json as Kimi K2 publishes it."""
    d = json.loads((path / "config.json").read_text())
    rope = d.pop("rope_parameters")
    d["rope_theta"] = rope.pop("rope_theta")
    rope.pop("rope_type")
    d["rope_scaling"] = rope
    d["model_type"] = "kimi_k2"
    (path / "config.json").write_text(json.dumps(d, indent=2))


@pytest.fixture(scope="module", params=sorted(ROUTINGS))
def case(request, tmp_path_factory):
    """(routing, checkpoint dir, artifact dir, transformers fp32 model of the saved weights)."""
    root = tmp_path_factory.mktemp(f"hf-{request.param}")
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(hf_config(*ROUTINGS[request.param]))
    with torch.no_grad():  # a non-zero correction bias, so selection differs from weighting
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.1 * torch.randn_like(buf))
    hf_dir = root / "hf"
    model.to(torch.bfloat16).save_pretrained(hf_dir)
    oracle = DeepseekV3ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ckpt = hf_dir
    if request.param == "k2":
        ckpt = root / "k2"
        shutil.copytree(hf_dir, ckpt)
        published_form(ckpt)
    art = root / "art"
    build_artifact(ckpt, art, progress=False)
    return request.param, ckpt, art, oracle


def oracle_logits(oracle) -> torch.Tensor:
    with torch.no_grad():
        return oracle(torch.tensor([TOKENS])).logits[0]


def check_close(got: torch.Tensor, want: torch.Tensor) -> None:
    rel = float((got.float() - want).norm() / want.norm())
    assert rel < 1e-4, rel
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_resident_logits_match_transformers(case):
    _, ckpt, _, oracle = case
    check_close(load_model(ckpt, dtype="float32").logits(TOKENS), oracle_logits(oracle))


def test_decode_steps_match_transformers(case):
    """Prefill half, then one token at a time: the absorbed MLA form with the rotated keys in
    the latent cache gives the full forward's rows."""
    _, ckpt, _, oracle = case
    model = load_model(ckpt, dtype="float32")
    state = model.new_state()
    rows = [model.prefill(TOKENS[:9], state)]
    rows += [model.decode(t, state)[None] for t in TOKENS[9:]]
    check_close(torch.cat(rows), oracle_logits(oracle))


@pytest.mark.parametrize("kernels", ["reference", "cpu"])
def test_streamed_logits_match_transformers(case, kernels):
    _, ckpt, art, oracle = case
    want = oracle_logits(oracle)
    with load(art, dtype="float32", cache_slots=(2, 0), kernels=kernels,
              tokenizer=False) as rt:
        got = rt.model.logits(TOKENS)
        reads = rt.provider.stats()["prefetch"]["demand_reads"]
    check_close(got, want)
    assert reads > 0  # two slots per layer of eight experts: the experts really streamed
    if kernels == "reference":  # the reference kernel's sums are the resident model's
        assert torch.equal(got, load_model(ckpt, dtype="float32").logits(TOKENS))


def test_greedy_continuation_matches_transformers(case):
    _, ckpt, art, oracle = case
    with torch.no_grad():
        want = oracle.generate(torch.tensor([TOKENS]), max_new_tokens=NEW_TOKENS,
                               do_sample=False)[0, len(TOKENS):].tolist()
    resident, _ = generate(load_model(ckpt, dtype="float32"), TOKENS, max_tokens=NEW_TOKENS)
    with load(art, dtype="float32", memory_budget="1GiB", tokenizer=False) as rt:
        streamed, _ = generate(rt.model, TOKENS, max_tokens=NEW_TOKENS)
    assert resident == want
    assert streamed == want
