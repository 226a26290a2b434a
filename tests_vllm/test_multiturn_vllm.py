"""Real vLLM, multi-turn reuse through kvpush: one prefill and one decode server (both
``kv_both`` with ``reuse`` on; the prefill without prefix caching, as a prefill pool that does
not keep conversations), driven the way a proxy written for vLLM's ``NixlConnector``
``bidirectional_kv_xfer`` drives them: each turn's prefill request carries the previous
decode response's ``kv_transfer_params`` as they came. Every turn's tokens must equal a
colocated vLLM instance's (prefix caching on), and the bytes moved each way must be exactly
the blocks the receiving side lacks. The lease and a decode restart between turns must end
in a recompute with the right tokens, never an error.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import BLOCK, MAX_TOKENS, PROMPTS, Colocated, tokens_of
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

    def turn(self, prompt: list[int], mode: str, kept: dict[str, Any] | None
             ) -> tuple[list[int], dict[str, Any] | None]:
        """One turn as a vLLM bidirectional proxy runs it (decode leg not streamed: that is
        where vLLM returns ``kv_transfer_params``). Returns (tokens, the decode's params)."""
        body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS,
                "temperature": 0, "return_token_ids": True}
        rid = str(uuid.uuid4())
        first = prefill_body(body)
        if kept:
            first["kv_transfer_params"] = {**kept, "do_remote_decode": True,
                                           "do_remote_prefill": False}
        first["kv_transfer_params"]["transfer_mode"] = mode
        if mode == "pull":
            status, answer = _post(self.prefill.url + "/v1/completions", first, rid, 120)
            assert status == 200, answer
            second = dict(body, kv_transfer_params=answer["kv_transfer_params"])
            status, out = _post(self.decode.url + "/v1/completions", second, rid, 120)
        else:
            result: dict[str, Any] = {}
            t = threading.Thread(target=lambda: result.update(
                p=_post(self.prefill.url + "/v1/completions", first, rid, 120)), daemon=True)
            t.start()
            second = decode_body_push(body, engine_id="prefill", host="127.0.0.1",
                                      port=self.prefill_kv, tp_size=1, request_id=rid)
            second["kv_transfer_params"]["transfer_mode"] = "push"
            status, out = _post(self.decode.url + "/v1/completions", second, rid, 120)
            t.join(120)
            assert result["p"][0] == 200, result["p"]
        assert status == 200, out
        return tokens_of(out), out.get("kv_transfer_params")

    def restart_decode(self, workdir: Path) -> None:
        self.decode.stop()
        self.decode = self.fleet.add(launch.start_vllm(**self.decode_args))
        launch.wait_healthy([self.decode], timeout_s=420)


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


@pytest.fixture(scope="module")
def reuse_pair(model_dir: Path, workdir: Path, colocated: Colocated) -> Iterator[ReusePair]:
    fleet = launch.Fleet()
    logs = workdir / "logs-multiturn"
    p_kv, d_kv, p_port, d_port = (launch.free_port() for _ in range(4))
    common = ["-O0", "--max-num-seqs", "8"]
    decode_args: dict[str, Any] = dict(
        model=model_dir, port=d_port, name="mt-decode", cores="1", log_dir=logs,
        extra_args=common, kv_transfer_config=launch.kvpush_config(
            "kv_both", d_kv, reuse=True, lease_s=LEASE_S))
    try:
        start = time.monotonic()
        prefill = fleet.add(launch.start_vllm(
            model_dir, p_port, name="mt-prefill", cores="0", log_dir=logs,
            extra_args=[*common, "--no-enable-prefix-caching"],
            kv_transfer_config=launch.kvpush_config(
                "kv_both", p_kv, reuse=True, request_timeout_s=10.0, peer_timeout_s=3.0,
                heartbeat_s=0.5, kv_load_failure_policy="recompute")))
        decode = fleet.add(launch.start_vllm(**decode_args))
        launch.wait_healthy([prefill, decode], timeout_s=420)
        print(f"\nmulti-turn servers healthy after {time.monotonic() - start:.0f} s")
        yield ReusePair(fleet, prefill, decode, p_kv, decode_args)
    finally:
        fleet.stop()


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


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_turns_match_colocated_and_move_only_what_is_lacking(
        reuse_pair: ReusePair, colocated: Colocated, model_dir: Path, mode: str) -> None:
    seed = 100 if mode == "push" else 200
    prompt, kept = first_prompt(seed), None
    turns: dict[str, tuple[list[int], list[int]]] = {}
    history = 0            # tokens with KV at the decode server after the last turn
    for k in range(TURNS):
        back_before, fwd_before = moved(reuse_pair.prefill.url), moved(reuse_pair.decode.url)
        tokens, kept = reuse_pair.turn(prompt, mode, kept)
        turns[f"mt-{mode}-{k}"] = (prompt, tokens)
        assert kept is not None and kept["kvpush_reuse"]["kvpush_num_tokens"] == \
            (len(prompt) + len(tokens) - 1) // BLOCK * BLOCK
        # back: the kept blocks of the previous turn (this prefill caches nothing)
        back_blocks = history // BLOCK
        assert settled(reuse_pair.prefill.url, back_before, back_blocks * BYTES_PER_BLOCK) \
            == back_blocks * BYTES_PER_BLOCK, f"turn {k}: bytes moved back"
        # forward: only the prompt's blocks past those the decode server kept
        fwd_blocks = -(-len(prompt) // BLOCK) - history // BLOCK
        assert settled(reuse_pair.decode.url, fwd_before, fwd_blocks * BYTES_PER_BLOCK) \
            == fwd_blocks * BYTES_PER_BLOCK, f"turn {k}: bytes moved forward"
        history = len(prompt) + len(tokens) - 1
        prompt = prompt + tokens + user_text(seed + k + 1)
    check_colocated(colocated, model_dir, f"mt-{mode}", turns)


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
    tokens, _ = reuse_pair.turn(prompt, mode, kept)
    turns[f"mt-{what}-1"] = (prompt, tokens)
    assert moved(reuse_pair.prefill.url) == before        # nothing came back
    check_colocated(colocated, model_dir, f"mt-{what}", turns)
