"""MLA caches (``cache_kind="mla"``): one latent vector per token and layer, no K/V split, no
heads to shard. Their layout, what a K/V cache of the same byte size meets (refused, naming
``cache_kind``: by ``check_compatible`` and by a handshake), and the routes that send each
transfer's latent from one tensor-parallel rank only. A real push and pull of MLA blocks is
``tests/endpoint/test_mla_transfer.py``."""

from __future__ import annotations

from collections import Counter

import msgspec
import numpy as np
import pytest

import kvpush
from kvpush import LayoutMismatch, check_compatible
from kvpush.layout import KVLayout, LayoutWire, replica_routes
from tests.support.harness import MLA_IDENTITY as IDENTITY
from tests.support.harness import MLA_LATENT as LATENT
from tests.support.harness import make_mla_cache as mla


def test_an_mla_block_is_its_latent_vectors_no_kv_pair() -> None:
    _, lay = mla(tokens=16)
    assert lay.block_bytes == 16 * LATENT * 2            # no factor 2 for K and V
    assert (lay.block_order, lay.num_regions, lay.token_units, lay.replicated) == \
        ("NL", 2, 1, True)
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(lay.to_wire()), type=LayoutWire)
    assert KVLayout.from_wire(wire) == lay


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(num_kv_heads=2, head_size=LATENT // 2), "num_kv_heads=1"),
    (dict(block_order="HNC"), "MLA"),
    (dict(kv_packed=False), "kv_packed"),
    (dict(cache_kind="ssm"), "cache_kind"),
])
def test_bad_mla_layouts_are_refused_at_construction(kwargs: dict, match: str) -> None:
    fields = dict(num_layers=2, num_blocks=4, tokens_per_block=8, num_kv_heads=1,
                  head_size=LATENT, dtype="bfloat16", cache_kind="mla")
    fields.update(kwargs)
    regions = 4 if not fields.get("kv_packed", True) else 2
    with pytest.raises(ValueError, match=match):
        KVLayout.from_buffers([np.zeros((4, 8 * LATENT), np.uint16) for _ in range(regions)],
                              **fields)


def kv_twin(tokens: int) -> KVLayout:
    """A K/V cache whose blocks have the MLA cache's byte size (2 heads of LATENT/4, K+V)."""
    buffers = [np.zeros((16, tokens * LATENT), np.uint16) for _ in range(2)]
    return KVLayout.from_buffers(buffers, num_layers=2, num_blocks=16, tokens_per_block=tokens,
                                 num_kv_heads=2, head_size=LATENT // 4, dtype="bfloat16",
                                 identity=IDENTITY)


def test_a_kv_cache_of_the_same_size_is_refused_naming_cache_kind() -> None:
    _, ours = mla(tokens=16)
    theirs = kv_twin(16)
    assert ours.block_bytes == theirs.block_bytes
    with pytest.raises(LayoutMismatch) as info:
        check_compatible(ours, theirs)
    assert (info.value.field, info.value.local, info.value.remote) == ("cache_kind", "mla", "kv")
    # ... and by a real handshake, before anything moves.
    with kvpush.Producer(ours) as p, kvpush.Consumer(theirs) as c:
        with pytest.raises(LayoutMismatch) as info:
            c.connect(p.address, timeout=10)
        assert info.value.field == "cache_kind" and c.producers() == []


def test_replica_routes_send_each_transfer_from_one_rank_spread_over_ranks() -> None:
    for p_tp, c_tp in [(1, 1), (2, 2), (2, 1), (1, 4), (4, 2)]:
        for i in range(20):
            r = replica_routes(p_tp, c_tp, f"req-{i}")
            (sender,) = {ranks for ranks in r.producers}
            assert len(sender) == 1 and r.sharers[sender[0]] == c_tp
            assert sum(r.sharers) == c_tp               # no other rank sends a byte
            assert [r.sends(p) for p in range(p_tp)] == [p == sender[0] for p in range(p_tp)]
            assert replica_routes(p_tp, 7, f"req-{i}").producers[0] == sender  # one answer
    load = Counter(replica_routes(4, 2, f"r{i}").producers[0][0] for i in range(400))
    assert set(load) == {0, 1, 2, 3} and min(load.values()) > 60
    with pytest.raises(ValueError, match="producer_tp"):
        replica_routes(0, 1, "x")
