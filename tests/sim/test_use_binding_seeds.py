"""Seeds that failed before every owner was bound to one use and an engine's abort ended a
use for good, and the release bound per source kind catching a planted regression.

Each seed failed on the ProducerCore before that change (loaded in the same simulation):
``inuse`` with ``ready_without_source`` (a registration of a new use of the id, made while
the producer held the previous use for its second sharer, got the previous use's bytes),
``order`` with ``release_not_held`` (an engine's prefill_done after its abort of a
layer-wise use was taken as a new use: its blocks were released twice, "aborted" then
"lease_expired")."""

from __future__ import annotations

import io
from typing import Any

import pytest

from kvpush.protocol.producer import CoreConfig, ProducerCore
from kvpush.testing import Faults, Simulation, Timings
from tests.support import ci_sim_runs


def _run(seed: int, faults: Faults, requests: int = 300, **kw: Any) -> Simulation:
    sim = Simulation(seed, requests=requests, faults=faults, out=io.StringIO(), **kw)
    sim.run()
    return sim


@pytest.mark.parametrize("seed", [0, 1])
def test_a_new_use_of_an_id_held_for_its_second_sharer_gets_its_own_bytes(seed: int) -> None:
    sim = _run(seed, Faults(enabled=frozenset({"sharers", "inuse"}), sharers_p=0.5))
    assert sim.checker.kinds() == []
    assert sim.stats["fault_inuse"] > 0


@pytest.mark.parametrize("seed", [1, 2])
def test_a_prefill_done_after_the_engines_abort_releases_once(seed: int) -> None:
    sim = _run(seed, Faults(enabled=frozenset({"pabort", "order"}), pabort_p=0.3))
    assert sim.checker.kinds() == []
    assert sim.stats["fault_order"] > 0


def _held_for_max_wait(ep: Any) -> ProducerCore:
    """A planted regression: every source held for max_wait_s, claimed or not."""
    t = ep.sim.timings
    return ProducerCore(ep.layout, CoreConfig(
        lease_s=t.max_wait_s, max_wait_s=t.max_wait_s, transfer_timeout_s=t.transfer_timeout_s,
        tombstone_s=t.tombstone_s, peer_timeout_s=t.peer_timeout_s), ep.links)


def test_an_unclaimed_source_held_for_max_wait_s_is_caught_by_the_ci_run() -> None:
    """.ci/run-sim's first run with the library's order of timeouts (its default producers
    and consumers)."""
    args = next(a for a in ci_sim_runs()
                if "--timings" in a and a[a.index("--timings") + 1] == "library")
    seed, requests = int(args[args.index("--seed") + 1]), int(args[args.index("--requests") + 1])
    sim = Simulation(seed, requests=requests, timings=Timings().with_order("library", seed),
                     make_producer=_held_for_max_wait, stop_after=1, out=io.StringIO())
    sim.run()
    assert sim.checker.kinds() == ["never_released"]



@pytest.mark.parametrize("seed", [3, 4])
def test_timeouts_in_an_order_drawn_from_the_seed(seed: int) -> None:
    sim = _run(seed, Faults(), requests=1000, timings=Timings().with_order("drawn", seed))
    assert sim.checker.kinds() == []
    assert sim.finished == sim.issued == 1000      # requests that ran, not arrivals
    assert sim.stats["skipped"] > 0
