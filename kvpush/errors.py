"""The exception hierarchy: every error kvpush raises derives from :class:`KvpushError`.

Where the meaning matches a builtin, the class mixes it in, so callers that already catch
``ValueError`` or ``TimeoutError`` keep working.
"""

from __future__ import annotations

__all__ = [
    "AuthenticationError",
    "ClosedError",
    "InvalidBlockIds",
    "InvalidRequest",
    "KvpushError",
    "LayoutMismatch",
    "OutOfBlocks",
    "PeerUnavailable",
    "ProtocolError",
    "RequestAborted",
    "TransferFailed",
    "TransferTimeout",
]


class KvpushError(Exception):
    """Base class of every kvpush error."""


class InvalidRequest(KvpushError, ValueError):
    """A request the caller asked for that cannot be taken as given: a request id that is not
    a non-empty str of at most 1,024 UTF-8 bytes, a request id already pending or already
    claimed on this endpoint, pull tickets that do not belong together. Raised (or put in
    the result) before anything is posted; :class:`InvalidBlockIds` is the kind for block
    ids."""


class InvalidBlockIds(InvalidRequest):
    """Block ids that cannot be transferred: wrong dtype or shape, out of range, duplicated,
    or local and remote arrays of different lengths. Raised before anything is posted."""


class LayoutMismatch(KvpushError, ValueError):
    """Two sides' KV layouts cannot exchange blocks; the message names the field."""

    def __init__(self, field: str, local: object, remote: object) -> None:
        self.field = field
        self.local = local
        self.remote = remote
        super().__init__(f"KV layouts differ in {field!r}: local={local!r}, remote={remote!r}")


class ProtocolError(KvpushError, ValueError):
    """A control message that is malformed, of an unknown version, or out of place."""


class AuthenticationError(ProtocolError):
    """A control message whose authentication tag is missing, wrong or replayed."""


class PeerUnavailable(KvpushError, ConnectionError):
    """The other side cannot be reached, stopped answering, or went away."""


class TransferFailed(KvpushError):
    """NIXL reported an error for a transfer, or the other side reported one."""


class TransferTimeout(KvpushError, TimeoutError):
    """A deadline passed before the request finished."""


class RequestAborted(KvpushError):
    """The request was aborted by one of the two sides."""


class OutOfBlocks(KvpushError, RuntimeError):
    """A :class:`~kvpush.prefix.BlockPool` cannot hand out the blocks asked for, even after
    reclaiming every unpinned cached block."""


class ClosedError(KvpushError, RuntimeError):
    """The Producer or Consumer was closed."""
