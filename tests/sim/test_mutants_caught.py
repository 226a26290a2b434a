"""The simulator finds the bugs the protocol cores guard against: each guard is reverted here
by patching the real ProducerCore (or ConsumerCore), and the CI-sized runs of `.ci/run-sim`
(``CI_RUNS``, every fault; or the run named) must report a violation. A mutant the simulator did
not catch would mean its faults or invariants miss that class of bug."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvpush.protocol import producer as core
from kvpush.protocol.effects import Emit, XferEnd
from kvpush.request import Release, ReleaseReason
from kvpush.testing import Faults, Simulation, Timings
from kvpush.testing.sim import main
from tests.support import ci_sim_runs

P = core.ProducerCore


def tombstones_forever(mp: pytest.MonkeyPatch) -> None:
    """Tombstones are honoured forever (their expiry never removes them)."""
    orig = P._tomb

    def tomb(self: Any, req: Any, code: str, why: str, state: Any = core.State.ENDED) -> None:
        orig(self, req, code, why, state)
        core._cancel(req.tomb)
    mp.setattr(P, "_tomb", tomb)


def nobody_owns(mp: pytest.MonkeyPatch) -> None:
    """A PullDone from any consumer ends the source, whoever else still reads it."""
    orig = P._on_pull_done

    def pull_done(self: Any, req: Any, peer: str, msg: Any) -> None:
        orig(self, req, peer, msg)
        if req.source is not None and (peer, msg.xid) not in req.done_owners:
            self._release(req, ReleaseReason.TRANSFERRED)
    mp.setattr(P, "_on_pull_done", pull_done)


def layerwise_held_again(mp: pytest.MonkeyPatch) -> None:
    """A layer_done after a layer-wise push ended holds the blocks again."""
    orig = P._on_layer_done

    def layer_done(self: Any, req: Any, ids: np.ndarray, layer: int, sid: int) -> None:
        if req.state is core.State.RELEASED_EARLY:
            req.state = core.State.ENDED
        orig(self, req, ids, layer, sid)
    mp.setattr(P, "_on_layer_done", layer_done)


def freed_while_read(mp: pytest.MonkeyPatch) -> None:
    """A silent consumer's READs are given up at once (its blocks freed), and no
    hold is promised (the consumer trusts a READ however late it ends)."""
    orig = P.peer_lost
    mp.setattr(P, "peer_lost", lambda self, now, peer, why, abandon=False:
               orig(self, now, peer, why, abandon=True))
    mp.setattr(P, "_hold_s", lambda self: 1e9)


def second_prefill_releases(mp: pytest.MonkeyPatch) -> None:
    """A second prefill_done releases the blocks it names, held or not."""
    orig = P._on_prefill_done

    def prefill_done(self: Any, req: Any, ids: np.ndarray, *args: Any) -> None:
        if req.state in (core.State.HELD, core.State.ENDING):
            self._out.append(Emit(Release(req.rid, ReleaseReason.FAILED, ids, "duplicate")))
            return
        orig(self, req, ids, *args)
    mp.setattr(P, "_on_prefill_done", prefill_done)


def abandoned_write_released(mp: pytest.MonkeyPatch) -> None:
    """An abandoned WRITE's source goes back at once (no fence)."""
    orig = P.transfer_ended

    def transfer_ended(self: Any, now: float, key: int, end: XferEnd) -> None:
        orig(self, now, key, XferEnd.ERROR if end is XferEnd.ABANDONED else end)
    mp.setattr(P, "transfer_ended", transfer_ended)


#: .ci/run-sim's two runs (keep in step with it)
CI_RUNS: list[dict[str, Any]] = [
    {"seed": 1, "requests": 20000},
    {"seed": 2, "requests": 3000, "producers": 16, "consumers": 16,
     "timings": Timings(tp=2, ctp=2)},
]

MUTANTS: list[Callable[[pytest.MonkeyPatch], None]] = [
    tombstones_forever, nobody_owns, layerwise_held_again, freed_while_read,
    second_prefill_releases, abandoned_write_released]


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda f: f.__name__)
def test_the_ci_sized_simulation_catches_the_reverted_fix(
        mutant: Callable[[pytest.MonkeyPatch], None], monkeypatch: pytest.MonkeyPatch) -> None:
    mutant(monkeypatch)
    for run in CI_RUNS:  # the two runs of .ci/run-sim, in order, until one finds it
        out = io.StringIO()   # (stopped at the first violation: the same run, cut short)
        if Simulation(out=out, faults=Faults.parse("all"), stop_after=1,
                      **run).run() > 0:  # type: ignore[arg-type]
            return
    raise AssertionError(f"{mutant.__name__}: no violation in the CI-sized runs")


def claims_dropped_untold(mp: pytest.MonkeyPatch) -> None:
    """A consumer's claim over several producers, given up because one of them was lost or
    refused it, is given up at none of the others (only the engine's abort tells them):
    each holds its source for the claim up to ``max_wait_s``."""
    from kvpush import messages as m
    from kvpush.protocol import consumer as ccore
    from kvpush.protocol.effects import Send

    C = ccore.ConsumerCore
    end_claim = C._end_claim

    def untold(self: Any, now: float, req: Any, why: str, by: str | None = None,
               tell: bool = True) -> None:
        end_claim(self, now, req, why, by, tell=False)

    def abort_claim(self: Any, now: float, rid: str, xid: int, reason: str) -> None:
        claim = self._claims.get(rid)
        if claim is None or claim.xid != xid:
            return
        sent = claim.phase is ccore.Phase.CLAIMED
        self._event(now, claim, ccore.Event.ABORT, why=reason)
        for name in claim.sids if sent else ():
            if name in self._peers:
                self._out.append(Send(name, m.Abort(rid, xid, reason)))
    mp.setattr(C, "_end_claim", untold)
    mp.setattr(C, "abort_claim", abort_claim)


def test_the_ci_run_over_four_producer_ranks_catches_claims_dropped_untold(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`.ci/run-sim`'s run with four producer ranks per request and the library's order of
    timeouts (where ``max_wait_s`` is far above a lease) reports a source held for a claim
    its consumer gave up, in its first 2,000 requests: the checker bounds a claimed source
    by ``max_wait_s`` only while its consumer still has the claim."""
    claims_dropped_untold(monkeypatch)
    (args,) = [a for a in ci_sim_runs() if a[a.index("--seed") + 1] == "192"]
    args[args.index("--requests") + 1] = "2000"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*args, "--stop-after", "1"]) == 1
    assert "VIOLATION never_released" in out.getvalue()


def fence_said_once(mp: pytest.MonkeyPatch) -> None:
    """A fencing owner's Failed(unfenced) is never said again: an Abort lost with its
    connection leaves the source held until ``max_wait_s``."""
    mp.setattr(P, "_resend_later", lambda self, owner, failed: None)


def claim_abort_said_once(mp: pytest.MonkeyPatch) -> None:
    """A claim given up is told its producers once: an Abort lost with its connection
    leaves the source held for the claim until ``max_wait_s``."""
    from kvpush import messages as m
    from kvpush.protocol.consumer import ConsumerCore
    from kvpush.protocol.effects import Send

    def once(self: Any, now: float, key: tuple[str, str, int], why: str) -> None:
        peer, rid, xid = key
        self._out.append(Send(peer, m.Abort(rid, xid, why)))
    mp.setattr(ConsumerCore, "_say_claim_gone", once)


@pytest.mark.parametrize("mutant", [fence_said_once, claim_abort_said_once],
                         ids=lambda f: f.__name__)
def test_the_ci_run_of_resets_catches_a_long_wait_ended_by_one_frame(
        mutant: Callable[[pytest.MonkeyPatch], None], monkeypatch: pytest.MonkeyPatch) -> None:
    """`.ci/run-sim`'s run with connections reset 400 times a simulated second: a frame
    that ends a long wait (a fencing owner's Failed(unfenced), a given-up claim's Abort),
    lost in a reset and never said again, leaves a source held past its bound (found in
    ``--requests 20000 --seed 251 --faults all --timings library --rate 3000 --kv-apart
    --verify``: the Abort that answers a Failed(unfenced), lost 2 ms after it was sent)."""
    mutant(monkeypatch)
    (args,) = [a for a in ci_sim_runs() if a[a.index("--seed") + 1] == "320"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*args, "--stop-after", "1"]) == 1
    assert "VIOLATION never_released" in out.getvalue()


def test_a_run_stopped_at_a_violation_is_the_whole_run_cut_short(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``stop_after`` (what the test above uses) ends a run after the step that found its
    n-th violation: the violations it reports are the whole run's first ones (n, or more
    when that step found several), word for word, found in fewer steps."""
    second_prefill_releases(monkeypatch)

    def sim(stop_after: int = 0) -> Simulation:
        s = Simulation(1, requests=1000, faults=Faults.parse("all"), out=io.StringIO(),
                       stop_after=stop_after)
        s.run()
        return s

    whole = sim()
    assert len(whole.checker.violations) >= 3 and not whole.stopped_early
    for n in (1, 2):
        cut = sim(n)
        assert cut.stopped_early and cut.sched.steps < whole.sched.steps
        # the step that found the n-th violation runs to its end (and may find more)
        found = [str(v) for v in cut.checker.violations]
        assert len(found) >= n and found == [str(v) for v in whole.checker.violations[:len(found)]]
        assert "stopped_at_violation" in cut.details()
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="stop_after"):
            Simulation(1, stop_after=bad)  # type: ignore[arg-type]
