"""A thin wrapper over one NIXL agent, configured the way kvpush needs it.

* NIXL's progress thread is **off**: its default polls without pause (~a core per agent,
  idle or not). The kvpush loop thread drives progress instead (see :mod:`kvpush.progress`).
* UCX error-handling mode defaults to ``none``: mode ``peer`` rules out UCX's shared-memory
  transports on a host and needs the *target* to progress for every transfer (TCP), which
  makes small transfers far slower (``docs/ARCHITECTURE.md``, "Transport choices").
  Liveness comes from kvpush's heartbeats and deadlines instead; a post toward a dead peer
  still fails fast (NIXL raises ``nixlRemoteDisconnectError``), which the fault tests
  check.
* Descriptor lists are prepared once per (layout, peer), region-major, and a request names
  descriptors by index (``make_prepped_xfer``) -- unless it is made of long runs of
  adjacent blocks: then it is posted as explicit merged descriptors, one per (region, run)
  (``initialize_xfer``), which NIXL prepares far faster there (:func:`explicit_is_cheaper`).
* Host memory is **populated** at registration (``TransportConfig.populate_host_memory``):
  every page faulted in, writable, its bytes unchanged. A cache allocated lazily (numpy's
  ``zeros``, torch's ``empty``) otherwise takes each page's first fault inside the first
  transfer that touches it -- and on one host a WRITE's faults in the target's pages are
  taken by the *initiator's* post (the copy runs there), so a decode engine's cold cache
  stalled its producer's loop, every peer's requests with it, for 0.1-0.25 s here (with
  transparent huge pages, each fault zeroes 2 MiB and may compact memory first).
* A dropped peer's NIXL metadata (its UCX endpoint) is **kept** (at most
  :data:`DORMANT_MAX` such peers, and until the agent closes): NIXL's
  ``remove_remote_agent`` closes the endpoint in flush mode, and a flush-mode close of a
  connection a link cut left behind is what UCX aborts the process on ("Endpoint timeout",
  ``docs/RELIABILITY.md``). The same incarnation coming back (after a cut) gets its
  endpoint back, never closed; a new incarnation of the name (new metadata, which NIXL
  refuses while the old is loaded) has the old removed first, with UCX progressed just
  before and after the removal.

Only the loop thread touches an agent after construction (NIXL's sync mode is NONE).
"""

from __future__ import annotations

import ctypes
import enum
import functools
import logging
import mmap
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._core import PreparedLink
from .errors import PeerUnavailable, TransferFailed
from .layout import KVLayout, MemoryKind, Region, head_overlap
from .plan import plan_split_transfer, plan_transfer

__all__ = ["Agent", "Link", "TransportConfig", "XferState"]

log = logging.getLogger("kvpush.agent")

#: Dropped peers whose NIXL metadata is kept (see the module's docstring); past it the
#: oldest is removed.
DORMANT_MAX = 64
#: A connection set-up or tear-down call into NIXL (``add_remote_agent``,
#: ``remove_remote_agent``) longer than this is logged: the loop thread waits on it.
SLOW_CALL_S = 0.1
#: A post (prepare and post, the copy NIXL may run inline included) longer than this is
#: logged: past what a copy takes, it waited on UCX (a connection being set up to a peer
#: that does not progress), and every request of the endpoint waited with it.
SLOW_POST_S = 1.0

#: A request is posted as explicit merged descriptors (one per region and run) rather than
#: by prepared indices when it names at least this many indices ...
EXPLICIT_MIN_INDICES = 16384
#: ... in runs of at least this many blocks on average (indices per merged descriptor).
EXPLICIT_MIN_RUN = 64


def explicit_is_cheaper(indices: int, merged: int) -> bool:
    """Whether a request of ``indices`` descriptor indices that merge into ``merged``
    descriptors moves sooner posted as explicit merged descriptors (``initialize_xfer``)
    than by prepared indices (``make_prepped_xfer``).

    Explicit descriptors cost NIXL a fixed preparation per call that prepared indices
    have paid once, and they are dearer than indices for scattered blocks; merged over long
    runs they are few, and end to end they win once a request names many indices. Hence:
    many indices, in long runs (the figures behind both bounds: ``docs/BENCHMARKS.md``)."""
    return indices >= EXPLICIT_MIN_INDICES and merged * EXPLICIT_MIN_RUN <= indices


_ERROR_MODES = ("none", "peer")
_DATA_PLANES = ("inprocess", "child")
_NIXL_APIS = ("python", "c")
_CONTROLS = ("tcp", "zmq")


@dataclass(frozen=True)
class TransportConfig:
    """How kvpush configures NIXL.

    Parameters
    ----------
    backend
        NIXL backend plugin (``"UCX"`` here; ``"LIBFABRIC"`` for EFA where installed).
    ucx_error_mode
        ``"none"`` (default: shared memory on a host, kvpush-level liveness) or ``"peer"``
        (UCX detects dead peers itself; TCP on a host, target must progress).
    data_plane
        ``"inprocess"`` (default: the NIXL agent runs in the engine's process) or
        ``"child"`` (a data-plane child process per endpoint, so a fatal abort inside
        UCX costs that endpoint's requests and a restart, not the engine; the KV cache
        must then come from :func:`kvpush.shared_array` / :func:`kvpush.shared_tensor`).
        See :mod:`kvpush.dataplane`.
    nixl_api
        ``"python"`` (default: NIXL's Python binding; the pinned nixl's lets the process's
        other threads run during a post's copy) or ``"c"`` (``kvpush._nixlc``: NIXL's C
        API, every call into NIXL without the GIL, whatever the binding does). With
        ``"c"`` NIXL's errors all read as :class:`TransferFailed` (its C API does not say
        which), a dead peer's included.
    populate_host_memory
        ``True`` (default): fault every page of the host (DRAM) KV cache in at
        registration, its bytes unchanged (:func:`populate`), so no transfer takes a first
        page fault. A cache already written (vLLM zeroes its own) costs nothing here; one
        allocated lazily becomes resident at once, in the time writing it once would take
        (``docs/ARCHITECTURE.md``). ``False``: pages are faulted in by the first transfer
        that touches them.
    control
        How control frames (handshakes, hints, heartbeats) travel: ``"tcp"`` (default:
        TCP connections the endpoint's loop thread reads and writes itself,
        :mod:`kvpush.stream`) or ``"zmq"`` (ZeroMQ DEALER and ROUTER sockets, whose I/O
        threads cost two thread wake-ups more per frame). Both ends of a connection must
        use the same: a peer that speaks the other is refused at its first bytes.
    """

    backend: str = "UCX"
    ucx_error_mode: str = "none"
    data_plane: str = "inprocess"
    nixl_api: str = "python"
    populate_host_memory: bool = True
    control: str = "tcp"

    def __post_init__(self) -> None:
        if self.ucx_error_mode not in _ERROR_MODES:
            raise ValueError(
                f"TransportConfig.ucx_error_mode must be one of {_ERROR_MODES}, "
                f"got {self.ucx_error_mode!r}"
            )
        if self.data_plane not in _DATA_PLANES:
            raise ValueError(
                f"TransportConfig.data_plane must be one of {_DATA_PLANES}, "
                f"got {self.data_plane!r}"
            )
        if not self.backend:
            raise ValueError("TransportConfig.backend must be a backend name")
        if self.nixl_api not in _NIXL_APIS:
            raise ValueError(
                f"TransportConfig.nixl_api must be one of {_NIXL_APIS}, got {self.nixl_api!r}"
            )
        if self.control not in _CONTROLS:
            raise ValueError(
                f"TransportConfig.control must be one of {_CONTROLS}, got {self.control!r}"
            )
        if not isinstance(self.populate_host_memory, bool):
            raise TypeError("TransportConfig.populate_host_memory must be a bool, got "
                            f"{self.populate_host_memory!r}")


#: madvise(2) advice that faults every page of a range in, writable, leaving its bytes as
#: they are (Linux 5.14 and later).
MADV_POPULATE_WRITE = 23
#: Populating longer than this is logged (the endpoint's construction waited on it).
SLOW_POPULATE_S = 1.0


def populate(regions: Sequence[Region]) -> int:
    """Fault in every page of the host-memory ``regions`` now, writable, bytes unchanged
    (``MADV_POPULATE_WRITE``); returns the bytes populated. Never raises: a kernel without
    the advice, or memory it cannot populate (a read-only or device mapping), is logged and
    left to fault as it is touched -- only the first transfers' latency is at stake."""
    host = [r for r in regions if r.kind is MemoryKind.DRAM and r.length > 0]
    if not host:
        return 0
    if not _can_populate():
        log.info("this kernel cannot populate pages ahead (MADV_POPULATE_WRITE, Linux "
                 "5.14+): the first transfers into the KV cache fault its pages in")
        return 0
    page = os.sysconf("SC_PAGE_SIZE")
    madvise = _libc().madvise
    started = time.monotonic()
    done = 0
    for region in host:
        start = region.addr - region.addr % page
        length = region.addr + region.length - start
        if madvise(start, length, MADV_POPULATE_WRITE) == 0:
            done += length
            continue
        log.warning("cannot populate the region at %#x (%d bytes) ahead: %s; the first "
                    "transfers into it fault its pages in", region.addr, region.length,
                    os.strerror(ctypes.get_errno()))
    took = time.monotonic() - started
    if took > SLOW_POPULATE_S:
        log.info("populated %d MiB of KV cache in %.1f s", done >> 20, took)
    return done


@functools.cache
def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc


@functools.cache
def _can_populate() -> bool:
    """Whether the kernel knows MADV_POPULATE_WRITE: asked once, of a page of our own
    (EINVAL also answers a region it cannot populate, so a region's EINVAL cannot say)."""
    page = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        address = ctypes.addressof(ctypes.c_char.from_buffer(page))
        ok: bool = _libc().madvise(address, mmap.PAGESIZE, MADV_POPULATE_WRITE) == 0
        return ok
    finally:
        page.close()


@dataclass(frozen=True)
class Link:
    """How this side's prepared descriptors pair with one peer's.

    Same tokens per block: one descriptor per (region, block), over the byte range of the
    KV heads both sides hold. Different tokens per block (one a multiple ``k`` of the
    other): one descriptor per (region, block, slot, head); the coarse side has ``k``
    slots per block (``local_split`` / ``remote_split``). ``merges``: on both sides every
    descriptor ends where the next index's begins (within a region), so NIXL merges a run
    of indices into one transfer; false for a head shard of each block or padded blocks,
    and plans then count every index as a descriptor.
    """

    remote_num_blocks: int
    desc_bytes: int            # bytes one descriptor moves
    heads: int = 0             # > 0: per-head descriptors (split blocks)
    local_split: int = 1
    remote_split: int = 1
    merges: bool = True
    # This side's blocks per region and regions; with them the link's planning constants
    # are converted and checked once, here, and each request is one compiled call.
    local_num_blocks: int = 0
    num_regions: int = 0
    prepared: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.local_num_blocks and self.num_regions:
            object.__setattr__(self, "prepared", PreparedLink(
                self.local_num_blocks, self.remote_num_blocks, self.num_regions, self.heads,
                self.local_split, self.remote_split, self.merges))

    def __reduce__(self) -> tuple[Any, ...]:
        # The compiled constants do not pickle (a contained data plane sends its Links to
        # the engine's process): rebuilt from the fields on the other side.
        return (Link, (self.remote_num_blocks, self.desc_bytes, self.heads, self.local_split,
                       self.remote_split, self.merges, self.local_num_blocks,
                       self.num_regions))

    def plan(self, local_ids: np.ndarray, remote_ids: np.ndarray, num_blocks: int,
             num_regions: int, coalesce: bool) -> Any:
        """The request's descriptor index arrays (compiled; raises InvalidBlockIds).
        ``num_blocks`` and ``num_regions`` are this side's layout's."""
        prepared = self.prepared
        if prepared is not None and (num_blocks, num_regions) == (self.local_num_blocks,
                                                                   self.num_regions):
            return prepared.plan(local_ids, remote_ids, coalesce)
        if self.heads:
            return plan_split_transfer(local_ids, remote_ids, num_blocks,
                                       self.remote_num_blocks, num_regions, self.heads,
                                       self.local_split, self.remote_split, merges=self.merges)
        return plan_transfer(local_ids, remote_ids, num_blocks, self.remote_num_blocks,
                             num_regions, coalesce, merges=self.merges)


def _adjacent_in_order(table: np.ndarray, num_regions: int) -> bool:
    """Whether, within each region, every descriptor of ``table`` (rows of address,
    length, device) ends exactly where the next one begins."""
    rows = table.reshape(num_regions, -1, 3)
    return bool(np.array_equal(rows[:, :-1, 0] + rows[:, :-1, 1], rows[:, 1:, 0]))


class XferState(enum.Enum):
    IN_PROGRESS = "PROC"
    DONE = "DONE"
    ERROR = "ERR"


def _nixl() -> Any:
    # nixl's logger prints an INFO line per agent; keep kvpush quiet unless asked.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    import nixl._api as nixl_api

    logging.getLogger("nixl").setLevel(logging.WARNING)
    return nixl_api


def nixl_c() -> Any:
    """``kvpush._nixlc`` with NIXL's C API loaded: ``libnixl_capi.so`` from the libraries
    of the nixl package that ``import nixl`` picks (the same ``libnixl.so`` its binding
    loaded, which is loaded first). Raises :class:`TransferFailed` when either is missing."""
    try:
        from . import _nixlc
    except ImportError as exc:
        raise TransferFailed(f"kvpush._nixlc is not built: {exc}") from exc
    if not _nixlc.loaded():
        _nixl()
        import nixl._bindings as binding

        package = os.path.dirname(os.path.abspath(binding.__file__))
        libs = os.path.join(os.path.dirname(package),
                            f".{os.path.basename(package)}.mesonpy.libs", "libnixl_capi.so")
        try:
            _nixlc.load(libs)
        except RuntimeError as exc:
            raise TransferFailed(str(exc)) from exc
    return _nixlc


class Agent:
    """One NIXL agent with kvpush's configuration, its registered layout, and its peers.

    Parameters
    ----------
    name
        Unique agent name (peers address it by this name).
    layout
        The local KV cache; registered at construction, deregistered by :meth:`close`.
    config
        :class:`TransportConfig`.
    """

    def __init__(self, name: str, layout: KVLayout, config: TransportConfig) -> None:
        self.name = name
        self.layout = layout
        if config.nixl_api == "c":
            # Same calls, same results; no progress or listen thread either.
            self._agent = nixl_c().NixlAgent(name)
        else:
            api = _nixl()
            conf = api.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False,
                                         backends=[])
            self._agent = api.nixl_agent(name, conf)
        params = {}
        if config.backend == "UCX":
            params["ucx_error_handling_mode"] = config.ucx_error_mode
        try:
            self._agent.create_backend(config.backend, params)
        except Exception as exc:
            raise TransferFailed(f"cannot create NIXL backend {config.backend}: {exc}") from exc
        mem = layout.kind.value
        self._mem = mem
        if config.populate_host_memory:
            populate(layout.regions)
        self._reg = self._agent.register_memory(
            [(r.addr, r.length, r.device_id, "") for r in layout.regions], mem
        )
        self._local_table = layout.descriptor_table()
        self._local_dlist = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", self._local_table,
                                                        mem)
        self._remote_dlists: dict[str, Any] = {}
        # Peers sharing only some heads, or with other block sizes, get lists of their own.
        self._local_dlists: dict[str, Any] = {}
        self._links: dict[str, Link] = {}
        # Per peer whose link merges whole blocks: (local table, remote table, remote memory
        # kind), the descriptor tables its lists were prepared from (explicit posts)
        self._tables: dict[str, tuple[np.ndarray, np.ndarray, str]] = {}
        self.last_explicit = False  # whether the last post went as explicit descriptors
        self._dormant: dict[str, None] = {}  # dropped peers still loaded in NIXL, oldest first
        # Notifications read while progressing UCX around a removal, for notifications()
        self._stash: dict[str, list[bytes]] = {}
        self._closed = False

    # -- peers -----------------------------------------------------------------------------
    def metadata(self) -> bytes:
        data: bytes = self._agent.get_agent_metadata()
        return data

    def add_peer(self, metadata: bytes, layout: KVLayout, name: str = "") -> str:
        """Load a peer's metadata and prepare its descriptor lists (over the KV heads both
        sides hold, per head when block sizes differ); returns its agent name. ``name``:
        the name the peer gave (a kept predecessor NIXL refuses to replace goes first)."""
        local, remote = self.layout, layout
        local_table: np.ndarray | None  # None: the shared whole-block list serves
        if local.tokens_per_block != remote.tokens_per_block:
            k = max(local.tokens_per_block, remote.tokens_per_block) // min(
                local.tokens_per_block, remote.tokens_per_block)
            local_split = k if local.tokens_per_block > remote.tokens_per_block else 1
            remote_split = k if local_split == 1 else 1
            # Per block: the pieces whose outermost axis is tokens (a head, a head's K or V
            # half, or the whole block): check_compatible refused layouts without them.
            heads = local.token_units or 0
            local_table = local.split_table(local_split)
            remote_table = remote.split_table(remote_split)
            merges = _adjacent_in_order(local_table, local.num_regions) and \
                _adjacent_in_order(remote_table, remote.num_regions)
            link = Link(remote.num_blocks, int(local_table[0, 1]), heads, local_split,
                        remote_split, merges, local.num_blocks, local.num_regions)
        else:
            overlap = head_overlap(local, remote)
            if overlap is None:
                raise PeerUnavailable("the peer holds none of this side's KV heads")
            local_offset, remote_offset, length = overlap
            remote_table = remote.descriptor_table(remote_offset, length)
            local_table = None if (local_offset, length) == (0, local.block_bytes) else \
                local.descriptor_table(local_offset, length)
            # Whole unpadded blocks on both sides: index-adjacent is byte-adjacent.
            merges = length == local.block_stride and length == remote.block_stride
            link = Link(remote.num_blocks, length, merges=merges,
                        local_num_blocks=local.num_blocks, num_regions=local.num_regions)
        try:
            try:
                # The same incarnation back (after a cut): NIXL takes its metadata again and
                # the kept endpoint serves on, never closed.
                name = self._timed("add_remote_agent", self._agent.add_remote_agent, metadata)
            except Exception:
                # A new incarnation: NIXL refuses its metadata while the old is loaded; the
                # old goes first (all kept ones, when the caller did not say who it is).
                stale = [name] if name in self._dormant else list(self._dormant)
                if not stale:
                    raise
                for old in stale:
                    self._remove_remote(old)
                name = self._timed("add_remote_agent", self._agent.add_remote_agent, metadata)
            if isinstance(name, bytes):
                name = name.decode()
            self._dormant.pop(name, None)
            self._release_remote(name)
            self._remote_dlists[name] = self._agent.prep_xfer_dlist(
                name, remote_table, remote.kind.value)
            if local_table is not None:
                self._local_dlists[name] = self._agent.prep_xfer_dlist(
                    "NIXL_INIT_AGENT", local_table, self._mem)
        except Exception as exc:
            raise PeerUnavailable(f"cannot load peer metadata: {exc}") from exc
        self._links[name] = link
        if link.merges and not link.heads and link.local_split == link.remote_split == 1:
            self._tables[name] = (self._local_table if local_table is None else local_table,
                                  np.asarray(remote_table), remote.kind.value)
        return name

    def link(self, peer: str) -> Link:
        """How descriptors pair with ``peer``'s; PeerUnavailable when not connected."""
        link = self._links.get(peer)
        if link is None:
            raise PeerUnavailable(f"no connection to {peer!r}")
        return link

    def remove_peer(self, name: str) -> None:
        """Drop a peer (after it died or left): its prepared lists at once; its NIXL
        metadata is kept (see the module's docstring)."""
        self._release_remote(name)
        if self._closed:
            self._remove_remote(name)
            return
        self._dormant.pop(name, None)
        self._dormant[name] = None
        while len(self._dormant) > DORMANT_MAX:
            self._remove_remote(next(iter(self._dormant)))

    def _remove_remote(self, name: str) -> None:
        """NIXL's removal, with UCX progressed just before and after it (what it finds
        about the peer's connection is handled then, not in the next post)."""
        self._dormant.pop(name, None)
        self._progress()
        try:
            self._timed(f"remove_remote_agent({name})", self._agent.remove_remote_agent, name)
        except Exception as exc:  # already gone: nothing to undo
            log.debug("remove_remote_agent(%s): %s", name, exc)
        self._progress()

    def _timed(self, what: str, fn: Any, *args: Any) -> Any:
        """``fn(*args)``, a NIXL call that sets a connection up or down; one that holds the
        loop thread longer than :data:`SLOW_CALL_S` is logged (every request of the
        endpoint waited meanwhile), raising or not."""
        started = time.monotonic()
        try:
            return fn(*args)
        finally:
            took = time.monotonic() - started
            if took > SLOW_CALL_S:
                log.warning("%s: NIXL %s took %.3f s (the loop thread waited on it)",
                            self.name, what, took)

    def _progress(self) -> None:
        """Progress UCX (NIXL's Python API does it through get_new_notifs); what comes is
        kept for :meth:`notifications`."""
        if self._agent is None:
            return
        try:
            notifs = self._agent.get_new_notifs()
        except Exception as exc:
            log.warning("get_new_notifs: %s", exc)
            return
        for sender, notes in notifs.items():
            self._stash.setdefault(sender, []).extend(notes)

    def _release_remote(self, name: str) -> None:
        self._links.pop(name, None)
        self._tables.pop(name, None)
        for lists in (self._remote_dlists, self._local_dlists):
            handle = lists.pop(name, None)
            if handle is not None:
                try:
                    handle.release()
                except Exception as exc:
                    log.warning("releasing descriptor list of %s: %s", name, exc)

    def has_peer(self, name: str) -> bool:
        return name in self._remote_dlists

    # -- transfers -------------------------------------------------------------------------
    def post(self, op: str, peer: str, local_idx: np.ndarray, remote_idx: np.ndarray,
             notif: bytes, runs: np.ndarray | None = None,
             regions: tuple[int, int] | None = None) -> Any:
        """Create and post a transfer; returns its handle (state via :meth:`state`).

        ``runs`` (the plan's, region 0's ``local_start, remote_start, length`` in block ids)
        and ``regions`` (the ``lo, hi`` regions the indices cover) let a request of long
        runs go as explicit merged descriptors (:func:`explicit_is_cheaper`); either None:
        by index. :attr:`last_explicit` says which it took.

        Raises :class:`PeerUnavailable` when the peer is gone, :class:`TransferFailed` when
        NIXL refuses the request.
        """
        started = time.monotonic()
        try:
            return self._post(op, peer, local_idx, remote_idx, notif, runs, regions)
        finally:
            took = time.monotonic() - started
            if took > SLOW_POST_S:
                log.warning("%s: NIXL %s to %s of %d descriptor(s) took %.3f s (the loop "
                            "thread waited on it)", self.name, op, peer, len(local_idx), took)

    def _post(self, op: str, peer: str, local_idx: np.ndarray, remote_idx: np.ndarray,
              notif: bytes, runs: np.ndarray | None,
              regions: tuple[int, int] | None) -> Any:
        remote = self._remote_dlists.get(peer)
        if remote is None:
            raise PeerUnavailable(f"no connection to {peer!r}")
        tables = self._tables.get(peer)
        self.last_explicit = explicit = (
            tables is not None and runs is not None and regions is not None
            and explicit_is_cheaper(len(local_idx), len(runs) * (regions[1] - regions[0])))
        try:
            if explicit:
                assert tables is not None and runs is not None and regions is not None
                local_descs, remote_descs = self._explicit(peer, tables, runs, regions)
                handle = self._agent.initialize_xfer(op, local_descs, remote_descs, peer,
                                                     notif)
            else:
                handle = self._agent.make_prepped_xfer(
                    op, self._local_dlists.get(peer, self._local_dlist), local_idx, remote,
                    remote_idx, notif
                )
        except Exception as exc:
            raise self._translate(exc, "prepare", peer) from exc
        try:
            status = self._agent.transfer(handle)
        except Exception as exc:
            self.release(handle)
            raise self._translate(exc, "post", peer) from exc
        if status == "ERR":
            self.release(handle)
            raise TransferFailed(f"NIXL refused to post a {op} to {peer!r}")
        return handle

    def _explicit(self, peer: str, tables: tuple[np.ndarray, np.ndarray, str],
                  runs: np.ndarray, regions: tuple[int, int]) -> tuple[Any, Any]:
        """NIXL descriptor lists of a request's merged descriptors: for each region in
        ``regions`` and each run, the run's first block's descriptor on each side, as long
        as the run (the link merges: index-adjacent descriptors are byte-adjacent)."""
        local_table, remote_table, remote_mem = tables
        link = self._links[peer]
        region = np.arange(regions[0], regions[1], dtype=np.int64)[:, None]
        lengths = np.tile(runs[:, 2].astype(np.uint64) * np.uint64(link.desc_bytes),
                          regions[1] - regions[0])
        out = []
        for table, starts, num_blocks, mem in (
                (local_table, runs[:, 0], link.local_num_blocks, self._mem),
                (remote_table, runs[:, 1], link.remote_num_blocks, remote_mem)):
            rows = (region * num_blocks + starts[None, :]).ravel()
            descs = table[rows].astype(np.uint64)
            descs[:, 1] = lengths
            out.append(self._agent.get_xfer_descs(descs, mem))
        return out[0], out[1]

    def state(self, handle: Any) -> XferState:
        try:
            return XferState(self._agent.check_xfer_state(handle))
        except Exception as exc:
            log.info("check_xfer_state: %s", exc)
            return XferState.ERROR

    def release(self, handle: Any) -> bool:
        """Release (cancelling if still active) a transfer handle. False when NIXL could not
        cancel it: the transfer may still be running and the handle must be polled again."""
        try:
            handle.release()
        except Exception as exc:
            log.debug("release of transfer handle: %s", exc)
            return False
        return True

    def notifications(self) -> dict[str, list[bytes]]:
        """New notifications by sender; also drives the agent's progress."""
        try:
            notifs: dict[str, list[bytes]] = self._agent.get_new_notifs()
        except Exception as exc:
            log.warning("get_new_notifs: %s", exc)
            notifs = {}
        if self._stash:  # read while progressing around a removal: those came first
            stash, self._stash = self._stash, {}
            for sender, notes in notifs.items():
                stash.setdefault(sender, []).extend(notes)
            return stash
        return notifs

    def send_notification(self, peer: str, message: bytes) -> None:
        try:
            self._agent.send_notif(peer, message)
        except Exception as exc:
            raise self._translate(exc, "notify", peer) from exc

    def _translate(self, exc: Exception, what: str, peer: str) -> Exception:
        kind = type(exc).__name__
        if "Disconnect" in kind or "NotFound" in kind:
            return PeerUnavailable(f"{what} toward {peer!r} failed: peer disconnected ({kind})")
        return TransferFailed(f"{what} toward {peer!r} failed: {kind}: {exc}")

    # -- teardown --------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for name in [*self._remote_dlists, *self._dormant]:
            self.remove_peer(name)
        try:
            self._local_dlist.release()
        except Exception as exc:
            log.warning("releasing local descriptor list: %s", exc)
        try:
            self._agent.deregister_memory(self._reg)
        except Exception as exc:
            log.warning("deregistering KV memory: %s", exc)
        self._agent = None
