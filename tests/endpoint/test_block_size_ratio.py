"""Different tokens per block on the two sides (one a multiple of the other): each fine
block lands, head by head, in its token slot of a coarse block, push and pull, both ways."""

from __future__ import annotations

import numpy as np
import pytest

import kvpush
from kvpush import RequestState, TransferMode
from tests.support.harness import CANARY, fill, make_cache


def head_slices(cache, region: int, block: int) -> list[np.ndarray]:
    lay = cache.layout
    raw = cache.buffers[region][block]
    return [raw[h * lay.head_bytes:(h + 1) * lay.head_bytes] for h in range(lay.num_kv_heads)]


@pytest.mark.parametrize(("p_tokens", "c_tokens"), [(4, 8), (8, 4), (4, 16), (4, 4)])
@pytest.mark.parametrize("mode", [TransferMode.PUSH, TransferMode.PULL])
def test_block_size_ratio(p_tokens: int, c_tokens: int, mode: TransferMode) -> None:
    src = make_cache(num_blocks=32, tokens_per_block=p_tokens, kv_packed=False)
    dst = make_cache(num_blocks=32, tokens_per_block=c_tokens, kv_packed=False)
    fill(src, 21)
    for buf in dst.buffers:
        buf[:] = CANARY
    tokens = 32  # the request's tokens: whole blocks on both sides
    src_ids = np.random.default_rng(0).choice(32, tokens // p_tokens, replace=False)
    dst_ids = np.random.default_rng(1).choice(32, tokens // c_tokens, replace=False)
    with kvpush.Producer(src.layout) as p, kvpush.Consumer(dst.layout) as c:
        name = c.connect(p.address)
        if mode is TransferMode.PUSH:
            handle = c.expect("r", dst_ids, name)
            p.prefill_done("r", src_ids)
        else:
            handle = c.pull(p.prefill_done("r", src_ids, mode), dst_ids)
        result = handle.wait(10)
        assert result.state is RequestState.READY, result
        assert result.bytes_moved == tokens // p_tokens * src.layout.bytes_per_block_id
    # Token t of head h: (source block t // p_tokens, slot t % p_tokens) -> same in dst.
    for r in range(src.layout.num_regions):
        for h in range(src.layout.num_kv_heads):
            src_tokens = np.concatenate([head_slices(src, r, b)[h] for b in src_ids])
            dst_tokens = np.concatenate([head_slices(dst, r, b)[h] for b in dst_ids])
            assert np.array_equal(src_tokens, dst_tokens), f"region {r} head {h}"
    untouched = np.setdiff1d(np.arange(32), dst_ids)
    assert all((buf[untouched] == CANARY).all() for buf in dst.buffers)


def test_ratio_that_is_not_a_multiple_is_refused() -> None:
    a = make_cache(num_blocks=8, tokens_per_block=4)
    b = make_cache(num_blocks=8, tokens_per_block=6)
    with kvpush.Producer(a.layout) as p, kvpush.Consumer(b.layout) as c, \
            pytest.raises(kvpush.LayoutMismatch, match="tokens_per_block"):
        c.connect(p.address)


def test_ratio_with_wrong_block_count_fails_cleanly() -> None:
    src = make_cache(num_blocks=16, tokens_per_block=4)
    dst = make_cache(num_blocks=16, tokens_per_block=8)
    with kvpush.Producer(src.layout) as p, kvpush.Consumer(dst.layout) as c:
        name = c.connect(p.address)
        handle = c.expect("bad", np.array([1, 2]), name)   # 2 coarse blocks need 3-4 fine
        p.prefill_done("bad", np.array([1, 2, 3, 4, 5, 6]))
        result = handle.wait(10)
        assert result.state is RequestState.FAILED
        assert isinstance(result.error, kvpush.TransferFailed)


@pytest.mark.parametrize("mode", [TransferMode.PUSH, TransferMode.PULL])
def test_split_descriptors_counted_as_posted(mode: TransferMode) -> None:
    """Coarse blocks of 2 slots x 2 heads: a slot's two heads lie apart, so NIXL merges
    nothing even where the blocks run on both sides: every index is a descriptor."""
    src = make_cache(num_blocks=16, tokens_per_block=4, kv_packed=False)
    dst = make_cache(num_blocks=16, tokens_per_block=8, kv_packed=False)
    src_ids, dst_ids = np.array([0, 1, 2, 3]), np.array([4, 5])
    with kvpush.Producer(src.layout) as p, kvpush.Consumer(dst.layout) as c:
        name = c.connect(p.address)
        if mode is TransferMode.PUSH:
            handle = c.expect("r", dst_ids, name)
            p.prefill_done("r", src_ids)
        else:
            handle = c.pull(p.prefill_done("r", src_ids, mode), dst_ids)
        assert handle.wait(10).state is RequestState.READY
        poster = p if mode is TransferMode.PUSH else c
        heads = src.layout.num_kv_heads
        assert poster.stats()["descriptors_posted"] == 4 * heads * src.layout.num_regions
