"""The table shape every protocol machine uses (kvpush.protocol.table)."""

from __future__ import annotations

import enum

import pytest

from kvpush.errors import KvpushError
from kvpush.protocol.table import Row, Table, TransitionError, mermaid, row


class St(enum.Enum):
    IDLE = "idle"
    BUSY = "busy"
    DONE = "done"


class Ev(enum.Enum):
    START = "start"
    FINISH = "finish"
    POKE = "poke"
    BREAK = "break"


TABLE: Table[St, Ev] = Table("toy", {
    St.IDLE: {Ev.START: row("_start", St.BUSY), Ev.POKE: row(None, St.IDLE)},
    St.BUSY: {Ev.FINISH: row("_finish", St.DONE, St.BUSY), Ev.POKE: row(None, St.BUSY),
              Ev.BREAK: row("_break", St.DONE)},
}, initial=[St.IDLE], final=[St.DONE])


class Toy:
    def __init__(self) -> None:
        self.state = St.IDLE
        self.calls: list[tuple[str, tuple[object, ...]]] = []
        self.refused = 0

    def fire(self, event: Ev, *args: object) -> bool:
        ok = TABLE.run(self, event, lambda: self.state, *args)
        self.refused += not ok
        return ok

    def _start(self, *args: object) -> None:
        self.calls.append(("start", args))
        self.state = St.BUSY

    def _finish(self, last: bool) -> None:
        self.calls.append(("finish", (last,)))
        if last:
            self.state = St.DONE

    def _break(self) -> None:
        self.state = St.IDLE   # not in its row: a bug the table catches


def test_dispatch_runs_the_handler_with_its_arguments_and_moves() -> None:
    toy = Toy()
    assert toy.fire(Ev.START, 1, "x")
    assert toy.calls == [("start", (1, "x"))] and toy.state is St.BUSY
    assert toy.fire(Ev.FINISH, False)
    assert toy.state is St.BUSY           # staying is allowed: BUSY is in the row
    assert toy.fire(Ev.FINISH, True)
    assert toy.state is St.DONE


def test_missing_row_runs_nothing_and_is_left_to_the_caller() -> None:
    toy = Toy()
    assert not toy.fire(Ev.FINISH, True)
    assert toy.calls == [] and toy.state is St.IDLE and toy.refused == 1
    toy.state = St.DONE                   # a state with no rows at all refuses everything
    assert not toy.fire(Ev.POKE)
    assert toy.refused == 2


def test_a_row_without_handler_accepts_and_changes_nothing() -> None:
    toy = Toy()
    assert toy.fire(Ev.POKE)
    assert toy.calls == [] and toy.state is St.IDLE and toy.refused == 0


def test_a_handler_that_moves_outside_its_row_is_caught() -> None:
    toy = Toy()
    toy.fire(Ev.START)
    with pytest.raises(TransitionError, match="BREAK in BUSY led to IDLE; its row allows DONE"):
        toy.fire(Ev.BREAK)


def test_check_alone_and_an_event_without_row() -> None:
    TABLE.check(St.BUSY, Ev.FINISH, St.DONE)
    with pytest.raises(TransitionError, match="led to IDLE"):
        TABLE.check(St.BUSY, Ev.FINISH, St.IDLE)
    with pytest.raises(TransitionError, match="has no row"):
        TABLE.check(St.DONE, Ev.START, St.BUSY)


def test_a_transition_error_is_not_a_kvpush_error() -> None:
    # callers that catch kvpush's errors must not hide a bug
    assert not issubclass(TransitionError, KvpushError)


def test_a_row_that_runs_nothing_cannot_lead_elsewhere() -> None:
    with pytest.raises(ValueError, match="runs nothing"):
        Table("bad", {St.IDLE: {Ev.POKE: Row(None, frozenset({St.BUSY}))}})


def test_lookup() -> None:
    assert TABLE.accepts(St.IDLE) == {Ev.START, Ev.POKE}
    assert TABLE.accepts(St.DONE) == frozenset()
    assert TABLE.row(St.BUSY, Ev.FINISH) == Row("_finish", frozenset({St.DONE, St.BUSY}))
    assert TABLE.row(St.IDLE, Ev.FINISH) is None
    assert TABLE.states() == [St.IDLE, St.BUSY, St.DONE]


def test_mermaid_renders_every_edge_once_without_self_loops() -> None:
    assert mermaid(TABLE) == (
        "stateDiagram-v2\n"
        "    [*] --> idle\n"
        "    idle --> busy: start\n"
        "    busy --> done: finish, break\n"
        "    done --> [*]\n")


def test_the_machines_states_and_events_hash_by_identity() -> None:
    """The cores look a state and an event up in their tables on every step: every machine's
    states and events (and the request enums the cores key on) hash with ``object``'s C
    slot, not ``Enum``'s Python ``__hash__``."""
    from kvpush._enum import IdentityEnum
    from kvpush.protocol import consumer, effects, producer, session
    from kvpush.request import ReleaseReason, RequestState, TransferMode

    tables = [consumer.TABLE, producer.TABLE, producer.OWNER_TABLE, session.DIAL_TABLE,
              session.LINK_TABLE]
    kinds = {type(s) for t in tables for s in t.states()}
    kinds |= {type(e) for t in tables for _, e, _ in t.edges()}
    kinds |= {effects.XferEnd, ReleaseReason, RequestState, TransferMode}
    assert len(kinds) == 13
    for kind in kinds:
        assert issubclass(kind, IdentityEnum), kind
        member = next(iter(kind))
        assert kind.__hash__ is object.__hash__ and hash(member) == object.__hash__(member)
