"""Rigs that drive the sans-IO protocol cores by hand: events in, effects out, time passed in.

The consumer side: :func:`core` makes a :class:`~kvpush.protocol.consumer.ConsumerCore` that
knows two producers (``P``, ``Q``); :func:`expect` registers a request and returns its
Register. The producer side: :class:`Harness` is a
:class:`~kvpush.protocol.producer.ProducerCore` with a clock and the effects it asked for.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvpush import messages as m
from kvpush.layout import KVLayout, Region
from kvpush.plan import plan_transfer
from kvpush.protocol.consumer import ConsumerCore, CoreConfig
from kvpush.protocol.effects import Abandon, Emit, Post, Send, XferEnd
from kvpush.protocol.producer import CoreConfig as ProducerConfig
from kvpush.protocol.producer import ProducerCore
from kvpush.request import Release, TransferMode, TransferResult
from tests.support.harness import make_cache

# -- the consumer core ---------------------------------------------------------------------
P, Q = "prod-a", "prod-b"
LAYOUT = make_cache(num_blocks=16).layout


class _Plan:
    def __init__(self, local: np.ndarray, remote: np.ndarray) -> None:
        self.local_indices = local.astype(np.int32)
        self.remote_indices = remote.astype(np.int32)
        self.num_blocks = len(local)
        self.num_descriptors = len(local)


class FakeLinks:
    """One descriptor per block, as given; checksums count up."""

    def plan(self, peer: str, local_ids: np.ndarray, remote_ids: np.ndarray,
             coalesce: bool) -> Any:
        return _Plan(local_ids, remote_ids)

    def desc_bytes(self, peer: str) -> int:
        return 100

    def checksums(self, ids: np.ndarray) -> np.ndarray:
        return np.arange(len(ids), dtype=np.uint64)


CORES: list[ConsumerCore] = []


def close_cores() -> None:
    """Close every core :func:`core` made and not closed yet (every use ends: LIVE counts
    return to zero); ``tests/protocol/conftest.py`` calls it after each test."""
    while CORES:
        c = CORES.pop()
        c.close(1e9)
        for effect in c.drain():
            if isinstance(effect, Abandon):
                c.transfer_ended(1e9, effect.key, XferEnd.ABANDONED)
        assert c.pending == 0


def core(grace: float = 1.0, verify: bool = False) -> ConsumerCore:
    c = ConsumerCore(LAYOUT, CoreConfig(abort_grace_s=grace, verify=verify), FakeLinks())
    c.peer_up(0.0, P)
    c.peer_up(0.0, Q)
    CORES.append(c)
    return c


def sends(effects: list[Any]) -> list[m.Message]:
    return [e.msg for e in effects if isinstance(e, Send)]


def results(effects: list[Any]) -> list[TransferResult]:
    return [e.item for e in effects if isinstance(e, Emit) and isinstance(e.item, TransferResult)]


def expect(c: ConsumerCore, rid: str = "r", xid: int = 11, producers: tuple[str, ...] = (P,),
           timeout: float = 10.0, groups: int = 1) -> m.Register:
    c.expect(0.0, rid, np.array([1, 2]), list(producers), timeout, groups, False,
             [1] * len(producers), xid)
    regs = sends(c.drain())
    assert all(isinstance(r, m.Register) and r.xid == xid for r in regs)
    reg = regs[0]
    assert isinstance(reg, m.Register)
    return reg


# -- the producer core ---------------------------------------------------------------------
NUM_BLOCKS = 32
LAYERS = 2


def layout() -> KVLayout:
    return KVLayout(regions=tuple(Region(1 << 20 * (i + 1), NUM_BLOCKS * 128)
                                  for i in range(LAYERS)),
                    num_layers=LAYERS, num_blocks=NUM_BLOCKS, tokens_per_block=4,
                    num_kv_heads=1, head_size=8, dtype="float16")


class Links:
    """Plans with the compiled planner over the rig's layout; checksums are zeros."""

    def plan(self, peer: str, src: np.ndarray, dst: np.ndarray, coalesce: bool) -> Any:
        return plan_transfer(src, dst, NUM_BLOCKS, NUM_BLOCKS, LAYERS, coalesce)

    def desc_bytes(self, peer: str) -> int:
        return 64

    def checksums(self, ids: np.ndarray) -> bytes:
        return b"\0" * 8 * len(ids)


class Harness:
    """A core, a clock, and what it asked for so far."""

    def __init__(self, **config: Any) -> None:
        self.now = 0.0
        self.core = ProducerCore(layout(), ProducerConfig(**{"lease_s": 10.0,
                                                          "tombstone_s": 5.0, **config}),
                                 Links())
        self.effects: list[Any] = []
        for peer in ("A", "B"):
            self.core.peer_up(self.now, peer, layout())

    def run(self) -> list[Any]:
        out = self.core.drain()
        self.effects += out
        return out

    def advance(self, dt: float) -> list[Any]:
        self.now += dt
        self.core.tick(self.now)
        return self.run()

    def releases(self) -> list[Release]:
        return [e.item for e in self.effects if isinstance(e, Emit)]

    def sent(self, kind: type, peer: str | None = None) -> list[Any]:
        return [e.msg for e in self.effects if isinstance(e, Send)
                and isinstance(e.msg, kind) and (peer is None or e.peer == peer)]

    def posts(self) -> list[Post]:
        return [e for e in self.effects if isinstance(e, Post)]

    def register(self, peer: str, rid: str, xid: int, ids: list[int], **kw: Any) -> None:
        msg = m.Register(rid, xid, m.encode_ids(np.array(ids)), kw.pop("part", 0),
                         kw.pop("wait_s", 30.0), **kw)
        self.core.on_message(self.now, peer, msg)
        self.run()

    def prefill(self, rid: str, ids: list[int], mode: TransferMode = TransferMode.PUSH,
                sid: int = 7) -> None:
        self.core.prefill_done(self.now, rid, np.array(ids, dtype=np.int64), mode, sid)
        self.run()

    def end_writes(self, end: XferEnd = XferEnd.DONE, inline_s: float = 0.0) -> None:
        for post in self.posts():
            self.core.transfer_ended(self.now, post.key, end, inline_s)
        self.run()
