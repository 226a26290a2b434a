"""Planted bugs for the simulator's own tests: cores that break the protocol on purpose, so
a test can check that the checker (:mod:`kvpush.testing.checker`) catches each kind.

Each wraps a real core (:mod:`kvpush.protocol`) and changes one thing; :func:`real_consumer`
is the real consumer core as a factory the simulator's CLI loads from this file.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvpush import messages as m
from kvpush.protocol.effects import Emit, Post
from kvpush.request import Release, ReleaseReason, RequestState


class _Wrap:
    """The wrapped core, but for what a subclass overrides."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _posting(core: Any, msg: object) -> Any:
    """The consumer core's live use that ``msg`` (a Posted) announces a WRITE for, or None."""
    if not isinstance(msg, m.Posted):
        return None
    req = core._requests.get(msg.request_id)
    return req if req is not None and req.xid == msg.xid else None


class HastyConsumer(_Wrap):
    """A PLANTED BUG: a consumer core that gives a push up, its blocks called safe, as soon as
    a producer says it is posting the WRITE (the bytes may still land)."""

    def on_message(self, now: float, peer: str, msg: Any) -> None:
        self._inner.on_message(now, peer, msg)
        req = _posting(self._inner, msg)
        if req is not None:
            self._inner._finish(now, req, RequestState.FAILED, None)


class EagerConsumer(_Wrap):
    """A PLANTED BUG: a consumer core that reports a push READY as soon as a producer says it
    is posting the WRITE, before the bytes landed."""

    def on_message(self, now: float, peer: str, msg: Any) -> None:
        req = _posting(self._inner, msg)
        if req is not None:
            self._inner._finish(now, req, RequestState.READY, None)
            return
        self._inner.on_message(now, peer, msg)


class EarlyReleaseProducer:
    """A PLANTED BUG: a producer core that releases a push source as soon as it posts the
    WRITE reading it (before the WRITE has ended) -- and swallows the real release later."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._early: set[str] = set()
        self._held: dict[str, np.ndarray] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def prefill_done(self, now: float, rid: str, ids: np.ndarray, mode: Any, sid: int) -> None:
        self._held[rid] = ids
        self._inner.prefill_done(now, rid, ids, mode, sid)

    def drain(self) -> list[Any]:
        out = []
        for eff in self._inner.drain():
            if isinstance(eff, Emit) and isinstance(eff.item, Release) \
                    and eff.item.request_id in self._early:
                self._early.discard(eff.item.request_id)
                continue
            out.append(eff)
            if isinstance(eff, Post) and eff.op == "WRITE":
                rid = eff.notif.request_id  # type: ignore[union-attr]
                ids = self._held.pop(rid, None)
                if ids is not None and rid not in self._early:
                    self._early.add(rid)
                    out.append(Emit(Release(rid, ReleaseReason.TRANSFERRED, ids, "early")))
        return out


def real_consumer(ep: Any) -> Any:
    """The real consumer core, unchanged: a factory for ``--consumer-core FILE.py:FUNC``
    (the CLI loads it from this file's path)."""
    from kvpush.testing.sim import default_consumer

    return default_consumer(ep)
