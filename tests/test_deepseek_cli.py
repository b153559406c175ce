"""The DeepSeek-V3 family through the command line: `mtplx build-manifest` turns each layout of
the tiny fixtures (bf16 in both variants, Kimi K2 Thinking's INT4, DeepSeek's FP8) into a
streaming artifact, and `mtplx generate --memory-budget` streams text from it (plain and
`--chat`), the same ids as the resident model; `mtplx inspect`, `mtplx plan`, route traces and
`mtplx profile` read the family too; `mtplx plan` sizes the full models from their published
configs, as the README prints it."""

import shlex
from pathlib import Path

import pytest
import torch

from mtplx_runtime import load_model
from mtplx_runtime.cli import main
from mtplx_runtime.engine.generate import generate
from mtplx_runtime.engine.hf_tokenizer import model_tokenizer as load_tokenizer
from mtplx_runtime.engine.plan import facts_from_dir
from mtplx_runtime.fixtures.tiny_deepseek import make_tiny_deepseek

CASES = [("bf16", "v3"), ("bf16", "k2"), ("int4", "k2"), ("fp8", "v3")]
PROMPT = "The expert cache keeps"


@pytest.fixture(scope="module", params=CASES, ids=["-".join(c) for c in CASES])
def built(request, tmp_path_factory):
    layout, variant = request.param
    root = tmp_path_factory.mktemp(f"{layout}-{variant}")
    src = make_tiny_deepseek(root / "src", layout, variant).path
    assert main(["build-manifest", str(src), str(root / "art"), "--quiet"]) == 0
    return src, root / "art"


def test_generate_streams_from_the_artifact(built, capsys):
    src, art = built
    args = ["generate", "--model", str(art), "--prompt", PROMPT, "--max-tokens", "6",
            "--memory-budget", "600MiB", "--dtype", "float32", "--warm", "off"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert "generated 6 tok" in err and "cache hit rate" in err  # streamed through the cache
    tok = load_tokenizer(src)
    want, _ = generate(load_model(src, dtype="float32"), tok.encode(PROMPT), max_tokens=6)
    assert out.rstrip("\n") == tok.decode(want, skip_special=True)


def test_generate_chat_uses_the_model_template(built, capsys):
    _, art = built
    args = ["generate", "--model", str(art), "--prompt", "Hello", "--chat", "--max-tokens",
            "3", "--memory-budget", "600MiB", "--warm", "off"]
    assert main(args) == 0
    _, err = capsys.readouterr()
    assert "[reply:" in err


def test_inspect_and_plan(built, capsys):
    src, art = built
    assert main(["inspect", str(src)]) == 0
    assert main(["plan", str(art), "--memory-budget", "2GiB", "--kernels", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "routed layers x 8 experts, top-2" in out
    assert "MLA latent cache" in out and "KDA state" not in out  # MLA only: no recurrent state


def test_resident_and_streamed_ids_agree(built):
    src, art = built
    from mtplx_runtime import load

    ids = load_tokenizer(src).encode(PROMPT)
    want, _ = generate(load_model(src, dtype="bfloat16"), ids, max_tokens=8)
    with load(art, memory_budget="600MiB", kernels="reference", tokenizer=False) as rt:
        got, _ = generate(rt.model, ids, max_tokens=8)
    assert got == want
    assert rt.model.dtype == torch.bfloat16


@pytest.mark.parametrize("resident_dtype", ["int8", "int4", "fp8"])
def test_quantized_residents_keep_the_router(built, resident_dtype):
    """--resident-dtype quantizes attention, dense and shared MLPs and the head, never the
    router: a quantized model routes the same hidden state exactly as the bf16 one."""
    src, _ = built
    model = load_model(src, dtype="bfloat16", resident_dtype=resident_dtype)
    moe = model.moe_blocks()[0]
    assert isinstance(moe.router, torch.Tensor) and moe.router.dtype == torch.bfloat16
    assert not isinstance(model.layers[0].attn.o, torch.Tensor)  # a quantized matrix
    logits = model.logits(load_tokenizer(src).encode(PROMPT))
    assert torch.isfinite(logits).all()


def test_artifact_leaves_the_mtp_module_out(built):
    src, art = built
    index = (art / "model.safetensors.index.json").read_text()
    assert '"model.layers.2.' in index and '"model.layers.3.' not in index


def test_route_trace_and_profiler(built, tmp_path, capsys):
    import json

    _, art = built
    trace = tmp_path / "routes.jsonl"
    assert main(["generate", "--model", str(art), "--prompt", PROMPT, "--max-tokens", "5",
                 "--memory-budget", "600MiB", "--warm", "off", "--trace-routes",
                 str(trace)]) == 0
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    assert {k: lines[0][k] for k in ("layers", "experts", "top_k")} == {
        "layers": [1, 2], "experts": 8, "top_k": 2}
    assert all(len(ids) == 2 for line in lines[1:] for ids in line["routes"].values())
    capsys.readouterr()
    assert main(["profile", str(trace), "--capacity", "4,8"]) == 0
    assert "2 layers x 8 experts top-2" in capsys.readouterr().out


ROOT = Path(__file__).parents[1]
PUBLISHED = ROOT / "tests" / "data" / "published"


@pytest.mark.parametrize("name, mode, bits, record, layers, experts", [
    # K2 Thinking: INT4 group 32, per projection 2048 x 7168 nibbles + one BF16 scale per 32
    ("kimi-k2-thinking", "ct-int", 4, 3 * (2048 * 7168 // 2 + 2048 * 7168 // 32 * 2), 60, 384),
    # FP8: per projection 2048 x 7168 bytes + 16 x 56 fp32 block scales, each 4 KiB-padded
    ("kimi-k2-instruct", "fp8-block", None, 3 * (2048 * 7168 + 4096), 60, 384),
    ("deepseek-v3", "fp8-block", None, 3 * (2048 * 7168 + 4096), 58, 256),
])
def test_full_models_plan_from_their_published_configs(name, mode, bits, record, layers,
                                                       experts):
    """`mtplx plan` of a published config.json alone: the bank build-manifest would write
    (K2 Thinking's INT4 as ct-int 4-bit in groups of 32, the FP8 checkpoints as fp8-block), its
    record size, and the DeepSeek-V3 geometry's routed layers (from first_k_dense_replace),
    experts and top-k."""
    facts = facts_from_dir(PUBLISHED / name)
    assert (facts.mode, facts.bits, facts.source) == (mode, bits, "config")
    assert facts.record_bytes == record  # K3's group of 64 would give fewer scale bytes
    assert len(facts.routed_layers) == layers and facts.routed_layers[-1] == 60
    assert (facts.geometry.experts, facts.geometry.top_k) == (experts, 8)
    assert facts.geometry.state_bytes("bfloat16", 1) == 0  # MLA only: no recurrent state


def _readme_plans() -> list[tuple[list[str], list[str]]]:
    """The README's `mtplx plan` outputs of the published configs: (argv, the lines quoted)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    out = []
    for block in text.split("```\n$ mtplx plan --model tests/data/published/")[1:]:
        command, *lines = block.split("```", 1)[0].splitlines()
        argv = shlex.split("--model tests/data/published/" + command)
        out.append(([str(ROOT / a) if a.startswith("tests/") else a for a in argv], lines))
    return out


def test_readme_plans_are_what_the_command_prints(capsys):
    plans = _readme_plans()
    assert len(plans) == 4  # K2 Thinking and V3, on a 64 GiB host and on one H200
    for argv, quoted in plans:
        assert main(["plan", *argv]) == 0
        assert capsys.readouterr().out.splitlines() == quoted, argv
