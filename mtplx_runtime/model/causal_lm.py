"""What every model family's class shares (KimiK3, DeepseekV3): the per-sequence state and the
token-level entry points, written once over the family's own `run` and `new_state`.

    token ids -> family.run(ids, state) -> logits [T, V];  prefill / decode / logits over it
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from .moe import ExpertProvider


@dataclass
class SequenceState:
    """Everything one sequence carries between steps: one entry per layer (a KDA state or an MLA
    cache), and how many tokens it has seen."""

    layers: list
    tokens: int = 0


class CausalLM(ABC):
    """Base of a family's model class: `cfg`, `top` (global tensors by short name), `layers`,
    `dtype`; a subclass defines the three methods below."""

    def __init__(self, cfg, top: dict[str, torch.Tensor], layers: list, dtype: torch.dtype):
        self.cfg, self.top, self.layers, self.dtype = cfg, top, layers, dtype
        moes = self.moe_blocks()
        for i, moe in enumerate(moes):
            moe.later = moes[i + 1:]  # lookahead routes through these

    @abstractmethod
    def moe_blocks(self) -> list:
        """The MoE blocks in layer order (each with `provider`, `layer`, `last_ids`)."""

    @abstractmethod
    def new_state(self) -> SequenceState:
        """A fresh sequence's state."""

    @abstractmethod
    def run(self, token_ids: torch.Tensor, state: SequenceState | None) -> torch.Tensor:
        """Logits [T, V] for `token_ids` [T], outside inference mode (so tools can train through
        it); `state` None: a fresh sequence whose state is not kept."""

    def use_provider(self, provider: ExpertProvider) -> None:
        """Make every MoE block use `provider` (tests and benchmarks that compare providers on
        one model; `engine.runtime.load` builds the model with its provider in place)."""
        for moe in self.moe_blocks():
            moe.provider = provider

    def begin_forward(self, tokens: int) -> None:
        """Tell each distinct expert provider that a forward of `tokens` tokens starts."""
        for provider in {id(m.provider): m.provider for m in self.moe_blocks()}.values():
            provider.begin_forward(tokens)

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, state: SequenceState) -> torch.Tensor:
        """Logits [T, V] for `token_ids` [T] continuing `state` (updated in place)."""
        return self.run(token_ids, state)

    def logits(self, token_ids) -> torch.Tensor:
        """Full causal forward over `token_ids` from a fresh state."""
        ids = torch.as_tensor(token_ids, dtype=torch.long)
        return self.forward(ids, self.new_state())

    def prefill(self, token_ids, state: SequenceState) -> torch.Tensor:
        return self.forward(torch.as_tensor(token_ids, dtype=torch.long), state)

    def decode(self, token_id: int, state: SequenceState) -> torch.Tensor:
        """Logits [V] of one next token."""
        return self.forward(torch.tensor([token_id], dtype=torch.long), state)[0]
