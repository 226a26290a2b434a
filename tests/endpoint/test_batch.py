"""Batch calls: ``prefill_done_many``, ``expect_many``, ``pull_many`` validate
each item on its own, hand the valid ones to the loop thread in one go, and return per item
a handle/ticket or the exception a single call would have raised."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import kvpush
from kvpush import ReleaseReason, RequestState, TransferMode
from tests.support.harness import (
    CANARY,
    check_blocks,
    check_canaries,
    drain_released,
    fill,
    make_cache,
)


def _count_handoffs(endpoint: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    original = endpoint._driver.call_soon

    def counting(fn: Any, opens: int = 0) -> None:
        calls[0] += 1
        original(fn, opens)

    monkeypatch.setattr(endpoint._driver, "call_soon", counting)
    return calls


def test_batches_move_the_good_items_and_refuse_the_bad_one_by_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    src, dst = make_cache(num_blocks=32), make_cache(num_blocks=32)
    fill(src, 4)
    for buf in dst.buffers:
        buf[:] = CANARY
    with kvpush.Producer(src.layout) as p, kvpush.Consumer(dst.layout) as c:
        name = c.connect(p.address)
        c_calls, p_calls = _count_handoffs(c, monkeypatch), _count_handoffs(p, monkeypatch)
        handles = c.expect_many([
            ("a", np.array([0, 1]), name),
            ("bad-range", np.array([99]), name),
            ("b", np.array([2]), name),
            ("bad-producers", np.array([3]), []),
            ("", np.array([4]), name),
            ("bad-shape",),
        ], timeout=20)
        assert c_calls == [1]
        assert isinstance(handles[0], kvpush.TransferHandle)
        assert isinstance(handles[1], kvpush.InvalidBlockIds)
        assert isinstance(handles[2], kvpush.TransferHandle)
        assert isinstance(handles[3], ValueError) and "at least one producer" in str(handles[3])
        assert isinstance(handles[4], kvpush.InvalidRequest)    # empty request id
        assert not isinstance(handles[4], kvpush.InvalidBlockIds)
        assert isinstance(handles[5], ValueError)
        out = p.prefill_done_many([
            ("a", np.array([10, 11])),
            ("b", np.array([12]), TransferMode.PUSH),
            ("p1", np.array([13, 14]), TransferMode.PULL),
            ("dup", np.array([15, 15]), TransferMode.PULL),
            ("p2", np.array([16]), "pull"),
            ("mode", np.array([17]), "sideways"),
            "not-a-tuple",
        ])
        assert p_calls == [1]
        assert out[0] is None and out[1] is None
        assert isinstance(out[2], kvpush.PullTicket) and isinstance(out[4], kvpush.PullTicket)
        assert isinstance(out[3], kvpush.InvalidBlockIds) and "duplicate" in str(out[3])
        assert isinstance(out[5], ValueError) and isinstance(out[6], ValueError)
        pulls = c.pull_many([
            (out[2].to_bytes(), np.array([20, 21])),        # type: ignore[union-attr]
            (b"not a ticket", np.array([22])),
            (out[4], np.array([23, 24])),                   # 1 source block, 2 destinations
            (out[4], np.array([25])),
            ([], np.array([26])),
        ], timeout=20)
        assert c_calls == [2]
        assert isinstance(pulls[0], kvpush.TransferHandle)
        assert isinstance(pulls[1], kvpush.ProtocolError)
        assert isinstance(pulls[2], kvpush.InvalidBlockIds)
        assert isinstance(pulls[3], kvpush.TransferHandle)
        assert isinstance(pulls[4], ValueError)
        good = [h for h in handles + pulls if isinstance(h, kvpush.TransferHandle)]
        results = [h.wait(20) for h in good]
        assert [r.state for r in results] == [RequestState.READY] * 4, results
        assert [r.request_id for r in results] == ["a", "b", "p1", "p2"]
        touched = np.array([0, 1, 2, 20, 21, 25])
        check_blocks(dst, touched, np.array([10, 11, 12, 13, 14, 16]), 4)
        check_canaries(dst, touched)      # nothing of a refused item landed anywhere
        released = drain_released(p, 4)
        assert sorted((r.request_id, r.reason) for r in released) == \
            [(rid, ReleaseReason.TRANSFERRED) for rid in ("a", "b", "p1", "p2")]
        assert p.pending == 0 and c.pending == 0
        assert c.stats()["transfers_posted"] == 2     # the two pulls' READs, nothing else


def test_empty_batches_hand_nothing_off(monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_cache(num_blocks=8)
    with kvpush.Producer(src.layout) as p, kvpush.Consumer(src.layout) as c:
        calls = _count_handoffs(c, monkeypatch)
        assert c.expect_many([]) == [] and c.pull_many([]) == []
        assert p.prefill_done_many([]) == []
        assert calls == [0]
