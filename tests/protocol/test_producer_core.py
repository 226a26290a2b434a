"""The producer's protocol core, sans-IO: tombstones that expire, sources owned by the
consumers that registered or pulled them, layer-wise sources released once, sources held
while a transfer may still read them, a second prefill_done, push claims -- each as the
event sequence that pins it, checked on the effects the core returns. No sockets, NIXL or
threads: events in, effects out. The same rules with real endpoints and NIXL:
``tests/processes/test_failures.py`` and ``tests/netns/test_fault_matrix.py``."""

from __future__ import annotations

import numpy as np
import pytest

from kvpush import messages as m
from kvpush.protocol.effects import Abandon, DropPeer, Send, XferEnd
from kvpush.protocol.producer import OWNER_TABLE, TABLE, OwnerState, ProducerCore, State
from kvpush.protocol.table import TransitionError
from kvpush.request import ReleaseReason, TransferMode
from tests.support.cores import LAYERS, NUM_BLOCKS, Harness, layout


def test_every_state_has_a_row_in_the_transition_table() -> None:
    assert set(TABLE.rows) == set(State)
    for table in (TABLE, OWNER_TABLE):
        for state, event, r in table.edges():
            assert r.handler is None or callable(getattr(ProducerCore, r.handler)), \
                (table.name, state, event)


def test_a_handler_that_leaves_its_row_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A registration's handler may leave WAITING only where the table says: one that
    ends the use is a bug, raised (the simulator reports it as a violation)."""
    def ends(self: ProducerCore, req: object, peer: str, msg: m.Register) -> None:
        req.state = State.ENDED  # type: ignore[attr-defined]
    monkeypatch.setattr(ProducerCore, "_on_register", ends)
    with pytest.raises(TransitionError, match="REGISTER in WAITING led to ENDED"):
        Harness().register("A", "r", 11, [1, 2])


def test_an_owner_change_outside_its_row_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """An owner still registered cannot be done on the consumer's Abort: only gone."""
    def done(self: ProducerCore, req: object, peer: str, msg: m.Abort) -> None:
        for owner in req.owners.values():  # type: ignore[attr-defined]
            self._to(owner, OwnerState.DONE)
    h = Harness()
    h.register("A", "r", 11, [1, 2])
    monkeypatch.setattr(ProducerCore, "_on_consumer_abort", done)
    with pytest.raises(TransitionError, match="CONSUMER_ABORT in REGISTERED led to DONE"):
        h.core.on_message(1.0, "A", m.Abort("r", 11, "gave up"))


def test_push_releases_once_after_the_write() -> None:
    h = Harness()
    h.register("A", "r", 11, [1, 2])
    h.prefill("r", [5, 6])
    assert [type(e.msg) for e in h.effects if isinstance(e, Send)] == [m.Posted]
    assert h.releases() == []            # the WRITE is in flight: nothing released yet
    h.end_writes()
    (release,) = h.releases()
    assert release.reason is ReleaseReason.TRANSFERRED
    assert release.block_ids.tolist() == [5, 6]
    landed = h.posts()[0].notif
    assert isinstance(landed, m.Landed) and landed.xid == 11
    assert h.core.held() == 0 and h.core.in_flight() == 0


def test_no_write_for_a_registration_whose_wait_ran_out_before_its_prefill_done() -> None:
    """A loop stalled past a registration's ``wait_s`` takes the engine's prefill_done
    before its timers: the consumer has given the request up (and, its Abort unanswered
    for ``abort_grace_s``, may reuse the blocks), so a WRITE posted then lands in another
    request's KV. The core posts nothing for it; the wait's timer ends it as a timeout."""
    h = Harness()
    h.register("A", "r", 11, [1, 2], wait_s=1.5)
    h.now += 2.0                                     # stalled: the wait ran out at 1.5
    h.prefill("r", [5, 6])
    assert h.posts() == [] and h.sent(m.Posted) == []
    h.advance(0.0)                                   # the same iteration's timers
    assert [f.code for f in h.sent(m.Failed)] == ["timeout"]
    assert h.posts() == []
    (release,) = h.releases()                        # its only owner gave up
    assert release.reason is ReleaseReason.ABORTED and release.blocks_safe


def test_a_prefill_done_within_the_wait_still_posts_at_once() -> None:
    """The control: the same prefill_done just inside the wait is served."""
    h = Harness()
    h.register("A", "r", 11, [1, 2], wait_s=1.5)
    h.now += 1.4
    h.prefill("r", [5, 6])
    assert len(h.posts()) == 1 and h.sent(m.Failed) == []


def test_a_tombstone_expires_and_the_id_is_usable_again() -> None:
    """A use of the id after its tombstone expired has its prefill_done taken (its blocks
    released) and its registration served: tombstones are not honoured forever."""
    h = Harness(tombstone_s=0.5)
    h.core.abort(h.now, "r", "engine gave up")       # no use yet: the next one is aborted
    h.prefill("r", [1])
    assert [r.reason for r in h.releases()] == [ReleaseReason.ABORTED]
    h.advance(1.0)                                   # the tombstone is gone
    assert h.core.records() == 0
    h.register("A", "r", 12, [3])
    h.prefill("r", [2])
    h.end_writes()
    assert [r.reason for r in h.releases()] == [ReleaseReason.ABORTED,
                                                ReleaseReason.TRANSFERRED]
    assert h.sent(m.Failed) == []


def test_an_abort_after_a_finished_request_does_not_block_later_uses() -> None:
    h = Harness()
    h.register("A", "r", 1, [3])
    h.prefill("r", [2])
    h.end_writes()
    h.core.abort(h.now, "r", "late abort")           # the use has ended: nothing to abort
    h.run()
    h.register("A", "r", 2, [4])                      # a new use, at once
    h.prefill("r", [5])
    h.end_writes()
    assert [r.reason for r in h.releases()] == [ReleaseReason.TRANSFERRED] * 2
    assert h.sent(m.Failed) == []


@pytest.mark.parametrize("registered", [True, False])
def test_a_prefill_done_long_after_an_abort_and_a_layer_is_still_that_uses(
        registered: bool) -> None:
    """The engine aborts a use before its prefill (a registration waiting, or no record
    yet), then goes on: a layer_done (its blocks go back at once, ABORTED) and, later than
    ``tombstone_s`` after the abort, its prefill_done. That prefill_done is the same use's
    and is swallowed; taken for a new use, it held the blocks the engine had back already
    and released them a second time at the lease (found by ``python -m
    kvpush.testing.sim --requests 60000 --seed 226 --faults all --timings library
    --producers 4 --consumers 4 --tp 2 --ctp 2``: ``release_not_held``, where an engine's
    abort of the id's previous, finished use reached this one)."""
    h = Harness(tombstone_s=2.0, lease_s=1.0, max_wait_s=10.0)
    sid = 0x7DCC
    if registered:
        h.register("A", "r", 11, [1, 2, 3, 4], sid=sid)
    h.core.abort(h.now, "r", "engine gave up")
    h.run()
    h.advance(1.9)                                   # inside the abort's tombstone
    h.core.layer_done(h.now, "r", np.array([5, 6, 7, 8]), 1, sid)
    h.run()
    h.advance(1.0)                                   # past it
    h.prefill("r", [5, 6, 7, 8], sid=sid)
    h.advance(2.0)                                   # past a lease
    assert [r.reason for r in h.releases()] == [ReleaseReason.ABORTED]
    assert h.core.held() == 0
    assert h.sent(m.Failed) == ([m.Failed("r", 11, "aborted", "engine gave up")]
                                if registered else [])


def test_a_named_abort_of_a_use_that_ended_leaves_the_next_use_alone() -> None:
    """With reused ids, the engine's abort of a use that already ended can reach the
    producer after the next use's registration: unnamed, it aborts that next use (its
    registration Failed ``aborted``, its prefill_done released at once). Named (the sid
    given to prefill_done), it changes nothing: the next use is served."""
    for named in (False, True):
        h = Harness(tombstone_s=2.0)
        h.register("A", "r", 11, [1, 2], sid=0xA1)
        h.prefill("r", [5, 6], sid=0xA1)
        h.end_writes()                                     # use A1 ended, TRANSFERRED
        h.advance(0.1)
        h.register("A", "r", 12, [3, 4], sid=0xB2)         # the next use's registration
        h.core.abort(h.now, "r", "late", 0xA1 if named else 0)
        h.run()
        h.prefill("r", [7, 8], sid=0xB2)
        h.end_writes()
        reasons = [r.reason for r in h.releases()]
        if named:
            assert reasons == [ReleaseReason.TRANSFERRED] * 2
            assert h.sent(m.Failed) == []
        else:
            assert reasons == [ReleaseReason.TRANSFERRED, ReleaseReason.ABORTED]
            assert [f.code for f in h.sent(m.Failed)] == ["aborted"]


def test_a_named_abort_before_its_use_aborts_that_use_only() -> None:
    """A named abort with no live use (the id's last use ended, or no record) aborts the
    use it names when it comes; a prefill_done of another named use starts that use."""
    h = Harness(tombstone_s=5.0)
    h.core.abort(h.now, "r", "engine gave up", 0xC3)        # no record yet
    h.run()
    h.prefill("r", [1, 2], sid=0xD4)                         # another use: held, served
    h.register("A", "r", 11, [3, 4])
    h.end_writes()
    assert [r.reason for r in h.releases()] == [ReleaseReason.TRANSFERRED]
    h.advance(0.1)
    h.core.abort(h.now, "r", "engine gave up", 0xC3)        # the id's last use ended
    h.run()
    h.register("A", "r", 12, [3, 4])                         # refused: the next use aborted
    h.prefill("r", [1, 2], sid=0xC3)                         # released at once
    assert [r.reason for r in h.releases()] == [ReleaseReason.TRANSFERRED,
                                                ReleaseReason.ABORTED]
    assert [f.code for f in h.sent(m.Failed)] == ["aborted"]
    assert h.core.held() == 0


def test_a_named_abort_reaches_the_live_use_it_names_and_no_other() -> None:
    h = Harness()
    h.prefill("r", [1, 2], TransferMode.PULL, sid=0xE5)
    h.core.abort(h.now, "r", "not this one", 0xF6)           # another use: ignored
    h.core.abort(h.now, "r", "the ended one", 0)             # unnamed: the live one
    h.run()
    h.advance(h.core.config.lease_s + 0.1)                   # no READ began: at the lease
    assert [r.reason for r in h.releases()] == [ReleaseReason.ABORTED]
    h = Harness()
    h.register("A", "r", 11, [3, 4])
    h.core.layer_done(h.now, "r", np.array([1, 2]), 0, 0xE5)
    h.run()
    h.core.abort(h.now, "r", "not this one", 0xF6)
    h.run()
    assert h.sent(m.Failed) == []
    h.core.abort(h.now, "r", "this one", 0xE5)
    h.run()
    h.end_writes()
    assert [r.reason for r in h.releases()] == [ReleaseReason.ABORTED]
    assert [f.code for f in h.sent(m.Failed)] == ["aborted"]


def test_a_message_of_a_non_owner_changes_nothing() -> None:
    """Consumer B's Abort or PullDone does not release the source consumer A is reading
    (else A reports READY over blocks the engine has reused)."""
    h = Harness()
    h.prefill("r", [1, 2, 3], TransferMode.PULL, sid=99)
    h.core.on_message(h.now, "A", m.PullBegin("r", 21, 99))
    h.run()
    assert h.sent(m.PullHeld, "A")[0].xid == 21
    # B takes the same ticket (a router retrying on a second decode instance)
    h.core.on_message(h.now, "B", m.PullBegin("r", 31, 99))
    h.core.on_message(h.now, "B", m.Abort("r", 31, "gave up"))
    h.core.on_notification(h.now, "B", m.PullDone("r", 31, 99, 64))
    h.run()
    assert h.releases() == []                        # A's READ may still run
    assert [f.code for f in h.sent(m.Failed, "B")] == ["not_owner"]
    h.core.on_notification(h.now, "A", m.PullDone("r", 21, 99, 192))
    h.run()
    assert [r.reason for r in h.releases()] == [ReleaseReason.TRANSFERRED]


def test_a_source_shared_by_two_decode_ranks_waits_for_both() -> None:
    """Heterogeneous TP: two decode ranks each read their share of one prefill request
    under one request id; the source is held until both are done."""
    h = Harness()
    h.prefill("r", [1, 2], TransferMode.PULL, sid=5)
    h.core.on_message(h.now, "A", m.PullBegin("r", 1, 5, sharers=2))
    h.core.on_notification(h.now, "A", m.PullDone("r", 1, 5, 10, sharers=2))
    h.run()
    assert h.releases() == []
    h.core.on_notification(h.now, "B", m.PullDone("r", 2, 5, 10, sharers=2))  # overtook
    h.run()
    assert [r.reason for r in h.releases()] == [ReleaseReason.TRANSFERRED]
    h.core.on_message(h.now, "B", m.PullBegin("r", 2, 5, sharers=2))          # its PullBegin
    h.run()
    assert [p.xid for p in h.sent(m.PullHeld, "B")] == [2]


def test_push_to_two_sharers_and_a_third_is_refused() -> None:
    h = Harness()
    h.register("A", "r", 1, [1], sharers=2)
    h.core.peer_up(h.now, "C", layout())
    h.register("B", "r", 2, [2], sharers=2)
    h.register("C", "r", 3, [3], sharers=2)
    assert [f.code for f in h.sent(m.Failed, "C")] == ["not_owner"]
    h.prefill("r", [9])
    assert len(h.posts()) == 2
    h.end_writes()
    assert [r.reason for r in h.releases()] == [ReleaseReason.TRANSFERRED]


def test_layerwise_failure_before_prefill_done_releases_once() -> None:
    """A planning failure while prefill still writes layers releases FAILED once: the next
    layer_done does not hold the blocks again (which would release them a second time)."""
    h = Harness()
    h.register("A", "r", 1, [NUM_BLOCKS + 5], groups=LAYERS)   # an id out of range
    h.core.layer_done(h.now, "r", np.array([1]), 0, 3)
    h.run()
    h.core.layer_done(h.now, "r", np.array([1]), 1, 3)
    h.prefill("r", [1], sid=3)
    assert [r.reason for r in h.releases()] == [ReleaseReason.FAILED]
    assert [f.code for f in h.sent(m.Failed)] == ["invalid_ids"]


def test_no_lease_runs_out_during_a_long_layerwise_prefill() -> None:
    h = Harness(lease_s=1.0)
    h.core.layer_done(h.now, "r", np.array([1]), 0, 3)
    h.run()
    h.advance(5.0)                                   # prefill takes longer than the lease
    h.register("A", "r", 1, [2], groups=LAYERS)
    h.core.layer_done(h.now, "r", np.array([1]), 1, 3)
    h.run()
    h.end_writes()
    h.prefill("r", [1], sid=3)
    assert [r.reason for r in h.releases()] == [ReleaseReason.TRANSFERRED]


def test_a_lost_reader_keeps_the_blocks_until_its_hold_ends() -> None:
    """A silent consumer's READ keeps its source until the hold its PullHeld promised ends:
    a consumer whose loop stalled may finish the READ on resume and report READY."""
    h = Harness(transfer_timeout_s=3.0)
    h.prefill("r", [1], TransferMode.PULL, sid=4)
    h.core.on_message(h.now, "A", m.PullBegin("r", 1, 4))
    h.run()
    assert h.sent(m.PullHeld)[0].hold_s == 3.0
    h.core.peer_lost(h.now, "A", "silent")
    h.run()
    assert h.releases() == []
    assert any(isinstance(e, DropPeer) for e in h.effects)   # no WRITE to wait for
    h.advance(2.9)
    assert h.releases() == []
    h.advance(0.2)
    assert [r.reason for r in h.releases()] == [ReleaseReason.FAILED]


def test_a_lost_consumer_write_ends_before_the_source_goes() -> None:
    h = Harness()
    h.register("A", "r", 1, [2])
    h.prefill("r", [1])
    h.core.peer_lost(h.now, "A", "silent")
    h.run()
    assert h.releases() == [] and not any(isinstance(e, DropPeer) for e in h.effects)
    h.end_writes()
    assert [r.reason for r in h.releases()] == [ReleaseReason.FAILED]
    assert any(isinstance(e, DropPeer) for e in h.effects)


def abandon_write(h: Harness) -> None:
    h.register("A", "r", 1, [2])
    h.prefill("r", [1])
    out = h.advance(2.5)
    (abandon,) = [e for e in out if isinstance(e, Abandon)]
    h.core.transfer_ended(h.now, abandon.key, XferEnd.ABANDONED)
    h.run()
    (failed,) = h.sent(m.Failed)
    assert failed.code == "timeout" and failed.unfenced


def test_an_abandoned_write_holds_its_source_until_the_consumer_acknowledges() -> None:
    """An abandoned WRITE may resume when a cut heals, copy the engine's reuse of the
    blocks, and its Landed reach the consumer before the Failed (READY with wrong bytes):
    its source stays until the consumer's Abort says it will not trust that WRITE."""
    h = Harness(transfer_timeout_s=2.0)
    abandon_write(h)
    assert h.releases() == []
    h.core.on_message(h.now, "A", m.Abort("r", 1, "unfenced write acknowledged"))
    h.run()
    assert [(r.reason, r.blocks_safe) for r in h.releases()] == [(ReleaseReason.FAILED, True)]


def test_an_unfenced_failed_is_sent_again_until_the_consumer_acknowledges() -> None:
    """The consumer's Abort that ends a fence can be lost with a TCP connection that
    ZeroMQ replaces at once (neither side sees a peer loss): a consumer that has given the
    use up answers each Failed(unfenced) of it with an Abort, so the producer says it
    again every peer_timeout_s / 4 while it fences, and the source goes at the next
    answer instead of after max_wait_s (found by the simulator: seed 251, a `reset`
    between the two)."""
    h = Harness(transfer_timeout_s=2.0, peer_timeout_s=4.0, max_wait_s=600.0)
    abandon_write(h)
    h.advance(0.99)
    assert len(h.sent(m.Failed)) == 1
    h.advance(0.02)
    first, again = h.sent(m.Failed)
    assert again == first and again.unfenced
    h.advance(1.0)
    assert len(h.sent(m.Failed)) == 3 and h.releases() == []
    h.core.on_message(h.now, "A", m.Abort("r", 1, "unfenced write acknowledged"))
    h.run()
    assert [(r.reason, r.blocks_safe) for r in h.releases()] == [(ReleaseReason.FAILED, True)]
    h.advance(5.0)
    assert len(h.sent(m.Failed)) == 3   # nothing more once acknowledged


def test_an_abandoned_write_never_acknowledged_is_released_unsafe() -> None:
    h = Harness(transfer_timeout_s=2.0)
    abandon_write(h)
    h.core.peer_lost(h.now, "A", "silent")
    h.run()
    assert [(r.reason, r.blocks_safe) for r in h.releases()] == [(ReleaseReason.FAILED, False)]


@pytest.mark.parametrize("what", ["write", "pull"])
def test_close_with_a_transfer_that_may_still_read_releases_unsafe(what: str) -> None:
    """close() releases a source a WRITE may still read, or a pulled one inside the hold its
    PullHeld promised, as unsafe: the engine keeps the blocks, the consumer never reads a
    reuse's bytes."""
    h = Harness()
    if what == "write":
        h.register("A", "r", 1, [2])
        h.prefill("r", [1])
    else:
        h.prefill("r", [1], TransferMode.PULL, sid=3)
        h.core.on_message(h.now, "A", m.PullBegin("r", 1, 3))
    h.prefill("quiet", [5])
    h.core.close(h.now)
    h.run()
    assert {r.request_id: r.blocks_safe for r in h.releases()} == {"r": False, "quiet": True}


def test_a_second_prefill_done_releases_nothing_still_held() -> None:
    """A second prefill_done of one use releases only the blocks the first did not name:
    never a second Release of blocks still to be written from."""
    h = Harness()
    h.prefill("r", [1, 2])
    h.prefill("r", [1, 2, 3])
    assert [(r.reason, r.block_ids.tolist()) for r in h.releases()] == [
        (ReleaseReason.FAILED, [3])]
    h.register("A", "r", 1, [4, 5])
    h.end_writes()
    assert [r.block_ids.tolist() for r in h.releases()] == [[3], [1, 2]]


@pytest.mark.parametrize("when", ["registered", "writing"])
def test_consumer_abort_is_acked_with_its_xid(when: str) -> None:
    h = Harness()
    h.register("A", "r", 8, [2])
    if when == "writing":
        h.prefill("r", [1])
    h.core.on_message(h.now, "A", m.Abort("r", 8, "bye"))
    h.run()
    if when == "writing":
        assert h.sent(m.AbortAck) == []          # once the WRITE has ended
        h.end_writes()
    (ack,) = h.sent(m.AbortAck)
    assert ack.xid == 8
    if when == "registered":
        h.prefill("r", [1])       # late: released at once, its only owner gave up
    assert [r.reason for r in h.releases()] == [ReleaseReason.ABORTED]


def test_a_stale_abort_of_an_unknown_use_is_answered_and_changes_nothing() -> None:
    h = Harness()
    h.register("A", "r", 8, [2])
    h.core.on_message(h.now, "A", m.Abort("r", 999, "old use"))
    h.run()
    assert [a.xid for a in h.sent(m.AbortAck)] == [999]
    h.prefill("r", [1])
    h.end_writes()
    assert [r.reason for r in h.releases()] == [ReleaseReason.TRANSFERRED]


def test_lease_expiry_releases_and_late_registrations_fail_fast() -> None:
    h = Harness(lease_s=1.0)
    h.prefill("r", [1])
    h.advance(1.5)
    assert [r.reason for r in h.releases()] == [ReleaseReason.LEASE_EXPIRED]
    h.register("A", "r", 3, [2])
    assert [f.code for f in h.sent(m.Failed)] == ["lease_expired"]


def test_a_claim_holds_the_source_past_its_lease() -> None:
    h = Harness(lease_s=1.0)
    h.prefill("r", [1], TransferMode.PULL, sid=6)
    h.core.on_message(h.now, "A", m.Claim("r", 4, 6))
    h.advance(5.0)
    assert h.releases() == []
    h.core.on_message(h.now, "A", m.PullBegin("r", 4, 6))
    h.core.on_notification(h.now, "A", m.PullDone("r", 4, 6, 64))
    h.run()
    assert [r.reason for r in h.releases()] == [ReleaseReason.TRANSFERRED]


def test_a_claimer_lost_gives_its_share_up() -> None:
    h = Harness(lease_s=1.0)
    h.prefill("r", [1], TransferMode.PULL, sid=6)
    h.core.on_message(h.now, "A", m.Claim("r", 4, 6))
    h.advance(5.0)
    h.core.peer_lost(h.now, "A", "gone")
    h.run()
    assert [r.reason for r in h.releases()] == [ReleaseReason.FAILED]


@pytest.mark.parametrize("claim_first", [True, False])
def test_a_push_claim_holds_the_source_past_its_lease_until_it_registers(
        claim_first: bool) -> None:
    """A decode request queued for blocks claims its push (leases renewed while the decode
    side waits); the source outlives the lease, and the registration with the claim's xid
    takes it."""
    h = Harness(lease_s=1.0)
    claim = m.Claim("r", 4, 0, push=True)
    if claim_first:                        # claimed while prefill is still running
        h.core.on_message(h.now, "A", claim)
        h.prefill("r", [5, 6])
    else:
        h.prefill("r", [5, 6])
        h.core.on_message(h.now, "A", claim)
    h.advance(5.0)                         # far past the lease
    assert h.releases() == [] and h.sent(m.Failed) == []
    assert h.core.held() == 1
    h.register("A", "r", 4, [1, 2])
    assert len(h.posts()) == 1             # the WRITE of the claimed source
    h.end_writes()
    assert [r.reason for r in h.releases()] == [ReleaseReason.TRANSFERRED]
    assert h.core.records() <= 1 and h.core.held() == 0


def test_without_a_claim_the_same_wait_loses_the_source() -> None:
    """The control: a registration after the lease fails fast (the test above is not
    passing by accident)."""
    h = Harness(lease_s=1.0)
    h.prefill("r", [5, 6])
    h.advance(5.0)
    assert [r.reason for r in h.releases()] == [ReleaseReason.LEASE_EXPIRED]


@pytest.mark.parametrize("how", ["lost", "abort", "max_wait"])
def test_a_push_claimer_that_goes_releases_the_source(how: str) -> None:
    """The decode side dies (or gives up, or never comes within max_wait_s): the
    claimed source is released, once."""
    h = Harness(lease_s=1.0, max_wait_s=20.0)
    h.prefill("r", [5, 6])
    h.core.on_message(h.now, "A", m.Claim("r", 4, 0, push=True))
    h.advance(5.0)
    assert h.releases() == []
    if how == "lost":
        h.core.peer_lost(h.now, "A", "silent")
    elif how == "abort":
        h.core.on_message(h.now, "A", m.Abort("r", 4, "request ended"))
    else:
        h.advance(20.0)
    h.run()
    (release,) = h.releases()
    assert release.reason is not ReleaseReason.TRANSFERRED and release.blocks_safe
    assert h.core.held() == 0
    if how == "max_wait":
        assert [f.code for f in h.sent(m.Failed)] == ["timeout"]


def test_a_push_claim_of_a_pull_source_or_an_expired_use_is_refused() -> None:
    h = Harness(lease_s=1.0)
    h.prefill("p", [1], TransferMode.PULL, sid=6)
    h.core.on_message(h.now, "A", m.Claim("p", 4, 0, push=True))
    h.prefill("q", [2])
    h.advance(1.5)                           # q's lease ends before anyone claims it
    h.core.on_message(h.now, "A", m.Claim("q", 5, 0, push=True))
    h.run()
    assert [(f.request_id, f.code) for f in h.sent(m.Failed)] == [
        ("p", "mode_conflict"), ("q", "lease_expired")]


def test_a_push_claim_and_another_owner_share_one_source() -> None:
    """Heterogeneous TP: rank A claims (no blocks yet), rank B registers at once; the source
    waits for A's registration, then goes once both WRITEs ended."""
    h = Harness(lease_s=1.0)
    h.core.on_message(h.now, "A", m.Claim("r", 4, 0, sharers=2, push=True))
    h.register("B", "r", 8, [3, 4], sharers=2)
    h.prefill("r", [5, 6])
    h.end_writes()
    h.advance(5.0)
    assert h.releases() == []                # A still owns a share
    h.register("A", "r", 4, [1, 2], sharers=2)
    h.end_writes()
    assert [r.reason for r in h.releases()] == [ReleaseReason.TRANSFERRED]


def test_registrations_waiting_per_peer_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpush.protocol import producer as core_module
    monkeypatch.setattr(core_module, "MAX_WAITING_PER_PEER", 3)
    h = Harness()
    for i in range(4):
        h.register("A", f"r{i}", i + 1, [i])
    assert [f.code for f in h.sent(m.Failed)] == ["too_many"]
    assert h.core.gauges["registrations_waiting"] == 3


def test_state_is_bounded_once_quiet() -> None:
    h = Harness(lease_s=1.0, tombstone_s=2.0)
    for i in range(50):
        h.register("A", f"r{i}", i + 1, [i % NUM_BLOCKS])
        h.prefill(f"r{i}", [i % NUM_BLOCKS])
    h.end_writes()
    h.core.abort(h.now, "x", "never seen")
    h.advance(3.0)
    assert h.core.records() == 0 and h.core.next_deadline() is None
    assert h.core.gauges == {"sources_held": 0, "registrations_waiting": 0}


def test_a_prefill_after_every_owner_gave_up_is_released_at_once() -> None:
    h = Harness(tombstone_s=2.0)
    h.register("A", "r", 1, [2])
    h.core.on_message(h.now, "A", m.Abort("r", 1, "timed out"))
    h.run()
    h.prefill("r", [5])
    assert [r.reason for r in h.releases()] == [ReleaseReason.ABORTED]
    h.register("A", "q", 2, [2])
    h.core.on_message(h.now, "A", m.Abort("q", 2, "timed out"))
    h.advance(3.0)                                   # remembered for tombstone_s only
    assert h.core.records() == 0


def test_a_registration_that_expires_gives_the_owner_up_like_its_abort() -> None:
    """CI found it: the registration's wait and the consumer's deadline end together;
    whichever came first decided a late prefill_done's release (FAILED or ABORTED)."""
    h = Harness()
    h.register("A", "r", 1, [2], wait_s=0.5)
    h.advance(0.6)                                    # the wait ends before the Abort
    h.core.on_message(h.now, "A", m.Abort("r", 1, "deadline"))
    h.run()
    h.prefill("r", [5])
    assert [r.reason for r in h.releases()] == [ReleaseReason.ABORTED]


def test_a_prefill_done_called_in_time_but_taken_late_is_still_the_released_uses() -> None:
    """A layer-wise source released early; the engine's prefill_done comes 0.6 s later, but
    the producer's loop is stalled and takes it after the record's tombstone_s. The
    engine's call time decides: it belongs to the use that ended (taken as a new use, the
    blocks would be held and released a second time)."""
    h = Harness(tombstone_s=2.0)
    h.register("A", "r", 1, [NUM_BLOCKS + 5], groups=LAYERS)    # fails at once: released
    h.core.layer_done(h.now, "r", np.array([1]), 0, 3)
    h.run()
    assert [r.reason for r in h.releases()] == [ReleaseReason.FAILED]
    called = h.now + 0.6
    h.advance(2.5)                                 # the loop was stalled past tombstone_s
    h.core.prefill_done(h.now, "r", np.array([1]), TransferMode.PUSH, 3, called)
    h.run()
    h.advance(20.0)
    assert len(h.releases()) == 1                  # swallowed: no second release
    h.core.prefill_done(h.now, "r", np.array([1]), TransferMode.PUSH, 4)   # much later: new
    h.run()
    h.advance(20.0)
    assert [r.reason for r in h.releases()] == [ReleaseReason.FAILED,
                                                ReleaseReason.LEASE_EXPIRED]


def test_an_abandoned_write_of_a_use_the_consumer_gave_up_is_not_fenced() -> None:
    """The short soak found it: the engine aborted a push whose WRITE hung; the consumer's
    Abort came before the WRITE was abandoned, so the owner waited in FENCING for a second
    Abort that never comes, and the source for max_wait_s: past every deadline."""
    h = Harness(transfer_timeout_s=2.0, max_wait_s=100.0)
    h.register("A", "r", 1, [2])
    h.prefill("r", [1])
    h.core.abort(h.now, "r", "engine gave up")
    h.core.on_message(h.now, "A", m.Abort("r", 1, "producer aborted"))
    out = h.advance(2.5)
    (abandon,) = [e for e in out if isinstance(e, Abandon)]
    h.core.transfer_ended(h.now, abandon.key, XferEnd.ABANDONED)
    h.run()
    assert [(r.reason, r.blocks_safe) for r in h.releases()] == [(ReleaseReason.ABORTED, True)]


def test_a_registration_before_prefill_done_is_stamped_in_the_release() -> None:
    """Release.timings["registered"] is documented as the registration reaching the loop,
    "often before prefill_done"; it was stamped only when the registration came second (and
    test_api's timing test failed whenever a loaded host let the Register in first)."""
    h = Harness()
    h.register("A", "r", 11, [0, 1])
    h.advance(0.5)
    h.prefill("r", [5, 6])
    h.end_writes()
    h.run()
    (release,) = h.releases()
    assert release.reason is ReleaseReason.TRANSFERRED and release.xids == (11,)
    assert list(release.timings) == ["prefill_done", "held", "registered", "posted",
                                     "written", "released"], release.timings
    assert release.timings["registered"] == 0.0 < release.timings["prefill_done"]


@pytest.mark.parametrize("aborted", [True, False])
def test_a_write_abandoned_after_its_consumer_was_lost_is_not_fenced(aborted: bool) -> None:
    """With transfer_timeout_s (4) above peer_timeout_s (1.5), as in the soak: the engine
    aborts a push whose WRITE hangs in a link cut, the consumer is then lost (silent), and
    the WRITE is abandoned later. The abort's Failed(unfenced) goes to no one, so no Abort
    can come to end the fence: the source goes at once, unsafe (the consumer may only be
    cut off and see that WRITE land), as a FENCING owner lost does; without the abort too."""
    h = Harness(transfer_timeout_s=4.0, max_wait_s=30.0, peer_timeout_s=1.5)
    h.register("A", "r", 1, [2])
    h.prefill("r", [1])
    if aborted:
        h.core.abort(h.now, "r", "engine gave up")
        h.run()
    h.advance(1.5)
    h.core.peer_lost(h.now, "A", "no heartbeat for 1.5 s")
    h.run()
    assert h.releases() == []                # the WRITE may still read the blocks
    out = h.advance(2.6)
    (abandon,) = [e for e in out if isinstance(e, Abandon)]
    h.core.transfer_ended(h.now, abandon.key, XferEnd.ABANDONED)
    h.run()
    reason = ReleaseReason.ABORTED if aborted else ReleaseReason.FAILED
    assert [(r.reason, r.blocks_safe) for r in h.releases()] == [(reason, False)]
    assert h.releases()[0].quarantine_s == 4.0
    assert h.sent(m.Failed) == []            # nothing goes to a consumer that is gone
    assert any(isinstance(e, DropPeer) for e in h.effects)
    assert h.core.held() == 0 and h.core.snapshot("r").phase == "ended"


def test_a_write_abandoned_because_its_consumer_reconnected_is_not_fenced() -> None:
    """The same through a restarted (or reconnecting) consumer: peer_lost(abandon=True)
    gives the WRITE up, and the new session will never acknowledge the old use's Failed.
    It is known dead, so the blocks are safe (as for a FENCING owner it replaces)."""
    h = Harness(transfer_timeout_s=4.0, max_wait_s=30.0)
    h.register("A", "r", 1, [2])
    h.prefill("r", [1])
    h.core.abort(h.now, "r", "engine gave up")
    h.run()
    h.core.peer_lost(h.now, "A", "consumer reconnected", abandon=True)
    (abandon,) = [e for e in h.run() if isinstance(e, Abandon)]
    h.core.transfer_ended(h.now, abandon.key, XferEnd.ABANDONED)
    h.run()
    h.core.peer_up(h.now, "A", layout())
    assert [(r.reason, r.blocks_safe) for r in h.releases()] == [(ReleaseReason.ABORTED, True)]


@pytest.mark.parametrize("claimed", [True, False])
def test_a_failed_xid_is_never_served_after(claimed: bool) -> None:
    """A consumer takes Failed(xid) to mean nothing of that xid will ever be written, and
    gives its blocks back. A push claim that ran out of ``max_wait_s`` is failed; the same
    consumer's registration under the claim's xid, sent before the Failed reached it and
    arriving after a new use of the id began, is refused, not written into blocks that
    consumer has given away (the simulator's seed 52). The same for a registration
    failed outright, then registered again under its xid."""
    h = Harness(lease_s=1.0, max_wait_s=2.0)
    h.prefill("r", [5, 6], sid=21)
    if claimed:
        h.core.on_message(h.now, "A", m.Claim("r", 4, 0, push=True))
        h.advance(2.5)                       # max_wait_s: the claim is failed
        assert [f.code for f in h.sent(m.Failed)] == ["timeout"]
    else:
        h.register("A", "r", 4, [1, 2, 3])   # three ids for a two-block source: refused
        assert len(h.sent(m.Failed)) == 1
        h.advance(2.5)
    h.prefill("r", [7, 8], sid=22)            # the engine's next use of the id
    h.register("A", "r", 4, [1, 2], sid=22)  # late: sent before the Failed arrived
    assert h.posts() == [], "a WRITE under a xid this producer failed"
    assert [f.xid for f in h.sent(m.Failed)] == [4, 4]
    h.register("A", "r", 9, [1, 2], sid=22)  # the consumer's retry, under a new xid
    assert len(h.posts()) == 1


def test_a_posted_hint_says_inline_once_a_write_of_its_size_ended_inside_its_post() -> None:
    """Posted.inline_s: the consumer sleeps to its predicted landing instead of polling.
    The producer says so only from what it saw: the last two WRITEs of the same size to
    the same consumer had ended by the time their posts returned (it says the shorter
    time); one that had not, or a lost consumer, takes it back."""
    h = Harness()

    def push(rid: str, xid: int, peer: str = "A", ids: tuple[int, ...] = (5, 6),
             inline_s: float = 0.002) -> float:
        h.effects.clear()
        h.register(peer, rid, xid, list(ids))
        h.prefill(rid, list(ids))
        (posted,) = h.sent(m.Posted, peer)
        h.end_writes(inline_s=inline_s)
        return float(posted.inline_s)

    assert push("r1", 11, inline_s=0.014) == 0.0   # nothing seen yet (the first: slow)
    assert push("r2", 12, inline_s=0.003) == 0.0   # one seen: not yet
    assert push("r3", 13) == 0.003                 # the shorter of the last two
    assert push("r4", 14, ids=(1, 2, 3, 4)) == 0.0  # another size class: not seen yet
    assert push("r5", 15, peer="B") == 0.0         # another consumer: not seen yet
    assert push("r6", 16, inline_s=0.0) == 0.002   # r6's does not end inside its post ...
    assert push("r7", 17) == 0.0                   # ... so none is said
    assert push("r8", 18) == 0.0
    assert push("r9", 19) == 0.002
    h.core.peer_lost(h.now, "A", "silent")
    h.core.peer_up(h.now, "A", layout())
    assert push("r10", 20) == 0.0                  # a consumer back from lost: seen anew


def test_a_pull_is_quiet_until_its_predicted_pull_done_when_its_read_moves_inline() -> None:
    """The PullDone of a READ the consumer begun with ``inline_s`` cannot need this side's
    progress: the loop need not poll before the predicted PullDone (the learnt
    PullBegin-to-PullDone time, at most ``inline_s``); any READ in flight begun without it,
    and it polls as before."""
    h = Harness()

    def begin(rid: str, xid: int, sid: int, peer: str = "A", inline_s: float = 0.01) -> None:
        h.prefill(rid, [1, 2, 3], TransferMode.PULL, sid=sid)
        h.core.on_message(h.now, peer, m.PullBegin(rid, xid, sid, inline_s=inline_s))
        h.run()

    begin("r1", 21, 101, inline_s=0.0)
    assert h.core.quiet_until(h.now) is None and h.core.predicted(h.now, 1e-4) is None
    h.now += 0.004
    h.core.on_notification(h.now, "A", m.PullDone("r1", 21, 101, 192), h.now - 0.001)
    h.run()
    assert not h.core.wants_notifications()
    h.now = 10.0
    begin("r2", 22, 102)
    took = 0.0035                                  # the middle of (3 ms, 4 ms]
    assert h.core.quiet_until(h.now) == pytest.approx(10.0 + took)
    assert h.core.predicted(h.now, 1e-4) == pytest.approx((10.0 + took, 10.0 + 1.25 * took))
    begin("r3", 23, 103, peer="B", inline_s=0.0)
    assert h.core.quiet_until(h.now) is None       # B's READ may need this side's progress
    assert h.core.predicted(h.now, 1e-4) == pytest.approx((10.0 + took, 10.0 + 1.25 * took))
