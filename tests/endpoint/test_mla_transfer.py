"""MLA caches (``cache_kind="mla"``) between a real Producer and Consumer whose blocks hold
different token counts: every latent vector lands at its token's place. The MLA layout and
its refusals are ``tests/layout/test_mla.py``."""

from __future__ import annotations

import numpy as np
import pytest

import kvpush
from kvpush import RequestState, TransferMode
from tests.support.harness import MLA_LATENT as LATENT
from tests.support.harness import make_mla_cache as mla


@pytest.mark.parametrize("mode", [TransferMode.PUSH, TransferMode.PULL])
def test_mla_push_and_pull_across_block_sizes_exact_bytes(mode: TransferMode) -> None:
    """Prefill blocks of 16 tokens, decode blocks of 32: every latent vector lands at its
    token's place (token slots), nothing else is written."""
    src, src_lay = mla(tokens=16, num_blocks=16, seed=3)
    dst, dst_lay = mla(tokens=32, num_blocks=8)
    src_ids, dst_ids = np.array([5, 2, 9, 14]), np.array([6, 1])
    with kvpush.Producer(src_lay) as p, kvpush.Consumer(dst_lay) as c:
        name = c.connect(p.address, timeout=10)
        if mode is TransferMode.PUSH:
            handle = c.expect("m", dst_ids, name)
            p.prefill_done("m", src_ids)
        else:
            handle = c.pull(p.prefill_done("m", src_ids, mode), dst_ids)
        result = handle.wait(30)
        assert result.state is RequestState.READY, result.error
        assert result.bytes_moved == len(src_ids) * src_lay.bytes_per_block_id
    for s, d in zip(src, dst, strict=True):
        tokens = s[src_ids].reshape(-1, LATENT)                 # the request's latents
        assert np.array_equal(d[dst_ids].reshape(-1, LATENT), tokens)
        others = np.setdiff1d(np.arange(8), dst_ids)
        assert not d[others].any()
