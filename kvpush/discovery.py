"""Discovery through etcd: each engine rank advertises itself under a lease; routers and
decode ranks follow the advertisements.

An :class:`Advertisement` names one rank of one engine instance: its role, its kvpush
producer address (prefill ranks), the compatibility identity of its KV cache
(:func:`compat_key`), the transfer modes it serves, whether it is ``serving`` or
``draining``, a boot epoch that changes with every incarnation, and the instance's HTTP
address for routers. A :class:`Publisher` keeps one record alive under an etcd lease while
its health callback says healthy; a killed or unhealthy process's record disappears when
its lease runs out. A :class:`Watcher` lists the records under a prefix and follows them
(an etcd watch; it lists again after every reconnect, so nothing missed while etcd was
away stays missed). :class:`ProducerDirectory` turns a watcher into the serving producers a
:class:`~kvpush.Consumer` can use, and :class:`RouterBridge` feeds vllm-router's ZeroMQ
discovery from the same records.

etcd is reached through its v3 JSON gateway (etcd 3.4 and later) with the standard
library: no client package to pin. Every call takes a timeout; every background thread is
stopped by ``close()``.

Record keys: ``{prefix}/{role}/{instance}/{rank}``, values JSON (see
:meth:`Advertisement.to_json`). The command line (``python -m kvpush.discovery``) lists
records and runs the bridge: see ``docs/DEPLOY.md``.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import enum
import hashlib
import http.client
import json
import logging
import os
import re
import secrets
import signal
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from .errors import KvpushError
from .request import TransferMode

if TYPE_CHECKING:
    from .consumer import Consumer
    from .endpoint import Endpoint
    from .layout import KVLayout
    from .producer import Producer

__all__ = [
    "Advertisement",
    "Change",
    "ChangeKind",
    "DiscoveryError",
    "DiscoveryUnavailable",
    "DrainListener",
    "EtcdClient",
    "InstanceState",
    "ProducerDirectory",
    "Publisher",
    "Role",
    "RouterBridge",
    "Watcher",
    "advertise_producer",
    "compat_key",
    "drain_reports",
    "endpoint_health",
    "endpoint_problem",
    "http_ready",
    "instance_records",
    "report_drained",
    "request_drain",
    "unrouted",
]

log = logging.getLogger("kvpush.discovery")

#: Version of the record's JSON; a reader refuses records of another version.
RECORD_VERSION = 1
#: vllm-router (0.1.17) drops an instance this long after its last ZeroMQ registration
#: (measured: the last request reached it 4.3 s after the last registration, under load).
ROUTER_EXPIRY_S = 5.0
#: A bridge confirms an instance is out of its router this long after the expiry.
_EXPIRY_MARGIN_S = 0.5
#: A bridge's presence key lives this long after its last renewal.
_BRIDGE_TTL_S = 10

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class DiscoveryError(KvpushError):
    """etcd refused a request, or a record or argument is not valid."""


class DiscoveryUnavailable(DiscoveryError, ConnectionError):
    """No etcd endpoint answered within the timeout."""


class Role(enum.Enum):
    """What an instance does with a request."""

    PREFILL = "prefill"
    DECODE = "decode"


class InstanceState(enum.Enum):
    """SERVING: takes new requests. DRAINING: finishes what it holds, takes nothing new."""

    SERVING = "serving"
    DRAINING = "draining"


def compat_key(layout: KVLayout) -> str:
    """A short digest of what two sides' layouts must have equal (the engines' identities
    and the fields that decide how a block's bytes are read): a watcher skips producers
    whose key differs from its own. Tensor-parallel shards, tokens per block and block
    counts are left out, since they may differ between compatible sides; the handshake
    still runs :func:`~kvpush.layout.check_compatible` in full."""
    from .layout import _MATCHING_FIELDS  # the one list of fields that must be equal

    facts = {"identity": [list(pair) for pair in layout.identity]}
    facts.update({name: getattr(layout, name) for name in _MATCHING_FIELDS})
    text = json.dumps(facts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Advertisement:
    """One rank of one engine instance, as published in etcd.

    Parameters
    ----------
    instance
        The instance's name, unique under the prefix (letters, digits, ``.``, ``_``,
        ``-``; at most 128).
    role
        :class:`Role`.
    compat
        Compatibility identity (:func:`compat_key` of the rank's layout).
    rank
        The rank's index in its instance (0 for a single-rank instance).
    producer
        The rank's kvpush :class:`~kvpush.Producer` address (``tcp://host:port``);
        required for a prefill rank, empty for a decode rank.
    http_address
        ``host:port`` of the instance's HTTP server (for routers); empty if none.
    modes
        Transfer modes the rank serves.
    state
        :class:`InstanceState`.
    epoch
        The incarnation: a publisher fills in its boot time (ns) when left 0, so a restart
        is seen as a new epoch under the same key.
    """

    instance: str
    role: Role
    compat: str
    rank: int = 0
    producer: str = ""
    http_address: str = ""
    modes: tuple[TransferMode, ...] = (TransferMode.PUSH, TransferMode.PULL)
    state: InstanceState = InstanceState.SERVING
    epoch: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.instance, str) or not _NAME.match(self.instance):
            raise DiscoveryError(f"Advertisement.instance must match {_NAME.pattern}, got "
                                 f"{self.instance!r}")
        if not isinstance(self.role, Role):
            raise DiscoveryError(f"Advertisement.role must be a Role, got {self.role!r}")
        if not isinstance(self.compat, str) or not self.compat:
            raise DiscoveryError(f"Advertisement.compat must be a non-empty str, got "
                                 f"{self.compat!r}")
        if not isinstance(self.rank, int) or not 0 <= self.rank < 1 << 16:
            raise DiscoveryError(f"Advertisement.rank must be an int in [0, 65536), got "
                                 f"{self.rank!r}")
        if not isinstance(self.producer, str) or (self.producer and "://" not in self.producer):
            raise DiscoveryError("Advertisement.producer must be a ZeroMQ endpoint like "
                                 f"tcp://host:port, got {self.producer!r}")
        if self.role is Role.PREFILL and not self.producer:
            raise DiscoveryError("Advertisement.producer is required for a prefill rank")
        if not isinstance(self.http_address, str) or (
                self.http_address and not _host_port(self.http_address)):
            raise DiscoveryError("Advertisement.http_address must be host:port, got "
                                 f"{self.http_address!r}")
        modes = tuple(self.modes)
        if not modes or not all(isinstance(m, TransferMode) for m in modes):
            raise DiscoveryError(f"Advertisement.modes must be TransferModes, got {modes!r}")
        object.__setattr__(self, "modes", modes)
        if not isinstance(self.state, InstanceState):
            raise DiscoveryError(f"Advertisement.state must be an InstanceState, got "
                                 f"{self.state!r}")
        if not isinstance(self.epoch, int) or self.epoch < 0:
            raise DiscoveryError(f"Advertisement.epoch must be an int >= 0, got "
                                 f"{self.epoch!r}")

    @property
    def key(self) -> str:
        """The record's key below the prefix."""
        return f"{self.role.value}/{self.instance}/{self.rank}"

    def to_json(self) -> bytes:
        """The record's value in etcd (read back by :meth:`from_json`)."""
        return json.dumps({
            "version": RECORD_VERSION, "instance": self.instance, "role": self.role.value,
            "rank": self.rank, "compat": self.compat, "producer": self.producer,
            "http_address": self.http_address, "modes": [m.value for m in self.modes],
            "state": self.state.value, "epoch": self.epoch,
        }, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Advertisement:
        """Parse a record; raises :class:`DiscoveryError` naming what is wrong."""
        try:
            d = json.loads(data)
            if not isinstance(d, dict):
                raise TypeError("not an object")
            if d.get("version") != RECORD_VERSION:
                raise DiscoveryError(f"record version {d.get('version')!r}, this reader "
                                     f"knows {RECORD_VERSION}")
            return cls(instance=d["instance"], role=Role(d["role"]), compat=d["compat"],
                       rank=d["rank"], producer=d["producer"],
                       http_address=d["http_address"],
                       modes=tuple(TransferMode(m) for m in d["modes"]),
                       state=InstanceState(d["state"]), epoch=d["epoch"])
        except DiscoveryError:
            raise
        except (ValueError, TypeError, KeyError) as exc:
            raise DiscoveryError(f"not a kvpush advertisement: {exc!r}") from None


def _host_port(text: str) -> bool:
    host, sep, port = text.rpartition(":")
    return bool(sep and host and "/" not in host and port.isdigit()
                and 0 < int(port) < 65536)


def advertise_producer(producer: Producer, instance: str, *, rank: int = 0,
                       http_address: str = "",
                       modes: Sequence[TransferMode] = (TransferMode.PUSH, TransferMode.PULL),
                       ) -> Advertisement:
    """The advertisement of a prefill rank whose kvpush side is ``producer``: its address
    and the :func:`compat_key` of its layout."""
    return Advertisement(instance, Role.PREFILL, compat_key(producer.layout), rank=rank,
                         producer=producer.address, http_address=http_address,
                         modes=tuple(modes))


def endpoint_problem(endpoint: Endpoint, timeout: float = 2.0) -> str | None:
    """What keeps a kvpush endpoint from serving now, or None when nothing does.

    Checked, in order: the :class:`~kvpush.Producer` or :class:`~kvpush.Consumer` is open;
    its loop thread runs; the loop answers a call within ``timeout`` (a loop stuck in a
    transport call answers no handshake and moves no request); its data plane is up (a
    data-plane child that died and is being restarted is not); and, for a Producer, its
    control port accepts a TCP connection (the listener peers dial). Call it off the
    endpoint's loop (a :class:`Publisher`'s thread does); it blocks up to ``timeout``
    twice at most."""
    from .dataplane import ChildAgent
    from .producer import Producer

    if endpoint.closed:
        return "closed"
    driver = endpoint._driver
    if not driver.thread.is_alive():
        return f"loop thread exited ({driver._loop_error!r})"

    def data_plane() -> str | None:
        agent = driver.agent
        if isinstance(agent, ChildAgent) and (agent.lost is not None or agent.pid is None):
            return f"data plane down ({agent.lost or 'restarting'})"
        return None

    try:
        problem: str | None = driver.call_and_wait(data_plane, timeout, "a health check")
    except TimeoutError:
        return f"loop did not answer within {timeout} s"
    except KvpushError as exc:   # closed meanwhile
        return f"loop refused a call: {exc}"
    if problem is not None:
        return problem
    if isinstance(endpoint, Producer):
        host, _, port = endpoint.address.rpartition("://")[2].rpartition(":")
        host = "127.0.0.1" if host in ("*", "0.0.0.0", "") else host.strip("[]")
        try:
            socket.create_connection((host, int(port)), timeout=timeout).close()
        except OSError as exc:
            return f"control port {endpoint.address} refuses connections: {exc}"
    return None


def endpoint_health(endpoint: Endpoint, timeout: float = 2.0) -> Callable[[], bool]:
    """A :class:`Publisher` health callback covering a kvpush endpoint: healthy while
    :func:`endpoint_problem` finds nothing (open, loop thread running and answering, data
    plane up, a Producer's control port listening); a problem is logged once when it
    starts. Combine it with the engine's own checks: ``health=lambda: ok() and
    engine_ok()``."""
    last: list[str | None] = [None]

    def healthy() -> bool:
        problem = endpoint_problem(endpoint, timeout)
        if problem != last[0] and problem is not None:
            log.warning("kvpush discovery: %s is unhealthy: %s", endpoint.name, problem)
        last[0] = problem
        return problem is None

    return healthy


# -- etcd through its JSON gateway ---------------------------------------------------------

def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _prefix_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with ``prefix`` (etcd's range_end)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"  # every key


@dataclass(frozen=True)
class _KeyValue:
    key: str
    value: bytes
    mod_revision: int


class _LeaseGone(DiscoveryError):
    """A put under a lease that expired or was revoked."""


class EtcdClient:
    """The few etcd v3 calls discovery needs, over the JSON gateway (HTTP, stdlib only).

    Parameters
    ----------
    endpoints
        ``http://host:port`` client URLs of the etcd cluster; tried in order, the last one
        that answered first.
    timeout
        Seconds one call may take, per endpoint tried.
    """

    def __init__(self, endpoints: str | Sequence[str], timeout: float = 2.0) -> None:
        urls = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        if not urls:
            raise DiscoveryError("EtcdClient needs at least one endpoint")
        for url in urls:
            parts = urllib.parse.urlsplit(url) if isinstance(url, str) else None
            if parts is None or parts.scheme != "http" or not parts.hostname or parts.path \
                    not in ("", "/"):
                raise DiscoveryError(f"etcd endpoint must be http://host:port, got {url!r}")
        if not isinstance(timeout, (int, float)) or not 0 < timeout <= 60:
            raise DiscoveryError(f"EtcdClient.timeout must be in (0, 60] s, got {timeout!r}")
        self.endpoints = tuple(u.rstrip("/") for u in urls)
        self.timeout = float(timeout)
        self._first = 0

    def _ordered(self) -> list[str]:
        n = len(self.endpoints)
        return [self.endpoints[(self._first + i) % n] for i in range(n)]

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` to ``path`` of the gateway; raises :class:`DiscoveryUnavailable`
        when no endpoint answers and :class:`DiscoveryError` when etcd refuses."""
        data = json.dumps(body).encode()
        failures = []
        for url in self._ordered():
            request = urllib.request.Request(url + path, data=data, method="POST",
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as resp:
                    text = resp.read()
            except urllib.error.HTTPError as exc:
                text = exc.read()
                if exc.code >= 500:  # this member cannot serve now (no leader, ...)
                    failures.append(f"{url}: HTTP {exc.code} {text[:200]!r}")
                    continue
                self._first = self.endpoints.index(url)
                raise self._refusal(path, exc.code, text) from None
            except (OSError, http.client.HTTPException) as exc:
                failures.append(f"{url}: {getattr(exc, 'reason', exc)}")
                continue
            self._first = self.endpoints.index(url)
            reply = json.loads(text or b"{}")
            if not isinstance(reply, dict):
                raise DiscoveryError(f"etcd {path}: unexpected answer {text[:200]!r}")
            return reply
        raise DiscoveryUnavailable(f"etcd unreachable for {path} within {self.timeout} s "
                                   f"per endpoint: {'; '.join(failures)}")

    @staticmethod
    def _refusal(path: str, status: int, text: bytes) -> DiscoveryError:
        try:
            message = str(json.loads(text).get("message", text[:200]))
        except (ValueError, AttributeError):
            message = repr(text[:200])
        if "lease not found" in message:
            return _LeaseGone(f"etcd {path}: {message}")
        return DiscoveryError(f"etcd {path}: HTTP {status} {message}")

    # -- leases --
    def grant(self, ttl: int) -> int:
        """A new lease of ``ttl`` seconds; returns its id."""
        reply = self.call("/v3/lease/grant", {"TTL": int(ttl)})
        if "ID" not in reply:
            raise DiscoveryError(f"etcd refused a lease: {reply}")
        return int(reply["ID"])

    def keepalive(self, lease: int) -> int:
        """Renew ``lease``; returns its TTL again, or 0 when the lease is gone."""
        reply = self.call("/v3/lease/keepalive", {"ID": str(lease)})
        return int(reply.get("result", {}).get("TTL", 0))

    def revoke(self, lease: int) -> None:
        """Revoke ``lease`` (its keys go with it); a lease already gone is fine."""
        with contextlib.suppress(_LeaseGone):
            self.call("/v3/lease/revoke", {"ID": str(lease)})

    # -- keys --
    def put(self, key: str, value: bytes, lease: int = 0) -> int:
        """Write ``key``; returns the store's revision after the write."""
        body: dict[str, Any] = {"key": _b64(key.encode()), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        reply = self.call("/v3/kv/put", body)
        return int(reply.get("header", {}).get("revision", 0))

    def delete(self, key: str) -> None:
        """Delete ``key`` (absent is fine)."""
        self.call("/v3/kv/deleterange", {"key": _b64(key.encode())})

    def get_prefix(self, prefix: str) -> tuple[int, list[_KeyValue]]:
        """Every key under ``prefix``, and the store's revision they were read at."""
        p = prefix.encode()
        reply = self.call("/v3/kv/range", {"key": _b64(p), "range_end": _b64(_prefix_end(p))})
        revision = int(reply.get("header", {}).get("revision", 0))
        kvs = [_KeyValue(base64.b64decode(kv["key"]).decode(errors="replace"),
                         base64.b64decode(kv.get("value", "")), int(kv.get("mod_revision", 0)))
               for kv in reply.get("kvs", [])]
        return revision, kvs


class _WatchIdle(DiscoveryError):
    """A watch that stayed silent for its idle bound: re-established without a fuss."""


class _WatchStream:
    """One etcd watch over HTTP: events as they come, each read bounded by ``idle_s``;
    :meth:`interrupt` (any thread) wakes a blocked read at once."""

    def __init__(self, endpoint: str, prefix: str, start_revision: int, timeout: float,
                 idle_s: float) -> None:
        parts = urllib.parse.urlsplit(endpoint)
        self._conn = http.client.HTTPConnection(parts.hostname or "", parts.port or 2379,
                                                timeout=timeout)
        p = prefix.encode()
        body = json.dumps({"create_request": {"key": _b64(p), "range_end": _b64(_prefix_end(p)),
                                              "start_revision": str(start_revision)}})
        try:
            self._conn.request("POST", "/v3/watch", body,
                               {"Content-Type": "application/json"})
            self._resp = self._conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            self._conn.close()
            raise DiscoveryUnavailable(f"etcd watch at {endpoint}: {exc}") from None
        if self._resp.status != 200:
            self._conn.close()
            raise DiscoveryError(f"etcd watch at {endpoint}: HTTP {self._resp.status}")
        if self._conn.sock is not None:
            self._conn.sock.settimeout(idle_s)

    def events(self) -> Iterator[dict[str, Any]]:
        """Results of the watch, until the stream ends, goes quiet for ``idle_s`` or is
        interrupted (then it raises :class:`DiscoveryUnavailable`)."""
        while True:
            try:
                line = self._resp.readline()
            except TimeoutError:
                raise _WatchIdle("etcd watch idle") from None
            except (OSError, http.client.HTTPException, ValueError) as exc:
                raise DiscoveryUnavailable(f"etcd watch ended: {exc!r}") from None
            if not line:
                raise DiscoveryUnavailable("etcd watch ended: the stream closed")
            line = line.strip()
            if not line:
                continue
            message = json.loads(line)
            if "error" in message:
                raise DiscoveryError(f"etcd watch: {message['error']}")
            yield message.get("result", {})

    def interrupt(self) -> None:
        sock = self._conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._conn.close()


# -- publishing ----------------------------------------------------------------------------

class Publisher:
    """Keeps one :class:`Advertisement` in etcd under a lease while ``health()`` is true.

    :meth:`start` writes the record (raising :class:`DiscoveryUnavailable` if etcd cannot
    be reached); a background thread renews the lease every ``renew_s``. When ``health``
    returns False (or raises), renewal stops and the record disappears within ``ttl_s``;
    once healthy again, the record is written anew under a new lease, with the same epoch.
    If etcd goes away longer than ``ttl_s``, the record is written again when it is back.
    :meth:`drain` marks the record ``draining``; :meth:`close` withdraws it (revokes the
    lease) and stops the thread.

    Parameters
    ----------
    client
        :class:`EtcdClient`.
    prefix
        Key prefix of the cluster (e.g. ``/kvpush/prod``); the record lives at
        ``{prefix}/{advertisement.key}``.
    advertisement
        What to publish; an epoch of 0 becomes this publisher's start time in ns.
    ttl_s
        The lease: how long a record outlives its last renewal (whole seconds, >= 1).
    health
        Called on the publisher's thread before each renewal; must return quickly.
    renew_s
        Renewal interval (default ``ttl_s / 3``; must be below ``ttl_s``).
    """

    def __init__(self, client: EtcdClient, prefix: str, advertisement: Advertisement, *,
                 ttl_s: int = 10, health: Callable[[], bool] | None = None,
                 renew_s: float | None = None) -> None:
        if not isinstance(ttl_s, int) or not 1 <= ttl_s <= 3600:
            raise DiscoveryError(f"Publisher.ttl_s must be an int in [1, 3600], got {ttl_s!r}")
        renew = ttl_s / 3 if renew_s is None else renew_s
        if not isinstance(renew, (int, float)) or not 0 < renew < ttl_s:
            raise DiscoveryError(f"Publisher.renew_s must be in (0, ttl_s={ttl_s}), got "
                                 f"{renew_s!r}")
        self._client = client
        self.prefix = _check_prefix(prefix)
        if advertisement.epoch == 0:
            advertisement = replace(advertisement, epoch=time.time_ns())
        self._ad = advertisement
        self.ttl_s = ttl_s
        self.renew_s = float(renew)
        self._health = health
        self._lock = threading.Lock()  # one etcd exchange at a time; guards _ad and _lease
        self._lease = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._healthy = True
        self._dirty = False  # the record changed and is not written yet
        self.last_error: DiscoveryError | None = None

    @property
    def advertisement(self) -> Advertisement:
        """The record as published (its epoch filled in; its state after :meth:`drain`)."""
        return self._ad

    @property
    def key(self) -> str:
        """The record's full key in etcd."""
        return f"{self.prefix}/{self._ad.key}"

    @property
    def published(self) -> bool:
        """True while the record is believed live: written, renewed in time, healthy."""
        return self._lease != 0 and self._healthy

    def start(self) -> Publisher:
        """Write the record and start renewing it; raises :class:`DiscoveryUnavailable`
        when etcd cannot be reached."""
        if self._thread is not None:
            raise DiscoveryError("Publisher.start() called twice")
        if self._stop.is_set():
            raise DiscoveryError("Publisher is closed")
        with self._lock:
            self._write_new()
        self._thread = threading.Thread(target=self._run, name=f"kvpush-publish-{self._ad.key}",
                                        daemon=True)
        self._thread.start()
        return self

    def drain(self) -> None:
        """Mark the record ``draining`` (routers and directories stop choosing it). If
        etcd cannot be reached, this raises :class:`DiscoveryUnavailable` and the state is
        written with the next successful renewal."""
        with self._lock:
            self._ad = replace(self._ad, state=InstanceState.DRAINING)
            self._dirty = True
            if self._lease and self._healthy:
                self._renew()

    def close(self, timeout: float = 5.0) -> None:
        """Withdraw the record (revoke its lease) and stop renewing. Idempotent; if etcd
        cannot be reached, the record disappears when its lease runs out."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("kvpush discovery: publisher thread of %s did not stop in %s s",
                            self.key, timeout)
        with self._lock:
            lease, self._lease = self._lease, 0
            if lease:
                try:
                    self._client.revoke(lease)
                except DiscoveryError as exc:
                    log.warning("kvpush discovery: %s not withdrawn (%s); it expires within "
                                "%s s", self.key, exc, self.ttl_s)

    def __enter__(self) -> Publisher:
        return self if self._thread is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write_new(self) -> None:
        # published (the lease held) before the record is visible to any watcher
        self._lease = self._client.grant(self.ttl_s)
        try:
            self._client.put(self.key, self._ad.to_json(), self._lease)
        except DiscoveryError:
            lease, self._lease = self._lease, 0
            with contextlib.suppress(DiscoveryError):
                self._client.revoke(lease)
            raise
        self._dirty = False

    def _renew(self) -> None:
        """Keep the lease (or take a new one) and write the record if it changed; the
        caller holds ``_lock``. Raises DiscoveryError when etcd does not answer."""
        try:
            if self._lease and self._client.keepalive(self._lease) > 0:
                if self._dirty:
                    self._client.put(self.key, self._ad.to_json(), self._lease)
                    self._dirty = False
                self.last_error = None
                return
        except _LeaseGone:
            pass
        except DiscoveryError as exc:
            self.last_error = exc
            raise
        if self._lease:
            log.warning("kvpush discovery: lease of %s ran out; publishing again", self.key)
            self._lease = 0
        try:
            self._write_new()
        except DiscoveryError as exc:
            self.last_error = exc
            raise
        self.last_error = None

    def _is_healthy(self) -> bool:
        if self._health is None:
            return True
        try:
            return bool(self._health())
        except Exception:
            log.exception("kvpush discovery: health callback of %s raised; counted unhealthy",
                          self.key)
            return False

    def _run(self) -> None:
        while not self._stop.wait(self.renew_s):
            healthy = self._is_healthy()
            if healthy != self._healthy:
                log.warning("kvpush discovery: %s is %s", self.key,
                            "healthy again: publishing" if healthy
                            else f"unhealthy: renewal stops, the record expires within "
                                 f"{self.ttl_s} s")
                self._healthy = healthy
            if not healthy:
                continue  # the lease runs out: a short hiccup costs one TTL at most
            with self._lock:
                if self._stop.is_set():
                    return
                failed = self.last_error is not None
                try:
                    self._renew()
                except DiscoveryError as exc:
                    if not failed:
                        log.warning("kvpush discovery: renewing %s failed: %s", self.key, exc)


def _check_prefix(prefix: str) -> str:
    if not isinstance(prefix, str) or not prefix.startswith("/") or prefix.endswith("/") \
            or "//" in prefix:
        raise DiscoveryError(f"prefix must start with '/' and not end with one, like "
                             f"/kvpush/prod; got {prefix!r}")
    return prefix


# -- following -----------------------------------------------------------------------------

class ChangeKind(enum.Enum):
    """What happened to a record, as a :class:`Watcher` reports it."""

    JOINED = "joined"        # a key not seen before
    UPDATED = "updated"      # same incarnation, something changed (e.g. draining)
    RESTARTED = "restarted"  # same key, a new epoch
    LEFT = "left"            # deleted, or its lease expired


@dataclass(frozen=True)
class Change:
    """One change a :class:`Watcher` saw: the record now (or, for LEFT, as last seen) and,
    for UPDATED and RESTARTED, the record before."""

    kind: ChangeKind
    advertisement: Advertisement
    previous: Advertisement | None = None


class Watcher:
    """Lists and follows every :class:`Advertisement` under ``prefix``.

    A background thread lists the records, then follows an etcd watch from the listed
    revision; after any break (etcd gone, idle longer than ``idle_s``) it waits (backing
    off up to ``max_backoff_s``), lists again and reports the difference, so it never
    misses a change for good. While etcd is away, :meth:`snapshot` returns the last known
    records and :attr:`connected` is False. Listeners are called on the watcher's thread
    with each :class:`Change`; they must not block.

    Parameters
    ----------
    client
        :class:`EtcdClient`.
    prefix
        Key prefix of the cluster.
    idle_s
        A watch silent this long is re-established (catches a silently dead connection).
    max_backoff_s
        Longest wait between attempts while etcd cannot be reached.
    """

    def __init__(self, client: EtcdClient, prefix: str, *, idle_s: float = 10.0,
                 max_backoff_s: float = 2.0) -> None:
        if not isinstance(idle_s, (int, float)) or not 0.1 <= idle_s <= 600:
            raise DiscoveryError(f"Watcher.idle_s must be in [0.1, 600] s, got {idle_s!r}")
        if not isinstance(max_backoff_s, (int, float)) or not 0.01 <= max_backoff_s <= 60:
            raise DiscoveryError(f"Watcher.max_backoff_s must be in [0.01, 60] s, got "
                                 f"{max_backoff_s!r}")
        self._client = client
        self.prefix = _check_prefix(prefix)
        self.idle_s = float(idle_s)
        self.max_backoff_s = float(max_backoff_s)
        self._records: dict[str, Advertisement] = {}
        self._cond = threading.Condition()
        self._listeners: list[Callable[[Change], None]] = []
        self._stop = threading.Event()
        self._stream: _WatchStream | None = None
        self._thread: threading.Thread | None = None
        self.connected = False
        self.last_error: DiscoveryError | None = None
        self.invalid = 0  # records under the prefix that were not advertisements

    def add_listener(self, listener: Callable[[Change], None]) -> None:
        """Call ``listener`` with every later change (on the watcher's thread)."""
        with self._cond:
            self._listeners.append(listener)

    def start(self) -> Watcher:
        """Start listing and following (a background thread); :attr:`connected` tells when
        the first list is in."""
        if self._thread is not None:
            raise DiscoveryError("Watcher.start() called twice")
        self._thread = threading.Thread(target=self._run, name=f"kvpush-watch-{self.prefix}",
                                        daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Stop following: wake the watch and join the thread within ``timeout``."""
        self._stop.set()
        with self._cond:
            stream = self._stream
            self._cond.notify_all()
        if stream is not None:
            stream.interrupt()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("kvpush discovery: watcher of %s did not stop in %s s",
                            self.prefix, timeout)

    def __enter__(self) -> Watcher:
        return self if self._thread is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def snapshot(self) -> list[Advertisement]:
        """The records known now, by key."""
        with self._cond:
            return [self._records[k] for k in sorted(self._records)]

    def wait_for(self, predicate: Callable[[list[Advertisement]], bool],
                 timeout: float) -> bool:
        """Wait until ``predicate(snapshot())`` holds; False if ``timeout`` passes first."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if predicate([self._records[k] for k in sorted(self._records)]):
                    return True
                left = deadline - time.monotonic()
                if left <= 0 or self._stop.is_set():
                    return False
                self._cond.wait(left)

    def _run(self) -> None:
        backoff = 0.0
        while not self._stop.is_set():
            try:
                revision = self._relist()
                backoff = 0.0
                self._follow(revision)
            except _WatchIdle:
                continue  # nothing happened for idle_s: list again and watch anew
            except DiscoveryError as exc:
                if self._stop.is_set():
                    break
                if self.connected or self.last_error is None:
                    log.warning("kvpush discovery: following %s: %s", self.prefix, exc)
                self.connected = False
                self.last_error = exc
                backoff = min(self.max_backoff_s, max(0.05, backoff * 2))
                self._stop.wait(backoff)
        self.connected = False

    def _relist(self) -> int:
        revision, kvs = self._client.get_prefix(self.prefix + "/")
        fresh: dict[str, Advertisement] = {}
        for kv in kvs:
            ad = self._parse(kv.key, kv.value)
            if ad is not None:
                fresh[kv.key] = ad
        changes: list[Change] = []
        with self._cond:
            for key in sorted(self._records.keys() - fresh.keys()):
                changes.append(Change(ChangeKind.LEFT, self._records.pop(key)))
            for key in sorted(fresh):
                change = self._apply(key, fresh[key])
                if change is not None:
                    changes.append(change)
            self.connected = True
            self.last_error = None
            self._cond.notify_all()
        self._tell(changes)
        return revision

    def _follow(self, revision: int) -> None:
        endpoint = self._client._ordered()[0]
        stream = _WatchStream(endpoint, self.prefix + "/", revision + 1, self._client.timeout,
                              self.idle_s)
        with self._cond:
            if self._stop.is_set():
                stream.close()
                return
            self._stream = stream
        try:
            for result in stream.events():
                if result.get("canceled") or result.get("compact_revision"):
                    raise DiscoveryUnavailable(f"etcd watch canceled: {result}")
                changes: list[Change] = []
                with self._cond:
                    for event in result.get("events", []):
                        kv = event.get("kv", {})
                        key = base64.b64decode(kv.get("key", "")).decode(errors="replace")
                        if event.get("type") == "DELETE":
                            gone = self._records.pop(key, None)
                            if gone is not None:
                                changes.append(Change(ChangeKind.LEFT, gone))
                            continue
                        ad = self._parse(key, base64.b64decode(kv.get("value", "")))
                        change = self._apply(key, ad) if ad is not None else None
                        if change is not None:
                            changes.append(change)
                    if changes:
                        self._cond.notify_all()
                self._tell(changes)
        finally:
            with self._cond:
                self._stream = None
            stream.close()

    def _apply(self, key: str, ad: Advertisement) -> Change | None:
        old = self._records.get(key)
        self._records[key] = ad
        if old is None:
            return Change(ChangeKind.JOINED, ad)
        if old.epoch != ad.epoch:
            return Change(ChangeKind.RESTARTED, ad, old)
        if old != ad:
            return Change(ChangeKind.UPDATED, ad, old)
        return None

    def _parse(self, key: str, value: bytes) -> Advertisement | None:
        if key.startswith(f"{self.prefix}/{CONTROL}/"):
            return None  # drain requests and reports: not advertisements
        try:
            ad = Advertisement.from_json(value)
        except DiscoveryError as exc:
            self.invalid += 1
            log.warning("kvpush discovery: skipping %s: %s", key, exc)
            return None
        if key != f"{self.prefix}/{ad.key}":
            self.invalid += 1
            log.warning("kvpush discovery: skipping %s: its record names %s", key, ad.key)
            return None
        return ad

    def _tell(self, changes: list[Change]) -> None:
        with self._cond:
            listeners = list(self._listeners)
        for change in changes:
            log.info("kvpush discovery: %s %s epoch %d %s", change.kind.value,
                     change.advertisement.key, change.advertisement.epoch,
                     change.advertisement.state.value)
            for listener in listeners:
                try:
                    listener(change)
                except Exception:
                    log.exception("kvpush discovery: a listener raised on %s", change)


# -- drain: asked through etcd, reported through etcd --------------------------------------

#: Keys under ``{prefix}/control/`` are requests and reports, not advertisements.
CONTROL = "control"


def _drain_key(prefix: str, instance: str) -> str:
    return f"{_check_prefix(prefix)}/{CONTROL}/drain/{instance}"


def _drained_key(prefix: str, instance: str, rank: int) -> str:
    return f"{_check_prefix(prefix)}/{CONTROL}/drained/{instance}/{rank}"


def instance_records(client: EtcdClient, prefix: str, instance: str) -> list[Advertisement]:
    """The records of one instance now (every role and rank), by role then rank."""
    _, kvs = client.get_prefix(_check_prefix(prefix) + "/")
    out = []
    for kv in kvs:
        if kv.key.startswith(f"{prefix}/{CONTROL}/"):
            continue
        with contextlib.suppress(DiscoveryError):
            ad = Advertisement.from_json(kv.value)
            if ad.instance == instance and kv.key == f"{prefix}/{ad.key}":
                out.append(ad)
    return sorted(out, key=lambda ad: (ad.role.value, ad.rank))


def request_drain(client: EtcdClient, prefix: str, instance: str) -> list[Advertisement]:
    """Ask every rank of ``instance`` as it runs now to drain: writes
    ``{prefix}/control/drain/{instance}`` naming the ranks' epochs (a later incarnation,
    with new epochs, does not drain for it). Returns the records asked; raises
    :class:`DiscoveryError` when the instance has none."""
    ads = instance_records(client, prefix, instance)
    if not ads:
        raise DiscoveryError(f"no records of instance {instance!r} under {prefix}")
    body = {"epochs": sorted({ad.epoch for ad in ads}), "requested_ns": time.time_ns()}
    client.put(_drain_key(prefix, instance), json.dumps(body).encode())
    return ads


def report_drained(client: EtcdClient, prefix: str, ad: Advertisement, *, held: int = 0,
                   ttl_s: int = 600) -> None:
    """A rank's word that it has drained (its record is withdrawn; ``held`` hand-offs were
    still held when it gave up waiting, 0 when it finished them all): written under a
    lease of ``ttl_s``, so old reports go by themselves."""
    lease = client.grant(ttl_s)
    body = {"epoch": ad.epoch, "held": held, "at_ns": time.time_ns()}
    client.put(_drained_key(prefix, ad.instance, ad.rank), json.dumps(body).encode(), lease)


def drain_reports(client: EtcdClient, prefix: str, ads: Sequence[Advertisement]
                  ) -> dict[int, dict[str, Any]]:
    """Of the ranks ``ads`` (as :func:`request_drain` returned them), the reports of those
    that have drained, by rank."""
    if not ads:
        return {}
    _, kvs = client.get_prefix(f"{_check_prefix(prefix)}/{CONTROL}/drained/{ads[0].instance}/")
    found: dict[str, dict[str, Any]] = {}
    for kv in kvs:
        with contextlib.suppress(ValueError):
            value = json.loads(kv.value)
            if isinstance(value, dict):
                found[kv.key] = value
    out = {}
    for ad in ads:
        report = found.get(_drained_key(prefix, ad.instance, ad.rank))
        if report is not None and report.get("epoch") == ad.epoch:
            out[ad.rank] = report
    return out


def _bridge_key(prefix: str, bridge: str) -> str:
    return f"{_check_prefix(prefix)}/{CONTROL}/bridges/{bridge}"


def _unrouted_key(prefix: str, instance: str, bridge: str) -> str:
    return f"{_check_prefix(prefix)}/{CONTROL}/unrouted/{instance}/{bridge}"


def unrouted(client: EtcdClient, prefix: str, instance: str, epoch: int, *,
             since_revision: int = 0) -> tuple[list[str], list[str]]:
    """Which running :class:`RouterBridge` s have confirmed that incarnation ``epoch`` of
    ``instance`` is out of their router (it is draining or gone, and the router's expiry
    has passed since the bridge's last registration of it), and which have not yet:
    ``(confirmed, waiting)``, bridge ids. Only confirmations written after etcd revision
    ``since_revision`` count (a drain passes the revision read before it marked the record
    ``draining``: a confirmation from an earlier lapse of the record does not). A bridge
    that stopped is not waited for (its presence key goes with its lease)."""
    _, kvs = client.get_prefix(f"{_check_prefix(prefix)}/{CONTROL}/")
    running = {kv.key.rsplit("/", 1)[1] for kv in kvs
               if kv.key.startswith(_bridge_key(prefix, ""))}
    done = set()
    for kv in kvs:
        if kv.key.startswith(_unrouted_key(prefix, instance, "")) \
                and kv.mod_revision > since_revision:
            with contextlib.suppress(ValueError, AttributeError, TypeError):
                if epoch in json.loads(kv.value).get("epochs", ()):
                    done.add(kv.key.rsplit("/", 1)[1])
    return sorted(running & done), sorted(running - done)


def http_ready(http_address: str, path: str = "/health", timeout: float = 1.0) -> bool:
    """True when ``GET http://{http_address}{path}`` answers 200 within ``timeout``."""
    try:
        with urllib.request.urlopen(f"http://{http_address}{path}", timeout=timeout) as resp:
            return int(resp.status) == 200
    except (OSError, http.client.HTTPException, ValueError):
        return False


class DrainListener:
    """Calls ``on_drain`` once, on its own thread, when a drain of this incarnation
    (``epoch``) of ``instance`` is asked (:func:`request_drain`). It reads the request key,
    then follows an etcd watch on it (re-read after any break, with a backoff of at most
    ``max_backoff_s``): the thread blocks on the watch socket; :meth:`close` wakes it."""

    def __init__(self, client: EtcdClient, prefix: str, instance: str, epoch: int,
                 on_drain: Callable[[], None], *, idle_s: float = 10.0,
                 max_backoff_s: float = 2.0) -> None:
        self._client = client
        self.key = _drain_key(prefix, instance)
        self.epoch = epoch
        self._on_drain = on_drain
        self.idle_s = float(idle_s)
        self.max_backoff_s = float(max_backoff_s)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._stream: _WatchStream | None = None
        self._thread: threading.Thread | None = None
        self.asked = False

    def start(self) -> DrainListener:
        """Start following the request key (a background thread)."""
        self._thread = threading.Thread(target=self._run, name=f"kvpush-drain-{self.key}",
                                        daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Stop following (a drain already begun goes on, on this thread: joined up to
        ``timeout``)."""
        self._stop.set()
        with self._lock:
            stream = self._stream
        if stream is not None:
            stream.interrupt()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _asked(self) -> tuple[bool, int]:
        revision, kvs = self._client.get_prefix(self.key)
        for kv in kvs:
            if kv.key == self.key:
                with contextlib.suppress(ValueError, AttributeError, TypeError):
                    if self.epoch in json.loads(kv.value).get("epochs", ()):
                        return True, revision
        return False, revision

    def _run(self) -> None:
        backoff = 0.0
        while not self._stop.is_set():
            try:
                asked, revision = self._asked()
                backoff = 0.0
                if asked:
                    self.asked = True
                    try:
                        self._on_drain()
                    except Exception:
                        log.exception("kvpush discovery: drain of %s failed", self.key)
                    return
                stream = _WatchStream(self._client._ordered()[0], self.key, revision + 1,
                                      self._client.timeout, self.idle_s)
                with self._lock:
                    if self._stop.is_set():
                        stream.close()
                        return
                    self._stream = stream
                try:
                    for result in stream.events():
                        if result.get("events") or result.get("canceled"):
                            break  # read the key again
                finally:
                    with self._lock:
                        self._stream = None
                    stream.close()
            except _WatchIdle:
                continue
            except DiscoveryError as exc:
                if self._stop.is_set():
                    return
                if not backoff:
                    log.warning("kvpush discovery: following %s: %s", self.key, exc)
                backoff = min(self.max_backoff_s, max(0.05, backoff * 2))
                self._stop.wait(backoff)


# -- users of the records ------------------------------------------------------------------

class ProducerDirectory:
    """The prefill ranks a decode side can take KV from: serving, compatible
    (same :func:`compat_key`) and offering ``mode``, as a :class:`Watcher` sees them.

    Given a :class:`~kvpush.Consumer`, it starts the handshake with every producer as it
    appears (``Consumer.connect_nowait``), so the first request to it does not pay for the
    handshake; a restarted producer (new epoch) is dialled again.

    Parameters
    ----------
    watcher
        A started :class:`Watcher` of the cluster's prefix.
    compat
        This side's :func:`compat_key` (None: any; for a router, which holds no KV and
        leaves the check to the handshake).
    mode
        Only producers serving this mode (None: any).
    consumer
        Optional :class:`~kvpush.Consumer` to connect ahead of use.
    """

    def __init__(self, watcher: Watcher, compat: str | None, *,
                 mode: TransferMode | None = None, consumer: Consumer | None = None) -> None:
        self._watcher = watcher
        self.compat = compat
        self.mode = mode
        self._consumer = consumer
        self._dialled: dict[str, int] = {}  # producer address -> epoch dialled
        self._lock = threading.Lock()
        if consumer is not None:
            watcher.add_listener(self._on_change)
            for ad in self.producers():
                self._dial(ad)

    def _usable(self, ad: Advertisement) -> bool:
        return (ad.role is Role.PREFILL and ad.state is InstanceState.SERVING
                and (self.compat is None or ad.compat == self.compat)
                and (self.mode is None or self.mode in ad.modes))

    def producers(self) -> list[Advertisement]:
        """Usable producer ranks now, by instance and rank."""
        return [ad for ad in self._watcher.snapshot() if self._usable(ad)]

    def instances(self) -> dict[str, list[str]]:
        """Usable instances, each with its producer addresses in rank order (the list a
        request's ``producers`` takes): only instances whose ranks are all usable and
        numbered 0..n-1 without a gap."""
        by_instance: dict[str, dict[int, Advertisement]] = {}
        for ad in self._watcher.snapshot():
            if ad.role is Role.PREFILL:
                by_instance.setdefault(ad.instance, {})[ad.rank] = ad
        out: dict[str, list[str]] = {}
        for name, ranks in sorted(by_instance.items()):
            if all(self._usable(ad) for ad in ranks.values()) \
                    and sorted(ranks) == list(range(len(ranks))):
                out[name] = [ranks[r].producer for r in range(len(ranks))]
        return out

    def at_http_address(self, http_address: str) -> list[str]:
        """The producer addresses, in rank order, of the usable instance that serves HTTP
        at ``http_address`` (``host:port``): what a router puts in a push request's decode
        leg when it sends the prefill leg there; empty when none is usable now."""
        names = {ad.instance for ad in self._watcher.snapshot()
                 if ad.role is Role.PREFILL and ad.http_address == http_address}
        usable = self.instances()
        return next((usable[n] for n in sorted(names) if n in usable), [])

    def _on_change(self, change: Change) -> None:
        if change.kind is not ChangeKind.LEFT and self._usable(change.advertisement):
            self._dial(change.advertisement)

    def _dial(self, ad: Advertisement) -> None:
        assert self._consumer is not None
        with self._lock:
            if self._dialled.get(ad.producer) == ad.epoch:
                return
            self._dialled[ad.producer] = ad.epoch
        try:
            self._consumer.connect_nowait(ad.producer)
        except KvpushError as exc:  # e.g. the consumer is closed
            log.warning("kvpush discovery: cannot connect to %s: %s", ad.producer, exc)


class RouterBridge:
    """Feeds vllm-router's ZeroMQ discovery (``--vllm-discovery-address``) from the etcd
    records: every ``interval_s`` it sends, for each serving instance whose HTTP server
    answers, the registration vllm-router expects (msgpack ``{"type": "P" | "D",
    "http_address": "host:port", "zmq_address": ...}``).

    vllm-router sends a request to whatever is registered and does not retry a refused
    connection elsewhere: so an incarnation is registered only once ``GET
    http://{http_address}{health_path}`` has answered 200 (a restarted instance publishes
    its record while its engine starts, before its HTTP server listens), and a draining
    instance is not registered again. vllm-router drops an instance :data:`ROUTER_EXPIRY_S`
    after its last registration; that long (and a margin) after its last registration of a
    draining or vanished instance, the bridge writes ``{prefix}/control/unrouted/{instance}/
    {bridge}`` naming the incarnation's epochs: a draining rank waits for this word from
    every running bridge (:func:`unrouted`; each bridge keeps ``{prefix}/control/bridges/
    {bridge}`` under a lease while it runs) before it looks for quiet.

    ``zmq_address`` is the prefill rank 0's kvpush producer address (the decode instance's
    HTTP address for a decode instance): vllm-router only carries it in the
    ``X-Request-Id`` it makes; kvpush takes its addresses from ``kv_transfer_params``.

    Parameters
    ----------
    watcher
        A started :class:`Watcher` (its client writes the bridge's keys).
    router
        ``host:port`` of the router's discovery socket.
    interval_s
        Seconds between registrations (below vllm-router's 5 s expiry).
    compat
        Register only instances with this :func:`compat_key` (None: all).
    health_path
        Path of the instances' HTTP health check (None: register without checking).
    bridge_id
        This bridge's name under ``{prefix}/control/bridges/`` (default: host, pid and a
        random part).
    """

    def __init__(self, watcher: Watcher, router: str, *, interval_s: float = 1.0,
                 compat: str | None = None, health_path: str | None = "/health",
                 bridge_id: str | None = None) -> None:
        if not isinstance(router, str) or not _host_port(router):
            raise DiscoveryError(f"RouterBridge.router must be host:port, got {router!r}")
        if not isinstance(interval_s, (int, float)) or not 0.05 <= interval_s <= 4:
            raise DiscoveryError(f"RouterBridge.interval_s must be in [0.05, 4] s (vllm-router "
                                 f"forgets an instance 5 s after its last message), got "
                                 f"{interval_s!r}")
        if health_path is not None and not health_path.startswith("/"):
            raise DiscoveryError(f"RouterBridge.health_path must start with '/', got "
                                 f"{health_path!r}")
        name = bridge_id or re.sub(r"[^A-Za-z0-9._-]+", "-",
                                   f"{socket.gethostname()}-{os.getpid()}-"
                                   f"{secrets.token_hex(3)}")
        if not _NAME.match(name):
            raise DiscoveryError(f"RouterBridge.bridge_id must be letters, digits, '.', '_', "
                                 f"'-', got {bridge_id!r}")
        self._watcher = watcher
        self.router = router
        self.interval_s = float(interval_s)
        self.compat = compat
        self.health_path = health_path
        self.bridge_id = name
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        #: (type, instance) -> the epochs whose HTTP server answered
        self._ready: dict[tuple[str, str], tuple[int, ...]] = {}
        #: (type, instance) -> (epochs, monotonic time) of its last registration sent
        self._last_sent: dict[tuple[str, str], tuple[tuple[int, ...], float]] = {}
        #: (instance, epochs) confirmed out of the router since its last registration
        self._confirmed: set[tuple[str, tuple[int, ...]]] = set()
        self.sent = 0
        self.confirmations = 0

    def _candidates(self) -> list[tuple[tuple[str, str], tuple[int, ...], str,
                                        dict[str, str]]]:
        """Serving instances whose every known rank serves: ((type, instance), epochs,
        state, registration); draining ones with state ``draining`` and no registration."""
        by_instance: dict[tuple[Role, str], list[Advertisement]] = {}
        for ad in self._watcher.snapshot():
            if ad.http_address and (self.compat is None or ad.compat == self.compat):
                by_instance.setdefault((ad.role, ad.instance), []).append(ad)
        out: list[tuple[tuple[str, str], tuple[int, ...], str, dict[str, str]]] = []
        for (role, instance), ads in sorted(by_instance.items(), key=lambda kv: kv[0][1]):
            kind = "P" if role is Role.PREFILL else "D"
            epochs = tuple(sorted({ad.epoch for ad in ads}))
            if any(ad.state is not InstanceState.SERVING for ad in ads):
                out.append(((kind, instance), epochs, "draining", {}))
                continue
            first = min(ads, key=lambda ad: ad.rank)
            out.append(((kind, instance), epochs, "serving",
                        {"type": kind, "http_address": first.http_address,
                         "zmq_address": first.producer or first.http_address}))
        return out

    def registrations(self) -> list[dict[str, str]]:
        """One registration per serving instance whose every known rank serves (what
        the next round sends once each one's HTTP server has answered)."""
        return [reg for _, _, state, reg in self._candidates() if state == "serving"]

    def start(self) -> RouterBridge:
        """Start sending registrations and checking the instances (background threads)."""
        if self._threads:
            raise DiscoveryError("RouterBridge.start() called twice")
        self._threads = [
            threading.Thread(target=self._run, name="kvpush-router-bridge", daemon=True),
            threading.Thread(target=self._keep, name="kvpush-router-bridge-keep",
                             daemon=True)]
        for thread in self._threads:
            thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Stop sending (the router forgets the instances within 5 s), withdraw the
        bridge's presence key and join the threads."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout)
            if thread.is_alive():
                log.warning("kvpush discovery: router bridge did not stop in %s s", timeout)

    def __enter__(self) -> RouterBridge:
        return self if self._threads else self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        """Sends the registrations (never blocks on HTTP or etcd)."""
        import msgspec
        import zmq

        ctx: Any = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 64)
        sock.connect(f"tcp://{self.router}")
        registered: set[tuple[str, str]] = set()
        try:
            while True:
                with self._lock:
                    ready = dict(self._ready)
                now = [(key, epochs, reg) for key, epochs, state, reg in self._candidates()
                       if state == "serving"
                       and (self.health_path is None or ready.get(key) == epochs)]
                current = {key for key, _, _ in now}
                for kind, instance in sorted(current - registered):
                    log.info("kvpush discovery: registering %s %s with %s", kind, instance,
                             self.router)
                for kind, instance in sorted(registered - current):
                    log.info("kvpush discovery: no longer registering %s %s", kind, instance)
                registered = current
                for key, epochs, registration in now:
                    try:
                        sock.send(msgspec.msgpack.encode(registration), zmq.NOBLOCK)
                    except zmq.Again:
                        break  # the router is not there (yet): the next round tries again
                    self.sent += 1
                    with self._lock:
                        self._last_sent[key] = (epochs, time.monotonic())
                        # in the router again (a record back after a lapse): a later
                        # drain needs a new confirmation
                        self._confirmed.discard((key[1], epochs))
                if self._stop.wait(self.interval_s):
                    return
        finally:
            sock.close(0)

    def _keep(self) -> None:
        """Checks the instances' HTTP servers, keeps the bridge's presence key and writes
        the confirmations (etcd and HTTP calls: on a thread of their own)."""
        client = self._watcher._client
        lease = 0
        renewed = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now - renewed >= _BRIDGE_TTL_S / 3:
                try:
                    if not lease or client.keepalive(lease) <= 0:
                        lease = client.grant(_BRIDGE_TTL_S)
                        client.put(_bridge_key(self._watcher.prefix, self.bridge_id),
                                   json.dumps({"router": self.router,
                                               "at_ns": time.time_ns()}).encode(), lease)
                    renewed = now
                except DiscoveryError as exc:
                    lease = 0
                    log.warning("kvpush discovery: bridge %s: presence key: %s",
                                self.bridge_id, exc)
            candidates = self._candidates()
            with self._lock:
                ready = dict(self._ready)
                last_sent = dict(self._last_sent)
            for key, epochs, state, reg in candidates:
                if state == "serving" and self.health_path is not None \
                        and ready.get(key) != epochs \
                        and http_ready(reg["http_address"], self.health_path, timeout=1.0):
                    log.info("kvpush discovery: %s %s answers at %s", key[0], key[1],
                             reg["http_address"])
                    with self._lock:
                        self._ready[key] = epochs
            # draining, or vanished after being registered: out of the router once the
            # expiry has passed since the last registration
            leaving = {key: epochs for key, epochs, state, _ in candidates
                       if state == "draining"}
            present = {key for key, _, _, _ in candidates}
            for key, (epochs, _) in last_sent.items():
                if key not in present:
                    leaving[key] = epochs
            for key, epochs in leaving.items():
                with self._lock:
                    confirmed = (key[1], epochs) in self._confirmed
                if not confirmed:
                    sent = last_sent.get(key)
                    if sent is not None and time.monotonic() - sent[1] \
                            < ROUTER_EXPIRY_S + _EXPIRY_MARGIN_S:
                        continue
                    try:
                        self._confirm(client, key[1], epochs)
                    except DiscoveryError as exc:
                        log.warning("kvpush discovery: bridge %s: confirming %s: %s",
                                    self.bridge_id, key[1], exc)
                        continue
                if key not in present:
                    with self._lock:
                        self._last_sent.pop(key, None)
                        self._ready.pop(key, None)
            self._stop.wait(self.interval_s)
        if lease:
            with contextlib.suppress(DiscoveryError):
                client.revoke(lease)

    def _confirm(self, client: EtcdClient, instance: str, epochs: tuple[int, ...]) -> None:
        lease = client.grant(600)
        client.put(_unrouted_key(self._watcher.prefix, instance, self.bridge_id),
                   json.dumps({"epochs": list(epochs), "at_ns": time.time_ns()}).encode(),
                   lease)
        with self._lock:
            self._confirmed.add((instance, epochs))
        self.confirmations += 1
        log.info("kvpush discovery: bridge %s: %s (epochs %s) is out of %s", self.bridge_id,
                 instance, list(epochs), self.router)


# -- command line --------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvpush.discovery list|bridge``: print the records under a prefix, or
    run a :class:`RouterBridge` until interrupted."""
    parser = argparse.ArgumentParser(prog="python -m kvpush.discovery",
                                     description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--etcd", action="append", required=True,
                        help="etcd client URL, http://host:port (repeat for several)")
    parser.add_argument("--prefix", required=True, help="key prefix, e.g. /kvpush/prod")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="print the records (not the control keys) as JSON lines")
    bridge = sub.add_parser("bridge", help="register serving instances with vllm-router")
    bridge.add_argument("--router", required=True,
                        help="host:port of vllm-router's --vllm-discovery-address")
    bridge.add_argument("--interval", type=float, default=1.0)
    bridge.add_argument("--compat", default=None)
    bridge.add_argument("--health-path", default="/health",
                        help="register an incarnation once GET http://ADDRESS/PATH answers "
                        "200 ('' registers without checking)")
    health = sub.add_parser("health", help="exit 0 if every rank of INSTANCE is published "
                            "and serving and its HTTP server answers /health, 1 if it is "
                            "draining, 2 if it has no complete record or its HTTP server "
                            "does not answer")
    health.add_argument("instance")
    drain = sub.add_parser("drain", help="ask every rank of INSTANCE to drain; with --wait, "
                           "exit 0 once they all report drained, 1 if not within the wait")
    drain.add_argument("instance")
    drain.add_argument("--wait", type=float, default=0.0, metavar="SECONDS")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    client = EtcdClient(args.etcd)
    prefix = _check_prefix(args.prefix)
    if args.command == "list":
        _, kvs = client.get_prefix(prefix + "/")
        for kv in kvs:
            if not kv.key.startswith(f"{prefix}/{CONTROL}/"):  # requests, reports, bridges
                print(kv.key, kv.value.decode(errors="replace"), flush=True)
        return 0
    if args.command == "health":
        return _health_command(client, prefix, args.instance)
    if args.command == "drain":
        return _drain_command(client, prefix, args.instance, args.wait)
    with Watcher(client, args.prefix) as watcher, \
            RouterBridge(watcher, args.router, interval_s=args.interval, compat=args.compat,
                         health_path=args.health_path or None):
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        with contextlib.suppress(KeyboardInterrupt):
            while not stop.wait(3600):
                pass
    return 0


def _health_command(client: EtcdClient, prefix: str, instance: str) -> int:
    """Readiness as routers see it: the instance's records. A rank whose kvpush side is
    unhealthy stops renewing, so its record is gone within the TTL."""
    ads = instance_records(client, prefix, instance)
    for ad in ads:
        print(f"{ad.role.value} rank {ad.rank}: {ad.state.value} epoch {ad.epoch} "
              f"{ad.producer or ad.http_address}", flush=True)
    ranks = sorted(ad.rank for ad in ads)
    if not ads or len({ad.role for ad in ads}) != 1 or ranks != list(range(len(ranks))):
        print(f"{instance}: not ready (no complete set of records)", flush=True)
        return 2
    if any(ad.state is not InstanceState.SERVING for ad in ads):
        print(f"{instance}: draining", flush=True)
        return 1
    # A restarted instance publishes while its engine starts: ready once it serves HTTP.
    http_address = ads[0].http_address
    if http_address and not http_ready(http_address):
        print(f"{instance}: not ready (its HTTP server at {http_address} does not answer "
              "/health)", flush=True)
        return 2
    print(f"{instance}: ready", flush=True)
    return 0


def _drain_command(client: EtcdClient, prefix: str, instance: str, wait: float) -> int:
    try:
        ads = request_drain(client, prefix, instance)
    except DiscoveryUnavailable:
        raise
    except DiscoveryError as exc:
        print(exc, flush=True)
        return 2
    print(f"{instance}: drain asked of {len(ads)} rank(s)", flush=True)
    deadline = time.monotonic() + wait
    while True:
        reports = drain_reports(client, prefix, ads)
        if len(reports) == len(ads):
            held = sum(int(r.get("held", 0)) for r in reports.values())
            print(f"{instance}: drained ({held} hand-off(s) still held when it stopped "
                  "waiting); it may stop", flush=True)
            return 0
        if time.monotonic() >= deadline:
            if wait:
                print(f"{instance}: {len(reports)} of {len(ads)} rank(s) drained within "
                      f"{wait} s", flush=True)
            return 1 if wait else 0
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


if __name__ == "__main__":
    raise SystemExit(main())
