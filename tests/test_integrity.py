"""Read-time integrity is on by default: a flipped byte in a bank record or a resident shard stops
`load` / `mtplx generate` with a message naming the file (and the expert), `--no-verify` turns
the checks off and says so, a verified shard is not re-hashed until the file changes, and a
record whose SHA-256 passed once is checked with its learned XXH3 after that (seeded with a
secret of this user's, so no one who cannot read it can craft bytes that pass)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys

import numpy as np
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
from mtplx_runtime.offload.digests import MAGIC, RecordDigests, fast_hash

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
    real = integrity.sha256_fd

    def counting(fd):
        hashed.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        return real(fd)

    monkeypatch.setattr(integrity, "sha256_fd", counting)
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


# ---- the fast record check: XXH3 learned from reads whose SHA-256 matched -------------------

def counts(digests) -> dict:
    st = digests.stats()
    assert st.pop("seconds") >= 0.0
    return st


def read_record(bank, art, key) -> bytearray:
    part, offset, length, _ = bank.locate(*key)
    with open(art / bank.manifest.sidecar.parts[part].file, "rb") as f:
        f.seek(offset)
        return bytearray(f.read(length))


def _xxh3_lengths() -> list[int]:
    """Every small and medium length, then both sides of each stripe (64 B) and block (1 KiB)
    boundary of the long path, and a few MB (the record sizes) with ragged tails."""
    edges = [k * 64 + d for k in range(4, 40) for d in (-1, 0, 1)]
    edges += [k * 1024 + d for k in (1, 2, 3, 16, 1000) for d in (-65, -64, -63, -1, 0, 1, 63, 64)]
    return sorted({*range(0, 301), *edges, 3 << 20, (7 << 20) + 4096, (7 << 20) + 4097})


# Seeds for the seeded XXH3: 0 (plain XXH3), small, each half all ones or only the top bit (the
# 4..8-byte path mixes the seed's low half into its high one), all ones, and two arbitrary ones.
XXH3_SEEDS = [0, 1, 0xFFFFFFFF, 1 << 32, 1 << 63, (1 << 64) - 1, 0x9E3779B97F4A7C15,
              0x243F6A8885A308D3]


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
def test_native_xxh3_matches_the_xxhash_package_on_every_path(isa):
    """Every length class (0, 1-3, 4-8, 9-16, 17-128, 129-240, over 240 with its stripe and
    block edges) with every seed, from an aligned start and two unaligned ones, equals xxHash's
    XXH3_64bits_withSeed on this ISA path."""
    xxhash = pytest.importorskip("xxhash")
    from mtplx_runtime.kernels import cpu_native
    if cpu_native.unavailable_reason() is not None:
        pytest.skip(cpu_native.unavailable_reason())
    if cpu_native.ISAS.index(isa) > cpu_native.ISAS.index(cpu_native.best_isa()):
        pytest.skip(f"this CPU has no {isa}")
    buf = np.random.default_rng(7).integers(0, 256, (7 << 20) + 4097 + 72, dtype=np.uint8)
    data = memoryview(buf[-buf.ctypes.data % 64:])  # data[0] on a 64-byte boundary
    before = cpu_native.isa()
    try:
        assert cpu_native.set_isa(isa) == isa
        bad = [(off, n, hex(seed)) for seed in XXH3_SEEDS for off in (0, 1, 7)
               for n in _xxh3_lengths()
               if cpu_native.xxh3(data[off:off + n], seed)
               != xxhash.xxh3_64_intdigest(data[off:off + n], seed=seed)]
        # seed 0 is the default: plain XXH3-64, as the learned values of earlier versions were
        assert all(cpu_native.xxh3(data[:n]) == xxhash.xxh3_64_intdigest(data[:n])
                   for n in (0, 3, 8, 16, 128, 240, 241, 4096))
        # a typed, multi-byte view hashes its bytes
        view = memoryview(np.arange(300, dtype=np.uint32))
        assert cpu_native.xxh3(view, 5) == xxhash.xxh3_64_intdigest(view.tobytes(), seed=5)
    finally:
        cpu_native.set_isa(before)
    assert bad == []


def test_xxh3_refuses_a_seed_outside_64_bits():
    """ctypes would wrap -1 and 2^64 into other seeds without a word."""
    from mtplx_runtime.kernels import cpu_native
    if cpu_native.unavailable_reason() is not None:
        pytest.skip(cpu_native.unavailable_reason())
    for seed in (-1, 1 << 64):
        with pytest.raises(ValueError, match="unsigned 64-bit"):
            cpu_native.xxh3(b"record", seed)


def test_first_read_hashes_sha256_then_xxh3_is_learned_and_kept(built, tmp_path):
    with open_source(built) as a:
        bank = a.expert_layout
    key = (bank.layers[0], 3)
    data = read_record(bank, built, key)
    first = RecordDigests(built, bank.manifest, receipts=tmp_path)
    check = first.check(key)
    assert check.verify(memoryview(data)) is None
    assert check.verify(memoryview(data)) is None
    assert counts(first) == {"xxh3": 1, "sha256": 1, "relearned": 0}
    first.save()
    second = RecordDigests(built, bank.manifest, receipts=tmp_path)  # a later process
    assert second.learned() == 1
    assert second.check(key).verify(memoryview(data)) is None
    assert counts(second) == {"xxh3": 1, "sha256": 0, "relearned": 0}
    data[100] ^= 0x10  # damaged after learning: XXH3 differs, SHA-256 settles it
    assert "do not match sha256" in second.check(key).verify(memoryview(data))
    assert second.stats()["sha256"] == 0  # a failed check counts as no pass


def test_a_wrong_learned_value_costs_a_rehash_never_a_verdict(built, tmp_path, caplog):
    with open_source(built) as a:
        bank = a.expert_layout
    key = (bank.layers[0], 0)
    good = read_record(bank, built, key)
    d = RecordDigests(built, bank.manifest, receipts=tmp_path)
    d.check(key).verify(memoryview(good))
    d.save()
    raw = bytearray(d.path.read_bytes())
    raw[16:24] = (12345).to_bytes(8, "little")  # record 0's learned value, now wrong
    d.path.write_bytes(bytes(raw))
    again = RecordDigests(built, bank.manifest, receipts=tmp_path)
    assert again.check(key).verify(memoryview(good)) is None  # SHA-256 says the bytes are right
    assert counts(again) == {"xxh3": 0, "sha256": 1, "relearned": 1}
    assert "stale" in caplog.text
    assert again.check(key).verify(memoryview(good)) is None
    assert again.stats()["xxh3"] == 1


def test_verify_records_seeds_every_record_so_reads_skip_sha256(art, tmp_path, monkeypatch,
                                                                capsys):
    monkeypatch.setenv(integrity.RECEIPTS_ENV, str(tmp_path / "receipts"))
    assert cli_main(["verify", str(art), "--records"]) == 0
    assert "stored the XXH3 of" in capsys.readouterr().out
    with open_source(art) as a:
        bank = a.expert_layout
    d = RecordDigests(art, bank.manifest)
    assert d.path.suffix == ".xxh3" and d.learned() == len(bank.manifest.records)
    for key in [(bank.layers[0], 0), (bank.layers[-1], 5)]:
        assert d.check(key).verify(memoryview(read_record(bank, art, key))) is None
    assert counts(d) == {"xxh3": 2, "sha256": 0, "relearned": 0}


def test_verify_records_and_reads_learn_the_same_values(art, tmp_path, monkeypatch):
    """`mtplx verify --records` hashes in artifact/verify with the seed reads use, so a file it
    writes is byte for byte the one that reading every record once (SHA-256, then learn) writes."""
    monkeypatch.setenv(integrity.RECEIPTS_ENV, str(tmp_path / "receipts"))
    assert cli_main(["verify", str(art), "--records"]) == 0
    with open_source(art) as a:
        bank = a.expert_layout
    d = RecordDigests(art, bank.manifest)
    by_verify = d.path.read_bytes()
    d.path.unlink()
    reads = RecordDigests(art, bank.manifest)
    for r in bank.manifest.records:
        key = (r.layer, r.expert)
        assert reads.check(key).verify(memoryview(read_record(bank, art, key))) is None
    reads.save()
    assert counts(reads)["sha256"] == len(bank.manifest.records)
    assert reads.path.read_bytes() == by_verify
    assert np.all(np.frombuffer(by_verify[16:], "<u8"))


@pytest.mark.parametrize("damage", ["short", "magic", "count", "fifo", "directory", "symlink"])
def test_a_damaged_or_special_checksum_file_is_ignored(built, tmp_path, damage, caplog):
    with open_source(built) as a:
        bank = a.expert_layout
    path = RecordDigests(built, bank.manifest, receipts=tmp_path).path
    n = len(bank.manifest.records)
    good = MAGIC + n.to_bytes(8, "little") + bytes(range(1, 9)) * n
    if damage == "short":
        path.write_bytes(good[:-1])
    elif damage == "magic":
        path.write_bytes(b"X" + good[1:])
    elif damage == "count":
        path.write_bytes(MAGIC + (n + 1).to_bytes(8, "little") + good[16:])
    elif damage == "fifo":
        os.mkfifo(path)
    elif damage == "directory":
        path.mkdir()
    else:
        (tmp_path / "elsewhere").write_bytes(good)
        path.symlink_to(tmp_path / "elsewhere")
    d = RecordDigests(built, bank.manifest, receipts=tmp_path)  # returns: nothing blocks
    assert d.learned() == 0 and "ignoring the record checksums" in caplog.text


def test_without_the_native_library_every_read_is_sha256_checked(built, tmp_path, monkeypatch,
                                                                  caplog):
    from mtplx_runtime.kernels import cpu_native
    monkeypatch.setattr(cpu_native, "unavailable_reason", lambda: "no compiler (test)")
    with open_source(built) as a:
        bank = a.expert_layout
    key = (bank.layers[0], 1)
    data = read_record(bank, built, key)
    d = RecordDigests(built, bank.manifest, receipts=tmp_path)
    assert "SHA-256 only" in caplog.text and "no compiler (test)" in caplog.text
    for _ in range(2):
        assert d.check(key).verify(memoryview(data)) is None
    assert counts(d) == {"xxh3": 0, "sha256": 2, "relearned": 0} and d.learned() == 0
    data[5] ^= 1
    assert "do not match sha256" in d.check(key).verify(memoryview(data))


def test_a_record_damaged_after_its_xxh3_was_learned_stops_generate(art, capsys):
    """The learned path end to end: a clean run learns every record it reads and saves them at
    close; a byte flipped afterwards is caught by XXH3 and confirmed by SHA-256."""
    assert generate_cli(art) == 0
    with open_source(art) as a:
        bank = a.expert_layout
    values = np.frombuffer(RecordDigests(art, bank.manifest).path.read_bytes()[16:], "<u8")
    learned = [r for r, v in zip(bank.manifest.records, values) if v]
    assert learned and len(learned) < len(values)
    capsys.readouterr()
    for r in learned:  # only records read (and learned) before: the XXH3 path must catch them
        part, offset, _, _ = bank.locate(r.layer, r.expert)
        flip(art / bank.manifest.sidecar.parts[part].file, offset + 100)
    assert generate_cli(art) == 2
    err = capsys.readouterr().err
    assert "expert (layer 1, expert" in err and "do not match sha256" in err


# ---- issue 35: what is hashed is what is read; the receipt directory is not trusted blindly --

HOLD_LOAD = """
import sys
import mtplx_runtime
from mtplx_runtime.artifact.integrity import IntegrityError
from mtplx_runtime.engine import runtime
real = runtime.model_tokenizer
def held(root):  # the shards are open now (a tokenizer load takes its time on K3): hold here
    print("opened", flush=True)
    sys.stdin.readline()
    return real(root)
runtime.model_tokenizer = held
try:
    with mtplx_runtime.load(sys.argv[1], dtype="float32", kernels="reference",
                            cache_slots=(2, 0)) as rt:
        print("loaded", flush=True)
except IntegrityError as e:
    print("refused", e, flush=True)
    sys.exit(3)
"""


def resident_shard(art):
    m = load_manifest(art / MANIFEST_NAME)
    head = next(t for t in m.resident_tensors if t.tensor.endswith("lm_head.weight"))
    return m, head


def test_a_shard_renamed_over_during_load_is_not_used_unverified(art, tmp_path):
    """A damaged shard sits at the path when load opens it; the good one is renamed over the
    path while the tokenizer loads. The check must hash the file the residents are read from
    (it once hashed the path, found the good file, and the run used the damaged one)."""
    _, head = resident_shard(art)
    shard = art / head.shard
    good = art / ".good"
    shutil.copyfile(shard, good)
    flip(shard, head.offset + 7)  # damaged in place: the file load will open
    env = {**os.environ, integrity.RECEIPTS_ENV: str(tmp_path / "receipts")}
    proc = subprocess.Popen([sys.executable, "-c", HOLD_LOAD, str(art)], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "opened"
        os.replace(good, shard)  # the good bytes at the path, the damaged ones still open
        out, _ = proc.communicate("\n", timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 3 and out.startswith("refused") and head.shard in out, out


def native():
    """kernels.cpu_native; the test is skipped where the library cannot be built."""
    from mtplx_runtime.kernels import cpu_native
    if cpu_native.unavailable_reason() is not None:
        pytest.skip(cpu_native.unavailable_reason())
    return cpu_native


def record_of(built, expert: int):
    """(bank, key, manifest index, bytes) of `expert`'s record in the first routed layer."""
    with open_source(built) as a:
        bank = a.expert_layout
    key = (bank.layers[0], expert)
    i = [(r.layer, r.expert) for r in bank.manifest.records].index(key)
    return bank, key, i, read_record(bank, built, key)


def test_a_forged_learned_value_does_not_pass_overwritten_bytes(built, tmp_path):
    """Whoever can write a bank part can compute the XXH3 of the bytes they write; writing it
    into the checksum file must not make the read pass (the kept value is keyed)."""
    cpu_native = native()
    bank, key, i, data = record_of(built, 2)
    d = RecordDigests(built, bank.manifest, receipts=tmp_path)
    assert d.check(key).verify(memoryview(data)) is None
    d.save()
    data[100] ^= 0x10  # the record overwritten ...
    raw = bytearray(d.path.read_bytes())
    raw[16 + 8 * i:24 + 8 * i] = cpu_native.xxh3(memoryview(data)).to_bytes(8, "little")
    d.path.write_bytes(bytes(raw))  # ... and its new XXH3 written where the learned value was
    forged = RecordDigests(built, bank.manifest, receipts=tmp_path)
    assert "do not match sha256" in forged.check(key).verify(memoryview(data))


def record_tag(key: bytes, path, i: int, value: int) -> int:
    """Record `i`'s kept tag as FORMAT.md "Verifying and reading" defines it."""
    mac = hashlib.blake2b(key=key, digest_size=8, person=b"mtplx-xxh3")
    mac.update(path.name.encode() + i.to_bytes(8, "little") + value.to_bytes(8, "little"))
    return int.from_bytes(mac.digest(), "little") or 1


def spy_seeds(monkeypatch) -> list[int]:
    """The seeds of every native XXH3 call from now on, in order."""
    cpu_native = native()
    real, seeds = cpu_native.xxh3, []

    def spy(view, seed=0):
        seeds.append(seed)
        return real(view, seed)

    monkeypatch.setattr(cpu_native, "xxh3", spy)
    return seeds


def test_the_learned_xxh3_is_seeded_with_a_secret_of_the_receipt_key(built, tmp_path,
                                                                     monkeypatch):
    """What is hashed, kept and compared is the XXH3 under the record seed (FORMAT.md: keyed
    BLAKE2b of the receipt key, person `mtplx-xxh3-seed`), never the seed-0 XXH3 that anyone
    who can read a bank part can compute; another key gives another seed."""
    real, seeds = native().xxh3, spy_seeds(monkeypatch)
    bank, key, i, data = record_of(built, 4)
    used = {}
    for user in ("alice", "bob"):
        d = RecordDigests(built, bank.manifest, receipts=tmp_path / user)
        assert d.check(key).verify(memoryview(data)) is None
        d.save()
        secret = (tmp_path / user / integrity.KEY_NAME).read_bytes()
        seed = int.from_bytes(hashlib.blake2b(key=secret, digest_size=8,
                                              person=b"mtplx-xxh3-seed").digest(), "little")
        assert seeds == [seed] == [integrity.record_seed(secret)] and seed != 0
        used[user] = seeds.pop()
        kept = int(np.frombuffer(d.path.read_bytes(), "<u8", offset=16)[i])
        assert kept == record_tag(secret, d.path, i, real(data, seed))
        assert kept != record_tag(secret, d.path, i, real(data, 0))
    assert used["alice"] != used["bob"]


def test_a_changed_receipt_key_means_relearning(built, tmp_path, monkeypatch):
    """Values learned under one key (so one seed) are tags nothing computed under another key
    matches: after the key changes a good record passes by SHA-256 and is relearned under the new
    seed (no false failure), a damaged one fails (no false pass)."""
    seeds = spy_seeds(monkeypatch)
    bank, key, _, data = record_of(built, 6)
    d = RecordDigests(built, bank.manifest, receipts=tmp_path)
    assert d.check(key).verify(memoryview(data)) is None
    d.save()
    key_file = tmp_path / integrity.KEY_NAME
    old = key_file.read_bytes()
    key_file.unlink()
    key_file.write_bytes(os.urandom(32))
    key_file.chmod(0o600)
    seeds.clear()
    again = RecordDigests(built, bank.manifest, receipts=tmp_path)
    assert again.learned() == 1  # the file fits the manifest: read, its tag just never matches
    damaged = bytearray(data)
    damaged[100] ^= 0x10
    assert "do not match sha256" in again.check(key).verify(memoryview(damaged))
    assert again.check(key).verify(memoryview(data)) is None
    assert again.check(key).verify(memoryview(data)) is None
    assert counts(again) == {"xxh3": 1, "sha256": 1, "relearned": 1}
    new_seed = integrity.record_seed(key_file.read_bytes())
    assert set(seeds) == {new_seed} and new_seed != integrity.record_seed(old)


def test_learned_values_of_the_unseeded_version_are_ignored(built, tmp_path, caplog):
    """A `MTPLXXHK` file (the previous version: keyed tags of the seed-0 XXH3) is not read, even
    with tags made under this very key: each record's first read pays SHA-256 once."""
    cpu_native = native()
    bank, key, i, data = record_of(built, 7)
    path = RecordDigests(built, bank.manifest, receipts=tmp_path).path
    secret = (tmp_path / integrity.KEY_NAME).read_bytes()
    tags = np.zeros(len(bank.manifest.records), "<u8")
    tags[i] = record_tag(secret, path, i, cpu_native.xxh3(memoryview(data)))
    path.write_bytes(b"MTPLXXHK" + len(tags).to_bytes(8, "little") + tags.tobytes())
    with caplog.at_level(logging.INFO, logger="mtplx_runtime.offload.digests"):
        d = RecordDigests(built, bank.manifest, receipts=tmp_path)
    assert d.learned() == 0 and "an earlier version's" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    for _ in range(2):
        assert d.check(key).verify(memoryview(data)) is None
    assert counts(d) == {"xxh3": 1, "sha256": 1, "relearned": 0}


def test_without_a_receipt_directory_the_seed_is_random_per_process(built, tmp_path,
                                                                    monkeypatch):
    """No usable receipt directory: each RecordDigests takes a random key (so seed) of its own,
    learns in memory only and keeps nothing."""
    seeds = spy_seeds(monkeypatch)
    receipts = tmp_path / "receipts"
    receipts.mkdir(mode=0o777)
    receipts.chmod(0o777)  # writable by others: not used
    bank, key, _, data = record_of(built, 1)
    used = []
    for _ in range(2):
        d = RecordDigests(built, bank.manifest, receipts=receipts)
        for _ in range(2):
            assert d.check(key).verify(memoryview(data)) is None
        assert counts(d) == {"xxh3": 1, "sha256": 1, "relearned": 0}
        d.save()
        assert not d.path.exists()
        assert len(set(seeds)) == 1 and seeds[0] != 0
        used.append(seeds[0])
        seeds.clear()
    assert used[0] != used[1]
    assert fast_hash(receipts) is None  # nothing to learn for: `verify --records` hashes nothing


def test_bytes_colliding_with_a_record_under_seed_0_do_not_pass(built, tmp_path, monkeypatch):
    """XXH3 is not collision-resistant: whoever can write a bank part can read a record and
    craft other bytes with its XXH3 under a seed they know. Stand-in for such bytes: a damaged
    record whose seed-0 XXH3 is made the original's. With the seed secret they fail (with seed
    0, as before, they passed by XXH3 alone)."""
    cpu_native = native()
    bank, key, _, data = record_of(built, 5)
    d = RecordDigests(built, bank.manifest, receipts=tmp_path)
    assert d.check(key).verify(memoryview(data)) is None  # learned
    forged = bytearray(data)
    forged[100] ^= 0x10
    real, target = cpu_native.xxh3, cpu_native.xxh3(memoryview(data))

    def colliding(view, seed=0):
        return target if seed == 0 and bytes(view) == forged else real(view, seed)

    monkeypatch.setattr(cpu_native, "xxh3", colliding)
    assert colliding(memoryview(forged)) == target  # the crafted collision
    assert "do not match sha256" in d.check(key).verify(memoryview(forged))
    assert d.check(key).verify(memoryview(data)) is None and d.stats()["xxh3"] == 1


def test_a_rewritten_receipt_does_not_skip_a_swapped_shard(art, tmp_path, monkeypatch):
    """A receipt rewritten to the identity of a shard swapped in must not be trusted."""
    monkeypatch.setenv(integrity.RECEIPTS_ENV, str(tmp_path / "receipts"))
    m, head = resident_shard(art)
    assert integrity.admit_shards(art, m).hashed
    shard = art / head.shard
    bad = tmp_path / "bad.safetensors"
    shutil.copyfile(shard, bad)
    flip(bad, head.offset + 7)
    os.replace(bad, shard)
    receipt = integrity.receipt_path(art, m, ".json")
    body = json.loads(receipt.read_text())
    st = os.stat(shard)
    body["shards"][head.shard] = [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
                                  st.st_ctime_ns]
    receipt.write_text(json.dumps(body))
    with pytest.raises(IntegrityError, match=head.shard):
        integrity.admit_shards(art, m)


@pytest.mark.parametrize("how", ["mode", "owner", "key-mode"])
def test_a_receipt_directory_others_can_write_is_not_used(art, tmp_path, monkeypatch, caplog,
                                                          how):
    receipts = tmp_path / f"receipts-{how}"
    monkeypatch.setenv(integrity.RECEIPTS_ENV, str(receipts))
    m, _ = resident_shard(art)
    shards = integrity.admit_shards(art, m).hashed
    assert integrity.admit_shards(art, m).trusted == shards  # a private directory: trusted
    if how == "mode":
        os.chmod(receipts, 0o777)
        why = "writable by group or others"
    elif how == "owner":
        if os.geteuid() != 0:
            pytest.skip("giving a directory away needs root")
        os.chown(receipts, os.geteuid() + 12345, -1)
        why = "owned by uid"
    else:
        os.chmod(receipts / integrity.KEY_NAME, 0o644)
        why = "secret.key is readable by group or others"
    third = integrity.admit_shards(art, m)
    assert third.hashed == shards and not third.trusted
    assert why in caplog.text and "not using the receipt directory" in caplog.text
    with open_source(art) as a:
        bank = a.expert_layout
    d = RecordDigests(art, bank.manifest)
    key = (bank.layers[0], 0)
    assert d.check(key).verify(memoryview(read_record(bank, art, key))) is None
    d.save()
    assert not d.path.exists()  # nothing learned is kept where others could rewrite it
    assert fast_hash() is None  # so `mtplx verify --records` does not hash for it either
