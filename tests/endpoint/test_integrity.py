"""Verify mode: per-block checksums (computed in C++) travel with the completion and are
checked on the consumer; a mismatch fails the request, never silently."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import kvpush
from kvpush import RequestState, TransferMode
from tests.support.harness import check_blocks, fill, make_cache


def pair(verify_producer: bool = True) -> tuple:
    src, dst = make_cache(num_blocks=32), make_cache(num_blocks=32)
    fill(src, 9)
    p = kvpush.Producer(src.layout, kvpush.ProducerConfig(verify=verify_producer))
    c = kvpush.Consumer(dst.layout, kvpush.ConsumerConfig(verify=True))
    return p, c, src, dst


def test_verified_push_and_pull_succeed() -> None:
    p, c, _src, dst = pair()
    with p, c:
        name = c.connect(p.address)
        h = c.expect("v1", np.array([3, 1, 2]), name)
        p.prefill_done("v1", np.array([10, 11, 20]))
        assert h.wait(10).state is RequestState.READY
        ticket = p.prefill_done("v2", np.array([5, 6]), TransferMode.PULL)
        assert ticket is not None and len(ticket.checksums) == 16
        assert c.pull(ticket, np.array([7, 8])).wait(10).state is RequestState.READY
        check_blocks(dst, np.array([3, 1, 2, 7, 8]), np.array([10, 11, 20, 5, 6]), 9)
        assert c.stats()["checksum_mismatches"] == 0


def test_corrupted_source_is_caught() -> None:
    """The engine scribbles on blocks it handed over (a bug): the READ moves the bad bytes,
    and the checksum taken at prefill_done catches them."""
    p, c, src, _dst = pair()
    with p, c:
        c.connect(p.address)
        ticket = p.prefill_done("bad", np.array([4, 5, 6]), TransferMode.PULL)
        src.buffers[1][5][100] ^= 0xFF
        result = c.pull(ticket, np.array([1, 2, 3])).wait(10)
        assert result.state is RequestState.FAILED
        assert isinstance(result.error, kvpush.TransferFailed)
        assert "1 block(s) differ" in str(result.error)
        assert "block 2" in str(result.error)
        assert c.stats()["checksum_mismatches"] == 1


def test_verify_needs_checksums_in_the_ticket() -> None:
    p, c, _src, _dst = pair(verify_producer=False)
    with p, c:
        c.connect(p.address)
        ticket = p.prefill_done("nosums", np.array([4]), TransferMode.PULL)
        result = c.pull(ticket, np.array([1])).wait(10)
        assert result.state is RequestState.FAILED
        assert "carries no per-block checksums" in str(result.error)
        assert c.stats()["transfers_posted"] == 0
        p.abort("nosums")


def _device_layout() -> tuple[kvpush.KVLayout, object]:
    """A layout that declares its regions VRAM. No GPU here: the regions lie over host
    buffers, so a checksum that read them on the host would *succeed* (and on a real GPU
    dereference device pointers): the refusal is what the test sees."""
    host = make_cache(num_blocks=8)
    lay = host.layout
    regions = tuple(kvpush.Region(r.addr, r.length, 0, kvpush.MemoryKind.VRAM)
                    for r in lay.regions)
    return dataclasses.replace(lay, regions=regions), host


def test_verify_on_device_memory_is_refused_at_construction() -> None:
    lay, _host = _device_layout()
    with pytest.raises(ValueError, match=r"ProducerConfig.verify needs host \(DRAM\) memory"):
        kvpush.Producer(lay, kvpush.ProducerConfig(verify=True))
    with pytest.raises(ValueError, match=r"ConsumerConfig.verify needs host \(DRAM\) memory"):
        kvpush.Consumer(lay, kvpush.ConsumerConfig(verify=True))


def test_block_checksums_never_read_device_memory() -> None:
    from kvpush.plan import block_checksums

    lay, _host = _device_layout()
    with pytest.raises(ValueError, match="region 0 of this layout is VRAM"):
        block_checksums(lay, np.array([0, 1]))
