"""Layer-wise push through the connector's halves, without servers (``layerwise`` in the
adapter's config): the prefill rank hands each layer to ``Producer.layer_done`` from
``save_kv_layer`` while the forward pass goes on, and the decode rank registers layer by
layer. A layer lands on the decode side before the prefill's forward pass has ended; every
byte is right at the end; and either side alone layer-wise still moves the request whole.
"""

from __future__ import annotations

import itertools
import time
from types import SimpleNamespace

import pytest
from test_adapter_tp import PROMPT, Flow, ranks, wait_reported
from test_adapter_units import request

from kvpush.integrations.vllm_common import (
    PARAM_LAYERWISE,
    RemotePrefill,
    decode_params,
    prefill_params,
)
from kvpush.request import TransferMode

_ids = itertools.count()
SRC, DST = [9, 3, 4, 12], [1, 7, 8, 2]


def test_layer_zero_lands_while_later_layers_compute() -> None:
    with ranks("kv_producer", 1, 2, layerwise=True) as prefill, \
            ranks("kv_consumer", 1, 2, layerwise=True) as dec:
        flow = Flow(prefill, dec, layerwise=True)
        tid = f"lw-{next(_ids)}"
        r = flow.arrive(tid, decode_params(tid, [prefill[0].info["address"]]))
        flow.allocate(r, DST)
        for _ in range(15):   # connected, and the registration is at the producer
            dec[0].call("poll", set())
            time.sleep(0.02)
        rid = f"p-{tid}"
        rp = request(rid, prefill_params(tid, "push"), PROMPT)
        flow.p.on_new_request(rp)
        flow.p._kv_manager.blocks[rid] = SRC
        plan = flow.p.build_plan(SimpleNamespace(num_scheduled_tokens={rid: PROMPT}))
        prefill[0].call("forward_layers", (plan, 1))      # layer 0 done, layer 1 computing
        deadline = time.monotonic() + 20
        while not dec[0].call("landed", (DST, SRC, 0)):
            dec[0].call("poll", set())
            assert time.monotonic() < deadline, "layer 0 never landed during the forward"
            time.sleep(0.02)
        assert not dec[0].call("landed", (DST, SRC, 1))   # not sent before it is final
        dec[0].call("poll", set())
        assert r.request_id not in dec[0].reported[1]     # the request is not ready yet
        prefill[0].call("end_forward", set())
        assert wait_reported(dec, r.request_id, 1) == {0: set()}
        flow.check(DST, SRC)
        rp.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
        delay, out = flow.p.request_finished(rp, SRC)
        assert delay and out is not None and out[PARAM_LAYERWISE] is True
        wait_reported(prefill, rp.request_id, 0, finished={rp.request_id})


@pytest.mark.parametrize(("prefill_lw", "decode_lw"), [(True, False), (False, True)])
def test_one_side_layerwise_still_moves_the_request(prefill_lw: bool, decode_lw: bool) -> None:
    with ranks("kv_producer", 1, 2, layerwise=prefill_lw) as prefill, \
            ranks("kv_consumer", 1, 2, layerwise=decode_lw) as dec:
        flow = Flow(prefill, dec, layerwise=prefill_lw)
        for mode in ("push", "pull"):
            tid = f"lw1-{mode}-{next(_ids)}"
            if mode == "push":
                r = flow.arrive(tid, decode_params(tid, [prefill[0].info["address"]]))
                flow.allocate(r, DST)
                rp, _ = flow.run_prefill(tid, mode, SRC)
            else:
                rp, out = flow.run_prefill(tid, mode, SRC)
                assert PARAM_LAYERWISE not in out              # pull is never layer-wise
                r = flow.arrive(tid, out)
                flow.allocate(r, DST)
            assert wait_reported(dec, r.request_id, 1) == {0: set()}, mode
            flow.check(DST, SRC)
            wait_reported(prefill, rp.request_id, 0, finished={rp.request_id})


def test_the_request_says_layerwise_or_not() -> None:
    params = decode_params("t", ["tcp://127.0.0.1:1"], layerwise=True)
    assert RemotePrefill.parse(params, TransferMode.PUSH).layerwise is True
    assert RemotePrefill.parse(decode_params("t", ["tcp://h:1"]),
                               TransferMode.PUSH).layerwise is None
    with pytest.raises(ValueError, match=PARAM_LAYERWISE):
        RemotePrefill.parse({**params, PARAM_LAYERWISE: "yes"}, TransferMode.PUSH)
