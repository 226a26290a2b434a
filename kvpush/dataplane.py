"""The contained data plane: the NIXL agent in a small child process per endpoint.

kvpush runs inside the inference engine's process, and UCX can abort the process that runs
its worker (``ucs_fatal``, e.g. "Endpoint timeout" when a connection that a link cut left
behind is closed: ``docs/RELIABILITY.md``): nothing in that process can catch it. With
``TransportConfig(data_plane="child")`` the NIXL agent runs in a child process instead (one
per Producer/Consumer), and an abort there costs the requests that data plane held, not the
engine:

* **Memory.** The KV cache must be host memory the child can map: allocate it with
  :func:`shared_array` / :func:`shared_tensor` (memfd-backed). The child receives the memfd
  over the channel (``SCM_RIGHTS``), maps it and registers it with NIXL at its own
  addresses (peers are told those; :attr:`ChildAgent.layout`). Memory kvpush did not
  allocate (an ordinary numpy array, a torch tensor, GPU memory) is refused at
  construction: GPU memory would need CUDA IPC, which is not implemented (no GPU here to
  test it).
* **Channel.** A ``socketpair``; each :class:`ChildAgent` call is one request and one answer
  (pickled, length-prefixed). The child only ever answers, so it blocks in ``recv`` when
  the endpoint has nothing in flight; the endpoint's loop polls the channel's fd beside its
  sockets, so a dying child wakes it (end of file) without anything spinning.
* **Death.** A child that exits, is killed, or does not answer within
  :data:`CALL_TIMEOUT_S` is *lost*: from then on its transfers read as in progress (so the
  endpoint gives them up as not fenced: ``blocks_safe=False``), posts create such transfers,
  and the endpoint (:meth:`kvpush.driver.Driver._data_plane_lost`) fails the requests of
  every peer, starts a new child (:meth:`ChildAgent.restart`: memory registered again, a new
  NIXL agent under the same name) and handshakes again. The child also exits when the
  engine process dies (its end of the channel closes).

The in-process :class:`~kvpush.agent.Agent` is the default; :func:`make_agent` picks one.
"""

from __future__ import annotations

import logging
import mmap
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import weakref
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from .agent import Agent, Link, TransportConfig, XferState
from .errors import KvpushError, PeerUnavailable, TransferFailed
from .layout import KVLayout, MemoryKind, Region

__all__ = ["CALL_TIMEOUT_S", "ChildAgent", "DataPlaneLost", "make_agent", "shared_array",
           "shared_tensor"]

log = logging.getLogger("kvpush.dataplane")

#: A child that has not answered one call this long is taken for hung and killed.
CALL_TIMEOUT_S = 30.0
#: How long the child may take to start (Python, NIXL, memory registration).
START_TIMEOUT_S = 60.0

_LEN = struct.Struct("!I")
_MAX_FRAME = 1 << 30


class DataPlaneLost(TransferFailed):
    """The data-plane child died or stopped answering (the endpoint restarts it)."""


# -- shared memory -------------------------------------------------------------------------
@dataclass
class _Mapping:
    fd: int
    base: int
    length: int


_mappings: dict[int, _Mapping] = {}   # by base address
_mappings_lock = threading.Lock()


def _forget_mapping(base: int) -> None:
    with _mappings_lock:
        entry = _mappings.pop(base, None)
    if entry is not None:
        os.close(entry.fd)


def _shared_buffer(nbytes: int) -> mmap.mmap:
    if not isinstance(nbytes, int) or nbytes <= 0:
        raise ValueError(f"a shared buffer needs a positive size, got {nbytes!r}")
    fd = os.memfd_create("kvpush-kv", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    base = np.frombuffer(mm, dtype=np.uint8, count=1).ctypes.data
    with _mappings_lock:
        _mappings[base] = _Mapping(fd, base, nbytes)
    # The memfd stays open (a data-plane child may be started again) until nothing maps it.
    weakref.finalize(mm, _forget_mapping, base)
    return mm


def shared_array(shape: int | tuple[int, ...], dtype: Any = np.uint8) -> np.ndarray:
    """A zeroed numpy array in shared memory (a memfd) that a contained data plane
    (``TransportConfig(data_plane="child")``) can register. Keep it alive while any endpoint
    uses it (as with any KV buffer)."""
    shape_t = (shape,) if isinstance(shape, int) else tuple(shape)
    dt = np.dtype(dtype)
    count = int(np.prod(shape_t, dtype=np.int64))
    mm = _shared_buffer(max(count, 1) * dt.itemsize)
    return np.frombuffer(mm, dtype=dt, count=count).reshape(shape_t)


def shared_tensor(shape: int | tuple[int, ...], dtype: Any = None) -> Any:
    """A zeroed CPU torch tensor in shared memory (see :func:`shared_array`); ``dtype`` a
    torch dtype (default ``torch.uint8``)."""
    import torch

    dt = torch.uint8 if dtype is None else dtype
    shape_t = (shape,) if isinstance(shape, int) else tuple(shape)
    count = 1
    for n in shape_t:
        count *= int(n)
    itemsize = torch.empty((), dtype=dt).element_size()
    mm = _shared_buffer(max(count, 1) * itemsize)
    flat = torch.frombuffer(mm, dtype=dt, count=count)
    return flat.reshape(shape_t)


def _share_of(region: Region) -> tuple[int, int]:
    """(memfd, offset) of a region kvpush's shared allocator made; ValueError otherwise."""
    if region.kind is not MemoryKind.DRAM:
        raise ValueError(
            "TransportConfig(data_plane='child') takes host memory only: GPU memory would "
            "be shared with the data-plane child through CUDA IPC, which kvpush does not "
            "implement; use data_plane='inprocess' for GPU KV caches")
    with _mappings_lock:
        for entry in _mappings.values():
            if entry.base <= region.addr and region.addr + region.length \
                    <= entry.base + entry.length:
                return entry.fd, region.addr - entry.base
    raise ValueError(
        f"TransportConfig(data_plane='child') needs KV memory the data-plane child can map: "
        f"the region at {region.addr:#x} ({region.length} bytes) was not allocated with "
        f"kvpush.shared_array / kvpush.shared_tensor")


# -- the channel -----------------------------------------------------------------------------
def _send_frame(sock: socket.socket, obj: Any, fds: list[int] | None = None) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    frame = _LEN.pack(len(data)) + data
    if fds:
        sent = socket.send_fds(sock, [frame], fds)
        if sent < len(frame):
            sock.sendall(frame[sent:])
    else:
        sock.sendall(frame)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("channel closed")
        buf += chunk
    return bytes(buf)


def _recv_frame(sock: socket.socket, with_fds: int = 0) -> tuple[Any, list[int]]:
    fds: list[int] = []
    if with_fds:
        head, fds, _, _ = socket.recv_fds(sock, _LEN.size, with_fds)
        if not head:
            raise EOFError("channel closed")
        if len(head) < _LEN.size:
            head += _recv_exact(sock, _LEN.size - len(head))
    else:
        head = _recv_exact(sock, _LEN.size)
    (n,) = _LEN.unpack(head)
    if n > _MAX_FRAME:
        raise EOFError(f"frame of {n} bytes")
    return pickle.loads(_recv_exact(sock, n)), fds


# -- the parent's side -----------------------------------------------------------------------
class _Lost:
    """A transfer handle of a lost data plane (or a post it may have made before dying):
    it reads as in progress until the endpoint gives it up (not fenced)."""

    __slots__ = ()


class ChildAgent:
    """:class:`~kvpush.agent.Agent`'s interface over a data-plane child process.

    ``layout`` is the engine's layout; :attr:`layout` (what peers are told) has the child's
    addresses of the same memory. Only the endpoint's loop thread calls it after
    construction (as with :class:`~kvpush.agent.Agent`)."""

    def __init__(self, name: str, layout: KVLayout, config: TransportConfig) -> None:
        self.name = name
        self.engine_layout = layout
        self._config = config
        self._shares = [_share_of(r) for r in layout.regions]  # refuses unshareable memory
        self._links: dict[str, Link] = {}
        # Transfer states are asked for all live handles at once (one call per poll of
        # the endpoint, not one per transfer) and kept until asked for: handle -> state.
        # Handles the child found ended it has released already (a release is then local).
        self._live: set[int] = set()
        self._states: dict[int, str] = {}
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._closed = False
        self.lost: str | None = None     # why the current child was lost (None: alive)
        self.restarts = 0
        self.last_explicit = False  # whether the last post went as explicit descriptors
        self._start()

    # -- the child's life --------------------------------------------------------------------
    def _start(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvpush._dataplane_child", str(child.fileno())],
                pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL,
                stdout=sys.stderr.fileno() if _has_fileno(sys.stderr) else None, env=env,
                close_fds=True)
        except BaseException:
            parent.close()
            child.close()
            raise
        child.close()
        self._proc, self._sock = proc, parent
        regions = [(offset, r.length) for (_, offset), r
                   in zip(self._shares, self.engine_layout.regions, strict=True)]
        fds = sorted({fd for fd, _ in self._shares})
        index = [fds.index(fd) for fd, _ in self._shares]
        try:
            parent.settimeout(START_TIMEOUT_S)
            _send_frame(parent, ("init", self.name, self.engine_layout, self._config,
                                 regions, index), fds)
            status, value = _recv_frame(parent)[0]
            if status != "ok":
                raise TransferFailed(f"data-plane child could not start: {value[1]}")
            addrs, self._metadata = value
        except BaseException as exc:
            self._kill()
            self._proc = self._sock = None
            if isinstance(exc, KvpushError):
                raise
            raise DataPlaneLost(f"data-plane child did not start: {exc!r}") from exc
        parent.settimeout(CALL_TIMEOUT_S)
        self.layout = replace(self.engine_layout, regions=tuple(
            replace(r, addr=a) for r, a in zip(self.engine_layout.regions, addrs, strict=True)))
        self.lost = None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def fileno(self) -> int:
        """The channel's fd (readable only when the child has gone); -1 when none."""
        return -1 if self._sock is None else self._sock.fileno()

    def _kill(self) -> None:
        proc, sock = self._proc, self._sock
        if proc is not None and proc.poll() is None:
            proc.kill()
        if proc is not None:
            try:
                proc.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                log.error("%s: data-plane child %d did not exit after SIGKILL", self.name,
                          proc.pid)
        if sock is not None:
            sock.close()

    def _mark_lost(self, why: str) -> None:
        if self.lost is not None:
            return
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
        rc = None
        if proc is not None:
            try:
                rc = proc.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                pass
        if rc is not None and rc < 0:
            try:
                sig = signal.Signals(-rc).name
            except ValueError:
                sig = str(-rc)
            why = f"{why}; the child died of {sig}"
        elif rc is not None:
            why = f"{why}; the child exited with status {rc}"
        self.lost = why
        self._links.clear()
        self._live.clear()
        self._states.clear()

    def check(self) -> str | None:
        """Whether the child is gone (called when its channel is readable); why, if so."""
        if self.lost is None and self._sock is not None:
            try:
                data = self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except BlockingIOError:
                return None
            except OSError as exc:
                self._mark_lost(f"data-plane channel failed: {exc}")
                return self.lost
            self._mark_lost("data-plane child closed its channel" if not data
                            else "data-plane child sent an unasked frame")
        return self.lost

    def restart(self) -> None:
        """A new child, its memory registered again (same name, new NIXL metadata); peers
        must handshake again. Raises if it cannot start (the caller retries)."""
        if self._closed:
            return
        self._kill()
        self._proc = self._sock = None
        self.restarts += 1
        self._start()

    def _call(self, op: str, *args: Any) -> Any:
        if self.lost is not None or self._sock is None:
            raise DataPlaneLost(f"data plane lost: {self.lost}")
        try:
            _send_frame(self._sock, (op, *args))
            (status, value), _ = _recv_frame(self._sock)
        except (OSError, EOFError, pickle.UnpicklingError) as exc:
            self._mark_lost(f"data-plane child did not answer {op}: {exc!r}")
            raise DataPlaneLost(f"data plane lost: {self.lost}") from exc
        if status == "ok":
            return value
        kind, text = value
        cls = {"PeerUnavailable": PeerUnavailable}.get(kind, TransferFailed)
        raise cls(text)

    # -- Agent's interface -------------------------------------------------------------------
    def metadata(self) -> bytes:
        data: bytes = self._metadata
        return data

    def add_peer(self, metadata: bytes, layout: KVLayout, name: str = "") -> str:
        name, link = self._call("add_peer", metadata, layout, name)
        self._links[name] = link
        return str(name)

    def link(self, peer: str) -> Link:
        link = self._links.get(peer)
        if link is None:
            raise PeerUnavailable(f"no connection to {peer!r}")
        return link

    def remove_peer(self, name: str) -> None:
        self._links.pop(name, None)
        if self.lost is None:
            try:
                self._call("remove_peer", name)
            except DataPlaneLost:
                pass

    def has_peer(self, name: str) -> bool:
        return name in self._links

    def post(self, op: str, peer: str, local_idx: np.ndarray, remote_idx: np.ndarray,
             notif: bytes, runs: np.ndarray | None = None,
             regions: tuple[int, int] | None = None) -> Any:
        self.last_explicit = False
        if self.lost is not None:
            raise DataPlaneLost(f"data plane lost: {self.lost}")
        if peer not in self._links:
            raise PeerUnavailable(f"no connection to {peer!r}")
        try:
            hid, state, self.last_explicit = self._call("post", op, peer, local_idx,
                                                        remote_idx, notif, runs, regions)
        except DataPlaneLost:
            return _Lost()  # the child may have posted it before dying: not fenced
        self._live.add(hid)
        self._states[hid] = state  # the endpoint asks at once (UCX often ends it inside)
        return hid

    def state(self, handle: Any) -> XferState:
        if isinstance(handle, _Lost) or self.lost is not None:
            return XferState.IN_PROGRESS
        state = self._states.pop(handle, None)
        if state is None:
            # Ask for the live handles with no state kept, and keep the answers beside the
            # others: an ended state the child reported (and released the transfer at) is
            # the only word on it -- asked again, the child knows no such handle, which
            # read as ERROR (a spurious FAILED of a transfer that was done).
            try:
                self._states.update(self._call(
                    "states", sorted(h for h in self._live if h not in self._states)))
            except DataPlaneLost:
                return XferState.IN_PROGRESS
            state = self._states.pop(handle, XferState.ERROR.value)
        if state != XferState.IN_PROGRESS.value:
            self._live.discard(handle)  # ended: the child has released it
        return XferState(state)

    def release(self, handle: Any) -> bool:
        if isinstance(handle, _Lost) or self.lost is not None:
            return True  # nothing left to release; the transfer reads as not fenced
        self._states.pop(handle, None)
        if handle not in self._live:
            return True  # the child released it when it saw it end
        try:
            released = bool(self._call("release", handle))
        except DataPlaneLost:
            return True
        if released:
            self._live.discard(handle)
        return released

    def notifications(self) -> dict[str, list[bytes]]:
        if self.lost is not None:
            return {}
        try:
            notifs: dict[str, list[bytes]] = self._call("notifications")
        except DataPlaneLost:
            return {}
        return notifs

    def send_notification(self, peer: str, message: bytes) -> None:
        self._call("send_notification", peer, message)

    def __getattr__(self, name: str) -> Any:
        """Any other public :class:`~kvpush.agent.Agent` method, run in the child (its
        arguments and result pickled; transfer handles are only those :meth:`post`
        returns)."""
        if name.startswith("_") or not callable(getattr(Agent, name, None)):
            raise AttributeError(name)

        def call(*args: Any) -> Any:
            return self._call("method", name, args)

        return call

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.lost is None and self._sock is not None:
            try:
                self._call("close")
            except KvpushError as exc:
                log.warning("%s: closing the data-plane child: %s", self.name, exc)
        proc = self._proc
        if proc is not None and proc.poll() is None:
            try:
                proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                log.warning("%s: data-plane child did not exit; killing it", self.name)
        self._kill()
        self._proc = self._sock = None


def _has_fileno(stream: Any) -> bool:
    try:
        stream.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    return True


def make_agent(name: str, layout: KVLayout, config: TransportConfig) -> Agent | ChildAgent:
    """The endpoint's agent: in process, or in a data-plane child (``config.data_plane``)."""
    if config.data_plane == "child":
        return ChildAgent(name, layout, config)
    return Agent(name, layout, config)


# -- the child -------------------------------------------------------------------------------
def _state(agent: Agent, handles: dict[int, Any], hid: int) -> str:
    """A transfer's state; one that ended is released here (the parent knows)."""
    handle = handles.get(hid)
    if handle is None:
        return XferState.ERROR.value
    state = agent.state(handle)
    if state is not XferState.IN_PROGRESS:
        agent.release(handle)
        del handles[hid]
    return state.value


def _serve(sock: socket.socket) -> None:
    (op, name, layout, config, regions, index), fds = _recv_frame(sock, with_fds=64)
    assert op == "init"
    maps = []
    try:
        sizes: dict[int, int] = {}
        for (offset, length), i in zip(regions, index, strict=True):
            sizes[i] = max(sizes.get(i, 0), offset + length)
        bases = {}
        for i, size in sizes.items():
            mm = mmap.mmap(fds[i], size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            maps.append(mm)
            bases[i] = np.frombuffer(mm, dtype=np.uint8, count=1).ctypes.data
        for fd in fds:
            os.close(fd)
        addrs = [bases[i] + offset for (offset, _), i in zip(regions, index, strict=True)]
        local = replace(layout, regions=tuple(
            replace(r, addr=a) for r, a in zip(layout.regions, addrs, strict=True)))
        agent = Agent(name, local, replace(config, data_plane="inprocess"))
    except Exception as exc:
        _send_frame(sock, ("err", (type(exc).__name__, str(exc))))
        return
    _send_frame(sock, ("ok", (addrs, agent.metadata())))
    handles: dict[int, Any] = {}
    ids = iter(range(1, 1 << 62))
    while True:
        try:
            (op, *args), _ = _recv_frame(sock)
        except (EOFError, OSError):
            # The engine died (or dropped the channel without a close): go as it went, at
            # once, as an engine dying with its agent in process does -- not with a tidy
            # NIXL close (handles released, every peer's endpoint closed in flush mode).
            os._exit(0)
        try:
            if op == "post":
                hid = next(ids)
                handles[hid] = agent.post(*args)
                value: Any = (hid, _state(agent, handles, hid), agent.last_explicit)
            elif op == "states":
                value = {hid: _state(agent, handles, hid) for hid in args[0]}
            elif op == "release":
                value = agent.release(handles[args[0]])
                if value:
                    del handles[args[0]]
            elif op == "notifications":
                value = agent.notifications()
            elif op == "add_peer":
                peer = agent.add_peer(*args)
                value = (peer, agent.link(peer))
            elif op == "remove_peer":
                agent.remove_peer(*args)
                value = None
            elif op == "send_notification":
                agent.send_notification(*args)
                value = None
            elif op == "method":  # ChildAgent.__getattr__: another Agent method
                name, margs = args
                if name.startswith("_") or not callable(getattr(Agent, name, None)):
                    raise TransferFailed(f"Agent has no method {name!r}")
                value = getattr(agent, name)(*margs)
            elif op == "close":
                for handle in handles.values():
                    agent.release(handle)
                agent.close()
                _send_frame(sock, ("ok", None))
                return
            else:
                raise TransferFailed(f"unknown data-plane call {op!r}")
            reply: tuple[str, Any] = ("ok", value)
        except Exception as exc:
            reply = ("err", (type(exc).__name__, str(exc)))
        try:
            _send_frame(sock, reply)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:  # not picklable
            _send_frame(sock, ("err", ("TransferFailed", f"{op}: answer not picklable: "
                                                         f"{exc}")))


def _child_main(argv: list[str]) -> int:
    # Ctrl-C in the engine's terminal reaches the whole process group: the engine decides.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=int(argv[0]))
    try:
        _serve(sock)
    finally:
        sock.close()
    return 0
