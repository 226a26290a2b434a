"""Routes of tensor parallelism (``kvpush.layout.tp_routes``): a pure function of the two TP
sizes and the KV head count that every rank of both sides computes alike. Over many shapes,
GQA/MQA replication on either side included: every consumer rank gets each of its heads
exactly once, from a producer rank that holds it; each producer rank's sharer count is the
number of consumer ranks that take from it; replicas that nobody needs send nothing."""

from __future__ import annotations

import itertools

import pytest

from kvpush.layout import tp_routes, tp_shard

SIZES = (1, 2, 3, 4, 6, 8, 16)
HEADS = (1, 2, 3, 4, 6, 8, 12)


def valid(tp: int, heads: int) -> bool:
    return heads % tp == 0 or tp % heads == 0


SHAPES = [(p, c, k) for p, c, k in itertools.product(SIZES, SIZES, HEADS)
          if valid(p, k) and valid(c, k)]


def heads(tp: int, rank: int, total: int) -> set[int]:
    start, n = tp_shard(tp, rank, total)
    return set(range(start, start + n))


def test_shards_follow_vllm() -> None:
    # vLLM: num_kv_heads per rank = max(1, total // tp); with tp > total, rank r holds head
    # r // (tp // total) (QKVParallelLinear's replicas).
    assert [tp_shard(4, r, 8) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [tp_shard(4, r, 2) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [tp_shard(2, r, 1) for r in range(2)] == [(0, 1), (0, 1)]
    with pytest.raises(ValueError, match="cannot be split"):
        tp_shard(3, 0, 2)
    with pytest.raises(ValueError, match="tp_rank"):
        tp_shard(2, 2, 4)


@pytest.mark.parametrize(("p_tp", "c_tp", "total"), SHAPES)
def test_every_head_once_to_every_rank_that_holds_it(p_tp: int, c_tp: int, total: int) -> None:
    routes = tp_routes(p_tp, c_tp, total)
    taken = [0] * p_tp
    for c in range(c_tp):
        ranks, sharers = routes.of_consumer(c)
        want = heads(c_tp, c, total)
        got: list[int] = []
        for p in ranks:
            common = heads(p_tp, p, total) & want
            assert common, f"consumer {c} takes nothing from producer {p}"
            got += sorted(common)
            taken[p] += 1
        assert sorted(got) == sorted(want), f"consumer {c}: heads {got}, holds {want}"
        assert list(ranks) == sorted(ranks)
        assert sharers == tuple(routes.sharers[p] for p in ranks)
    assert list(routes.sharers) == taken
    # A producer rank sends iff it is the first of its head's replicas (known from its own
    # side's shape alone), and every such rank is taken by someone.
    rep = max(1, p_tp // total)
    for p in range(p_tp):
        assert routes.sends(p) == (p % rep == 0)
    # Bytes: each consumer receives exactly its own heads (replicated heads once per rank).
    assert sum(len(heads(p_tp, p, total) & heads(c_tp, c, total))
               for c in range(c_tp) for p in routes.producers[c]) == sum(
        len(heads(c_tp, c, total)) for c in range(c_tp))


def test_named_shapes() -> None:
    # Same size: rank r <-> rank r, one sharer each.
    r = tp_routes(2, 2, 2)
    assert (r.producers, r.sharers) == (((0,), (1,)), (1, 1))
    # P TP2 -> D TP1: the decode rank reads both halves.
    r = tp_routes(2, 1, 2)
    assert (r.producers, r.sharers) == (((0, 1),), (1, 1))
    # P TP1 -> D TP2: both decode ranks share the one source.
    r = tp_routes(1, 2, 2)
    assert (r.producers, r.sharers) == (((0,), (0,)), (2,))
    # MQA (1 KV head), P TP2 -> D TP1: rank 1 replicates rank 0's head and sends nothing.
    r = tp_routes(2, 1, 1)
    assert (r.producers, r.sharers) == (((0,),), (1, 0))
    # GQA, P TP4 (2 heads, replicated twice) -> D TP4 (replicated too): ranks 0 and 2 send,
    # each to the two decode ranks holding its head.
    r = tp_routes(4, 4, 2)
    assert (r.producers, r.sharers) == (((0,), (0,), (2,), (2,)), (2, 0, 2, 0))
    # P TP4 (3 heads each) -> D TP3 (4 heads each) of 12: decode rank 0 takes from two
    # producer ranks with different sharer counts.
    r = tp_routes(4, 3, 12)
    assert r.of_consumer(0) == ((0, 1), (1, 2))
