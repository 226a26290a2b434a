"""Real vLLM, disaggregated through kvpush: a prefill server and a decode server (separate
processes on separate cores, CPU memory, NIXL/UCX) behind the example router must produce
exactly the tokens of a single colocated vLLM instance -- in push mode, in pull mode, with
decode-side prefix caching, and under concurrency; a prefill server killed mid-request must
turn into an error on the decode side (kv_load_failure_policy "fail"), never into a hang or
into wrong tokens.

The fault test kills the shared prefill server, so it comes last in this module.
"""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from conftest import BLOCK, LENGTHS, PROMPTS, Pair, tokens_of

from examples.vllm import launch

#: Bytes moved per block id: 4 layers x (32 tokens x 2 heads x 2*64 x bf16).
BYTES_PER_BLOCK = 4 * BLOCK * 2 * 128 * 2


def decode_metric(pair: Pair, name: str) -> float:
    return launch.metrics(pair.decode.url).get(name, 0.0)


def wait_metric(url: str, name: str, above: float, timeout: float = 10.0) -> float:
    """Prometheus values are recorded a step or two after the response: poll."""
    deadline = time.monotonic() + timeout
    value = launch.metrics(url).get(name, 0.0)
    while value <= above and time.monotonic() < deadline:
        time.sleep(0.1)
        value = launch.metrics(url).get(name, 0.0)
    return value


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_tokens_match_colocated(pair: Pair, reference: dict[str, list[int]], mode: str) -> None:
    for n in LENGTHS:
        status, body = pair.complete(PROMPTS[f"len{n}"], mode=mode)
        assert status == 200, body
        assert tokens_of(body) == reference[f"len{n}"], f"{mode}, {n}-token prompt"


def test_streaming_push(pair: Pair, reference: dict[str, list[int]]) -> None:
    status, body = pair.complete(PROMPTS["push-a"], mode="push", stream=True)
    assert status == 200
    assert body["chunks"] >= 2  # streamed, not one blob
    assert tokens_of(body) == reference["push-a"]
    status, body = pair.complete(PROMPTS["pull-a"], mode="pull", stream=True)
    assert status == 200
    assert tokens_of(body) == reference["pull-a"]


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_first_token_from_prefill_tokens_match_colocated(pair: Pair,
                                                        reference: dict[str, list[int]],
                                                        mode: str) -> None:
    """The router streams the prefill instance's first token, then the decode instance's
    stream without its own first token (examples/vllm/router.py, ``--first-token
    prefill``): every token still equals colocated's, and the answer says where the first
    came from."""
    for name in ("push-a", "pull-a"):
        status, body = pair.complete(PROMPTS[name], mode=mode, stream=True,
                                     first_token="prefill")
        assert status == 200
        assert body["first_token_from"] == "prefill"
        assert tokens_of(body) == reference[name], f"{mode}, {name}"


def test_concurrent_push_and_pull(pair: Pair, reference: dict[str, list[int]]) -> None:
    names = [f"conc{i}" for i in range(6)]
    with ThreadPoolExecutor(len(names)) as pool:
        futures = {n: pool.submit(pair.complete, PROMPTS[n], mode="push" if i % 2 else "pull")
                   for i, n in enumerate(names)}
        results = {n: f.result(timeout=180) for n, f in futures.items()}
    for name, (status, body) in results.items():
        assert status == 200, (name, body)
        assert tokens_of(body) == reference[name], name


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_decode_prefix_cache_moves_only_missing_blocks(pair: Pair, reference: dict[str, list[int]],
                                                      mode: str) -> None:
    """The second prompt shares 8 blocks with the first; the decode server already holds
    them (prefix cache), so only the rest may cross."""
    name = "vllm:kvpush_bytes_transferred_sum"
    moved = []
    for key in (f"{mode}-p1", f"{mode}-p2"):
        before = decode_metric(pair, name)
        status, body = pair.complete(PROMPTS[key], mode=mode)
        assert status == 200, body
        assert tokens_of(body) == reference[key], key
        moved.append(wait_metric(pair.decode.url, name, before) - before)
    blocks = [-(-len(PROMPTS[f"{mode}-p{i}"]) // BLOCK) for i in (1, 2)]
    assert moved[0] == blocks[0] * BYTES_PER_BLOCK
    assert moved[1] == (blocks[1] - 8) * BYTES_PER_BLOCK


def test_stats_and_blocks_released(pair: Pair) -> None:
    """Prometheus counters in vLLM's style, and every prefill block handed back."""
    decode = launch.metrics(pair.decode.url)
    assert decode.get("vllm:kvpush_num_push_total", 0) >= 8
    assert decode.get("vllm:kvpush_num_pull_total", 0) >= 8
    assert decode.get("vllm:kvpush_num_failed_total", 0) == 0
    assert decode.get("vllm:kvpush_xfer_time_seconds_count", 0) >= 16
    deadline = time.monotonic() + 10
    while True:
        prefill = launch.metrics(pair.prefill.url)
        if prefill.get("vllm:kv_cache_usage_perc", 1.0) == 0.0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert prefill.get("vllm:kv_cache_usage_perc") == 0.0, "prefill blocks still held"
    assert prefill.get("vllm:kvpush_num_released_total", 0) >= 16
    assert prefill.get("vllm:kvpush_num_lease_expired_total", 0) == 0


def test_decode_request_abandoned_while_waiting(pair: Pair, reference: dict[str, list[int]]
                                                ) -> None:
    """A push registration for which no prefill ever comes, whose client gives up: the
    decode server drops it (kvpush aborts the registration) and carries on."""
    tid = uuid.uuid4().hex
    body = {"model": "tiny", "prompt": PROMPTS["len200"], "max_tokens": 4, "temperature": 0,
            "kv_transfer_params": {"do_remote_prefill": True, "kvpush_id": tid,
                                   "kvpush_mode": "push",
                                   "kvpush_producers": [pair.producer_address]}}
    req = urllib.request.Request(pair.decode.url + "/v1/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with pytest.raises((TimeoutError, urllib.error.URLError)):
        urllib.request.urlopen(req, timeout=2.0)
    deadline = time.monotonic() + 15
    while launch.metrics(pair.decode.url).get("vllm:num_requests_waiting", 0) > 0:
        assert time.monotonic() < deadline, "the abandoned request is still waiting"
        time.sleep(0.2)
    status, out = pair.complete(PROMPTS["len40"], mode="push")
    assert status == 200 and tokens_of(out) == reference["len40"]


@pytest.mark.parametrize("how", ["pull", "push"])
def test_vllm_toy_proxy_schema_gets_exact_tokens(pair: Pair, reference: dict[str, list[int]],
                                                 how: str) -> None:
    """A client that speaks only vLLM's NIXL kv_transfer_params (vLLM's toy proxy: pull
    by the prefill's answer; push by one X-Request-Id sent to both at once)."""
    from toy_proxy import ToyProxy

    host, port = pair.producer_address.removeprefix("tcp://").rsplit(":", 1)
    proxy = ToyProxy(pair.prefill.url, pair.decode.url, prefill_kv_host=host,
                     prefill_kv_port=int(port))
    for name in ("len200", "len650"):
        body = {"model": "tiny", "prompt": PROMPTS[name], "max_tokens": len(reference[name]),
                "temperature": 0, "return_token_ids": True}
        status, out = getattr(proxy, how)(body)
        assert status == 200, out
        assert tokens_of(out) == reference[name], f"{how}, {name}"


def test_decode_of_another_model_is_refused_at_handshake(pair: Pair, model_dir: Path,
                                                          workdir: Path) -> None:
    """A decode server whose compatibility identity differs (here its ``model_id``) is
    refused by the prefill's kvpush endpoint: the request fails under the default
    ``kv_load_failure_policy`` ("fail") and the log names the field, instead of decoding
    another model's KV."""
    from toy_proxy import ToyProxy

    fleet = launch.Fleet()
    try:
        other = fleet.add(launch.start_vllm(
            model_dir, launch.free_port(), name="decode-other-model", cores="1",
            log_dir=workdir / "logs", extra_args=["-O0", "--max-num-seqs", "4"],
            kv_transfer_config=launch.kvpush_config("kv_consumer", model_id="another/model",
                                                    connect_timeout_s=5.0)))
        launch.wait_healthy([other], timeout_s=300)
        host, port = pair.producer_address.removeprefix("tcp://").rsplit(":", 1)
        proxy = ToyProxy(pair.prefill.url, other.url, prefill_kv_host=host,
                         prefill_kv_port=int(port))
        status, out = proxy.push({"model": "tiny", "prompt": PROMPTS["len200"],
                                  "max_tokens": 4, "temperature": 0}, timeout=60)
        assert status != 200, out
        assert "identity.model" in other.log.read_text(errors="replace")
    finally:
        fleet.stop()


def test_prefill_killed_mid_request(pair: Pair, reference: dict[str, list[int]]) -> None:
    """Last: kills the shared prefill server. Prefill in flight (the engine is frozen so it
    cannot finish), decode registered; the prefill server dies. The decode server must
    answer with an error within its peer timeout (3 s here), then keep serving."""
    tid = uuid.uuid4().hex
    prompt = PROMPTS["fault"]
    prefill_body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0,
                    "kv_transfer_params": {"do_remote_decode": True, "kvpush_id": tid,
                                           "kvpush_mode": "push"}}
    decode_body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0,
                   "return_token_ids": True,
                   "kv_transfer_params": {"do_remote_prefill": True, "kvpush_id": tid,
                                          "kvpush_mode": "push",
                                          "kvpush_producers": [pair.producer_address]}}
    # vLLM's IPC sockets are in the server's own folder, not the system's temp folder, and
    # go with it when it is killed (it cannot remove them itself).
    scratch = pair.prefill.scratch
    assert scratch is not None and any(p.is_socket() for p in scratch.iterdir()), scratch
    pair.prefill.signal_group(signal.SIGSTOP)
    out: dict[str, Any] = {}

    def send_prefill() -> None:
        try:
            out["prefill"] = launch.http_json(pair.prefill.url + "/v1/completions",
                                              prefill_body, timeout=20)
        except OSError as exc:
            out["prefill"] = exc

    threading.Thread(target=send_prefill, daemon=True).start()
    killer = threading.Timer(1.0, pair.prefill.kill)
    killer.start()
    start = time.monotonic()
    status, body = launch.http_json(pair.decode.url + "/v1/completions", decode_body,
                                    timeout=60)
    elapsed = time.monotonic() - start
    killer.join()
    assert not scratch.exists(), sorted(scratch.iterdir())
    finish = (body.get("choices") or [{}])[0].get("finish_reason")
    assert status >= 400 or finish == "error", (status, body)
    assert elapsed < 20, f"the decode server took {elapsed:.1f} s to give up"
    # No wrong tokens slipped out, and the decode server is fine.
    assert not (status == 200 and tokens_of(body) != reference["fault"])
    status, local = launch.http_json(pair.decode.url + "/v1/completions",
                                     {"model": "tiny", "prompt": PROMPTS["len200"],
                                      "max_tokens": 16, "temperature": 0,
                                      "return_token_ids": True}, timeout=60)
    assert status == 200 and tokens_of(local) == reference["len200"]
    assert decode_metric(pair, "vllm:kvpush_num_failed_total") >= 1
    # Through the router, a push now fails fast instead of waiting for a dead prefill.
    start = time.monotonic()
    status, body = pair.complete(PROMPTS["len40"], mode="push", timeout=60)
    assert status >= 400, body
    assert time.monotonic() - start < 20
