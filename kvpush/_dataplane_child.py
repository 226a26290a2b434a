"""Entry point of a data-plane child process (see :mod:`kvpush.dataplane`)."""

import sys

from kvpush.dataplane import _child_main

if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
