"""Many hosts on one machine: N network namespaces, each with one veth into a bridge that
lives in a hub namespace of its own (so nothing touches the host's namespace). Made and
deleted by its owner; see tests/support/netns.py for the two-host link and the Node driver."""

from __future__ import annotations

import os
import secrets
import subprocess

from tests.support.netns import netns_unavailable


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=True)


class Fabric:
    """``n`` hosts ``ns[i]`` with device ``dev[i]`` and address ``ip[i]``, all on one
    bridge. :meth:`close` deletes every namespace (and with them the veths and bridge).
    ``prefix`` starts every namespace and device name, so two users of fabrics (the library
    tests, the vLLM deployment test) never make the same name; keep it to 3 characters,
    since a device name is at most 15."""

    def __init__(self, n: int, prefix: str = "kvf") -> None:
        reason = netns_unavailable()
        if reason is not None:
            raise RuntimeError(f"network namespaces unavailable: {reason}")
        tag = f"{prefix}{os.getpid()}{secrets.token_hex(1)}"
        self._made: list[str] = []
        self.ns = [f"{tag}{i}" for i in range(n)]
        self.dev = [f"{tag}{i}e" for i in range(n)]
        net = f"10.251.{os.getpid() % 250}"
        self.ip = [f"{net}.{i + 1}" for i in range(n)]
        hub = f"{tag}h"
        #: the bridge's namespace, and in it each host's peer end (``tc`` there shapes
        #: what reaches host i)
        self.hub, self.hub_dev = hub, [f"{tag}{i}h" for i in range(n)]
        try:
            _ip("netns", "add", hub)
            self._made.append(hub)
            _ip("-n", hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", hub, "link", "set", "br0", "up")
            for i, ns in enumerate(self.ns):
                _ip("netns", "add", ns)
                self._made.append(ns)
                hub_end = f"{tag}{i}h"
                _ip("-n", hub, "link", "add", hub_end, "type", "veth", "peer", "name",
                    self.dev[i], "netns", ns)
                _ip("-n", hub, "link", "set", hub_end, "master", "br0")
                _ip("-n", hub, "link", "set", hub_end, "up")
                _ip("-n", ns, "addr", "add", f"{self.ip[i]}/24", "dev", self.dev[i])
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "link", "set", self.dev[i], "up")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        while self._made:
            subprocess.run(["ip", "netns", "del", self._made.pop()], capture_output=True,
                           timeout=10)

    def __enter__(self) -> Fabric:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
