"""Testing with kvpush: simulated peers for an engine's own integration tests, and the
deterministic simulator of kvpush's protocol.

For an engine's tests (docs/API.md, "Testing an integration"):

* :mod:`kvpush.testing.peers` -- :class:`SimulatedPrefill` and :class:`SimulatedDecode`,
  the other side of the engine's real ``Consumer`` or ``Producer``: real endpoints over real
  NIXL and ZeroMQ that can be killed, restarted as a new incarnation, stalled, slowed, made
  to abort or fail a push, and that send known bytes (:func:`fill_blocks`,
  :func:`check_blocks`).
* :mod:`kvpush.testing.proxy` -- :class:`ControlProxy`, the ZeroMQ man in the middle each
  simulated peer sits behind, and the seeded :class:`FrameRule` s that drop, delay,
  duplicate or answer its control frames.

For kvpush's own protocol (docs/SIMULATION.md): the production driver, sessions and cores
below the facades, over fakes.

* :mod:`kvpush.testing.fakes` -- a seeded scheduler, fake KV memory, a fake NIXL that
  copies real bytes at times the scheduler picks (and keeps copying after an abandon), a
  fake control network (FIFO per direction, link cuts), and the ``links`` a core plans with.
* :mod:`kvpush.testing.wire` -- ZeroMQ's ROUTER and DEALER in memory, for a
  :class:`kvpush.driver.Driver` run without its thread.
* :mod:`kvpush.testing.driver` -- one simulated process: the real driver (stepped on the
  simulated clock), sessions and core over the wire and a NIXL agent on the fakes, with
  the simulator's checks as observers; stalls, kills, closes.
* :mod:`kvpush.testing.engines` -- prefill and decode engine models that write and check
  real bytes, and the invariants of docs/PROTOCOL.md.
* :mod:`kvpush.testing.sim` -- the simulation and its CLI,
  ``python -m kvpush.testing.sim --requests N --seed S``.
"""

from typing import Any

from .checker import Checker, Violation
from .fakes import FakeMemory, FakeNixl, Network, Scheduler, SimLinks, Transfer
from .peers import SimulatedDecode, SimulatedPrefill, check_blocks, fill_blocks, host_layout
from .proxy import Action, ControlProxy, Direction, FrameRule, frame_info

_FROM_SIM = ("FAULTS", "Faults", "Simulation", "Timings", "main")


def __getattr__(name: str) -> Any:
    # Imported on first use, so ``python -m kvpush.testing.sim`` does not find the module
    # already imported by its package (runpy warns about that).
    if name in _FROM_SIM:
        from . import sim
        return getattr(sim, name)
    raise AttributeError(f"module 'kvpush.testing' has no attribute {name!r}")

__all__ = ["FAULTS", "Action", "Checker", "ControlProxy", "Direction", "FakeMemory", "FakeNixl",
           "Faults", "FrameRule", "Network", "Scheduler", "SimLinks", "SimulatedDecode",
           "SimulatedPrefill", "Simulation", "Timings", "Transfer", "Violation", "check_blocks",
           "fill_blocks", "frame_info", "host_layout", "main"]
