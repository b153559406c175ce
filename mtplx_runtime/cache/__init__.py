"""Expert cache: replacement policies (pure, shared with trace replay), slot tiers, ExpertCache.

The cache owns slots, replacement order and counters; it does no I/O (STYLE.md principle 3).
"""

from .expert_cache import ExpertCache, SlotRef, TierCounters
from .policy import (
    BeladyPolicy,
    DecayedFrequencyPolicy,
    LRUPolicy,
    Policy,
    ReplayStats,
    Scope,
    make_policy,
    replay,
)
from .slots import SlotTier, copy_slot, cuda_available

__all__ = [
    "BeladyPolicy", "DecayedFrequencyPolicy", "ExpertCache", "LRUPolicy", "Policy",
    "ReplayStats", "Scope", "SlotRef", "SlotTier", "TierCounters", "copy_slot", "cuda_available",
    "make_policy", "replay",
]
