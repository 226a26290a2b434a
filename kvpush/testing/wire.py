"""ZeroMQ's ROUTER and DEALER sockets in memory, for a :class:`~kvpush.driver.Driver` run
without its thread (:class:`~kvpush.driver.LoopIO`): the production loop, sessions and cores
over a network a test or the simulator controls frame by frame.

What it keeps of ZeroMQ, because the sessions rely on it: a DEALER's frames reach the ROUTER
bound at its address in order, each as one message; the ROUTER sees them under the DEALER's
``IDENTITY``, a later connection under the same identity takes it over
(``ROUTER_HANDOVER``), and a send to an identity not connected raises ``EHOSTUNREACH``
(``ROUTER_MANDATORY``); a DEALER whose address has nothing bound keeps its frames until
something binds there (a restarted producer), and reconnects to whatever is bound there now.
A send past the high-water mark raises ``zmq.Again``: a DEALER's when the ROUTER holds that
many of its frames unread (or, with nothing bound at its address, it keeps that many), a
ROUTER's when the DEALER holds that many unread (without ``ROUTER_MANDATORY`` the frame is
dropped) -- the socket's ``SNDHWM`` (0: none), or
:attr:`Network.hwm` when set (a small one makes a stalled reader's peers meet it).
What it leaves to :class:`Network.carry`: when (and whether, and how often) a frame arrives.
By default every frame arrives at once; the simulator delays, drops and duplicates them. A
frame in flight to a socket closed meanwhile is lost, as a frame queued in a closed ZeroMQ
socket is.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from typing import Any

import zmq

__all__ = ["Context", "Frame", "Network", "Socket"]


class Frame:
    """A received frame: ``bytes``, ``buffer`` and ``len()`` like :class:`zmq.Frame`."""

    __slots__ = ("bytes",)

    def __init__(self, data: bytes) -> None:
        self.bytes = data

    @property
    def buffer(self) -> memoryview:
        return memoryview(self.bytes)

    def __len__(self) -> int:
        return len(self.bytes)


class Network:
    """Where sockets bind and connect. ``hosts`` maps other spellings of a host (a name and
    its IP) to one; a ROUTER bound to ``0.0.0.0`` is reached at its context's host."""

    def __init__(self) -> None:
        self.bound: dict[str, Socket] = {}          # canonical "tcp://host:port" -> ROUTER
        self.hosts: dict[str, str] = {}
        self._waiting: list[Socket] = []            # DEALERs whose address has no ROUTER
        self._ports = 40000
        #: every socket's high-water mark, when set (None: each socket's own ``SNDHWM``)
        self.hwm: int | None = None

    def canonical(self, address: str, host: str = "") -> str:
        scheme, _, rest = address.partition("://")
        name, _, port = rest.rpartition(":")
        if name in ("0.0.0.0", "*") and host:
            name = host
        return f"{scheme}://{self.hosts.get(name, name)}:{port}"

    def carry(self, src: Socket, dst: Socket, frames: list[bytes],
              arrive: Callable[[], None]) -> None:
        """Deliver one message: call ``arrive`` when it arrives (here: at once). Override
        to delay it, drop it (never call it) or duplicate it (call it twice)."""
        arrive()

    # -- used by the sockets -----------------------------------------------------------
    def _bind(self, sock: Socket, address: str) -> str:
        scheme, _, rest = address.partition("://")
        name, _, port = rest.rpartition(":")
        if port in ("*", "0"):
            self._ports += 1
            port = str(self._ports)
        where = self.canonical(f"{scheme}://{name}:{port}", sock.ctx.host)
        if where in self.bound:
            raise zmq.ZMQError(zmq.EADDRINUSE, f"{where} is bound already")
        self.bound[where] = sock
        for dealer in list(self._waiting):
            if dealer.closed:
                self._waiting.remove(dealer)
            elif self.canonical(dealer.address) == where:
                self._waiting.remove(dealer)
                dealer._attach(sock)
        return f"{scheme}://{name}:{port}"

    def _router_at(self, address: str) -> Socket | None:
        router = self.bound.get(self.canonical(address))
        return None if router is None or router.closed else router

    def _wait_for(self, dealer: Socket) -> None:
        if dealer not in self._waiting:
            self._waiting.append(dealer)

    def _unbind(self, sock: Socket) -> None:
        for where in [w for w, s in self.bound.items() if s is sock]:
            del self.bound[where]


class Context:
    """A socket factory on one host of a :class:`Network`. ``on_frame`` is called each
    time a frame lands in one of its sockets (the owner steps its driver then);
    ``identify``, when given, names each DEALER as it connects, in place of the
    ``IDENTITY`` it was given (a test that wants readable identities)."""

    def __init__(self, net: Network, host: str = "127.0.0.1",
                 on_frame: Callable[[], None] | None = None,
                 identify: Callable[[Socket], bytes] | None = None) -> None:
        self.net = net
        self.host = host
        self.on_frame: Callable[[], None] = on_frame or (lambda: None)
        self.identify = identify
        self.sockets: list[Socket] = []

    def socket(self, kind: int) -> Socket:
        if kind not in (zmq.ROUTER, zmq.DEALER):
            raise ValueError(f"only ROUTER and DEALER sockets, got {kind}")
        sock = Socket(self, kind)
        self.sockets = [s for s in self.sockets if not s.closed]
        self.sockets.append(sock)
        return sock

    def destroy(self, linger: int = 0) -> None:
        for sock in self.sockets:
            sock.close(linger)


class Socket:
    """A ROUTER or a DEALER (see the module for what it keeps of ZeroMQ)."""

    def __init__(self, ctx: Context, kind: int) -> None:
        self.ctx = ctx
        self.kind = kind
        self.closed = False
        self.options: dict[int, Any] = {}
        self.inbox: deque[list[bytes]] = deque()
        self.address = ""                     # DEALER: where it connected; ROUTER: bound
        self.peers: dict[bytes, Socket] = {}  # ROUTER: connected DEALERs by identity
        self._router: Socket | None = None    # DEALER: the ROUTER it reaches now
        self._held: list[bytes] = []          # DEALER: frames waiting for a ROUTER
        self._named: bytes | None = None      # DEALER: the context's name for it
        self._unread: Counter[bytes] = Counter()  # ROUTER: frames in the inbox, by sender

    # -- options -----------------------------------------------------------------------
    def setsockopt(self, option: int, value: Any) -> None:
        self.options[option] = value

    def getsockopt(self, option: int) -> Any:
        if option == zmq.EVENTS:
            return zmq.POLLIN if self.inbox else 0
        return self.options.get(option, 0)

    def getsockopt_string(self, option: int) -> str:
        if option == zmq.LAST_ENDPOINT:
            return self.address
        return str(self.options.get(option, ""))

    @property
    def identity(self) -> bytes:
        if self._named is not None:
            return self._named
        value = self.options.get(zmq.IDENTITY, b"")
        return value if isinstance(value, bytes) else str(value).encode()

    # -- connections -------------------------------------------------------------------
    def bind(self, address: str) -> None:
        if self.kind != zmq.ROUTER:
            raise ValueError("only a ROUTER binds here")
        self.address = self.ctx.net._bind(self, address)

    def connect(self, address: str) -> None:
        if self.kind != zmq.DEALER:
            raise ValueError("only a DEALER connects here")
        self.address = address
        if self.ctx.identify is not None:
            self._named = self.ctx.identify(self)
        router = self.ctx.net._router_at(address)
        if router is None:
            self.ctx.net._wait_for(self)
        else:
            self._attach(router)

    def _attach(self, router: Socket) -> None:
        self._router = router
        router.peers[self.identity] = self     # a reconnection under it takes it over
        held, self._held = self._held, []
        for frame in held:
            self._carry(router, [self.identity, frame])

    def _reach(self) -> Socket | None:
        """The ROUTER bound at this DEALER's address now (reconnecting if it changed)."""
        router = self.ctx.net._router_at(self.address)
        if router is None:
            self._router = None
            self.ctx.net._wait_for(self)
        elif router is not self._router:
            self._attach(router)
        return router

    # -- frames ------------------------------------------------------------------------
    def would_take(self, identity: bytes | None = None) -> bool:
        """Whether a send now would be taken (``identity``: a ROUTER's peer): the peer is
        reachable and below the high-water mark."""
        if self.closed:
            return False
        if self.kind == zmq.DEALER:
            router = self.ctx.net._router_at(self.address)
            if router is None:
                return not self._at_hwm(len(self._held))
            return not self._at_hwm(router._unread[self.identity])
        dealer = self._dealer(identity or b"")
        return dealer is not None and not self._at_hwm(len(dealer.inbox))

    def _dealer(self, identity: bytes) -> Socket | None:
        """ROUTER: the DEALER connected under ``identity`` now (None: not connected)."""
        dealer = self.peers.get(identity)
        if dealer is None or dealer.closed or dealer._router is not self:
            return None
        return dealer

    def _full(self, queued: int, flags: int) -> None:
        """Raise ``zmq.Again`` for a send that finds ``queued`` frames waiting at the
        high-water mark (a blocking send would wait; nothing here may block)."""
        if self._at_hwm(queued):
            if not flags & zmq.NOBLOCK:
                raise RuntimeError("a blocking send at the high-water mark would wait forever")
            raise zmq.Again()

    def _at_hwm(self, queued: int) -> bool:
        hwm = self.ctx.net.hwm
        limit = int(self.options.get(zmq.SNDHWM, 0)) if hwm is None else hwm
        return bool(limit) and queued >= limit

    def send(self, frame: bytes, flags: int = 0) -> None:
        if self.closed:
            raise zmq.ZMQError(zmq.ENOTSOCK, "socket closed")
        if self.kind != zmq.DEALER:
            raise ValueError("a ROUTER sends with send_multipart([identity, frame])")
        router = self._reach()
        if router is None:
            self._full(len(self._held), flags)
            self._held.append(bytes(frame))
            return
        self._full(router._unread[self.identity], flags)
        self._carry(router, [self.identity, bytes(frame)])

    def send_multipart(self, frames: list[bytes], flags: int = 0) -> None:
        if self.closed:
            raise zmq.ZMQError(zmq.ENOTSOCK, "socket closed")
        if self.kind != zmq.ROUTER or len(frames) != 2:
            raise ValueError("a ROUTER sends [identity, frame]")
        identity, frame = bytes(frames[0]), bytes(frames[1])
        dealer = self._dealer(identity)
        if dealer is None:
            self.peers.pop(identity, None)
            if self.options.get(zmq.ROUTER_MANDATORY):
                raise zmq.ZMQError(zmq.EHOSTUNREACH, "host unreachable")
            return
        if self.options.get(zmq.ROUTER_MANDATORY):
            self._full(len(dealer.inbox), flags)
        elif self._at_hwm(len(dealer.inbox)):
            return  # without ROUTER_MANDATORY, ZeroMQ drops it
        self._carry(dealer, [frame])

    def _carry(self, dst: Socket, frames: list[bytes]) -> None:
        def arrive() -> None:
            if dst.closed:
                return  # lost with the socket it was queued in
            dst.inbox.append(frames)
            if dst.kind == zmq.ROUTER:
                dst._unread[frames[0]] += 1
            dst.ctx.on_frame()
        self.ctx.net.carry(self, dst, frames, arrive)

    def recv_multipart(self, flags: int = 0, copy: bool = True) -> list[Any]:
        if self.closed:
            raise zmq.ZMQError(zmq.ENOTSOCK, "socket closed")
        if not self.inbox:
            raise zmq.Again()
        frames = self.inbox.popleft()
        if self.kind == zmq.ROUTER:
            left = self._unread[frames[0]] - 1
            if left > 0:
                self._unread[frames[0]] = left
            else:
                del self._unread[frames[0]]
        return [Frame(f) for f in frames] if not copy else list(frames)

    def close(self, linger: int | None = None) -> None:
        if self.closed:
            return
        self.closed = True
        self.inbox.clear()
        self._unread.clear()
        if self.kind == zmq.ROUTER:
            self.ctx.net._unbind(self)
            for dealer in self.peers.values():   # they reconnect to what binds here next
                if not dealer.closed and dealer._router is self:
                    dealer._router = None
                    self.ctx.net._wait_for(dealer)
            self.peers.clear()
        elif self._router is not None and self._router.peers.get(self.identity) is self:
            del self._router.peers[self.identity]
