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
    # inside the window: poll every min_sleep
    assert backoff.next_delay((now - 1e-3, now + 1.0)) == pytest.approx(POLICY.min_sleep_s)
    # a window far ahead or already over changes nothing
    assert backoff.next_delay((now + 10.0, now + 11.0)) == pytest.approx(POLICY.max_sleep_s)
    assert backoff.next_delay((now - 2.0, now - 1.0)) == pytest.approx(POLICY.max_sleep_s)
