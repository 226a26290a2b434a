from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from kvpush.metrics import LIVE


@pytest.fixture(autouse=True)
def _nothing_left_behind() -> Iterator[None]:
    """Every test ends with no kvpush resource live and no kvpush thread running."""
    yield
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        threads = [t.name for t in threading.enumerate() if t.name.startswith("kvpush-")]
        live = LIVE.snapshot()
        if not threads and not live:
            return
        time.sleep(0.05)
    raise AssertionError(f"left behind: threads={threads} live={live}")
