"""`load()`: the one door from a model directory to a runnable model (ARCHITECTURE.md "Loading").

    path -> tokenizer
         -> streaming artifact (or a memory budget given):
              manifest parsed once -> bank (record layout, record index; parts checked, not
              opened) -> memory plan -> StreamingExpertProvider (opens each part once, on its
              first read) -> model built with the provider in place
         -> plain checkpoint: experts decoded once, kept resident (ResidentExpertProvider)

`generate`, `chat`, `serve`, `demo`, `tools/bench_decode.py` and the Python API all load through
here; `load_model` is the resident-model door of the same path.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from ..artifact.integrity import admit_shards
from ..artifact.open import is_artifact, open_artifact, open_source
from ..checkpoint import DeepseekV3Config
from ..formats.record import align_up
from ..kernels import name_of, select_backend
from ..model.deepseek_v3 import DeepseekV3
from ..model.kimi_k3 import KimiK3
from ..model.load import check_resident_dtype, load_residents, model_dtype
from ..model.moe import ResidentExpertProvider
from ..offload.bank_reader import DEFAULT_READ_DEPTH
from ..offload.provider import DEFAULT_DECODE_DEPTH, StreamingExpertProvider
from ..offload.warm import WarmStart, warm_path
from .chat_template import read_chat_template
from .hf_tokenizer import HFTokenizer, model_tokenizer
from .plan import (
    DEFAULT_CONTEXT,
    MemoryPlan,
    afforded_context,
    facts_from_dir,
    mem_available_bytes,
    plan_for,
)
from .tokenizer import Tokenizer

__all__ = ["Runtime", "load", "load_model"]

log = logging.getLogger(__name__)


@dataclass
class Runtime:
    """What a generation run needs, loaded once: the model with its expert provider in place,
    the tokenizer, and for streamed experts the memory plan. `trace` (engine.trace.RouteTrace)
    is set by callers that record routes; `close()` closes it and the provider."""

    model: KimiK3 | DeepseekV3
    tokenizer: Tokenizer | HFTokenizer | None
    provider: StreamingExpertProvider | ResidentExpertProvider
    plan: MemoryPlan | None = None
    trace: object | None = None
    context: int = DEFAULT_CONTEXT  # tokens of prompt + reply this run holds state for

    @property
    def streamed(self) -> bool:
        return isinstance(self.provider, StreamingExpertProvider)

    @property
    def kernels(self) -> ModuleType | None:
        """The expert kernel backend of a streamed model; None when experts are resident."""
        return self.provider.kernels if self.streamed else None

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()
        if self.streamed:
            self.provider.close()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load(path: str | os.PathLike, *, dtype: str = "bfloat16", memory_budget=None,
         host_budget=0, kernels: str | ModuleType | None = None, lookahead: int = 1,
         cache_policy: str = "lru", context: int | None = None, prefill_chunk: int = 64,
         cache_slots: tuple[int, int] | None = None, tokenizer: bool = True,
         verify: bool = True, device: str | None = None,
         read_depth: int = DEFAULT_READ_DEPTH, decode_depth: int = DEFAULT_DECODE_DEPTH,
         warm: str | os.PathLike = "off",
         warm_progress: Callable[[str], None] | None = None,
         resident_dtype: str | None = None) -> Runtime:
    """Load the model at `path` (a streaming artifact or any checkpoint the reader accepts).

    Experts stream from the bank when `path` is a streaming artifact or `memory_budget` is given
    (a budget needs an artifact): `memory_budget` (bytes or "24GiB"; None: MemAvailable) and
    `host_budget` are split by the memory plan (`engine.plan`) for `context` tokens (None: the
    longest the budget affords, `plan.afforded_context`; DEFAULT_CONTEXT without a plan) and
    `prefill_chunk`; `cache_slots=(device, host)` per MoE layer sizes the cache directly instead
    (demos, benchmarks). The context used is `Runtime.context`. `kernels`: 'reference' |
    'cpu' | 'cuda' | 'auto' | None ($MTPLX_KERNELS, else the best available); with the cuda
    kernels the residents live on the GPU. Otherwise every expert is decoded once and kept
    resident (tiny models, tests).
    `dtype`: "bfloat16" | "float32". `resident_dtype`: None (as the model stores them: bf16, or
    what an artifact was built with by `mtplx build-manifest --resident-dtype`) | "bf16" (every
    exactness guarantee) | "int8" | "int4" | "fp8": the large resident matrices quantized at load
    from bf16 ones (`model.quant`), or read quantized from such an artifact (another dtype than it
    holds is a ValueError); needs dtype bfloat16. `tokenizer=False` skips the tokenizer
    (logits-only use).
    `verify` (streamed experts): every record read is checked (its manifest SHA-256 the first
    time, then its learned XXH3: `offload.digests`) and every resident shard before use
    (`artifact.integrity.admit_shards`: hashed once, then trusted while the file is unchanged);
    False skips both. `read_depth` (streamed experts): reads in flight at once, a window's misses
    and the lookahead's guesses together (`offload.bank_reader.DEFAULT_READ_DEPTH`: BENCHMARKS.md
    "bench_io"); `decode_depth`: the fewer a one-token forward keeps in flight so its records
    land one by one and compute as they land (`offload.provider.DEFAULT_DECODE_DEPTH`).
    `warm` (streamed experts): 'off', 'auto' (the file beside the integrity receipts) or a
    warm-start file's path: the cache is filled from its expert use counts by the prefetcher's
    lowest class of reads (`offload.warm`; `provider.warm.wait()` blocks until done,
    `warm_progress(line)` hears of a long warm) and the counts of this run are merged into it
    at `close()`.
    Raises CheckpointError / PlanError / ValueError / RuntimeError with a one-line reason.
    """
    # The model directory is checked before the tokenizer is read, so a wrong --model is
    # reported as what it is (a missing config or shard), not as a missing tokenizer file.
    root = Path(path)
    torch_dtype = model_dtype(dtype)
    check_resident_dtype(resident_dtype, torch_dtype)
    streamed = memory_budget is not None or cache_slots is not None or is_artifact(root)
    if not streamed:
        if kernels not in (None, "auto", "reference"):
            raise ValueError(f"kernels {kernels!r} run on streamed experts: give a streaming "
                             "artifact (mtplx build-manifest) or leave the kernels unset")
        ckpt = open_source(root)
        tok = _tokenizer(root, ckpt.config) if tokenizer else None
        dev = device or "cpu"
        provider = ResidentExpertProvider(ckpt, torch_dtype, dev)
        return Runtime(_build(ckpt, torch_dtype, dev, provider, resident_dtype), tok, provider,
                       context=context or DEFAULT_CONTEXT)
    if not is_artifact(root):
        raise ValueError(f"{root} is not a streaming artifact (no expert-manifest.json): build "
                         "one with `mtplx build-manifest`, or load it without a memory budget "
                         "or cache slots")
    backend = kernels if isinstance(kernels, ModuleType) else select_backend(kernels)
    # With the CUDA kernels the residents (attention, router, shared experts...) live on the GPU
    # next to the expert slots; every other backend runs the model on the CPU.
    dev = device or ("cuda" if backend.DEVICE == "cuda" else "cpu")
    ckpt = open_artifact(root, verify_sha256=verify)
    try:
        tok = _tokenizer(root, ckpt.config) if tokenizer else None
        bank, cfg = ckpt.expert_layout, ckpt.config
        # Hashed through the descriptors the residents are read from, so a file renamed over a
        # shard during the load changes nothing that is read.
        admitted = admit_shards(root, bank.manifest, ckpt.shard_fds()) if verify else None
        stride = align_up(bank.layout.logical_bytes)  # a slot: one record, 4 KiB-rounded
        plan = None
        transient_bytes = None  # cache_slots: the provider's default prefill pool
        if cache_slots is not None:
            n = len(bank.layers)
            compute_bytes, host_bytes = cache_slots[0] * n * stride, cache_slots[1] * n * stride
        else:
            budget = memory_budget or mem_available_bytes()
            facts = facts_from_dir(root, bank.manifest)
            kw = dict(host_budget=host_budget, dtype=dtype, prefill_chunk=prefill_chunk,
                      kernels=name_of(backend), read_depth=read_depth,
                      resident_dtype=resident_dtype)
            if context is None:
                context = afforded_context(facts, memory_budget=budget, **kw)
            plan = plan_for(facts, memory_budget=budget, context=context, **kw)
            compute_bytes = plan.compute_slots * plan.record_stride
            host_bytes = plan.host_slots * plan.record_stride
            transient_bytes = plan.transient_slots * plan.record_stride
        provider = StreamingExpertProvider(
            bank, cfg, torch_dtype, compute_bytes=compute_bytes, host_bytes=host_bytes,
            transient_bytes=transient_bytes, policy=cache_policy, lookahead=lookahead,
            verify_sha256=verify, kernels=backend, read_depth=read_depth,
            decode_depth=decode_depth)
        try:
            model = _build(ckpt, torch_dtype, dev, provider, resident_dtype)
            if admitted is not None:  # no write landed between the check and the reads
                admitted.confirm(root, ckpt.shard_fds())
            path = warm_path(root, bank.manifest, warm)
            if path is not None:
                provider.start_warm(WarmStart(bank.manifest, path, progress=warm_progress))
        except BaseException:
            provider.close()
            raise
    finally:
        ckpt.close()  # residents are in memory now; the provider has its own reader
    return Runtime(model, tok, provider, plan, context=context or DEFAULT_CONTEXT)


def load_model(path: str | os.PathLike, device: str = "cpu", dtype: str = "float32",
               resident_dtype: str | None = None) -> KimiK3 | DeepseekV3:
    """The reference model with every expert resident (decoded once): `load` without streaming,
    for any checkpoint or artifact the reader accepts."""
    torch_dtype = model_dtype(dtype)
    check_resident_dtype(resident_dtype, torch_dtype)
    ckpt = open_source(path)
    provider = ResidentExpertProvider(ckpt, torch_dtype, device)
    return _build(ckpt, torch_dtype, device, provider, resident_dtype)


def _tokenizer(root: Path, cfg) -> Tokenizer | HFTokenizer:
    """The model directory's tokenizer; a DeepSeek-V3 family model's carries its Jinja chat
    template (K3 chats are rendered natively: engine/chat.py)."""
    tok = model_tokenizer(root)
    if isinstance(cfg, DeepseekV3Config):
        tok.chat_template = read_chat_template(root)
    return tok


def _build(ckpt, dtype: torch.dtype, device: str, provider,
           resident_dtype: str | None) -> KimiK3 | DeepseekV3:
    top, layers = load_residents(ckpt, dtype, device, resident_dtype)
    family = DeepseekV3 if isinstance(ckpt.config, DeepseekV3Config) else KimiK3
    return family.from_weights(ckpt.config, top, layers, provider, dtype)
