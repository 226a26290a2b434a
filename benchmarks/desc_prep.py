"""Descriptor preparation, honestly: where a request's CPU time goes between its block ids
and a NIXL transfer handle.

For a Qwen3-32B-shaped cache (64 layers, K and V in separate regions: 128 regions of
16-token blocks) and requests of 512 and 8,192 blocks, with ids ``scattered`` (random on
both sides: no runs), in ``runs`` (runs of 8 blocks adjacent on both sides, listed in
random order) and ``in_order`` (one run), time, one call at a time (median):

* ``compiled_us`` -- kvpush's planner as the endpoints call it: one
  ``PreparedLink.plan(local_ids, remote_ids)`` (validation, duplicates, ordering by local
  id, runs, the two region-major int32 index lists); ``compiled_args_us`` is the same
  through ``plan_transfer`` with its counts converted on every call;
* ``numpy_us`` -- the same algorithm in numpy, producing the same int32 index lists
  (:func:`numpy_plan`: range and duplicate checks, a stable sort by local id, runs, indices
  computed in int32): what the compiled code saves over numpy doing the same job;
* ``reference_us`` -- ``tests.support.reference.plan_transfer``, the numpy twin the tests hold
  the compiled core to (written for clarity: int64 throughout, ``np.unique`` checks);
* ``vllm_us`` -- the path vLLM's NIXL connector takes (``_get_block_descs_ids``): block ids
  arrive as Python lists, become arrays, and each side's indices are
  ``region * num_blocks + id`` in int64, flattened: no validation, no ordering, no runs;
* ``nixl_prepped_us`` -- NIXL's own cost for the same request: ``make_prepped_xfer`` with
  the plan's index lists, then releasing the handle (nothing posted), between two agents
  in this process with descriptor lists prepared as kvpush prepares them;
* ``nixl_explicit_us`` -- the alternative: explicit merged descriptors, one per (region,
  run), built from the plan's runs in numpy, turned into NIXL descriptor lists and
  ``initialize_xfer``, then released.

The index lists of every method are checked equal to the compiled plan's (vLLM's before
ordering: same multiset). ``explicit_wins`` says which NIXL call was cheaper for the
request; ``nixl_explicit_over_prepped_<order>_<blocks>`` in the summary is the measured ratio
(below 1: explicit merged descriptors are the cheaper call for that shape).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._common import Progress, block_ids

__all__ = ["PRESETS", "Preset", "numpy_plan", "run", "vllm_style"]

NAME = "desc_prep"
DESCRIPTION = ("Descriptor preparation: block ids -> NIXL descriptor indices, compiled planner "
               "against numpy, vLLM's path and NIXL's own calls (Qwen3-32B cache)")
SUMMARY_KEYS: dict[str, str] = {
    "desc_prep_speedup_vs_numpy":
        "numpy's time for the same algorithm over the compiled planner's (8,192 scattered "
        "blocks)",
    "desc_prep_speedup_vs_reference":
        "the numpy reference's (tests.support.reference) time over the compiled planner's (8,192 "
        "blocks)",
    "desc_prep_speedup_vs_vllm":
        "vLLM's connector path's time over the compiled planner's (8,192 blocks)",
    "desc_prep_qwen3_32b_512_us": "compiled plan of 512 scattered blocks, us (median)",
    "desc_prep_qwen3_32b_8192_us": "compiled plan of 8,192 scattered blocks, us (median)",
    "nixl_prepped_qwen3_32b_512_us":
        "NIXL's make_prepped_xfer + release for the 512-block plan, us",
    "nixl_prepped_qwen3_32b_8192_us": "the same for the 8,192-block plan, us",
    "nixl_explicit_over_prepped_{order}_{blocks}":
        "initialize_xfer with merged descriptors over make_prepped_xfer, per block order and "
        "count (below 1: explicit is cheaper)",
}


@dataclass(frozen=True)
class Preset:
    name: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype_bytes: int
    tokens_per_block: int
    kv_separate: bool

    @property
    def regions(self) -> int:
        return self.num_layers * (2 if self.kv_separate else 1)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in one region."""
        return self.tokens_per_block * self.num_kv_heads * self.head_size * self.dtype_bytes * (
            1 if self.kv_separate else 2)


PRESETS = {
    # 64 layers, 8 KV heads x 128, bf16, 16 tokens per block, K and V separate: 128 regions
    # of 32 KiB blocks (4 MiB per block id).
    "qwen3-32b": Preset("qwen3-32b", 64, 8, 128, 2, 16, True),
    # A small model of the same family: 28 layers, 8 KV heads x 128, bf16 -> 56 regions.
    "qwen3-0.6b": Preset("qwen3-0.6b", 28, 8, 128, 2, 16, True),
}

CACHE_BLOCKS = 16384  # blocks per region on each side (an 8k-block request is half of them)
NIXL_DESC_BYTES = 16  # NIXL's costs do not depend on the bytes: registered regions stay small


def vllm_style(local_ids: Any, remote_ids: Any, local_num_blocks: int,
               remote_num_blocks: int, num_regions: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-region index arithmetic the way vLLM's NIXL connector maps block ids
    (``_get_block_descs_ids``, once per side): lists to arrays, ``region * num_blocks +
    id`` in int64, flattened. No validation, no ordering, no coalescing."""
    region = np.arange(num_regions)[:, None]
    local = (region * local_num_blocks + np.array(local_ids)[None, :]).flatten()
    remote = (region * remote_num_blocks + np.array(remote_ids)[None, :]).flatten()
    return local, remote


@dataclass
class NumpyPlan:
    local_indices: np.ndarray
    remote_indices: np.ndarray
    num_blocks: int
    num_descriptors: int


def numpy_plan(local_ids: np.ndarray, remote_ids: np.ndarray, local_num_blocks: int,
               remote_num_blocks: int, num_regions: int, coalesce: bool = True) -> NumpyPlan:
    """The compiled planner's algorithm in numpy, with its output dtype (int32): range and
    duplicate checks, a stable order by local id, runs adjacent on both sides, region-major
    int32 index lists."""
    if len(local_ids) != len(remote_ids):
        raise ValueError("length mismatch")
    local = local_ids.astype(np.int32)
    remote = remote_ids.astype(np.int32)
    for ids, nb in ((local, local_num_blocks), (remote, remote_num_blocks)):
        if len(ids) and (ids.min() < 0 or ids.max() >= nb):
            raise ValueError("block id out of range")
        seen = np.zeros(nb, dtype=bool)
        seen[ids] = True
        if np.count_nonzero(seen) != len(ids):
            raise ValueError("duplicate block id")
    if coalesce:
        order = np.argsort(local, kind="stable")
        local, remote = local[order], remote[order]
    n = len(local)
    runs = n
    if n > 1:
        runs = 1 + int(np.count_nonzero((np.diff(local) != 1) | (np.diff(remote) != 1)))
    region = np.arange(num_regions, dtype=np.int32)[:, None]
    li = (region * np.int32(local_num_blocks) + local[None, :]).ravel()
    ri = (region * np.int32(remote_num_blocks) + remote[None, :]).ravel()
    return NumpyPlan(li, ri, n, runs * num_regions)


def _reference() -> tuple[Callable[..., Any], str]:
    try:
        from tests.support import reference as ref

        return ref.plan_transfer, "tests.support.reference.plan_transfer"
    except (ImportError, AttributeError):
        return numpy_plan, "benchmarks.desc_prep.numpy_plan (tests.support.reference absent)"


def _interleaved(fns: dict[str, Callable[[], Any]], min_time: float, rounds: int = 6
                 ) -> dict[str, float]:
    """Median seconds per call of each function. Calls are timed one by one, in blocks of
    calls of one function (so each runs with its own data in cache, as in a loop), and the
    blocks rotate between functions ``rounds`` times (so a busy host slows all alike);
    about ``min_time`` in all."""
    est = {}
    for name, fn in fns.items():
        fn()  # warm
        t0 = time.perf_counter()
        fn()
        est[name] = max(time.perf_counter() - t0, 1e-6)
    per_block = min_time / (rounds * len(fns))
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            for _ in range(max(3, int(per_block / est[name]))):
                t0 = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - t0)
    return {k: float(np.median(v)) for k, v in samples.items()}


class _Nixl:
    """Two NIXL agents in this process, configured as kvpush configures its own, each with
    ``regions`` registered regions of ``num_blocks`` descriptors, prepared region-major as
    kvpush prepares them (A's local list, B's as A's remote list)."""

    def __init__(self, regions: int, num_blocks: int) -> None:
        from ._common import RawAgent, descriptor_table

        self.regions, self.num_blocks = regions, num_blocks
        self.a = RawAgent("desc-prep-a", "kvpush")
        self.b = RawAgent("desc-prep-b", "kvpush")
        size = num_blocks * NIXL_DESC_BYTES
        self.bufs_a = [np.zeros(size, np.uint8) for _ in range(regions)]
        self.bufs_b = [np.zeros(size, np.uint8) for _ in range(regions)]
        self.a.register(self.bufs_a)
        self.b.register(self.bufs_b)
        self.peer = self.a.add_peer(self.b.metadata())
        self.bases_a = np.array([b.ctypes.data for b in self.bufs_a], dtype=np.uint64)
        self.bases_b = np.array([b.ctypes.data for b in self.bufs_b], dtype=np.uint64)
        self.local = self.a.prep("NIXL_INIT_AGENT", descriptor_table(
            list(self.bases_a), num_blocks, NIXL_DESC_BYTES))
        self.remote = self.a.prep(self.peer, descriptor_table(
            list(self.bases_b), num_blocks, NIXL_DESC_BYTES))

    def prepped(self, plan: Any) -> None:
        handle = self.a.agent.make_prepped_xfer("WRITE", self.local, plan.local_indices,
                                                self.remote, plan.remote_indices, b"")
        handle.release()

    def explicit(self, plan: Any) -> None:
        """Merged descriptors from the plan's runs: one per (region, run) on each side."""
        runs = plan.runs
        lengths = (runs[:, 2] * NIXL_DESC_BYTES).astype(np.uint64)
        agent = self.a.agent
        lists = []
        for bases, col in ((self.bases_a, 0), (self.bases_b, 1)):
            table = np.empty((self.regions * len(runs), 3), dtype=np.uint64)
            table[:, 0] = (bases[:, None] + (runs[None, :, col] * NIXL_DESC_BYTES)
                           .astype(np.uint64)).ravel()
            table[:, 1] = np.tile(lengths, self.regions)
            table[:, 2] = 0
            lists.append(agent.get_xfer_descs(table, "DRAM"))
        handle = agent.initialize_xfer("WRITE", lists[0], lists[1], self.peer, b"")
        handle.release()

    def close(self) -> None:
        for agent in (self.a, self.b):
            with contextlib.suppress(Exception):
                agent.close()


def run(quick: bool, progress: bool = True, min_time: float | None = None,
        prompts: list[int] | None = None, nixl: bool = True) -> dict[str, Any]:
    """``prompts`` are request sizes in tokens (16 per block): 512 and 8,192 blocks by
    default."""
    from kvpush import _core
    from kvpush.plan import plan_transfer

    ref_fn, ref_name = _reference()
    if prompts is None:
        prompts = [512 * 16, 8192 * 16] if quick else [512 * 16, 2048 * 16, 8192 * 16]
    min_time = min_time if min_time is not None else (0.15 if quick else 0.5)
    orders = ("scattered", "runs", "in_order")
    presets = [PRESETS["qwen3-32b"]]
    bar = Progress("desc-prep", len(presets) * len(prompts) * len(orders) + 1, progress)
    rows: list[dict[str, Any]] = []
    agents = _Nixl(presets[0].regions, CACHE_BLOCKS) if nixl else None
    bar.step("NIXL agents up" if nixl else "no NIXL")
    try:
        for preset in presets:
            link = _core.PreparedLink(CACHE_BLOCKS, CACHE_BLOCKS, preset.regions)
            for tokens in prompts:
                n = -(-tokens // preset.tokens_per_block)
                for order in orders:
                    local, remote = block_ids(order, n, CACHE_BLOCKS, CACHE_BLOCKS, seed=n)
                    args = (local, remote, CACHE_BLOCKS, CACHE_BLOCKS, preset.regions)
                    plan = link.plan(local, remote, True)
                    for other in (plan_transfer(*args, True), ref_fn(*args, True),
                                  numpy_plan(*args, True)):
                        if not (np.array_equal(np.asarray(other.local_indices),
                                               plan.local_indices)
                                and np.array_equal(np.asarray(other.remote_indices),
                                                   plan.remote_indices)):
                            raise AssertionError(f"{preset.name} {n} {order}: a plan differs "
                                                 "from the compiled one")
                    lists = (local.tolist(), remote.tolist())
                    v_local, _ = vllm_style(*lists, CACHE_BLOCKS, CACHE_BLOCKS, preset.regions)
                    if not np.array_equal(np.sort(v_local), np.sort(plan.local_indices)):
                        raise AssertionError("vLLM-style indices differ")
                    fns: dict[str, Callable[[], Any]] = {
                        "compiled": lambda lk=link, a=args: lk.plan(a[0], a[1], True),
                        "compiled_args": lambda a=args: plan_transfer(*a, True),
                        "numpy": lambda a=args: numpy_plan(*a, True),
                        "reference": lambda a=args: ref_fn(*a, True),
                        "vllm": lambda li=lists, r=preset.regions: vllm_style(
                            *li, CACHE_BLOCKS, CACHE_BLOCKS, r),
                    }
                    if agents is not None:
                        fns["nixl_prepped"] = lambda p=plan: agents.prepped(p)
                        fns["nixl_explicit"] = lambda p=plan: agents.explicit(p)
                    t = _interleaved(fns, min_time)
                    row: dict[str, Any] = {
                        "preset": preset.name, "tokens": tokens, "blocks": n, "order": order,
                        "regions": preset.regions, "descriptors_before": n * preset.regions,
                        "descriptors_after": int(plan.num_descriptors),
                        **{f"{k}_us": v * 1e6 for k, v in t.items()},
                        "speedup_vs_numpy": t["numpy"] / t["compiled"],
                        "speedup_vs_reference": t["reference"] / t["compiled"],
                        "speedup_vs_vllm": t["vllm"] / t["compiled"],
                    }
                    if agents is not None:
                        row["explicit_wins"] = t["nixl_explicit"] < t["nixl_prepped"]
                    rows.append(row)
                    bar.step(f"{n} blocks {order}")
    finally:
        if agents is not None:
            agents.close()
        bar.finish()
    key = next((r for r in rows if r["blocks"] == 512 and r["order"] == "scattered"), rows[0])
    big = next((r for r in rows if r["blocks"] == 8192 and r["order"] == "scattered"), key)
    summary: dict[str, Any] = {
        "desc_prep_speedup_vs_numpy": big["speedup_vs_numpy"],
        "desc_prep_speedup_vs_reference": big["speedup_vs_reference"],
        "desc_prep_speedup_vs_vllm": big["speedup_vs_vllm"],
        "desc_prep_qwen3_32b_512_us": key["compiled_us"],
        "desc_prep_qwen3_32b_8192_us": big["compiled_us"],
    }
    if nixl:
        summary["nixl_prepped_qwen3_32b_512_us"] = key["nixl_prepped_us"]
        summary["nixl_prepped_qwen3_32b_8192_us"] = big["nixl_prepped_us"]
        # The choice between the two NIXL calls, measured: explicit over prepped per shape
        for r in rows:
            summary[f"nixl_explicit_over_prepped_{r['order']}_{r['blocks']}"] = (
                r["nixl_explicit_us"] / r["nixl_prepped_us"])
    return {"reference": ref_name, "cache_blocks": CACHE_BLOCKS, "rows": rows,
            "summary": summary}
