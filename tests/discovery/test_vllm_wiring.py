"""The vLLM adapter's discovery wiring (``discovery_*`` keys), with a real etcd and real
kvpush endpoints, without vLLM (worker ranks over CPU tensors shaped like vLLM's): a prefill
rank's record and a decode rank that finds and connects to it; a killed rank gone within
its TTL and its restart seen as a new epoch; health that covers the loop; drain asked
through etcd, finished only once the rank holds nothing, reported, and not inherited by
the next incarnation; the ``health`` and ``drain`` commands' exit codes."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import kvpush
from kvpush.discovery import (
    ROUTER_EXPIRY_S,
    ChangeKind,
    EtcdClient,
    InstanceState,
    ProducerDirectory,
    Role,
    RouterBridge,
    Watcher,
    drain_reports,
    endpoint_problem,
    instance_records,
    main,
    request_drain,
    unrouted,
)
from kvpush.integrations.vllm_common import AdapterConfig
from tests.discovery.stand_ins import HealthServer
from tests.discovery.vllm_rank import worker
from tests.support import ROOT

pytest.importorskip("torch")

TTL = 2


@pytest.fixture
def watcher(client: EtcdClient, prefix: str) -> Iterator[Watcher]:
    with Watcher(client, prefix, idle_s=5.0, max_backoff_s=0.2) as w:
        yield w


def _cli(client: EtcdClient, prefix: str, *args: str) -> int:
    return main(["--etcd", client.endpoints[0], "--prefix", prefix, *args])


def test_config_is_checked_at_start_up() -> None:
    with pytest.raises(ValueError, match="discovery_ttl_s"):
        AdapterConfig(discovery_etcd="http://127.0.0.1:2379", discovery_ttl_s=0)
    with pytest.raises(ValueError, match="discovery_etcd"):
        AdapterConfig(discovery_etcd="127.0.0.1:2379")
    with pytest.raises(ValueError, match="discovery_http_address"):
        AdapterConfig(discovery_etcd="http://127.0.0.1:2379", discovery_http_address="x")
    with pytest.raises(ValueError, match="discovery_etcd / discovery_prefix"):
        AdapterConfig(discovery_etcd="http://127.0.0.1:2379", discovery_prefix="kvpush/")
    cfg = AdapterConfig.from_extra_config({"discovery_etcd": "http://a:1, http://b:2"})
    assert cfg.discovery_prefix == "/kvpush/default"


def test_decode_rank_finds_the_prefill_rank_and_loses_it_at_shutdown(
        client: EtcdClient, prefix: str, watcher: Watcher) -> None:
    url = client.endpoints[0]
    prefill = worker("kv_producer", url, prefix, discovery_http_address="127.0.0.1:8100")
    decode = None
    try:
        assert watcher.wait_for(lambda ads: len(ads) == 1, 5)
        (ad,) = watcher.snapshot()
        # the default name comes from the HTTP address; the record carries the rank's
        # advertised producer address
        assert (ad.instance, ad.role, ad.rank) == ("127.0.0.1-8100", Role.PREFILL, 0)
        assert ad.producer == prefill.address and ad.state is InstanceState.SERVING
        decode = worker("kv_consumer", url, prefix, "decode-a")
        assert decode.discovery.directory.instances() == {"127.0.0.1-8100": [prefill.address]}
        # the directory dialled the producer before any request named it
        deadline = time.monotonic() + 10
        while prefill.producer.name not in decode.consumer.producers():
            assert time.monotonic() < deadline, "never connected"
            time.sleep(0.05)
        # the decode rank has its own record (the bridge registers it with the router)
        assert watcher.wait_for(lambda ads: any(a.role is Role.DECODE for a in ads), 5)
        prefill.shutdown()
        assert watcher.wait_for(lambda ads: [a.role for a in ads] == [Role.DECODE], 2)
        assert decode.discovery.watcher.wait_for(   # the decode rank's own view, too
            lambda ads: [a.role for a in ads] == [Role.DECODE], 2)
        assert decode.discovery.directory.instances() == {}
    finally:
        prefill.shutdown()
        if decode is not None:
            decode.shutdown()
    assert watcher.wait_for(lambda ads: ads == [], 2)


def test_a_killed_rank_goes_within_its_ttl_and_its_restart_has_a_new_epoch(
        client: EtcdClient, prefix: str, watcher: Watcher) -> None:
    changes: list[Any] = []
    watcher.add_listener(changes.append)

    def start() -> tuple[subprocess.Popen[str], int]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.discovery.vllm_rank", "kv_producer",
             client.endpoints[0], prefix, "prefill-k"], cwd=ROOT, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the child prints once published (or dies: "")
        assert line, "the rank did not start"
        return proc, int(line.split()[1])

    def kill(proc: subprocess.Popen[str]) -> None:
        proc.kill()
        proc.wait(10)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()

    proc, epoch = start()
    try:
        assert watcher.wait_for(lambda ads: len(ads) == 1, 5)
        kill(proc)
        t0 = time.monotonic()
        assert watcher.wait_for(lambda ads: ads == [], TTL + 1.5)
        assert time.monotonic() - t0 <= TTL + 1.5
        proc, epoch2 = start()
        assert watcher.wait_for(lambda ads: len(ads) == 1, 5)
        assert epoch2 > epoch and watcher.snapshot()[0].epoch == epoch2
        kinds = [c.kind for c in changes]
        assert kinds == [ChangeKind.JOINED, ChangeKind.LEFT, ChangeKind.JOINED]
    finally:
        kill(proc)


def test_a_stuck_loop_stops_renewal_and_the_record_comes_back_with_it(
        client: EtcdClient, prefix: str, watcher: Watcher) -> None:
    prefill = worker("kv_producer", client.endpoints[0], prefix, "prefill-h")
    try:
        assert watcher.wait_for(lambda ads: len(ads) == 1, 5)
        assert endpoint_problem(prefill.producer) is None
        stuck = 6.0
        # the loop blocked (as in a transport call that does not return): it answers no
        # handshake, so the record must go
        prefill.producer._driver.call_soon(lambda: time.sleep(stuck))
        t0 = time.monotonic()
        assert "did not answer" in (endpoint_problem(prefill.producer, timeout=0.5) or "")
        assert watcher.wait_for(lambda ads: ads == [], TTL + 2 + 1.5)
        assert time.monotonic() - t0 < stuck
        assert watcher.wait_for(lambda ads: len(ads) == 1, stuck + 3)   # healthy again
        assert endpoint_problem(prefill.producer) is None
        prefill.producer.close()
        assert endpoint_problem(prefill.producer) == "closed"
        assert watcher.wait_for(lambda ads: ads == [], TTL + 1.5)
    finally:
        prefill.shutdown()


def test_drain_finishes_what_the_rank_holds_then_withdraws_and_reports(
        client: EtcdClient, prefix: str, watcher: Watcher) -> None:
    url = client.endpoints[0]
    http = HealthServer()  # the instance's HTTP server: ``health`` asks it too
    prefill = worker("kv_producer", url, prefix, "prefill-d", discovery_drain_grace_s=1.0,
                     discovery_http_address=http.address)
    decode = worker("kv_consumer", url, prefix, "decode-d",
                    discovery_http_address="127.0.0.1:8201")
    nxt = None
    try:
        assert watcher.wait_for(lambda ads: len(ads) == 2, 5)
        bridge = RouterBridge(watcher, "127.0.0.1:1")
        assert sorted(r["type"] for r in bridge.registrations()) == ["D", "P"]
        routing = ProducerDirectory(watcher, None)    # a router's view: any compat
        assert routing.at_http_address(http.address) == [prefill.address]
        assert routing.at_http_address("127.0.0.1:8201") == []   # a decode instance
        assert _cli(client, prefix, "health", "prefill-d") == 0
        # a hand-off held for a decode instance: the source waits for its READ
        ids = np.arange(4, dtype=np.int64)
        ticket = prefill.producer.prefill_done("held-1", ids, mode=kvpush.TransferMode.PULL)
        deadline = time.monotonic() + 5
        while prefill.holding() != 1:       # prefill_done reaches the loop asynchronously
            assert time.monotonic() < deadline
            time.sleep(0.02)
        asked = request_drain(client, prefix, "prefill-d")
        assert [a.epoch for a in asked] == [prefill.discovery.publisher.advertisement.epoch]
        assert watcher.wait_for(
            lambda ads: any(a.instance == "prefill-d" and a.state is InstanceState.DRAINING
                            for a in ads), 5)
        # the router bridge stops registering it; decode ranks stop choosing it
        assert [r["type"] for r in bridge.registrations()] == ["D"]
        assert decode.discovery.watcher.wait_for(   # the decode rank's own view, too
            lambda ads: any(a.state is InstanceState.DRAINING for a in ads), 5)
        assert decode.discovery.directory.instances() == {}
        assert routing.at_http_address(http.address) == []
        assert _cli(client, prefix, "health", "prefill-d") == 1
        time.sleep(2.5)                        # past the grace: still held, still there
        assert not prefill.discovery.drained.is_set()
        assert drain_reports(client, prefix, asked) == {}
        assert len(instance_records(client, prefix, "prefill-d")) == 1
        # the decode side takes its KV: nothing held, the rank withdraws and reports
        dst = np.arange(8, 12, dtype=np.int64)
        assert decode.consumer.pull(ticket, dst).wait(10).ok
        assert prefill.discovery.drained.wait(10)
        assert instance_records(client, prefix, "prefill-d") == []
        report = drain_reports(client, prefix, asked)
        assert list(report) == [0] and report[0]["epoch"] == asked[0].epoch
        assert report[0]["held"] == 0
        assert _cli(client, prefix, "health", "prefill-d") == 2
        prefill.shutdown()
        # its next incarnation joins with a new epoch and is not drained by the old ask
        nxt = worker("kv_producer", url, prefix, "prefill-d", discovery_drain_grace_s=1.0)
        (rec,) = instance_records(client, prefix, "prefill-d")
        assert rec.epoch > asked[0].epoch and rec.state is InstanceState.SERVING
        time.sleep(1.0)
        assert not nxt.discovery.draining
        assert _cli(client, prefix, "health", "prefill-d") == 0
        # the command a rolling restart runs: ask, wait for the report, exit 0
        assert _cli(client, prefix, "drain", "prefill-d", "--wait", "20") == 0
        assert instance_records(client, prefix, "prefill-d") == []
        assert _cli(client, prefix, "drain", "nobody") == 2
    finally:
        for w in (prefill, decode, nxt):
            if w is not None:
                w.shutdown()
        http.close()


def test_a_producer_that_stops_listening_is_unhealthy(
        client: EtcdClient, prefix: str, watcher: Watcher) -> None:
    """The control port peers dial stops accepting (unbound here, as when the listener is
    lost): the record goes, though the loop still runs."""
    prefill = worker("kv_producer", client.endpoints[0], prefix, "prefill-l")
    try:
        assert watcher.wait_for(lambda ads: len(ads) == 1, 5)
        router = prefill.producer._sessions.router
        prefill.producer._driver.call_and_wait(lambda: router.unbind(router.last_endpoint), 5)
        # ZeroMQ closes the listener on its I/O thread, a moment after unbind returns
        deadline = time.monotonic() + 5
        while "refuses connections" not in (endpoint_problem(prefill.producer) or "") \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "refuses connections" in (endpoint_problem(prefill.producer) or "")
        assert watcher.wait_for(lambda ads: ads == [], TTL + 1.5)
    finally:
        prefill.shutdown()


def test_drain_waits_until_the_router_bridge_has_let_the_instance_go(
        client: EtcdClient, prefix: str, watcher: Watcher) -> None:
    """vllm-router keeps sending to an instance until its expiry after the bridge's last
    registration: a draining rank withdraws (and the instance may stop) only once every
    running bridge confirms it is out of its router, however short the grace."""
    import msgspec
    import zmq

    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)  # stands in for vllm-router's discovery socket
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    http = HealthServer()
    prefill = worker("kv_producer", client.endpoints[0], prefix, "prefill-b",
                     discovery_drain_grace_s=0.5, discovery_http_address=http.address)
    try:
        with RouterBridge(watcher, f"127.0.0.1:{port}", interval_s=0.1) as bridge:
            assert router.poll(5000), "the bridge did not register the instance"
            asked = request_drain(client, prefix, "prefill-b")
            t0 = time.monotonic()
            last = t0
            while not prefill.discovery.drained.is_set():
                assert time.monotonic() - t0 < ROUTER_EXPIRY_S + 5, "never drained"
                if router.poll(50):
                    body = router.recv_multipart()[1]
                    assert msgspec.msgpack.decode(body)["http_address"] == http.address
                    last = time.monotonic()
            # not before the router's expiry had passed since the last registration
            assert time.monotonic() - last >= ROUTER_EXPIRY_S
            epoch = asked[0].epoch
            assert unrouted(client, prefix, "prefill-b", epoch) == ([bridge.bridge_id], [])
            assert list(drain_reports(client, prefix, asked)) == [0]
    finally:
        prefill.shutdown()
        router.close(0)
        http.close()
