"""What a protocol core asks its I/O driver to do.

A core appends effects to its outbox in the order they must happen (a ``Posted`` hint is
sent before the WRITE it announces is posted); the driver drains them with
``core.drain()`` and carries each out in that order. Carrying one out may feed events back
into the core (a post that NIXL refuses at once: ``core.transfer_ended``), which appends
more effects: the driver drains until the outbox is empty.

Peers are named by their NIXL agent name (a ``str``) on both sides; transfers by a key the
core chooses (an ``int``, unique for the core's lifetime).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import numpy as np

from .. import messages as m
from .._enum import IdentityEnum
from ..request import Release, TransferResult

__all__ = ["Abandon", "ClaimGone", "Dial", "DropPeer", "Effect", "Emit", "Post", "Send",
           "XferEnd"]


class XferEnd(IdentityEnum):
    """How a transfer ended, as the driver reports it to ``core.transfer_ended``."""

    DONE = "done"            # NIXL reports it complete: every byte has landed
    ERROR = "error"          # NIXL reports an error, or refused the post: nothing more lands
    ABANDONED = "abandoned"  # released while still in progress (after an Abandon): bytes
                             # may still land at any later time
    LOST = "lost"            # the peer is unreachable (NIXL disconnect error at post time)


@dataclass(frozen=True, slots=True)
class Send:
    """Send a control frame to ``peer`` over its control connection."""

    peer: str
    msg: m.Message


@dataclass(frozen=True, slots=True)
class Post:
    """Post a NIXL transfer. ``local``/``remote`` are descriptor indices into the lists the
    driver prepared for ``peer``; ``notif`` is the notification NIXL delivers to the target
    once the bytes have landed. The driver answers ``core.transfer_ended(key, ...)`` when
    the transfer ends (at once if NIXL refuses the post or finishes it inside the call)."""

    key: int
    op: str                  # "WRITE" | "READ"
    peer: str
    local: np.ndarray
    remote: np.ndarray
    notif: m.Message
    nbytes: int
    descriptors: int
    # The plan's runs (region 0's local_start, remote_start, length, in block ids) and the
    # regions [lo, hi) the indices cover: what lets the driver post a request of long runs
    # as explicit merged descriptors instead (kvpush.agent.explicit_is_cheaper); None where
    # the plan has none.
    runs: np.ndarray | None = None
    regions: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class Abandon:
    """Give up transfer ``key`` without waiting for its end (its deadline passed, or its
    peer is gone). The driver releases the NIXL handle and answers
    ``core.transfer_ended(key, DONE | ERROR | ABANDONED)`` with the state it found; if NIXL
    refuses the release, the driver keeps polling it and answers when it ends."""

    key: int


@dataclass(frozen=True, slots=True)
class ClaimGone:
    """A consumer's claim ``xid`` of ``request_id`` ended without its pull or expect (the
    engine, a producer or the core gave it up): it has no result, so this tells the facade,
    which answers "already claimed" on the engine's thread, to forget it."""

    request_id: str
    xid: int


@dataclass(frozen=True, slots=True)
class Emit:
    """Hand a :class:`~kvpush.request.Release` (producer) or a
    :class:`~kvpush.request.TransferResult` (consumer) to the engine, or a
    :class:`ClaimGone` to the consumer's facade."""

    item: Release | TransferResult | ClaimGone


@dataclass(frozen=True, slots=True)
class DropPeer:
    """Forget ``peer`` at the transport level (``remove_remote_agent``, close its
    connection). The core has already ended everything it had with the peer."""

    peer: str
    why: str


@dataclass(frozen=True, slots=True)
class Dial:
    """Connect to the producer at ``address`` within ``timeout`` seconds (a consumer's
    pull names a producer it is not connected to). The driver answers
    ``core.dialed(address, name, error)`` once the handshake ended, whichever way."""

    address: str
    timeout: float


Effect = Union[Send, Post, Abandon, Emit, DropPeer, Dial]  # noqa: UP007

