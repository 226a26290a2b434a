"""``TransportConfig(nixl_api="c")`` (``kvpush._nixlc``: NIXL's C API, every call into NIXL
without the GIL) behaves as NIXL's Python binding does: the same posts land the same bytes
and notifications, by prepared indices and by explicit descriptors, between agents of either
kind and between endpoints of either kind, push and pull; and a post's copy lets the
process's other Python threads run.

Real NIXL agents in this process (UCX over shared memory)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import kvpush
from kvpush import agent as agent_mod
from kvpush.agent import Agent, TransportConfig, XferState
from tests.support.harness import CANARY, check_blocks, check_canaries, fill, make_cache

pytest.importorskip("kvpush._nixlc")

APIS = ("python", "c")
PAIRS = [(a, b) for a in APIS for b in APIS]
SEED = 5


def _wait_done(initiator: Agent, target: Agent, handle: Any) -> XferState:
    deadline = time.monotonic() + 20
    while (state := initiator.state(handle)) is XferState.IN_PROGRESS:
        target.notifications()  # UCX progresses on both sides, as the loop threads do
        if time.monotonic() > deadline:
            raise TimeoutError("transfer still in progress after 20 s")
        time.sleep(1e-4)
    initiator.release(handle)
    return state


def _notes(agent: Agent, want: int) -> list[tuple[str, bytes]]:
    got: list[tuple[str, bytes]] = []
    deadline = time.monotonic() + 20
    while len(got) < want and time.monotonic() < deadline:
        for sender, notes in agent.notifications().items():
            got += [(sender, n) for n in notes]
        time.sleep(1e-4)
    return got


@pytest.fixture()
def agents() -> Iterator[Any]:
    made: list[Agent] = []

    def make(name: str, api: str, cache: Any) -> Agent:
        made.append(Agent(name, cache.layout, TransportConfig(nixl_api=api)))
        return made[-1]

    try:
        yield make
    finally:
        for a in made:
            a.close()


@pytest.mark.parametrize(("initiator_api", "target_api"), PAIRS)
def test_agents_move_the_same_bytes_and_notifications(agents: Any, initiator_api: str,
                                                      target_api: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    nb = 32
    mine, theirs = make_cache(num_blocks=nb), make_cache(num_blocks=nb)
    fill(mine, SEED)
    fill(theirs, SEED + 1)
    init = agents(f"kvpush-capi-i-{initiator_api}{target_api}", initiator_api, mine)
    target = agents(f"kvpush-capi-t-{initiator_api}{target_api}", target_api, theirs)
    peer = init.add_peer(target.metadata(), target.layout, target.name)
    init_name = target.add_peer(init.metadata(), init.layout, init.name)
    assert (peer, init_name) == (target.name, init.name)
    regions = mine.layout.num_regions

    def idx(blocks: np.ndarray) -> np.ndarray:
        return (np.arange(regions)[:, None] * nb + blocks[None, :]).ravel().astype(np.int32)

    # WRITE by prepared indices, with a notification
    src, dst = np.array([3, 4, 9]), np.array([10, 11, 20])
    handle = init.post("WRITE", peer, idx(src), idx(dst), b"w-1")
    assert not init.last_explicit
    assert _wait_done(init, target, handle) is XferState.DONE
    check_blocks(theirs, dst, src, SEED)
    assert _notes(target, 1) == [(init.name, b"w-1")]
    # READ by prepared indices, without one
    src, dst = np.array([0, 1, 30]), np.array([5, 6, 7])
    handle = init.post("READ", peer, idx(dst), idx(src), b"")
    assert _wait_done(init, target, handle) is XferState.DONE
    check_blocks(mine, dst, src, SEED + 1)
    # WRITE of runs as explicit merged descriptors
    monkeypatch.setattr(agent_mod, "EXPLICIT_MIN_INDICES", 1)
    monkeypatch.setattr(agent_mod, "EXPLICIT_MIN_RUN", 2)
    for buf in theirs.buffers:
        buf[:] = CANARY
    src, dst = np.arange(12, 16), np.arange(24, 28)
    runs = np.array([[12, 24, 4]], dtype=np.int64)
    handle = init.post("WRITE", peer, idx(src), idx(dst), b"w-2", runs=runs,
                       regions=(0, regions))
    assert init.last_explicit
    assert _wait_done(init, target, handle) is XferState.DONE
    check_blocks(theirs, dst, src, SEED)
    check_canaries(theirs, dst)
    assert _notes(target, 1) == [(init.name, b"w-2")]
    # a notification alone
    init.send_notification(peer, b"hello")
    assert _notes(target, 1) == [(init.name, b"hello")]


@pytest.mark.parametrize(("producer_api", "consumer_api"), PAIRS)
def test_endpoints_push_and_pull_alike(producer_api: str, consumer_api: str) -> None:
    src_cache = make_cache(num_blocks=64, num_layers=2, kv_packed=False)
    dst_cache = make_cache(num_blocks=64, num_layers=2, kv_packed=False)
    fill(src_cache, SEED)
    for buf in dst_cache.buffers:
        buf[:] = CANARY
    pconf = kvpush.ProducerConfig(transport=TransportConfig(nixl_api=producer_api))
    cconf = kvpush.ConsumerConfig(transport=TransportConfig(nixl_api=consumer_api))
    with kvpush.Producer(src_cache.layout, config=pconf) as p, \
            kvpush.Consumer(dst_cache.layout, config=cconf) as c:
        c.connect(p.address, timeout=20)
        src, dst = np.arange(10), np.arange(20, 30)
        handle = c.expect("push", dst, p.name)
        time.sleep(0.05)  # the registration first: the WRITE leaves from prefill_done
        p.prefill_done("push", src)
        result = handle.wait(20)
        assert result.ok, result
        ticket = p.prefill_done("pull", src[:5] + 40, kvpush.TransferMode.PULL)
        result = c.pull(ticket, dst[:5] + 20, timeout=20).wait(20)
        assert result.ok, result
    check_blocks(dst_cache, dst, src, SEED)
    check_blocks(dst_cache, dst[:5] + 20, src[:5] + 40, SEED)
    check_canaries(dst_cache, np.concatenate([dst, dst[:5] + 20]))


def ticks_during_posts(api: str, posts: int = 6) -> list[int]:
    """How far a thread counting in Python advanced while each of ``posts`` 64 MiB WRITEs
    was inside :meth:`Agent.post` (the copy runs there on host memory: ~10 ms, long enough
    for the counter to be scheduled on a busy host). The switch interval is raised so that
    the counter runs only when the posting thread lets the GIL go."""
    nb = 256   # 2 regions x 256 blocks of 128 KiB: 64 MiB
    kw: dict[str, Any] = dict(num_blocks=nb, num_layers=1, kv_packed=False,
                              tokens_per_block=64, num_kv_heads=8, head_size=128)
    mine, theirs = make_cache(**kw), make_cache(**kw)
    init = Agent(f"kvpush-capi-gil-i-{api}", mine.layout, TransportConfig(nixl_api=api))
    target = Agent(f"kvpush-capi-gil-t-{api}", theirs.layout, TransportConfig(nixl_api=api))
    count = [0]
    stop = threading.Event()

    def counter() -> None:
        while not stop.is_set():
            count[0] += 1

    old = sys.getswitchinterval()
    thread = threading.Thread(target=counter, daemon=True)
    advanced = []
    try:
        peer = init.add_peer(target.metadata(), target.layout, target.name)
        idx = np.arange(2 * nb, dtype=np.int32)
        _wait_done(init, target, init.post("WRITE", peer, idx, idx, b""))  # connected, warm
        sys.setswitchinterval(0.05)
        thread.start()
        for _ in range(posts):
            before = count[0]
            handle = init.post("WRITE", peer, idx, idx, b"")
            advanced.append(count[0] - before)
            _wait_done(init, target, handle)
    finally:
        stop.set()
        sys.setswitchinterval(old)
        if thread.is_alive():
            thread.join(10)
        init.close()
        target.close()
    return advanced


@pytest.mark.parametrize("api", APIS)
def test_a_post_lets_other_threads_run(api: str) -> None:
    """Over the C API by construction; over the binding as the pinned nixl does it (what
    ``TransportConfig.nixl_api`` says of it)."""
    advanced = ticks_during_posts(api)
    assert sum(1 for a in advanced if a > 0) >= len(advanced) // 2, advanced


def test_the_cpu_a_post_spends_without_the_gil_is_counted_while_counting_is_on(
        agents: Any) -> None:
    """``released_cpu_ns`` is what the GIL figures of ``benchmarks.cpu_per_request`` take
    off a thread's CPU: a 64 MiB post's copy runs inside NIXL without the GIL, so most of
    the posting thread's CPU in the post is counted, none of it while counting is off."""
    from kvpush import _nixlc

    nb = 256   # 2 regions x 256 blocks of 128 KiB: 64 MiB
    kw: dict[str, Any] = dict(num_blocks=nb, num_layers=1, kv_packed=False,
                              tokens_per_block=64, num_kv_heads=8, head_size=128)
    mine, theirs = make_cache(**kw), make_cache(**kw)   # alive while their agents are
    init = agents("kvpush-capi-count-i", "c", mine)
    target = agents("kvpush-capi-count-t", "c", theirs)
    peer = init.add_peer(target.metadata(), target.layout, target.name)
    idx = np.arange(2 * nb, dtype=np.int32)
    _wait_done(init, target, init.post("WRITE", peer, idx, idx, b""))  # connected, warm

    def post() -> tuple[int, int]:
        released, cpu = _nixlc.released_cpu_ns(), time.thread_time_ns()
        handle = init.post("WRITE", peer, idx, idx, b"")
        cpu, released = time.thread_time_ns() - cpu, _nixlc.released_cpu_ns() - released
        _wait_done(init, target, handle)
        return released, cpu

    assert post()[0] == 0
    _nixlc.count_released(True)
    try:
        released, cpu = post()
    finally:
        _nixlc.count_released(False)
    assert 0.5 * cpu < released <= cpu, (released, cpu)
