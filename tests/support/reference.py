"""Pure-Python/numpy twin of :mod:`kvpush._core`, for tests.

Every function and class here has the compiled one's signature and, for the same input,
returns the same values and raises the same exception class with the same message. It is
written for obviousness, not speed; the tests compare the two on generated inputs, so a
rule changed in ``csrc/kvpush`` must be changed here too.

The order of checks, first failure wins (``plan_transfer``): dtype, shape and contiguity
of ``local_ids`` then ``remote_ids``; length mismatch; ``num_regions``,
``local_num_blocks``, ``remote_num_blocks`` at least 1; the local then the remote
descriptor index space fits in int32; local ids in range; remote ids in range; no repeated
local id; no repeated remote id.

``plan_split_transfer`` takes the same arrays, checked first in the same way, then:
``num_regions``, ``local_num_blocks``, ``remote_num_blocks``, ``heads``, ``local_split``,
``remote_split`` at least 1; not both splits above 1; the coarse side (the one whose split
is above 1, else remote) holds exactly ``ceil(n / k)`` ids, ``n`` the fine side's count;
``num_regions * side_num_blocks * side_split * heads`` fits in int32, local then remote;
then ranges and repeats as for ``plan_transfer``.
"""

from __future__ import annotations

import ctypes
import enum
import operator
import threading
from dataclasses import dataclass
from typing import Final, SupportsIndex

import numpy as np
from numpy.typing import NDArray

from kvpush.errors import InvalidBlockIds

__all__ = [
    "DEBUG",
    "Arrival",
    "CompletionTable",
    "PreparedLink",
    "TransferPlan",
    "__version__",
    "block_checksums",
    "check_block_ids",
    "plan_split_transfer",
    "plan_transfer",
]

__version__: Final = "0.1.0"
#: The compiled module reports whether it was built with ``KVPUSH_DEBUG``; the
#: reference has no such build.
DEBUG: Final = False

_INT32_MAX: Final = 2**31 - 1
_INT64_MIN: Final = -(2**63)
_INT64_MAX: Final = 2**63 - 1
_MAX_PARTS: Final = 1 << 24

# The checksum's constants; see csrc/kvpush/checksum.hpp for the definition.
_SEED: Final = 0x243F6A8885A308D3
_MUL1: Final = np.uint64(0x9E3779B97F4A7C15)
_MUL2: Final = np.uint64(0xD1B54A32D192ED03)
_MASK64: Final = 2**64 - 1


def _index(value: SupportsIndex) -> int:
    """Return ``operator.index(value)`` clamped to int64, as the bindings convert ints.

    Clamping keeps an absurd value absurd, so it fails the same validity check with the
    same message in both implementations.
    """
    return min(max(operator.index(value), _INT64_MIN), _INT64_MAX)


def _describe_non_1d(obj: object) -> str:
    if isinstance(obj, np.ndarray):
        return f"{obj.ndim}-D array of {obj.dtype}"
    return repr(type(obj))


def _block_ids(ids: object, name: str) -> NDArray[np.int64]:
    """Check that ``ids`` is a 1-D, C-contiguous, native int32 or int64 array; copy it."""
    expected = f"{name} must be a 1-D int32 or int64 array, got "
    if not isinstance(ids, np.ndarray) or ids.ndim != 1:
        raise InvalidBlockIds(expected + _describe_non_1d(ids))
    # dtype equality includes byte order, as the bindings' check does.
    if ids.dtype != np.dtype(np.int32) and ids.dtype != np.dtype(np.int64):
        raise InvalidBlockIds(expected + str(ids.dtype))
    if isinstance(ids, np.ma.MaskedArray):
        raise InvalidBlockIds(f"{name} must be a plain array, not a masked array (its mask "
                              "would be ignored)")
    if not ids.flags.c_contiguous:
        raise InvalidBlockIds(f"{name} must be C-contiguous")
    if not ids.flags.aligned:
        raise InvalidBlockIds(f"{name} must be aligned to its dtype's size")
    return ids.astype(np.int64)


def _require_positive(name: str, value: int) -> None:
    if value < 1:
        raise InvalidBlockIds(f"{name} must be >= 1, got {value}")


def _check_range(ids: NDArray[np.int64], name: str, num_blocks: int) -> None:
    bad = (ids < 0) | (ids >= num_blocks)
    if bad.any():
        i = int(np.argmax(bad))
        raise InvalidBlockIds(f"{name}[{i}] = {int(ids[i])} is out of range [0, {num_blocks})")


def _check_unique(ids: NDArray[np.int64], name: str) -> None:
    # After a stable sort, every element equal to its predecessor repeats an earlier
    # position; the smallest such position is the first repeat in array order.
    order = np.argsort(ids, kind="stable")
    ordered = ids[order]
    repeats = order[1:][ordered[1:] == ordered[:-1]]
    if repeats.size:
        i = int(repeats.min())
        earlier = int(np.argmax(ids == ids[i]))
        raise InvalidBlockIds(
            f"{name} has duplicate block id {int(ids[i])} (positions {earlier} and {i})"
        )


@dataclass(frozen=True, repr=False, eq=False)
class TransferPlan:
    """Descriptor indices for one transfer: what :func:`plan_transfer` returns.

    :func:`plan_split_transfer` returns one too, with per-head indices and runs; its
    docstring says how the attributes read there.

    Attributes
    ----------
    local_indices, remote_indices : NDArray[np.int32]
        Region-major descriptor indices, ``num_blocks * num_regions`` each, read-only:
        entry ``r * num_blocks + k`` is ``r * side_num_blocks + side_block[k]``.
    runs : NDArray[np.int64]
        Shape ``(num_runs, 3)``, read-only: ``local_start, remote_start, length`` of each
        maximal stretch of pairs that advance by one on both sides, in emitted order.
    num_blocks : int
        Block pairs in the request.
    num_regions : int
        Regions each pair is moved in.
    num_runs : int
        Runs per region.
    num_descriptors : int
        Descriptors NIXL moves: ``num_runs * num_regions`` where it merges each run into
        one, else every index (``merges=False``, or a split plan whose coarse slots hold
        several heads).
    """

    local_indices: NDArray[np.int32]
    remote_indices: NDArray[np.int32]
    runs: NDArray[np.int64]
    num_blocks: int
    num_regions: int
    num_runs: int
    num_descriptors: int

    def __repr__(self) -> str:
        return (
            f"TransferPlan(num_blocks={self.num_blocks}, num_regions={self.num_regions}, "
            f"num_runs={self.num_runs})"
        )


def _read_only(arr: NDArray[np.generic]) -> None:
    arr.flags.writeable = False


def plan_transfer(
    local_ids: NDArray[np.int32] | NDArray[np.int64],
    remote_ids: NDArray[np.int32] | NDArray[np.int64],
    local_num_blocks: int,
    remote_num_blocks: int,
    num_regions: int,
    coalesce: bool = True,
    *,
    merges: bool = True,
) -> TransferPlan:
    """Map block-id pairs to NIXL descriptor indices, optionally coalescing runs.

    Parameters
    ----------
    local_ids, remote_ids : NDArray[np.int32] | NDArray[np.int64]
        1-D, C-contiguous, same length; pair ``i`` moves local block ``local_ids[i]``
        to remote block ``remote_ids[i]`` in every region. No id may repeat on one side.
    local_num_blocks, remote_num_blocks : int
        Blocks per region on each side; ids must lie in ``[0, side_num_blocks)``.
    num_regions : int
        Memory regions of the cache (e.g. one per layer); ``num_regions *
        side_num_blocks`` must fit in int32.
    coalesce : bool, default True
        Sort pairs by local id so blocks adjacent on both sides get adjacent
        descriptor indices, which NIXL merges into one transfer. Otherwise keep the
        given order.
    merges : bool, default True
        Whether adjacent descriptor indices are adjacent bytes on both sides (whole,
        unpadded blocks); only then does NIXL merge runs (see ``num_descriptors``).

    Returns
    -------
    TransferPlan

    Raises
    ------
    InvalidBlockIds
        For the first failed check, in the order given in the module docstring.
    """
    local = _block_ids(local_ids, "local_ids")
    remote = _block_ids(remote_ids, "remote_ids")
    local_blocks = _index(local_num_blocks)
    remote_blocks = _index(remote_num_blocks)
    regions = _index(num_regions)

    if local.size != remote.size:
        raise InvalidBlockIds(
            f"local_ids and remote_ids differ in length: {local.size} != {remote.size}"
        )
    _require_positive("num_regions", regions)
    _require_positive("local_num_blocks", local_blocks)
    _require_positive("remote_num_blocks", remote_blocks)
    for name, blocks in (("local_num_blocks", local_blocks), ("remote_num_blocks", remote_blocks)):
        if blocks > _INT32_MAX // regions:
            raise InvalidBlockIds(
                f"num_regions * {name} = {regions} * {blocks} "
                "does not fit in int32 descriptor indices"
            )
    _check_range(local, "local_ids", local_blocks)
    _check_range(remote, "remote_ids", remote_blocks)
    _check_unique(local, "local_ids")
    _check_unique(remote, "remote_ids")

    if coalesce:
        order = np.argsort(local, kind="stable")
        local, remote = local[order], remote[order]
    n = local.size
    if n:
        breaks = (np.diff(local) != 1) | (np.diff(remote) != 1)
        starts = np.flatnonzero(np.concatenate(([True], breaks)))
        lengths = np.diff(np.append(starts, n))
        runs = np.stack([local[starts], remote[starts], lengths], axis=1).astype(np.int64)
    else:
        runs = np.empty((0, 3), dtype=np.int64)

    region = np.arange(regions, dtype=np.int64)[:, None]
    local_indices = (region * local_blocks + local).ravel().astype(np.int32)
    remote_indices = (region * remote_blocks + remote).ravel().astype(np.int32)
    for arr in (local_indices, remote_indices, runs):
        _read_only(arr)
    return TransferPlan(
        local_indices=local_indices,
        remote_indices=remote_indices,
        runs=runs,
        num_blocks=n,
        num_regions=regions,
        num_runs=len(runs),
        num_descriptors=len(runs) * regions if merges else n * regions,
    )


def check_block_ids(
    ids: NDArray[np.int32] | NDArray[np.int64], num_blocks: int, name: str = "block_ids"
) -> NDArray[np.int64]:
    """Validate one side's block ids on their own; return a read-only int64 copy."""
    out = _block_ids(ids, name)
    blocks = _index(num_blocks)
    _require_positive("num_blocks", blocks)
    _check_range(out, name, blocks)
    _check_unique(out, name)
    _read_only(out)
    return out


def plan_split_transfer(
    local_ids: NDArray[np.int32] | NDArray[np.int64],
    remote_ids: NDArray[np.int32] | NDArray[np.int64],
    local_num_blocks: int,
    remote_num_blocks: int,
    num_regions: int,
    heads: int,
    local_split: int,
    remote_split: int,
    *,
    merges: bool = True,
) -> TransferPlan:
    """Map fine blocks to per-head slots of coarse blocks as NIXL descriptor indices.

    One side's block holds ``k`` times the tokens of the other's; the side whose split is
    ``k`` is coarse. Fine id ``i`` pairs with slot ``i % k`` of coarse block
    ``coarse_ids[i // k]``. On each side, (region ``r``, block ``b``, slot ``s``, head
    ``h``) is descriptor ``((r * side_num_blocks + b) * side_split + s) * heads + h``.

    Returns
    -------
    TransferPlan
        ``local_indices``, ``remote_indices``: ``num_regions * n * heads`` each, region,
        then pair ``i`` in the given order, then head. ``runs``: maximal stretches of
        region 0's emitted (local, remote) descriptor index pairs advancing by one on
        both sides, as ``local_start, remote_start, length`` in region-0 descriptor
        indices and descriptors. ``num_blocks`` is ``n``.

    Raises
    ------
    InvalidBlockIds
        For the first failed check, in the order given in the module docstring.
    """
    local = _block_ids(local_ids, "local_ids")
    remote = _block_ids(remote_ids, "remote_ids")
    local_blocks = _index(local_num_blocks)
    remote_blocks = _index(remote_num_blocks)
    regions = _index(num_regions)
    head_count = _index(heads)
    splits = {"local": _index(local_split), "remote": _index(remote_split)}

    _require_positive("num_regions", regions)
    _require_positive("local_num_blocks", local_blocks)
    _require_positive("remote_num_blocks", remote_blocks)
    _require_positive("heads", head_count)
    _require_positive("local_split", splits["local"])
    _require_positive("remote_split", splits["remote"])
    if splits["local"] > 1 and splits["remote"] > 1:
        raise InvalidBlockIds(
            "local_split and remote_split cannot both exceed 1, "
            f"got {splits['local']} and {splits['remote']}"
        )
    coarse, fine = ("local", "remote") if splits["local"] > 1 else ("remote", "local")
    sizes = {"local": local.size, "remote": remote.size}
    n, k = sizes[fine], splits[coarse]
    expected = -(-n // k)
    if sizes[coarse] != expected:
        raise InvalidBlockIds(
            f"{coarse}_ids has {sizes[coarse]} entries, but {n} {fine}_ids at "
            f"{coarse}_split = {k} need ceil({n} / {k}) = {expected}"
        )
    for side, blocks in (("local", local_blocks), ("remote", remote_blocks)):
        if regions * blocks * splits[side] * head_count > _INT32_MAX:
            raise InvalidBlockIds(
                f"num_regions * {side}_num_blocks * {side}_split * heads = "
                f"{regions} * {blocks} * {splits[side]} * {head_count} "
                "does not fit in int32 descriptor indices"
            )
    _check_range(local, "local_ids", local_blocks)
    _check_range(remote, "remote_ids", remote_blocks)
    _check_unique(local, "local_ids")
    _check_unique(remote, "remote_ids")

    # Unit = block * split + slot: descriptor index of head 0 in region 0, over heads.
    position = np.arange(n, dtype=np.int64)
    units = {
        side: ids[position // splits[side]] * splits[side] + position % splits[side]
        for side, ids in (("local", local), ("remote", remote))
    }
    region = np.arange(regions, dtype=np.int64)[:, None, None]
    head = np.arange(head_count, dtype=np.int64)
    local_indices = (
        ((region * local_blocks * splits["local"] + units["local"][:, None]) * head_count + head)
        .ravel()
        .astype(np.int32)
    )
    remote_indices = (
        ((region * remote_blocks * splits["remote"] + units["remote"][:, None]) * head_count + head)
        .ravel()
        .astype(np.int32)
    )

    # Region 0's pairs written out, one per descriptor, and split wherever either side
    # fails to advance by one.
    local_row = local_indices[: n * head_count].astype(np.int64)
    remote_row = remote_indices[: n * head_count].astype(np.int64)
    if n:
        breaks = (np.diff(local_row) != 1) | (np.diff(remote_row) != 1)
        starts = np.flatnonzero(np.concatenate(([True], breaks)))
        lengths = np.diff(np.append(starts, local_row.size))
        runs = np.stack([local_row[starts], remote_row[starts], lengths], axis=1).astype(np.int64)
    else:
        runs = np.empty((0, 3), dtype=np.int64)

    for arr in (local_indices, remote_indices, runs):
        _read_only(arr)
    return TransferPlan(
        local_indices=local_indices,
        remote_indices=remote_indices,
        runs=runs,
        num_blocks=n,
        num_regions=regions,
        num_runs=len(runs),
        # A coarse slot's heads lie apart when there are several of both: nothing merges.
        num_descriptors=len(runs) * regions if merges and not (k > 1 and head_count > 1)
        else int(local_indices.size),
    )


class PreparedLink:
    """A link's planning constants, checked once (see ``kvpush/_core.pyi``)."""

    def __init__(self, local_num_blocks: int, remote_num_blocks: int, num_regions: int,
                 heads: int = 0, local_split: int = 1, remote_split: int = 1,
                 merges: bool = True) -> None:
        self.local_num_blocks = _index(local_num_blocks)
        self.remote_num_blocks = _index(remote_num_blocks)
        self.num_regions = _index(num_regions)
        self.heads = _index(heads)
        self.local_split = _index(local_split)
        self.remote_split = _index(remote_split)
        self.merges = bool(merges)
        try:
            self._check()
        except InvalidBlockIds as exc:
            raise ValueError(str(exc)) from None

    def _check(self) -> None:
        _require_positive("num_regions", self.num_regions)
        _require_positive("local_num_blocks", self.local_num_blocks)
        _require_positive("remote_num_blocks", self.remote_num_blocks)
        splits = (self.local_split, self.remote_split)
        if self.heads <= 0:
            if self.heads < 0:
                raise InvalidBlockIds(f"heads must be >= 0, got {self.heads}")
            if splits != (1, 1):
                raise InvalidBlockIds(f"a link without heads has splits 1, got {splits[0]} "
                                      f"and {splits[1]}")
            for name, blocks in (("local_num_blocks", self.local_num_blocks),
                                 ("remote_num_blocks", self.remote_num_blocks)):
                if blocks > _INT32_MAX // self.num_regions:
                    raise InvalidBlockIds(f"num_regions * {name} = {self.num_regions} * "
                                          f"{blocks} does not fit in int32 descriptor indices")
            return
        _require_positive("local_split", splits[0])
        _require_positive("remote_split", splits[1])
        if splits[0] > 1 and splits[1] > 1:
            raise InvalidBlockIds("local_split and remote_split cannot both exceed 1, "
                                  f"got {splits[0]} and {splits[1]}")
        for side, blocks, split in (("local", self.local_num_blocks, splits[0]),
                                    ("remote", self.remote_num_blocks, splits[1])):
            if self.num_regions * blocks * split * self.heads > _INT32_MAX:
                raise InvalidBlockIds(
                    f"num_regions * {side}_num_blocks * {side}_split * heads = "
                    f"{self.num_regions} * {blocks} * {split} * {self.heads} "
                    "does not fit in int32 descriptor indices")

    def plan(self, local_ids: NDArray[np.int32] | NDArray[np.int64],
             remote_ids: NDArray[np.int32] | NDArray[np.int64],
             coalesce: bool = True) -> TransferPlan:
        if self.heads:
            return plan_split_transfer(local_ids, remote_ids, self.local_num_blocks,
                                       self.remote_num_blocks, self.num_regions, self.heads,
                                       self.local_split, self.remote_split, merges=self.merges)
        return plan_transfer(local_ids, remote_ids, self.local_num_blocks,
                             self.remote_num_blocks, self.num_regions, coalesce,
                             merges=self.merges)

    def __repr__(self) -> str:
        return (f"PreparedLink(local_num_blocks={self.local_num_blocks}, "
                f"remote_num_blocks={self.remote_num_blocks}, num_regions={self.num_regions}, "
                f"heads={self.heads}, local_split={self.local_split}, "
                f"remote_split={self.remote_split}, merges={self.merges})")


class Arrival(enum.Enum):
    """What one :meth:`CompletionTable.arrive` call did."""

    PENDING = 0
    COMPLETE = 1
    DUPLICATE = 2
    UNKNOWN = 3
    OUT_OF_RANGE = 4


def _check_key(key: object) -> str:
    """Reject what the bindings reject: non-str keys, and strs UTF-8 cannot encode."""
    if not isinstance(key, str):
        raise TypeError(f"key must be str, got {type(key).__name__}")
    key.encode("utf-8")
    return key


class CompletionTable:
    """Thread-safe count of the parts of each keyed transfer that have arrived.

    Each part index in ``[0, parts)`` counts once; the arrival that completes a key
    returns :attr:`Arrival.COMPLETE` exactly once. A key stays until :meth:`remove`.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._expected: dict[str, int] = {}
        self._seen: dict[str, set[int]] = {}

    def expect(self, key: str, parts: int) -> None:
        """Start counting ``parts`` parts for ``key``.

        Raises
        ------
        ValueError
            If ``parts`` is not in ``[1, 2**24]``.
        KeyError
            If ``key`` is already held.
        """
        key = _check_key(key)
        count = _index(parts)
        if not 1 <= count <= _MAX_PARTS:
            raise ValueError(f"parts must be in [1, {_MAX_PARTS}], got {count}")
        with self._lock:
            if key in self._expected:
                raise KeyError(f"completion key '{key}' is already expected")
            self._expected[key] = count
            self._seen[key] = set()

    def arrive(self, key: str, part: int) -> Arrival:
        """Count part ``part`` of ``key``; never raises for an unknown key or bad part."""
        key = _check_key(key)
        index = _index(part)
        with self._lock:
            expected = self._expected.get(key)
            if expected is None:
                return Arrival.UNKNOWN
            if not 0 <= index < expected:
                return Arrival.OUT_OF_RANGE
            seen = self._seen[key]
            if index in seen:
                return Arrival.DUPLICATE
            seen.add(index)
            return Arrival.COMPLETE if len(seen) == expected else Arrival.PENDING

    def remove(self, key: str) -> bool:
        """Forget ``key``; return whether it was held."""
        key = _check_key(key)
        with self._lock:
            self._seen.pop(key, None)
            return self._expected.pop(key, None) is not None

    def progress(self, key: str) -> tuple[int, int] | None:
        """Return ``(arrived, expected)`` for ``key``, or None if it is not held."""
        key = _check_key(key)
        with self._lock:
            expected = self._expected.get(key)
            return None if expected is None else (len(self._seen[key]), expected)

    def __len__(self) -> int:
        with self._lock:
            return len(self._expected)

    def __contains__(self, key: str) -> bool:
        key = _check_key(key)
        with self._lock:
            return key in self._expected

    def __repr__(self) -> str:
        return f"CompletionTable(len={len(self)})"


def _round(v: NDArray[np.uint64], w: NDArray[np.uint64]) -> NDArray[np.uint64]:
    x = v + w * _MUL2
    rotated: NDArray[np.uint64] = (x << np.uint64(31)) | (x >> np.uint64(33))
    return rotated * _MUL1


def _base_addresses(obj: object) -> NDArray[np.uint64]:
    expected = "base_addresses must be a 1-D uint64 array, got "
    if not isinstance(obj, np.ndarray) or obj.ndim != 1:
        raise InvalidBlockIds(expected + _describe_non_1d(obj))
    if obj.dtype != np.dtype(np.uint64):
        raise InvalidBlockIds(expected + str(obj.dtype))
    if not obj.flags.c_contiguous:
        raise InvalidBlockIds("base_addresses must be C-contiguous")
    if not obj.flags.aligned:
        raise InvalidBlockIds("base_addresses must be aligned to its dtype's size")
    return obj.astype(np.uint64)


def _gather_blocks(
    base: int, block_stride: int, block_bytes: int, ids: NDArray[np.int64]
) -> NDArray[np.uint8]:
    """Copy block ``ids[i]`` of the region at ``base`` into row ``i``."""
    rows = int(ids.max()) + 1
    memory = (ctypes.c_uint8 * ((rows - 1) * block_stride + block_bytes)).from_address(base)
    region = np.lib.stride_tricks.as_strided(
        np.frombuffer(memoryview(memory), dtype=np.uint8),
        shape=(rows, block_bytes),
        strides=(block_stride, 1),
        writeable=False,
    )
    return region[ids]


def block_checksums(
    base_addresses: NDArray[np.uint64],
    block_stride: int,
    block_bytes: int,
    block_ids: NDArray[np.int32] | NDArray[np.int64],
    num_blocks: int,
) -> NDArray[np.uint64]:
    """One 64-bit checksum per block id, over that block in every region.

    Parameters
    ----------
    base_addresses : NDArray[np.uint64]
        1-D: the address of block 0 of each region, in the order the hash visits them.
    block_stride : int
        Bytes from one block to the next in a region; at least ``block_bytes``.
    block_bytes : int
        Bytes hashed per block per region; at least 1.
    block_ids : NDArray[np.int32] | NDArray[np.int64]
        1-D, C-contiguous; ids in ``[0, num_blocks)``, repeats allowed.
    num_blocks : int
        Blocks per region.

    Returns
    -------
    NDArray[np.uint64]
        ``checksums[i]`` belongs to ``block_ids[i]``. The hash is defined in
        ``csrc/kvpush/checksum.hpp``; this computes it over all ids at once, word by word.

    Raises
    ------
    InvalidBlockIds
        For a bad array, no regions, ``block_bytes < 1``, ``block_stride < block_bytes``,
        ``num_blocks < 1``, ``num_blocks * block_stride`` beyond int64, or an id out of
        range; checked in that order.
    """
    bases = _base_addresses(base_addresses)
    ids = _block_ids(block_ids, "block_ids")
    stride = _index(block_stride)
    nbytes = _index(block_bytes)
    blocks = _index(num_blocks)
    if bases.size == 0:
        raise InvalidBlockIds("base_addresses is empty: need at least one region")
    if nbytes < 1:
        raise InvalidBlockIds(f"block_bytes must be >= 1, got {nbytes}")
    if stride < nbytes:
        raise InvalidBlockIds(f"block_stride must be >= block_bytes, got {stride} < {nbytes}")
    if blocks < 1:
        raise InvalidBlockIds(f"num_blocks must be >= 1, got {blocks}")
    if stride > _INT64_MAX // blocks:
        raise InvalidBlockIds(
            f"num_blocks * block_stride = {blocks} * {stride} does not fit in int64 byte offsets"
        )
    _check_range(ids, "block_ids", blocks)

    n = ids.size
    words = -(-nbytes // 8)
    lanes = [np.full(n, (_SEED + j * int(_MUL2)) & _MASK64, dtype=np.uint64) for j in range(4)]
    if n:
        for base in bases.tolist():
            padded = np.zeros((n, words * 8), dtype=np.uint8)
            padded[:, :nbytes] = _gather_blocks(base, stride, nbytes, ids)
            as_words = padded.view(np.dtype("<u8"))
            for k in range(words):
                lanes[k % 4] = _round(lanes[k % 4], as_words[:, k])
    h = np.full(n, (bases.size * nbytes * int(_MUL1)) & _MASK64, dtype=np.uint64)
    for lane in lanes:
        h = _round(h, lane)
    h ^= h >> np.uint64(32)
    h *= _MUL2
    h ^= h >> np.uint64(29)
    h *= _MUL1
    h ^= h >> np.uint64(32)
    return h
