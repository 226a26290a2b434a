"""Invariant violations and the trace that explains them.

A violation is recorded with the seed, the step (scheduler event number) and simulated
time at which it was found, and printed with the tail of the trace, so that
``python -m kvpush.testing.sim --seed S ...`` replays it exactly.
"""

from __future__ import annotations

import sys
import zlib
from collections import deque
from dataclasses import dataclass
from typing import Any, TextIO

__all__ = ["Checker", "Violation"]


@dataclass(frozen=True)
class Violation:
    """One broken invariant. ``kind`` is a short stable name (tests match on it)."""

    kind: str
    detail: str
    seed: int
    step: int
    now: float

    def __str__(self) -> str:
        return (f"VIOLATION {self.kind} (seed={self.seed} step={self.step} "
                f"t={self.now:.6f}): {self.detail}")


class Checker:
    """Collects violations and keeps the trace.

    The trace is a ring of the last ``tail`` lines plus a running CRC-32 of every line, so
    two runs can be compared by their :attr:`trace_hash` without keeping whole traces.
    """

    def __init__(self, seed: int, tail: int = 120, out: TextIO | None = None,
                 print_limit: int = 5, keep: TextIO | None = None) -> None:
        self.seed = seed
        self.violations: list[Violation] = []
        self.lines: deque[str] = deque(maxlen=tail)
        self.trace_hash = 0
        #: where ``now`` and ``step`` come from (the simulation's scheduler, once set)
        self.clock: Any = None
        self.out = out if out is not None else sys.stdout
        self.print_limit = print_limit
        self.quiet = False
        #: every trace line goes here too, when set (``--trace FILE``)
        self.keep = keep

    @property
    def now(self) -> float:
        return float(self.clock.now) if self.clock is not None else 0.0

    @property
    def step(self) -> int:
        return int(self.clock.steps) if self.clock is not None else 0

    def trace(self, line: str) -> None:
        text = f"{self.now:.6f} {line}"
        self.lines.append(text)
        if self.keep is not None:
            print(text, file=self.keep)
        self.trace_hash = zlib.crc32(text.encode(), self.trace_hash)

    def fail(self, kind: str, detail: str) -> Violation:
        v = Violation(kind, detail, self.seed, self.step, self.now)
        self.violations.append(v)
        self.trace(f"!! {kind}: {detail}")
        if not self.quiet and len(self.violations) <= self.print_limit:
            print(str(v), file=self.out)
            print("  trace tail:", file=self.out)
            for line in self.lines:
                print("   ", line, file=self.out)
        return v

    def kinds(self) -> list[str]:
        return [v.kind for v in self.violations]
