"""Requests of long runs go to NIXL as explicit merged descriptors (``initialize_xfer``, one
per region and run) instead of prepared indices (``kvpush.agent.explicit_is_cheaper``):
every byte lands where prepared indices put it, in push, pull and layer-wise push; links that
do not merge whole blocks (a head shard) keep prepared indices.

Two in-process endpoints over real NIXL agents. The thresholds are lowered so that these
small caches reach them (each test says which); the rule itself is checked at its measured
points."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

import kvpush
from kvpush import TransferMode, agent
from tests.support.harness import (
    CANARY,
    check_blocks,
    check_canaries,
    drain_released,
    fill,
    make_cache,
)

SEED = 11
CACHE = dict(num_blocks=256, num_layers=3, kv_packed=False)  # 6 regions


@pytest.fixture()
def explicit_always(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any request in runs of 2 blocks on average or longer goes explicit."""
    monkeypatch.setattr(agent, "EXPLICIT_MIN_INDICES", 1)
    monkeypatch.setattr(agent, "EXPLICIT_MIN_RUN", 2)


def _pair(src_kw: dict[str, object] | None = None, dst_kw: dict[str, object] | None = None
          ) -> Iterator[tuple[kvpush.Producer, kvpush.Consumer, object, object]]:
    src, dst = make_cache(**{**CACHE, **(src_kw or {})}), make_cache(**{**CACHE, **(dst_kw or {})})
    fill(src, SEED)
    for buf in dst.buffers:
        buf[:] = CANARY
    with kvpush.Producer(src.layout) as p, kvpush.Consumer(dst.layout) as c:
        c.connect(p.address, timeout=20)
        yield p, c, src, dst


@pytest.fixture()
def pair() -> Iterator[tuple[kvpush.Producer, kvpush.Consumer, object, object]]:
    yield from _pair()


def _runs(rng: np.random.Generator, n_runs: int, length: int, num_blocks: int) -> np.ndarray:
    """``n_runs`` disjoint runs of ``length`` adjacent blocks, in random order."""
    starts = rng.choice(num_blocks // length, n_runs, replace=False) * length
    return np.concatenate([np.arange(s, s + length) for s in starts])


def _push(p: kvpush.Producer, c: kvpush.Consumer, rid: str, src: np.ndarray, dst: np.ndarray,
          layerwise: bool = False) -> None:
    handle = c.expect(rid, dst, p.name, layerwise=layerwise)
    time.sleep(0.05)  # the registration first: the WRITE leaves from prefill_done
    if layerwise:
        for layer in range(CACHE["num_layers"]):  # type: ignore[operator]
            p.layer_done(rid, src, layer)
    p.prefill_done(rid, src)
    result = handle.wait(20)
    assert result.ok, result
    assert [r.reason.value for r in drain_released(p, 1)] == ["transferred"]


def test_push_of_runs_goes_explicit_and_lands_exactly(pair: tuple, explicit_always: None
                                                      ) -> None:
    p, c, _src_cache, dst_cache = pair
    rng = np.random.default_rng(1)
    src, dst = _runs(rng, 5, 8, 256), _runs(rng, 5, 8, 256)
    _push(p, c, "runs", src, dst)
    assert p.stats()["transfers_explicit"] == 1
    check_blocks(dst_cache, dst, src, SEED)
    check_canaries(dst_cache, dst)


def test_scattered_blocks_keep_prepared_indices(pair: tuple, explicit_always: None) -> None:
    p, c, _src_cache, dst_cache = pair
    rng = np.random.default_rng(2)
    src = rng.choice(256, 40, replace=False)
    dst = rng.choice(256, 40, replace=False)
    _push(p, c, "scattered", src, dst)
    assert p.stats()["transfers_explicit"] == 0   # runs of ~1 block: prepared is cheaper
    check_blocks(dst_cache, dst, src, SEED)
    check_canaries(dst_cache, dst)


def test_pull_of_one_run_goes_explicit_and_lands_exactly(pair: tuple, explicit_always: None
                                                         ) -> None:
    p, c, _src_cache, dst_cache = pair
    src, dst = np.arange(17, 117), np.arange(150, 250)
    ticket = p.prefill_done("pull", src, TransferMode.PULL)
    assert ticket is not None
    result = c.pull(ticket, dst).wait(20)
    assert result.ok, result
    assert c.stats()["transfers_explicit"] == 1
    check_blocks(dst_cache, dst, src, SEED)
    check_canaries(dst_cache, dst)


def test_layerwise_push_goes_explicit_per_layer(pair: tuple, explicit_always: None) -> None:
    """One WRITE per layer: each covers only its layer's regions."""
    p, c, _src_cache, dst_cache = pair
    src, dst = np.arange(0, 64), np.arange(128, 192)
    _push(p, c, "layers", src, dst, layerwise=True)
    assert p.stats()["transfers_explicit"] == CACHE["num_layers"]
    check_blocks(dst_cache, dst, src, SEED)
    check_canaries(dst_cache, dst)


def test_a_head_shard_link_keeps_prepared_indices(explicit_always: None) -> None:
    """The decode side holds one of two KV heads: each block's share is a slice of it, so
    adjacent blocks are not adjacent bytes and nothing merges."""
    src_kw = dict(num_kv_heads=2, total_kv_heads=2)
    dst_kw = dict(num_kv_heads=1, head_start=1, total_kv_heads=2)
    for p, c, _src_cache, _dst_cache in _pair(src_kw, dst_kw):
        _push(p, c, "shard", np.arange(0, 32), np.arange(64, 96))
        assert p.stats()["transfers_explicit"] == 0
        assert p.stats()["transfers_posted"] == 1


def test_below_the_measured_threshold_requests_keep_prepared_indices(pair: tuple) -> None:
    p, c, _src_cache, dst_cache = pair
    src, dst = np.arange(0, 100), np.arange(100, 200)   # one run, 600 indices
    _push(p, c, "small", src, dst)
    assert p.stats()["transfers_explicit"] == 0
    check_blocks(dst_cache, dst, src, SEED)


@pytest.mark.parametrize(("indices", "merged", "explicit"), [
    (65536, 128, True),        # one run of 512 blocks x 128 regions
    (1048576, 128, True),      # one run of 8,192 blocks: 14 % faster end to end
    (1048576, 2048, True),     # runs of 512 blocks: 6 % faster
    (524288, 65536, False),    # runs of 8 blocks: 7 % slower
    (65536, 65536, False),     # scattered: preparation 1.5x dearer explicit
    (4096, 16, False),         # small: explicit's fixed cost dominates (7 vs 14 us)
])
def test_the_rule_at_its_measured_points(indices: int, merged: int, explicit: bool) -> None:
    assert agent.explicit_is_cheaper(indices, merged) is explicit


@pytest.mark.parametrize("data_plane", ["inprocess", "child"])
def test_a_long_run_goes_explicit_at_the_default_thresholds(data_plane: str) -> None:
    """6 regions x one run of 3,000 blocks: 18,000 indices, 6 merged descriptors -- past
    the measured thresholds as shipped, in the engine's process and in a contained data
    plane alike (whose agent decides in its own process)."""
    kw = dict(num_blocks=4096, num_layers=3, kv_packed=False, tokens_per_block=1,
              num_kv_heads=1, head_size=8, shared=data_plane == "child")
    src_cache, dst_cache = make_cache(**kw), make_cache(**kw)
    fill(src_cache, SEED)
    for buf in dst_cache.buffers:
        buf[:] = CANARY
    transport = kvpush.TransportConfig(data_plane=data_plane)
    with kvpush.Producer(src_cache.layout, kvpush.ProducerConfig(transport=transport)) as p, \
            kvpush.Consumer(dst_cache.layout, kvpush.ConsumerConfig(transport=transport)) as c:
        c.connect(p.address, timeout=30)
        src, dst = np.arange(50, 3050), np.arange(1000, 4000)
        _push(p, c, "long", src, dst)
        assert p.stats()["transfers_explicit"] == 1
        ticket = p.prefill_done("long-pull", src, TransferMode.PULL)
        assert ticket is not None
        for buf in dst_cache.buffers:
            buf[:] = CANARY
        assert c.pull(ticket, dst).wait(30).ok
        assert c.stats()["transfers_explicit"] == 1
        check_blocks(dst_cache, dst, src, SEED)
        check_canaries(dst_cache, dst)
