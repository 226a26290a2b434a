"""Two kvpush trees side by side, request by request: is a hot-path change a gain here?

On a shared 2-core host one run's per-request figures drift by hundreds of microseconds
from one minute to the next, so a change measured before/after in separate runs is mostly
measuring the host. This runs both trees at once: the working tree (``head``) and a git
revision (``base``, checked out in a temporary worktree), each as its own pair of spawned
processes (a Producer and a Consumer, one request at a time), and alternates them request
by request (``head, base`` then ``base, head``), so a slow minute hits both alike. A pair of
processes also has lasting quirks of its own (the same code gave 0.27 ms apart at 4 MiB
between two pairs here), so the run is cut into ``--segments``, each with fresh pairs for
both trees (made in alternating order). Per size it times:

* ``push_release``: ``prefill_done`` -> the release reaches the prefill engine (the
  engine's thread waits on ``fileno()`` and drains ``get_released()``, as the vLLM adapter
  does; ``--callbacks``: an ``on_release`` callback sets an event instead);
* ``push_result``: ``prefill_done`` -> the decode engine's ``wait()`` returns READY (one
  monotonic clock for the processes of a host);
* ``pull``: ``Consumer.pull`` -> READY.

The engine sleeps ``--gap`` before each timed call, as an engine is busy elsewhere between
requests (cores go idle, caches cold). Reported per size and metric: each tree's p50, the
median of the paired differences (head - base, round by round) with a 95% interval from a
two-level bootstrap (segments, then rounds within them), and each segment's median; an
interval that spans 0 is noise. The layout is the hot-path benchmark's (16 regions of
4 KiB blocks: 1 block is 64 KiB).

``python -m benchmarks.ab_trees BASE [--requests N] [--segments S] [--blocks 1,16,64]
[--gap S] [--callbacks] [--json PATH]``

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
    from .throughput import _wait_registrations  # kvpush is the tree's by now

    _wait_registrations(1, 30.0)
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
def paired(segments: list[list[float]], seed: int = 0, resamples: int = 2000
           ) -> tuple[float, float, float]:
    """Median of paired differences and its 95% interval, by a two-level bootstrap: the
    segments (fresh process pairs) with replacement, then the differences within each.
    Each pair of processes has lasting quirks of its own (which core, which pages: up to
    0.27 ms at 4 MiB here), so the segments, not the requests, are the independent draws."""
    segs = [np.asarray(d, dtype=float) for d in segments if len(d)]
    if not segs:
        return math.nan, math.nan, math.nan
    rng = np.random.default_rng(seed)
    meds = np.empty(resamples)
    for r in range(resamples):
        picked = [segs[k] for k in rng.integers(0, len(segs), size=len(segs))]
        meds[r] = np.median(np.concatenate([d[rng.integers(0, len(d), size=len(d))]
                                            for d in picked]))
    return (float(np.median(np.concatenate(segs))), float(np.percentile(meds, 2.5)),
            float(np.percentile(meds, 97.5)))


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


def _open_pairs(trees: dict[str, Path], order: tuple[str, ...], callbacks: bool,
                workers: list[Worker]) -> dict[str, tuple[Worker, Worker]]:
    sides: dict[str, tuple[Worker, Worker]] = {}
    for name in order:
        p, c = Worker(f"ab-{name}-prefill"), Worker(f"ab-{name}-decode")
        workers += [p, c]
        address = p.call(_M + "side_open", tree=str(trees[name]), role="prefill",
                         callbacks=callbacks)
        c.call(_M + "side_open", tree=str(trees[name]), role="decode", address=address)
        sides[name] = (p, c)
    return sides


def _round(sides: dict[str, tuple[Worker, Worker]], order: tuple[str, ...], i: int, n: int,
           gap: float) -> dict[str, dict[str, float]]:
    """One request of each kind per tree, in ``order``; us per metric per tree."""
    ids = (np.arange(n, dtype=np.int64) * 3) % NUM_BLOCKS
    out: dict[str, dict[str, float]] = {}
    for name in order:
        p, c = sides[name]
        rid = f"{name}-{n}-{i}"
        c.call(_M + "side_expect", rid=rid, ids=ids)
        t0, released = p.call(_M + "side_push", rid=rid, ids=ids, gap=gap)
        landed = c.call(_M + "side_result", rid=rid)
        ticket = p.call(_M + "side_ticket", rid=rid + "-pull", ids=ids)
        pulled = c.call(_M + "side_pull", rid=rid + "-pull", ticket=ticket, ids=ids,
                        gap=gap)
        p.call(_M + "side_released", rid=rid + "-pull")
        out[name] = {"push_release": (released - t0) / 1e3,
                     "push_result": (landed - t0) / 1e3, "pull": pulled / 1e3}
    return out


def compare(base: str, requests: int, blocks: list[int], gap: float, callbacks: bool,
            segments: int = 4, progress: bool = True) -> dict[str, Any]:
    """Run the comparison: ``segments`` times, fresh process pairs for both trees (made
    in alternating order), ``requests // segments`` rounds each (the first warms up);
    returns ``{"rows": [...], "meta": {...}}``."""
    if segments < 1:
        raise ValueError("--segments must be at least 1")
    if requests < 2 * segments:
        raise ValueError("--requests must be at least 2 per segment (round 0 warms up)")
    if not blocks or any(not 0 < n <= NUM_BLOCKS // 3 for n in blocks):
        raise ValueError(f"--blocks must be in [1, {NUM_BLOCKS // 3}]")
    tmp = Path(tempfile.mkdtemp(prefix="kvpush-ab-"))
    workers: list[Worker] = []
    try:
        # The working tree's package is copied beside the base's: both trees are then
        # imported from the same file system (an A/A run from ROOT itself differed).
        shutil.copytree(ROOT / "kvpush", tmp / "head" / "kvpush",
                        ignore=shutil.ignore_patterns("__pycache__"))
        trees = {"head": tmp / "head", "base": _worktree(base, tmp)}
        # times[(tree, blocks, metric)][segment] -> us per request
        times: dict[tuple[str, int, str], list[list[float]]] = {
            (t, n, k): [[] for _ in range(segments)] for t in trees for n in blocks
            for k in METRICS}
        t_start = time.monotonic()
        rounds = requests // segments
        for seg in range(segments):
            made = ("head", "base") if seg % 2 == 0 else ("base", "head")
            sides = _open_pairs(trees, made, callbacks, workers)
            for i in range(rounds):
                order = ("head", "base") if i % 2 == 0 else ("base", "head")
                for n in blocks:
                    got = _round(sides, order, i, n, gap)
                    if i:  # round 0 warms both trees up
                        for name, metrics in got.items():
                            for k, v in metrics.items():
                                times[(name, n, k)][seg].append(v)
            stop_all(workers)
            workers.clear()
            if progress:
                print(f"[ab_trees] segment {seg + 1}/{segments} "
                      f"({time.monotonic() - t_start:.0f} s)", file=sys.stderr)
        rows = []
        for n in blocks:
            for k in METRICS:
                head, old = times[("head", n, k)], times[("base", n, k)]
                diffs = [[h - b for h, b in zip(hs, bs, strict=True)]
                         for hs, bs in zip(head, old, strict=True)]
                med, lo, hi = paired(diffs)
                rows.append({"blocks": n, "bytes": n * REGIONS * BLOCK_BYTES, "metric": k,
                             "base_p50_us": float(np.median(np.concatenate(old))),
                             "head_p50_us": float(np.median(np.concatenate(head))),
                             "diff_p50_us": med, "diff_lo_us": lo, "diff_hi_us": hi,
                             "segment_diffs_us": [float(np.median(d)) for d in diffs],
                             "noise": bool(lo <= 0 <= hi)})
        return {"rows": rows, "meta": {"base": base, "requests": requests,
                                       "segments": segments, "gap_s": gap,
                                       "callbacks": callbacks, "blocks": blocks}}
    finally:
        stop_all(workers)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                        str(tmp / "base")], check=False, stderr=subprocess.DEVNULL)
        shutil.rmtree(tmp, ignore_errors=True)


def table(out: dict[str, Any]) -> str:
    meta = out["meta"]
    lines = [f"head (working tree) vs base {meta['base']}: {meta['requests']} rounds in "
             f"{meta['segments']} segments (fresh process pairs each), gap "
             f"{meta['gap_s'] * 1e3:g} ms, releases by "
             f"{'callback' if meta['callbacks'] else 'fileno + get_released'}",
             "", "| size | metric | base p50 us | head p50 us | head - base, median "
             "[95%] us | per segment | |", "|---|---|---|---|---|---|---|"]
    for r in out["rows"]:
        size = r["bytes"] // 1024
        verdict = "noise" if r["noise"] else ("gain" if r["diff_p50_us"] < 0 else "loss")
        per = " ".join(f"{d:+.0f}" for d in r["segment_diffs_us"])
        lines.append(f"| {size} KiB | {r['metric']} | {r['base_p50_us']:.0f} | "
                     f"{r['head_p50_us']:.0f} | {r['diff_p50_us']:+.0f} "
                     f"[{r['diff_lo_us']:+.0f}, {r['diff_hi_us']:+.0f}] | {per} | "
                     f"{verdict} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ab_trees", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", help="git revision to compare the working tree against")
    ap.add_argument("--requests", type=int, default=400,
                    help="rounds in all (the first of each segment warms up)")
    ap.add_argument("--segments", type=int, default=4,
                    help="fresh process pairs this many times (the independent draws)")
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
        out = compare(args.base, args.requests, blocks, args.gap, args.callbacks,
                      args.segments)
    except (ValueError, subprocess.CalledProcessError) as exc:
        print(f"ab_trees: {exc}", file=sys.stderr)
        return 2
    print(table(out))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
