"""kvpush on GPU memory between two processes (``bash .ci/run-gpu``): push and pull of VRAM
regions (GPUDirect: NIXL reads and writes the VRAM itself), byte-exact; and the same through
host staging (``kv_buffer_device: "cpu"``: the adapter's pinned host mirrors, device<->host
copies on a side stream, readiness by CUDA event). Skipped, with the reason, where no CUDA
device and CUDA build of torch exist (this project's CI machine has none).

The producer runs in a child process (its own NIXL agent and CUDA context); the consumer in
the test's process."""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
if not torch.cuda.is_available():
    pytest.skip(f"no CUDA device here (torch {torch.__version__}, "
                f"cuda build: {torch.version.cuda}): the GPU suite needs one",
                allow_module_level=True)

import kvpush  # noqa: E402
from kvpush import RequestState, TransferMode  # noqa: E402

pytestmark = pytest.mark.gpu
LAYERS, BLOCKS, HEADS, TOKENS, HEAD = 2, 64, 2, 16, 64


def device_caches(seed: int | None) -> dict[str, Any]:
    out = {}
    for i in range(LAYERS):
        t = torch.zeros(BLOCKS, HEADS, TOKENS, 2 * HEAD, dtype=torch.float16, device="cuda")
        if seed is not None:
            g = torch.Generator(device="cuda").manual_seed(seed + i)
            t.normal_(generator=g)
        out[f"model.layers.{i}.self_attn.attn"] = t
    return out


def layout_of(caches: dict[str, Any]) -> kvpush.KVLayout:
    from kvpush.integrations.vllm_worker import layout_from_kv_caches

    return layout_from_kv_caches(caches, block_size=TOKENS, num_blocks=BLOCKS)


def _producer(conn: Connection, staged: bool, mode: str, src: list[int]) -> None:
    from kvpush.integrations.vllm_staging import HostStaging, record_event

    dev = device_caches(seed=11)
    staging = HostStaging(dev) if staged else None
    caches = staging.host if staging is not None else dev
    if staging is not None:  # the mirrors start stale: only staged blocks may arrive right
        for t in staging.host.values():
            t.zero_()
    with kvpush.Producer(layout_of(caches)) as p:
        conn.send(p.address)
        conn.recv()   # the consumer registered (push) / is ready (pull)
        computed = record_event("cuda")
        ready = computed if staging is None else staging.to_host(src, after=computed)
        ready.synchronize()
        ticket = p.prefill_done("r", np.array(src), TransferMode(mode))
        conn.send(None if ticket is None else ticket.to_bytes())
        conn.recv()   # done


@pytest.mark.parametrize("staged", [False, True], ids=["vram", "host-staged"])
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_two_processes_byte_exact(mode: str, staged: bool) -> None:
    from kvpush.integrations.vllm_staging import HostStaging

    src, dst = [3, 4, 5, 60], [0, 1, 2, 10]
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_producer, args=(child, staged, mode, src), daemon=True)
    proc.start()
    try:
        dev = device_caches(seed=None)
        staging = HostStaging(dev) if staged else None
        caches = staging.host if staging is not None else dev
        assert conn.poll(120)
        address = conn.recv()
        with kvpush.Consumer(layout_of(caches)) as c:
            name = c.connect(address, timeout=60)
            if mode == "push":
                handle = c.expect("r", np.array(dst), name)
                conn.send("go")
                assert conn.poll(60)
                conn.recv()
            else:
                conn.send("go")
                assert conn.poll(60)
                handle = c.pull(conn.recv(), np.array(dst))
            result = handle.wait(60)
            assert result.state is RequestState.READY, result.error
            conn.send("done")
        if staging is not None:
            staging.to_device(dst).synchronize()
        want = device_caches(seed=11)
        for name_, t in dev.items():
            assert torch.equal(t[dst], want[name_][src]), name_
            others = [b for b in range(BLOCKS) if b not in dst]
            assert not t[others].any()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(10)
