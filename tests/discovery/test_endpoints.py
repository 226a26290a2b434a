"""Discovery with real kvpush endpoints (NIXL over DRAM): a Producer advertised with its own
health, found by a Consumer through a ProducerDirectory, its blocks pulled, and its record
gone once it closes."""

from __future__ import annotations

import time

import numpy as np

import kvpush
from kvpush.discovery import (
    EtcdClient,
    ProducerDirectory,
    Publisher,
    Watcher,
    advertise_producer,
    compat_key,
    endpoint_health,
)
from tests.support.harness import check_blocks, fill, make_cache


def test_consumer_finds_an_advertised_producer_and_loses_it_on_close(
        client: EtcdClient, prefix: str) -> None:
    src, dst = make_cache(num_blocks=8), make_cache(num_blocks=8)
    fill(src, seed=3)
    with Watcher(client, prefix, idle_s=5.0, max_backoff_s=0.2) as watcher, \
            kvpush.Consumer(dst.layout) as consumer:
        producer = kvpush.Producer(src.layout)
        try:
            ad = advertise_producer(producer, "prefill-0", http_address="127.0.0.1:8000")
            assert ad.producer == producer.address
            with Publisher(client, prefix, ad, ttl_s=2, renew_s=0.3,
                           health=endpoint_health(producer)) as pub:
                directory = ProducerDirectory(watcher, compat_key(dst.layout),
                                              consumer=consumer)
                assert watcher.wait_for(lambda ads: len(ads) == 1, 5)
                assert directory.instances() == {"prefill-0": [producer.address]}
                # the directory started the handshake: the producer is connected before
                # any request names it
                deadline = time.monotonic() + 10
                while producer.name not in consumer.producers() \
                        and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert producer.name in consumer.producers()

                ids = np.arange(4, dtype=np.int64)
                ticket = producer.prefill_done("r1", ids, mode=kvpush.TransferMode.PULL)
                assert ticket is not None
                assert consumer.pull(ticket, ids + 4).wait(10).ok
                check_blocks(dst, ids + 4, ids, seed=3)

                producer.close()
                assert watcher.wait_for(lambda ads: ads == [], 2 + 1.5)
                assert directory.instances() == {}
                assert not pub.published
        finally:
            producer.close()
