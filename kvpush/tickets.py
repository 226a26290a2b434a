"""Pull tickets as a consumer takes them from its engine (through a router): decoded,
opened with the shared key, checked to name one request and distinct producers, trimmed to
the blocks left to read after a prefix-cache hit, and what is left of their lease. All of
it runs on the engine's thread, so bad input raises there with nothing queued.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TypeAlias

import msgspec
import numpy as np

from . import messages as m
from .errors import AuthenticationError, InvalidBlockIds, InvalidRequest
from .plan import check_request_id

__all__ = ["Tickets", "lease_left", "parse_tickets", "source_ids"]

#: One ticket (a struct or its bytes), or one per producer rank of the same request.
Tickets: TypeAlias = m.PullTicket | bytes | Sequence[m.PullTicket | bytes]


def parse_tickets(tickets: Tickets, what: str, key: bytes | None) -> tuple[str, list[m.PullTicket]]:
    """The request id and the tickets of one ``what`` (pull, claim), opened with ``key``: a
    router can neither read nor alter a sealed ticket."""
    batch = [tickets] if isinstance(tickets, (m.PullTicket, bytes, bytearray)) \
        else list(tickets)
    parsed = [m.PullTicket.from_bytes(bytes(t)) if isinstance(t, (bytes, bytearray))
              else t for t in batch]
    if not parsed:
        raise ValueError(f"{what} needs at least one ticket")
    if key is not None:
        parsed = [t.open(key) for t in parsed]
    elif any(t.sealed for t in parsed):
        raise AuthenticationError("the pull ticket is sealed, but this consumer has no "
                                  "auth_key to open it")
    rid = check_request_id(parsed[0].request_id)
    if any(t.request_id != rid for t in parsed):
        raise InvalidRequest(f"all tickets of one {what} must be for the same request")
    if len({t.producer for t in parsed}) != len(parsed):
        raise InvalidRequest(f"two tickets of one {what} name the same producer")
    return rid, parsed


def lease_left(tickets: Sequence[m.PullTicket], margin: float) -> float:
    """Seconds until the first of the tickets' leases ends, less ``margin`` (by this
    host's wall clock: the tickets carry the producer's)."""
    now = time.time()
    return min(t.lease_s - (now - t.issued_at) - margin for t in tickets)


def source_ids(tickets: list[m.PullTicket], dst: np.ndarray,
               tail: bool) -> tuple[list[m.PullTicket], list[np.ndarray]]:
    """The tickets and each one's source block ids; with ``tail``, only the last
    ``len(dst)`` blocks (and their checksums) of each."""
    srcs = [m.decode_ids(t.block_ids) for t in tickets]
    if not tail:
        return tickets, srcs
    for t, src in zip(tickets, srcs, strict=True):
        if len(dst) > len(src):
            raise InvalidBlockIds(f"source_tail: block_ids has {len(dst)} blocks, the "
                                  f"ticket of {t.producer} only {len(src)}")
    skip = [len(src) - len(dst) for src in srcs]
    return ([msgspec.structs.replace(t, checksums=t.checksums[8 * k:]) if t.checksums else t
             for t, k in zip(tickets, skip, strict=True)],
            [src[k:] for src, k in zip(srcs, skip, strict=True)])
