"""Warm start (offload/warm.py): the use counts a run leaves, the cache they fill at the next load,
and files that must only ever cost a cold start. All on the tiny t158 artifact under the
reference kernels, where streamed output is bit-identical to the resident model's."""

from __future__ import annotations

import logging
import os
import re

import numpy as np
import pytest
import torch

import mtplx_runtime
from mtplx_runtime.artifact.build import build_artifact
from mtplx_runtime.artifact.integrity import receipt_path
from mtplx_runtime.artifact.manifest import MANIFEST_NAME, load_manifest
from mtplx_runtime.cli import SUBCOMMANDS
from mtplx_runtime.cli import main as cli_main
from mtplx_runtime.engine import generate as generate_module
from mtplx_runtime.engine.generate import generate
from mtplx_runtime.fixtures.tiny import make_tiny
from mtplx_runtime.offload import warm as warm_module
from mtplx_runtime.offload.prefetch import PrefetchError
from mtplx_runtime.offload.warm import DECAY, read_counts, write_counts

PROMPT = [5, 6, 7, 8]
TOKENS = 6


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    root = tmp_path_factory.mktemp("warm")
    src, out = root / "t158", root / "t158-art"
    make_tiny(src, "t158")
    build_artifact(src, out, codec="keep", progress=False)
    return src, out


@pytest.fixture(scope="module")
def manifest(art):
    return load_manifest(art[1] / MANIFEST_NAME)


@pytest.fixture(scope="module")
def want(art):
    ids, _ = generate(mtplx_runtime.load_model(art[0], dtype="float32"), PROMPT,
                      max_tokens=TOKENS)
    return ids


def _load(art, warm, slots=2):
    # Lookahead off: its guesses land or not depending on thread timing, and these tests count
    # misses exactly.
    return mtplx_runtime.load(art, dtype="float32", kernels="reference", cache_slots=(slots, 0),
                              warm=warm, lookahead=0)


def _cached(rt) -> set[tuple[int, int]]:
    """Keys in the compute tier, ready."""
    cache = rt.provider.cache
    out = set()
    for r in rt.provider.manifest.records:
        ref = cache.where((r.layer, r.expert))
        if ref is not None and ref.tier == "compute" and not cache.is_loading(ref.key):
            out.add(ref.key)
    return out


def _counts_for(manifest, hot: dict[int, list[int]]) -> np.ndarray:
    """Counts that make `hot[layer]` that layer's experts, hottest first; 0 elsewhere."""
    counts = np.zeros(len(manifest.records))
    for i, r in enumerate(manifest.records):
        order = hot.get(r.layer, [])
        if r.expert in order:
            counts[i] = 100.0 - order.index(r.expert)
    return counts


def test_warm_start_fills_the_cache_with_the_hottest_records_in_file_order(art, manifest,
                                                                           tmp_path, monkeypatch):
    _, root = art
    monkeypatch.setattr(warm_module, "PROGRESS_EVERY_S", 0.0)  # every warm is "long" here
    lines: list[str] = []
    layers = sorted({r.layer for r in manifest.records})
    hot = {la: [(3 * la + 5) % 8, (la + 1) % 8 if (la + 1) % 8 != (3 * la + 5) % 8 else 0, 7]
           for la in layers}
    path = tmp_path / "hot.warm"
    assert write_counts(path, manifest, _counts_for(manifest, hot))
    with mtplx_runtime.load(root, dtype="float32", kernels="reference", cache_slots=(2, 0),
                            warm=path, warm_progress=lines.append) as rt:
        w = rt.provider.warm
        plan = w.planned
        locs = [rt.provider.bank.locate(*k)[:2] for k in plan]
        assert locs == sorted(locs)  # one pass through each part, in offset order
        assert w.wait(60)
        st = rt.provider.stats()
        # Two slots per layer: each layer's two hottest, nothing else.
        assert _cached(rt) == {(la, e) for la in layers for e in hot[la][:2]}
        assert st["warm"]["records"] == st["warm"]["planned"] == 2 * len(layers)
        assert st["warm"]["bytes"] == sum(rt.provider.bank.locate(*k).length for k in plan)
        assert st["warm"]["failed"] == 0 and st["warm"]["found"]
        # Read like any miss: through the prefetcher and the reader's check.
        assert st["checks"]["sha256"] + st["checks"]["xxh3"] == 2 * len(layers)
        assert st["totals"]["compute"]["lookups"] == 0  # warming is not a cache lookup
        assert st["totals"]["compute"]["bytes_read"] == st["warm"]["bytes"]  # counted once
        n = len(plan)
        assert lines and lines[-1].startswith(f"mtplx: warm start {n}/{n} records (")


def test_output_is_identical_with_and_without_warm_and_warm_saves_misses(art, want, tmp_path):
    _, root = art
    path = tmp_path / "run.warm"
    got, misses = {}, {}
    for name, warm in (("cold", "off"), ("first", path), ("warm", path)):
        with _load(root, warm, slots=8) as rt:  # slots for every expert: all warm
            if warm != "off" and rt.provider.warm is not None:
                assert rt.provider.warm.wait(60)
            got[name], _ = generate(rt.model, PROMPT, max_tokens=TOKENS)
            misses[name] = rt.provider.stats()["totals"]["compute"]["misses"]
        assert path.exists() == (name != "cold")
    assert got["cold"] == got["first"] == got["warm"] == want
    assert misses["first"] == misses["cold"] > 0
    assert misses["warm"] == 0  # every decode expert was in the cache from the first token


def test_counts_are_every_pick_and_merge_with_decay(art, manifest, tmp_path):
    _, root = art
    path = tmp_path / "merge.warm"
    with _load(root, path) as rt:
        assert not rt.provider.warm.stats()["found"]
        ids, _ = generate(rt.model, PROMPT, max_tokens=TOKENS)
        k = rt.model.cfg.num_experts_per_token
        moe_layers = len({r.layer for r in manifest.records})
    first = read_counts(path, manifest)
    # prompt tokens + every generated token but the last go through each MoE layer's router
    assert first.sum() == (len(PROMPT) + len(ids) - 1) * k * moe_layers
    with _load(root, path) as rt:
        assert rt.provider.warm.stats()["found"]
        generate(rt.model, PROMPT, max_tokens=TOKENS)  # the same run again
    np.testing.assert_array_equal(read_counts(path, manifest), first * DECAY + first)
    with _load(root, path) as rt:
        pass  # a run that used no expert leaves the file as it was
    np.testing.assert_array_equal(read_counts(path, manifest), first * DECAY + first)


def _hostile(path, manifest, kind):
    good = _counts_for(manifest, {r.layer: [1, 2] for r in manifest.records})
    write_counts(path, manifest, good)
    data = bytearray(path.read_bytes())
    if kind == "garbage":
        path.write_bytes(os.urandom(len(data)))
    elif kind == "truncated":
        path.write_bytes(bytes(data[:-5]))
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "version":
        data[8:12] = (2).to_bytes(4, "little")
        path.write_bytes(bytes(data))
    elif kind == "other-artifact":
        data[16] ^= 0xFF
        path.write_bytes(bytes(data))
    elif kind == "count":
        data[48:56] = (len(manifest.records) + 1).to_bytes(8, "little")
        path.write_bytes(bytes(data) + bytes(8))
    elif kind in ("nan", "negative"):
        v = np.float64("nan" if kind == "nan" else -1.0).tobytes()
        data[warm_module.HEADER_BYTES:warm_module.HEADER_BYTES + 8] = v
        path.write_bytes(bytes(data))
    elif kind == "oversize":
        path.write_bytes(bytes(data) + bytes(1 << 20))
    elif kind == "symlink":
        real = path.with_name("real.warm")
        path.rename(real)
        path.symlink_to(real)
    elif kind == "directory":
        path.unlink()
        path.mkdir()
    elif kind == "fifo":
        path.unlink()
        os.mkfifo(path)


HOSTILE = ["garbage", "truncated", "empty", "version", "other-artifact", "count", "nan",
           "negative", "oversize", "symlink", "directory", "fifo"]


@pytest.mark.parametrize("kind", HOSTILE)
def test_a_hostile_or_stale_file_is_a_warning_and_a_cold_start(art, manifest, tmp_path, kind,
                                                              caplog):
    path = tmp_path / "bad.warm"
    _hostile(path, manifest, kind)
    with caplog.at_level(logging.WARNING, logger="mtplx_runtime.offload.warm"):
        assert read_counts(path, manifest) is None
    assert "ignoring the warm-start file" in caplog.text and "starting cold" in caplog.text
    if kind == "other-artifact":
        assert "another artifact" in caplog.text


@pytest.mark.parametrize("kind", ["garbage", "other-artifact", "nan"])
def test_a_run_over_a_hostile_file_gives_the_same_tokens_and_replaces_it(art, manifest, want,
                                                                         tmp_path, kind):
    _, root = art
    path = tmp_path / "bad.warm"
    _hostile(path, manifest, kind)
    with _load(root, path) as rt:
        st = rt.provider.warm.stats()
        assert not st["found"] and st["planned"] == 0 and rt.provider.warm.wait(0)
        got, _ = generate(rt.model, PROMPT, max_tokens=TOKENS)
    assert got == want
    assert read_counts(path, manifest) is not None  # this run's counts, for the next


def test_an_unwritable_place_is_a_warning_not_an_error(art, want, tmp_path, caplog):
    _, root = art
    path = tmp_path / "missing-parent-is-a-file" / "x.warm"
    path.parent.write_text("a file, not a directory")
    with caplog.at_level(logging.WARNING, logger="mtplx_runtime.offload.warm"):
        with _load(root, path) as rt:
            got, _ = generate(rt.model, PROMPT, max_tokens=TOKENS)
    assert got == want and "cannot write the warm-start file" in caplog.text


# ---- the CLI --------------------------------------------------------------------------------

@pytest.fixture
def cli(monkeypatch):
    monkeypatch.setitem(SUBCOMMANDS, "generate", ("mtplx_runtime.cli.generate", "generate"))
    return cli_main


def _flags(root):
    return ["generate", "--model", str(root), "--prompt", "warm start", "--dtype", "float32",
            "--max-tokens", "4", "--kernels", "reference", "--device-slots", "8"]


def test_cli_warm_auto_writes_beside_the_receipts_and_off_writes_nothing(cli, tmp_path,
                                                                         capsys):
    root = tmp_path / "art"
    make_tiny(tmp_path / "src", "t158")
    build_artifact(tmp_path / "src", root, codec="keep", progress=False)
    manifest = load_manifest(root / MANIFEST_NAME)
    auto = receipt_path(root, manifest, ".warm")
    assert cli([*_flags(root), "--warm", "off"]) == 0
    off_out, err = capsys.readouterr()
    assert not auto.exists() and "warm" not in err
    assert cli(_flags(root)) == 0  # --warm auto is the default
    out, err = capsys.readouterr()
    assert auto.exists() and "warm" not in err and out == off_out  # nothing to warm yet
    assert cli(_flags(root)) == 0
    out, err = capsys.readouterr()
    # 8 slots per layer hold every record: all of them planned. How many land before this
    # 4-token run ends depends on the clock (the warm waits for the prompt's prefill).
    n = len(manifest.records)
    assert re.search(rf"warm \d+/{n} records", err) and out == off_out

    # --warm-wait: the whole warm before the prompt, so every planned record lands
    assert cli([*_flags(root), "--warm-wait"]) == 0
    out, err = capsys.readouterr()
    assert f"warm start done before the prompt: {n} records" in err
    assert f"warm {n}/{n} records" in err and out == off_out


def test_ctrl_c_still_writes_the_counts(cli, art, manifest, tmp_path, monkeypatch, capsys):
    _, root = art
    path = tmp_path / "interrupted.warm"
    real = generate_module.generate_step

    def interrupted(*args, **kwargs):
        for i, t in enumerate(real(*args, **kwargs)):
            if i == 2:
                raise KeyboardInterrupt
            yield t

    monkeypatch.setattr(generate_module, "generate_step", interrupted)
    assert cli([*_flags(root), "--warm", str(path)]) == 130
    assert "interrupted" in capsys.readouterr().err
    counts = read_counts(path, manifest)
    assert counts is not None and counts.sum() > 0


def test_a_record_in_a_transient_slot_is_not_counted_as_warm(art, manifest, tmp_path):
    """A prefill's transient slot is no decode slot: the warm tries that record again after the
    others and, when it is still transient, reports it skipped instead of warmed."""
    from mtplx_runtime.offload.warm import WarmStart

    _, root = art
    layer = manifest.records[0].layer
    path = tmp_path / "t.warm"
    assert write_counts(path, manifest, _counts_for(manifest, {layer: [4, 6]}))
    with _load(root, "off") as rt:
        cache = rt.provider.cache
        ref = cache.reserve((layer, 4), transient=True)  # as a prefill window would
        cache.commit((layer, 4))
        w = WarmStart(rt.provider.manifest, path)
        rt.provider.start_warm(w)
        assert w.wait(60)
        st = w.stats()
        assert cache.where((layer, 4)) == ref  # left where the prefill put it
        assert cache.where((layer, 6)).tier == "compute"
        assert st["skipped"] == 1 and st["records"] == st["planned"] - 1


def test_the_warm_reads_nothing_while_a_prefill_runs(art, manifest, tmp_path):
    """While a prompt's forward runs its MoE layers the warm issues no read; once its last MoE
    layer is computed, or a one-token forward begins, it warms everything it planned, with no
    thread of its own. A prompt forward that fails releases the hold too."""
    import threading

    from mtplx_runtime.offload.warm import WarmStart

    _, root = art
    layer = manifest.records[0].layer
    path = tmp_path / "t.warm"
    assert write_counts(path, manifest, _counts_for(manifest, {layer: [4, 6]}))
    threads = threading.active_count()
    with _load(root, "off") as rt:
        p = rt.provider
        p.begin_forward(3)  # a prompt that has not reached its first MoE layer yet
        w = WarmStart(p.manifest, path)
        p.start_warm(w)
        assert not w.wait(0.5)
        assert w.stats()["records"] == 0 and p.prefetcher.stats.demand_reads == 0
        assert threading.active_count() == threads  # the warm started no thread
        p.begin_forward(1)  # a decode step releases it
        assert w.wait(60) and w.stats()["records"] == w.stats()["planned"] >= 2

    with _load(root, "off") as rt:
        p = rt.provider
        held: list[bool] = []
        run_experts = p.run_experts

        def spy(layer, x, *a):
            if x.shape[0] > 1:
                held.append(p.prefetcher.prompt_held)
            return run_experts(layer, x, *a)

        p.run_experts = spy
        gen = generate_module.generate_step(rt.model, PROMPT, max_tokens=2)
        next(gen)  # the prompt's forward: held in every MoE layer, released after the last
        assert held == [True] * len(rt.model.cfg.moe_layers)
        assert not p.prefetcher.prompt_held
        p.begin_forward(3)
        assert p.prefetcher.prompt_held
        next(gen)  # one decode forward
        assert not p.prefetcher.prompt_held
        p.begin_forward(3)
        ids = torch.zeros(3, rt.model.cfg.num_experts_per_token, dtype=torch.long)
        x = torch.zeros(3, rt.model.cfg.routed_expert_hidden_size)
        p.prefetcher.fill.reader.close()  # its reads now fail: the prompt forward fails
        with pytest.raises(PrefetchError, match="RecordReader is closed"):
            p.run_experts(rt.model.cfg.moe_layers[0], x, ids, torch.ones(3, ids.shape[1]))
        assert not p.prefetcher.prompt_held
