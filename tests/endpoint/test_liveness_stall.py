"""A loop thread that stalls longer than ``peer_timeout_s`` (a long NIXL or UCX call, a
callback that blocks, the GIL, the process stopped) does not blame its peer for its own
silence: the peer's messages that came meanwhile are read before a liveness check judges,
and the consumer counts silence from a Heartbeat it sent, not across the stretch in which
it could send none. (Two fault-matrix flakes in CI: a consumer stalled in a UCX call lost
the producer that had answered meanwhile, and the push after it failed PeerUnavailable.)
Each test fails without that mechanism (the stale last-heard time decides)."""

from __future__ import annotations

import contextlib
import logging
import math
import re
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

import kvpush
import kvpush.driver as driver_mod
from kvpush.agent import SLOW_CALL_S
from kvpush.driver import LOOP_STALL_S
from tests.support.harness import make_cache

SHORT, LONG = 0.5, 10.0   # peer timeouts: the side that stalls, the side that does not
STALL_S = 3 * SHORT


def _stall(endpoint: kvpush.Producer | kvpush.Consumer) -> None:
    """Block ``endpoint``'s loop thread for STALL_S (as a long call inside it would)."""
    started = threading.Event()

    def block() -> None:
        started.set()
        time.sleep(STALL_S)

    endpoint._driver.call_soon(block)
    assert started.wait(5)
    time.sleep(STALL_S + 0.3)  # the stall, then a few liveness checks after it


@contextlib.contextmanager
def _pair(producer_timeout: float, consumer_timeout: float
          ) -> Iterator[tuple[kvpush.Producer, kvpush.Consumer, str]]:
    """A connected pair with these peer timeouts (the consumer heartbeats every 50 ms)."""
    src, dst = make_cache(num_blocks=8), make_cache(num_blocks=8)
    with kvpush.Producer(src.layout, kvpush.ProducerConfig(
            peer_timeout_s=producer_timeout)) as p, \
            kvpush.Consumer(dst.layout, kvpush.ConsumerConfig(
                peer_timeout_s=consumer_timeout, heartbeat_s=0.05)) as c:
        name = c.connect(p.address, timeout=10)
        time.sleep(0.2)                     # heartbeats answered
        yield p, c, name


def _push_works(p: kvpush.Producer, c: kvpush.Consumer, name: str, rid: str) -> None:
    h = c.expect(rid, np.array([0, 1]), name)
    p.prefill_done(rid, np.array([2, 3]))
    assert h.wait(10).state is kvpush.RequestState.READY


def test_a_stalled_consumer_keeps_a_producer_that_answered() -> None:
    with _pair(LONG, SHORT) as (p, c, name):
        _stall(c)
        assert c.stats()["peers_lost"] == 0, c.stats()
        assert c.producers() == [name]
        _push_works(p, c, name, "after-stall")


def test_a_stalled_producer_keeps_a_consumer_that_kept_sending() -> None:
    with _pair(SHORT, LONG) as (p, c, name):
        _stall(p)
        assert p.stats()["peers_lost"] == 0, p.stats()
        _push_works(p, c, name, "after-stall")


def test_a_silent_producer_is_still_lost_in_time() -> None:
    """The other half: a producer that stops answering (its process stopped here by
    stalling its loop past the consumer's timeout) is lost about peer_timeout_s after the
    first unanswered Heartbeat."""
    with _pair(LONG, SHORT) as (p, c, _):
        t0 = time.monotonic()
        _stall(p)
        assert c.stats()["peers_lost"] == 1, c.stats()
        assert c.producers() == []
        assert time.monotonic() - t0 < STALL_S + 2


def test_a_stalled_loop_iteration_is_logged_with_where_its_time_went(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stall itself is visible: the iteration that overran LOOP_STALL_S is counted
    and logged with its parts (here a command), and a slow NIXL connection call names
    itself (how the CI stall above would be found next time)."""
    monkeypatch.setattr(driver_mod, "STALL_LOG_EVERY_S", 0.0)  # every stall logged here
    src = make_cache(num_blocks=8)
    with caplog.at_level(logging.WARNING, logger="kvpush"), kvpush.Producer(src.layout) as p:
        before = p.stats()["loop_stalls"]
        started = threading.Event()

        def block() -> None:
            started.set()
            time.sleep(2 * LOOP_STALL_S)

        p._driver.call_soon(block)
        assert started.wait(5)
        deadline = time.monotonic() + 5
        while p.stats()["loop_stalls"] == before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert p.stats()["loop_stalls"] > before
        p._driver.call_and_wait(lambda: p._agent._timed("remove_remote_agent(x)", time.sleep,
                                                  2 * SLOW_CALL_S), 5)
    lines = [r.getMessage() for r in caplog.records]
    assert any(re.search(r"one loop iteration took .*\(commands (0\.[2-9]|[1-9])", m)
               for m in lines), lines
    assert any("NIXL remove_remote_agent(x) took" in m for m in lines), lines


def test_stall_lines_are_rate_limited_and_count_what_they_left_out(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_cache(num_blocks=8)
    with caplog.at_level(logging.WARNING, logger="kvpush"), kvpush.Producer(src.layout) as p:
        def stall() -> None:
            p._driver._stalled(0.5, (("commands", 0.5),))

        monkeypatch.setattr(driver_mod, "STALL_LOG_EVERY_S", 3600.0)
        def fresh() -> None:  # as if nothing was logged yet (a real stall may have been)
            p._driver._stall_logged, p._driver._stalls_unlogged = -math.inf, 0

        p._driver.call_and_wait(fresh, 5)
        p._driver.call_and_wait(stall, 5)                        # logged
        p._driver.call_and_wait(stall, 5)                        # within the hour: counted only
        monkeypatch.setattr(driver_mod, "STALL_LOG_EVERY_S", 0.0)
        p._driver.call_and_wait(stall, 5)                        # logged, naming the one left out
    lines = [r.getMessage() for r in caplog.records if "took 0.500 s" in r.getMessage()]
    assert len(lines) == 2, lines
    assert "more since" not in lines[0] and re.search(r"; [1-9]\d* more since", lines[1])


def test_a_slow_post_names_itself(caplog: pytest.LogCaptureFixture,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A post that holds the loop thread past SLOW_POST_S (it waited on UCX, beyond any
    copy) is logged with its peer, so a loop stall in "commands" says which call it was."""
    import kvpush.agent as agent_mod
    monkeypatch.setattr(agent_mod, "SLOW_POST_S", 0.0)     # every post counts as slow here
    src, dst = make_cache(num_blocks=8), make_cache(num_blocks=8)
    with caplog.at_level(logging.WARNING, logger="kvpush"), \
            kvpush.Producer(src.layout) as p, kvpush.Consumer(dst.layout) as c:
        name = c.connect(p.address, timeout=10)
        handle = c.expect("slow", [1, 2], name)
        p.prefill_done("slow", [3, 4])
        assert handle.wait(10).state is kvpush.RequestState.READY
    lines = [r.getMessage() for r in caplog.records]
    assert any(re.search(rf"NIXL WRITE to {re.escape(c.name)} of \d+ descriptor\(s\) took",
                         m) for m in lines), lines
