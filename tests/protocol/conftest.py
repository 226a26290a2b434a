from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.cores import close_cores


@pytest.fixture(autouse=True)
def _close_cores() -> Iterator[None]:
    """Every consumer core a test made with ``tests.support.cores.core`` is closed after it."""
    yield
    close_cores()
