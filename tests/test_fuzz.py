"""Fuzzing the readers (FORMAT.md "What the readers validate"): valid inputs mutated by byte
flips, truncation, insertion, deletion and JSON value replacement must either be accepted or
raise the reader's documented error, never another exception type:

    manifest parser (parse_manifest_bytes)       ManifestError
    safetensors header parser (SafetensorsFile)   CheckpointError
    config parser (ModelConfig.from_file)         CheckpointError (ConfigError for values)
    GGUF source reader (GGUFFile)                 CheckpointError
    route traces, every kind (profile.traces.load): JSONL, plain list, .npy, synth: spec
                                                  TraceError
    tokenizer (load_tokenizer, then an encode): tokenizer_config.json, tiktoken.model
                                                  TokenizerError
    presets (presets.load)                        PresetError

Every case runs under a memory limit and a generous timeout that catches a hang
(tests/bounds.py): a reader that allocates what a small file declares fails with MemoryError,
which is no documented error. The default run is bounded and seeded (derandomized, a few
hundred cases per reader); the `slow` variants explore more, with fresh random seeds."""

from __future__ import annotations

import hashlib
import json
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
from bounds import bounded
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mtplx_runtime.artifact.descriptor import descriptor_for
from mtplx_runtime.artifact.manifest import (
    EMPTY_SHA256,
    Manifest,
    ManifestError,
    Record,
    ResidentTensor,
    Segment,
    Shard,
    Sidecar,
    SidecarPart,
    canonical_json,
    parse_manifest_bytes,
)
from mtplx_runtime.checkpoint.config import ModelConfig
from mtplx_runtime.checkpoint.gguf_source import GGUFFile
from mtplx_runtime.checkpoint.safetensors_io import (
    CheckpointError,
    SafetensorsFile,
    write_safetensors,
)
from mtplx_runtime.engine import presets
from mtplx_runtime.engine.tokenizer import TokenizerError, load_tokenizer
from mtplx_runtime.engine.trace import TRACE_FORMAT, TraceError
from mtplx_runtime.fixtures import tokenizer as fixture_tokenizer
from mtplx_runtime.fixtures.tiny import tiny_config
from mtplx_runtime.formats.record import padded_layout, tensor_name
from mtplx_runtime.profile import traces
from mtplx_runtime.profile.traces import read_route_trace

FAST = settings(derandomize=True, database=None, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SLOW = settings(deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
_TMP = Path(tempfile.mkdtemp(prefix="mtplx-fuzz-"))


# ---- valid inputs ----

def _write(name: str, raw: bytes) -> Path:
    p = _TMP / name
    p.write_bytes(raw)
    return p


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def manifest_bytes() -> bytes:
    """A structure-valid t158 manifest of the tiny config: 2 routed layers x 8 experts."""
    cfg = tiny_config()
    desc = descriptor_for(cfg, "t158", layers=[1, 2], model_key="tiny-fuzz")
    rb, parts, records = sum(c[3] for c in padded_layout(list(desc.components))), [], []
    for pi, layer in enumerate(desc.layers):
        name = f"experts-t158-layer-{layer:03d}-of-002.bin"
        parts.append(SidecarPart(name, desc.experts * rb, _sha(name.encode())))
        for e in range(desc.experts):
            off, segs = e * rb, []
            for comp, dtype, shape, length in padded_layout(list(desc.components)):
                tensor = "" if comp == "pad" else tensor_name(layer, e, *comp.split("_proj."))
                segs.append(Segment(comp, tensor, name, off, length, dtype, tuple(shape)))
                off += length
            records.append(Record(layer, e, rb, segs, _sha(b"%d %d" % (layer, e)), e * rb, rb,
                                  pi))
    res = "resident-00001-of-00001.safetensors"
    residents = [ResidentTensor("lm_head.weight", res, 200, 512, "BF16", (4, 64)),
                 ResidentTensor("model.norm.weight", res, 712, 128, "BF16", (64,))]
    shards = [Shard(res, 840, 200, _sha(b"h"), _sha(b"f"))]
    shards += [Shard(p.file, p.size, 0, EMPTY_SHA256, p.sha256, "sidecar") for p in parts]
    routed = len(records) * rb
    m = Manifest("mtplx-expert-manifest-v1", "tiny-fuzz", "", "", dict(desc.quantization),
                 {"tensor_bytes": 640 + routed, "resident_tensor_bytes": 640,
                  "routed_expert_bytes": routed, "shard_count": len(shards),
                  "record_count": len(records)},
                 shards, residents, records, Sidecar(4096, parts))
    m.manifest_sha256 = m.compute_sha256()
    raw = canonical_json(m.to_dict()) + b"\n"
    parse_manifest_bytes(raw)  # valid to start with
    return raw


def safetensors_bytes() -> bytes:
    p = _TMP / "valid.safetensors"
    write_safetensors(p, {"a": ("F32", np.arange(6, dtype=np.float32).reshape(2, 3)),
                          "b": ("BF16", np.ones(4, np.uint16)),
                          "c": ("I64", np.array([1, -2], np.int64))},
                      metadata={"format": "pt"})
    SafetensorsFile(p).close()
    return p.read_bytes()


def config_bytes() -> bytes:
    return json.dumps(tiny_config().to_official_dict(), indent=1).encode()


def _gguf_str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def gguf_bytes() -> bytes:
    """A small GGUF v3 file: a string, an array, general.alignment and three tensors."""
    kv = [_gguf_str("general.architecture") + struct.pack("<I", 8) + _gguf_str("kimi"),
          _gguf_str("general.alignment") + struct.pack("<II", 4, 32),
          _gguf_str("tokenizer.scores") + struct.pack("<IIQ", 9, 6, 3) + b"\0" * 12,
          _gguf_str("tokenizer.tokens") + struct.pack("<IIQ", 9, 8, 2) + _gguf_str("a")
          + _gguf_str("bc")]
    tensors = [("norm.weight", (8,), 0, 32), ("embed.weight", (8, 2), 30, 32),
               ("blk.1.ffn_gate_exps.weight", (256, 1, 1), 10, 84)]
    infos, off = [], 0
    for name, dims, gtype, nbytes in tensors:
        infos.append(_gguf_str(name) + struct.pack("<I", len(dims))
                     + struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", gtype, off))
        off += -(-nbytes // 32) * 32
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv)) + b"".join(kv) + b"".join(infos)
    head += b"\0" * (-len(head) % 32)
    raw = head + bytes(range(256))[:off] + b"\0" * max(0, off - 256)
    p = _TMP / "valid.gguf"
    p.write_bytes(raw)
    GGUFFile(p).close()
    return raw


def trace_bytes() -> bytes:
    lines = [{"format": TRACE_FORMAT, "model": "tiny", "layers": [1, 2], "experts": 8,
              "top_k": 2, "record_bytes": 4096}]
    for t in range(6):
        line = {"t": t, "phase": "prefill" if t < 3 else "decode",
                "routes": {"1": [t % 8, (t + 3) % 8], "2": [0, 5]}}
        if t >= 3:
            line["predicted"] = {"2": {"1": [0, 4]}}
        lines.append(line)
    raw = "".join(json.dumps(x) + "\n" for x in lines).encode()
    p = _TMP / "valid.jsonl"
    p.write_bytes(raw)
    read_route_trace(p)
    return raw


def plain_bytes() -> bytes:
    raw = b"# mtplx-plain-routes\n# layers=3,5 experts=10\n1 2; 3,4\n2 9; 4 0\n\n7,1;0\n"
    traces.load(str(_write("valid.txt", raw)))
    return raw


def npy_bytes() -> bytes:
    p = _TMP / "valid.npy"
    np.save(p, np.array([[[1, 2], [3, -1]], [[0, 5], [4, 2]]], np.int16))
    traces.load(str(p))
    return p.read_bytes()


def tokenizer_dir() -> Path:
    """The fixture tokenizer (512 ranks, the ASCII pre-tokenizer) in its own directory."""
    d = _TMP / "tok"
    fixture_tokenizer.write_tokenizer(d)
    load_tokenizer(d)
    return d


def preset_bytes() -> bytes:
    raw = (b'# a preset\nmemory_budget = "24GiB"\nhost_budget = 0\ncontext = 8192\n'
           b'prefill_chunk = 64\ndtype = "bfloat16"\nkernels = "cpu"\ncache_policy = "lru"\n'
           b"lookahead = 1\ntemperature = 0.7\ntop_p = 0.95\nseed = 3\n")
    presets.load(_write("valid.toml", raw))
    return raw


TOKENIZER_DIR = tokenizer_dir()
VALID = {"manifest": manifest_bytes(), "safetensors": safetensors_bytes(),
         "config": config_bytes(), "gguf": gguf_bytes(), "trace": trace_bytes(),
         "plain": plain_bytes(), "npy": npy_bytes(), "synth": b"synth:temporal,tokens=20,"
         b"layers=3,experts=16,top_k=4,alpha=0.8,locality=0.5,seed=2",
         "tokenizer_config": (TOKENIZER_DIR / "tokenizer_config.json").read_bytes(),
         "tiktoken": (TOKENIZER_DIR / "tiktoken.model").read_bytes(),
         "preset": preset_bytes()}


# ---- mutations ----

@st.composite
def mutated(draw, raw: bytes) -> bytes:
    """1-4 edits: flip a byte, truncate, insert bytes, delete a range, or overwrite with a
    token that matters to a JSON or binary parser."""
    data = bytearray(raw)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "truncate", "insert", "delete", "token"]))
        i = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "truncate":
            del data[i:]
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete":
            del data[i:i + draw(st.integers(1, 64))]
        else:
            tok = draw(st.sampled_from([b"[", b"{", b"}", b"]", b'"', b",", b":", b"-1", b"0",
                                        b"1e999", b"NaN", b"null", b"[[]]", b"{}", b"\xff",
                                        b"\\ud800", b"\xff" * 8, b"\0" * 8, b"9" * 30]))
            data[i:i + draw(st.integers(0, 4))] = tok
    return bytes(data)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=12) | st.sampled_from(["U8", "F32", "pad", "t158", "gate_proj.packed"]),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids,
                                                              max_size=4),
    max_leaves=8)


@st.composite
def replaced(draw, obj: object, lines: bool = False) -> bytes:
    """`obj` with one value (at a random path) replaced, deleted, or wrapped in deep nesting,
    as JSON bytes (`lines`: a list of objects as JSON lines)."""
    obj = json.loads(json.dumps(obj))
    parent, key, node = None, None, obj
    while isinstance(node, (dict, list)) and node and draw(st.integers(0, 3)):
        keys = sorted(node) if isinstance(node, dict) else range(len(node))
        key = draw(st.sampled_from(list(keys)))
        parent, node = node, node[key]
    if parent is None:
        obj = draw(JSON_VALUES)
    else:
        how = draw(st.sampled_from(["value", "delete", "deep"]))
        if how == "delete":
            del parent[key]
        elif how == "deep":
            deep: object = node
            for _ in range(draw(st.sampled_from([2, 50, 5000]))):
                deep = [deep]
            parent[key] = deep
        else:
            parent[key] = draw(JSON_VALUES)
    if lines and isinstance(obj, list):
        return b"".join(_json_dumps(o) + b"\n" for o in obj)
    return _json_dumps(obj)




def _json_dumps(obj: object) -> bytes:
    try:
        return json.dumps(obj).encode()
    except RecursionError:  # our own deep wrapping: too deep for the encoder, not the reader
        return b"[" * 100_000


# ---- the properties ----

def check_manifest(raw: bytes) -> None:
    try:
        parse_manifest_bytes(raw)
    except ManifestError:
        pass


def check_manifest_value(raw: bytes) -> None:
    try:
        parse_manifest_bytes(raw, require_digest=False)
    except ManifestError:
        pass


def check_safetensors(raw: bytes) -> None:
    try:
        SafetensorsFile(_write("f.safetensors", raw)).close()
    except CheckpointError:
        pass


def check_config(raw: bytes) -> None:
    try:
        ModelConfig.from_file(_write("config.json", raw))
    except CheckpointError:
        pass


def check_gguf(raw: bytes) -> None:
    try:
        GGUFFile(_write("f.gguf", raw)).close()
    except CheckpointError:
        pass


def check_trace(raw: bytes) -> None:
    try:
        read_route_trace(_write("t.jsonl", raw))
    except TraceError:
        pass


def check_trace_any(name: str):
    """The profiler's door for a trace file of one kind (`name`'s suffix picks the reader)."""
    def check(raw: bytes) -> None:
        try:
            traces.load(str(_write(name, raw)))
        except TraceError:
            pass
    return check


def check_synth(raw: bytes) -> None:
    try:
        traces.load(raw.decode("utf-8", "replace"))
    except TraceError:
        pass


def check_tokenizer(name: str):
    """`load_tokenizer` of the fixture tokenizer with file `name` replaced; a tokenizer that
    loads must encode and decode text (tiktoken once panicked there: a BaseException)."""
    def check(raw: bytes) -> None:
        d = _TMP / "tok-case"
        d.mkdir(exist_ok=True)
        for f in ("tokenizer_config.json", "tiktoken.model"):
            (d / f).write_bytes(raw if f == name else (TOKENIZER_DIR / f).read_bytes())
        try:
            tok = load_tokenizer(d)
            text = "Hello, world! 12 ab\n\tcafé 中文"
            assert tok.decode(tok.encode(text)) == text
        except TokenizerError:
            pass
    return check


def check_preset(raw: bytes) -> None:
    try:
        presets.load(_write("p.toml", raw))
    except presets.PresetError:
        pass


BYTE_CASES = {"manifest": (check_manifest, 300), "safetensors": (check_safetensors, 400),
              "config": (check_config, 300), "gguf": (check_gguf, 400),
              "trace": (check_trace, 400), "plain": (check_trace_any("t.txt"), 300),
              "npy": (check_trace_any("t.npy"), 300), "synth": (check_synth, 300),
              "tokenizer_config": (check_tokenizer("tokenizer_config.json"), 200),
              "tiktoken": (check_tokenizer("tiktoken.model"), 200),
              "preset": (check_preset, 300)}
VALUE_CASES = {"manifest": (check_manifest_value, 200), "config": (check_config, 300),
               "trace": (check_trace, 200),
               "tokenizer_config": (check_tokenizer("tokenizer_config.json"), 300)}


def _valid_obj(reader: str) -> object:
    raw = VALID[reader]
    if reader == "trace":
        return [json.loads(x) for x in raw.splitlines()]
    obj = json.loads(raw)
    if reader == "manifest":  # value changes break the digest: check the rules without it
        obj.pop("manifest_sha256")
    return obj


def _fuzz(strategy, check, base: settings, n: int) -> None:
    @settings(base, max_examples=n)
    @given(strategy)
    def run(x):
        with bounded():
            check(x)

    run()


@pytest.mark.parametrize("reader", sorted(BYTE_CASES))
def test_byte_mutations_raise_only_documented_errors(reader):
    check, n = BYTE_CASES[reader]
    _fuzz(mutated(VALID[reader]), check, FAST, n)


@pytest.mark.parametrize("reader", sorted(VALUE_CASES))
def test_value_replacements_raise_only_documented_errors(reader):
    check, n = VALUE_CASES[reader]
    _fuzz(replaced(_valid_obj(reader), reader == "trace"), check, FAST, n)


@pytest.mark.slow
@pytest.mark.parametrize("reader", sorted(BYTE_CASES))
def test_byte_mutations_more(reader):
    check, n = BYTE_CASES[reader]
    _fuzz(mutated(VALID[reader]), check, SLOW, 4 * n)


@pytest.mark.slow
@pytest.mark.parametrize("reader", sorted(VALUE_CASES))
def test_value_replacements_more(reader):
    check, n = VALUE_CASES[reader]
    _fuzz(replaced(_valid_obj(reader), reader == "trace"), check, SLOW, 4 * n)
