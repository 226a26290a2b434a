"""The simulator runs the real peer-session machines (kvpush.protocol.session): a handshake
bug planted in that module is reported by a run shaped as `.ci/run-sim`'s first one (seed
1, every fault, a key; fewer requests), and the same run without the plant reports none."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import pytest

from kvpush.protocol import session
from kvpush.testing import Faults, Simulation


def _run(requests: int = 3000, stop_after: int = 1) -> Simulation:
    sim = Simulation(1, requests=requests, faults=Faults.parse("all"), out=io.StringIO(),
                     stop_after=stop_after)
    sim.run()
    return sim


def challenge_not_checked(mp: pytest.MonkeyPatch) -> None:
    """The producer takes a Hello whatever challenge it answers: a Hello captured on its
    way to one producer is accepted by another that shares the key and port."""
    orig = session.Acceptor.check_hello

    def check_hello(self: Any, now: float, msg: Any) -> Any:
        mp.setattr(self.challenges, "redeem", lambda nonce, now=None: None)
        try:
            return orig(self, now, msg)
        finally:
            mp.delattr(self.challenges, "redeem")
    mp.setattr(session.Acceptor, "check_hello", check_hello)


def silence_not_judged(mp: pytest.MonkeyPatch) -> None:
    """The producer never drops a silent consumer."""
    mp.setattr(session.Acceptor, "check", lambda self, now: [])


PLANTED: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    "challenge_not_checked": challenge_not_checked,
    "silence_not_judged": silence_not_judged,
}


@pytest.mark.parametrize("plant", sorted(PLANTED))
def test_planted_session_bug_is_reported(plant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    PLANTED[plant](monkeypatch)
    sim = _run()
    assert sim.checker.violations, f"the simulator missed a planted session bug: {plant}"


def test_unplanted_run_reports_nothing() -> None:
    sim = _run(stop_after=0)
    assert not sim.checker.violations, sim.checker.violations[:3]
    assert sim.stats["fault_forge"] > 0   # attackers were there
    assert sim.issued == 3000


def test_without_a_key_the_sessions_run_too() -> None:
    sim = Simulation(2, requests=1000, faults=Faults.parse("all"), out=io.StringIO(),
                     auth=False)
    assert sim.run() == 0, sim.checker.violations[:3]
    assert sim.auth_key is None and sim.stats["fault_forge"] == 0
