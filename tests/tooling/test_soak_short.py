"""A short soak (``benchmarks/soak.py``): a couple of thousand requests across two network
namespaces with every kind of fault injected at least once; nothing lost, leaked, reported
twice or left running, memory flat after warm-up."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from benchmarks import soak
from tests.support.netns import netns_unavailable

pytestmark = [pytest.mark.netns, pytest.mark.timeout(240)]

REQUESTS = 2500


@pytest.fixture(scope="module")
def report() -> Iterator[dict[str, Any]]:
    reason = netns_unavailable()
    if reason is not None:
        pytest.skip(f"no network namespaces here: {reason}")
    yield soak.run(REQUESTS, seed=7, fault_every=350, warmup=300, all_faults=True,
                   progress=False)


def test_every_request_is_accounted_for(report: dict[str, Any]) -> None:
    assert set(report["global_faults"]) == set(soak.GLOBAL_FAULTS), report["global_faults"]
    done = (report["completed"] + report["failed_by_design"] + report["failed_unexpected"]
            + report["ready_but_corrupted"] + report["lost"])
    assert done == REQUESTS
    # the timeline says what the faults, the driver's slow calls and the losses did when
    assert report["lost"] == 0, (report["examples"].get("lost"), report["timeline"])
    assert report["double_reports"] == 0 and report["double_releases"] == 0
    assert report["blocks_leaked"] == 0
    assert report["pending_at_end"] == {"p0": 0, "p1": 0, "c0": 0, "c1": 0}
    assert report["completed"] > REQUESTS // 2
    assert report["push"] > 0 and report["pull"] > 0 and report["verified_share"] > 0.2


def test_nothing_left_running(report: dict[str, Any]) -> None:
    for label, final in report["nodes_at_close"].items():
        assert final == {"rc": 0, "live": {}, "threads": []}, (label, final)
    for label, threads in report["threads_at_end"].items():
        assert threads == ["MainThread", f"soak-{label}-loop"], (label, threads)


def test_memory_flat(report: dict[str, Any]) -> None:
    measured = {label: growth for label, growth in report["rss_growth_pct"].items()
                if growth is not None}  # None: that process crashed and restarted (below)
    assert measured, report["crashes"]
    for label, growth in measured.items():
        assert growth <= 5.0, (label, report["rss_kb"][label])


@pytest.mark.xfail(strict=False, reason="RELIABILITY.md, UCX's 'Endpoint timeout' abort: UCX "
                   "can abort the process (ucp_request.inl Fatal); the trigger the soak hit "
                   "after link cuts is avoided (0 aborts in 12 reproducer runs, 26 before), "
                   "but aborts kvpush cannot avoid remain (test_dataplane_child.py's strict "
                   "xfail; data_plane='child' contains them): not strict, it depends on what "
                   "the random faults hit")
def test_no_process_crashed_by_itself(report: dict[str, Any]) -> None:
    assert report["crashes"] == [], [(c["node"], c["what"], c["log"][-200:])
                                     for c in report["crashes"]]


@pytest.mark.xfail(strict=False, reason="NIXL 1.5.1: the flush-mode removal of a killed "
                   "peer's endpoint (when its new incarnation comes) can leave its TCP "
                   "connection open; a peer back after a cut keeps its endpoint and leaks "
                   "nothing (test_fault_matrix.py::test_link_cut_leaves_no_sockets_behind). "
                   "Depends on what the random faults hit, hence not strict")
def test_descriptors_flat(report: dict[str, Any]) -> None:
    for label, (start, end) in report["fds"].items():
        assert end <= start + 2, (label, start, end)


def test_no_corrupted_or_late_bytes(report: dict[str, Any]) -> None:
    """Nothing lands after a result (results wait for the transfer's real end; blocks of
    results that could not be fenced are quarantined, never handed out again)."""
    assert report["corrupted_bytes"] == 0 and report["late_landing_bytes"] == 0, (
        report["corrupted_bytes"], report["late_landing_bytes"])
    assert report["failed_unexpected"] == 0, report["examples"].get("unexpected")
