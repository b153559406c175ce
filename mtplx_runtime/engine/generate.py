"""Token generation: chunked prefill, sampling, and `generate_step` as a generator.

    prompt ids -> prefill (chunks of `prefill_chunk`) -> logits -> sample -> yield id
               -> decode(id) -> logits -> sample -> yield id ... until a stop id or max_tokens

Plain functions over any model with `new_state`, `prefill(ids, state) -> [T, V]` and
`decode(id, state) -> [V]` (`model.kimi_k3.KimiK3`); where routed experts live (resident or
streamed) is the provider's business, not this module's. `generate_step` times only the model's
own work (the consumer's time between yields is excluded) into a `GenerationStats`.

Stop ids are NOT yielded: generation ends when the sampled id is a stop id (K3: `<|end_of_msg|>`
or `[EOS]`, `Tokenizer.stop_ids`); `stats.stop_reason` is then "stop" and `stats.stop_id` holds
it. Otherwise it ends with "length" after `max_tokens` ids. No decode forward is run for the last
yielded id when `max_tokens` ends generation (its logits would never be used).

Logits that are not all finite (NaN/inf: a corrupt checkpoint or artifact) stop generation with
`NonFiniteLogits` rather than sampling garbage or nothing.

Sampling (temperature > 0) without a seed draws a fresh one (`fresh_seed`), so two runs differ;
`stats.seed` holds the seed used, which repeats the run. Greedy decoding needs none.

Shape legend: T tokens, V vocab (163840).
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

# on_forward(phase, first_position, n_tokens): called after each model forward, while the MoE
# layers' `last_ids` still hold that forward's route (the route-trace writer hooks in here).
ForwardHook = Callable[[str, int, int], None]


class NonFiniteLogits(RuntimeError):
    """The model produced NaN or infinite logits: its weights (or the bytes read for them) are
    corrupt, or the numerics overflowed. Generation cannot continue meaningfully."""


def check_logits(logits: torch.Tensor, phase: str, position: int) -> torch.Tensor:
    """`logits` unchanged if all finite, else raise NonFiniteLogits (one reduction over V)."""
    if not bool(torch.isfinite(logits).all()):
        bad = int((~torch.isfinite(logits)).sum())
        raise NonFiniteLogits(f"the model produced non-finite logits ({bad} of {logits.numel()} "
                              f"NaN/inf) in {phase} at position {position}; the checkpoint or "
                              "artifact may be corrupt (mtplx verify checks an artifact)")
    return logits


# Below the smallest normal fp32 number a temperature rounds to 0 (or a denormal that GPUs
# flush to 0) when logits are divided by it, giving 0 / 0 = NaN: such a temperature samples as
# greedy, its limit.
_MIN_TEMPERATURE = torch.finfo(torch.float32).tiny


@dataclass(slots=True)
class GenerationStats:
    """Counters and wall times of one `generate_step` run (model work only, seconds)."""

    prompt_tokens: int = 0
    generated_tokens: int = 0  # ids yielded (stop id excluded)
    decode_forwards: int = 0  # one-token forwards run
    prefill_s: float = 0.0
    decode_s: float = 0.0
    ttft_s: float = 0.0  # start of prefill -> first sampled id (model work only)
    stop_reason: str = ""  # "stop" | "length" | "stopped" (`stop()` said so) | "" while running
    stop_id: int | None = None
    seed: int | None = None  # the sampling seed (given or fresh); None when decoding greedily

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_forwards / self.decode_s if self.decode_s > 0 else 0.0

    def summary(self) -> str:
        """One line: tokens, prefill and decode speed, TTFT, why it stopped."""
        return (f"prompt {self.prompt_tokens} tok, generated {self.generated_tokens} tok; "
                f"prefill {self.prefill_tok_s:.1f} tok/s, decode {self.decode_tok_s:.1f} tok/s, "
                f"TTFT {1000 * self.ttft_s:.0f} ms; stop: {self.stop_reason or 'running'}"
                + ("" if self.seed is None else f"; seed {self.seed}"))


def fresh_seed() -> int:
    """A seed for a run that was given none: random, 32 bits (short enough to copy from a
    stats line into `--seed`)."""
    return secrets.randbits(32)


def is_greedy(temperature: float) -> bool:
    """Whether `sample` decodes greedily at this temperature (no draw, no seed needed)."""
    return temperature < _MIN_TEMPERATURE


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, frequency: float,
                    presence: float) -> torch.Tensor:
    """OpenAI's frequency and presence penalties: logits [V] - counts [V] * frequency -
    (counts > 0) * presence, in fp32; `counts` is how often each id was generated so far."""
    return logits.float() - counts * frequency - (counts > 0).float() * presence  # [V]


def sample(logits: torch.Tensor, *, temperature: float = 0.0, top_p: float = 1.0,
           top_k: int = 0, generator: torch.Generator | None = None) -> int:
    """One token id from `logits` [V] (any float dtype; filtered and sampled in fp32).

    temperature 0 is greedy argmax (top_k/top_p ignored; the lowest id wins a tie), and so is a
    temperature too small to divide fp32 logits by (below ~1.2e-38). Otherwise (logits - max) /
    temperature (shifted first, so a tiny temperature gives -inf, never +inf or NaN), then top-k
    (keep the k largest; 0 = all), then top-p (keep the smallest most-probable set whose mass
    reaches top_p; the best id is always kept, so a vanishing top_p is greedy), then one draw
    from `generator` (seed it for reproducible output; it must live on logits' device).
    Logits are expected finite (`check_logits`).
    """
    if not (0 <= temperature < math.inf and 0 < top_p <= 1 and top_k >= 0):  # NaN fails too
        raise ValueError(f"need finite temperature >= 0, 0 < top_p <= 1, top_k >= 0; got "
                         f"{temperature}, {top_p}, {top_k}")
    x = logits.float().reshape(-1)  # [V] fp32
    if is_greedy(temperature):
        return int(torch.argmax(x))
    x = (x - x.max()) / temperature  # max -> 0, the rest <= 0 (-inf when tiny): no NaN
    if 0 < top_k < x.numel():
        keep = torch.topk(x, top_k).indices  # exactly k ids, ties broken by topk
        masked = torch.full_like(x, float("-inf"))
        masked[keep] = x[keep]
        x = masked
    if top_p < 1:
        order = torch.argsort(x, descending=True)  # [V]
        probs = torch.softmax(x[order], dim=-1)  # [V] sorted descending
        before = torch.cumsum(probs, dim=-1) - probs  # mass strictly ahead of each id
        cut = before >= top_p  # top_p is compared in fp32: 1e-300 becomes 0
        cut[0] = False  # the best id is always kept
        drop = order[cut]
        x = x.clone()
        x[drop] = float("-inf")
    probs = torch.softmax(x, dim=-1)  # [V]
    return int(torch.multinomial(probs, 1, generator=generator))


def prefill(model, state, ids: Sequence[int], chunk: int = 64,
            on_forward: ForwardHook | None = None) -> torch.Tensor:
    """Run prompt `ids` through `model` in chunks of `chunk` tokens, continuing `state`.

    Returns the logits [V] of the last prompt token. Chunking bounds the activations
    (`plan.plan_for`; a streaming provider runs a chunk's experts in windows that fit its
    slots); the result equals one whole-prompt forward up to float rounding. Blocks until done.
    """
    if chunk < 1:
        raise ValueError(f"prefill chunk must be >= 1, got {chunk}")
    ids = [int(t) for t in ids]
    if not ids:
        raise ValueError("prefill needs at least one token")
    last = None
    for i in range(0, len(ids), chunk):
        part = ids[i:i + chunk]
        start = state.tokens
        last = check_logits(model.prefill(part, state)[-1], "prefill", start + len(part) - 1)
        if on_forward is not None:
            on_forward("prefill", start, len(part))
    return last


class _Stopped(Exception):
    """`stop()` said yes after a forward (raised through `prefill`, caught in generate_step)."""


def generate_step(model, prompt_ids: Iterable[int], *, max_tokens: int,
                  temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                  seed: int | None = None, frequency_penalty: float = 0.0,
                  presence_penalty: float = 0.0, stop_ids: Iterable[int] = (),
                  prefill_chunk: int = 64, trace=None, stats: GenerationStats | None = None,
                  state=None, stop: Callable[[], bool] | None = None) -> Iterator[int]:
    """Yield generated token ids one by one as they are produced.

    Prefills `prompt_ids` (chunks of `prefill_chunk`) into a fresh state (or `state`, which is
    continued and left holding the sequence), then samples (see `sample`; `seed` seeds one
    torch.Generator for the whole run, None: `fresh_seed()`, kept in `stats.seed`) and decodes
    until a stop id (not yielded) or `max_tokens` ids. `frequency_penalty` / `presence_penalty`
    (OpenAI's, `apply_penalties`) lower the logits of ids already generated, greedy included.
    `trace`: an object with `on_forward(model, phase, first_position, n_tokens)` (e.g.
    `trace.RouteTrace`), called after every forward. `stop()` is asked after every forward
    (prefill chunks included): True ends generation there, `stats.stop_reason` "stopped", with
    the state whole. `stats` (optional) is filled as it runs; the same `GenerationStats` is the
    generator's return value (`StopIteration.value`).
    Each step blocks on the model (and on expert I/O when streaming).
    """
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    if not (math.isfinite(frequency_penalty) and math.isfinite(presence_penalty)):
        raise ValueError(f"penalties must be finite, got {frequency_penalty}, {presence_penalty}")
    stats = GenerationStats() if stats is None else stats
    prompt = [int(t) for t in prompt_ids]
    stops = frozenset(int(t) for t in stop_ids)
    stats.prompt_tokens = len(prompt)
    state = model.new_state() if state is None else state
    if max_tokens == 0:
        stats.stop_reason = "length"
        return stats

    def after_forward(phase: str, pos: int, n: int) -> None:
        if trace is not None:
            trace.on_forward(model, phase, pos, n)
        if stop is not None and stop():
            raise _Stopped

    t0 = time.perf_counter()
    try:
        logits = prefill(model, state, prompt, prefill_chunk, after_forward)  # [V]
    except _Stopped:
        stats.stop_reason = "stopped"
        return stats
    if not is_greedy(temperature):
        stats.seed = fresh_seed() if seed is None else int(seed)
    gen = torch.Generator(device=logits.device).manual_seed(stats.seed or 0)
    # How often each id was generated: only kept when a penalty needs it.
    counts = None if frequency_penalty == presence_penalty == 0 else \
        torch.zeros(logits.numel(), dtype=torch.float32, device=logits.device)  # [V]
    stats.prefill_s = time.perf_counter() - t0
    for i in range(max_tokens):
        if counts is not None:
            logits = apply_penalties(logits, counts, frequency_penalty, presence_penalty)
        tok = sample(logits, temperature=temperature, top_p=top_p, top_k=top_k, generator=gen)
        if i == 0:
            stats.ttft_s = time.perf_counter() - t0
        if tok in stops:
            stats.stop_reason, stats.stop_id = "stop", tok
            return stats
        stats.generated_tokens += 1
        if counts is not None:
            counts[tok] += 1
        yield tok
        if i + 1 == max_tokens:
            break
        t1 = time.perf_counter()  # the consumer's time between yields is not ours
        pos = state.tokens
        logits = check_logits(model.decode(tok, state), "decode", pos)  # [V]
        stats.decode_forwards += 1
        stats.decode_s += time.perf_counter() - t1
        try:  # trace writing and the stop check are not model time
            after_forward("decode", pos, 1)
        except _Stopped:
            stats.stop_reason = "stopped"
            return stats
    stats.stop_reason = "length"
    return stats


def generate(model, prompt_ids: Iterable[int], **kwargs) -> tuple[list[int], GenerationStats]:
    """All of `generate_step` at once: (generated ids without the stop id, stats)."""
    stats = GenerationStats()
    ids = list(generate_step(model, prompt_ids, stats=stats, **kwargs))
    return ids, stats
