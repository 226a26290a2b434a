"""Compiled core of kvpush (C++, ``csrc/``): transfer planning, completion counting,
per-block checksums.

``tests.support.reference`` implements the same interface in numpy; tests hold the two equal.
Ints are taken as ``operator.index`` does and clamped to int64, so an absurdly large one
fails the relevant range check rather than the conversion.
"""

import enum
from typing import Final, final

import numpy as np
from numpy.typing import NDArray

__version__: Final[str]
#: True when built with ``KVPUSH_DEBUG=1`` (assertions on, ``-O0 -g``).
DEBUG: Final[bool]

_BlockIds = NDArray[np.int32] | NDArray[np.int64]

@final
class TransferPlan:
    """Descriptor indices for one transfer: what :func:`plan_transfer` returns.

    Read-only; its arrays are not writeable either, so a plan can be shared freely. Large
    index arrays (16 KiB and up) live in buffers that the core hands to later plans once
    no array or view over them is left (the system allocator tends to unmap buffers that
    size and fault them in again); like any numpy array's, their memory stays valid while
    referenced.
    :func:`plan_split_transfer` returns one too; how its attributes read there (per-head
    indices, runs in descriptor indices) is in that function's docstring.
    """

    @property
    def local_indices(self) -> NDArray[np.int32]:
        """Region-major local descriptor indices, ``num_blocks * num_regions`` of them:
        entry ``r * num_blocks + k`` is ``r * local_num_blocks + local_block[k]``."""

    @property
    def remote_indices(self) -> NDArray[np.int32]:
        """The remote counterpart of :attr:`local_indices`."""

    @property
    def runs(self) -> NDArray[np.int64]:
        """Shape ``(num_runs, 3)``: ``local_start, remote_start, length`` of each maximal
        stretch of pairs advancing by one on both sides, in emitted order (block ids, the
        same in every region)."""

    @property
    def num_blocks(self) -> int:
        """Block pairs in the request."""

    @property
    def num_regions(self) -> int:
        """Regions each pair is moved in."""

    @property
    def num_runs(self) -> int:
        """Runs per region (with ``coalesce=False``, runs in the given order)."""

    @property
    def num_descriptors(self) -> int:
        """Descriptors NIXL moves: ``num_runs * num_regions`` where it merges each run into
        one (``merges=True``), else every index, ``len(local_indices)`` (a head shard of
        each block, padded blocks, or a split plan whose coarse slots hold several heads:
        no two index-adjacent descriptors are adjacent bytes there)."""

def plan_transfer(
    local_ids: _BlockIds,
    remote_ids: _BlockIds,
    local_num_blocks: int,
    remote_num_blocks: int,
    num_regions: int,
    coalesce: bool = True,
    *,
    merges: bool = True,
) -> TransferPlan:
    """Map block-id pairs to NIXL descriptor indices, optionally coalescing runs.

    Each side's descriptor list is region-major: (region ``r``, block ``b``) is descriptor
    ``r * side_num_blocks + b``. The GIL is held, except for plans of at least 2**22
    index entries: winning it back beside a busy Python thread can take a whole switch
    interval, far longer than the work (see ``csrc/bindings.cpp``).

    Parameters
    ----------
    local_ids, remote_ids : NDArray[np.int32] | NDArray[np.int64]
        1-D, C-contiguous, aligned, native byte order, not masked, same length (the two
        dtypes may differ);
        pair ``i`` moves local block ``local_ids[i]`` to remote block ``remote_ids[i]``
        in every region. No id may repeat on one side. Never converted: a list, a float
        or a 2-D array is rejected.
    local_num_blocks, remote_num_blocks : int
        Blocks per region on each side; ids must lie in ``[0, side_num_blocks)``.
    num_regions : int
        Memory regions of the cache (e.g. one per layer, or K and V per layer);
        ``num_regions * side_num_blocks`` must fit in int32.
    coalesce : bool, default True
        Sort pairs by local id, so blocks adjacent on both sides get adjacent descriptor
        indices, which NIXL merges into one transfer. Otherwise keep the given order.
    merges : bool, default True
        Whether adjacent descriptor indices are adjacent bytes on both sides (whole,
        unpadded blocks), so that NIXL merges runs; only sets ``num_descriptors``.

    Returns
    -------
    TransferPlan

    Raises
    ------
    kvpush.errors.InvalidBlockIds
        For the first failed check, in this order: shape/dtype/mask/contiguity/alignment
        of ``local_ids`` then ``remote_ids``; length mismatch; ``num_regions``,
        ``local_num_blocks``, ``remote_num_blocks`` >= 1; local then remote index space
        fits int32; local ids in range; remote ids in range; no repeated local id; no
        repeated remote id (reported at its first repeat, with both positions).
    TypeError
        If a count is not an integer.
    """

def check_block_ids(ids: _BlockIds, num_blocks: int, name: str = "block_ids") -> NDArray[np.int64]:
    """Validate one side's block ids on their own and return a read-only int64 copy.

    What :func:`plan_transfer` checks of one side, before its pairing is known: ``ids``
    1-D, C-contiguous, aligned, not masked, int32 or int64 (never converted);
    ``num_blocks`` >= 1; every id in ``[0, num_blocks)``; no id repeated. Messages name the
    array ``name``, and are otherwise those of :func:`plan_transfer`. The copy is read once
    from ``ids``, so the caller may reuse its array at once. The GIL is held, except for
    at least 2**22 ids (as in :func:`plan_transfer`).

    Raises
    ------
    kvpush.errors.InvalidBlockIds
        For the first failed check, in the order above (a repeat at its first repeat).
    TypeError
        If ``num_blocks`` is not an integer.
    """

def plan_split_transfer(
    local_ids: _BlockIds,
    remote_ids: _BlockIds,
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

    The two sides hold the same tokens, but one side's block (the *coarse* side, whose
    split is ``k``) holds ``k`` times the tokens of the other's (the *fine* side, split 1).
    Every block is head-major: ``heads`` heads one after another, each holding its tokens
    contiguously. So fine block ``i`` of the request lives, for each head, in slot
    ``i % k`` of coarse block ``coarse_ids[i // k]``: ``heads`` separate byte ranges, one
    descriptor each. Each side's descriptor list is prepared at that granularity:
    (region ``r``, block ``b``, slot ``s``, head ``h``) is descriptor
    ``((r * side_num_blocks + b) * side_split + s) * heads + h``. Nothing is sorted or
    coalesced: slots must stay with their coarse block, so pairs keep the given order.
    The GIL is held, except for at least 2**22 index entries (as in :func:`plan_transfer`).

    Parameters
    ----------
    local_ids, remote_ids : NDArray[np.int32] | NDArray[np.int64]
        1-D, C-contiguous, native byte order, as for :func:`plan_transfer`; no id may
        repeat on one side. The fine side has ``n`` ids; the coarse side exactly
        ``ceil(n / k)`` (its last block may be partly used). With both splits 1 they are
        plain pairs and remote counts as the coarse side, so both have ``n``.
    local_num_blocks, remote_num_blocks : int
        Blocks per region on each side; ids must lie in ``[0, side_num_blocks)``.
    num_regions : int
        Memory regions of the cache.
    heads : int
        Heads per block, at least 1.
    local_split, remote_split : int
        Slots per block on each side, at least 1; at most one of them above 1.
        ``num_regions * side_num_blocks * side_split * heads`` must fit in int32.

    Returns
    -------
    TransferPlan
        ``local_indices``, ``remote_indices``: ``num_regions * n * heads`` int32 each,
        region-major, then pair ``i`` in the given order, then head ``h``; entry
        ``(r * n + i) * heads + h`` is the descriptor of region ``r``, head ``h`` of pair
        ``i`` on that side.
        ``runs``: shape ``(num_runs, 3)``, the maximal stretches of region 0's emitted
        (local, remote) descriptor index pairs, entries ``0 .. n * heads - 1``, in which
        both indices advance by exactly one from each pair to the next; each is
        ``local_start, remote_start, length`` with the starts region-0 descriptor indices
        and the length a count of descriptors (a multiple of ``heads``: a pair's heads
        always advance together). Every other region has the same stretches shifted by
        ``r * side_num_blocks * side_split * heads``; stretches never span regions. With
        ``heads == 1`` and both splits 1, this is exactly :func:`plan_transfer` with
        ``coalesce=False``.
        ``num_blocks``: ``n``. ``num_runs``: runs per region. ``num_descriptors``
        (``merges`` as for :func:`plan_transfer`; ``len(local_indices)`` when
        ``heads > 1`` and a split above 1, since a coarse slot's heads lie apart), else:
        ``num_runs * num_regions``.

    Raises
    ------
    kvpush.errors.InvalidBlockIds
        For the first failed check, in this order: shape/dtype/mask/contiguity/alignment
        of ``local_ids`` then ``remote_ids``; ``num_regions``, ``local_num_blocks``,
        ``remote_num_blocks``, ``heads``, ``local_split``, ``remote_split`` >= 1; not both
        splits above 1; coarse side length ``ceil(n / k)``; local then remote index space
        fits int32; local ids in range; remote ids in range; no repeated local id; no
        repeated remote id (messages as for :func:`plan_transfer`).
    TypeError
        If a count is not an integer.
    """

@final
class PreparedLink:
    """The constants of every request over one link (this side's cache and one peer's),
    converted and checked once, at handshake: :meth:`plan` then takes only the ids.

    ``heads == 0``: :meth:`plan` is :func:`plan_transfer`; above 0, it is
    :func:`plan_split_transfer` with these heads and splits (and ``coalesce`` is ignored:
    split plans keep the given order). ``merges`` as for :func:`plan_transfer`.

    Raises
    ------
    ValueError
        For constants no request could use (the plan functions' checks of them, messages
        as theirs; a link without heads has splits 1).
    TypeError
        If a count is not an integer.
    """

    def __init__(self, local_num_blocks: int, remote_num_blocks: int, num_regions: int,
                 heads: int = 0, local_split: int = 1, remote_split: int = 1,
                 merges: bool = True) -> None: ...
    def plan(self, local_ids: _BlockIds, remote_ids: _BlockIds,
             coalesce: bool = True) -> TransferPlan:
        """Plan one request over the link; raises as the plan functions do."""

    @property
    def local_num_blocks(self) -> int: ...
    @property
    def remote_num_blocks(self) -> int: ...
    @property
    def num_regions(self) -> int: ...
    @property
    def heads(self) -> int: ...
    @property
    def local_split(self) -> int: ...
    @property
    def remote_split(self) -> int: ...
    @property
    def merges(self) -> bool: ...

class Arrival(enum.Enum):
    """What one :meth:`CompletionTable.arrive` call did."""

    PENDING = 0
    """Counted; parts are still outstanding."""
    COMPLETE = 1
    """Counted, and it was the last part. Returned once per key."""
    DUPLICATE = 2
    """That part had already arrived; nothing changed."""
    UNKNOWN = 3
    """No such key: never expected, or already removed."""
    OUT_OF_RANGE = 4
    """The part index is outside ``[0, parts)``."""

@final
class CompletionTable:
    """Thread-safe count of the parts of each keyed transfer that have arrived.

    Each part index in ``[0, parts)`` counts once; the arrival that completes a key
    returns :attr:`Arrival.COMPLETE` exactly once, later ones :attr:`Arrival.DUPLICATE`.
    A key stays, complete or not, until :meth:`remove`.
    """

    def __init__(self) -> None: ...
    def expect(self, key: str, parts: int) -> None:
        """Start counting ``parts`` parts for ``key``.

        Raises
        ------
        ValueError
            If ``parts`` is not in ``[1, 2**24]``.
        KeyError
            If ``key`` is already held.
        """

    def arrive(self, key: str, part: int) -> Arrival:
        """Count part ``part`` of ``key``. Never raises for an unknown key or a bad part:
        the result says what happened."""

    def remove(self, key: str) -> bool:
        """Forget ``key``; return whether it was held."""

    def progress(self, key: str) -> tuple[int, int] | None:
        """Return ``(arrived, expected)`` for ``key``, or None if it is not held."""

    def __len__(self) -> int: ...
    def __contains__(self, key: str) -> bool: ...

def block_checksums(
    base_addresses: NDArray[np.uint64],
    block_stride: int,
    block_bytes: int,
    block_ids: _BlockIds,
    num_blocks: int,
) -> NDArray[np.uint64]:
    """One 64-bit checksum per block id, over that block in every region.

    Reads raw memory, without the GIL from 16 MiB hashed on (less is over before a hand-off
    of the GIL would be); the caller guarantees every addressed block is
    readable host memory. The hash is defined in ``csrc/kvpush/checksum.hpp``.

    Parameters
    ----------
    base_addresses : NDArray[np.uint64]
        1-D: the address of block 0 of each region, in the order the hash visits them.
    block_stride : int
        Bytes from one block to the next in a region; at least ``block_bytes``.
    block_bytes : int
        Bytes hashed per block per region; at least 1.
    block_ids : NDArray[np.int32] | NDArray[np.int64]
        1-D, C-contiguous, aligned, not masked; ids in ``[0, num_blocks)``, repeats
        allowed.
    num_blocks : int
        Blocks per region.

    Returns
    -------
    NDArray[np.uint64]
        ``checksums[i]`` belongs to ``block_ids[i]``.

    Raises
    ------
    kvpush.errors.InvalidBlockIds
        For a bad array, no regions, ``block_bytes < 1``, ``block_stride < block_bytes``,
        ``num_blocks < 1``, ``num_blocks * block_stride`` beyond int64, or an id out of
        range; checked in that order.
    """
