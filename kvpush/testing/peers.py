"""Simulated peers for an engine's integration tests: the other side of the engine's real
:class:`~kvpush.Producer` or :class:`~kvpush.Consumer`, with the faults an integration
must survive.

An engine author tests their prefill integration against :class:`SimulatedDecode` (it
connects to the engine's Producer and registers or pulls requests) and their decode
integration against :class:`SimulatedPrefill` (the engine's Consumer connects to it and
it pushes or hands out pull tickets). Both are real kvpush endpoints over real NIXL agents
and real ZeroMQ, each behind a :class:`~kvpush.testing.proxy.ControlProxy` that carries
its control frames, so that it can:

* be **killed** (:meth:`~SimulatedPrefill.kill`): its connections reset, no ``Bye``, its
  NIXL agent gone, as when its process dies;
* **restart** under the same name (:meth:`~SimulatedPrefill.restart`): a new incarnation,
  with a new NIXL agent, at the same address;
* **stall** (:meth:`~SimulatedPrefill.stall` / :meth:`~SimulatedPrefill.resume`): it
  stays connected and says nothing, for as long as the test likes (past the engine's
  ``peer_timeout_s``); what it and the engine sent meanwhile arrives, in order, when it
  resumes. Its own loop keeps running (only its control frames wait), and NIXL's
  notifications still flow;
* **drop, delay or duplicate** control frames by kind, direction and request id, chosen by
  seeded :class:`~kvpush.testing.proxy.FrameRule` s (:meth:`~SimulatedPrefill.add_rule`),
  or **answer slowly** (:meth:`~SimulatedPrefill.slow`);
* **abort** a request, or (the prefill) **fail** a push transfer
  (:meth:`SimulatedPrefill.fail_push`);
* fill the blocks it sends with **known bytes** and check what landed
  (:func:`fill_blocks`, :func:`check_blocks`, keyed by request id, so a test fills the
  engine's source or checks the engine's destination the same way).

Everything a peer starts (its endpoint, the proxy's thread and sockets) stops in
:meth:`close` or at the end of its ``with`` block; every call that waits takes a timeout.
The peer's cache is host memory shaped like the engine's layout (:func:`host_layout`), so
the engine's layout must be in host memory too (``MemoryKind.DRAM``) and hold the same
heads (block bytes are compared whole).

``SimulatedPrefill`` listens on 127.0.0.1 (its proxy) and binds its Producer to 127.0.0.2
at the same port, advertising the proxy's address, so pull tickets and authenticated
Hellos (which name the address they dialled) reach the Producer through the proxy. An
authenticated ``SimulatedDecode`` cannot stand behind a proxy (the engine's Producer
refuses a Hello that did not dial it): it refuses ``auth_key``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import threading
import time
import uuid
import zlib
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ..consumer import Consumer, ConsumerConfig
from ..errors import PeerUnavailable
from ..layout import KVLayout, MemoryKind
from ..messages import PullTicket
from ..producer import Producer, ProducerConfig
from ..request import Release, TransferHandle, TransferMode, TransferResult
from .proxy import Action, ControlProxy, Direction, FrameRule

__all__ = ["DECODE_CONFIG", "SimulatedDecode", "SimulatedPrefill", "check_blocks", "fill_blocks",
           "host_layout"]

#: A SimulatedDecode's Consumer settings unless given: heartbeats every 0.1 s, so that an
#: engine's Producer with a test's short ``peer_timeout_s`` keeps it (the library's 1 s
#: would be taken for silence below 2 s).
DECODE_CONFIG = ConsumerConfig(heartbeat_s=0.1, peer_timeout_s=10.0)

#: Where a SimulatedPrefill's proxy listens, and where its Producer binds (same port).
FRONT_HOST = "127.0.0.1"
BACK_HOST = "127.0.0.2"


def host_layout(like: KVLayout) -> tuple[list[np.ndarray], KVLayout]:
    """Zeroed host buffers of ``like``'s regions' lengths, and the layout over them (every
    other field as in ``like``, so the two layouts are compatible). A buffer whose region
    is exactly ``num_blocks`` blocks is shaped ``(num_blocks, block_stride)`` (row ``b``:
    block ``b``), any other is flat."""
    if any(r.kind is not MemoryKind.DRAM for r in like.regions):
        raise ValueError("a simulated peer holds its cache in host memory: give it a layout "
                         "in host memory (MemoryKind.DRAM)")
    rows = like.num_blocks * like.block_stride
    buffers = [np.zeros((like.num_blocks, like.block_stride) if r.length == rows
                        else r.length, np.uint8) for r in like.regions]
    return buffers, like.with_buffers(buffers)


def _blocks(layout: KVLayout, block_ids: Iterable[int]) -> list[tuple[int, int, np.ndarray]]:
    """(region, index in the request, view of the block) for every block, every region."""
    views = []
    for region in layout.regions:
        if region.kind is not MemoryKind.DRAM:
            raise ValueError("fill_blocks/check_blocks read host memory (MemoryKind.DRAM)")
        views.append(np.ctypeslib.as_array(
            (ctypes.c_uint8 * region.length).from_address(region.addr)))
    out = []
    for i, block in enumerate(int(b) for b in block_ids):
        if not 0 <= block < layout.num_blocks:
            raise ValueError(f"block id {block} outside [0, {layout.num_blocks})")
        start = block * layout.block_stride
        for r, view in enumerate(views):
            out.append((r, i, view[start:start + layout.block_bytes]))
    return out


def _pattern(key: str, region: int, index: int, nbytes: int) -> np.ndarray:
    seed = [zlib.crc32(key.encode()), region, index]
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def fill_blocks(layout: KVLayout, block_ids: Iterable[int], key: str) -> None:
    """Write known bytes into ``block_ids`` of the host-memory ``layout``: the i-th block
    of every region gets bytes drawn from ``(key, region, i)``, so the blocks a request
    moves can be checked wherever they land (:func:`check_blocks` with the same key and
    the destination's block ids). A simulated prefill keys them by request id."""
    for r, i, view in _blocks(layout, block_ids):
        view[:] = _pattern(key, r, i, view.size)


def check_blocks(layout: KVLayout, block_ids: Iterable[int], key: str) -> None:
    """Raise AssertionError, naming the first block and region that differ, unless
    ``block_ids`` of ``layout`` hold what :func:`fill_blocks` wrote with ``key``."""
    for r, i, view in _blocks(layout, block_ids):
        want = _pattern(key, r, i, view.size)
        if not np.array_equal(view, want):
            first = int(np.flatnonzero(view != want)[0])
            raise AssertionError(f"{key!r}: block #{i} of region {r} differs from what was "
                                 f"sent (first at byte {first})")


class _Peer:
    """What both simulated peers do with their proxy."""

    proxy: ControlProxy
    name: str
    _killed: bool

    def add_rule(self, rule: FrameRule) -> None:
        """Tamper with control frames from now on (see
        :class:`~kvpush.testing.proxy.FrameRule`; rules added earlier are checked first)."""
        self.proxy.add_rule(rule)

    def clear_rules(self) -> None:
        """Let every control frame pass from now on."""
        self.proxy.clear_rules()

    def stall(self) -> None:
        """Go silent: connected, but no control frame passes either way until
        :meth:`resume`."""
        self.proxy.hold()

    def resume(self) -> None:
        """End a :meth:`stall`: what waited is delivered, in order."""
        self.proxy.release()

    @property
    def killed(self) -> bool:
        """True between :meth:`kill` and :meth:`restart`."""
        return self._killed


class SimulatedPrefill(_Peer):
    """A prefill engine for a decode engine's test: the engine's real
    :class:`~kvpush.Consumer` connects to :attr:`address` (or pulls its tickets).

    Parameters
    ----------
    layout
        The decode engine's layout: the simulated cache is host memory of the same shape
        (:func:`host_layout`), :attr:`layout`.
    config
        Its Producer's settings; ``host``, ``port`` and ``advertise`` are chosen here (see
        the module docstring), ``name`` is kept across restarts (one is made if None).
    rules
        :class:`~kvpush.testing.proxy.FrameRule` s for its control frames from the start.

    Every :class:`~kvpush.Release` of its Producer is recorded (:meth:`releases`,
    :meth:`wait_release`), and its blocks are what :meth:`prefill` filled with
    :func:`fill_blocks` keyed by the request id.
    """

    def __init__(self, layout: KVLayout, *, config: ProducerConfig | None = None,
                 rules: Iterable[FrameRule] = ()) -> None:
        self.buffers, self.layout = host_layout(layout)
        config = config or ProducerConfig()
        self.name: str = config.name or f"simulated-prefill-{uuid.uuid4().hex[:8]}"
        self._auth = config.auth_key is not None
        self._released: list[Release] = []
        self._cond = threading.Condition()
        self._killed = False
        self.proxy = ControlProxy("tcp://0.0.0.0:0", host=FRONT_HOST, rules=rules,
                                  name=f"{self.name}-proxy")
        try:
            port = int(self.proxy.address.rsplit(":", 1)[1])
            self.proxy.target = f"tcp://{BACK_HOST}:{port}"
            self._config = dataclasses.replace(config, host=BACK_HOST, port=port,
                                               advertise=FRONT_HOST, name=self.name)
            self._producer: Producer = self._start(0.0)
        except BaseException:
            self.proxy.close()
            raise
        #: What the engine's Consumer dials.
        self.address: str = self.proxy.address

    def _start(self, retry_s: float) -> Producer:
        deadline = time.monotonic() + retry_s
        while True:
            try:
                return Producer(self.layout, self._config, on_release=self._on_release)
            except PeerUnavailable:  # the previous incarnation's port not free yet
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.02)

    def _on_release(self, release: Release) -> None:
        with self._cond:
            self._released.append(release)
            self._cond.notify_all()

    @property
    def producer(self) -> Producer:
        """The current incarnation's Producer (its ``status``, ``stats``)."""
        return self._producer

    def prefill(self, request_id: str, block_ids: Sequence[int],
                mode: TransferMode = TransferMode.PUSH) -> PullTicket | None:
        """Fill ``block_ids`` with the request's known bytes (:func:`fill_blocks` keyed by
        ``request_id``) and call ``prefill_done``: push, the WRITE starts once the engine
        has registered; pull, the ticket to hand the engine is returned."""
        fill_blocks(self.layout, block_ids, request_id)
        return self._producer.prefill_done(request_id, np.asarray(block_ids, np.int64), mode)

    def abort(self, request_id: str, reason: str = "aborted by the simulated prefill") -> None:
        """Give the request up (``Producer.abort``): the engine's use ends ABORTED."""
        self._producer.abort(request_id, reason)

    def fail_push(self, request_id: str) -> None:
        """Fail the next push of ``request_id``: its registration never reaches the
        Producer and the engine is told ``Failed`` (code "failed", nothing written, its
        blocks safe), as from a producer that cannot deliver. Unauthenticated only (the
        answer is forged on the wire)."""
        if self._auth:
            raise ValueError("fail_push forges the producer's answer: not with auth_key")
        self.proxy.add_rule(FrameRule(Action.FAIL, frozenset({"register"}),
                                      Direction.TO_PRODUCER, request_id, limit=1))

    def slow(self, delay_s: float) -> None:
        """Answer slowly: every control frame to the engine is held ``delay_s`` (in order)."""
        self.proxy.add_rule(FrameRule(Action.DELAY, direction=Direction.TO_CONSUMER,
                                      delay_s=delay_s))

    def releases(self, request_id: str | None = None) -> list[Release]:
        """The releases so far (of ``request_id`` only, if given), in order."""
        with self._cond:
            return [r for r in self._released if request_id in (None, r.request_id)]

    def wait_release(self, request_id: str, timeout: float = 10.0) -> Release:
        """The first release of ``request_id``, waiting for it up to ``timeout`` s."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.releases(request_id), timeout):
                raise TimeoutError(f"no release of {request_id!r} in {timeout} s")
            return self.releases(request_id)[0]

    def kill(self, timeout: float = 10.0) -> None:
        """Die without a word: every connection reset (no ``Bye``), the Producer and its
        NIXL agent gone; what it held is lost with it."""
        if self._killed:
            return
        self._killed = True
        self.proxy.cut()
        self._producer.close(timeout)

    def restart(self, timeout: float = 10.0) -> None:
        """Come back under the same name at the same address, as a new incarnation (a new
        Producer and NIXL agent, nothing of the old one held); killed first if alive."""
        self.kill(timeout)
        self._producer = self._start(timeout)
        self.proxy.reopen()
        self._killed = False

    def close(self, timeout: float = 10.0) -> None:
        """Stop the Producer (politely, with ``Bye``, unless killed) and the proxy."""
        try:
            if not self._killed:
                self._producer.close(timeout)
        finally:
            self.proxy.close()

    def __enter__(self) -> SimulatedPrefill:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SimulatedDecode(_Peer):
    """A decode engine for a prefill engine's test: connects to the engine's real
    :class:`~kvpush.Producer` at ``producer_address`` and registers (push) or pulls
    requests into a cache of its own.

    Parameters
    ----------
    producer_address
        The engine's ``Producer.address``.
    layout
        The prefill engine's layout: the simulated cache is host memory of the same shape
        (:func:`host_layout`), :attr:`layout`.
    config
        Its Consumer's settings (default :data:`DECODE_CONFIG`); ``name`` is kept across
        restarts (one is made if None); no ``auth_key`` (see the module docstring).
    rules
        :class:`~kvpush.testing.proxy.FrameRule` s for its control frames from the start.
    connect_timeout
        Bound of each handshake (here and after :meth:`restart`).

    Results land in its own blocks; :meth:`check` compares them with what the engine's
    source held (:func:`fill_blocks` keyed by request id).
    """

    def __init__(self, producer_address: str, layout: KVLayout, *,
                 config: ConsumerConfig | None = None, rules: Iterable[FrameRule] = (),
                 connect_timeout: float = 10.0) -> None:
        config = config or DECODE_CONFIG
        if config.auth_key is not None:
            raise ValueError("SimulatedDecode: the engine's Producer refuses an "
                             "authenticated Hello through a proxy; leave auth_key None")
        self.buffers, self.layout = host_layout(layout)
        self.name: str = config.name or f"simulated-decode-{uuid.uuid4().hex[:8]}"
        self._config = dataclasses.replace(config, name=self.name)
        self._connect_timeout = connect_timeout
        self._killed = False
        self.proxy = ControlProxy(producer_address, rules=rules, name=f"{self.name}-proxy")
        self._consumer: Consumer | None = None
        try:
            self._consumer = Consumer(self.layout, self._config)
            #: The engine's Producer's name (what ``expect`` registers with).
            self.producer_name: str = self._consumer.connect(self.proxy.address,
                                                             connect_timeout)
        except BaseException:
            self.close()
            raise

    @property
    def consumer(self) -> Consumer:
        """The current incarnation's Consumer (its ``status``, ``stats``)."""
        assert self._consumer is not None
        return self._consumer

    def expect(self, request_id: str, block_ids: Sequence[int], **options: Any
               ) -> TransferHandle:
        """Register ``block_ids`` for a push of ``request_id`` (``Consumer.expect`` with
        ``options``)."""
        return self.consumer.expect(request_id, np.asarray(block_ids, np.int64),
                                    self.producer_name, **options)

    def pull(self, ticket: PullTicket | bytes, block_ids: Sequence[int], **options: Any
             ) -> TransferHandle:
        """READ what ``ticket`` names into ``block_ids`` (``Consumer.pull``)."""
        return self.consumer.pull(ticket, np.asarray(block_ids, np.int64), **options)

    def abort(self, request_id: str, reason: str = "aborted by the simulated decode") -> None:
        """Give the request up (``Consumer.abort``)."""
        self.consumer.abort(request_id, reason)

    def slow(self, delay_s: float) -> None:
        """Answer slowly: every control frame to the engine is held ``delay_s`` (in order)."""
        self.proxy.add_rule(FrameRule(Action.DELAY, direction=Direction.TO_PRODUCER,
                                      delay_s=delay_s))

    def check(self, result: TransferResult, key: str | None = None) -> None:
        """Raise AssertionError unless ``result`` is READY and its blocks hold what the
        engine's source held (:func:`fill_blocks` with ``key``, by default the request
        id)."""
        if not result.ok:
            raise AssertionError(f"{result.request_id!r} ended {result.state.value}: "
                                 f"{result.error}")
        check_blocks(self.layout, result.block_ids, key or result.request_id)

    def kill(self, timeout: float = 10.0) -> None:
        """Die without a word: every connection reset (no ``Bye``), the Consumer and its
        NIXL agent gone; its requests are lost with it."""
        if self._killed:
            return
        self._killed = True
        self.proxy.cut()
        self.consumer.close(timeout)

    def restart(self, timeout: float = 10.0) -> None:
        """Come back under the same name as a new incarnation (a new Consumer and NIXL
        agent) and connect again; killed first if alive."""
        self.kill(timeout)
        self.proxy.reopen()
        self._consumer = Consumer(self.layout, self._config)
        self._killed = False
        self.producer_name = self._consumer.connect(self.proxy.address,
                                                    self._connect_timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the Consumer (politely, with ``Bye``, unless killed) and the proxy."""
        try:
            if self._consumer is not None and not self._killed:
                self._consumer.close(timeout)
        finally:
            self.proxy.close()

    def __enter__(self) -> SimulatedDecode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
