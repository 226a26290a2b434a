"""Which NIXL call to post a request with, measured end to end: prepared indices
(``make_prepped_xfer``) against explicit merged descriptors (``initialize_xfer``, one per
region and run), the rule kvpush applies (:func:`kvpush.agent.explicit_is_cheaper`) being
what this measures.

A Producer and a Consumer in this process, 128 regions (Qwen3-32B: 64 layers, K and V) of
small blocks (so that NIXL's per-descriptor work shows beside the copy), push requests one at
a time with the registration first. Per shape the two calls alternate request by request
(the rule's thresholds are switched between them); reported per call: the push's time from
``prefill_done`` to its release (p50 / p90) and the time inside ``Agent.post`` (preparation
and NIXL's post, which on a host copies the bytes). ``desc_prep.py`` times the preparation
alone; this is what a request feels.

``python -m benchmarks.nixl_call [--requests N] [--json PATH]``
"""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any

import numpy as np

from ._common import pct, save_json

__all__ = ["SHAPES", "run"]

REGIONS = 128
#: (blocks per request, blocks per run, blocks per region, block bytes)
SHAPES = ((512, 512, 1024, 256), (8192, 8192, 16384, 16), (8192, 512, 16384, 16),
          (4096, 8, 8192, 16))


def _cache(num_blocks: int, block_bytes: int) -> tuple[list[np.ndarray], Any]:
    import kvpush

    bufs = [np.zeros((num_blocks, block_bytes), np.uint8) for _ in range(REGIONS)]
    layout = kvpush.KVLayout.from_buffers(
        bufs, num_layers=REGIONS // 2, num_blocks=num_blocks, tokens_per_block=1,
        num_kv_heads=1, head_size=block_bytes // 2, dtype="float16", kv_packed=False)
    return bufs, layout


def _shape(blocks: int, run: int, num_blocks: int, block_bytes: int, requests: int
           ) -> dict[str, Any]:
    import kvpush
    from kvpush import agent

    src_bufs, src_layout = _cache(num_blocks, block_bytes)  # the buffers live as long
    dst_bufs, dst_layout = _cache(num_blocks, block_bytes)  # as the endpoints use them
    released: dict[str, threading.Event] = {}
    posts: dict[bool, list[float]] = {True: [], False: []}
    pushes: dict[bool, list[float]] = {True: [], False: []}
    original_post = agent.Agent.post

    def timed_post(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        handle = original_post(self, *args, **kwargs)
        posts[self.last_explicit].append(time.perf_counter() - t0)
        return handle

    saved = agent.EXPLICIT_MIN_INDICES, agent.EXPLICIT_MIN_RUN
    agent.Agent.post = timed_post  # type: ignore[method-assign]
    try:
        with kvpush.Producer(src_layout, on_release=lambda r: released[r.request_id].set()
                             ) as producer, kvpush.Consumer(dst_layout) as consumer:
            consumer.connect(producer.address, timeout=30)
            for i in range(requests + 4):
                explicit = bool(i % 2)
                # explicit: every request with runs goes explicit; prepared: none does
                agent.EXPLICIT_MIN_INDICES, agent.EXPLICIT_MIN_RUN = (1, 1) if explicit \
                    else (1 << 62, 1)
                rng = np.random.default_rng(i // 2)  # both calls get the same shapes

                def ids(rng: np.random.Generator = rng) -> np.ndarray:
                    starts = rng.choice(num_blocks // run, blocks // run, replace=False) * run
                    return np.concatenate([np.arange(s, s + run) for s in starts])

                rid = f"r{i}"
                released[rid] = threading.Event()
                handle = consumer.expect(rid, ids(), producer.name)
                time.sleep(0.003)
                src = ids()
                t0 = time.perf_counter()
                producer.prefill_done(rid, src)
                if not released[rid].wait(30):
                    raise TimeoutError(f"push {rid}: no release in 30 s")
                dt = time.perf_counter() - t0
                if not handle.wait(30).ok:
                    raise RuntimeError(f"push {rid} failed")
                if i >= 4:
                    pushes[explicit].append(dt)
            if producer.stats()["transfers_explicit"] != (requests + 4) // 2:
                raise AssertionError("the explicit requests did not all go explicit")
    finally:
        agent.Agent.post = original_post  # type: ignore[method-assign]
        agent.EXPLICIT_MIN_INDICES, agent.EXPLICIT_MIN_RUN = saved
        del src_bufs, dst_bufs
    indices = blocks * REGIONS
    merged = blocks // run * REGIONS
    row: dict[str, Any] = {"blocks": blocks, "run": run, "indices": indices, "merged": merged,
                           "rule_says_explicit": agent.explicit_is_cheaper(indices, merged)}
    for explicit, name in ((False, "prepped"), (True, "explicit")):
        row[f"{name}_push_us_p50"] = pct(pushes[explicit], 50) * 1e6
        row[f"{name}_push_us_p90"] = pct(pushes[explicit], 90) * 1e6
        row[f"{name}_post_us_p50"] = pct(posts[explicit][2:], 50) * 1e6
    row["explicit_over_prepped_push"] = row["explicit_push_us_p50"] / row["prepped_push_us_p50"]
    return row


def run(requests: int = 30) -> list[dict[str, Any]]:
    rows = []
    for shape in SHAPES:
        rows.append(_shape(*shape, requests=requests))
        r = rows[-1]
        print(f"{r['blocks']:5d} blocks in runs of {r['run']:5d} ({r['indices']:8d} indices, "
              f"{r['merged']:6d} merged): push p50 prepped {r['prepped_push_us_p50']:8.0f} us, "
              f"explicit {r['explicit_push_us_p50']:8.0f} us "
              f"(x{r['explicit_over_prepped_push']:.2f}); post p50 "
              f"{r['prepped_post_us_p50']:8.0f} / {r['explicit_post_us_p50']:8.0f} us; "
              f"rule: {'explicit' if r['rule_says_explicit'] else 'prepped'}", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=30, help="per shape (half each call)")
    p.add_argument("--json", default="", help="write the rows here")
    args = p.parse_args()
    rows = run(args.requests)
    save_json(rows, args.json)


if __name__ == "__main__":
    main()
