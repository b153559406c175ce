"""One sequence's model state kept across the turns of a conversation, so a turn prefills only
the prompt ids the state has not seen (ARCHITECTURE.md "Conversation state").

    prompt ids -> start from: the state's own ids if they begin the prompt, else the mark (where
               the last prompt ended) if it begins the prompt, else a fresh state
               -> generate_step(the rest of the prompt, state) -> reply ids; the state holds all

KDA layers keep a recurrent state that cannot be rolled back to an earlier token (FORMAT.md
"Decode state"), so a state is reused only from a point it can return to: its end, or the mark,
a copy of the KDA states (in host memory) plus the MLA cache lengths, taken after the last
prompt's prefill. The mark covers a reply whose ids re-render differently (BPE of the parsed
text, a reply cut short): the next prompt still begins with the last prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from ..model.kda import KDAState
from .generate import GenerationStats, generate_step


class _Hook:
    """Per-forward hook of one turn: the caller's trace, then the mark at the prompt's end."""

    def __init__(self, session: Session, prompt: list[int], trace):
        self.session, self.prompt, self.trace = session, prompt, trace

    def on_forward(self, model, phase: str, first_position: int, n_tokens: int) -> None:
        if self.trace is not None:
            self.trace.on_forward(model, phase, first_position, n_tokens)
        if phase == "prefill" and first_position + n_tokens == len(self.prompt):
            self.session._mark = (self.prompt, _snapshot(self.session.state))


def _snapshot(state) -> tuple[list, int]:
    """(per layer: host copies of a KDA state's conv and S, or an MLA cache's length; tokens)."""
    return ([(s.conv.to("cpu", copy=True), s.S.to("cpu", copy=True)) if isinstance(s, KDAState)
             else s.len for s in state.layers], state.tokens)


def _restore(state, saved: tuple[list, int]) -> None:
    """Return `state` to a snapshot of itself: copy the KDA states back, trim the MLA caches
    (their rows up to the mark are untouched, later tokens only append)."""
    layers, tokens = saved
    for s, v in zip(state.layers, layers):
        if isinstance(s, KDAState):
            s.conv.copy_(v[0])
            s.S.copy_(v[1])
        else:
            s.trim(v)
    state.tokens = tokens


class Session:
    """A model state reused turn after turn. `ids` are the ids `state` holds; `reused` is how
    many prompt ids the last `generate` did not prefill. One sequence, one thread."""

    def __init__(self, model):
        self.model = model
        self.reused = 0
        self.reset()

    def reset(self) -> None:
        """Forget the state: the next turn prefills its whole prompt."""
        self.state = None
        self.ids: list[int] = []
        self._mark: tuple[list[int], tuple[list, int]] | None = None  # (ids, snapshot)

    def _start(self, prompt: list[int]) -> int:
        """Bring the state to the longest start of `prompt` it can reach (at least one prompt
        id is left to prefill: it gives the first logits); that start's length."""
        n = len(self.ids)
        if self.state is not None and n < len(prompt) and prompt[:n] == self.ids:
            return n
        if self._mark is not None:  # the state holds the mark's ids and more
            ids, saved = self._mark
            if len(ids) < len(prompt) and prompt[:len(ids)] == ids:
                _restore(self.state, saved)
                self.ids = list(ids)
                return len(ids)
        self.reset()
        self.state = self.model.new_state()
        return 0

    def generate(self, prompt_ids: Iterable[int], *, stats: GenerationStats | None = None,
                 stop: Callable[[], bool] | None = None, trace=None, **kwargs) -> Iterator[int]:
        """`generate_step` on the prompt's ids past the reusable start; yields reply ids.

        `stop()` is asked after every forward (prefill chunks included): True ends the reply
        there (`stats.stop_reason` "stopped") with the state whole, as does closing the
        generator. Any exception out of generation drops the state: a forward cut in half (or
        one that produced NaN) leaves it unusable. `kwargs` go to `generate_step`.
        """
        prompt = [int(t) for t in prompt_ids]
        stats = GenerationStats() if stats is None else stats
        self.reused = start = self._start(prompt)
        reply: list[int] = []
        whole = False
        try:
            for t in generate_step(self.model, prompt[start:], state=self.state, stats=stats,
                                   trace=_Hook(self, prompt, trace), stop=stop, **kwargs):
                reply.append(t)
                yield t
            whole = True
        except GeneratorExit:  # the consumer stopped between tokens
            whole = True
            raise
        finally:
            if whole:  # a reply ended by max_tokens leaves its last id undecoded
                self.ids = (prompt + reply)[:self.state.tokens]
            else:
                self.reset()
