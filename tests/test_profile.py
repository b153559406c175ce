"""Cache profiler: hand-made traces give exact hits per policy (Belady included); on random
traces Belady is the optimum and LRU/Belady hit rates never fall with capacity; the fast driver
equals a real ExpertCache where their semantics meet; formats; a K3-shaped run with plots."""

import argparse

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtplx_runtime.cli import profile as cli
from mtplx_runtime.profile import load, profile, record_bytes, replay_runtime, synthetic
from mtplx_runtime.profile.replay import POLICY_NAMES
from mtplx_runtime.profile.traces import _from_array, write_route_trace


def one_layer(seq_steps):
    k = max(len(s) for s in seq_steps)
    arr = np.full((len(seq_steps), 1, k), -1, np.int32)
    for i, s in enumerate(seq_steps):
        arr[i, 0, :len(s)] = s
    return _from_array(arr, [1], 8)


def hits(trace, cap, policies=POLICY_NAMES):
    res, _ = profile(trace, list(policies), [cap], workers=1)
    return {r.policy: r.hits for r in res}


def test_hand_made_trace_exact_hits():
    tr = one_layer([[e] for e in (1, 2, 3, 1, 2, 4, 1, 2)])
    # LRU thrashes; freq admission refuses 4; MIN bypasses 3 and 4. At 3 slots all keep 1, 2.
    assert hits(tr, 2) == {"lru": 0, "lfu": 1, "freq": 2, "belady": 4}
    assert hits(tr, 3) == {"lru": 4, "lfu": 4, "freq": 4, "belady": 4}


def test_step_keys_are_pinned():
    # Capacity 1: the second key of a step cannot evict the first (pinned) and goes uncached.
    tr = one_layer([[1, 2], [1], [2]])
    assert hits(tr, 1, ["lru"]) == {"lru": 1, "belady": 1}


def test_global_scope_shares_capacity():
    arr = np.array([[[0], [0]], [[0], [1]], [[0], [0]]], np.int32)  # [N=3, L=2, K=1]
    tr = _from_array(arr, [1, 2], 2)
    res, _ = profile(tr, ["lru"], [2], scope="global", workers=1)
    assert {r.policy: r.hits for r in res} == {"lru": 2, "belady": 3}
    res, _ = profile(tr, ["lru"], [2], scope="layer", workers=1)  # one slot per layer
    assert {r.policy: r.hits for r in res} == {"lru": 2, "belady": 3}


def test_fast_driver_matches_expert_cache_when_nothing_is_refused():
    tr = synthetic("zipf", tokens=200, layers=3, experts=16, top_k=2, seed=4)
    for per_layer in (2, 4, 7):
        cache = replay_runtime(tr, policy="lru", compute_slots=3 * per_layer, transient_slots=0)
        dev = cache.totals()["compute"]
        res, _ = profile(tr, ["lru"], [3 * per_layer], workers=1)
        assert (res[0].hits, res[0].misses) == (dev["hits"], dev["misses"])


@st.composite
def traces(draw):
    e = draw(st.integers(2, 8))
    k = draw(st.integers(1, min(3, e)))
    n = draw(st.integers(1, 30))
    nl = draw(st.integers(1, 2))
    rows = [[sorted(draw(st.permutations(range(e)))[:k]) for _ in range(nl)] for _ in range(n)]
    return _from_array(np.array(rows, np.int32), list(range(nl)), e)


@settings(max_examples=300, deadline=None)
@given(traces(), st.sampled_from(["layer", "global"]))
def test_belady_is_optimal_and_monotone(tr, scope):
    # MIN is replayed key by key without the runtime's step pinning: an upper bound everywhere.
    caps = [len(tr.layers) * c for c in range(1, tr.experts + 2)]
    res, _ = profile(tr, list(POLICY_NAMES), caps, scope=scope, workers=1)
    by = {(r.policy, r.capacity): r.hits for r in res}
    for c in caps:
        for p in POLICY_NAMES:
            assert by[("belady", c)] >= by[(p, c)], (p, c)
    for p in ("lru", "belady"):
        seq = [by[(p, c)] for c in caps]
        assert seq == sorted(seq), (p, seq)


def test_record_bytes_are_the_k3_table():
    assert record_bytes("t158") == 7_741_440
    assert record_bytes("w3") == 13_418_496
    assert record_bytes("mxfp4") == 17_547_264


def test_plain_format_and_jsonl_round_trip(tmp_path):
    p = tmp_path / "plain.txt"
    p.write_text("# mtplx-plain-routes\n# layers=3,5 experts=10\n1 2;3,4\n\n2 9;4 0\n")
    tr = load(str(p))
    assert tr.layers == [3, 5] and tr.experts == 10 and tr.top_k == 2
    assert tr.routes.tolist() == [[[1, 2], [3, 4]], [[2, 9], [0, 4]]]
    j = tmp_path / "t.jsonl"
    write_route_trace(tr, j)
    back = load(str(j))
    assert back.layers == tr.layers and np.array_equal(back.routes, tr.routes)
    np.save(tmp_path / "r.npy", tr.routes)
    assert np.array_equal(load(str(tmp_path / "r.npy")).routes, tr.routes)
    bad = tmp_path / "bad.txt"
    bad.write_text("1 1;2 3\n")
    with pytest.raises(ValueError, match="repeated"):
        load(str(bad))


def test_synthetic_generators_shape_and_locality():
    for kind in ("uniform", "zipf", "temporal"):
        tr = synthetic(kind, tokens=50, layers=3, experts=32, top_k=4, seed=1)
        assert tr.routes.shape == (50, 3, 4)
        assert all(len(set(r)) == 4 for r in tr.routes.reshape(-1, 4).tolist())
    hot = synthetic("temporal", tokens=200, layers=2, experts=64, top_k=8, locality=0.9)
    cold = synthetic("uniform", tokens=200, layers=2, experts=64, top_k=8)
    assert hits(hot, 32, ["lru"])["lru"] > 2 * hits(cold, 32, ["lru"])["lru"]


def parse(argv):
    p = argparse.ArgumentParser()
    cli.add_args(p)
    return p.parse_args(argv)


def test_cli_small_run_writes_every_output(tmp_path, capsys):
    out = tmp_path / "p.png"
    args = parse(["synth:zipf,tokens=300,layers=4,experts=32,top_k=4", "--capacity", "16,64",
                  "--policy", "lru,lfu,freq:0.9", "--plot", str(out), "--json",
                  str(tmp_path / "p.json"), "--csv", str(tmp_path / "p.csv"), "--workers", "1"])
    assert cli.main(args) == 0
    text = capsys.readouterr().out
    assert "belady" in text and "freq:0.9" in text
    for f in (out, tmp_path / "p-layers.png", tmp_path / "p-reuse.png", tmp_path / "p.json",
              tmp_path / "p.csv"):
        assert f.stat().st_size > 0


@pytest.mark.slow
def test_k3_shaped_10k_tokens_report(tmp_path):
    tr = synthetic("zipf", tokens=10_000, seed=2)  # 92 layers x 896 experts, top-16
    path = tmp_path / "k3.npy"
    np.save(path, tr.routes)
    out = tmp_path / "k3.png"
    s = cli.run(parse([str(path), "--capacity-bytes", "23GiB", "--policy", "lru",
                       "--plot", str(out), "--json", str(tmp_path / "k3.json")]))
    assert s["decode_tokens"] == 10_000 and len(s["results"]) == 2
    assert 0 < s["results"][0]["belady_share"] <= 1
    for f in s["plots"]:
        assert (tmp_path / f).stat().st_size > 0


def test_prefetch_quality_by_hand(tmp_path):
    """Coverage = share of misses that were guessed; waste = guesses never used per covered miss;
    recall = share of the used experts that were guessed. Worked out for one layer, depth 1."""
    import json

    from mtplx_runtime.profile.stats import prefetch_by_depth, prefetch_quality
    from mtplx_runtime.profile.traces import read_route_trace

    lines = [
        {"format": "mtplx-route-trace-v1", "model": "hand", "layers": [1, 2], "experts": 8,
         "top_k": 2, "record_bytes": 4096},
        {"t": 0, "phase": "prefill", "routes": {"1": [0, 1], "2": [2, 3]}},
        # decode 0: layer 2 uses {4, 5}; guessed {4, 6} -> hit 4, wasted 6
        {"t": 1, "phase": "decode", "routes": {"1": [0, 1], "2": [4, 5]},
         "predicted": {"2": {"1": [4, 6]}}},
        # decode 1: layer 2 uses {4, 7}; guessed {7, 0} -> hit 7, wasted 0
        {"t": 2, "phase": "decode", "routes": {"1": [0, 2], "2": [4, 7]},
         "predicted": {"2": {"1": [0, 7]}}},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    trace = read_route_trace(path)
    # Misses per layer per decode line, as a replay would report them: layer 2 missed {4, 5}
    # on the first decode token and {7} on the second (4 was cached by then).
    missed = [[[], []], [[4, 5], [7]]]
    (row,) = prefetch_quality(trace, missed)
    assert (row["layer"], row["depth"], row["misses"]) == (2, 1, 3)
    assert row["coverage"] == 2 / 3  # 4 and 7 of the misses {4, 5, 7} were guessed
    assert row["waste"] == 2 / 2  # 6 and 0 never used, per covered miss (4 and 7)
    assert row["recall"] == 2 / 4  # 4 and 7 of the used {4, 5, 4, 7}
    assert prefetch_by_depth([row]) == {1: {"coverage": 2 / 3}}
