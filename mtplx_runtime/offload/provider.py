"""StreamingExpertProvider: routed experts read from an artifact's bank through a small cache.

    LatentMoE -> begin_forward(tokens): a prompt holds the warm start's reads, decode releases
              -> hint(l, ids, guesses): score earlier guesses, cancel stale ones, keep the new;
                 one token: open its first window (lookup, pin, demand misses), queue the
                 guesses behind, and have the prefetcher hold the window (`reserve`)
              -> run_experts(l, r, ids, w): per window of ascending expert ids: the one held
                 (`claim`) or one opened now -> kernel backend on each slot's bytes as it
                 lands -> fp32 sum

On the GPU the route stays on the device: hint copies it to pinned host memory behind an event
(offload/device_io.HostIds) and waits for it only when the layer has an expert without a
compute slot (the one host wait of such a layer, then the steps above); a layer whose experts
all hold slots launches `moe_layer` on the device slot table's row at once (offload/
slot_table.py) and its route is accounted later, in order, before any cache decision that
follows it (hits, replacement order, guesses, warm counts). Each window is one launch set.

The ExpertCache owns the slots, the Prefetcher schedules every read and the fill pipeline
(offload/fill.py) moves its bytes, the kernel backend (mtplx_runtime/kernels, chosen once at
construction) computes; this module looks experts up, pins them and computes, for the model's
`ExpertProvider` protocol (ARCHITECTURE.md "Data path"). Under the `reference` backend streamed
and resident logits are bit-identical; `cpu` and `cuda` differ by fp32 summation order. Prefill
(tokens > 1) reads each needed expert once for all its tokens into transient slots, in windows
no larger than the transient pool, so it never evicts decode experts (on the GPU it shares the
compute tier). `experts` still hands out decoded ExpertWeights for callers that want the weights.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from functools import partial
from pathlib import Path
from types import ModuleType

import torch

from ..artifact.manifest import MANIFEST_NAME, load_manifest
from ..artifact.open import BankExpertLayout
from ..formats.record import ALIGNMENT, align_up
from ..kernels import select_backend
from ..kernels.reference import ExpertWeights, decode_record
from .bank_reader import DEFAULT_DECODE_DEPTH, DEFAULT_READ_DEPTH, from_manifest
from .buffers import aligned_buffer
from .cache import ExpertCache
from .device_io import CudaStreams, HostIds, device_reads, tier_mover
from .digests import RecordDigests
from .fill import Fill
from .lookahead import LookaheadScore, predicted_keys
from .prefetch import Prefetcher, Window
from .slot_table import SlotTable
from .slots import copy_slot
from .warm import WarmStart

# A lookahead depth's guesses are read once GUESS_MIN_PAIRS scored layers show them naming the
# layer's experts at least GUESS_MIN_PRECISION of the time; below that, more guesses would be
# read in vain than used. Until then (and whenever they fall below) they are made and scored,
# not read: a slice with free cache slots read 31 bad guesses in its first two tokens.
GUESS_MIN_PRECISION = 0.5
GUESS_MIN_PAIRS = 8

__all__ = ["DEFAULT_DECODE_DEPTH", "StreamingExpertProvider"]

log = logging.getLogger(__name__)

ExpertKey = tuple[int, int]


class StreamingExpertProvider:
    """An `ExpertProvider` over a built artifact's bank.

    bank: the artifact's BankExpertLayout (`artifact.open.open_artifact(...).expert_layout`: its
    manifest, record layout and record index are used as they are, nothing is parsed twice), or
    the artifact directory (the bank is opened here).
    cfg: the ModelConfig (expert shapes, top-k); dtype / device: what the returned weights are.
    compute_bytes / host_bytes / transient_bytes: cache tier budgets (transient None: room for
    max(top_k, 4) records; 0 disables transient slots and prefill then uses the compute tier).
    policy, scope: ExpertCache replacement ('lru' | 'freq', 'layer' | 'global').
    lookahead: how many later MoE layers the model guesses for in decode (`hint`; 0: off).
    read_depth: reads in flight at once, demand and lookahead together (reader and prefetcher;
    default offload.bank_reader.DEFAULT_READ_DEPTH): prefill windows and the warm start read at it.
    decode_depth: the reads in flight in a one-token forward, its misses and the lookahead's
    guesses together (at most read_depth; default DEFAULT_DECODE_DEPTH): few, so the records land
    one by one and compute as they land. max_inflight_bytes, direct: prefetcher and reader
    settings. verify_sha256 (default on): every record read is checked before a kernel sees it,
    against its manifest SHA-256 the first time and its learned XXH3 after (offload/digests.py;
    `self.digests`).
    timeout_s: longest a forward waits for one batch of reads before TimeoutError.
    kernels: the expert kernel backend `run_experts` computes with: a name ('reference' | 'cpu'
    | 'cuda'), a backend module, or None ($MTPLX_KERNELS, else the best available;
    `kernels.select_backend`). Chosen once, here.
    streams: with a device backend (`DEVICE == "cuda"`), its streams and events
    (offload.device_io.CudaStreams, made here when None; tests pass a fake).
    """

    def __init__(self, bank: BankExpertLayout | str | os.PathLike, cfg,
                 dtype: torch.dtype = torch.float32, *, compute_bytes: int, host_bytes: int = 0,
                 transient_bytes: int | None = None, policy: str = "lru", scope: str = "layer",
                 lookahead: int = 1, read_depth: int = DEFAULT_READ_DEPTH,
                 decode_depth: int = DEFAULT_DECODE_DEPTH, max_inflight_bytes: int | None = None,
                 direct: bool | str = "auto", verify_sha256: bool = True, device: str = "cpu",
                 timeout_s: float = 120.0, kernels: str | ModuleType | None = None,
                 streams=None):
        if lookahead < 0:
            raise ValueError(f"lookahead must be >= 0, got {lookahead}")
        if decode_depth < 1:
            raise ValueError(f"decode_depth must be >= 1, got {decode_depth}")
        if not isinstance(bank, BankExpertLayout):
            root = Path(bank)
            bank = BankExpertLayout(cfg, root, load_manifest(root / MANIFEST_NAME))
        self.bank, self.manifest, self.layout = bank, bank.manifest, bank.layout
        self.cfg, self.dtype, self.device = cfg, dtype, device
        self.kernels = kernels if isinstance(kernels, ModuleType) else select_backend(kernels)
        self._kernel_args = dict(shapes=cfg.expert_shapes, beta=cfg.activation_situ_beta,
                                 beta_lin=cfg.activation_situ_linear_beta)
        self.lookahead, self.timeout_s = int(lookahead), float(timeout_s)
        self.decode_depth = min(int(decode_depth), int(read_depth))
        why = self.kernels.unsupported(self.layout)
        if why:
            raise ValueError(f"{bank.root}: {why}")
        self.codec = self.layout.codec
        self.stride_bytes = self.layout.logical_bytes
        layers = bank.layers
        # CUDA kernels address slots as base + index * stride of ONE device buffer, so on the
        # GPU prefill shares the compute tier instead of a separate transient pool.
        self.on_gpu = self.kernels.DEVICE == "cuda"
        self.streams = self.table = None
        hooks = dict(device="cpu", on_slot=None, mover=copy_slot)
        if self.on_gpu:
            transient_bytes = 0
            self.streams = streams if streams is not None else CudaStreams()
            # slot_of[layer, expert] on the device, kept with the cache's compute tier
            self.table = SlotTable(layers, cfg.num_experts, self.streams)
            hooks = dict(device=self.streams.slot_memory, on_slot=self.table.on_slot,
                         mover=tier_mover(self.streams, self.table))
        elif transient_bytes is None:
            transient_bytes = max(cfg.num_experts_per_token, 4) * align_up(self.stride_bytes)
        self.cache = ExpertCache(self.stride_bytes, compute_bytes, host_bytes, scope=scope,
                                 policy=policy, layers=layers, transient_bytes=transient_bytes,
                                 **hooks)
        self._transient_slots = self.cache.capacity()["transient"]
        self.verify_sha256 = verify_sha256
        self.digests = RecordDigests(bank.root, self.manifest) if verify_sha256 else None
        unaligned = _unaligned_record(self.manifest)
        if unaligned is not None and direct is not False:
            if direct is True:
                raise ValueError(f"{bank.root}: direct=True needs every record 4 KiB-aligned in "
                                 f"offset and length; {unaligned} is not")
            log.warning("%s: %s is not 4 KiB-aligned in offset and length, so bank reads are "
                        "buffered (O_DIRECT needs both)", bank.root, unaligned)
            direct = False
        # Every part may be open at once: each is opened once, on its first read. The reader
        # only reads: the fill pipeline checks what it read (offload/fill.py).
        reader = from_manifest(bank.root, self.manifest, direct=direct, read_depth=read_depth,
                               max_open_files=max(64, len(self.manifest.sidecar.parts)))
        self._host_reader = reader  # `experts` on the GPU reads host copies through it
        staging = None
        if self.on_gpu:
            reader, staging = device_reads(
                reader, staging_bytes=self.stride_bytes, table=self.table, streams=self.streams,
                tier=self.cache.tier("compute"), threads=read_depth, verified=verify_sha256)
        self.reader = reader
        # A backend whose kernels read records in a layout of their own defines
        # repack(layout, buf): the fill pipeline applies it to every record it reads (on the
        # GPU enqueued on the copy stream, behind the record's copy).
        repack = getattr(self.kernels, "repack", None)
        if repack is not None:
            repack = (partial(repack, self.layout, stream=self.streams.copy) if self.on_gpu
                      else partial(repack, self.layout))
        self.fill = Fill(reader, bank, self.cache, digests=self.digests, staging=staging,
                         repack=repack)
        if max_inflight_bytes is None:
            # Room for the whole read depth, and for a window's misses beside the guesses.
            span = max(read_depth, 2 * cfg.num_experts_per_token * max(1, self.lookahead))
            max_inflight_bytes = span * self.stride_bytes
        self.prefetcher = Prefetcher(self.fill, max_inflight_bytes=max_inflight_bytes,
                                     speculative_fraction=0.5, read_depth=read_depth)
        self.score = LookaheadScore()
        self._first_layer = min(layers) if layers else 0
        self._last_layer = max(layers) if layers else 0
        # layer -> {depth: ids [T, K]}: this forward's guesses, for the route trace.
        self.last_predictions: dict[int, dict[int, torch.Tensor]] = {}
        self._spec_keys: set[ExpertKey] = set()  # guesses issued and not yet consumed
        self._guesses: list[ExpertKey] = []  # the last hint's, read after its layer's misses
        self.stall_ms = 0.0       # time forwards spent blocked on reads (this provider's view)
        # Time in the kernel backend's calls, and the part of it with a read at the drive: how
        # much of the compute the drive overlapped (on a GPU, enqueue time only).
        self.kernel_ms = 0.0
        self.kernel_overlap_ms = 0.0
        self.prefill_uses = 0     # (token, expert) pairs in multi-token calls
        self.prefill_unique = 0   # distinct experts read for them
        self.warm: WarmStart | None = None  # set by start_warm: counts uses, its reads queued
        # The GPU path: this forward's routes on their way to the host, by layer, until
        # run_experts; routes computed without a wait, accounted in order later; moe_layer's
        # buffers per dtype; the CUDA events around each launch set not yet summed.
        self._routes: dict[int, HostIds] = {}
        self._pending: deque[HostIds] = deque()
        self._buffers: dict = {}
        self._timed: deque = deque()
        self.route_wait_ms = 0.0  # GPU: time forwards waited for a route's ids (host waits)
        self.launches = 0         # GPU: launch sets (moe_layer calls)
        self._closed = False

    # ---- the ExpertProvider contract -----------------------------------------------------

    def begin_forward(self, tokens: int) -> None:
        """A prompt's forward (tokens > 1) holds the warm start's reads from its first layer
        until its last MoE layer's experts are computed, so its reads and checks get the drive
        and the cores; a one-token forward releases the hold (`Prefetcher.hold_prompt`). On the
        GPU, the routes of the forwards before whose copies have landed are accounted first."""
        if self.on_gpu:
            self._account_pending(block=False)
        if tokens > 1:
            self.prefetcher.hold_prompt()
        else:
            self.prefetcher.release_prompt()

    def start_warm(self, warm: WarmStart) -> None:
        """Count this run's expert uses into `warm` and queue the records it plans (each layer's
        cache quota of the hottest, in file order) as the prefetcher's warm reads."""
        self.warm = warm
        keys = warm.plan(lambda layer: self.cache.quota((layer, 0)),
                         self.cache.scope_kind == "global", lambda key: self.bank.locate(*key)[:2])
        self.prefetcher.warm(keys, warm)

    def experts(self, layer: int, ids: Sequence[int]) -> dict[int, ExpertWeights]:
        """Weights of experts `ids` (distinct) of `layer`, decoded from their slots (the
        reference codec decode, as ResidentExpertProvider). Blocks until every read has landed;
        the model itself computes through `run_experts` instead. On the GPU, whose slots hold
        records in the kernels' layout (`repack`), each record is read from the bank into host
        memory and checked there instead; the cache is not touched."""
        if self.on_gpu:
            return {int(e): self.decode(self._read_host((int(layer), int(e)))) for e in ids}
        keys = [(int(layer), int(e)) for e in ids]
        room = self._room(layer)
        out = {}
        for i in range(0, len(keys), room):
            with self._landed(keys[i:i + room], transient=False) as refs:
                out.update({k[1]: self.decode(self.cache.buffer(ref)) for k, ref in refs.items()})
        return {int(e): out[int(e)] for e in ids}

    def run_experts(self, layer: int, x: torch.Tensor, ids: torch.Tensor,
                    weights: torch.Tensor) -> torch.Tensor:
        """The routed sum of `layer`: sum_k weights[t, k] * expert_{ids[t, k]}(x_t), computed by
        the kernel backend straight from the cache slots.

        x [T, R] latent activations (model dtype), ids / weights [T, K] from `route`. The needed
        experts go in windows of ascending ids, each small enough that all of them hold a slot
        at once (the transient pool in prefill, the layer's device quota otherwise). In decode
        (T = 1) each expert computes as soon as its slot holds it (hits first, then misses in
        the order they land) into its own fp32 product w * y, and the products are summed in
        ascending expert id at the end (`_decode_sum`), so the reads of a window overlap the
        compute of what has landed and the sum order is the reference's whatever the landing
        order. In prefill a window is read, then computed into one fp32 accumulator; the last
        MoE layer's (or a failed one) releases the prompt's hold on the warm start.
        Returns [T, R] in x.dtype; under the reference backend bit-identical to
        ResidentExpertProvider's sum. Raises PrefetchError (names the expert, file and offset)
        or TimeoutError.
        """
        if self._closed:
            raise RuntimeError("StreamingExpertProvider is closed")
        prompt = ids.shape[0] > 1
        try:
            out = (self._run_device if self.on_gpu else self._run_host)(layer, x, ids, weights)
        except BaseException:
            if prompt:
                self.prefetcher.release_prompt()  # a failed prompt must not hold the warm
            raise
        if prompt and layer == self._last_layer:
            self.prefetcher.release_prompt()
        return out

    def _run_host(self, layer: int, x, ids, weights) -> torch.Tensor:
        """run_experts on host slots: one token's experts as they land, a prompt's by window."""
        keys = self._keys(layer, ids)
        if self.warm is not None:
            self.warm.add(layer, ids)
        if ids.shape[0] == 1:
            out = self._decode_sum(layer, x, ids, weights, keys)
        else:
            out = self._prefill_sum(layer, x, ids, weights, keys)
        self._spec_keys.difference_update(keys)
        return out

    def _prefill_sum(self, layer: int, x, ids, weights, keys: list[ExpertKey]) -> torch.Tensor:
        """Several tokens' routed sum: windows of `keys` read, then computed into one fp32
        accumulator."""
        transient = self._transient_slots > 0
        self.prefill_uses += int((ids >= 0).sum())
        self.prefill_unique += len(keys)
        # Transient misses need a transient slot each; otherwise the layer's device quota.
        room = self._transient_slots if transient else self._room(layer)
        acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, R]
        for i in range(0, len(keys), room):
            with self._landed(keys[i:i + room], transient) as refs:
                acc = self._compute(x, ids, weights, refs, acc)
        return acc.to(x.dtype)

    def _decode_sum(self, layer: int, x, ids, weights, keys: list[ExpertKey]) -> torch.Tensor:
        """One token's routed sum, computing experts as they land. A batch of landed experts
        runs as one kernel call with one row per expert (x repeated, K = 1), each row an
        expert's own product w * y added to zero, so it is exactly that expert's term; the
        terms then add in ascending id, as the reference's accumulator does. The first window
        is the one the hint opened, when it did."""
        room = self._room(layer)
        picks = {int(e): k for k, e in enumerate(ids[0].tolist()) if e >= 0}
        terms: dict[int, torch.Tensor] = {}
        for i in range(0, len(keys), room):
            window = keys[i:i + room]
            with self.prefetcher.claim(layer, window) or self._open_decode(window) as win:
                for refs in self._batches(win):
                    order = sorted(k[1] for k in refs)
                    one = torch.tensor(order, dtype=ids.dtype, device=ids.device).unsqueeze(1)
                    w = weights[0, [picks[e] for e in order]].unsqueeze(1)  # [n, 1]
                    rows = torch.zeros((len(order), x.shape[1]), dtype=torch.float32,
                                       device=x.device)
                    # every row is one of these experts: no row selection (`_compute`) needed
                    rows = self._kernel_call(x.expand(len(order), -1), one, w, refs, rows)
                    terms.update(zip(order, rows))
        acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [1, R]
        for e in sorted(terms):
            acc[0] += terms[e]
        return acc.to(x.dtype)

    @staticmethod
    def _keys(layer: int, ids: torch.Tensor) -> list[ExpertKey]:
        """The distinct experts of a route [T, K] (-1: no pick), ascending."""
        return [(int(layer), int(e)) for e in torch.unique(ids[ids >= 0]).tolist()]

    def _room(self, layer: int) -> int:
        """Keys per window outside prefill's transient pool: the layer's device quota."""
        return max(1, self.cache.quota((layer, 0)))

    def _open(self, keys: list[ExpertKey], transient: bool, depth: int | None = None
              ) -> Window:
        """Look up `keys`, pin the hits and have the prefetcher read the misses (at most `depth`
        in flight; None: the read depth): a Window whose every slot stays pinned until it is
        closed (callers size `keys` to fit)."""
        if self._closed:
            raise RuntimeError("StreamingExpertProvider is closed")
        hits, misses = self.cache.lookup(keys, transient=transient)
        pinned = set(self.cache.pin(list(hits) + misses))  # hits, and misses already loading
        try:
            self.prefetcher.note_used(hits)
            futures = self.prefetcher.demand(misses, transient, depth)
            # demand reserved every miss's slot: pin them now, so no other reservation (a
            # lookahead guess under global scope) can evict one between its commit and our use.
            pinned.update(self.cache.pin([k for k in misses if k not in pinned]))
        except BaseException:
            self.cache.unpin(pinned)
            raise
        return Window(hits, futures, partial(self.cache.unpin, pinned))

    def _open_decode(self, keys: list[ExpertKey]) -> Window:
        """A decode window's reads at the decode depth, then the last hint's guesses queued
        behind its misses."""
        win = self._open(keys, False, self.decode_depth)
        try:
            self._speculate()
        except BaseException:
            win.close()
            raise
        return win

    @contextlib.contextmanager
    def _landed(self, keys: list[ExpertKey], transient: bool) -> Iterator[dict]:
        """Look up `keys`, read the misses, and yield {key: SlotRef} once every read has landed,
        with every slot pinned until the block ends. Raises PrefetchError / TimeoutError."""
        with self._open(keys, transient) as win:
            refs: dict = {}
            for batch in self._batches(win):
                refs.update(batch)
            yield refs

    def _batches(self, win: Window) -> Iterator[dict]:
        """{key: SlotRef} batches of a window: its hits first, then its misses as they land,
        those found landed together as one batch (a drive may complete its queue in waves:
        benchmarks log, "On a Zen 3 VM again: reads land in waves"); time blocked waiting is
        the stall."""
        if win.hits:
            yield win.hits
        landing = self.prefetcher.landed(win.futures, self.timeout_s)
        while True:
            t0 = time.monotonic()
            got = next(landing, None)
            self.stall_ms += (time.monotonic() - t0) * 1e3
            if got is None:
                return
            yield dict(got)

    def _compute(self, x, ids, weights, refs: Mapping, acc: torch.Tensor) -> torch.Tensor:
        """Add the products of the experts of `refs` ({key: SlotRef}, landed and pinned) into
        `acc` [T, R] fp32. Picks of other experts become empty picks (id -1, the kernel API's
        skip mark)."""
        window = torch.tensor(sorted(k[1] for k in refs), dtype=ids.dtype, device=ids.device)
        mine = torch.isin(ids, window)  # [T, K]
        rows = mine.any(dim=1).nonzero().squeeze(1)  # [n] tokens that use this window
        if len(rows) == ids.shape[0]:
            rows = slice(None)  # every token (always so in decode): no gather, no scatter
        args = (x[rows], torch.where(mine, ids, -1)[rows], weights[rows])  # [n, R], [n, K] x2
        acc[rows] = self._kernel_call(*args, refs, acc[rows])
        return acc

    def _kernel_call(self, x, ids, weights, refs: Mapping, acc: torch.Tensor) -> torch.Tensor:
        """The kernel backend on host slots, rows whose every pick is one of `refs` (or -1): acc
        [n, R] fp32 plus their products (the backends take {expert: record bytes})."""
        storage = {k[1]: self.cache.buffer(ref) for k, ref in refs.items()}
        t0, busy0 = time.monotonic(), self.prefetcher.busy_seconds()
        part = self.kernels.expert_mlp(x, ids, weights, {e: e for e in storage}, storage,
                                       self.layout, acc=acc, **self._kernel_args)
        # busy read inside the kernel's own interval, so the overlap never exceeds it
        self.kernel_overlap_ms += (self.prefetcher.busy_seconds() - busy0) * 1e3
        self.kernel_ms += (time.monotonic() - t0) * 1e3
        return part

    # ---- the GPU path: device slots, the route kept on the device ---------------------------

    def _run_device(self, layer: int, x, ids, weights) -> torch.Tensor:
        """run_experts on device slots: a layer whose experts all hold slots launches at once on
        the slot table (no host wait; its route accounted later); otherwise the route's copy is
        waited for (unless the hint did), the windows are read and each is one launch set."""
        rec = self._routes.pop(int(layer), None)
        if rec is None:  # no hint for this route
            rec = HostIds(self.streams, layer, ids, {})
        out = None
        if not rec.taken:
            out = self._launch(layer, x, ids, weights, whole=True)
            if out is not None:
                rec.taken = True
                self._pending.append(rec)
            else:
                self._take(rec)
        if out is None:
            keys = self._keys(layer, rec.ids)
            if self.warm is not None:
                self.warm.add(layer, rec.ids)
            out = self._device_sum(layer, x, ids, weights, keys)
            self._spec_keys.difference_update(keys)
        return out

    def _take(self, rec: HostIds) -> list[ExpertKey]:
        """The layer's one host wait: its route's ids, then every route accounted that was
        computed before it (their copies came first on the stream), then its guesses scored and
        kept (returned), as on the host."""
        t0 = time.monotonic()
        rec.wait()
        self.route_wait_ms += (time.monotonic() - t0) * 1e3
        rec.taken = True
        self._account_pending(block=True, current=rec.layer)
        return self._keep_guesses(rec.layer, rec.ids, rec.predicted)

    def _device_sum(self, layer: int, x, ids, weights, keys: list[ExpertKey]) -> torch.Tensor:
        """Windows of `keys` (ascending ids, each fitting the layer's slots): every read of a
        window landed, then one launch set for it, the sum carried in `out` from one window to
        the next (the reference's order). The first decode window is the one the hint opened."""
        T = x.shape[0]
        if T > 1:
            self.prefill_uses += int((ids >= 0).sum())
            self.prefill_unique += len(keys)
        room = self._room(layer)
        out = None
        for i in range(0, len(keys), room):
            window = keys[i:i + room]
            opened = ((self.prefetcher.claim(layer, window) or self._open_decode(window))
                      if T == 1 else self._open(window, self._transient_slots > 0))
            with opened as win:
                for _ in self._batches(win):  # stall counted there
                    pass
                out = self._launch(layer, x, ids, weights,
                                   window=window if len(keys) > room else None, acc=i > 0)
        if out is None:  # no pick at all
            return torch.zeros_like(x)
        return out

    def _launch(self, layer: int, x, ids, weights, *, window: list[ExpertKey] | None = None,
                acc: bool = False, whole: bool = False) -> torch.Tensor | None:
        """One launch set of `moe_layer` on the layer's slot-table row, into the provider's
        buffers: every pick (or only those of `window`'s id range, the rest masked to -1 on the
        device) added to the previous window's sum (`acc`) or to 0. `whole`: only if every
        expert of the layer holds a slot, else None and nothing launched. Returns the sum in
        x.dtype, a tensor of its own."""
        T = x.shape[0]
        ws, buf = self._workspace(T, x.dtype)
        out = buf[:T]  # [T, R] fp32, the running sum of this layer's windows
        if window is not None:  # the window's experts are exactly the picks in its id range
            ids = torch.where((ids >= window[0][1]) & (ids <= window[-1][1]), ids, -1)
        tier = self.cache.tier("compute")
        with self.table.launch(layer, whole=whole) as row:
            if row is None:
                return None
            start = self.streams.compute_event(timing=True)
            self.kernels.moe_layer(x, ids, weights, row, tier.address(0), tier.slot_bytes,
                                   self.layout, self.cfg.expert_shapes, ws, out,
                                   acc=out if acc else None, beta=self._kernel_args["beta"],
                                   beta_lin=self._kernel_args["beta_lin"])
            self._timed.append((start, self.streams.compute_event(timing=True)))
        self.launches += 1
        # a copy: the buffer is the next layer's
        return out.to(x.dtype) if x.dtype != out.dtype else out.clone()

    def _workspace(self, T: int, dtype: torch.dtype):
        """(Workspace, out fp32 [>= T, R]) for `moe_layer`, kept per dtype and grown to the
        largest T asked for (a decode step's, then a prefill chunk's)."""
        have = self._buffers.get(dtype)
        if have is None or have[0].tokens < T:
            R = self.cfg.routed_expert_hidden_size
            dev = self.streams.device
            have = self._buffers[dtype] = (
                self.kernels.workspace(T, self.cfg.num_experts_per_token, self.cfg.expert_shapes,
                                       dtype, dev),
                torch.empty(T, R, dtype=torch.float32, device=dev))
        return have

    def _account_pending(self, *, block: bool, current: int | None = None) -> None:
        """Account the routes computed without a wait, in order: all of them (`block`: waiting
        for their copies), else those whose copies have landed. A layer's route is accounted as
        its lookup would have been (hits, replacement order, used guesses), its guesses scored
        and kept, and read only for layers after `current` (the layer about to compute; None:
        none read, their layers have run), its picks counted for the warm start. Then the
        launch sets' CUDA-event times that are done go into kernel_ms."""
        while self._pending and (block or self._pending[0].ready()):
            rec = self._pending.popleft()
            rec.wait()  # no wait when ready
            keys = self._keys(rec.layer, rec.ids)
            self._keep_guesses(rec.layer, rec.ids, rec.predicted)
            guesses, self._guesses = self._guesses, []
            if current is not None:
                self._guesses = [k for k in guesses if k[0] > current]
                self._speculate()
            prefill = rec.ids.shape[0] > 1
            if prefill:
                self.prefill_uses += int((rec.ids >= 0).sum())
                self.prefill_unique += len(keys)
            self.cache.count_hits(keys, transient=prefill and self._transient_slots > 0)
            self.prefetcher.note_used(keys)
            if self.warm is not None:
                self.warm.add(rec.layer, rec.ids)
            self._spec_keys.difference_update(keys)
        while self._timed and (block or self._timed[0][1].query()):
            start, end = self._timed.popleft()
            end.synchronize()
            self.kernel_ms += start.elapsed_time(end)

    def _read_host(self, key: ExpertKey):
        """Record `key` read from the bank into host memory and checked (when verified)."""
        ext = self.fill.locate(key)
        buf = aligned_buffer(align_up(ext.length))[:ext.length]
        self._host_reader.read_into(ext.part, ext.offset, ext.length, buf,
                                    digest=ext.check).result(self.timeout_s)
        return buf

    def decode(self, buf) -> ExpertWeights:
        """Record bytes -> ExpertWeights: the reference decode, as ResidentExpertProvider."""
        return decode_record(buf, self.layout, self.cfg.expert_shapes, self.dtype, self.device)

    # ---- lookahead -----------------------------------------------------------------------

    def hint(self, layer: int, actual: torch.Tensor, predicted: Mapping[int, torch.Tensor]
             ) -> list[ExpertKey]:
        """Score earlier guesses against `actual` [T, K] (this layer's route), cancel queued
        guesses no longer predicted, and keep the experts of `predicted` ({later layer: ids
        [T, K]}, depth 1 first: the model guesses in one-token decode steps only) at the depths
        whose guesses have been right often enough (`guessing_depths`), to be read once this
        layer's misses are queued: before them, a guess would take a place in the decode depth
        the misses of the layer about to compute need. In a one-token step, this layer's first
        window then starts reading here, so its reads overlap what the block computes before
        `run_experts` (the latent projection, the shared expert): the prefetcher holds it until
        run_experts claims it. A window held from an earlier hint whose run_experts never came
        is closed first (its pins go). Returns the kept keys.
        On the GPU (`actual` on the device) all of this waits for the route's copy to the host,
        which only a one-token step of a layer with an expert outside the compute slots does
        here; otherwise run_experts decides, and a layer it computes without a wait has its
        guesses scored and kept later (`_account_pending`), returning [] here."""
        self.prefetcher.release_reserved()
        self._note_predictions(layer, predicted)
        if self.on_gpu:
            rec = self._routes[int(layer)] = HostIds(self.streams, layer, actual, predicted)
            if actual.shape[0] != 1 or self._closed or self.table.fully_resident(layer):
                return []
            keys = self._take(rec)
            actual = rec.ids
        else:
            keys = self._keep_guesses(layer, actual, predicted)
        if actual.shape[0] == 1 and not self._closed:
            window = self._keys(layer, actual)[:self._room(layer)]
            self.prefetcher.reserve(layer, window, self._open_decode(window))
        return keys

    def _note_predictions(self, layer: int, predicted: Mapping[int, torch.Tensor]) -> None:
        """This forward's guesses by target layer and depth, for the route trace."""
        if layer == self._first_layer:
            self.last_predictions = {}  # a new forward: the trace wants this forward's guesses
        for depth, target in enumerate(sorted(predicted), 1):
            self.last_predictions.setdefault(target, {})[depth] = predicted[target]

    def _keep_guesses(self, layer: int, actual: torch.Tensor,
                      predicted: Mapping[int, torch.Tensor]) -> list[ExpertKey]:
        """`hint`'s scoring and guess keeping: the guesses to read after this layer's misses."""
        self.score.add_actual(layer, actual)
        self._guesses = []  # an earlier hint's guesses not read by now are for a past layer
        if not predicted:
            return []
        targets = sorted(predicted)
        preds = [predicted[t] for t in targets]  # [T, K] each
        self.score.add_predictions(targets, preds)
        reading = self.guessing_depths(len(targets))
        keys = predicted_keys([t for d, t in enumerate(targets, 1) if d in reading],
                              [p for d, p in enumerate(preds, 1) if d in reading])
        # Guesses for this layer are about to be demanded: never cancel those.
        keep = set(keys) | {k for k in self._spec_keys if k[0] == layer}
        self.prefetcher.cancel_stale(keep)
        self._spec_keys &= keep
        self._guesses = keys
        return keys

    def _speculate(self) -> None:
        """Queue the last hint's guesses (once): the prefetcher reads them after queued demand,
        in what the decode depth leaves."""
        keys, self._guesses = self._guesses, []
        if keys:
            self._spec_keys.update(self.prefetcher.speculate(keys, self.decode_depth))

    def guessing_depths(self, depths: int) -> set[int]:
        """The lookahead depths among 1..`depths` whose guesses are read: those with at least
        GUESS_MIN_PAIRS scored layers and a precision of GUESS_MIN_PRECISION or more."""
        scored = self.score.by_depth
        return {d for d in range(1, depths + 1) if d in scored
                and scored[d].pairs >= GUESS_MIN_PAIRS
                and scored[d].precision >= GUESS_MIN_PRECISION}

    # ---- reporting and lifetime ----------------------------------------------------------

    def stats(self) -> dict:
        """Cache counters per layer and tier, totals, prefetch counters, lookahead scores per
        depth and the depths whose guesses are read (`guessing_depths`), stall time, time in the
        host kernels and the part of it that reads overlapped (`kernel_ms`, `kernel_overlap_ms`;
        on the GPU `kernel_ms` is the launch sets' CUDA-event time and no overlap is counted),
        the prefill dedup factor (expert uses / unique experts), the warm start
        (`offload.warm.WarmStart.stats`; None without one) and on the GPU `device`: launch sets,
        route waits (host waits for a route's ids, ms) and slot-table rows copied. A GPU run's
        routes computed without a wait are accounted first (a host sync)."""
        if self.on_gpu and not self._closed:
            self._account_pending(block=True)
        totals = self.cache.totals()
        dev = totals["compute"]
        return {
            "cache": self.cache.stats(),
            "totals": totals,
            "hit_rate": dev["hits"] / dev["lookups"] if dev["lookups"] else 0.0,
            "prefetch": self.prefetcher.stats.as_dict(),
            "lookahead": self.score.summary(),
            "guessing_depths": sorted(self.guessing_depths(self.lookahead)),
            "stall_ms": self.stall_ms,
            "kernel_ms": self.kernel_ms,
            "kernel_overlap_ms": self.kernel_overlap_ms,
            "prefill_dedup": {"uses": self.prefill_uses, "unique": self.prefill_unique,
                              "factor": (self.prefill_uses / self.prefill_unique
                                         if self.prefill_unique else 0.0)},
            "checks": self.digests.stats() if self.digests is not None else None,
            "warm": self.warm.stats() if self.warm is not None else None,
            "device": ({"launches": self.launches, "route_wait_ms": self.route_wait_ms,
                        "table_uploads": self.table.uploads} if self.on_gpu else None),
        }

    def close(self) -> None:
        """Cancel queued reads (the warm start's too) and the window held, close the reader,
        write the warm-start counts. Idempotent."""
        if self._closed:
            return
        try:
            if self.on_gpu:  # the warm counts want every route
                self._account_pending(block=True)
        finally:
            self._closed = True
        try:
            self.prefetcher.shutdown(cancel_pending=True, timeout=self.timeout_s)
        finally:
            self.reader.close()
            if self.digests is not None:
                self.digests.save()
            if self.warm is not None:
                self.warm.close()  # writes this run's expert use counts

    def __enter__(self) -> StreamingExpertProvider:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _unaligned_record(manifest) -> str | None:
    """The first record whose absolute offset or length is not a multiple of 4 KiB (records of
    other writers may be unpadded), as words; None when every record is aligned."""
    parts = manifest.sidecar.parts
    for r in manifest.records:
        start = parts[r.part].data_start + r.sidecar_offset
        if start % ALIGNMENT or r.sidecar_length % ALIGNMENT:
            return f"record (layer {r.layer}, expert {r.expert})"
    return None
