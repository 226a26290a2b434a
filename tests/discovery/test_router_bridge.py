"""The bridge from etcd records to vllm-router's ZeroMQ discovery: what it sends (to a
ZeroMQ socket standing in for the router), and, where vllm-router is installed, that the
real router routes to instances as they join and stops when they leave, with no restart.

vllm-router is found on PATH or at ``$KVPUSH_VLLM_ROUTER`` (``pip install
vllm-router==0.1.17``); without it that test skips and says so."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from kvpush.discovery import (
    ROUTER_EXPIRY_S,
    Advertisement,
    EtcdClient,
    Publisher,
    Role,
    RouterBridge,
    Watcher,
    main,
    unrouted,
)
from tests.discovery.stand_ins import HealthServer, Served
from tests.support import ROOT


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _prefill(instance: str, http_address: str, rank: int = 0) -> Advertisement:
    return Advertisement(instance, Role.PREFILL, "c0", rank=rank,
                         producer=f"tcp://127.0.0.1:{5600 + rank}", http_address=http_address)


def _decode(instance: str, http_address: str) -> Advertisement:
    return Advertisement(instance, Role.DECODE, "c0", http_address=http_address)


@pytest.fixture
def watcher(client: EtcdClient, prefix: str) -> Iterator[Watcher]:
    with Watcher(client, prefix, idle_s=5.0, max_backoff_s=0.2) as w:
        yield w


def test_bridge_sends_what_vllm_router_reads(client: EtcdClient, prefix: str,
                                             watcher: Watcher) -> None:
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)  # vllm-router's discovery socket is a ROUTER too
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    seen: dict[str, dict[str, str]] = {}

    def receive(seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if router.poll(int(left * 1000)):
                _, body = router.recv_multipart()
                message = msgspec.msgpack.decode(body)
                seen[message["http_address"]] = message

    pubs = [Publisher(client, prefix, ad, ttl_s=3) for ad in
            (_prefill("p0", "127.0.0.1:8100"), _decode("d0", "127.0.0.1:8200"))]
    try:
        for pub in pubs:
            pub.start()
        # no HTTP server behind these addresses: registered without the health check
        with RouterBridge(watcher, f"127.0.0.1:{port}", interval_s=0.1, health_path=None):
            receive(1.0)
            assert seen == {
                "127.0.0.1:8100": {"type": "P", "http_address": "127.0.0.1:8100",
                                   "zmq_address": "tcp://127.0.0.1:5600"},
                "127.0.0.1:8200": {"type": "D", "http_address": "127.0.0.1:8200",
                                   "zmq_address": "127.0.0.1:8200"},
            }
            pubs[0].drain()
            assert watcher.wait_for(lambda ads: ads[1].state.value == "draining", 5)
            receive(0.3)  # what was already queued
            seen.clear()
            receive(0.5)
            assert list(seen) == ["127.0.0.1:8200"]  # the draining prefill is not sent
    finally:
        for pub in pubs:
            pub.close()
        router.close(0)


def test_bridge_registers_an_incarnation_once_it_serves_http_and_confirms_it_out(
        client: EtcdClient, prefix: str, watcher: Watcher,
        capsys: pytest.CaptureFixture[str]) -> None:
    """vllm-router fails a request sent to an instance that refuses the connection (it
    does not retry it elsewhere): the bridge registers an incarnation only once its HTTP
    server answers (a restarted instance publishes its record before), and confirms a
    draining one out of the router only once the router's expiry has passed since its
    last registration."""
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    http_port = _free_port()
    address = f"127.0.0.1:{http_port}"
    last: dict[str, float] = {}

    def receive(seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if router.poll(int(left * 1000)):
                _, body = router.recv_multipart()
                last[msgspec.msgpack.decode(body)["http_address"]] = time.monotonic()

    pub = Publisher(client, prefix, _prefill("p0", address), ttl_s=3).start()
    epoch = pub.advertisement.epoch
    http = None
    bridge = RouterBridge(watcher, f"127.0.0.1:{port}", interval_s=0.1)
    try:
        with bridge:
            assert watcher.wait_for(lambda ads: len(ads) == 1, 5)
            receive(1.0)
            assert last == {}  # its record serves, its HTTP server does not listen yet
            assert main(["--etcd", client.endpoints[0], "--prefix", prefix, "health",
                         "p0"]) == 2
            http = HealthServer(http_port)
            deadline = time.monotonic() + 3
            while address not in last and time.monotonic() < deadline:
                receive(0.2)
            assert address in last, "not registered once its HTTP server answered"
            assert main(["--etcd", client.endpoints[0], "--prefix", prefix, "health",
                         "p0"]) == 0
            assert unrouted(client, prefix, "p0", epoch) == ([], [bridge.bridge_id])
            pub.drain()
            assert watcher.wait_for(lambda ads: ads[0].state.value == "draining", 5)
            receive(0.3)  # what was already queued
            stopped = last[address]
            while unrouted(client, prefix, "p0", epoch)[1]:
                assert time.monotonic() - stopped < ROUTER_EXPIRY_S + 3, "never confirmed"
                receive(0.1)
            assert last[address] == stopped  # nothing sent once draining
            assert time.monotonic() - stopped >= ROUTER_EXPIRY_S
            assert unrouted(client, prefix, "p0", epoch) == ([bridge.bridge_id], [])
            assert unrouted(client, prefix, "p0", epoch + 1)[1] == [bridge.bridge_id]
            # ``list`` prints the records, not the bridges' control keys
            capsys.readouterr()
            assert main(["--etcd", client.endpoints[0], "--prefix", prefix, "list"]) == 0
            assert [line.split()[0] for line in capsys.readouterr().out.splitlines()] \
                == [pub.key]
        # a stopped bridge is not waited for: its presence key went with it
        assert unrouted(client, prefix, "p0", epoch + 1) == ([], [])
    finally:
        pub.close()
        router.close(0)
        if http is not None:
            http.close()


def test_a_confirmation_from_an_earlier_lapse_does_not_count_for_a_drain(
        client: EtcdClient, prefix: str, watcher: Watcher) -> None:
    """A record that lapsed (its lease ran out) and came back with the same epoch: the
    bridge confirmed it out of the router then, registers it again, and confirms it anew
    for the drain; the drain counts only confirmations written after it began."""
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    def registered(seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        seen = False
        while (left := deadline - time.monotonic()) > 0 and not seen:
            if router.poll(int(left * 1000)):
                router.recv_multipart()
                seen = True
        return seen

    with HealthServer() as http:
        pub = Publisher(client, prefix, _prefill("p0", http.address), ttl_s=3).start()
        epoch = pub.advertisement.epoch
        try:
            with RouterBridge(watcher, f"127.0.0.1:{port}", interval_s=0.1) as bridge:
                assert registered(5)
                pub.close()  # the record lapses
                deadline = time.monotonic() + ROUTER_EXPIRY_S + 3
                while unrouted(client, prefix, "p0", epoch)[1]:
                    assert time.monotonic() < deadline, "the lapse was never confirmed"
                    time.sleep(0.1)
                pub = Publisher(client, prefix, pub.advertisement, ttl_s=3).start()
                assert pub.advertisement.epoch == epoch
                while router.poll(0):
                    router.recv_multipart()
                assert registered(5)  # back in the router
                since = client.get_prefix(pub.key)[0]
                pub.drain()
                assert unrouted(client, prefix, "p0", epoch, since_revision=since) \
                    == ([], [bridge.bridge_id])
                started = time.monotonic()
                while unrouted(client, prefix, "p0", epoch, since_revision=since)[1]:
                    assert time.monotonic() - started < ROUTER_EXPIRY_S + 3, "never confirmed"
                    time.sleep(0.1)
                assert time.monotonic() - started >= ROUTER_EXPIRY_S - 0.6
        finally:
            pub.close()
            router.close(0)


# -- the real vllm-router ------------------------------------------------------------------

def _router_binary() -> str | None:
    bundled = ROOT / ".venv-vllm" / "bin" / "vllm-router"  # .ci/bootstrap-vllm installs it
    path = (os.environ.get("KVPUSH_VLLM_ROUTER") or shutil.which("vllm-router")
            or (str(bundled) if bundled.exists() else None))
    return path if path and os.access(path, os.X_OK) else None


class _FakeWorker(Served):
    """A vLLM OpenAI server's surface as vllm-router's P/D mode uses it: a prefill answers
    with ``kv_transfer_params``, a decode with the completion. It records each request."""

    def __init__(self, role: Role) -> None:
        self.role = role
        self.requests: list[tuple[dict[str, str], dict[str, Any]]] = []
        worker = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._send({})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                worker.requests.append(({k.lower(): v for k, v in self.headers.items()}, body))
                text = "" if worker.role is Role.PREFILL else " decoded"
                reply: dict[str, Any] = {
                    "id": "cmpl-1", "object": "text_completion", "model": body.get("model"),
                    "choices": [{"index": 0, "text": text, "finish_reason": "length"}]}
                if worker.role is Role.PREFILL:
                    reply["kv_transfer_params"] = {"kvpush_transfer_id": "t-1"}
                self._send(reply)

        super().__init__(Handler)


class _VllmRouter:
    """vllm-router in P/D mode with ZeroMQ discovery, stopped by its pid."""

    def __init__(self, binary: str) -> None:
        self.port = _free_port()
        self.discovery = f"127.0.0.1:{_free_port()}"
        self.log = Path(tempfile.mkstemp(prefix="kvpush-vllm-router-", suffix=".log")[1])
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [binary, "--vllm-pd-disaggregation", "--vllm-discovery-address",
                 self.discovery, "--policy", "round_robin",  # every instance in turn
                 "--host", "127.0.0.1", "--port", str(self.port),
                 "--prometheus-port", str(_free_port())],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"vllm-router exited: {self.log.read_text()[-2000:]}")
            try:
                urllib.request.urlopen(self.url("/liveness"), timeout=1).close()
                return
            except OSError:
                time.sleep(0.1)
        self.close()
        raise AssertionError("vllm-router did not start in 30 s")

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def complete(self) -> tuple[int, str]:
        body = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 4}).encode()
        request = urllib.request.Request(self.url("/v1/completions"), data=body,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=10) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.unlink(missing_ok=True)


def _until(check: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result or time.monotonic() > deadline:
            return result
        time.sleep(0.1)


def test_vllm_router_follows_instances_through_the_bridge(client: EtcdClient,
                                                         prefix: str) -> None:
    binary = _router_binary()
    if binary is None:
        pytest.skip("vllm-router is not installed (pip install vllm-router==0.1.17, or set "
                    "KVPUSH_VLLM_ROUTER to its path)")
    workers = {name: _FakeWorker(role) for name, role in
               (("p0", Role.PREFILL), ("p1", Role.PREFILL), ("d0", Role.DECODE))}
    router = _VllmRouter(binary)
    pubs: list[Publisher] = []
    # the bridge as docs/DEPLOY.md runs it
    bridge = subprocess.Popen(
        [sys.executable, "-m", "kvpush.discovery", "--etcd", client.endpoints[0],
         "--prefix", prefix, "bridge", "--router", router.discovery, "--interval", "0.5"],
        cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    try:
        assert router.complete()[0] != 200  # nobody registered yet
        pubs = [Publisher(client, prefix, _prefill("p0", workers["p0"].address), ttl_s=3),
                Publisher(client, prefix, _decode("d0", workers["d0"].address), ttl_s=3)]
        for pub in pubs:
            pub.start()
        answer = _until(lambda: (r := router.complete())[0] == 200 and r, 10)
        assert answer, f"the router never routed: {router.complete()}"
        assert json.loads(answer[1])["choices"][0]["text"] == " decoded"
        headers, body = workers["p0"].requests[-1]
        assert body["max_tokens"] == 1
        assert body["kv_transfer_params"]["do_remote_decode"] is True
        assert headers["x-request-id"].startswith("___prefill_addr_tcp://127.0.0.1:5600")
        _, body = workers["d0"].requests[-1]
        assert body["kv_transfer_params"] == {"kvpush_transfer_id": "t-1"}
        assert body["max_tokens"] == 4

        # a second prefill instance joins: the running router takes it
        pubs.append(Publisher(client, prefix, _prefill("p1", workers["p1"].address),
                              ttl_s=3).start())
        pubs[0].drain()
        time.sleep(6)  # p0's last registration expires in the router
        before = len(workers["p0"].requests)
        for _ in range(3):
            assert router.complete()[0] == 200
        assert len(workers["p0"].requests) == before
        assert len(workers["p1"].requests) >= 3

        # a prefill instance whose record serves before its HTTP server listens (a
        # restart: the engine publishes while it starts): vllm-router would send it
        # requests and fail them (it does not retry a refused connection elsewhere), so
        # the bridge does not register it
        pubs.append(Publisher(client, prefix, _prefill("p2", f"127.0.0.1:{_free_port()}"),
                              ttl_s=3).start())
        time.sleep(1.5)  # three of the bridge's rounds
        for _ in range(4):
            status, text = router.complete()
            assert status == 200, text
        pubs[3].close()

        # every prefill gone: the router has no pair within its 5 s expiry
        pubs[2].close()
        assert _until(lambda: router.complete()[0] != 200, 10)
    finally:
        bridge.terminate()
        returncode = bridge.wait(10)
        for pub in pubs:
            pub.close()
        router.close()
        for worker in workers.values():
            worker.close()
    assert returncode == 0  # SIGTERM stops the bridge cleanly
