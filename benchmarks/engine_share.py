"""What kvpush costs the engine's own model thread: step times with and without transfers.

A disaggregated engine's worker process runs its model thread (tensor ops, each letting go of
the GIL inside the kernel and taking it back after) beside kvpush's loop thread. Whatever the
loop does while the model computes -- polling NIXL, spinning, waking up, taking the GIL --
lands on the model's step time, which is the decode server's TPOT and part of the prefill
server's TTFT. The handover benchmarks do not see it: they time kvpush, not the engine.

Two processes (a prefill engine with a :class:`kvpush.Producer`, a decode engine with a
:class:`kvpush.Consumer`), each with a *model thread* that runs steps of small torch ops
(one intra-op thread, as vLLM's CPU workers run, ~2.5 ms a step) and is also the engine's
thread for kvpush calls, as in vLLM: the prefill's hands a request over
(``prefill_done``) every few steps and drains ``get_released()`` every step; the decode's
registers (``expect``) or pulls (``pull``) and drains ``get_finished()`` every step. Rounds
take turns: ``quiet`` (the same steps, no transfers), ``push``, ``pull``, so a loaded host
slows them alike. Reported per side and mode: mean and p90 step time, and the mean over the
quiet rounds' (``engine_step_{side}_{mode}_over_quiet``), and the process CPU outside the
model thread per request (kvpush's loop and NIXL's threads).
"""

from __future__ import annotations

import math
import multiprocessing.connection as mpc
import threading
import time
from typing import Any

import numpy as np

from ._common import Progress, geomean, open_endpoint, pct
from ._procs import Worker, stop_all

__all__ = ["run"]

NAME = "engine_share"
DESCRIPTION = ("What kvpush costs the engine's own model thread: step times with transfers in "
               "flight against quiet rounds")
SUMMARY_KEYS: dict[str, str] = {
    "engine_step_{side}_{mode}_over_quiet":
        "the model thread's mean step with push or pull transfers over the quiet rounds', "
        "prefill or decode side",
    "engine_step_over_quiet": "geometric mean of the four",
}

_M = "benchmarks.engine_share:"
REQUEST_BLOCKS = 16      # 16 blocks x 16 regions x 4 KiB = 1 MiB a request
EVERY = 8                # a request every EVERY model steps (~20 ms: ~50 requests/s)
STEP_S = 2.5e-3          # the model step's target length
MODES = ("quiet", "push", "pull")


def side_setup(state: dict[str, Any], conn: mpc.Connection, role: str, num_blocks: int,
               address: str = "") -> str:
    import torch

    import kvpush

    from .critical_path import _make_cache

    torch.set_num_threads(1)
    buffers, layout = _make_cache(num_blocks)
    state.update(buffers=buffers, layout=layout, role=role)
    # the model: a few layers of small matmuls, repeated to ~STEP_S
    x, w = torch.randn(32, 256), torch.randn(256, 256) * 0.05

    def layer(x: Any) -> Any:
        return torch.relu(x @ w) + x * 0.5

    def step(n: int) -> None:
        y = x
        for _ in range(n):
            y = layer(y)

    for _ in range(20):  # warm up, then size the step to about STEP_S
        step(8)
    took = []
    for _ in range(20):
        t0 = time.perf_counter()
        step(8)
        took.append(time.perf_counter() - t0)
    n = max(1, round(8 * STEP_S / float(np.median(took))))
    state["step"] = lambda: step(n)
    config = kvpush.ProducerConfig(lease_s=60.0) if role == "prefill" else None
    return open_endpoint(state, role, layout, address, config=config)


def side_round(state: dict[str, Any], conn: mpc.Connection, mode: str, rids: list[str],
               ids: np.ndarray, tickets: list[bytes] | None = None,
               seconds: float = 1.5) -> dict[str, Any]:
    """Run the model thread for ``seconds``; in ``push``/``pull`` rounds it also makes one
    kvpush call every EVERY steps (prefill: ``prefill_done``; decode: ``pull`` of the next
    ticket; a push round's registrations are made before it starts) and drains kvpush's
    queues every step. Returns the step times and CPU figures; a prefill pull round returns
    its tickets first (``tickets_only``)."""
    import kvpush

    ep = state["endpoint"]
    role = state["role"]
    if role == "prefill" and mode == "pull" and tickets is None:  # the tickets, at once
        return {"tickets": [ep.prefill_done(rid, ids, kvpush.TransferMode.PULL).to_bytes()
                            for rid in rids]}
    if role == "decode" and mode == "push":
        for rid in rids:
            ep.expect(rid, ids, state["producer"], timeout=60)
    out: dict[str, Any] = {}

    def model() -> None:
        import os

        import torch

        torch.set_num_threads(1)  # OpenMP's thread count is per calling thread
        steps: list[float] = []
        queue: list[Any] = list(rids) if mode == "push" and role == "prefill" else \
            list(tickets or []) if mode == "pull" and role == "decode" else []
        done, total = 0, len(queue)
        # Both clocks count to the nanosecond (a tick-counted thread time would put up to
        # 10 ms of error into a window's "other" CPU).
        cpu0, thread0 = time.process_time(), time.thread_time()
        end = time.perf_counter() + seconds
        i = 0
        while time.perf_counter() < end:
            t = time.perf_counter()
            state["step"]()
            if queue and i % EVERY == 0:
                item = queue.pop(0)
                if role == "prefill":
                    ep.prefill_done(item, ids, kvpush.TransferMode.PUSH)
                else:
                    ep.pull(kvpush.PullTicket.from_bytes(item), ids, timeout=60)
            if role == "prefill":
                done += len(ep.get_released())
            else:
                done += len(ep.get_finished())
            steps.append(time.perf_counter() - t)
            i += 1
        other = (time.process_time() - cpu0) - (time.thread_time() - thread0)
        issued = total - len(queue)
        for item in queue:  # what the round had no time for goes now, untimed
            if role == "prefill":
                ep.prefill_done(item, ids, kvpush.TransferMode.PUSH)
            else:
                ep.pull(kvpush.PullTicket.from_bytes(item), ids, timeout=60)
        out.update(steps=steps, other_cpu_s=other, done=done, pid=os.getpid(),
                   issued=issued if total else None)

    th = threading.Thread(target=model, name="model", daemon=True)
    th.start()
    th.join(seconds + 60)
    if th.is_alive():
        raise TimeoutError("the model thread did not finish its round")
    # what is still owed ends now (a push round's last registrations, late results)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and mode != "quiet":
        got = ep.get_released() if role == "prefill" else ep.get_finished()
        out["done"] += len(got)
        if out["done"] >= len(rids):
            break
        time.sleep(0.01)
    return out


def run(quick: bool, progress: bool = True, rounds: int | None = None,
        seconds: float | None = None) -> dict[str, Any]:
    """``rounds`` of (quiet, push, pull), each ``seconds`` long in both engines."""
    rounds = rounds or (3 if quick else 6)
    seconds = seconds or (1.0 if quick else 1.5)
    per_round = int(seconds / (STEP_S * EVERY)) + 8
    num_blocks = 1024
    bar = Progress("engine-share", 1 + rounds * len(MODES), progress)
    prefill, decode = Worker("es-prefill"), Worker("es-decode")
    steps: dict[tuple[str, str], list[float]] = {}
    other: dict[tuple[str, str], list[float]] = {}
    moved: dict[str, int] = {}
    try:
        address = prefill.call(_M + "side_setup", role="prefill", num_blocks=num_blocks,
                               timeout=120)
        decode.call(_M + "side_setup", role="decode", num_blocks=num_blocks, address=address,
                    timeout=120)
        rng = np.random.default_rng(0)
        src = rng.choice(num_blocks, REQUEST_BLOCKS, replace=False)
        dst = rng.choice(num_blocks, REQUEST_BLOCKS, replace=False)
        bar.step("engines up")
        n = 0
        for r in range(rounds):
            for mode in MODES:
                rids = [f"{mode}-{n + i}" for i in range(per_round)] if mode != "quiet" else []
                n += per_round
                tickets = None
                if mode == "pull":
                    tickets = prefill.call(_M + "side_round", mode=mode, rids=rids,
                                           ids=src)["tickets"]
                # both engines step at once, each in its process
                prefill.send_call(_M + "side_round", mode=mode, rids=rids, seconds=seconds,
                                  ids=src, tickets=[] if mode == "pull" else None)
                d = decode.call(_M + "side_round", mode=mode, rids=rids, seconds=seconds,
                                ids=dst, tickets=tickets, timeout=seconds + 120)
                p = prefill.result(seconds + 120)
                for side, res in (("prefill", p), ("decode", d)):
                    steps.setdefault((side, mode), []).extend(res["steps"][2:])
                    other.setdefault((side, mode), []).append(res["other_cpu_s"])
                if mode != "quiet":  # requests handed over inside the timed round
                    issued = p["issued"] if mode == "push" else d["issued"]
                    moved[mode] = moved.get(mode, 0) + issued
                bar.step(f"round {r + 1} {mode}")
    finally:
        stop_all([decode, prefill])
        bar.finish()
    rows: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    for side in ("prefill", "decode"):
        quiet = steps[(side, "quiet")]
        for mode in MODES:
            vals = steps[(side, mode)]
            row: dict[str, Any] = {
                "side": side, "mode": mode, "steps": len(vals),
                "step_mean_ms": float(np.mean(vals)) * 1e3,
                "step_p50_ms": pct(vals, 50) * 1e3, "step_p90_ms": pct(vals, 90) * 1e3,
                "other_cpu_ms_per_s": 1e3 * sum(other[(side, mode)])
                / (seconds * len(other[(side, mode)])),
            }
            if mode != "quiet":
                row["mean_over_quiet"] = float(np.mean(vals) / np.mean(quiet))
                row["requests"] = moved.get(mode, 0)
                extra = sum(other[(side, mode)]) - sum(other[(side, "quiet")])
                row["other_cpu_us_per_request"] = 1e6 * extra / max(moved.get(mode, 0), 1)
                summary[f"engine_step_{side}_{mode}_over_quiet"] = row["mean_over_quiet"]
            rows.append(row)
    ratio = geomean([r["mean_over_quiet"] for r in rows if r["mode"] != "quiet"])
    summary["engine_step_over_quiet"] = ratio if math.isfinite(ratio) else math.nan
    return {"request_bytes": REQUEST_BLOCKS * 16 * 4096, "every_steps": EVERY,
            "rows": rows, "summary": summary}


if __name__ == "__main__":
    import json
    import sys

    res = run("--quick" in sys.argv)
    for row in res["rows"]:
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v)
                          for k, v in row.items()}))
    print(json.dumps(res["summary"]))
