"""Replacement policies on scripted traces, hit and eviction counts computed by hand."""

import math

import pytest

from mtplx_runtime.offload.policy import (
    BeladyPolicy,
    DecayedFrequencyPolicy,
    LRUPolicy,
    Scope,
    make_policy,
    replay,
)

A, B, C = (0, 1), (0, 2), (0, 3)


def one_per_step(keys):
    return [[k] for k in keys]


def global_scope(capacity, factory):
    return Scope("global", capacity, lambda g: factory())


def test_lru_trace_exact():
    # cap 2: a- b- a+ c-(evict b) b-(evict a) a-(evict c)
    st = replay(one_per_step([A, B, A, C, B, A]), global_scope(2, LRUPolicy))
    assert (st.hits, st.misses, st.evictions, st.bypassed) == (1, 5, 3, 0)


def test_lru_victim_order_and_eligibility():
    p = LRUPolicy()
    for k in (A, B, C):
        p.touch(k)
        p.insert(k)
    p.touch(A)  # order now B, C, A
    assert p.victim() == B
    assert p.victim(lambda k: k != B) == C
    assert p.victim({A}) == A
    assert p.victim(lambda k: False) is None
    p.remove(B)
    assert B not in p and len(p) == 2 and p.score(B) == 2.0  # history survives removal


def test_decayed_frequency_scores_by_hand():
    p = DecayedFrequencyPolicy(decay=0.9)
    p.touch(A)  # t1
    p.touch(A)  # t2
    p.touch(B)  # t3: a = 0.9**2 + 0.9 = 1.71, b = 1
    assert math.isclose(math.exp(p.score(A) - p.score(B)), 1.71)  # score: log of the count
    assert p.hotter(A, B)
    assert p.score(C) == -math.inf


def test_decay_changes_the_victim():
    # a touched at t1, t2; b at t3; c misses at t4 with cap 2 (no admission).
    # decay 0.5: a = .5**3 + .5**2 = 0.375 < b = 0.5 -> evict a.
    # decay 0.9: a = .729 + .81 = 1.539 > b = 0.9 -> evict b.
    for decay, evicted in ((0.5, A), (0.9, B)):
        scope = global_scope(2, lambda d=decay: DecayedFrequencyPolicy(d, admission=False))
        st = replay(one_per_step([A, A, B, C]), scope)
        pol = scope.policies[None]
        assert (st.hits, st.misses, st.evictions) == (1, 3, 1)
        assert evicted not in pol and C in pol


def test_admission_first_seen_does_not_evict_hotter():
    # cap 1, decay 0.9: t3 b (1.0) vs a (1.71): bypassed; t4 b (1.9) vs a (1.539): admitted.
    scope = global_scope(1, lambda: DecayedFrequencyPolicy(0.9, admission=True))
    st = replay(one_per_step([A, A, B, B]), scope)
    assert (st.hits, st.misses, st.evictions, st.bypassed) == (1, 3, 1, 1)
    assert B in scope.policies[None]
    # Without admission the first b evicts a at once; the second b hits.
    scope = global_scope(1, lambda: DecayedFrequencyPolicy(0.9, admission=False))
    st = replay(one_per_step([A, A, B, B]), scope)
    assert (st.hits, st.misses, st.evictions, st.bypassed) == (2, 2, 1, 0)


def test_lfu_decay_one_counts():
    p = DecayedFrequencyPolicy(decay=1.0)
    for k in (A, A, A, B):
        p.touch(k)
    assert math.isclose(math.exp(p.score(A) - p.score(B)), 3.0)


def test_freq_ties_evict_least_recent():
    p = DecayedFrequencyPolicy(decay=1.0, admission=False)
    for k in (A, B):
        p.touch(k)
        p.insert(k)
    assert p.victim() == A


def test_belady_min_with_and_without_bypass():
    trace = [A, B, C, A, B]
    # bypass: c is never used again -> not cached; a, b hit.
    st = replay(one_per_step(trace), global_scope(2, lambda: BeladyPolicy(trace)))
    assert (st.hits, st.misses, st.bypassed) == (2, 3, 1)
    # classic MIN: c evicts b (next use 4 > a's 3); a hits, b misses.
    st = replay(one_per_step(trace), global_scope(2, lambda: BeladyPolicy(trace, bypass=False)))
    assert (st.hits, st.misses, st.evictions) == (1, 4, 2)


def test_belady_rejects_off_trace_touch():
    p = BeladyPolicy([A, B])
    with pytest.raises(ValueError):
        p.touch(B)


def test_belady_beats_lru_on_a_loop():
    trace = [(0, i % 3) for i in range(30)]
    lru = replay(one_per_step(trace), global_scope(2, LRUPolicy))
    opt = replay(one_per_step(trace), global_scope(2, lambda: BeladyPolicy(trace)))
    assert lru.hits == 0 and opt.hits > 10


def test_scope_per_layer_vs_global():
    trace = [(0, i % 3) for i in range(12)] + [(1, 0)]
    per = Scope("layer", 4, lambda g: LRUPolicy(), layers=[0, 1])
    glob = Scope("global", 4, lambda g: LRUPolicy())
    assert per.capacity((0, 0)) == 2 and glob.capacity((0, 0)) == 4
    assert per.policy((0, 0)) is not per.policy((1, 0))
    assert replay(one_per_step(trace), per).hits == 0  # 3 keys cycling through 2 slots
    assert replay(one_per_step(trace), glob).hits == 9
    with pytest.raises(KeyError):
        per.policy((7, 0))


def test_per_layer_belady_uses_layer_subsequence():
    steps = [[(0, 1), (1, 5)], [(0, 2), (1, 5)], [(0, 1), (1, 6)]]
    flat = [k for s in steps for k in s]
    scope = Scope("layer", 2, lambda g: BeladyPolicy([k for k in flat if k[0] == g]),
                  layers=[0, 1])
    st = replay(steps, scope)
    # one slot per layer; layer 0: 1- 2-(bypassed: never reused) 1+; layer 1: 5- 5+ 6-
    assert st.per_layer == {0: [1, 2], 1: [1, 2]} and st.bypassed == 2


def test_step_keys_are_pinned_in_replay():
    # cap 1, a and b in the same step: b may not evict a (pinned), so it is bypassed.
    st = replay([[A, B]], global_scope(1, LRUPolicy))
    assert (st.misses, st.evictions, st.bypassed) == (2, 0, 1)


def test_make_policy():
    assert isinstance(make_policy("lru"), LRUPolicy)
    p = make_policy("freq", decay=0.5, admission=False)
    assert isinstance(p, DecayedFrequencyPolicy) and p.decay == 0.5 and not p.admission
    with pytest.raises(ValueError):
        make_policy("belady")
    with pytest.raises(ValueError):
        DecayedFrequencyPolicy(decay=0.0)
