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

Usage::

    python examples/vllm/router.py --port 8000 --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --producers tcp://127.0.0.1:29600

Only aiohttp (which vLLM already brings) and the standard library.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import uuid
from typing import Any

import aiohttp
from aiohttp import web

log = logging.getLogger("router")

MODES = ("push", "pull")


class Router:
    def __init__(self, args: argparse.Namespace) -> None:
        self.prefill = args.prefill.rstrip("/")
        self.decode = args.decode.rstrip("/")
        self.protocol = args.protocol
        self.mode = args.mode
        self.producers = list(args.producers or [])
        self.nixl_engine_id = args.nixl_engine_id
        self.nixl_host = args.nixl_host
        self.nixl_port = args.nixl_port
        self.timeout = args.timeout
        self.session: aiohttp.ClientSession | None = None

    async def on_startup(self, app: web.Application) -> None:
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.timeout),
            connector=aiohttp.TCPConnector(limit=0))

    async def on_cleanup(self, app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    # -- request shaping -------------------------------------------------------------------
    def _params(self, mode: str, rid: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """(prefill kv_transfer_params, decode kv_transfer_params or None: from prefill)."""
        if self.protocol == "kvpush":
            prefill = {"do_remote_decode": True, "kvpush_id": rid, "kvpush_mode": mode}
            if mode == "pull":
                return prefill, None
            return prefill, {"do_remote_prefill": True, "kvpush_id": rid, "kvpush_mode": "push",
                             "kvpush_producers": self.producers}
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
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        headers = {"X-Request-Id": rid}
        path = request.path
        layerwise = body.pop("kvpush_layerwise", None)
        prefill_params, decode_params = self._params(mode, rid)
        if layerwise is not None and decode_params is not None and self.protocol == "kvpush":
            decode_params["kvpush_layerwise"] = bool(layerwise)  # register layer by layer
        prefill_body = self._prefill_body(body, prefill_params)
        decode_body = dict(body)
        if mode == "push":
            assert decode_params is not None
            decode_body["kv_transfer_params"] = decode_params
            # Truly concurrent: both requests are on their way before either answers.
            prefill = asyncio.ensure_future(
                self._post_json(self.prefill + path, prefill_body, headers))
            try:
                return await self._relay(request, self.decode + path, decode_body, headers,
                                         prefill)
            finally:
                if not prefill.done():
                    prefill.cancel()
                with contextlib.suppress(BaseException):
                    await prefill
        status, data = await self._post_json(self.prefill + path, prefill_body, headers)
        if status != 200:
            return web.json_response(data, status=status)
        decode_body["kv_transfer_params"] = data.get("kv_transfer_params")
        return await self._relay(request, self.decode + path, decode_body, headers, None)

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
            if not body.get("stream"):
                data = await resp.read()
                return web.Response(body=data, status=resp.status,
                                    content_type=resp.content_type or "application/json")
            out = web.StreamResponse(status=resp.status, headers={
                "Content-Type": resp.headers.get("Content-Type", "text/event-stream")})
            await out.prepare(request)
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    async def passthrough(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        async with self.session.get(self.decode + request.path) as resp:
            return web.Response(body=await resp.read(), status=resp.status,
                                content_type=resp.content_type)

    async def health(self, request: web.Request) -> web.Response:
        assert self.session is not None
        for url in (self.prefill, self.decode):
            try:
                async with self.session.get(url + "/health") as resp:
                    if resp.status != 200:
                        return web.Response(status=503, text=f"{url}: {resp.status}")
            except aiohttp.ClientError as exc:
                return web.Response(status=503, text=f"{url}: {exc}")
        return web.Response(text="ok")


def build_app(args: argparse.Namespace) -> web.Application:
    router = Router(args)
    app = web.Application(client_max_size=64 << 20)
    app.on_startup.append(router.on_startup)
    app.on_cleanup.append(router.on_cleanup)
    app.router.add_post("/v1/completions", router.handle)
    app.router.add_post("/v1/chat/completions", router.handle)
    app.router.add_get("/v1/models", router.passthrough)
    app.router.add_get("/health", router.health)
    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prefill", required=True, help="prefill instance URL")
    p.add_argument("--decode", required=True, help="decode instance URL")
    p.add_argument("--protocol", choices=("kvpush", "nixl"), default="kvpush")
    p.add_argument("--mode", choices=MODES, default="push", help="default transfer mode")
    p.add_argument("--producers", nargs="*", default=[],
                   help="kvpush push: the prefill instance's kvpush address, one per TP rank")
    p.add_argument("--nixl-engine-id", help="nixl push: the prefill instance's engine_id")
    p.add_argument("--nixl-host", default="127.0.0.1",
                   help="nixl push: the prefill instance's side-channel host")
    p.add_argument("--nixl-port", type=int, default=5600,
                   help="nixl push: the prefill instance's VLLM_NIXL_SIDE_CHANNEL_PORT")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request limit (s)")
    args = p.parse_args(argv)
    if args.protocol == "kvpush" and args.mode == "push" and not args.producers:
        p.error("kvpush push needs --producers (the prefill instance's kvpush address)")
    return args


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    web.run_app(build_app(args), host=args.host, port=args.port, access_log=None,
                print=lambda *_: log.info("router on http://%s:%d", args.host, args.port))


if __name__ == "__main__":
    main()
