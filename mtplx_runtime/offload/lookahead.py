"""Residual-stream lookahead, the offload side: turn guesses into prefetch keys and score them.

    model (moe.predict): hidden at layer l -> router_j (j = l+1..l+d) -> ids -> provider.hint
        -> predicted_keys -> speculate(keys)     ... later: actual route of layer j -> score

Applying a later layer's router to the current hidden state recovers most of its top-k
(ARCHITECTURE.md "Lookahead"); the model makes the guesses (it owns the routers), this module
orders them for the prefetcher, and `LookaheadScore` keeps the recall / precision counters per
depth that the trace writer and profiler report.

Shape legend: T tokens, D hidden (7168), E experts (896), K top-k (16).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import torch

__all__ = ["predicted_keys", "LookaheadScore", "DepthCounts"]


def predicted_keys(layers: Sequence[int], preds: Sequence[torch.Tensor]
                   ) -> list[tuple[int, int]]:
    """Flatten predictions into speculate() order: depth 1 first, then by token and rank within
    a depth; each (layer, expert) once. `layers[j]` is the model layer of `preds[j]`."""
    seen: dict[tuple[int, int], None] = {}
    for layer, ids in zip(layers, preds, strict=True):
        for e in ids.reshape(-1).tolist():
            seen.setdefault((int(layer), int(e)), None)
    return list(seen)


@dataclass(slots=True)
class DepthCounts:
    """Counters for one lookahead depth, summed over scored (prediction, actual) pairs.
    Set counts use the union over the T tokens (what gets fetched); token counts compare each
    token's predicted top-k with its own actual top-k (the literature's "top-k overlap")."""

    pairs: int = 0
    predicted: int = 0      # |union of predicted ids|
    actual: int = 0         # |union of actual ids|
    hits: int = 0           # |predicted ∩ actual|
    token_slots: int = 0    # sum over tokens of K (actual)
    token_hits: int = 0     # sum over tokens of |pred_t ∩ actual_t|

    @property
    def recall(self) -> float:
        return self.hits / self.actual if self.actual else 0.0

    @property
    def precision(self) -> float:
        return self.hits / self.predicted if self.predicted else 0.0

    @property
    def overlap(self) -> float:
        return self.token_hits / self.token_slots if self.token_slots else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "recall": self.recall, "precision": self.precision,
                "overlap": self.overlap}


class LookaheadScore:
    """Scores predictions once the predicted layers have actually routed.

    `add_predictions(layers, preds)` files the guesses for layers[j] at depth j+1;
    `add_actual(layer, ids)` scores every guess filed for `layer` and forgets them. Guesses whose
    layer never routes (generation ended) stay pending until `clear_pending()`.
    """

    def __init__(self) -> None:
        self.by_depth: dict[int, DepthCounts] = defaultdict(DepthCounts)
        self._pending: dict[int, list[tuple[int, torch.Tensor]]] = defaultdict(list)

    def add_predictions(self, layers: Sequence[int], preds: Sequence[torch.Tensor]) -> None:
        for depth, (layer, ids) in enumerate(zip(layers, preds, strict=True), start=1):
            self._pending[int(layer)].append((depth, ids.detach().cpu()))

    def add_actual(self, layer: int, ids: torch.Tensor) -> None:
        """ids: [T, K] the route layer `layer` actually took (same T as the predictions)."""
        actual = ids.detach().cpu()
        act_rows = [set(r) for r in actual.tolist()]  # [T] sets
        act_all = set().union(*act_rows)
        for depth, pred in self._pending.pop(int(layer), []):
            c = self.by_depth[depth]
            pred_rows = [set(r) for r in pred.tolist()]
            pred_all = set().union(*pred_rows)
            c.pairs += 1
            c.predicted += len(pred_all)
            c.actual += len(act_all)
            c.hits += len(pred_all & act_all)
            if len(pred_rows) == len(act_rows):
                c.token_slots += sum(len(a) for a in act_rows)
                c.token_hits += sum(len(p & a) for p, a in zip(pred_rows, act_rows))

    def clear_pending(self) -> None:
        self._pending.clear()

    def summary(self) -> dict[int, dict]:
        """{depth: counters + recall, precision, overlap}, depths ascending."""
        return {d: self.by_depth[d].as_dict() for d in sorted(self.by_depth)}

    def merge(self, others: Iterable[LookaheadScore]) -> None:
        for o in others:
            for d, c in o.by_depth.items():
                m = self.by_depth[d]
                for f in ("pairs", "predicted", "actual", "hits", "token_slots", "token_hits"):
                    setattr(m, f, getattr(m, f) + getattr(c, f))
