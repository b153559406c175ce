"""The quantized DeepSeek-V3 family layouts against transformers on their dequantized weights:
Kimi K2 Thinking's compressed-tensors INT4 experts (symmetric, group 32) dequantized by
compressed-tensors itself, and DeepSeek's FP8 e4m3 weights with 128x128 block scales (experts
and the resident matrices) dequantized by torch's own float8_e4m3fn conversion. The oracle is
transformers' DeepseekV3ForCausalLM in fp32 on a bf16 checkpoint of those weights; our model
reads the quantized checkpoint resident and streamed (build_artifact keeps the codec): logits
within rel-L2 1e-4 with every argmax equal, and each decoded expert equal to the oracle's bits."""

import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.pack_quantized.base import (  # noqa: E402
    PackedQuantizationCompressor,
)
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import DeepseekV3ForCausalLM  # noqa: E402

from mtplx_runtime import load, load_model  # noqa: E402
from mtplx_runtime.artifact.build import build_artifact  # noqa: E402
from mtplx_runtime.checkpoint import open_checkpoint  # noqa: E402
from mtplx_runtime.fixtures.tiny_deepseek import (  # noqa: E402
    FP8_BLOCK,
    INT4_GROUP,
    make_tiny_deepseek,
)

CASES = [("int4", "k2"), ("fp8", "v3"), ("fp8", "k2")]
TOKENS = [5, 17, 200, 3, 99, 42, 7, 250, 31, 64, 128, 11, 90, 1, 77, 8]
INT4 = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
    num_bits=4, type="int", symmetric=True, strategy="group", group_size=INT4_GROUP))


def int4_dequant(t: dict, stem: str) -> torch.Tensor:
    """compressed-tensors' own decompress of one INT4 projection -> bf16."""
    sd = {k: t[stem + k] for k in ("weight_packed", "weight_scale", "weight_shape")}
    return PackedQuantizationCompressor.decompress(sd, INT4)["weight"].to(torch.bfloat16)


def fp8_dequant(t: dict, stem: str) -> torch.Tensor:
    """e4m3 through torch's float8_e4m3fn, times its block's scale in fp32, rounded to bf16."""
    w, s = t[stem + "weight"], t[stem + "weight_scale_inv"]
    rows, cols = w.shape
    scale = s.repeat_interleave(FP8_BLOCK, 0)[:rows].repeat_interleave(FP8_BLOCK, 1)[:, :cols]
    return (w.view(torch.float8_e4m3fn).float() * scale).to(torch.bfloat16)


def oracle_checkpoint(src, out) -> dict:
    """A bf16 checkpoint transformers reads (model_type deepseek_v3) of `src`'s dequantized
    weights; returns {tensor: bf16 weight} of the dequantized matrices."""
    t = {}
    for shard in sorted(src.glob("*.safetensors")):
        t.update(load_file(shard))
    dense, done = {}, {}
    for name in t:
        if name.endswith("weight_packed"):
            stem = name[: -len("weight_packed")]
            done[stem + "weight"] = int4_dequant(t, stem)
        elif name.endswith("weight_scale_inv"):
            stem = name[: -len("weight_scale_inv")]
            done[stem + "weight"] = fp8_dequant(t, stem)
    for name, v in t.items():
        if not name.endswith(("weight_packed", "weight_scale", "weight_shape",
                              "weight_scale_inv")) and name not in done:
            dense[name] = v
    dense.update(done)
    out.mkdir()
    save_file({k: v.contiguous() for k, v in dense.items()}, out / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config")
    cfg["model_type"] = "deepseek_v3"
    (out / "config.json").write_text(json.dumps(cfg))
    return done


@pytest.fixture(scope="module", params=CASES, ids=["-".join(c) for c in CASES])
def case(request, tmp_path_factory):
    layout, variant = request.param
    root = tmp_path_factory.mktemp(f"{layout}-{variant}")
    src = make_tiny_deepseek(root / "src", layout, variant).path
    dequantized = oracle_checkpoint(src, root / "oracle")
    oracle = DeepseekV3ForCausalLM.from_pretrained(root / "oracle", dtype=torch.float32).eval()
    with torch.no_grad():
        want = oracle(torch.tensor([TOKENS])).logits[0]
    build_artifact(src, root / "art", progress=False)
    return layout, src, root / "art", want, dequantized


def check_close(got, want):
    rel = float((got.float() - want).norm() / want.norm())
    assert rel < 1e-4, rel
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_experts_decode_to_the_oracles_bits(case):
    layout, src, _, _, dequantized = case
    with open_checkpoint(src) as ckpt:
        assert ckpt.layout == ("w3" if layout == "int4" else "fp8")
        for layer, e in ((1, 0), (2, 7)):
            ours = ckpt.expert(layer, e).decode()
            for proj in ("gate", "up", "down"):
                want = dequantized[f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight"]
                assert np.array_equal(ours[proj], want.float().numpy())


def test_resident_logits_match_transformers(case):
    _, src, _, want, _ = case
    check_close(load_model(src, dtype="float32").logits(TOKENS), want)


@pytest.mark.parametrize("kernels", ["reference", "cpu"])
def test_streamed_logits_match_transformers(case, kernels):
    layout, src, art, want, _ = case
    with load(art, dtype="float32", cache_slots=(2, 0), kernels=kernels,
              tokenizer=False) as rt:
        assert rt.provider.layout.mode == ("ct-int" if layout == "int4" else "fp8-block")
        got = rt.model.logits(TOKENS)
    check_close(got, want)
    if kernels == "reference":
        assert torch.equal(got, load_model(src, dtype="float32").logits(TOKENS))


def test_plan_sizes_fp8_residents_as_loaded(case, tmp_path):
    """An fp8 artifact's FP8 resident matrices load as bf16: the plan counts them so, the same
    resident bytes as the bf16 layout's artifact of the same model."""
    from mtplx_runtime.engine.plan import make_plan

    layout, src, art, _, _ = case
    if layout != "fp8":
        pytest.skip("fp8 residents only")
    kind = json.loads((src / "config.json").read_text())["model_type"]
    bf16 = make_tiny_deepseek(tmp_path / "bf16", "bf16",
                              "v3" if kind == "deepseek_v3" else "k2").path
    build_artifact(bf16, tmp_path / "bf16-art", progress=False)
    plans = [make_plan(a, memory_budget="2GiB", kernels="cpu")
             for a in (art, tmp_path / "bf16-art")]
    assert plans[0].items["residents"] == plans[1].items["residents"]


def test_fp8_residents_quantize_at_load_not_at_build(case, tmp_path):
    from mtplx_runtime.artifact.journal import BuildError

    layout, src, art, _, _ = case
    if layout != "fp8":
        pytest.skip("fp8 residents only")
    with pytest.raises(BuildError, match="resident matrices are FP8"):
        build_artifact(src, tmp_path / "int8", resident_dtype="int8", progress=False)
    assert not (tmp_path / "int8").exists()  # refused before OUT is made
    with load(art, dtype="bfloat16", cache_slots=(2, 0), kernels="reference", tokenizer=False,
              resident_dtype="int8") as rt:
        assert torch.isfinite(rt.model.logits(TOKENS)).all()


def test_fp8_checkpoints_are_checked_at_open(tmp_path):
    from mtplx_runtime.checkpoint import CheckpointError
    from mtplx_runtime.fixtures.tiny_layout import write_shards

    src = make_tiny_deepseek(tmp_path / "m", "fp8", "v3").path
    with open_checkpoint(src) as ckpt:
        tensors = {n: (ckpt.tensor_info(n).dtype, ckpt.tensor(n)) for n in ckpt.tensor_names()}
    scale = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    bad = {**tensors, scale: ("F32", np.ones((2, 2), np.float32))}
    write_shards(src, bad)
    with pytest.raises(CheckpointError, match=r"o_proj.weight_scale_inv' is F32\[2, 2\], its FP8 "
                                              r"weight needs F32\[1, 1\]"):
        open_checkpoint(src)
    write_shards(src, {n: t for n, t in tensors.items() if n != scale})
    with pytest.raises(CheckpointError, match="has no 'model.layers.0.self_attn.o_proj.weight_"):
        open_checkpoint(src)
    write_shards(src, tensors)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [64, 64]
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="experts are FP8 .* weight_block_size"):
        open_checkpoint(src)
