"""`mtplx_runtime.load`, the one door: what loading a streamed artifact reads, and what it gives."""

from __future__ import annotations

import os

import pytest
import torch

import mtplx_runtime
from mtplx_runtime.artifact import manifest as manifest_module
from mtplx_runtime.artifact.build import build_artifact
from mtplx_runtime.checkpoint import CheckpointError
from mtplx_runtime.engine.generate import generate
from mtplx_runtime.engine.plan import PlanError
from mtplx_runtime.fixtures.tiny import make_tiny
from mtplx_runtime.model.moe import ResidentExpertProvider
from mtplx_runtime.offload.provider import StreamingExpertProvider

PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    root = tmp_path_factory.mktemp("runtime")
    src, art = root / "t158", root / "t158-art"
    make_tiny(src, "t158")
    build_artifact(src, art, codec="keep", progress=False)
    return src, art


def test_streamed_load_parses_the_manifest_once_and_opens_each_part_once(artifact, monkeypatch):
    _, art = artifact
    parts = {str(p) for p in art.glob("experts-*.bin")}
    assert len(parts) > 1
    opens: dict[str, int] = {}
    parses = []
    real_open, real_parse = os.open, manifest_module.parse_manifest_bytes

    def counting_open(path, *args, **kwargs):
        opens[str(path)] = opens.get(str(path), 0) + 1
        return real_open(path, *args, **kwargs)

    def counting_parse(raw, **kwargs):
        parses.append(kwargs.get("where"))
        return real_parse(raw, **kwargs)

    monkeypatch.setattr(os, "open", counting_open)
    monkeypatch.setattr(manifest_module, "parse_manifest_bytes", counting_parse)
    with mtplx_runtime.load(art, dtype="float32", kernels="reference",
                            cache_slots=(2, 1)) as rt:
        ids, _ = generate(rt.model, PROMPT, max_tokens=6)
        read = rt.provider.stats()["prefetch"]["demand_bytes"]
    assert len(ids) == 6 and read > 0
    assert len(parses) == 1, parses
    part_opens = {p: n for p, n in opens.items() if p in parts}
    assert set(part_opens) == parts  # generation read from every part ...
    assert set(part_opens.values()) == {1}, part_opens  # ... each opened once


def test_streamed_load_equals_resident_under_reference_kernels(artifact):
    src, art = artifact
    want, _ = generate(mtplx_runtime.load_model(src, dtype="float32"), PROMPT, max_tokens=6)
    with mtplx_runtime.load(art, dtype="float32", kernels="reference",
                            cache_slots=(2, 0)) as rt:
        assert isinstance(rt.provider, StreamingExpertProvider) and rt.streamed
        assert rt.model.moe_blocks()[0].provider is rt.provider  # built in place
        assert rt.plan is None and rt.tokenizer is not None
        got, _ = generate(rt.model, PROMPT, max_tokens=6)
        assert rt.provider.stats()["totals"]["compute"]["misses"] > 0  # it really streamed
    assert got == want


@pytest.mark.parametrize("depth", [1, 16])
def test_read_depth_reaches_reader_and_prefetcher_and_changes_no_token(artifact, depth):
    src, art = artifact
    want, _ = generate(mtplx_runtime.load_model(src, dtype="float32"), PROMPT, max_tokens=6)
    with mtplx_runtime.load(art, dtype="float32", kernels="reference", cache_slots=(2, 0),
                            read_depth=depth) as rt:
        assert rt.provider.reader.read_depth == rt.provider.prefetcher.read_depth == depth
        got, _ = generate(rt.model, PROMPT, max_tokens=6)
        assert 1 <= rt.provider.stats()["prefetch"]["peak_inflight_reads"] <= depth
    assert got == want
    with pytest.raises(ValueError, match="read_depth"):
        mtplx_runtime.load(art, kernels="reference", cache_slots=(2, 0), read_depth=0)


def test_checkpoint_loads_resident_and_budget_plans(artifact):
    src, art = artifact
    rt = mtplx_runtime.load(src, dtype="float32")
    assert isinstance(rt.provider, ResidentExpertProvider) and not rt.streamed
    assert rt.kernels is None and rt.plan is None
    with mtplx_runtime.load(art, dtype="float32", kernels="reference",
                            memory_budget="1GiB") as planned:
        assert planned.plan is not None and planned.plan.compute_slots > 0
        assert isinstance(planned.model.logits(PROMPT), torch.Tensor)


def test_load_errors_are_one_line_reasons(artifact, tmp_path):
    src, art = artifact
    with pytest.raises(ValueError, match="not a streaming artifact"):
        mtplx_runtime.load(src, memory_budget="1GiB")
    with pytest.raises(ValueError, match="run on streamed experts"):
        mtplx_runtime.load(src, kernels="cpu")
    with pytest.raises(PlanError):
        mtplx_runtime.load(art, memory_budget="1MiB", kernels="reference")
    with pytest.raises(ValueError, match="kernels must be one of .*got .fastest."):
        mtplx_runtime.load(art, kernels="fastest")
    (tmp_path / "config.json").write_text("{}")  # a model directory without a checkpoint
    with pytest.raises(CheckpointError) as e:
        mtplx_runtime.load(tmp_path)
    assert "tiktoken" not in str(e.value)  # the checkpoint is checked before the tokenizer


# ---- one options object for load(), the presets and the command line ------------------------

@pytest.mark.parametrize("choices, field, why", [
    ({"dtype": "float16"}, "dtype", "must be one of 'bfloat16', 'float32', got 'float16'"),
    ({"resident_dtype": "int8", "dtype": "float32"}, "resident_dtype",
     "int8 needs a bfloat16 model (dtype bfloat16), not float32"),
    ({"memory_budget": "lots"}, "memory_budget", "must be a byte size such as 24GiB"),
    ({"cache_slots": (0, 0)}, "cache_slots", "must be >= 1, got 0"),
    ({"cache_slots": (2, 1), "memory_budget": "1GiB"}, "cache_slots",
     "or memory_budget sizes the cache: give one, not both"),
    ({"context": 0}, "context", "must be >= 1, got 0"),
    ({"lookahead": True}, "lookahead", "expected an integer, got True"),
    ({"read_depth": 0}, "read_depth", "must be >= 1, got 0"),
    ({"kernels": "tpu"}, "kernels", "must be one of 'auto', 'reference', 'cpu', 'cuda'"),
    ({"cache_policy": "mru"}, "cache_policy", "must be one of 'lru', 'freq', got 'mru'"),
    ({"verify": "yes"}, "verify", "must be True or False"),
])
def test_load_options_check_every_choice_and_name_it(choices, field, why):
    from mtplx_runtime import LoadOptions
    from mtplx_runtime.engine.options import OptionError

    with pytest.raises(OptionError) as e:
        LoadOptions(**choices)
    assert e.value.field == field and why in str(e.value) and str(e.value).startswith(field)


def test_load_takes_options_or_keywords_alike(artifact):
    from mtplx_runtime import LoadOptions

    _, art = artifact
    opts = LoadOptions(dtype="float32", kernels="reference", cache_slots=(2, 0))
    outs = []
    for args, kw in (((opts,), {}), ((), dict(dtype="float32", kernels="reference",
                                              cache_slots=(2, 0))),
                     ((opts,), {"lookahead": 0})):  # keywords replace fields of the options
        with mtplx_runtime.load(art, *args, **kw) as rt:
            assert rt.provider.cache.capacity()["compute"] == 2 * len(rt.model.moe_blocks())
            assert rt.record_bytes == manifest_module.load_manifest(
                art / "expert-manifest.json").records[0].logical_bytes
            outs.append(generate(rt.model, PROMPT, max_tokens=4)[0])
    assert outs[0] == outs[1] == outs[2]
    with pytest.raises(ValueError, match="lookahead must be >= 0"):
        mtplx_runtime.load(art, opts, lookahead=-1)  # replaced fields are checked again


def test_the_cli_flags_build_the_options_and_name_the_flag(artifact, capsys):
    """A bad load flag is LoadOptions' own check, said with the flag's name; the trace header
    gets the record size from the load, not from reading the artifact again."""
    from mtplx_runtime.cli import main
    from mtplx_runtime.engine import plan
    from mtplx_runtime.engine.trace import read_trace

    _, art = artifact
    base = ["generate", str(art), "-p", "hi", "-n", "2", "--kernels", "reference"]
    for flags, msg in ((["--lookahead", "-1"], "--lookahead must be >= 0, got -1"),
                       (["--context", "0"], "--context must be >= 1, got 0"),
                       (["--memory-budget", "12 parsecs"], "--memory-budget must be a byte size"),
                       (["--device-slots", "0"], "--device-slots must be >= 1, got 0"),
                       (["--device-slots", "2", "--memory-budget", "1GiB"],
                        "--device-slots or --memory-budget sizes the cache: give one, not both"),
                       (["--resident-dtype", "int4", "--dtype", "float32"],
                        "--resident-dtype int4 needs a bfloat16 model (--dtype bfloat16)")):
        assert main([*base, *flags]) == 2
        assert f"mtplx generate: error: {msg}" in capsys.readouterr().err, flags
    trace = art.parent / "t.jsonl"
    real = plan.facts_from_dir
    try:
        plan.facts_from_dir = None  # a second read of the artifact would fail here
        assert main([*base, "--device-slots", "2", "--trace-routes", str(trace)]) == 0
    finally:
        plan.facts_from_dir = real
    header, _ = read_trace(trace)
    assert header["record_bytes"] == real(art).record_bytes
