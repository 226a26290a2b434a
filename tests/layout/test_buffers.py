"""A layout made from arrays holds them: an endpoint registers the layout's memory, and a
peer's WRITE lands there, so memory freed while the layout lives would take the peer's bytes
into whatever reused it (a test that built an agent on ``make_cache(...).layout`` crashed
its process in a later ``np.zeros``)."""

from __future__ import annotations

import dataclasses
import gc
import pickle
import weakref

import numpy as np
import pytest

from kvpush.layout import KVLayout

SHAPE = dict(num_layers=2, num_blocks=8, tokens_per_block=4, num_kv_heads=2, head_size=16,
             dtype="float16")
BLOCK = 4 * 2 * 16 * 2 * 2


def _buffers() -> list[np.ndarray]:
    return [np.zeros((8, BLOCK), np.uint8) for _ in range(2)]


def test_a_layout_from_buffers_keeps_its_memory_alive() -> None:
    buffers = _buffers()
    alive = [weakref.ref(b) for b in buffers]
    layout = KVLayout.from_buffers(buffers, **SHAPE)
    del buffers
    gc.collect()
    assert all(ref() is not None for ref in alive)
    assert [b.ctypes.data for b in layout.buffers] == [r.addr for r in layout.regions]
    del layout
    gc.collect()
    assert all(ref() is None for ref in alive)


def test_a_layouts_buffers_are_not_compared_pickled_or_replaced() -> None:
    layout = KVLayout.from_buffers(_buffers(), **SHAPE)
    bare = KVLayout(regions=layout.regions, **SHAPE)
    assert bare == layout and hash(bare) == hash(layout) and bare.buffers == ()
    assert "buffers" not in repr(layout)
    sent = pickle.dumps(layout)
    assert len(sent) < BLOCK * 8          # the cache's bytes do not travel
    back = pickle.loads(sent)
    assert back == layout and back.buffers == ()
    assert layout.to_wire() == bare.to_wire()
    # field-wise copies take the fields only (no copy of the cache); a replaced layout's
    # regions may be other memory: it holds nothing
    assert "buffers" not in dataclasses.asdict(layout)
    assert KVLayout(**layout.__dict__) == layout
    assert dataclasses.replace(layout, num_blocks=4).buffers == ()


def test_a_layout_over_other_buffers_holds_them() -> None:
    layout = KVLayout.from_buffers(_buffers(), **SHAPE)
    others = _buffers()
    moved = layout.with_buffers(others)
    assert moved.buffers == tuple(others) and moved.block_bytes == layout.block_bytes
    assert [r.addr for r in moved.regions] == [b.ctypes.data for b in others]
    with pytest.raises(ValueError, match="region lengths"):
        layout.with_buffers([np.zeros(16, np.uint8)] * 2)
