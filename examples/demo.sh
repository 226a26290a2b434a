#!/usr/bin/env bash
# The README's first command: set up .venv (if needed) and run the push-vs-pull demo.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash .ci/bootstrap
exec .venv/bin/python examples/demo.py "$@"
