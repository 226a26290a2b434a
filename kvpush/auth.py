"""Optional shared-key authentication of every control message and notification.

With an ``auth_key`` configured on both sides, each frame carries a 64-bit counter and an
HMAC-SHA256 tag over (direction label, counter, body):

* the handshake is tagged with the shared key itself. The consumer's Probe asks who answers
  at the address; the producer's Challenge names it and carries a nonce of its own that the
  consumer's Hello must carry back (:class:`Challenges`: once, and only to the producer that
  issued it, so a Hello captured on its way to one producer is refused by any other that
  shares the key and port). The Hello carries a fresh nonce and its wall-clock time (the
  producer refuses stale Hellos and nonces it has seen); the producer's HelloAck -- or its
  HelloReject, so the consumer can trust a refusal -- echoes that nonce and adds its own;
* every later frame is tagged with a per-connection session key,
  ``HMAC(key, "kvpush session" | consumer nonce | producer nonce)``, so frames of one
  connection cannot be replayed into another;
* receivers accept each counter once (a sliding window, because NIXL notifications of
  different transfers may arrive out of order). Forged, tampered and replayed frames raise
  :class:`~kvpush.errors.AuthenticationError` and are counted, never acted on. A consumer
  opens notifications with ``accept_old``: one older than the window is not refused (a
  large WRITE's can be overtaken by thousands of later ones), because a ``Landed`` counts
  once per (transfer id, part) anyway.

Confidentiality (AEAD, ChaCha20-Poly1305 from the ``cryptography`` package): what lets a
peer touch this side's memory -- the NIXL agent metadata (worker address and the remote keys
of the whole cache) in the Hello and HelloAck, and the block ids of a pull ticket -- travels
encrypted and authenticated (:func:`encrypt` / :func:`decrypt`), so a router or an observer
of the control plane can neither read nor alter it.

Keys are bytes of at least 16; give both sides the same key out of band. What the key
protects and what it cannot (one-sided RDMA inside the fabric): docs/RELIABILITY.md, "Threat
model".
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import time
from typing import Any

from .errors import AuthenticationError

__all__ = ["Challenges", "HelloGuard", "Opener", "Sealer", "check_key", "decrypt", "encrypt",
           "new_nonce", "session_key"]

TAG_BYTES = 32
COUNTER = struct.Struct(">Q")
HELLO_MAX_SKEW_S = 120.0


def check_key(key: bytes | None, owner: str) -> bytes | None:
    """Refuse a key that is not bytes of at least 16 (``owner`` names the config)."""
    if key is None:
        return None
    if not isinstance(key, (bytes, bytearray)) or len(key) < 16:
        raise ValueError(f"{owner}.auth_key must be bytes of length >= 16 (or None)")
    _aead_class()  # a key needs the cipher: say so at configuration, not mid-handshake
    return bytes(key)


def _aead_class() -> Any:
    try:
        from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("kvpush's auth_key needs the 'cryptography' package "
                          "(pip install cryptography)") from exc
    return ChaCha20Poly1305


def _aead(key: bytes, label: bytes) -> Any:
    return _aead_class()(hmac.new(key, b"kvpush aead\0" + label, hashlib.sha256).digest())


def encrypt(key: bytes, label: bytes, aad: bytes, data: bytes) -> bytes:
    """``nonce | ciphertext+tag`` of ``data`` under a key derived from ``key`` and
    ``label``; ``aad`` is authenticated, not encrypted (what the blob is bound to)."""
    nonce = os.urandom(12)
    return nonce + bytes(_aead(key, label).encrypt(nonce, data, aad))


def decrypt(key: bytes, label: bytes, aad: bytes, blob: bytes) -> bytes:
    """Inverse of :func:`encrypt`; AuthenticationError if the blob was made with another
    key, label or ``aad``, or altered."""
    from cryptography.exceptions import InvalidTag
    if len(blob) < 12 + 16:
        raise AuthenticationError("encrypted field too short")
    try:
        return bytes(_aead(key, label).decrypt(blob[:12], blob[12:], aad))
    except InvalidTag:
        raise AuthenticationError("encrypted field does not open with this key "
                                  "(forged, altered, or bound to something else)") from None


def new_nonce() -> bytes:
    """16 random bytes."""
    return os.urandom(16)


def session_key(key: bytes, consumer_nonce: bytes, producer_nonce: bytes) -> bytes:
    """The key of one connection, from the shared key and both sides' nonces."""
    return hmac.new(key, b"kvpush session\0" + consumer_nonce + producer_nonce,
                    hashlib.sha256).digest()


class Sealer:
    """Tags the frames one side sends in one direction."""

    __slots__ = ("_counter", "_key", "_label")

    def __init__(self, key: bytes, label: bytes) -> None:
        self._key = key
        self._label = label
        self._counter = 0

    def seal(self, body: bytes) -> bytes:
        """``counter | tag | body``."""
        self._counter += 1
        counter = COUNTER.pack(self._counter)
        tag = hmac.new(self._key, self._label + counter + body, hashlib.sha256).digest()
        return counter + tag + body


class Opener:
    """Checks the frames one side receives in one direction.

    ``window`` counters behind the highest seen are still accepted once each; older ones
    and repeats are replays. With ``accept_old``, counters older than the window are
    accepted (repeats inside it still are not): for frames whose own content makes a
    second copy harmless, such as NIXL notifications, which the consumer counts once per
    (transfer id, part) and which a large WRITE's may arrive after thousands of later ones.
    """

    __slots__ = ("_accept_old", "_highest", "_key", "_label", "_replay", "_seen", "_window")

    def __init__(self, key: bytes, label: bytes, window: int = 4096,
                 replay: bool = True, accept_old: bool = False) -> None:
        self._key = key
        self._label = label
        self._highest = 0
        self._seen = 0  # bit i set: counter (highest - i) was seen
        self._window = window
        self._replay = replay  # False for handshakes, which HelloGuard / nonces protect
        self._accept_old = accept_old

    def open(self, sealed: bytes | memoryview) -> bytes:
        """The body of a sealed frame; raises AuthenticationError if forged or replayed."""
        data = bytes(sealed)
        if len(data) < COUNTER.size + TAG_BYTES:
            raise AuthenticationError("authenticated frame too short")
        counter_bytes = data[:COUNTER.size]
        tag = data[COUNTER.size:COUNTER.size + TAG_BYTES]
        body = data[COUNTER.size + TAG_BYTES:]
        want = hmac.new(self._key, self._label + counter_bytes + body, hashlib.sha256).digest()
        if not hmac.compare_digest(tag, want):
            raise AuthenticationError("bad authentication tag (forged, tampered, or wrong key)")
        (counter,) = COUNTER.unpack(counter_bytes)
        if not self._replay:
            return body
        if counter > self._highest:
            shift = counter - self._highest
            self._seen = ((self._seen << shift) | 1) & ((1 << self._window) - 1) \
                if shift < self._window else 1
            self._highest = counter
        else:
            back = self._highest - counter
            if back >= self._window:
                if self._accept_old:
                    return body
                raise AuthenticationError(f"replayed frame (counter {counter})")
            if (self._seen >> back) & 1:
                raise AuthenticationError(f"replayed frame (counter {counter})")
            self._seen |= 1 << back
        return body


class HelloGuard:
    """Producer side: refuse stale Hellos and Hello nonces already used."""

    def __init__(self) -> None:
        self._seen: dict[bytes, float] = {}

    def check(self, nonce: bytes, sent_at: float, now: float | None = None) -> None:
        """Refuse a Hello too old, from the future, or seen before (a replay). ``now``: this
        side's wall clock (default ``time.time()``; the simulator passes its own)."""
        if now is None:
            now = time.time()
        if abs(now - sent_at) > HELLO_MAX_SKEW_S:
            raise AuthenticationError(f"Hello is {now - sent_at:.0f} s old (clock skew or replay)")
        if len(nonce) != 16:
            raise AuthenticationError("Hello nonce must be 16 bytes")
        if nonce in self._seen:
            raise AuthenticationError("replayed Hello")
        if len(self._seen) > 10000:
            self._seen = {k: t for k, t in self._seen.items() if now - t < 2 * HELLO_MAX_SKEW_S}
        self._seen[nonce] = now


class Challenges:
    """Producer side: the nonces of the Challenges it issued; a Hello redeems one, once,
    within :data:`HELLO_MAX_SKEW_S` of its issue. At most ``limit`` wait (the oldest go
    first: a consumer whose challenge went is refused and probes again), so strangers that
    probe and never say Hello cannot grow this side's memory."""

    def __init__(self, limit: int = 4096) -> None:
        self._issued: dict[bytes, float] = {}
        self._limit = limit

    def issue(self, now: float | None = None, nonce: bytes | None = None) -> bytes:
        """A fresh challenge nonce, remembered until redeemed, stale or pushed out. ``now``
        (monotonic, default ``time.monotonic()``) and ``nonce`` (default random): the
        simulator passes its own clock and seeded nonces."""
        while len(self._issued) >= self._limit:
            del self._issued[next(iter(self._issued))]
        nonce = new_nonce() if nonce is None else nonce
        self._issued[nonce] = time.monotonic() if now is None else now
        return nonce

    def redeem(self, nonce: bytes, now: float | None = None) -> None:
        """Accept ``nonce`` once; AuthenticationError if this side did not issue it (a Hello
        meant for another producer), or it was redeemed already or is stale."""
        issued = self._issued.pop(nonce, None)
        if now is None:
            now = time.monotonic()
        if issued is None or now - issued > HELLO_MAX_SKEW_S:
            raise AuthenticationError("Hello does not answer a challenge of this producer "
                                      "(meant for another, replayed, or stale)")
