"""Descriptor preparation: block ids -> NIXL descriptor indices, compiled vs numpy.

For caches shaped like real models (every block id names one block in each of R regions:
one per layer, or one per layer for K and one for V) and prompts of 1k..32k tokens with
scattered block ids on both sides, time

* ``kvpush.plan.plan_transfer`` -- the compiled core: validation (range, duplicates),
  ordering by local id, coalescing of runs adjacent on both sides, region-major int32 indices;
* the numpy reference of the same function (``kvpush._reference.plan_transfer``; if that
  module is absent, :func:`numpy_plan` here, which does the same work);
* "vLLM-style" numpy: per-region index arithmetic only (``region * num_blocks + ids`` for
  every region, flattened), no validation and no coalescing -- the least a connector does.

Also counts descriptors per request before coalescing (blocks x regions) and after.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._common import Progress

__all__ = ["PRESETS", "Preset", "numpy_plan", "run", "vllm_style"]


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

CACHE_BLOCKS = 32768  # blocks per region on each side (a 32k-token prompt needs 2048)


def vllm_style(local_ids: np.ndarray, remote_ids: np.ndarray, local_num_blocks: int,
               remote_num_blocks: int, num_regions: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-region index arithmetic in numpy, the way vLLM's NIXL connector maps block ids:
    no validation, no coalescing."""
    region = np.arange(num_regions, dtype=np.int64)[:, None]
    local = (region * local_num_blocks + local_ids[None, :]).ravel()
    remote = (region * remote_num_blocks + remote_ids[None, :]).ravel()
    return local, remote


@dataclass
class NumpyPlan:
    local_indices: np.ndarray
    remote_indices: np.ndarray
    num_blocks: int
    num_descriptors: int


def numpy_plan(local_ids: np.ndarray, remote_ids: np.ndarray, local_num_blocks: int,
               remote_num_blocks: int, num_regions: int, coalesce: bool = True) -> NumpyPlan:
    """The compiled planner's work in numpy (used when ``kvpush._reference`` is absent):
    range and duplicate checks, order by local id, runs adjacent on both sides, indices."""
    if len(local_ids) != len(remote_ids):
        raise ValueError("length mismatch")
    for ids, nb in ((local_ids, local_num_blocks), (remote_ids, remote_num_blocks)):
        if len(ids) and (ids.min() < 0 or ids.max() >= nb):
            raise ValueError("block id out of range")
        if len(np.unique(ids)) != len(ids):
            raise ValueError("duplicate block id")
    local, remote = local_ids.astype(np.int64), remote_ids.astype(np.int64)
    if coalesce:
        order = np.argsort(local, kind="stable")
        local, remote = local[order], remote[order]
    n = len(local)
    runs = n
    if n > 1:
        runs = 1 + int(np.count_nonzero((np.diff(local) != 1) | (np.diff(remote) != 1)))
    li, ri = vllm_style(local, remote, local_num_blocks, remote_num_blocks, num_regions)
    return NumpyPlan(li.astype(np.int32), ri.astype(np.int32), n, runs * num_regions)


def _reference() -> tuple[Callable[..., Any], str]:
    try:
        from kvpush import _reference as ref

        return ref.plan_transfer, "kvpush._reference.plan_transfer"
    except (ImportError, AttributeError):
        return numpy_plan, "benchmarks.desc_prep.numpy_plan (kvpush._reference absent)"


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
            for _ in range(max(5, int(per_block / est[name]))):
                t0 = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - t0)
    return {k: float(np.median(v)) for k, v in samples.items()}


def run(quick: bool, progress: bool = True, min_time: float | None = None,
        prompts: list[int] | None = None) -> dict[str, Any]:
    from kvpush.plan import plan_transfer

    from ._common import block_ids

    ref_fn, ref_name = _reference()
    if prompts is None:
        prompts = [1024, 8192, 32768] if quick else [1024, 2048, 4096, 8192, 16384, 32768]
    min_time = min_time if min_time is not None else (0.15 if quick else 0.5)
    rows: list[dict[str, Any]] = []
    bar = Progress("desc-prep", len(PRESETS) * len(prompts), progress)
    for preset in PRESETS.values():
        for tokens in prompts:
            n = -(-tokens // preset.tokens_per_block)
            row: dict[str, Any] = {"preset": preset.name, "tokens": tokens, "blocks": n,
                                   "regions": preset.regions}
            for order in ("scattered", "runs"):
                local, remote = block_ids(order, n, CACHE_BLOCKS, CACHE_BLOCKS, seed=tokens)
                args = (local, remote, CACHE_BLOCKS, CACHE_BLOCKS, preset.regions)
                plan = plan_transfer(*args, True)
                ref = ref_fn(*args, True)
                if not (np.array_equal(np.asarray(plan.local_indices),
                                       np.asarray(ref.local_indices))
                        and np.array_equal(np.asarray(plan.remote_indices),
                                           np.asarray(ref.remote_indices))):
                    raise AssertionError(f"{preset.name} {tokens}: compiled plan differs "
                                         "from the numpy reference")
                row[f"descriptors_before_{order}"] = n * preset.regions
                row[f"descriptors_after_{order}"] = int(plan.num_descriptors)
                if order != "scattered":
                    continue
                t = _interleaved({
                    "core": lambda a=args: plan_transfer(*a, True),
                    "core_nc": lambda a=args: plan_transfer(*a, False),
                    "ref": lambda a=args: ref_fn(*a, True),
                    "vllm": lambda a=args: vllm_style(*a),
                }, min_time)
                t_core, t_core_nc, t_ref, t_vllm = t["core"], t["core_nc"], t["ref"], t["vllm"]
                row.update({
                    "compiled_us": t_core * 1e6,
                    "compiled_no_coalesce_us": t_core_nc * 1e6,
                    "reference_us": t_ref * 1e6,
                    "vllm_style_us": t_vllm * 1e6,
                    "speedup_vs_reference": t_ref / t_core,
                    "speedup_vs_vllm_style": t_vllm / t_core,
                })
            rows.append(row)
            bar.step(f"{preset.name} {tokens // 1024}k")
    bar.finish()
    key = next((r for r in rows if r["preset"] == "qwen3-32b" and r["tokens"] == 8192), rows[0])
    return {
        "reference": ref_name,
        "cache_blocks": CACHE_BLOCKS,
        "rows": rows,
        "summary": {
            "desc_prep_speedup_vs_numpy": key["speedup_vs_reference"],
            "desc_prep_speedup_vs_vllm_style": key["speedup_vs_vllm_style"],
            "desc_prep_qwen3_32b_8k_us": key["compiled_us"],
        },
    }
