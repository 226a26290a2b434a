"""Control-plane messages: versioned, schema-checked, never pickle.

Every message is a msgspec ``Struct`` in one tagged union, encoded as MessagePack behind a
one-byte protocol version. :func:`decode` accepts only this schema: unknown tags, missing or
extra fields, wrong types and other versions all raise :class:`~kvpush.errors.ProtocolError`,
so a malformed or hostile frame can never reach the protocol logic as a half-valid object.

Block ids travel as little-endian int64 bytes (compact, and decoded without a Python loop).

Transfer ids (protocol version 2). Every *use* of a request id carries ids that name it, so a
stale message of an earlier use, or a message of another consumer, can never touch the live
one: ``xid`` is chosen by the consumer for each ``expect``/``pull`` (random, non-zero) and is
carried by every message about that use in both directions; ``sid`` is chosen by the producer
for each ``prefill_done`` (a *source use*) and travels in the pull ticket. ``sharers`` is how
many consumer endpoints take a share of one producer's source for one request (heterogeneous
TP: several decode ranks read, or are written, the same prefill request, each its own head
share); the producer holds the source until that many owners have finished or given up.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Annotated, Union

import msgspec
import numpy as np

from .errors import AuthenticationError, ProtocolError
from .layout import LayoutWire

__all__ = [
    "MAX_FRAME_BYTES",
    "PROTOCOL_VERSION",
    "Abort",
    "AbortAck",
    "Bye",
    "Challenge",
    "Claim",
    "Failed",
    "Heartbeat",
    "HeartbeatAck",
    "Hello",
    "HelloAck",
    "HelloReject",
    "Landed",
    "Message",
    "Posted",
    "Probe",
    "PullBegin",
    "PullDone",
    "PullHeld",
    "PullTicket",
    "Register",
    "decode",
    "decode_ids",
    "encode",
    "encode_ids",
    "is_sealed",
    "new_id",
]

# Every frame and ticket starts with it; a peer of another version is refused whole (its
# frames at the first byte, its Hello with them), never half understood: messages refuse
# fields they do not know (forbid_unknown_fields), so a new field is a new version.
PROTOCOL_VERSION = 5
_PLAIN = bytes([PROTOCOL_VERSION, 0])
_SEALED = bytes([PROTOCOL_VERSION, 1])

if TYPE_CHECKING:
    from .auth import Opener, Sealer
#: Largest control frame either side accepts (ZeroMQ's ``MAXMSGSIZE``: a larger frame is
#: refused by libzmq before it is allocated, and the connection that sent it dropped).
MAX_FRAME_BYTES = 64 << 20
#: Most block ids one message may carry (they travel as 8 bytes each).
_MAX_ID_COUNT = MAX_FRAME_BYTES // 8 - 4096
#: Upper bound of ``sharers`` (consumer endpoints sharing one producer's source).
MAX_SHARERS = 1024


#: Field types with limits checked while decoding: a hostile frame cannot smuggle an
#: oversized id or text into the protocol logic.
RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
Id = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
Sharers = Annotated[int, msgspec.Meta(ge=1, le=MAX_SHARERS)]
Text = Annotated[str, msgspec.Meta(max_length=4096)]
Parts = Annotated[list[int], msgspec.Meta(max_length=1 << 16)]


class _Msg(msgspec.Struct, tag_field="t", forbid_unknown_fields=True, frozen=True):
    pass


class Probe(_Msg, tag="probe", frozen=True):
    """Consumer -> producer, first: who answers at this address? Answered by
    :class:`Challenge`. With authentication, sealed with the key (a peer without it learns
    nothing and makes the producer sign nothing)."""

    nonce: bytes = b""        # fresh per connection attempt; the Hello carries it again


class Challenge(_Msg, tag="challenge", frozen=True):
    """Producer -> consumer, the answer to :class:`Probe`: which producer this is, before
    the consumer commits to a connection (a second address of a producer it is connected
    to joins that connection), and the nonce its Hello must carry. With authentication,
    sealed with the key: a Hello is then bound to the producer that issued its challenge,
    not only to an address, so one captured on its way to one producer is refused by
    every other."""

    name: str                 # the producer's NIXL agent name
    instance: bytes           # random per Producer object: same name and instance, same producer
    nonce: bytes              # the Hello must carry it (``Hello.challenge``), once
    echo: bytes = b""         # the Probe's nonce


class Hello(_Msg, tag="hello", frozen=True):
    """Consumer -> producer: open a connection."""

    name: str                 # the sender's NIXL agent name (checked against its metadata)
    agent_metadata: bytes     # with authentication: encrypted (auth.encrypt), bound to nonce
    layout: LayoutWire
    nonce: bytes = b""        # with authentication: fresh per connection attempt
    sent_at: float = 0.0      # wall clock, with authentication
    to: str = ""              # the address the consumer dialed (the producer checks it)
    challenge: bytes = b""    # the nonce of the Challenge it answers (required)
    # How the consumer judges the producer's silence: a Heartbeat every heartbeat_s, the
    # producer given up once one goes unanswered peer_timeout_s. The producer reads its
    # frames' delays against them (0: not said; its delays are not judged).
    heartbeat_s: float = 0.0
    peer_timeout_s: float = 0.0


class HelloAck(_Msg, tag="hello_ack", frozen=True):
    """Producer -> consumer: the connection is open."""

    name: str
    agent_metadata: bytes
    layout: LayoutWire
    nonce: bytes = b""        # the producer's nonce (authentication)
    echo: bytes = b""         # the Hello's nonce, echoed (authentication)


class HelloReject(_Msg, tag="hello_reject", frozen=True):
    """Producer -> consumer: the connection is refused (``field`` names a layout field, or
    is empty for other reasons)."""

    reason: Text
    field: str = ""
    local: str = ""
    remote: str = ""
    echo: bytes = b""         # the refused Hello's nonce (sealed with the key, if it had one)


class Register(_Msg, tag="register", frozen=True):
    """Consumer -> producer (push): destination blocks for a request are allocated."""

    request_id: RequestId
    xid: int                  # the consumer's transfer id of this use
    block_ids: bytes
    part: int
    wait_s: float
    verify: bool = False      # ask for per-block checksums with the completion
    groups: int = 1           # WRITEs (and Landed parts) per producer: 1, or one per layer
    tail: bool = False        # the consumer wants only the last len(block_ids) source blocks
    sharers: Sharers = 1          # consumer endpoints that take a share of this source
    # The source use (the producer's sid) this registration is for, when the consumer knows
    # it (the router relays it, as in a pull ticket); 0: the use the producer holds or
    # starts next. A named registration never attaches to another use.
    sid: Id = 0
    sent: float = 0.0         # the consumer's monotonic clock when it sent this (0: unsaid)


class Posted(_Msg, tag="posted", frozen=True):
    """Producer -> consumer: the WRITE of one part of a request is being posted (poll for
    its landing). Sent just before the post, so its trip overlaps the bytes'; if NIXL then
    refuses the post, the ``Failed`` that follows names the part in ``errored``."""

    request_id: RequestId
    xid: Id
    part: int
    # Nothing to write for this part (e.g. a full prefix hit): it counts as landed now.
    # Sent over the control socket because a NIXL notification alone would need the
    # producer to keep progressing its agent until a first connection is up.
    empty: bool = False
    # The producer's last WRITE of this size to this consumer had moved its bytes by the
    # time its post returned (UCX over shared memory or CMA), and the post took this long
    # (seconds; 0: it had not, or none yet): the consumer's progress does not move them, so
    # it need not poll before the landing it predicts, nor wait past this long for it.
    inline_s: float = 0.0


class Failed(_Msg, tag="failed", frozen=True):
    """Producer -> consumer: the producer will not (or could not) deliver a request's data.

    Push: sent once every WRITE of the request has ended. A part announced by ``Posted``
    whose WRITE completed has its ``Landed`` notification on the way behind its bytes (the
    consumer waits for it before reporting); ``errored`` names the parts whose WRITE ended
    in error instead (nothing more comes from them); ``unfenced`` says a WRITE was abandoned
    while NIXL still had it in progress, so its bytes may land at any later time. Pull
    (code "not_held"): the producer does not hold the ticket's blocks, so what a READ got
    from them is wrong.
    """

    request_id: RequestId
    xid: Id
    code: str
    reason: Text
    errored: Parts = []
    unfenced: bool = False


class Abort(_Msg, tag="abort", frozen=True):
    """Either direction: give up a request (the use named by ``xid``)."""

    request_id: RequestId
    xid: Id
    reason: Text


class AbortAck(_Msg, tag="abort_ack", frozen=True):
    """Producer -> consumer: every WRITE of this request has ended (done or in error, never
    merely cancelled: NIXL's release of a WRITE in progress does not stop its bytes).
    ``errored`` and ``unfenced`` as in :class:`Failed`."""

    request_id: RequestId
    xid: Id
    errored: Parts = []
    unfenced: bool = False


class PullHeld(_Msg, tag="pull_held", frozen=True):
    """Producer -> consumer (pull), the answer to ``PullBegin``: the blocks are held and stay
    held until the READ has ended. The consumer reports READY only after both this and its
    READ being done (otherwise ``Failed`` with code "not_held" or "aborted" comes).

    ``hold_s``: the blocks stay held at least this long after the producer received the
    ``PullBegin``, whatever happens to the connection; a READ that ends later than
    ``hold_s`` after the consumer sent its ``PullBegin`` is not trusted."""

    request_id: RequestId
    xid: Id
    hold_s: float


class PullBegin(_Msg, tag="pull_begin", frozen=True):
    """Consumer -> producer (pull): a READ of the source use ``sid`` is in flight."""

    request_id: RequestId
    xid: Id
    sid: Id
    sharers: Sharers = 1
    # The consumer's last READ of this size from this producer had moved its bytes by the
    # time its post returned, and the post took this long (seconds; 0: not so, or none
    # yet): the producer need not poll for the PullDone before the moment it predicts.
    inline_s: float = 0.0


class Claim(_Msg, tag="claim", frozen=True):
    """Consumer -> producer: this consumer will take a share of ``request_id`` but cannot
    yet (e.g. its engine has no free blocks): hold the source past its lease while this
    consumer is alive (its heartbeats keep it so), or until it takes it or gives up.

    Pull (``push`` false): the READ of source use ``sid`` (a ticket's) follows as a
    ``PullBegin`` with the same ``xid``. Push (``push`` true, ``sid`` 0: the consumer knows
    no source use yet): a ``Register`` with the same ``xid`` follows, before or after the
    prefill is done."""

    request_id: RequestId
    xid: Id
    sid: Id
    sharers: Sharers = 1
    push: bool = False


class Heartbeat(_Msg, tag="hb", frozen=True):
    """Consumer -> producer: still here (answered by HeartbeatAck)."""

    seq: int
    sent: float = 0.0         # the consumer's monotonic clock when it sent this (0: unsaid)


class HeartbeatAck(_Msg, tag="hb_ack", frozen=True):
    """Producer -> consumer: the answer to Heartbeat ``seq``."""

    seq: int


class Bye(_Msg, tag="bye", frozen=True):
    """Either direction: the sender is closing; drop its state. ``rejoin`` (producer to
    consumer): connect again -- the producer's data plane restarted (new NIXL metadata), or
    the producer was silent so long that the consumer may have given it up."""

    name: str
    rejoin: bool = False


# -- carried as NIXL notifications (delivered after the data has landed) -----------------
class Landed(_Msg, tag="landed", frozen=True):
    """WRITE notification, producer -> consumer: this part of the request has landed.
    ``checksums``: per-block 64-bit checksums of the source blocks (little-endian uint64, in
    registration order) when the consumer asked to verify."""

    request_id: RequestId
    xid: Id
    part: int
    checksums: bytes = b""
    nbytes: int = 0           # bytes this part moved


class PullDone(_Msg, tag="pull_done", frozen=True):
    """READ notification, consumer -> producer: the consumer has read the request's blocks
    (source use ``sid``; also sent over the control socket for an empty pull, and after a
    READ that could not be posted)."""

    request_id: RequestId
    xid: Id
    sid: Id
    nbytes: int = 0           # bytes the READ moved
    sharers: Sharers = 1          # as in the PullBegin (a PullDone can overtake it)


class _Sealed(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The part of a pull ticket that a router must neither read nor alter."""

    block_ids: bytes
    lease_s: float
    issued_at: float
    sid: int
    checksums: bytes


class PullTicket(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the router relays to the consumer in pull mode: where the source blocks are.

    ``lease_s`` is how long the producer holds the blocks from ``issued_at`` (its wall
    clock); the consumer refuses to start a READ it could not finish inside that lease.

    With an ``auth_key`` the ticket is *sealed* (:meth:`seal`): block ids, lease, sid and
    checksums travel only inside ``sealed`` (AEAD, bound to producer, address and request
    id), so a router can route it but not read or alter it; the consumer opens it
    (:meth:`open`) and refuses an unsealed or altered ticket.
    """

    producer: str
    address: str
    request_id: RequestId
    block_ids: bytes
    lease_s: float
    issued_at: float
    sid: int = 0              # the producer's source use these blocks belong to
    checksums: bytes = b""    # per-block source checksums (ProducerConfig.verify)
    version: int = PROTOCOL_VERSION
    sealed: bytes = b""       # with auth_key: the fields above, encrypted (see seal)

    def to_bytes(self) -> bytes:
        """The ticket as bytes, for the router to relay."""
        return msgspec.msgpack.encode(self)

    def _aad(self) -> bytes:
        return msgspec.msgpack.encode((self.producer, self.address, self.request_id,
                                       self.version))

    def seal(self, key: bytes) -> PullTicket:
        """This ticket with its block ids, lease, sid and checksums encrypted under
        ``key`` (the plain copies emptied)."""
        from .auth import encrypt
        inner = _Sealed(self.block_ids, self.lease_s, self.issued_at, self.sid, self.checksums)
        return msgspec.structs.replace(
            self, block_ids=b"", lease_s=0.0, issued_at=0.0, sid=0, checksums=b"",
            sealed=encrypt(key, b"pull-ticket", self._aad(), msgspec.msgpack.encode(inner)))

    def open(self, key: bytes) -> PullTicket:
        """The sealed ticket's fields back (AuthenticationError for a ticket that is not
        sealed, or was sealed with another key, or altered)."""
        from .auth import decrypt
        if not self.sealed:
            raise AuthenticationError("pull ticket is not sealed, but this side has an "
                                      "auth_key (a ticket from a producer without the key, "
                                      "or forged)")
        inner = msgspec.msgpack.decode(decrypt(key, b"pull-ticket", self._aad(), self.sealed),
                                       type=_Sealed)
        return msgspec.structs.replace(self, block_ids=inner.block_ids, lease_s=inner.lease_s,
                                       issued_at=inner.issued_at, sid=inner.sid,
                                       checksums=inner.checksums, sealed=b"")

    @classmethod
    def from_bytes(cls, data: bytes) -> PullTicket:
        """A ticket from :meth:`to_bytes` (ProtocolError if malformed)."""
        try:
            ticket = msgspec.msgpack.decode(data, type=cls)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError(f"invalid pull ticket: {exc}") from exc
        if ticket.version != PROTOCOL_VERSION:
            raise ProtocolError(f"pull ticket of protocol version {ticket.version}, "
                                f"this side speaks {PROTOCOL_VERSION}")
        return ticket


Message = Union[  # noqa: UP007 - msgspec needs a runtime Union here
    Probe, Challenge, Hello, HelloAck, HelloReject, Register, Posted, Failed, Abort, AbortAck,
    PullBegin, PullHeld, Claim, Heartbeat, HeartbeatAck, Bye, Landed, PullDone,
]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message, sealer: Sealer | None = None) -> bytes:
    """Serialize a message: version byte, auth byte, then the MessagePack body (sealed with
    an HMAC tag and counter when ``sealer`` is given)."""
    body = _encoder.encode(msg)
    if sealer is None:
        return _PLAIN + body
    return _SEALED + sealer.seal(body)


def is_sealed(frame: bytes | memoryview) -> bool:
    """True if ``frame`` is sealed (authenticated with a key)."""
    return len(frame) >= 2 and frame[1] == 1


def decode(frame: bytes | memoryview, opener: Opener | None = None) -> Message:
    """Parse a frame. Anything but a well-formed message of this version raises
    :class:`~kvpush.errors.ProtocolError`; with ``opener``, an unauthenticated, forged or
    replayed frame raises :class:`~kvpush.errors.AuthenticationError` (and without one, an
    authenticated frame does: this side has no key to check it)."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"frame must be bytes, got {type(frame).__name__}")
    if len(frame) < 3:
        raise ProtocolError("empty or truncated control frame")
    if frame[0] != PROTOCOL_VERSION:
        raise ProtocolError(
            f"control frame of protocol version {frame[0]}, this side speaks {PROTOCOL_VERSION}"
        )
    flag = frame[1]
    if flag == 0:
        if opener is not None:
            raise AuthenticationError("unauthenticated frame, but this side requires auth_key")
        body: bytes | memoryview = memoryview(frame)[2:]
    elif flag == 1:
        if opener is None:
            raise AuthenticationError(
                "the peer authenticates its frames, but no auth_key is configured here")
        body = opener.open(memoryview(frame)[2:])
    else:
        raise ProtocolError(f"unknown frame flag {flag}")
    try:
        return _decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"malformed control message: {exc}") from exc


def new_id() -> int:
    """A fresh random id for ``xid`` or ``sid``: 63 bits, never 0."""
    return int.from_bytes(os.urandom(8), "little") >> 1 | 1


def encode_ids(ids: np.ndarray) -> bytes:
    """Block ids as little-endian int64 bytes."""
    return np.ascontiguousarray(ids, dtype="<i8").tobytes()


def decode_ids(data: bytes) -> np.ndarray:
    """Inverse of :func:`encode_ids`; a length that is not a whole number of ids raises
    :class:`~kvpush.errors.ProtocolError`."""
    if len(data) % 8:
        raise ProtocolError(f"block id payload of {len(data)} bytes is not a multiple of 8")
    if len(data) // 8 > _MAX_ID_COUNT:
        raise ProtocolError(f"block id payload of {len(data) // 8} ids exceeds {_MAX_ID_COUNT}")
    return np.frombuffer(data, dtype="<i8").astype(np.int64, copy=False)
