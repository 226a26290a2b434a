"""Event-loop integration: the queue behind ``get_finished`` / ``get_released``, its file
descriptor, and async iterators over it.

A :class:`DrainQueue` is written by the endpoint's loop thread and drained by the engine's.
Its :meth:`~DrainQueue.fileno` is an eventfd the loop thread writes when the queue gains an
item and nobody was told yet; draining clears it. So a selector, an ``epoll`` set, a C++
engine's poll loop or an asyncio loop (``loop.add_reader``) can watch one descriptor per
endpoint -- no thread per request, nothing spinning -- and drain when it becomes readable.

:func:`drain_iter` turns that into an async iterator (``Consumer.results()``,
``Producer.releases()``); it works on the stock asyncio loop and on uvloop (both watch
descriptors with ``add_reader``).
"""

from __future__ import annotations

import asyncio
import os
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Generic, TypeVar

__all__ = ["DrainQueue", "drain_iter"]

_T = TypeVar("_T")


class DrainQueue(deque[_T], Generic[_T]):
    """A deque the loop thread appends to (:meth:`put`) and any thread drains
    (:meth:`take`), with a descriptor that is readable while there may be something to
    take. The descriptor lives as long as this object (an event loop watching it never
    sees it closed under it); it is closed when the object is collected."""

    def __init__(self) -> None:
        super().__init__()
        self._fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._signalled = False
        self._ended = False
        self._finalizer = weakref.finalize(self, os.close, self._fd)

    def fileno(self) -> int:
        """The eventfd: readable when items may be waiting (and once the endpoint is
        closed, so a watcher learns the end)."""
        return self._fd

    def put(self, item: _T) -> None:
        """(Loop thread.) Queue ``item``; wake a watcher unless one was woken already and
        has not drained since (one write per drain, not per item)."""
        self.append(item)
        self.signal()

    def end(self) -> None:
        """(Loop thread, at close.) Nothing more will come: wake every watcher."""
        self._ended = True
        self.signal(force=True)

    @property
    def ended(self) -> bool:
        """True once the endpoint closed (what is queued may still be taken)."""
        return self._ended

    def signal(self, force: bool = False) -> None:
        """(Loop thread.) Wake the watcher (see :meth:`put`). The descriptor is written
        before the flag is set: a drain that sees the flag set finds the write there."""
        if not self._signalled or force:
            os.eventfd_write(self._fd, 1)
            self._signalled = True

    def take(self) -> list[_T]:
        """Everything queued now, oldest first (any thread). If the loop signalled, clears
        the descriptor, then the flag, then drains: an item queued before the flag is
        cleared is drained here, and one queued after it writes the descriptor again.
        (Clearing the flag before reading the descriptor lost that write: a watcher then
        slept with an item queued.) Nothing signalled: no system call."""
        if self._signalled and not self._ended:
            try:
                os.eventfd_read(self._fd)
            except BlockingIOError:
                pass
            self._signalled = False
        out = []
        while self:
            try:
                out.append(self.popleft())
            except IndexError:  # another thread drained it meanwhile
                break
        return out


async def drain_iter(queue: DrainQueue[_T], check: Callable[[], None] | None = None
                     ) -> AsyncIterator[_T]:
    """Yield every item of ``queue`` as it comes, in order, until the endpoint closes and
    the queue is empty. Waits with ``loop.add_reader`` on the queue's descriptor (no thread,
    no polling). ``check`` is called before each wait (e.g. to refuse a misuse)."""
    loop = asyncio.get_running_loop()
    fd = queue.fileno()
    while True:
        for item in queue.take():
            yield item
        if queue.ended and not queue:
            return
        if check is not None:
            check()
        ready = loop.create_future()

        def wake(future: asyncio.Future[None] = ready) -> None:
            if not future.done():
                future.set_result(None)

        loop.add_reader(fd, wake)
        try:
            if not queue and not queue.ended:  # queued between take() and add_reader
                await ready
        finally:
            loop.remove_reader(fd)

