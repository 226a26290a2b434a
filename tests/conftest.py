from __future__ import annotations

import threading
import time
from collections.abc import Generator, Iterator
from typing import Any

import pytest

from kvpush.metrics import LIVE
from tests.support.terminate import pytest_configure  # noqa: F401 - the hook: SIGTERM tears down


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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) \
        -> Generator[None, Any, None]:
    """A failing test that holds node processes (a fixture with ``log_tails()``, e.g.
    the fault matrix's Pair) shows their logs: they are deleted when the nodes close."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    seen: set[int] = set()
    for value in getattr(item, "funcargs", {}).values():
        tails = getattr(value, "log_tails", None)
        if callable(tails) and id(value) not in seen:  # fixtures may share one object
            seen.add(id(value))
            report.sections.append((f"node logs ({report.when})", str(tails())))
