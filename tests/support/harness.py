"""Test harness: KV caches with recognisable bytes, and a Producer or Consumer running in a
child process driven over a pipe (every call with a timeout; children stopped by pid)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import traceback
from dataclasses import dataclass
from typing import Any

import numpy as np

import kvpush
from kvpush import messages as m
from kvpush.layout import KVLayout

HEADER = 16  # bytes of (block id, region, seed) at the start of every block


@dataclass
class Cache:
    """A KV cache over numpy buffers: ``regions`` arrays of ``num_blocks`` blocks."""

    buffers: list[np.ndarray]
    layout: KVLayout

    @property
    def block_bytes(self) -> int:
        return self.layout.block_bytes

    def block(self, region: int, block: int) -> np.ndarray:
        return self.buffers[region][block]


def make_cache(num_blocks: int = 64, num_layers: int = 2, kv_packed: bool = True,
               tokens_per_block: int = 4, num_kv_heads: int = 2, head_size: int = 16,
               dtype: str = "float16", head_start: int = 0, total_kv_heads: int = 0,
               shared: bool = False) -> Cache:
    """``shared``: in shared memory (``kvpush.shared_array``), as a contained data plane
    (``TransportConfig(data_plane="child")``) needs."""
    probe = KVLayout(
        regions=tuple(kvpush.Region(1 << 20, 1 << 40) for _ in range(
            num_layers * (1 if kv_packed else 2))),
        num_layers=num_layers, num_blocks=num_blocks, tokens_per_block=tokens_per_block,
        num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype, kv_packed=kv_packed,
        head_start=head_start, total_kv_heads=total_kv_heads)
    bb = probe.block_bytes
    alloc = kvpush.shared_array if shared else np.zeros
    buffers = [alloc((num_blocks, bb), np.uint8) for _ in range(probe.num_regions)]
    layout = KVLayout.from_buffers(buffers, num_layers=num_layers, num_blocks=num_blocks,
                                   tokens_per_block=tokens_per_block, num_kv_heads=num_kv_heads,
                                   head_size=head_size, dtype=dtype, kv_packed=kv_packed,
                                   head_start=head_start, total_kv_heads=total_kv_heads)
    return Cache(buffers, layout)


#: Elements per token of the MLA caches :func:`make_mla_cache` makes (DeepSeek: kv_lora_rank
#: 512 + rope 64 = 576).
MLA_LATENT = 32
MLA_IDENTITY = (("model", "org/mla"), ("cache_kind", "mla"))


def make_mla_cache(tokens: int, num_blocks: int = 16, layers: int = 2, seed: int | None = None
                   ) -> tuple[list[np.ndarray], KVLayout]:
    """An MLA cache (``cache_kind="mla"``: one latent vector of :data:`MLA_LATENT` bfloat16
    elements per token and layer) of ``tokens`` per block; random, nonzero elements when
    ``seed`` is given, zeros otherwise."""
    rng = np.random.default_rng(seed)
    buffers = [np.zeros((num_blocks, tokens, MLA_LATENT), np.uint16) for _ in range(layers)]
    if seed is not None:
        for b in buffers:
            b[:] = rng.integers(1, 65535, size=b.shape, dtype=np.uint16)
    layout = KVLayout.from_buffers(buffers, num_layers=layers, num_blocks=num_blocks,
                                   tokens_per_block=tokens, num_kv_heads=1,
                                   head_size=MLA_LATENT, dtype="bfloat16", cache_kind="mla",
                                   identity=MLA_IDENTITY)
    return buffers, layout


def expected_block(seed: int, region: int, block: int, nbytes: int) -> np.ndarray:
    out = ((np.arange(nbytes, dtype=np.uint32) * (2 * region + 3) + block * 131 + seed * 17)
           % 251).astype(np.uint8)
    out[:HEADER].view(np.int64)[:] = (block, region * 1_000_003 + seed)
    return out


def fill(cache: Cache, seed: int) -> None:
    """Give every block recognisable bytes: a header naming (block, region, seed) + pattern."""
    nb, bb = cache.layout.num_blocks, cache.block_bytes
    blocks = np.arange(nb, dtype=np.uint32)[:, None]
    for r, buf in enumerate(cache.buffers):
        buf[:] = ((np.arange(bb, dtype=np.uint32)[None, :] * (2 * r + 3) + blocks * 131
                   + seed * 17) % 251).astype(np.uint8)
        header = buf[:, :HEADER].view(np.int64)
        header[:, 0] = np.arange(nb)
        header[:, 1] = r * 1_000_003 + seed


CANARY = 0xA5


def check_blocks(cache: Cache, dst_ids: np.ndarray, src_ids: np.ndarray, seed: int) -> None:
    """Every destination block holds its source block's bytes, in every region."""
    for r, buf in enumerate(cache.buffers):
        got = buf[dst_ids]
        for d, s in zip(dst_ids, src_ids, strict=True):
            want = expected_block(seed, r, int(s), cache.block_bytes)
            if not np.array_equal(buf[d], want):
                raise AssertionError(
                    f"region {r} block {d} (from source {s}) differs: header "
                    f"{buf[d][:HEADER].view(np.int64)} vs {want[:HEADER].view(np.int64)}")
        del got


def check_canaries(cache: Cache, touched: np.ndarray) -> None:
    """Blocks outside ``touched`` still hold the canary byte everywhere."""
    mask = np.ones(cache.layout.num_blocks, dtype=bool)
    mask[touched] = False
    for r, buf in enumerate(cache.buffers):
        bad = np.nonzero((buf[mask] != CANARY).any(axis=1))[0]
        if len(bad):
            raise AssertionError(f"region {r}: untouched blocks changed: "
                                 f"{np.nonzero(mask)[0][bad][:10]}")


def raw_hello(sock: Any, name: str, metadata: bytes, wire: Any,
              timeout: float = 10.0) -> m.Message:
    """A consumer's handshake without a key, frame by frame on a raw DEALER ``sock``: the
    Probe, the producer's Challenge, the Hello answering it. Returns the producer's answer
    to the Hello (HelloAck, or HelloReject)."""
    nonce = os.urandom(16)
    sock.send(m.encode(m.Probe(nonce)))
    assert sock.poll(int(timeout * 1000)), "no Challenge"
    challenge = m.decode(sock.recv())
    assert isinstance(challenge, m.Challenge), challenge
    sock.send(m.encode(m.Hello(name, metadata, wire, nonce, challenge=challenge.nonce)))
    assert sock.poll(int(timeout * 1000)), "no answer to the Hello"
    return m.decode(sock.recv())


def drain_released(p: kvpush.Producer, want: int, timeout: float = 10) -> list[kvpush.Release]:
    """Releases of an in-process Producer until ``want`` have come (or ``timeout``)."""
    out: list[kvpush.Release] = []
    deadline = time.monotonic() + timeout
    while len(out) < want and time.monotonic() < deadline:
        out += p.get_released()
        time.sleep(0.005)
    return out


# -- a Producer in a child process ----------------------------------------------------------
def _producer_main(conn: Any, cache_kwargs: dict[str, Any], seed: int,
                   config_kwargs: dict[str, Any]) -> None:
    cache = make_cache(**cache_kwargs)
    fill(cache, seed)
    config = kvpush.ProducerConfig(**config_kwargs)
    with kvpush.Producer(cache.layout, config) as producer:
        conn.send(("ready", producer.address, producer.name))
        while True:
            if not conn.poll(60):
                return  # parent gone quiet: never outlive the test
            cmd, args = conn.recv()
            try:
                if cmd == "close":
                    conn.send(("ok", None))
                    return
                if cmd == "prefill_done":
                    rid, ids, mode = args
                    ticket = producer.prefill_done(rid, ids, kvpush.TransferMode(mode))
                    conn.send(("ok", ticket.to_bytes() if ticket else None))
                elif cmd == "prefill_done_many":
                    tickets = []
                    for rid, ids, mode in args:
                        t = producer.prefill_done(rid, ids, kvpush.TransferMode(mode))
                        tickets.append(t.to_bytes() if t else None)
                    conn.send(("ok", tickets))
                elif cmd == "layer_done":
                    rid, ids, layer = args
                    producer.layer_done(rid, ids, layer)
                    conn.send(("ok", None))
                elif cmd == "abort":
                    producer.abort(args)
                    conn.send(("ok", None))
                elif cmd == "released":
                    conn.send(("ok", [(r.request_id, r.reason.value, r.block_ids.tolist())
                                      for r in producer.get_released()]))
                elif cmd == "state":
                    conn.send(("ok", producer._driver.call_and_wait(
                        lambda a=args: producer._debug_state(a), 5.0)))
                elif cmd == "stats":
                    conn.send(("ok", {**producer.stats(), "pending": producer.pending}))
                elif cmd == "block":
                    r, b = args
                    conn.send(("ok", cache.block(r, b).copy()))
                else:
                    conn.send(("error", f"unknown command {cmd}"))
            except Exception as exc:
                conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


class ChildProducer:
    """A Producer in a spawned process. Every call waits at most ``timeout`` seconds."""

    def __init__(self, seed: int = 1, timeout: float = 60.0, **kwargs: Any) -> None:
        cache_kwargs = kwargs.pop("cache", {})
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_producer_main, args=(child, cache_kwargs, seed, kwargs),
                                   daemon=True)
        self.process.start()
        child.close()
        self.timeout = timeout
        try:
            if not self._conn.poll(timeout):
                raise TimeoutError("child producer did not start")
            _, self.address, self.name = self._conn.recv()
        except BaseException:
            self.kill()
            raise

    def call(self, cmd: str, args: Any = None) -> Any:
        self._conn.send((cmd, args))
        if not self._conn.poll(self.timeout):
            raise TimeoutError(f"child producer did not answer {cmd!r}")
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(value)
        return value

    def released(self, want: int, timeout: float = 30.0) -> list[tuple[str, str, list[int]]]:
        """Collect releases until ``want`` have come (or ``timeout`` passes)."""
        out: list[tuple[str, str, list[int]]] = []
        deadline = time.monotonic() + timeout
        while len(out) < want and time.monotonic() < deadline:
            out += self.call("released")
            if len(out) < want:
                time.sleep(0.01)
        return out

    def kill(self) -> None:
        if self.process.pid and self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(10)

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.call("close")
            except (TimeoutError, OSError, EOFError, RuntimeError):
                pass
            self.process.join(15)
        self.kill()
        self._conn.close()
