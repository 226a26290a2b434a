"""A private etcd for the discovery tests (one per module), and a fresh key prefix per
test so that tests sharing it never see each other's records."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator

import pytest

from kvpush.discovery import EtcdClient
from tests.support.etcd import EtcdServer, etcd_unavailable

_PREFIXES = itertools.count()


@pytest.fixture(scope="module")
def etcd_server() -> Iterator[EtcdServer]:
    why = etcd_unavailable()
    if why:
        pytest.skip(f"no etcd: {why}")
    with EtcdServer() as server:
        yield server


@pytest.fixture
def client(etcd_server: EtcdServer) -> EtcdClient:
    return EtcdClient(etcd_server.url, timeout=2.0)


@pytest.fixture
def prefix() -> str:
    return f"/kvpush-test/{os.getpid()}-{next(_PREFIXES)}"
