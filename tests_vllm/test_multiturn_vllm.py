"""Real vLLM, multi-turn reuse through kvpush: one prefill and one decode server (both
``kv_both`` with ``reuse`` on; the prefill without prefix caching, as a prefill pool that does
not keep conversations, and loading every kept token it lacks, ``reuse_load`` ``always``),
driven the way a proxy written for vLLM's ``NixlConnector``
``bidirectional_kv_xfer`` drives them: each turn's prefill request carries the previous
decode response's ``kv_transfer_params`` as they came. Every turn's tokens must equal a
colocated vLLM instance's (prefix caching on), and the bytes moved each way must be exactly
the blocks the receiving side lacks. The lease and a decode restart between turns must end
in a recompute with the right tokens, never an error. A second pair, its prefill with prefix
caching and ``reuse_load`` ``measured`` (the sticky scenario), chooses per turn from its
measured costs whether to load or compute what it lacks, by push and by pull. Last, kvpush's
router (``examples/vllm/router.py``) in front of the first pair drives the turns of a client
that knows nothing of KV, and the kept KV must come back the same way.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import BLOCK, MAX_TOKENS, PROMPTS, Colocated, sse_events, tokens_of
from toy_proxy import _post, decode_body_push, prefill_body

from examples.vllm import launch

#: Bytes per block of the tiny Llama: 4 layers x (32 tokens x 2 heads x 2*64 x bf16).
BYTES_PER_BLOCK = 4 * BLOCK * 2 * 128 * 2
#: The decode server's lease on a kept turn (its Producer holds only kept turns)
LEASE_S = 10.0
METRIC = "vllm:kvpush_bytes_transferred_sum"
TURNS = 4
USER_TOKENS = 16


class ReusePair:
    def __init__(self, fleet: launch.Fleet, prefill: launch.Process, decode: launch.Process,
                 prefill_kv: int, decode_args: dict[str, Any]) -> None:
        self.fleet, self.prefill, self.decode = fleet, prefill, decode
        self.prefill_kv, self.decode_args = prefill_kv, decode_args

    def turn(self, prompt: list[int], mode: str, kept: dict[str, Any] | None,
             stream: bool = False) -> tuple[list[int], dict[str, Any] | None]:
        """One turn as a vLLM bidirectional proxy runs it (decode leg not streamed unless
        ``stream``: vLLM returns ``kv_transfer_params`` only in a non-streamed answer).
        Returns (tokens, the decode's params)."""
        body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS,
                "temperature": 0, "return_token_ids": True}
        rid = str(uuid.uuid4())
        first = prefill_body(body)
        if kept:
            first["kv_transfer_params"] = {**kept, "do_remote_decode": True,
                                           "do_remote_prefill": False}
        first["kv_transfer_params"]["transfer_mode"] = mode
        decode = _post_stream if stream else _post
        if mode == "pull":
            status, answer = _post(self.prefill.url + "/v1/completions", first, rid, 120)
            assert status == 200, answer
            second = dict(body, kv_transfer_params=answer["kv_transfer_params"])
            status, out = decode(self.decode.url + "/v1/completions", second, rid, 120)
        else:
            result: dict[str, Any] = {}
            t = threading.Thread(target=lambda: result.update(
                p=_post(self.prefill.url + "/v1/completions", first, rid, 120)), daemon=True)
            t.start()
            second = decode_body_push(body, engine_id="prefill", host="127.0.0.1",
                                      port=self.prefill_kv, tp_size=1, request_id=rid)
            second["kv_transfer_params"]["transfer_mode"] = "push"
            status, out = decode(self.decode.url + "/v1/completions", second, rid, 120)
            t.join(120)
            assert result["p"][0] == 200, result["p"]
        assert status == 200, out
        return tokens_of(out), out.get("kv_transfer_params")

    def restart_decode(self, workdir: Path) -> None:
        self.decode.stop()
        self.decode = self.fleet.add(launch.start_vllm(**self.decode_args))
        launch.wait_healthy([self.decode], timeout_s=420)


def _post_stream(url: str, body: dict[str, Any], request_id: str,
                 timeout: float) -> tuple[int, dict[str, Any]]:
    """A streamed decode leg: the token ids of every event, and whether the stream named
    any ``kv_transfer_params`` (vLLM's does not)."""
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 method="POST", headers={"Content-Type": "application/json",
                                                         "X-Request-Id": request_id})
    tokens: list[int] = []
    chunks, params = 0, None
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for event in sse_events(r):
            chunks += 1
            params = event.get("kv_transfer_params") or params
            for choice in event.get("choices", []):
                tokens += choice.get("token_ids") or []
        status = r.status
    assert chunks >= 2, "not streamed"
    return status, {"choices": [{"token_ids": tokens}], "kv_transfer_params": params}


def moved(url: str) -> float:
    return launch.metrics(url).get(METRIC, 0.0)


def settled(url: str, before: float, expect: float, timeout: float = 10.0) -> float:
    """Prometheus values land a step or two after the response: poll for ``expect``."""
    deadline = time.monotonic() + timeout
    value = moved(url) - before
    while value != expect and time.monotonic() < deadline:
        time.sleep(0.1)
        value = moved(url) - before
    return value


def _start_pair(model_dir: Path, logs: Path, tag: str, lease_s: float,
                prefill_extra: list[str], **prefill_kv: Any) -> Iterator[ReusePair]:
    """Prefill (core 0) and decode (core 1) servers, both ``kv_both`` with reuse on, until
    the caller is done with them."""
    fleet = launch.Fleet()
    p_kv, d_kv, p_port, d_port = (launch.free_port() for _ in range(4))
    common = ["-O0", "--max-num-seqs", "8"]
    decode_args: dict[str, Any] = dict(
        model=model_dir, port=d_port, name=f"mt-decode{tag}", cores="1", log_dir=logs,
        extra_args=common, kv_transfer_config=launch.kvpush_config(
            "kv_both", d_kv, reuse=True, lease_s=lease_s))
    try:
        start = time.monotonic()
        prefill = fleet.add(launch.start_vllm(
            model_dir, p_port, name=f"mt-prefill{tag}", cores="0", log_dir=logs,
            extra_args=[*common, *prefill_extra],
            kv_transfer_config=launch.kvpush_config(
                "kv_both", p_kv, reuse=True, request_timeout_s=10.0, peer_timeout_s=3.0,
                heartbeat_s=0.5, kv_load_failure_policy="recompute", **prefill_kv)))
        decode = fleet.add(launch.start_vllm(**decode_args))
        launch.wait_healthy([prefill, decode], timeout_s=420)
        print(f"\nmulti-turn servers{tag} healthy after {time.monotonic() - start:.0f} s")
        yield ReusePair(fleet, prefill, decode, p_kv, decode_args)
    finally:
        fleet.stop()


@pytest.fixture(scope="module")
def reuse_pair(model_dir: Path, workdir: Path, colocated: Colocated) -> Iterator[ReusePair]:
    yield from _start_pair(model_dir, workdir / "logs-multiturn", "", LEASE_S,
                           ["--no-enable-prefix-caching"], reuse_load="always")


def first_prompt(seed: int, n: int = 200) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(10, 1000, n)]


def user_text(seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(10, 1000, USER_TOKENS)]


def check_colocated(colocated: Colocated, model_dir: Path, tag: str,
                    turns: dict[str, tuple[list[int], list[int]]]) -> None:
    """Every turn's tokens against one colocated instance's (prefix caching on)."""
    for name, (prompt, _) in turns.items():
        PROMPTS[name] = prompt
    ref = colocated.tokens(model_dir, list(turns), tag)
    for name, (_, tokens) in turns.items():
        assert tokens == ref[name], name


USAGE = "vllm:kv_cache_usage_perc"


def usage_settles(url: str, held: bool, timeout: float = 5.0) -> float:
    """The server's KV cache usage (kept blocks count, cached free ones do not), polled
    until it is above zero (``held``) or zero; its last value."""
    deadline = time.monotonic() + timeout
    value = launch.metrics(url).get(USAGE, -1.0)
    while (value > 0) != held and time.monotonic() < deadline:
        time.sleep(0.1)
        value = launch.metrics(url).get(USAGE, -1.0)
    return value


def test_a_streamed_decode_leg_keeps_nothing(reuse_pair: ReusePair, colocated: Colocated,
                                            model_dir: Path) -> None:
    """A streamed decode answer carries no ``kv_transfer_params`` (vLLM's OpenAI server
    drops them from a stream), so nobody could name a kept turn: the decode server keeps
    nothing and its blocks go back to vLLM at once (its prefix cache still holds them). The
    next turn has nothing to load back: the prefill computes it, and only the blocks past
    the decode's prefix-cache hit move forward, push and pull. A non-streamed turn after
    them is kept (the usage gauge shows it). Runs first: the decode server holds nothing."""
    pair, seed = reuse_pair, 50
    assert usage_settles(pair.decode.url, held=False) == 0.0
    prompt = first_prompt(seed)
    turns: dict[str, tuple[list[int], list[int]]] = {}
    history = 0
    for k, (mode, stream) in enumerate([("push", True), ("pull", True), ("push", False)]):
        back_before, fwd_before = moved(pair.prefill.url), moved(pair.decode.url)
        tokens, kept = pair.turn(prompt, mode, None, stream=stream)
        turns[f"mt-stream-{k}"] = (prompt, tokens)
        assert (kept is None) == stream, f"turn {k}"
        if stream:
            assert usage_settles(pair.decode.url, held=False) == 0.0, \
                f"turn {k}: a streamed turn holds blocks"
        else:
            assert usage_settles(pair.decode.url, held=True) > 0, f"turn {k}: not kept"
        fwd_blocks = -(-len(prompt) // BLOCK) - history // BLOCK
        assert settled(pair.decode.url, fwd_before, fwd_blocks * BYTES_PER_BLOCK) \
            == fwd_blocks * BYTES_PER_BLOCK, f"turn {k}: bytes moved forward"
        assert moved(pair.prefill.url) == back_before, f"turn {k}: nothing comes back"
        history = len(prompt) + len(tokens) - 1
        prompt = prompt + tokens + user_text(seed + k + 1)
    check_colocated(colocated, model_dir, "mt-stream", turns)


Turn = Callable[[list[int]], tuple[list[int], dict[str, Any] | None]]


def converse(pair: ReusePair, colocated: Colocated, model_dir: Path, tag: str, seed: int,
             send: Turn) -> None:
    """``TURNS`` turns of one conversation, each sent by ``send(prompt)`` -> (tokens, the
    decode's params or None where the client does not see them): every turn after the
    first loads what the decode server kept of the one before (the prefill's log says so),
    exactly those blocks move back and only the prompt's blocks past them move forward;
    every turn's tokens equal colocated."""
    prompt = first_prompt(seed)
    turns: dict[str, tuple[list[int], list[int]]] = {}
    history = 0            # tokens with KV at the decode server after the last turn
    mark = pair.prefill.log.stat().st_size
    for k in range(TURNS):
        back_before, fwd_before = moved(pair.prefill.url), moved(pair.decode.url)
        tokens, kept = send(prompt)
        turns[f"{tag}-{k}"] = (prompt, tokens)
        found, mark = decisions(pair.prefill.log, mark)
        assert [what for what, *_ in found] == (["loads"] if k else []), f"turn {k}: {found}"
        if kept is not None:
            assert kept["kvpush_reuse"]["kvpush_num_tokens"] == \
                (len(prompt) + len(tokens) - 1) // BLOCK * BLOCK
        # back: the kept blocks of the previous turn (this prefill caches nothing)
        back = history // BLOCK * BYTES_PER_BLOCK
        assert settled(pair.prefill.url, back_before, back) == back, \
            f"turn {k}: bytes moved back"
        fwd = (-(-len(prompt) // BLOCK) - history // BLOCK) * BYTES_PER_BLOCK
        assert settled(pair.decode.url, fwd_before, fwd) == fwd, \
            f"turn {k}: bytes moved forward"
        history = len(prompt) + len(tokens) - 1
        prompt = prompt + tokens + user_text(seed + k + 1)
    check_colocated(colocated, model_dir, tag, turns)


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_turns_match_colocated_and_move_only_what_is_lacking(
        reuse_pair: ReusePair, colocated: Colocated, model_dir: Path, mode: str) -> None:
    kept: dict[str, Any] | None = None

    def send(prompt: list[int]) -> tuple[list[int], dict[str, Any] | None]:
        nonlocal kept
        tokens, kept = reuse_pair.turn(prompt, mode, kept)
        assert kept is not None
        return tokens, kept

    converse(reuse_pair, colocated, model_dir, f"mt-{mode}", 100 if mode == "push" else 200,
             send)


@pytest.mark.parametrize("what", ["lease", "restart"])
def test_kept_turn_gone_recomputes(reuse_pair: ReusePair, colocated: Colocated,
                                   model_dir: Path, workdir: Path, what: str) -> None:
    """The next turn arrives after the decode server let its kept turn go (lease; pull:
    the ticket's lease has run out) or after it restarted (push: the new decode server
    never heard of the kept turn, the registration fails at the prefill's
    ``request_timeout_s``, well inside the lease the restart outlasts otherwise): the
    prefill's load fails, vLLM recomputes, the tokens are right."""
    seed, mode = (300, "pull") if what == "lease" else (400, "push")
    prompt = first_prompt(seed)
    tokens, kept = reuse_pair.turn(prompt, mode, None)
    turns = {f"mt-{what}-0": (prompt, tokens)}
    if what == "lease":
        time.sleep(LEASE_S + 1.0)
    else:
        reuse_pair.restart_decode(workdir)
    prompt = prompt + tokens + user_text(seed + 1)
    before = moved(reuse_pair.prefill.url)
    mark = reuse_pair.prefill.log.stat().st_size
    tokens, _ = reuse_pair.turn(prompt, mode, kept)
    turns[f"mt-{what}-1"] = (prompt, tokens)
    found, _ = decisions(reuse_pair.prefill.log, mark)
    assert [w for w, *_ in found] == ["loads"], found     # it tried
    assert moved(reuse_pair.prefill.url) == before        # nothing came back
    check_colocated(colocated, model_dir, f"mt-{what}", turns)


# -- a prefill instance that keeps prefix caching (sticky), and a second decode instance ----
@pytest.fixture(scope="module")
def sticky_pair(model_dir: Path, workdir: Path) -> Iterator[ReusePair]:
    """A prefill server with prefix caching (it holds a conversation's earlier prompts) and
    another decode server; the decode also stands for a conversation's second decode
    instance next to ``reuse_pair``'s."""
    yield from _start_pair(model_dir, workdir / "logs-multiturn-sticky", "-sticky", 60.0, [])


DECISION = re.compile(r"kvpush: request \S+: (loads|computes) the (\d+) kept tokens its "
                      r"prefix cache lacks \(estimated load (\S+)(?: ms)?, compute (\S+?)"
                      r"(?: ms)?(?:; ([^)]*))?\)")


def decisions(log: Path, since: int) -> tuple[list[tuple[str, int, float | None,
                                                        float | None, str]], int]:
    """The prefill's load-or-compute lines past byte ``since`` of its log (what it did, the
    tokens, both estimates in ms, why when the estimates did not decide), and the new end."""
    text = log.read_bytes()
    found = []
    for m in DECISION.finditer(text[since:].decode(errors="replace")):
        load, compute = (None if v == "unmeasured" else float(v) for v in m.group(3, 4))
        found.append((m.group(1), int(m.group(2)), load, compute, m.group(5) or ""))
    return found, len(text)


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_sticky_turns_load_or_compute_from_measured_costs(
        sticky_pair: ReusePair, colocated: Colocated, model_dir: Path, mode: str) -> None:
    """The prefill's prefix cache holds each previous prompt: only the previous answer's
    blocks are lacking. A turn decided before anything is measured loads them (it learns
    the link); every other one loads them only when its measured link beats its measured
    prefill time per token, and the bytes moved back say which it did (which way it goes
    depends on the machine: the rule is what is checked). The first prompt's length (28
    past a block boundary, each turn adding 32 tokens) makes every answer end in a block
    the prefill's prefix cache lacks. Both modes, on one pair of servers: the second
    conversation starts with what the first one measured."""
    pair, seed = sticky_pair, 500 if mode == "push" else 550
    prompt, kept = first_prompt(seed, 220), None
    turns: dict[str, tuple[list[int], list[int]]] = {}
    mark = pair.prefill.log.stat().st_size
    measured = 0        # turns decided from measured estimates of both costs
    cached = 0          # tokens of the previous prompt in the prefill's prefix cache
    for k in range(TURNS + 1):
        back_before = moved(pair.prefill.url)
        tokens, kept_next = pair.turn(prompt, mode, kept)
        turns[f"mt-sticky-{mode}-{k}"] = (prompt, tokens)
        found, mark = decisions(pair.prefill.log, mark)
        if k:
            assert kept is not None
            lacking = kept["kvpush_reuse"]["kvpush_num_tokens"] - cached
            ((what, tokens_lacking, load_ms, compute_ms, why),) = found
            assert tokens_lacking == lacking and 0 < lacking <= 2 * BLOCK
            if why:                                   # nothing measured, or far out: learn
                assert what == "loads", found
            else:                                     # the figures logged decide it
                assert load_ms is not None and compute_ms is not None, found
                assert (what == "loads") == (load_ms < compute_ms), found
                measured += 1
            back = lacking // BLOCK * BYTES_PER_BLOCK if what == "loads" else 0
            assert settled(pair.prefill.url, back_before, back) == back, f"turn {k}"
        else:
            assert not found
        kept, cached = kept_next, len(prompt) // BLOCK * BLOCK
        prompt = prompt + tokens + user_text(seed + k + 1)
    assert measured, "no turn was decided from measured costs"
    check_colocated(colocated, model_dir, f"mt-sticky-{mode}", turns)


def test_prefix_cache_holding_every_kept_token_moves_nothing(
        sticky_pair: ReusePair, colocated: Colocated, model_dir: Path) -> None:
    """The prefill server already computed the next turn's prompt (a client's earlier
    attempt): its prefix cache holds every kept token, nothing moves back, and the decode
    server's kept turn is let go at once."""
    pair, seed = sticky_pair, 600
    prompt = first_prompt(seed)
    tokens, kept = pair.turn(prompt, "pull", None)
    turns = {"mt-cached-0": (prompt, tokens)}
    prompt = prompt + tokens + user_text(seed + 1)
    status, _ = _post(pair.prefill.url + "/v1/completions",
                      {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0},
                      str(uuid.uuid4()), 120)
    assert status == 200
    before = moved(pair.prefill.url)
    tokens, _ = pair.turn(prompt, "pull", kept)
    turns["mt-cached-1"] = (prompt, tokens)
    time.sleep(0.5)
    assert moved(pair.prefill.url) == before
    check_colocated(colocated, model_dir, "mt-cached", turns)


def test_two_turns_of_one_conversation_in_flight_at_once(
        reuse_pair: ReusePair, colocated: Colocated, model_dir: Path) -> None:
    """Two next turns carry the same kept turn at once (a client sends both, or retries):
    one loads it, the other computes; both answer right and the kept blocks move back
    once."""
    seed = 700
    prompt = first_prompt(seed)
    tokens, kept = reuse_pair.turn(prompt, "push", None)
    turns = {"mt-twice-0": (prompt, tokens)}
    history = len(prompt) + len(tokens) - 1
    nexts = [prompt + tokens + user_text(seed + i) for i in (1, 2)]
    before = moved(reuse_pair.prefill.url)
    mark = reuse_pair.prefill.log.stat().st_size
    out: dict[int, list[int]] = {}
    threads = [threading.Thread(target=lambda i=i: out.update(
        {i: reuse_pair.turn(nexts[i], "push", kept)[0]}), daemon=True) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert sorted(out) == [0, 1]
    found, _ = decisions(reuse_pair.prefill.log, mark)
    assert len(found) == 1, found          # the other turn never considered the kept one
    back = history // BLOCK * BYTES_PER_BLOCK if found[0][0] == "loads" else 0
    assert settled(reuse_pair.prefill.url, before, back) == back
    time.sleep(0.5)
    assert moved(reuse_pair.prefill.url) - before == back          # once, not twice
    turns |= {f"mt-twice-{i + 1}": (nexts[i], out[i]) for i in (0, 1)}
    check_colocated(colocated, model_dir, "mt-twice", turns)


def test_a_turn_on_another_decode_instance(reuse_pair: ReusePair, sticky_pair: ReusePair,
                                           colocated: Colocated, model_dir: Path) -> None:
    """A conversation's next turn goes to another decode server (its own went away from
    the router, or the router has none for it): the prefill loads the kept turn from the
    old decode server and hands the turn to the new one; the turn after loads from the new
    one. No error; tokens equal colocated."""
    seed = 800
    moved_pair = ReusePair(reuse_pair.fleet, reuse_pair.prefill, sticky_pair.decode,
                           reuse_pair.prefill_kv, sticky_pair.decode_args)
    prompt = first_prompt(seed)
    turns: dict[str, tuple[list[int], list[int]]] = {}
    kept = None
    for k, (pair, mode) in enumerate([(reuse_pair, "pull"), (moved_pair, "pull"),
                                      (moved_pair, "push")]):
        before = moved(reuse_pair.prefill.url)
        mark = reuse_pair.prefill.log.stat().st_size
        tokens, kept_next = pair.turn(prompt, mode, kept)
        turns[f"mt-moved-{k}"] = (prompt, tokens)
        if kept is not None:
            found, _ = decisions(reuse_pair.prefill.log, mark)
            assert [w for w, *_ in found] == ["loads"], found
            back = kept["kvpush_reuse"]["kvpush_num_tokens"] // BLOCK * BYTES_PER_BLOCK
            assert settled(reuse_pair.prefill.url, before, back) == back, f"turn {k}"
        kept = kept_next
        prompt = prompt + tokens + user_text(seed + k + 1)
    check_colocated(colocated, model_dir, "mt-moved", turns)


# -- kvpush's router in front of the real pair ------------------------------------------------
@pytest.fixture(scope="module")
def reuse_router(reuse_pair: ReusePair, workdir: Path) -> Iterator[launch.Process]:
    """``examples/vllm/router.py`` in front of ``reuse_pair`` (the decode server's URL
    outlives its restart: same port)."""
    fleet = launch.Fleet()
    try:
        router = fleet.add(launch.start_router(
            launch.free_port(), prefill=reuse_pair.prefill.url, decode=reuse_pair.decode.url,
            log_dir=workdir / "logs-multiturn",
            args=["--producers", f"tcp://127.0.0.1:{reuse_pair.prefill_kv}"]))
        launch.wait_healthy([router], timeout_s=60)
        yield router
    finally:
        fleet.stop()


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_turns_through_kvpushs_router_reuse_the_kept_kv(
        reuse_pair: ReusePair, reuse_router: launch.Process, colocated: Colocated,
        model_dir: Path, mode: str) -> None:
    """A client that knows nothing of KV sends each turn (the whole conversation so far,
    not streamed, named by ``kvpush_conversation``) to kvpush's router: the router sends
    the next turn's prefill the ``kvpush_reuse`` of the decode answer before it, the prefill
    loads exactly the kept blocks, only the rest moves forward, and every turn's tokens
    equal colocated."""
    def send(prompt: list[int]) -> tuple[list[int], dict[str, Any] | None]:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "return_token_ids": True, "kvpush_mode": mode,
                "kvpush_conversation": f"router-{mode}"}
        status, out = _post(reuse_router.url + "/v1/completions", body, str(uuid.uuid4()), 120)
        assert status == 200, out
        return tokens_of(out), None

    converse(reuse_pair, colocated, model_dir, f"mt-router-{mode}",
             900 if mode == "push" else 950, send)
