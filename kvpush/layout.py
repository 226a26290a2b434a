"""How a paged KV cache lies in memory, and whether two sides' caches can exchange blocks.

A cache is a tuple of :class:`Region` s -- contiguous pieces of registered memory -- that all
hold the same number of blocks at the same stride. Block id ``b`` names the ``b``-th block of
*every* region, so moving one block moves ``len(regions)`` pieces of memory. This one shape
covers the common engines:

* one region per layer holding K and V together (vLLM on CPU: ``[blocks, heads, tokens, 2*head]``),
  ``kv_packed=True``;
* separate K and V regions per layer (vLLM's GPU backends), ``kv_packed=False``;
* a single region for a whole cache whose blocks are outermost, ``num_layers`` layers packed
  inside each block (``kv_packed=True``, one region, ``layers_per_region=num_layers``);
* one latent tensor per layer and no K/V split (multi-head latent attention, DeepSeek-style
  MLA: ``[blocks, tokens, kv_lora_rank + rope_dim]``), ``cache_kind="mla"``: one "head" of
  ``head_size`` latent elements per token, the same on every tensor-parallel rank.

How the bytes *inside* a block are ordered is part of the layout, never guessed from
sizes: ``block_order`` names the axes of one block from outermost to innermost (``H`` KV
heads, ``N`` tokens, ``D`` elements of a head, ``K`` the K/V pair when they share a region,
``C`` a per-token content whose K/V arrangement is not known), ``kernel_tokens`` says when
several kernel blocks are folded into one block, and ``identity`` carries what the engine
says about itself (model, cache dtype, attention backend, versions) so that two engines that
would read each other's bytes differently refuse at handshake.

The two sides may hold different numbers of blocks; everything that decides how bytes are
interpreted must match or be convertible, and :func:`check_compatible` names the first field
that is neither.
"""

from __future__ import annotations

import enum
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import msgspec
import numpy as np

from .errors import LayoutMismatch

__all__ = ["BLOCK_ORDERS", "CACHE_KINDS", "DTYPE_SIZES", "KVLayout", "MemoryKind", "Region",
           "TPRoutes", "check_compatible", "covering_producers", "head_overlap",
           "replica_routes", "tp_routes", "tp_shard"]

#: Element sizes of the dtypes a layout may name (KV caches in use today).
DTYPE_SIZES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "int8": 1,
    "uint8": 1,
}


def _orders(axes: str) -> frozenset[str]:
    from itertools import permutations

    return frozenset("".join(p) for p in permutations(axes))


#: Valid ``block_order`` values: K and V in separate regions (``HND``, ``NHD``, ...), K and
#: V sharing a region with the K/V axis placed (``HKND``: per head all of K then all of V,
#: vLLM's CPU cache; ``HNKD``: per token K then V), or with an opaque per-token content
#: (``HNC``, ``NHC``: equal layouts exchange blocks, nothing is converted).
BLOCK_ORDERS = {
    False: _orders("HND"),
    True: _orders("HNKD") | _orders("HNC"),
}

#: What a cache holds per token, and the block orders each kind may have: ``kv`` (K and V
#: of ``num_kv_heads`` heads; :data:`BLOCK_ORDERS`) or ``mla`` (one latent vector per token,
#: ``L`` its ``head_size`` elements, tokens outermost: ``NL``; no K/V split, no heads to
#: shard -- every tensor-parallel rank holds all of it).
CACHE_KINDS = {"kv": None, "mla": frozenset({"NL"})}


class MemoryKind(str, enum.Enum):
    """Where a region lives, in NIXL's words."""

    DRAM = "DRAM"
    VRAM = "VRAM"


@dataclass(frozen=True)
class Region:
    """A contiguous piece of memory registered with NIXL.

    Parameters
    ----------
    addr
        Start address.
    length
        Length in bytes.
    device_id
        GPU index for VRAM, 0 for DRAM.
    kind
        :class:`MemoryKind`.
    """

    addr: int
    length: int
    device_id: int = 0
    kind: MemoryKind = MemoryKind.DRAM

    def __post_init__(self) -> None:
        if self.addr <= 0:
            raise ValueError(f"Region.addr must be a positive address, got {self.addr}")
        if self.length <= 0:
            raise ValueError(f"Region.length must be > 0, got {self.length}")
        if self.device_id < 0:
            raise ValueError(f"Region.device_id must be >= 0, got {self.device_id}")
        object.__setattr__(self, "kind", MemoryKind(self.kind))

    @classmethod
    def of(cls, buffer: Any) -> Region:
        """The region of a contiguous numpy array or torch tensor (CPU or CUDA).

        The caller keeps ``buffer`` alive for as long as the region is registered (a
        layout made by :meth:`KVLayout.from_buffers` holds its buffers).
        """
        if isinstance(buffer, np.ndarray):
            if not buffer.flags.c_contiguous:
                raise ValueError("Region.of: numpy array must be C-contiguous")
            return cls(buffer.ctypes.data, buffer.nbytes)
        data_ptr = getattr(buffer, "data_ptr", None)
        if data_ptr is None:
            raise TypeError(f"Region.of takes a numpy array or torch tensor, got {type(buffer)}")
        if not buffer.is_contiguous():
            raise ValueError("Region.of: tensor must be contiguous")
        nbytes = buffer.numel() * buffer.element_size()
        if buffer.device.type == "cuda":
            return cls(data_ptr(), nbytes, buffer.device.index or 0, MemoryKind.VRAM)
        if buffer.device.type != "cpu":
            raise ValueError(f"Region.of: unsupported device {buffer.device}")
        return cls(data_ptr(), nbytes)


class LayoutWire(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A layout as it travels in a handshake (addresses included: the peer prepares
    descriptors for them)."""

    regions: list[tuple[int, int, int, str]]
    num_layers: int
    num_blocks: int
    block_bytes: int
    block_stride: int
    tokens_per_block: int
    num_kv_heads: int
    head_size: int
    dtype: str
    kv_packed: bool
    layers_per_region: int
    head_start: int = 0
    total_kv_heads: int = 0
    block_order: str = ""
    kernel_tokens: int = 0
    identity: tuple[tuple[str, str], ...] = ()
    cache_kind: str = "kv"


@dataclass(frozen=True)
class KVLayout:
    """A paged KV cache's shape in memory.

    Parameters
    ----------
    regions
        The registered memory regions, in a fixed order both sides agree on (layer-major;
        K before V when ``kv_packed`` is False).
    num_layers
        Transformer layers held by the cache.
    num_blocks
        Blocks per region; block ids run over ``[0, num_blocks)``.
    tokens_per_block
        Tokens held by one block.
    num_kv_heads
        KV heads held by this side (its tensor-parallel shard).
    head_size
        Elements per head.
    dtype
        Element type, one of :data:`DTYPE_SIZES`.
    kv_packed
        True when K and V of a layer share one region; False when they are separate regions.
    layers_per_region
        Layers packed into one region (1 for per-layer tensors).
    block_bytes
        Bytes of one block in one region; computed from the fields above when omitted,
        and checked against them when given.
    block_stride
        Distance in bytes between consecutive blocks of a region (default ``block_bytes``).
    head_start, total_kv_heads
        Tensor parallelism: this side holds KV heads ``[head_start, head_start +
        num_kv_heads)`` of ``total_kv_heads`` (default: all of them). Sides with different
        shards exchange the heads they have in common (heterogeneous TP).
    block_order
        The axes of one block (of one layer, of one kernel block) from outermost to
        innermost: ``H`` heads, ``N`` tokens, ``D`` head elements, and when ``kv_packed``
        either ``K`` (the K/V pair) or ``C`` (per-token content of unknown K/V arrangement).
        One of :data:`BLOCK_ORDERS`; default ``HNKD`` (packed) or ``HND`` (separate).
    kernel_tokens
        Tokens of one kernel block when ``tokens_per_block // kernel_tokens`` kernel blocks
        are folded, outermost, into each block (default ``tokens_per_block``: no folding).
    identity
        ``(key, value)`` pairs naming the engine (model, cache dtype, attention backend,
        versions, ...); two sides' identities must be equal (see :func:`check_compatible`).
    cache_kind
        What a block holds per token (:data:`CACHE_KINDS`): ``"kv"`` (default) or
        ``"mla"``, one latent vector of ``head_size`` elements per token (``num_kv_heads``
        1, ``kv_packed`` True, ``block_order`` ``NL``; replicated, never sharded, across
        tensor-parallel ranks).
    """

    regions: tuple[Region, ...]
    num_layers: int
    num_blocks: int
    tokens_per_block: int
    num_kv_heads: int
    head_size: int
    dtype: str
    kv_packed: bool = True
    layers_per_region: int = 1
    block_bytes: int = 0
    block_stride: int = 0
    head_start: int = 0
    total_kv_heads: int = 0
    block_order: str = ""
    kernel_tokens: int = 0
    identity: tuple[tuple[str, str], ...] = ()
    cache_kind: str = "kv"
    # The buffers a layout holds live in a slot, not in a field: no field-wise copy
    # (``dataclasses.asdict``, ``replace``, ``KVLayout(**layout.__dict__)``), comparison or
    # pickle takes them along.
    __slots__ = ("__dict__", "__weakref__", "_buffers")

    @property
    def buffers(self) -> tuple[Any, ...]:
        """The arrays or tensors the regions are in, held while the layout lives, when it
        was made by :meth:`from_buffers` or :meth:`with_buffers` (else empty: the caller
        keeps the memory alive). Not compared, pickled or sent, and not carried by
        ``dataclasses.replace``: a replaced layout's regions may be other memory."""
        held: tuple[Any, ...] = getattr(self, "_buffers", ())
        return held

    def __getstate__(self) -> dict[str, Any]:
        # A layout pickled for another process (a contained data plane) names memory that
        # process maps by itself: copying the buffers would copy the whole cache.
        return dict(self.__dict__)

    def __post_init__(self) -> None:
        object.__setattr__(self, "regions", tuple(self.regions))
        if self.cache_kind not in CACHE_KINDS:
            raise ValueError(f"KVLayout.cache_kind must be one of {sorted(CACHE_KINDS)}, got "
                             f"{self.cache_kind!r}")
        latent = self.cache_kind == "mla"
        if latent:
            self._check_latent()
        elif not self.block_order:
            object.__setattr__(self, "block_order", "HNKD" if self.kv_packed else "HND")
        if not latent and self.block_order not in BLOCK_ORDERS[bool(self.kv_packed)]:
            kv = "K+V packed" if self.kv_packed else "K and V separate"
            raise ValueError(
                f"KVLayout.block_order {self.block_order!r} is not an order of a {kv} block "
                f"(e.g. {'HKND, HNKD, NHKD, HNC' if self.kv_packed else 'HND, NHD'})")
        if self.kernel_tokens == 0:
            object.__setattr__(self, "kernel_tokens", self.tokens_per_block)
        if (not isinstance(self.kernel_tokens, int) or self.kernel_tokens < 1
                or self.tokens_per_block % self.kernel_tokens):
            raise ValueError(f"KVLayout.kernel_tokens ({self.kernel_tokens!r}) must divide "
                             f"tokens_per_block ({self.tokens_per_block})")
        identity = tuple(sorted((str(k), str(v)) for k, v in self.identity))
        keys = [k for k, _ in identity]
        if len(set(keys)) != len(keys):
            raise ValueError(f"KVLayout.identity names a key twice: {keys}")
        object.__setattr__(self, "identity", identity)
        for name in ("num_layers", "num_blocks", "tokens_per_block", "num_kv_heads",
                     "head_size", "layers_per_region"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"KVLayout.{name} must be an int >= 1, got {value!r}")
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(
                f"KVLayout.dtype must be one of {sorted(DTYPE_SIZES)}, got {self.dtype!r}"
            )
        if self.total_kv_heads == 0:
            object.__setattr__(self, "total_kv_heads", self.head_start + self.num_kv_heads)
        if self.head_start < 0 or self.head_start + self.num_kv_heads > self.total_kv_heads:
            raise ValueError(
                f"KVLayout heads [{self.head_start}, {self.head_start + self.num_kv_heads}) do "
                f"not fit in total_kv_heads={self.total_kv_heads}"
            )
        if self.num_layers % self.layers_per_region:
            raise ValueError(
                f"KVLayout.num_layers ({self.num_layers}) must be a multiple of "
                f"layers_per_region ({self.layers_per_region})"
            )
        per_region_tensors = 1 if self.kv_packed else 2
        expected = self.num_layers // self.layers_per_region * per_region_tensors
        if len(self.regions) != expected:
            kv = "K+V packed" if self.kv_packed else "K and V separate"
            raise ValueError(
                f"KVLayout.regions: expected {expected} regions ({self.num_layers} layers, "
                f"{self.layers_per_region} per region, {kv}), got {len(self.regions)}"
            )
        kinds = {r.kind for r in self.regions}
        if len(kinds) != 1:
            raise ValueError("KVLayout.regions must all be of one memory kind")
        pair = 2 if self.kv_packed and not latent else 1
        natural = (
            self.tokens_per_block * self.num_kv_heads * self.head_size
            * DTYPE_SIZES[self.dtype] * pair * self.layers_per_region
        )
        if self.block_bytes == 0:
            object.__setattr__(self, "block_bytes", natural)
        elif self.block_bytes != natural:
            raise ValueError(
                f"KVLayout.block_bytes ({self.block_bytes}) != tokens_per_block * num_kv_heads "
                f"* head_size * itemsize{' * 2' if pair == 2 else ''} * layers_per_region "
                f"({natural})"
            )
        if self.block_stride == 0:
            object.__setattr__(self, "block_stride", self.block_bytes)
        elif self.block_stride < self.block_bytes:
            raise ValueError(
                f"KVLayout.block_stride ({self.block_stride}) must be >= block_bytes "
                f"({self.block_bytes})"
            )
        need = (self.num_blocks - 1) * self.block_stride + self.block_bytes
        for i, region in enumerate(self.regions):
            if region.length < need:
                raise ValueError(
                    f"KVLayout.regions[{i}] holds {region.length} bytes, but {self.num_blocks} "
                    f"blocks of {self.block_bytes} bytes at stride {self.block_stride} need {need}"
                )

    def _check_latent(self) -> None:
        """An MLA cache: one latent vector per token, one region per layer, no heads."""
        if not self.block_order:
            object.__setattr__(self, "block_order", "NL")
        orders = CACHE_KINDS["mla"]
        assert orders is not None
        if self.block_order not in orders:
            raise ValueError(f"KVLayout.block_order {self.block_order!r} is not an order of an "
                             f"MLA (latent) block: {sorted(orders)}")
        if not self.kv_packed:
            raise ValueError("KVLayout: an MLA cache has no K/V split: kv_packed must be True")
        total = self.total_kv_heads or 1
        if (self.num_kv_heads, self.head_start, total) != (1, 0, 1):
            raise ValueError("KVLayout: an MLA cache holds one latent vector per token, "
                             "replicated across TP ranks: num_kv_heads=1, head_start=0, "
                             f"total_kv_heads=1 (got {self.num_kv_heads}, {self.head_start}, "
                             f"{self.total_kv_heads})")

    # -- derived ---------------------------------------------------------------------------
    @property
    def replicated(self) -> bool:
        """True when every tensor-parallel rank holds the whole cache (MLA's latent): any
        one rank's copy serves any peer rank."""
        return self.cache_kind == "mla"

    @property
    def num_regions(self) -> int:
        """Registered memory regions (one per layer, or per layer and K/V)."""
        return len(self.regions)

    @property
    def kind(self) -> MemoryKind:
        """Where the regions live (host or GPU memory)."""
        return self.regions[0].kind

    @property
    def bytes_per_block_id(self) -> int:
        """Bytes moved for one block id (all regions)."""
        return self.block_bytes * self.num_regions

    @property
    def head_bytes(self) -> int:
        """Bytes of one KV head in one block of one region."""
        return self.block_bytes // self.num_kv_heads

    @property
    def folded(self) -> bool:
        """True when each block is several kernel blocks (``kernel_tokens``) side by side."""
        return self.kernel_tokens != self.tokens_per_block

    @property
    def head_major(self) -> bool:
        """True when a range of KV heads is one contiguous byte range of every block (heads
        outermost, one layer per region, no folded kernel blocks): what exchanging head
        shards (heterogeneous TP) needs."""
        return (self.block_order[0] == "H" and not self.folded
                and self.layers_per_region == 1)

    @property
    def token_units(self) -> int | None:
        """How many contiguous pieces of a block have tokens as their outermost axis (the
        heads and K/V halves before ``N`` in ``block_order``): a block of ``k`` times the
        tokens is then cut into ``k`` token slots per piece. None when tokens cannot be cut
        out of a block this way (opaque content ``C``, folded kernel blocks, several layers
        per region)."""
        if "C" in self.block_order or self.folded or self.layers_per_region != 1:
            return None
        units = 1
        for axis in self.block_order[:self.block_order.index("N")]:
            units *= self.num_kv_heads if axis == "H" else 2
        return units

    def split_table(self, split: int) -> np.ndarray:
        """Descriptors of every (region, block, slot, unit) when each block is cut into
        ``split`` token slots per unit (see :attr:`token_units`: a head, or a head's K or V
        half, or the whole block when tokens are outermost): index ``((r * num_blocks + b)
        * split + s) * units + u``, each ``block_bytes // units // split`` long."""
        units = self.token_units
        if units is None or self.block_bytes % (units * split):
            raise ValueError(f"cannot cut {self.block_order} blocks of {self.block_bytes} "
                             f"bytes into {split} token slots")
        unit_bytes = self.block_bytes // units
        piece = unit_bytes // split
        base = np.array([r.addr for r in self.regions], dtype=np.uint64)
        blocks = np.arange(self.num_blocks, dtype=np.uint64) * np.uint64(self.block_stride)
        slots = np.arange(split, dtype=np.uint64) * np.uint64(piece)
        unit = np.arange(units, dtype=np.uint64) * np.uint64(unit_bytes)
        addr = (base[:, None, None, None] + blocks[None, :, None, None]
                + slots[None, None, :, None] + unit[None, None, None, :]).ravel()
        table = np.empty((addr.size, 3), dtype=np.uint64)
        table[:, 0] = addr
        table[:, 1] = piece
        table[:, 2] = np.repeat(np.array([r.device_id for r in self.regions], dtype=np.uint64),
                                self.num_blocks * split * units)
        return table

    def descriptor_table(self, offset: int = 0, length: int | None = None) -> np.ndarray:
        """NIXL descriptors of every (region, block), region-major: an ``(R*B, 3)`` uint64
        array of (address, length, device id). Index ``r * num_blocks + b``. ``offset`` and
        ``length`` select a byte range inside every block (a head shard)."""
        length = self.block_bytes - offset if length is None else length
        if offset < 0 or length < 1 or offset + length > self.block_bytes:
            raise ValueError(f"byte range [{offset}, {offset + length}) is not inside a "
                             f"{self.block_bytes}-byte block")
        base = np.array([r.addr for r in self.regions], dtype=np.uint64) + np.uint64(offset)
        offsets = np.arange(self.num_blocks, dtype=np.uint64) * np.uint64(self.block_stride)
        table = np.empty((self.num_regions * self.num_blocks, 3), dtype=np.uint64)
        table[:, 0] = (base[:, None] + offsets[None, :]).ravel()
        table[:, 1] = length
        table[:, 2] = np.repeat(
            np.array([r.device_id for r in self.regions], dtype=np.uint64), self.num_blocks
        )
        return table

    # -- wire ------------------------------------------------------------------------------
    def to_wire(self) -> LayoutWire:
        """This layout as the handshake sends it."""
        return LayoutWire(
            regions=[(r.addr, r.length, r.device_id, r.kind.value) for r in self.regions],
            num_layers=self.num_layers,
            num_blocks=self.num_blocks,
            block_bytes=self.block_bytes,
            block_stride=self.block_stride,
            tokens_per_block=self.tokens_per_block,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            dtype=self.dtype,
            kv_packed=self.kv_packed,
            layers_per_region=self.layers_per_region,
            head_start=self.head_start,
            total_kv_heads=self.total_kv_heads,
            block_order=self.block_order,
            kernel_tokens=self.kernel_tokens,
            identity=self.identity,
            cache_kind=self.cache_kind,
        )

    @classmethod
    def from_wire(cls, wire: LayoutWire) -> KVLayout:
        """A peer's layout from its handshake (ProtocolError if malformed)."""
        try:
            regions = tuple(Region(a, n, d, MemoryKind(k)) for a, n, d, k in wire.regions)
            return cls(
                regions=regions,
                num_layers=wire.num_layers,
                num_blocks=wire.num_blocks,
                tokens_per_block=wire.tokens_per_block,
                num_kv_heads=wire.num_kv_heads,
                head_size=wire.head_size,
                dtype=wire.dtype,
                kv_packed=wire.kv_packed,
                layers_per_region=wire.layers_per_region,
                block_bytes=wire.block_bytes,
                block_stride=wire.block_stride,
                head_start=wire.head_start,
                total_kv_heads=wire.total_kv_heads,
                block_order=wire.block_order,
                kernel_tokens=wire.kernel_tokens,
                identity=wire.identity,
                cache_kind=wire.cache_kind,
            )
        except (ValueError, TypeError) as exc:
            from .errors import ProtocolError

            raise ProtocolError(f"peer sent an invalid layout: {exc}") from exc

    @classmethod
    def from_buffers(
        cls,
        buffers: Sequence[Any],
        *,
        num_layers: int,
        num_blocks: int,
        tokens_per_block: int,
        num_kv_heads: int,
        head_size: int,
        dtype: str,
        kv_packed: bool = True,
        layers_per_region: int = 1,
        head_start: int = 0,
        total_kv_heads: int = 0,
        block_order: str = "",
        kernel_tokens: int = 0,
        identity: Sequence[tuple[str, str]] = (),
        cache_kind: str = "kv",
    ) -> KVLayout:
        """A layout over numpy arrays or torch tensors (one per region), each holding
        ``num_blocks`` contiguous blocks. The layout holds them (:attr:`buffers`): an
        endpoint made with it keeps its memory alive, so a peer's WRITE never lands in
        memory freed and reused meanwhile."""
        buffers = tuple(buffers)
        layout = cls(
            regions=tuple(Region.of(b) for b in buffers),
            num_layers=num_layers,
            num_blocks=num_blocks,
            tokens_per_block=tokens_per_block,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            dtype=dtype,
            kv_packed=kv_packed,
            layers_per_region=layers_per_region,
            head_start=head_start,
            total_kv_heads=total_kv_heads,
            block_order=block_order,
            kernel_tokens=kernel_tokens,
            identity=tuple(identity),
            cache_kind=cache_kind,
        )
        object.__setattr__(layout, "_buffers", buffers)
        return layout

    def with_buffers(self, buffers: Sequence[Any]) -> KVLayout:
        """This layout's fields over other arrays or tensors (one per region, each as long
        as the region it replaces), held as :meth:`from_buffers` holds them."""
        buffers = tuple(buffers)
        regions = tuple(Region.of(b) for b in buffers)
        if [r.length for r in regions] != [r.length for r in self.regions]:
            raise ValueError(f"KVLayout.with_buffers: region lengths "
                             f"{[r.length for r in regions]} are not this layout's "
                             f"{[r.length for r in self.regions]}")
        layout = replace(self, regions=regions)
        object.__setattr__(layout, "_buffers", buffers)
        return layout


#: Fields that decide how a block's bytes are read; they must match exactly.
_MATCHING_FIELDS = (
    "cache_kind",
    "num_layers",
    "kv_packed",
    "layers_per_region",
    "dtype",
    "total_kv_heads",
    "head_size",
    "num_regions",
    "kind",
    "block_order",
)


def check_compatible(local: KVLayout, remote: KVLayout) -> None:
    """Raise :class:`~kvpush.errors.LayoutMismatch` naming the first field on which the two
    layouts cannot exchange blocks.

    The engines' identities come first (``identity.<key>``: a different model, cache dtype,
    attention backend or version is refused before any shape is compared), then every
    field that decides how a block's bytes are read (including ``block_order``: an NHD and
    an HND cache are never paired). Block counts and addresses may differ; so may tokens per
    block (one a multiple of the other, both sides cut into token slots: see
    :attr:`KVLayout.token_units`) and, for head-major layouts, head shards.
    """
    ours, theirs = dict(local.identity), dict(remote.identity)
    for key in sorted(ours.keys() | theirs.keys()):
        if ours.get(key) != theirs.get(key):
            raise LayoutMismatch(f"identity.{key}", ours.get(key), theirs.get(key))
    for name in _MATCHING_FIELDS:
        a, b = getattr(local, name), getattr(remote, name)
        if a != b:
            raise LayoutMismatch(name, a, b)
    same_shard = (local.head_start, local.num_kv_heads) == (remote.head_start,
                                                           remote.num_kv_heads)
    if local.folded or remote.folded:
        # Folded kernel blocks interleave tokens with heads: only an identical block reads
        # the same.
        for name in ("tokens_per_block", "kernel_tokens"):
            if getattr(local, name) != getattr(remote, name):
                raise LayoutMismatch(name, getattr(local, name), getattr(remote, name))
        if not same_shard:
            raise LayoutMismatch("kernel_tokens", local.kernel_tokens, remote.kernel_tokens)
    if local.tokens_per_block != remote.tokens_per_block:
        # Blocks of k times the tokens: exchanged token slot by token slot of each unit.
        small, big = sorted((local.tokens_per_block, remote.tokens_per_block))
        if (big % small or not same_shard or local.token_units is None
                or remote.token_units is None):
            raise LayoutMismatch("tokens_per_block", local.tokens_per_block,
                                 remote.tokens_per_block)
        return
    if same_shard:
        if local.block_bytes != remote.block_bytes:
            raise LayoutMismatch("block_bytes", local.block_bytes, remote.block_bytes)
        return
    if not (local.head_major and remote.head_major):
        raise LayoutMismatch("head_major", local.head_major, remote.head_major)
    if head_overlap(local, remote) is None:
        raise LayoutMismatch(
            "head_start", (local.head_start, local.num_kv_heads),
            (remote.head_start, remote.num_kv_heads))


def covering_producers(local: KVLayout, producers: dict[str, KVLayout]) -> list[str]:
    """The fewest producers (by name) whose head shards cover ``local``'s heads, each head
    from one producer only: with replicated KV heads (GQA with TP > KV heads) every head is
    sent once, not once per rank that holds it. Raises ValueError if some head is missing.
    """
    need = set(range(local.head_start, local.head_start + local.num_kv_heads))
    chosen: list[str] = []
    while need:
        best: str | None = None
        gain: set[int] = set()
        for name in sorted(producers):
            lay = producers[name]
            held = need & set(range(lay.head_start, lay.head_start + lay.num_kv_heads))
            if len(held) > len(gain):
                best, gain = name, held
        if best is None:
            raise ValueError(f"no producer holds KV heads {sorted(need)}")
        chosen.append(best)
        need -= gain
    return chosen


def head_overlap(local: KVLayout, remote: KVLayout) -> tuple[int, int, int] | None:
    """The KV heads two sides hold in common, as (byte offset in a local block, byte offset
    in a remote block, byte length); None when they share no head."""
    lo = max(local.head_start, remote.head_start)
    hi = min(local.head_start + local.num_kv_heads, remote.head_start + remote.num_kv_heads)
    if lo >= hi:
        return None
    size = local.head_bytes
    return ((lo - local.head_start) * size, (lo - remote.head_start) * size, (hi - lo) * size)


# -- tensor parallelism: who sends which heads to whom -------------------------------------
def tp_shard(tp_size: int, tp_rank: int, total_kv_heads: int) -> tuple[int, int]:
    """``(head_start, num_heads)`` of tensor-parallel rank ``tp_rank`` of ``tp_size``, as
    vLLM (and Megatron-style sharding in general) splits ``total_kv_heads`` KV heads: each
    rank holds ``total // tp`` consecutive heads, or, with more ranks than heads (GQA/MQA),
    one head replicated on ``tp // total`` consecutive ranks. One of the two sizes must
    divide the other (vLLM refuses any other pair)."""
    for name, value in (("tp_size", tp_size), ("total_kv_heads", total_kv_heads)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} is not in [0, {tp_size})")
    if total_kv_heads % tp_size and tp_size % total_kv_heads:
        raise ValueError(f"{total_kv_heads} KV heads cannot be split over {tp_size} ranks "
                         "(one must divide the other)")
    return tp_rank * total_kv_heads // tp_size, max(1, total_kv_heads // tp_size)


@dataclass(frozen=True)
class TPRoutes:
    """Which producer (prefill) ranks each consumer (decode) rank takes its KV heads from,
    and how many consumer ranks take a share of each producer rank's source
    (see :func:`tp_routes`)."""

    producer_tp: int
    consumer_tp: int
    total_kv_heads: int
    #: per consumer rank: the producer ranks it takes from, in rank order
    producers: tuple[tuple[int, ...], ...]
    #: per producer rank: how many consumer ranks take a share (0: it sends nothing)
    sharers: tuple[int, ...]

    def sends(self, producer_rank: int) -> bool:
        """Whether a producer rank's source is taken at all (a replica of heads another
        rank sends is not: it releases its blocks at once)."""
        return self.sharers[producer_rank] > 0

    def of_consumer(self, consumer_rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(producer ranks, their sharer counts) of one consumer rank."""
        ranks = self.producers[consumer_rank]
        return ranks, tuple(self.sharers[p] for p in ranks)


def tp_routes(producer_tp: int, consumer_tp: int, total_kv_heads: int) -> TPRoutes:
    """The routes of heterogeneous (or equal) tensor parallelism, a pure function of the
    two TP sizes and the model's KV head count, so every rank of both sides computes the
    same answer without talking.

    Every head is sent once to each consumer rank that holds it: where producer ranks
    replicate a head (``producer_tp > total_kv_heads``), only the first rank of each
    replica group sends it -- always that one, whatever the consumer side's size, so a
    producer rank knows from its own side's shape alone whether anyone will come for its
    blocks (:meth:`TPRoutes.sends`). A consumer rank takes each of its heads from the
    sending producer rank that holds it; consumer ranks that replicate a head each take
    it (each needs it in its own memory).
    """
    rep = max(1, producer_tp // total_kv_heads)     # producer ranks per replicated head
    shards = [tp_shard(producer_tp, p, total_kv_heads) for p in range(producer_tp)]
    senders = [p for p in range(producer_tp) if p % rep == 0]
    producers: list[tuple[int, ...]] = []
    sharers = [0] * producer_tp
    for c in range(consumer_tp):
        start, n = tp_shard(consumer_tp, c, total_kv_heads)
        mine = tuple(p for p in senders
                     if shards[p][0] < start + n and start < shards[p][0] + shards[p][1])
        for p in mine:
            sharers[p] += 1
        producers.append(mine)
    return TPRoutes(producer_tp, consumer_tp, total_kv_heads, tuple(producers),
                    tuple(sharers))


def replica_routes(producer_tp: int, consumer_tp: int, transfer_id: str) -> TPRoutes:
    """The routes of a cache every rank of both sides holds whole (MLA's latent: one vector
    per token, replicated across tensor-parallel ranks, nothing to shard).

    Every consumer rank takes its copy from one producer rank -- the same one for every
    consumer rank of a transfer, so no other producer rank sends a byte of it -- chosen by
    a stable hash of ``transfer_id``: transfers spread evenly over the producer ranks. Both
    sides compute it from the transfer id and the producer TP size alone, so a producer
    rank knows without talking whether anyone comes for its blocks
    (:meth:`TPRoutes.sends`); each consumer rank still needs its own copy in its own memory.
    """
    for name, value in (("producer_tp", producer_tp), ("consumer_tp", consumer_tp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    sender = zlib.crc32(transfer_id.encode()) % producer_tp
    sharers = tuple(consumer_tp if p == sender else 0 for p in range(producer_tp))
    return TPRoutes(producer_tp, consumer_tp, 1, ((sender,),) * consumer_tp, sharers)
