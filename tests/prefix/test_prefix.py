"""kvpush.prefix: chained block hashes, the TTL prefix index, the block pool."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpush import KvpushError
from kvpush.prefix import (
    HASH_BYTES,
    BlockPool,
    EvictReason,
    OutOfBlocks,
    PrefixIndex,
    block_hashes,
    hash_block,
    reusable_blocks,
    root_hash,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# block_hashes(range(4), 4)[0]: pinned, so that a change of the scheme (person strings, byte
# order, digest size) cannot make caches of different kvpush versions silently disagree.
GOLDEN = "42585f991fa03156f4e4cec623ca392c"

tokens_st = st.lists(st.integers(0, 2**31 - 1), max_size=80)


# -- hashing -------------------------------------------------------------------------------
def test_hashes_name_full_blocks_only() -> None:
    toks = list(range(50))
    hs = block_hashes(toks, 16)
    assert len(hs) == 3
    assert all(isinstance(h, bytes) and len(h) == HASH_BYTES for h in hs)
    assert block_hashes(toks[:47], 16) == hs[:2]
    assert block_hashes(toks[:15], 16) == []
    assert block_hashes([], 16) == []


def test_hash_is_chained_and_equals_stepwise() -> None:
    toks = list(range(100, 148))
    hs = block_hashes(toks, 16)
    prev = root_hash()
    for i in range(3):
        prev = hash_block(toks[16 * i:16 * (i + 1)], prev)
        assert prev == hs[i]
    # Resuming from a known block gives the same tail.
    assert block_hashes(toks[16:], 16, parent=hs[0]) == hs[1:]


def test_same_block_content_at_different_depth_differs() -> None:
    a = [7] * 16
    hs = block_hashes(a * 3, 16)
    assert len(set(hs)) == 3


def test_dtype_and_container_do_not_matter() -> None:
    toks = list(range(64))
    want = block_hashes(toks, 8)
    for arr in (np.array(toks, dtype=np.int32), np.array(toks, dtype=np.int64),
                np.array(toks, dtype=np.uint16), tuple(toks)):
        assert block_hashes(arr, 8) == want


def test_namespace_separates_caches() -> None:
    toks = list(range(32))
    assert block_hashes(toks, 16, namespace=b"model-a") != block_hashes(toks, 16,
                                                                        namespace=b"model-b")
    assert root_hash(b"x") != root_hash()


def test_golden_value() -> None:
    assert block_hashes(list(range(4)), 4)[0].hex() == GOLDEN



def test_deterministic_across_processes() -> None:
    code = ("from kvpush.prefix import block_hashes;"
            "print(block_hashes(list(range(40)), 8)[-1].hex())")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=60, check=True).stdout.strip()
    assert out == block_hashes(list(range(40)), 8)[-1].hex()


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_block_size(bad: object) -> None:
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1, 2], bad)  # type: ignore[arg-type]


def test_bad_tokens() -> None:
    with pytest.raises(TypeError, match="integers"):
        block_hashes([1.5, 2.0], 1)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="1-D"):
        block_hashes(np.zeros((2, 2), dtype=np.int64), 1)
    with pytest.raises(ValueError, match="parent"):
        block_hashes([1], 1, parent=b"short")
    with pytest.raises(ValueError, match="parent"):
        hash_block([1], b"")


@given(tokens_st, st.integers(1, 9), st.data())
@settings(max_examples=60, deadline=None)
def test_changing_a_token_changes_its_block_and_all_later(toks: list[int], bs: int,
                                                          data: st.DataObject) -> None:
    if not toks:
        return
    i = data.draw(st.integers(0, len(toks) - 1))
    other = list(toks)
    other[i] = toks[i] + 1
    a, b = block_hashes(toks, bs), block_hashes(other, bs)
    blk = i // bs
    assert a[:blk] == b[:blk]
    assert all(x != y for x, y in zip(a[blk:], b[blk:], strict=True))


@given(tokens_st, st.integers(1, 9), st.integers(0, 80))
@settings(max_examples=60, deadline=None)
def test_prefix_of_tokens_gives_prefix_of_hashes(toks: list[int], bs: int, cut: int) -> None:
    full = block_hashes(toks, bs)
    assert block_hashes(toks[:cut], bs) == full[:min(cut, len(toks)) // bs]


def test_reusable_blocks_leaves_one_token_to_compute() -> None:
    assert reusable_blocks(0, 16) == 0
    assert reusable_blocks(1, 16) == 0
    assert reusable_blocks(16, 16) == 0
    assert reusable_blocks(17, 16) == 1
    assert reusable_blocks(32, 16) == 1
    assert reusable_blocks(33, 16) == 2


# -- the index -----------------------------------------------------------------------------
def chain(n: int, seed: int = 0) -> list[bytes]:
    return block_hashes(list(range(seed * 1000, seed * 1000 + 4 * n)), 4)


def test_lookup_longest_prefix_and_missing() -> None:
    idx = PrefixIndex(60)
    hs = chain(5)
    assert idx.insert(hs[:3], [10, 11, 12]) == [10, 11, 12]
    assert idx.match(hs) == 3
    assert idx.lookup(hs) == [10, 11, 12]
    assert idx.missing(hs) == [3, 4]
    idx.insert([hs[4]], [14])
    assert idx.match(hs) == 3  # a hole stops the prefix
    assert idx.missing(hs) == [3]
    assert hs[4] in idx and hs[3] not in idx and b"x" not in idx and 5 not in idx
    assert idx.get(hs[1]) == 11 and idx.get(hs[3]) is None
    assert idx.hash_of(12) == hs[2] and idx.hash_of(99) is None
    st_ = idx.stats()
    assert st_["lookups"] == 1 and st_["hit_blocks"] == 3 and st_["miss_blocks"] == 2
    assert st_["entries"] == 4 and st_["pinned"] == 0


def test_ttl_expiry_is_lazy_and_reclaimed_with_callback() -> None:
    clock = Clock()
    dropped: list[tuple[int, EvictReason]] = []
    idx = PrefixIndex(10, on_evict=lambda e: dropped.append((e.block_id, e.reason)),
                      clock=clock)
    hs = chain(3)
    idx.insert(hs, [1, 2, 3])
    clock.now += 9.9
    assert idx.match(hs) == 3
    clock.now += 0.2
    # Expired: never returned, even before expire() reclaims it.
    assert idx.match(hs) == 0 and idx.get(hs[0]) is None and idx.lookup(hs) == []
    assert len(idx) == 3 and dropped == []
    out = idx.expire()
    assert sorted(e.block_id for e in out) == [1, 2, 3]
    assert sorted(dropped) == [(1, EvictReason.EXPIRED), (2, EvictReason.EXPIRED),
                               (3, EvictReason.EXPIRED)]
    assert len(idx) == 0


def test_pinned_blocks_never_expire_and_unpin_restarts_ttl() -> None:
    clock = Clock()
    idx = PrefixIndex(10, clock=clock)
    hs = chain(4)
    idx.insert(hs, [1, 2, 3, 4])
    assert idx.acquire(hs[:2]) == [1, 2]
    clock.now += 100
    assert idx.match(hs) == 2       # pinned ones live on; the others expired
    assert sorted(e.block_id for e in idx.expire()) == [3, 4]
    assert idx.pinned == 2 and idx.evictable == 0
    idx.unpin(hs[:2])
    clock.now += 9
    assert idx.match(hs) == 2       # TTL restarted at the unpin
    clock.now += 2
    assert idx.match(hs) == 0


def test_refcounted_pins() -> None:
    idx = PrefixIndex(10)
    hs = chain(2)
    idx.insert(hs, [1, 2], pin=True)
    idx.pin(hs)
    idx.unpin(hs)
    assert idx.pinned == 2
    idx.unpin(hs)
    assert idx.pinned == 0
    with pytest.raises(KeyError, match="not pinned"):
        idx.unpin(hs[:1])
    with pytest.raises(KeyError):
        idx.unpin([hs[0], hs[0]])  # more unpins than pins: nothing changes
    idx.pin([hs[0]])
    with pytest.raises(KeyError):
        idx.unpin([hs[0], hs[0]])
    assert idx.pinned == 1


def test_pin_is_all_or_nothing() -> None:
    idx = PrefixIndex(10)
    hs = chain(3)
    idx.insert(hs[:2], [1, 2])
    with pytest.raises(KeyError, match="position 2"):
        idx.pin(hs)
    assert idx.pinned == 0


def test_evict_takes_least_recent_and_chain_tails_first() -> None:
    clock = Clock()
    idx = PrefixIndex(math.inf, clock=clock)
    a, b = chain(3, seed=1), chain(3, seed=2)
    idx.insert(a, [1, 2, 3])
    clock.now += 1
    idx.insert(b, [4, 5, 6])
    idx.acquire(b[:1])
    ev = idx.evict(4)
    # a is older: tail first, then its head; then b's tail (b's head is pinned).
    assert [e.block_id for e in ev] == [3, 2, 1, 6]
    assert all(e.reason is EvictReason.EVICTED for e in ev)
    assert idx.lookup(b) == [4, 5]
    assert [e.block_id for e in idx.evict(10)] == [5]
    assert len(idx) == 1 and idx.evictable == 0


def test_touch_moves_a_chain_to_most_recent() -> None:
    idx = PrefixIndex(math.inf)
    a, b = chain(2, seed=1), chain(2, seed=2)
    idx.insert(a, [1, 2])
    idx.insert(b, [3, 4])
    idx.touch(a)
    assert [e.block_id for e in idx.evict(4)] == [4, 3, 2, 1]


def test_evict_prefers_expired() -> None:
    clock = Clock()
    idx = PrefixIndex(5, clock=clock)
    a, b = chain(2, seed=1), chain(2, seed=2)
    idx.insert(a, [1, 2])
    clock.now += 4
    idx.insert(b, [3, 4])
    clock.now += 2  # a expired, b not
    ev = idx.evict(1)
    assert sorted(e.block_id for e in ev) == [1, 2]
    assert all(e.reason is EvictReason.EXPIRED for e in ev)


def test_insert_first_writer_wins_and_expired_entry_is_replaced() -> None:
    clock = Clock()
    dropped: list[int] = []
    idx = PrefixIndex(10, on_evict=lambda e: dropped.append(e.block_id), clock=clock)
    hs = chain(2)
    assert idx.insert(hs, [1, 2]) == [1, 2]
    assert idx.insert(hs, [7, 8], pin=True) == [1, 2]  # duplicates: caller keeps its copies
    assert idx.pinned == 2
    idx.unpin(hs)
    clock.now += 11
    assert idx.insert(hs[:1], [7]) == [7]              # the expired entry is replaced
    assert dropped == [1]
    assert idx.hash_of(1) is None and idx.hash_of(7) == hs[0]


def test_insert_validation() -> None:
    idx = PrefixIndex(10)
    hs = chain(3)
    idx.insert(hs[:1], [1])
    with pytest.raises(ValueError, match="another hash"):
        idx.insert(hs[1:2], [1])
    with pytest.raises(ValueError, match="2 hashes but 1"):
        idx.insert(hs[1:], [5])
    with pytest.raises(ValueError, match="distinct"):
        idx.insert(hs[1:], [5, 5])
    with pytest.raises(ValueError, match="bytes"):
        idx.insert([b"short"], [5])
    with pytest.raises(ValueError, match=">= 0"):
        idx.insert(hs[1:2], [-1])
    assert len(idx) == 1
    with pytest.raises(ValueError, match="ttl_s"):
        PrefixIndex(0)
    with pytest.raises(ValueError, match="ttl_s"):
        PrefixIndex(float("nan"))


def test_remove_and_clear() -> None:
    dropped: list[EvictReason] = []
    idx = PrefixIndex(10, on_evict=lambda e: dropped.append(e.reason))
    hs = chain(3)
    idx.insert(hs, [1, 2, 3])
    idx.pin(hs[:1])
    with pytest.raises(KeyError, match="pinned"):
        idx.remove(hs)
    assert [e.block_id for e in idx.remove([*hs[2:], b"\x00" * HASH_BYTES])] == [3]
    assert [e.block_id for e in idx.clear()] == [2]
    assert len(idx) == 1 and dropped == [EvictReason.REMOVED] * 2


# -- the pool ------------------------------------------------------------------------------
def test_pool_allocates_in_order_and_checks_frees() -> None:
    pool = BlockPool(8)
    a = pool.allocate(3)
    assert a.dtype == np.int64 and a.tolist() == [0, 1, 2]
    pool.free(a)
    assert pool.allocate(3).tolist() == [0, 1, 2]  # a freed run comes back in order
    with pytest.raises(ValueError, match="already free"):
        pool.free([5])
    with pytest.raises(ValueError, match="out of range"):
        pool.free([8])
    with pytest.raises(ValueError, match="duplicate"):
        pool.free([0, 0])
    with pytest.raises(OutOfBlocks):
        pool.allocate(6)
    assert pool.num_free == 5
    assert issubclass(OutOfBlocks, KvpushError)
    with pytest.raises(ValueError):
        BlockPool(0)


def test_pool_reclaims_unpinned_cached_blocks() -> None:
    pool = BlockPool(4)
    idx = PrefixIndex(60, on_evict=pool.reclaim)
    hs = chain(4)
    ids = pool.allocate(4)
    idx.insert(hs, ids)
    idx.pin(hs[:1])
    got = pool.allocate(2, idx)  # evicts the chain's tail
    assert sorted(got.tolist()) == [2, 3]
    assert idx.match(hs) == 2
    with pytest.raises(OutOfBlocks, match="pinned"):
        pool.allocate(2, idx)   # only one unpinned block is left to reclaim
    assert idx.match(hs) == 2 and pool.num_free == 0  # failed: nothing evicted, nothing taken
    assert pool.allocate(1, idx).tolist() == [1]


# -- a random walk over index + pool against a model --------------------------------------
class IndexMachine(RuleBasedStateMachine):
    """Requests come and go: a block is always exactly one of free, cached (indexed) or
    private to a request; nothing expired is ever returned; pinned blocks stay put."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.pool = BlockPool(24)
        self.index = PrefixIndex(10, on_evict=self.pool.reclaim, clock=self.clock)
        self.requests: list[tuple[list[bytes], list[int], int, list[int]]] = []
        self.chains = [chain(6, seed=s) for s in range(4)]

    @rule(c=st.integers(0, 3), n=st.integers(1, 6))
    def start(self, c: int, n: int) -> None:
        hs = self.chains[c][:n]
        got = self.index.acquire(hs)
        k = len(got)
        try:
            new = self.pool.allocate(n - k, self.index).tolist()
        except OutOfBlocks:
            self.index.unpin(hs[:k])
            return
        held = self.index.insert(hs[k:], new, pin=True)
        dups = [a for a, b in zip(new, held, strict=True) if a != b]
        self.requests.append((hs, got + new, n, dups))

    @precondition(lambda self: self.requests)
    @rule(i=st.integers(0, 100))
    def finish(self, i: int) -> None:
        hs, _, n, dups = self.requests.pop(i % len(self.requests))
        self.index.unpin(hs[:n])
        self.pool.free(dups)

    @rule(dt=st.floats(0, 8))
    def wait(self, dt: float) -> None:
        self.clock.now += dt

    @rule()
    def expire(self) -> None:
        for e in self.index.expire():
            assert e.reason is EvictReason.EXPIRED

    @rule(n=st.integers(0, 5))
    def evict(self, n: int) -> None:
        self.index.evict(n)

    @invariant()
    def blocks_are_accounted_once(self) -> None:
        cached = set(self.index._by_block)
        private = {b for r in self.requests for b in r[3]}
        free = set(np.nonzero(self.pool._is_free)[0].tolist())
        assert not (cached & private) and not (cached & free) and not (private & free)
        assert len(cached) + len(private) + len(free) == 24
        assert len(free) == self.pool.num_free

    @invariant()
    def running_requests_keep_their_blocks(self) -> None:
        for hs, ids, n, _ in self.requests:
            held = [self.index.get(h) for h in hs[:n]]
            assert None not in held and len(ids) == n

    @invariant()
    def nothing_expired_is_returned(self) -> None:
        now = self.clock.now
        for h, e in self.index._entries.items():
            if e.pins == 0 and e.expires_at <= now:
                assert self.index.get(h) is None


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])
