"""kvpush benchmarks: ``python -m benchmarks [--quick]``.

Suites (one module each; each returns a dict of results and the figures it contributes to
``summary.json``):

* :mod:`benchmarks.desc_prep` -- block ids -> descriptor indices: the compiled planner
  against numpy, on model-shaped caches.
* :mod:`benchmarks.throughput` -- nixlbench-style GB/s sweep across two processes: memcpy,
  raw NIXL (prep_xfer_dlist + make_prepped_xfer) and kvpush push (WRITE) / pull (READ) on
  the same buffers; coalescing on/off.
* :mod:`benchmarks.critical_path` -- 1 prefill + 1 decode engine + a router, Poisson
  arrivals, push vs pull TTFT and handover overhead.
* :mod:`benchmarks.cpu` -- "idle means idle": CPU of idle pairs, CPU-seconds per GiB moved,
  and the latency cost of each :class:`kvpush.ProgressPolicy`.

Every process a suite starts is a :class:`benchmarks._procs.Worker`, stopped by the suite
(by pid, with timeouts), so nothing outlives a run.
"""

from __future__ import annotations

SCHEMA_VERSION = 1
