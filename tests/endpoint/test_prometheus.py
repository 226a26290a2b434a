"""kvpush[prometheus]: the figures of the vLLM adapter's metrics for any engine,
served over HTTP and scraped with a real HTTP client."""

from __future__ import annotations

import importlib.util
import re
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import prometheus_client  # pinned in requirements/lock.txt: missing, the tests fail
import pytest
from prometheus_client.parser import text_string_to_metric_families

import kvpush
from kvpush.prometheus import KvpushMetrics
from tests.support import ROOT
from tests.support.harness import fill, make_cache


@pytest.fixture()
def served() -> Iterator[tuple[KvpushMetrics, int]]:
    registry = prometheus_client.CollectorRegistry()
    metrics = KvpushMetrics(registry)
    server, thread = prometheus_client.start_http_server(0, addr="127.0.0.1",
                                                         registry=registry)
    try:
        yield metrics, server.server_port
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
        assert not thread.is_alive()


def scrape(port: int) -> dict[tuple[str, str], float]:
    """Every kvpush sample, by (sample name, role), as an HTTP client reads /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("kvpush_") and "le" not in sample.labels:
                out[(sample.name, sample.labels["role"])] = sample.value
    return out


def test_scrape_shows_the_counters_moving(served: tuple[KvpushMetrics, int]) -> None:
    metrics, port = served
    src, dst = make_cache(num_blocks=16), make_cache(num_blocks=16)
    fill(src, 1)
    config = kvpush.ProducerConfig(lease_s=1.0)
    with kvpush.Producer(src.layout, config) as p, \
            kvpush.Consumer(dst.layout, kvpush.ConsumerConfig(lease_margin_s=0.1)) as c:
        metrics.track(p)
        metrics.track(c)
        metrics.track(c)  # a second track is a no-op: nothing counted twice
        before = scrape(port)
        assert before[("kvpush_num_push_total", "consumer")] == 0
        assert before[("kvpush_requests_in_flight", "consumer")] == 0
        name = c.connect(p.address)
        pending = c.expect("waits", [9], name, timeout=30)
        assert scrape(port)[("kvpush_requests_in_flight", "consumer")] == 1
        handles = [c.expect(f"push-{i}", [i], name) for i in range(3)]
        for i in range(3):
            p.prefill_done(f"push-{i}", [i + 4])
        tickets = [p.prefill_done(f"pull-{i}", [i + 8], kvpush.TransferMode.PULL)
                   for i in range(2)]
        handles += [c.pull(t, [i + 12]) for i, t in enumerate(tickets)]
        assert all(h.wait(10).ok for h in handles)
        p.prefill_done("nobody-comes", [15], kvpush.TransferMode.PUSH)
        c.abort("waits")
        assert pending.wait(10).state is kvpush.RequestState.ABORTED
        deadline = time.monotonic() + 10
        after = scrape(port)
        while after[("kvpush_num_lease_expired_total", "producer")] < 1 \
                and time.monotonic() < deadline:
            time.sleep(0.05)
            after = scrape(port)
        assert after[("kvpush_num_push_total", "consumer")] == 3
        assert after[("kvpush_num_pull_total", "consumer")] == 2
        assert after[("kvpush_num_failed_total", "consumer")] == 1
        assert after[("kvpush_num_released_total", "producer")] == 5
        assert after[("kvpush_num_lease_expired_total", "producer")] == 1
        assert after[("kvpush_xfer_time_seconds_count", "consumer")] == 5
        assert after[("kvpush_bytes_transferred_count", "consumer")] == 5
        assert after[("kvpush_bytes_transferred_sum", "consumer")] == \
            5 * src.layout.block_bytes * src.layout.num_regions
        assert after[("kvpush_xfer_time_seconds_sum", "consumer")] > 0
        assert after[("kvpush_requests_in_flight", "consumer")] == 0
        metrics.untrack(p)
        metrics.untrack(c)
        assert scrape(port) == {}
        with pytest.raises(TypeError):
            metrics.track("not an endpoint")  # type: ignore[arg-type]


def test_names_match_the_vllm_adapters() -> None:
    """Every figure the vLLM adapter exports (``vllm:kvpush_*``) exists here under the same
    name without vLLM's namespace."""
    source = (ROOT / "kvpush" / "integrations" / "vllm.py").read_text()
    vllm_names = set(re.findall(r'"vllm:kvpush_(\w+)"', source))
    vllm_names |= set(re.findall(r'\("(num_\w+)",', source))
    assert {"xfer_time_seconds", "bytes_transferred", "num_push", "num_lease_expired"} \
        <= vllm_names
    registry = prometheus_client.CollectorRegistry()
    KvpushMetrics(registry)
    ours = {m.name for m in registry.collect()}
    assert {f"kvpush_{n}" for n in vllm_names} <= ours, ours


def test_the_example_serves_and_scrapes_its_metrics(capsys: pytest.CaptureFixture[str]
                                                    ) -> None:
    spec = importlib.util.spec_from_file_location(
        "prometheus_example", ROOT / "examples" / "prometheus_metrics.py")
    assert spec is not None and spec.loader is not None
    example: Any = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--requests", "6"]) == 0
    lines = capsys.readouterr().out.splitlines()
    values = {(line.split("{")[0], re.findall(r'role="(\w+)"', line)[0]):
              float(line.rsplit(" ", 1)[1]) for line in lines if "role=" in line}
    assert values[("kvpush_num_push_total", "consumer")] == 3
    assert values[("kvpush_num_pull_total", "consumer")] == 3
    assert values[("kvpush_num_released_total", "producer")] == 6
    assert values[("kvpush_num_failed_total", "consumer")] == 0
