"""The public API's contract: bad input raises a precise KvpushError with nothing posted;
incompatible layouts are refused at handshake; lifecycles release everything."""

from __future__ import annotations

import gc
import logging
import sys
import threading
import time
import warnings
from collections.abc import Iterator

import numpy as np
import pytest

import kvpush
from kvpush import RequestState, TransferMode
from tests.support.harness import CANARY, check_blocks, drain_released, fill, make_cache


@pytest.fixture()
def pair() -> Iterator[tuple[kvpush.Producer, kvpush.Consumer, object, object, str]]:
    src, dst = make_cache(num_blocks=32), make_cache(num_blocks=48)
    fill(src, 3)
    for buf in dst.buffers:
        buf[:] = CANARY
    with kvpush.Producer(src.layout) as p, kvpush.Consumer(dst.layout) as c:
        name = c.connect(p.address, timeout=10)
        yield p, c, src, dst, name


def test_in_process_push_and_pull(pair: tuple) -> None:
    p, c, _src, dst, name = pair
    h = c.expect("a", np.array([0, 1, 2], dtype=np.int32), name)
    assert p.prefill_done("a", np.array([7, 8, 9])) is None
    assert h.wait(10).state is RequestState.READY
    check_blocks(dst, np.array([0, 1, 2]), np.array([7, 8, 9]), 3)
    ticket = p.prefill_done("b", [30, 2], mode=TransferMode.PULL)
    assert ticket is not None
    result = c.pull(ticket.to_bytes(), np.array([40, 41])).wait(10)
    assert result.ok and result.mode is TransferMode.PULL
    check_blocks(dst, np.array([40, 41]), np.array([30, 2]), 3)
    reasons = {r.request_id: r.reason for r in drain_released(p, 2)}
    assert reasons == {"a": kvpush.ReleaseReason.TRANSFERRED,
                       "b": kvpush.ReleaseReason.TRANSFERRED}
    assert [r.request_id for r in c.get_finished()] == ["a", "b"]


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        (np.array([0, 99]), "out of range"),
        (np.array([3, 3]), "duplicate"),
        (np.array([1.0, 2.0]), "int32 or int64"),
        (np.array([[1, 2]]), "1-D"),
        (np.arange(10)[::2], "contiguous"),
        ("1,2", "numpy"),
        ([1.5], "ints"),
        (np.array([-1]), "out of range"),
    ],
)
def test_bad_block_ids_raise_before_posting(pair: tuple, ids: object, message: str) -> None:
    p, c, _src, _dst, name = pair
    with pytest.raises(kvpush.InvalidBlockIds, match=message):
        p.prefill_done("bad", ids)
    with pytest.raises(kvpush.InvalidBlockIds, match=message):
        c.expect("bad", ids, name)
    assert p.stats()["transfers_posted"] == 0
    assert c.stats()["transfers_posted"] == 0
    assert p.pending == 0 and c.pending == 0


def test_a_bad_request_raises_invalid_request_and_not_the_block_ids_error(pair: tuple) -> None:
    """An error in the request rather than its blocks -- its id, an id already pending or
    claimed, tickets that do not belong together -- is an InvalidRequest (a ValueError), not
    an InvalidBlockIds: a caller that frees or re-allocates blocks on InvalidBlockIds must not
    do so for these. Block-id errors are InvalidRequests too."""
    p, c, _src, _dst, name = pair

    def refused(call: object, match: str) -> None:
        with pytest.raises(kvpush.InvalidRequest, match=match) as caught:
            call()  # type: ignore[operator]
        assert not isinstance(caught.value, kvpush.InvalidBlockIds), caught.value
        assert isinstance(caught.value, ValueError)

    refused(lambda: c.expect("", [0], name), "non-empty str")
    refused(lambda: p.prefill_done("x" * 1025, [0]), "at most 1024")
    refused(lambda: c.status(b"rid"), "non-empty str")
    t1 = p.prefill_done("t1", [1], TransferMode.PULL)
    t2 = p.prefill_done("t2", [2], TransferMode.PULL)
    refused(lambda: c.pull([t1, t2], [3]), "same request")
    refused(lambda: c.pull([t1, t1], [3]), "same producer")
    c.claim(t1)
    refused(lambda: c.claim(t1), "already claimed")
    first = c.expect("twice", [5], name)
    again = c.expect("twice", [6], name).wait(10)
    assert isinstance(again.error, kvpush.InvalidRequest), again
    assert not isinstance(again.error, kvpush.InvalidBlockIds), again
    assert "already pending" in str(again.error)
    p.prefill_done("twice", [7])
    assert first.wait(10).ok
    assert issubclass(kvpush.InvalidBlockIds, kvpush.InvalidRequest)
    with pytest.raises(kvpush.InvalidRequest, match="out of range"):
        c.expect("range", [99], name)


def test_mismatched_lengths_in_pull(pair: tuple) -> None:
    p, c, *_ = pair
    ticket = p.prefill_done("len", np.array([1, 2, 3]), mode=TransferMode.PULL)
    with pytest.raises(kvpush.InvalidBlockIds, match="3 source blocks"):
        c.pull(ticket, np.array([1, 2]))
    assert c.stats()["transfers_posted"] == 0
    # Aborted, but its ticket is out: the blocks stay until no READ can touch them (the
    # lease); closing the producer then releases them.
    p.abort("len")
    assert drain_released(p, 1, timeout=0.3) == []
    assert p.pending == 1


def test_a_request_counts_as_pending_once_its_call_returns(pair: tuple) -> None:
    """``pending`` is the caller's view: a request whose call has returned counts while
    the loop thread has not taken it in yet (a Prometheus scrape right after ``expect``
    read 0 when it did not). The loop thread is held busy for the first part."""
    p, c, _src, _dst, name = pair
    busy = threading.Event()

    def hold(endpoint: kvpush.Producer | kvpush.Consumer) -> None:
        held = threading.Event()

        def run() -> None:
            held.set()
            busy.wait(10)

        endpoint._driver.call_soon(run)
        assert held.wait(10)

    hold(p)
    hold(c)
    try:
        handles = [c.expect("counted", [1], name)]
        handles += c.expect_many([("counted-too", [2], name)])
        ticket = p.prefill_done("counted", [3])
        assert ticket is None
        p.prefill_done_many([("counted-too", [4])])
        assert c.pending == 2 and p.pending == 2
    finally:
        busy.set()
    assert all(h.wait(10).ok for h in handles)
    assert [r.reason for r in drain_released(p, 2)] == [kvpush.ReleaseReason.TRANSFERRED] * 2
    assert p.pending == 0 and c.pending == 0


def test_pending_can_be_read_by_code_a_request_runs_on_the_loop_thread(pair: tuple) -> None:
    """A log handler runs inside the core's work on the loop thread, and may read
    ``pending`` there (the count's lock is re-entrant): an expect that supersedes a pull
    claim logs the claim's end while the loop takes the expect in."""
    p, c, _src, _dst, name = pair
    c.claim(p.prefill_done("superseded", [5], TransferMode.PULL))
    seen: list[int] = []

    class Counting(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "superseded" in record.getMessage():
                seen.append(c.pending)

    logger = logging.getLogger("kvpush.consumer")
    handler, level = Counting(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        result = c.expect("superseded", [6], name, timeout=2).wait(10)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    # Giving the claim up gives the producer's source up: the push finds it aborted.
    assert result.state is RequestState.ABORTED, result
    assert seen == [1], result


def test_registration_of_mismatched_length_fails_cleanly(pair: tuple) -> None:
    p, c, _src, dst, name = pair
    h = c.expect("mis", np.array([1, 2]), name)
    p.prefill_done("mis", np.array([1, 2, 3]))
    result = h.wait(10)
    assert result.state is RequestState.FAILED
    assert isinstance(result.error, kvpush.TransferFailed)
    assert "differ in length" in str(result.error)
    assert [r.reason for r in drain_released(p, 1)] == [kvpush.ReleaseReason.FAILED]
    assert p.stats()["transfers_posted"] == 0
    assert (dst.buffers[0][:3] == CANARY).all()


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("num_layers", dict(num_layers=3)),
        ("dtype", dict(dtype="bfloat16", head_size=16)),
        ("head_size", dict(head_size=32)),
        ("total_kv_heads", dict(num_kv_heads=4)),
        ("tokens_per_block", dict(tokens_per_block=6)),  # not a multiple of 4
        ("kv_packed", dict(kv_packed=False)),
    ],
)
def test_layout_mismatch_refused_at_handshake(field: str, kwargs: dict) -> None:
    src = make_cache(num_blocks=16)
    dst = make_cache(num_blocks=16, **kwargs)
    with kvpush.Producer(src.layout) as p, kvpush.Consumer(dst.layout) as c:
        with pytest.raises(kvpush.LayoutMismatch) as info:
            c.connect(p.address, timeout=10)
        assert info.value.field == field
        assert field in str(info.value)
        assert c.producers() == []


def test_connect_to_nobody_times_out() -> None:
    dst = make_cache(num_blocks=8)
    with kvpush.Consumer(dst.layout) as c, pytest.raises(kvpush.PeerUnavailable):
        c.connect("tcp://127.0.0.1:9", timeout=0.5)


def _ticket(address: str, lease_s: float, age_s: float) -> kvpush.PullTicket:
    return kvpush.PullTicket("nobody", address, "r", kvpush.messages.encode_ids(
        np.array([0, 1], dtype=np.int64)), lease_s, time.time() - age_s)


def test_pull_waits_for_a_handshake_no_longer_than_its_lease() -> None:
    """A pull connects to its ticket's producer first, on the loop thread: the call returns
    at once, and the handshake is part of the request. A handshake that outlasts
    the ticket's lease cannot make the pull succeed, so it is given no longer than that (not
    connect_timeout_s), and none at all once the lease is over."""
    dst = make_cache(num_blocks=8)
    config = kvpush.ConsumerConfig(connect_timeout_s=30.0, lease_margin_s=0.0)
    with kvpush.Consumer(dst.layout, config) as c:
        for lease_s, age_s, timeout, state, error in (
                (0.5, 0.0, None, RequestState.FAILED, kvpush.PeerUnavailable),
                (0.5, 5.0, None, RequestState.TIMED_OUT, kvpush.TransferTimeout),
                # the pull's own timeout bounds the handshake as well
                (60.0, 0.0, 0.5, RequestState.FAILED, kvpush.PeerUnavailable)):
            t0 = time.monotonic()
            handle = c.pull(_ticket("tcp://127.0.0.1:9", lease_s, age_s), [0, 1],
                            timeout=timeout)
            assert time.monotonic() - t0 < 0.3  # never blocks on the handshake (>= 0.5 s)
            result = handle.wait(5)
            assert time.monotonic() - t0 < 3.0
            assert (result.state, result.blocks_safe, result.xid) == \
                (state, True, handle.xid), result
            assert isinstance(result.error, error), result
            assert list(result.block_ids) == [0, 1]
        assert "lease" in str(c.pull(_ticket("tcp://127.0.0.1:9", 0.5, 5.0), [0, 1])
                              .wait(5).error)
        assert c.pending == 0 and c.stats()["requests_failed"] == 2


def test_config_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="lease_s"):
        kvpush.ProducerConfig(lease_s=0)
    with pytest.raises(ValueError, match="ucx_error_mode"):
        kvpush.TransportConfig(ucx_error_mode="sometimes")
    with pytest.raises(ValueError, match="max_sleep_s"):
        kvpush.ProgressPolicy(min_sleep_s=0.01, max_sleep_s=0.001)
    with pytest.raises(ValueError, match="heartbeat"):
        kvpush.ConsumerConfig(heartbeat_s=5, peer_timeout_s=6)


def test_layout_validation() -> None:
    cache = make_cache(num_blocks=8)
    with pytest.raises(ValueError, match="regions"):
        kvpush.KVLayout(regions=cache.layout.regions[:1], num_layers=2, num_blocks=8,
                        tokens_per_block=4, num_kv_heads=2, head_size=16, dtype="float16")
    with pytest.raises(ValueError, match="dtype"):
        kvpush.KVLayout(regions=cache.layout.regions, num_layers=2, num_blocks=8,
                        tokens_per_block=4, num_kv_heads=2, head_size=16, dtype="float99")
    with pytest.raises(ValueError, match="need"):
        kvpush.KVLayout(regions=cache.layout.regions, num_layers=2, num_blocks=9,
                        tokens_per_block=4, num_kv_heads=2, head_size=16, dtype="float16")


def test_unclosed_endpoint_warns() -> None:
    cache = make_cache(num_blocks=8)
    c = kvpush.Consumer(cache.layout)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c.__del__()
    assert any(issubclass(w.category, ResourceWarning) for w in caught)
    assert c.closed
    del c
    gc.collect()


def test_close_releases_held_blocks() -> None:
    cache = make_cache(num_blocks=8)
    released = []
    p = kvpush.Producer(cache.layout, on_release=released.append)
    p.prefill_done("held", np.array([1, 2]))
    p.close()
    assert [(r.request_id, r.reason) for r in released] == [("held", kvpush.ReleaseReason.CLOSED)]
    with pytest.raises(kvpush.ClosedError):
        p.prefill_done("x", np.array([1]))


def test_empty_requests_as_first_traffic() -> None:
    """A full prefix hit as the very first request of a pair: nothing to move, and no NIXL
    connection yet; the protocol still completes on both sides."""
    src, dst = make_cache(num_blocks=8), make_cache(num_blocks=8)
    empty = np.array([], dtype=np.int64)
    with kvpush.Producer(src.layout) as p, kvpush.Consumer(dst.layout) as c:
        name = c.connect(p.address)
        handle = c.expect("e1", empty, name)
        p.prefill_done("e1", empty)
        assert handle.wait(5).state is RequestState.READY
        ticket = p.prefill_done("e2", empty, TransferMode.PULL)
        assert c.pull(ticket, empty).wait(5).state is RequestState.READY
        assert [r.reason for r in drain_released(p, 2)] == [kvpush.ReleaseReason.TRANSFERRED] * 2
        assert p.stats()["requests_completed"] == 2


@pytest.mark.parametrize("mode", [TransferMode.PUSH, TransferMode.PULL])
def test_source_tail_moves_only_the_missing_blocks(pair: tuple, mode: TransferMode) -> None:
    """A decode-side prefix-cache hit: the consumer holds the first 3 of 5 blocks and asks
    for the last 2 only."""
    p, c, _src, dst, name = pair
    src_ids, dst_ids = np.array([10, 11, 12, 13, 14]), np.array([40, 41])
    if mode is TransferMode.PUSH:
        handle = c.expect("tail", dst_ids, name, source_tail=True)
        p.prefill_done("tail", src_ids)
    else:
        handle = c.pull(p.prefill_done("tail", src_ids, mode), dst_ids, source_tail=True)
    result = handle.wait(10)
    assert result.ok, result
    assert result.bytes_moved == 2 * dst.layout.bytes_per_block_id
    check_blocks(dst, dst_ids, src_ids[3:], 3)
    released = drain_released(p, 1)
    assert [r.block_ids.tolist() for r in released] == [src_ids.tolist()]  # all of them
    with pytest.raises(kvpush.InvalidBlockIds, match="source_tail"):
        c.pull(p.prefill_done("tail2", src_ids[:1], TransferMode.PULL), dst_ids,
               source_tail=True)


@pytest.mark.parametrize("bad", [0, -1, 1 << 63, True, "5", 1.0])
def test_a_use_is_named_by_a_positive_63_bit_int(pair: tuple, bad: object) -> None:
    p, _c, _src, _dst, _name = pair
    with pytest.raises(ValueError, match="sid"):
        p.prefill_done("s", [1], sid=bad)
    with pytest.raises(ValueError, match="sid"):
        p.abort("s", sid=bad)
    assert p.stats()["requests_aborted"] == 0


def test_an_abort_naming_a_use_that_ended_leaves_the_next_alone(pair: tuple) -> None:
    """The engine aborts a use of a reused id just as it ends: named, the abort cannot
    reach the next use of the id (unnamed, it fails that use's registration)."""
    p, c, _src, dst, name = pair
    h = c.expect("u", [0, 1], name)
    p.prefill_done("u", [7, 8], sid=0x51)
    assert h.wait(10).ok
    drain_released(p, 1)
    h = c.expect("u", [2, 3], name)                  # the id's next use registers
    deadline = time.monotonic() + 10
    while p.status("u").phase != "waiting":
        assert time.monotonic() < deadline, p.status("u")
        time.sleep(0.01)
    p.abort("u", "ended already", sid=0x51)          # the engine's late abort
    p.prefill_done("u", [9, 10], sid=0x52)
    assert h.wait(10).ok
    check_blocks(dst, np.array([2, 3]), np.array([9, 10]), 3)
    assert [r.reason for r in drain_released(p, 1)] == [kvpush.ReleaseReason.TRANSFERRED]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, 0.0, True, "5"])
def test_api_timeouts_must_be_finite_positive(pair: tuple, bad: object) -> None:
    """A NaN timeout once reached the loop's timer heap, where it stops every timer."""
    p, c, _src, _dst, name = pair
    with pytest.raises(ValueError, match="timeout"):
        c.expect("t", [0], name, timeout=bad)
    with pytest.raises(ValueError, match="timeout"):
        c.connect(p.address, timeout=bad)
    ticket = p.prefill_done("t", [1], mode=TransferMode.PULL)
    assert ticket is not None
    with pytest.raises(ValueError, match="timeout"):
        c.pull(ticket, [0], timeout=bad)
    handle = c.pull(ticket, [0], timeout=10)
    if bad != 0.0:  # wait(0) is a valid poll
        with pytest.raises(ValueError, match="timeout"):
            handle.wait(bad)  # type: ignore[arg-type]
    assert handle.wait(10).ok and handle.wait(10).blocks_safe
    # The loop's timers still run: a short request times out on time.
    assert c.expect("late", [1], name, timeout=0.2).wait(5).state is RequestState.TIMED_OUT


def test_refused_write_fails_at_once_with_safe_blocks(pair: tuple,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The Posted hint goes out before the WRITE is posted; when NIXL then refuses the post,
    the producer names that part errored, so the consumer ends the request FAILED with its
    blocks safe at once instead of fencing on a Landed that never comes. (NIXL refusing a
    post cannot be provoked on demand here, so the refusal is injected.)"""
    p, c, _src, _dst, name = pair

    def refuse(*args: object, **kwargs: object) -> None:
        raise kvpush.errors.TransferFailed("injected: NIXL refused the post")

    monkeypatch.setattr(p._agent, "post", refuse)
    handle = c.expect("r", np.array([0, 1]), name, timeout=30)
    p.prefill_done("r", np.array([4, 5]))
    result = handle.wait(c.config.abort_grace_s / 2)
    assert (result.state, result.blocks_safe) == (RequestState.FAILED, True), result
    assert [r.reason for r in drain_released(p, 1)] == [kvpush.ReleaseReason.FAILED]


def test_release_timings_trace_the_stages(pair: tuple) -> None:
    """Release.timings: monotonic stamps of each stage that happened, in causal order."""
    p, c, _src, _dst, name = pair
    handle = c.expect("w", np.array([0, 1]), name, timeout=30)
    p.prefill_done("w", np.array([2, 3]))
    assert handle.wait(10).ok
    ticket = p.prefill_done("r", np.array([4]), mode=TransferMode.PULL)
    assert ticket is not None and c.pull(ticket, np.array([5])).wait(10).ok
    timings = {r.request_id: dict(r.timings) for r in drain_released(p, 2)}
    push, pull = timings["w"], timings["r"]
    assert list(push) == ["prefill_done", "held", "registered", "posted", "written",
                          "released"], push
    # the registration may reach the loop before or after prefill_done
    assert push["prefill_done"] <= push["held"] <= push["posted"] <= push["written"] \
        <= push["released"] and push["registered"] <= push["posted"], push
    assert list(pull) == ["prefill_done", "held", "pull_begin", "released"], pull
    assert pull["prefill_done"] <= pull["held"] <= pull["pull_begin"] <= pull["released"]


def test_pull_begin_overtaking_its_prefill_done(pair: tuple,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """prefill_done(PULL) returns the ticket before the producer's loop has taken the blocks
    (that is queued to it); a relayed ticket's PullBegin can reach the loop in the same
    iteration, after its command drain (seen in the demo: the loop waited for the GIL
    there). The blocks are held from the engine's call on, so the pull must succeed: the
    loop runs its queued commands after receiving messages, before handling them. The race
    is forced here by holding back the drain at the top of each loop iteration."""
    p, c, _src, dst, _name = pair
    held_back = threading.Event()
    drain = p._driver._drain_commands

    def drain_unless_held_back() -> None:
        if held_back.is_set() and sys._getframe(1).f_code.co_name == "_run":
            return
        drain()

    monkeypatch.setattr(p._driver, "_drain_commands", drain_unless_held_back)
    held_back.set()
    ticket = p.prefill_done("overtaken", np.array([6, 7]), mode=TransferMode.PULL)
    assert ticket is not None
    result = c.pull(ticket, np.array([8, 9])).wait(10)
    held_back.clear()
    assert result.ok, result
    check_blocks(dst, np.array([8, 9]), np.array([6, 7]), 3)
    assert [r.reason for r in drain_released(p, 1)] == [kvpush.ReleaseReason.TRANSFERRED]


def test_callbacks_may_not_block_but_may_close_and_nothing_is_dropped() -> None:
    """A blocking call (connect) from inside a callback would stall the loop that has to
    answer it: it raises at once. close() from a callback ends the loop after the callback
    (it cannot join its own thread), and undrained results are kept past 65,536."""
    from collections import deque

    from kvpush import endpoint

    src, dst = make_cache(num_blocks=8), make_cache(num_blocks=8)
    errors: list[BaseException] = []
    closed = threading.Event()
    producer = kvpush.Producer(src.layout)
    consumer: kvpush.Consumer

    def on_finished(result: kvpush.TransferResult) -> None:
        try:
            consumer.connect(producer.address, timeout=1.0)
        except RuntimeError as exc:
            errors.append(exc)
        consumer.close()  # from the loop thread: returns, the loop ends after this
        closed.set()

    consumer = kvpush.Consumer(dst.layout, on_finished=on_finished)
    try:
        name = consumer.connect(producer.address)
        h = consumer.expect("cb", np.array([1]), name, timeout=10)
        producer.prefill_done("cb", np.array([2]))
        assert h.wait(10).state is RequestState.READY
        assert closed.wait(10) and len(errors) == 1 and "callback" in str(errors[0])
        deadline = time.monotonic() + 10
        while consumer._driver.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not consumer._driver.thread.is_alive() and consumer.closed
    finally:
        consumer.close()
        producer.close()
    queue: deque[int] = deque()
    for i in range(endpoint.RESULT_QUEUE + 10):
        endpoint.queue_result(queue, i, "x", "get_finished")
    assert len(queue) == endpoint.RESULT_QUEUE + 10 and queue[0] == 0
    assert producer._released.maxlen is None and consumer._finished.maxlen is None
