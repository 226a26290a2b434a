"""MLA (DeepSeek-style latent attention) through the connector's halves, without servers:
vLLM's MLA cache is one ``[blocks, tokens, kv_lora_rank + rope]`` tensor per layer, the same
on every TP rank. Each decode rank takes its copy from one prefill rank -- the same one for
every decode rank of a transfer, chosen per transfer so transfers spread over the prefill
ranks -- and the other prefill ranks send nothing and hand their blocks back at once. Bytes
are counted on every prefill rank and checked byte for byte on every decode rank.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from test_adapter_tp import PROMPT, Flow, ranks, wait_reported

from kvpush.integrations.vllm_common import EngineFacts, RankCoords, decode_params, wire_id
from kvpush.integrations.vllm_worker import layout_from_kv_caches
from kvpush.layout import replica_routes

_ids = itertools.count()


@pytest.mark.parametrize("shape", [(64, 16, 576), (64, 1, 16, 576)])
def test_mla_cache_tensors_make_a_latent_layout(shape: tuple[int, ...]) -> None:
    """vLLM 0.32 hands the CPU MLA cache over as [blocks, 1, 16, 576] (its unified
    [B, H, N, C] view); older shapes are [blocks, 16, 576]."""
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(*shape, dtype=torch.bfloat16)
              for i in range(3)}
    facts = EngineFacts(attn_backend="CPU_MLA", total_kv_heads=1, cache_kind="mla")
    for rank in (0, 1):  # every rank holds the whole latent
        lay = layout_from_kv_caches(caches, block_size=16, num_blocks=64, facts=facts,
                                    coords=RankCoords(tp_rank=rank, tp_size=2))
        assert (lay.cache_kind, lay.block_order, lay.num_kv_heads, lay.head_size) == \
            ("mla", "NL", 1, 576)
        assert lay.block_bytes == 16 * 576 * 2 and lay.num_regions == 3
        assert (lay.head_start, lay.total_kv_heads) == (0, 1)


def test_mla_beside_kv_caches_is_refused() -> None:
    caches = {"l.0": torch.zeros(8, 16, 576), "l.1": torch.zeros(8, 2, 16, 128)}
    with pytest.raises(NotImplementedError, match="MLA"):
        layout_from_kv_caches(caches, block_size=16)


def _tids(p_tp: int, d_tp: int, mode: str) -> list[str]:
    """Transfer ids that land on every prefill rank in turn."""
    out: dict[int, str] = {}
    for i in itertools.count():
        tid = f"mla-{mode}-{p_tp}{d_tp}-{i}-{next(_ids)}"
        # the sender is chosen by kvpush's id (the name and the prompt's fingerprint)
        out.setdefault(replica_routes(p_tp, d_tp, wire_id(tid, str(PROMPT))).producers[0][0],
                       tid)
        if len(out) == p_tp:
            return [out[p] for p in range(p_tp)]
    raise AssertionError("unreachable")


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 2), (2, 1)])
def test_mla_tp_each_decode_rank_takes_one_copy_from_one_prefill_rank(p_tp: int,
                                                                      d_tp: int) -> None:
    with ranks("kv_producer", p_tp, 1, kind="mla") as prefill, \
            ranks("kv_consumer", d_tp, 1, kind="mla") as dec:
        flow = Flow(prefill, dec)
        per_block = prefill[0].call("block_bytes")
        for mode, tid in [(m, t) for m in ("push", "pull") for t in _tids(p_tp, d_tp, m)]:
            src, dst = [9, 3, 4, 12], [1, 7, 8, 2]
            sender = replica_routes(p_tp, d_tp, wire_id(tid, str(PROMPT))).producers[0][0]
            before = [r.call("bytes_moved") for r in prefill]
            if mode == "push":
                r = flow.arrive(tid, decode_params(tid, [p.info["address"] for p in prefill]))
                flow.allocate(r, dst)
                rp, _ = flow.run_prefill(tid, mode, src)
            else:
                rp, out = flow.run_prefill(tid, mode, src)
                r = flow.arrive(tid, out)
                flow.allocate(r, dst)
            errors = wait_reported(dec, r.request_id, 1)
            assert errors == {d: set() for d in range(d_tp)}, (mode, errors)
            flow.check(dst, src)
            # Every prefill rank hands its blocks back (the ones that send nothing, at once).
            wait_reported(prefill, rp.request_id, 0, finished={rp.request_id})
            sent = [r.call("bytes_moved") - b for r, b in zip(prefill, before, strict=True)]
            # One copy per decode rank, all from the transfer's one sender: no duplicates.
            want = [d_tp * len(src) * per_block if p == sender else 0 for p in range(p_tp)]
            assert sent == want, (mode, tid, sent, want)
            for rank in prefill:
                assert rank.call("pending") == 0
