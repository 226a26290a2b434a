"""ChildAgent keeps every transfer state the data-plane child reported until it is asked
for (sans child: its channel is a fake that answers as the child does)."""

from __future__ import annotations

from typing import Any

from kvpush.agent import XferState
from kvpush.dataplane import ChildAgent


class _Child:
    """The child's side of "states": a transfer it reports ended it releases (then it
    knows no such handle: ERROR)."""

    def __init__(self, states: dict[int, str]) -> None:
        self.states = states

    def __call__(self, op: str, *args: Any) -> Any:
        assert op == "states"
        out = {h: self.states.get(h, XferState.ERROR.value) for h in args[0]}
        for h, state in out.items():
            if state != XferState.IN_PROGRESS.value:
                self.states.pop(h, None)
        return out


def _agent(child: _Child, live: set[int]) -> ChildAgent:
    agent = ChildAgent.__new__(ChildAgent)
    agent.lost = None
    agent._live = set(live)
    agent._states = {}
    agent._call = child  # type: ignore[method-assign]
    return agent


def test_a_transfer_reported_done_alongside_another_reads_done() -> None:
    done = XferState.DONE.value
    agent = _agent(_Child({1: done, 2: done, 3: XferState.IN_PROGRESS.value}), {1, 2, 3})
    assert agent.state(1) is XferState.DONE       # the child reported 1, 2 and 3
    assert agent.state(3) is XferState.IN_PROGRESS
    assert agent.state(3) is XferState.IN_PROGRESS  # asked again: the kept 2 stays kept
    assert agent.state(2) is XferState.DONE       # was ERROR: its state was dropped
