"""Host KV memory is populated at registration: a cache allocated lazily (``np.zeros``)
is resident once its endpoint is built, its bytes unchanged, so no transfer takes its
first page faults (on one host a WRITE's faults in the target's pages stall the
producer's loop). Residency is read with mincore(2)."""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np
import pytest

import kvpush
from kvpush import agent
from kvpush.agent import populate
from kvpush.layout import Region

needs_populate = pytest.mark.skipif(
    not agent._can_populate(), reason="this kernel has no MADV_POPULATE_WRITE (Linux 5.14+)")

PAGE = os.sysconf("SC_PAGE_SIZE")
LAYOUT = dict(num_layers=2, tokens_per_block=16, num_kv_heads=2, head_size=64,
              dtype="float16", kv_packed=False)
BLOCK_BYTES = 16 * 2 * 64 * 2
NUM_BLOCKS = 512


def resident(buf: np.ndarray) -> float:
    """The share of ``buf``'s pages resident now (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    start = buf.ctypes.data - buf.ctypes.data % PAGE
    length = buf.ctypes.data + buf.nbytes - start
    pages = -(-length // PAGE)
    vec = ctypes.create_string_buffer(pages)
    assert libc.mincore(start, length, vec) == 0, os.strerror(ctypes.get_errno())
    return sum(b & 1 for b in vec.raw) / pages


@pytest.fixture()
def fresh_cache() -> tuple[list[np.ndarray], kvpush.KVLayout]:
    """A cache in fresh anonymous mappings (as a large ``np.zeros`` gets; numpy's own
    allocation may reuse memory a test before it touched): no page resident."""
    maps = [mmap.mmap(-1, NUM_BLOCKS * BLOCK_BYTES) for _ in range(4)]
    buffers = [np.frombuffer(mm, dtype=np.uint8).reshape(NUM_BLOCKS, BLOCK_BYTES)
               for mm in maps]
    assert all(resident(b) == 0.0 for b in buffers)
    buffers[1][7, :5] = [1, 2, 3, 4, 5]  # one page written before registration
    # Each mapping goes when the last array over it does.
    return buffers, kvpush.KVLayout.from_buffers(buffers, num_blocks=NUM_BLOCKS, **LAYOUT)


@needs_populate
@pytest.mark.parametrize("role", ["producer", "consumer"])
def test_a_lazily_allocated_cache_is_resident_once_registered(
        role: str, fresh_cache: tuple[list[np.ndarray], kvpush.KVLayout]) -> None:
    buffers, layout = fresh_cache
    endpoint = kvpush.Producer(layout) if role == "producer" else kvpush.Consumer(layout)
    try:
        assert all(resident(b) == 1.0 for b in buffers)
        assert list(buffers[1][7, :6]) == [1, 2, 3, 4, 5, 0]
        assert all(not b.any() for i, b in enumerate(buffers) if i != 1)
    finally:
        endpoint.close()


@needs_populate
def test_the_data_plane_child_populates_the_shared_cache() -> None:
    """With a data-plane child the child registers the memory, and populates it: the
    engine's mapping of the same shared pages sees them resident."""
    buffers = [kvpush.shared_array((NUM_BLOCKS, BLOCK_BYTES)) for _ in range(4)]
    assert all(resident(b) == 0.0 for b in buffers)
    layout = kvpush.KVLayout.from_buffers(buffers, num_blocks=NUM_BLOCKS, **LAYOUT)
    transport = kvpush.TransportConfig(data_plane="child")
    with kvpush.Consumer(layout, kvpush.ConsumerConfig(transport=transport)):
        assert all(resident(b) == 1.0 for b in buffers)


def test_population_can_be_turned_off(
        fresh_cache: tuple[list[np.ndarray], kvpush.KVLayout]) -> None:
    buffers, layout = fresh_cache
    transport = kvpush.TransportConfig(populate_host_memory=False)
    with kvpush.Consumer(layout, kvpush.ConsumerConfig(transport=transport)):
        # (buffer 1 had a page written: with transparent huge pages always on, 2 MiB)
        assert all(resident(b) < 0.1 for i, b in enumerate(buffers) if i != 1)
    with pytest.raises(TypeError, match="populate_host_memory"):
        kvpush.TransportConfig(populate_host_memory="yes")  # type: ignore[arg-type]


@needs_populate
def test_memory_that_cannot_be_populated_is_left_as_it_is(
        caplog: pytest.LogCaptureFixture) -> None:
    """A region the kernel cannot populate (here: read-only) is logged; registration and
    the other regions go on."""
    ro = mmap.mmap(-1, 4 * PAGE, prot=mmap.PROT_READ)
    view = np.frombuffer(ro, dtype=np.uint8)
    rw_map = mmap.mmap(-1, 64 * PAGE)
    rw = np.frombuffer(rw_map, dtype=np.uint8)
    done = populate([Region(view.ctypes.data, view.nbytes), Region(rw.ctypes.data, rw.nbytes)])
    assert done == rw.nbytes and resident(rw) == 1.0
    assert "cannot populate the region" in caplog.text
    del view, rw, ro, rw_map  # unmapped with the last reference


def test_a_kernel_without_the_advice_leaves_memory_as_it_is(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        fresh_cache: tuple[list[np.ndarray], kvpush.KVLayout]) -> None:
    """Before Linux 5.14 the advice is unknown: said once at INFO, nothing populated, and
    the endpoint is built as before."""
    buffers, layout = fresh_cache
    monkeypatch.setattr(agent, "_can_populate", lambda: False)
    caplog.set_level("INFO", logger="kvpush.agent")
    with kvpush.Consumer(layout):
        assert all(resident(b) < 0.1 for i, b in enumerate(buffers) if i != 1)
    assert "cannot populate pages ahead" in caplog.text
