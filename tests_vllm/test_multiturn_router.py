"""The example router's conversations, against stand-in prefill and decode servers (aiohttp,
in this process): a conversation's turns stay on the decode instance that holds its KV (by
the client's id, else by the prompt's start), the next turn's prefill gets the decode's
``kvpush_reuse``, and a failed turn falls back to no reuse. Real servers behind the adapter's
reuse: ``test_multiturn_vllm.py``."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

from examples.vllm import router as router_mod  # noqa: E402


class Stands:
    """One prefill and two decode stand-ins; what each was asked."""

    def __init__(self) -> None:
        self.prefill_params: list[dict[str, Any]] = []
        self.decode_hits: list[int] = []
        self.fail_next = -1        # a decode instance whose next answer is a 500

    async def prefill(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.prefill_params.append(body["kv_transfer_params"])
        return web.json_response({"choices": [{"text": "x", "token_ids": [1]}],
                                  "kv_transfer_params": {"do_remote_prefill": True}})

    def decode(self, index: int) -> Any:
        async def answer(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            self.decode_hits.append(index)
            if self.fail_next == index:
                self.fail_next = -1
                return web.json_response({"error": "boom"}, status=500)
            kept = {"kvpush_id": f"reuse.{index}.{len(self.decode_hits)}",
                    "kvpush_num_tokens": 32}
            if body.get("stream"):
                out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await out.prepare(request)
                await out.write(b'data: {"choices": [{"text": "y"}]}\n\ndata: [DONE]\n\n')
                await out.write_eof()
                return out
            return web.json_response({"choices": [{"text": "y", "token_ids": [2]}],
                                      "kv_transfer_params": {"kvpush_reuse": kept}})
        return answer


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


async def _run(stands: Stands, turns: list[tuple[dict[str, Any], dict[str, str]]]
               ) -> list[int]:
    """Post each (body, headers) through a router over the stand-ins; the statuses."""
    runners = []
    try:
        apps = [web.Application() for _ in range(3)]
        apps[0].router.add_post("/v1/completions", stands.prefill)
        for i in (0, 1):
            apps[i + 1].router.add_post("/v1/completions", stands.decode(i))
        urls = []
        for app in apps:
            runner, url = await _serve(app)
            runners.append(runner)
            urls.append(url)
        args = router_mod.parse_args(["--prefill", urls[0], "--decode", urls[1], urls[2],
                                      "--mode", "pull", "--timeout", "20"])
        runner, url = await _serve(router_mod.build_app(args))
        runners.append(runner)
        statuses = []
        async with aiohttp.ClientSession() as session:
            for body, headers in turns:
                async with session.post(url + "/v1/completions", json=body,
                                        headers=headers) as resp:
                    await resp.read()
                    statuses.append(resp.status)
        return statuses
    finally:
        for runner in reversed(runners):
            await runner.cleanup()


def _body(prompt: list[int], **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 1, **extra}


def test_turns_of_a_named_conversation_stay_together_and_reuse() -> None:
    stands = Stands()
    named = {"X-Conversation-Id": "c1"}
    turns = [(_body([1, 2]), named), (_body([9, 9]), {}), (_body([1, 2, 3]), named),
             (_body([7, 7], kvpush_conversation="c1"), {})]
    assert asyncio.run(_run(stands, turns)) == [200] * 4
    assert stands.decode_hits == [0, 1, 0, 0]
    reuse = [p.get("kvpush_reuse") for p in stands.prefill_params]
    assert reuse[0] is None and reuse[1] is None
    assert reuse[2] == {"kvpush_id": "reuse.0.1", "kvpush_num_tokens": 32}
    assert reuse[3] == {"kvpush_id": "reuse.0.3", "kvpush_num_tokens": 32}


def test_conversations_without_an_id_are_told_by_their_prompt() -> None:
    stands = Stands()
    a, b = list(range(100, 180)), list(range(500, 580))
    turns = [(_body(a), {}), (_body(b), {}), (_body([*a, 1, 2]), {}), (_body([*b, 3]), {})]
    assert asyncio.run(_run(stands, turns)) == [200] * 4
    assert stands.decode_hits == [0, 1, 0, 1]
    assert stands.prefill_params[2]["kvpush_reuse"]["kvpush_id"] == "reuse.0.1"
    assert stands.prefill_params[3]["kvpush_reuse"]["kvpush_id"] == "reuse.1.2"


def test_a_failed_turn_falls_back_to_no_reuse() -> None:
    stands = Stands()
    named = {"X-Conversation-Id": "c2"}
    stands.fail_next = 0
    turns = [(_body([1]), named), (_body([1]), named), (_body([1, 2]), named),
             (_body([1, 2], stream=True), named), (_body([1, 2, 3]), named)]
    statuses = asyncio.run(_run(stands, turns))
    assert statuses == [500, 200, 200, 200, 200]
    # the failed turn's conversation is forgotten: the next goes to any decode instance
    assert stands.decode_hits == [0, 1, 1, 1, 1]
    reuse = [p.get("kvpush_reuse") for p in stands.prefill_params]
    assert reuse[1] is None                           # nothing kept by the failed turn
    assert reuse[2]["kvpush_id"] == "reuse.1.2"
    assert reuse[3]["kvpush_id"] == "reuse.1.3"
    assert reuse[4] is None                           # a streamed answer names nothing
