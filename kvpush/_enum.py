"""The base of kvpush's enums that are looked up per request."""

from __future__ import annotations

import enum

__all__ = ["IdentityEnum"]


class IdentityEnum(enum.Enum):
    """An :class:`enum.Enum` hashed by identity.

    Members are singletons that compare by identity (pickling and copying give the same
    member back), so ``object``'s hash agrees with equality; it is a C slot, where
    ``Enum.__hash__`` is a Python call (``hash(self._name_)``): the protocol cores hash ~35
    members per request looking up their transition tables and state counters. Neither hash
    is the same from one process to the next, so nothing may depend on the order in which
    a set of members iterates: ``tests/sim/test_sim.py`` runs one seed under other hash
    seeds and checks the trace is the same."""

    __hash__ = object.__hash__
