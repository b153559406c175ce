"""Read-time integrity is on by default: a flipped byte in a bank record or a resident shard stops
`load` / `mtplx generate` with a message naming the file (and the expert), `--no-verify` turns
the checks off and says so, and a verified shard is not re-hashed until the file changes."""

from __future__ import annotations

import os
import shutil

import pytest

import mtplx_runtime
from mtplx_runtime.artifact import integrity
from mtplx_runtime.artifact.build import build_artifact
from mtplx_runtime.artifact.integrity import IntegrityError
from mtplx_runtime.artifact.manifest import MANIFEST_NAME, load_manifest
from mtplx_runtime.artifact.open import open_source
from mtplx_runtime.cli import main as cli_main
from mtplx_runtime.engine.generate import generate
from mtplx_runtime.fixtures.tiny import make_tiny

PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("integrity")
    make_tiny(root / "src", "t158")
    build_artifact(root / "src", root / "art", codec="keep", progress=False)
    return root / "art"


@pytest.fixture
def art(built, tmp_path):
    return shutil.copytree(built, tmp_path / "art")


def flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def flip_every_record(art) -> None:
    """One byte of every record of the first routed layer, so the first decode step reads one."""
    with open_source(art) as a:
        bank = a.expert_layout
        layer = bank.layers[0]
        for e in range(a.config.num_experts):
            part, offset, _, _ = bank.locate(layer, e)
            flip(art / bank.manifest.sidecar.parts[part].file, offset + 100)


def generate_cli(art, *flags):
    return cli_main(["generate", "--model", str(art), "--prompt", "hello", "--dtype", "float32",
                     "--max-tokens", "3", "--kernels", "reference", *flags])


def test_damaged_record_stops_generate_naming_the_expert(art, capsys):
    flip_every_record(art)
    assert generate_cli(art) == 2
    err = capsys.readouterr().err
    assert "mtplx generate: error:" in err and "expert (layer 1, expert" in err
    assert "experts-t158-layer-001" in err and "mtplx verify --records" in err
    assert generate_cli(art, "--no-verify") == 0  # the user's explicit choice: it runs ...
    assert "integrity checks off (--no-verify)" in capsys.readouterr().err  # ... and says so


def test_damaged_resident_shard_stops_load(art, capsys):
    m = load_manifest(art / MANIFEST_NAME)
    head = next(t for t in m.resident_tensors if t.tensor.endswith("lm_head.weight"))
    flip(art / head.shard, head.offset + 7)
    with pytest.raises(IntegrityError, match=f"{head.shard}.*verify --shard-hashes"):
        mtplx_runtime.load(art, dtype="float32", kernels="reference", cache_slots=(2, 0))
    assert generate_cli(art) == 2
    assert head.shard in capsys.readouterr().err
    with mtplx_runtime.load(art, dtype="float32", kernels="reference", cache_slots=(2, 0),
                            verify=False) as rt:
        assert len(generate(rt.model, PROMPT, max_tokens=2)[0]) == 2


def test_a_verified_shard_is_trusted_until_it_changes(art, tmp_path, monkeypatch):
    monkeypatch.setenv(integrity.RECEIPTS_ENV, str(tmp_path / "receipts"))
    hashed = []
    real = integrity._file_sha256

    def counting(path):
        hashed.append(path.name)
        return real(path)

    monkeypatch.setattr(integrity, "_file_sha256", counting)
    m = load_manifest(art / MANIFEST_NAME)
    shards = sorted(s.name for s in m.shards if s.kind in integrity.RESIDENT_KINDS)
    assert shards
    first = integrity.admit_shards(art, m)
    assert sorted(first.hashed) == sorted(hashed) == shards and not first.trusted
    hashed.clear()
    second = integrity.admit_shards(art, m)
    assert hashed == [] and sorted(second.trusted) == shards
    # Any write changes ctime, even one that restores the mtime: that shard is hashed again.
    st = os.stat(art / shards[0])
    flip(art / shards[0], st.st_size - 1)
    flip(art / shards[0], st.st_size - 1)  # the same bytes again
    os.utime(art / shards[0], ns=(st.st_atime_ns, st.st_mtime_ns))
    third = integrity.admit_shards(art, m)
    assert hashed == [shards[0]] and third.hashed == [shards[0]]


def test_an_unwritable_receipt_directory_only_costs_a_rehash(art, tmp_path, monkeypatch):
    (tmp_path / "not-a-dir").write_text("x")
    monkeypatch.setenv(integrity.RECEIPTS_ENV, str(tmp_path / "not-a-dir" / "receipts"))
    m = load_manifest(art / MANIFEST_NAME)
    assert integrity.admit_shards(art, m).hashed
    assert integrity.admit_shards(art, m).hashed  # no receipt could be kept: hashed again
