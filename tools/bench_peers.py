"""bench_peers: mtplx_runtime beside llama.cpp on one K3-geometry MXFP4 model, same memory cap.

    llama-cpp-python sdist (pinned) -> its vendored llama.cpp, cmake CPU build, cached
                                       (~/.cache/mtplx/peers) -> bench_peers_driver.c on llama.h
    make_k3_slice(codec=mxfp4): real expert shapes (latent 3584, width 3072, 896 experts, top-16),
        small trunk, official MXFP4 layout
        -> llama.cpp's convert_hf_to_gguf.py (its MXFP4 repack)  -> model.gguf
        -> mtplx build-manifest --codec keep                    -> our streaming artifact
    check: experts decode to the same float32 values from the GGUF (gguf-py) and from our records
    baseline: each engine decodes a 16-expert slice with the same trunk, uncapped; its cgroup peak
        less the 16 experts' bytes is its footprint with no expert held; the larger one counts
    per cap (baseline + 5 %, 25 %, 100 % of the expert bytes): a memory cgroup with that hard
        limit (page cache included), the models' pages evicted first (checked with mincore),
        each engine run as a child in it: ours with --memory-budget = cap, cold (empty cache)
        and then warm (the next start: the cache filled before the prompt from the counts the
        cold run wrote, --warm); llama.cpp as users run it (mmap, default repack), mmap without
        repack, and --no-mmap.

One line per (cap, engine); then per cap the ratio of each of our runs to llama.cpp's best.
Every engine gets the same prompt ids (tokenized once by our tokenizer), greedy, the same number
of tokens, 2 threads. Disk bytes come from /proc/self/io read_bytes inside each engine, split at
the end of load, prefill and decode; peak RSS from getrusage; the cgroup's peak from its
max_usage (v1) or memory.peak (v2).

    python tools/bench_peers.py --work /work/peers            # build, convert, run, print
    python tools/bench_peers.py --work /work/peers --caps 5   # one cap
    python tools/bench_peers.py --work /work/peers --caps 100,none   # and without a cap

Needs root for the cgroup and a Linux memory controller; not part of `make test`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
LLAMA_CPP_PYTHON = "0.3.36"  # the pinned llama-cpp-python sdist; its vendor/llama.cpp is the peer
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DGGML_CUDA=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
               "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF")
DRIVER_SRC = Path(__file__).with_name("bench_peers_driver.c")
PROMPT = ("the model reads one token at a time and writes one token at a time between the two "
          "every layer mixes what it has seen with what it is seeing now")
THREADS = 2
CAP_PERCENTS = (5, 25, 100)
BASE_EXPERTS = 16  # the baseline slice: every expert of it is held (top-16 of 16)
RUN_TIMEOUT_S = 900
# llama.cpp configurations: (name, load mode, repack)
LLAMA_CONFIGS = (("llama.cpp mmap", "mmap", 1), ("llama.cpp mmap no-repack", "mmap", 0),
                 ("llama.cpp no-mmap", "none", 1))


# ---- the memory cgroup ----

class CgroupError(RuntimeError):
    pass


class MemoryCgroup:
    """A memory cgroup with a hard limit, page cache included: v2 `memory.max` / `memory.peak`
    where the unified hierarchy has the memory controller, else v1's `memory.limit_in_bytes` /
    `memory.max_usage_in_bytes`. `root` is the cgroup mount (a fake directory in tests)."""

    def __init__(self, name: str, root: str | os.PathLike = "/sys/fs/cgroup"):
        root = Path(root)
        if (root / "cgroup.controllers").exists():
            if "memory" not in (root / "cgroup.controllers").read_text().split():
                raise CgroupError(f"{root}: cgroup v2 without the memory controller")
            self.version, self.path = 2, root / name
        elif (root / "memory" / "memory.limit_in_bytes").exists():
            self.version, self.path = 1, root / "memory" / name
        else:
            raise CgroupError(f"{root}: no memory cgroup controller (v1 memory/ or v2 "
                              "cgroup.controllers)")
        self.path.mkdir(exist_ok=True)

    def _file(self, v1: str, v2: str) -> Path:
        return self.path / (v1 if self.version == 1 else v2)

    def set_limit(self, nbytes: int | None) -> None:
        """Hard limit in bytes; None lifts it."""
        if self.version == 1:
            value = str(nbytes) if nbytes is not None else "-1"
        else:
            value = str(nbytes) if nbytes is not None else "max"
        self._file("memory.limit_in_bytes", "memory.max").write_text(value)
        self.reset_peak()

    def reset_peak(self) -> None:
        # v1 resets max_usage on any write; v2's memory.peak resets per writer (kernel 6.12+),
        # elsewhere it cannot: a fresh cgroup per run is what makes the peak a run's own.
        f = self._file("memory.max_usage_in_bytes", "memory.peak")
        if self.version == 1 or f.exists():
            try:
                f.write_text("0")
            except OSError:
                if self.version == 1:
                    raise

    def peak(self) -> int:
        return int(self._file("memory.max_usage_in_bytes", "memory.peak").read_text().split()[0])

    def _fields(self, name: str) -> dict[str, str]:
        """A flat keyed file ("name value" lines) as a dict; {} when the kernel has none."""
        f = self.path / name
        if not f.exists():
            return {}
        return dict(line.split() for line in f.read_text().splitlines() if line.strip())

    def oom_kills(self) -> int:
        """OOM kills inside the cgroup (v1: under_oom/oom_kill in memory.oom_control)."""
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        return int(self._fields(name).get("oom_kill", 0))

    def limit_hits(self) -> int:
        """Times usage reached the limit and had to reclaim (v1 `memory.failcnt`, v2 the `max`
        count of `memory.events`): 0 when a limit never pressed the cgroup."""
        if self.version == 1:
            f = self.path / "memory.failcnt"
            return int(f.read_text()) if f.exists() else 0
        return int(self._fields("memory.events").get("max", 0))

    def kmem_peak(self) -> int | None:
        """The kernel-memory part of the peak (page tables, slab): v1 only, v2 keeps none."""
        f = self.path / "memory.kmem.max_usage_in_bytes"
        return int(f.read_text()) if self.version == 1 and f.exists() else None

    def procs_file(self) -> Path:
        return self.path / "cgroup.procs"

    def remove(self) -> None:
        self.path.rmdir()


def in_cgroup(procs: Path):
    """preexec_fn placing the child in the cgroup before it execs, so its every page counts."""
    def enter() -> None:
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
    return enter


# ---- the page cache ----

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is no package
import bench_io  # noqa: E402  (after the path fix)

# A cold start: the files dropped from the page cache, checked empty with mincore.
evict = bench_io.evict


def model_files(path: Path) -> list[Path]:
    return sorted(p for p in ([path] if path.is_file() else path.rglob("*")) if p.is_file())


# ---- results ----

@dataclass
class Run:
    """One engine run: what both engines report, the same fields."""

    engine: str
    cap: int | None  # bytes; None = no limit
    status: str  # ok | oom | timeout | error: <reason>
    ids: list[int]
    load_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_forwards: int = 0
    read_load: int = 0
    read_prefill: int = 0
    read_decode: int = 0
    maxrss: int = 0  # bytes
    cgroup_peak: int = 0
    wall_s: float = 0.0  # the child's whole life

    @property
    def tok_s(self) -> float:
        return self.decode_forwards / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def read_per_token(self) -> float:
        return self.read_decode / self.decode_forwards if self.decode_forwards else 0.0


def parse_report(engine: str, cap: int | None, stdout: str) -> Run:
    """The one JSON object a child (the C driver or `--child-ours`) prints last on stdout."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    if not lines:
        raise ValueError(f"{engine}: no JSON report on stdout: {stdout[-300:]!r}")
    d = json.loads(lines[-1])
    missing = {"ids", "load_s", "prefill_s", "decode_s", "decode_forwards", "read_load",
               "read_prefill", "read_decode", "maxrss_kib"} - set(d)
    if missing:
        raise ValueError(f"{engine}: report lacks {sorted(missing)}")
    if min(d["read_load"], d["read_prefill"], d["read_decode"]) < 0:
        raise ValueError(f"{engine}: /proc/self/io was not readable")
    return Run(engine, cap, "ok", [int(i) for i in d["ids"]], float(d["load_s"]),
               float(d["prefill_s"]), float(d["decode_s"]), int(d["decode_forwards"]),
               int(d["read_load"]), int(d["read_prefill"]), int(d["read_decode"]),
               int(d["maxrss_kib"]) * 1024)


def agreement(a: list[int], b: list[int]) -> int:
    """Leading ids two greedy runs share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def run_line(r: Run, ref: list[int]) -> str:
    cap = "none" if r.cap is None else gb(r.cap)
    if r.status != "ok":
        return f"peers cap_gb={cap} engine={r.engine!r} status={r.status}"
    return (f"peers cap_gb={cap} engine={r.engine!r} status=ok tok_s={r.tok_s:.3f} "
            f"decode_read_gb_per_tok={gb(r.read_per_token)} prefill_read_gb={gb(r.read_prefill)} "
            f"load_read_gb={gb(r.read_load)} load_s={r.load_s:.1f} peak_rss_gb={gb(r.maxrss)} "
            f"cgroup_peak_gb={gb(r.cgroup_peak)} same_first_ids={agreement(r.ids, ref)}/"
            f"{len(ref)} wall_s={r.wall_s:.0f} ids={','.join(map(str, r.ids))} "
            f"load={os.getloadavg()[0]:.1f}")


# ---- the peer: build ----

def llama_dir(cache: Path) -> Path:
    return cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"


def ensure_llama(cache: Path) -> tuple[Path, Path]:
    """(llama.cpp source dir, the driver binary): download, build and compile what is missing."""
    cache.mkdir(parents=True, exist_ok=True)
    src = llama_dir(cache)
    if not (src / "CMakeLists.txt").exists():
        sdist = cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
        if not sdist.exists():
            print(f"bench_peers: downloading llama-cpp-python {LLAMA_CPP_PYTHON} (sdist)",
                  file=sys.stderr)
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                            "--no-binary", ":all:", f"llama-cpp-python=={LLAMA_CPP_PYTHON}",
                            "-d", str(cache)], check=True)
        with tarfile.open(sdist) as t:
            t.extractall(cache, filter="data")
    build = src / "build"
    stamp = build / "mtplx-flags.txt"
    lib = build / "bin" / "libllama.so"
    if not lib.exists() or not stamp.exists() or stamp.read_text() != " ".join(CMAKE_FLAGS):
        print("bench_peers: building llama.cpp (CPU; about 15-20 min on 2 cores)", file=sys.stderr)
        subprocess.run(["cmake", "-S", str(src), "-B", str(build), *CMAKE_FLAGS], check=True,
                       stdout=subprocess.DEVNULL)
        subprocess.run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2),
                        "--target", "llama"], check=True)
        stamp.write_text(" ".join(CMAKE_FLAGS))
    driver = build / "bench_peers_driver"
    if not driver.exists() or driver.stat().st_mtime < DRIVER_SRC.stat().st_mtime:
        subprocess.run(["gcc", "-O2", "-o", str(driver), str(DRIVER_SRC),
                        f"-I{src / 'include'}", f"-I{src / 'ggml' / 'include'}",
                        f"-L{build / 'bin'}", "-lllama", "-lggml", "-lggml-base",
                        f"-Wl,-rpath,{build / 'bin'}"], check=True)
    return src, driver


def llama_version(src: Path) -> str:
    """libllama's version and commit as its build generated them (e.g. 0.5.0-dev 0c1e570)."""
    text = (src / "build" / "src" / "llama-version.h").read_text()
    defs = dict(line.split()[1:3] for line in text.splitlines() if line.startswith("#define"))
    return f"libllama {defs['LLAMA_VERSION'].strip(chr(34))} {defs['LLAMA_COMMIT'].strip(chr(34))}"


# ---- the model: slice, GGUF, artifact ----

def convert_child(src_dir: str, out: str, llama: str) -> None:
    """Run llama.cpp's convert_hf_to_gguf.py on `src_dir` in this process, with one shim: the
    toy tokenizer has no tokenization_kimi.py, so its vocabulary is handed to llama.cpp's own
    kimi-k2 vocabulary code as the object that module expects (same ranks, same specials). The
    tensors, the MXFP4 expert repack included, are llama.cpp's conversion untouched."""
    sys.path[:0] = [llama, str(Path(llama) / "gguf-py")]
    import conversion.base as base
    import transformers

    from mtplx_runtime.engine.tokenizer import load_tokenizer, read_ranks

    class ToyKimiTokenizer:
        def __init__(self, path):
            tok = load_tokenizer(path)
            self.model = type("Model", (), {"_mergeable_ranks": read_ranks(
                Path(path) / "tiktoken.model")})()
            self.special_tokens = {s.text: s.id for s in tok.specials}
            self.eos_id = tok.eos_id

    transformers.AutoTokenizer.from_pretrained = lambda path, **kw: ToyKimiTokenizer(path)
    # Both split text with K3's pattern, which llama.cpp names kimi-k2.
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "kimi-k2"
    import runpy
    sys.argv = ["convert_hf_to_gguf.py", src_dir, "--outfile", out, "--outtype", "bf16"]
    runpy.run_path(str(Path(llama) / "convert_hf_to_gguf.py"), run_name="__main__")


def make_models(work: Path, src_llama: Path, experts: int, tag: str) -> tuple[Path, Path]:
    """(GGUF path, artifact dir) of a one-MoE-layer MXFP4 slice with `experts` experts."""
    from mtplx_runtime.artifact.open import is_artifact
    from mtplx_runtime.fixtures.k3_slice import make_k3_slice

    d = work / tag
    ckpt, gguf_path, art = d / "src", d / "model.gguf", d / "art"
    if not is_artifact(art) or not gguf_path.exists():
        if not (ckpt / "model.safetensors.index.json").exists():
            print(f"bench_peers: writing the {tag} slice ({experts} experts)", file=sys.stderr)
            make_k3_slice(ckpt, moe_layers=1, experts=experts, codec="mxfp4")
    if not gguf_path.exists():
        print(f"bench_peers: llama.cpp converts {tag} to GGUF", file=sys.stderr)
        subprocess.run([sys.executable, __file__, "--child-convert", str(ckpt),
                        str(gguf_path) + ".partial", str(src_llama)], check=True)
        os.replace(str(gguf_path) + ".partial", gguf_path)
    if not is_artifact(art):
        print(f"bench_peers: building our artifact of {tag}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "mtplx_runtime", "build-manifest", str(ckpt),
                        str(art), "--codec", "keep", "--no-progress"], check=True)
    if ckpt.exists():
        shutil.rmtree(ckpt)  # the two engines' copies are all the runs read
    return gguf_path, art


def check_experts(gguf_path: Path, art: Path, src_llama: Path, layer: int,
                  experts: list[int]) -> str:
    """Dequantize experts from the GGUF with gguf-py and from our records with our codec; the
    float32 values must be identical (the MXFP4 repack is lossless)."""
    sys.path.insert(0, str(src_llama / "gguf-py"))
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from mtplx_runtime.artifact.open import open_artifact

    reader = GGUFReader(gguf_path)
    tensors = {t.name: t for t in reader.tensors}
    ck = open_artifact(art)
    try:
        for e in experts:
            ours = ck.expert(layer, e).decode()
            for proj in ("gate", "up", "down"):
                t = tensors[f"blk.{layer}.ffn_{proj}_exps.weight"]
                theirs = dequantize(np.asarray(t.data[e]), t.tensor_type)
                if not np.array_equal(theirs.astype(np.float32), ours[proj]):
                    raise SystemExit(f"bench_peers: expert {e} {proj} decodes differently in "
                                     "the GGUF and in our artifact")
    finally:
        ck.close()
    return f"experts {experts} x gate/up/down identical"


# ---- runs ----

def ours_child(art: str, cap: str, warm: str, n: int, ids: list[int]) -> None:
    """Our engine, timed like the driver: load, prefill, decode; /proc/self/io at each end.
    `warm`: a warm-start file; when it exists the cache is filled from it before the prompt,
    and that counts as load (as --no-mmap's whole read counts as llama.cpp's load)."""
    import resource

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the mtplx command sets it
    import torch

    import mtplx_runtime
    from mtplx_runtime.engine.generate import GenerationStats, generate_step

    def read_bytes() -> int:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
        return -1

    torch.set_num_threads(THREADS)
    t0 = time.perf_counter()
    # The context llama.cpp's driver sizes (n_ctx = prompt + tokens + 16): the default
    # afforded context (up to 32K) would spend cache slots on attention room this run never uses.
    rt = mtplx_runtime.load(art, memory_budget=None if cap == "none" else int(cap),
                            kernels="cpu", warm=warm, tokenizer=False, context=len(ids) + n + 16)
    if rt.provider.warm is not None:
        rt.provider.warm.wait()
    load_s, r_load = time.perf_counter() - t0, read_bytes()
    stats = GenerationStats()
    out, r_prefill = [], 0
    for tok in generate_step(rt.model, ids, max_tokens=n, stats=stats):
        if not out:
            r_prefill = read_bytes()
        out.append(tok)
    r_end = read_bytes()
    rt.close()
    print(json.dumps({
        "ids": out, "load_s": load_s, "prefill_s": stats.prefill_s, "decode_s": stats.decode_s,
        "decode_forwards": stats.decode_forwards, "read_load": r_load,
        "read_prefill": r_prefill - r_load, "read_decode": r_end - r_prefill,
        "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))


def run_engine(engine: str, argv: list[str], cap: int | None, files: list[Path],
               cg_root: str, env: dict) -> Run:
    evict(files)
    cg = MemoryCgroup(f"mtplx_peers_{os.getpid()}_{time.monotonic_ns()}", cg_root)
    try:
        cg.set_limit(cap)
        t0 = time.perf_counter()
        try:
            p = subprocess.run(argv, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                               preexec_fn=in_cgroup(cg.procs_file()), env=env)
        except subprocess.TimeoutExpired:
            return Run(engine, cap, "timeout", [])
        if cg.oom_kills() or p.returncode in (-9, 137):
            return Run(engine, cap, "oom", [])
        if p.returncode != 0:
            why = (p.stderr.strip().splitlines() or ["?"])[-1][:160]
            return Run(engine, cap, f"error: {why}", [])
        r = parse_report(engine, cap, p.stdout)
        r.cgroup_peak, r.wall_s = cg.peak(), time.perf_counter() - t0
        return r
    finally:
        cg.remove()


def engines(art: Path, gguf_path: Path, driver: Path, n: int, ids: list[int], cap: int | None,
            warm: Path):
    """(name, argv, files it reads) per engine configuration at `cap`. Ours runs twice: cold
    (the cache starts empty and `warm` does not exist; the run writes its expert counts there)
    and warm (the next start, filled from `warm` before the prompt)."""
    budget = "none" if cap is None else str(cap)
    warm.unlink(missing_ok=True)
    for name in ("mtplx", "mtplx warm"):
        yield (name, [sys.executable, __file__, "--child-ours", str(art), budget, str(warm),
                      str(n), *map(str, ids)], model_files(art))
    for name, mode, repack in LLAMA_CONFIGS:
        yield (name, [str(driver), str(gguf_path), mode, str(repack), str(THREADS), str(n),
                      *map(str, ids)], [gguf_path])


def commit() -> str:
    r = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                       capture_output=True, text=True)
    return r.stdout.strip() or "?"


def parse_caps(text: str) -> list[int | None]:
    """'5,25,100,none' -> [5, 25, 100, None] (None: no cap)."""
    try:
        return [None if x.strip() == "none" else int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"caps: percentages or 'none', not {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, required=True,
                    help="where the slices, GGUFs and artifacts go (about 32 GB for 896 experts)")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "mtplx" / "peers",
                    help="llama.cpp source and build (reused)")
    ap.add_argument("--experts", type=int, default=896)
    ap.add_argument("--tokens", type=int, default=16, help="greedy tokens per run")
    ap.add_argument("--caps", type=parse_caps, default=list(CAP_PERCENTS),
                    help="caps, %% of the expert bytes over baseline; 'none' runs every engine "
                         "without a cap (llama.cpp's --no-mmap needs more than 100 %%)")
    ap.add_argument("--cgroup-root", default="/sys/fs/cgroup")
    return ap


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child-convert"]:
        convert_child(*argv[1:4])
        return 0
    if argv[:1] == ["--child-ours"]:
        ours_child(argv[1], argv[2], argv[3], int(argv[4]), [int(x) for x in argv[5:]])
        return 0
    a = build_parser().parse_args(argv)
    try:  # fail before an hour of building and converting
        MemoryCgroup("mtplx_peers_probe", a.cgroup_root).remove()
    except (CgroupError, OSError) as e:
        raise SystemExit(f"bench_peers: {e}") from None
    src, driver = ensure_llama(a.cache)
    version = llama_version(src)
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS), MTPLX_CPU_THREADS=str(THREADS),
               PYTHONPATH=str(ROOT))
    base_gguf, base_art = make_models(a.work, src, BASE_EXPERTS, "base")
    gguf_path, art = make_models(a.work, src, a.experts, "k3")

    from mtplx_runtime.artifact.manifest import MANIFEST_NAME, load_manifest
    from mtplx_runtime.engine.tokenizer import load_tokenizer

    ids = load_tokenizer(art).encode(PROMPT)
    records = load_manifest(art / MANIFEST_NAME).records
    expert_bytes, record = sum(r.logical_bytes for r in records), records[0].logical_bytes
    print(f"peers header llama-cpp-python={LLAMA_CPP_PYTHON} {version} "
          f"cmake='{' '.join(CMAKE_FLAGS)}' threads={THREADS} tokens={a.tokens} "
          f"prompt_ids={len(ids)} experts={a.experts} commit={commit()} "
          f"{check_experts(gguf_path, art, src, 1, [0, 1, a.experts - 1])}", flush=True)

    foot = {}
    warm = a.work / "counts.warm"
    for name, cmd, files in engines(base_art, base_gguf, driver, a.tokens, ids, None, warm):
        r = run_engine(name, cmd, None, files, a.cgroup_root, env)
        if r.status != "ok":
            raise SystemExit(f"bench_peers: baseline run of {name} failed: {r.status}")
        foot[name] = r.cgroup_peak - BASE_EXPERTS * record
        print(f"peers baseline engine={name!r} cgroup_peak_gb={gb(r.cgroup_peak)} "
              f"footprint_gb={gb(foot[name])}", flush=True)
    baseline = max(foot.values())
    for pct in a.caps:
        cap = None if pct is None else baseline + expert_bytes * pct // 100
        runs = []
        for name, cmd, files in engines(art, gguf_path, driver, a.tokens, ids, cap, warm):
            runs.append(run_engine(name, cmd, cap, files, a.cgroup_root, env))
            print(run_line(runs[-1], runs[0].ids), flush=True)
        best = max((r for r in runs if r.status == "ok" and r.engine.startswith("llama")),
                   key=lambda r: r.tok_s, default=None)
        for ours in runs[:2]:
            if ours.status == "ok" and best is not None:
                where = "none" if cap is None else gb(cap)
                print(f"peers ratio cap_pct={pct or 'none'} cap_gb={where} engine={ours.engine!r} "
                      f"over_best_llama={ours.tok_s / best.tok_s:.2f} (best: {best.engine!r} "
                      f"{best.tok_s:.3f} tok/s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
