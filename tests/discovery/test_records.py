"""Advertisements, the compatibility key and argument checks: no etcd needed."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest

from kvpush import KVLayout, TransferMode
from kvpush.discovery import (
    Advertisement,
    DiscoveryError,
    DiscoveryUnavailable,
    EtcdClient,
    InstanceState,
    Publisher,
    Role,
    RouterBridge,
    Watcher,
    compat_key,
)


def _prefill(**kw: object) -> Advertisement:
    args: dict[str, object] = {"instance": "prefill-0", "role": Role.PREFILL, "compat": "c0",
                               "producer": "tcp://10.0.0.1:5600", "http_address": "10.0.0.1:8000"}
    args.update(kw)
    return Advertisement(**args)  # type: ignore[arg-type]


def test_advertisement_round_trips_through_json() -> None:
    ad = _prefill(rank=3, modes=(TransferMode.PULL,), state=InstanceState.DRAINING, epoch=7)
    assert Advertisement.from_json(ad.to_json()) == ad
    assert ad.key == "prefill/prefill-0/3"


@pytest.mark.parametrize(("change", "field"), [
    ({"instance": "a/b"}, "instance"),
    ({"instance": ""}, "instance"),
    ({"role": "prefill"}, "role"),
    ({"compat": ""}, "compat"),
    ({"rank": -1}, "rank"),
    ({"producer": "10.0.0.1:5600"}, "producer"),
    ({"producer": ""}, "producer is required"),
    ({"http_address": "http://10.0.0.1"}, "http_address"),
    ({"modes": ()}, "modes"),
    ({"modes": ("push",)}, "modes"),
    ({"state": "serving"}, "state"),
    ({"epoch": -1}, "epoch"),
])
def test_bad_advertisement_names_the_field(change: dict[str, object], field: str) -> None:
    with pytest.raises(DiscoveryError, match=field):
        _prefill(**change)


def test_decode_rank_needs_no_producer() -> None:
    ad = Advertisement("decode-0", Role.DECODE, "c0", http_address="10.0.0.2:8000")
    assert Advertisement.from_json(ad.to_json()) == ad


@pytest.mark.parametrize(("data", "message"), [
    (b"not json", "not a kvpush advertisement"),
    (b"[]", "not a kvpush advertisement"),
    (b'{"version": 2}', "record version 2"),
    (_prefill().to_json().replace(b'"prefill"', b'"middle"', 1), "not a kvpush"),
])
def test_foreign_records_are_refused(data: bytes, message: str) -> None:
    with pytest.raises(DiscoveryError, match=message):
        Advertisement.from_json(data)


def _layout(**kw: object) -> KVLayout:
    args: dict[str, object] = {"num_layers": 2, "num_blocks": 4, "tokens_per_block": 16,
                               "num_kv_heads": 4, "head_size": 8, "dtype": "float16",
                               "identity": (("model", "m"),)}
    args.update(kw)
    buffers = [np.zeros(1 << 16, np.uint8) for _ in range(int(args["num_layers"]))]  # type: ignore[call-overload]
    return KVLayout.from_buffers(buffers, **args)  # type: ignore[arg-type]


def test_compat_key_leaves_out_what_may_differ() -> None:
    base = compat_key(_layout(total_kv_heads=8))
    # another tensor-parallel shard, block size and block count are still compatible
    assert compat_key(_layout(total_kv_heads=8, head_start=4)) == base
    assert compat_key(_layout(total_kv_heads=8, tokens_per_block=32)) == base
    assert compat_key(_layout(total_kv_heads=8, num_blocks=2)) == base
    # another model, element type or layer count are not
    assert compat_key(_layout(total_kv_heads=8, identity=(("model", "n"),))) != base
    assert compat_key(_layout(total_kv_heads=8, dtype="bfloat16")) != base
    assert compat_key(_layout(total_kv_heads=8, num_layers=1)) != base


@pytest.mark.parametrize("endpoint", ["127.0.0.1:2379", "https://h:1", "http://h:1/v3", ""])
def test_client_refuses_a_bad_endpoint(endpoint: str) -> None:
    with pytest.raises(DiscoveryError, match="etcd endpoint must be"):
        EtcdClient(endpoint)


def test_unreachable_etcd_is_a_clear_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        client = EtcdClient(f"http://127.0.0.1:{port}", timeout=1.0)
        started = time.monotonic()
        with pytest.raises(DiscoveryUnavailable, match=f"127.0.0.1:{port}") as info:
            Publisher(client, "/kvpush/t", _prefill(), ttl_s=2).start()
        assert isinstance(info.value, ConnectionError)
        assert time.monotonic() - started < 2.0


@pytest.mark.parametrize(("kw", "message"), [
    ({"ttl_s": 0}, "ttl_s"), ({"ttl_s": 2.5}, "ttl_s"), ({"renew_s": 10}, "renew_s"),
])
def test_publisher_checks_its_arguments(kw: dict[str, object], message: str) -> None:
    with pytest.raises(DiscoveryError, match=message):
        Publisher(EtcdClient("http://127.0.0.1:1"), "/kvpush/t", _prefill(),
                  **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("prefix", ["kvpush", "/kvpush/", "/a//b", ""])
def test_prefix_must_be_absolute_without_trailing_slash(prefix: str) -> None:
    with pytest.raises(DiscoveryError, match="prefix"):
        Watcher(EtcdClient("http://127.0.0.1:1"), prefix)


class _Records:
    """Stands in for a Watcher: RouterBridge reads only its snapshot."""

    def __init__(self, ads: list[Advertisement]) -> None:
        self.ads = ads

    def snapshot(self) -> list[Advertisement]:
        return self.ads


def test_router_registrations_cover_serving_instances_once() -> None:
    ads = [
        _prefill(instance="p0", rank=0, producer="tcp://10.0.0.1:5600"),
        _prefill(instance="p0", rank=1, producer="tcp://10.0.0.1:5601"),
        _prefill(instance="p1", producer="tcp://10.0.0.3:5600", http_address="10.0.0.3:8000",
                 state=InstanceState.DRAINING),
        _prefill(instance="p2", http_address=""),  # no HTTP server: nothing to route to
        _prefill(instance="p3", compat="other", http_address="10.0.0.4:8000"),
        Advertisement("d0", Role.DECODE, "c0", http_address="10.0.0.2:8000"),
    ]
    bridge = RouterBridge(_Records(ads), "127.0.0.1:30001", compat="c0")  # type: ignore[arg-type]
    assert bridge.registrations() == [
        {"type": "D", "http_address": "10.0.0.2:8000", "zmq_address": "10.0.0.2:8000"},
        {"type": "P", "http_address": "10.0.0.1:8000", "zmq_address": "tcp://10.0.0.1:5600"},
    ]


@pytest.mark.parametrize(("router", "interval"), [("tcp://h:1", 1.0), ("h:1", 5.0)])
def test_router_bridge_checks_its_arguments(router: str, interval: float) -> None:
    with pytest.raises(DiscoveryError):
        RouterBridge(_Records([]), router, interval_s=interval)  # type: ignore[arg-type]
