"""What a Producer and a Consumer facade share: a :class:`~kvpush.driver.Driver` they own,
the lifecycle (``close``, ``with``, a warning for one never closed), and the checks of
their arguments. The facades keep configuration, validation, handles and queues; the
driver does every piece of I/O, and no facade overrides any of it.
"""

from __future__ import annotations

import logging
import warnings
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

from .driver import Core, Driver, Sessions
from .layout import KVLayout
from .messages import MAX_SHARERS

__all__ = ["RESULT_QUEUE", "Endpoint", "check_durations", "check_timeout", "queue_result",
           "sharer_counts"]

log = logging.getLogger("kvpush")

#: Results and releases waiting in ``get_finished`` / ``get_released`` past which (and at
#: every doubling) a warning says the engine does not drain them. None is ever dropped: a
#: lost Release would leak the engine's blocks.
RESULT_QUEUE = 1 << 16

C = TypeVar("C", bound=Core)
S = TypeVar("S", bound=Sessions)


def check_durations(config: Any, *names: str) -> None:
    """Every named field of a config dataclass is a duration in (0, 86400] seconds."""
    for name in names:
        value = getattr(config, name)
        if not 0 < value <= 86400:  # also refuses NaN
            raise ValueError(f"{type(config).__name__}.{name} must be in (0, 86400] s, "
                             f"got {value}")


def check_timeout(value: Any, what: str) -> float:
    """An API timeout: a real number of seconds in (0, 86400] (NaN, infinities, bools and
    strings raise ValueError: one NaN deadline would stop every timer of the loop)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0 < value <= 86400:
        raise ValueError(f"{what} must be a number of seconds in (0, 86400], got {value!r}")
    return float(value)


def sharer_counts(sharers: Any, n: int, what: str) -> list[int]:
    """``sharers`` as a count in [1, MAX_SHARERS] for each of ``n`` producers or tickets
    (one int for all, or a sequence of ``n``)."""
    counts = list(sharers) if isinstance(sharers, (list, tuple)) else [sharers] * n
    name = "each of sharers" if isinstance(sharers, (list, tuple)) else "sharers"
    for value in counts:
        if isinstance(value, bool) or not isinstance(value, int) \
                or not 1 <= value <= MAX_SHARERS:
            raise ValueError(f"{name} must be an int in [1, {MAX_SHARERS}], got {value!r}")
    if len(counts) != n:
        raise ValueError(f"sharers names {len(counts)} counts for {n} {what}")
    return counts


def queue_result(queue: deque[Any], item: Any, owner: str, drain: str) -> None:
    queue.append(item)
    n = len(queue)
    if n >= RESULT_QUEUE and n & (n - 1) == 0:
        log.warning("%s: %s() not drained: %d waiting (none is dropped)", owner, drain, n)


class Endpoint:
    """Base of :class:`~kvpush.Producer` and :class:`~kvpush.Consumer` (not public): the
    driver's owner and the object's lifecycle."""

    _role = "endpoint"
    _driver: Driver

    def _assemble(self, layout: KVLayout, config: Any, core: Callable[[Driver], C],
                  sessions: Callable[[Driver, C], S], deliver: Callable[[Any], None],
                  ended: Callable[[], None]) -> tuple[C, S]:
        """Make this endpoint's driver (from ``config``'s name, transport, progress and
        key), the role's core and sessions over it, and start its loop: ``deliver`` hands
        a result or release to the engine, ``ended`` follows the last. What was made is
        closed if a later part fails."""
        if not isinstance(layout, KVLayout):
            raise TypeError(f"layout must be a KVLayout, got {type(layout).__name__}")
        self.layout = layout
        driver = self._driver = Driver(layout, role=self._role, name=config.name,
                                       transport=config.transport, progress=config.progress,
                                       auth_key=config.auth_key)
        self.name: str = driver.name
        self._agent = driver.agent
        try:
            made = core(driver)
            talks = sessions(driver, made)
        except BaseException:
            driver.close()
            raise
        driver.start(made, talks, deliver, ended)
        return made, talks

    def close(self, timeout: float = 10.0) -> None:
        """Stop the loop thread, fail requests still in flight with
        :class:`~kvpush.errors.ClosedError`, and release every NIXL registration."""
        driver = getattr(self, "_driver", None)
        if driver is not None:
            driver.close(timeout)

    @property
    def closed(self) -> bool:
        """True once close() began (calls then raise ClosedError)."""
        return self._driver.closed

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        driver = getattr(self, "_driver", None)
        if driver is not None and not driver.finalized:
            warnings.warn(f"{self._role} {self.name} was not closed", ResourceWarning,
                          stacklevel=2)
            try:
                driver.close(timeout=2.0)
            except Exception:
                pass
