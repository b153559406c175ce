"""The device slot table (offload/slot_table.py) kept in step with the ExpertCache through its
hooks, on fake streams (tests/fake_cuda.py): a key's row entry appears only when its fill
commits and goes when it leaves its slot; pins keep it; a launch reads a row no older than the
cache and waits for the copies behind it; a slot is rewritten only after the launches that read
it; concurrent fills leave the table equal to the cache."""

import threading

import numpy as np
import pytest
from fake_cuda import FakeStreams

from mtplx_runtime.offload.cache import ExpertCache
from mtplx_runtime.offload.device_io import tier_mover
from mtplx_runtime.offload.slot_table import SlotTable

PAGE = 4096


def cache_with_table(slots=2, host=0, layers=(1, 2), experts=8, scope="layer"):
    streams = FakeStreams()
    table = SlotTable(layers, experts, streams)
    cache = ExpertCache(PAGE, slots * len(layers) * PAGE if scope == "layer" else slots * PAGE,
                        host * PAGE, layers=layers, scope=scope, device="cpu",
                        on_slot=table.on_slot, mover=tier_mover(streams, table))
    return cache, table, streams


def fill(cache, streams, key, byte):
    """What the fill pipeline does for `key`: reserve, the bytes copied on the copy stream from a
    host buffer, commit. Returns the slot (None if nothing could be reserved)."""
    ref = cache.reserve(key)
    if ref is None:
        return None
    src = np.full(PAGE, byte, dtype=np.uint8)
    fill.keep.append(src)  # the copy runs later: keep its source alive
    tier = cache.tier(ref.tier)
    streams.copy_bytes(tier.address(ref.slot), src.__array_interface__["data"][0], PAGE)
    cache.commit(key)
    return ref.slot


fill.keep = []


def row(table, layer):
    return table.host[table.layers.index(layer)].tolist()


def test_a_key_enters_the_table_at_commit_not_at_reserve():
    cache, table, streams = cache_with_table()
    ref = cache.reserve((1, 3))
    assert table.slot((1, 3)) == -1  # loading: no kernel may name the slot yet
    cache.commit((1, 3))
    assert table.slot((1, 3)) == ref.slot and not table.fully_resident(1)
    assert row(table, 2) == [-1] * 8


def test_eviction_clears_the_entry_and_pins_keep_it():
    cache, table, streams = cache_with_table(slots=2, layers=(1,))
    fill(cache, streams, (1, 0), 1)
    fill(cache, streams, (1, 1), 2)
    cache.pin([(1, 0), (1, 1)])
    assert fill(cache, streams, (1, 2), 3) is None  # both pinned: nothing evicted
    assert table.slot((1, 0)) >= 0 and table.slot((1, 1)) >= 0
    cache.unpin([(1, 0)])
    slot = fill(cache, streams, (1, 2), 3)
    assert table.slot((1, 0)) == -1 and table.slot((1, 2)) == slot
    assert sorted(s for s in row(table, 1) if s >= 0) == [0, 1]


def test_demotion_and_promotion_move_the_entry():
    cache, table, streams = cache_with_table(slots=1, host=2, layers=(1,))
    fill(cache, streams, (1, 0), 7)
    fill(cache, streams, (1, 1), 8)  # (1, 0) demoted to the host tier
    assert table.slot((1, 0)) == -1 and table.slot((1, 1)) == 0
    hits, misses = cache.lookup([(1, 0)])  # promoted back, (1, 1) demoted
    assert not misses and table.slot((1, 0)) == 0 and table.slot((1, 1)) == -1
    with table.launch(1) as slot_of:
        assert slot_of.tolist()[:2] == [0, -1]
    streams.run_copies(10**9)
    assert (cache.tier("compute").view(0) == 7).all()  # the record that came back


def test_a_launch_waits_for_the_copies_of_its_row_and_uploads_a_changed_row_once():
    cache, table, streams = cache_with_table(slots=2, layers=(1,))
    fill(cache, streams, (1, 0), 5)
    tier = cache.tier("compute")
    with table.launch(1) as slot_of:
        assert slot_of.tolist()[0] == 0
        streams.launch([tier.address(0)])  # raises if the copy was not waited for
    assert (tier.view(0) == 5).all()
    with table.launch(1):
        pass
    assert table.uploads == 1  # the row did not change


def test_a_launch_that_skipped_the_copy_wait_is_caught():
    """The fake's own check: a kernel reading a slot whose copy the compute stream never waited
    on fails (what the table's launch prevents)."""
    cache, table, streams = cache_with_table(slots=2, layers=(1,))
    fill(cache, streams, (1, 0), 5)
    with pytest.raises(AssertionError, match="never waited"):
        streams.launch([cache.tier("compute").address(0)])


def test_a_slot_is_rewritten_only_after_the_launches_that_read_it():
    cache, table, streams = cache_with_table(slots=1, layers=(1, 2), scope="global")
    tier = cache.tier("compute")
    fill(cache, streams, (1, 0), 1)
    with table.launch(1):
        streams.launch([tier.address(0)])
    guard = table.guard(0)
    assert guard is not None and guard.stream == "compute"
    # (2, 4) evicts (1, 0): the copy stream must wait for the launch first
    ref = cache.reserve((2, 4))
    assert ref.slot == 0 and table.slot((1, 0)) == -1
    with pytest.raises(AssertionError, match="before launch"):
        streams.copy_bytes(tier.address(0), tier.address(0), PAGE)
    streams.copy_wait(table.guard(0))
    streams.copy_bytes(tier.address(0), tier.address(0), PAGE)


def test_whole_launches_only_a_fully_resident_layer():
    cache, table, streams = cache_with_table(slots=4, layers=(1,), experts=4)
    for e in range(3):
        fill(cache, streams, (1, e), e)
    with table.launch(1, whole=True) as slot_of:
        assert slot_of is None
    assert table.guard(0) is None  # nothing launched, no event
    fill(cache, streams, (1, 3), 3)
    assert table.fully_resident(1)
    with table.launch(1, whole=True) as slot_of:
        assert sorted(slot_of.tolist()) == [0, 1, 2, 3]
    cache.unpin()
    fill(cache, streams, (1, 9), 9)  # out of the table's range: ignored, no error
    assert table.fully_resident(1) or table.slot((1, 9)) == -1


def test_an_eviction_during_a_launch_waits_for_its_event():
    """leave() from another thread while a launch holds the table: it lands after the launch's
    event is recorded, so the slot's next writer waits for that launch."""
    cache, table, streams = cache_with_table(slots=1, layers=(1, 2), scope="global")
    fill(cache, streams, (1, 0), 1)
    entered, done = threading.Event(), []

    def evict():
        entered.wait()
        done.append(cache.reserve((2, 0)))

    t = threading.Thread(target=evict)
    t.start()
    with table.launch(1) as slot_of:
        entered.set()
        t.join(0.2)
        assert slot_of.tolist()[0] == 0 and not done  # blocked on the table's lock
        streams.launch([cache.tier("compute").address(0)])
    t.join()
    assert done[0].slot == 0 and table.guard(0).pos == streams.launches


def test_concurrent_fills_leave_the_table_equal_to_the_cache():
    cache, table, streams = cache_with_table(slots=3, layers=(1, 2, 3), experts=16)
    rng = np.random.default_rng(0)
    keys = [(int(la), int(e)) for la, e in zip(rng.integers(1, 4, 600), rng.integers(0, 16, 600))]
    errors = []

    def worker(part):
        try:
            for key in part:
                if cache.where(key) is None:
                    try:
                        fill(cache, streams, key, key[1])
                    except ValueError:  # another thread reserved it first
                        pass
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(keys[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    want = np.full((3, 16), -1, dtype=np.int32)
    for la in (1, 2, 3):
        for e in range(16):
            ref = cache.where((la, e))
            if ref is not None and ref.tier == "compute":
                want[la - 1, e] = ref.slot
    assert (table.host == want).all()
    for la in (1, 2, 3):
        with table.launch(la) as slot_of:
            assert slot_of.tolist() == want[la - 1].tolist()


def test_slot_addresses_map_back_to_their_slots():
    """What a GDS read into a slot's view uses to find the slot's guard."""
    cache, table, streams = cache_with_table(slots=3, layers=(1,))
    tier = cache.tier("compute")
    assert [tier.slot_at(tier.address(s)) for s in range(3)] == [0, 1, 2]
    assert tier.address(1) == tier.view(1).__array_interface__["data"][0]
    for bad in (tier.address(1) + 8, tier.address(0) - tier.slot_bytes):
        with pytest.raises(ValueError, match="no slot's start"):
            tier.slot_at(bad)
