"""Hostile inputs to the readers (FORMAT.md "What the readers validate"): a FIFO, directory or
device in place of any file the runtime opens fails at once with the reader's documented error
(each call runs in a thread with a generous timeout, so a regression fails instead of hanging the
suite); out-of-range config values, ignored tensors, deep JSON, unhashable values and bad
manifest fields are refused with errors naming the key, tensor or record."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import threading
from pathlib import Path

import numpy as np
import pytest
from bounds import bounded
from k3_manifest_writer import k3_manifest_dict, serialize

from mtplx_runtime.artifact.build import build_artifact
from mtplx_runtime.artifact.manifest import (
    ManifestError,
    load_manifest,
    parse_manifest_bytes,
    write_manifest,
)
from mtplx_runtime.artifact.open import _open_part, open_artifact
from mtplx_runtime.artifact.verify import verify_artifact
from mtplx_runtime.checkpoint.config import ConfigError, ModelConfig, load_json
from mtplx_runtime.checkpoint.gguf_source import GGUFFile
from mtplx_runtime.checkpoint.reader import open_checkpoint
from mtplx_runtime.checkpoint.safetensors_io import CheckpointError, SafetensorsFile
from mtplx_runtime.engine.tokenizer import load_tokenizer
from mtplx_runtime.engine.trace import TraceError, read_trace
from mtplx_runtime.fixtures.tiny import make_tiny, tiny_config
from mtplx_runtime.profile import traces

# Only a hang guard (a correct reader returns at once), not a timing assertion.
HANG_GUARD_S = float(os.environ.get("MTPLX_HANG_GUARD_S", "120"))


def no_hang(fn, *unblock: Path):
    """fn() in a daemon thread; ("ok", value) or ("error", exception). A call still blocked
    after the guard fails the test; the FIFOs in `unblock` are then opened for writing so the
    blocked reader returns."""
    out: dict = {}

    def run():
        try:
            out["ok"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(HANG_GUARD_S)
    if t.is_alive():
        for p in unblock:
            try:
                os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        pytest.fail(f"{fn} blocked (a FIFO was opened before it was checked)")
    return out


def raises(fn, exc: type[BaseException], match: str, *unblock: Path) -> BaseException:
    out = no_hang(fn, *unblock)
    assert "error" in out, f"no error, got {out.get('ok')!r}"
    e = out["error"]
    assert isinstance(e, exc), repr(e)
    assert re.search(match, str(e)), str(e)
    return e


def fifo(path: Path) -> Path:
    if path.exists() or path.is_symlink():
        path.unlink()
    os.mkfifo(path)
    return path


@pytest.fixture(scope="module")
def tiny_art(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    src, art = root / "src", root / "art"
    make_tiny(src, "t158")
    build_artifact(src, art, codec="keep", progress=False)
    return src, art


@pytest.fixture
def src(tiny_art, tmp_path):
    out = tmp_path / "src"
    shutil.copytree(tiny_art[0], out)
    return out


@pytest.fixture
def art(tiny_art, tmp_path):
    out = tmp_path / "art"
    shutil.copytree(tiny_art[1], out)
    return out


def part_of(art: Path) -> Path:
    return sorted(art.glob("experts-*-layer-*.bin"))[0]


# ---- file kinds: FIFO, directory, device ----

def test_config_json_fifo_and_directory(src):
    p = fifo(src / "config.json")
    raises(lambda: ModelConfig.from_file(p), CheckpointError, "FIFO", p)
    raises(lambda: open_checkpoint(src), CheckpointError, "config.json: not a regular file", p)
    p.unlink()
    p.mkdir()
    raises(lambda: ModelConfig.from_file(p), CheckpointError, "a directory")


def test_index_fifo(src):
    p = fifo(src / "model.safetensors.index.json")
    raises(lambda: open_checkpoint(src), CheckpointError, "index.json: not a regular file", p)


def test_shard_fifo_and_device(src):
    shard = sorted(src.glob("*.safetensors"))[0]
    p = fifo(shard)
    raises(lambda: SafetensorsFile(p), CheckpointError, "FIFO", p)
    raises(lambda: open_checkpoint(src), CheckpointError, shard.name, p)
    raises(lambda: SafetensorsFile("/dev/null"), CheckpointError, "character device")


def test_tokenizer_files_fifo(src):
    p = fifo(src / "tokenizer_config.json")
    raises(lambda: load_tokenizer(src), ValueError, "tokenizer_config.json: not a regular", p)
    p = fifo(src / "tiktoken.model")
    raises(lambda: load_tokenizer(src), ValueError, "tiktoken.model: not a regular", p)


def test_manifest_fifo_verify_and_load(art):
    from mtplx_runtime import load

    p = fifo(art / "expert-manifest.json")
    raises(lambda: load_manifest(p), ManifestError, "FIFO", p)
    rep = no_hang(lambda: verify_artifact(art, records=True), p)["ok"]
    assert not rep.ok and "FIFO" in rep.problems[0]
    raises(lambda: load(art, tokenizer=False), CheckpointError, "FIFO", p)


def test_bank_part_fifo_verify_records_and_generate(art):
    from mtplx_runtime import load

    p = fifo(part_of(art))
    rep = no_hang(lambda: verify_artifact(art, records=True), p)["ok"]
    assert not rep.ok
    assert any(p.name in x and "FIFO" in x for x in rep.problems), rep.problems
    raises(lambda: open_artifact(art), CheckpointError,
           r"not a regular file \(a FIFO\); the bank part must be one", p)
    raises(lambda: load(art, tokenizer=False), CheckpointError, "bank part", p)
    # A FIFO swapped in after open time: the read-time open refuses it too.
    raises(lambda: _open_part(p, 4096), CheckpointError, "FIFO", p)


def test_bank_part_symlink_and_directory(art, tmp_path):
    part = part_of(art)
    shutil.move(part, tmp_path / "elsewhere.bin")
    os.symlink(tmp_path / "elsewhere.bin", part)
    raises(lambda: _open_part(part, 1), CheckpointError, "symlink")
    part.unlink()
    part.mkdir()
    raises(lambda: _open_part(part, 1), CheckpointError, "directory")


def test_route_trace_fifo(tmp_path):
    p = fifo(tmp_path / "routes.jsonl")
    raises(lambda: read_trace(p), TraceError, "FIFO", p)
    raises(lambda: traces.load(str(p)), TraceError, "FIFO", p)
    raises(lambda: traces.read_plain(p), TraceError, "FIFO", p)
    n = fifo(tmp_path / "routes.npy")
    raises(lambda: traces.load(str(n)), TraceError, "FIFO", n)


def test_gguf_fifo(tmp_path):
    p = fifo(tmp_path / "k3.gguf")
    raises(lambda: GGUFFile(p), CheckpointError, "FIFO", p)


# ---- config values ----

def flat(**changes) -> dict:
    d = tiny_config().to_flat_dict()
    lac = changes.pop("linear_attn_config", {})
    d.update(changes)
    d["linear_attn_config"].update(lac)
    return d


@pytest.mark.parametrize("changes, message", [
    ({"num_hidden_layers": 4294967296}, "num_hidden_layers = 4294967296 exceeds"),
    ({"num_experts": 1 << 40}, "num_experts = .* exceeds"),
    ({"vocab_size": 1 << 40}, "vocab_size = .* exceeds"),
    ({"linear_attn_config": {"kda_layers": list(range(1, 40_001))}},
     "kda_layers has 40000 entries, more than num_hidden_layers"),
    ({"linear_attn_config": {"gate_lower_bound": 9007199254740993}},
     r"kda_gate_lower_bound = 9007199254740992.0 must be in \[-1000.0, 0\)"),
    ({"linear_attn_config": {"gate_lower_bound": 0}}, "kda_gate_lower_bound"),
    ({"linear_attn_config": {"gate_lower_bound": -1e30}}, "kda_gate_lower_bound"),
    ({"rms_norm_eps": 0}, "rms_norm_eps must be finite and positive"),
    ({"rms_norm_eps": 5.0}, "rms_norm_eps = 5.0 exceeds"),
    ({"routed_scaling_factor": 10**400}, "routed_scaling_factor = .* out of range"),
    ({"num_experts_per_token": 9}, "num_experts_per_token 9 exceeds num_experts 8"),
    ({"linear_attn_config": {"short_conv_kernel_size": 1 << 30}},
     "kda_short_conv_kernel_size = .* exceeds"),
])
def test_config_bounds_name_the_key(changes, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(flat(**changes))


def test_deep_json_is_the_documented_error(tmp_path):
    deep = b"[" * 100_000 + b"]" * 100_000
    p = tmp_path / "config.json"
    p.write_bytes(b'{"a": ' + deep + b"}")
    with pytest.raises(CheckpointError, match="config.json: not valid JSON: nested too deeply"):
        load_json(p)
    with pytest.raises(CheckpointError, match="config.json"):
        ModelConfig.from_file(p)
    st = tmp_path / "deep.safetensors"
    header = b'{"x": ' + deep + b"}"
    st.write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(CheckpointError, match="deep.safetensors: header is not valid JSON"):
        SafetensorsFile(st)
    with pytest.raises(ManifestError, match="m.json: not valid JSON: nested too deeply"):
        parse_manifest_bytes(b'{"records": ' + deep + b"}", where="m.json")
    tr = tmp_path / "t.jsonl"
    tr.write_bytes(deep + b"\n")
    with pytest.raises(TraceError, match="t.jsonl:1: not valid JSON"):
        read_trace(tr)


# ---- resident tensors the config would ignore ----

def test_tensors_the_config_ignores_are_refused(src):
    d = json.loads((src / "config.json").read_text())
    text = d.get("text_config", d)
    text["num_shared_experts"] = 0
    (src / "config.json").write_text(json.dumps(d))
    with pytest.raises(CheckpointError,
                       match=r"shared_experts\..*is not used by the config.*num_shared_experts"):
        open_checkpoint(src)


# ---- unhashable and hostile values ----

def st_file(tmp_path: Path, entry: dict) -> Path:
    header = json.dumps({"t": entry}).encode()
    p = tmp_path / "x.safetensors"
    p.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 4)
    return p


@pytest.mark.parametrize("entry", [
    {"dtype": {}, "shape": [1], "data_offsets": [0, 4]},
    {"dtype": [], "shape": [1], "data_offsets": [0, 4]},
    {"dtype": "F32", "shape": [[1]], "data_offsets": [0, 4]},
])
def test_safetensors_unhashable_values(tmp_path, entry):
    with pytest.raises(CheckpointError, match="tensor 't'"):
        SafetensorsFile(st_file(tmp_path, entry))


def small() -> dict:
    return k3_manifest_dict(layers=1)


def reject(d: dict, match: str) -> None:
    with pytest.raises(ManifestError, match=match):
        parse_manifest_bytes(serialize(d)[0])


@pytest.mark.parametrize("where", ["segment", "resident"])
@pytest.mark.parametrize("value", [{}, [], [1]])
def test_manifest_unhashable_dtype_and_shape(where, value):
    d = small()
    obj = d["records"][0]["segments"][0] if where == "segment" else d["resident_tensors"][0]
    obj["dtype"] = value
    reject(d, r"(records\[0\]\.segments\[0\]|resident_tensors\[0\])\.dtype: unknown dtype")
    d = small()
    obj = d["records"][0]["segments"][0] if where == "segment" else d["resident_tensors"][0]
    obj["shape"] = [value, 3]
    reject(d, r"(records\[0\]\.segments\[0\]|resident_tensors\[0\]).* shape")


@pytest.mark.parametrize("tensor", ["../../etc/passwd", "x" * 2_000_000,
                                    "model.layers.1.mlp.switch_mlp.experts.1.gate_proj.packed"])
def test_manifest_segment_tensor_is_the_canonical_name(tensor):
    d = small()
    d["records"][0]["segments"][0]["tensor"] = tensor
    reject(d, r"record \(layer 1, expert 0\) segment gate_proj.packed: tensor .* is not "
              r"'model.layers.1.mlp.switch_mlp.experts.0.gate_proj.packed' \(rule 7\)")


def test_manifest_record_needs_sha256():
    d = small()
    del d["records"][5]["sha256"]
    reject(d, r"record \(layer 1, expert 5\): sha256 is required .*\(rule 11\)")


def test_stat_kinds_are_named(tmp_path):
    # The helper's words for each kind appear in the errors above; a socket is one more.
    import socket

    p = tmp_path / "s.sock"
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(str(p))
        assert stat.S_ISSOCK(os.stat(p).st_mode)
        raises(lambda: SafetensorsFile(p), CheckpointError, "a socket")
    finally:
        s.close()


# ---- issue 35 item 4: no member of a model directory is read from outside it ----

def _move_part_into(art: Path, sub: str) -> str:
    """Rename the first bank part to `sub/<name>` in the manifest (digest recomputed); returns
    the part's file name."""
    m = load_manifest(art / "expert-manifest.json")
    old = m.sidecar.parts[0].file
    new = f"{sub}/{old}"
    m.sidecar.parts[0].file = new
    for s in m.shards:
        if s.name == old:
            s.name = new
    for r in m.records:
        for seg in r.segments:
            if seg.shard == old:
                seg.shard = new
    write_manifest(m, art / "expert-manifest.json")
    return old


def test_a_bank_part_behind_a_symlinked_directory_is_refused(art, tmp_path):
    from mtplx_runtime import load

    outside = tmp_path / "outside"
    outside.mkdir()
    name = _move_part_into(art, "sub")
    shutil.move(art / name, outside / name)
    os.symlink(outside, art / "sub")
    raises(lambda: open_artifact(art), CheckpointError,
           r"sub/.*resolves to .*outside.*must not leave the artifact directory")
    raises(lambda: load(art, tokenizer=False), CheckpointError, "resolves to .*outside")
    raises(lambda: _open_part(art / "sub" / name, 1, art), CheckpointError, "outside")
    rep = verify_artifact(art, records=True)
    assert any("outside the artifact root" in p for p in rep.problems), rep.problems
    # The same part in a real subdirectory is a member like any other.
    (art / "sub").unlink()
    shutil.move(outside, art / "sub")
    open_artifact(art).close()


@pytest.mark.parametrize("member", ["config.json", "tiktoken.model", "tokenizer_config.json",
                                    "model.safetensors.index.json", "resident"])
def test_a_member_linking_out_of_the_artifact_is_refused(art, tmp_path, member):
    from mtplx_runtime import load

    if member == "resident":
        member = sorted(p.name for p in art.glob("resident-*.safetensors"))[0]
    shutil.move(art / member, tmp_path / member)
    os.symlink(tmp_path / member, art / member)
    tokenizer = member in ("tiktoken.model", "tokenizer_config.json")
    opener = (lambda: load_tokenizer(art)) if tokenizer else (lambda: open_artifact(art))
    raises(opener, ValueError, f"{member}: resolves to .*outside")
    raises(lambda: load(art, kernels="reference", cache_slots=(2, 0)), ValueError,
           f"{member}: resolves to .*outside")
    rep = verify_artifact(art)
    assert any(p.startswith(f"{member}: resolves to") for p in rep.problems), rep.problems


def test_a_hugging_face_snapshot_of_blob_links_loads(tiny_art, tmp_path):
    """An HF cache checkpoint is a snapshot of links into ../../blobs: it must keep working,
    while a link elsewhere is still refused."""
    from mtplx_runtime import load

    snap, blobs = tmp_path / "models--x" / "snapshots" / "rev", tmp_path / "models--x" / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for p in tiny_art[0].iterdir():
        blob = hashlib.sha256(p.read_bytes()).hexdigest()
        shutil.copyfile(p, blobs / blob)
        os.symlink(f"../../blobs/{blob}", snap / p.name)
    with load(snap, dtype="float32") as rt:
        assert rt.tokenizer.decode(rt.tokenizer.encode("hello")) == "hello"
        assert rt.model.logits([5, 6]).shape[0] == 2
    (snap / "config.json").unlink()
    os.symlink(tiny_art[0] / "config.json", snap / "config.json")
    raises(lambda: open_checkpoint(snap), CheckpointError, "config.json: resolves to .*outside")


# ---- issue 35 item 2: sizes an input declares are bounded before anything is allocated ----

def _profile(argv: list[str], capsys) -> tuple[int, str]:
    from mtplx_runtime.cli import main as cli_main

    with bounded():  # a MemoryError here is the bug: the old reader built a 15 GiB array
        rc = cli_main(["profile", *argv, "--workers", "1"])
    return rc, capsys.readouterr().err


def _trace_header(**fields) -> str:
    h = {"format": "mtplx-route-trace-v1", "model": "x", "layers": [1, 2], "experts": 8,
         "top_k": 2, "record_bytes": None, **fields}
    return json.dumps(h) + "\n"


@pytest.mark.parametrize("name, text, message", [
    ("experts.txt", "# experts=999999999\n1 2\n",
     r"experts.txt:1: '999999999' is not a 0-based integer below 65537 \(experts\)"),
    ("ids.txt", "1 2; 3 123456789\n", r"ids.txt:1: '123456789' is not .* \(an expert id\)"),
    ("wide.txt", ";" * 5000 + "\n", "5001 layers, more than 1024"),
    ("experts.jsonl", _trace_header(experts=999999999), r"1 <= experts <= 65536"),
    ("topk.jsonl", _trace_header(experts=65536, top_k=4194304), r"top_k 4194304"),
    ("layers.jsonl", _trace_header(layers=list(range(2000, 2004))), r"layer indices in 0..1023"),
])
def test_declared_sizes_are_refused_naming_the_key(tmp_path, capsys, name, text, message):
    p = tmp_path / name
    p.write_text(text + json.dumps({"t": 0, "phase": "decode", "routes": {"1": [0], "2": [1]}})
                 + "\n" if name.endswith(".jsonl") else text)
    rc, err = _profile([str(p)], capsys)
    assert rc == 2 and re.search(message, err), err


@pytest.mark.parametrize("spec, message", [
    ("synth:zipf,experts=1000000000", "experts=1000000000 exceeds 65536"),
    ("synth:temporal,tokens=10000000", "tokens=10000000 exceeds 1048576"),
    ("synth:uniform,tokens=1000000,layers=1024,experts=64,top_k=4",
     "65,536,000,000 random draws, more than 2,147,483,648"),
    ("synth:k3,layers=" + "9" * 5000, "layers='9999.*' is not an integer"),
])
def test_synthetic_specs_are_bounded(capsys, spec, message):
    rc, err = _profile([spec], capsys)
    assert rc == 2 and re.search(message, err), err


def test_routes_beyond_the_memory_share_are_refused_as_lines_arrive(tmp_path, capsys,
                                                                    monkeypatch):
    # 65,536 experts top-65,536 is within the bounds; each line then costs 512 KiB of routes.
    monkeypatch.setattr(traces, "memory_available_bytes", lambda: 64 << 20)
    line = json.dumps({"t": 0, "phase": "decode", "routes": {"1": [0], "2": [1]}}) + "\n"
    p = tmp_path / "big.jsonl"
    p.write_text(_trace_header(experts=65536, top_k=65536) + line * 100)
    rc, err = _profile([str(p)], capsys)
    assert rc == 2 and re.search(r"big.jsonl:18: 17 lines x 2 layers x top_k 65536 need "
                                 r"8.5 MiB; profiling may use 8.0 MiB for routes", err), err


def test_npy_headers_are_checked_against_the_file(tmp_path, capsys):
    p = tmp_path / "r.npy"
    np.save(p, np.zeros((2, 2, 2), np.int32))
    raw = p.read_bytes()
    head = raw[:raw.index(b"}") + 1]
    huge = head.replace(b"(2, 2, 2)", b"(100000, 1000, 1000)")
    p.write_bytes(huge + b" " * (len(head) - len(huge)) + raw[len(head):])
    rc, err = _profile([str(p)], capsys)
    assert rc == 2 and re.search(r"r.npy: the header's int32\[100000, 1000, 1000\] needs "
                                 r"400000000000 bytes of data, the file holds \d+;", err), err
    for bad in (b"{'descr': '<i4', 'fortran_order': False, 'shape': (2, 2, 2), }\x00",
                b"{'descr': '<i4', 'fortran_order': False, 'shape': (2, 2, 2}",  # tokenize
                b"{'descr': 'O', 'fortran_order': False, 'shape': (2, 2, 2), }"):
        body = bad + b" " * (len(head) - len(bad))
        p.write_bytes(raw[:10] + body[:len(head) - 10] + raw[len(head):])
        rc, err = _profile([str(p)], capsys)
        assert rc == 2 and "r.npy:" in err and "Traceback" not in err, err


# ---- issue 35 item 7: malformed presets are PresetErrors ----

def test_a_preset_that_is_not_utf8_is_a_preset_error(tmp_path):
    from mtplx_runtime.engine import presets

    p = tmp_path / "p.toml"
    p.write_bytes(b'memory_budget = "24GiB"\ncontext = 8192 # \xff\xfe\n')
    with pytest.raises(presets.PresetError, match=r"p.toml: not UTF-8 text \(byte 41\)"):
        presets.load(p)
    p.write_bytes(b"a = " + b"[" * 100_000 + b"]" * 100_000 + b"\n")
    with pytest.raises(presets.PresetError, match="p.toml: not valid TOML"):
        presets.load(p)
    p.unlink()
    os.mkfifo(p)
    raises(lambda: presets.load(p), presets.PresetError, "no such preset file|FIFO", p)


# ---- issue 35 item 9: manifest rule errors name the file ----

def test_manifest_rule_errors_name_the_file(tmp_path):
    d = small()
    d["records"][0]["segments"][0]["dtype"] = "X"
    p = tmp_path / "expert-manifest.json"
    p.write_bytes(serialize(d)[0])
    with pytest.raises(ManifestError, match=rf"^{re.escape(str(p))}: records\[0\]"):
        load_manifest(p)
    d = small()
    d["artifact"]["record_count"] += 1
    p.write_bytes(serialize(d)[0])
    with pytest.raises(ManifestError, match=rf"^{re.escape(str(p))}: artifact.record_count"):
        load_manifest(p)
