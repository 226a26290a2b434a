"""The GPU path's parts that run anywhere: host staging's copies (over CPU tensors standing
for the device caches: the same indexing, run synchronously), the readiness queue that
hands a request over once its own event has completed (events stood in for by
threading.Event), and that no stream is synchronised in the adapter. The CUDA runs are in
``tests_gpu/`` (``bash .ci/run-gpu``)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

import kvpush.integrations as integrations
from kvpush.integrations.vllm_staging import DONE, HostStaging, Readiness, block_runs


def caches() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    out = {f"model.layers.{i}.self_attn.attn":
           torch.randn(16, 2, 32, 128, generator=g).to(torch.bfloat16) for i in range(3)}
    out["model.layers.3.self_attn.attn"] = out["model.layers.2.self_attn.attn"]  # shared
    return out


def test_block_runs_group_consecutive_ids() -> None:
    assert block_runs([7, 3, 4, 5, 9, 8, 1]) == [(1, 2), (3, 6), (7, 10)]
    assert block_runs([]) == []


def test_staging_copies_only_the_named_blocks_both_ways() -> None:
    dev = caches()
    staging = HostStaging(dev, pin=False)
    names = list(dev)
    assert staging.host[names[2]] is staging.host[names[3]]      # one mirror per tensor
    assert staging.nbytes == 3 * dev[names[0]].numel() * 2
    for name in names:
        staging.host[name].zero_()
    ids = [9, 3, 4, 12]
    assert staging.to_host(ids) is DONE                           # CPU: done at once
    for name in names:
        host, src = staging.host[name], dev[name]
        assert torch.equal(host[ids], src[ids])
        others = [b for b in range(16) if b not in ids]
        assert not host[others].any()
    # One layer only (layer-wise push with staging).
    staging.host[names[0]].zero_()
    staging.host[names[1]].zero_()
    staging.to_host([5], layers=[names[1]])
    assert not staging.host[names[0]].any() and torch.equal(staging.host[names[1]][5],
                                                             dev[names[1]][5])
    # Landed in the mirror -> the device blocks, nothing else.
    before = {n: t.clone() for n, t in dev.items()}
    for name in names:
        staging.host[name][[1, 2]] = 3.0
    staging.to_device([1, 2])
    for name in names:
        assert (dev[name][[1, 2]] == 3.0).all()
        keep = [b for b in range(16) if b not in (1, 2)]
        assert torch.equal(dev[name][keep], before[name][keep])


class Gate:
    """An event that completes when the test says so."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def query(self) -> bool:
        return self.done.is_set()

    def synchronize(self) -> None:
        assert self.done.wait(10)


def test_readiness_waits_for_each_event_in_order_off_the_callers_thread() -> None:
    ready = Readiness()
    ran: list[tuple[str, str]] = []
    first, second = Gate(), Gate()
    try:
        ready.when_ready(DONE, lambda: ran.append(("now", threading.current_thread().name)))
        assert ran == [("now", threading.main_thread().name)]    # nothing queued: inline
        ready.when_ready(first, lambda: ran.append(("a", threading.current_thread().name)))
        ready.when_ready(second, lambda: ran.append(("b", "")))
        ready.when_ready(DONE, lambda: ran.append(("c", "")))      # queued behind them
        time.sleep(0.1)
        assert len(ran) == 1 and ready.pending == 3               # waits, returns at once
        second.done.set()
        time.sleep(0.1)
        assert len(ran) == 1                                       # still in order
        first.done.set()
        deadline = time.monotonic() + 5
        while ready.pending:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert [k for k, _ in ran] == ["now", "a", "b", "c"]
        assert ran[1][1] == "kvpush-vllm-ready"
    finally:
        ready.close()
    assert ready._thread is None


def test_no_stream_is_synchronised_in_the_adapter() -> None:
    """Readiness is per request (an event), never the whole stream or device per step."""
    root = Path(integrations.__file__).parent
    for path in sorted(root.glob("*.py")):
        text = path.read_text()
        for banned in ("current_stream().synchronize", "cuda.synchronize(",
                       "stream.synchronize("):
            assert banned not in text, f"{path.name}: {banned}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
def test_record_event_on_cpu_is_done() -> None:
    from kvpush.integrations.vllm_staging import record_event

    assert record_event("cpu") is DONE
