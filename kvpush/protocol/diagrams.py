"""The protocol machines' state diagrams, generated from their tables.

Every :class:`~kvpush.protocol.table.Table` defined at the top level of the protocol modules
(:data:`MODULES`) is rendered as a Mermaid ``stateDiagram-v2``, in the order the modules and
their tables are defined. ``docs/ARCHITECTURE.md`` holds them between two marker comments::

    python -m kvpush.protocol.diagrams                 # print the diagrams
    python -m kvpush.protocol.diagrams --write docs/ARCHITECTURE.md
    python -m kvpush.protocol.diagrams --check docs/ARCHITECTURE.md   # exit 1 if stale

``tests/tooling/test_state_diagrams.py`` fails when the document and the tables differ.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .table import Table, mermaid

__all__ = ["BEGIN", "END", "MODULES", "machines", "render", "replace"]

#: The modules whose tables are drawn, in this order.
MODULES = ("kvpush.protocol.producer", "kvpush.protocol.consumer", "kvpush.protocol.session")

BEGIN = ("<!-- state diagrams: generated from the tables by "
         "`python -m kvpush.protocol.diagrams --write docs/ARCHITECTURE.md`; do not edit -->")
END = "<!-- end of the generated state diagrams -->"


def machines() -> list[tuple[str, str, Table[Any, Any]]]:
    """(module, attribute, table) for every table of :data:`MODULES` (a module that does
    not exist is skipped)."""
    found = []
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        for attr, value in vars(module).items():
            if isinstance(value, Table):
                found.append((name, attr, value))
    return found


def render() -> str:
    """Every diagram, each under a heading naming its table, as Markdown."""
    parts = []
    for module, attr, table in machines():
        parts.append(f"#### {table.name} (`{module}.{attr}`)\n\n```mermaid\n"
                     f"{mermaid(table)}```\n")
    return "\n".join(parts)


def replace(text: str, diagrams: str | None = None) -> str:
    """``text`` with what lies between :data:`BEGIN` and :data:`END` replaced by the
    diagrams (``render()`` unless given)."""
    start = text.find(BEGIN)
    stop = text.find(END)
    if start < 0 or stop < start:
        raise ValueError(f"the document has no {BEGIN!r} ... {END!r} markers")
    body = render() if diagrams is None else diagrams
    return text[:start + len(BEGIN)] + "\n\n" + body + "\n" + text[stop:]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpush.protocol.diagrams",
                                     description=__doc__.splitlines()[0] if __doc__ else "")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", metavar="DOC", type=Path,
                       help="replace the diagrams between DOC's markers")
    group.add_argument("--check", metavar="DOC", type=Path,
                       help="exit 1 when DOC's diagrams differ from the tables")
    args = parser.parse_args(argv)
    if args.write is None and args.check is None:
        sys.stdout.write(render())
        return 0
    path: Path = args.write or args.check
    text = path.read_text()
    new = replace(text)
    if args.check is not None:
        if new != text:
            print(f"{path}: the state diagrams differ from the tables; run "
                  f"python -m kvpush.protocol.diagrams --write {path}", file=sys.stderr)
            return 1
        return 0
    if new != text:
        path.write_text(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
