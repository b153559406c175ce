"""Memory plan: the items add up to the budget, refusal below the minimum, items sized by the
kernel backend, a prefill chunk that leaves the minimum alone, a budget holding the bank caching
all of it, full-size K3 arithmetic against FORMAT.md "Decode state", "Geometry" and "Bank
parts", byte sizes, the CLI."""

from __future__ import annotations

import argparse
import json

import pytest
from test_config import k3_official

from mtplx_runtime.artifact.build import build_artifact
from mtplx_runtime.artifact.manifest import load_manifest
from mtplx_runtime.checkpoint import ModelConfig
from mtplx_runtime.cli import plan as plan_cli
from mtplx_runtime.engine.plan import (
    ITEMS,
    KERNEL_HEADROOM_BYTES,
    RESERVE_FRACTION,
    RUNTIME_BASELINE_BYTES,
    PlanError,
    facts_from_config,
    facts_from_dir,
    format_plan,
    kda_state_bytes,
    make_plan,
    mla_token_bytes,
    parse_bytes,
    plan_for,
    resident_bytes,
    workspace_bytes,
)
from mtplx_runtime.fixtures.k3_slice import k3_slice_config
from mtplx_runtime.fixtures.tiny import make_tiny

GiB = 2**30


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(plain t158 checkpoint, streaming artifact built from it)."""
    root = tmp_path_factory.mktemp("plan")
    make_tiny(root / "src", "t158")
    build_artifact(root / "src", root / "art", progress=False)
    return root / "src", root / "art"


@pytest.fixture(scope="module")
def k3():
    return facts_from_config(ModelConfig.from_dict(k3_official()))


def adds_up(p) -> None:
    assert list(p.items) == list(ITEMS)
    assert sum(p.items.values()) + p.compute_slots * p.record_stride + p.slack_bytes \
        == p.memory_budget
    assert p.host_slots * p.record_stride + p.host_slack_bytes == p.host_budget
    assert p.slack_bytes >= 0 and p.host_slack_bytes >= 0
    assert p.record_stride % 4096 == 0 and p.record_stride >= p.record_bytes
    assert p.compute_slots >= p.working_set_records == p.top_k
    assert p.items["prefill_pool"] == p.transient_slots * p.record_stride
    assert p.planned_peak_bytes == (sum(p.items.values()) - p.items["headroom"]
                                    + p.compute_slots * p.record_stride)


def torch_held(p) -> int:
    return sum(p.items[n] for n in ("residents", "kda_state", "mla_cache", "workspace"))


def test_tiny_artifact_adds_up(tiny):
    _, art = tiny
    m = load_manifest(art / "expert-manifest.json")
    p = make_plan(art, memory_budget="1GiB", host_budget="3MiB", prefill_chunk=1)
    adds_up(p)
    assert p.source == "manifest" and p.mode == "t158"
    assert p.record_bytes == m.records[0].logical_bytes
    assert p.routed_layers == len({r.layer for r in m.records})
    assert p.compute_slots == p.total_records == len(m.records)  # a tiny bank fits whole
    assert p.host_slots == 0 and p.host_slack_bytes == 3 * 2**20  # nothing left to cache
    assert p.cacheable_share == 1.0 and p.slots_per_layer == p.experts_per_layer
    # Residents are the manifest's stored bytes in bf16, BF16 doubled in float32, F32 kept.
    stored = {t.tensor: (t.dtype, t.length) for t in m.resident_tensors}
    facts = facts_from_dir(art)
    assert {n: (d, b) for n, d, b in facts.residents}.items() <= stored.items()
    assert p.items["residents"] == sum(b for _, _, b in facts.residents)
    assert resident_bytes(facts, "float32") == sum(2 * b if d == "BF16" else b
                                                   for _, d, b in facts.residents)
    # The reserve is the measured baseline plus a fraction of what torch allocates, never of
    # the budget: the slots are one mmap per tier and fragment nothing.
    assert p.items["reserve"] == RUNTIME_BASELINE_BYTES + int(torch_held(p) * RESERVE_FRACTION)
    assert p.items["io_buffers"] == 0  # host reads land in the slots


def test_tiny_slots_scale_with_budget(tiny):
    """Past the fixed items every record of budget is a slot: compute slots plus the prefill
    pool the packed-byte kernels take from spare slots (at most one window, and only while the
    compute tier would miss more than a window's records), the rest slack; more budget never
    gives fewer compute slots, and a tier one window short of the bank holds all it can."""
    _, art = tiny
    kw = dict(runtime_baseline=0, reserve_fraction=0, prefill_chunk=1)
    low = make_plan(art, memory_budget="1GiB", **kw)
    fixed = sum(low.items.values()) - low.items["prefill_pool"]
    total, k = low.total_records, low.top_k
    window = max(k, 4)
    last = 0
    for extra in range(k, total + 2):
        p = make_plan(art, memory_budget=fixed + extra * low.record_stride + 123, **kw)
        adds_up(p)
        assert p.compute_slots + p.transient_slots == min(extra, total)
        assert p.transient_slots == min(window, extra - k, max(0, total - extra - window))
        assert p.slack_bytes == 123 + max(0, extra - total) * p.record_stride
        assert p.compute_slots >= last
        last = p.compute_slots
        if extra >= total - window:
            assert p.compute_slots == min(extra, total)


def test_refusal_below_the_minimum(tiny):
    _, art = tiny
    p = make_plan(art, memory_budget="1GiB")
    minimum = p.minimum_budget
    at_min = make_plan(art, memory_budget=minimum)
    adds_up(at_min)
    assert at_min.compute_slots == at_min.working_set_records == at_min.top_k
    assert at_min.transient_slots == 0  # prefill windows through the decode slots
    assert minimum == sum(at_min.minimum_parts.values())
    with pytest.raises(PlanError) as e:
        make_plan(art, memory_budget=minimum - 1)
    msg = str(e.value)
    assert f"{minimum:,} B" in msg and "largest first: runtime reserve" in msg
    assert "--context" in msg and "--prefill-chunk" in msg


def test_the_prefill_chunk_adds_only_its_activations(tiny):
    """The provider runs a prefill chunk's experts in windows that fit the slots there are, so a
    chunk needs no more records than a decode step: the minimum grows by activations alone."""
    _, art = tiny
    one = make_plan(art, memory_budget="1GiB", prefill_chunk=1)
    for chunk in (4, 64, 256):
        p = make_plan(art, memory_budget="1GiB", prefill_chunk=chunk)
        grown = p.items["workspace"] - one.items["workspace"]
        assert grown > 0 and p.working_set_records == one.working_set_records == p.top_k
        assert p.minimum_budget - one.minimum_budget == grown + int(
            torch_held(p) * RESERVE_FRACTION) - int(torch_held(one) * RESERVE_FRACTION)
        make_plan(art, memory_budget=p.minimum_budget, prefill_chunk=chunk)


def test_items_follow_the_kernel_backend(tiny):
    """Only a decoding backend holds decoded experts (one prefill window of them) and always a
    prefill pool; only the GPU reader stages reads, one record per read in flight."""
    _, art = tiny
    facts = facts_from_dir(art)
    cfg = facts.cfg
    kw = dict(memory_budget="1GiB", context=64, prefill_chunk=2)
    cpu, ref, gpu = (plan_for(facts, kernels=k, **kw) for k in ("cpu", "reference", "cuda"))
    window = max(cfg.num_experts_per_token, 4)
    assert cpu.decoded_experts == gpu.decoded_experts == 0 and ref.decoded_experts == window
    assert cpu.items["workspace"] == gpu.items["workspace"] == workspace_bytes(
        cfg, "bfloat16", 2, 64, 0)
    expert = 3 * cfg.moe_intermediate_size * cfg.routed_expert_hidden_size * 2  # bf16
    assert ref.items["workspace"] - cpu.items["workspace"] == window * expert
    assert ref.minimum_parts["prefill_pool"] == window * ref.record_stride
    assert cpu.minimum_parts["prefill_pool"] == gpu.minimum_parts["prefill_pool"] == 0
    assert gpu.items["io_buffers"] == gpu.read_depth * gpu.record_stride
    assert plan_for(facts, kernels="cuda", read_depth=9, **kw).items["io_buffers"] \
        == 9 * gpu.record_stride
    assert cpu.items["io_buffers"] == ref.items["io_buffers"] == 0
    # A bank mode without native cpu kernels goes through the reference decode there.
    bf16 = facts_from_config(cfg, "bf16")
    assert plan_for(bf16, kernels="cpu", **kw).decoded_experts == window
    with pytest.raises(PlanError, match="kernels must be one of"):
        plan_for(facts, kernels="metal", **kw)


def test_k3_slice_minimum_and_a_budget_that_holds_the_bank():
    """The issue's geometry: one MoE layer of 640 real-size MXFP4 experts. The minimum is what
    a decode step holds (well under 1 GB, whatever the prefill chunk); 5 % of the experts' bytes
    plans; the minimum less its working set plus every record caches every record, and a record
    less still caches >= 99 % of them."""
    facts = facts_from_config(k3_slice_config(moe_layers=1, experts=640, top_k=16), "mxfp4")
    kw = dict(context=4096, prefill_chunk=64)
    p = plan_for(facts, memory_budget="1TiB", **kw)
    stride, total = p.record_stride, p.total_records
    assert p.minimum_budget < 0.9e9
    assert p.minimum_parts["working_set"] == 16 * stride
    assert plan_for(facts, memory_budget="1TiB", context=4096, prefill_chunk=1).minimum_budget \
        > p.minimum_budget - 2**26  # chunk 64 costs activations only (< 64 MiB)
    five = plan_for(facts, memory_budget=int(0.05 * total * stride) + p.minimum_budget
                    - 16 * stride, **kw)  # the decode slots and the prefill pool share them
    assert five.compute_slots + five.transient_slots >= int(0.05 * total) - 1
    whole = p.minimum_budget - 16 * stride + total * stride
    full = plan_for(facts, memory_budget=whole, **kw)
    assert full.compute_slots == total and full.transient_slots == 0 and full.cacheable_share == 1
    assert plan_for(facts, memory_budget=whole - stride, **kw).compute_slots >= 0.99 * total
    slots = [plan_for(facts, memory_budget=p.minimum_budget + n * stride, **kw).compute_slots
             for n in range(0, total, 7)]
    assert slots == sorted(slots)  # more budget never means fewer slots


def test_load_gives_the_provider_the_planned_pool(tiny):
    """`load` sizes every cache tier from the plan, the prefill pool included: none at the
    minimum with packed-byte kernels, one window with the reference kernels."""
    import mtplx_runtime

    _, art = tiny
    for kernels in ("cpu", "reference"):
        floor = make_plan(art, memory_budget="1GiB", context=64, prefill_chunk=64,
                          kernels=kernels).minimum_budget
        with mtplx_runtime.load(art, dtype="bfloat16", kernels=kernels, memory_budget=floor,
                                context=64, tokenizer=False) as rt:
            p, cap = rt.plan, rt.provider.cache.capacity()
            assert p.kernels == kernels and p.minimum_budget == floor
            assert (cap["compute"], cap["transient"]) == (p.compute_slots, p.transient_slots)
            assert p.transient_slots == (0 if kernels == "cpu" else 4)


def test_plain_checkpoint_matches_artifact(tiny):
    src, art = tiny
    a = make_plan(art, memory_budget="1GiB", context=64)
    b = make_plan(src, memory_budget="1GiB", context=64)
    assert b.source == "checkpoint"
    assert (a.items, a.compute_slots, a.record_bytes) == (b.items, b.compute_slots, b.record_bytes)


def test_k3_state_figures_match_spec(k3):
    cfg = k3.cfg
    assert kda_state_bytes(cfg, "bfloat16") == 449_372_160  # batch 1 ("Decode state")
    assert kda_state_bytes(cfg, "float32") == 434_110_464 + 2 * 15_261_696
    assert kda_state_bytes(cfg, "bfloat16", batch=3) == 3 * 449_372_160
    assert mla_token_bytes(cfg, "bfloat16") == 27_648  # 24 x 576 x 2
    assert k3.record_bytes == 7_741_440  # "Bank parts"
    assert resident_bytes(k3, "bfloat16") == 113_509_540_864  # trunk ("Geometry")
    f32_bytes = sum(b for _, d, b in k3.residents if d == "F32")
    assert resident_bytes(k3, "float32") == 2 * (113_509_540_864 - f32_bytes) + f32_bytes


def test_k3_refuses_8gib(k3):
    with pytest.raises(PlanError) as e:
        plan_for(k3, memory_budget="8GiB")
    msg = str(e.value)
    assert "8.00 GiB" in msg and "largest first: resident tensors 105.71 GiB" in msg
    minimum = int(msg.split("(")[1].split(" B)")[0].replace(",", ""))
    assert minimum > 113_509_540_864 + 449_372_160 + 16 * 7_741_440
    plan_for(k3, memory_budget=minimum)  # and the stated minimum plans
    with pytest.raises(PlanError):
        plan_for(k3, memory_budget=minimum - 1)


def test_k3_160gib(k3):
    p = plan_for(k3, memory_budget="160GiB", host_budget="64GiB", context=4096,
                 prefill_chunk=1)
    adds_up(p)
    assert p.items["residents"] == 113_509_540_864
    assert p.items["kda_state"] == 449_372_160
    assert p.items["mla_cache"] == 27_648 * 4096
    assert p.items["io_buffers"] == 0 and p.items["prefill_pool"] == 16 * 7_741_440
    assert p.items["reserve"] == RUNTIME_BASELINE_BYTES + int(torch_held(p) * RESERVE_FRACTION)
    assert p.items["headroom"] == KERNEL_HEADROOM_BYTES
    assert p.slack_bytes < p.record_stride
    assert p.compute_slots == (160 * GiB - sum(p.items.values())) // 7_741_440
    assert p.host_slots == 64 * GiB // 7_741_440 == 8876
    assert p.compute_slots == 6642 and p.slots_per_layer == 72
    assert p.total_records == 82_432
    ctx = plan_for(k3, memory_budget="160GiB", context=1_048_576, prefill_chunk=1)
    assert ctx.items["mla_cache"] == 28_991_029_248  # ≈ 29.0 GB ("MLA")
    auto = plan_for(k3, memory_budget="160GiB")
    adds_up(auto)
    assert auto.prefill_chunk >= 1 and 4 * auto.compute_slots >= 3 * p.compute_slots
    assert auto.minimum_chunk == 1 and auto.minimum_budget == p.minimum_budget
    gpu = plan_for(k3, memory_budget="160GiB", prefill_chunk=1, kernels="cuda")
    assert gpu.items["io_buffers"] == 16 * 7_741_440 and gpu.items["prefill_pool"] == 0
    assert gpu.items["headroom"] == 0  # no page cache in a GPU budget
    text = format_plan(p)
    for needle in ("resident tensors", "KDA state", "MLA latent cache", "I/O buffers",
                   "prefill pool", "compute-tier slots", "host-tier slots: 8876",
                   "slots per layer: device 72", "105.71 GiB", "cpu kernels",
                   "minimum budget: 112.11 GiB (120,374,351,104 B) at prefill chunk 1, largest "
                   "part first:\n  resident tensors 105.71 GiB: fixed by the model"):
        assert needle in text


@pytest.mark.parametrize("text, n", [
    ("8GiB", 8 * GiB), ("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000), ("123456", 123456),
    ("16 gib", 16 * GiB), ("2TB", 2 * 10**12), ("0.5KiB", 512), ("7B", 7), (4096, 4096),
    ("123456789012345678", 123456789012345678), ("1e3", 1000),
])
def test_parse_bytes(text, n):
    assert parse_bytes(text) == n


@pytest.mark.parametrize("text, why", [
    ("8GiX", "unknown unit"), ("", "not a byte size"), ("GiB", "not a byte size"),
    ("-1GiB", "not a byte size|>= 0"), ("1.5B", "whole number"), ("nan", "unknown unit"),
    ("1..5GiB", "not a byte size"), (True, "not a byte size"),
])
def test_parse_bytes_errors(text, why):
    with pytest.raises(PlanError, match=why):
        parse_bytes(text)


def run_cli(argv, capsys):
    parser = argparse.ArgumentParser()
    plan_cli.add_args(parser)
    rc = plan_cli.main(parser.parse_args(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli(tiny, capsys):
    _, art = tiny
    rc, out, err = run_cli(["--model", str(art), "--memory-budget", "1GiB",
                            "--host-budget", "1MiB", "--context", "128"], capsys)
    assert rc == 0 and err == ""
    assert "memory plan: t158" in out and "128 tokens" in out and "minimum budget" in out
    assert "largest part first:\n  runtime reserve" in out and "grows with --context" in out
    rc, out, _ = run_cli(["--model", str(art), "--memory-budget", "1GiB", "--kernels",
                          "reference"], capsys)
    assert rc == 0 and "reference kernels" in out and " decoded experts" in out
    rc, out, _ = run_cli(["--model", str(art), "--memory-budget", "1GiB", "--json"], capsys)
    d = json.loads(out)
    assert rc == 0 and d["memory_budget"] == GiB and set(d["items"]) == set(ITEMS)
    rc, out, err = run_cli(["--model", str(art), "--memory-budget", "100MiB"], capsys)
    assert rc == 2 and out == "" and "cannot hold the minimum working set" in err
    rc, _, err = run_cli(["--model", str(art), "--memory-budget", "lots"], capsys)
    assert rc == 2 and "unknown unit 'LOTS'" in err


def test_plan_without_a_budget_uses_memavailable_as_generate_does(tiny, monkeypatch, capsys):
    from mtplx_runtime.cli import main as cli_main
    from mtplx_runtime.engine import plan as plan_mod

    monkeypatch.setattr(plan_mod, "mem_available_bytes", lambda: 3 * 2**30)
    assert cli_main(["plan", "--model", str(tiny[1]), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["memory_budget"] == 3 * 2**30


def test_the_default_context_is_what_the_plan_affords(tiny, monkeypatch, capsys):
    """No --context: the longest power of two (4,096 .. 32,768) whose plan keeps 90 % of the
    4,096-token plan's expert slots; printed by generate; a tight budget stays at 4,096."""
    import mtplx_runtime
    from mtplx_runtime.cli import main as cli_main
    from mtplx_runtime.engine import plan as plan_mod

    facts = facts_from_dir(tiny[1])
    roomy = plan_mod.afforded_context(facts, memory_budget="8GiB")
    assert roomy == 32768  # the tiny model's state is small: the ceiling
    base = plan_for(facts, memory_budget="8GiB", context=4096)
    assert plan_for(facts, memory_budget="8GiB", context=roomy).compute_slots \
        >= 0.9 * base.compute_slots
    minimum = base.minimum_budget
    tight = plan_mod.afforded_context(facts, memory_budget=minimum + 2**20)
    assert tight == 4096
    with mtplx_runtime.load(tiny[1], dtype="float32", kernels="reference",
                            memory_budget="8GiB", tokenizer=False) as rt:
        assert rt.context == 32768 and rt.plan.context == 32768
    assert cli_main(["generate", str(tiny[1]), "--prompt", "hi", "--max-tokens", "1",
                     "--dtype", "float32", "--memory-budget", "8GiB",
                     "--kernels", "reference"]) == 0
    assert "mtplx: context 32,768 tokens: the longest this memory plan affords" in \
        capsys.readouterr().err


def test_an_afforded_context_gives_up_no_record_of_a_whole_bank():
    """A budget whose 4,096-token plan caches every record keeps them all: the context grows
    only into bytes the cache cannot use; with 99 % cached it stops before the misses grow by
    more than 1 / 0.9 (the K3-geometry MXFP4 slice of bench_peers)."""
    from mtplx_runtime.engine import plan as plan_mod
    from mtplx_runtime.fixtures.k3_slice import k3_slice_config

    facts = facts_from_config(k3_slice_config(moe_layers=1), "mxfp4")
    base = plan_for(facts, memory_budget="1TiB", context=4096)
    whole = base.fixed_bytes + base.total_records * base.record_stride
    assert plan_for(facts, memory_budget=whole, context=4096).compute_slots == 896
    ctx = plan_mod.afforded_context(facts, memory_budget=whole)
    assert plan_for(facts, memory_budget=whole, context=ctx).compute_slots == 896
    assert plan_for(facts, memory_budget=whole, context=2 * ctx).compute_slots < 896
    roomy = whole + 64 * 2**20  # bytes no record can use: the context grows into them
    ctx = plan_mod.afforded_context(facts, memory_budget=roomy)
    assert ctx > 4096 and plan_for(facts, memory_budget=roomy, context=ctx).compute_slots == 896
    # 99 %: 8 records short of the bank at 4,096; a longer context may leave 8 / 0.9 uncached
    near = whole - 8 * base.record_stride
    ctx = plan_mod.afforded_context(facts, memory_budget=near)
    assert 896 - plan_for(facts, memory_budget=near, context=ctx).compute_slots <= 8 / 0.9
    assert ctx < plan_mod.CONTEXT_CEILING


# ---- sizing a machine before the download (config.json alone) --------------------------------

def _config_only(src, dst, *, index: bool = True):
    """A directory with `src`'s config.json (and its index), none of its shards."""
    import shutil

    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    if index:
        shutil.copy(src / "model.safetensors.index.json", dst / "model.safetensors.index.json")
    return dst


def test_a_plan_needs_no_shard(tiny, tmp_path):
    """config.json + the index plan exactly as the whole checkpoint and its artifact do, and the
    artifact's NVMe bytes are the built artifact's: every bank part, every resident tensor."""
    from mtplx_runtime.engine.plan import artifact_size

    src, art = tiny
    bare = _config_only(src, tmp_path / "bare")
    kw = dict(memory_budget="1GiB", context=64)
    full, built, planned = (make_plan(d, **kw) for d in (src, art, bare))
    assert (planned.items, planned.compute_slots) == (full.items, full.compute_slots) == \
        (built.items, built.compute_slots)
    m = load_manifest(art / "expert-manifest.json")
    size = artifact_size(facts_from_dir(bare))
    assert size.bank_bytes == sum(p.size for p in m.sidecar.parts)
    assert size.bank_bytes == sum((art / p.file).stat().st_size for p in m.sidecar.parts)
    assert size.resident_bytes == m.artifact["resident_tensor_bytes"]
    # Without the index the config cannot tell t158 from bf16 (no quantization_config): said,
    # with the two ways out; --bank-codec t158 plans a t158 build from the config alone.
    alone = _config_only(src, tmp_path / "alone", index=False)
    with pytest.raises(PlanError, match="put model.safetensors.index.json beside it, or pass "
                                        "--bank-codec t158"):
        facts_from_dir(alone)
    assert facts_from_dir(alone, bank_codec="t158").record_bytes == planned.record_bytes


def test_k3_sizes_from_its_config_alone(tmp_path, capsys):
    """The published K3 config.json alone (MXFP4 by its quantization_config): the plan, the
    artifact's 1.56 TB (82,432 records of 17,547,264 B + 113.5 GB of residents), 0.75 TB as a
    t158 build; the estimate states its inputs."""
    from mtplx_runtime.cli import main as cli_main

    (tmp_path / "k3").mkdir()
    (tmp_path / "k3" / "config.json").write_text(json.dumps(k3_official()))
    argv = ["plan", str(tmp_path / "k3"), "--memory-budget", "256GiB", "--kernels", "cpu"]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert "memory plan: mxfp4 records of 17,547,264 B from config, 92 routed layers" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("artifact on NVMe: "))
    assert line == ("artifact on NVMe: 1,560.0 GB = bank parts 1,446.5 GB (82,432 records in "
                    "17,547,264-B slots) + resident shards 113.5 GB (bf16)")
    est = out[out.index("decode estimate (not a measurement): "):]
    for needle in ("1,472 records/token x 17,547,264 B at 7 GB/s (default: a PCIe 4.0 NVMe",
                   "routes like synth:k3's through LRU", "(uniform routes)",
                   "ms per expert (bench_kernels, cpu kernels, 2 threads)",
                   "read per token at 11.5-19.1 GB/s (bench_model, torch bf16, 2 threads)"):
        assert needle in est, needle
    assert cli_main([*argv, "--bank-codec", "t158", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["mode"] == "t158" and d["artifact"]["bank_bytes"] == 82_432 * 7_741_440
    assert d["artifact"]["total_bytes"] == 82_432 * 7_741_440 + 113_509_540_864
    low, high = d["estimate"]["tok_s"]
    assert 0 < low <= high < 100


def test_k3_on_one_h200_is_projected_as_an_estimate(tmp_path, capsys):
    """`mtplx plan --kernels cuda` for K3 on an H200's memory: tok/s with every expert cached
    and at the K3-like hit rate, for bf16 and int4 residents, each labelled an estimate with its
    measured and expected ends."""
    from mtplx_runtime.cli import main as cli_main

    (tmp_path / "k3").mkdir()
    (tmp_path / "k3" / "config.json").write_text(json.dumps(k3_official()))
    for rd in ("bf16", "int4"):
        assert cli_main(["plan", str(tmp_path / "k3"), "--memory-budget", "139GiB", "--kernels",
                         "cuda", "--bank-codec", "t158", "--resident-dtype", rd]) == 0
        est = capsys.readouterr().out.split("decode estimate (not a measurement): ")[1]
        for needle in ("ms per expert (one H200: 70 % of its copy rate, expected - its first "
                       "run, measured)", f"(one H200, {rd}: its first run, measured - the goal",
                       "host work the GPU waits for: 0.2-5.4 ms per layer x 93 layers",
                       "every expert cached: ", "hit rate (K3-like routes): ",
                       "the GPU's slow end is its first run, its fast end the goal, expected"):
            assert needle in est, needle


def test_the_estimate_follows_its_inputs(k3):
    """More drive rate never gives fewer tok/s; a cache of every expert reads nothing; the
    cuda kernels add the host's time per layer to their compute, and more cache hits never
    give fewer tok/s; K3-like routes miss less than uniform ones at a partial cache."""
    from mtplx_runtime.profile.estimate import estimate_decode

    p = plan_for(k3, memory_budget="160GiB", context=4096, prefill_chunk=1)
    slow, fast = (estimate_decode(p, k3, g) for g in (2.0, 14.0))
    assert slow.tok_s[0] <= fast.tok_s[0] and slow.tok_s[1] <= fast.tok_s[1]
    assert 0 < fast.miss_k3like < fast.miss_uniform < 1
    assert fast.io_s[1] == pytest.approx(
        fast.miss_uniform * 1472 * 7_741_440 / 14e9)
    gpu = estimate_decode(plan_for(k3, memory_budget="160GiB", kernels="cuda"), k3, 7.0)
    assert gpu.host_s == pytest.approx((93 * 0.2e-3, 93 * 5.4e-3))
    assert gpu.compute_s == pytest.approx(tuple(
        e + r + h for e, r, h in zip(gpu.expert_s, gpu.resident_s, gpu.host_s)))
    cached, partial = gpu.tok_s_at(0.0), gpu.tok_s_at(gpu.miss_k3like)
    assert gpu.tok_s[1] == pytest.approx(partial[1])  # the high end: K3-like routes
    assert cached == pytest.approx((1 / gpu.compute_s[1], 1 / gpu.compute_s[0]))
    assert partial[0] < cached[0] and partial[1] <= cached[1]
    whole = plan_for(k3, memory_budget="1TiB", resident_dtype="int4")
    e = estimate_decode(whole, k3, 7.0)
    assert whole.cacheable_share == 1 and e.io_s == (0.0, 0.0) and e.miss_k3like == 0
    assert e.tok_s[1] == pytest.approx(1 / e.compute_s[0])


def test_plan_defaults_its_context_as_generate_does_and_plans_without_a_compile(tiny, capsys,
                                                                            monkeypatch):
    """No --context: the context generate and serve would pick at this budget, said; kernels
    auto: the backend generate would pick, found without compiling it."""
    from mtplx_runtime.cli import main as cli_main
    from mtplx_runtime.engine import plan as plan_mod
    from mtplx_runtime.kernels import cpu_build

    def no_compile(*a, **kw):
        raise AssertionError("mtplx plan compiled the kernels")

    monkeypatch.setattr(cpu_build, "build", no_compile)
    monkeypatch.delenv("MTPLX_KERNELS", raising=False)
    _, art = tiny
    assert cli_main(["plan", str(art), "--memory-budget", "8GiB"]) == 0
    out = capsys.readouterr().out
    from mtplx_runtime.cli.plan import planned_backend

    kernels = planned_backend()  # cpu where a C compiler is, as select_backend("auto") picks
    want = plan_mod.afforded_context(facts_from_dir(art), memory_budget="8GiB", kernels=kernels)
    assert out.startswith(f"context {want:,} tokens: the longest this plan affords")
    assert f"{want} tokens x batch 1" in out and f"{kernels} kernels" in out.splitlines()[1]


def test_measure_disk_reads_a_scratch_file_and_leaves_nothing(tiny, tmp_path, capsys):
    from mtplx_runtime.cli import main as cli_main
    from mtplx_runtime.profile.estimate import measure_disk

    nbytes, secs = measure_disk(tmp_path, 24_576, total_bytes=2 << 20, depth=4)
    assert nbytes == (2 << 20) // 24_576 * 24_576 and secs > 0
    assert list(tmp_path.iterdir()) == []
    _, art = tiny
    assert cli_main(["plan", str(art), "--memory-budget", "1GiB", "--measure-disk",
                     str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert f"measuring the drive under {tmp_path}" in err
    assert f"(measured under {tmp_path}: " in out and list(tmp_path.iterdir()) == []
    assert cli_main(["plan", str(art), "--measure-disk", str(tmp_path / "no")]) == 2
    assert "no such directory" in capsys.readouterr().err


def test_plan_help_has_examples(capsys):
    from mtplx_runtime.cli import main as cli_main

    with pytest.raises(SystemExit):
        cli_main(["plan", "--help"])
    out = capsys.readouterr().out
    assert "examples:\n  mtplx plan " in out and "--memory-budget 256GiB    config.json" in out
