"""A second engine shape: asyncio servers with continuous batching, prefill and decode in two
processes, over the tiny transformer of ``examples/multiturn/``.

* The **decode server** (the front) takes requests from clients over TCP (JSON lines:
  ``{"rid", "tokens", "max_new"}`` -> ``{"rid", "tokens"}``). Its scheduler runs steps: it
  admits the waiting requests as one batch -- allocates their blocks, registers them with
  ``Consumer.expect_many`` (one hand-off) and sends the batch to the prefill server -- and
  runs one decode token for every running sequence. A request joins the running batch
  when its KV has landed (``async for result in consumer.results()``; the result names its
  use by ``xid``) and its first token has come; it leaves when done. No thread per request:
  everything is one event loop (uvloop when ``--uvloop``).
* The **prefill server** takes batches, computes each prompt's KV into its own blocks and
  its first token, and hands the batch to kvpush with ``Producer.prefill_done_many`` (push:
  the WRITEs start at once, the registrations are there already); a task frees blocks as
  ``async for release in producer.releases()`` yields them.

Greedy decoding gives exactly the tokens of :func:`colocated` (the same model calls in one
process over one cache): ``tests/tooling/test_example_async_batching.py`` checks it. From
the repository root::

    python -m examples.async_batching --requests 16 --max-new 8 [--uvloop]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import kvpush
from examples.multiturn.model import ModelConfig, PagedKVCache, TinyTransformer

BLOCK = 16
NUM_BLOCKS = 512
TIMEOUT_S = 60.0


def _blocks(n_tokens: int) -> int:
    return -(-n_tokens // BLOCK)


class _Engine:
    """Model, paged cache and a free list of blocks (one per process)."""

    def __init__(self) -> None:
        import torch

        torch.set_num_threads(1)  # exactness: the same reductions in every process
        self.config = ModelConfig()
        self.cache = PagedKVCache(self.config, NUM_BLOCKS, BLOCK)
        self.model = TinyTransformer(self.config)
        self.free = list(range(NUM_BLOCKS))

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise kvpush.OutOfBlocks(f"{n} blocks wanted, {len(self.free)} free")
        out, self.free = self.free[:n], self.free[n:]
        return out

    def release(self, ids: Sequence[int]) -> None:
        self.free += [int(i) for i in ids]


# -- prefill --------------------------------------------------------------------------------
async def prefill_server(ready: Any, use_uvloop: bool) -> None:
    engine = _Engine()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    with kvpush.Producer(engine.cache.layout()) as producer:

        async def free_released() -> None:
            async for release in producer.releases():
                if release.blocks_safe:
                    engine.release(release.block_ids)
                else:  # a transfer may still read them: keep them a while
                    loop.call_later(release.quarantine_s, engine.release, release.block_ids)

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                await prefill_batches(reader, writer)
            except asyncio.CancelledError:  # the server stops (see DecodeServer.client)
                writer.close()

        async def prefill_batches(reader: asyncio.StreamReader,
                                  writer: asyncio.StreamWriter) -> None:
            while line := await reader.readline():
                batch = json.loads(line)
                items, firsts = [], {}
                for req in batch:       # one engine step: the batch's prefills
                    try:
                        table = engine.allocate(_blocks(len(req["tokens"])))
                    except kvpush.OutOfBlocks as exc:
                        firsts[req["rid"]] = {"error": str(exc)}
                        continue
                    firsts[req["rid"]] = engine.model.next_token(req["tokens"], 0,
                                                                 engine.cache, table)
                    items.append((req["rid"], np.asarray(table)))
                for (rid, table), out in zip(items, producer.prefill_done_many(items),
                                             strict=True):
                    if isinstance(out, Exception):   # refused: the blocks are still ours
                        engine.release(table)
                        firsts[rid] = {"error": str(out)}
                writer.write((json.dumps(firsts) + "\n").encode())
                await writer.drain()
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        freeing = loop.create_task(free_released())
        ready.send((producer.address, port))
        ready.close()
        await stop.wait()
        server.close()
        freeing.cancel()


# -- decode ---------------------------------------------------------------------------------
@dataclass
class _Request:
    rid: str
    tokens: list[int]
    max_new: int
    done: asyncio.Future[list[int]]
    table: list[int] = field(default_factory=list)
    xid: int = 0
    landed: bool = False
    out: list[int] = field(default_factory=list)   # first token, then decoded ones


class DecodeServer:
    """The front: admission in batches, continuous decode batching, KV by push."""

    def __init__(self, engine: _Engine, consumer: kvpush.Consumer) -> None:
        self.engine = engine
        self.consumer = consumer
        self.waiting: list[_Request] = []
        self.admitted: dict[str, _Request] = {}   # by rid: KV or first token not here yet
        self.by_xid: dict[int, _Request] = {}
        self.running: list[_Request] = []
        self.wake = asyncio.Event()
        self.steps = 0
        self.max_batch = 0

    async def run(self, producer_address: str, prefill_port: int) -> None:
        name = await asyncio.wait_for(self.consumer.connect_nowait(producer_address),
                                      TIMEOUT_S)
        reader, writer = await asyncio.open_connection("127.0.0.1", prefill_port)
        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(self._landings()),
                 loop.create_task(self._first_tokens(reader))]
        try:
            await self._schedule(name, writer)
        finally:
            for task in tasks:
                task.cancel()
            writer.close()

    async def _schedule(self, name: str, prefill: asyncio.StreamWriter) -> None:
        while True:
            if not (self.waiting or self.running):
                self.wake.clear()
                await self.wake.wait()
            if self.waiting:   # admit every waiting request as one batch
                batch, self.waiting = self.waiting, []
                items = []
                for req in batch:
                    n = _blocks(len(req.tokens) + req.max_new)
                    try:
                        req.table = self.engine.allocate(n)
                    except kvpush.OutOfBlocks as exc:
                        req.done.set_exception(exc)
                        continue
                    items.append((req.rid, req.table[:_blocks(len(req.tokens))], name))
                handles = self.consumer.expect_many(items, timeout=TIMEOUT_S)
                admitted = []
                for req, handle in zip([r for r in batch if r.table], handles, strict=True):
                    if isinstance(handle, Exception):
                        self._end(req, handle)
                        continue
                    req.xid = handle.xid
                    self.by_xid[handle.xid] = req
                    self.admitted[req.rid] = req
                    admitted.append({"rid": req.rid, "tokens": req.tokens})
                prefill.write((json.dumps(admitted) + "\n").encode())
                await prefill.drain()
            if self.running:   # one decode step for the running batch
                self.steps += 1
                self.max_batch = max(self.max_batch, len(self.running))
                for req in list(self.running):
                    if len(req.out) == req.max_new:
                        self.running.remove(req)
                        self._end(req, None)
                        continue
                    pos = len(req.tokens) + len(req.out) - 1
                    req.out.append(self.engine.model.next_token(
                        [req.out[-1]], pos, self.engine.cache, req.table))
            await asyncio.sleep(0)   # arrivals, landings and first tokens between steps

    def _join(self, req: _Request) -> None:
        if req.landed and req.out and self.admitted.pop(req.rid, None) is not None:
            self.running.append(req)
            self.wake.set()

    async def _landings(self) -> None:
        async for result in self.consumer.results():
            req = self.by_xid.pop(result.xid, None)   # the result names its use
            if req is None:
                continue
            if not result.ok:
                self.admitted.pop(req.rid, None)
                self._end(req, result.error)
                continue
            req.landed = True
            self._join(req)

    async def _first_tokens(self, reader: asyncio.StreamReader) -> None:
        while line := await reader.readline():
            for rid, first in json.loads(line).items():
                req = self.admitted.get(rid)
                if req is None:
                    continue
                if isinstance(first, dict):    # the prefill refused it
                    self.admitted.pop(rid)
                    self.consumer.abort(rid, first["error"])
                    self._end(req, RuntimeError(first["error"]))
                    continue
                req.out.append(first)
                self._join(req)

    def _end(self, req: _Request, error: BaseException | None) -> None:
        if req.table:
            self.engine.release(req.table)
            req.table = []
        if req.done.done():
            return
        if error is None:
            req.done.set_result(req.out)
        else:
            req.done.set_exception(error)

    async def client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One client connection (JSON lines; see the module docstring)."""
        try:
            await self._client(reader, writer)
        except asyncio.CancelledError:  # the server stops: end quietly (asyncio logs a
            writer.close()              # connection task that ends cancelled as an error)

    async def _client(self, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()

        async def answer(req: _Request) -> None:
            try:
                reply: dict[str, Any] = {"rid": req.rid, "tokens": await req.done}
            except Exception as exc:
                reply = {"rid": req.rid, "error": f"{type(exc).__name__}: {exc}"}
            writer.write((json.dumps(reply) + "\n").encode())
            await writer.drain()

        pending = []
        while line := await reader.readline():
            msg = json.loads(line)
            if msg.get("stats"):
                writer.write((json.dumps({"steps": self.steps, "max_batch": self.max_batch})
                              + "\n").encode())
                continue
            req = _Request(msg["rid"], [int(t) for t in msg["tokens"]], int(msg["max_new"]),
                           loop.create_future())
            self.waiting.append(req)
            self.wake.set()
            pending.append(loop.create_task(answer(req)))
        await asyncio.gather(*pending)
        writer.close()


async def decode_server(ready: Any, producer_address: str, prefill_port: int,
                        use_uvloop: bool) -> None:
    engine = _Engine()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    with kvpush.Consumer(engine.cache.layout()) as consumer:
        front = DecodeServer(engine, consumer)
        server = await asyncio.start_server(front.client, "127.0.0.1", 0)
        scheduling = loop.create_task(front.run(producer_address, prefill_port))
        ready.send(server.sockets[0].getsockname()[1])
        ready.close()
        stopping = loop.create_task(stop.wait())
        await asyncio.wait([scheduling, stopping], return_when=asyncio.FIRST_COMPLETED)
        server.close()
        scheduling.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await scheduling


def _main(role: str, ready: Any, args: tuple[Any, ...], use_uvloop: bool) -> None:
    if use_uvloop:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    else:
        runner = asyncio.Runner()
    with runner:
        if role == "prefill":
            runner.run(prefill_server(ready, use_uvloop))
        else:
            runner.run(decode_server(ready, *args, use_uvloop))


# -- the pair, a client, the reference ------------------------------------------------------
class Pair:
    """The prefill and decode server processes (stopped by pid in :meth:`close`)."""

    def __init__(self, use_uvloop: bool = False, start_timeout: float = 120.0) -> None:
        ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        try:
            recv, send = ctx.Pipe(duplex=False)
            self._start(ctx, "prefill", send, (), use_uvloop)
            if not recv.poll(start_timeout):
                raise TimeoutError("the prefill server did not start")
            producer_address, prefill_port = recv.recv()
            recv, send = ctx.Pipe(duplex=False)
            self._start(ctx, "decode", send, (producer_address, prefill_port), use_uvloop)
            if not recv.poll(start_timeout):
                raise TimeoutError("the decode server did not start")
            self.port: int = recv.recv()
        except BaseException:
            self.close()
            raise

    def _start(self, ctx: Any, role: str, send: Any, args: tuple[Any, ...],
               use_uvloop: bool) -> None:
        proc = ctx.Process(target=_main, args=(role, send, args, use_uvloop), daemon=True,
                           name=f"async-batching-{role}")
        proc.start()
        send.close()
        self.procs.append(proc)

    def close(self) -> None:
        for proc in reversed(self.procs):
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGTERM)
            proc.join(15)
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(5)
        self.procs.clear()

    def __enter__(self) -> Pair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def serve_all(port: int, prompts: Sequence[Sequence[int]], max_new: int,
                    stagger_s: float = 0.0) -> tuple[list[list[int]], dict[str, int]]:
    """Send every prompt to the decode server (``stagger_s`` apart: arrivals while others
    decode) and return the generated tokens in prompt order, and the server's step counts."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for i, tokens in enumerate(prompts):
        writer.write((json.dumps({"rid": f"r{i}", "tokens": list(tokens),
                                  "max_new": max_new}) + "\n").encode())
        await writer.drain()
        if stagger_s:
            await asyncio.sleep(stagger_s)
    replies: dict[str, Any] = {}
    while len(replies) < len(prompts):
        reply = json.loads(await asyncio.wait_for(reader.readline(), TIMEOUT_S))
        if "error" in reply:
            raise RuntimeError(f"{reply['rid']}: {reply['error']}")
        replies[reply["rid"]] = reply["tokens"]
    writer.write(b'{"stats": true}\n')
    stats = json.loads(await asyncio.wait_for(reader.readline(), TIMEOUT_S))
    writer.close()
    return [replies[f"r{i}"] for i in range(len(prompts))], stats


def colocated(prompts: Sequence[Sequence[int]], max_new: int) -> list[list[int]]:
    """The reference: prefill then greedy decode of each prompt in one process."""
    engine = _Engine()
    out = []
    for tokens in prompts:
        table = engine.allocate(_blocks(len(tokens) + max_new))
        gen = [engine.model.next_token(list(tokens), 0, engine.cache, table)]
        for _ in range(max_new - 1):
            gen.append(engine.model.next_token([gen[-1]], len(tokens) + len(gen) - 1,
                                               engine.cache, table))
        engine.release(table)
        out.append(gen)
    return out


def prompts_for(seed: int, count: int, vocab: int = 512) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(rng.integers(3, 70))).tolist() for _ in range(count)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--uvloop", action="store_true")
    args = ap.parse_args(argv)
    prompts = prompts_for(args.seed, args.requests)
    with Pair(args.uvloop) as pair:
        t0 = time.monotonic()
        got, stats = asyncio.run(serve_all(pair.port, prompts, args.max_new, 0.01))
        elapsed = time.monotonic() - t0
    want = colocated(prompts, args.max_new)
    same = sum(g == w for g, w in zip(got, want, strict=True))
    print(f"{args.requests} requests in {elapsed:.2f} s, {stats['steps']} decode steps, "
          f"up to {stats['max_batch']} sequences per step; {same}/{len(prompts)} exactly "
          f"the colocated tokens")
    return 0 if same == len(prompts) else 1


if __name__ == "__main__":
    sys.exit(main())
