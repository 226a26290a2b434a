"""The simulator runs the production loop (kvpush.driver.Driver) and the sessions over their
sockets (kvpush.sessions), not a copy of them: a bug planted in either is reported by a run
shaped as `.ci/run-sim`'s first one (seed 1, every fault, a key; 6,000 of its 16,000
requests, stopped at the first violation), and the same run without a plant reports none
(tests/sim/test_session_planted.py)."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import pytest

from kvpush import driver, sessions
from kvpush.protocol.effects import XferEnd
from kvpush.testing import Faults, Simulation


def _run(requests: int = 6000) -> Simulation:
    sim = Simulation(1, requests=requests, faults=Faults.parse("all"), out=io.StringIO(),
                     stop_after=1)
    sim.run()
    return sim


def liveness_checked_once(mp: pytest.MonkeyPatch) -> None:
    """The producer judges its consumers' silence once, and never arms the next check."""
    def check_peers(self: Any) -> None:
        self._driver.read_waiting()
        self._carry_out(self.machine.check(self._driver.clock()))
    mp.setattr(sessions.Accepting, "_check_peers", check_peers)


def connects_never_answered(mp: pytest.MonkeyPatch) -> None:
    """A consumer's session comes up, but the connect() calls and the core's Dials
    waiting on it are never told."""
    mp.setattr(sessions.Dialing, "_resolve", lambda self, address, name, error: None)


def abandoned_write_reported_done(mp: pytest.MonkeyPatch) -> None:
    """The driver gives up a transfer still moving (its deadline passed, its peer is gone)
    and tells the core it ended DONE: its bytes may still land."""
    orig = driver.Driver._end_xfer

    def abandon(self: Any, key: int) -> None:
        handle = self._xfers.get(key)
        if handle is not None and self.agent.release(handle):
            orig(self, key, XferEnd.DONE)
    mp.setattr(driver.Driver, "_abandon", abandon)


def failed_transfer_reported_done(mp: pytest.MonkeyPatch) -> None:
    """The driver reports every transfer's end as DONE, a failed one too."""
    orig = driver.Driver._end_xfer

    def end_xfer(self: Any, key: int, end: XferEnd) -> None:
        orig(self, key, XferEnd.DONE)
    mp.setattr(driver.Driver, "_end_xfer", end_xfer)


def outbox_never_retried(mp: pytest.MonkeyPatch) -> None:
    """Control frames ZeroMQ refused at the high-water mark wait in the outbox, and are
    never retried: only a peer's loss clears them."""
    def flush(self: Any) -> None:
        self._flush_timer = None
    mp.setattr(driver.Driver, "_flush", flush)


def frames_overtake_the_outbox(mp: pytest.MonkeyPatch) -> None:
    """A control frame goes out at once when ZeroMQ takes it, ahead of frames for the same
    peer still waiting in the outbox (a Failed overtaking its Posted)."""
    orig = driver.Driver.send_frame

    def send_frame(self: Any, sock: Any, frame: bytes, identity: bytes | None = None) -> None:
        if not self.try_send(sock, frame, identity):
            orig(self, sock, frame, identity)
    mp.setattr(driver.Driver, "send_frame", send_frame)


PLANTED: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    "liveness_checked_once": liveness_checked_once,
    "connects_never_answered": connects_never_answered,
    "abandoned_write_reported_done": abandoned_write_reported_done,
    "failed_transfer_reported_done": failed_transfer_reported_done,
    "outbox_never_retried": outbox_never_retried,
    "frames_overtake_the_outbox": frames_overtake_the_outbox,
}


@pytest.mark.parametrize("plant", sorted(PLANTED))
def test_planted_driver_or_sessions_bug_is_reported(plant: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    PLANTED[plant](monkeypatch)
    sim = _run()
    assert sim.checker.violations, f"the simulator missed a bug planted in the loop: {plant}"
