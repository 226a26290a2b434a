"""Prometheus metrics for any engine (the optional extra ``kvpush[prometheus]``).

The same figures as the vLLM adapter's (``vllm:kvpush_*``, see
:mod:`kvpush.integrations.vllm`), named without vLLM's namespace -- so a dashboard reads
either -- and labelled by ``role`` (``producer``/``consumer``) and ``endpoint`` (its name)::

    kvpush_xfer_time_seconds          histogram  decode side: expect/pull -> all KV landed
    kvpush_bytes_transferred          histogram  decode side: bytes received per request
    kvpush_num_push_total             counter    decode side: requests received by push
    kvpush_num_pull_total             counter    decode side: requests received by pull
    kvpush_num_failed_total           counter    decode side: failed, timed out, aborted
    kvpush_num_released_total         counter    prefill side: sources released after transfer
    kvpush_num_lease_expired_total    counter    prefill side: nobody came within the lease
    kvpush_num_send_failed_total      counter    prefill side: released after failure/abort/close
    kvpush_requests_in_flight         gauge      requests with no result (consumer) or
                                                 sources held (producer), now
    kvpush_results_unsafe_total       counter    decode side: results with blocks_safe=False

Use::

    import kvpush.prometheus, prometheus_client
    metrics = kvpush.prometheus.KvpushMetrics()      # default registry, or registry=...
    metrics.track(producer)                          # or a consumer; any number of them
    prometheus_client.start_http_server(9400)        # serves /metrics

Observations are made on each endpoint's loop thread as results and releases are emitted
(a few counter increments: no I/O, no lock held across kvpush), whichever way the engine
takes them (callbacks, handles, get_finished, async iterators). See
``examples/prometheus_metrics.py``.
"""

from __future__ import annotations

import threading
from typing import Any

try:
    import prometheus_client
except ImportError as _exc:  # pragma: no cover - depends on the install
    raise ImportError("kvpush.prometheus needs prometheus_client: "
                      "pip install 'kvpush[prometheus]'") from _exc

from .consumer import Consumer
from .producer import Producer
from .request import Release, ReleaseReason, TransferMode, TransferResult

__all__ = ["BYTES_BUCKETS", "TIME_BUCKETS", "KvpushMetrics"]

#: Buckets of ``kvpush_xfer_time_seconds`` (the vLLM adapter's).
TIME_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                5.0, 10.0, 30.0)
#: Buckets of ``kvpush_bytes_transferred`` (the vLLM adapter's: 2 KiB .. 8 GiB by 4x).
BYTES_BUCKETS = tuple(float(2 ** (10 + i)) for i in range(1, 25, 2))

_LABELS = ("role", "endpoint")

_COUNTERS = {
    "num_push": "Requests whose KV arrived by push (producer WRITE).",
    "num_pull": "Requests whose KV arrived by pull (consumer READ).",
    "num_failed": "Requests whose KV did not arrive (failed, timed out, aborted).",
    "num_released": "Prefill requests whose blocks were released after their transfer.",
    "num_lease_expired": "Prefill requests whose blocks were released because no decode "
                         "instance came for them within the lease.",
    "num_send_failed": "Prefill requests whose transfer failed or was aborted.",
    "results_unsafe": "Results with blocks_safe=False: a transfer could not be fenced and "
                      "bytes may still land in their blocks.",
}


class KvpushMetrics:
    """kvpush's Prometheus metrics in ``registry`` (default: prometheus_client's global
    one); :meth:`track` each Producer or Consumer whose figures they should carry.
    ``prefix`` is the name prefix (``kvpush``). Any thread may call :meth:`track` and
    :meth:`untrack`."""

    def __init__(self, registry: Any = None, prefix: str = "kvpush") -> None:
        registry = prometheus_client.REGISTRY if registry is None else registry
        self.registry = registry
        self.xfer_time = prometheus_client.Histogram(
            f"{prefix}_xfer_time_seconds",
            "Time from a request's registration (push) or READ (pull) to all of its KV "
            "landed, on the decode side.", _LABELS, buckets=TIME_BUCKETS, registry=registry)
        self.bytes = prometheus_client.Histogram(
            f"{prefix}_bytes_transferred", "Bytes of KV received per request, on the decode "
            "side.", _LABELS, buckets=BYTES_BUCKETS, registry=registry)
        self.counters = {key: prometheus_client.Counter(f"{prefix}_{key}", doc, _LABELS,
                                                        registry=registry)
                         for key, doc in _COUNTERS.items()}
        self.in_flight = prometheus_client.Gauge(
            f"{prefix}_requests_in_flight", "Requests with no result yet (consumer) or "
            "source blocks held (producer).", _LABELS, registry=registry)
        self._tracked: dict[int, tuple[Any, Any]] = {}
        self._lock = threading.Lock()

    def track(self, endpoint: Producer | Consumer) -> None:
        """Count ``endpoint``'s results (Consumer) or releases (Producer) from now on, and
        report its in-flight requests at every scrape. Tracking twice is a no-op."""
        with self._lock:
            self._track(endpoint)

    def _track(self, endpoint: Producer | Consumer) -> None:
        if id(endpoint) in self._tracked:
            return
        if isinstance(endpoint, Consumer):
            role = "consumer"
            observer: Any = self._consumer_observer(endpoint.name)
        elif isinstance(endpoint, Producer):
            role = "producer"
            observer = self._producer_observer(endpoint.name)
        else:
            raise TypeError(f"track() takes a kvpush Producer or Consumer, got "
                            f"{type(endpoint).__name__}")
        labels = (role, endpoint.name)
        for counter in self.counters.values():   # every series exists from the start
            counter.labels(*labels)
        self.xfer_time.labels(*labels)
        self.bytes.labels(*labels)
        self.in_flight.labels(*labels).set_function(lambda: float(endpoint.pending))
        self._tracked[id(endpoint)] = (endpoint, observer)
        # copied, not changed in place: the loop thread may be iterating the old list
        endpoint._observers = [*endpoint._observers, observer]

    def untrack(self, endpoint: Producer | Consumer) -> None:
        """Stop counting ``endpoint`` and drop its series (e.g. once it is closed)."""
        with self._lock:
            self._untrack(endpoint)

    def _untrack(self, endpoint: Producer | Consumer) -> None:
        entry = self._tracked.pop(id(endpoint), None)
        if entry is None:
            return
        _, observer = entry
        kept: Any = [o for o in endpoint._observers if o is not observer]
        endpoint._observers = kept
        role = "consumer" if isinstance(endpoint, Consumer) else "producer"
        for metric in (*self.counters.values(), self.xfer_time, self.bytes, self.in_flight):
            try:
                metric.remove(role, endpoint.name)
            except KeyError:
                pass

    def _consumer_observer(self, name: str) -> Any:
        labels = ("consumer", name)
        xfer_time = self.xfer_time.labels(*labels)
        nbytes = self.bytes.labels(*labels)
        push, pull, failed, unsafe = (self.counters[k].labels(*labels) for k in
                                      ("num_push", "num_pull", "num_failed", "results_unsafe"))

        def observe(result: TransferResult) -> None:
            if result.ok:
                xfer_time.observe(result.elapsed_s)
                nbytes.observe(result.bytes_moved)
                (push if result.mode is TransferMode.PUSH else pull).inc()
            else:
                failed.inc()
            if not result.blocks_safe:
                unsafe.inc()

        return observe

    def _producer_observer(self, name: str) -> Any:
        labels = ("producer", name)
        released, expired, send_failed = (self.counters[k].labels(*labels) for k in
                                          ("num_released", "num_lease_expired",
                                           "num_send_failed"))

        def observe(release: Release) -> None:
            if release.reason is ReleaseReason.TRANSFERRED:
                released.inc()
            elif release.reason is ReleaseReason.LEASE_EXPIRED:
                expired.inc()
            else:
                send_failed.inc()

        return observe
