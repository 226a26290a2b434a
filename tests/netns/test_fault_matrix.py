"""The fault matrix across two "hosts": a Producer in one network namespace, a Consumer in
another, UCX forced onto TCP over the veth between them (see ``tests/support/netns.py``).
Aborts, leases and lost peers are also pinned on the protocol cores (``tests/protocol``) and
between two processes on one host (``tests/processes/test_failures.py``); here they meet a
real network.

Every cell injects one fault -- a killed peer, a missing registration or prefill, an abort at
one protocol step, a cut or frozen link, a restarted peer -- in push and in pull, and checks
that each surviving side ends in a defined state within its deadline, that source blocks
are released and requests reported exactly once, that no thread or process is left behind,
and that a dead peer's NIXL state is gone. Cells that show a bug in the core are marked
``xfail`` with the bug named -- strict where the failure is deterministic, not strict where
it is a race -- and docs/RELIABILITY.md has the fixes.

UCX runs in kvpush's default error mode, ``none``, throughout: the cells that post toward a
killed peer show that it neither hangs nor crashes the survivor.
"""

from __future__ import annotations

import base64
import contextlib
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest

from kvpush.messages import PullTicket
from tests.support.netns import Ledger, Link, Node, NodeError, netns_unavailable

pytestmark = [pytest.mark.netns, pytest.mark.timeout(180)]

# 8 KiB per block id (two regions of 4 KiB): 512 blocks = 4 MiB, ~1.4 s on the shaped link.
CACHE = dict(num_blocks=1024, num_layers=2, head_size=128)
BIG_SRC = list(range(0, 512))
BIG_DST = list(range(512, 1024))
RATE = "24mbit"
PEER_TIMEOUT = 1.5
PRODUCER = dict(lease_s=3.0, peer_timeout_s=PEER_TIMEOUT, transfer_timeout_s=6.0,
                max_wait_s=30.0, tombstone_s=60.0)
CONSUMER = dict(heartbeat_s=0.15, peer_timeout_s=PEER_TIMEOUT, abort_grace_s=2.0,
                request_timeout_s=15.0, lease_margin_s=0.05, connect_timeout_s=10.0)
#: how long a side may take to notice a silent or dead peer
DETECT = PEER_TIMEOUT + 2.5
#: a pull source whose READ began waits this long at most (lease + transfer timeout)
PULL_HOLD = PRODUCER["lease_s"] + PRODUCER["transfer_timeout_s"]
#: a WRITE to a silent consumer is left to end (bytes still in flight must not read reused
#: source blocks), at most until its deadline; a READ's blocks stay held for its PullHeld
#: hold_s (the transfer timeout) after its PullBegin, whatever happened to the puller
WRITE_HOLD = PRODUCER["transfer_timeout_s"] + 1.5
READ_HOLD = PRODUCER["transfer_timeout_s"] + 1.5


def wait_for(what: str, fn: Callable[[], Any], timeout: float, every: float = 0.02) -> Any:
    """Poll ``fn`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s (last: {value!r})")
        time.sleep(every)


class Pair:
    """One producer node (namespace a) and one consumer node (namespace b), connected."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.ledger = Ledger()
        self.producer: Node | None = None
        self.consumer: Node | None = None
        self.seed = 1
        self.cut = False
        self.shaped = False
        self.counter = 0

    # -- nodes -----------------------------------------------------------------------------
    def start_producer(self, name: str | None = None, port: int = 0, seed: int | None = None,
                       **overrides: Any) -> Node:
        self.seed = seed if seed is not None else self.seed + 1
        node = Node("producer", self.link.a_ns, self.link.a_dev)
        config = dict(PRODUCER, host=self.link.a_ip, port=port, name=name, **overrides)
        try:
            return node.start("producer", CACHE, config, seed=self.seed)
        except BaseException:
            node.close()
            raise

    def start_consumer(self, name: str | None = None, **overrides: Any) -> Node:
        node = Node("consumer", self.link.b_ns, self.link.b_dev)
        try:
            return node.start("consumer", CACHE, dict(CONSUMER, name=name, **overrides))
        except BaseException:
            node.close()
            raise

    def log_tails(self, lines: int = 60) -> str:
        """The last lines of each live node's log (a failing test shows them)."""
        return "\n".join(f"--- {node.label} (pid {node.pid}) ---\n{node.log_tail(lines)}"
                         for node in (self.producer, self.consumer) if node is not None)

    @property
    def p(self) -> Node:
        assert self.producer is not None
        return self.producer

    @property
    def c(self) -> Node:
        assert self.consumer is not None
        return self.consumer

    def connect(self) -> str:
        name: str = self.c.call("connect", address=self.p.address, timeout=10.0)
        assert name == self.p.name
        return name

    def heal(self) -> None:
        """Before a cell: link up and unshaped, both nodes alive and connected."""
        if self.cut:
            self.link.restore()
            self.cut = False
        if self.shaped:
            self.link.unshape()
            self.shaped = False
        for node in (self.producer, self.consumer):
            if node is not None and node.stopped:
                node.cont()
        if self.producer is None or not self.producer.alive():
            if self.producer is not None:
                self.producer.close()
            self.producer = self.start_producer()
        if self.consumer is None or not self.consumer.alive():
            if self.consumer is not None:
                self.consumer.close()
            self.consumer = self.start_consumer()
        if self.p.name not in self.c.call("producers"):
            wait_for("reconnect", self._try_connect, 10.0, every=0.2)

    def _try_connect(self) -> bool:
        try:
            self.connect()
        except NodeError:
            return False
        return True

    def shape(self) -> None:
        self.link.shape(RATE)
        self.shaped = True

    def cut_link(self) -> None:
        self.link.cut()
        self.cut = True

    def restore_link(self) -> None:
        self.link.restore()
        self.cut = False

    def close(self) -> None:
        """Stop both nodes; a node that was alive must exit cleanly, with nothing live."""
        for node in (self.consumer, self.producer):
            if node is not None:
                if node.stopped:
                    node.cont()
                was_alive = node.alive()
                rc = node.close()
                if was_alive:
                    assert rc == 0 and node.final == {"live": {}, "threads": []}, \
                        (node.label, rc, node.final)

    # -- requests --------------------------------------------------------------------------
    def rid(self, tag: str) -> str:
        self.counter += 1
        return f"{tag}-{self.counter}"

    def expect(self, rid: str, src: list[int], dst: list[int], timeout: float = 10.0) -> None:
        errors = self.c.call("expect", items=[[rid, dst, self.p.name, timeout, self.seed, src]])
        assert errors == [None], errors

    def prefill(self, rid: str, src: list[int], mode: str) -> str | None:
        (ticket,) = self.p.call("prefill", items=[[rid, src, mode]])
        assert not isinstance(ticket, dict), ticket
        return ticket  # type: ignore[no-any-return]

    def pull(self, rid: str, ticket: str, dst: list[int], timeout: float = 10.0) -> None:
        errors = self.c.call("pull", items=[[rid, ticket, dst, timeout, self.seed]])
        assert errors == [None], errors

    def result(self, rid: str, timeout: float) -> dict[str, Any]:
        """The consumer's one result for ``rid`` (waits at most ``timeout`` s)."""
        def got() -> dict[str, Any] | None:
            self.ledger.drain_consumer(self.c)
            return self.ledger.results[rid][0] if self.ledger.results.get(rid) else None
        out: dict[str, Any] = wait_for(f"result of {rid}", got, timeout)
        return out

    def release(self, rid: str, timeout: float) -> str:
        """The reason of the producer's release of ``rid`` (waits at most ``timeout`` s)."""
        def got() -> str | None:
            self.ledger.drain_producer(self.p)
            return self.ledger.releases[rid][0] if self.ledger.releases.get(rid) else None
        out: str = wait_for(f"release of {rid}", got, timeout)
        return out

    def no_result(self, rid: str) -> bool:
        self.ledger.drain_consumer(self.c)
        return rid not in self.ledger.results

    def no_release(self, rid: str) -> bool:
        self.ledger.drain_producer(self.p)
        return rid not in self.ledger.releases

    def state(self, rid: str) -> str:
        st: str = self.p.call("state", rid=rid)
        return st

    def wait_state(self, rid: str, want: str, timeout: float = 5.0) -> None:
        wait_for(f"{rid} in state {want}", lambda: self.state(rid) == want, timeout, 0.005)

    def stats(self, node: Node) -> dict[str, int]:
        st: dict[str, int] = node.call("stats")
        return st

    def big(self, mode: str, tag: str, timeout: float = 15.0, blocks: int = 512) -> str:
        """Start a transfer of ``blocks`` blocks (512: 4 MiB, ~1.4 s) over the shaped link;
        return once it is mid-way. (A pull must finish inside the producer's lease.)"""
        self.shape()
        rid = self.rid(tag)
        src, dst = BIG_SRC[:blocks], BIG_DST[:blocks]
        if mode == "push":
            self.expect(rid, src, dst, timeout)
            self.prefill(rid, src, "push")
            self.wait_state(rid, "writing")
        else:
            ticket = self.prefill(rid, src, "pull")
            assert ticket is not None
            self.pull(rid, ticket, dst, timeout)
            self.wait_state(rid, "pulling")
        rx = self.link.rx_bytes()
        wait_for("bytes flowing on the veth", lambda: self.link.rx_bytes() > rx + 64 * 1024,
                 5.0, every=0.01)
        assert self.no_result(rid), \
            f"the transfer was meant to be still running: {self.ledger.results[rid]}"
        return rid

    def start_short(self, mode: str, rid: str, deadline: float = 0.6) -> None:
        """Start a BIG transfer over the shaped link whose consumer deadline (``deadline``)
        passes mid-transfer; return 0.2 s into it."""
        self.shape()
        if mode == "push":
            self.expect(rid, BIG_SRC, BIG_DST, timeout=deadline)
            self.prefill(rid, BIG_SRC, "push")
            self.wait_state(rid, "writing")
        else:
            ticket = self.prefill(rid, BIG_SRC, "pull")
            assert ticket is not None
            self.pull(rid, ticket, BIG_DST, timeout=deadline)
            self.wait_state(rid, "pulling")
        time.sleep(0.2)

    def pull_beside_busy(self, rid: str, ticket: str | None, dst: list[int]) -> dict[str, Any]:
        """Pull ``rid`` while another pull keeps the producer progressing, and return its
        result. Over TCP a READ is served only while the producer polls NIXL, which it does
        only while one of *its* pulls runs; RDMA and shared memory serve a READ without the
        producer, and this makes TCP behave the same for a READ the producer does not
        expect."""
        assert ticket is not None
        busy = self.rid("busy")
        busy_ticket = self.prefill(busy, BIG_SRC, "pull")
        errors = self.c.call("pull", items=[[busy, busy_ticket, BIG_DST, 10.0, self.seed],
                                            [rid, ticket, dst, 10.0, self.seed]])
        assert errors == [None, None], errors
        res = self.result(busy, 10.0)
        assert (res["state"], res["corrupted"]) == ("ready", 0), res
        assert self.release(busy, 5.0) == "transferred"
        return self.result(rid, 10.0)

    def smoke(self, tag: str = "smoke") -> None:
        """A push and a pull, every byte checked: the pair serves requests again."""
        rid = self.rid(f"{tag}-push")
        self.expect(rid, [5, 9, 10], [1, 2, 3])
        self.prefill(rid, [5, 9, 10], "push")
        res = self.result(rid, 10.0)
        # a failure shows the kernel's view of every connection (retransmissions, backoff)
        assert (res["state"], res["corrupted"]) == ("ready", 0), \
            f"{res}\n{self.link.sockets()}"
        assert self.release(rid, 5.0) == "transferred"
        rid = self.rid(f"{tag}-pull")
        ticket = self.prefill(rid, [20, 21], "pull")
        assert ticket is not None
        self.pull(rid, ticket, [30, 31])
        res = self.result(rid, 10.0)
        assert (res["state"], res["corrupted"]) == ("ready", 0), \
            f"{res}\n{self.link.sockets()}"
        assert self.release(rid, 5.0) == "transferred"

    def settle(self) -> None:
        """After a cell: nothing pending on a live side, nothing reported or released twice,
        one kvpush thread per live node."""
        for node in (self.producer, self.consumer):
            if node is None or not node.alive() or node.stopped:
                continue
            wait_for(f"{node.label} idle", lambda n=node: self.stats(n)["pending"] == 0, 10.0,
                     0.05)
            threads = [t for t in node.call("info")["threads"] if t.startswith("kvpush-")]
            assert threads == [f"{node.name}-loop"], threads
        if self.producer is not None and self.producer.alive():
            self.ledger.drain_producer(self.producer)
        if self.consumer is not None and self.consumer.alive():
            self.ledger.drain_consumer(self.consumer)
        assert not self.ledger.repeated(), self.ledger.repeated()


@pytest.fixture(scope="module")
def link() -> Iterator[Link]:
    reason = netns_unavailable()
    if reason is not None:
        pytest.skip(f"no network namespaces here: {reason}")
    with Link() as made:
        yield made
    names = {made.a_ns, made.b_ns}
    import subprocess
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                          timeout=10).stdout
    assert not any(n in left for n in names), f"namespaces left behind: {left}"


@pytest.fixture(scope="module")
def pair(link: Link) -> Iterator[Pair]:
    made = Pair(link)
    try:
        yield made
    finally:
        made.close()


@pytest.fixture()
def fx(pair: Pair) -> Iterator[Pair]:
    pair.heal()
    yield pair
    pair.settle()


def dead_gone_from_consumer(pair: Pair, name: str) -> None:
    """The consumer forgot a producer: not listed, no NIXL metadata or descriptor lists."""
    wait_for("producer forgotten", lambda: name not in pair.c.call("producers"), DETECT)
    assert name not in pair.c.call("nixl_peers")


def dead_gone_from_producer(pair: Pair, name: str, lost_before: int) -> None:
    wait_for("consumer counted lost", lambda: pair.stats(pair.p)["peers_lost"] > lost_before,
             DETECT)
    assert name not in pair.p.call("nixl_peers")


MODES = ["push", "pull"]
#: how a consumer reports a request whose producer died or became unreachable
LOST_ERRORS = ("PeerUnavailable", "TransferFailed")


# -- the transport: UCX really crosses the veth ----------------------------------------------
def test_bytes_cross_the_veth(fx: Pair) -> None:
    """UCX_TLS=tcp,self: a 4 MiB push and pull show up as at least 4 MiB each on the veth."""
    for mode in MODES:
        rx = fx.link.rx_bytes()
        rid = fx.rid(f"veth-{mode}")
        if mode == "push":
            fx.expect(rid, BIG_SRC, BIG_DST)
            fx.prefill(rid, BIG_SRC, "push")
        else:
            ticket = fx.prefill(rid, BIG_SRC, "pull")
            assert ticket is not None
            fx.pull(rid, ticket, BIG_DST)
        res = fx.result(rid, 10.0)
        assert (res["state"], res["corrupted"]) == ("ready", 0), res
        assert fx.link.rx_bytes() - rx >= len(BIG_SRC) * 8192
        assert fx.release(rid, 5.0) == "transferred"


# -- a peer killed mid-transfer --------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_producer_killed_mid_transfer(fx: Pair, mode: str) -> None:
    rid = fx.big(mode, "pkill")
    name = fx.p.name
    t0 = time.monotonic()
    fx.p.kill()
    res = fx.result(rid, DETECT)
    # PeerUnavailable once the heartbeats stop; a READ may fail first (connection reset)
    assert res["state"] == "failed" and res["error"] in LOST_ERRORS, res
    assert time.monotonic() - t0 < DETECT
    dead_gone_from_consumer(fx, name)


@pytest.mark.parametrize("mode", MODES)
def test_consumer_killed_mid_transfer(fx: Pair, mode: str) -> None:
    lost = fx.stats(fx.p)["peers_lost"]
    rid = fx.big(mode, "ckill")
    name = fx.c.name
    t0 = time.monotonic()
    fx.c.kill()
    if mode == "push":  # the WRITE fails (or is cancelled when the peer is declared lost)
        assert fx.release(rid, DETECT) == "failed"
        assert time.monotonic() - t0 < DETECT
    else:  # the puller is declared lost; its blocks stay held until its READ's hold ends
        assert fx.release(rid, READ_HOLD) == "failed"
    dead_gone_from_producer(fx, name, lost)


def test_pull_source_held_until_a_lost_pullers_hold_ends(fx: Pair) -> None:
    """A silent puller may only be stalled (released at once, a consumer that resumes would
    finish its READ over reused blocks and report READY): its blocks stay held until the
    hold its PullHeld promised is over, then are released once."""
    rid = fx.big("pull", "ckill-prompt")
    t0 = time.monotonic()
    fx.c.kill()
    wait_for("puller counted lost", lambda: fx.stats(fx.p)["peers_lost"] > 0, DETECT)
    assert fx.no_release(rid), "released while its READ could still run"
    assert fx.release(rid, READ_HOLD) == "failed"
    assert time.monotonic() - t0 > PRODUCER["transfer_timeout_s"] - 2.0


def test_read_error_does_not_kill_the_consumer(fx: Pair) -> None:
    """UCX error mode ``peer`` makes a READ from a killed producer end in error at once (in
    mode ``none`` it waits for the heartbeat timeout, but a READ can end in error there too:
    the soak saw it after a producer crash)."""
    peer_mode = {"transport": {"ucx_error_mode": "peer"}}
    for node in (fx.producer, fx.consumer):
        if node is not None:
            node.close()
    fx.producer = fx.start_producer(**peer_mode)
    fx.consumer = fx.start_consumer(**peer_mode)
    fx.connect()
    try:
        rid = fx.big("pull", "readerr")
        fx.p.kill()
        res = fx.result(rid, DETECT)
        assert res["state"] == "failed", res
        time.sleep(0.3)
        assert f"{fx.c.name}-loop" in fx.c.call("info")["threads"], "consumer loop died"
    finally:  # the next cell gets fresh nodes in the default mode
        fx.c.kill()
        fx.p.kill()


# -- a WRITE / READ posted toward a peer that was just killed (UCX error mode none) ----------
@pytest.mark.parametrize("mode", MODES)
def test_post_toward_killed_peer_fails_fast(fx: Pair, mode: str) -> None:
    """Neither hangs nor crashes the survivor: NIXL refuses the post at once
    (nixlRemoteDisconnectError), kvpush fails the request, the survivor serves others."""
    rid = fx.rid(f"deadpost-{mode}")
    if mode == "push":  # registration in, consumer killed, then prefill triggers the WRITE
        lost = fx.stats(fx.p)["peers_lost"]
        fx.expect(rid, [1, 2, 3], [4, 5, 6])
        fx.wait_state(rid, "registered")
        fx.c.kill()
        t0 = time.monotonic()
        fx.prefill(rid, [1, 2, 3], "push")
        assert fx.release(rid, 2.0) == "failed"
        assert time.monotonic() - t0 < 1.0
        assert fx.stats(fx.p)["peers_lost"] == lost + 1  # the failed post dropped it at once
    else:  # ticket issued, producer killed, then the consumer READs
        ticket = fx.prefill(rid, [1, 2, 3], "pull")
        assert ticket is not None
        fx.p.kill()
        t0 = time.monotonic()
        fx.pull(rid, ticket, [4, 5, 6])
        res = fx.result(rid, 2.0)
        assert res["state"] == "failed" and res["error"] == "PeerUnavailable", res
        assert time.monotonic() - t0 < 1.0
        assert fx.c.alive()


# -- one of the two rendezvous events never comes --------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_registration_never_arrives(fx: Pair, mode: str) -> None:
    """push: no Register; pull: the ticket is never used. The lease releases the source."""
    rid = fx.rid(f"noreg-{mode}")
    t0 = time.monotonic()
    ticket = fx.prefill(rid, [7, 8], mode)
    assert fx.release(rid, PRODUCER["lease_s"] + 1.5) == "lease_expired"
    assert time.monotonic() - t0 >= PRODUCER["lease_s"] - 0.1
    # What comes late fails fast, and moves nothing.
    if mode == "push":
        fx.expect(rid, [7, 8], [40, 41])
    else:
        assert ticket is not None
        fx.pull(rid, ticket, [40, 41])
    res = fx.result(rid, 3.0)
    assert res["state"] == "timed_out" and res["error"] == "TransferTimeout", res
    assert fx.c.call("canary_intact", dst=[40, 41])


def test_prefill_never_arrives(fx: Pair) -> None:
    """push: the registration's deadline ends it on both sides; a late prefill_done gets its
    blocks back at once. (pull has no such cell: without prefill_done there is no ticket.)"""
    rid = fx.rid("noprefill")
    t0 = time.monotonic()
    fx.expect(rid, [1, 2], [3, 4], timeout=0.5)
    res = fx.result(rid, 3.0)
    assert res["state"] == "timed_out", res
    assert time.monotonic() - t0 < 2.0
    fx.wait_state(rid, "none")
    fx.prefill(rid, [1, 2], "push")
    assert fx.release(rid, 1.0) == "aborted"


# -- aborts at every protocol step, from either side -----------------------------------------

ABORTS = [
    ("producer", "push", "before_anything"),
    ("producer", "push", "registered"),
    ("producer", "push", "held"),
    ("producer", "push", "writing"),
    ("producer", "push", "done"),
    ("producer", "pull", "before_anything"),
    ("producer", "pull", "held"),
    ("producer", "pull", "pulling"),
    ("producer", "pull", "done"),
    ("consumer", "push", "before_anything"),
    ("consumer", "push", "registered"),
    ("consumer", "push", "writing"),
    ("consumer", "push", "done"),
    ("consumer", "pull", "pulling"),
    ("consumer", "pull", "done"),
]


@pytest.mark.parametrize(("side", "mode", "step"), ABORTS)
def test_abort(fx: Pair, side: str, mode: str, step: str) -> None:
    rid = fx.rid(f"abort-{side}-{mode}-{step}")
    src, dst = [11, 12], [13, 14]
    ticket: str | None = None
    ender = fx.p if side == "producer" else fx.c

    def abort() -> None:
        ender.call("abort", rids=[rid])

    if step == "before_anything":
        abort()
        if side == "consumer":  # the consumer knows nothing of it yet: a no-op
            fx.expect(rid, src, dst)
            fx.prefill(rid, src, mode)
            assert fx.result(rid, 5.0)["state"] == "ready"
            assert fx.release(rid, 2.0) == "transferred"
            return
        t0 = time.monotonic()
        ticket = fx.prefill(rid, src, mode)
        if mode == "push":
            assert fx.release(rid, 1.0) == "aborted"  # at once, not after a lease
            assert time.monotonic() - t0 < 1.0
            fx.expect(rid, src, dst)
            res = fx.result(rid, 3.0)
        else:
            # The ticket is out: the blocks stay until no READ can touch them; the router
            # relays the ticket anyway, and the pull must not succeed, even when its READ
            # finishes before the producer's answer (READY waits for PullHeld).
            res = fx.pull_beside_busy(rid, ticket, dst)
            assert fx.release(rid, PULL_HOLD + 1.5) == "aborted"
        assert res["state"] in ("aborted", "failed", "timed_out"), res
        return

    if step == "registered":
        fx.expect(rid, src, dst)
        fx.wait_state(rid, "registered")
        abort()
        assert fx.result(rid, 3.0)["state"] == "aborted"
        fx.wait_state(rid, "none")
        fx.prefill(rid, src, "push")  # prefill ends late: the blocks go back at once
        assert fx.release(rid, 1.0) == "aborted"
        return

    if step == "held":
        ticket = fx.prefill(rid, src, mode)
        fx.wait_state(rid, f"held-{mode}")
        abort()
        # push: at once; pull: a ticket is out, so at the end of its lease
        assert fx.release(rid, 1.0 if mode == "push" else PULL_HOLD + 1.5) == "aborted"
        if mode == "push":  # a registration after the abort fails at once
            fx.expect(rid, src, dst)
            assert fx.result(rid, 3.0)["state"] == "aborted"
        return

    if step in ("writing", "pulling"):
        rid = fx.big(mode, f"abort-{side}-{step}")
        t0 = time.monotonic()
        ender.call("abort", rids=[rid])
        res = fx.result(rid, DETECT)
        assert res["state"] == "aborted", res
        assert fx.release(rid, DETECT) == "aborted"
        assert time.monotonic() - t0 < DETECT
        return

    assert step == "done"
    if mode == "push":
        fx.expect(rid, src, dst)
        fx.prefill(rid, src, "push")
    else:
        ticket = fx.prefill(rid, src, "pull")
        assert ticket is not None
        fx.pull(rid, ticket, dst)
    assert fx.result(rid, 5.0)["state"] == "ready"
    assert fx.release(rid, 2.0) == "transferred"
    abort()  # too late: nothing changes, nothing is released or reported twice
    time.sleep(0.3)
    assert fx.no_release(rid) is False and len(fx.ledger.releases[rid]) == 1
    assert len(fx.ledger.results[rid]) == 1


# -- the link cut mid-transfer, then restored ------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_link_cut_mid_transfer(fx: Pair, mode: str) -> None:
    """Cut for longer than the peer timeout: both sides give the request up and forget the
    peer; once the link is back, new requests succeed. (Bytes of the old request can still
    land after the result -- the connection UCX kept is not closed -- see
    test_no_byte_lands_after_the_result and docs/RELIABILITY.md.)"""
    lost = fx.stats(fx.p)["peers_lost"]
    consumer_name, producer_name = fx.c.name, fx.p.name
    rid = fx.big(mode, "cut")
    t0 = time.monotonic()
    fx.cut_link()
    res = fx.result(rid, DETECT)
    assert res["state"] == "failed" and res["error"] in LOST_ERRORS, res
    dead_gone_from_consumer(fx, producer_name)
    if mode == "push":  # the WRITE over the cut link is left to its deadline
        assert fx.release(rid, WRITE_HOLD) == "failed"
    dead_gone_from_producer(fx, consumer_name, lost)
    assert time.monotonic() - t0 < WRITE_HOLD + DETECT
    fx.restore_link()
    fx.link.unshape()
    fx.shaped = False
    wait_for("reconnect", fx._try_connect, 10.0, every=0.2)
    fx.smoke("after-cut")
    if mode == "pull":  # released when the puller was declared lost
        assert fx.release(rid, PULL_HOLD + 1.5) == "failed"


def sockets(node: Node) -> int:
    """Open sockets of a node's process."""
    count = 0
    for fd in os.listdir(f"/proc/{node.pid}/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/{node.pid}/fd/{fd}").startswith("socket:")
    return count


def control_connections(fx: Pair) -> int:
    """Kernel TCP sockets in the producer's namespace on its ZeroMQ port, any state but
    orphaned FIN-WAIT ones (a closed connection whose FIN waits for a dead link)."""
    port = fx.p.address.rsplit(":", 1)[1]
    out = subprocess.run(["ip", "netns", "exec", fx.link.a_ns, "ss", "-tn", "-H", "state",
                          "established", f"( sport = :{port} )"], capture_output=True,
                         text=True, timeout=10).stdout
    return len([line for line in out.splitlines() if line.strip()])


def cut_and_reconnect_twice(fx: Pair) -> None:
    for i in range(2):
        fx.cut_link()
        wait_for("consumer drops producer", lambda: fx.p.name not in fx.c.call("producers"),
                 DETECT)
        time.sleep(0.5)  # the producer drops the consumer too
        fx.restore_link()
        wait_for("reconnect", fx._try_connect, 10.0, every=0.2)
        fx.smoke(f"leak-{i}")


def test_control_connection_of_a_vanished_consumer_is_closed(fx: Pair) -> None:
    """The consumer's host vanishes behind a cut (its FIN never arrives): the producer's end
    of the control connection must not stay open for ever. TCP keepalive closes it once the
    peer has been silent for peer_timeout_s + 3 probes (the ZeroMQ side of a cut's leak)."""
    fx.smoke("before-vanish")
    assert control_connections(fx) >= 1  # the consumer's (earlier cells may leave more)
    fx.cut_link()
    fx.c.kill()
    wait_for("half-open control connection closed", lambda: control_connections(fx) == 0,
             PEER_TIMEOUT + 3 + 3.0, every=0.1)


def test_link_cut_leaves_no_sockets_behind(fx: Pair) -> None:
    """The UCX side of a cut's leak: NIXL's remove_remote_agent would leave each cut's UCX
    TCP connection open (one socket per side per cut). The agent keeps a dropped peer's
    endpoint, and the same peer back after the cut gets it again: nothing new is opened,
    nothing leaks. A leak adds a socket per side per cut; a socket an earlier cell left
    (the half-open UCX connection of a peer it killed) may close meanwhile, so fewer is
    no leak (seen in a fresh-clone CI run: the producer's 7 sockets became 6)."""
    fx.smoke("before-leak")
    before = (sockets(fx.p), sockets(fx.c))
    cut_and_reconnect_twice(fx)
    time.sleep(PEER_TIMEOUT + 0.5)  # ZeroMQ closes the half-open control connections
    after = (sockets(fx.p), sockets(fx.c))
    assert after[0] <= before[0] and after[1] <= before[1], \
        f"sockets (producer, consumer): {before} -> {after}\n{fx.link.sockets()}"


#: Over UCX/TCP a READ cut off by a short link outage sometimes does not resume once the link
#: is back (seen in loaded full-suite runs; NIXL/UCX, not understood yet). kvpush then does the
#: safe thing -- the READ is abandoned and the result says ``blocks_safe=False`` (or, within
#: a deadline, TIMED_OUT) -- but a cell that needs the READ to resume fails.
READ_RESUME = pytest.mark.xfail(
    strict=False, reason="intermittent: a READ across a short cut over UCX/TCP sometimes does "
    "not resume after the link is back; kvpush then reports it not READY, with "
    "blocks_safe=False once it gave the READ up (never wrongly READY or safe)")


@pytest.mark.parametrize("mode", [
    "push",
    pytest.param("pull", marks=READ_RESUME),
])
def test_link_flap_shorter_than_peer_timeout(fx: Pair, mode: str) -> None:
    """A cut shorter than the peer timeout only delays the transfer."""
    rid = fx.big(mode, "flap", blocks=256)
    fx.cut_link()
    time.sleep(PEER_TIMEOUT / 4)
    fx.restore_link()
    res = fx.result(rid, 15.0)
    assert (res["state"], res["corrupted"]) == ("ready", 0), (res, fx.link.sockets())
    assert fx.release(rid, 5.0) == "transferred"
    assert fx.p.name in fx.c.call("producers")


@pytest.mark.parametrize("mode", ["push", pytest.param("pull", marks=READ_RESUME)])
def test_no_byte_lands_after_the_result(fx: Pair, mode: str) -> None:
    """The request times out during a cut shorter than the peer timeout (and than
    ``abort_grace_s``). push: the consumer's Abort waits for the link, the producer lets its
    WRITE finish (no cancel: NIXL's release does not stop the bytes) and acknowledges, and
    the consumer waits for the WRITE's Landed notification, which travels behind its bytes;
    pull: the consumer polls its READ to its end. Either way the result comes once the link
    is back and says the blocks are safe; nothing may land in them after that, once the
    consumer progresses NIXL again (cancelling a transfer is no fence)."""
    rid = fx.rid(f"late-{mode}")
    fx.start_short(mode, rid)
    fx.cut_link()
    time.sleep(PEER_TIMEOUT / 2)
    assert fx.no_result(rid), "a result came while the transfer could still land"
    fx.link.unshape()  # the rest of the transfer at full speed, well inside abort_grace_s
    fx.shaped = False
    fx.restore_link()
    res = fx.result(rid, 3.0)
    assert (res["state"], res["safe"]) == ("timed_out", True), (res, fx.stats(fx.c))
    fx.c.call("rescrub", dst=BIG_DST)
    # The transfer may have ended before the producer saw the consumer's Abort.
    assert fx.release(rid, 3.0) in ("aborted", "transferred")
    fx.smoke("after-late")  # the consumer progresses NIXL again
    time.sleep(0.3)
    assert fx.c.call("canary_intact", dst=BIG_DST), "bytes landed after the result"


@pytest.mark.parametrize("mode", MODES)
def test_unfenced_result_says_blocks_unsafe(fx: Pair, mode: str) -> None:
    """The link stays cut past ``abort_grace_s``: the consumer cannot learn that the
    transfer ended, so it reports the request with ``blocks_safe=False`` within the grace
    (instead of waiting forever or claiming the blocks are free). The producer side ends the
    request too, and new requests succeed once the link is back."""
    rid = fx.rid(f"unfenced-{mode}")
    fx.start_short(mode, rid)
    t0 = time.monotonic()
    fx.cut_link()
    res = fx.result(rid, DETECT)
    assert res["state"] in ("timed_out", "failed") and res["safe"] is False, res
    assert time.monotonic() - t0 < 0.6 + CONSUMER["abort_grace_s"] + 1.0
    assert fx.stats(fx.c)["results_unsafe"] >= 1
    fx.restore_link()
    fx.link.unshape()
    fx.shaped = False
    wait_for("reconnect", fx._try_connect, 10.0, every=0.2)
    fx.smoke("after-unfenced")
    assert fx.release(rid, PULL_HOLD + DETECT) in ("failed", "aborted", "transferred")


# -- a slow consumer: the whole process frozen (SIGSTOP) then resumed ------------------------
@pytest.mark.parametrize("mode", MODES)
def test_consumer_stalled_briefly(fx: Pair, mode: str) -> None:
    rid = fx.big(mode, "stall", blocks=256)
    fx.c.stop()
    time.sleep(PEER_TIMEOUT / 3)
    fx.c.cont()
    res = fx.result(rid, 15.0)
    assert (res["state"], res["corrupted"]) == ("ready", 0), res
    assert fx.release(rid, 5.0) == "transferred"


@pytest.mark.parametrize("mode", MODES)
def test_consumer_stalled_past_peer_timeout(fx: Pair, mode: str) -> None:
    lost = fx.stats(fx.p)["peers_lost"]
    name = fx.c.name
    rid = fx.big(mode, "freeze")
    t0 = time.monotonic()
    fx.c.stop()
    if mode == "push":  # the WRITE to the frozen consumer is left to its deadline
        assert fx.release(rid, WRITE_HOLD) == "failed"
    dead_gone_from_producer(fx, name, lost)
    assert time.monotonic() - t0 < WRITE_HOLD + 0.5
    fx.c.cont()
    res = fx.result(rid, 3.0)  # on waking, the consumer finds its producer silent too
    # ... or, pull, finds its READ done first: the producer, whose NIXL keeps a dropped
    # peer's endpoint (see test_agent_dropped_peers), served it from the source it still
    # holds, inside the hold its PullHeld promised; then the bytes must be exact.
    ready = mode == "pull" and res["state"] == "ready"
    assert ready or res["state"] in ("failed", "timed_out"), str(res)
    if ready:
        assert res["corrupted"] == 0 and res["safe"], str(res)
    # The link at full speed first: a READ the frozen consumer left in flight goes on once
    # it wakes, and on the shaped link it would hold the new session's HelloAck for most
    # of the peer timeout (the producer counts the session's silence from that answer).
    fx.link.unshape()
    fx.shaped = False
    wait_for("reconnect", fx._try_connect, 10.0, every=0.2)
    fx.smoke("after-freeze")
    if mode == "pull":
        # Released when the puller was declared lost, or when its READ ended: on waking, the
        # consumer's loop may declare its producer lost (and fail the pull) before it polls
        # NIXL, whose progress then still completes the READ the producer's kept endpoint
        # served and delivers its PullDone: TRANSFERRED with the consumer's result FAILED
        # (seen once in a fresh-clone CI run). Released exactly once either way.
        assert fx.release(rid, PULL_HOLD + 1.5) in ("failed", "transferred")


# -- a peer restarted under the same name ----------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_producer_restarted_same_name(fx: Pair, mode: str) -> None:
    """Killed mid-transfer, back on the same port under the same name (with other bytes):
    the consumer fails the old request, drops the old incarnation, and serves requests from
    the new one."""
    old = fx.p
    rid = fx.big(mode, "prestart")
    old.kill()
    old.close()  # reaped already: removes its log
    port = int(old.address.rsplit(":", 1)[1])
    fx.producer = fx.start_producer(name=old.name, port=port)
    res = fx.result(rid, DETECT)
    assert res["state"] == "failed" and res["error"] in LOST_ERRORS, res
    fx.link.unshape()
    fx.shaped = False
    wait_for("reconnect", fx._try_connect, 10.0, every=0.2)
    assert fx.c.call("producers") == [old.name]
    fx.smoke("after-prestart")  # the bytes checked are the new incarnation's (new seed)


@pytest.mark.parametrize("mode", MODES)
def test_consumer_restarted_same_name(fx: Pair, mode: str) -> None:
    lost = fx.stats(fx.p)["peers_lost"]
    old = fx.c
    rid = fx.big(mode, "crestart")
    old.kill()
    old.close()  # reaped already: removes its log
    fx.consumer = fx.start_consumer(name=old.name)
    fx.link.unshape()
    fx.shaped = False
    fx.connect()
    assert fx.release(rid, DETECT) == "failed"  # the old incarnation's transfer died with it
    assert fx.stats(fx.p)["peers_lost"] > lost
    assert fx.p.call("nixl_peers") == [old.name]  # the new incarnation only
    fx.smoke("after-crestart")


def test_puller_restarted_after_its_loss_noticed(fx: Pair) -> None:
    """Back under the same name only after the producer dropped it as silent and forgot it:
    its predecessor's pull source is released at the new incarnation's handshake, not left
    held until a silent puller's hold ends (seen in a fresh-clone CI run: a slow restart made
    the test above wait for the hold). (A WRITE to a killed consumer fails at once.)"""
    lost = fx.stats(fx.p)["peers_lost"]
    old = fx.c
    rid = fx.big("pull", "crestart-late")
    old.kill()
    old.close()
    wait_for("the old incarnation dropped as silent",
             lambda: fx.stats(fx.p)["peers_lost"] > lost, DETECT)
    assert fx.no_release(rid)  # a silent puller's READ: held
    fx.consumer = fx.start_consumer(name=old.name)
    fx.link.unshape()
    fx.shaped = False
    fx.connect()
    assert fx.release(rid, 1.0) == "failed"  # at the handshake, well inside the hold
    fx.smoke("after-crestart-late")


def test_producer_restarted_elsewhere_before_loss_noticed(fx: Pair) -> None:
    old = fx.p
    new = fx.start_producer(name=old.name)  # e.g. rescheduled on another port
    try:
        old.kill()
        old.close()  # reaped already: removes its log
        fx.producer = new
        name = fx.c.call("connect", address=new.address, timeout=5.0)
        assert name == old.name
    finally:
        fx.producer = new
        wait_for("connected to the new incarnation", fx._try_connect, DETECT + 2.0, every=0.2)
    fx.smoke("after-move")


# -- pull tickets and the producer's clock -----------------------------------------------------
def test_pull_after_lease_expiry_with_clock_skew(fx: Pair) -> None:
    """The consumer's clock lets it start a READ of blocks the producer already released:
    the READ may finish first, but READY waits for the producer's PullHeld, and the producer
    answers Failed (lease_expired) instead."""
    rid = fx.rid("skew")
    ticket = fx.prefill(rid, [50, 51], "pull")
    assert ticket is not None
    assert fx.release(rid, PRODUCER["lease_s"] + 1.5) == "lease_expired"
    # The consumer's clock is behind the producer's by the time that passed.
    skewed = msgspec.structs.replace(PullTicket.from_bytes(base64.b64decode(ticket)),
                                     issued_at=time.time())
    res = fx.pull_beside_busy(rid, base64.b64encode(skewed.to_bytes()).decode(), [52, 53])
    assert res["state"] != "ready", res
