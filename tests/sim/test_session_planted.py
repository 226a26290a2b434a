"""The simulator runs the real peer-session machines (kvpush.protocol.session): a handshake
bug planted in that module is reported by a run shaped as `.ci/run-sim`'s first one (seed
1, every fault, a key; fewer requests), and the same run without the plant reports none.

Among the plants, the old behaviour of a consumer that dials a producer under a second
spelling of its address (host name and IP): each spelling its own connection, so the
producer takes the second Hello for a reconnect and drops the first session, and the
consumer takes the second HelloAck for a restart; pending requests fail (fault ``twin``)."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import pytest

from kvpush.protocol import session
from kvpush.testing import Faults, Simulation
from kvpush.testing.driver import Endpoint


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


def twins_not_joined(mp: pytest.MonkeyPatch) -> None:
    """The consumer never joins a second spelling of a producer's address to the session
    that reaches it: every spelling says its own Hello."""
    mp.setattr(session.Dialers, "_twin", lambda self, d: None)


def instance_per_probe(mp: pytest.MonkeyPatch) -> None:
    """The producer's Challenge names a new instance each time: a consumer cannot tell
    that two spellings reach one producer."""
    mp.setattr(session.Acceptor, "instance",
               property(lambda self: self.cfg.nonce(), lambda self, value: None),
               raising=False)


PLANTED: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    "challenge_not_checked": challenge_not_checked,
    "silence_not_judged": silence_not_judged,
    "twins_not_joined": twins_not_joined,
    "instance_per_probe": instance_per_probe,
}
#: what a second spelling dialled as a connection of its own breaks
TWIN_KINDS = {"two_connections", "false_restart"}


@pytest.mark.parametrize("plant", sorted(PLANTED))
def test_planted_session_bug_is_reported(plant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    PLANTED[plant](monkeypatch)
    sim = _run()
    assert sim.checker.violations, f"the simulator missed a planted session bug: {plant}"


@pytest.mark.parametrize("plant", ["twins_not_joined", "instance_per_probe"])
def test_a_second_spelling_dialled_as_its_own_connection_is_reported(
        plant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    PLANTED[plant](monkeypatch)
    sim = _run()
    assert sim.checker.kinds()[:1] and sim.checker.kinds()[0] in TWIN_KINDS, \
        sim.checker.violations[:1]


def test_the_restart_a_second_spelling_causes_is_seen_on_both_sides(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the check of one connection per producer (the mechanism), what the user
    sees is caught: the producer drops a session its consumer still holds, and the
    consumer takes a producer that runs as it did for restarted."""
    twins_not_joined(monkeypatch)
    monkeypatch.setattr(Endpoint, "_check_one_connection", lambda self, address: None)
    sim = _run(stop_after=0, requests=300)
    details = [v.detail for v in sim.checker.violations if v.kind == "false_restart"]
    assert any(" drops " in d for d in details), sim.checker.violations[:3]     # producer
    assert any(" takes " in d for d in details), sim.checker.violations[:3]     # consumer


@pytest.mark.parametrize("seed", [1, 2])
def test_regression_a_second_spelling_joins_the_first_connection(
        seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Second spellings dialled often, mid-handshake and with requests in flight, with
    cuts, kills and stalls: one connection per producer, no restart seen -- and the same
    seed reports the old behaviour (each spelling its own connection)."""
    faults = Faults(enabled=frozenset({"twin", "cut", "kill", "stall"}), twin_rate=4.0,
                    twin_p=0.5)

    def run() -> Simulation:
        sim = Simulation(seed, requests=500, faults=faults, out=io.StringIO(), stop_after=1)
        sim.run()
        return sim

    sim = run()
    assert sim.checker.kinds() == [], sim.checker.violations[:1]
    assert sim.stats["twin_joined"] > 0 and sim.stats["twin_joined_dialling"] > 0
    assert sim.stats["twin_with_requests_open"] > 0
    twins_not_joined(monkeypatch)
    assert run().checker.kinds()[0] in TWIN_KINDS


def test_unplanted_run_reports_nothing() -> None:
    sim = _run(stop_after=0)
    assert not sim.checker.violations, sim.checker.violations[:3]
    assert sim.stats["fault_forge"] > 0   # attackers were there
    assert sim.stats["twin_joined"] > 0 and sim.stats["twin_joined_dialling"] > 0
    assert sim.issued == 3000


def test_without_a_key_the_sessions_run_too() -> None:
    sim = Simulation(2, requests=1000, faults=Faults.parse("all"), out=io.StringIO(),
                     auth=False)
    assert sim.run() == 0, sim.checker.violations[:3]
    assert sim.auth_key is None and sim.stats["fault_forge"] == 0
