"""A small OpenAI-compatible router for disaggregated vLLM: each request goes to a prefill
instance and a decode instance, and the decode instance's answer is streamed back.

* **push** (kvpush): the prefill request and the decode request leave *at the same time*;
  the decode instance registers its blocks with the prefill instance's kvpush Producer at
  once, and the KV is written into them the moment prefill ends.
* **pull** (kvpush): prefill first; its response carries a pull ticket
  (``kv_transfer_params``), which goes to the decode instance, which READs the KV.

The mode is per request: ``"kvpush_mode": "push" | "pull"`` in the body or an
``X-KVPush-Mode`` header (default: ``--mode``); ``"kvpush_layerwise": true | false`` in the
body asks the decode instance to register a push layer by layer (or not), whatever its
``layerwise`` setting. ``--protocol nixl`` speaks vLLM's own
``NixlConnector`` (pull) / ``NixlPushConnector`` (push) instead, for comparisons.

**First token from the prefill instance** (``--first-token prefill``, or per request
``"kvpush_first_token": "prefill"`` / an ``X-KVPush-First-Token`` header): the prefill
instance computes the first token anyway (its request runs with ``max_tokens=1``). The router
streams it to the client the moment the prefill answers, then the decode instance's stream
without its own first token, which must be the same token: the client's time to first token
no longer includes the KV hand-over and the decode step. Only where the decode instance is
sure to compute that same token: a streamed ``/v1/completions`` request, greedy
(``"temperature": 0``), without any of the fields in ``_FIRST_TOKEN_EXCLUDES`` (``logprobs``,
``echo``, ``stop``, ``stop_token_ids``, ...); any other request takes the decode instance's
first token as usual. A decode instance whose first
token differs anyway (numerics) is logged and counted, and the stream ends there with an
error event, never with a text that mixes two continuations. The answer's
``X-KVPush-First-Token`` header says which instance gave the first token; ``GET /stats``
counts both.

**Conversations** (multi-turn reuse; the adapter's ``reuse`` on both instances): with
several decode instances (``--decode URL URL ...``), the turns of one conversation go to the
decode instance that holds its KV. A conversation is named by the client (an
``X-Conversation-Id`` header or ``"kvpush_conversation"`` in the body), else by its first
prompt tokens (or first chat message), which every later turn repeats. After a turn whose
decode answer is not streamed, the router keeps the decode instance's ``kvpush_reuse``
(vLLM returns ``kv_transfer_params`` only in non-streamed answers) and sends it with the
next turn's prefill request, which then loads only what it lacks. A turn whose decode
instance fails or answers with an error forgets the conversation: the next turn goes to
any decode instance and its prefill computes everything, as without reuse.

Usage::

    python examples/vllm/router.py --port 8000 --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --producers tcp://127.0.0.1:29600

**Producers from etcd** (``--discovery-etcd URLS --discovery-prefix PREFIX`` instead of
``--producers``): a push request's decode leg names the producers of the prefill instance
whose record (:mod:`kvpush.discovery`, published by the adapter's ``discovery_*`` keys)
serves HTTP at ``--prefill``'s address; while it has no serving record (draining, gone),
push requests are answered 503.

Only aiohttp (which vLLM already brings) and the standard library.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

log = logging.getLogger("router")

MODES = ("push", "pull")
FIRST_TOKEN = ("decode", "prefill")
#: Request fields under which the decode instance might not compute the prefill's first
#: token, or the router could not tell it apart in the stream.
_FIRST_TOKEN_EXCLUDES = ("logprobs", "echo", "stop", "stop_token_ids", "best_of",
                         "prompt_logprobs", "min_tokens")


#: Conversations remembered (least recently used forgotten first).
MAX_CONVERSATIONS = 4096
#: Tokens (or characters of text) of a prompt's start that name its conversation when
#: the client names none.
PREFIX_TOKENS = 64


@dataclass
class Conversation:
    """Where a conversation's KV is: its decode instance and the ``kvpush_reuse`` of its
    last turn there (None: nothing to load)."""

    decode: str
    kept: dict[str, Any] | None = None


def conversation_key(headers: Any, body: dict[str, Any]) -> str | None:
    """The conversation a request belongs to: the client's id, else a hash of its prompt's
    start (None: no prompt to tell it by). Pops ``kvpush_conversation`` from ``body``."""
    named = body.pop("kvpush_conversation", None) or headers.get("X-Conversation-Id")
    if named:
        return f"id:{named}"
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        start: Any = prompt[:PREFIX_TOKENS]
    elif isinstance(prompt, str) and prompt:
        start = prompt[:4 * PREFIX_TOKENS]
    elif isinstance(body.get("messages"), list) and body["messages"]:
        start = body["messages"][0]
    else:
        return None
    digest = hashlib.blake2b(json.dumps(start, sort_keys=True).encode(), digest_size=12)
    return f"prefix:{digest.hexdigest()}"


def _sse(event: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(event).encode() + b"\n\n"


class Router:
    def __init__(self, args: argparse.Namespace) -> None:
        self.prefill = args.prefill.rstrip("/")
        decodes = args.decode if isinstance(args.decode, list) else [args.decode]
        self.decodes = [d.rstrip("/") for d in decodes]
        self.decode = self.decodes[0]            # passthrough requests
        self._next_decode = 0
        self.conversations: OrderedDict[str, Conversation] = OrderedDict()
        self._turns: dict[str, tuple[str, Conversation]] = {}   # rid -> its conversation
        self.protocol = args.protocol
        self.mode = args.mode
        self.producers = list(args.producers or [])
        self.directory: Any = None                # producers from etcd (--discovery-etcd)
        self._watcher: Any = None
        if getattr(args, "discovery_etcd", None):
            from kvpush.discovery import EtcdClient, ProducerDirectory, Watcher

            client = EtcdClient([u.strip() for u in args.discovery_etcd.split(",")])
            self._watcher = Watcher(client, args.discovery_prefix).start()
            self.directory = ProducerDirectory(self._watcher, None)
        self.nixl_engine_id = args.nixl_engine_id
        self.nixl_host = args.nixl_host
        self.nixl_port = args.nixl_port
        self.timeout = args.timeout
        self.first_token = args.first_token
        self.stage_log = bool(getattr(args, "stage_log", False))
        self.first_tokens_from_prefill = 0   # answers whose first token was the prefill's
        self.first_token_mismatches = 0      # ... and whose decode's first token was not it
        self.session: aiohttp.ClientSession | None = None

    async def on_startup(self, app: web.Application) -> None:
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.timeout),
            connector=aiohttp.TCPConnector(limit=0))

    async def on_cleanup(self, app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()
        if self._watcher is not None:
            self._watcher.close()

    def push_producers(self) -> list[str]:
        """The prefill instance's kvpush addresses a push names: from its etcd record when
        the router follows one, else ``--producers``."""
        if self.directory is None:
            return self.producers
        return list(self.directory.at_http_address(self.prefill.split("://")[-1]))

    # -- request shaping -------------------------------------------------------------------
    def _params(self, mode: str, rid: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """(prefill kv_transfer_params, decode kv_transfer_params or None: from prefill)."""
        if self.protocol == "kvpush":
            prefill = {"do_remote_decode": True, "kvpush_id": rid, "kvpush_mode": mode}
            if mode == "pull":
                return prefill, None
            return prefill, {"do_remote_prefill": True, "kvpush_id": rid, "kvpush_mode": "push",
                             "kvpush_producers": self.push_producers()}
        # vLLM's NIXL connectors
        if mode == "pull":
            return {"do_remote_decode": True, "do_remote_prefill": False,
                    "remote_engine_id": None, "remote_block_ids": None,
                    "remote_host": None, "remote_port": None}, None
        return ({"do_remote_decode": True, "do_remote_prefill": False},
                {"do_remote_prefill": True, "do_remote_decode": False,
                 "remote_engine_id": self.nixl_engine_id, "remote_host": self.nixl_host,
                 "remote_port": self.nixl_port, "tp_size": 1,
                 # Pairing is by the shared X-Request-Id; vLLM still wants this key.
                 "remote_request_id": rid})

    @staticmethod
    def _prefill_body(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in body.items()
               if k not in ("stream", "stream_options", "max_completion_tokens")}
        out["max_tokens"] = 1
        out["kv_transfer_params"] = params
        return out

    # -- HTTP ------------------------------------------------------------------------------
    async def _post_json(self, url: str, body: dict[str, Any],
                         headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
        assert self.session is not None
        async with self.session.post(url, json=body, headers=headers) as resp:
            text = await resp.text()
            try:
                return resp.status, json.loads(text)
            except json.JSONDecodeError:
                return resp.status, {"error": {"message": text[:500]}}

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        mode = body.pop("kvpush_mode", None) or request.headers.get("X-KVPush-Mode") \
            or self.mode
        if mode not in MODES:
            return web.json_response({"error": {"message": f"unknown mode {mode!r}"}},
                                     status=400)
        if body.get("n", 1) != 1:
            return web.json_response({"error": {"message": "n > 1 is not supported"}},
                                     status=400)
        first_token = body.pop("kvpush_first_token", None) \
            or request.headers.get("X-KVPush-First-Token") or self.first_token
        if first_token not in FIRST_TOKEN:
            return web.json_response(
                {"error": {"message": f"unknown first-token source {first_token!r}"}},
                status=400)
        if mode == "push" and self.protocol == "kvpush" and not self.push_producers():
            return web.json_response(
                {"error": {"message": f"no serving kvpush producer for {self.prefill}"}},
                status=503)
        # A client's X-Request-Id may repeat; the transfer's name must not: a nonce per request.
        client_id = request.headers.get("X-Request-Id")
        rid = f"{client_id}.{uuid.uuid4().hex[:12]}" if client_id else uuid.uuid4().hex
        headers = {"X-Request-Id": rid}
        self._stage("router_in", rid, mode)
        key = conversation_key(request.headers, body)
        conv = self._conversation(key)
        decode_url = conv.decode if conv is not None else self._pick_decode()
        if key is not None:
            self._turns[rid] = (key, conv or Conversation(decode_url))
        try:
            return await self._turn(request, body, mode, first_token, rid, headers,
                                    decode_url, conv)
        except (aiohttp.ClientError, asyncio.TimeoutError):
            self._forget(rid)
            raise
        finally:
            self._turns.pop(rid, None)

    async def _turn(self, request: web.Request, body: dict[str, Any], mode: str,
                    first_token: str, rid: str, headers: dict[str, str], decode_url: str,
                    conv: Conversation | None) -> web.StreamResponse:
        path = request.path
        early = first_token == "prefill" and self._first_token_applies(path, body)
        layerwise = body.pop("kvpush_layerwise", None)
        prefill_params, decode_params = self._params(mode, rid)
        if conv is not None and conv.kept and self.protocol == "kvpush":
            # the decode instance's KV of the conversation: the prefill loads what it lacks
            prefill_params["kvpush_reuse"] = conv.kept
        if layerwise is not None and decode_params is not None and self.protocol == "kvpush":
            decode_params["kvpush_layerwise"] = bool(layerwise)  # register layer by layer
        prefill_body = self._prefill_body(body, prefill_params)
        decode_body = dict(body)
        if early:  # the first token is told apart in both answers by its id
            prefill_body["return_token_ids"] = decode_body["return_token_ids"] = True
        if mode == "push":
            assert decode_params is not None
            decode_body["kv_transfer_params"] = decode_params
            # Truly concurrent: both requests are on their way before either answers.
            prefill = asyncio.ensure_future(
                self._post_json(self.prefill + path, prefill_body, headers))
            if self.stage_log:
                prefill.add_done_callback(lambda _: self._stage("prefill_answered", rid))
            try:
                if early:
                    return await self._relay_early(request, decode_url + path, decode_body,
                                                   headers, prefill, body)
                return await self._relay(request, decode_url + path, decode_body, headers,
                                         prefill)
            finally:
                if not prefill.done():
                    prefill.cancel()
                with contextlib.suppress(BaseException):
                    await prefill
        status, data = await self._post_json(self.prefill + path, prefill_body, headers)
        self._stage("prefill_answered", rid)
        if status != 200:
            return web.json_response(data, status=status)
        decode_body["kv_transfer_params"] = data.get("kv_transfer_params")
        if early:
            done: asyncio.Future[tuple[int, dict[str, Any]]] = \
                asyncio.get_running_loop().create_future()
            done.set_result((status, data))
            return await self._relay_early(request, decode_url + path, decode_body, headers,
                                           done, body)
        return await self._relay(request, decode_url + path, decode_body, headers, None)

    # -- conversations -----------------------------------------------------------------------
    def _conversation(self, key: str | None) -> Conversation | None:
        conv = self.conversations.get(key) if key is not None else None
        if conv is not None:
            self.conversations.move_to_end(key)  # type: ignore[arg-type]
        return conv

    def _pick_decode(self) -> str:
        url = self.decodes[self._next_decode % len(self.decodes)]
        self._next_decode += 1
        return url

    def _remember(self, rid: str, status: int, data: bytes) -> None:
        """After a turn's non-streamed decode answer: keep where its KV is, or forget the
        conversation if the turn failed."""
        turn = self._turns.get(rid)
        if turn is None:
            return
        if status != 200:
            self._forget(rid)
            return
        key, conv = turn
        try:
            params = json.loads(data).get("kv_transfer_params") or {}
        except (ValueError, AttributeError):
            params = {}
        kept = params.get("kvpush_reuse") if isinstance(params, dict) else None
        conv.kept = kept if isinstance(kept, dict) else None
        self.conversations[key] = conv
        self.conversations.move_to_end(key)
        while len(self.conversations) > MAX_CONVERSATIONS:
            self.conversations.popitem(last=False)

    def _remember_streamed(self, rid: str, status: int) -> None:
        """A streamed answer carries no ``kv_transfer_params``: the conversation stays on
        its decode instance (prefix caching there still helps), with nothing to load."""
        turn = self._turns.get(rid)
        if turn is None:
            return
        if status != 200:
            self._forget(rid)
            return
        key, conv = turn
        conv.kept = None
        self.conversations[key] = conv

    def _forget(self, rid: str) -> None:
        turn = self._turns.get(rid)
        if turn is not None:
            self.conversations.pop(turn[0], None)

    def _stage(self, stage: str, rid: str, detail: str = "") -> None:
        """``--stage-log``: one line per stage, on the clock the adapter's ``stage_log``
        uses (``time.monotonic``; see ``benchmarks/vllm/stages.py``)."""
        if self.stage_log:
            log.info("kvpush stage %.6f %s %s router %s", time.monotonic(), stage, rid,
                     detail)

    @staticmethod
    def _first_token_applies(path: str, body: dict[str, Any]) -> bool:
        """Whether the prefill's first token is sure to be the decode instance's (see the
        module's docstring)."""
        temperature = body.get("temperature")
        return (path == "/v1/completions" and body.get("stream") is True
                and isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
                and temperature == 0
                and not any(body.get(k) for k in _FIRST_TOKEN_EXCLUDES))

    async def _relay_early(self, request: web.Request, url: str, body: dict[str, Any],
                           headers: dict[str, str],
                           prefill: asyncio.Future[tuple[int, dict[str, Any]]],
                           client_body: dict[str, Any]) -> web.StreamResponse:
        """First token from the prefill: the decode request leaves at once (push: beside
        the prefill request), the prefill's token is streamed as soon as it answers, then
        the decode instance's stream without its first token. A failed prefill cancels the
        decode request, as in :meth:`_relay`."""
        assert self.session is not None
        decode = asyncio.ensure_future(self.session.post(url, json=body, headers=headers))
        try:
            try:
                status, data = await prefill
            except Exception as exc:  # the prefill instance is unreachable
                status, data = 502, {"error": {"message": f"prefill failed: {exc}"}}
            choices = data.get("choices") or [{}]
            first_ids = list(choices[0].get("token_ids") or [])
            if status != 200:
                log.warning("prefill failed (%s); decode request cancelled", status)
                return web.json_response(data, status=status if status >= 400 else 502)
            resp = await decode  # released below, with the other ways out
            if len(first_ids) != 1:  # nothing to tell the decode's first token apart by
                log.warning("prefill answer without one token id: first token from decode")
                return await self._pipe(request, resp, body)
            return await self._stream_after_first(request, resp, data, first_ids[0],
                                                  bool(client_body.get("return_token_ids")))
        finally:
            if not decode.done():
                decode.cancel()
                with contextlib.suppress(BaseException):
                    await decode
            elif not decode.cancelled() and decode.exception() is None:
                decode.result().release()

    async def _stream_after_first(self, request: web.Request, resp: aiohttp.ClientResponse,
                                  data: dict[str, Any], first_id: int,
                                  keep_ids: bool) -> web.StreamResponse:
        """Stream the prefill's answer ``data`` as the first chunk, then ``resp`` (the
        decode instance's stream) without its first token, which must be ``first_id``."""
        self._remember_streamed(str(resp.request_info.headers.get("X-Request-Id")),
                                resp.status)
        if resp.status != 200:  # nothing was streamed yet: the decode's answer as it is
            return web.Response(body=await resp.read(), status=resp.status,
                                content_type=resp.content_type or "application/json")
        choice0 = data["choices"][0]
        first_text = choice0.get("text") or ""
        cid = data.get("id")
        first: dict[str, Any] = {
            "id": cid, "object": "text_completion", "created": data.get("created"),
            "model": data.get("model"),
            "choices": [{"index": 0, "text": first_text, "logprobs": None,
                         "finish_reason": None, "stop_reason": None}]}
        if keep_ids:
            first["choices"][0]["token_ids"] = [first_id]
            if choice0.get("prompt_token_ids") is not None:
                first["choices"][0]["prompt_token_ids"] = choice0["prompt_token_ids"]
        out = web.StreamResponse(status=200, headers={
            "Content-Type": "text/event-stream", "X-KVPush-First-Token": "prefill"})
        await out.prepare(request)
        await out.write(_sse(first))
        self._stage("first_chunk", str(resp.request_info.headers.get("X-Request-Id")),
                    "prefill")
        self.first_tokens_from_prefill += 1
        pending = True  # decode's first token is still to be dropped
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            if line == b"data: [DONE]":
                await out.write(b"data: [DONE]\n\n")
                continue
            event = json.loads(line[5:])
            event["id"] = cid
            for choice in event.get("choices", []):
                ids = list(choice.get("token_ids") or [])
                if pending and ids:
                    pending = False
                    if ids[0] != first_id:
                        self.first_token_mismatches += 1
                        log.error("decode's first token %d is not the prefill's %d: stream "
                                  "ended", ids[0], first_id)
                        await out.write(_sse({"error": {
                            "message": "the decode instance's first token differs from the "
                                       "prefill's"}}))
                        await out.write_eof()
                        return out
                    ids = ids[1:]
                    # one token per decode step: the first event's text is that token's
                    text = choice.get("text") or ""
                    if not ids:
                        text = ""
                    elif text.startswith(first_text):
                        text = text[len(first_text):]
                    choice["text"] = text
                if keep_ids:
                    choice["token_ids"] = ids
                else:
                    choice.pop("token_ids", None)
                    choice.pop("prompt_token_ids", None)
            if not event.get("usage") and not any(
                    c.get("text") or c.get("token_ids") or c.get("finish_reason")
                    for c in event.get("choices", [])):
                continue  # only the dropped token was in it
            await out.write(_sse(event))
        await out.write_eof()
        return out

    async def _relay(self, request: web.Request, url: str, body: dict[str, Any],
                     headers: dict[str, str],
                     prefill: asyncio.Future[tuple[int, dict[str, Any]]] | None
                     ) -> web.StreamResponse:
        """Send ``body`` to the decode instance and stream its answer back. In push mode a
        failed prefill cancels the decode request (the decode instance then aborts it)."""
        assert self.session is not None
        relay = asyncio.ensure_future(self._forward(request, url, body, headers))
        if prefill is None:
            return await relay
        done, _ = await asyncio.wait({relay, prefill}, return_when=asyncio.FIRST_COMPLETED)
        if relay not in done:
            try:
                status, data = prefill.result()
            except Exception as exc:  # the prefill instance is unreachable
                status, data = 502, {"error": {"message": f"prefill failed: {exc}"}}
            if status != 200:
                relay.cancel()
                with contextlib.suppress(BaseException):
                    await relay
                log.warning("prefill failed (%s); decode request cancelled", status)
                return web.json_response(data, status=status if status >= 400 else 502)
        return await relay

    async def _forward(self, request: web.Request, url: str, body: dict[str, Any],
                       headers: dict[str, str]) -> web.StreamResponse:
        assert self.session is not None
        async with self.session.post(url, json=body, headers=headers) as resp:
            return await self._pipe(request, resp, body)

    async def _pipe(self, request: web.Request, resp: aiohttp.ClientResponse,
                    body: dict[str, Any]) -> web.StreamResponse:
        """The decode instance's answer ``resp``, to the client as it comes."""
        rid = str(resp.request_info.headers.get("X-Request-Id"))
        if not body.get("stream"):
            data = await resp.read()
            self._remember(rid, resp.status, data)
            return web.Response(body=data, status=resp.status,
                                content_type=resp.content_type or "application/json")
        self._remember_streamed(rid, resp.status)
        out = web.StreamResponse(status=resp.status, headers={
            "Content-Type": resp.headers.get("Content-Type", "text/event-stream")})
        await out.prepare(request)
        first = True
        async for chunk in resp.content.iter_any():
            if first:
                first = False
                self._stage("first_chunk", str(resp.request_info.headers.get("X-Request-Id")),
                            "decode")
            await out.write(chunk)
        await out.write_eof()
        return out

    async def passthrough(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        async with self.session.get(self.decode + request.path) as resp:
            return web.Response(body=await resp.read(), status=resp.status,
                                content_type=resp.content_type)

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response({"first_tokens_from_prefill": self.first_tokens_from_prefill,
                                  "first_token_mismatches": self.first_token_mismatches})

    async def health(self, request: web.Request) -> web.Response:
        assert self.session is not None
        for url in (self.prefill, *self.decodes):
            try:
                async with self.session.get(url + "/health") as resp:
                    if resp.status != 200:
                        return web.Response(status=503, text=f"{url}: {resp.status}")
            except aiohttp.ClientError as exc:
                return web.Response(status=503, text=f"{url}: {exc}")
        return web.Response(text="ok")


#: The app's :class:`Router` (its counters, for a test or a status page).
ROUTER = web.AppKey("router", Router)


def build_app(args: argparse.Namespace) -> web.Application:
    router = Router(args)
    app = web.Application(client_max_size=64 << 20)
    app[ROUTER] = router
    app.on_startup.append(router.on_startup)
    app.on_cleanup.append(router.on_cleanup)
    app.router.add_post("/v1/completions", router.handle)
    app.router.add_post("/v1/chat/completions", router.handle)
    app.router.add_get("/v1/models", router.passthrough)
    app.router.add_get("/health", router.health)
    app.router.add_get("/stats", router.stats)
    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prefill", required=True, help="prefill instance URL")
    p.add_argument("--decode", required=True, nargs="+",
                   help="decode instance URL(s); a conversation's turns stay on one")
    p.add_argument("--protocol", choices=("kvpush", "nixl"), default="kvpush")
    p.add_argument("--mode", choices=MODES, default="push", help="default transfer mode")
    p.add_argument("--producers", nargs="*", default=[],
                   help="kvpush push: the prefill instance's kvpush address, one per TP rank")
    p.add_argument("--discovery-etcd", metavar="URLS",
                   help="kvpush push: take the producers from etcd (comma-separated "
                        "http://host:port) instead of --producers")
    p.add_argument("--discovery-prefix", default="/kvpush/default",
                   help="the cluster's key prefix in etcd")
    p.add_argument("--nixl-engine-id", help="nixl push: the prefill instance's engine_id")
    p.add_argument("--nixl-host", default="127.0.0.1",
                   help="nixl push: the prefill instance's side-channel host")
    p.add_argument("--nixl-port", type=int, default=5600,
                   help="nixl push: the prefill instance's VLLM_NIXL_SIDE_CHANNEL_PORT")
    p.add_argument("--first-token", choices=FIRST_TOKEN, default="decode",
                   help="which instance's first token a greedy streamed completion gets "
                        "(prefill: streamed as soon as the prefill answers)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request limit (s)")
    p.add_argument("--stage-log", action="store_true",
                   help="log each request's stages (kvpush stage lines; with the adapter's "
                        "stage_log, benchmarks/vllm/stages.py lines them up)")
    args = p.parse_args(argv)
    if args.protocol == "kvpush" and args.mode == "push" and not args.producers \
            and not args.discovery_etcd:
        p.error("kvpush push needs --producers (the prefill instance's kvpush address) or "
                "--discovery-etcd")
    return args


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    web.run_app(build_app(args), host=args.host, port=args.port, access_log=None,
                print=lambda *_: log.info("router on http://%s:%d", args.host, args.port))


if __name__ == "__main__":
    main()
