"""A multi-host vLLM deployment on one machine, for ``test_deploy_netns.py`` and its
benchmark: every vLLM instance, the routers and etcd each in a network namespace of its own
(hosts on one bridge, ``tests/support/netns_fabric.py``), UCX over TCP on each host's veth,
each instance's kvpush binding and advertising its host's address.

What runs where (``P`` prefill, ``D`` decode; every vLLM host uses the same ports, since each
namespace has its own port space):

* ``prefill-i`` / ``decode-j``: ``ip netns exec NS taskset -c CORE python -m
  vllm.entrypoints.openai.api_server --host IP --port 8000 ...`` with kvpush listening at
  ``tcp://IP:29600`` (prefill) and ``UCX_TLS=tcp,self UCX_NET_DEVICES=<the host's veth>``;
* the router host: vllm-router in P/D mode (pull: it sends the decode leg after the prefill
  answered) and kvpush's own router (``examples/vllm/router.py``: push, both legs at once),
  one process per route set;
* the etcd host: one etcd member (when discovery is used).

The test process reaches the hosts through :func:`connect_in`: a socket made by a thread
that entered the host's namespace (``setns``: a network namespace is per thread, and a
socket stays in the namespace it was made in), so nothing is added to the machine's own
namespace. Everything is started here and stopped by pid (:meth:`Deployment.close`), then
the namespaces are deleted; whatever would still run in one of them is killed by pid and
reported in :attr:`Deployment.leftovers`.
"""

from __future__ import annotations

import contextlib
import ctypes
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from examples.vllm import launch
from tests.support.netns_fabric import Fabric

#: Namespace and device names start with this (the library's netns tests use kvf / kvp).
PREFIX = "kvd"
HTTP_PORT = 8000
KV_PORT = 29600
ETCD_PORT = 2379
#: The deployment's key prefix in etcd.
ETCD_PREFIX = "/kvpush/deploy"
REPO = Path(__file__).resolve().parent.parent
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def vllm_router_binary() -> str | None:
    """vllm-router from .venv-vllm (``.ci/bootstrap-vllm`` installs it), PATH, or
    ``$KVPUSH_VLLM_ROUTER``."""
    bundled = Path(sys.executable).parent / "vllm-router"
    path = (os.environ.get("KVPUSH_VLLM_ROUTER")
            or (str(bundled) if bundled.exists() else None) or shutil.which("vllm-router"))
    return path if path and os.access(path, os.X_OK) else None


# -- reaching a namespace from this process ------------------------------------------------

def connect_in(ns: str, host: str, port: int, timeout: float) -> Any:
    """A TCP connection to ``host:port`` made from inside network namespace ``ns``."""
    import socket

    out: dict[str, Any] = {}

    def run() -> None:
        try:
            fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
            try:
                if _libc.setns(fd, CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns into {ns}: {os.strerror(err)}")
            finally:
                os.close(fd)
            out["sock"] = socket.create_connection((host, port), timeout=timeout)
        except BaseException as exc:  # handed to the caller
            out["error"] = exc

    thread = threading.Thread(target=run, name=f"connect-{ns}", daemon=True)
    thread.start()
    thread.join(timeout + 5)
    if "sock" in out:
        return out["sock"]
    if "error" in out:
        raise out["error"]
    raise TimeoutError(f"no connection to {host}:{port} in {ns} after {timeout + 5} s")


class _Connection(http.client.HTTPConnection):
    def __init__(self, ns: str, host: str, port: int, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self.ns = ns

    def connect(self) -> None:
        self.sock = connect_in(self.ns, self.host, self.port, float(self.timeout or 60))


def _open(ns: str, url: str, body: dict[str, Any] | None, timeout: float,
          headers: dict[str, str] | None = None
          ) -> tuple[_Connection, http.client.HTTPResponse]:
    parts = urlsplit(url)
    conn = _Connection(ns, parts.hostname or "", parts.port or 80, timeout)
    data = None if body is None else json.dumps(body).encode()
    try:
        conn.request("GET" if body is None else "POST", parts.path or "/", body=data,
                     headers={"Content-Type": "application/json", **(headers or {})})
        return conn, conn.getresponse()
    except BaseException:
        conn.close()
        raise


def http_json(ns: str, url: str, body: dict[str, Any] | None = None, timeout: float = 60.0,
              headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    """POST (GET without a body) JSON from namespace ``ns``: (status, parsed body)."""
    conn, resp = _open(ns, url, body, timeout, headers)
    try:
        status, text = resp.status, resp.read().decode(errors="replace")
    finally:
        conn.close()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, {"raw": text}


@dataclass
class Streamed:
    """One streamed completion as the client saw it."""

    status: int
    tokens: list[int]
    ttft_s: float            # request sent -> first chunk with a token
    token_times: list[float]  # monotonic time of each token's arrival
    error: str = ""

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first (0 with fewer than two)."""
        t = self.token_times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else 0.0


def stream(ns: str, url: str, body: dict[str, Any], timeout: float = 120.0) -> Streamed:
    """POST a streaming completion from ``ns``; the token ids and when each arrived."""
    start = time.monotonic()
    conn, resp = _open(ns, url, {**body, "stream": True}, timeout)
    tokens: list[int] = []
    times: list[float] = []
    try:
        if resp.status != 200:
            return Streamed(resp.status, [], 0.0, [], resp.read().decode(errors="replace"))
        while True:
            raw = resp.readline()
            if not raw:
                break
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            now = time.monotonic()
            for choice in event.get("choices", []):
                ids = choice.get("token_ids") or []
                tokens += ids
                times += [now] * len(ids)
            if "error" in event:
                return Streamed(500, tokens, 0.0, times, json.dumps(event["error"]))
    finally:
        conn.close()
    ttft = times[0] - start if times else 0.0
    return Streamed(200, tokens, ttft, times)


def metrics(ns: str, url: str, prefix: str = "vllm:") -> dict[str, float]:
    """Prometheus samples of ``url/metrics`` named ``prefix...`` (labels summed over)."""
    status, body = http_json(ns, url + "/metrics", timeout=10)
    text = body.get("raw", "") if status == 200 else ""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0]
        with contextlib.suppress(ValueError):
            out[name] = out.get(name, 0.0) + float(value)
    return out


# -- the deployment --------------------------------------------------------------------------

@dataclass
class Host:
    ns: str
    dev: str
    ip: str


@dataclass
class Service:
    """A process on a host: a vLLM instance, a router, etcd."""

    name: str
    host: Host
    port: int
    process: launch.Process
    health_path: str = "/health"

    @property
    def url(self) -> str:
        return f"http://{self.host.ip}:{self.port}"

    @property
    def producer(self) -> str:
        """A prefill instance's kvpush control address."""
        return f"tcp://{self.host.ip}:{KV_PORT}"


@dataclass
class Deployment:
    """``prefills`` + ``decodes`` vLLM instances, a router host and an etcd host.

    Build it with :meth:`start_instances`, then :meth:`wait_healthy`, then add routers
    (:meth:`vllm_router`, :meth:`kvpush_router`); :meth:`close` stops everything.
    """

    workdir: Path
    model: Path
    prefills: int
    decodes: int
    #: every instance publishes its records in etcd (``discovery_*`` keys), and kvpush's
    #: routers take a push's producers from them (``--discovery-etcd``)
    discovery: bool = False
    fabric: Fabric = field(init=False)
    client_ns: str = field(init=False)
    instances: dict[str, Service] = field(default_factory=dict)
    routers: dict[str, Service] = field(default_factory=dict)
    others: list[Service] = field(default_factory=list)
    #: "ns: pids" of processes found in a namespace after every service was stopped
    leftovers: list[str] = field(default_factory=list)
    closed: bool = False

    def __post_init__(self) -> None:
        self.logs = self.workdir / "deploy-logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.fabric = Fabric(self.prefills + self.decodes + 2, prefix=PREFIX)
        hosts = [Host(ns, dev, ip) for ns, dev, ip in
                 zip(self.fabric.ns, self.fabric.dev, self.fabric.ip, strict=True)]
        n = self.prefills + self.decodes
        self.hosts = {**{f"prefill-{i}": hosts[i] for i in range(self.prefills)},
                      **{f"decode-{j}": hosts[self.prefills + j] for j in range(self.decodes)},
                      "router": hosts[n], "etcd": hosts[n + 1]}
        # Requests are sent from the router host: the client sits next to its router.
        self.client_ns = self.hosts["router"].ns

    @property
    def namespaces(self) -> list[str]:
        return [h.ns for h in self.hosts.values()]

    # -- processes --------------------------------------------------------------------------
    def _spawn(self, name: str, host: Host, cmd: Sequence[str], env: dict[str, str],
               port: int, cores: str = "", scratch: Path | None = None) -> launch.Process:
        # ``ip netns exec`` and ``taskset`` exec: the pid is the service's own, and its
        # session (process group) holds every process it starts.
        return launch.spawn(name, ["ip", "netns", "exec", host.ns, *cmd],
                            self.logs / f"{name}.log", port, cores=cores, env=env,
                            cwd=self.logs, scratch=scratch, append=True,
                            stdin=subprocess.DEVNULL)

    def host_env(self, host: Host, cores: str = "") -> dict[str, str]:
        env = {**os.environ, **launch.BASE_ENV,
               "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": host.dev,
               "UCX_LOG_LEVEL": "error", "NIXL_LOG_LEVEL": "WARN",
               # vLLM looks for its own address through a default route, which a host
               # here has not: name it.
               "VLLM_HOST_IP": host.ip, "PYTHONUNBUFFERED": "1"}
        if cores:
            env["VLLM_CPU_OMP_THREADS_BIND"] = cores
        return env

    def start_instance(self, name: str, cores: str, *, extra_config: dict[str, Any] | None = None,
                       extra_args: Sequence[str] = ()) -> Service:
        host = self.hosts[name]
        role = "kv_producer" if name.startswith("prefill") else "kv_consumer"
        cfg: dict[str, Any] = {"host": host.ip, "advertise_host": host.ip}
        if role == "kv_producer":
            # A decode peer that dies is noticed within seconds: its blocks go back.
            cfg.update(port=KV_PORT, peer_timeout_s=5.0)
        else:
            cfg.update(peer_timeout_s=3.0, heartbeat_s=0.5, request_timeout_s=60.0)
        if self.discovery:
            # vllm-router keeps an instance 5 s after the bridge's last registration: a
            # draining instance waits longer than that before it may stop.
            cfg.update(discovery_etcd=self.etcd_url, discovery_prefix=ETCD_PREFIX,
                       discovery_instance=name,
                       discovery_http_address=f"{host.ip}:{HTTP_PORT}",
                       discovery_ttl_s=3, discovery_drain_grace_s=6.0)
        cfg.update(extra_config or {})
        cmd = ["taskset", "-c", cores, sys.executable, "-m",
               "vllm.entrypoints.openai.api_server", "--model", str(self.model),
               "--served-model-name", "tiny", "--host", host.ip, "--port", str(HTTP_PORT),
               "--block-size", "32", "--max-model-len", "4096",
               "--disable-uvicorn-access-log", "-O0", "--max-num-seqs", "16",
               "--kv-transfer-config",
               json.dumps(launch.kvpush_config(role, cfg.pop("port", 0), **cfg)),
               *extra_args]
        scratch = launch.rpc_folder(name)
        env = {**self.host_env(host, cores), **launch.scratch_env(scratch)}
        proc = self._spawn(name, host, cmd, env, HTTP_PORT, cores, scratch)
        service = Service(name, host, HTTP_PORT, proc)
        self.instances[name] = service
        return service

    def start_instances(self) -> None:
        """Every instance at once; prefill-i and decode-j alternate over the two cores."""
        for i in range(self.prefills):
            self.start_instance(f"prefill-{i}", str(i % 2))
        for j in range(self.decodes):
            self.start_instance(f"decode-{j}", str((j + 1) % 2))

    @property
    def etcd_url(self) -> str:
        return f"http://{self.hosts['etcd'].ip}:{ETCD_PORT}"

    def start_etcd(self) -> Service:
        host = self.hosts["etcd"]
        url = self.etcd_url
        peer = f"http://{host.ip}:{ETCD_PORT + 1}"
        data = self.workdir / "etcd-data"
        cmd = ["etcd", "--name", "kvdep", "--data-dir", str(data),
               "--listen-client-urls", url, "--advertise-client-urls", url,
               "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
               "--initial-cluster", f"kvdep={peer}", "--log-level", "warn"]
        service = Service("etcd", host, ETCD_PORT,
                          self._spawn("etcd", host, cmd, dict(os.environ), ETCD_PORT))
        self.others.append(service)
        self.wait_healthy([service], 30)
        return service

    def vllm_router(self, name: str, port: int, prefills: Sequence[str],
                    decodes: Sequence[str]) -> Service:
        """vllm-router in P/D mode over the named instances (static lists), round robin."""
        binary = vllm_router_binary()
        if binary is None:
            raise RuntimeError("vllm-router not found (.ci/bootstrap-vllm installs it)")
        host = self.hosts["router"]
        cmd = [binary, "--vllm-pd-disaggregation", "--host", host.ip, "--port", str(port),
               "--policy", "round_robin", "--prometheus-host", host.ip,
               "--prometheus-port", str(port + 1000)]
        for p in prefills:
            cmd += ["--prefill", self.instances[p].url]
        for d in decodes:
            cmd += ["--decode", self.instances[d].url]
        service = Service(name, host, port, self._spawn(name, host, cmd, dict(os.environ), port),
                          health_path="/liveness")
        self.routers[name] = service
        return service

    def bridged_vllm_router(self, name: str, port: int) -> Service:
        """vllm-router in P/D mode with no static worker: kvpush's bridge registers every
        serving instance of the etcd records with it (``python -m kvpush.discovery
        bridge``), so instances join and leave it while it runs."""
        binary = vllm_router_binary()
        if binary is None:
            raise RuntimeError("vllm-router not found (.ci/bootstrap-vllm installs it)")
        host = self.hosts["router"]
        zmq = f"{host.ip}:{port + 2000}"
        cmd = [binary, "--vllm-pd-disaggregation", "--vllm-discovery-address", zmq,
               "--host", host.ip, "--port", str(port), "--policy", "round_robin",
               "--prometheus-host", host.ip, "--prometheus-port", str(port + 1000)]
        service = Service(name, host, port, self._spawn(name, host, cmd, dict(os.environ), port),
                          health_path="/liveness")
        self.routers[name] = service
        bridge = self.discovery_cmd("bridge", "--router", zmq, "--interval", "0.5")
        self.others.append(Service(f"{name}-bridge", host, 0, self._spawn(
            f"{name}-bridge", host, bridge, dict(os.environ), 0)))
        return service

    def discovery_cmd(self, *args: str) -> list[str]:
        """``python -m kvpush.discovery`` against this deployment's etcd and prefix."""
        return [sys.executable, "-m", "kvpush.discovery", "--etcd", self.etcd_url,
                "--prefix", ETCD_PREFIX, *args]

    def run_discovery(self, *args: str, timeout: float = 150.0
                      ) -> subprocess.CompletedProcess[str]:
        """Run ``python -m kvpush.discovery ARGS`` on the router host."""
        return subprocess.run(["ip", "netns", "exec", self.hosts["router"].ns,
                               *self.discovery_cmd(*args)], capture_output=True, text=True,
                              timeout=timeout, cwd=str(self.logs))

    def kvpush_router(self, name: str, port: int, prefill: str,
                      decodes: Sequence[str]) -> Service:
        """kvpush's router (``examples/vllm/router.py``): one prefill instance, decodes in
        turn; push sends both legs at once."""
        host = self.hosts["router"]
        cmd = [sys.executable, str(REPO / "examples/vllm/router.py"), "--host", host.ip,
               "--port", str(port), "--prefill", self.instances[prefill].url,
               "--decode", *(self.instances[d].url for d in decodes),
               "--mode", "push"]
        if self.discovery:  # the prefill's producers from its record
            cmd += ["--discovery-etcd", self.etcd_url, "--discovery-prefix", ETCD_PREFIX]
        else:
            cmd += ["--producers", self.instances[prefill].producer]
        service = Service(name, host, port, self._spawn(name, host, cmd, dict(os.environ), port))
        self.routers[name] = service
        return service

    def wait_healthy(self, services: Sequence[Service], timeout_s: float) -> None:
        pending = list(services)
        deadline = time.monotonic() + timeout_s
        while pending:
            for s in list(pending):
                if not s.process.alive():
                    raise RuntimeError(f"{s.name} exited with {s.process.proc.returncode}:\n"
                                       f"{s.process.log_tail()}")
                try:
                    status, _ = http_json(s.host.ns, s.url + s.health_path, timeout=2)
                except OSError:
                    status = 0
                if status == 200:
                    pending.remove(s)
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"{[s.name for s in pending]} not healthy after "
                                   f"{timeout_s} s:\n"
                                   + "\n".join(s.process.log_tail() for s in pending))
            if pending:
                time.sleep(0.5)

    # -- measurements ------------------------------------------------------------------------
    def rx_bytes(self, name: str) -> int:
        """Bytes received so far on ``name``'s host veth."""
        host = self.hosts[name]
        out = subprocess.run(["ip", "-n", host.ns, "-j", "-s", "link", "show", "dev", host.dev],
                             capture_output=True, text=True, timeout=10, check=True).stdout
        return int(json.loads(out)[0]["stats64"]["rx"]["bytes"])

    def shape_into(self, name: str, rate: str | None) -> None:
        """Limit what reaches ``name``'s host to ``rate`` (``tc tbf`` on its bridge port;
        None lifts it)."""
        i = self.fabric.ns.index(self.hosts[name].ns)
        cmd = ["ip", "netns", "exec", self.fabric.hub, "tc", "qdisc"]
        dev = ["dev", self.fabric.hub_dev[i], "root"]
        if rate is None:
            subprocess.run([*cmd, "del", *dev], capture_output=True, timeout=10)
        else:
            subprocess.run([*cmd, "replace", *dev, "tbf", "rate", rate, "burst", "32kbit",
                            "latency", "400ms"], check=True, capture_output=True, timeout=10)

    def metrics(self, name: str) -> dict[str, float]:
        s = self.instances[name]
        return metrics(self.client_ns, s.url)

    def complete(self, router: str, prompt: list[int], max_tokens: int,
                 timeout: float = 120.0, **extra: Any) -> tuple[int, dict[str, Any]]:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "return_token_ids": True, **extra}
        return http_json(self.client_ns, self.routers[router].url + "/v1/completions", body,
                         timeout=timeout)

    def stream(self, router: str, prompt: list[int], max_tokens: int,
               timeout: float = 120.0, **extra: Any) -> Streamed:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "return_token_ids": True, **extra}
        return stream(self.client_ns, self.routers[router].url + "/v1/completions", body,
                      timeout=timeout)

    # -- teardown ----------------------------------------------------------------------------
    def services(self) -> Iterator[Service]:
        yield from self.routers.values()
        yield from self.instances.values()
        yield from self.others

    def close(self) -> None:
        """Stop every service by pid (its whole process group), kill by pid whatever still
        runs in one of the namespaces (recorded in :attr:`leftovers`), delete them."""
        if self.closed:
            return
        self.closed = True
        for s in list(self.services()):
            s.process.stop()
        for ns in self.namespaces:
            pids = _pids_in(ns)
            if pids:
                self.leftovers.append(f"{ns}: {pids}")
                for pid in pids:  # only ever ours: these namespaces are this test's own
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                deadline = time.monotonic() + 10
                while _pids_in(ns) and time.monotonic() < deadline:
                    time.sleep(0.1)
        self.fabric.close()


def _pids_in(ns: str) -> list[int]:
    done = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                          timeout=10)
    return [int(p) for p in done.stdout.split()]


def namespaces_present(prefix: str = PREFIX) -> list[str]:
    """The network namespaces whose name starts with ``prefix``."""
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    return [line.split()[0] for line in done.stdout.splitlines()
            if line.startswith(prefix)]
