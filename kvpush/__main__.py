"""The ``kvpush`` command: ``kvpush doctor`` (also ``python -m kvpush doctor``)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["main"]

_USAGE = """usage: kvpush <command> [options]

commands:
  doctor    check NIXL, its plugins and the transport kvpush's transfers take here
  version   print kvpush's version

'kvpush <command> --help' describes a command's options."""


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "doctor":
        from .doctor import main as doctor

        return doctor(rest)
    if command in ("version", "--version"):
        from . import __version__

        print(__version__)
        return 0
    print(f"kvpush: unknown command {command!r}\n\n{_USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
