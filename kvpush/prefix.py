"""Content-addressed KV blocks: chained block hashes and a prefix index with a TTL.

Multi-turn reuse needs every engine to answer one question cheaply and identically: *which
blocks of this prompt do I already hold?* A block is named by its content, as prefix caches
do: the hash of the token ids it holds **and** of the previous block's hash, so a hash names
the whole prefix up to the end of its block, and two engines (two processes, two hosts) that
saw the same tokens compute the same names. Only full blocks are named; a request's last,
partial block is private to it.

The pieces, engine-agnostic (no torch, no NIXL):

* :func:`block_hashes` / :func:`hash_block` -- the chained hashes (BLAKE2b, 16 bytes,
  little-endian int64 token ids; deterministic across processes, unlike ``hash()``).
* :class:`PrefixIndex` -- hash -> block id for the blocks an engine keeps after a request
  ends, with reference counts ("pins") for blocks in use, a time-to-live that restarts when a
  block is last unpinned, least-recently-used eviction, and a callback for every block it
  drops so the engine can free it. An expired or evicted entry is never returned, even before
  :meth:`PrefixIndex.expire` reclaims it: a miss means recompute, never stale KV.
* :class:`BlockPool` -- a free list that reclaims cached blocks from an index when it runs
  short.
* :func:`reusable_blocks` -- how many leading blocks a prompt may take from a cache (at least
  one token is always computed, so the engine has logits for the first output token).

Typical use on one engine, per request::

    hashes = block_hashes(tokens, block_size)
    cap = reusable_blocks(len(tokens), block_size)
    cached = index.acquire(hashes[:cap])            # pinned prefix, block ids
    ... compute or receive blocks len(cached) ..., then
    index.insert(hashes[k:n_full], new_ids, pin=True)
    ... when the request ends:
    index.unpin(hashes[:n_full])                    # kept for ttl_s, then freed

Nothing here is thread-safe: call an index and a pool from one thread (the engine's
scheduler), and hand release callbacks from kvpush's loop threads over to it.
"""

from __future__ import annotations

import array
import enum
import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import OutOfBlocks

__all__ = [
    "HASH_BYTES",
    "BlockHash",
    "BlockPool",
    "EvictReason",
    "Evicted",
    "OutOfBlocks",
    "PrefixIndex",
    "block_hashes",
    "hash_block",
    "reusable_blocks",
    "root_hash",
]

#: Bytes of a block hash (BLAKE2b digest size). 128 bits: collisions are out of reach for
#: any cache size, and a hash stays cheap to send in control messages.
HASH_BYTES = 16

BlockHash = bytes
"""A block's name: :data:`HASH_BYTES` bytes."""

_PERSON_ROOT = b"kvpush.root.v1"
_PERSON_BLOCK = b"kvpush.block.v1"


def root_hash(namespace: bytes = b"") -> BlockHash:
    """The parent hash of a sequence's first block.

    Parameters
    ----------
    namespace
        Anything that must keep two caches' blocks apart although their tokens match: model
        and weights version, KV dtype, adapter id, tenant. Empty by default.

    Returns
    -------
    bytes
        :data:`HASH_BYTES` bytes.
    """
    if not isinstance(namespace, (bytes, bytearray)):
        raise TypeError(f"namespace must be bytes, got {type(namespace).__name__}")
    return hashlib.blake2b(bytes(namespace), digest_size=HASH_BYTES,
                           person=_PERSON_ROOT).digest()


def _token_bytes(tokens: Any, what: str) -> np.ndarray:
    if isinstance(tokens, (list, tuple)):
        # array('q') converts a list of Python ints ~10x faster than numpy's inference, and
        # refuses floats and out-of-range values instead of truncating them.
        try:
            packed = array.array("q", tokens)
        except TypeError as exc:
            raise TypeError(f"{what} must hold integers: {exc}") from None
        except OverflowError:
            raise ValueError(f"{what} holds a token id beyond int64") from None
        return np.frombuffer(packed, dtype=np.int64).astype("<i8", copy=False)
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"{what} must hold integers, got dtype {arr.dtype}")
    if arr.size and arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and arr.max() > 2**63 - 1:
        raise ValueError(f"{what} holds a token id beyond int64")
    return np.ascontiguousarray(arr, dtype="<i8")


def hash_block(tokens: Sequence[int] | np.ndarray, parent: BlockHash) -> BlockHash:
    """The hash of one block: its token ids chained to the previous block's hash.

    Parameters
    ----------
    tokens
        The block's token ids (any integer sequence; hashed as little-endian int64).
    parent
        The previous block's hash, or :func:`root_hash` for a sequence's first block.

    Returns
    -------
    bytes
        :data:`HASH_BYTES` bytes.
    """
    if not isinstance(parent, bytes) or len(parent) != HASH_BYTES:
        raise ValueError(f"parent must be {HASH_BYTES} bytes, got {parent!r}")
    h = hashlib.blake2b(parent, digest_size=HASH_BYTES, person=_PERSON_BLOCK)
    h.update(_token_bytes(tokens, "tokens").tobytes())
    return h.digest()


def block_hashes(tokens: Sequence[int] | np.ndarray, block_size: int, *,
                 parent: BlockHash | None = None, namespace: bytes = b"") -> list[BlockHash]:
    """Chained hashes of every *full* block of a token sequence.

    Parameters
    ----------
    tokens
        Token ids from the start of the sequence (or from the block after ``parent``).
    block_size
        Tokens per block (the KV layout's ``tokens_per_block``).
    parent
        Hash of the block just before ``tokens[0]``; default: the root of ``namespace``.
    namespace
        Passed to :func:`root_hash` when ``parent`` is None.

    Returns
    -------
    list of bytes
        ``len(tokens) // block_size`` hashes; the trailing partial block has none.

    Examples
    --------
    >>> a = block_hashes(list(range(40)), 16)
    >>> len(a), a == block_hashes(list(range(32)), 16)
    (2, True)
    >>> block_hashes(list(range(16, 32)), 16, parent=a[0]) == a[1:]
    True
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    raw = _token_bytes(tokens, "tokens")
    prev = root_hash(namespace) if parent is None else parent
    if not isinstance(prev, bytes) or len(prev) != HASH_BYTES:
        raise ValueError(f"parent must be {HASH_BYTES} bytes, got {prev!r}")
    data = memoryview(raw.tobytes())
    step = block_size * 8
    out: list[BlockHash] = []
    blake2b = hashlib.blake2b
    for i in range(len(raw) // block_size):
        h = blake2b(prev, digest_size=HASH_BYTES, person=_PERSON_BLOCK)
        h.update(data[i * step:(i + 1) * step])
        prev = h.digest()
        out.append(prev)
    return out


def reusable_blocks(num_tokens: int, block_size: int) -> int:
    """Leading blocks of a ``num_tokens`` prompt that may come from a cache.

    At least one prompt token must be computed to get the logits of the first output token,
    so a prompt that is entirely cached still recomputes its last block (as vLLM does): the
    bound is ``(num_tokens - 1) // block_size``.
    """
    if num_tokens < 1:
        return 0
    return (num_tokens - 1) // block_size


class EvictReason(enum.Enum):
    """Why a :class:`PrefixIndex` dropped a block."""

    EXPIRED = "expired"      #: unused for ``ttl_s``
    EVICTED = "evicted"      #: least recently used, reclaimed for space
    REMOVED = "removed"      #: dropped on request (:meth:`PrefixIndex.remove`, ``clear``)


@dataclass(frozen=True)
class Evicted:
    """A block a :class:`PrefixIndex` no longer holds: the engine may reuse ``block_id``."""

    block_hash: BlockHash
    block_id: int
    reason: EvictReason


@dataclass
class _Entry:
    block_id: int
    pins: int
    expires_at: float


class PrefixIndex:
    """Which content-addressed blocks an engine holds, for how long, and which are in use.

    Parameters
    ----------
    ttl_s
        How long an unpinned block stays usable after its last use (its last unpin, or its
        insertion unpinned); ``math.inf`` keeps blocks until evicted. A pinned block never
        expires: a request is using it, so its KV is valid.
    on_evict
        Called with each :class:`Evicted` as the index drops a block (expiry, eviction,
        removal, or an expired entry replaced by :meth:`insert`); typically returns the block
        to the engine's free list.
    clock
        Seconds, monotonic (``time.monotonic`` by default; tests pass a manual clock).

    Notes
    -----
    Unpinned entries are kept in least-recently-used order. Bulk operations take hashes in
    prefix order and touch them back to front, so the head of a chain counts as the most
    recently used and the tail goes first: evicting a chain's head would orphan every block
    after it, since only a *prefix* of cached blocks is usable.
    """

    def __init__(self, ttl_s: float, *, on_evict: Callable[[Evicted], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not ttl_s > 0:  # also refuses NaN
            raise ValueError(f"PrefixIndex.ttl_s must be > 0 (math.inf: no expiry), got {ttl_s}")
        self.ttl_s = float(ttl_s)
        self._on_evict = on_evict
        self._clock = clock
        self._entries: dict[BlockHash, _Entry] = {}
        self._by_block: dict[int, BlockHash] = {}
        self._lru: OrderedDict[BlockHash, None] = OrderedDict()  # unpinned, oldest first
        self._counts = {"lookups": 0, "hit_blocks": 0, "miss_blocks": 0, "inserted": 0,
                        "expired": 0, "evicted": 0, "removed": 0}

    # -- queries -----------------------------------------------------------------------------
    def __len__(self) -> int:
        """Entries held, including expired ones not reclaimed yet."""
        return len(self._entries)

    def __contains__(self, block_hash: object) -> bool:
        """True when ``block_hash`` is held and usable (not expired)."""
        if not isinstance(block_hash, bytes):
            return False
        entry = self._entries.get(block_hash)
        return entry is not None and self._live(entry, self._clock())

    def get(self, block_hash: BlockHash) -> int | None:
        """The block id holding ``block_hash``, or None when absent or expired."""
        entry = self._entries.get(block_hash)
        if entry is None or not self._live(entry, self._clock()):
            return None
        return entry.block_id

    def hash_of(self, block_id: int) -> BlockHash | None:
        """The hash a block id is indexed under, or None."""
        return self._by_block.get(int(block_id))

    def match(self, hashes: Sequence[BlockHash]) -> int:
        """Length of the longest prefix of ``hashes`` held and usable."""
        now = self._clock()
        entries = self._entries
        n = 0
        for h in hashes:
            entry = entries.get(h)
            if entry is None or (entry.pins == 0 and entry.expires_at <= now):
                break
            n += 1
        return n

    def lookup(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Block ids of the longest usable prefix of ``hashes`` (not pinned: see
        :meth:`acquire`)."""
        n = self.match(hashes)
        self._counts["lookups"] += 1
        self._counts["hit_blocks"] += n
        self._counts["miss_blocks"] += len(hashes) - n
        return [self._entries[h].block_id for h in hashes[:n]]

    def missing(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Positions in ``hashes`` of the blocks not held (or expired), in order."""
        now = self._clock()
        out = []
        for i, h in enumerate(hashes):
            entry = self._entries.get(h)
            if entry is None or not self._live(entry, now):
                out.append(i)
        return out

    @property
    def pinned(self) -> int:
        """Entries in use by at least one request."""
        return len(self._entries) - len(self._lru)

    @property
    def evictable(self) -> int:
        """Unpinned entries (expired or not): what :meth:`evict` can reclaim."""
        return len(self._lru)

    def stats(self) -> dict[str, int]:
        """Counters: lookups, hit/miss blocks, inserted, expired, evicted, removed, plus the
        current ``entries`` and ``pinned``."""
        return {**self._counts, "entries": len(self._entries), "pinned": self.pinned}

    # -- pins ----------------------------------------------------------------------------------
    def acquire(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Pin the longest usable prefix of ``hashes`` and return its block ids.

        The ids stay valid (never expired, evicted or reused) until :meth:`unpin` is called
        with the same hashes -- ``hashes[:len(result)]``.
        """
        ids = self.lookup(hashes)
        self._pin(hashes[:len(ids)])
        return ids

    def pin(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Pin every one of ``hashes`` (all or none) and return their block ids.

        Raises
        ------
        KeyError
            When one of them is absent or expired; nothing is pinned then.
        """
        now = self._clock()
        for i, h in enumerate(hashes):
            entry = self._entries.get(h)
            if entry is None or not self._live(entry, now):
                raise KeyError(f"block hash {h.hex()} (position {i}) is not held")
        self._pin(hashes)
        return [self._entries[h].block_id for h in hashes]

    def _pin(self, hashes: Iterable[BlockHash]) -> None:
        for h in hashes:
            entry = self._entries[h]
            if entry.pins == 0:
                self._lru.pop(h, None)
            entry.pins += 1

    def unpin(self, hashes: Sequence[BlockHash]) -> None:
        """Drop one pin from each of ``hashes`` (prefix order). A block left with no pin
        stays cached for ``ttl_s`` from now.

        Raises
        ------
        KeyError
            When one of them is not held or not pinned; nothing is changed then.
        """
        for h in hashes:
            entry = self._entries.get(h)
            if entry is None or entry.pins == 0:
                raise KeyError(f"block hash {h.hex()} is not pinned")
        if len(set(hashes)) != len(hashes):
            counts: dict[BlockHash, int] = {}
            for h in hashes:
                counts[h] = counts.get(h, 0) + 1
            for h, c in counts.items():
                if self._entries[h].pins < c:
                    raise KeyError(f"block hash {h.hex()} is unpinned more often than pinned")
        expires = self._clock() + self.ttl_s
        for h in reversed(hashes):  # the head of the chain ends most recently used
            entry = self._entries[h]
            entry.pins -= 1
            if entry.pins == 0:
                entry.expires_at = expires
                self._lru[h] = None
                self._lru.move_to_end(h)

    def touch(self, hashes: Sequence[BlockHash]) -> None:
        """Mark held, unpinned ``hashes`` as used now (restarts their TTL); others are
        ignored."""
        now = self._clock()
        expires = now + self.ttl_s
        for h in reversed(hashes):
            entry = self._entries.get(h)
            if entry is not None and entry.pins == 0 and self._live(entry, now):
                entry.expires_at = expires
                self._lru.move_to_end(h)

    # -- insertion -----------------------------------------------------------------------------
    def insert(self, hashes: Sequence[BlockHash], block_ids: Sequence[int] | np.ndarray, *,
               pin: bool = False) -> list[int]:
        """Index blocks the engine has just filled.

        Parameters
        ----------
        hashes
            Their hashes, in prefix order.
        block_ids
            The blocks holding them, one per hash.
        pin
            Pin every returned entry (the request goes on using the blocks); unpin later.

        Returns
        -------
        list of int
            For each hash, the block id the index now holds for it: the one given, or the
            block of an earlier, still usable entry with the same hash (first writer wins;
            the caller keeps or frees its own copy -- it is not indexed).

        Raises
        ------
        ValueError
            When the lengths differ, or a block id is already indexed under another hash.
        """
        ids = [int(b) for b in np.asarray(block_ids, dtype=np.int64).reshape(-1)]
        if len(ids) != len(hashes):
            raise ValueError(f"insert: {len(hashes)} hashes but {len(ids)} block ids")
        for h, b in zip(hashes, ids, strict=True):
            if not isinstance(h, bytes) or len(h) != HASH_BYTES:
                raise ValueError(f"insert: a block hash must be {HASH_BYTES} bytes, got {h!r}")
            if b < 0:
                raise ValueError(f"insert: block ids must be >= 0, got {b}")
            other = self._by_block.get(b)
            if other is not None and other != h:
                raise ValueError(f"insert: block {b} is already indexed under another hash")
        if len(set(ids)) != len(ids):
            raise ValueError("insert: block ids must be distinct")
        now = self._clock()
        out: list[int] = []
        for h, b in zip(hashes, ids, strict=True):
            entry = self._entries.get(h)
            if entry is not None and not self._live(entry, now):
                self._drop(h, EvictReason.EXPIRED)
                entry = None
            if entry is None:
                entry = _Entry(b, 0, now + self.ttl_s)
                self._entries[h] = entry
                self._by_block[b] = h
                self._lru[h] = None
                self._counts["inserted"] += 1
            out.append(entry.block_id)
        # Fresh entries were appended head first; put the head at the most-recent end.
        for h in reversed(hashes):
            if self._entries[h].pins == 0:
                self._lru.move_to_end(h)
        if pin:
            self._pin(hashes)
        return out

    # -- dropping ------------------------------------------------------------------------------
    def expire(self) -> list[Evicted]:
        """Drop every unpinned entry whose TTL has run out; returns them (each also went
        to ``on_evict``)."""
        now = self._clock()
        out = []
        # Unpinned entries share one TTL, so the LRU order is also expiry order.
        while self._lru:
            h = next(iter(self._lru))
            if self._entries[h].expires_at > now:
                break
            out.append(self._drop(h, EvictReason.EXPIRED))
        return out

    def evict(self, n: int) -> list[Evicted]:
        """Drop up to ``n`` unpinned entries, expired ones and then the least recently used
        first; returns them (each also went to ``on_evict``)."""
        out = self.expire()
        while len(out) < n and self._lru:
            out.append(self._drop(next(iter(self._lru)), EvictReason.EVICTED))
        return out

    def remove(self, hashes: Iterable[BlockHash]) -> list[Evicted]:
        """Drop the given unpinned entries (absent ones are ignored).

        Raises
        ------
        KeyError
            When one of them is pinned; nothing is dropped then.
        """
        hs = [h for h in hashes if h in self._entries]
        for h in hs:
            if self._entries[h].pins:
                raise KeyError(f"block hash {h.hex()} is pinned")
        return [self._drop(h, EvictReason.REMOVED) for h in dict.fromkeys(hs)]

    def clear(self) -> list[Evicted]:
        """Drop every unpinned entry."""
        return [self._drop(h, EvictReason.REMOVED) for h in list(self._lru)]

    # -- internals -------------------------------------------------------------------------------
    @staticmethod
    def _live(entry: _Entry, now: float) -> bool:
        return entry.pins > 0 or entry.expires_at > now

    def _drop(self, h: BlockHash, reason: EvictReason) -> Evicted:
        entry = self._entries.pop(h)
        self._lru.pop(h, None)
        del self._by_block[entry.block_id]
        self._counts[reason.value] += 1
        ev = Evicted(h, entry.block_id, reason)
        if self._on_evict is not None:
            self._on_evict(ev)
        return ev


class BlockPool:
    """Free block ids of one engine's KV cache, reclaiming cached blocks when short.

    Parameters
    ----------
    num_blocks
        Blocks in the cache: ids ``[0, num_blocks)``, all free at first.

    Notes
    -----
    Pair it with a :class:`PrefixIndex` whose ``on_evict`` is :meth:`reclaim`, and pass that
    index to :meth:`allocate`. A fresh pool hands out ids in increasing order and freed
    runs are reused in their order, so requests tend to get runs of adjacent blocks (which
    kvpush moves as one descriptor).
    """

    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"BlockPool.num_blocks must be an int >= 1, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives the lowest
        self._is_free = np.ones(num_blocks, dtype=bool)

    @property
    def num_free(self) -> int:
        """Blocks free now."""
        return len(self._free)

    def allocate(self, n: int, index: PrefixIndex | None = None) -> np.ndarray:
        """Take ``n`` free blocks (int64 array), first evicting unpinned cached blocks from
        ``index`` (expired, then least recently used) if too few are free.

        Raises
        ------
        OutOfBlocks
            When even that could not make ``n`` free; nothing is taken or evicted then.
        """
        if n < 0:
            raise ValueError(f"allocate: n must be >= 0, got {n}")
        reclaimable = 0 if index is None else index.evictable
        if n > len(self._free) + reclaimable:  # fail before evicting anything
            raise OutOfBlocks(f"need {n} KV blocks, {len(self._free)} free of {self.num_blocks}"
                              f"{'' if index is None else f', {index.pinned} pinned in use'}")
        if n > len(self._free) and index is not None:
            index.evict(n - len(self._free))
            if n > len(self._free):
                raise OutOfBlocks(f"need {n} KV blocks, reclaimed only up to "
                                  f"{len(self._free)}: the index's on_evict must return "
                                  f"blocks to this pool (BlockPool.reclaim)")
        out = np.array([self._free.pop() for _ in range(n)], dtype=np.int64)
        self._is_free[out] = False
        return out

    def free(self, block_ids: Iterable[int] | np.ndarray) -> None:
        """Return blocks to the pool.

        Raises
        ------
        ValueError
            On an id out of range or already free (a double free would hand one block to
            two requests).
        """
        arr = block_ids if isinstance(block_ids, np.ndarray) else list(block_ids)
        ids: list[int] = np.asarray(arr, dtype=np.int64).reshape(-1).tolist()
        for b in ids:
            if not 0 <= b < self.num_blocks:
                raise ValueError(f"free: block {b} out of range [0, {self.num_blocks})")
            if self._is_free[b]:
                raise ValueError(f"free: block {b} is already free")
        if len(set(ids)) != len(ids):
            raise ValueError("free: duplicate block ids")
        self._is_free[ids] = True
        self._free.extend(reversed(ids))

    def reclaim(self, evicted: Evicted) -> None:
        """``on_evict`` callback for a :class:`PrefixIndex`: the block is free again."""
        self.free([evicted.block_id])

