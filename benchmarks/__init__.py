"""kvpush benchmarks: ``python -m benchmarks [--quick] [--only SUITE ...] [--list [--verbose]]``.

One module per suite, found by name (:mod:`benchmarks.suites` says what a suite declares and
lists them in the order of a full run); :mod:`benchmarks.report` makes the tables, targets
and ``summary.json``; :mod:`benchmarks.vllm` holds the benchmarks in real vLLM servers and
:mod:`benchmarks.soak` the fault-injection soak, both run on their own.

Every process a suite starts is a :class:`benchmarks._procs.Worker`, stopped by the suite
(by pid, with timeouts), so nothing outlives a run.
"""

from __future__ import annotations

SCHEMA_VERSION = 1
