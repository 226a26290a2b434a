"""The example of an engine's integration tests (``examples/engine_tests.py``: toy engines
against kvpush.testing's simulated peers) passes: collected here, so they run with the
suite and under its checks (nothing left running after each)."""

from __future__ import annotations

from examples.engine_tests import (  # noqa: F401  (collected by pytest)
    test_decode_engine_frees_every_block_when_its_prefill_dies,
    test_decode_engine_survives_a_prefill_that_stalls_and_restarts,
    test_prefill_engine_gets_every_block_back_whatever_the_decode_does,
)
