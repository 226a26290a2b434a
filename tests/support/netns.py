"""Two hosts on one machine: network namespaces joined by a veth pair, and kvpush endpoints
running in them as child processes driven over a line-based JSON pipe.

Why namespaces. On one host NIXL/UCX would move bytes through shared memory or CMA, which
work across network namespaces too (they do not use the network). To make UCX really cross
an interface, every node runs with ``UCX_TLS=tcp,self`` and ``UCX_NET_DEVICES=<its veth>``:
the only way between the two namespaces is the veth pair, so cutting it (``ip link set ...
down``) or shaping it (``tc ... tbf``) acts on both the control plane (ZeroMQ) and the data
plane (UCX over TCP).

Everything here is made and removed by its owner: :class:`Link` creates the namespaces and
the veth (names ``kvp<pid><random byte><n><a|b|x|y>``, unique per link even across
containers that share the host's namespace list) and deletes them in :meth:`Link.close`;
a :class:`Node` is one ``ip netns exec NS python -m tests.support.netns_node`` process
(``ip netns exec`` execs, so the Popen pid *is* the Python process), stopped by its pid.
Every call takes a timeout. Where namespaces cannot be made (not root, no ``ip``, no
permission), :func:`netns_unavailable` says why, and fixtures skip with that reason.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from tests.support import ROOT

__all__ = ["Ledger", "Link", "Node", "NodeError", "netns_unavailable", "node_env"]

NODE_MODULE = "tests.support.netns_node"
_counter = itertools.count()


def _ip(*args: str, check: bool = True, timeout: float = 10.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout,
                          check=check)


_unavailable: str | None = None
_probed = False


def netns_unavailable() -> str | None:
    """None where this process can make network namespaces and veth pairs, else why not."""
    global _unavailable, _probed
    if _probed:
        return _unavailable
    _probed = True
    if not sys.platform.startswith("linux"):
        _unavailable = "network namespaces need Linux"
    elif shutil.which("ip") is None:
        _unavailable = "the `ip` tool (iproute2) is not installed"
    elif os.geteuid() != 0:
        _unavailable = "creating network namespaces needs root"
    else:
        probe = f"kvp{os.getpid()}{secrets.token_hex(2)}p"
        made = None
        try:
            made = _ip("netns", "add", probe, check=False)
            if made.returncode != 0:
                _unavailable = f"`ip netns add` failed: {made.stderr.strip()}"
            else:
                veth = _ip("-n", probe, "link", "add", f"{probe}x", "type", "veth", "peer",
                           "name", f"{probe}y", check=False)
                if veth.returncode != 0:
                    _unavailable = f"cannot create a veth pair: {veth.stderr.strip()}"
        except (OSError, subprocess.SubprocessError) as exc:
            _unavailable = f"cannot run `ip`: {exc}"
        finally:
            if made is not None and made.returncode == 0:  # only what this probe made
                subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)
    return _unavailable


class Link:
    """Two namespaces, ``a`` (producer side) and ``b`` (consumer side), joined by a veth pair.

    ``a_ip`` / ``b_ip`` are the two ends' addresses; ``a_dev`` / ``b_dev`` the interface
    names (pass them as ``UCX_NET_DEVICES``). :meth:`close` deletes everything, and is safe
    to call twice.
    """

    def __init__(self) -> None:
        reason = netns_unavailable()
        if reason is not None:
            raise RuntimeError(f"network namespaces unavailable: {reason}")
        n = next(_counter)
        self._made: list[str] = []
        self._shaped = False
        # Namespace names are global to the host, and other containers (other pid
        # namespaces) make theirs too: pid + a random byte + a counter, and never reuse a
        # name that exists (``ip netns add`` refuses it; we retry with another).
        for _attempt in range(8):
            tag = f"kvp{os.getpid()}{secrets.token_hex(1)}{n}"
            made = _ip("netns", "add", f"{tag}a", check=False)
            if made.returncode == 0:
                self._made.append(f"{tag}a")
                break
        else:
            raise RuntimeError(f"cannot create a network namespace: {made.stderr.strip()}")
        self.a_ns, self.b_ns = f"{tag}a", f"{tag}b"
        self.a_dev, self.b_dev = f"{tag}x", f"{tag}y"
        # Namespaces are private, so these addresses cannot clash with anyone's; distinct
        # per link anyway, to keep logs readable.
        net = f"10.{200 + n % 50}.{os.getpid() % 250}"
        self.a_ip, self.b_ip = f"{net}.1", f"{net}.2"
        try:
            _ip("netns", "add", self.b_ns)
            self._made.append(self.b_ns)
            _ip("-n", self.a_ns, "link", "add", self.a_dev, "type", "veth", "peer", "name",
                self.b_dev, "netns", self.b_ns)
            for ns, dev, ip in ((self.a_ns, self.a_dev, self.a_ip),
                                (self.b_ns, self.b_dev, self.b_ip)):
                _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "link", "set", dev, "up")
        except BaseException:
            self.close()
            raise

    def cut(self) -> None:
        """Take the link down (both ends): every packet between the namespaces is lost."""
        _ip("-n", self.a_ns, "link", "set", self.a_dev, "down")
        _ip("-n", self.b_ns, "link", "set", self.b_dev, "down")

    def restore(self) -> None:
        _ip("-n", self.a_ns, "link", "set", self.a_dev, "up")
        _ip("-n", self.b_ns, "link", "set", self.b_dev, "up")

    def shape(self, rate: str = "40mbit") -> None:
        """Limit the producer side's egress (the data of both WRITE and READ) to ``rate``,
        with a short queue (50 ms), so transfers last long enough to be hit mid-way while
        control messages still get through."""
        subprocess.run(["ip", "netns", "exec", self.a_ns, "tc", "qdisc", "replace", "dev",
                        self.a_dev, "root", "tbf", "rate", rate, "burst", "32kbit", "latency",
                        "50ms"], check=True, capture_output=True, timeout=10)
        self._shaped = True

    def unshape(self) -> None:
        if self._shaped:
            subprocess.run(["ip", "netns", "exec", self.a_ns, "tc", "qdisc", "del", "dev",
                            self.a_dev, "root"], capture_output=True, timeout=10)
            self._shaped = False

    def rx_bytes(self) -> int:
        """Bytes received by the consumer-side end so far."""
        out = _ip("-n", self.b_ns, "-j", "-s", "link", "show", "dev", self.b_dev).stdout
        return int(json.loads(out)[0]["stats64"]["rx"]["bytes"])

    def tx_bytes(self) -> int:
        """Bytes sent by the consumer-side end so far."""
        out = _ip("-n", self.b_ns, "-j", "-s", "link", "show", "dev", self.b_dev).stdout
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])

    def sockets(self) -> str:
        """``ss -tni`` in both namespaces (for failure messages: stuck TCP queues)."""
        out = []
        for ns in (self.a_ns, self.b_ns):
            text = subprocess.run(["ip", "netns", "exec", ns, "ss", "-tni"], capture_output=True,
                                  text=True, timeout=10).stdout
            out.append(f"[{ns}]\n{text}")
        return "\n".join(out)

    def close(self) -> None:
        # Deleting a namespace deletes the veth end inside it, and with it the pair. A
        # namespace a live process still sits in would outlive its name: owners stop their
        # nodes first.
        while self._made:
            ns = self._made.pop()
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)

    def __enter__(self) -> Link:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def node_env(device: str | None) -> dict[str, str]:
    """Environment of a node: UCX over TCP only, on ``device`` when given."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["UCX_TLS"] = "tcp,self"
    if device:
        env["UCX_NET_DEVICES"] = device
    env.setdefault("NIXL_LOG_LEVEL", "WARN")
    env.setdefault("UCX_LOG_LEVEL", "error")
    # A node that dies leaves where: UCX's native backtrace on a fatal error, and every
    # Python thread's stack on SIGABRT/SIGSEGV (both go to the node's log).
    env.setdefault("UCX_HANDLE_ERRORS", "bt")
    env.setdefault("PYTHONFAULTHANDLER", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


class NodeError(RuntimeError):
    """A node answered a command with an error, died, or did not answer in time."""


class Node:
    """One kvpush endpoint (producer or consumer) in a child process, in namespace ``netns``
    (None: this namespace).

    :meth:`call` sends one JSON command and waits at most ``timeout`` seconds for its answer.
    The child's stderr goes to :attr:`log_path` (shown by :meth:`log_tail` on failures).
    """

    def __init__(self, label: str, netns: str | None, device: str | None,
                 env: dict[str, str] | None = None, start_timeout: float = 30.0) -> None:
        self.label = label
        self.netns = netns
        cmd = [sys.executable, "-m", NODE_MODULE]
        if netns is not None:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        fd, path = tempfile.mkstemp(prefix=f"kvp-{label}-", suffix=".log")
        self.log_path = Path(path)
        full_env = node_env(device)
        full_env.update(env or {})
        try:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=fd, env=full_env, cwd=str(ROOT), bufsize=0)
        finally:
            os.close(fd)
        self.pid = self.proc.pid
        self.name = ""       # the endpoint's name, once started
        self.address = ""    # a producer's control address, once started
        self._buf = b""
        self._seq = 0
        self.stopped = False
        #: what the node reported as still live when it closed (``exit``): None until then
        self.final: dict[str, Any] | None = None
        try:
            hello = self._read(start_timeout)
            if hello.get("value") != "ready":
                raise NodeError(f"{label}: unexpected greeting {hello}")
        except BaseException:
            self.kill()
            raise

    # -- the pipe --------------------------------------------------------------------------
    def _read(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        out = self.proc.stdout
        assert out is not None
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise NodeError(f"{self.label} (pid {self.pid}) did not answer within "
                                f"{timeout} s; log tail:\n{self.log_tail()}")
            ready, _, _ = select.select([out], [], [], left)
            if not ready:
                continue
            chunk = os.read(out.fileno(), 1 << 20)
            if not chunk:
                raise NodeError(f"{self.label} (pid {self.pid}) exited (rc "
                                f"{self.proc.poll()}); log tail:\n{self.log_tail()}")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        msg: dict[str, Any] = json.loads(line)
        return msg

    def call(self, cmd: str, timeout: float = 30.0, **args: Any) -> Any:
        """Run ``cmd`` in the node; returns its value or raises :class:`NodeError`."""
        self._seq += 1
        seq = self._seq
        data = (json.dumps({"seq": seq, "cmd": cmd, "args": args}) + "\n").encode()
        stdin = self.proc.stdin
        assert stdin is not None
        try:
            stdin.write(data)
        except (BrokenPipeError, OSError) as exc:
            raise NodeError(f"{self.label} (pid {self.pid}) is gone: {exc}") from exc
        while True:
            msg = self._read(timeout)
            if msg.get("seq") == seq:
                break  # answers to calls abandoned after a timeout are skipped
        if not msg["ok"]:
            raise NodeError(f"{self.label}: {cmd} failed: {msg['error']}")
        return msg["value"]

    def start(self, role: str, cache: dict[str, Any], config: dict[str, Any],
              seed: int = 1, scrub_on_result: bool = False,
              scrub_on_release: bool = False) -> Node:
        """Create the node's Producer or Consumer; returns self (see netns_node for the
        two ``scrub`` options: blocks reused by the engine once kvpush gives them back)."""
        info = self.call("start", role=role, cache=cache, seed=seed, config=config,
                         scrub_on_result=scrub_on_result, scrub_on_release=scrub_on_release)
        self.name, self.address = info["name"], info["address"]
        return self

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    # -- signals ---------------------------------------------------------------------------
    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        """SIGSTOP: the whole process freezes (a stalled host, a long GC pause)."""
        os.kill(self.pid, signal.SIGSTOP)
        self.stopped = True

    def cont(self) -> None:
        os.kill(self.pid, signal.SIGCONT)
        self.stopped = False

    def kill(self, timeout: float = 10.0) -> None:
        """SIGKILL by pid and reap; no-op once exited."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired as exc:
                raise NodeError(f"{self.label} (pid {self.pid}) survived SIGKILL") from exc
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()

    def close(self, timeout: float = 15.0) -> int | None:
        """Ask the node to close its endpoint and exit; SIGKILL if it does not in time.
        Returns the exit code (None if it had to be killed)."""
        rc: int | None = None
        if self.proc.poll() is None:
            if self.stopped:
                self.cont()
            try:
                self.final = self.call("exit", timeout=timeout)
                rc = self.proc.wait(timeout)
            except (NodeError, subprocess.TimeoutExpired):
                rc = None
        else:
            rc = self.proc.returncode
        self.kill()
        keep = os.environ.get("KVPUSH_TEST_LOGS")  # a folder: every node's log is kept there
        with contextlib.suppress(OSError):
            if keep:
                Path(keep).mkdir(parents=True, exist_ok=True)
                shutil.move(self.log_path, Path(keep) / self.log_path.name)
            else:
                self.log_path.unlink()
        return rc


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


class Ledger:
    """Every Release and every result seen, by request id, to check "exactly once"."""

    def __init__(self) -> None:
        self.releases: dict[str, list[str]] = defaultdict(list)
        self.results: dict[str, list[dict[str, Any]]] = defaultdict(list)

    def drain_producer(self, node: Node, timeout: float = 10.0) -> list[list[Any]]:
        got: list[list[Any]] = node.call("released", timeout=timeout)
        for rid, reason, _nblocks, _detail in got:
            self.releases[rid].append(reason)
        return got

    def drain_consumer(self, node: Node, timeout: float = 10.0) -> list[dict[str, Any]]:
        got: list[dict[str, Any]] = node.call("results", timeout=timeout)
        for result in got:
            self.results[result["rid"]].append(result)
        return got

    def repeated(self) -> dict[str, Any]:
        """Request ids released or reported more than once (must stay empty)."""
        out: dict[str, Any] = {r: v for r, v in self.releases.items() if len(v) > 1}
        out.update({r: [x["state"] for x in v] for r, v in self.results.items() if len(v) > 1})
        return out
