"""The critical path, 1 prefill + 1 decode: push vs pull TTFT under Poisson load.

Three processes, as in disaggregated serving with vLLM:

* the **router** (this process; vLLM's disaggregation proxy) draws Poisson arrivals and
  prompt lengths and routes each request;
* the **prefill engine** (a worker; owns a :class:`kvpush.Producer`) serves requests one at a
  time, FIFO, like one GPU: allocates source blocks, "computes" the prefill, calls
  ``prefill_done``. The compute is a **sleep** of a calibrated model (below), so it uses no
  CPU on this 2-core host; nothing is written into the blocks (KV bytes are moved, not
  checked, here -- the tests and the demo check bytes);
* the **decode engine** (a worker; owns a :class:`kvpush.Consumer`) is vLLM's engine core: a
  loop of *steps*. At each step boundary it schedules (takes what the router sent,
  allocates destination blocks, admits requests whose KV has arrived), then runs one
  forward pass for the whole running batch -- a sleep of ``step_time(batch)`` (below) --
  after which every request in the batch has one more token. A request's **first token**
  is the end of the first step it runs in; it then stays ``decode_steps`` steps and frees
  its blocks.

What each mode does (the per-request work of the decode engine runs on its step loop, as in
vLLM's NIXL connector; kvpush's own thread does the transfer):

* **push** -- at arrival the router sends the request to *both* engines. At its next step
  boundary the decode engine allocates destination blocks and calls ``Consumer.expect``
  (the registration travels to the producer while prefill computes). When prefill ends,
  ``prefill_done`` triggers the WRITE at once on the producer's loop thread (the
  registration is already there); kvpush reports READY when the ``Landed`` notification
  arrives, with no help from the decode loop; the request is admitted at the first step
  boundary after READY.
* **pull** (the old default, vLLM's NixlConnector) -- the router sends the request to the
  prefill engine only. When prefill ends, ``prefill_done(..., PULL)`` returns a ticket (the
  source block ids); the prefill engine hands it to the router, which relays it to the
  decode engine -- which learns of the request only now. At its next step boundary it
  allocates destination blocks; at the start of that step's forward (vLLM:
  ``start_load_kv``) it calls ``Consumer.pull`` (ids -> descriptors and the READ then run on
  kvpush's loop thread), the step runs, and the request is admitted at the first step
  boundary after READY (vLLM: ``get_finished`` at the end of a step, admission at the next
  ``schedule``).

Measured per request (one monotonic clock for all processes, ``CLOCK_MONOTONIC``):
**TTFT** = arrival -> the end of the decode step that produced the request's first token;
**handover** = ``prefill_done`` called -> kvpush reports READY on the decode side;
**handover overhead** = handover - the pure wire time of the same number of blocks: the
*median* of raw NIXL WRITEs (push) or READs (pull) of that size, kvpush's NIXL
configuration, back-to-back polling, measured in the same run on the same buffers (the
minimum is reported too: a WRITE inside kvpush is drawn from the same distribution as a
raw one, so measuring against the fastest of a dozen counted the wire's own spread -- 0.3 ms
at 4 MiB, 1.6 ms at 16 MiB here -- as kvpush overhead). For push the handover is split at
the producer's release of the source blocks (the WRITE done at the initiator):
``write_p50_ms`` (prefill_done -> release; ``write_overhead_p50_us`` is that minus the
wire time) and ``notice_p50_us`` (release -> READY: the consumer noticing the landing), and
further into ``PUSH_STAGES`` from kvpush's own stamps (``Release.timings``). The wire is
also sampled *cold* (each raw transfer after ``COLD_GAP_S`` idle, no warm-up, as the
engines' blocks sit between requests); overheads against it are reported beside.

**Prefill model** (sleep): ``t(T) = 2 ms + 20 us * T + 1 ns * T^2`` for a T-token prompt
(1k: 23 ms, 4k: 101 ms, 8k: 233 ms, 16k: 598 ms): linear work plus quadratic attention.
For scale: Qwen3-32B needs ~2 * 32.8e9 * T FLOPs plus attention, ~0.58 PFLOP at 8k tokens,
~120 ms on 8 H200 at ~600 TFLOP/s each -- the model is within ~2x of that. The sleep is
calibrated: its mean overshoot on this host is measured at start and subtracted, and the
actual prefill durations are reported.

**Decode step model** (sleep): ``step_time(B) = step_s + B * step_per_request_s +
C * step_per_token_s`` for ``B`` running requests holding ``C`` context tokens in all.
Defaults are estimates for Qwen3-32B (64 layers, 8 KV heads x 128, bf16: 256 KiB of KV
per token) with tensor parallelism 8 on H200 (HBM3e 4.8 TB/s per GPU), the AWS 1P1D setup:

* ``step_s`` = 10 ms: reading 8.2 GB of weights per GPU (~2 ms at ~4 TB/s achieved), 128
  tensor-parallel all-reduces (2 per layer, ~15-25 us each), sampling, scheduling and
  launch overheads -- the ~10 ms inter-token latency dense 30-70B models show at low batch;
* ``step_per_token_s`` = 9 ns: each context token's KV, 32 KiB per GPU at TP 8, read once
  per step at ~3.5 TB/s achieved;
* ``step_per_request_s`` = 40 us: per-sequence work of the step (scheduler, input
  preparation, sampling) on the engine's CPU thread.

A run holds 30-60 measured requests, far fewer than the batch a decode engine carries under
load, so the engine also carries a **background batch**: the steady state that the run's
request rate implies by Little's law for ``output_tokens``-token answers,
``B_bg = rate * output_tokens * step_time(B_bg)`` (contexts: the mean prompt plus half the
answer; capped at ``max_batch`` = 256, vLLM's default ``max_num_seqs``). Background
requests add to every step's time and need no KV blocks here. With ``output_tokens`` = 256
and prompts of 16k tokens at 8 req/s (the AWS point) this gives ~16 ms steps at ~33
requests; the quick sweep reaches ~15 ms at its top rate (shorter prompts, higher rates),
the full sweep 10-12 ms (long prompts keep its rates at 1-4.6 req/s). Because the
background batch is never empty, the decode engine steps continuously, as a loaded engine
does.

**Sustainable rate**: a run keeps up when every request completes and its completion rate
-- the slope of first-token times (sorted) against their rank, fitted over the whole run --
is at least 95 % of its offered rate (the same fit over arrival times). The *high-load*
point is the highest swept rate at which **both** modes keep up; ``saturation_rate_rps``
is the lowest at which either does not.

The KV cache is 8 layers, K and V separate (16 regions), 16 tokens per block, 2 KV heads x
64, fp16: 4 KiB per block per region, 4 KiB of KV per token (a real Qwen3-32B TP-8 shard
has 128 regions of 4 KiB blocks: more descriptors per token, the same block size).
"""

from __future__ import annotations

import collections
import contextlib
import math
import multiprocessing.connection as mpc
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._common import Progress, RawAgent, descriptor_table, open_endpoint, pct, sorted_pairs
from ._procs import Worker, stop_all

__all__ = ["CPConfig", "background_batch", "prefill_seconds", "run", "step_seconds"]

NAME = "critical_path"
DESCRIPTION = ("1 prefill + 1 decode engine behind a router under Poisson load: push vs pull "
               "TTFT and handover overhead")
SUMMARY_KEYS: dict[str, str] = {
    "handover_overhead_{mode}_us":
        "prefill_done -> READY minus the wire time of the request's size, p50 over all rates, us",
    "handover_overhead_{mode}_low_load_us": "the same at the lowest rate",
    "handover_overhead_push_over_pull": "push's handover overhead over pull's",
    "handover_overhead_{mode}_cold_wire_us":
        "the overhead against raw transfers sampled after an idle gap, us",
    "handover_overhead_push_over_pull_cold_wire": "the ratio against the cold wire",
    "ttft_p50_pull_over_push_{load}":
        "TTFT p50 pull over push at the high-load point, the lowest rate, or the largest over "
        "rates (max)",
    "ttft_pull_over_push_paired_{load}":
        "median over requests of pull's TTFT over push's for the same request",
    "ttft_p50_{mode}_high_load_ms": "TTFT p50 at the high-load point, ms",
    "high_load_rate_rps":
        "the high-load point: the highest swept rate both modes keep up with, req/s",
    "high_load_rate_fraction": "that rate as a fraction of the prefill engine's capacity",
    "high_load_sustainable": "whether both modes kept up there",
    "saturation_rate_rps": "the lowest swept rate some mode did not keep up with",
    "decode_step_ms_high_load": "the decode engine's step p50 at the high-load point, ms",
    "push_stage_{stage}_us":
        "push's handover by stage at the high-load point (benchmarks.critical_path.PUSH_STAGES), "
        "p50 us",
}

TOKENS_PER_BLOCK = 16
LAYERS = 8
REGIONS = 2 * LAYERS
BLOCK_BYTES = TOKENS_PER_BLOCK * 2 * 64 * 2  # per region
SUSTAINED = 0.95  # completion rate / offered rate that counts as keeping up
COLD = "_cold"     # wire samples taken after COLD_GAP_S of idleness
COLD_GAP_S = 0.05  # ~ the gap between two requests' transfers at the swept rates
_M = "benchmarks.critical_path:"


def prefill_seconds(tokens: int) -> float:
    return 2e-3 + 20e-6 * tokens + 1e-9 * tokens * tokens


@dataclass
class CPConfig:
    prompts: list[int]
    rate_fractions: list[float]       # of the prefill engine's capacity
    requests: int                      # per (rate, mode)
    num_blocks: int
    step_s: float = 0.010              # decode step time of an empty batch
    decode_steps: int = 16             # steps a measured request stays in the batch
    wire_reps: int = 12
    seed: int = 0
    modes: tuple[str, ...] = ("push", "pull")
    step_per_request_s: float = 40e-6  # decode step time per running request
    step_per_token_s: float = 9e-9     # ... per context token in the batch
    output_tokens: int = 256           # answer length behind the background batch
    max_batch: int = 256               # vLLM's default max_num_seqs
    background: bool = True            # carry the Little's-law background batch

    @property
    def capacity(self) -> float:
        """Requests per second the prefill engine can serve (prompt lengths uniform)."""
        return 1.0 / float(np.mean([prefill_seconds(t) for t in self.prompts]))

    def step_model(self) -> dict[str, float]:
        return {"step_s": self.step_s, "per_request_s": self.step_per_request_s,
                "per_token_s": self.step_per_token_s}


def step_seconds(model: dict[str, float], batch: float, context_tokens: float) -> float:
    """One decode step of ``batch`` requests holding ``context_tokens`` tokens of KV."""
    return (model["step_s"] + batch * model["per_request_s"]
            + context_tokens * model["per_token_s"])


def background_batch(cfg: CPConfig, rate: float) -> tuple[int, float]:
    """(requests, context tokens) of the steady-state batch at ``rate`` (Little's law):
    B = rate * output_tokens * step_time(B), capped at ``max_batch``."""
    if not cfg.background or rate <= 0:
        return 0, 0.0
    ctx = float(np.mean(cfg.prompts)) + cfg.output_tokens / 2
    per_req = cfg.step_per_request_s + ctx * cfg.step_per_token_s
    lam_l = rate * cfg.output_tokens
    denom = 1.0 - lam_l * per_req
    b = cfg.max_batch if denom <= 0 else min(cfg.max_batch, lam_l * cfg.step_s / denom)
    n = round(b)
    return n, n * ctx


def quick_config() -> CPConfig:
    return CPConfig(prompts=[1024, 2048, 4096], rate_fractions=[0.3, 0.6, 0.8, 0.95, 1.1],
                    requests=40, num_blocks=8192)


def full_config() -> CPConfig:
    return CPConfig(prompts=[1024, 4096, 8192, 16384],
                    rate_fractions=[0.25, 0.5, 0.75, 0.9, 1.0, 1.1], requests=60,
                    num_blocks=16384)


# =========================================================================================
# Engines (run in workers)
# =========================================================================================
def _make_cache(num_blocks: int) -> tuple[list[np.ndarray], Any]:
    import kvpush

    buffers = []
    for _ in range(REGIONS):
        buf = np.empty((num_blocks, BLOCK_BYTES), dtype=np.uint8)
        buf.fill(0)
        buffers.append(buf)
    layout = kvpush.KVLayout.from_buffers(
        buffers, num_layers=LAYERS, num_blocks=num_blocks, tokens_per_block=TOKENS_PER_BLOCK,
        num_kv_heads=2, head_size=64, dtype="float16", kv_packed=False)
    return buffers, layout


class _Pool:
    """Free block ids, handed out in random order (as an allocator does after churn)."""

    def __init__(self, n: int, seed: int) -> None:
        self._free = collections.deque(int(i) for i in np.random.default_rng(seed).permutation(n))
        self._lock = threading.Lock()
        self._later: collections.deque[np.ndarray] = collections.deque()

    def take(self, n: int) -> np.ndarray | None:
        with self._lock:
            while self._later:
                self._free.extend(int(i) for i in self._later.popleft())
            if n > len(self._free):
                return None
            return np.array([self._free.popleft() for _ in range(n)], dtype=np.int64)

    def give(self, ids: np.ndarray) -> None:
        with self._lock:
            self._free.extend(int(i) for i in ids)

    def give_later(self, ids: np.ndarray) -> None:
        """Return blocks from a kvpush callback: O(1) and lock-free, so the callback costs
        kvpush's loop thread (the push path: it runs before the consumer is told) almost
        nothing; the next :meth:`take` puts them back."""
        self._later.append(ids)


def _sleep_overshoot() -> float:
    samples = []
    for _ in range(15):
        t0 = time.monotonic()
        time.sleep(0.002)
        samples.append(time.monotonic() - t0 - 0.002)
    return max(0.0, float(np.median(samples)))


def side_setup(state: dict[str, Any], conn: mpc.Connection, role: str, num_blocks: int,
               address: str = "") -> dict[str, Any]:
    """Make the cache, the kvpush endpoint and a raw NIXL agent over the same buffers."""
    import kvpush

    buffers, layout = _make_cache(num_blocks)
    state.update(buffers=buffers, layout=layout, role=role, num_blocks=num_blocks)
    state["pool"] = _Pool(num_blocks, seed=1 if role == "prefill" else 2)
    raw = RawAgent(f"cp-raw-{role}", "kvpush")
    raw.register(buffers)
    state["raw"] = raw
    state["cleanup"].append(raw.close)
    out: dict[str, Any] = {"raw_md": raw.metadata(),
                           "bases": [int(b.ctypes.data) for b in buffers]}
    if role == "prefill":
        pool = state["pool"]

        def on_release(release: kvpush.Release) -> None:
            # Runs on the producer's loop thread: keep it short (see _Pool.give_later).
            pool.give_later(release.block_ids)
            state.setdefault("released", []).append(
                (release.request_id, release.reason.value, time.monotonic(),
                 dict(release.timings)))

        out["address"] = open_endpoint(state, role, layout, on_release=on_release)
    else:
        # The callback stamps the moment kvpush reports a request; the engine's step loop
        # collects the results at its next step boundary (with a callback, kvpush does not
        # also queue results for get_finished).
        # A pipe wakes the engine when it waits between steps (nothing running).
        finished: collections.deque[tuple[Any, float]] = collections.deque()
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)

        def on_finished(result: kvpush.TransferResult) -> None:
            finished.append((result, time.monotonic()))
            with contextlib.suppress(BlockingIOError):
                os.write(wake_w, b"\0")

        def close_pipe() -> None:
            os.close(wake_r)
            os.close(wake_w)

        state["cleanup"].append(close_pipe)
        state["wake"] = wake_r

        state["finished"] = finished
        out["producer"] = open_endpoint(state, role, layout, address, on_finished=on_finished)
    return out


def side_raw_peer(state: dict[str, Any], conn: mpc.Connection, metadata: bytes,
                  bases: list[int]) -> None:
    raw: RawAgent = state["raw"]
    peer = raw.add_peer(metadata)
    nb = state["num_blocks"]
    state["raw_dl"] = (
        raw.prep("NIXL_INIT_AGENT", descriptor_table(
            [b.ctypes.data for b in state["buffers"]], nb, BLOCK_BYTES)),
        raw.prep(peer, descriptor_table(bases, nb, BLOCK_BYTES)))


def side_wire(state: dict[str, Any], conn: mpc.Connection, op: str, blocks: int, reps: int,
              seed: int, gap_s: float = 0.0) -> list[float]:
    """Pure wire time: raw NIXL ``op`` of ``blocks`` scattered block ids in every region,
    this side initiating (the same descriptors kvpush would post). ``gap_s`` = 0: after a
    warm-up transfer (hot); > 0: each transfer after ``gap_s`` of idleness, no warm-up
    (cold, as the engines' blocks are between requests)."""
    raw: RawAgent = state["raw"]
    local_h, remote_h = state["raw_dl"]
    nb = state["num_blocks"]
    rng = np.random.default_rng(seed)
    out = []
    for i in range(reps + (0 if gap_s else 1)):
        loc, rem = sorted_pairs(rng.choice(nb, blocks, replace=False),
                                rng.choice(nb, blocks, replace=False))
        region = np.arange(REGIONS, dtype=np.int64)[:, None] * nb
        li = (region + loc[None, :]).ravel().astype(np.int32)
        ri = (region + rem[None, :]).ravel().astype(np.int32)
        if gap_s:
            time.sleep(gap_s)
        dt = raw.xfer(op, local_h, li, remote_h, ri)
        if i or gap_s:
            out.append(dt)
    return out


def side_prefill_engine(state: dict[str, Any], conn: mpc.Connection) -> dict[str, Any]:
    """Serve prefill requests FIFO until the router says stop."""
    import kvpush

    producer: kvpush.Producer = state["endpoint"]
    pool: _Pool = state["pool"]
    overshoot = _sleep_overshoot()
    queue: collections.deque[tuple[str, int, str]] = collections.deque()
    durations: list[tuple[int, float]] = []
    pool_waits = 0
    stop = False
    state["released"] = []
    while not stop or queue:
        if conn.poll(0 if queue else 0.5):
            while conn.poll(0):
                msg = conn.recv()
                if msg[0] == "stop":
                    stop = True
                else:
                    queue.append(msg[1:])
        if not queue:
            continue
        rid, tokens, mode = queue[0]
        ids = pool.take(-(-tokens // TOKENS_PER_BLOCK))
        if ids is None:  # out of KV blocks: wait for releases
            pool_waits += 1
            time.sleep(0.001)
            continue
        queue.popleft()
        t_start = time.monotonic()
        time.sleep(max(0.0, prefill_seconds(tokens) - overshoot))
        t_done = time.monotonic()
        ticket = producer.prefill_done(rid, ids, kvpush.TransferMode(mode))
        t_returned = time.monotonic()
        durations.append((tokens, t_done - t_start))
        conn.send(("ev", "prefilled", rid, t_start, t_done,
                   ticket.to_bytes() if ticket is not None else None, t_returned))
    return {"overshoot_s": overshoot, "durations": durations, "pool_waits_ms": pool_waits,
            "stats": producer.stats(),
            # (request id, monotonic time, Release.timings) of each release of source blocks
            "released": [(rid, t, stages) for rid, _reason, t, stages in state["released"]]}


def side_decode_engine(state: dict[str, Any], conn: mpc.Connection, model: dict[str, float],
                       background: int, background_tokens: float,
                       decode_steps: int) -> dict[str, Any]:
    """The decode engine's step loop (see the module docstring)."""
    import kvpush

    consumer: kvpush.Consumer = state["endpoint"]
    pool: _Pool = state["pool"]
    producer = state["producer"]
    finished: collections.deque[tuple[Any, float]] = state["finished"]
    wake: int = state["wake"]
    waiting: collections.deque[tuple[Any, ...]] = collections.deque()  # no blocks yet
    held: dict[str, np.ndarray] = {}     # rid -> destination blocks (transfer or decode)
    tokens_of: dict[str, int] = {}
    running: dict[str, int] = {}         # rid -> steps left
    step_times: list[float] = []
    batches: list[int] = []
    stop = False
    pool_waits = 0
    overshoot = _sleep_overshoot()

    def drain_wake() -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(wake, 4096):
                pass

    while True:
        # -- step boundary: schedule --------------------------------------------------------
        drain_wake()
        while conn.poll(0):
            msg = conn.recv()
            if msg[0] == "stop":
                stop = True
            else:
                waiting.append(msg)
        boundary = time.monotonic()
        # Transfers kvpush reported by now are admitted into this step (vLLM: get_finished
        # at the end of the last step, update_from_output, then schedule).
        admitted = []
        while finished:
            result, ready_at = finished.popleft()
            rid = result.request_id
            conn.send(("ev", "ready", rid, ready_at, boundary, result.state.value,
                       result.bytes_moved))
            if result.ok:
                running[rid] = decode_steps
                admitted.append(rid)
            else:
                pool.give(held.pop(rid))
                tokens_of.pop(rid, None)
        to_load: list[tuple[str, Any, np.ndarray]] = []
        while waiting:
            msg = waiting[0]
            kind, rid, tokens = msg[:3]
            ids = pool.take(-(-tokens // TOKENS_PER_BLOCK))
            if ids is None:  # out of KV blocks: wait for running requests to finish
                pool_waits += 1
                break
            waiting.popleft()
            held[rid] = ids
            tokens_of[rid] = tokens
            if kind == "route":  # push: register now, while prefill computes
                t = time.monotonic()
                consumer.expect(rid, ids, producer, timeout=120)
                conn.send(("ev", "issued", rid, t))
            else:                # pull: the READ starts with this step's forward
                to_load.append((rid, msg[3], ids))
        if stop:  # every request has its first token: stop decoding, keep nothing
            for rid in running:
                tokens_of.pop(rid, None)
                pool.give(held.pop(rid))
            running.clear()
            if not held and not waiting:
                break
        batch = len(running) + background
        if batch == 0 and not to_load:
            # Idle (no background load, nothing decoding): wait for the router or kvpush.
            mpc.wait([conn, wake], timeout=0.5)
            continue
        # -- the step -----------------------------------------------------------------------
        step_start = time.monotonic()
        for rid, ticket, ids in to_load:  # vLLM: start_load_kv, before the forward
            t = time.monotonic()
            consumer.pull(ticket, ids, timeout=120)
            conn.send(("ev", "issued", rid, t))
        context = background_tokens + sum(tokens_of[r] for r in running)
        # The forward pass follows the CPU work above, as on a GPU that waits for its launch.
        time.sleep(max(0.0, step_seconds(model, batch, context) - overshoot))
        step_end = time.monotonic()
        step_times.append(step_end - step_start)
        batches.append(batch)
        for rid in admitted:
            conn.send(("ev", "first", rid, step_end))
        for rid in list(running):
            running[rid] -= 1
            if running[rid] == 0:
                del running[rid]
                tokens_of.pop(rid, None)
                pool.give(held.pop(rid))
    return {"steps": len(step_times), "pool_waits": pool_waits, "stats": consumer.stats(),
            "step_ms_p50": pct(step_times, 50) * 1e3, "step_ms_p90": pct(step_times, 90) * 1e3,
            "batch_p50": pct(batches, 50)}


# =========================================================================================
# Router (parent)
# =========================================================================================
@dataclass
class _Req:
    rid: str
    tokens: int
    mode: str
    arrival: float
    prefill_start: float = 0.0
    prefill_done: float = 0.0
    call_returned: float = 0.0  # the engine's prefill_done call returned
    issued: float = 0.0        # decode engine called expect / pull
    ready: float = 0.0         # kvpush reported the request (callback time)
    admitted: float = 0.0      # the step boundary that admitted it
    first: float = 0.0         # end of its first decode step: the first token
    released: float = 0.0      # producer released the source blocks
    stages: dict[str, float] = field(default_factory=dict)  # the Release's timings
    state: str = ""
    nbytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def _route(cfg: CPConfig, mode: str, rate: float, prefill: Worker, decode: Worker,
           seed: int, tag: str, timeout: float) -> list[_Req]:
    # The same draws at every rate (common random numbers): exponential gaps rescaled so the
    # run's mean rate is exactly ``rate`` (30 raw draws would miss it by ~20 %), and the
    # same prompt sequence.
    rng = np.random.default_rng(seed)
    draws = rng.exponential(1.0, cfg.requests)
    draws[0] = 0.0
    gaps = draws / max(draws[1:].mean(), 1e-12) / rate if cfg.requests > 1 else draws
    tokens = rng.choice(cfg.prompts, cfg.requests)
    bg, bg_tokens = background_batch(cfg, rate)
    prefill.send_call(_M + "side_prefill_engine")
    decode.send_call(_M + "side_decode_engine", model=cfg.step_model(), background=bg,
                     background_tokens=bg_tokens, decode_steps=cfg.decode_steps)
    arrivals = time.monotonic() + 0.05 + np.cumsum(gaps)
    reqs = [_Req(f"{tag}-{i}", int(tokens[i]), mode, float(arrivals[i]))
            for i in range(cfg.requests)]
    by_id = {r.rid: r for r in reqs}
    sent = done = 0
    summaries: dict[str, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while done < len(reqs):
            now = time.monotonic()
            while sent < len(reqs) and reqs[sent].arrival <= now:
                r = reqs[sent]
                if mode == "push":  # to both engines at once
                    decode.conn.send(("route", r.rid, r.tokens))
                prefill.conn.send(("prefill", r.rid, r.tokens, mode))
                sent += 1
            wait = (reqs[sent].arrival - time.monotonic()) if sent < len(reqs) else 0.5
            for conn in mpc.wait([prefill.conn, decode.conn], timeout=max(0.0, wait)):
                assert isinstance(conn, mpc.Connection)   # what was passed in comes back
                msg = conn.recv()
                if msg[0] != "ev":
                    raise RuntimeError(f"engine stopped early: {msg[0]}: {msg[1]}")
                r = by_id[msg[2]]
                if msg[1] == "prefilled":
                    r.prefill_start, r.prefill_done, r.call_returned = msg[3], msg[4], msg[6]
                    if mode == "pull":  # relay the ticket: decode learns the ids only now
                        decode.conn.send(("ticket", r.rid, r.tokens, msg[5]))
                elif msg[1] == "issued":
                    r.issued = msg[3]
                elif msg[1] == "ready":
                    r.ready, r.admitted, r.state, r.nbytes = msg[3], msg[4], msg[5], msg[6]
                    if r.state != "ready":
                        done += 1
                elif msg[1] == "first":
                    r.first = msg[3]
                    done += 1
            if time.monotonic() > deadline:
                raise TimeoutError(f"{tag}: {len(reqs) - done} requests unfinished")
    finally:
        for w in (prefill, decode):
            w.conn.send(("stop",))
        for name, w in (("prefill", prefill), ("decode", decode)):
            end = time.monotonic() + 30
            while time.monotonic() < end:  # drain late events, then the engine's result
                if not w.conn.poll(max(0.0, end - time.monotonic())):
                    break
                msg = w.conn.recv()
                if msg[0] == "ev":
                    continue
                if msg[0] == "error":
                    raise RuntimeError(f"{name} engine: {msg[1]}")
                summaries[name] = msg[1]
                break
    for rid, t, stages in summaries.get("prefill", {}).get("released", []):
        if rid in by_id:
            by_id[rid].released = t
            by_id[rid].stages = stages
    reqs[0].extra["engines"] = summaries
    reqs[0].extra["background"] = (bg, bg_tokens)
    return reqs


def _rate_fit(times: list[float]) -> float:
    """Events per second: the inverse slope of the sorted times against their rank (a
    least-squares fit over the whole run, so neither end's spread decides it)."""
    if len(times) < 3:
        return math.nan
    t = np.sort(np.asarray(times, dtype=float))
    slope = float(np.polyfit(np.arange(len(t), dtype=float), t, 1)[0])
    return 1.0 / slope if slope > 0 else math.inf


#: Where push's handover goes, from each Release's timings (kvpush's own stamps).
PUSH_STAGES = {
    "engine_call": "the engine's thread inside prefill_done (validation, hand-off queued)",
    "to_loop": "prefill_done called -> kvpush's loop thread took the blocks (a wake-up)",
    "prepare": "-> the WRITE handed to NIXL (registration matched, plan, hint sent)",
    "write_extra": "WRITE posted -> seen done, minus the raw wire time of its size",
    "release": "WRITE done -> source released (callback)",
    "notice": "source released -> READY on the decode side",
}


def _push_stages(rel: list[_Req], wire: dict[tuple[str, int], dict[str, float]]
                 ) -> dict[str, float]:
    """p50 of each PUSH_STAGES stage over the requests in ``rel`` (microseconds)."""
    parts: dict[str, list[float]] = {k: [] for k in PUSH_STAGES}
    for r in rel:
        st = r.stages
        if not {"held", "posted", "written", "released"} <= st.keys():
            continue
        parts["engine_call"].append(r.call_returned - st["prefill_done"])
        parts["to_loop"].append(st["held"] - st["prefill_done"])
        parts["prepare"].append(st["posted"] - max(st["held"], st.get("registered", 0.0)))
        parts["write_extra"].append(st["written"] - st["posted"]
                                    - wire[("WRITE", r.tokens)]["p50"])
        parts["release"].append(st["released"] - st["written"])
        parts["notice"].append(r.ready - st["released"])
    return {k: pct(v, 50) * 1e6 for k, v in parts.items()}


def _stats(reqs: list[_Req], wire: dict[tuple[str, int], dict[str, float]], rate: float
           ) -> dict[str, Any]:
    ok = [r for r in reqs if r.state == "ready" and r.first > 0]
    ok_ids = {r.rid for r in ok}
    op = "WRITE" if reqs[0].mode == "push" else "READ"
    ttft = [r.first - r.arrival for r in ok]
    hand = [r.ready - r.prefill_done for r in ok]
    over = [r.ready - r.prefill_done - wire[(op, r.tokens)]["p50"] for r in ok]
    over_min = [r.ready - r.prefill_done - wire[(op, r.tokens)]["min"] for r in ok]
    over_cold = [r.ready - r.prefill_done - wire[(op + COLD, r.tokens)]["p50"] for r in ok]
    offered = _rate_fit([r.arrival for r in reqs])
    served = _rate_fit([r.first for r in ok])
    engines = reqs[0].extra.get("engines", {})
    dec = engines.get("decode", {})
    out: dict[str, Any] = {
        "mode": reqs[0].mode, "rate": rate, "requests": len(reqs), "ok": len(ok),
        "offered_rps": offered, "throughput_rps": served if ok else 0.0,
        "sustainable": bool(len(ok) == len(reqs) and served >= SUSTAINED * offered),
        "throughput_gbps": (sum(r.nbytes for r in ok)
                            / max(1e-9, max(r.first for r in ok) - min(r.arrival for r in reqs))
                            / 1e9) if ok else 0.0,
        # per request, in arrival order (NaN if it failed): both modes serve the same
        # requests, so they can be compared pair by pair
        "ttft_ms_all": [(r.first - r.arrival) * 1e3 if r.rid in ok_ids else math.nan
                        for r in reqs],
        "ttft_p50_ms": pct(ttft, 50) * 1e3, "ttft_p90_ms": pct(ttft, 90) * 1e3,
        "ttft_p99_ms": pct(ttft, 99) * 1e3,
        "handover_p50_ms": pct(hand, 50) * 1e3, "handover_p90_ms": pct(hand, 90) * 1e3,
        "handover_p99_ms": pct(hand, 99) * 1e3,
        "handover_overhead_p50_us": pct(over, 50) * 1e6,
        "handover_overhead_us_all": [o * 1e6 for o in over],
        "handover_overhead_p90_us": pct(over, 90) * 1e6,
        "handover_overhead_vs_min_wire_p50_us": pct(over_min, 50) * 1e6,
        "handover_overhead_vs_cold_wire_p50_us": pct(over_cold, 50) * 1e6,
        "handover_overhead_vs_cold_wire_us_all": [o * 1e6 for o in over_cold],
        # prefill done -> first token: everything after prefill, decode loop included
        "prefill_to_first_token_p50_ms": pct([r.first - r.prefill_done for r in ok], 50) * 1e3,
        "ready_to_admit_p50_ms": pct([r.admitted - r.ready for r in ok], 50) * 1e3,
        "prefill_queue_p50_ms": pct([r.prefill_start - r.arrival for r in ok], 50) * 1e3,
        "decode_step_p50_ms": dec.get("step_ms_p50", math.nan),
        "decode_step_p90_ms": dec.get("step_ms_p90", math.nan),
        "decode_batch_p50": dec.get("batch_p50", math.nan),
        "background_batch": reqs[0].extra.get("background", (0, 0.0))[0],
    }
    if reqs[0].mode == "pull":
        # prefill done -> decode engine issued the READ (relay + waiting for a step boundary)
        out["relay_to_issue_p50_us"] = pct([r.issued - r.prefill_done for r in ok], 50) * 1e6
        out["issue_to_ready_p50_us"] = pct([r.ready - r.issued for r in ok], 50) * 1e6
    else:
        out["registered_before_prefill_done"] = sum(r.issued < r.prefill_done for r in ok)
        rel = [r for r in ok if r.released > 0]
        # prefill_done -> source released (the WRITE done at the initiator), then the
        # consumer's notice: release -> READY
        out["write_p50_ms"] = pct([r.released - r.prefill_done for r in rel], 50) * 1e3
        out["write_overhead_p50_us"] = pct(
            [r.released - r.prefill_done - wire[(op, r.tokens)]["p50"] for r in rel], 50) * 1e6
        out["write_overhead_vs_cold_wire_p50_us"] = pct(
            [r.released - r.prefill_done - wire[(op + COLD, r.tokens)]["p50"] for r in rel],
            50) * 1e6
        out["notice_p50_us"] = pct([r.ready - r.released for r in rel], 50) * 1e6
        out["push_stages_p50_us"] = _push_stages(rel, wire)
    by_len = {}
    for t in sorted({r.tokens for r in ok}):
        sel = [r.first - r.arrival for r in ok if r.tokens == t]
        by_len[str(t)] = pct(sel, 50) * 1e3
    out["ttft_p50_ms_by_prompt"] = by_len
    out["prefill_pool_waits_ms"] = engines.get("prefill", {}).get("pool_waits_ms", 0)
    out["decode_pool_waits"] = dec.get("pool_waits", 0)
    durs = [(t, d) for t, d in engines.get("prefill", {}).get("durations", [])]
    if durs:
        out["prefill_model_error_p50_us"] = pct(
            [(d - prefill_seconds(t)) for t, d in durs], 50) * 1e6
    return out


def _sample_wire(cfg: CPConfig, prefill: Worker, decode: Worker, reps: int, seed: int,
                 samples: dict[tuple[str, int], list[float]]) -> None:
    """Raw NIXL WRITEs (prefill side initiating) and READs (decode side) of each prompt's
    size, hot and cold (after ``COLD_GAP_S`` idle), taking turns, added to ``samples``."""
    for t in cfg.prompts:
        blocks = -(-t // TOKENS_PER_BLOCK)
        for rep in range(reps):
            for op, side in (("WRITE", prefill), ("READ", decode)):
                for key, gap in ((op, 0.0), (op + COLD, COLD_GAP_S)):
                    samples.setdefault((key, t), []).extend(side.call(
                        _M + "side_wire", op=op, blocks=blocks, reps=1, seed=seed + t + rep,
                        gap_s=gap))


def _wire_table(cfg: CPConfig, samples: dict[tuple[str, int], list[float]]
                ) -> tuple[dict[tuple[str, int], dict[str, float]], list[dict[str, Any]]]:
    """Pure wire time per (op, prompt length): median and minimum of every sample."""
    wire = {key: {"p50": float(np.median(v)), "min": min(v), "n": len(v)}
            for key, v in samples.items()}
    rows = []
    for t in cfg.prompts:
        blocks = -(-t // TOKENS_PER_BLOCK)
        w, r = wire[("WRITE", t)], wire[("READ", t)]
        wc, rc = wire[("WRITE" + COLD, t)], wire[("READ" + COLD, t)]
        rows.append({"tokens": t, "blocks": blocks, "bytes": blocks * REGIONS * BLOCK_BYTES,
                     "write_us": w["p50"] * 1e6, "read_us": r["p50"] * 1e6,
                     "write_min_us": w["min"] * 1e6, "read_min_us": r["min"] * 1e6,
                     "write_cold_us": wc["p50"] * 1e6, "read_cold_us": rc["p50"] * 1e6,
                     "samples": int(w["n"])})
    return wire, rows


def run(quick: bool, progress: bool = True, cfg: CPConfig | None = None) -> dict[str, Any]:
    cfg = cfg or (quick_config() if quick else full_config())
    rates = [f * cfg.capacity for f in cfg.rate_fractions]
    steps = 3 + len(rates) * len(cfg.modes)
    bar = Progress("critical-path", steps, progress)
    prefill = Worker("cp-prefill")
    decode = Worker("cp-decode")
    try:
        a = prefill.call(_M + "side_setup", role="prefill", num_blocks=cfg.num_blocks)
        b = decode.call(_M + "side_setup", role="decode", num_blocks=cfg.num_blocks,
                        address=a["address"], timeout=60)
        prefill.call(_M + "side_raw_peer", metadata=b["raw_md"], bases=b["bases"])
        decode.call(_M + "side_raw_peer", metadata=a["raw_md"], bases=a["bases"])
        bar.step("engines up")
        # Wire time is sampled before the sweep and again after every run, so its median
        # reflects the host's load over the whole sweep (it varies several-fold here).
        samples: dict[tuple[str, int], list[float]] = {}
        _sample_wire(cfg, prefill, decode, cfg.wire_reps, 0, samples)
        bar.step("wire time")
        done: list[tuple[list[_Req], float, int]] = []
        for i, rate in enumerate(rates):
            for mode in cfg.modes:  # same arrivals and prompts for both modes
                timeout = cfg.requests / rate * 3 + 60
                reqs = _route(cfg, mode, rate, prefill, decode, seed=cfg.seed,
                              tag=f"{mode}{i}", timeout=timeout)
                done.append((reqs, rate, i))
                _sample_wire(cfg, prefill, decode, 1, 1000 * len(done), samples)
                ttft = pct([r.first - r.arrival for r in reqs if r.first > 0], 50) * 1e3
                bar.step(f"{mode} {rate:.1f} req/s: TTFT p50 {ttft:.1f} ms")
        wire, wire_rows = _wire_table(cfg, samples)
        runs = []
        for reqs, rate, i in done:
            row = _stats(reqs, wire, rate)
            row["rate_fraction"] = cfg.rate_fractions[i]
            runs.append(row)
        bar.step("done")
    finally:
        stop_all([decode, prefill])
        bar.finish()
    return _summarize(cfg, rates, wire_rows, runs)


def _summarize(cfg: CPConfig, rates: list[float], wire_rows: list[dict[str, Any]],
               runs: list[dict[str, Any]]) -> dict[str, Any]:
    def row(mode: str, rate: float) -> dict[str, Any]:
        return next((r for r in runs if r["mode"] == mode and r["rate"] == rate),
                    {"ok": 0, "throughput_rps": 0.0, "ttft_p50_ms": math.nan,
                     "handover_overhead_p50_us": math.nan, "sustainable": False,
                     "decode_step_p50_ms": math.nan})

    def keeps_up(rate: float) -> bool:
        return all(row(mode, rate)["sustainable"] for mode in cfg.modes)

    sustainable = [rate for rate in rates if keeps_up(rate)]
    high = max(sustainable) if sustainable else min(rates)
    low = min(rates)
    over = [rate for rate in rates if not keeps_up(rate)]

    def overhead(mode: str, key: str = "handover_overhead_us_all") -> float:
        """p50 over every request of every rate (handover - median wire time of its size)."""
        vals = [v for r in runs if r["mode"] == mode for v in r[key]]
        return pct(vals, 50)

    def ratio(rate: float) -> float:
        return float(row("pull", rate)["ttft_p50_ms"] / row("push", rate)["ttft_p50_ms"])

    def paired(rate: float) -> float:
        """Median over requests of pull's TTFT / push's TTFT for the same request (same
        arrival, same prompt): steadier than a ratio of medians over a mix of lengths."""
        a = np.asarray(row("pull", rate).get("ttft_ms_all", []), dtype=float)
        b = np.asarray(row("push", rate).get("ttft_ms_all", []), dtype=float)
        if len(a) != len(b) or not len(a):
            return math.nan
        keep = np.isfinite(a) & np.isfinite(b) & (b > 0)
        return float(np.median(a[keep] / b[keep])) if keep.any() else math.nan

    summary = {
        "handover_overhead_push_us": overhead("push"),
        "handover_overhead_pull_us": overhead("pull"),
        "handover_overhead_push_low_load_us": row("push", low)["handover_overhead_p50_us"],
        "handover_overhead_pull_low_load_us": row("pull", low)["handover_overhead_p50_us"],
        "ttft_p50_pull_over_push_high_load": ratio(high),
        "ttft_p50_pull_over_push_low_load": ratio(low),
        "ttft_p50_pull_over_push_max": max((ratio(r) for r in rates), default=math.nan),
        "ttft_pull_over_push_paired_high_load": paired(high),
        "ttft_pull_over_push_paired_low_load": paired(low),
        "high_load_rate_rps": high,
        "high_load_rate_fraction": cfg.rate_fractions[rates.index(high)],
        "high_load_sustainable": bool(sustainable),
        "saturation_rate_rps": min(over) if over else math.nan,
        "ttft_p50_push_high_load_ms": row("push", high)["ttft_p50_ms"],
        "ttft_p50_pull_high_load_ms": row("pull", high)["ttft_p50_ms"],
        "decode_step_ms_high_load": row("push", high)["decode_step_p50_ms"],
    }
    summary["handover_overhead_push_over_pull"] = (summary["handover_overhead_push_us"]
                                                   / summary["handover_overhead_pull_us"])
    # Where push's handover goes at the high-load point (Release.timings; PUSH_STAGES)
    for stage, us in row("push", high).get("push_stages_p50_us", {}).items():
        summary[f"push_stage_{stage}_us"] = us
    # The same against the cold wire (raw transfers after an idle gap, as kvpush's are)
    cold = "handover_overhead_vs_cold_wire_us_all"
    summary["handover_overhead_push_cold_wire_us"] = overhead("push", cold)
    summary["handover_overhead_pull_cold_wire_us"] = overhead("pull", cold)
    summary["handover_overhead_push_over_pull_cold_wire"] = (
        summary["handover_overhead_push_cold_wire_us"]
        / summary["handover_overhead_pull_cold_wire_us"])
    return {
        "config": {"prompts": cfg.prompts, "rate_fractions": cfg.rate_fractions,
                   "rates_rps": rates, "capacity_rps": cfg.capacity,
                   "requests_per_point": cfg.requests, "step_s": cfg.step_s,
                   "step_per_request_s": cfg.step_per_request_s,
                   "step_per_token_s": cfg.step_per_token_s,
                   "output_tokens": cfg.output_tokens, "max_batch": cfg.max_batch,
                   "background": cfg.background,
                   "background_batch": [background_batch(cfg, r)[0] for r in rates],
                   "decode_steps": cfg.decode_steps, "num_blocks": cfg.num_blocks,
                   "regions": REGIONS, "block_bytes_per_region": BLOCK_BYTES,
                   "sustained_fraction": SUSTAINED,
                   "prefill_model": "2 ms + 20 us*T + 1 ns*T^2 (sleep)",
                   "step_model": "step_s + B*step_per_request_s + context*step_per_token_s"},
        "wire": wire_rows,
        "runs": runs,
        "summary": summary,
    }
