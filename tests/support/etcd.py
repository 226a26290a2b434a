"""A private etcd for a test: its own data directory and free ports on 127.0.0.1, started
and stopped by pid.

The binary is Debian's ``etcd-server`` (etcd 3.4). Where it is missing and this process is
root with apt, :func:`etcd_binary` installs it (``apt-get install etcd-server``, after one
``apt-get update`` if the first try fails); the package's own system service is not used.
Where etcd cannot be had, :func:`etcd_unavailable` says why and fixtures skip with that
reason. Every wait takes a timeout.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

_INSTALL_TRIED: list[str] = []  # one attempt per test session: its outcome


def _install() -> str | None:
    """Try to install etcd-server with apt; None on success, else why not."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return "etcd is not installed and this is not root with apt-get"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "etcd-server"]
    try:
        if subprocess.run(cmd, env=env, capture_output=True, timeout=300).returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True,
                           timeout=300)
            done = subprocess.run(cmd, env=env, capture_output=True, timeout=300)
            if done.returncode != 0:
                return f"apt-get install etcd-server failed: {done.stderr[-300:]!r}"
    except subprocess.TimeoutExpired:
        return "apt-get install etcd-server took over 300 s"
    if shutil.which("etcd") is None:
        return "etcd-server installed but no etcd on PATH"
    return None


def etcd_unavailable() -> str | None:
    """Why etcd cannot run here (None: it can), installing it once if needed."""
    if shutil.which("etcd") is not None:
        return None
    if not _INSTALL_TRIED:
        _INSTALL_TRIED.append(_install() or "")
    return _INSTALL_TRIED[0] or None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EtcdServer:
    """One etcd member on 127.0.0.1, its data in a temporary directory removed by
    :meth:`close`. :meth:`stop` and :meth:`start` again keep the data and the ports (etcd
    down and back)."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvpush-etcd-"))
        self.client_port = _free_port()
        self.peer_port = _free_port()
        self.url = f"http://127.0.0.1:{self.client_port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 20.0) -> EtcdServer:
        peer = f"http://127.0.0.1:{self.peer_port}"
        log = open(self.dir / "etcd.log", "ab")  # noqa: SIM115 - kept by the child
        try:
            self.proc = subprocess.Popen(
                ["etcd", "--name", "kvpush-test", "--data-dir", str(self.dir / "data"),
                 "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                 "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", f"kvpush-test={peer}", "--log-level", "warn"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as resp:
                    if b'"true"' in resp.read():
                        return self
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"etcd did not become healthy in {timeout} s: {self.log_tail()}")

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the member by its pid (SIGTERM, then SIGKILL after ``timeout``)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def log_tail(self, n: int = 2000) -> str:
        try:
            return (self.dir / "etcd.log").read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def __enter__(self) -> EtcdServer:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()
