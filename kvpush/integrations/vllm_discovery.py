"""Discovery for the vLLM adapter: one worker rank's records in etcd, the producers a decode
rank finds there, and a drain asked through etcd (``discovery_*`` keys of
``kv_connector_extra_config``; :mod:`kvpush.discovery` has the parts, ``docs/DEPLOY.md``
the deployment).

Every rank of an instance with ``discovery_etcd`` set:

* publishes its :class:`~kvpush.discovery.Advertisement` (prefill ranks: role ``prefill``
  with the rank's advertised producer address; decode ranks: role ``decode``) under a
  lease renewed while :func:`~kvpush.discovery.endpoint_health` finds its kvpush side
  healthy; a killed or unhealthy rank's record goes within ``discovery_ttl_s``, and a
  restarted one shows a new epoch;
* decode ranks (``kv_consumer`` / ``kv_both``) follow the records with a
  :class:`~kvpush.discovery.Watcher` and a :class:`~kvpush.discovery.ProducerDirectory`,
  which starts the handshake with every serving, compatible producer as it appears (the
  producers a request names in ``kv_transfer_params`` are still the ones it uses);
* follows ``{prefix}/control/drain/{instance}`` (:func:`~kvpush.discovery.request_drain`,
  ``python -m kvpush.discovery ... drain INSTANCE``). Asked, the rank marks its record
  ``draining`` (the router bridge stops registering the instance, directories stop
  choosing it), waits at least ``discovery_drain_grace_s`` for routers to stop sending and
  until every running router bridge confirms the instance is out of its router
  (:func:`~kvpush.discovery.unrouted`; at most :data:`BRIDGE_WAIT_S` more), then until it
  holds no hand-off (kvpush's held sources, sends not yet handed over or released, loads
  in flight) and vLLM ran no forward pass for :data:`QUIET_S`, withdraws its record and
  reports ``{prefix}/control/drained/{instance}/{rank}``: the instance may stop. Whatever
  still reaches it meanwhile is served: nothing is refused.

Everything here runs on its own threads (the publisher's, the watcher's, the drain
listener's); the engine's thread only starts and closes it.
"""

from __future__ import annotations

import logging
import re
import socket
import threading
import time
from typing import TYPE_CHECKING

from ..discovery import (
    Advertisement,
    DiscoveryError,
    DrainListener,
    EtcdClient,
    ProducerDirectory,
    Publisher,
    Role,
    Watcher,
    _check_prefix,
    _host_port,
    compat_key,
    endpoint_health,
    report_drained,
    unrouted,
)
from ..request import TransferMode

if TYPE_CHECKING:
    from collections.abc import Callable

    from .vllm_common import AdapterConfig
    from .vllm_worker import KVPushWorker

__all__ = ["BRIDGE_WAIT_S", "QUIET_S", "RankDiscovery", "check_discovery_config", "instance_name"]

log = logging.getLogger("kvpush.vllm")

#: A draining rank withdraws only after vLLM ran no forward pass on it for this long with
#: nothing held: a request that reached the engine is scheduled well within it.
QUIET_S = 1.0
#: How often a draining rank looks at what it still holds.
_DRAIN_CHECK_S = 0.2
#: How often a draining rank logs what it still waits for.
_DRAIN_TELL_S = 5.0
#: How often a draining rank asks etcd whether the router bridges have let it go.
_BRIDGE_CHECK_S = 0.5
#: A draining rank waits at most this long past its grace for the bridges' word (a bridge
#: confirms about 5.5 s after its last registration of the instance).
BRIDGE_WAIT_S = 30.0


def _endpoints(config: AdapterConfig) -> list[str]:
    return [u.strip() for u in config.discovery_etcd.split(",") if u.strip()]


def check_discovery_config(config: AdapterConfig) -> None:
    """Raise ``ValueError`` naming a bad ``discovery_*`` value (at engine start-up)."""
    try:
        EtcdClient(_endpoints(config))
        _check_prefix(config.discovery_prefix)
    except DiscoveryError as exc:
        raise ValueError(f"kvpush: discovery_etcd / discovery_prefix: {exc}") from None
    ttl = config.discovery_ttl_s
    if isinstance(ttl, bool) or not isinstance(ttl, int) or not 1 <= ttl <= 3600:
        raise ValueError(f"kvpush: discovery_ttl_s must be an int in [1, 3600], got {ttl!r}")
    if config.discovery_http_address and not _host_port(config.discovery_http_address):
        raise ValueError("kvpush: discovery_http_address must be host:port, got "
                         f"{config.discovery_http_address!r}")
    if config.discovery_instance and not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,119}$",
                                                  config.discovery_instance):
        raise ValueError("kvpush: discovery_instance must be letters, digits, '.', '_', '-' "
                         f"(at most 120), got {config.discovery_instance!r}")
    if not 0 <= config.discovery_drain_grace_s <= 600:
        raise ValueError("kvpush: discovery_drain_grace_s must be in [0, 600] s, got "
                         f"{config.discovery_drain_grace_s}")


def instance_name(config: AdapterConfig, dp_rank: int, address: str, engine_id: str) -> str:
    """This instance's name in the records (see ``discovery_instance``)."""
    name = config.discovery_instance
    if not name:
        base = config.discovery_http_address or address.rpartition("://")[2] \
            or f"{socket.gethostname()}-{engine_id[:8]}"
        name = re.sub(r"[^A-Za-z0-9._-]+", "-", base).strip("-.")[:120] or "vllm"
    return f"{name}-dp{dp_rank}" if dp_rank else name


class RankDiscovery:
    """One worker rank's part in discovery (see the module docstring). Built and started by
    the worker once its endpoints run; :meth:`close` at the worker's shutdown."""

    def __init__(self, worker: KVPushWorker) -> None:
        config = worker.config
        self.worker = worker
        self.config = config
        self.client = EtcdClient(_endpoints(config))
        self.prefix = config.discovery_prefix
        self.instance = instance_name(config, worker.coords.dp_rank, worker.address,
                                      worker.engine_id)
        self.publisher: Publisher | None = None
        self.watcher: Watcher | None = None
        self.directory: ProducerDirectory | None = None
        self.listener: DrainListener | None = None
        self._stop = threading.Event()
        self.draining = False
        self.drained = threading.Event()

    def _advertisement(self) -> Advertisement:
        w = self.worker
        endpoint = w.producer or w.consumer
        assert endpoint is not None
        modes = (TransferMode.PUSH, TransferMode.PULL)
        if w.producer is not None:
            return Advertisement(self.instance, Role.PREFILL, compat_key(w.producer.layout),
                                 rank=w.coords.tp_rank, producer=w.address,
                                 http_address=self.config.discovery_http_address, modes=modes)
        return Advertisement(self.instance, Role.DECODE, compat_key(endpoint.layout),
                             rank=w.coords.tp_rank,
                             http_address=self.config.discovery_http_address, modes=modes)

    def _health(self) -> Callable[[], bool]:
        checks = [endpoint_health(e) for e in (self.worker.producer, self.worker.consumer)
                  if e is not None]
        return lambda: all(check() for check in checks)

    def start(self) -> RankDiscovery:
        """Publish this rank's record (raises :class:`~kvpush.discovery.DiscoveryUnavailable`
        when etcd cannot be reached), follow the producers (decode ranks) and the drain
        key."""
        w = self.worker
        if w.consumer is not None:
            self.watcher = Watcher(self.client, self.prefix).start()
            self.directory = ProducerDirectory(self.watcher, compat_key(w.consumer.layout),
                                               consumer=w.consumer)
        try:
            self.publisher = Publisher(self.client, self.prefix, self._advertisement(),
                                       ttl_s=self.config.discovery_ttl_s,
                                       health=self._health()).start()
        except BaseException:
            self.close()
            raise
        epoch = self.publisher.advertisement.epoch
        self.listener = DrainListener(self.client, self.prefix, self.instance, epoch,
                                      self._drain).start()
        log.info("kvpush: discovery: %s published in etcd %s (epoch %d, TTL %d s)",
                 self.publisher.key, ",".join(self.client.endpoints), epoch,
                 self.config.discovery_ttl_s)
        return self

    def _drain(self) -> None:
        """(The drain listener's thread.) Stop being chosen, finish what this rank holds,
        withdraw, report."""
        assert self.publisher is not None
        self.draining = True
        start = time.monotonic()
        try:
            # the bridges' word counts from here on (not one from an earlier lapse)
            since = self.client.get_prefix(self.publisher.key)[0]
        except DiscoveryError:
            since = 0
        try:
            self.publisher.drain()
        except DiscoveryError as exc:  # written with the next renewal
            log.warning("kvpush: discovery: marking %s draining: %s", self.publisher.key, exc)
        c = self.config
        limit = c.discovery_drain_grace_s + c.lease_s + c.max_wait_s + c.transfer_timeout_s
        log.info("kvpush: discovery: %s draining: no new requests are routed here; "
                 "finishing what it holds (at most %.0f s)", self.publisher.key, limit)
        quiet_since: float | None = None
        told = start
        epoch = self.publisher.advertisement.epoch
        waiting: list[str] | None = None  # bridges not yet confirming (None: not asked)
        asked_at = 0.0
        while not self._stop.wait(_DRAIN_CHECK_S):
            now = time.monotonic()
            # Out of every router first: each running bridge confirms the instance is out
            # of its vllm-router, which does not retry a refused connection elsewhere.
            if (waiting is None or waiting) and now - asked_at >= _BRIDGE_CHECK_S:
                asked_at = now
                try:
                    waiting = unrouted(self.client, self.prefix, self.instance, epoch,
                                       since_revision=since)[1]
                except DiscoveryError as exc:
                    waiting = waiting or [f"etcd: {exc}"]
                if waiting and now - start >= c.discovery_drain_grace_s + BRIDGE_WAIT_S:
                    log.error("kvpush: discovery: %s: no word from router bridge(s) %s "
                              "after %.0f s; going on", self.publisher.key, waiting,
                              now - start)
                    waiting = []
            held = self.worker.holding()
            idle = held == 0 and now - self.worker.last_forward >= QUIET_S
            if now - told >= _DRAIN_TELL_S:  # why it is not done yet, for whoever waits
                told = now
                log.info("kvpush: discovery: %s draining for %.0f s: %d hand-off(s) held, "
                         "last forward pass %.1f s ago, router bridge(s) not yet "
                         "confirming: %s", self.publisher.key, now - start, held,
                         now - self.worker.last_forward, waiting)
            quiet_since = (quiet_since or now) if idle and waiting == [] else None
            if now - start >= c.discovery_drain_grace_s and quiet_since is not None \
                    and now - quiet_since >= QUIET_S:
                break
            if now - start >= limit:
                log.error("kvpush: discovery: %s still holds %d hand-off(s) after %.0f s of "
                          "draining; withdrawing anyway", self.publisher.key,
                          self.worker.holding(), now - start)
                break
        else:
            return  # shut down while draining: close() withdraws the record
        held = self.worker.holding()
        ad = self.publisher.advertisement
        self.publisher.close()
        try:
            report_drained(self.client, self.prefix, ad, held=held)
        except DiscoveryError as exc:
            log.error("kvpush: discovery: %s drained, but the report was not written: %s",
                      ad.key, exc)
        self.drained.set()
        log.info("kvpush: discovery: %s drained in %.1f s (%d held): it may stop",
                 ad.key, time.monotonic() - start, held)

    def close(self) -> None:
        """Withdraw the record and stop every thread (the worker's shutdown)."""
        self._stop.set()
        if self.listener is not None:
            self.listener.close()
        if self.publisher is not None:
            self.publisher.close()
        if self.watcher is not None:
            self.watcher.close()
