"""The progress budget: how long the loop sleeps between polls while something is in flight
(kvpush.progress.Backoff), including a predicted completion window."""

from __future__ import annotations

import time

import pytest

from kvpush.progress import Backoff, ProgressPolicy

POLICY = ProgressPolicy(spin_s=0.0, min_sleep_s=20e-6, max_sleep_s=500e-6, sleep_fraction=0.5)


def _waited(backoff: Backoff, seconds: float) -> None:
    """Pretend the last progress was ``seconds`` ago."""
    backoff._last_progress = time.monotonic() - seconds


def test_spin_then_proportional_sleeps_capped() -> None:
    backoff = Backoff(ProgressPolicy(spin_s=1.0))
    assert backoff.next_delay() == 0.0  # spinning right after progress
    backoff = Backoff(POLICY)
    _waited(backoff, 100e-6)
    assert 20e-6 <= backoff.next_delay() <= 60e-6  # half of ~100 us
    _waited(backoff, 1.0)
    assert backoff.next_delay() == pytest.approx(POLICY.max_sleep_s)


def test_predicted_window_only_shortens_sleeps() -> None:
    backoff = Backoff(POLICY)
    _waited(backoff, 1.0)  # without a window: the longest sleep
    now = time.monotonic()
    # the window starts soon: wake at its start, not a whole max sleep later
    assert backoff.next_delay((now + 100e-6, now + 1.0)) <= 100e-6
    # inside a short window: poll every min_sleep
    assert backoff.next_delay((now - 1e-4, now + 1e-4)) == pytest.approx(POLICY.min_sleep_s)
    # a window far ahead or already over changes nothing
    assert backoff.next_delay((now + 10.0, now + 11.0)) == pytest.approx(POLICY.max_sleep_s)
    assert backoff.next_delay((now - 2.0, now - 1.0)) == pytest.approx(POLICY.max_sleep_s)


def test_keep_polling_while_in_flight_then_back_off() -> None:
    backoff = Backoff(ProgressPolicy(inflight_s=0.01))
    assert backoff.keep_polling()  # just progressed: poll NIXL again at once
    _waited(backoff, 0.02)
    assert not backoff.keep_polling()  # past inflight_s: the sleeps above take over
    assert not Backoff(ProgressPolicy(inflight_s=0.0)).keep_polling()
    assert ProgressPolicy.cpu_first().inflight_s == 0.0
    with pytest.raises(ValueError, match="inflight_s must be in"):
        ProgressPolicy(inflight_s=2.0)


def test_idle_endpoints_do_no_work_per_engine_step() -> None:
    """What an engine calls every step (results, releases, stats) must not wake kvpush's
    loop thread while nothing is in flight: the loop stays blocked in poll (heartbeats
    apart), spins nothing, and a step is only the engine's own few attribute reads."""
    import kvpush
    from tests.support.harness import make_cache

    src, dst = make_cache(num_blocks=8), make_cache(num_blocks=8)
    with kvpush.Producer(src.layout) as p, kvpush.Consumer(dst.layout) as c:
        c.connect(p.address)
        time.sleep(0.2)  # let the handshake's messages settle
        before = (c.stats(), p.stats())
        t0 = time.monotonic()
        for _ in range(2000):  # 2000 engine steps
            assert c.get_finished() == [] and p.get_released() == []
            c.pending, p.pending  # noqa: B018
        elapsed = time.monotonic() - t0
        after = (c.stats(), p.stats())
    for b, a in zip(before, after, strict=True):
        assert a["hot_polls"] == b["hot_polls"]
        # a heartbeat per second (consumer) and the peers' answers; never one per step
        assert a["loop_wakeups"] - b["loop_wakeups"] <= 6 + 4 * elapsed


@pytest.mark.parametrize(("window_s", "step_s"), [(2e-3, 125e-6), (200e-6, 20e-6),
                                                  (20e-3, 500e-6)])
def test_a_window_is_polled_window_polls_times(window_s: float, step_s: float,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside a predicted window the loop polls ``window_polls`` times through it: a 16 MiB
    push's 2 ms window (a quarter of 8 ms) every 125 us, not every 20 us (a landing a
    millisecond after the window opened took 50 polls); never closer than ``min_sleep_s``
    (a 1 MiB push's window) nor further than ``max_sleep_s``. The clock stands still: a
    thread descheduled between the window's making and the delay's reading would find
    itself past the window's end."""
    backoff = Backoff(POLICY)
    _waited(backoff, 1.0)
    now = time.monotonic()
    monkeypatch.setattr(time, "monotonic", lambda: now)
    assert POLICY.window_polls == 16
    delay = backoff.next_delay((now - window_s / 2, now + window_s / 2))
    assert delay == pytest.approx(step_s, rel=0.01)
    closely = Backoff(ProgressPolicy.latency_first())
    _waited(closely, 1.0)
    assert closely.next_delay((now - window_s / 2, now + window_s / 2)) == \
        pytest.approx(ProgressPolicy.latency_first().min_sleep_s, rel=0.01)
    with pytest.raises(ValueError, match="window_polls must be in"):
        ProgressPolicy(window_polls=0)
