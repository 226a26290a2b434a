"""Control frames over TCP connections that the caller's thread reads and writes itself.

ZeroMQ moves every frame through an I/O thread on each side: a send wakes the sender's I/O
thread, which writes the bytes; a receive wakes the receiver's I/O thread, which reads them
and wakes the receiving thread. For an isolated frame that is two thread wake-ups per frame
on top of the two the frame needs anyway (``benchmarks.control_frames``). This module gives
the driver and the sessions the part of ZeroMQ's ROUTER and DEALER sockets they use, with
the bytes written by the sending call and read by the receiving call, on the loop thread:
no thread of its own.

What it keeps of ZeroMQ's behaviour, because the sessions rely on it:

* a DEALER connects in the background and reconnects every :data:`RECONNECT_S` after its
  connection is lost or refused; frames sent meanwhile wait (up to ``SNDHWM``) and leave
  once it is connected; a frame cut by a lost connection is lost, as over any network;
* a ROUTER routes by the identity each DEALER sends when it connects; a second connection
  under an identity takes it over (``ROUTER_HANDOVER``); a frame to an identity not
  connected raises ``EHOSTUNREACH`` (``ROUTER_MANDATORY``), one past the high-water mark
  ``zmq.Again``;
* a frame longer than ``MAXMSGSIZE`` ends its connection unread;
* ``fileno()`` is readable while something waits to be done (frames to read, a connection
  to accept or finish, queued bytes the kernel can take, a reconnect due), so a
  ``zmq.Poller`` waits on it beside ZeroMQ sockets and eventfds; ``recv_multipart`` and
  ``getsockopt(EVENTS)`` do that work.

The wire: each side opens with :data:`GREETING` and its identity (one length byte), then
frames, each a 4-byte big-endian length and its bytes. A peer that opens otherwise (a
ZeroMQ socket's greeting, say) is disconnected, and that is logged. Nothing here is
encrypted or authenticated: the sessions seal what they send (:mod:`kvpush.auth`).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
import select
import socket
import time
from collections import deque
from typing import Any

import zmq

__all__ = ["GREETING", "RECONNECT_S", "Context", "Frame", "Socket"]

log = logging.getLogger("kvpush.stream")

#: What each side sends first (then one byte: its identity's length, then the identity).
#: ZeroMQ's greeting starts with 0xFF, so the two are told apart at the first byte.
GREETING = b"\x00kvpush-stream\x01"
#: A DEALER tries its address again this long after a connection ended or was refused.
RECONNECT_S = 0.1
#: Bytes read from a connection per readable event; more wait in the kernel's buffer, where
#: TCP holds back a peer the reader does not keep up with.
READ_CHUNK = 1 << 18
#: Bytes a connection queues before a send raises ``zmq.Again`` (a frame to a connection
#: with nothing queued is taken whatever its size), beside ``SNDHWM``'s count of frames.
QUEUE_BYTES = 64 << 20
#: The most frames one sendmsg(2) writes (the kernel's IOV_MAX is 1024).
WRITE_BATCH = 64
_HEADER = 4
_MAX_IDENTITY = 255

_EPOLLIN = select.EPOLLIN
_EPOLLOUT = select.EPOLLOUT
_GONE = select.EPOLLERR | select.EPOLLHUP


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


class _Itimerspec(ctypes.Structure):
    _fields_ = [("interval_s", ctypes.c_long), ("interval_ns", ctypes.c_long),
                ("value_s", ctypes.c_long), ("value_ns", ctypes.c_long)]


@functools.cache
def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.timerfd_create.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.timerfd_create.restype = ctypes.c_int
    libc.timerfd_settime.argtypes = [ctypes.c_int, ctypes.c_int,
                                     ctypes.POINTER(_Itimerspec), ctypes.c_void_p]
    libc.timerfd_settime.restype = ctypes.c_int
    return libc


def _timerfd() -> int:
    """A monotonic timerfd (Python 3.11's ``os`` has none), non-blocking, close-on-exec."""
    fd = int(_libc().timerfd_create(time.CLOCK_MONOTONIC, os.O_NONBLOCK | os.O_CLOEXEC))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"timerfd_create: {os.strerror(err)}")
    return fd


def _arm(fd: int, delay: float) -> None:
    delay = max(delay, 1e-6)
    spec = _Itimerspec(0, 0, int(delay), int(delay % 1 * 1e9))
    if _libc().timerfd_settime(fd, 0, ctypes.byref(spec), None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"timerfd_settime: {os.strerror(err)}")


def parse_address(address: str) -> tuple[str, int]:
    """``tcp://host:port`` as (host, port); ``*`` is every interface, ``[v6]`` a v6 one."""
    if not address.startswith("tcp://"):
        raise zmq.ZMQError(errno.EPROTONOSUPPORT,
                           f"only tcp:// addresses carry control frames, got {address!r}")
    host, sep, port = address[len("tcp://"):].rpartition(":")
    if not sep or not host or (not port.isdigit() and port != "*"):
        raise zmq.ZMQError(errno.EINVAL, f"not a tcp://host:port address: {address!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return ("0.0.0.0" if host == "*" else host), (0 if port == "*" else int(port))


def _family(host: str) -> socket.AddressFamily:
    """IPv4 unless the host is a v6 literal: a name resolves to its v4 address, as ZeroMQ's
    sockets do by default (``localhost`` is 127.0.0.1 on both sides, never ::1 on one)."""
    return socket.AF_INET6 if ":" in host else socket.AF_INET


class _Conn:
    """One TCP connection: what it has sent that is not read yet, and what waits to go
    (whole frames, each with its header; ``sent`` bytes of the first are gone already)."""

    __slots__ = (
        "connecting",
        "fd",
        "greeted",
        "identity",
        "out",
        "peer",
        "queued",
        "rbuf",
        "sent",
        "sock",
        "watching",
    )

    def __init__(self, sock: socket.socket | None, peer: str) -> None:
        self.sock = sock
        self.fd = -1 if sock is None else sock.fileno()
        self.rbuf = bytearray()
        self.out: deque[bytes] = deque()
        self.sent = 0
        self.queued = 0                      # bytes in ``out`` not sent yet
        self.identity: bytes | None = None   # the peer's, once its greeting came
        self.greeted = False
        self.connecting = False
        self.watching = 0                    # the epoll events registered
        self.peer = peer


class Socket:
    """A ROUTER or a DEALER (see the module) for one thread: not thread-safe, as a ZeroMQ
    socket is not."""

    def __init__(self, context: Context, kind: int) -> None:
        if kind not in (zmq.ROUTER, zmq.DEALER):
            raise zmq.ZMQError(errno.EINVAL, "a kvpush stream socket is a ROUTER or a DEALER")
        self._context = context
        self.kind = kind
        self.closed = False
        self._ep = select.epoll()
        self._ready = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)  # frames wait here
        self._ready_set = False
        self._pumped = False            # the inbox was filled by a look at the connections
        self._ep.register(self._ready, _EPOLLIN)
        self._scratch = bytearray(READ_CHUNK)
        self._inbox: deque[tuple[bytes | None, bytes]] = deque()
        self._conns: dict[int, _Conn] = {}
        self._routes: dict[bytes, _Conn] = {}            # ROUTER: greeted, by identity
        self._listener: socket.socket | None = None
        self._endpoint = ""
        self._target: str | None = None                  # DEALER: the address it dials
        self._pipe: _Conn | None = None                  # DEALER: frames and connection
        self._timer = -1                                 # DEALER: when to dial again
        self._warned: set[str] = set()
        self._identity = b""
        self._hwm = 1000
        self._max_frame = -1
        self._tcp: dict[tuple[int, int], int] = {}        # socket options per connection
        context._sockets.add(self)

    # -- what ZeroMQ's socket offers, the part kvpush uses -------------------------------
    def fileno(self) -> int:
        return self._ep.fileno()

    def setsockopt(self, option: int, value: int | bytes) -> None:
        if option == zmq.IDENTITY:
            assert isinstance(value, bytes)
            if not 0 < len(value) <= _MAX_IDENTITY:
                raise zmq.ZMQError(errno.EINVAL, "an identity is 1 to 255 bytes")
            self._identity = value
        elif option == zmq.SNDHWM:
            self._hwm = int(value) or 1 << 62
        elif option == zmq.MAXMSGSIZE:
            self._max_frame = int(value)
        elif option == zmq.TCP_KEEPALIVE:
            self._tcp[(socket.SOL_SOCKET, socket.SO_KEEPALIVE)] = int(value)
        elif option == zmq.TCP_KEEPALIVE_IDLE:
            self._tcp[(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE)] = int(value)
        elif option == zmq.TCP_KEEPALIVE_INTVL:
            self._tcp[(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL)] = int(value)
        elif option == zmq.TCP_KEEPALIVE_CNT:
            self._tcp[(socket.IPPROTO_TCP, socket.TCP_KEEPCNT)] = int(value)
        elif option == zmq.TCP_MAXRT:  # ms: the kernel's user timeout
            self._tcp[(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)] = int(value)
        elif option in (zmq.LINGER, zmq.RCVHWM, zmq.ROUTER_HANDOVER, zmq.ROUTER_MANDATORY):
            pass  # closing never lingers; reads are bounded by TCP; both ROUTER modes hold
        else:
            raise zmq.ZMQError(errno.EINVAL, f"socket option {option} is not supported here")

    def getsockopt(self, option: int) -> Any:
        if option == zmq.IDENTITY:
            return self._identity
        if option == zmq.EVENTS:
            return zmq.POLLIN if self._settle() else 0
        raise zmq.ZMQError(errno.EINVAL, f"socket option {option} is not readable here")

    def getsockopt_bytes(self, option: int) -> bytes:
        if option == zmq.IDENTITY:
            return self._identity
        raise zmq.ZMQError(errno.EINVAL, f"socket option {option} is not readable here")

    def getsockopt_string(self, option: int) -> str:
        if option == zmq.LAST_ENDPOINT:
            return self._endpoint
        raise zmq.ZMQError(errno.EINVAL, f"socket option {option} is not readable here")

    def bind(self, address: str) -> None:
        if self.kind != zmq.ROUTER or self._listener is not None:
            raise zmq.ZMQError(errno.EINVAL, "only a ROUTER binds, once")
        host, port = parse_address(address)
        try:
            info = socket.getaddrinfo(host, port, _family(host), socket.SOCK_STREAM,
                                      flags=socket.AI_PASSIVE)[0]
            listener = socket.socket(info[0], socket.SOCK_STREAM)
            try:
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener.bind(info[4])
                listener.listen(128)
            except OSError:
                listener.close()
                raise
        except OSError as exc:
            raise zmq.ZMQError(exc.errno or errno.EADDRNOTAVAIL,
                               f"cannot listen on {address}: {exc}") from exc
        listener.setblocking(False)
        self._listener = listener
        bound = listener.getsockname()
        shown = f"[{bound[0]}]" if listener.family == socket.AF_INET6 else bound[0]
        self._endpoint = f"tcp://{shown}:{bound[1]}"
        self._ep.register(listener.fileno(), _EPOLLIN)

    def bind_to_random_port(self, address: str) -> int:
        """Bind ``address`` (``tcp://host``) to a port the kernel picks; returns it."""
        self.bind(f"{address}:0")
        return int(self._endpoint.rsplit(":", 1)[1])

    def connect(self, address: str) -> None:
        if self.kind != zmq.DEALER or self._target is not None:
            raise zmq.ZMQError(errno.EINVAL, "only a DEALER connects, once")
        parse_address(address)
        self._target = address
        self._pipe = _Conn(None, address)
        self._timer = _timerfd()
        self._ep.register(self._timer, _EPOLLIN)
        self._dial()

    def send(self, frame: bytes, flags: int = 0, copy: bool = True,
             track: bool = False) -> None:
        """Queue ``frame`` (a DEALER's); never blocks: past ``SNDHWM`` raises
        ``zmq.Again``, whatever ``flags`` (``copy`` and ``track`` are ZeroMQ's, ignored)."""
        if self.kind != zmq.DEALER or self._pipe is None:
            raise zmq.ZMQError(errno.ENOTSUP, "send() is a connected DEALER's")
        self._queue(self._pipe, frame)

    def send_multipart(self, frames: list[bytes], flags: int = 0, copy: bool = True,
                       track: bool = False) -> None:
        if self.kind == zmq.DEALER:
            if len(frames) != 1:
                raise zmq.ZMQError(errno.EINVAL, "a DEALER sends one frame per message")
            self.send(frames[0], flags)
            return
        if len(frames) != 2:
            raise zmq.ZMQError(errno.EINVAL, "a ROUTER sends [identity, frame]")
        conn = self._routes.get(bytes(frames[0]))
        if conn is None:
            raise zmq.ZMQError(errno.EHOSTUNREACH, "no connection has that identity")
        self._queue(conn, frames[1])

    def poll(self, timeout: int | None = None, flags: int = zmq.POLLIN) -> int:
        """Wait up to ``timeout`` ms (None or negative: no limit) for a frame to read:
        ``zmq.POLLIN`` when one came, else 0 (as ZeroMQ's ``Socket.poll``)."""
        if not flags & zmq.POLLIN:
            raise zmq.ZMQError(errno.EINVAL, "a kvpush stream socket polls for POLLIN only")
        deadline = None if timeout is None or timeout < 0 else time.monotonic() + timeout / 1e3
        waiter = select.poll()
        waiter.register(self.fileno(), select.POLLIN)
        while not self._settle():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return 0
            waiter.poll(None if left is None else max(left * 1e3, 1.0))
        return zmq.POLLIN

    def recv(self, flags: int = 0, copy: bool = True) -> Any:
        """A DEALER's next frame (without ``zmq.NOBLOCK``: waits for it)."""
        if self.kind != zmq.DEALER:
            raise zmq.ZMQError(errno.ENOTSUP, "recv() is a DEALER's; a ROUTER's frames come "
                               "with their identity (recv_multipart)")
        return self.recv_multipart(flags, copy)[0]

    def recv_multipart(self, flags: int = 0, copy: bool = True) -> list[Any]:
        if not self._inbox and flags & zmq.NOBLOCK and self._pumped:
            # Everything the last look found is read: say so without another look (what
            # came since keeps fileno() readable, so a poller brings the caller back).
            self._pumped = False
            self._unready()
            raise zmq.Again()
        if not self._settle():
            if flags & zmq.NOBLOCK:
                raise zmq.Again()
            self.poll(None)
        identity, data = self._inbox.popleft()
        if self._inbox and not self._ready_set:
            self._ready_set = True   # the poller wakes for what is left
            os.eventfd_write(self._ready, 1)
        if copy:
            return [data] if identity is None else [identity, data]
        return [Frame(data)] if identity is None else [Frame(identity), Frame(data)]

    def close(self, linger: int | None = None) -> None:
        if self.closed:
            return
        self.closed = True
        for conn in list(self._conns.values()):
            self._drop(conn, None)
        if self._listener is not None:
            self._listener.close()
        for fd in (self._timer, self._ready):
            if fd >= 0:
                os.close(fd)
        self._ep.close()
        self._inbox.clear()
        self._context._sockets.discard(self)

    def _settle(self) -> bool:
        """Whether a frame waits, after doing what the poller woke for; the inbox's eventfd
        is reset once nothing waits, so a poller does not wake for it again."""
        if not self._inbox:
            self._pump()
            self._pumped = bool(self._inbox)
            if not self._inbox:
                self._unready()
        return bool(self._inbox)

    def _unready(self) -> None:
        if self._ready_set:
            self._ready_set = False
            os.eventfd_read(self._ready)

    # -- sending ---------------------------------------------------------------------------
    def _queue(self, conn: _Conn, frame: bytes) -> None:
        if self.closed:
            raise zmq.ZMQError(errno.ENOTSOCK, "socket closed")
        if conn.out or conn.connecting:
            # What the kernel can take now leaves first (a connection finished meanwhile,
            # room freed in its buffer), so a thread that only sends moves frames too.
            self._pump()
        if conn.out and (len(conn.out) >= self._hwm or conn.queued >= QUEUE_BYTES):
            raise zmq.Again()
        size = len(frame)
        conn.out.append(size.to_bytes(_HEADER, "big") + frame)
        conn.queued += _HEADER + size
        if conn.sock is not None and not conn.connecting and len(conn.out) == 1:
            self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        """Write what the kernel takes; watch for room when it takes less."""
        sock, out = conn.sock, conn.out
        assert sock is not None
        while out:
            if len(out) == 1 and not conn.sent:
                bufs: list[Any] = [out[0]]
            else:
                bufs = [memoryview(out[0])[conn.sent:]]
                bufs.extend(out[i] for i in range(1, min(len(out), WRITE_BATCH)))
            try:
                n = sock.sendmsg(bufs)
            except BlockingIOError:
                break
            except OSError as exc:
                self._drop(conn, f"write failed: {exc}")
                return
            conn.queued -= n
            n += conn.sent
            while out and n >= len(out[0]):
                n -= len(out.popleft())
            conn.sent = n
        self._watch(conn, _EPOLLIN | (_EPOLLOUT if out else 0))

    def _watch(self, conn: _Conn, events: int) -> None:
        if conn.watching != events:
            self._ep.modify(conn.fd, events)
            conn.watching = events

    # -- the events a poller woke the owner for --------------------------------------------
    def _pump(self) -> None:
        if self.closed:
            return
        for fd, events in self._ep.poll(0):
            if fd == self._ready:
                continue
            if fd == self._timer:
                try:
                    os.read(self._timer, 8)
                except BlockingIOError:
                    pass
                self._dial()
                continue
            if self._listener is not None and fd == self._listener.fileno():
                self._accept()
                continue
            conn = self._conns.get(fd)
            if conn is None:
                continue
            if conn.connecting:
                self._connected(conn)
                continue
            if events & (_EPOLLIN | _GONE):
                self._read(conn)
            if events & _EPOLLOUT and conn.sock is not None:
                self._flush(conn)

    def _accept(self) -> None:
        assert self._listener is not None
        for _ in range(64):
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of fds, say: the listener stays, the kernel queues
                log.warning("kvpush stream: cannot accept a connection on %s: %s",
                            self._endpoint, exc)
                return
            conn = self._attach(sock, f"{addr[0]}:{addr[1]}")
            greeting = self._greeting()
            conn.out.append(greeting)
            conn.queued += len(greeting)
            self._flush(conn)

    def _attach(self, sock: socket.socket, peer: str) -> _Conn:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for (level, option), value in self._tcp.items():
            try:
                sock.setsockopt(level, option, value)
            except OSError:  # an option this kernel lacks: ZeroMQ ignores it too
                pass
        conn = self._pipe if self._pipe is not None else _Conn(None, peer)
        conn.sock, conn.fd = sock, sock.fileno()
        conn.rbuf.clear()
        conn.greeted, conn.identity = False, None
        self._conns[conn.fd] = conn
        conn.watching = _EPOLLIN
        self._ep.register(conn.fd, _EPOLLIN)
        return conn

    def _greeting(self) -> bytes:
        return GREETING + bytes([len(self._identity)]) + self._identity

    def _dial(self) -> None:
        """A DEALER's (re)connection, in the background: finished by :meth:`_connected`."""
        pipe, target = self._pipe, self._target
        if self.closed or pipe is None or target is None or pipe.sock is not None:
            return
        host, port = parse_address(target)
        try:
            info = socket.getaddrinfo(host, port, _family(host), socket.SOCK_STREAM)[0]
            sock = socket.socket(info[0], socket.SOCK_STREAM)
        except OSError as exc:
            self._retry(f"cannot resolve {target}: {exc}")
            return
        sock.setblocking(False)
        err = sock.connect_ex(info[4])
        if err not in (0, errno.EINPROGRESS):
            sock.close()
            self._retry(f"cannot connect to {target}: {os.strerror(err)}")
            return
        conn = self._attach(sock, target)
        conn.connecting = True
        self._watch(conn, _EPOLLOUT)

    def _connected(self, conn: _Conn) -> None:
        assert conn.sock is not None
        err = conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            self._drop(conn, f"cannot connect: {os.strerror(err)}")
            return
        conn.connecting = False
        greeting = self._greeting()
        conn.out.appendleft(greeting)
        conn.queued += len(greeting)
        conn.sent = 0
        self._flush(conn)

    def _retry(self, why: str) -> None:
        if why not in self._warned:  # a peer that is down is tried every 100 ms: log once
            self._warned.add(why)
            log.debug("kvpush stream: %s; trying again every %g s", why, RECONNECT_S)
        if self._timer >= 0 and not self.closed:
            _arm(self._timer, RECONNECT_S)

    # -- receiving -------------------------------------------------------------------------
    def _read(self, conn: _Conn) -> None:
        assert conn.sock is not None
        try:
            n = conn.sock.recv_into(self._scratch)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._drop(conn, f"read failed: {exc}")
            return
        if not n:
            self._drop(conn, "closed by the peer")
            return
        buf = conn.rbuf
        buf += memoryview(self._scratch)[:n]
        pos = 0
        if not conn.greeted:
            pos = self._greeted(conn)
            if pos <= 0:
                return
        end = len(buf)
        limit = self._max_frame
        identity = conn.identity if self.kind == zmq.ROUTER else None
        inbox = self._inbox
        while end - pos >= _HEADER:
            size = int.from_bytes(buf[pos:pos + _HEADER], "big")
            if 0 <= limit < size:
                self._drop(conn, f"a frame of {size} bytes, over the limit of {limit}",
                           warn=True)
                return
            if end - pos - _HEADER < size:
                break
            with memoryview(buf) as view:
                inbox.append((identity, bytes(view[pos + _HEADER:pos + _HEADER + size])))
            pos += _HEADER + size
        del buf[:pos]

    def _greeted(self, conn: _Conn) -> int:
        """Read the peer's greeting from ``conn.rbuf``: the bytes it took (0: not all of it
        came yet; -1: the connection is dropped)."""
        buf = conn.rbuf
        head = len(GREETING)
        if bytes(buf[:head]) != GREETING[:min(len(buf), head)]:
            self._drop(conn, "the peer does not speak kvpush's control stream (a ZeroMQ "
                       "socket, or another program?)", warn=True)
            return -1
        if len(buf) <= head or len(buf) < head + 1 + buf[head]:
            return 0
        identity = bytes(buf[head + 1:head + 1 + buf[head]])
        conn.greeted = True
        if self.kind == zmq.ROUTER:
            if not identity:  # ZeroMQ's ROUTER names such a peer itself
                identity = b"\x00" + os.urandom(8)
            old = self._routes.get(identity)
            if old is not None and old is not conn:
                self._drop(old, "taken over by a new connection under its identity")
            conn.identity = identity
            self._routes[identity] = conn
        return head + 1 + buf[head]

    def _drop(self, conn: _Conn, why: str | None, *, warn: bool = False) -> None:
        """End ``conn``'s TCP connection. A ROUTER forgets it, with what waited for it; a
        DEALER keeps the frames not begun (the connection was cut under the one begun) and
        dials again after :data:`RECONNECT_S`."""
        if why is not None:
            if warn:
                log.warning("kvpush stream: %s (%s): %s", self._endpoint or self._target,
                            conn.peer, why)
            else:
                log.debug("kvpush stream: %s (%s): %s", self._endpoint or self._target,
                          conn.peer, why)
        if conn.sock is not None:
            self._conns.pop(conn.fd, None)
            try:
                self._ep.unregister(conn.fd)
            except (OSError, ValueError):
                pass
            conn.sock.close()
            conn.sock, conn.fd = None, -1
        conn.connecting = False
        conn.watching = 0
        conn.rbuf.clear()
        if conn is self._pipe:
            if conn.sent and conn.out:
                conn.queued -= len(conn.out.popleft()) - conn.sent
            conn.sent = 0
            if why is not None:
                self._retry(why)
            return
        if conn.identity is not None and self._routes.get(conn.identity) is conn:
            del self._routes[conn.identity]
        conn.out.clear()
        conn.queued = 0


class Context:
    """Makes :class:`Socket` objects; :meth:`destroy` closes those still open."""

    def __init__(self) -> None:
        self._sockets: set[Socket] = set()

    def socket(self, kind: int) -> Socket:
        return Socket(self, kind)

    def destroy(self, linger: int | None = None) -> None:
        for sock in list(self._sockets):
            sock.close()

    def term(self) -> None:
        self.destroy()
