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
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType

import torch

from ..artifact.build import BuildError, ExpertSource
from ..artifact.integrity import admit_shards
from ..artifact.open import is_artifact, open_artifact, open_source
from ..checkpoint import DeepseekV3Config
from ..formats.record import align_up
from ..kernels import name_of, select_backend
from ..model.deepseek_v3 import DeepseekV3
from ..model.kimi_k3 import KimiK3
from ..model.load import check_resident_dtype, load_residents, model_dtype
from ..model.moe import ResidentExpertProvider
from ..offload.provider import StreamingExpertProvider
from ..offload.warm import WarmStart, warm_path
from .chat_template import read_chat_template
from .hf_tokenizer import HFTokenizer, model_tokenizer
from .options import LoadOptions
from .plan import (
    DEFAULT_CONTEXT,
    MemoryPlan,
    afforded_context,
    facts_from_dir,
    mem_available_bytes,
    plan_for,
)
from .tokenizer import Tokenizer

__all__ = ["LoadOptions", "Runtime", "load", "load_model"]

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
    # logical bytes of one expert record as a bank stores it (route traces price reads with
    # it); None for a resident checkpoint no bank mode can hold
    record_bytes: int | None = None

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


def load(path: str | os.PathLike, options: LoadOptions | None = None, /,
         **choices) -> Runtime:
    """Load the model at `path` (a streaming artifact or any checkpoint the reader accepts) as
    `options` say (engine.options.LoadOptions, which documents every choice); keyword `choices`
    build one (`load(path, dtype="float32", cache_slots=(8, 0))`) or replace fields of
    `options`. A bad choice is an OptionError (a ValueError) naming it.

    Experts stream from the bank when `path` is a streaming artifact or a memory budget or cache
    slots are given (both need an artifact), through a cache the memory plan sizes
    (`engine.plan`; `Runtime.plan`, and the context it affords is `Runtime.context`) or
    `cache_slots` sets, computed by the chosen kernels (with the cuda kernels the residents live
    on the GPU), each record checked as read unless `verify` is off, the cache warmed from
    earlier runs per `warm` (`offload.warm`; `provider.warm.wait()` blocks until done) and this
    run's use recorded at `close()`. Otherwise every expert is decoded once and kept resident
    (tiny models, tests). Residents load in `dtype`, or quantized per `resident_dtype` (read as
    stored from an artifact built with `mtplx build-manifest --resident-dtype`; another dtype
    than it holds is a ValueError).
    Raises CheckpointError / PlanError / ValueError / RuntimeError with a one-line reason.
    """
    if options is None:
        options = LoadOptions(**choices)
    elif choices:
        options = replace(options, **choices)  # checked again by __post_init__
    o = options
    # The model directory is checked before the tokenizer is read, so a wrong --model is
    # reported as what it is (a missing config or shard), not as a missing tokenizer file.
    root = Path(path)
    torch_dtype = model_dtype(o.dtype)
    streamed = o.memory_budget is not None or o.cache_slots is not None or is_artifact(root)
    if not streamed:
        if o.kernels not in (None, "auto", "reference"):
            raise ValueError(f"kernels {o.kernels!r} run on streamed experts: give a streaming "
                             "artifact (mtplx build-manifest) or leave the kernels unset")
        ckpt = open_source(root)
        tok = _tokenizer(root, ckpt.config) if o.tokenizer else None
        dev = o.device or "cpu"
        provider = ResidentExpertProvider(ckpt, torch_dtype, dev)
        return Runtime(_build(ckpt, torch_dtype, dev, provider, o.resident_dtype), tok, provider,
                       context=o.context or DEFAULT_CONTEXT, record_bytes=_record_bytes(ckpt))
    if not is_artifact(root):
        raise ValueError(f"{root} is not a streaming artifact (no expert-manifest.json): build "
                         "one with `mtplx build-manifest`, or load it without a memory budget "
                         "or cache slots")
    backend = o.kernels if isinstance(o.kernels, ModuleType) else select_backend(o.kernels)
    # With the CUDA kernels the residents (attention, router, shared experts...) live on the GPU
    # next to the expert slots; every other backend runs the model on the CPU.
    dev = o.device or ("cuda" if backend.DEVICE == "cuda" else "cpu")
    ckpt = open_artifact(root, verify_sha256=o.verify)
    try:
        tok = _tokenizer(root, ckpt.config) if o.tokenizer else None
        bank, cfg = ckpt.expert_layout, ckpt.config
        # Hashed through the descriptors the residents are read from, so a file renamed over a
        # shard during the load changes nothing that is read.
        admitted = admit_shards(root, bank.manifest, ckpt.shard_fds()) if o.verify else None
        stride = align_up(bank.layout.logical_bytes)  # a slot: one record, 4 KiB-rounded
        plan = None
        transient_bytes = None  # cache_slots: the provider's default prefill pool
        if o.cache_slots is not None:
            n = len(bank.layers)
            compute_bytes, host_bytes = o.cache_slots[0] * n * stride, o.cache_slots[1] * n * stride
        else:
            budget = o.memory_budget or mem_available_bytes()
            facts = facts_from_dir(root, bank.manifest, config=cfg)
            kw = dict(host_budget=o.host_budget, dtype=o.dtype, prefill_chunk=o.prefill_chunk,
                      kernels=name_of(backend), read_depth=o.read_depth,
                      resident_dtype=o.resident_dtype)
            context = o.context
            if context is None:
                context = afforded_context(facts, memory_budget=budget, **kw)
            plan = plan_for(facts, memory_budget=budget, context=context, **kw)
            compute_bytes = plan.compute_slots * plan.record_stride
            host_bytes = plan.host_slots * plan.record_stride
            transient_bytes = plan.transient_slots * plan.record_stride
        provider = StreamingExpertProvider(
            bank, cfg, torch_dtype, compute_bytes=compute_bytes, host_bytes=host_bytes,
            transient_bytes=transient_bytes, policy=o.cache_policy, lookahead=o.lookahead,
            verify_sha256=o.verify, kernels=backend, read_depth=o.read_depth,
            decode_depth=o.decode_depth)
        try:
            model = _build(ckpt, torch_dtype, dev, provider, o.resident_dtype)
            if admitted is not None:  # no write landed between the check and the reads
                admitted.confirm(root, ckpt.shard_fds())
            path = warm_path(root, bank.manifest, o.warm)
            if path is not None:
                provider.start_warm(WarmStart(bank.manifest, path, progress=o.warm_progress))
        except BaseException:
            provider.close()
            raise
    finally:
        ckpt.close()  # residents are in memory now; the provider has its own reader
    return Runtime(model, tok, provider, plan, context=(plan.context if plan else o.context)
                   or DEFAULT_CONTEXT, record_bytes=bank.layout.logical_bytes)


def _record_bytes(ckpt) -> int | None:
    """The bank record size `mtplx build-manifest --codec keep` would give `ckpt`'s experts."""
    try:
        return ExpertSource(ckpt, "keep").layout.logical_bytes
    except BuildError:
        return None


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
