"""What the tests share, and what the benchmarks reuse: ``harness`` (caches, fills, a
Producer in a child process), ``cores`` (rigs for the sans-IO protocol cores), ``netns``,
``netns_node`` and ``netns_fabric`` (endpoints on hosts made of network namespaces),
``reference`` (the numpy twin of ``kvpush._core``), ``sim_doubles`` (planted faults for
the simulator) and ``etcd`` (a private etcd member for the discovery tests)."""

from pathlib import Path

#: The repository root: the working directory and ``PYTHONPATH`` of child processes.
ROOT = Path(__file__).resolve().parents[2]
