"""Every owner is bound to one use of its source, and an engine's abort ends a use for good
(sans-IO, on the real ProducerCore): a message of one use never attaches to another, and a
use's blocks are released exactly once whatever order the engine calls in."""

from __future__ import annotations

import numpy as np

from kvpush import messages as m
from kvpush.protocol.effects import XferEnd
from kvpush.request import ReleaseReason, TransferMode
from tests.support.cores import LAYERS, Harness


def test_a_reused_id_is_not_admitted_as_a_sharer_of_the_previous_use() -> None:
    """sharers=2: A took its share of use 1, B has not come yet. A's registration of a new
    use of the id waits for use 1's release instead of taking B's place (it got use 1's
    bytes, and B then got the new use's)."""
    h = Harness()
    h.register("A", "r", 1, [1, 2], sharers=2)
    h.prefill("r", [5, 6], sid=7)
    h.end_writes()                                   # A's share of use 1 is done
    h.register("A", "r", 2, [3, 4], sharers=2)       # use 2 of "r", from A
    assert len(h.posts()) == 1                       # nothing of use 1 goes to use 2
    assert h.sent(m.Failed) == []
    h.register("B", "r", 3, [8, 9], sharers=2)       # use 1's second sharer
    (write_b,) = h.posts()[1:]
    assert write_b.peer == "B" and write_b.notif.xid == 3
    h.end_writes()
    (release,) = h.releases()
    assert release.sid == 7 and release.reason is ReleaseReason.TRANSFERRED
    assert set(release.xids) == {1, 3}
    h.prefill("r", [10, 11], sid=8)                  # use 2's source
    (write_a2,) = h.posts()[2:]
    assert write_a2.peer == "A" and write_a2.notif.xid == 2
    h.end_writes()
    h.register("B", "r", 4, [12, 13], sharers=2)     # use 2's second sharer
    h.end_writes()
    assert [(r.sid, set(r.xids)) for r in h.releases()] == [(7, {1, 3}), (8, {2, 4})]
    assert h.sent(m.Failed) == []


def test_a_waiting_registration_of_the_next_use_ends_with_its_consumer() -> None:
    """A registration waiting for the next use is given up by its Abort or its consumer's
    loss: nothing of it is left, and the next use starts without it."""
    h = Harness()
    h.register("A", "r", 1, [1], sharers=2)
    h.prefill("r", [5], sid=7)
    h.end_writes()
    h.register("A", "r", 2, [3], sharers=2)
    h.core.on_message(h.now, "A", m.Abort("r", 2, "gave up"))
    h.run()
    assert [a.xid for a in h.sent(m.AbortAck)] == [2]
    h.advance(11.0)                                  # use 1's lease ends: released
    assert [r.reason for r in h.releases()] == [ReleaseReason.TRANSFERRED]
    h.prefill("r", [6], sid=8)
    assert len(h.posts()) == 1                       # the aborted xid 2 got nothing
    h.advance(11.0)                                  # use 2's lease, then its tombstone
    h.advance(6.0)
    assert h.core.records() == 0 and h.core.held() == 0


def test_a_retry_after_a_timed_out_registration_is_served() -> None:
    """The consumer's registration of a use timed out (its Abort came) before the prefill:
    its retry, a new xid from the same endpoint, takes that use's share (it was refused
    "not_owner" until the tombstone went)."""
    h = Harness()
    h.register("A", "r", 1, [1, 2])
    h.core.on_message(h.now, "A", m.Abort("r", 1, "timeout"))
    h.run()
    h.register("A", "r", 2, [1, 2])                  # the engine retries
    assert h.sent(m.Failed) == []
    h.prefill("r", [5, 6])
    (post,) = h.posts()
    assert post.notif.xid == 2
    h.end_writes()
    assert [r.reason for r in h.releases()] == [ReleaseReason.TRANSFERRED]


def layerwise_partial(h: Harness) -> None:
    h.register("A", "r", 1, [1, 2], groups=LAYERS)
    h.core.layer_done(h.now, "r", np.array([5, 6]), 0, 7)
    h.run()
    h.end_writes()


def test_an_aborted_layerwise_use_takes_its_late_prefill_done_as_its_own() -> None:
    """abort() in PARTIAL releases the layers handed over (ABORTED); the engine's
    prefill_done for that use, made after its abort, is swallowed: not a new use whose
    blocks are held again and released a second time (lease_expired)."""
    h = Harness()
    layerwise_partial(h)
    h.core.abort(h.now, "r", "engine gave up")
    h.run()
    h.prefill("r", [5, 6], sid=7)
    h.advance(30.0)                                  # past any lease and tombstone
    assert [r.reason for r in h.releases()] == [ReleaseReason.ABORTED]
    assert h.core.records() == 0 and h.core.held() == 0


def test_an_abort_after_an_early_release_keeps_the_use_ended_for_its_prefill_done() -> None:
    """A layer-wise use released early (its registration's wait ran out before
    prefill_done), then aborted by the engine, then its prefill_done: one release."""
    h = Harness()
    h.register("A", "r", 1, [1, 2], groups=LAYERS, wait_s=1.0)
    h.core.layer_done(h.now, "r", np.array([5, 6]), 0, 7)
    h.run()
    h.end_writes()
    h.advance(1.5)                                   # the wait runs out: released early
    assert [r.reason for r in h.releases()] == [ReleaseReason.FAILED]
    h.core.abort(h.now, "r", "engine gave up")
    h.run()
    h.prefill("r", [5, 6], sid=7)
    h.advance(30.0)
    assert len(h.releases()) == 1
    assert h.core.records() == 0 and h.core.held() == 0


def test_a_double_abort_and_a_late_prefill_done_release_once() -> None:
    h = Harness()
    h.register("A", "r", 1, [1, 2])
    h.core.abort(h.now, "r", "once")
    h.core.abort(h.now, "r", "twice")
    h.run()
    h.prefill("r", [5, 6], sid=7)
    h.advance(30.0)
    assert [r.reason for r in h.releases()] == [ReleaseReason.ABORTED]
    assert h.core.records() == 0


def test_an_abort_while_writing_layers_then_prefill_done_releases_once() -> None:
    h = Harness()
    h.register("A", "r", 1, [1, 2], groups=LAYERS)
    h.core.layer_done(h.now, "r", np.array([5, 6]), 0, 7)
    h.run()                                          # layer 0's WRITE in flight
    h.core.abort(h.now, "r", "engine gave up")
    h.run()
    h.prefill("r", [5, 6], sid=7)
    h.end_writes(XferEnd.DONE)
    h.advance(30.0)
    assert [r.reason for r in h.releases()] == [ReleaseReason.ABORTED]
    assert h.core.records() == 0 and h.core.held() == 0
    assert TransferMode.PUSH in {r.mode for r in h.releases()}


def test_a_registration_naming_its_source_use_never_attaches_to_another() -> None:
    """sharers=2, use 1 (sid 7) held for its second sharer. A registration that names use 2
    (sid 8), from an endpoint with no share of use 1, waits for use 2 instead of taking
    use 1's second share; use 1's own late sharer still gets use 1."""
    h = Harness()
    h.register("A", "r", 1, [1], sharers=2, sid=7)
    h.prefill("r", [5], sid=7)
    h.end_writes()
    h.register("B", "r", 2, [3], sharers=2, sid=8)    # use 2, from B
    assert len(h.posts()) == 1 and h.sent(m.Failed) == []
    h.register("B", "r", 3, [4], sharers=2, sid=7)    # use 1's own second sharer
    (write,) = h.posts()[1:]
    assert write.notif.xid == 3
    h.end_writes()
    assert [(r.sid, set(r.xids)) for r in h.releases()] == [(7, {1, 3})]
    h.prefill("r", [9], sid=8)
    (write2,) = h.posts()[2:]
    assert write2.notif.xid == 2 and write2.peer == "B"


def test_a_registration_naming_an_earlier_use_is_refused_when_another_comes() -> None:
    h = Harness()
    h.register("A", "r", 1, [1], sid=7)
    h.prefill("r", [5], sid=8)                        # another use of the id came
    assert h.posts() == []
    (failed,) = h.sent(m.Failed)
    assert failed.xid == 1 and failed.code == "not_held"


def test_a_prefill_done_later_than_tombstone_s_after_an_early_release_is_still_its_uses() -> None:
    """A layer-wise prefill can outlive its registration's wait by more than tombstone_s
    (the library's defaults: a 120 s request timeout, tombstone_s 120 s): its prefill_done
    is that use's, not a new use whose blocks are held again and released twice."""
    h = Harness(tombstone_s=0.5)
    h.register("A", "r", 1, [1, 2], groups=LAYERS, wait_s=1.0)
    h.core.layer_done(h.now, "r", np.array([5, 6]), 0, 7)
    h.run()
    h.end_writes()
    h.advance(1.5)                                   # the wait runs out: released early
    h.advance(0.6)                                   # past tombstone_s
    h.advance(0.1)
    h.prefill("r", [5, 6], sid=7)
    h.advance(11.0)                                  # past a lease
    assert len(h.releases()) == 1


def test_a_registration_naming_another_use_than_a_partial_one_is_refused() -> None:
    h = Harness()
    h.core.layer_done(h.now, "r", np.array([5, 6]), 0, 7)    # use 7, layer by layer
    h.run()
    h.register("A", "r", 1, [1, 2], groups=LAYERS, sid=8)
    assert h.posts() == []
    (failed,) = h.sent(m.Failed)
    assert (failed.xid, failed.code) == (1, "not_held")


def test_layers_handed_after_an_early_abort_come_back_when_the_engine_aborts_again() -> None:
    """The engine aborts a use before its prefill (a registration is waiting), then hands
    layers of the id (a late call, or a new use while the abort's tombstone stands) and
    aborts again instead of calling prefill_done. The layers' blocks come back once,
    ABORTED, and the late prefill_done and abort change nothing (they were swallowed, and
    the blocks stayed with nobody)."""
    h = Harness()
    h.register("A", "r", 1, [1, 2], groups=LAYERS)
    h.core.abort(h.now, "r", "engine gave up")
    h.run()
    assert [f.code for f in h.sent(m.Failed)] == ["aborted"]
    h.core.layer_done(h.now, "r", np.array([5, 6]), 0, 9)
    h.core.layer_done(h.now, "r", np.array([5, 6]), 1, 9)
    h.core.abort(h.now, "r", "engine gave up again")
    h.run()
    (release,) = h.releases()
    assert release.reason is ReleaseReason.ABORTED
    assert release.block_ids.tolist() == [5, 6] and release.sid == 9
    h.prefill("r", [5, 6], sid=9)                   # the use's own, late
    h.advance(30.0)                                  # past any lease and tombstone
    assert len(h.releases()) == 1 and h.core.held() == 0 and h.core.records() == 0
    assert h.posts() == []
