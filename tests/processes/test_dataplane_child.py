"""The contained data plane (``TransportConfig(data_plane="child")``): the NIXL agent runs
in a child process per endpoint, so an abort inside UCX (docs/RELIABILITY.md, "UCX's
Endpoint timeout abort") costs that endpoint's requests and a restart, never the engine's
process.

Real Producer and Consumer in this process (the "engine"), each with a real data-plane
child running a real NIXL agent; UCX over TCP loopback only, so a transfer cannot finish
while the child on its target side is stopped (SIGSTOP): that holds it in flight for the
SIGKILL. Every child a test starts is stopped by the endpoint's close (checked by pid).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import numpy as np
import pytest

import kvpush
from kvpush import RequestState, TransferMode
from tests.support import ROOT
from tests.support.harness import check_blocks, fill, make_cache

CHILD = kvpush.TransportConfig(data_plane="child")
#: 32 blocks of 2 x 64 KiB: 4 MiB per request, more than loopback's socket buffers take
#: while the target side does not progress
CACHE = dict(num_blocks=48, tokens_per_block=16, head_size=512, shared=True)
SEED = 11


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait(cond, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@pytest.fixture()
def pair(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[kvpush.Producer, kvpush.Consumer,
                                                            object, object]]:
    monkeypatch.setenv("UCX_TLS", "tcp,self")  # the children inherit it
    pc, cc = make_cache(**CACHE), make_cache(**CACHE)
    fill(pc, SEED)
    p = kvpush.Producer(pc.layout, kvpush.ProducerConfig(
        host="127.0.0.1", transport=CHILD, lease_s=10.0, peer_timeout_s=3.0,
        transfer_timeout_s=3.0))
    c = kvpush.Consumer(cc.layout, kvpush.ConsumerConfig(
        transport=CHILD, peer_timeout_s=3.0, request_timeout_s=6.0, connect_timeout_s=20.0))
    pids = []
    try:
        c.connect(p.address, timeout=20.0)
        yield p, c, pc, cc
        pids = [x._agent.pid for x in (p, c)]
    finally:
        for x in (p, c):
            pid = x._agent.pid
            if pid is not None and _alive(pid):
                try:  # never leave one stopped
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        c.close()
        p.close()
    for pid in pids:
        assert pid is not None and not _alive(pid), "data-plane child left running"


def _one(p: kvpush.Producer, c: kvpush.Consumer, mode: TransferMode, rid: str,
         src: list[int], dst: list[int], timeout: float) -> kvpush.TransferHandle:
    if mode is TransferMode.PUSH:
        h = c.expect(rid, dst, p.name, timeout=timeout)
        p.prefill_done(rid, src)
        return h
    ticket = p.prefill_done(rid, src, TransferMode.PULL)
    assert ticket is not None
    return c.pull(ticket, dst, timeout=timeout)


@pytest.mark.parametrize("killed", ["producer", "consumer"])
@pytest.mark.parametrize("mode", [TransferMode.PUSH, TransferMode.PULL])
def test_sigkill_of_the_data_plane_mid_transfer(pair, mode: TransferMode,  # type: ignore[no-untyped-def]
                                                killed: str) -> None:
    p, c, _, cc = pair
    src, dst = list(range(32)), list(range(8, 40))
    # Warm: one request of the same size goes through.
    h = _one(p, c, mode, "warm", src, dst, 10.0)
    assert h.wait(15.0).state is RequestState.READY
    check_blocks(cc, np.array(dst), np.array(src), SEED)

    poster = p if mode is TransferMode.PUSH else c
    target = c if mode is TransferMode.PUSH else p
    victim = p if killed == "producer" else c
    os.kill(target._agent.pid, signal.SIGSTOP)  # the transfer cannot finish now
    posted = poster.stats()["transfers_posted"]
    timeout = 8.0
    began = time.monotonic()
    h = _one(p, c, mode, "hit", src, dst, timeout)
    _wait(lambda: poster.stats()["transfers_posted"] > posted, 5.0, "the transfer's post")
    time.sleep(0.2)
    assert not h.done(), "the transfer finished with its target stopped"
    old = victim._agent.pid
    os.kill(old, signal.SIGKILL)
    if target is not victim:
        time.sleep(0.3)
        os.kill(target._agent.pid, signal.SIGCONT)
    result = h.wait(timeout + 5.0)
    took = time.monotonic() - began
    # The engine (this process) is alive, the request failed within its deadline, and
    # a transfer that could not be fenced says so.
    assert result.state is RequestState.FAILED, result
    assert took < timeout, took
    # The request fails as the loss is handled; the new child starts right after.
    _wait(lambda: victim._agent.pid not in (None, old) and victim._agent.lost is None, 30.0,
          "the data plane's restart")
    assert victim.stats()["data_plane_restarts"] == 1
    assert _alive(victim._agent.pid) and not _alive(old)
    # The producer released the request's source.
    _wait(lambda: p.pending == 0, 10.0, "the source's release")
    # Both sides handshake again by themselves; the next requests succeed, every byte.
    _wait(lambda: c.stats()["peers_lost"] >= 1 and p.name in c.producers(), 20.0,
          "the new handshake")
    for i in range(3):
        dst2 = list(range(40 - 32 + i, 40 + i)) if i else dst
        for buf in cc.buffers:
            buf[dst2] = 0
        h = _one(p, c, mode, f"after{i}", src, dst2, 10.0)
        got = h.wait(15.0)
        assert got.state is RequestState.READY, got
        assert got.blocks_safe
        check_blocks(cc, np.array(dst2), np.array(src), SEED)
    # The other side's data plane may have died too: UCX aborts a worker that meets a
    # connection its peer reset with an operation outstanding (pull, consumer killed: the
    # producer's child logs "ucp_request.inl:356 Fatal: unexpected error: Connection reset
    # by remote peer", the abort an in-process agent brings down the engine with). Contained,
    # that is one more restart.
    other = c if victim is p else p
    assert other.stats()["data_plane_restarts"] <= 1


def test_contained_mode_refuses_memory_it_cannot_share() -> None:
    plain = make_cache()  # ordinary numpy memory
    with pytest.raises(ValueError, match="shared_array"):
        kvpush.Producer(plain.layout, kvpush.ProducerConfig(transport=CHILD))
    with pytest.raises(ValueError, match="data_plane must be one of"):
        kvpush.TransportConfig(data_plane="thread")
    # GPU memory (CUDA IPC) is refused with its own reason (a fake VRAM region: no GPU
    # here, and the refusal comes before anything touches it).
    region = kvpush.Region(plain.layout.regions[0].addr, plain.layout.regions[0].length, 0,
                           kvpush.MemoryKind.VRAM)
    vram = plain.layout.__class__(**{**plain.layout.__dict__,
                                     "regions": (region,) * plain.layout.num_regions})
    with pytest.raises(ValueError, match="CUDA IPC"):
        kvpush.Consumer(vram, kvpush.ConsumerConfig(transport=CHILD))


def test_shared_allocators() -> None:
    a = kvpush.shared_array((4, 3), np.float32)
    assert a.shape == (4, 3) and a.dtype == np.float32 and not a.any()
    a[:] = 1.5
    torch = pytest.importorskip("torch")
    t = kvpush.shared_tensor((2, 5), torch.float16)
    assert tuple(t.shape) == (2, 5) and t.dtype == torch.float16
    t += 1
    assert float(t.sum()) == 10.0


@pytest.mark.xfail(strict=True, reason="RELIABILITY.md, UCX's abort: UCX aborts a worker that "
                   "meets a connection its peer reset under an outstanding READ; in process, "
                   "that is the engine")
def test_inprocess_producer_survives_a_reader_killed_mid_read(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The same sequence as ``[PULL-consumer]`` above, against an in-process producer (its
    own process, as an engine): frozen while a consumer READs from it, the reader killed,
    the producer thawed. In process, UCX's ``Fatal: unexpected error: Connection reset by
    remote peer`` aborts the producer's whole process (every run here); contained, the
    same abort costs a data-plane child (the test above)."""
    from tests.support.harness import ChildProducer

    monkeypatch.setenv("UCX_TLS", "tcp,self")
    kw = {k: v for k, v in CACHE.items() if k != "shared"}
    producer = ChildProducer(seed=SEED, cache=kw, host="127.0.0.1", lease_s=10.0)
    cc = make_cache(**CACHE)
    c = kvpush.Consumer(cc.layout, kvpush.ConsumerConfig(transport=CHILD, peer_timeout_s=3.0))
    try:
        name = c.connect(producer.address, timeout=20.0)
        src, dst = list(range(32)), list(range(8, 40))
        ticket = producer.call("prefill_done", ("warm", src, "pull"))
        assert c.pull(ticket, dst, timeout=10.0).wait(15.0).state is RequestState.READY
        ticket = producer.call("prefill_done", ("hit", src, "pull"))
        os.kill(producer.process.pid, signal.SIGSTOP)
        posted = c.stats()["transfers_posted"]
        h = c.pull(ticket, dst, timeout=8.0)
        _wait(lambda: c.stats()["transfers_posted"] > posted, 5.0, "the READ's post")
        time.sleep(0.2)
        os.kill(c._agent.pid, signal.SIGKILL)
        time.sleep(0.3)
        os.kill(producer.process.pid, signal.SIGCONT)
        assert h.wait(15.0).state is RequestState.FAILED
        time.sleep(2.0)  # the producer progresses its worker on its next poll
        assert producer.process.is_alive(), \
            f"the producer's process died (exit {producer.process.exitcode})"
        assert name
    finally:
        if producer.process.is_alive():
            os.kill(producer.process.pid, signal.SIGCONT)
        c.close()
        producer.close()


def test_other_agent_methods_run_in_the_child() -> None:
    """A public Agent method ChildAgent does not define itself runs in the child (the
    generic path, exercised here through one it does define); private names never do."""
    from kvpush.agent import Agent
    from kvpush.dataplane import ChildAgent

    cache, other = make_cache(shared=True), make_cache()
    agent = ChildAgent("kvpush-test-generic", cache.layout, CHILD)
    peer = Agent("kvpush-test-generic-peer", other.layout, kvpush.TransportConfig())
    try:
        assert agent.__getattr__("has_peer")("nobody") is False
        assert agent.__getattr__("metadata")() == agent.metadata()
        with pytest.raises(AttributeError):
            agent.__getattr__("_agent")
        with pytest.raises(AttributeError):
            agent.no_such_method  # noqa: B018
        # An answer that cannot cross the channel (a NIXL handle) is an error, not a
        # dead child.
        name = agent.add_peer(peer.metadata(), peer.layout, peer.name)
        idx = np.zeros(1, np.int64)
        with pytest.raises(kvpush.TransferFailed, match="not picklable"):
            agent.__getattr__("post")("WRITE", name, idx, idx, b"")
        assert agent.lost is None and agent.__getattr__("has_peer")(name) is True
    finally:
        pid = agent.pid
        agent.close()
        peer.close()
    assert pid is not None and not _alive(pid)


def test_a_consumer_that_missed_the_rejoin_bye_hears_it_again(pair) -> None:  # type: ignore[no-untyped-def]
    """A producer whose data plane restarted answers a heartbeat on a connection it
    dropped for that with ``Bye(rejoin=True)`` (its first Bye may have been lost)."""
    import zmq

    from kvpush import messages as m
    from kvpush import stream

    p, c, _, _ = pair
    old = c._sessions.conns[p.address].getsockopt(zmq.IDENTITY)
    os.kill(p._agent.pid, signal.SIGKILL)
    _wait(lambda: p.stats()["data_plane_restarts"] == 1 and c.stats()["peers_lost"] >= 1
          and p.name in c.producers(), 30.0, "the restart and the new handshake")
    assert c._sessions.conns[p.address].getsockopt(zmq.IDENTITY) != old
    ctx = stream.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, old)
    try:
        sock.connect(p.address)
        sock.send(m.encode(m.Heartbeat(1)))
        assert sock.poll(10_000), "no answer"
        msg = m.decode(sock.recv())
        assert isinstance(msg, m.Bye) and msg.rejoin, msg
        stranger = ctx.socket(zmq.DEALER)  # a connection it never had: a plain Bye
        stranger.setsockopt(zmq.LINGER, 0)
        stranger.connect(p.address)
        stranger.send(m.encode(m.Heartbeat(1)))
        assert stranger.poll(10_000), "no answer"
        msg = m.decode(stranger.recv())
        assert isinstance(msg, m.Bye) and not msg.rejoin, msg
        stranger.close()
    finally:
        sock.close()
        ctx.term()


def test_the_child_goes_with_the_engine() -> None:
    """An engine process killed outright (SIGKILL: no close) takes its data-plane child
    with it: the child sees its channel close and exits at once."""
    import subprocess
    import sys

    code = ("import kvpush, time\n"
            "from tests.support.harness import make_cache\n"
            "c = make_cache(shared=True)\n"
            "p = kvpush.Producer(c.layout, kvpush.ProducerConfig(host='127.0.0.1', "
            "transport=kvpush.TransportConfig(data_plane='child')))\n"
            "print(p._agent.pid, flush=True)\n"
            "time.sleep(60)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    engine = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, cwd=ROOT,
                              env=env, text=True)
    try:
        line = engine.stdout.readline() if engine.stdout else ""
        child = int(line)
        assert _alive(child)
        engine.kill()
        engine.wait(10)
        _wait(lambda: not _alive(child), 10.0, "the child's exit")
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait(10)
        if engine.stdout:
            engine.stdout.close()
