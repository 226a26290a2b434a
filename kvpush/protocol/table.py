"""One shape for every protocol state machine: a table of (state, event) -> row.

Each machine of :mod:`kvpush.protocol` (a request on either side, a source's owner, a peer
session) declares its transitions once, as h11 declares HTTP's: for each state, the events
it accepts, and for each such event the :class:`Row` -- the handler that runs it and the
states it may lead to. Dispatch is three steps, the same for every machine:

1. look the row up (:meth:`Table.row`); a missing row means the event is not accepted in
   that state, and the caller refuses it in its own way (the cores count refusals and log
   them; a consumer waiting for an answer may still be told the truth);
2. run the handler;
3. check that the state the handler left is one the row allows (:meth:`Table.check`). A
   state outside the row is a programming error in the machine: :class:`TransitionError`
   is raised, and the simulator reports any exception a core raises as a violation.

API
---
``Row(handler, to)``
    ``handler`` names the machine's method that runs the event (``None``: accepted, changes
    nothing -- the row leads back to its own state); ``to`` is every state it may lead to,
    the row's own state included when the handler may leave it unchanged.
``Table(name, rows, initial=(), final=())``
    ``rows`` maps each state to ``{event: Row}`` (``row(...)`` builds a Row from a handler
    name and states). ``initial`` are the states a record starts in and ``final`` the
    states in which it may be forgotten (both only for diagrams).
``Table.row(state, event) -> Row | None``, ``Table.accepts(state) -> frozenset[event]``
    Lookup.
``Table.run(machine, event, state_of, *args) -> bool``
    Steps 1-3: False when there is no row (nothing ran); otherwise calls
    ``getattr(machine, row.handler)(*args)``, checks ``state_of()`` against the row and
    returns True.
``Table.check(before, event, after)``
    Step 3 alone, for a caller that runs the handler itself.
``mermaid(table) -> str``
    The table as a Mermaid ``stateDiagram-v2`` (one edge per pair of states, labelled with
    the events that take it; rows that stay in their state are left out).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = ["Row", "Table", "TransitionError", "mermaid", "row"]

S = TypeVar("S", bound=enum.Enum)
E = TypeVar("E", bound=enum.Enum)


class TransitionError(AssertionError):
    """A handler left its machine in a state its row does not allow: a bug in the machine,
    never a peer's doing (so it is not a :class:`kvpush.KvpushError`)."""


@dataclass(frozen=True)
class Row(Generic[S]):
    """What one accepted event does in one state: the handler and where it may lead."""

    handler: str | None
    to: frozenset[S]


def row(handler: str | None, *to: S) -> Row[S]:
    """``Row(handler, frozenset(to))``."""
    return Row(handler, frozenset(to))


class Table(Generic[S, E]):
    """A machine's transitions (see the module docstring)."""

    def __init__(self, name: str, rows: Mapping[S, Mapping[E, Row[S]]], *,
                 initial: Iterable[S] = (), final: Iterable[S] = ()) -> None:
        self.name = name
        self.rows: dict[S, dict[E, Row[S]]] = {}
        for state, events in rows.items():
            self.rows[state] = {}
            for event, r in events.items():
                if r.handler is None and r.to != {state}:
                    raise ValueError(f"{name}: {state.name} on {event.name} runs nothing, "
                                     f"so it can only stay in {state.name}")
                self.rows[state][event] = r
        self.initial = tuple(initial)
        self.final = frozenset(final)
        self._accepts = {state: frozenset(events) for state, events in self.rows.items()}

    def row(self, state: S, event: E) -> Row[S] | None:
        events = self.rows.get(state)
        return None if events is None else events.get(event)

    def accepts(self, state: S) -> frozenset[E]:
        return self._accepts.get(state, frozenset())

    def states(self) -> list[S]:
        """Every state the table names (as a source or a target), in declaration order."""
        seen: dict[S, None] = dict.fromkeys(self.initial)
        for state, events in self.rows.items():
            seen[state] = None
            for r in events.values():
                seen.update(dict.fromkeys(sorted(r.to, key=_order)))
        seen.update(dict.fromkeys(sorted(self.final, key=_order)))
        return sorted(seen, key=_order)

    def edges(self) -> Iterator[tuple[S, E, Row[S]]]:
        for state, events in self.rows.items():
            for event, r in events.items():
                yield state, event, r

    def check(self, before: S, event: E, after: S) -> None:
        r = self.row(before, event)
        if r is None:
            raise TransitionError(f"{self.name}: {event.name} ran in {before.name}, which "
                                  "has no row for it")
        if after not in r.to:
            allowed = ", ".join(sorted(s.name for s in r.to))
            raise TransitionError(f"{self.name}: {event.name} in {before.name} led to "
                                  f"{after.name}; its row allows {allowed}")

    def run(self, machine: object, event: E, state_of: Callable[[], S], *args: Any) -> bool:
        before = state_of()
        r = self.row(before, event)
        if r is None:
            return False
        if r.handler is not None:
            getattr(machine, r.handler)(*args)
        after = state_of()
        if after not in r.to:
            self.check(before, event, after)
        return True


def _order(state: enum.Enum) -> int:
    return list(type(state)).index(state)


def _node(state: enum.Enum) -> str:
    return str(state.value).replace("-", "_")


def mermaid(table: Table[Any, Any]) -> str:
    """The table as a Mermaid ``stateDiagram-v2`` block body (without the code fence)."""
    lines = ["stateDiagram-v2"]
    for state in table.initial:
        lines.append(f"    [*] --> {_node(state)}")
    labels: dict[tuple[Any, Any], list[str]] = {}
    for state, event, r in table.edges():
        for target in sorted(r.to, key=_order):
            if target is not state:
                labels.setdefault((state, target), []).append(str(event.value))
    for state in table.states():
        for target in table.states():
            events = labels.get((state, target))
            if events:
                lines.append(f"    {_node(state)} --> {_node(target)}: {', '.join(events)}")
    for state in table.states():
        if state in table.final:
            lines.append(f"    {_node(state)} --> [*]")
    return "\n".join(lines) + "\n"
