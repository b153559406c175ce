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
    with pytest.raises(ValueError, match="unknown kernel backend"):
        mtplx_runtime.load(art, kernels="fastest")
    (tmp_path / "config.json").write_text("{}")  # a model directory without a checkpoint
    with pytest.raises(CheckpointError) as e:
        mtplx_runtime.load(tmp_path)
    assert "tiktoken" not in str(e.value)  # the checkpoint is checked before the tokenizer
