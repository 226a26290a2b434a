"""Publishing and following advertisements in a real etcd started by the test: leases,
renewal, expiry of a killed process, draining, restarts with a new epoch, health, and etcd
going away and coming back. TTLs are short (2-3 s) so that each test takes seconds."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator

import pytest

from kvpush.discovery import (
    Advertisement,
    Change,
    ChangeKind,
    DiscoveryUnavailable,
    EtcdClient,
    InstanceState,
    ProducerDirectory,
    Publisher,
    Role,
    Watcher,
)
from tests.support import ROOT
from tests.support.etcd import EtcdServer, etcd_unavailable


def _prefill(instance: str = "prefill-0", rank: int = 0, **kw: object) -> Advertisement:
    args: dict[str, object] = {"compat": "c0", "producer": f"tcp://127.0.0.1:{5600 + rank}",
                               "http_address": "127.0.0.1:8000"}
    args.update(kw)
    return Advertisement(instance, Role.PREFILL, rank=rank, **args)  # type: ignore[arg-type]


class _Changes:
    """Collects a watcher's changes; waits for one with a timeout."""

    def __init__(self, watcher: Watcher) -> None:
        self.items: list[Change] = []
        self._cond = threading.Condition()
        watcher.add_listener(self._add)

    def _add(self, change: Change) -> None:
        with self._cond:
            self.items.append(change)
            self._cond.notify_all()

    def wait(self, kind: ChangeKind, key: str, timeout: float) -> Change:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for change in self.items:
                    if change.kind is kind and change.advertisement.key == key:
                        self.items.remove(change)
                        return change
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no {kind.value} of {key} in {timeout} s; "
                                         f"saw {self.items}")
                self._cond.wait(left)


@pytest.fixture
def watcher(client: EtcdClient, prefix: str) -> Iterator[Watcher]:
    with Watcher(client, prefix, idle_s=5.0, max_backoff_s=0.2) as w:
        yield w


def test_record_is_published_drained_and_withdrawn(client: EtcdClient, prefix: str,
                                                  watcher: Watcher) -> None:
    changes = _Changes(watcher)
    ad = _prefill()
    with Publisher(client, prefix, ad, ttl_s=3) as pub:
        joined = changes.wait(ChangeKind.JOINED, ad.key, 5)
        assert joined.advertisement.producer == ad.producer
        assert joined.advertisement.epoch == pub.advertisement.epoch > 0
        assert joined.advertisement.state is InstanceState.SERVING
        pub.drain()
        updated = changes.wait(ChangeKind.UPDATED, ad.key, 5)
        assert updated.advertisement.state is InstanceState.DRAINING
        assert updated.previous is not None
        assert updated.previous.state is InstanceState.SERVING
        # renewals keep it (several TTLs pass) and change nothing
        time.sleep(4)
        assert [a.key for a in watcher.snapshot()] == [ad.key]
        started = time.monotonic()
    changes.wait(ChangeKind.LEFT, ad.key, 2)  # withdrawn at once, not at lease expiry
    assert time.monotonic() - started < 2
    assert watcher.snapshot() == []


_PUBLISH_AND_WAIT = textwrap.dedent("""
    import sys, time
    from kvpush.discovery import Advertisement, EtcdClient, Publisher, Role
    url, prefix, ttl = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ad = Advertisement("prefill-0", Role.PREFILL, "c0", producer="tcp://127.0.0.1:5600",
                       http_address="127.0.0.1:8000")
    pub = Publisher(EtcdClient(url), prefix, ad, ttl_s=ttl).start()
    print(pub.advertisement.epoch, flush=True)
    time.sleep(60)
""")


def _publisher_process(url: str, prefix: str, ttl: int) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen([sys.executable, "-c", _PUBLISH_AND_WAIT, url, prefix, str(ttl)],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the child prints its epoch once published
    if not line:
        _stop(proc)
        raise AssertionError("the publisher process did not publish")
    return proc, int(line)


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.wait(10)
    if proc.stdout is not None:
        proc.stdout.close()


def test_killed_publisher_disappears_within_its_lease(etcd_server: EtcdServer,
                                                      client: EtcdClient, prefix: str,
                                                      watcher: Watcher) -> None:
    changes = _Changes(watcher)
    proc, epoch = _publisher_process(etcd_server.url, prefix, ttl=2)
    try:
        assert changes.wait(ChangeKind.JOINED, "prefill/prefill-0/0", 5).advertisement.epoch \
            == epoch
        time.sleep(3)  # outlives its first lease: it renews
        assert len(watcher.snapshot()) == 1
        proc.kill()
        killed = time.monotonic()
    finally:
        _stop(proc)
    changes.wait(ChangeKind.LEFT, "prefill/prefill-0/0", 5)
    # etcd expires a lease at TTL, checked every 500 ms: gone in TTL + a little
    assert time.monotonic() - killed < 2 + 1.5


def test_restart_is_seen_as_a_new_epoch(etcd_server: EtcdServer, client: EtcdClient,
                                        prefix: str, watcher: Watcher) -> None:
    changes = _Changes(watcher)
    proc, first = _publisher_process(etcd_server.url, prefix, ttl=5)
    try:
        changes.wait(ChangeKind.JOINED, "prefill/prefill-0/0", 5)
    finally:
        _stop(proc)
    # the next incarnation comes back before the old record's lease has run out
    with Publisher(client, prefix, _prefill(), ttl_s=5) as pub:
        restarted = changes.wait(ChangeKind.RESTARTED, "prefill/prefill-0/0", 5)
        assert restarted.previous is not None and restarted.previous.epoch == first
        assert restarted.advertisement.epoch == pub.advertisement.epoch != first
    changes.wait(ChangeKind.LEFT, "prefill/prefill-0/0", 2)


def test_unhealthy_publisher_stops_renewing_and_returns(client: EtcdClient, prefix: str,
                                                       watcher: Watcher) -> None:
    changes = _Changes(watcher)
    healthy = threading.Event()
    healthy.set()
    ad = _prefill()
    with Publisher(client, prefix, ad, ttl_s=2, renew_s=0.3, health=healthy.is_set) as pub:
        changes.wait(ChangeKind.JOINED, ad.key, 5)
        healthy.clear()
        unhealthy = time.monotonic()
        changes.wait(ChangeKind.LEFT, ad.key, 5)
        assert time.monotonic() - unhealthy < 2 + 1.5
        assert not pub.published
        healthy.set()
        back = changes.wait(ChangeKind.JOINED, ad.key, 5)
        assert back.advertisement.epoch == pub.advertisement.epoch  # the same incarnation
        assert pub.published


def test_health_callback_that_raises_counts_as_unhealthy(client: EtcdClient, prefix: str,
                                                        watcher: Watcher) -> None:
    changes = _Changes(watcher)

    def broken() -> bool:
        raise RuntimeError("probe failed")

    with Publisher(client, prefix, _prefill(), ttl_s=2, renew_s=0.3, health=broken):
        changes.wait(ChangeKind.JOINED, "prefill/prefill-0/0", 5)
        changes.wait(ChangeKind.LEFT, "prefill/prefill-0/0", 5)


def test_watcher_skips_foreign_records(client: EtcdClient, prefix: str,
                                       watcher: Watcher) -> None:
    client.put(f"{prefix}/prefill/x/0", b"not a record")
    client.put(f"{prefix}/prefill/other-name/0", _prefill().to_json())  # key disagrees
    with Publisher(client, prefix, _prefill(), ttl_s=3):
        assert watcher.wait_for(lambda ads: len(ads) == 1, 5)
    assert watcher.invalid >= 2


class _Dialler:
    """Stands in for a Consumer: ProducerDirectory only calls connect_nowait."""

    def __init__(self) -> None:
        self.dialled: list[str] = []

    def connect_nowait(self, address: str) -> None:
        self.dialled.append(address)


def test_directory_offers_serving_compatible_producers(client: EtcdClient, prefix: str,
                                                      watcher: Watcher) -> None:
    dialler = _Dialler()
    directory = ProducerDirectory(watcher, "c0", consumer=dialler)  # type: ignore[arg-type]
    pubs = [Publisher(client, prefix, ad, ttl_s=3) for ad in [
        _prefill("p0", 0, producer="tcp://127.0.0.1:5600"),
        _prefill("p0", 1, producer="tcp://127.0.0.1:5601"),
        _prefill("p1", 0, producer="tcp://127.0.0.1:5700", compat="other"),
        _prefill("p2", 0, producer="tcp://127.0.0.1:5800"),
        _prefill("p3", 1, producer="tcp://127.0.0.1:5901"),  # rank 0 missing
        Advertisement("d0", Role.DECODE, "c0", http_address="127.0.0.1:9000"),
    ]]
    try:
        for pub in pubs:
            pub.start()
        pubs[3].drain()
        assert watcher.wait_for(lambda ads: len(ads) == 6
                                and any(a.state is InstanceState.DRAINING for a in ads), 5)
        assert directory.instances() == {"p0": ["tcp://127.0.0.1:5600", "tcp://127.0.0.1:5601"]}
        assert sorted(dialler.dialled) == ["tcp://127.0.0.1:5600", "tcp://127.0.0.1:5601",
                                           "tcp://127.0.0.1:5800", "tcp://127.0.0.1:5901"]
    finally:
        for pub in pubs:
            pub.close()


def test_etcd_down_is_a_clear_error_and_everything_recovers() -> None:
    why = etcd_unavailable()
    if why:
        pytest.skip(f"no etcd: {why}")
    with EtcdServer() as server:
        client = EtcdClient(server.url, timeout=1.0)
        prefix = "/kvpush-test/down"
        ad = _prefill()
        with Watcher(client, prefix, idle_s=5.0, max_backoff_s=0.2) as watcher, \
                Publisher(client, prefix, ad, ttl_s=3, renew_s=0.3) as pub:
            assert watcher.wait_for(lambda ads: len(ads) == 1, 5)
            server.stop()
            with pytest.raises(DiscoveryUnavailable, match=server.url.split("//")[1]):
                Publisher(client, prefix, _prefill("prefill-1"), ttl_s=3).start()
            with pytest.raises(DiscoveryUnavailable):
                pub.drain()  # kept, and written once etcd is back
            deadline = time.monotonic() + 5
            while watcher.connected and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not watcher.connected and watcher.last_error is not None
            assert [a.key for a in watcher.snapshot()] == [ad.key]  # the last known view
            time.sleep(1)
            assert pub.last_error is not None
            server.start()
            assert watcher.wait_for(
                lambda ads: [a.state for a in ads] == [InstanceState.DRAINING], 10)
            assert watcher.connected
            deadline = time.monotonic() + 5
            while pub.last_error is not None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert pub.last_error is None and pub.published
            with Publisher(client, prefix, _prefill("prefill-1"), ttl_s=3):
                assert watcher.wait_for(lambda ads: len(ads) == 2, 5)


def test_command_line_lists_the_records(etcd_server: EtcdServer, client: EtcdClient,
                                        prefix: str) -> None:
    ad = _prefill()
    with Publisher(client, prefix, ad, ttl_s=3) as pub:
        out = subprocess.run([sys.executable, "-m", "kvpush.discovery", "--etcd",
                              etcd_server.url, "--prefix", prefix, "list"],
                             cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    key, record = out.stdout.strip().split(" ", 1)
    assert key == pub.key
    assert Advertisement.from_json(record.encode()) == pub.advertisement
