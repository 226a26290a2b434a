"""The example router's first token from the prefill instance (``--first-token prefill``),
against stand-in prefill and decode servers (aiohttp, in this process): what the router does
with the two answers is the subject here; real vLLM servers behind it are in
``test_vllm_disagg.py::test_first_token_from_prefill_tokens_match_colocated``.

The stand-ins answer as vLLM 0.32's OpenAI server does with ``return_token_ids``: the prefill
one a JSON completion of one token, the decode one a server-sent-event stream with one token
per event, then ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import pytest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

from examples.vllm import router as router_mod  # noqa: E402

PROMPT = [5, 6, 7]
TOKENS = [11, 12, 13]
TEXTS = [" A", " B", " C"]
PREFILL_S = 0.05   # the prefill answers after this
DECODE_S = 0.40    # the decode instance's first event comes after this


class Stand:
    """A prefill and a decode stand-in; what they were asked and when."""

    def __init__(self, decode_tokens: list[int] | None = None, prefill_status: int = 200
                 ) -> None:
        self.decode_tokens = decode_tokens or TOKENS
        self.prefill_status = prefill_status
        self.t0 = time.monotonic()
        self.prefill_body: dict[str, Any] = {}
        self.decode_body: dict[str, Any] = {}
        self.decode_asked_at = -1.0
        self.prefill_answered_at = -1.0
        self.decode_finished = False
        self.decode_dropped = False  # the router hung up on the decode stream

    async def prefill(self, request: web.Request) -> web.Response:
        self.prefill_body = await request.json()
        await asyncio.sleep(PREFILL_S)
        self.prefill_answered_at = time.monotonic() - self.t0
        if self.prefill_status != 200:
            return web.json_response({"error": {"message": "boom"}},
                                     status=self.prefill_status)
        choice: dict[str, Any] = {"index": 0, "text": TEXTS[0], "finish_reason": "length"}
        if self.prefill_body.get("return_token_ids"):
            choice.update(token_ids=[TOKENS[0]], prompt_token_ids=PROMPT)
        return web.json_response({"id": "cmpl-prefill", "object": "text_completion",
                                  "created": 1, "model": "tiny", "choices": [choice],
                                  "kv_transfer_params": {"ticket": "t"}})

    async def decode(self, request: web.Request) -> web.StreamResponse:
        self.decode_body = await request.json()
        self.decode_asked_at = time.monotonic() - self.t0
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await asyncio.sleep(DECODE_S)
        n = len(self.decode_tokens)
        try:
            for i, (tok, text) in enumerate(zip(self.decode_tokens, TEXTS, strict=True)):
                choice: dict[str, Any] = {"index": 0, "text": text,
                                          "finish_reason": "length" if i == n - 1 else None}
                if self.decode_body.get("return_token_ids"):
                    choice["token_ids"] = [tok]
                await out.write(b"data: " + json.dumps(
                    {"id": "cmpl-decode", "object": "text_completion", "model": "tiny",
                     "choices": [choice]}).encode() + b"\n\n")
                await asyncio.sleep(0.01)
            await out.write(b"data: [DONE]\n\n")
            await out.write_eof()
        except (ConnectionError, aiohttp.ClientConnectionResetError):
            self.decode_dropped = True  # the router hung up (what some tests check)
            return out
        self.decode_finished = True
        return out


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


async def _ask(stand: Stand, body: dict[str, Any], *, mode: str = "push",
               first_token: str = "prefill", linger: float = 0.0,
               router_args: tuple[str, ...] = ()) -> dict[str, Any]:
    """Start both stand-ins and a router, post ``body``, gather the answer; the servers
    stay up ``linger`` seconds longer."""
    pre, dec = web.Application(), web.Application()
    pre.router.add_post("/v1/completions", stand.prefill)
    dec.router.add_post("/v1/completions", stand.decode)
    runners = []
    try:
        r1, pre_url = await _serve(pre)
        runners.append(r1)
        r2, dec_url = await _serve(dec)
        runners.append(r2)
        args = router_mod.parse_args(["--prefill", pre_url, "--decode", dec_url,
                                      "--producers", "tcp://127.0.0.1:1", "--mode", mode,
                                      "--first-token", first_token, "--timeout", "20",
                                      *router_args])
        app = router_mod.build_app(args)
        r3, url = await _serve(app)
        runners.append(r3)
        router = app[router_mod.ROUTER]
        events: list[dict[str, Any]] = []
        first_at = -1.0
        async with aiohttp.ClientSession() as session:
            t0 = time.monotonic()
            stand.t0 = t0
            async with session.post(url + "/v1/completions", json=body) as resp:
                status, header = resp.status, resp.headers.get("X-KVPush-First-Token")
                if resp.content_type != "text/event-stream":
                    answer = await resp.json()
                    await asyncio.sleep(linger)
                    return {"status": status, "header": header, "body": answer,
                            "router": router}
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:") or line == b"data: [DONE]":
                        continue
                    if first_at < 0:
                        first_at = time.monotonic() - t0
                    events.append(json.loads(line[5:]))
        tokens = [t for e in events for c in e.get("choices", []) for t in
                  c.get("token_ids") or []]
        text = "".join(c.get("text") or "" for e in events for c in e.get("choices", []))
        return {"status": status, "header": header, "events": events, "tokens": tokens,
                "text": text, "first_at": first_at, "router": router}
    finally:
        for runner in reversed(runners):
            await runner.cleanup()


def _greedy(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "temperature": 0,
            "stream": True, "return_token_ids": True, **extra}


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_first_token_streamed_when_the_prefill_answers(mode: str) -> None:
    stand = Stand()
    out = asyncio.run(_ask(stand, _greedy(), mode=mode))
    assert out["status"] == 200 and out["header"] == "prefill"
    assert out["tokens"] == TOKENS and out["text"] == "".join(TEXTS)
    # the first token came with the prefill's answer, long before the decode's first event
    assert out["first_at"] < PREFILL_S + DECODE_S / 2, out["first_at"]
    assert {e["id"] for e in out["events"]} == {"cmpl-prefill"}
    assert out["events"][-1]["choices"][0]["finish_reason"] == "length"
    if mode == "push":  # the decode request still left beside the prefill's
        assert 0 <= stand.decode_asked_at < stand.prefill_answered_at
    assert stand.prefill_body["max_tokens"] == 1 and "stream" not in stand.prefill_body


def test_token_ids_not_asked_for_are_not_returned() -> None:
    stand = Stand()
    out = asyncio.run(_ask(stand, _greedy(return_token_ids=False)))
    assert out["status"] == 200 and out["header"] == "prefill"
    assert out["tokens"] == [] and out["text"] == "".join(TEXTS)
    # ... though the router asked both instances for them, to tell the first token apart
    assert stand.prefill_body["return_token_ids"] and stand.decode_body["return_token_ids"]


def test_a_different_first_token_at_decode_ends_the_stream_with_an_error() -> None:
    stand = Stand(decode_tokens=[99, 12, 13])
    out = asyncio.run(_ask(stand, _greedy()))
    assert out["tokens"] == [TOKENS[0]]          # the prefill's, and nothing mixed after it
    assert "error" in out["events"][-1]
    assert out["router"].first_token_mismatches == 1
    assert out["router"].first_tokens_from_prefill == 1


@pytest.mark.parametrize("extra", [{"temperature": 0.7}, {"logprobs": 1}, {"stop": ["x"]},
                                   {"stream": False}])
def test_requests_the_decode_might_answer_otherwise_take_its_first_token(
        extra: dict[str, Any]) -> None:
    stand = Stand()
    out = asyncio.run(_ask(stand, _greedy(**extra)))
    assert out["status"] == 200 and out["header"] is None
    if extra.get("stream") is False:
        return  # the stand-in streams anyway; only the router's choice matters here
    assert out["tokens"] == TOKENS and out["first_at"] >= DECODE_S


def test_a_failed_prefill_is_the_answer_and_the_decode_request_is_dropped() -> None:
    stand = Stand(prefill_status=500)
    out = asyncio.run(_ask(stand, _greedy(), linger=DECODE_S + 0.3))
    assert out["status"] == 500 and out["body"]["error"]["message"] == "boom"
    assert stand.decode_asked_at >= 0        # it had left beside the prefill request
    assert stand.decode_dropped and not stand.decode_finished


def test_first_token_default_is_decode_and_bad_values_are_refused() -> None:
    stand = Stand()
    out = asyncio.run(_ask(stand, _greedy(), first_token="decode"))
    assert out["header"] is None and out["first_at"] >= DECODE_S
    out = asyncio.run(_ask(Stand(), _greedy(kvpush_first_token="prefill"),
                           first_token="decode"))
    assert out["header"] == "prefill"
    out = asyncio.run(_ask(Stand(), _greedy(kvpush_first_token="both")))
    assert out["status"] == 400 and "first-token" in out["body"]["error"]["message"]


@pytest.mark.parametrize("first_token", ["decode", "prefill"])
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_stage_log_stamps_each_step_of_a_request(mode: str, first_token: str,
                                                caplog: pytest.LogCaptureFixture) -> None:
    """``--stage-log``: the lines benchmarks/vllm/stages.py joins with the adapter's, on
    the same clock (time.monotonic), in order; none without it."""
    caplog.set_level(logging.INFO, logger="router")
    t0 = time.monotonic()
    out = asyncio.run(_ask(Stand(), _greedy(), mode=mode, first_token=first_token,
                           router_args=("--stage-log",)))
    assert out["status"] == 200
    lines = [r.getMessage().split() for r in caplog.records
             if r.getMessage().startswith("kvpush stage ")]
    assert [w[3] for w in lines] == ["router_in", "prefill_answered", "first_chunk"], lines
    assert len({w[4] for w in lines}) == 1 and all(w[5] == "router" for w in lines)
    times = [float(w[2]) for w in lines]
    assert t0 <= times[0] <= times[1] <= times[2] <= time.monotonic()
    assert lines[0][6] == mode and lines[2][6] == first_token
    caplog.clear()
    asyncio.run(_ask(Stand(), _greedy(), mode=mode, first_token=first_token))
    assert not [r for r in caplog.records if r.getMessage().startswith("kvpush stage ")]
