"""Transfer names under the adapter: two requests naming one transfer never break each other,
and the two legs of a transfer pair only when they carry the same prompt (scheduler side with
stand-ins for vLLM's objects; real kvpush endpoints in this process for the pairing)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from test_adapter_units import Blocks, scheduler

import kvpush
from kvpush.integrations.vllm_common import (
    RemotePrefill,
    decode_params,
    prefill_params,
    prompt_fingerprint,
    wire_id,
)
from kvpush.integrations.vllm_scheduler import KVPushScheduler, RankInfo

NONE: dict[str, Any] = {}
FINISHED = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")


def request(req_id: str, params: dict[str, Any], tokens: list[int]) -> Any:
    return SimpleNamespace(request_id=req_id, kv_transfer_params=dict(params),
                           prompt_token_ids=list(tokens), num_prompt_tokens=len(tokens),
                           num_computed_tokens=0, status=SimpleNamespace(name="RUNNING"))


def prompt(seed: int, n: int = 100) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(7, 2048, n)]


def prefill_side() -> KVPushScheduler:
    s = scheduler("kv_producer")
    s.set_handshake({0: RankInfo("producer", "p0", "tcp://127.0.0.1:9", "127.0.0.1", 9)})
    return s


def last_chunk(s: KVPushScheduler, r: Any, blocks: list[int]) -> list[Any]:
    """Schedule ``r``'s whole prompt in one step: the sends that step plans."""
    s.on_new_request(r)
    s._kv_manager.blocks[r.request_id] = blocks
    return s.build_plan(SimpleNamespace(
        num_scheduled_tokens={r.request_id: r.num_prompt_tokens})).send


def idle(s: KVPushScheduler) -> Any:
    return s.build_plan(SimpleNamespace(num_scheduled_tokens=NONE))


# -- one name, two requests ------------------------------------------------------------------
def test_second_push_export_of_a_name_never_aborts_the_first() -> None:
    s = prefill_side()
    tokens = prompt(1)
    first, second = (request(r, prefill_params("client-id", "push"), tokens)
                     for r in ("p1", "p2"))
    (send,) = last_chunk(s, first, [1, 2, 3, 4])
    assert last_chunk(s, second, [5, 6, 7, 8]) == []     # refused: its decode pairs with p1
    second.status = FINISHED
    assert s.request_finished(second, [5, 6, 7, 8]) == (False, None)
    assert idle(s).send_aborts == []                     # p1's transfer is left alone
    first.status = FINISHED
    delay, params = s.request_finished(first, [1, 2, 3, 4])
    assert delay and params is not None and params["kvpush_id"] == "client-id"
    assert idle(s).send_aborts == []
    # Aborted before its prefill finished, while another request holds the name: no abort.
    third = request("p3", prefill_params("client-id", "push"), tokens)
    s.on_new_request(third)
    third.status = SimpleNamespace(name="FINISHED_ABORTED")
    assert s.request_finished(third, []) == (False, None)
    assert idle(s).send_aborts == []
    s.update_connector_output(SimpleNamespace(finished_sending={"p1"}, finished_recving=None))
    # Nobody holds it now: a request ending before its prefill did fails its registration.
    fourth = request("p4", prefill_params("client-id", "push"), tokens)
    s.on_new_request(fourth)
    fourth.status = SimpleNamespace(name="FINISHED_ABORTED")
    s.request_finished(fourth, [])
    assert idle(s).send_aborts == [(send.transfer_id, 0)]   # no send planned: unnamed


def test_second_pull_export_of_a_name_gets_its_own() -> None:
    s = prefill_side()
    tokens = prompt(2)
    out = []
    for req_id, blocks in (("p1", [1, 2, 3, 4]), ("p2", [5, 6, 7, 8])):
        r = request(req_id, prefill_params("client-id", "pull"), tokens)
        (send,) = last_chunk(s, r, blocks)
        r.status = FINISHED
        delay, params = s.request_finished(r, blocks)
        assert delay and params is not None
        remote = RemotePrefill.parse(params, kvpush.TransferMode.PUSH, "", "")
        ticket = kvpush.PullTicket.from_bytes(remote.tickets[0])
        assert remote.transfer_id == ticket.request_id == send.transfer_id
        out.append(send.transfer_id)
    assert out[0] != out[1] and all(t.startswith("client-id") for t in out)


def test_decode_requests_naming_one_transfer_never_share_it() -> None:
    d = scheduler("kv_consumer")
    tokens = prompt(3)
    params = decode_params("client-id", ["tcp://127.0.0.1:9"])
    first, second = request("d1", params, tokens), request("d2", params, tokens)
    for r in (first, second):
        d.on_new_request(r)
    assert d.get_num_new_matched_tokens(first, 0) == (100, True)
    assert d.get_num_new_matched_tokens(second, 0) == (0, False)   # computed here
    d.update_state_after_alloc(first, Blocks([1, 2, 3, 4]), 100)
    d.update_state_after_alloc(second, Blocks([5, 6, 7, 8]), 0)
    plan = idle(d)
    assert [(c.req_id, c.remote.transfer_id) for c in plan.recv] == \
        [("d1", wire_id("client-id", prompt_fingerprint(100, tokens)))]
    # The second one's finish says nothing about the first's transfer.
    second.status = FINISHED
    assert d.request_finished(second, [5, 6, 7, 8]) == (False, None)
    assert not idle(d)
    first.status = FINISHED
    assert d.request_finished(first, [1, 2, 3, 4]) == (True, None)
    assert idle(d).recv_aborts == ["d1"]


# -- one name, two prompts -------------------------------------------------------------------
def test_prompt_fingerprint_names_the_tokens_not_only_their_count() -> None:
    a, b = prompt(4), prompt(5)
    assert prompt_fingerprint(100, a) == prompt_fingerprint(100, list(a))
    assert prompt_fingerprint(100, a) != prompt_fingerprint(100, b)
    assert prompt_fingerprint(100, None) == "100"
    assert wire_id("x", "") == "x"


def test_push_legs_of_different_prompts_get_different_kvpush_ids() -> None:
    s, d = prefill_side(), scheduler("kv_consumer")
    (send,) = last_chunk(s, request("p1", prefill_params("rid", "push"), prompt(6)),
                         [1, 2, 3, 4])
    r = request("d1", decode_params("rid", ["tcp://127.0.0.1:9"]), prompt(7))
    assert d.get_num_new_matched_tokens(r, 0) == (100, True)    # nothing tells it here...
    d.update_state_after_alloc(r, Blocks([1, 2, 3, 4]), 100)
    (recv,) = idle(d).recv
    assert recv.remote.transfer_id != send.transfer_id           # ... but they never pair


def test_push_registration_for_another_prompt_is_never_written() -> None:
    # The ids the two legs derive, on real endpoints: the source stays unpaired (its lease
    # hands it back), the registration never becomes READY over the other prompt's bytes.
    bufs = [np.full((8, 4096), 7, np.uint8) for _ in range(2)]
    layout = kvpush.KVLayout.from_buffers(bufs, num_layers=2, num_blocks=8,
                                          tokens_per_block=16, num_kv_heads=2, head_size=32,
                                          dtype="float16")
    dst_bufs = [np.zeros((8, 4096), np.uint8) for _ in range(2)]
    dst_layout = kvpush.KVLayout.from_buffers(dst_bufs, num_layers=2, num_blocks=8,
                                              tokens_per_block=16, num_kv_heads=2,
                                              head_size=32, dtype="float16")
    config = kvpush.ProducerConfig(lease_s=1.0)
    with kvpush.Producer(layout, config) as producer, kvpush.Consumer(dst_layout) as consumer:
        name = consumer.connect(producer.address, timeout=10)
        producer.prefill_done(wire_id("rid", prompt_fingerprint(100, prompt(8))),
                              np.arange(4))
        result = consumer.expect(wire_id("rid", prompt_fingerprint(100, prompt(9))),
                                 np.arange(4), name, timeout=2.0).wait(10)
        assert not result.ok
        assert all(not b.any() for b in dst_bufs)


def test_decode_refuses_a_prefill_response_for_another_prompt() -> None:
    s, d = prefill_side(), scheduler("kv_consumer")
    pr = request("p1", prefill_params("rid", "pull"), prompt(10))
    (send,) = last_chunk(s, pr, [1, 2, 3, 4])
    pr.status = FINISHED
    _, response = s.request_finished(pr, [1, 2, 3, 4])
    assert response is not None and response["kvpush_prompt"] == \
        prompt_fingerprint(100, prompt(10))
    same_length = request("d1", response, prompt(11))
    assert d.get_num_new_matched_tokens(same_length, 0) == (0, False)
    d.update_state_after_alloc(same_length, Blocks([1, 2, 3, 4]), 0)
    # Nothing moves, but the prefill's source is named, so the producer lets it go at once.
    (recv,) = idle(d).recv
    assert recv.dst == [] and not recv.report and recv.remote.transfer_id == send.transfer_id
    right = request("d2", response, prompt(10))
    assert scheduler("kv_consumer").get_num_new_matched_tokens(right, 0) == (100, True)


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_both_legs_of_one_prompt_name_one_transfer(mode: str) -> None:
    s, d = prefill_side(), scheduler("kv_consumer")
    tokens = prompt(12)
    pr = request("p1", prefill_params("rid", mode), tokens)
    (send,) = last_chunk(s, pr, [1, 2, 3, 4])
    pr.status = FINISHED
    _, response = s.request_finished(pr, [1, 2, 3, 4])
    assert response is not None
    params = response if mode == "pull" else decode_params("rid", ["tcp://127.0.0.1:9"])
    r = request("d1", params, tokens)
    assert d.get_num_new_matched_tokens(r, 0) == (100, True)
    d.update_state_after_alloc(r, Blocks([1, 2, 3, 4]), 100)
    (recv,) = idle(d).recv
    assert recv.remote.transfer_id == send.transfer_id
