"""Real vLLM servers found through etcd: a prefill and a decode instance on loopback with the
adapter's ``discovery_*`` keys and no static producer list anywhere (kvpush's router takes
the prefill's producers from its etcd record too). Tokens equal a colocated instance's, push
and pull. Then the prefill instance is drained through etcd (the command a rolling restart
runs): it reports drained with nothing held, its record is gone, and the router refuses
push for want of a serving producer.

Needs etcd (``tests/support/etcd.py`` starts a private one; skips, saying why, without it).
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import MAX_TOKENS, PROMPTS, tokens_of

from examples.vllm import launch
from kvpush.discovery import EtcdClient, InstanceState, Role, Watcher, instance_records
from tests.support.etcd import EtcdServer, etcd_unavailable

PREFIX = "/kvpush/vllm-test"
_ids = itertools.count()


@pytest.fixture(scope="module")
def etcd() -> Iterator[EtcdServer]:
    why = etcd_unavailable()
    if why:
        pytest.skip(f"no etcd: {why}")
    with EtcdServer() as server:
        yield server


def _complete(router: launch.Process, prompt: list[int], mode: str
              ) -> tuple[int, dict[str, Any]]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True, "kvpush_mode": mode}
    return launch.http_json(router.url + "/v1/completions", body, timeout=120)


def test_prefill_and_decode_found_through_etcd_then_drained(
        etcd: EtcdServer, model_dir: Path, workdir: Path,
        reference: dict[str, list[int]]) -> None:
    fleet = launch.Fleet()
    logs = workdir / "logs-discovery"
    kv_port, p_port, d_port, r_port = (launch.free_port() for _ in range(4))
    common = ["-O0", "--max-num-seqs", "8"]
    discovery = {"discovery_etcd": etcd.url, "discovery_prefix": PREFIX,
                 "discovery_ttl_s": 3, "discovery_drain_grace_s": 2.0}
    client = EtcdClient(etcd.url)
    try:
        prefill = fleet.add(launch.start_vllm(
            model_dir, p_port, name="prefill-disc", cores="0", log_dir=logs,
            extra_args=common, kv_transfer_config=launch.kvpush_config(
                "kv_producer", kv_port, discovery_instance="prefill-0",
                discovery_http_address=f"127.0.0.1:{p_port}", **discovery)))
        decode = fleet.add(launch.start_vllm(
            model_dir, d_port, name="decode-disc", cores="1", log_dir=logs,
            extra_args=common, kv_transfer_config=launch.kvpush_config(
                "kv_consumer", discovery_instance="decode-0",
                discovery_http_address=f"127.0.0.1:{d_port}", **discovery)))
        router = fleet.add(launch.start_router(
            r_port, prefill=prefill.url, decode=decode.url, log_dir=logs,
            args=["--discovery-etcd", etcd.url, "--discovery-prefix", PREFIX]))
        launch.wait_healthy([prefill, decode, router], timeout_s=420)

        with Watcher(client, PREFIX, idle_s=5.0, max_backoff_s=0.2) as watcher:
            assert watcher.wait_for(lambda ads: {(a.instance, a.role) for a in ads} == {
                ("prefill-0", Role.PREFILL), ("decode-0", Role.DECODE)}, 30)
            (p_ad,) = [a for a in watcher.snapshot() if a.role is Role.PREFILL]
            assert p_ad.producer == f"tcp://127.0.0.1:{kv_port}"
            assert p_ad.http_address == f"127.0.0.1:{p_port}"

            for mode in ("push", "pull"):
                for name in ("len200", "len650", f"{mode}-a"):
                    status, out = _complete(router, PROMPTS[name], mode)
                    assert status == 200, (mode, name, out)
                    assert tokens_of(out) == reference[name], (mode, name)
            for server in (prefill, decode):
                assert "published in etcd" in server.log.read_text(errors="replace")

            # drain the prefill instance as a rolling restart does: ask, wait for its report
            drain = subprocess.run(
                [sys.executable, "-m", "kvpush.discovery", "--etcd", etcd.url, "--prefix",
                 PREFIX, "drain", "prefill-0", "--wait", "60"], cwd=workdir,
                capture_output=True, text=True, timeout=90)
            assert drain.returncode == 0, drain.stdout + drain.stderr
            assert "drained (0 hand-off(s) still held" in drain.stdout
            assert instance_records(client, PREFIX, "prefill-0") == []
            assert watcher.wait_for(
                lambda ads: [a.instance for a in ads] == ["decode-0"]
                and ads[0].state is InstanceState.SERVING, 5)
            status, out = _complete(router, PROMPTS["len200"], "push")
            assert status == 503, out
            assert "drained in" in prefill.log.read_text(errors="replace")
    finally:
        fleet.stop()
    deadline = time.monotonic() + 3 + 2
    while time.monotonic() < deadline and instance_records(client, PREFIX, "decode-0"):
        time.sleep(0.2)
    assert instance_records(client, PREFIX, "decode-0") == []
