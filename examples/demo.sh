#!/usr/bin/env bash
# The README's first command: set up .venv (if needed), then run the two demos:
#   1. push vs pull: a prefill and a decode process move a few hundred requests of random KV;
#   2. multi-turn: a tiny transformer's conversation, KV moved both ways, only missing blocks,
#      tokens checked against a colocated run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash .ci/bootstrap
echo "== push vs pull (examples/demo.py)"
.venv/bin/python examples/demo.py "$@"
echo
echo "== multi-turn with a real model (examples/multiturn/demo.py)"
.venv/bin/python -m examples.multiturn.demo
