"""A prefill engine and a decode engine that move KV both ways with kvpush, and the router.

Roles are per transfer, not per process: each engine process owns a
:class:`kvpush.Producer` *and* a :class:`kvpush.Consumer` over the same KV memory (two NIXL
agents registering the same tensors -- NIXL allows it). Forward (prefill -> decode), the
prefill engine produces; backward (decode -> prefill, for the next turn), the decode engine
produces. Push or pull is chosen per turn (``Cluster.turn(mode=..., back_mode=...)``),
for each direction.

One turn of a conversation, as the router (:class:`Cluster`) drives it::

    router -> prefill  lookup(tokens)          pins its cached prefix: k_p blocks
    router -> decode   admit(tokens, k_p)      pins its cached prefix: k_d blocks; allocates
                                               blocks [k_d, n) for this turn's KV
                       push: Consumer.expect(rid, those blocks)        (registration, early)
                       back: Producer.prefill_done(rid/back, its blocks [k_p, k_d))
                             -- empty when k_d <= k_p: the protocol still completes
    router -> prefill  prefill(k_d, ticket)    back transfer into new blocks [k_p, k):
                                               push Consumer.expect / pull Consumer.pull;
                                               compute tokens [k*B, len) -> first token;
                                               Producer.prefill_done(rid, blocks [k_d, n))
    router -> decode   decode(first, ticket)   (pull: Consumer.pull) wait READY, decode,
                                               keep the full blocks under the TTL

with ``k = max(k_p, k_d)``, both capped by :func:`kvpush.prefix.reusable_blocks` so at least
one prompt token is computed. Each direction moves only the blocks its destination lacks:
backward ``k - k_p`` (the blocks the decode side computed last turn), forward ``n - k_d``
(the new suffix). A block missing from both caches -- expired after its TTL, evicted, or never
seen -- is recomputed; cached blocks are found by content (chained hashes), so KV is never
stale.

:class:`ColocatedEngine` runs the same steps in one process with one cache (the reference:
same model calls with the same shapes, so disaggregated greedy decoding must give exactly
its tokens). With ``EngineConfig.synthetic`` set, the engines skip the model and account a
calibrated prefill time instead (the benchmark uses this for long prefixes).
"""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing as mp
import os
import signal
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

import kvpush
from kvpush.prefix import BlockPool, PrefixIndex, block_hashes, reusable_blocks

from .model import ModelConfig, PagedKVCache, TinyTransformer

__all__ = [
    "Cluster",
    "ColocatedEngine",
    "CostModel",
    "EngineConfig",
    "TurnResult",
    "converse",
    "make_conversations",
]

IDLE_EXIT_S = 300.0  # an engine whose router went quiet this long exits


@dataclass(frozen=True)
class CostModel:
    """Synthetic prefill time of ``n`` new tokens after ``ctx`` cached ones (seconds):
    ``fixed_s + per_token_s * n + per_pair_s * n * (ctx + (n + 1) / 2)`` -- a linear part
    (projections, MLP) and attention over every earlier position."""

    fixed_s: float = 0.0
    per_token_s: float = 0.0
    per_pair_s: float = 0.0

    def prefill_s(self, n: int, ctx: int) -> float:
        return self.fixed_s + self.per_token_s * n + self.per_pair_s * n * (ctx + (n + 1) / 2)


@dataclass(frozen=True)
class EngineConfig:
    """One engine's settings (the same for both engines of a cluster).

    Parameters
    ----------
    model
        The tiny model's shape (and seed: both engines build the same weights).
    num_blocks, block_size
        KV cache size in blocks, tokens per block.
    ttl_s
        How long a conversation's blocks stay cached after their last use.
    synthetic
        None: run the model. A :class:`CostModel`: do not compute; account its prefill time
        (and write no KV content -- the bytes still move).
    sleep
        Synthetic only: sleep for the modelled time (True) or just report it (False).
    timeout_s
        Deadline of every transfer an engine waits for.
    threads
        torch intra-op threads (1: deterministic and fair on a small host).
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    num_blocks: int = 2048
    block_size: int = 16
    ttl_s: float = 600.0
    synthetic: CostModel | None = None
    sleep: bool = True
    timeout_s: float = 30.0
    threads: int = 1


@dataclass
class _Seq:
    """One request on one engine: its block table and what it holds in the prefix index."""

    rid: str
    tokens: list[int]
    hashes: list[bytes]          # hashes of the prompt's full blocks
    table: list[int] = field(default_factory=list)   # block id per block of positions
    indexed: int = 0             # positions [0, indexed) are pinned in the index by this seq
    dups: list[int] = field(default_factory=list)    # our copies of blocks indexed elsewhere
    reuse: bool = True
    dst: list[int] = field(default_factory=list)     # decode side: forward destination
    fwd: Any = None              # decode side: TransferHandle of the forward transfer


class EngineCore:
    """Model, paged cache, block pool and prefix index of one engine (one process)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.block_size = config.block_size
        self.clock_offset = 0.0
        self.cache = PagedKVCache(config.model, config.num_blocks, config.block_size)
        self.model = TinyTransformer(config.model) if config.synthetic is None else None
        self.pool = BlockPool(config.num_blocks)
        self.index = PrefixIndex(config.ttl_s, on_evict=self.pool.reclaim, clock=self.clock)
        self.seqs: dict[str, _Seq] = {}

    def clock(self) -> float:
        """The index's clock: monotonic, plus whatever :meth:`advance_clock` added (tests
        and demos use it to let TTLs run out without waiting)."""
        return time.monotonic() + self.clock_offset

    def advance_clock(self, seconds: float) -> int:
        self.clock_offset += seconds
        return len(self.index.expire())

    # -- requests -------------------------------------------------------------------------
    def begin(self, rid: str, tokens: Sequence[int], reuse: bool) -> _Seq:
        """Start a request: hash its full blocks and pin the longest cached prefix."""
        if rid in self.seqs:
            raise ValueError(f"request {rid!r} is already running")
        tokens = [int(t) for t in tokens]
        seq = _Seq(rid, tokens, block_hashes(tokens, self.block_size), reuse=reuse)
        if reuse:
            cap = reusable_blocks(len(tokens), self.block_size)
            seq.table = self.index.acquire(seq.hashes[:cap])
            seq.indexed = len(seq.table)
        self.seqs[rid] = seq
        return seq

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        return [int(b) for b in self.pool.allocate(n, self.index)]

    def index_upto(self, seq: _Seq, upto: int, hashes: Sequence[bytes]) -> None:
        """Index (pinned) the filled full blocks at positions ``[seq.indexed, upto)``."""
        if not seq.reuse or upto <= seq.indexed:
            return
        hs = list(hashes[seq.indexed:upto])
        mine = seq.table[seq.indexed:upto]
        held = self.index.insert(hs, mine, pin=True)
        seq.dups += [a for a, b in zip(mine, held, strict=True) if a != b]
        seq.indexed = upto

    def finish(self, seq: _Seq, kv_tokens: Sequence[int]) -> None:
        """End a request whose cache holds the KV of ``kv_tokens``: keep its full blocks in
        the index (reuse on), unpin, free the rest."""
        self.seqs.pop(seq.rid, None)
        hashes = list(seq.hashes)
        if seq.reuse:
            start = len(hashes) * self.block_size
            hashes += block_hashes(list(kv_tokens)[start:], self.block_size,
                                   parent=hashes[-1] if hashes else None)
            self.index_upto(seq, min(len(hashes), len(seq.table)), hashes)
            self.index.unpin(hashes[:seq.indexed])
        self.pool.free(seq.dups + seq.table[seq.indexed:])

    def drop(self, rid: str) -> None:
        """Forget a request that will not finish (its KV is not kept)."""
        seq = self.seqs.pop(rid, None)
        if seq is not None:
            if seq.reuse:
                self.index.unpin(seq.hashes[:seq.indexed])
            self.pool.free(seq.dups + seq.table[seq.indexed:])

    # -- compute --------------------------------------------------------------------------
    def compute(self, tokens: Sequence[int], start: int, table: Sequence[int]) -> tuple[int, float]:
        """Run ``tokens`` at ``start``; returns (greedy next token, compute seconds -- measured,
        or modelled in synthetic mode)."""
        cost = self.config.synthetic
        if cost is None:
            assert self.model is not None
            t0 = time.perf_counter()
            tok = self.model.next_token(tokens, start, self.cache, table)
            return tok, time.perf_counter() - t0
        modelled = cost.prefill_s(len(tokens), start)
        if self.config.sleep:
            time.sleep(modelled)
        # A deterministic stand-in for the model's choice.
        h = hashlib.blake2b(np.asarray(tokens[-4:], dtype="<i8").tobytes()
                            + start.to_bytes(8, "little"), digest_size=8).digest()
        return int.from_bytes(h, "little") % self.config.model.vocab_size, modelled

    def decode(self, seq: _Seq, first: int, max_new: int) -> list[int]:
        """Greedy decode after the prompt: ``first`` (from the prefill) and ``max_new - 1``
        more tokens, one forward call each."""
        out = [first]
        pos = len(seq.tokens)
        for _ in range(max_new - 1):
            if pos // self.block_size >= len(seq.table):
                seq.table += self.allocate(1)
            tok, _ = self.compute([out[-1]], pos, seq.table)
            out.append(tok)
            pos += 1
        return out

    def digests(self, hashes: Sequence[bytes]) -> list[str | None]:
        """SHA-256 of the KV bytes of each cached block (None when not cached): for checks."""
        out: list[str | None] = []
        for h in hashes:
            b = self.index.get(h)
            out.append(None if b is None else hashlib.sha256(self.cache.block_bytes(b)).hexdigest())
        return out


class ColocatedEngine(EngineCore):
    """Prefill and decode in one process over one cache: the reference."""

    def turn(self, rid: str, tokens: Sequence[int], max_new: int,
             reuse: bool = True) -> tuple[list[int], int]:
        """One turn; returns (generated tokens, prompt blocks reused)."""
        seq = self.begin(rid, tokens, reuse)
        k = len(seq.table)
        seq.table += self.allocate(self.num_blocks_for(len(seq.tokens)) - k)
        first, _ = self.compute(seq.tokens[k * self.block_size:], k * self.block_size,
                                seq.table)
        self.index_upto(seq, len(seq.hashes), seq.hashes)
        out = self.decode(seq, first, max_new)
        self.finish(seq, seq.tokens + out[:-1])
        return out, k


# -- the engine processes ------------------------------------------------------------------
class _Engine(EngineCore):
    """An engine with a Producer and a Consumer over its one cache."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.layout = self.cache.layout()
        self.producer = kvpush.Producer(self.layout)
        try:
            self.consumer = kvpush.Consumer(self.layout)
        except BaseException:
            self.producer.close()
            raise
        self.peer = ""            # the other engine's producer name, once connected
        self._on_release: dict[str, Callable[[kvpush.Release], None]] = {}

    def close(self) -> None:
        self.consumer.close()
        self.producer.close()

    def service(self) -> None:
        """Hand the Producer's releases to their owners (on this thread: the index and the
        pool are single-threaded)."""
        for rel in self.producer.get_released():
            handler = self._on_release.pop(rel.request_id, None)
            if handler is not None:
                handler(rel)

    def cmd_connect(self, address: str) -> str:
        self.peer = self.consumer.connect(address, timeout=self.config.timeout_s)
        return self.peer

    def settle(self, timeout: float = 5.0) -> None:
        """Wait (bounded) until the Producer has released every source: in pull mode it
        learns that a READ ended a moment after the reader does."""
        deadline = time.monotonic() + timeout
        self.service()
        while (self.producer.pending or self._on_release) and time.monotonic() < deadline:
            time.sleep(0.002)
            self.service()

    def cmd_stats(self) -> dict[str, Any]:
        self.settle()
        return {"producer": self.producer.stats(), "consumer": self.consumer.stats(),
                "index": self.index.stats(), "free_blocks": self.pool.num_free,
                "running": len(self.seqs), "held": self.producer.pending}

    def cmd_advance_clock(self, seconds: float) -> int:
        self.settle()  # a real pause would see these releases first
        return self.advance_clock(seconds)

    def cmd_digests(self, hashes: list[bytes]) -> list[str | None]:
        return self.digests(hashes)

    def cmd_drop(self, rid: str) -> None:
        """Give up a request after a failure elsewhere; its blocks are freed only once no
        transfer can touch them."""
        if rid + "/back" in self._on_release:  # decode side: the offer to the prefill side
            self.producer.abort(rid + "/back", "dropped by the router")
        if rid in self._on_release:  # our Producer holds its source: abort, free on release
            self.producer.abort(rid, "dropped by the router")
            return
        seq = self.seqs.get(rid)
        if seq is not None and seq.fwd is not None and not seq.fwd.done():
            self.consumer.abort(rid, "dropped by the router")
            self.wait(seq.fwd)  # reported only once no WRITE can still land
        self.drop(rid)

    # Warm-up: one one-block transfer per direction and mode when the cluster starts, so
    # every NIXL agent pair has its UCX endpoint wired up before the first measured turn
    # (the first transfer of a pair pays for the connection).
    def cmd_warm_source(self, rid: str, mode: str) -> bytes | None:
        ids = self.allocate(1)
        self._on_release[rid] = lambda rel: self.pool.free(ids)
        ticket = self.producer.prefill_done(rid, np.asarray(ids, dtype=np.int64),
                                            kvpush.TransferMode(mode))
        return ticket.to_bytes() if ticket is not None else None

    def cmd_warm_sink(self, rid: str, mode: str, ticket: bytes | None) -> float:
        ids = np.asarray(self.allocate(1), dtype=np.int64)
        t0 = time.monotonic()
        try:
            if mode == "push":
                handle = self.consumer.expect(rid, ids, self.peer, timeout=self.config.timeout_s)
            else:
                assert ticket is not None
                handle = self.consumer.pull(ticket, ids, timeout=self.config.timeout_s)
            self.wait(handle).raise_for_state()
        finally:
            self.pool.free(ids)
        return time.monotonic() - t0

    def wait(self, handle: kvpush.TransferHandle) -> kvpush.TransferResult:
        deadline = time.monotonic() + self.config.timeout_s + 5.0
        while not handle.done():
            self.service()
            if time.monotonic() > deadline:
                raise kvpush.TransferTimeout(f"{handle.request_id}: no result")
            try:
                return handle.wait(0.5)
            except kvpush.TransferTimeout:
                continue
        assert handle.result is not None
        return handle.result


class PrefillEngine(_Engine):
    def cmd_lookup(self, rid: str, tokens: list[int], reuse: bool) -> int:
        return len(self.begin(rid, tokens, reuse).table)

    def cmd_prefill(self, rid: str, k_d: int, back_ticket: bytes | None, mode: str,
                    back_mode: str) -> dict[str, Any]:
        seq = self.seqs[rid]
        bs = self.block_size
        k_p = len(seq.table)
        k = max(k_p, k_d)
        info: dict[str, Any] = {"k_p": k_p, "k_d": k_d}
        t0 = time.monotonic()
        if seq.reuse:
            ids = self.allocate(k - k_p)
            back_rid = rid + "/back"
            if back_mode == "push":
                handle = self.consumer.expect(back_rid, ids, self.peer,
                                              timeout=self.config.timeout_s)
            else:
                assert back_ticket is not None
                handle = self.consumer.pull(back_ticket, ids, timeout=self.config.timeout_s)
            result = self.wait(handle)
            if result.ok:
                seq.table += ids
                self.index_upto(seq, k, seq.hashes)
                info.update(back_blocks=len(ids), back_bytes=result.bytes_moved)
            else:  # recompute instead: never wait on, or use, KV that did not land
                self.pool.free(ids)
                k = k_p
                info.update(back_blocks=0, back_bytes=0, back_error=str(result.error))
        info["back_s"] = time.monotonic() - t0
        seq.table += self.allocate(self.num_blocks_for(len(seq.tokens)) - k)
        first, info["compute_s"] = self.compute(seq.tokens[k * bs:], k * bs, seq.table)
        self.index_upto(seq, len(seq.hashes), seq.hashes)
        src = seq.table[k_d:]

        def release(rel: kvpush.Release) -> None:  # the forward source is free: end here
            self.finish(seq, seq.tokens)

        self._on_release[rid] = release
        ticket = self.producer.prefill_done(rid, np.asarray(src, dtype=np.int64),
                                            kvpush.TransferMode(mode))
        info.update(first=first, k=k, fwd_blocks=len(src),
                    ticket=ticket.to_bytes() if ticket is not None else None)
        return info


class DecodeEngine(_Engine):
    def cmd_admit(self, rid: str, tokens: list[int], k_p: int, mode: str, back_mode: str,
                  reuse: bool) -> tuple[int, bytes | None]:
        seq = self.begin(rid, tokens, reuse)
        k_d = len(seq.table)
        dst = self.allocate(self.num_blocks_for(len(seq.tokens)) - k_d)
        seq.table += dst
        seq.dst = dst
        if mode == "push":  # register at once: the WRITE starts the moment prefill is done
            seq.fwd = self.consumer.expect(rid, np.asarray(dst, dtype=np.int64), self.peer,
                                           timeout=self.config.timeout_s)
        if not reuse:
            return k_d, None
        # Offer the prefill side what it lacks; empty when it has all we have.
        back = seq.hashes[k_p:k_d]
        src = seq.table[k_p:k_d] if k_d > k_p else []
        self.index.pin(back)  # held for the transfer even if this request ends first
        self._on_release[rid + "/back"] = lambda rel: self.index.unpin(back)
        ticket = self.producer.prefill_done(rid + "/back", np.asarray(src, dtype=np.int64),
                                            kvpush.TransferMode(back_mode))
        return k_d, ticket.to_bytes() if ticket is not None else None

    def cmd_decode(self, rid: str, first: int, max_new: int,
                   ticket: bytes | None) -> dict[str, Any]:
        seq = self.seqs[rid]
        if ticket is not None:
            seq.fwd = self.consumer.pull(ticket, np.asarray(seq.dst, dtype=np.int64),
                                         timeout=self.config.timeout_s)
        result = self.wait(seq.fwd)
        ready_at = time.monotonic()
        if not result.ok:
            self.drop(rid)
            raise RuntimeError(f"forward transfer of {rid} failed: {result.error}")
        self.index_upto(seq, len(seq.hashes), seq.hashes)
        t0 = time.perf_counter()
        out = self.decode(seq, first, max_new)
        decode_s = time.perf_counter() - t0
        self.finish(seq, seq.tokens + out[:-1])
        return {"tokens": out, "ready_at": ready_at, "fwd_bytes": result.bytes_moved,
                "decode_s": decode_s}


def _engine_main(conn: Any, role: str, config: EngineConfig) -> None:
    import torch

    torch.set_num_threads(config.threads)
    if os.environ.get("KVPUSH_MT_DEBUG"):
        import logging

        logging.basicConfig(level=logging.DEBUG, format=f"{role} %(asctime)s %(name)s %(message)s")
    engine = (PrefillEngine if role == "prefill" else DecodeEngine)(config)
    try:
        conn.send(("ready", engine.producer.address, engine.producer.name))
        quiet_since = time.monotonic()
        while True:
            if not conn.poll(0.05):
                engine.service()
                if time.monotonic() - quiet_since > IDLE_EXIT_S:
                    return
                continue
            cmd, args = conn.recv()
            quiet_since = time.monotonic()
            if cmd == "close":
                conn.send(("ok", None))
                return
            try:
                conn.send(("ok", getattr(engine, "cmd_" + cmd)(*args)))
            except Exception as exc:
                conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
            engine.service()
    except (EOFError, OSError, KeyboardInterrupt):
        return  # the router is gone
    finally:
        engine.close()


# -- the router -----------------------------------------------------------------------------
@dataclass
class TurnResult:
    """What one turn did. Blocks are prompt blocks; bytes are what kvpush reported moved."""

    rid: str
    mode: str                  # forward (prefill -> decode)
    back_mode: str             # backward (decode -> prefill)
    reuse: bool
    prompt_tokens: int
    tokens: list[int]          # generated
    ttft_s: float              # router dispatch -> decode side has all KV + first token
    reused_blocks: int         # k: prompt blocks not recomputed
    local_blocks: int          # k_p: cached on the prefill side
    remote_blocks: int         # k_d: cached on the decode side
    back_blocks: int           # decode -> prefill
    back_bytes: int
    fwd_blocks: int            # prefill -> decode
    fwd_bytes: int
    back_s: float              # prefill side: waiting for the backward transfer
    compute_s: float           # prefill compute (modelled in synthetic mode)
    decode_s: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Child:
    def __init__(self, ctx: Any, role: str, config: EngineConfig) -> None:
        self.role = role
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_engine_main, args=(child, role, config),
                                   name=f"kvpush-{role}", daemon=True)
        self.process.start()
        child.close()
        self.address = self.name = ""

    def started(self, timeout: float) -> None:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.role} engine did not start within {timeout} s")
        try:
            _, self.address, self.name = self.conn.recv()
        except EOFError:
            self.process.join(5)
            raise RuntimeError(f"{self.role} engine exited while starting "
                               f"(exit code {self.process.exitcode})") from None

    def call(self, timeout: float, cmd: str, *args: Any) -> Any:
        self.conn.send((cmd, args))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.role} engine did not answer {cmd!r} within {timeout} s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"{self.role} engine, {cmd}: {value}")
        return value

    def stop(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(TimeoutError, OSError, EOFError, RuntimeError):
                self.call(15.0, "close")
            self.process.join(15)
        if self.process.is_alive() and self.process.pid:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.join(5)
        self.conn.close()


class Cluster:
    """The router: a prefill engine and a decode engine in child processes, connected both
    ways, driven over pipes (every call with a timeout; children stopped by pid).

    Parameters
    ----------
    config
        Both engines' :class:`EngineConfig`.
    call_timeout
        Deadline of every call into an engine.
    """

    def __init__(self, config: EngineConfig | None = None, *, start_timeout: float = 120.0,
                 call_timeout: float = 60.0) -> None:
        self.config = config or EngineConfig()
        self.timeout = call_timeout
        ctx = mp.get_context("spawn")
        self._children: list[_Child] = []
        self._seq = 0
        try:
            self.prefill = _Child(ctx, "prefill", self.config)
            self._children.append(self.prefill)
            self.decode = _Child(ctx, "decode", self.config)
            self._children.append(self.decode)
            for c in self._children:
                c.started(start_timeout)
            # Each engine's Consumer connects to the other's Producer.
            self.decode.call(call_timeout, "connect", self.prefill.address)
            self.prefill.call(call_timeout, "connect", self.decode.address)
            for src, dst in ((self.prefill, self.decode), (self.decode, self.prefill)):
                for mode in ("push", "pull"):
                    rid = f"warm-{src.role}-{mode}"
                    ticket = src.call(call_timeout, "warm_source", rid, mode)
                    dst.call(call_timeout, "warm_sink", rid, mode, ticket)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for c in self._children:
            c.stop()
        self._children = []

    def turn(self, tokens: Sequence[int], max_new: int, *, mode: str = "push",
             reuse: bool = True, back_mode: str | None = None,
             rid: str | None = None) -> TurnResult:
        """Serve one turn: prefill on one engine, decode on the other, KV moved both ways.

        ``mode`` ("push" or "pull") applies to both directions unless ``back_mode`` names
        another for the backward one (decode -> prefill)."""
        back_mode = back_mode or mode
        for name, value in (("mode", mode), ("back_mode", back_mode)):
            if value not in ("push", "pull"):
                raise ValueError(f"{name} must be 'push' or 'pull', got {value!r}")
        self._seq += 1
        rid = f"{rid or 'req'}#{self._seq}"
        tokens = [int(t) for t in tokens]
        p, d, t = self.prefill, self.decode, self.timeout
        t0 = time.monotonic()
        try:
            k_p = p.call(t, "lookup", rid, tokens, reuse)
            k_d, back_ticket = d.call(t, "admit", rid, tokens, k_p, mode, back_mode, reuse)
            info = p.call(t, "prefill", rid, k_d, back_ticket, mode, back_mode)
            dec = d.call(t, "decode", rid, info["first"], max_new, info["ticket"])
        except BaseException:
            for c in (p, d):
                with contextlib.suppress(Exception):
                    c.call(10.0, "drop", rid)
            raise
        ttft = dec["ready_at"] - t0
        if self.config.synthetic is not None and not self.config.sleep:
            ttft += info["compute_s"]  # accounted, not slept: it sits on the critical path
        return TurnResult(
            rid=rid, mode=mode, back_mode=back_mode, reuse=reuse, prompt_tokens=len(tokens),
            tokens=dec["tokens"],
            ttft_s=ttft, reused_blocks=info["k"], local_blocks=k_p, remote_blocks=k_d,
            back_blocks=info.get("back_blocks", 0), back_bytes=info.get("back_bytes", 0),
            fwd_blocks=info["fwd_blocks"], fwd_bytes=dec["fwd_bytes"], back_s=info["back_s"],
            compute_s=info["compute_s"], decode_s=dec["decode_s"])

    def stats(self) -> dict[str, dict[str, Any]]:
        """Both engines' Producer, Consumer and index counters (after pending releases)."""
        return {c.role: c.call(self.timeout, "stats") for c in self._children}

    def advance_clock(self, seconds: float) -> None:
        """Let ``seconds`` pass for both engines' TTLs."""
        for c in self._children:
            c.call(self.timeout, "advance_clock", seconds)

    def digests(self, side: str, hashes: Sequence[bytes]) -> list[str | None]:
        child = self.prefill if side == "prefill" else self.decode
        result: list[str | None] = child.call(self.timeout, "digests", list(hashes))
        return result


# -- workloads --------------------------------------------------------------------------------
def make_conversations(seed: int, count: int, turns: int, *, system_tokens: int,
                       user_tokens: int, vocab: int, shared_system: bool = False
                       ) -> list[tuple[list[int], list[list[int]]]]:
    """Random conversations: (system prompt, one user message per turn). With
    ``shared_system`` every conversation starts with the same system prompt."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, vocab, system_tokens).tolist()
    out = []
    for _ in range(count):
        system = shared if shared_system else rng.integers(0, vocab, system_tokens).tolist()
        users = [rng.integers(0, vocab, user_tokens).tolist() for _ in range(turns)]
        out.append((system, users))
    return out


def converse(serve: Callable[[list[int], int], list[int]], system: Sequence[int],
             users: Sequence[Sequence[int]], max_new: int) -> list[list[int]]:
    """Run a conversation: each turn's prompt is the previous prompt + the answer + the next
    user message. ``serve(prompt, max_new)`` returns the answer; returns every answer."""
    history = list(system)
    answers = []
    for user in users:
        history += list(user)
        answer = serve(list(history), max_new)
        answers.append(answer)
        history += answer
    return answers
