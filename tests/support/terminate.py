"""A pytest run that is sent SIGTERM (a CI job's timeout, ``kill``) stops what its fixtures
started, as Ctrl-C does: the signal raises ``KeyboardInterrupt`` in the main thread, and
pytest then runs every fixture's teardown before it exits. Python's default for SIGTERM
ends the process at once, leaving the services the fixtures started running (etcd, vLLM
servers, namespaced nodes) and their folders in the temp folder.

Both test trees' conftests import :func:`pytest_configure` (a hook where it is imported)."""

from __future__ import annotations

import signal
import threading
from types import FrameType

import pytest


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}: stopping, fixtures "
                            "torn down")


def pytest_configure(config: pytest.Config) -> None:
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _interrupt)
