"""2 producers x 2 consumers, each in its own network namespace (4 hosts on one bridge),
UCX over TCP between them: 1,000 requests routed across the pairs, push and pull, some owed
by both producers (two ranks counted), every byte verified, nothing lost or repeated."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from tests.support.netns import Ledger, Node, netns_unavailable
from tests.support.netns_fabric import Fabric

CACHE = dict(num_blocks=256, num_layers=2, kv_packed=False)
SEED = 17  # both producers hold the same bytes, so two-rank requests check the same way
FAST = dict(heartbeat_s=0.2, peer_timeout_s=5.0)

pytestmark = pytest.mark.netns


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[list[Node], list[Node]]]:
    reason = netns_unavailable()
    if reason is not None:
        pytest.skip(f"network namespaces unavailable: {reason}")
    nodes: list[Node] = []
    with Fabric(4) as fabric:
        try:
            producers = []
            for i in range(2):
                node = Node(f"p{i}", fabric.ns[i], fabric.dev[i])
                nodes.append(node)
                producers.append(node.start("producer", CACHE, {"host": fabric.ip[i],
                                                               "port": 5555}, seed=SEED))
            consumers = []
            for i in range(2, 4):
                node = Node(f"c{i}", fabric.ns[i], fabric.dev[i])
                nodes.append(node)
                consumers.append(node.start("consumer", CACHE, FAST))
            for c in consumers:
                for p in producers:
                    assert c.call("connect", address=p.address, timeout=30) == p.name
            yield producers, consumers
        finally:
            for node in nodes:
                node.close()


def test_two_by_two_thousand_requests(cluster: tuple[list[Node], list[Node]]) -> None:
    producers, consumers = cluster
    ledger = Ledger()
    rng = np.random.default_rng(99)
    total, batches = 0, 10
    t0 = time.monotonic()
    for batch in range(batches):
        # Per consumer, disjoint destination blocks within a batch.
        pools = {c.label: list(rng.permutation(CACHE["num_blocks"])) for c in consumers}
        pushes: dict[str, list] = {c.label: [] for c in consumers}
        prefills: dict[str, list] = {p.label: [] for p in producers}
        for i in range(100):
            c = consumers[int(rng.integers(2))]
            n = int(rng.integers(0, 5))
            dst = [int(pools[c.label].pop()) for _ in range(n)]
            src = [int(x) for x in rng.choice(CACHE["num_blocks"], n, replace=False)]
            rid = f"b{batch}-{i}"
            two_ranks = i % 4 == 0
            owners = producers if two_ranks else [producers[int(rng.integers(2))]]
            if i % 2 == 0:  # push
                pushes[c.label].append([rid, dst, [p.name for p in owners], 30, SEED, src])
                for p in owners:
                    prefills[p.label].append((rid, src, "push", c, dst))
            else:           # pull: the router relays the ticket after prefill
                p = owners[0]
                prefills[p.label].append((rid, src, "pull", c, dst))
        for c in consumers:
            errors = c.call("expect", items=pushes[c.label])
            assert errors == [None] * len(errors), errors
        for p in producers:
            items = prefills[p.label]
            tickets = p.call("prefill", items=[[rid, src, mode] for rid, src, mode, _, _ in items])
            by_consumer: dict[str, list] = {}
            for (rid, _src, mode, c, dst), ticket in zip(items, tickets, strict=True):
                if mode == "pull":
                    assert isinstance(ticket, str), ticket
                    by_consumer.setdefault(c.label, []).append([rid, ticket, dst, 30, SEED])
            for c in consumers:
                if c.label in by_consumer:
                    errors = c.call("pull", items=by_consumer[c.label])
                    assert errors == [None] * len(errors), errors
        want = sum(len(pushes[c.label]) for c in consumers) + sum(
            1 for p in producers for it in prefills[p.label] if it[2] == "pull")
        deadline = time.monotonic() + 60
        got = 0
        while got < want:
            assert time.monotonic() < deadline, f"batch {batch}: {got}/{want} finished"
            for c in consumers:
                got += len(ledger.drain_consumer(c))
            time.sleep(0.01)
        total += want
    elapsed = time.monotonic() - t0
    results = [r for rs in ledger.results.values() for r in rs]
    assert total == 1000 == len(results)
    assert not ledger.repeated()
    bad = [r for r in results if r["state"] != "ready" or r["corrupted"]]
    assert not bad, bad[:5]
    # Every source hold ends in exactly one release, per producer (two-rank requests
    # release on both producers: 25 per batch).
    per_producer = {p.label: Ledger() for p in producers}
    deadline = time.monotonic() + 30
    while True:
        for p in producers:
            per_producer[p.label].drain_producer(p)
        count = sum(len(v) for led in per_producer.values() for v in led.releases.values())
        if count >= 1250 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert count == 1250
    for led in per_producer.values():
        assert not led.repeated()
        assert {r for v in led.releases.values() for r in v} == {"transferred"}
    print(f"1000 requests across 2x2 hosts in {elapsed:.1f} s")
