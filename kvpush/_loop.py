"""Which thread is a kvpush loop thread, and the rule that none of them may block.

Every Producer and Consumer runs one loop thread; kvpush's callbacks (``on_release``,
``on_finished``, ``add_done_callback`` functions) run on it. A call that waits for a loop --
``TransferHandle.wait``, the blocking ``Consumer.connect``, ``Consumer.claim`` (it may
connect), ``status`` of another endpoint -- would stall that thread, and when the loop it waits
for is its own, wait for ever (until its timeout). Such calls check :func:`no_blocking` first
and raise at once instead.
"""

from __future__ import annotations

import threading

__all__ = ["enter_loop", "loop_name", "no_blocking"]

_local = threading.local()


def enter_loop(name: str) -> None:
    """Mark the calling thread as the loop thread of endpoint ``name`` (called once, by the
    loop thread itself, when it starts)."""
    _local.endpoint = name


def loop_name() -> str | None:
    """The endpoint whose loop thread this is, or None on any other thread."""
    name: str | None = getattr(_local, "endpoint", None)
    return name


def no_blocking(what: str) -> None:
    """Raise RuntimeError if called on a kvpush loop thread: ``what`` would block it."""
    name = loop_name()
    if name is not None:
        raise RuntimeError(
            f"{what} blocks, and was called on {name}'s loop thread (from a kvpush "
            f"callback): a blocking call there stalls every request of that endpoint, and "
            f"waits for ever for an answer only that thread can give. Call it from another "
            f"thread, or use the non-blocking form (add_done_callback, await, connect_nowait, "
            f"get_finished/get_released)")
