"""`mtplx demo`: the README's main command. Streamed generation from a small Kimi K3.

    first run: shipped trained checkpoint (or make_tiny(t158) with --random-weights)
      -> build_artifact -> cache dir (reused while complete)
    load(artifact) + StreamingExpertProvider (a cache smaller than the experts) -> text streamed
    -> stats table: per-tier hits, bytes read per token, stall share, tok/s, the I/O bound

The same prompt is then run with every expert resident (decoded once, kept in memory) and the
two id sequences are compared. `--codecs` adds the per-codec fixture table (`fixtures.codec_table`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import time
from pathlib import Path

from .common import note_native_build

PROMPT = "The LORD is my shepherd;"
# The small K3 trained on the King James Bible by tools/train_tiny.py (README "The trained tiny
# K3"): package data, so a wheel install runs the demo too.
TRAINED = Path(__file__).resolve().parents[1] / "fixtures" / "kimi-k3-tiny-kjv"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache-dir", default=".mtplx-cache", help="where the tiny model is built")
    p.add_argument("--prompt", default=PROMPT, help="text to continue")
    p.add_argument("--max-tokens", type=int, default=40, help="tokens to generate (greedy)")
    p.add_argument("--slots-per-layer", type=int, default=None,
                   help="device cache slots per MoE layer (default: a quarter of the experts)")
    p.add_argument("--host-slots-per-layer", type=int, default=None,
                   help="second-tier (host) cache slots per MoE layer (0: no host tier; "
                        "default: a quarter of the experts)")
    p.add_argument("--lookahead", type=int, default=1, help="prefetch this many layers ahead")
    p.add_argument("--kernels", default=None, choices=("auto", "reference", "cpu", "cuda"),
                   help="routed-expert kernels (default: $MTPLX_KERNELS, else auto)")
    p.add_argument("--random-weights", action="store_true",
                   help="stream the random-weight tiny fixture (8 experts per layer) instead of "
                        "the trained model")
    p.add_argument("--seed", type=int, default=0, help="seed of the random fixture's weights")
    p.add_argument("--rebuild", action="store_true", help="rebuild even if already built")
    p.add_argument("--codecs", action="store_true",
                   help="also build one tiny fixture per expert codec and show what each holds")


def ensure_artifact(root: Path, rebuild: bool, seed: int | None = None,
                    on_build=None) -> tuple[Path, bool]:
    """(artifact dir, built now?): the streaming artifact of the trained checkpoint (`seed`
    None) or of the random tiny t158 fixture of `seed` (written under `root` first), under
    `root`. A present manifest marks a finished build; the bank part sizes are checked too.
    `on_build(out)` is called before a build starts."""
    from ..artifact.build import build_artifact
    from ..artifact.manifest import ManifestError, load_manifest
    from ..fixtures.codec_table import fixture

    out = root / (f"tiny-t158-seed{seed}-stream" if seed is not None else f"{TRAINED.name}-stream")
    manifest = out / "expert-manifest.json"
    if not rebuild and manifest.is_file():
        try:  # a damaged or half-deleted earlier build is rebuilt, not reused
            sidecar = load_manifest(manifest).sidecar
            if sidecar is not None and all((out / p.file).stat().st_size == p.size
                                           for p in sidecar.parts):
                return out, False
        except (OSError, ManifestError):
            pass
    if on_build is not None:
        on_build(out)
    shutil.rmtree(out, ignore_errors=True)
    if seed is None:
        if not (TRAINED / "config.json").is_file():
            raise FileNotFoundError(f"the trained checkpoint is missing from {TRAINED}")
        source = TRAINED
    else:
        source = fixture(root, "t158", "t158", {}, seed, rebuild)[0].path
    build_artifact(source, out, progress=False)
    return out, True


def stream_generate(model, tok, prompt_ids: list[int], max_tokens: int, out, provider=None):
    """Greedy ids from `model`, text written to `out` as produced (special ids as ·). Returns
    (ids, GenerationStats, provider totals right after prefill or None)."""
    from ..engine.generate import GenerationStats, generate_step

    stats, ids, after_prefill = GenerationStats(), [], None
    dec = tok.stream_decoder()
    for t in generate_step(model, prompt_ids, max_tokens=max_tokens, stats=stats):
        if not ids and provider is not None:
            after_prefill = _counters(provider)
        ids.append(t)
        text = dec.flush() + "\u00b7" if tok.is_special(t) else dec.push(t)
        out.write("".join(c if c.isprintable() else "\u00b7" for c in text))
        out.flush()
    out.write(dec.flush() + "\n")
    return ids, stats, after_prefill


def _counters(provider) -> dict:
    s = provider.stats()
    pf = s["prefetch"]
    return {"tiers": s["totals"], "bytes": pf["demand_bytes"] + pf["spec_bytes"],
            "stall_ms": s["stall_ms"]}


MIN_RATE_BYTES = 64 * 2**20  # a tiny bank is ~1 MB: one cold pass of it measures noise


def measure_disk_rate(artifact: Path, min_bytes: int = MIN_RATE_BYTES) -> tuple[int, float]:
    """(bytes, seconds) of cold reads of every expert record, repeated until at least
    `min_bytes` were read: before each pass the page cache is dropped for the bank parts
    (posix_fadvise DONTNEED), then the RecordReader reads every record."""
    from ..artifact.manifest import load_manifest
    from ..formats.record import align_up
    from ..offload.bank_reader import from_manifest
    from ..offload.buffers import aligned_buffer

    man = load_manifest(artifact / "expert-manifest.json")
    stride = align_up(max(r.sidecar_length for r in man.records))
    buf = aligned_buffer(stride * len(man.records))
    total, secs = 0, 0.0
    with from_manifest(artifact, man) as reader:
        while total < min_bytes:
            for p in man.sidecar.parts:
                fd = os.open(artifact / p.file, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
            t0 = time.perf_counter()
            futures = [reader.read_record(r, buf[i * stride:(i + 1) * stride])
                       for i, r in enumerate(man.records)]
            total += sum(f.result() for f in futures)
            secs += time.perf_counter() - t0
    return total, secs


def _rate(hits: int, lookups: int) -> str:
    return f"{100 * hits / lookups:5.1f}%" if lookups else "    -"


def _tier_rows(before: dict, after: dict) -> dict[str, tuple[int, int, int]]:
    """{row: (lookups, hits, misses)}: device and host over decode; the prefill row counts the
    prompt's lookups (their misses are read into transient slots, from disk)."""
    d = {t: {k: after[t][k] - before[t][k] for k in ("lookups", "hits", "misses")}
         for t in ("compute", "host")}
    pre_hits = before["compute"]["hits"] + before["host"]["hits"]
    return {"compute": (d["compute"]["lookups"], d["compute"]["hits"], d["compute"]["misses"]),
            "host": (d["host"]["lookups"], d["host"]["hits"], d["host"]["misses"]),
            "transient": (before["compute"]["lookups"], pre_hits,
                          before["compute"]["lookups"] - pre_hits)}


def print_stats(model, provider, stats, after_prefill, disk, out) -> None:
    cfg, end = model.cfg, _counters(provider)
    s = provider.stats()
    n_dec = max(stats.decode_forwards, 1)
    per_token = len(cfg.moe_layers) * cfg.num_experts_per_token  # expert records a token uses
    caps = provider.cache.capacity()
    p = lambda *a: print(*a, file=out)  # noqa: E731
    p(f"{'cache tier':<22}{'slots':>6}{'lookups':>9}{'hits':>7}{'misses':>8}{'hit rate':>10}")
    rows = _tier_rows(after_prefill["tiers"], end["tiers"])
    for tier, phase in (("compute", "decode"), ("host", "decode"), ("transient", "prefill")):
        n, h, m = rows[tier]
        p(f"{tier + ' (' + phase + ')':<22}{caps[tier]:>6}{n:>9}{h:>7}{m:>8}{_rate(h, n):>10}")
    last = "host" if caps["host"] else "compute"  # the tier in front of the disk
    m = rows[last][2] / rows["compute"][0] if rows["compute"][0] else 0.0
    dec_bytes = (end["bytes"] - after_prefill["bytes"]) / n_dec
    pre_bytes = after_prefill["bytes"] / max(stats.prompt_tokens, 1)
    total_ms = 1000 * (stats.prefill_s + stats.decode_s)
    dedup = s["prefill_dedup"]["factor"]
    recall = s["lookahead"].get(1, {}).get("recall")
    p()
    p(f"prefill            {stats.prompt_tokens:>4} tok  {stats.prefill_tok_s:8.1f} tok/s   "
      f"dedup {dedup:.1f}x (expert uses per record read)")
    p(f"decode             {stats.decode_forwards:>4} tok  {stats.decode_tok_s:8.1f} tok/s   "
      f"miss rate m = {m:.2f} ({last} tier, decode)")
    p(f"bytes read / token {dec_bytes:>12,.0f} B decode (guesses included), {pre_bytes:,.0f} B "
      "per prompt token")
    p(f"stall share        {end['stall_ms'] / total_ms if total_ms else 0:>8.1%}   "
      f"({end['stall_ms']:.1f} of {total_ms:.1f} ms waiting for reads)")
    p("lookahead recall   " + (f"{'-':>8}" if recall is None else f"{recall:>8.1%}")
      + "   (depth 1: share of the next layer's experts guessed)")
    nbytes, secs = disk
    rate = nbytes / secs if secs > 0 else float("inf")
    bound = rate / (m * per_token * provider.stride_bytes) if m > 0 else float("inf")
    p(f"disk rate          {rate / 1e6:8.1f} MB/s  (cold read of {nbytes:,} B in "
      f"{1000 * secs:.1f} ms)")
    p(f"I/O bound          {bound:8.1f} tok/s <= rate / (m x {per_token} records/token x "
      f"{provider.stride_bytes:,} B); measured decode {stats.decode_tok_s:.1f} tok/s")
    if stats.decode_tok_s > bound:
        p("                   (decode beat the bound: its reads were faster than the cold rate "
          "measured above, e.g. served from the page cache; the bound assumes every miss is a "
          "cold disk read)")


EXPLAIN = """\
The model's routed experts live in bank files on disk; each token's router picks top-{k} of
{e} experts in each of {n} MoE layers, and a small cache holds the recent ones. compute: the
slots the kernels read from; host: the second tier that compute-tier victims fall to; transient:
the prompt's experts, read once for all its tokens (prefill) so they never evict decode experts.
A cache miss waits for a read (stall); lookahead guesses the next layer's experts from this
layer's hidden state and reads them early. The I/O bound is the fastest decode this disk
allows at this miss rate: the disk rate over the bytes a token's misses read (its formula is
the last line above). The tiny model decodes far below it (Python overhead, not reads); full
K3 reads 1,472 records of 7.7 MB per token, and there the bound is what limits decode
(`mtplx plan` estimates it for a model and a machine before you download one).
{weights} `mtplx demo --codecs`: the expert codecs."""
TRAINED_NOTE = """The model was trained on the King James Bible: it writes in its style (greedy,
so it repeats itself). Its routers are balanced as K3's are, so experts are used about evenly,
and a later layer's router guesses most of its experts a layer early (the lookahead recall
above). `mtplx generate --trace-routes FILE` records a run's routes; `mtplx profile FILE`
replays them through every cache policy."""
RANDOM_NOTE = "The weights are random, so the text is noise."


def main(args: argparse.Namespace) -> int:
    if args.max_tokens < 1 or (args.slots_per_layer is not None and args.slots_per_layer < 1) \
            or (args.host_slots_per_layer is not None and args.host_slots_per_layer < 0) \
            or args.lookahead < 0:
        print("mtplx demo: error: need --max-tokens >= 1, --slots-per-layer >= 1, "
              "--host-slots-per-layer >= 0, --lookahead >= 0", file=sys.stderr)
        return 2
    with one_compute_thread():
        return _run(args)


@contextlib.contextmanager
def one_compute_thread():
    """torch on one intra-op thread while inside: the tiny model has nothing to split, and on a
    small machine torch's threads otherwise spin against the prefetcher's I/O threads (~5x
    slower)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace) -> int:
    from ..checkpoint.config import ModelConfig
    from ..engine.runtime import load, load_model
    from ..kernels import name_of

    root = Path(args.cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    out = sys.stdout
    t0 = time.perf_counter()
    try:
        artifact, built = ensure_artifact(root, args.rebuild,
                                          args.seed if args.random_weights else None,
                                          on_build=lambda out: print(
                                              f"mtplx demo: building {out}/ (once)",
                                              file=sys.stderr, flush=True))
    except FileNotFoundError as e:
        print(f"mtplx demo: error: {e}; --random-weights runs the random fixture",
              file=sys.stderr)
        return 2
    size = sum(f.stat().st_size for f in artifact.iterdir() if f.suffix in (".bin", ".safetensors"))
    kind = "random-weight tiny" if args.random_weights else "trained small"
    print(f"mtplx demo: {kind} Kimi K3, t158 experts streamed from {artifact}/ "
          f"({'built' if built else 'reused'} in {time.perf_counter() - t0:.2f} s, "
          f"{size / 2**20:.1f} MiB)")
    # A cache smaller than the experts: by default a quarter of each layer's in each tier.
    quarter = max(ModelConfig.from_file(artifact / "config.json").num_experts // 4, 1)
    slots = (args.slots_per_layer or quarter,
             quarter if args.host_slots_per_layer is None else args.host_slots_per_layer)
    if args.kernels != "reference":
        note_native_build()
    try:
        rt = load(artifact, dtype="float32", kernels=args.kernels, lookahead=args.lookahead,
                  cache_slots=slots)
    except (ValueError, RuntimeError) as e:  # an unavailable --kernels backend
        print(f"mtplx demo: error: {e}", file=sys.stderr)
        return 2
    tok, model, provider = rt.tokenizer, rt.model, rt.provider
    cfg = model.cfg
    prompt = tok.encode(args.prompt)
    if not prompt:
        rt.close()
        print("mtplx demo: error: the prompt encodes to no tokens", file=sys.stderr)
        return 2
    try:
        print(f"model: {cfg.num_hidden_layers} layers, {len(cfg.moe_layers)} MoE layers x "
              f"{cfg.num_experts} experts (top-{cfg.num_experts_per_token}); cache "
              f"{slots[0]} compute + {slots[1]} host slots per "
              f"layer, lookahead {args.lookahead}, kernels "
              f"{name_of(provider.kernels)}")
        print(f"prompt: {args.prompt!r} ({len(prompt)} tokens)")
        out.write("text:   ")
        ids, stats, after_prefill = stream_generate(model, tok, prompt, args.max_tokens, out,
                                                    provider)
        resident, _, _ = stream_generate(load_model(artifact, dtype="float32"), tok, prompt,
                                         args.max_tokens, open(os.devnull, "w"))
        same = ids == resident
        print(f"        {'same' if same else 'DIFFERENT'} {len(ids)} token ids as the resident "
              "model (every expert decoded once, kept in memory)")
        print()
        print_stats(model, provider, stats, after_prefill, measure_disk_rate(artifact), out)
    finally:
        rt.close()
    print()
    print(EXPLAIN.format(k=cfg.num_experts_per_token, e=cfg.num_experts, n=len(cfg.moe_layers),
                         weights=RANDOM_NOTE if args.random_weights else TRAINED_NOTE))
    ok = same
    if args.codecs:
        from ..fixtures.codec_table import codec_table

        print()
        ok = codec_table(root, args.seed, args.rebuild, out) and ok
    return 0 if ok else 1
