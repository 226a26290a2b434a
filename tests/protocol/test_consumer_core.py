"""The consumer's protocol core without any I/O: events in, effects out, time passed in.

Each test drives :class:`kvpush.protocol.consumer.ConsumerCore` by hand, the way the
simulator and the Consumer facade do, and checks the effects and results it asks for.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvpush import messages as m
from kvpush.auth import Opener, Sealer
from kvpush.errors import AuthenticationError, PeerUnavailable, RequestAborted
from kvpush.protocol.consumer import TABLE, ConsumerCore, CoreConfig, Event, Phase
from kvpush.protocol.effects import Abandon, ClaimGone, Dial, Emit, Post, Send, XferEnd
from kvpush.protocol.landings import PostTimes
from kvpush.protocol.table import TransitionError
from kvpush.request import RequestState, TransferMode, TransferResult
from tests.support.cores import CORES, LAYOUT, FakeLinks, P, Q, core, expect, results, sends


def test_the_table_names_a_handler_for_every_allowed_event() -> None:
    assert set(TABLE.rows) == set(Phase) - {Phase.DONE}
    for phase, events in TABLE.rows.items():
        for event, r in events.items():
            assert r.handler is None or callable(getattr(ConsumerCore, r.handler)), \
                (phase, event)
        assert Event.CLOSE in events
        # a use that names producers hears of their loss (a connecting one names none yet)
        assert Event.PEER_LOST in events or phase is Phase.CONNECTING


def test_a_handler_that_leaves_its_row_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Posted hint never ends a use: a handler that did would be a bug, raised (the
    simulator reports it as a violation)."""
    c = core()
    expect(c, producers=(P,))

    def ends(self: ConsumerCore, now: float, req: object, peer: str, part: int,
             inline_s: float = 0.0) -> None:
        req.phase = Phase.PUSH_CLOSING  # type: ignore[attr-defined]
    monkeypatch.setattr(ConsumerCore, "_on_posted", ends)
    with pytest.raises(TransitionError, match="POSTED in PUSHING led to PUSH_CLOSING"):
        c.on_message(0.1, P, m.Posted("r", 11, 0))


def test_a_claim_is_a_use_in_the_claimed_phase() -> None:
    """A claim is the use's first phase, in the same record and table: the pull that
    continues it begins it, a producer's refusal ends it."""
    c = core()
    t = m.PullTicket(P, "tcp://x:1", "r", m.encode_ids(np.array([3, 4])), 30.0, 0.0, sid=7)
    xid = c.claim(0.0, t)
    assert c.status("r") == "claimed" and c.snapshot("r").xid == xid
    c.on_message(0.1, P, m.Failed("r", xid, "not_held", "gone"))
    assert c.status("r") == "none" and c.drain() == [Send(P, m.Claim("r", xid, 7, 1)),
                                                     Emit(ClaimGone("r", xid))]


def test_push_ready_once_every_part_landed() -> None:
    c = core()
    expect(c, producers=(P, Q))
    assert c.status("r") == "pushing"
    c.on_message(0.1, P, m.Posted("r", 11, 0))
    assert c.wants_notifications() and c.drain() == []
    c.on_notification(0.2, P, m.Landed("r", 11, 0, nbytes=300))
    assert c.drain() == []
    c.on_message(0.3, Q, m.Posted("r", 11, 1, empty=True))
    (res,) = results(c.drain())
    assert res.state is RequestState.READY and res.xid == 11 and res.bytes_moved == 300
    assert res.block_ids.tolist() == [1, 2] and res.blocks_safe
    assert c.status("r") == "none" and not c.wants_notifications() and c.pending == 0
    assert c.next_deadline() is None


def test_messages_of_another_use_are_stale_and_change_nothing() -> None:
    c = core()
    expect(c)
    for peer, msg in [(P, m.Landed("r", 12, 0)), (Q, m.Landed("r", 11, 0)),  # not its part
                      (P, m.Failed("r", 10, "aborted", "old")), (P, m.Posted("x", 11, 0))]:
        if isinstance(msg, m.Landed):
            c.on_notification(0.1, peer, msg)
        else:
            c.on_message(0.1, peer, msg)
    assert c.drain() == [] and c.stats.stale_messages == 4 and c.status("r") == "pushing"


def test_events_a_phase_does_not_allow_are_refused_and_counted() -> None:
    c = core()
    expect(c)
    c.on_message(0.1, P, m.AbortAck("r", 11))       # nothing was asked
    c.on_message(0.1, P, m.PullHeld("r", 11, 5.0))  # a push is not held
    c.on_notification(0.2, P, m.Landed("r", 11, 5))  # no such part
    assert c.drain() == [] and c.stats.events_refused == 3
    c.on_notification(0.2, P, m.Landed("r", 11, 0))
    assert results(c.drain())[0].state is RequestState.READY


def test_xids_come_from_the_given_source_when_a_call_brings_none() -> None:
    ids = iter([101, 102])
    c = ConsumerCore(LAYOUT, CoreConfig(), FakeLinks(), xids=lambda: next(ids))
    c.peer_up(0.0, P)
    CORES.append(c)
    assert c.expect(0.0, "a", np.array([1]), [P], 5.0) == 101
    assert c.claim(0.0, ticket("b")) == 102


def test_a_duplicate_expect_fails_on_its_own() -> None:
    c = core()
    expect(c)
    c.expect(0.1, "r", np.array([7]), [P], 10.0, 1, False, [1], 99)
    (dup,) = results(c.drain())
    assert (dup.state, dup.xid, dup.block_ids.tolist()) == (RequestState.FAILED, 99, [7])
    assert c.status("r") == "pushing" and c.xid_of("r") == 11


def test_deadline_aborts_and_the_result_waits_for_the_producers_word() -> None:
    c = core(grace=2.0)
    expect(c, timeout=5.0)
    assert c.next_deadline() == 5.0
    c.tick(4.9)
    assert c.drain() == []
    c.tick(5.0)
    (abort,) = sends(c.drain())
    assert isinstance(abort, m.Abort) and abort.xid == 11
    assert c.status("r") == "push_closing" and c.next_deadline() == 7.0
    c.on_message(5.5, P, m.AbortAck("r", 11))
    (res,) = results(c.drain())
    assert res.state is RequestState.TIMED_OUT and res.blocks_safe


def test_an_announced_write_is_fenced_by_its_landed() -> None:
    c = core()
    expect(c)
    c.on_message(0.1, P, m.Posted("r", 11, 0))
    c.abort(0.2, "r", RequestState.ABORTED, RequestAborted("engine"))
    assert isinstance(sends(c.drain())[0], m.Abort)
    c.on_message(0.3, P, m.AbortAck("r", 11))  # the WRITE ended; its bytes are on the way
    assert c.drain() == []
    c.on_notification(0.4, P, m.Landed("r", 11, 0))
    (res,) = results(c.drain())
    assert res.state is RequestState.ABORTED and res.blocks_safe


class _Clock:
    """A monotonic clock the test moves by hand (for kvpush.progress.Backoff)."""

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


def _landings(monkeypatch: pytest.MonkeyPatch, landing_s: float, jitter: float,
              requests: int = 200, inline: bool = False, first_s: float | None = None,
              ) -> tuple[float, float, float, list[float]]:
    """Pushes one after another, each landing ``landing_s`` (+- ``jitter`` of it; the
    first ``first_s`` when given) after its Posted hint, which says ``inline_s`` as a
    producer whose posts take the landings' times says it, when ``inline``; found by a
    driver that polls as the endpoint's loop does: once at the hint, then after each
    ``Backoff.next_delay`` given the core's predicted window and quiet span, every sleep
    overrunning by up to 50 us. Returns the median lateness of the sightings over the
    second half (s), the hint-to-landing time the core learnt, the median number of polls
    per push over the second half, and every push's lateness."""
    from kvpush import progress

    clock = _Clock()
    monkeypatch.setattr(progress, "time", clock)
    rng = np.random.default_rng(7)
    policy = progress.ProgressPolicy()
    backoff = progress.Backoff(policy)
    c = core()
    late: list[float] = []
    polls: list[int] = []
    posts = PostTimes()
    for i in range(requests):
        rid, xid = f"r{i}", 100 + i
        c.expect(clock.now, rid, np.array([1, 2]), [P], 10.0, 1, False, [1], xid)
        c.drain()
        clock.now += 0.01          # the engine's gap: nothing moved for a while
        hinted = clock.now         # (a control message is not progress for the backoff)
        took = landing_s * (1 + jitter * rng.uniform(-1, 1)) if i or first_s is None \
            else first_s
        landed = hinted + took
        c.on_message(hinted, P, m.Posted(rid, xid, 0,
                                         inline_s=posts.hint(P, 0) if inline else 0.0))
        posts.ended(P, 0, took)
        since = None
        polls.append(1)
        while clock.now < landed:  # this poll finds nothing; sleep as the loop would
            since = clock.now
            clock.now += (backoff.next_delay(c.predicted(clock.now, policy.spin_s),
                                             c.quiet_until(clock.now))
                          + rng.uniform(0, 50e-6))
            polls[-1] += 1
        c.on_notification(clock.now, P, m.Landed(rid, xid, 0, nbytes=300), since)
        backoff.progressed()
        assert results(c.drain())[0].state is RequestState.READY
        assert c.quiet_until(clock.now) is None  # nothing awaited
        late.append(clock.now - landed)
    (learnt,) = c._landings._took.values()
    return (float(np.median(late[requests // 2:])), learnt,
            float(np.median(polls[requests // 2:])), late)


@pytest.mark.parametrize(("landing_s", "jitter"),
                         [(200e-6, 0.0), (200e-6, 0.1), (2.23e-3, 0.0), (8e-3, 0.0)])
def test_the_landing_window_is_learnt_from_when_landings_happened(
        monkeypatch: pytest.MonkeyPatch, landing_s: float, jitter: float) -> None:
    """The driver sleeps until the predicted window opens, so a landing before it is seen at
    its opening. Learning the sighting (as before) never moved the window earlier and every
    late sighting moved it later: it settled on one of the backoff's poll times after the
    landings, seen 0.3-0.4 ms late every time (200 us landings: window at 521 us). Learning
    the middle of (last look without it, sighting] keeps the window on the landings."""
    late, learnt, _, _ = _landings(monkeypatch, landing_s, jitter)
    assert late < 100e-6, (late, learnt)
    assert abs(learnt - landing_s) < 0.2 * landing_s + 50e-6, learnt


@pytest.mark.parametrize(("landing_s", "jitter", "ratio"),
                         [(3e-3, 0.0, 1.0), (8e-3, 0.0, 0.5), (8e-3, 0.1, 1.0)])
def test_an_inline_push_is_not_polled_before_its_predicted_landing(
        monkeypatch: pytest.MonkeyPatch, landing_s: float, jitter: float,
        ratio: float) -> None:
    """Posted.inline: the bytes move without this side's progress, so the loop sleeps from
    the hint to the predicted landing instead of polling along the backoff (an 8 ms push:
    3-5 polls, not 17). Fewer polls (under ``ratio`` of those without), the window still
    learnt from the landings, and the landings seen no later than the window's step."""
    late, learnt, polls, _ = _landings(monkeypatch, landing_s, jitter, inline=True)
    late0, _, polls0, _ = _landings(monkeypatch, landing_s, jitter, inline=False)
    # no later than the window's poll step (1/64 of the landing time) behind
    assert late < 100e-6 and late <= late0 + max(20e-6, landing_s / 64), (late, late0)
    assert abs(learnt - landing_s) < 0.2 * landing_s + 50e-6, learnt
    assert polls < polls0 * ratio, (polls, polls0)


def test_a_short_inline_push_is_polled_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under QUIET_MIN_S (a 1 MiB push here) a quiet wait would save a poll or two and see
    early landings late: such pushes are polled as without ``inline_s``."""
    late, _, polls, _ = _landings(monkeypatch, 1e-3, 0.1, inline=True)
    late0, _, polls0, _ = _landings(monkeypatch, 1e-3, 0.1, inline=False)
    assert polls == polls0 and abs(late - late0) < 20e-6, (polls, polls0, late, late0)


def test_a_quiet_wait_lasts_no_longer_than_the_initiators_last_post(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A first push that took 20 ms (the first transfer to a new peer does, here) and then
    3 ms ones: the prediction learnt from it is long, and a quiet wait, which does not look
    before the predicted moment, learns slowly (it saw each early landing only at the
    window's opening). Hinted bool-only, pushes 2-10 were each seen 2-15 ms late; bounded by
    the producer's ``inline_s`` (the shorter of its last two posts: push 2 gets none, and
    is polled along the backoff) they are seen on time."""
    _, _, _, late = _landings(monkeypatch, 3e-3, 0.0, requests=10, inline=True, first_s=0.02)
    assert late[1] < 600e-6 and max(late[2:]) < 100e-6, [round(x * 1e6) for x in late]


def test_a_push_waits_quietly_only_while_every_announced_part_came_inline() -> None:
    """Quiet until the earliest predicted landing (the learnt time, at most the hint's
    ``inline_s``) while every announced part came with ``inline_s``; one part without it
    (its producer's WRITEs need this side's progress, or it has not seen one end yet) and
    the loop polls along the backoff again."""
    c = core()
    for i, rid in enumerate(("a", "b")):
        c.expect(0.0, rid, np.array([1, 2]), [P], 10.0, 1, False, [1], 10 + i)
    c.drain()
    c.on_message(1.0, P, m.Posted("a", 10, 0, inline_s=0.006))
    assert c.quiet_until(1.0) == pytest.approx(1.006)   # nothing learnt: the hint's time
    c.on_notification(1.004, P, m.Landed("a", 10, 0, nbytes=300), 1.003)
    c.drain()
    (took,) = c._landings._took.values()
    assert took == pytest.approx(0.0035)
    for i, rid in enumerate(("c", "d")):
        c.expect(2.0, rid, np.array([1, 2]), [P], 10.0, 1, False, [1], 20 + i)
    c.drain()
    c.on_message(2.0, P, m.Posted("c", 20, 0, inline_s=0.006))
    assert c.quiet_until(2.0) == pytest.approx(2.0 + took)      # learnt, under the hint's
    assert c.predicted(2.0, 1e-4) == pytest.approx((2.0 + took, 2.0 + 1.25 * took))
    assert c.quiet_until(2.0 + took) is None   # its moment has come: poll
    c.on_message(2.0001, P, m.Posted("d", 21, 0, inline_s=0.0025))
    assert c.quiet_until(2.0001) == pytest.approx(2.0026)       # the hint's, under the learnt
    c.on_message(2.0002, P, m.Posted("b", 11, 0, inline_s=0.001))
    assert c.quiet_until(2.0002) is None       # "b" is predicted under QUIET_MIN_S: polled
    for bad in (float("nan"), float("inf"), -1.0):
        assert c._landings.quiet_until(2.0, [(9, 2.0, bad)]) is None


def test_grace_over_reports_unsafe() -> None:
    c = core(grace=1.0)
    expect(c)
    c.abort(0.0, "r", RequestState.ABORTED, RequestAborted("engine"))
    c.drain()
    c.tick(1.0)
    (res,) = results(c.drain())
    assert res.state is RequestState.ABORTED and not res.blocks_safe
    assert c.stats.results_unsafe == 1


def ticket(rid: str, sid: int = 5) -> m.PullTicket:
    return m.PullTicket(P, "tcp://x:1", rid, m.encode_ids(np.array([3, 4])), 30.0, 0.0,
                        sid=sid)


def _pull(c: ConsumerCore, rid: str = "p", xid: int = 21) -> int:
    c.pull(1.0, [ticket(rid)], [np.array([3, 4])], np.array([8, 9]), 10.0, 2, xid)
    effects = c.drain()
    begin, post = effects
    assert isinstance(begin, Send) and isinstance(begin.msg, m.PullBegin)
    assert (begin.msg.xid, begin.msg.sid, begin.msg.sharers) == (xid, 5, 2)
    assert isinstance(post, Post) and post.op == "READ" and post.nbytes == 200
    assert post.notif == m.PullDone(rid, xid, 5, 200, sharers=2)
    return post.key


def test_a_pull_begin_says_inline_once_a_read_of_its_size_ended_inside_its_post() -> None:
    """PullBegin.inline_s: the producer sleeps to its predicted PullDone instead of polling.
    Said only from what this side saw: the last READ of that size from that producer had
    ended by the time its post returned, which took that long; a lost producer is seen
    anew."""
    c = core()

    def pull(rid: str, xid: int, inline_s: float) -> float:
        c.pull(1.0, [ticket(rid)], [np.array([3, 4])], np.array([8, 9]), 10.0, 2, xid)
        begin, post = c.drain()
        c.transfer_ended(1.1, post.key, XferEnd.DONE, inline_s)
        c.on_message(1.2, P, m.PullHeld(rid, xid, 0.5))
        c.drain()
        return float(begin.msg.inline_s)

    assert pull("a", 21, 0.012) == 0.0   # nothing seen yet
    assert pull("b", 22, 0.002) == 0.0   # one READ ended inside its post: not yet
    assert pull("c", 23, 0.0) == 0.002   # two: the shorter of them
    assert pull("d", 24, 0.003) == 0.0   # c's did not end inside its post
    assert pull("e", 25, 0.004) == 0.0
    assert pull("f", 26, 0.003) == 0.003
    c.peer_lost(2.0, P, "silent")
    c.peer_up(2.0, P, LAYOUT)
    assert pull("g", 27, 0.003) == 0.0


@pytest.mark.parametrize("hold_s, ready", [(0.5, True), (0.05, False), (float("nan"), False)])
def test_pull_ready_only_if_the_read_ended_inside_the_hold(hold_s: float, ready: bool) -> None:
    c = core()
    key = _pull(c)
    assert c.in_flight() == 1
    c.transfer_ended(1.1, key, XferEnd.DONE)
    assert c.drain() == [] and c.status("p") == "pulling"
    c.on_message(1.2, P, m.PullHeld("p", 21, hold_s))
    (res,) = results(c.drain())
    assert res.ok is ready and res.blocks_safe and res.xid == 21
    assert c.in_flight() == 0


def test_pull_read_error_tells_the_producer_and_fails() -> None:
    c = core()
    key = _pull(c)
    c.transfer_ended(1.1, key, XferEnd.ERROR)
    effects = c.drain()
    abort, done = sends(effects)  # the Abort first: the producer counts a give-up, not done
    assert done == m.PullDone("p", 21, 5, 0, sharers=2) and isinstance(abort, m.Abort)
    (res,) = results(effects)
    assert res.state is RequestState.FAILED and res.blocks_safe


def test_pull_whose_producer_is_lost_abandons_the_read() -> None:
    c = core()
    key = _pull(c)
    c.peer_lost(1.1, P, "silent")
    assert c.drain() == [Abandon(key)]
    c.transfer_ended(1.1, key, XferEnd.ABANDONED)
    (res,) = results(c.drain())
    assert res.state is RequestState.FAILED and not res.blocks_safe


def test_close_ends_everything_and_unannounced_push_parts_are_unsafe() -> None:
    c = core()
    expect(c, rid="push")          # nothing announced yet: its WRITE may still come
    key = _pull(c, rid="pull")
    c.close(2.0)
    effects = c.drain()
    assert Abandon(key) in effects
    c.transfer_ended(2.0, key, XferEnd.DONE)  # it had ended: nothing more lands
    got = {r.request_id: r for r in results(effects + c.drain())}
    assert got["push"].state is RequestState.ABORTED and not got["push"].blocks_safe
    assert got["pull"].state is RequestState.ABORTED and got["pull"].blocks_safe
    assert c.pending == 0


def test_a_claim_becomes_the_pull_or_is_dropped_when_refused() -> None:
    c = core()
    c.claim(0.0, ticket("p", 5), 2, 21)
    (claim,) = sends(c.drain())
    assert claim == m.Claim("p", 21, 5, 2) and c.status("p") == "claimed"
    _pull(c, xid=21)
    assert c.status("p") == "pulling"
    assert c.claim(0.0, [ticket("q", 6)], xid=31) == 31
    c.drain()
    c.on_message(0.1, P, m.Failed("q", 31, "not_owner", "taken"))
    assert c.status("q") == "none" and c.stats.stale_messages == 0
    assert c.drain() == [Emit(ClaimGone("q", 31))]   # no result: the facade forgets it
    c.claim(0.0, ticket("s", 7), xid=41)
    c.drain()
    c.abort_claim(0.2, "s", 41, "engine")
    assert sends(c.drain()) == [m.Abort("s", 41, "engine")]
    # A claimed pull that cannot start gives the claim up at the producer.
    c.claim(0.0, ticket("t", 8), xid=51)
    c.drain()
    c.pull(0.3, [ticket("t", 8)], [np.array([3, 4])], np.array([8, 9]), 0.0, 1, 51)
    effects = c.drain()
    assert sends(effects) == [m.Abort("t", 51, "the pull ticket's lease for 't' has run out")]
    assert results(effects)[0].state is RequestState.TIMED_OUT and c.status("t") == "none"


def test_notification_opener_accepts_old_counters_but_not_repeats_or_forgeries() -> None:
    """A big WRITE's Landed, overtaken by 4096 later notifications, still opens."""
    key = b"s" * 32
    sealer = Sealer(key, b"p2c-notif")
    first = sealer.seal(b"late landed")
    later = [sealer.seal(b"x") for _ in range(5000)]
    for strict, opener in ((True, Opener(key, b"p2c-notif")),
                           (False, Opener(key, b"p2c-notif", accept_old=True))):
        for frame in later:
            opener.open(frame)
        if strict:
            with pytest.raises(AuthenticationError, match="replayed"):
                opener.open(first)
        else:
            assert opener.open(first) == b"late landed"
        with pytest.raises(AuthenticationError, match="replayed"):
            opener.open(later[-1])  # a repeat inside the window
        with pytest.raises(AuthenticationError, match="tag"):
            opener.open(first[:-1] + b"X")


@pytest.mark.parametrize("seed", range(12))
def test_random_events_never_break_the_promises(seed: int) -> None:
    """Seeded random events, stale and duplicated ones among them, at random times: every
    use gets exactly one result; a READY push had every part landed, a READY pull its READ
    done inside the producer's hold; nothing raises; close ends everything."""
    import random
    rng = random.Random(seed)
    c = core(grace=0.5)
    now = 0.0
    uses: dict[int, dict[str, Any]] = {}     # xid -> what the test knows of that use
    got: dict[int, TransferResult] = {}
    reads: dict[int, int] = {}                # transfer key -> xid (posted, not ended)
    next_xid = iter(range(1000, 10**6))

    def collect() -> None:
        while effects := c.drain():
            collect_some(effects)

    def collect_some(effects: list[Any]) -> None:
        for effect in effects:
            if isinstance(effect, Emit):
                res = effect.item
                assert isinstance(res, TransferResult)
                assert res.xid not in got, "two results for one use"
                got[res.xid] = res
            elif isinstance(effect, Post):
                reads[effect.key] = effect.notif.xid  # type: ignore[union-attr]
            elif isinstance(effect, Abandon) and effect.key in reads:
                xid = reads.pop(effect.key)
                end = rng.choice([XferEnd.ABANDONED, XferEnd.DONE])
                uses[xid]["read_end"] = now if end is XferEnd.DONE else None
                c.transfer_ended(now, effect.key, end)

    for _ in range(400):
        now += rng.choice([0.0, 0.01, 0.1, 0.4])
        live = [x for x in uses if x not in got]
        xid = rng.choice(live) if live and rng.random() < 0.8 else rng.randrange(1, 50)
        use = uses.get(xid, {"rid": "r0", "parts": 1, "mode": "push"})
        rid = use["rid"]
        action = rng.randrange(12)
        if action == 0:
            x = next(next_xid)
            parts = rng.choice([1, 2])
            rid = f"r{rng.randrange(3)}"
            uses[x] = {"rid": rid, "parts": parts, "mode": "push", "landed": set()}
            c.expect(now, rid, np.array([1, 2]), [P, Q][:parts], rng.choice([0.3, 5.0]),
                     1, False, 1, x)
        elif action == 1:
            x = next(next_xid)
            rid = f"r{rng.randrange(3)}"
            uses[x] = {"rid": rid, "parts": 1, "mode": "pull", "began": now}
            c.pull(now, [ticket(rid)], [np.array([3, 4])], np.array([8, 9]),
                   rng.choice([0.3, 5.0]), 1, x)
        elif action == 2:
            c.on_message(now, P, m.Posted(rid, xid, rng.randrange(2)))
        elif action == 3:
            part = rng.randrange(2)
            c.on_notification(now, [P, Q][part], m.Landed(rid, xid, part))
            if xid in uses and uses[xid]["mode"] == "push" and xid not in got:
                uses[xid]["landed"].add(part)
        elif action == 4:
            c.on_message(now, rng.choice([P, Q]), m.Failed(rid, xid, rng.choice(
                ["aborted", "timeout", "boom"]), "x", unfenced=rng.random() < 0.3))
        elif action == 5:
            c.on_message(now, rng.choice([P, Q]), m.AbortAck(rid, xid))
        elif action == 6:
            hold = rng.choice([0.05, 10.0])
            c.on_message(now, P, m.PullHeld(rid, xid, hold))
            if xid in uses and uses[xid]["mode"] == "pull" and "hold" not in uses[xid]:
                uses[xid]["hold"] = hold
        elif action == 7 and reads:
            key = rng.choice(sorted(reads))
            x = reads.pop(key)
            end = rng.choice([XferEnd.DONE, XferEnd.DONE, XferEnd.ERROR])
            uses[x]["read_end"] = now if end is XferEnd.DONE else None
            c.transfer_ended(now, key, end)
        elif action == 8:
            c.abort(now, rid, RequestState.ABORTED, RequestAborted("engine"))
        elif action == 9:
            c.on_message(now, rng.choice([P, Q]), m.Abort(rid, xid, "producer"))
        elif action == 10 and rng.random() < 0.1:
            peer = rng.choice([P, Q])
            c.peer_lost(now, peer, "test")
            c.peer_up(now, peer)
        else:
            c.tick(now)
        collect()
        for x, res in got.items():
            if res.ok:
                use = uses[x]
                if use["mode"] == "push":
                    assert use["landed"] >= set(range(use["parts"])), (seed, x)
                else:
                    assert use.get("read_end") is not None, (seed, x)
                    assert use["read_end"] <= use["began"] + use["hold"], (seed, x)
                assert res.blocks_safe
    c.close(now)
    collect()
    while reads:
        key, x = reads.popitem()
        c.transfer_ended(now, key, XferEnd.DONE)
        collect()
    assert c.pending == 0 and c.next_deadline() is None
    assert set(got) == set(uses), "a use without a result"


def test_a_push_claim_becomes_the_registration_or_is_given_up() -> None:
    """claim_push announces the push (no blocks yet); the expect with its xid
    continues it; an expect that cannot start gives the held source up at the producer."""
    c = core()
    assert c.claim_push(0.0, "p", [P], 2, 21) == 21
    assert sends(c.drain()) == [m.Claim("p", 21, 0, 2, push=True)]
    assert c.status("p") == "claimed"
    c.expect(0.5, "p", np.array([1, 2]), [P], 10.0, sharers=2, xid=21)
    (register,) = sends(c.drain())
    assert isinstance(register, m.Register) and register.xid == 21
    assert c.status("p") == "pushing"
    # A claim the producer refuses is dropped (its Failed is not a result of anything).
    c.claim_push(0.0, "q", [P], xid=31)
    c.drain()
    c.on_message(0.1, P, m.Failed("q", 31, "lease_expired", "released"))
    assert c.status("q") == "none" and c.drain() == [Emit(ClaimGone("q", 31))]
    # A claimed push whose expect fails at once (producer lost since) gives the claim up.
    c.claim_push(0.0, "s", [P, Q], xid=41)
    c.drain()
    c.peer_lost(0.2, Q, "gone")       # its claim goes with it ...
    assert c.status("s") == "none"
    c.claim_push(0.3, "t", [P], xid=51)
    c.drain()
    c.expect(0.4, "t", np.array([3]), [P, Q], 10.0, xid=51)   # Q is not connected
    effects = c.drain()
    assert sends(effects) == [m.Abort("t", 51, "expect failed")]
    assert results(effects)[0].state is RequestState.FAILED


def _aborts(effects: list[Any]) -> list[tuple[str, m.Abort]]:
    return [(e.peer, e.msg) for e in effects
            if isinstance(e, Send) and isinstance(e.msg, m.Abort)]


def test_a_claim_given_up_here_is_given_up_at_each_producer_it_went_to() -> None:
    """A claim over several producers (tensor-parallel ranks) that ends here however it
    ends -- one producer lost, one refusing or giving it up, the engine's abort -- is
    given up at every other producer it went to, which otherwise holds its source for it
    up to ``max_wait_s`` (found by ``python -m kvpush.testing.sim --requests 10000
    --seed 192 --producers 8 --consumers 4 --faults all --tp 4 --ctp 2 --timings library
    --fault-rate 5``: a producer closed, its consumer dropped the claim of a push over it
    and another rank, and that rank held the prefilled blocks on)."""
    c = core()
    c.claim_push(0.0, "lost", [P, Q], 2, 21)
    c.drain()
    c.peer_lost(0.1, Q, "closed")
    effects = c.drain()
    assert Emit(ClaimGone("lost", 21)) in effects
    assert _aborts(effects) == [(P, m.Abort("lost", 21, f"producer {Q} lost: closed"))]
    # the producer that refused it is not told again; the other is
    c.peer_up(0.15, Q)
    c.claim_push(0.2, "refused", [P, Q], 2, 31)
    c.drain()
    c.on_message(0.3, P, m.Failed("refused", 31, "lease_expired", "released"))
    assert _aborts(c.drain()) == [(Q, m.Abort("refused", 31, f"by {P}: released"))]
    c.claim_push(0.4, "aborted", [P, Q], 2, 41)
    c.drain()
    c.on_message(0.5, Q, m.Abort("aborted", 41, "gone"))
    assert _aborts(c.drain()) == [(P, m.Abort("aborted", 41, f"by {Q}: gone"))]
    # the engine's abort: both
    c.claim_push(0.6, "engine", [P, Q], 2, 51)
    c.drain()
    c.abort_claim(0.7, "engine", 51, "no blocks")
    assert _aborts(c.drain()) == [(P, m.Abort("engine", 51, "no blocks")),
                                  (Q, m.Abort("engine", 51, "no blocks"))]
    # closing: the Bye ends every claim at the producers; no Abort per claim
    c.claim_push(0.8, "closing", [P, Q], 2, 61)
    c.drain()
    c.close(0.9)
    effects = c.drain()
    assert Emit(ClaimGone("closing", 61)) in effects and _aborts(effects) == []


def test_a_claim_given_up_is_said_again_until_the_producer_acknowledges() -> None:
    """The Abort that gives a claim up can be lost with a TCP connection ZeroMQ replaces at
    once (no peer loss on either side): the producer would hold its source for the claim
    up to ``max_wait_s``. It is said again every ``abort_grace_s`` until that producer's
    AbortAck, and no more once the producer is lost (its sessions end every claim)."""
    c = core(grace=1.0)
    c.claim_push(0.0, "r", [P, Q], 2, 21)
    c.drain()
    c.abort_claim(0.1, "r", 21, "no blocks")
    first = [(P, m.Abort("r", 21, "no blocks")), (Q, m.Abort("r", 21, "no blocks"))]
    assert _aborts(c.drain()) == first
    c.on_message(0.2, Q, m.AbortAck("r", 21))   # P's Abort was lost
    c.tick(1.05)
    assert _aborts(c.drain()) == []
    c.tick(1.15)
    assert _aborts(c.drain()) == [(P, m.Abort("r", 21, "no blocks"))]
    c.tick(2.2)
    assert _aborts(c.drain()) == [(P, m.Abort("r", 21, "no blocks"))]
    c.on_message(2.3, P, m.AbortAck("r", 21))
    c.tick(10.0)
    assert _aborts(c.drain()) == []
    assert c.next_deadline() is None
    # a producer lost meanwhile is not asked again
    c.claim_push(11.0, "s", [P], 2, 31)
    c.drain()
    c.abort_claim(11.1, "s", 31, "no blocks")
    assert _aborts(c.drain()) == [(P, m.Abort("s", 31, "no blocks"))]
    c.peer_lost(11.5, P, "silent")
    c.tick(20.0)
    assert _aborts(c.drain()) == [] and c.next_deadline() is None
    # the engine continues the claim before it hears it is gone: that use's Register goes
    # out under the claim's xid, and an Abort said again after it would end it
    c.peer_up(21.0, P)
    c.claim_push(21.0, "t", [P], 2, 41)
    c.drain()
    c.abort_claim(21.1, "t", 41, "no blocks")
    assert _aborts(c.drain()) == [(P, m.Abort("t", 41, "no blocks"))]
    c.expect(21.2, "t", np.array([1, 2]), [P], 5.0, xid=41)
    assert [type(x) for x in sends(c.drain())] == [m.Register]
    c.tick(23.0)
    assert _aborts(c.drain()) == []


def test_a_second_claim_of_an_id_gives_the_first_up_at_its_producers() -> None:
    """A consumer keeps one claim per request id. An engine that claims the id again
    (another use of it) gives the earlier claim up: its producers are sent the Abort (and
    again until they acknowledge) and the facade hears ClaimGone. Replaced silently, the
    earlier claim held its producers' sources up to ``max_wait_s`` with nothing left here to
    end it (the simulator: a push claim's Claim queued at one producer behind the use it
    held, the engine claiming the next use before it gave the first claim up)."""
    c = core(grace=1.0)
    c.claim_push(0.0, "r", [P, Q], 2, 21)
    c.drain()
    c.claim_push(0.5, "r", [P], 2, 22)
    out = c.drain()
    assert _aborts(out) == [(P, m.Abort("r", 21, "superseded by a new claim of the request")),
                            (Q, m.Abort("r", 21, "superseded by a new claim of the request"))]
    assert [e.item for e in out if isinstance(e, Emit)] == [ClaimGone("r", 21)]
    assert [(x.peer, x.msg.xid) for x in out
            if isinstance(x, Send) and isinstance(x.msg, m.Claim)] == [(P, 22)]
    c.on_message(0.6, P, m.AbortAck("r", 21))
    c.tick(1.6)                                   # Q's Abort was lost: said again
    assert _aborts(c.drain()) == [(Q, m.Abort("r", 21,
                                              "superseded by a new claim of the request"))]
    c.abort_claim(2.0, "r", 21, "no blocks")      # the first claim is gone: nothing
    assert _aborts(c.drain()) == []
    c.abort_claim(2.1, "r", 22, "no blocks")      # the second is the live one
    assert _aborts(c.drain()) == [(P, m.Abort("r", 22, "no blocks"))]
    # the same xid claimed again is the same claim, not a second one
    c.claim_push(3.0, "s", [P], 2, 31)
    c.drain()
    c.claim_push(3.1, "s", [P], 2, 31)
    assert _aborts(c.drain()) == []


R = "prod-r"   # a producer this consumer is not connected to


def _ticket_of_r(rid: str = "p", blocks: int = 2) -> m.PullTicket:
    return m.PullTicket(R, "tcp://r:1", rid, m.encode_ids(np.arange(3, 3 + blocks)), 30.0,
                        0.0, sid=5)


def _pull_connecting(c: ConsumerCore, t: m.PullTicket | None = None) -> None:
    t = t or _ticket_of_r()
    c.pull(0.5, [t], [m.decode_ids(t.block_ids)], np.array([8, 9]), 29.5, 2, 21, dial_s=5.0)
    assert c.drain() == [Dial("tcp://r:1", 5.0)]


def test_a_pull_connecting_is_a_phase_of_its_record() -> None:
    """A pull whose producer is not connected yet waits in CONNECTING in the core while the
    driver dials it (the facade's status reads it there); once dialled, it begins under
    its xid."""
    c = core()
    _pull_connecting(c)
    assert c.status("p") == "connecting" and c.pending == 1
    snap = c.snapshot("p")
    assert (snap.phase, snap.xid, snap.deadline, snap.block_ids.tolist()) == \
        ("connecting", 21, 30.0, [8, 9])
    c.peer_up(1.0, R, LAYOUT)
    c.dialed(1.0, "tcp://r:1", R, None)
    begin, post = c.drain()
    assert isinstance(begin, Send) and begin.peer == R and begin.msg.xid == 21
    assert isinstance(post, Post) and post.op == "READ" and post.peer == R
    assert c.status("p") == "pulling" and c.pending == 1


@pytest.mark.parametrize("how", ["failed", "other_producer", "length", "abort", "close"])
def test_a_pull_that_ends_in_its_handshake_is_reported_at_once(how: str) -> None:
    """Whichever way a connecting pull ends -- its handshake failed, the address is another
    producer than its ticket names, the producer's blocks do not match, the engine aborts,
    the consumer closes -- it is reported at once, FAILED or ABORTED, its blocks safe
    (nothing was posted), and a late answer changes nothing."""
    c = core()
    _pull_connecting(c, _ticket_of_r(blocks=3 if how == "length" else 2))
    want = RequestState.FAILED
    if how == "failed":
        c.dialed(1.0, "tcp://r:1", None, PeerUnavailable("no answer"))
    elif how == "other_producer":
        c.peer_up(1.0, Q, LAYOUT)
        c.dialed(1.0, "tcp://r:1", Q, None)
    elif how == "length":
        c.peer_up(1.0, R, LAYOUT)
        c.dialed(1.0, "tcp://r:1", R, None)
    elif how == "abort":
        c.abort(1.0, "p", RequestState.ABORTED, RequestAborted("engine"))
        want = RequestState.ABORTED
    else:
        c.close(1.0)
        want = RequestState.ABORTED
    (res,) = results(c.drain())
    assert (res.state, res.blocks_safe, res.xid, res.elapsed_s) == (want, True, 21, 0.5)
    if how == "other_producer":
        assert "the ticket names" in str(res.error)
    if how == "length":
        assert "names 3 source blocks" in str(res.error)
    assert c.status("p") == "none" and c.pending == 0
    c.dialed(2.0, "tcp://r:1", None, PeerUnavailable("late"))   # ended: nothing more
    assert c.drain() == []


def test_two_pulls_dialling_one_producer_both_begin_on_its_answer() -> None:
    c = core()
    for rid, xid in (("p", 21), ("q", 22)):
        t = _ticket_of_r(rid)
        c.pull(0.5, [t], [m.decode_ids(t.block_ids)], np.array([8, 9]), 29.5, 1, xid,
               dial_s=5.0)
    assert [e for e in c.drain() if isinstance(e, Dial)] == [Dial("tcp://r:1", 5.0)] * 2
    c.peer_up(1.0, R, LAYOUT)
    c.dialed(1.0, "tcp://r:1", R, None)
    assert [e.op for e in c.drain() if isinstance(e, Post)] == ["READ", "READ"]
    c.dialed(1.0, "tcp://r:1", R, None)   # the second Dial's answer: nothing more
    assert c.drain() == []
    assert c.status("p") == c.status("q") == "pulling"


def _claim_connecting(c: ConsumerCore, lease_s: float = 20.0) -> m.PullTicket:
    """Claim ``p`` (xid 21) from P, connected, and R, not: R is dialled first."""
    t = _ticket_of_r()
    c.claim(0.5, [ticket("p", 6), t], 2, 21, dial_s=5.0, lease_s=lease_s)
    assert c.drain() == [Dial("tcp://r:1", min(5.0, lease_s))]
    return t


def test_a_claim_waits_for_its_producers_handshakes_in_claiming() -> None:
    """A claim whose producer is not connected waits in CLAIMING (the facade's status
    reads it there) while the driver dials it, and sends its Claim to every producer once
    all are up."""
    c = core()
    _claim_connecting(c)
    snap = c.snapshot("p")
    assert (snap.phase, snap.xid, snap.mode, snap.parts, snap.deadline) == \
        ("claiming", 21, TransferMode.PULL, 2, 5.5)
    assert c.pending == 0 and c.next_deadline() == 5.5
    c.peer_up(1.0, R, LAYOUT)
    c.dialed(1.0, "tcp://r:1", R, None)
    assert sends(c.drain()) == [m.Claim("p", 21, 6, 2), m.Claim("p", 21, 5, 2)]
    assert c.status("p") == "claimed" and c.next_deadline() is None
    c.tick(6.0)   # its dial bound no longer applies
    assert c.drain() == [] and c.status("p") == "claimed"


@pytest.mark.parametrize("how", ["failed", "other_producer", "lease", "peer_lost", "abort",
                                 "close"])
def test_a_claim_given_up_in_its_handshake_tells_the_facade_and_sends_nothing(
        how: str) -> None:
    """However a claiming claim ends -- its handshake failed or reached another producer,
    the tickets' lease ran out, a producer already up is lost, the engine aborts, the
    consumer closes -- it ends with no result and no message to a producer (none holds
    anything for it), and the facade is told (ClaimGone), so a later claim or pull of the
    id starts anew; a late answer changes nothing."""
    c = core()
    _claim_connecting(c, lease_s=2.0)
    if how == "failed":
        c.dialed(1.0, "tcp://r:1", None, PeerUnavailable("no answer"))
    elif how == "other_producer":
        c.dialed(1.0, "tcp://r:1", Q, None)
    elif how == "lease":
        c.tick(2.5)
    elif how == "peer_lost":
        c.peer_lost(1.0, P, "silent")
    elif how == "abort":
        c.abort_claim(1.0, "p", 21, "engine")
    else:
        c.close(1.0)
    assert c.drain() == [Emit(ClaimGone("p", 21))]
    assert c.status("p") == "none" and c.stats.events_refused == 0
    c.peer_up(3.0, R, LAYOUT)
    c.dialed(3.0, "tcp://r:1", R, None)
    assert c.drain() == []


def test_a_pull_of_a_claiming_claim_connects_itself_within_the_lease() -> None:
    """The claim was never sent, so no producer holds its source past the lease: the pull
    (the claim's xid, a budget that trusted the claim) ends the claim and connects as a
    pull of its own, bounded by the tickets' lease."""
    c = core()
    t = _claim_connecting(c, lease_s=2.0)
    c.pull(1.0, [ticket("p", 6), t], [np.array([3, 4]), np.array([3, 4])], np.array([8, 9]),
           29.0, 2, 21, dial_s=5.0)
    assert c.drain() == [Emit(ClaimGone("p", 21)), Dial("tcp://r:1", 1.5)]
    snap = c.snapshot("p")
    assert (snap.phase, snap.xid, snap.deadline) == ("connecting", 21, 2.5)


def test_a_claim_without_dial_s_is_sent_to_the_producers_connected_now() -> None:
    c = core()
    c.claim(0.5, [ticket("p", 6), _ticket_of_r()], 1, 21)
    assert c.drain() == [Send(P, m.Claim("p", 21, 6, 1))] and c.status("p") == "claimed"


def test_a_pull_without_dial_s_fails_at_once_on_a_producer_not_connected() -> None:
    c = core()
    t = _ticket_of_r()
    c.pull(0.5, [t], [m.decode_ids(t.block_ids)], np.array([8, 9]), 29.5, 1, 21)
    (res,) = results(c.drain())
    assert res.state is RequestState.FAILED and "not connected" in str(res.error)
