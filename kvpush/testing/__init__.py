"""The deterministic simulator of kvpush's protocol: the real request cores and peer
sessions over fakes. (It drives the protocol machines, not a real ``Producer`` or
``Consumer``: a simulated peer for an engine's own integration tests is not provided.)

* :mod:`kvpush.testing.fakes` -- a seeded scheduler, fake KV memory, a fake NIXL that
  copies real bytes at times the scheduler picks (and keeps copying after an abandon), a
  fake control network (FIFO per direction, link cuts), and the ``links`` a core plans with.
* :mod:`kvpush.testing.driver` -- the I/O driver of one simulated endpoint: the real peer
  sessions (:mod:`kvpush.protocol.session`: handshake, authentication, heartbeats, peer
  loss, incarnations), stalls, kills, and the core's effects carried out on the fakes.
* :mod:`kvpush.testing.engines` -- prefill and decode engine models that write and check
  real bytes, and the invariants of docs/PROTOCOL.md.
* :mod:`kvpush.testing.sim` -- the simulation and its CLI,
  ``python -m kvpush.testing.sim --requests N --seed S``.
"""

from typing import Any

from .checker import Checker, Violation
from .fakes import FakeMemory, FakeNixl, Network, Scheduler, SimLinks, Transfer

_FROM_SIM = ("FAULTS", "Faults", "Simulation", "Timings", "main")


def __getattr__(name: str) -> Any:
    # Imported on first use, so ``python -m kvpush.testing.sim`` does not find the module
    # already imported by its package (runpy warns about that).
    if name in _FROM_SIM:
        from . import sim
        return getattr(sim, name)
    raise AttributeError(f"module 'kvpush.testing' has no attribute {name!r}")

__all__ = ["FAULTS", "Checker", "FakeMemory", "FakeNixl", "Faults", "Network", "Scheduler",
           "SimLinks", "Simulation", "Timings", "Transfer", "Violation", "main"]
