"""One contract, checked for every index implementation against a dict; tables reloaded from snapshots."""

import sys

import numpy as np
import pytest

from shardps.core.optim import Adam
from shardps.core.specs import Initializer, TableSpec
from shardps.server.storage.index import DirectIndex, HashIndex
from shardps.server.storage.table import Table

IMPLS = {
    "hash": lambda: HashIndex(capacity=16),
    "direct": lambda: DirectIndex(num_embeddings=10**6),
}


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_index_contract(impl):
    index = IMPLS[impl]()
    rng = np.random.default_rng(0)
    reference: dict[int, int] = {}
    next_slot = 0
    for _ in range(30):
        ids = rng.integers(0, 10**6, rng.integers(1, 3000))
        got = index.lookup(ids)
        want = np.array([reference.get(int(i), -1) for i in ids])
        np.testing.assert_array_equal(got, want)
        new = np.unique(ids[got < 0])
        slots = np.arange(next_slot, next_slot + len(new))
        if len(reference) % 2:  # (a table's new rows come through append, which gives the next slots itself)
            index.insert(new, slots)
        else:
            np.testing.assert_array_equal(index.append(new.astype(np.int32)), slots)
        reference.update(zip(new.tolist(), slots.tolist()))
        next_slot += len(new)
        assert len(index) == len(reference)
    all_ids = np.array(sorted(reference))
    np.testing.assert_array_equal(index.lookup(all_ids), [reference[i] for i in all_ids])


def test_hash_index_any_int64_and_colliding_ids():
    index = HashIndex(capacity=4)
    ids = np.array([-(2**63), 2**63 - 1, -1, 0, 1], dtype=np.int64)
    index.insert(ids, np.arange(5))
    np.testing.assert_array_equal(index.lookup(ids), np.arange(5))
    # Many ids, growth through several doublings, all still found.
    many = np.arange(100_000, dtype=np.int64) * 7919 - 10**9
    index.insert(many, np.arange(5, 100_005))
    np.testing.assert_array_equal(index.lookup(many[::997]), np.arange(5, 100_005)[::997])
    assert index.lookup(np.array([12345678901])).tolist() == [-1]


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_index_keeps_ids_in_slot_order_and_refuses_other_slots(impl):
    index = IMPLS[impl]()
    index.insert(np.array([50, 7, 900]), np.arange(3))
    index.insert(np.array([3]), np.array([3]))
    np.testing.assert_array_equal(index.ids, [50, 7, 900, 3])
    for slots in ([5, 6], [4, 6], [4, 4, 6], [4, 6, 5], [3, 4]):  # a gap, a repeat, out of order, a slot taken
        with pytest.raises(ValueError, match="insertion order"):
            index.insert(np.arange(11, 11 + len(slots)), np.array(slots))
    with pytest.raises(ValueError, match="insertion order"):  # fewer slots than ids (the kernel reads unchecked)
        index.insert(np.array([11, 12, 13]), np.array([4, 5]))
    np.testing.assert_array_equal(index.lookup(np.array([11, 3])), [-1, 3])


@pytest.mark.parametrize("num_embeddings", [None, 10**6])
def test_absent_rows_read_in_any_order_with_repeats_are_made_once_each(num_embeddings):
    """A read of absent ids, repeated and out of order (another client's request) or sorted and unique (a
    client's), makes each row once, from the initializer, whatever order the ids came in."""
    spec = TableSpec(name="t", dim=3, num_embeddings=num_embeddings, optimizer=Adam(lr=0.1),
                     initializer=Initializer("normal", std=0.1, seed=4))
    ids = np.array([90, 5, 90, 700, 5, 5, 42], np.int64)
    want = spec.initializer.rows(ids, 3)
    for order in (ids, np.unique(ids)):
        t = Table(spec, owns=lambda x: np.ones(len(x), bool), expected_rows=4)
        with t.lock:
            rows = t.read(order)
            np.testing.assert_array_equal(rows, spec.initializer.rows(order, 3))
            assert t.n == 4 and sorted(t.ids.tolist()) == [5, 42, 90, 700]
            np.testing.assert_array_equal(t.read(ids), want)  # the same rows, none made again
            assert t.n == 4


@pytest.mark.parametrize("num_embeddings", [None, 10**6])
def test_table_snapshot_loads_into_a_used_table(num_embeddings):
    spec = TableSpec(name="t", dim=4, num_embeddings=num_embeddings, optimizer=Adam(lr=0.1),
                     initializer=Initializer("normal", std=0.1, seed=1))
    src = Table(spec, owns=lambda ids: np.ones(len(ids), bool), expected_rows=16)
    rng = np.random.default_rng(0)
    for _ in range(5):  # grows the arrays past their first capacity
        ids = rng.integers(0, 10**6, 40)
        src.apply(ids, rng.standard_normal((40, 4)).astype(np.float32), 1.0)
    snap = src.snapshot()
    dst = Table(spec, owns=lambda ids: np.ones(len(ids), bool))
    dst.apply(np.array([1, 2, 3]), np.ones((3, 4), np.float32), 1.0)  # rows the snapshot replaces
    dst.load(snap)
    assert dst.n == src.n
    probe = np.concatenate([src.ids[::3], [1, 2, 3]])
    with src.lock, dst.lock:
        np.testing.assert_array_equal(dst.rows[dst._slots(probe, create=True)], src.rows[src._slots(probe, create=True)])
        for k in src.state:
            np.testing.assert_array_equal(dst.state[k][dst._slots(probe, create=True)],
                                          src.state[k][src._slots(probe, create=True)])


def test_arrays_on_pages_of_their_own_behave_as_numpy_arrays():
    from shardps.core.memory import full, grown, zeros

    big = zeros((70_000, 4), np.float32)  # 1.1 MB: its own mapping
    assert big.flags.writeable and big.flags.c_contiguous and not big.any()
    big[123] = 7.0
    more = grown(big, 100_000)
    assert more.shape == (100_000, 4) and more[123].tolist() == [7.0] * 4 and not more[70_000:].any()
    np.testing.assert_array_equal(full(300_000, -1, np.int32), np.full(300_000, -1, np.int32))
    assert zeros(10, np.int64).tolist() == [0] * 10  # small: numpy's own allocation


def test_regrow_moves_a_mapping_only_held_by_its_owner_and_copies_one_that_a_reader_holds():
    from types import SimpleNamespace

    from shardps.core.memory import _own_mapping, regrow, zeros

    owner = SimpleNamespace(rows=zeros((70_000, 4), np.float32))
    owner.rows[[0, 123, 69_999]] = [[1.0], [7.0], [9.0]]
    pages = _own_mapping(owner.rows)
    regrow(owner, "rows", 200_000)  # sole holder: the kernel enlarges the mapping where it lies
    assert _own_mapping(owner.rows) is pages and len(pages) == 200_000 * 16
    assert owner.rows.shape == (200_000, 4) and owner.rows.flags.writeable
    assert owner.rows[[0, 123, 69_999], 0].tolist() == [1.0, 7.0, 9.0] and not owner.rows[70_000:].any()
    assert owner.rows.sum() == 4 * 17.0
    owner.rows[199_999] = 5.0  # the new rows are writable memory

    reader = owner.rows[:10]  # a reader's view: the mapping must not move under it
    regrow(owner, "rows", 300_000)
    assert _own_mapping(owner.rows) is not pages and len(pages) == 200_000 * 16
    assert not np.shares_memory(reader, owner.rows) and reader[0].tolist() == [1.0] * 4
    owner.rows[0] = 2.0
    assert reader[0].tolist() == [1.0] * 4 and owner.rows[0].tolist() == [2.0] * 4  # a copy: the view kept its rows
    assert owner.rows[199_999].tolist() == [5.0] * 4 and not owner.rows[200_000:].any()

    arrays = {"acc": zeros((70_000, 4), np.float32), "small": np.arange(5, dtype=np.int64)}
    arrays["acc"][3] = 2.5
    regrow(arrays, "acc", 90_000)  # held by a dict
    regrow(arrays, "small", 8)  # numpy's own allocation: a copy
    assert arrays["acc"].shape == (90_000, 4) and arrays["acc"][3].tolist() == [2.5] * 4
    assert arrays["small"].tolist() == [0, 1, 2, 3, 4, 0, 0, 0]


def _vm_flags(arr: np.ndarray) -> list[str]:
    """The kernel's VmFlags of the mapping that holds ``arr``'s first byte (/proc/self/smaps)."""
    addr, flags, inside = arr.ctypes.data, None, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                flags = line.split()[1:]
    assert flags is not None, "no mapping holds the array"
    return flags


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps is Linux's")
def test_large_arrays_ask_for_huge_pages_and_keep_asking_when_grown_in_place(monkeypatch):
    from types import SimpleNamespace

    from shardps.core import memory

    small = memory.zeros((50_000, 64), np.float32)  # 12.2 MiB: 4 KiB pages
    big = SimpleNamespace(rows=memory.zeros((70_000, 64), np.float32))  # 17 MiB
    assert "hg" not in _vm_flags(small) and "hg" in _vm_flags(big.rows)
    memory.regrow(big, "rows", 200_000)
    assert "hg" in _vm_flags(big.rows)
    grown_past = SimpleNamespace(rows=small)
    del small
    memory.regrow(grown_past, "rows", 100_000)  # 24 MiB now: asks once it is large enough
    assert "hg" in _vm_flags(grown_past.rows)
    monkeypatch.setattr(memory, "_HUGE", False)  # SHARDPS_HUGEPAGES=0
    assert "hg" not in _vm_flags(memory.zeros((70_000, 64), np.float32))


def test_a_regrow_that_runs_out_of_memory_leaves_the_holder_its_rows(monkeypatch):
    from types import SimpleNamespace

    from shardps.core import memory

    owner = SimpleNamespace(rows=memory.zeros((70_000, 4), np.float32))
    owner.rows[7] = 3.0
    reader = owner.rows[:1]  # forces the copy, which fails

    def no_memory(arr, cap):
        raise MemoryError("no room for the copy")

    monkeypatch.setattr(memory, "grown", no_memory)
    with pytest.raises(MemoryError):
        memory.regrow(owner, "rows", 100_000)
    assert owner.rows.shape == (70_000, 4) and owner.rows[7].tolist() == [3.0] * 4 and reader.shape == (1, 4)


@pytest.mark.parametrize("n", [0, 1, 2, 1000])
def test_unique_ids_is_np_unique(n):
    from shardps.core.ids import unique_ids

    ids = np.random.default_rng(n).zipf(1.2, n).astype(np.int64) - 5
    np.testing.assert_array_equal(unique_ids(ids), np.unique(ids))


REMOVERS = {
    "hash kernel": (lambda: HashIndex(capacity=16), "remove"),
    "hash numpy": (lambda: HashIndex(capacity=16), "remove_numpy"),
    "direct kernel": (lambda: DirectIndex(num_embeddings=5000), "remove"),
    "direct numpy": (lambda: DirectIndex(num_embeddings=5000), "remove_numpy"),
}


@pytest.mark.parametrize("impl", sorted(REMOVERS))
def test_remove_keeps_slots_dense_against_a_reference_model(impl):
    """Inserts and removals (eviction) against a plain-Python model of the slots: after every step each
    present id is found at its slot, removed ids are absent, slots stay 0..len-1, and the moves reported
    are exactly the model's (the last slot into each freed one, in order). Ids from a small range collide
    in the probe table, so runs are long and backward-shift deletion is exercised."""
    make, method = REMOVERS[impl]
    index = make()
    rng = np.random.default_rng(1)
    model: list[int] = []  # model[slot] = id
    for step in range(60):
        absent = np.setdiff1d(rng.integers(0, 5000, rng.integers(1, 400)), np.array(model, dtype=np.int64))
        index.insert(absent, np.arange(len(model), len(model) + absent.size))
        model += absent.tolist()
        if model and step % 3 != 2:
            victims = rng.choice(np.array(model), size=rng.integers(1, max(2, len(model) // 3)), replace=False)
            want_moves = []
            for v in victims.tolist():
                slot = model.index(v)
                last = len(model) - 1
                if slot != last:
                    model[slot] = model[last]
                    want_moves.append([last, slot])
                model.pop()
            moves = getattr(index, method)(victims)
            assert moves.tolist() == want_moves
            np.testing.assert_array_equal(index.lookup(victims), -1)
        assert len(index) == len(model)
        np.testing.assert_array_equal(index.ids, model)
        np.testing.assert_array_equal(index.lookup(np.array(model, dtype=np.int64)), np.arange(len(model)))
    everything = np.array(model[::-1], dtype=np.int64)  # last slot first: nothing needs to move
    moves = getattr(index, method)(everything)  # down to nothing, then it fills again
    assert len(index) == 0 and moves.shape == (0, 2)
    index.insert(np.array([4, 2]), np.arange(2))
    np.testing.assert_array_equal(index.lookup(np.array([2, 4, 3])), [1, 0, -1])


@pytest.mark.parametrize("impl", sorted(REMOVERS))
def test_remove_refuses_absent_or_repeated_ids_and_changes_nothing(impl):
    make, method = REMOVERS[impl]
    index = make()
    index.insert(np.array([10, 20, 30]), np.arange(3))
    for bad in ([10, 10], [10, 40]):
        with pytest.raises(ValueError, match="present, unique"):
            index.remove(np.array(bad))
    np.testing.assert_array_equal(index.ids, [10, 20, 30])
    np.testing.assert_array_equal(index.lookup(np.array([10, 20, 30])), [0, 1, 2])


def test_row_metadata_records_follow_their_rows_through_growth_and_removal():
    """A row's step count and metadata live in one record (``rows.META``) whose fields the store shows as arrays:
    written through those arrays, they stay with their rows when the store grows (new records, new views) and when
    removals move the last rows into freed slots; a snapshot carries them."""
    from shardps.server.storage.budget import MemoryBudget
    from shardps.server.storage.rows import RowStore

    store = RowStore("t", 3, {"acc": 0.5}, None, 16, MemoryBudget(1 << 30), 10**6)
    rng = np.random.default_rng(3)
    model: dict[int, tuple[int, int, int, int]] = {}
    for step in range(12):
        new = np.setdiff1d(rng.integers(0, 10**6, 400), store.ids[: store.n])
        slots = store.append(new, np.full((new.size, 3), step, np.float32))  # grows past 16, then again
        store.steps[slots] = step + 1
        store.last_version[slots] = new * 3
        store.last_time[slots] = step * 7
        store.touches[slots] += new % 5
        model.update({int(i): (step + 1, int(i) * 3, step * 7, int(i) % 5) for i in new})
        if step % 3 == 2:
            victims = rng.choice(store.ids[: store.n], size=store.n // 5, replace=False)
            store.remove(victims, check=False)
            for v in victims.tolist():
                del model[v]
        ids = np.array(sorted(model), dtype=np.int64)
        s = store.index.lookup(ids)
        want = np.array([model[i] for i in ids.tolist()], dtype=np.int64)
        got = np.stack([store.steps[s], store.last_version[s], store.last_time[s], store.touches[s]], axis=1)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(store.state["acc"][s], 0.5)
    snap = store.snapshot()
    order = np.argsort(snap["ids"])
    np.testing.assert_array_equal(snap["meta.touches"][order], want[:, 3])
    np.testing.assert_array_equal(snap["steps"][order], want[:, 0])


def test_a_growing_tables_probe_table_starts_small_and_keeps_its_load_as_rows_arrive():
    """A table sized for a guess (half a million expected rows here) makes its hash probe table for few ids and
    doubles it as rows arrive, load between 1/4 and 1/2, every id found through each doubling; the budget is
    charged for the small table, not for the guess. A bounded hot set (``sized``) gets its table at once."""
    from shardps.server.storage.budget import MemoryBudget
    from shardps.server.storage.rows import FIRST_PROBE_ROWS, RowStore

    budget = MemoryBudget(1 << 30)
    store = RowStore("t", 4, {}, None, 500_000, budget, 10**7)
    assert isinstance(store.index, HashIndex)
    assert store.index._table.shape[0] == HashIndex.table_size(FIRST_PROBE_ROWS) < 500_000
    assert budget.used == 4 * HashIndex.table_size(FIRST_PROBE_ROWS)
    rng = np.random.default_rng(5)
    sizes = set()
    for _ in range(20):
        new = np.setdiff1d(rng.integers(-(2**62), 2**62, 1500), store.ids[: store.n])
        store.append(new, np.zeros((new.size, 4), np.float32))
        size = store.index._table.shape[0]
        sizes.add(size)
        assert size // 4 < store.n <= size // 2, (store.n, size)
        np.testing.assert_array_equal(store.index.lookup(store.ids[: store.n]), np.arange(store.n))
    assert len(sizes) >= 4  # it doubled along the way
    hot = RowStore("h", 4, {}, None, 50_000, MemoryBudget(1 << 30), 50_000, sized=True)
    assert hot.index._table.shape[0] == HashIndex.table_size(50_000)


def test_a_table_of_known_size_gets_a_flat_map_when_it_is_small_beside_its_rows_and_the_budget_left():
    """The flat id map (4 bytes an id, charged when the table is made): under 5% of the rows a shard expects to hold,
    or up to DIRECT_INDEX_BYTES while it is at most a quarter of them and 1/16 of the budget left; else the hash
    index (a few KiB at first). So a shard's budget is never spent on maps before rows: a table a shard holds a
    sixteenth of, or a budget mostly used, gets the hash index."""
    from shardps.server.storage.budget import MemoryBudget
    from shardps.server.storage.rows import DIRECT_INDEX_BYTES, RowStore

    big = MemoryBudget(1 << 34)

    def index(num_embeddings: int, expected: int, budget: MemoryBudget = big, dim: int = 16) -> type:
        return type(RowStore("t", dim, {"sum": 0.0}, num_embeddings, expected, budget, 2**31 - 1).index)

    assert index(1_000_000, 500_000) is DirectIndex  # the DLRM example's tables, 2 shards: 4 MB for 64 MB of rows
    assert index(1_000_000, 62_500) is HashIndex  # a sixteenth of the ids: the map would be half the rows
    assert index(DIRECT_INDEX_BYTES // 4 + 1, 2**20) is HashIndex  # over DIRECT_INDEX_BYTES (and 5%)
    assert index(10**7, 2**20, dim=256) is DirectIndex  # under 5% of the rows: the old rule, at any size
    tight = MemoryBudget(60 << 20)  # 60 MiB left: under 16 x 4 MB
    before = tight.used
    assert index(1_000_000, 500_000, tight) is HashIndex
    assert tight.used - before < 1 << 20  # the hash index's first probe table, not the map


def _resident_rows(arr: np.ndarray, start: int, end: int) -> tuple[int, int]:
    """How many of the pages that rows ``[start, end)`` of ``arr`` lie on are made (``mincore``), of how many."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    per = arr.nbytes // arr.shape[0]
    lo = (arr.ctypes.data + start * per) // mmap.PAGESIZE * mmap.PAGESIZE
    hi = arr.ctypes.data + end * per
    pages = -(-(hi - lo) // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec), pages


def _wait_made(store) -> None:
    import time

    deadline = time.monotonic() + 60
    while (store._queued or store._made < store._asked) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not store._queued


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore and MADV_POPULATE_WRITE are Linux's")
def test_a_growing_tables_next_rows_get_their_pages_ahead_within_its_window_and_its_budget():
    """A growing table's next rows have their pages made in the background (no fault on a row's first write), as
    far as its window (an eighth of the rows reserved here) and never past what its memory budget has left; the
    rows keep their values; a hot set (``sized``) gets none."""
    from shardps.core import memory
    from shardps.server.storage.budget import MemoryBudget
    from shardps.server.storage.rows import AHEAD_BYTES, RowStore

    if not memory.can_populate():
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14)")
    huge = 8192  # rows of 64 float32 on one 2 MiB page: how far past a limit a made page may reach
    store = RowStore("t", 64, {}, 10**8, 400_000, MemoryBudget(1 << 40), 2**31 - 1)
    window = min(400_000 // 8, AHEAD_BYTES // store.row_bytes)
    store.append(np.arange(1000), np.ones((1000, 64), np.float32))
    _wait_made(store)
    assert store._made == store._asked == window  # asked for when the table was made
    made, pages = _resident_rows(store.rows, 1000, window - huge)
    assert made == pages  # every page of the window
    assert _resident_rows(store.rows, window + huge, 400_000)[0] == 0  # none past it
    assert (store.rows[:1000] == 1).all() and not store.rows[1000:].any()

    # Rows that arrive within the first window use it; past it, the window is a quarter of the rows held (no more
    # the first eighth on top of them: pages a table that stops growing would never use).
    store.append(np.arange(1000, 40_000), np.full((39_000, 64), 2, np.float32))
    _wait_made(store)
    assert store._asked == window and (store.rows[1000:40_000] == 2).all()  # 10,000 ahead: a quarter of 40,000
    store.append(np.arange(40_000, 80_000), np.full((40_000, 64), 3, np.float32))
    _wait_made(store)
    assert store._asked == 80_000 + 80_000 // 4 and (store.rows[40_000:80_000] == 3).all()
    made, pages = _resident_rows(store.rows, 80_000, 100_000 - huge)
    assert made == pages

    # A budget with room for 10,000 more rows: no page past them (and the slack of one huge page).
    small = MemoryBudget(1 << 20)  # (the index; then the limit is set to leave room for 12,000 rows)
    tight = RowStore("t", 64, {}, 10**8, 400_000, small, 2**31 - 1)
    _wait_made(tight)
    assert tight._made == tight._asked == (small.limit - small.used) // tight.row_bytes
    small.limit = small.used + 2000 * (tight.row_bytes + 24) + 10_000 * tight.row_bytes
    tight.append(np.arange(2000), np.ones((2000, 64), np.float32))
    _wait_made(tight)
    assert 2000 < tight._asked <= 2000 + 10_000
    assert _resident_rows(tight.rows, 12_000 + huge, 400_000)[0] == 0

    hot = RowStore("t", 64, {}, 10**8, 400_000, MemoryBudget(1 << 40), 2**31 - 1, sized=True)
    hot.append(np.arange(1000), np.ones((1000, 64), np.float32))
    assert not hot._queued and hot._asked == 0 and _resident_rows(hot.rows, 1000 + huge, 400_000)[0] == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore and MADV_POPULATE_WRITE are Linux's")
def test_tables_that_stopped_growing_give_their_pages_ahead_to_one_that_found_no_room():
    """The first tables of a shard take its AHEAD_SHARD_BYTES of pages ahead; once they have had no new row for
    AHEAD_IDLE_S and another table found no room, the shard's sweeper hands their pages back to the OS (mincore: not
    resident) and the other table's next rows get pages of their own. Without a table short of room, or before
    AHEAD_IDLE_S, nothing is given back; a table that grows again asks again."""
    import time

    from shardps.core import memory
    from shardps.core.specs import TableSpec
    from shardps.server.shard.limits import Limits
    from shardps.server.shard.registry import TableRegistry
    from shardps.server.storage import budget as budget_mod
    from shardps.server.storage import rows as rows_mod

    if not memory.can_populate():
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14)")
    registry = TableRegistry(0, Limits())
    owns = lambda ids: np.ones(ids.shape[0], bool)  # noqa: E731 - every id this shard's
    a, b = (registry.new(TableSpec(name, 64, 10**8), owns, 1_000_000) for name in ("a", "b"))
    per = rows_mod.AHEAD_BYTES // a.store.row_bytes
    assert (a.store._asked, b.store._asked) == (per, per)
    for t in (a, b):
        _wait_made(t.store)
    assert _resident_rows(a.store.rows, 0, per - 8192)[0] > 0
    assert registry.give_back_pages_ahead() == 0  # nobody short of room yet
    c = registry.new(TableSpec("c", 64, 10**8), owns, 1_000_000)
    assert c.store._asked == 0 and registry.budget.short_within(1.0)  # c found no room
    a.store._grew_at = b.store._grew_at = time.monotonic()  # (as if rows had just come: however slow this machine)
    assert registry.give_back_pages_ahead() == 0
    a.store._grew_at -= budget_mod.AHEAD_IDLE_S  # as if AHEAD_IDLE_S had passed without a row
    b.store._grew_at -= budget_mod.AHEAD_IDLE_S
    c.store._make_ahead()  # c asks again (as its rows arrive), and finds no room: just now
    assert registry.give_back_pages_ahead() == 2
    for t in (a, b):
        assert t.store._asked == t.store.n == 0
        assert _resident_rows(t.store.rows, 0, per)[0] == 0  # handed back to the OS
    assert registry.budget.ahead_bytes == 0
    with c.lock:
        c.read(np.arange(10))  # c's next rows: now it gets its pages ahead, its whole window (a and b ask no share)
    assert c.store._asked - c.store.n == per
    _wait_made(c.store)
    assert np.array_equal(c.read(np.arange(10)), c.read(np.arange(10)))
    with a.lock:
        a.apply(np.arange(5), np.ones((5, 64), np.float32))  # a grows again: asks again, for its share of two
    assert 0 < a.store._asked - a.store.n <= budget_mod.AHEAD_SHARD_BYTES // 2 // a.store.row_bytes
    assert registry.budget.ahead_bytes <= budget_mod.AHEAD_SHARD_BYTES
    registry.clear()
    assert registry.budget.ahead_bytes == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")
def test_pages_ahead_are_bounded_across_a_shards_tables_and_shared_as_their_rows_arrive():
    """Pages made ahead are resident and not charged: a shard's tables together make at most AHEAD_SHARD_BYTES of
    them (26 empty tables must not each take AHEAD_BYTES), each its share; a table's rows that arrive, or a table
    dropped, give the room back to the others."""
    from shardps.core import memory
    from shardps.server.storage.budget import AHEAD_SHARD_BYTES, MemoryBudget
    from shardps.server.storage.rows import AHEAD_BYTES, RowStore

    if not memory.can_populate():
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14)")
    budget = MemoryBudget(1 << 40)

    def table(name: str) -> RowStore:  # an eighth of its million reserved rows is past AHEAD_BYTES
        return RowStore(name, 64, {}, 10**8, 1_000_000, budget, 2**31 - 1)

    a, b, c = table("a"), table("b"), table("c")
    per = AHEAD_BYTES // a.row_bytes
    assert (a._asked, b._asked, c._asked) == (per, per, 0)  # the shard's pages ahead are all a's and b's
    assert budget.ahead_bytes == 2 * per * a.row_bytes <= AHEAD_SHARD_BYTES
    for s in (a, b, c):
        _wait_made(s)
    assert _resident_rows(c.rows, 0, 100_000)[0] == 0
    # Rows arriving in a and b: what they ask for again is their share of three (a third each), and c's rows find
    # the room that frees.
    share = AHEAD_SHARD_BYTES // 3 // a.row_bytes
    for s in (a, b):
        s.append(np.arange(per - per // 4), np.ones((per - per // 4, 64), np.float32))
        assert s._asked - s.n <= share
    c.append(np.arange(10), np.ones((10, 64), np.float32))
    assert 0 < c._asked - c.n <= share
    assert budget.ahead_bytes <= AHEAD_SHARD_BYTES
    # A table dropped gives its pages ahead back: two tables left, a half each (c asks again once its rows have used
    # half of its window: past its first eighth, a quarter of the rows it holds).
    a.release()
    c.append(np.arange(10, 400_000), np.ones((399_990, 64), np.float32))
    assert share < c._asked - c.n <= AHEAD_SHARD_BYTES // 2 // c.row_bytes
    assert budget.ahead_bytes <= AHEAD_SHARD_BYTES
    for store in (a, b, c):
        _wait_made(store)
    # A store garbage-collected without a release (its finalizer takes no lock: it may run inside any allocation of a
    # thread holding the budget's) gives its count back too.
    import gc

    before = budget.ahead_bytes
    with budget._lock:
        budget.ahead_collected(id(b))  # what the finalizer does, here while the lock is held: no deadlock
    assert budget.ahead_bytes == before - (b._asked - b.n) * b.row_bytes
    del a, b, store
    gc.collect()
    assert budget.ahead_bytes == (c._asked - c.n) * c.row_bytes
    c.release()
    assert budget.ahead_bytes == 0
