"""Streaming artifact builder: every fixture codec round-trips through a bank, t158 records are
copied byte for byte, resume after ENOSPC / corruption / Ctrl-C, extending a finished artifact,
header mismatch, layouts, progress, CLI."""

from __future__ import annotations

import argparse
import dataclasses
import errno
import fnmatch
import hashlib
import io
import itertools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from mtplx_runtime import cli as mtplx_cli
from mtplx_runtime.artifact import part as bank
from mtplx_runtime.artifact.build import (
    ExpertSource,
    Progress,
    build_artifact,
    format_layers,
    parse_layers,
)
from mtplx_runtime.artifact.journal import BuildError, canonical_line, parse_journal
from mtplx_runtime.artifact.manifest import load_manifest
from mtplx_runtime.artifact.open import open_source
from mtplx_runtime.artifact.verify import verify_artifact
from mtplx_runtime.cli import build_manifest as builder_cli
from mtplx_runtime.fixtures.tiny import make_tiny, tiny_config
from mtplx_runtime.formats import FormatError
from mtplx_runtime.formats.modes import mode_codec
from mtplx_runtime.formats.record import PAD, part_name, record_layout, record_parts
from mtplx_runtime.formats.t158 import encode_t158

SOURCES = {
    "t158": dict(codec="t158"),
    "mxfp4": dict(codec="mxfp4"),
    "bf16": dict(codec="bf16"),
    "w3-legacy-sym": dict(codec="w3", w3_layout="legacy", w3_symmetric=True),
    "w3-legacy-asym": dict(codec="w3", w3_layout="legacy", w3_symmetric=False),
    "w3-dense-sym": dict(codec="w3", w3_layout="dense", w3_symmetric=True),
    "w3-dense-asym": dict(codec="w3", w3_layout="dense", w3_symmetric=False),
    "w3-legacy-asym-g32": dict(codec="w3", w3_layout="legacy", w3_symmetric=False, w3_group=32),
}
MODES = {"t158": "t158", "mxfp4": "mxfp4", "bf16": "bf16", "w3-legacy-sym": "ct-int",
         "w3-legacy-asym": "ct-int-asym", "w3-dense-sym": "ct-int", "w3-dense-asym": "ct-int-asym",
         "w3-legacy-asym-g32": "ct-int-asym"}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("src")
    return {k: make_tiny(root / k, **kw).path for k, kw in SOURCES.items()}


def snapshot(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.is_file()}


def read_record(root: Path, rec) -> tuple[bytes, dict[str, bytes]]:
    """Whole record bytes and `{component: bytes}` via the manifest's segments."""
    segs = {}
    with open(root / rec.segments[0].shard, "rb") as f:
        f.seek(rec.segments[0].offset)
        whole = f.read(rec.logical_bytes)
    base = rec.segments[0].offset
    for s in rec.segments:
        segs.setdefault(s.component, b"")
        segs[s.component] += whole[s.offset - base:s.offset - base + s.length]
    return whole, segs


def decode_bank(root: Path, cfg, m, layer: int, expert: int) -> dict[str, np.ndarray]:
    (rec,) = [r for r in m.records if (r.layer, r.expert) == (layer, expert)]
    whole, _ = read_record(root, rec)
    q = m.quantization
    ct = q["mode"].startswith("ct-int")
    layout = record_layout(cfg, q["mode"], q["bits"] if ct else None,
                           q["group_size"] if ct else None)
    parts = record_parts(layout, whole)
    codec = mode_codec(layout.mode, layout.bits, layout.group_size)
    return {p: codec.decode(parts[p], cfg.expert_shapes[p]) for p in parts}


@pytest.mark.parametrize("name", list(SOURCES))
def test_keep_round_trips_every_codec(sources, tmp_path, name):
    out = tmp_path / "art"
    report = build_artifact(sources[name], out, progress=False)
    assert report.mode == MODES[name] and report.written == report.records == 5 * 8
    m = load_manifest(out / "expert-manifest.json")
    assert m.quantization["mode"] == MODES[name]
    if "w3" in name:  # ct-int banks keep the source's group size
        assert m.quantization["group_size"] == SOURCES[name].get("w3_group", 64)
    with open_source(sources[name]) as ckpt:
        cfg = ckpt.config
        for layer, expert in [(1, 0), (3, 5), (5, 7)]:
            want = ckpt.expert(layer, expert).decode()
            got = decode_bank(out, cfg, m, layer, expert)
            for p in want:
                np.testing.assert_array_equal(got[p], want[p])
    for rec in m.records:  # every record and component 4 KiB aligned; pads are zeros
        assert rec.sidecar_offset % 4096 == 0 and rec.logical_bytes % 4096 == 0
        for s in rec.segments:
            assert (s.component == PAD) or (s.offset - rec.segments[0].offset) % 4096 == 0
    whole, segs = read_record(out, m.records[3])
    assert set(segs.get(PAD, b"")) <= {0}
    names = sorted(p.name for p in out.iterdir())
    assert part_name(MODES[name], 1, 5) in names and "resident-00001-of-00001.safetensors" in names
    assert not [n for n in names if n.endswith(".partial")]
    rep = verify_artifact(out, records=True, shard_hashes=True)  # the MANIFEST helper's check
    assert rep.problems == [] and rep.records_checked == 40


def test_t158_source_records_are_byte_identical(sources, tmp_path):
    out = tmp_path / "art"
    build_artifact(sources["t158"], out, progress=False)
    m = load_manifest(out / "expert-manifest.json")
    with open_source(sources["t158"]) as ckpt:
        for rec in m.records:
            src = ckpt.expert(rec.layer, rec.expert)
            _, segs = read_record(out, rec)
            for proj, pname in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
                for comp, arr in src.projections[proj].parts.items():
                    assert segs[f"{pname}.{comp}"] == arr.tobytes()
        # Resident tensors are copied byte for byte.
        for t in m.resident_tensors[:20]:
            with open(out / t.shard, "rb") as f:
                f.seek(t.offset)
                assert f.read(t.length) == ckpt.tensor(t.tensor).tobytes()


def test_codec_t158_reencodes(sources, tmp_path):
    out = tmp_path / "art"
    build_artifact(sources["mxfp4"], out, codec="t158", layers="2-3", progress=False)
    m = load_manifest(out / "expert-manifest.json")
    assert {r.layer for r in m.records} == {2, 3} and m.quantization["mode"] == "t158"
    with open_source(sources["mxfp4"]) as ckpt:
        cfg = ckpt.config
        for layer, expert in [(2, 1), (3, 6)]:
            src = ckpt.expert(layer, expert).decode()
            got = decode_bank(out, cfg, m, layer, expert)
            t158 = mode_codec("t158")
            for p, w in src.items():
                packed, scales = encode_t158(w)
                want = t158.decode({"packed": packed, "scales": scales}, w.shape)
                np.testing.assert_array_equal(got[p], want)
    # A --layers artifact holds a subset of the routed layers, each complete: it verifies.
    report = verify_artifact(out, records=True, shard_hashes=True)
    assert report.ok, report.problems


def test_install_removes_a_spare_partial_link(tmp_path):
    """A kill between link and unlink leaves `X.partial` as a second link to `X`; the resumed
    build must end with the same directory as an uninterrupted one."""
    from mtplx_runtime.artifact.outputs import install_bytes

    final = tmp_path / "config.json"
    install_bytes(final, b"{}")
    os.link(final, tmp_path / "config.json.partial")
    assert install_bytes(final, b"{}") == (2, hashlib.sha256(b"{}").hexdigest())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


def test_gguf_source_converts_to_t158(tmp_path):
    pytest.importorskip("gguf")
    from mtplx_runtime.checkpoint.gguf_source import open_gguf_source
    from mtplx_runtime.fixtures.tiny_gguf import make_tiny_gguf

    src = make_tiny_gguf(tmp_path / "gguf").path
    out = tmp_path / "art"
    report = build_artifact(src, out, layers="1", progress=False)
    assert report.mode == "t158"
    m = load_manifest(out / "expert-manifest.json")
    with open_gguf_source(src) as g:
        w = g.expert(1, 4).decode()
        got = decode_bank(out, g.config, m, 1, 4)
        for p in w:
            packed, scales = encode_t158(w[p])
            want = mode_codec("t158").decode({"packed": packed, "scales": scales}, w[p].shape)
            np.testing.assert_array_equal(got[p], want)


def test_jobs_and_rerun_give_identical_artifact(sources, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    build_artifact(sources["mxfp4"], a, progress=False)
    build_artifact(sources["mxfp4"], b, jobs=3, progress=False)
    assert snapshot(a) == snapshot(b)
    again = build_artifact(sources["mxfp4"], a, progress=False)  # finished: nothing to do
    assert again.notes == ["already complete"] and snapshot(a) == snapshot(b)


def _enospc_after(monkeypatch, n: int) -> None:
    real, calls = bank.write_all, {"n": 0}

    def write_all(fd, data, offset=None):
        calls["n"] += 1
        if calls["n"] > n:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, data, offset)

    monkeypatch.setattr(bank, "write_all", write_all)


def test_enospc_leaves_a_resumable_build(sources, tmp_path, monkeypatch):
    ref, out = tmp_path / "ref", tmp_path / "out"
    build_artifact(sources["mxfp4"], ref, progress=False)
    # header + (record, journal line) x 5, then the 6th record write fails
    _enospc_after(monkeypatch, 11)
    with pytest.raises(BuildError, match="no space left on device.*rerun the same command"):
        build_artifact(sources["mxfp4"], out, progress=False)
    assert not (out / "expert-manifest.json").exists()
    part = out / part_name("mxfp4", 1, 5)
    assert (out / (part.name + ".partial")).exists()
    assert len(parse_journal(Path(str(part) + ".journal.jsonl"), 8).records) == 5
    monkeypatch.undo()
    report = build_artifact(sources["mxfp4"], out, progress=False)
    assert report.resumed == 5 and report.written == 35
    assert snapshot(out) == snapshot(ref)


def _fail_writes_to(monkeypatch, name_glob: str, err: int = errno.ENOSPC) -> None:
    """`err` on every write (part.write_all) and fsync of a file whose name matches `name_glob`;
    every other file is written as usual. The disk itself is never filled."""
    real_write, real_fsync = bank.write_all, os.fsync

    def hit(fd: int) -> bool:
        return fnmatch.fnmatch(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), name_glob)

    def write_all(fd, data, offset=None):
        if hit(fd):
            raise OSError(err, os.strerror(err))
        real_write(fd, data, offset)

    def fsync(fd):
        if hit(fd):
            raise OSError(err, os.strerror(err))
        real_fsync(fd)

    monkeypatch.setattr(bank, "write_all", write_all)
    monkeypatch.setattr(os, "fsync", fsync)


STAGES = {  # a file of each build stage: (glob the fault hits, the file the message must name)
    "bank-journal": ("experts-*.journal.jsonl", part_name("bf16", 1, 5) + ".journal.jsonl"),
    "resident": ("resident-*.partial", "resident-00001-of-00001.safetensors.partial"),
    "metadata": ("config.json.partial", "config.json.partial"),
    "index": ("model.safetensors.index.json.partial", "model.safetensors.index.json.partial"),
    "receipt": ("build-receipt.json.partial", "build-receipt.json.partial"),
    # written by files.atomic_write: a temporary name of its own, the message names the file
    "manifest": (".expert-manifest.json.*.partial", "expert-manifest.json"),
}
WHY = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
       errno.EIO: "I/O error"}


@pytest.mark.parametrize("stage,err", [(s, errno.ENOSPC) for s in STAGES]
                         + [("resident", errno.EDQUOT), ("manifest", errno.EIO)])
def test_full_disk_in_any_stage_names_the_file_and_resumes(sources, tmp_path, monkeypatch,
                                                           capsys, stage, err):
    ref, out = tmp_path / "ref", tmp_path / "out"
    build_artifact(sources["bf16"], ref, layers="1", progress=False)
    glob, name = STAGES[stage]
    _fail_writes_to(monkeypatch, glob, err)
    assert mtplx_cli.main(["build-manifest", str(sources["bf16"]), str(out), "--layers", "1",
                           "--no-progress"]) == 2
    msg = capsys.readouterr().err
    assert f"{out / name}: {WHY[err]} while " in msg, msg
    assert "free space and rerun the same command to resume" in msg
    assert not (out / "expert-manifest.json").exists()
    if stage != "bank-journal":  # a file that is not journaled gives its space back
        assert not (out / name).exists()
    monkeypatch.undo()
    report = build_artifact(sources["bf16"], out, layers="1", progress=False)
    assert report.written == (8 if stage == "bank-journal" else 0)
    assert snapshot(out) == snapshot(ref)


def test_corrupt_partial_record_is_truncated_and_rebuilt(sources, tmp_path, monkeypatch):
    ref, out = tmp_path / "ref", tmp_path / "out"
    build_artifact(sources["bf16"], ref, progress=False)
    _enospc_after(monkeypatch, 13)  # 6 records journaled in layer 1
    with pytest.raises(BuildError):
        build_artifact(sources["bf16"], out, progress=False)
    monkeypatch.undo()
    partial = out / (part_name("bf16", 1, 5) + ".partial")
    stride = record_layout(tiny_config(), "bf16").logical_bytes
    with open(partial, "r+b") as f:  # flip one byte inside record 2
        f.seek(2 * stride + 100)
        b = f.read(1)
        f.seek(2 * stride + 100)
        f.write(bytes([b[0] ^ 0xFF]))
    report = build_artifact(sources["bf16"], out, progress=False)
    assert report.resumed == 2 and report.written == 38
    assert snapshot(out) == snapshot(ref)


def test_mismatched_header_aborts(sources, tmp_path, monkeypatch):
    src = tmp_path / "src"
    make_tiny(src, "bf16")
    _enospc_after(monkeypatch, 5)
    with pytest.raises(BuildError):
        build_artifact(src, tmp_path / "out", progress=False)
    monkeypatch.undo()
    shard = sorted(src.glob("*.safetensors"))[0]
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the source changed
    with pytest.raises(BuildError, match="journal header differs.*'source'"):
        build_artifact(src, tmp_path / "out", progress=False)


def test_torn_journal_line_is_ignored(tmp_path):
    path = tmp_path / "j.jsonl"
    header = {"format": "mtplx-bank-part-journal-v1", "layer": 1}
    path.write_bytes(canonical_line(header) + canonical_line({"ordinal": 0, "x": 1})
                     + b'{"ordinal":1,"x"')
    parsed = parse_journal(path, 8)
    assert parsed.header == header and len(parsed.records) == 1 and parsed.torn_bytes == 16
    path.write_bytes(canonical_line(header) + canonical_line({"ordinal": 1}))
    assert parse_journal(path, 8).problem is not None  # ordinals must start at 0


def test_record_layouts():
    cfg = tiny_config()
    lay = record_layout(cfg, "t158")
    comps = [s.component for s in lay.segments if s.component != PAD]
    assert comps == ["gate_proj.packed", "gate_proj.scales", "up_proj.packed", "up_proj.scales",
                     "down_proj.packed", "down_proj.scales"]
    assert lay.logical_bytes == 6 * 4096
    asym = record_layout(cfg, "ct-int-asym", 3)
    assert [s.component for s in asym.segments if s.component != PAD][:3] == [
        "gate_proj.weight_packed", "gate_proj.weight_scale", "gate_proj.weight_zero_point"]
    off = 0
    for s in asym.segments:  # contiguous, cover logical_bytes
        assert s.offset == off
        off += s.length
    assert off == asym.logical_bytes
    # K3 geometry: t158 records need no padding (FORMAT.md "Bank parts").
    k3 = dataclasses.replace(cfg, moe_intermediate_size=3072, routed_expert_hidden_size=3584)
    k3_lay = record_layout(k3, "t158")
    assert k3_lay.logical_bytes == 7_741_440 and PAD not in [s.component for s in k3_lay.segments]
    assert part_name("t158", 1, 92) == "experts-t158-layer-001-of-092.bin"
    with pytest.raises(FormatError, match="cannot be stored as t158"):
        record_layout(dataclasses.replace(cfg, routed_expert_hidden_size=96), "t158")


def test_t158_rejects_unfit_shapes():
    cfg = dataclasses.replace(tiny_config(), routed_expert_hidden_size=96)

    class Fake:
        config, layout, path = cfg, "bf16", Path("/nowhere")

    with pytest.raises(BuildError, match="cannot be stored as t158"):
        ExpertSource(Fake(), "t158")


def test_parse_layers():
    assert parse_layers("1-3,5", [1, 2, 3, 4, 5]) == [1, 2, 3, 5]
    assert parse_layers(None, [1, 2]) == [1, 2]
    with pytest.raises(BuildError, match="not MoE layers"):
        parse_layers("0-2", [1, 2, 3])
    assert format_layers([5, 1, 2, 3, 7, 8]) == "1-3,5,7-8"
    assert parse_layers(format_layers([1, 2, 3, 5]), [1, 2, 3, 4, 5]) == [1, 2, 3, 5]


def test_cli(sources, tmp_path, capsys):
    assert mtplx_cli.main(["build-manifest", str(sources["bf16"]), str(tmp_path / "o"),
                           "--layers", "4", "--no-progress", "--jobs", "2"]) == 0
    assert "bf16 1 parts, 8 records" in capsys.readouterr().out
    assert mtplx_cli.main(["build-manifest", str(sources["bf16"]), str(tmp_path / "o"),
                           "--codec", "t158"]) == 2  # another mode's artifact is already there
    assert "error" in capsys.readouterr().err


def test_cli_flags_and_help(capsys):
    parser = argparse.ArgumentParser()
    builder_cli.add_args(parser)
    for flag in ("--no-progress", "--quiet"):  # --quiet as in recode-w4
        assert parser.parse_args(["s", "o", flag]).no_progress
    assert not parser.parse_args(["s", "o"]).no_progress
    with pytest.raises(SystemExit):
        mtplx_cli.main(["build-manifest", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--no-progress, --quiet" in text
    for default in ("(default)", "(default: all)", "(default 1)", "(default: a bar on a terminal"):
        assert default in text


def test_missing_source_or_bad_layers_create_nothing(sources, tmp_path, capsys):
    out = tmp_path / "new" / "out"
    assert mtplx_cli.main(["build-manifest", str(tmp_path / "nope"), str(out)]) == 2
    assert "nope does not exist" in capsys.readouterr().err
    assert mtplx_cli.main(["build-manifest", str(sources["bf16"]), str(out), "--layers", "9"]) == 2
    assert "--layers: [9] not MoE layers" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_progress_lines_off_a_terminal(sources, tmp_path):
    """Logs, nohup and CI get a plain line every interval (here the clock steps 2 s a call)."""
    stream, ticks = io.StringIO(), itertools.count(0, 2)
    build_artifact(sources["bf16"], tmp_path / "a", layers="1",
                   progress=Progress(stream, interval_s=5, clock=lambda: next(ticks)))
    stride = record_layout(tiny_config(), "bf16").logical_bytes
    # t=6 s: 3 records, rate 3*stride/6, 5 left -> ETA 10 s; t=12 s: 6 records, ETA 4 s.
    assert stream.getvalue().splitlines() == [
        f"build-manifest: 3/8 records, {3 * stride / 1e9:.2f} GB written, "
        f"{3 * stride / 6 / 1e6:.1f} MB/s, ETA 0:00:10",
        f"build-manifest: 6/8 records, {6 * stride / 1e9:.2f} GB written, "
        f"{6 * stride / 12 / 1e6:.1f} MB/s, ETA 0:00:04",
    ]


def test_progress_bar_on_a_tty(sources, tmp_path, monkeypatch):
    class TTY(io.StringIO):
        def isatty(self):
            return True

    err = TTY()
    monkeypatch.setattr(sys, "stderr", err)
    build_artifact(sources["bf16"], tmp_path / "a", layers="1", progress=True)
    assert "8/8 records" in err.getvalue() and "B/s" in err.getvalue()
    err.truncate(0)
    build_artifact(sources["bf16"], tmp_path / "b", layers="1", progress=False)
    assert err.getvalue() == ""


class InterruptAfter(Progress):
    """Raises KeyboardInterrupt from the progress callback once `n` records were written."""

    def __init__(self, n: int):
        super().__init__(disable=True)
        self.n, self.seen, self.seen_lock = n, 0, threading.Lock()

    def __call__(self, records: int, written_bytes: int) -> None:
        with self.seen_lock:
            self.seen += written_bytes > 0
            if self.seen == self.n:
                raise KeyboardInterrupt


def assert_resumable(out: Path, mode: str, n_experts: int = 8) -> int:
    """Every unfinished part's partial ends at the last journaled record; returns their count."""
    stride = record_layout(tiny_config(), mode).logical_bytes
    total = 0
    for j in out.glob("*.journal.jsonl"):
        parsed = parse_journal(j, n_experts)
        partial = out / j.name.replace(".journal.jsonl", ".partial")
        if parsed.completion is None:
            assert partial.stat().st_size == len(parsed.records) * stride
            assert parsed.torn_bytes == 0
        total += len(parsed.records)
    return total


def test_ctrl_c_stops_at_a_record_boundary_and_resumes(sources, tmp_path, monkeypatch, capsys):
    """A real SIGINT to the main thread while it waits for the workers: the worker finishes the
    record it is writing and stops before the next; the CLI says how to resume."""
    ref, out = tmp_path / "ref", tmp_path / "out"
    build_artifact(sources["bf16"], ref, progress=False)
    real_check, calls = bank.check_stop, []

    def check_stop(stop, path):
        calls.append(path)
        if len(calls) == 4:  # before record 3 of layer 1: Ctrl-C, then wait for it to land
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            assert stop.wait(timeout=60)
        real_check(stop, path)

    monkeypatch.setattr(bank, "check_stop", check_stop)
    assert mtplx_cli.main(["build-manifest", str(sources["bf16"]), str(out), "--quiet"]) == 130
    assert capsys.readouterr().err == ("mtplx build-manifest: interrupted; every finished record "
                                       "is kept: rerun the same command to resume\n")
    name = part_name("bf16", 1, 5)
    # Layer 1 stopped after its 3rd record; the queued layers never started.
    assert sorted(p.name for p in out.iterdir()) == [name + ".journal.jsonl", name + ".partial"]
    assert assert_resumable(out, "bf16") == 3
    monkeypatch.undo()
    report = build_artifact(sources["bf16"], out, progress=False)
    assert (report.resumed, report.written) == (3, 37)
    assert snapshot(out) == snapshot(ref)


@pytest.mark.parametrize("jobs", [1, 3])
def test_keyboard_interrupt_in_a_worker_resumes_byte_identical(sources, tmp_path, jobs):
    ref, out = tmp_path / "ref", tmp_path / "out"
    build_artifact(sources["mxfp4"], ref, progress=False)
    with pytest.raises(KeyboardInterrupt):
        build_artifact(sources["mxfp4"], out, jobs=jobs, progress=InterruptAfter(11))
    assert not (out / "expert-manifest.json").exists()
    kept = assert_resumable(out, "mxfp4")
    if jobs == 1:  # one worker: exactly the 11 records written, layer 2 stopped after 3
        assert kept == 11 and not list(out.glob("*layer-003*"))
    report = build_artifact(sources["mxfp4"], out, jobs=jobs, progress=False)
    assert report.resumed + 8 * report.adopted + report.written == 40
    assert report.written == 40 - kept
    assert snapshot(out) == snapshot(ref)


def test_finished_layers_extend_to_all(sources, tmp_path):
    ref, out = tmp_path / "ref", tmp_path / "out"
    build_artifact(sources["bf16"], ref, progress=False)
    build_artifact(sources["bf16"], out, layers="1-3", progress=False)
    old = load_manifest(out / "expert-manifest.json")
    # Asking for fewer layers than are built is refused, naming the command that extends it.
    with pytest.raises(BuildError, match="layers 1-3 and --layers 2-4 leaves out 1; to extend "
                                         "it use --layers 1-4, else use a fresh output"):
        build_artifact(sources["bf16"], out, layers="2-4", progress=False)
    with pytest.raises(BuildError, match="finished bf16 artifact and this build makes t158"):
        build_artifact(sources["bf16"], out, codec="t158", progress=False)
    assert load_manifest(out / "expert-manifest.json").manifest_sha256 == old.manifest_sha256
    stream = io.StringIO()
    report = build_artifact(sources["bf16"], out, layers="1-5", progress=Progress(
        stream, interval_s=0, clock=itertools.count().__next__))
    assert report.notes == ["extended"] and (report.adopted, report.written) == (3, 16)
    stride = record_layout(tiny_config(), "bf16").logical_bytes
    assert stream.getvalue().splitlines()[-1].startswith(
        f"build-manifest: 40/40 records, {16 * stride / 1e9:.2f} GB written")
    assert snapshot(out) == snapshot(ref)  # receipt and manifest as if built whole at once
    assert verify_artifact(out, records=True, shard_hashes=True).problems == []


def test_hf_snapshot_source_keeps_its_metadata_files(sources, tmp_path):
    """An HF cache snapshot holds only symlinks into ../../blobs; config and tokenizer files
    must still be copied (verify derives the record layout from config.json), while a link
    leaving the snapshot and its blobs is refused."""
    snap, blobs = tmp_path / "m" / "snapshots" / "rev", tmp_path / "m" / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for p in sources["bf16"].iterdir():
        shutil.copyfile(p, blobs / f"blob-{p.name}")
        os.symlink(f"../../blobs/blob-{p.name}", snap / p.name)
    out = tmp_path / "art"
    build_artifact(snap, out, progress=False)
    for name in ("config.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (sources["bf16"] / name).read_bytes()
    assert verify_artifact(out).problems == []
    (snap / "tokenizer_config.json").unlink()
    os.symlink(sources["bf16"] / "tokenizer_config.json", snap / "tokenizer_config.json")
    with pytest.raises(BuildError, match="tokenizer_config.json: resolves to .*outside"):
        build_artifact(snap, tmp_path / "art2", progress=False)


HOLD_BUILD = """
import sys
from mtplx_runtime.artifact import part
from mtplx_runtime.artifact.build import build_artifact
real, held = part.write_all, []
def write_all(fd, data, offset=None):
    if not held:  # the first write of the build: say so, then wait for the test's go
        held.append(1)
        print("holding", flush=True)
        sys.stdin.readline()
    real(fd, data, offset)
part.write_all = write_all
build_artifact(sys.argv[1], sys.argv[2], layers="1", progress=False)
"""


def test_second_build_into_the_same_directory_is_refused(sources, tmp_path, capsys):
    """A build holds the output directory's lock from start to end: a second one started while
    the first runs (here: held at its first write) is refused at once and touches nothing."""
    out = tmp_path / "out"
    first = subprocess.Popen([sys.executable, "-c", HOLD_BUILD, str(sources["bf16"]), str(out)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    try:
        ready, _, _ = select.select([first.stdout], [], [], 120)
        assert ready and first.stdout.readline() == b"holding\n", first.stderr.read1()
        before = snapshot(out)
        with pytest.raises(BuildError, match="another mtplx build-manifest is running") as ei:
            build_artifact(sources["bf16"], out, layers="1", progress=False)
        assert str(out) in str(ei.value)
        assert mtplx_cli.main(["build-manifest", str(sources["bf16"]), str(out), "--layers",
                               "1"]) == 2
        assert "another mtplx build-manifest is running" in capsys.readouterr().err
        assert snapshot(out) == before
        first.stdin.write(b"go\n")
        first.stdin.flush()
        _, err = first.communicate(timeout=120)
        assert first.returncode == 0, err.decode()
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(timeout=60)
    # The finished directory holds no lock file and nothing verify or the reader objects to.
    assert not (out / ".build.lock").exists()
    assert verify_artifact(out, records=True, shard_hashes=True).problems == []
    again = build_artifact(sources["bf16"], out, layers="1", progress=False)
    assert again.notes == ["already complete"] and not (out / ".build.lock").exists()


def test_lock_file_left_by_a_killed_build_is_taken_over(sources, tmp_path):
    ref, out = tmp_path / "ref", tmp_path / "out"
    build_artifact(sources["bf16"], ref, layers="1", progress=False)
    out.mkdir()
    (out / ".build.lock").write_bytes(b"")  # nobody holds it: the kernel freed the flock
    build_artifact(sources["bf16"], out, layers="1", progress=False)
    assert snapshot(out) == snapshot(ref)
    receipt = json.loads((out / "build-receipt.json").read_text())
    assert ".build.lock" not in [o["file"] for o in receipt["outputs"]]
