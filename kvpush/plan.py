"""Block ids -> NIXL descriptor indices: the Python face of the compiled planner.

The work happens in ``kvpush._core`` (C++): validation (dtype, range, duplicates, lengths),
sorting, coalescing of runs that are adjacent on both sides, and the region-major index
arrays ``make_prepped_xfer`` takes. NIXL merges consecutive descriptors with adjacent
addresses into one, so a coalesced plan moves a run of blocks as one piece of memory.
``tests.support.reference`` holds a numpy version of the same functions for tests.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _core
from .errors import InvalidBlockIds, InvalidRequest
from .layout import KVLayout, MemoryKind

__all__ = ["as_block_ids", "block_checksums", "check_request_id", "plan_split_transfer",
           "plan_transfer", "require_host_checksums", "validate_block_ids"]

plan_transfer = _core.plan_transfer


def plan_split_transfer(local_ids: Any, remote_ids: Any, local_num_blocks: int,
                        remote_num_blocks: int, num_regions: int, heads: int,
                        local_split: int, remote_split: int, *,
                        merges: bool = True) -> _core.TransferPlan:
    """Plan a request between sides whose blocks hold different token counts (one a
    multiple of the other): per (region, block, slot, head) descriptors, in C++."""
    return _core.plan_split_transfer(local_ids, remote_ids, local_num_blocks,
                                     remote_num_blocks, num_regions, heads, local_split,
                                     remote_split, merges=merges)


def as_block_ids(ids: Any, name: str) -> np.ndarray:
    """Accept a 1-D int32/int64 numpy array as is, or a list/tuple of ints (copied to
    int64); anything else raises :class:`~kvpush.errors.InvalidBlockIds`."""
    if isinstance(ids, np.ndarray):
        return ids
    if isinstance(ids, (list, tuple)):
        if len(ids) == 0:
            return np.empty(0, dtype=np.int64)
        try:
            arr = np.asarray(ids)
        except ValueError as exc:  # ragged
            raise InvalidBlockIds(f"{name} must be a flat sequence of ints: {exc}") from None
        if arr.dtype.kind not in "iu" or arr.ndim != 1:
            raise InvalidBlockIds(f"{name} must be a sequence of ints, got {arr.dtype} {arr.shape}")
        return arr.astype(np.int64)
    raise InvalidBlockIds(f"{name} must be a numpy int32/int64 array, got {type(ids).__name__}")


#: Longest request id (UTF-8 bytes) accepted at the API and on the wire.
MAX_REQUEST_ID_BYTES = 1024


def check_request_id(request_id: Any) -> str:
    """A request id is a non-empty str that UTF-8 can encode (it travels on the wire), of
    at most :data:`MAX_REQUEST_ID_BYTES` bytes."""
    if not isinstance(request_id, str) or not request_id:
        raise InvalidRequest("request_id must be a non-empty str")
    try:
        size = len(request_id.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise InvalidRequest(f"request_id must be valid UTF-8: {exc}") from None
    if size > MAX_REQUEST_ID_BYTES:
        raise InvalidRequest(f"request_id is {size} bytes; at most {MAX_REQUEST_ID_BYTES}")
    return request_id


def require_host_checksums(layout: KVLayout, what: str) -> None:
    """Checksums are computed on the host, reading the blocks' bytes: a layout with device
    memory (VRAM) cannot have them. Raises ValueError naming ``what`` (the setting)."""
    device = [i for i, r in enumerate(layout.regions) if r.kind is not MemoryKind.DRAM]
    if device:
        raise ValueError(f"{what} needs host (DRAM) memory: per-block checksums read the "
                         f"blocks on the CPU, and region {device[0]} of this layout is "
                         f"{layout.regions[device[0]].kind.value}")


def block_checksums(layout: KVLayout, ids: np.ndarray) -> np.ndarray:
    """One 64-bit checksum per block id (over the block in every region), in ``ids`` order,
    computed in C++ (without the GIL from 16 MiB on). Refuses (ValueError) a layout with
    device memory, which the host cannot read."""
    require_host_checksums(layout, "block_checksums")
    bases = np.array([r.addr for r in layout.regions], dtype=np.uint64)
    sums: np.ndarray = _core.block_checksums(bases, layout.block_stride, layout.block_bytes,
                                             ids, layout.num_blocks)
    return sums


def validate_block_ids(ids: Any, num_blocks: int, name: str) -> np.ndarray:
    """Check ``ids`` (dtype, shape, range ``[0, num_blocks)``, no duplicates) on the
    caller's thread, in compiled code; returns them as a read-only int64 copy the loop
    thread can keep while the caller reuses its array."""
    out: np.ndarray = _core.check_block_ids(as_block_ids(ids, name), num_blocks, name)
    return out
