"""The GPU side of the vLLM adapter: knowing when a request's KV is really in memory, and
host staging for GPUs whose memory NIXL cannot reach (no GPUDirect RDMA).

A GPU forward pass is asynchronous: when vLLM's ``wait_for_save`` / ``save_kv_layer`` run,
the kernels that write the KV may still be queued on the compute stream. Synchronising
that whole stream every step would stall the engine; instead :class:`Readiness` records a
CUDA event per request (or per layer) on the stream and a waiter thread hands the request
to kvpush once *that* event has completed, while the engine goes on. On CPU (and in tests)
everything is already in memory and the work runs at once.

:class:`HostStaging` (``kv_buffer_device: "cpu"`` with CUDA caches) keeps a pinned host
mirror of every cache tensor, registered with NIXL instead of the VRAM: the prefill side
copies a request's blocks device -> host on a side stream (after the compute event) before
kvpush sends them; the decode side copies them host -> device on a side stream after they
land, and reports the request only when that copy has completed.

torch is imported lazily; vLLM not at all.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["HostStaging", "Readiness", "block_runs", "record_event"]

log = logging.getLogger("kvpush.vllm")


class _Done:
    """An event that has completed (CPU tensors: the work ran synchronously)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


DONE = _Done()


def record_event(device_type: str, stream: Any = None) -> Any:
    """A CUDA event recorded on ``stream`` (default: the current stream) for CUDA work;
    an already-completed one for CPU."""
    if device_type != "cuda":
        return DONE
    import torch

    event = torch.cuda.Event()  # type: ignore[no-untyped-call, unused-ignore]
    event.record(stream if stream is not None else torch.cuda.current_stream())
    return event


class Readiness:
    """Runs callbacks once their event has completed, in order, on one waiter thread (no
    stream synchronisation on the engine's thread). A callback whose event is already
    complete runs at once on the caller's thread. The thread sleeps on its queue when
    nothing is pending (idle means idle); :meth:`close` stops it."""

    def __init__(self, name: str = "kvpush-vllm-ready") -> None:
        self._queue: queue.Queue[tuple[Any, Callable[[], None]] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._name = name
        self._lock = threading.Lock()
        self._pending = 0

    def when_ready(self, event: Any, fn: Callable[[], None]) -> None:
        if event is DONE and not self.pending:
            fn()   # nothing queued before it: run in order, now
            return
        with self._lock:
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name,
                                                daemon=True)
                self._thread.start()
        self._queue.put((event, fn))

    @property
    def pending(self) -> int:
        with self._lock:
            return self._pending

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            event, fn = item
            try:
                event.synchronize()   # this request's (or layer's) work only
                fn()
            except Exception:  # a failed hand-over is the callback's to report
                log.exception("kvpush: a deferred hand-over failed")
            finally:
                with self._lock:
                    self._pending -= 1

    def close(self, timeout: float = 10.0) -> None:
        thread = self._thread
        if thread is None:
            return
        self._queue.put(None)
        thread.join(timeout)
        if thread.is_alive():
            log.error("kvpush: the readiness thread did not stop within %.0f s", timeout)
        self._thread = None


class HostStaging:
    """Pinned host mirrors of vLLM's KV cache tensors and the copies between them, on a
    side stream (``kv_buffer_device: "cpu"``).

    Parameters
    ----------
    device_caches
        vLLM's cache tensors by layer name (CUDA; CPU tensors work too, synchronously,
        which is how the copy logic is tested without a GPU).
    pin
        Pin the host mirrors (page-locked: device<->host copies run asynchronously). On by
        default for CUDA caches.
    """

    def __init__(self, device_caches: Mapping[str, Any], pin: bool | None = None) -> None:
        import torch

        if not device_caches:
            raise ValueError("kvpush: no KV cache tensors to stage")
        first = next(iter(device_caches.values()))
        self.device_type: str = first.device.type
        cuda = self.device_type == "cuda"
        pin = cuda if pin is None else pin
        self.device = dict(device_caches)
        # One mirror per distinct tensor (layers sharing a cache share its mirror), with the
        # device tensor's shape; contiguous whatever the device tensor's strides: the
        # layout is read from the mirrors.
        self.host: dict[str, Any] = {}
        by_ptr: dict[tuple[int, tuple[int, ...]], Any] = {}
        for name, t in self.device.items():
            key = (t.data_ptr(), tuple(t.shape))
            mirror = by_ptr.get(key)
            if mirror is None:
                mirror = torch.empty(tuple(t.shape), dtype=t.dtype, device="cpu",
                                     pin_memory=pin)
                mirror.copy_(t)
                by_ptr[key] = mirror
            self.host[name] = mirror
        owners: dict[int, str] = {}
        for name, mirror in self.host.items():
            owners.setdefault(id(mirror), name)
        self._unique = [(n, self.device[n], self.host[n]) for n in owners.values()]
        self.stream = (torch.cuda.Stream(device=first.device)  # type: ignore[no-untyped-call, unused-ignore]
                       if cuda else None)
        self.nbytes = sum(m.numel() * m.element_size() for _, _, m in self._unique)

    def _copy(self, block_ids: Sequence[int], to_host: bool, after: Any,
              layers: Sequence[str] | None) -> Any:
        import torch

        if not len(block_ids):
            return DONE
        names = set(layers) if layers is not None else None
        cuda = self.stream is not None
        with torch.cuda.stream(self.stream) if cuda else _null():
            if cuda and after is not DONE:
                self.stream.wait_event(after)   # type: ignore[union-attr]
            for name, dev, host in self._unique:
                if names is not None and name not in names:
                    continue
                # One copy per run of consecutive blocks (dim 0 of vLLM's logical view);
                # into or out of pinned memory, each is asynchronous on the side stream.
                for lo, hi in block_runs(block_ids):
                    if to_host:
                        host[lo:hi].copy_(dev[lo:hi], non_blocking=cuda)
                    else:
                        dev[lo:hi].copy_(host[lo:hi], non_blocking=cuda)
        return record_event(self.device_type, self.stream)

    def to_host(self, block_ids: Sequence[int], after: Any = DONE,
                layers: Sequence[str] | None = None) -> Any:
        """Copy ``block_ids`` of every layer (or of ``layers``) device -> host once ``after``
        (the compute event) has completed; returns the copy's event."""
        return self._copy(block_ids, True, after, layers)

    def to_device(self, block_ids: Sequence[int]) -> Any:
        """Copy ``block_ids`` of every layer host -> device (after they landed in the
        mirror); returns the copy's event."""
        return self._copy(block_ids, False, DONE, None)


def block_runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """``[lo, hi)`` runs of consecutive ids, in sorted order (each copied at once)."""
    runs: list[tuple[int, int]] = []
    for b in sorted(set(int(x) for x in block_ids)):
        if runs and runs[-1][1] == b:
            runs[-1] = (runs[-1][0], b + 1)
        else:
            runs.append((b, b + 1))
    return runs


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
