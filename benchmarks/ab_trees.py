"""Two kvpush trees side by side, request by request: is a hot-path change a gain here?

On a shared 2-core host one run's per-request figures drift by hundreds of microseconds
from one minute to the next, so a change measured before/after in separate runs is mostly
measuring the host. This runs both trees at once: the working tree (``head``) and a git
revision (``base``, checked out in a temporary worktree), each as its own pair of spawned
processes (a Producer and a Consumer, one request at a time), and alternates them request
by request (``head, base`` then ``base, head``), so a slow minute hits both alike. Per size
it times:

* ``push_release``: ``prefill_done`` -> the release reaches the prefill engine (the
  engine's thread waits on ``fileno()`` and drains ``get_released()``, as the vLLM adapter
  does; ``--callbacks``: an ``on_release`` callback sets an event instead);
* ``push_result``: ``prefill_done`` -> the decode engine's ``wait()`` returns READY (one
  monotonic clock for the processes of a host);
* ``pull``: ``Consumer.pull`` -> READY.

The engine sleeps ``--gap`` before each timed call, as an engine is busy elsewhere between
requests (cores go idle, caches cold). Reported per size and metric: each tree's p50 and
the median of the paired differences (head - base, round by round) with a 95% bootstrap
interval; an interval that spans 0 is noise. The layout is the hot-path benchmark's (16
regions of 4 KiB blocks: 1 block is 64 KiB).

``python -m benchmarks.ab_trees BASE [--requests N] [--blocks 1,16,64] [--gap S]
[--callbacks] [--json PATH]``

``base``'s compiled core is the working tree's (copied) when ``csrc/`` and ``setup.py``
do not differ between them, else built in its worktree. The worktree is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing.connection as mpc
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from ._procs import Worker, stop_all

__all__ = ["compare", "main", "paired"]

_M = "benchmarks.ab_trees:"
ROOT = Path(__file__).resolve().parents[1]
NUM_BLOCKS = 1024
REGIONS, BLOCK_BYTES = 16, 4096
METRICS = ("push_release", "push_result", "pull")


# -- in the workers ------------------------------------------------------------------------
def side_open(state: dict[str, Any], conn: mpc.Connection, tree: str, role: str,
              address: str = "", callbacks: bool = False) -> str:
    """Import kvpush from ``tree`` (nothing of it is imported before) and open the side's
    endpoint over a fresh cache; returns the producer's address (prefill) or name."""
    sys.path.insert(0, tree)
    import kvpush

    where = Path(kvpush.__file__).resolve()
    if not where.is_relative_to(Path(tree).resolve()):
        raise RuntimeError(f"kvpush came from {where}, not from {tree}")
    buffers = [np.zeros((NUM_BLOCKS, BLOCK_BYTES), dtype=np.uint8) for _ in range(REGIONS)]
    layout = kvpush.KVLayout.from_buffers(
        buffers, num_layers=REGIONS // 2, num_blocks=NUM_BLOCKS, tokens_per_block=16,
        num_kv_heads=2, head_size=64, dtype="float16", kv_packed=False)
    state["buffers"] = buffers  # registered memory lives as long as the endpoint
    if role == "prefill":
        events: dict[str, threading.Event] = {}
        state["events"] = events

        def on_release(release: Any) -> None:
            events.setdefault(release.request_id, threading.Event()).set()

        p = kvpush.Producer(layout, on_release=on_release if callbacks else None)
        state.update(endpoint=p, callbacks=callbacks)
        state["cleanup"].append(p.close)
        return str(p.address)
    c = kvpush.Consumer(layout)
    state["cleanup"].append(c.close)
    state.update(endpoint=c, producer=c.connect(address, timeout=30), handles={})
    return str(state["producer"])


def _release_wait(state: dict[str, Any], rid: str, timeout: float) -> None:
    events: dict[str, threading.Event] = state["events"]
    if state["callbacks"]:
        if not events.setdefault(rid, threading.Event()).wait(timeout):
            raise TimeoutError(f"{rid}: no release in {timeout} s")
        return
    p = state["endpoint"]
    deadline = time.monotonic() + timeout
    while True:
        for release in p.get_released():
            events.setdefault(release.request_id, threading.Event()).set()
        if rid in events:
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{rid}: no release in {timeout} s")
        select.select([p.fileno()], [], [], left)


def side_expect(state: dict[str, Any], conn: mpc.Connection, rid: str,
                ids: np.ndarray) -> None:
    c = state["endpoint"]
    state["handles"][rid] = c.expect(rid, ids, state["producer"], timeout=30)


def side_result(state: dict[str, Any], conn: mpc.Connection, rid: str) -> int:
    result = state["handles"].pop(rid).wait(30)
    done = time.monotonic_ns()
    if not result.ok:
        raise RuntimeError(f"{rid}: {result.state} {result.error}")
    return done


def side_push(state: dict[str, Any], conn: mpc.Connection, rid: str, ids: np.ndarray,
              gap: float) -> tuple[int, int]:
    from kvpush.metrics import LIVE

    deadline = time.monotonic() + 30
    while LIVE.snapshot().get("registrations_waiting", 0) < 1:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{rid}: the registration did not come")
        time.sleep(0.0005)
    time.sleep(gap)
    t0 = time.monotonic_ns()
    state["endpoint"].prefill_done(rid, ids)
    _release_wait(state, rid, 30)
    return t0, time.monotonic_ns()


def side_ticket(state: dict[str, Any], conn: mpc.Connection, rid: str,
                ids: np.ndarray) -> bytes:
    import kvpush

    ticket: bytes = state["endpoint"].prefill_done(rid, ids, kvpush.TransferMode.PULL
                                                   ).to_bytes()
    return ticket


def side_pull(state: dict[str, Any], conn: mpc.Connection, rid: str, ticket: bytes,
              ids: np.ndarray, gap: float) -> int:
    time.sleep(gap)
    t0 = time.monotonic_ns()
    result = state["endpoint"].pull(ticket, ids, timeout=30).wait(30)
    dt = time.monotonic_ns() - t0
    if not result.ok:
        raise RuntimeError(f"{rid}: {result.state} {result.error}")
    return dt


def side_released(state: dict[str, Any], conn: mpc.Connection, rid: str) -> None:
    _release_wait(state, rid, 30)


# -- in the parent -------------------------------------------------------------------------
def paired(diffs: list[float], seed: int = 0, resamples: int = 2000
           ) -> tuple[float, float, float]:
    """Median of paired differences and its 95% bootstrap interval."""
    a = np.asarray(diffs, dtype=float)
    if len(a) == 0:
        return math.nan, math.nan, math.nan
    rng = np.random.default_rng(seed)
    meds = np.median(a[rng.integers(0, len(a), size=(resamples, len(a)))], axis=1)
    return float(np.median(a)), float(np.percentile(meds, 2.5)), float(np.percentile(meds, 97.5))


def _worktree(base: str, where: Path) -> Path:
    tree = where / "base"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree),
                    base], check=True)
    same_core = subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", base, "--",
                                "csrc", "setup.py"]).returncode == 0
    built = sorted((ROOT / "kvpush").glob("_core*.so"))
    if same_core and built:
        for so in built:
            shutil.copy2(so, tree / "kvpush" / so.name)
    else:
        print(f"[ab_trees] building the compiled core of {base}", file=sys.stderr)
        subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
                       cwd=tree, check=True, stdout=subprocess.DEVNULL)
    return tree


def compare(base: str, requests: int, blocks: list[int], gap: float, callbacks: bool,
            progress: bool = True) -> dict[str, Any]:
    """Run the comparison; returns ``{"rows": [...], "meta": {...}}``."""
    if requests < 2:
        raise ValueError("--requests must be at least 2 (round 0 warms up)")
    if not blocks or any(not 0 < n <= NUM_BLOCKS // 3 for n in blocks):
        raise ValueError(f"--blocks must be in [1, {NUM_BLOCKS // 3}]")
    tmp = Path(tempfile.mkdtemp(prefix="kvpush-ab-"))
    workers: list[Worker] = []
    try:
        trees = {"head": ROOT, "base": _worktree(base, tmp)}
        sides: dict[str, tuple[Worker, Worker]] = {}
        for name, tree in trees.items():
            p, c = Worker(f"ab-{name}-prefill"), Worker(f"ab-{name}-decode")
            workers += [p, c]
            address = p.call(_M + "side_open", tree=str(tree), role="prefill",
                             callbacks=callbacks)
            c.call(_M + "side_open", tree=str(tree), role="decode", address=address)
            sides[name] = (p, c)
        times: dict[tuple[str, int, str], list[float]] = {
            (t, n, k): [] for t in trees for n in blocks for k in METRICS}
        t_start = time.monotonic()
        for i in range(requests):
            order = ("head", "base") if i % 2 == 0 else ("base", "head")
            for n in blocks:
                ids = (np.arange(n, dtype=np.int64) * 3) % NUM_BLOCKS
                for name in order:
                    p, c = sides[name]
                    rid = f"{name}-{n}-{i}"
                    c.call(_M + "side_expect", rid=rid, ids=ids)
                    t0, released = p.call(_M + "side_push", rid=rid, ids=ids, gap=gap)
                    landed = c.call(_M + "side_result", rid=rid)
                    ticket = p.call(_M + "side_ticket", rid=rid + "-pull", ids=ids)
                    pulled = c.call(_M + "side_pull", rid=rid + "-pull", ticket=ticket,
                                    ids=ids, gap=gap)
                    p.call(_M + "side_released", rid=rid + "-pull")
                    if i:  # round 0 warms both trees up
                        times[(name, n, "push_release")].append((released - t0) / 1e3)
                        times[(name, n, "push_result")].append((landed - t0) / 1e3)
                        times[(name, n, "pull")].append(pulled / 1e3)
            if progress and (i + 1) % max(1, requests // 10) == 0:
                print(f"[ab_trees] round {i + 1}/{requests} "
                      f"({time.monotonic() - t_start:.0f} s)", file=sys.stderr)
        rows = []
        for n in blocks:
            for k in METRICS:
                head, old = times[("head", n, k)], times[("base", n, k)]
                med, lo, hi = paired([h - b for h, b in zip(head, old, strict=True)])
                rows.append({"blocks": n, "bytes": n * REGIONS * BLOCK_BYTES, "metric": k,
                             "base_p50_us": float(np.median(old)),
                             "head_p50_us": float(np.median(head)),
                             "diff_p50_us": med, "diff_lo_us": lo, "diff_hi_us": hi,
                             "noise": bool(lo <= 0 <= hi)})
        return {"rows": rows, "meta": {"base": base, "requests": requests, "gap_s": gap,
                                       "callbacks": callbacks, "blocks": blocks}}
    finally:
        stop_all(workers)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                        str(tmp / "base")], check=False, stderr=subprocess.DEVNULL)
        shutil.rmtree(tmp, ignore_errors=True)


def table(out: dict[str, Any]) -> str:
    meta = out["meta"]
    lines = [f"head (working tree) vs base {meta['base']}: {meta['requests'] - 1} rounds, "
             f"gap {meta['gap_s'] * 1e3:g} ms, releases by "
             f"{'callback' if meta['callbacks'] else 'fileno + get_released'}",
             "", "| size | metric | base p50 us | head p50 us | head - base, median "
             "[95%] us | |", "|---|---|---|---|---|---|"]
    for r in out["rows"]:
        size = r["bytes"] // 1024
        lines.append(f"| {size} KiB | {r['metric']} | {r['base_p50_us']:.0f} | "
                     f"{r['head_p50_us']:.0f} | {r['diff_p50_us']:+.0f} "
                     f"[{r['diff_lo_us']:+.0f}, {r['diff_hi_us']:+.0f}] | "
                     f"{'noise' if r['noise'] else ('gain' if r['diff_p50_us'] < 0 else 'loss')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ab_trees", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", help="git revision to compare the working tree against")
    ap.add_argument("--requests", type=int, default=200, help="rounds (the first warms up)")
    ap.add_argument("--blocks", default="1,16,64",
                    help="blocks per request, comma-separated (x 16 regions x 4 KiB)")
    ap.add_argument("--gap", type=float, default=0.002, help="engine idle before each call, s")
    ap.add_argument("--callbacks", action="store_true",
                    help="releases by on_release callback instead of fileno + get_released")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args(argv)
    try:
        blocks = [int(b) for b in args.blocks.split(",")]
    except ValueError:
        ap.error(f"--blocks must be integers, got {args.blocks!r}")
    if not 0 <= args.gap <= 1:
        ap.error("--gap must be in [0, 1] s")
    try:
        out = compare(args.base, args.requests, blocks, args.gap, args.callbacks)
    except (ValueError, subprocess.CalledProcessError) as exc:
        print(f"ab_trees: {exc}", file=sys.stderr)
        return 2
    print(table(out))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
