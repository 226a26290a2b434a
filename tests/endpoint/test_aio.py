"""The API for engines with an event loop: ``await handle``, done callbacks,
async iterators over results and releases, ``fileno()``, non-blocking connect and pull, on
the stock asyncio loop and on uvloop; and the callback rules (a blocking kvpush call on a
loop thread raises at once)."""

from __future__ import annotations

import asyncio
import selectors
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import numpy as np
import pytest
import uvloop  # pinned in requirements/lock.txt: missing, the tests fail (never skip)

import kvpush
from kvpush import RequestState, TransferMode
from tests.support.harness import CANARY, check_blocks, check_canaries, fill, make_cache

T = TypeVar("T")
LOOPS = ["asyncio", "uvloop"]


def run(loop_kind: str, main: Callable[[], Awaitable[T]]) -> T:
    """Run ``main()`` on a fresh event loop of the given kind (closed afterwards)."""
    factory = uvloop.new_event_loop if loop_kind == "uvloop" else asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        loop = runner.get_loop()
        assert type(loop).__module__.startswith("uvloop") == (loop_kind == "uvloop")
        return runner.run(main())  # type: ignore[arg-type]


@pytest.fixture()
def caches() -> Iterator[tuple[Any, Any]]:
    src, dst = make_cache(num_blocks=1200), make_cache(num_blocks=1200)
    fill(src, 5)
    for buf in dst.buffers:
        buf[:] = CANARY
    yield src, dst


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_asyncio_push_and_pull_of_many_requests_every_byte_checked(
        loop_kind: str, caches: tuple[Any, Any]) -> None:
    """600 pushes and 600 pulls driven from one coroutine: handles awaited, the consumer's
    results and the producer's releases taken by ``async for``; every destination block
    holds its source's bytes, every other block its canary, every result and release
    names its blocks and transfer id."""
    src, dst = caches
    n = 600
    rng = np.random.default_rng(7)
    src_of = rng.permutation(2 * n)      # request i reads source block src_of[i]
    dst_of = rng.permutation(2 * n)      # ... into destination block dst_of[i]

    async def main() -> None:
        with kvpush.Producer(src.layout) as p, kvpush.Consumer(dst.layout) as c:
            ticker = Ticker()
            name = await asyncio.wait_for(c.connect_nowait(p.address), 10)
            handles = [c.expect(f"push-{i}", dst_of[i:i + 1], name) for i in range(n)]
            for i in range(n):
                assert p.prefill_done(f"push-{i}", src_of[i:i + 1]) is None
            tickets = [p.prefill_done(f"pull-{i}", src_of[n + i:n + i + 1],
                                      TransferMode.PULL) for i in range(n)]
            handles += [c.pull(t.to_bytes(), dst_of[n + i:n + i + 1])  # type: ignore[union-attr]
                        for i, t in enumerate(tickets)]

            async def take(it: Any, want: int) -> list[Any]:
                out = []
                async for item in it:
                    out.append(item)
                    if len(out) == want:
                        break
                return out

            results = await asyncio.wait_for(asyncio.gather(*handles), 60)
            finished = await asyncio.wait_for(take(c.results(), 2 * n), 30)
            released = await asyncio.wait_for(take(p.releases(), 2 * n), 30)
            ticker.stop()
            assert ticker.ticks > 0  # the event loop ran while kvpush worked
            assert [r.state for r in results] == [RequestState.READY] * (2 * n)
            for h, r in zip(handles, results, strict=True):
                assert (r.request_id, r.xid, r.mode) == (h.request_id, h.xid, h.mode)
                i = int(r.request_id.split("-")[1]) + (n if r.mode is TransferMode.PULL
                                                       else 0)
                assert list(r.block_ids) == [dst_of[i]]
            assert {r.xid for r in finished} == {h.xid for h in handles}
            by_rid = {h.request_id: h.xid for h in handles}
            for rel in released:
                assert rel.reason is kvpush.ReleaseReason.TRANSFERRED and rel.blocks_safe
                assert rel.xids == (by_rid[rel.request_id],)
                assert rel.mode is TransferMode(rel.request_id.split("-")[0])
            assert c.get_finished() == [] and p.get_released() == []
        check_blocks(dst, dst_of, src_of, 5)
        check_canaries(dst, dst_of)

    run(loop_kind, main)


class Ticker:
    """A task that counts event-loop turns every 10 ms: proof the loop is not blocked."""

    def __init__(self) -> None:
        self.ticks = 0
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(0.01)
            self.ticks += 1

    def stop(self) -> None:
        self._task.cancel()


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_connect_to_an_absent_producer_does_not_block_and_fails_in_its_deadline(
        loop_kind: str) -> None:
    dst = make_cache(num_blocks=8)

    async def main() -> None:
        with kvpush.Consumer(dst.layout) as c:
            ticker = Ticker()
            t0 = time.monotonic()
            handle = c.connect_nowait("tcp://127.0.0.1:9", timeout=0.5)
            ticket = kvpush.PullTicket("nobody", "tcp://127.0.0.1:9", "r",
                                       kvpush.messages.encode_ids(np.array([0, 1])), 60.0,
                                       time.time())
            pull = c.pull(ticket, [2, 3], timeout=0.7)
            assert time.monotonic() - t0 < 0.3          # both returned at once
            assert not handle.done() and not pull.done()
            assert c.status("r").phase == "connecting"
            with pytest.raises(kvpush.PeerUnavailable):
                await asyncio.wait_for(handle, 5)
            elapsed = time.monotonic() - t0
            assert 0.4 < elapsed < 3.0, elapsed          # within its deadline, not before
            result = await asyncio.wait_for(pull, 5)
            assert time.monotonic() - t0 < 3.0
            assert (result.state, result.blocks_safe) == (RequestState.FAILED, True)
            assert isinstance(result.error, kvpush.PeerUnavailable)
            assert ticker.ticks >= 10                   # the loop kept turning meanwhile
            ticker.stop()
            assert c.status("r").phase == "none" and c.pending == 0
            # a pull given up during its handshake ends ABORTED at once, blocks safe
            waiting = c.pull(ticket, [4, 5], timeout=30)
            c.abort("r", "changed my mind")   # (queued after the pull: it sees it)
            result = await asyncio.wait_for(waiting, 2)
            assert (result.state, result.blocks_safe, result.xid) == \
                (RequestState.ABORTED, True, waiting.xid)
            assert c.pending == 0 and c.stats()["requests_aborted"] == 1

    run(loop_kind, main)


def test_fileno_is_readable_when_there_is_something_to_drain() -> None:
    src, dst = make_cache(num_blocks=8), make_cache(num_blocks=8)
    with kvpush.Producer(src.layout) as p, kvpush.Consumer(dst.layout) as c, \
            selectors.DefaultSelector() as sel:
        sel.register(p.fileno(), selectors.EVENT_READ, "producer")
        sel.register(c.fileno(), selectors.EVENT_READ, "consumer")
        assert sel.select(0) == []
        name = c.connect(p.address)
        c.expect("f", [1], name)
        p.prefill_done("f", [2])
        seen: set[str] = set()
        deadline = time.monotonic() + 10
        while seen != {"producer", "consumer"} and time.monotonic() < deadline:
            seen |= {key.data for key, _ in sel.select(1.0)}
        assert seen == {"producer", "consumer"}
        assert [r.request_id for r in p.get_released()] == ["f"]
        assert [r.request_id for r in c.get_finished()] == ["f"]
        # Drained: not readable any more. A drain that ran between the loop's write and its
        # flag (the selector woke on the write) leaves one spurious wake-up, which the next
        # drain clears: readable means "may have something" (a rare flake of this test).
        deadline = time.monotonic() + 5
        while sel.select(0) and time.monotonic() < deadline:
            assert p.get_released() == [] and c.get_finished() == []
            time.sleep(0.01)
        assert sel.select(0) == []
        p.close()
        assert [k.data for k, _ in sel.select(1.0)] == ["producer"]  # and its end is seen


def test_done_callbacks_run_once_and_at_once_when_already_done() -> None:
    src, dst = make_cache(num_blocks=8), make_cache(num_blocks=8)
    with kvpush.Producer(src.layout) as p, kvpush.Consumer(dst.layout) as c:
        name = c.connect(p.address)
        calls: list[tuple[str, kvpush.TransferHandle]] = []
        h = c.expect("d", [1], name)
        h.add_done_callback(lambda handle: calls.append((threading.current_thread().name,
                                                         handle)))
        with pytest.raises(TypeError):
            h.add_done_callback(None)  # type: ignore[arg-type]
        p.prefill_done("d", [2])
        assert h.wait(10).ok
        deadline = time.monotonic() + 5
        while not calls and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(calls) == 1 and calls[0][1] is h and calls[0][0].endswith("-loop")
        h.add_done_callback(lambda handle: calls.append(("now", handle)))
        assert calls[1] == ("now", h)
        connect = c.connect_nowait(p.address)
        assert connect.wait(10) == name and connect.result is not None \
            and connect.result.ok


def test_a_blocking_call_from_a_callback_raises_at_once() -> None:
    """Inside a callback (any kvpush loop thread) every blocking kvpush call raises
    RuntimeError saying why -- a handle's wait, the blocking connect, claim, another
    endpoint's status -- while the non-blocking forms work, and closing another endpoint
    from a callback returns without joining its thread."""
    src, dst, other = (make_cache(num_blocks=8) for _ in range(3))
    errors: dict[str, str] = {}
    ok: dict[str, Any] = {}
    done = threading.Event()
    p = kvpush.Producer(src.layout)
    bystander = kvpush.Producer(other.layout)
    c: kvpush.Consumer
    handles: list[kvpush.TransferHandle] = []

    def attempt(what: str, fn: Callable[[], Any]) -> None:
        t0 = time.monotonic()
        try:
            ok[what] = fn()
        except RuntimeError as exc:
            errors[what] = str(exc)
        # at once: a call that blocked would take its 1 s timeout (or more)
        assert time.monotonic() - t0 < 0.9, what

    def on_finished(result: kvpush.TransferResult) -> None:
        if result.request_id != "cb":
            return
        ticket = p.prefill_done("t", [5], TransferMode.PULL)
        attempt("wait", lambda: handles[0].wait(1.0))
        attempt("connect", lambda: c.connect(p.address, timeout=1.0))
        attempt("claim", lambda: c.claim(ticket))  # type: ignore[arg-type]
        attempt("producer status", lambda: p.status("cb"))
        attempt("own status", lambda: c.status("cb").phase)
        attempt("connect_nowait", lambda: c.connect_nowait(p.address).done() in (0, 1))
        attempt("close other", bystander.close)
        done.set()

    c = kvpush.Consumer(dst.layout, on_finished=on_finished)
    try:
        name = c.connect(p.address)
        handles.append(c.expect("cb", [1], name, timeout=10))
        p.prefill_done("cb", [2])
        assert done.wait(10)
        assert set(errors) == {"wait", "connect", "producer status"}, (errors, ok)
        for what, message in errors.items():
            assert "loop thread" in message and "callback" in message, (what, message)
        assert ok["own status"] == "none" and ok["connect_nowait"] is True
        assert isinstance(ok["claim"], int)  # claim() never blocks: it is allowed here
        deadline = time.monotonic() + 10   # the bystander's loop tore itself down
        while bystander._driver.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert bystander.closed and not bystander._driver.thread.is_alive()
        # the same rule for a handle's done callback, and from an asyncio-free thread the
        # same calls work
        h = c.expect("cb2", [3], name, timeout=10)
        h.add_done_callback(lambda handle: attempt("wait in done callback",
                                                   lambda: handle.wait(1.0)))
        p.prefill_done("cb2", [4])
        assert h.wait(10).ok
        deadline = time.monotonic() + 5
        while "wait in done callback" not in errors and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "wait in done callback" in errors
        assert p.status("cb2").phase in ("ended", "none")
    finally:
        c.close()
        p.close()
        bystander.close()


def test_status_names_the_use_its_parts_and_deadline() -> None:
    src, dst = make_cache(num_blocks=16), make_cache(num_blocks=16)
    fill(src, 2)
    with kvpush.Producer(src.layout) as p, kvpush.Consumer(dst.layout) as c:
        name = c.connect(p.address)
        assert c.status("s").phase == "none" and p.status("s").phase == "none"
        t0 = time.monotonic()
        h = c.expect("s", [1, 2], name, timeout=30)
        deadline = time.monotonic() + 10
        while p.status("s").phase != "waiting" and time.monotonic() < deadline:
            time.sleep(0.01)
        cs, ps = c.status("s"), p.status("s")
        assert (cs.phase, cs.mode, cs.xid, list(cs.block_ids), cs.parts, cs.parts_landed) \
            == ("pushing", TransferMode.PUSH, h.xid, [1, 2], 1, 0)
        assert cs.deadline is not None and t0 + 29 < cs.deadline < time.monotonic() + 31
        assert ps.phase == "waiting" and ps.live
        assert [(o.xid, o.mode, o.state) for o in ps.owners] == \
            [(h.xid, TransferMode.PUSH, "registered")]
        assert ps.owners[0].peer == c.name
        with pytest.raises(kvpush.InvalidRequest):
            c.status("")
        ticket = p.prefill_done("q", [7, 8], TransferMode.PULL)
        assert ticket is not None
        ps = p.status("q")
        assert (ps.phase, ps.mode, ps.sid, list(ps.block_ids), ps.owners) == \
            ("held", TransferMode.PULL, ticket.sid, [7, 8], ())
        assert ps.deadline is not None and ps.deadline > time.monotonic() + 50  # its lease
        p.prefill_done("s", [3, 4])
        result = h.wait(10)
        assert result.ok and list(result.block_ids) == [1, 2] and result.xid == h.xid
        assert c.status("s").phase == "none" and not c.status("s").live
        c.pull(ticket, [5, 6]).wait(10)
        check_blocks(dst, np.array([1, 2, 5, 6]), np.array([3, 4, 7, 8]), 2)


def test_a_drain_queue_never_sleeps_on_a_queued_item(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop thread queues an item while the engine's thread is clearing the descriptor
    (here: inside its read). Clearing the flag before reading lost the write of that moment,
    and the next item wrote nothing: a watcher slept with results queued (found by
    examples/async_batching.py hanging on the stock loop). Now the next item wakes it."""
    import os
    import select

    from kvpush import aio

    q: aio.DrainQueue[int] = aio.DrainQueue()
    q.put(1)
    real_read = os.eventfd_read
    raced = []

    def read_racing_a_put(fd: int) -> int:
        if not raced:
            raced.append(True)
            q.put(2)   # what the loop thread does at that instant
        return real_read(fd)

    monkeypatch.setattr(aio.os, "eventfd_read", read_racing_a_put)
    assert q.take() == [1, 2]
    monkeypatch.setattr(aio.os, "eventfd_read", real_read)
    q.put(3)
    assert select.select([q], [], [], 0)[0] == [q]      # the watcher is woken
    assert q.take() == [3]
    assert select.select([q], [], [], 0)[0] == []       # and not again: nothing spins
    # A drain that runs while the loop is writing the descriptor (before it sets the
    # flag) takes the item; the write then wakes the watcher once, and only once.
    real_write = os.eventfd_write
    taken: list[list[int]] = []

    def write_racing_a_take(fd: int, value: int) -> None:
        taken.append(q.take())
        real_write(fd, value)

    monkeypatch.setattr(aio.os, "eventfd_write", write_racing_a_take)
    q.put(4)
    monkeypatch.setattr(aio.os, "eventfd_write", real_write)
    assert taken == [[4]]
    assert select.select([q], [], [], 0)[0] == [q] and q.take() == []
    assert select.select([q], [], [], 0)[0] == []
    q.end()
    assert select.select([q], [], [], 0)[0] == [q] and q.take() == [] and q.ended


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_iterators_end_at_close_and_refuse_endpoints_with_callbacks(loop_kind: str) -> None:
    src, dst = make_cache(num_blocks=8), make_cache(num_blocks=8, num_layers=3)

    async def main() -> None:
        p = kvpush.Producer(src.layout)
        c = kvpush.Consumer(dst.layout, on_finished=lambda result: None)
        try:
            with pytest.raises(RuntimeError, match="on_finished"):
                c.results()
            with pytest.raises(kvpush.LayoutMismatch):   # a refused handshake, awaited
                await asyncio.wait_for(c.connect_nowait(p.address), 10)
            seen: list[str] = []

            async def collect() -> None:
                async for release in p.releases():
                    seen.append(release.request_id)

            task = asyncio.get_running_loop().create_task(collect())
            p.prefill_done("held", [1], TransferMode.PULL)
            await asyncio.sleep(0.05)
            assert not task.done()
            p.close()                                    # releases "held" CLOSED, then ends
            await asyncio.wait_for(task, 10)
            assert seen == ["held"]
        finally:
            c.close()
            p.close()

    run(loop_kind, main)
