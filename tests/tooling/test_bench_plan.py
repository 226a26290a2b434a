"""pytest-benchmark entry: descriptor preparation on model-shaped caches.

    pytest tests/tooling/test_bench_plan.py [--benchmark-only] [--benchmark-compare]

Times ``kvpush.plan.plan_transfer`` (compiled) and the numpy reference on scattered block
ids for the presets of :mod:`benchmarks.desc_prep`. Figures, not pass/fail thresholds: the
targets are checked by ``python -m benchmarks``, never by timed unit tests.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from benchmarks._common import block_ids
from benchmarks.desc_prep import CACHE_BLOCKS, PRESETS, _reference

PROMPTS = (1024, 8192, 32768)


def _args(preset: str, tokens: int) -> tuple[Any, ...]:
    p = PRESETS[preset]
    n = -(-tokens // p.tokens_per_block)
    local, remote = block_ids("scattered", n, CACHE_BLOCKS, CACHE_BLOCKS, seed=tokens)
    return local, remote, CACHE_BLOCKS, CACHE_BLOCKS, p.regions, True


@pytest.mark.parametrize("tokens", PROMPTS)
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_plan_transfer_compiled(benchmark: Any, preset: str, tokens: int) -> None:
    from kvpush.plan import plan_transfer

    args = _args(preset, tokens)
    plan = benchmark(plan_transfer, *args)
    assert plan.num_blocks == len(args[0])
    assert len(plan.local_indices) == len(args[0]) * PRESETS[preset].regions


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_plan_transfer_numpy_reference(benchmark: Any, preset: str) -> None:
    ref, _ = _reference()
    args = _args(preset, 8192)
    plan = benchmark(ref, *args)
    assert len(np.asarray(plan.local_indices)) == len(args[0]) * PRESETS[preset].regions
