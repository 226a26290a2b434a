"""A starved host: busy processes load every core while push and pull run. No handshake or
transfer may fail spuriously; every request completes correctly or fails with a status,
never hangs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest

import kvpush
from kvpush import RequestState, TransferMode
from tests.support.harness import CANARY, ChildProducer, check_blocks, make_cache

SEED = 11
CACHE = dict(num_blocks=256, num_layers=2)
BURN_S = 40  # each burner stops itself after this long, even if the test dies


@pytest.fixture()
def burners() -> Iterator[list[subprocess.Popen[bytes]]]:
    code = f"import time\nend = time.monotonic() + {BURN_S}\nwhile time.monotonic() < end: pass\n"
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(os.cpu_count() or 2)]
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
            p.wait(10)


def test_push_and_pull_under_full_cpu_load(burners: list) -> None:
    child = ChildProducer(seed=SEED, cache=CACHE, timeout=120)
    cache = make_cache(**CACHE)
    for buf in cache.buffers:
        buf[:] = CANARY
    rng = np.random.default_rng(5)
    try:
        with kvpush.Consumer(cache.layout) as consumer:
            t0 = time.monotonic()
            name = consumer.connect(child.address, timeout=60)
            for mode in (TransferMode.PUSH, TransferMode.PULL):
                for batch in range(4):
                    dst_all = rng.permutation(CACHE["num_blocks"])
                    reqs = []
                    for i in range(25):
                        n = int(rng.integers(0, 8))
                        dst = dst_all[i * 8:i * 8 + n]
                        src = rng.choice(CACHE["num_blocks"], size=n, replace=False)
                        reqs.append((f"{mode.value}-{batch}-{i}", src, dst))
                    if mode is TransferMode.PUSH:
                        handles = [consumer.expect(r, d, name) for r, _, d in reqs]
                        child.call("prefill_done_many", [(r, s, "push") for r, s, _ in reqs])
                    else:
                        tickets = child.call("prefill_done_many",
                                             [(r, s, "pull") for r, s, _ in reqs])
                        handles = [consumer.pull(t, d) for t, (_, _, d) in zip(tickets, reqs,
                                                                                strict=True)]
                    for h in handles:
                        result = h.wait(60)
                        assert result.state is RequestState.READY, result
                    for _, s, d in reqs:
                        check_blocks(cache, d, s, SEED)
                    assert len(child.released(len(reqs), timeout=60)) == len(reqs)
            assert all(p.poll() is None for p in burners), "the load stopped before the test"
            assert consumer.stats()["peers_lost"] == 0
            print(f"200 requests under load in {time.monotonic() - t0:.1f} s")
    finally:
        child.close()
