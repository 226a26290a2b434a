"""The fakes a simulation runs on: a seeded scheduler, fake KV memory, a fake NIXL that
copies real bytes, a fake control network, and the ``links`` object the protocol cores
plan with.

Everything here is driven by one :class:`Scheduler`: its ``rng`` (one
:class:`random.Random`) draws every delay, and its simulated clock is the ``now`` handed to
the cores. Nothing reads the wall clock, so a seed replays exactly.

What the fakes model, and why:

* :class:`FakeNixl`: a posted WRITE or READ is an in-flight transfer whose bytes move *at
  times the scheduler chooses*, possibly in several pieces. Each piece reads the source
  memory when it moves, so a transfer that runs after its source blocks were released and
  reused copies the reuse's bytes. Releasing a transfer in progress (``Abandon``) does not
  stop its bytes (NIXL 1.5.1 over UCX: ``ucp_request_cancel`` does nothing for RMA). While
  the link between its two endpoints is cut, a transfer makes no progress.
* :class:`Network`: control frames between two endpoints keep their order per direction
  (ZeroMQ over one TCP connection never reorders) but race NIXL notifications; a link cut
  holds them, and one long enough to break the connection loses them.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import _core
from ..layout import KVLayout
from ..protocol.effects import XferEnd

__all__ = ["FakeMemory", "FakeNixl", "Network", "Scheduler", "SimLinks", "Transfer"]


class Scheduler:
    """Simulated time and the one source of randomness.

    Events are callables kept in a heap by (time, sequence number): two events due at the
    same time run in the order they were scheduled, so a run is a pure function of the
    seed.
    """

    __slots__ = ("_heap", "_seq", "now", "rng", "steps")

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.now = 0.0
        self.steps = 0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0

    def at(self, when: float, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` at simulated time ``when`` (never earlier than now)."""
        if when < self.now:
            when = self.now
        heapq.heappush(self._heap, (when, self._seq, fn, args))
        self._seq += 1

    def after(self, delay: float, fn: Callable[..., None], *args: Any) -> None:
        self.at(self.now + delay, fn, *args)

    def step(self) -> bool:
        """Run the next event; False when none is left."""
        if not self._heap:
            return False
        when, _, fn, args = heapq.heappop(self._heap)
        self.now = when
        self.steps += 1      # (the trace reads both while fn runs)
        fn(*args)
        return True

    def next_time(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def __len__(self) -> int:
        return len(self._heap)


class FakeMemory:
    """One endpoint's registered KV memory: ``num_regions`` regions of ``num_blocks``
    blocks, all in one numpy array of shape ``(num_regions * num_blocks, block_bytes)``
    (row ``r * num_blocks + b`` is block ``b`` of region ``r``: exactly NIXL descriptor
    ``r * num_blocks + b`` of the region-major lists kvpush prepares). A block holds
    ``heads`` KV heads one after another (head-major, K and V packed, 16 bytes a head):
    heads ``[head_start, head_start + heads)`` of ``total_heads`` (a tensor-parallel
    shard). :attr:`layout` is a real :class:`~kvpush.layout.KVLayout` over it (uint8): one
    region per layer, K and V packed, or with ``kv_apart`` two (K, then V: a block of a
    region holds one of them, 16 bytes a head)."""

    HEAD_BYTES = 16

    __slots__ = ("block_bytes", "data", "head_start", "heads", "layout", "num_blocks",
                 "num_regions", "owner", "regions_per_layer", "words")

    def __init__(self, num_regions: int = 2, num_blocks: int = 32, heads: int = 1,
                 head_start: int = 0, total_heads: int = 0, kv_apart: bool = False) -> None:
        if kv_apart and num_regions % 2:
            raise ValueError("K and V apart need two regions a layer")
        self.num_regions = num_regions
        self.regions_per_layer = 2 if kv_apart else 1
        self.num_blocks = num_blocks
        self.heads = heads
        self.head_start = head_start
        self.block_bytes = block_bytes = heads * self.HEAD_BYTES
        #: the engine model whose KV cache this is (the simulation sets it)
        self.owner: Any = None
        self.data = np.zeros((num_regions * num_blocks, block_bytes), dtype=np.uint8)
        #: The same bytes as uint64 words: patterns are written a word at a time.
        self.words = self.data.view(np.uint64)
        regions = [self.data[r * num_blocks:(r + 1) * num_blocks] for r in range(num_regions)]
        self.layout = KVLayout.from_buffers(
            regions, num_layers=num_regions // self.regions_per_layer, num_blocks=num_blocks,
            tokens_per_block=1, num_kv_heads=heads,
            head_size=self.HEAD_BYTES // 2 * self.regions_per_layer, dtype="uint8",
            kv_packed=not kv_apart, head_start=head_start, total_kv_heads=total_heads)

    def layer_regions(self, layer: int) -> range:
        """The regions of layer ``layer`` (its K and V when they are apart)."""
        per = self.regions_per_layer
        return range(layer * per, (layer + 1) * per)

    def overlap(self, other: FakeMemory) -> tuple[int, int, int]:
        """The heads both hold, as (byte offset here, byte offset in ``other``, bytes)."""
        lo = max(self.head_start, other.head_start)
        hi = min(self.head_start + self.heads, other.head_start + other.heads)
        n = max(hi - lo, 0)
        return ((lo - self.head_start) * self.HEAD_BYTES,
                (lo - other.head_start) * self.HEAD_BYTES, n * self.HEAD_BYTES)

    def rows(self, block_ids: np.ndarray) -> np.ndarray:
        """Rows (descriptor indices) of ``block_ids`` in every region, region-major."""
        ids = np.asarray(block_ids, dtype=np.int64)
        return (np.arange(self.num_regions, dtype=np.int64)[:, None] * self.num_blocks
                + ids[None, :]).ravel()

    def fill(self, block_ids: np.ndarray, tag: int, region: int | None = None) -> None:
        """Write a pattern unique to ``tag`` (< 2**40) into ``block_ids``: every word of
        row ``k`` of the selection (region-major) holds ``tag << 24 | k << 8 | word``.
        ``region``: only that region's rows (a layer of a layer-wise prefill), with the
        values a whole fill would give them."""
        rows = self.rows(block_ids)
        n, w = len(rows), self.words.shape[1]
        k = np.arange(n, dtype=np.uint64)
        if region is not None:
            per = len(block_ids)
            rows, k = rows[region * per:(region + 1) * per], k[region * per:(region + 1) * per]
        vals = (np.uint64(tag) << np.uint64(24)) | (k[:, None] << np.uint64(8)) \
            | np.arange(w, dtype=np.uint64)[None, :]
        self.words[rows] = vals

    def snapshot(self, block_ids: np.ndarray) -> np.ndarray:
        out: np.ndarray = self.words[self.rows(block_ids)].copy()
        return out

    def tags(self, block_ids: np.ndarray) -> list[int]:
        """The pattern tag found in the first word of each block of region 0 (which use's
        bytes are there: for messages)."""
        return [int(v) >> 24 for v in self.words[np.asarray(block_ids, dtype=np.int64), 0]]


@dataclass(eq=False)
class Transfer:
    """One posted WRITE or READ in the fake NIXL."""

    key: int
    op: str
    poster: Any              # the posting endpoint (testing.sim.Endpoint or any object)
    poster_inc: int
    target: Any
    target_inc: int
    src: FakeMemory
    dst: FakeMemory
    src_rows: np.ndarray
    dst_rows: np.ndarray
    notif: bytes
    xid: int                 # the consumer use it belongs to (from its notification)
    consumer: str            # the consumer's name (the WRITE's target or the READ's poster)
    posted_at: float
    src_blocks: frozenset[int] = frozenset()   # block ids it reads
    src_off: int = 0         # the byte range of each block it moves (the heads both hold)
    dst_off: int = 0
    length: int = -1         # -1: whole blocks
    pieces: list[tuple[int, int]] = field(default_factory=list)  # row ranges still to move
    moved: int = 0           # rows moved so far
    state: str = "moving"    # moving | landed | error | dead
    reported: bool = False   # transfer_ended was handed to the poster's core
    abandoned: bool = False
    fail_at: int = -1        # the piece at which it errors (-1: never)
    use: Any = None          # the simulation's record of the consumer use, if known
    flagged: bool = False    # a violation was reported for it (once is enough)

    @property
    def still_moving(self) -> bool:
        return self.state == "moving"


class FakeNixl:
    """All in-flight transfers of a simulation.

    Hooks (set by the simulation): ``on_piece(transfer, lo, hi)`` after a piece's bytes
    moved, ``on_landed(transfer)`` when the last piece moved, ``on_error(transfer)`` when
    it failed, ``on_stopped(transfer)`` whenever it stops moving for any reason (landed,
    error, dead), ``link_cut_until(a, b) -> float`` for the link between two endpoints (0
    when whole), and ``stalled_until(endpoint) -> float``: a transfer moves only while its
    poster progresses it (UCX over TCP, what these hosts use: a frozen initiator's READ or
    WRITE waits for it).
    """

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.active: dict[int, Transfer] = {}   # by id(transfer): still moving
        self.on_piece: Callable[[Transfer, int, int], None] = lambda t, lo, hi: None
        self.on_landed: Callable[[Transfer], None] = lambda t: None
        self.on_error: Callable[[Transfer], None] = lambda t: None
        self.on_stopped: Callable[[Transfer], None] = lambda t: None
        self.link_cut_until: Callable[[Any, Any], float] = lambda a, b: 0.0
        self.stalled_until: Callable[[Any], float] = lambda a: 0.0
        # delay of one piece: (min, max) seconds; pieces per transfer at most
        self.piece_delay = (20e-6, 1e-3)
        self.max_pieces = 3

    def start(self, xfer: Transfer, slow: float = 0.0) -> None:
        """Schedule the pieces of ``xfer``; ``slow`` (seconds) stretches every piece's delay
        up to that long (a slow fabric)."""
        rng = self.sched.rng
        n = len(xfer.src_rows)
        k = 1 if n <= 1 else rng.randint(1, min(self.max_pieces, n))
        cuts = sorted(rng.sample(range(1, n), k - 1)) if k > 1 else []
        bounds = [0, *cuts, n]
        xfer.pieces = [(bounds[i], bounds[i + 1]) for i in range(k)]
        self.active[id(xfer)] = xfer
        self._schedule_next(xfer, slow)

    def finish_now(self, xfer: Transfer) -> None:
        """Move every byte at once (on a host UCX often finishes a transfer inside the
        post call)."""
        while xfer.state == "moving" and xfer.pieces:
            lo, hi = xfer.pieces.pop(0)
            self._copy(xfer, lo, hi)
        if xfer.state == "moving":
            self._stop(xfer, "landed")
            self.on_landed(xfer)

    def _copy(self, xfer: Transfer, lo: int, hi: int) -> None:
        # The bytes as the source holds them *now*.
        if xfer.length < 0:
            xfer.dst.data[xfer.dst_rows[lo:hi]] = xfer.src.data[xfer.src_rows[lo:hi]]
        else:
            so, do, n = xfer.src_off, xfer.dst_off, xfer.length
            xfer.dst.data[xfer.dst_rows[lo:hi], do:do + n] = \
                xfer.src.data[xfer.src_rows[lo:hi], so:so + n]
        xfer.moved += hi - lo
        self.on_piece(xfer, lo, hi)

    def _schedule_next(self, xfer: Transfer, slow: float) -> None:
        lo, hi = self.piece_delay
        delay = self.sched.rng.uniform(lo, hi)
        if slow:
            delay += self.sched.rng.uniform(0, slow)
        self.sched.after(delay, self._piece, xfer, slow)

    def _piece(self, xfer: Transfer, slow: float) -> None:
        if xfer.state != "moving":
            return
        until = max(self.link_cut_until(xfer.poster, xfer.target),
                    self.stalled_until(xfer.poster))
        if until > self.sched.now:   # no progress while the link is cut or the poster frozen
            self.sched.at(until + self.sched.rng.uniform(*self.piece_delay),
                          self._piece, xfer, slow)
            return
        if xfer.fail_at == 0:
            self._stop(xfer, "error")
            self.on_error(xfer)
            return
        xfer.fail_at -= 1
        lo, hi = xfer.pieces.pop(0)
        self._copy(xfer, lo, hi)
        if xfer.pieces:
            self._schedule_next(xfer, slow)
        else:
            self._stop(xfer, "landed")
            self.on_landed(xfer)

    def _stop(self, xfer: Transfer, state: str) -> None:
        xfer.state = state
        self.active.pop(id(xfer), None)
        self.on_stopped(xfer)

    def kill(self, xfer: Transfer) -> None:
        """Stop a transfer for good (its poster or target process died): no more bytes."""
        if xfer.state == "moving":
            self._stop(xfer, "dead")

    def abandon(self, xfer: Transfer) -> XferEnd:
        """What NIXL's release of the handle finds: DONE if every byte moved, ERROR if it
        failed, else ABANDONED -- and then its bytes keep moving."""
        xfer.abandoned = True
        if xfer.state == "landed":
            return XferEnd.DONE
        if xfer.state in ("error", "dead"):
            return XferEnd.ERROR
        return XferEnd.ABANDONED

    def reading(self, mem: FakeMemory) -> Iterator[Transfer]:
        """Transfers still moving whose source is ``mem``."""
        return (x for x in self.active.values() if x.src is mem)


class Network:
    """Control frames between endpoints.

    Per directed pair, frames are delivered in the order sent: each is due no earlier than
    the one before it. A link cut holds every frame of the pair (TCP retransmits) until the
    cut heals; a cut that lasts ``reset_s`` or more breaks the connection (the facades close
    a connection dead for ``peer_timeout_s``: TCP keepalive), and every frame held by it is
    lost. ``deliver(sender, frame)`` is called at delivery time; whether the target can take
    it (alive, not stalled) is the caller's business.
    """

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self._last: dict[tuple[str, str], float] = {}
        self._cut: dict[frozenset[str], tuple[float, float]] = {}   # pair -> (start, until)
        #: per endpoint, the seconds its links have been cut or are cut to be, counted as
        #: each cut is made or lengthened (see :meth:`held_s`)
        self._held_s: dict[str, float] = {}
        self.delay = (50e-6, 2e-3)
        self.slow_p = 0.01          # chance of a slow frame (a retransmission, a full queue)
        self.slow_delay = 20e-3
        self.dup_p = 0.0            # chance of duplicating an idempotent frame
        self.reset_s = 1.0
        self._gen: dict[tuple[str, str], int] = {}   # connection generation per pair
        self.sent = 0
        self.lost = 0
        self.duplicated = 0

    def cut(self, a: str, b: str, until: float) -> None:
        key = frozenset((a, b))
        now = self.sched.now
        start, old = self._cut.get(key, (now, 0.0))
        if old <= now:
            start = now
        added = max(until, old) - max(old, now)
        if added > 0:
            for end in (a, b):
                self._held_s[end] = self._held_s.get(end, 0.0) + added
        self._cut[key] = (start, max(until, old))

    def held_s(self, endpoint: str) -> float:
        """Seconds the links of ``endpoint`` have held frames so far (cuts of its links, each
        link apart; ``heal_all`` does not take back what its cuts would have held). A frame
        sent before a cut arrives when it heals, so what a peer learns from it (that the
        sender is alive) is late by up to that much."""
        return self._held_s.get(endpoint, 0.0) - sum(self._ongoing(endpoint))

    def held_for_s(self, endpoint: str) -> float:
        """Seconds the cuts of ``endpoint``'s links still hold frames for, from now."""
        return sum(self._ongoing(endpoint))

    def _ongoing(self, endpoint: str) -> list[float]:
        now = self.sched.now
        return [until - now for pair, (_, until) in self._cut.items()
                if endpoint in pair and until > now]

    def cut_until(self, a: str, b: str) -> float:
        entry = self._cut.get(frozenset((a, b)))
        if entry is None:
            return 0.0
        return entry[1] if entry[1] > self.sched.now else 0.0

    def heal_all(self) -> None:
        self._cut.clear()

    def reset(self, a: str, b: str) -> None:
        """The connection between ``a`` and ``b`` breaks and ZeroMQ reconnects at once:
        the frames in flight either way are lost (those in the broken TCP connection);
        later ones arrive, so the stream has a gap while neither side notices a loss."""
        for pair in ((a, b), (b, a)):
            self._gen[pair] = self._gen.get(pair, 0) + 1

    def send(self, src: str, dst: str, frame: bytes, deliver: Callable[[str, bytes], None],
             idempotent: bool = False) -> None:
        self.sent += 1
        rng = self.sched.rng
        delay = rng.uniform(*self.delay)
        if rng.random() < self.slow_p:
            delay += rng.uniform(0, self.slow_delay)
        self._queue(src, dst, frame, deliver, self.sched.now + delay, -1.0)
        if idempotent and self.dup_p and rng.random() < self.dup_p:
            self.duplicated += 1
            self._queue(src, dst, frame, deliver, self.sched.now + delay, -1.0)

    def _queue(self, src: str, dst: str, frame: bytes, deliver: Callable[[str, bytes], None],
               when: float, held_since: float) -> None:
        pair = (src, dst)
        when = max(when, self._last.get(pair, 0.0))
        self._last[pair] = when
        self.sched.at(when, self._arrive, src, dst, frame, deliver, held_since,
                      self._gen.get(pair, 0))

    def _arrive(self, src: str, dst: str, frame: bytes,
                deliver: Callable[[str, bytes], None], held_since: float,
                gen: int = 0) -> None:
        if gen != self._gen.get((src, dst), 0):
            self.lost += 1                              # in the connection that broke
            return
        entry = self._cut.get(frozenset((src, dst)))
        now = self.sched.now
        if entry is not None and entry[1] > now:       # held until the cut heals
            since = entry[0] if held_since < 0 else held_since
            self._queue(src, dst, frame, deliver,
                        entry[1] + self.sched.rng.uniform(*self.delay), since)
            return
        if held_since >= 0 and entry is not None and entry[1] - entry[0] >= self.reset_s:
            self.lost += 1                              # the connection broke meanwhile
            return
        deliver(src, frame)


class SimLinks:
    """The ``links`` object a protocol core plans with (docs/PROTOCOL.md): descriptor
    indices from the compiled planner over the two sides' fake memories."""

    def __init__(self, local: FakeMemory, peer_memory: Callable[[str], FakeMemory | None]) -> None:
        self.local = local
        self._peer_memory = peer_memory

    def plan(self, peer: str, local_ids: np.ndarray, remote_ids: np.ndarray,
             coalesce: bool = True) -> _core.TransferPlan:
        remote = self._peer_memory(peer)
        if remote is None:
            raise KeyError(f"no link to {peer!r}")
        return _core.plan_transfer(np.ascontiguousarray(local_ids, dtype=np.int64),
                                   np.ascontiguousarray(remote_ids, dtype=np.int64),
                                   self.local.num_blocks, remote.num_blocks,
                                   self.local.num_regions, coalesce)

    def desc_bytes(self, peer: str) -> int:
        remote = self._peer_memory(peer)
        return self.local.overlap(remote)[2] if remote is not None else self.local.block_bytes

    def checksums(self, ids: np.ndarray) -> bytes:
        from ..plan import block_checksums
        sums: np.ndarray = block_checksums(self.local.layout, np.asarray(ids, dtype=np.int64))
        return sums.astype("<u8").tobytes()
