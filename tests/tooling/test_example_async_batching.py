"""The asyncio continuous-batching example: prefill and decode servers in two
processes, KV by push through the async and batch API, give exactly the tokens of the same
model run colocated; requests arrive while others decode, so batches really change."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("torch")

from examples.async_batching import Pair, colocated, prompts_for, serve_all


def test_disaggregated_async_servers_give_the_colocated_tokens() -> None:
    """Stock asyncio here (tests/endpoint/test_aio.py covers uvloop; ``--uvloop`` runs this
    on it)."""
    prompts = prompts_for(seed=3, count=24)
    max_new = 6
    with Pair(use_uvloop=False) as pair:
        got, stats = asyncio.run(asyncio.wait_for(
            serve_all(pair.port, prompts, max_new, stagger_s=0.005), 120))
        assert all(p.is_alive() for p in pair.procs)
    assert got == colocated(prompts, max_new)
    assert stats["max_batch"] > 1    # sequences joined and decoded side by side
