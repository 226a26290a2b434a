"""What two sides' layouts say about a block's interior and about their engines, and what
``check_compatible`` makes of it: converted (tokens per block, any known order) or refused
with the field named. No endpoints: a conversion is checked byte by byte by copying the
descriptor pairs the compiled planner emits between the tables the agent prepares, which is
what NIXL does with them."""

from __future__ import annotations

import ctypes

import msgspec
import numpy as np
import pytest

from kvpush import LayoutMismatch, check_compatible
from kvpush.layout import KVLayout, LayoutWire
from kvpush.plan import plan_split_transfer

HEADS, HEAD_SIZE = 2, 8


class Cache:
    """A cache over numpy buffers whose element values name (token, head, K/V, element)."""

    def __init__(self, *, tokens: int, order: str, packed: bool, num_blocks: int = 16,
                 num_layers: int = 2, identity: tuple[tuple[str, str], ...] = (),
                 kernel_tokens: int = 0, dtype: str = "float16") -> None:
        self.tokens, self.order, self.packed = tokens, order, packed
        per_block = tokens * HEADS * HEAD_SIZE * (2 if packed else 1)
        regions = num_layers * (1 if packed else 2)
        self.buffers = [np.zeros((num_blocks, per_block), np.uint16) for _ in range(regions)]
        self.layout = KVLayout.from_buffers(
            self.buffers, num_layers=num_layers, num_blocks=num_blocks,
            tokens_per_block=tokens, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=dtype,
            kv_packed=packed, block_order=order, kernel_tokens=kernel_tokens,
            identity=identity)

    def _shape(self) -> list[int]:
        sizes = {"H": HEADS, "N": self.tokens, "D": HEAD_SIZE, "K": 2}
        return [sizes[a] for a in self.order]

    def canonical(self, region: int, ids: np.ndarray) -> np.ndarray:
        """The request's KV in one region as [tokens, heads, (K/V,) elements]."""
        blocks = self.buffers[region][ids].reshape([len(ids), *self._shape()])
        want = "NHKD" if "K" in self.order else "NHD"
        perm = [0] + [1 + self.order.index(a) for a in want]
        out = blocks.transpose(perm)
        return out.reshape([-1, *out.shape[2:]])

    def fill(self, ids: np.ndarray, seed: int) -> None:
        """Token t of the request (block ids[t // tokens]) gets values naming (t, head,
        K/V, element) in every region."""
        for r, buf in enumerate(self.buffers):
            view = buf.reshape([buf.shape[0], *self._shape()])
            idx = np.indices(view.shape[1:])
            axes = {a: idx[i] for i, a in enumerate(self.order)}
            for pos, b in enumerate(ids):
                token = pos * self.tokens + axes["N"]
                kv = axes.get("K", 0)
                view[b] = ((token * 7 + axes["H"] * 3 + kv) * 16 + axes["D"] + r * 5 + seed) \
                    % 65521


def fake_push(src: Cache, dst: Cache, src_ids: np.ndarray, dst_ids: np.ndarray) -> None:
    """The producer's side of a split transfer (agent.add_peer + Link.plan), with memmove
    standing for NIXL."""
    check_compatible(src.layout, dst.layout)
    check_compatible(dst.layout, src.layout)
    lo, hi = sorted((src.tokens, dst.tokens))
    k = hi // lo
    local_split = k if src.tokens > dst.tokens else 1
    remote_split = k if local_split == 1 else 1
    local_table = src.layout.split_table(local_split)
    remote_table = dst.layout.split_table(remote_split)
    units = src.layout.token_units
    assert units == dst.layout.token_units and units is not None
    plan = plan_split_transfer(src_ids, dst_ids, src.layout.num_blocks, dst.layout.num_blocks,
                               src.layout.num_regions, units, local_split, remote_split)
    for li, ri in zip(plan.local_indices, plan.remote_indices, strict=True):
        assert local_table[li, 1] == remote_table[ri, 1]
        ctypes.memmove(int(remote_table[ri, 0]), int(local_table[li, 0]),
                       int(local_table[li, 1]))


CONVERTIBLE = [("HKND", True), ("HNKD", True), ("NHKD", True), ("HND", False),
               ("NHD", False)]


@pytest.mark.parametrize(("order", "packed"), CONVERTIBLE)
@pytest.mark.parametrize(("p_tokens", "d_tokens"), [(4, 8), (8, 4), (4, 16)])
def test_block_size_conversion_keeps_every_token_in_place(order: str, packed: bool,
                                                          p_tokens: int, d_tokens: int) -> None:
    src = Cache(tokens=p_tokens, order=order, packed=packed)
    dst = Cache(tokens=d_tokens, order=order, packed=packed)
    total = 32
    src_ids = np.random.default_rng(0).choice(16, total // p_tokens, replace=False)
    dst_ids = np.random.default_rng(1).choice(16, total // d_tokens, replace=False)
    src.fill(src_ids, seed=3)
    fake_push(src, dst, src_ids.astype(np.int64), dst_ids.astype(np.int64))
    for r in range(src.layout.num_regions):
        assert np.array_equal(src.canonical(r, src_ids), dst.canonical(r, dst_ids)), r
    untouched = np.setdiff1d(np.arange(16), dst_ids)
    assert all((buf[untouched] == 0).all() for buf in dst.buffers)


def test_cpu_order_cuts_k_and_v_apart() -> None:
    # vLLM's CPU cache: per head all of K, then all of V. Cutting a head into token slots
    # (the old rule) would give the fine side K of tokens 0-7 where it wants K then V.
    lay = Cache(tokens=8, order="HKND", packed=True).layout
    assert lay.token_units == 2 * HEADS
    assert Cache(tokens=8, order="HNKD", packed=True).layout.token_units == HEADS
    assert Cache(tokens=8, order="NHD", packed=False).layout.token_units == 1


@pytest.mark.parametrize(("a", "b", "field"), [
    (dict(order="NHD", packed=False), dict(order="HND", packed=False), "block_order"),
    (dict(order="HKND", packed=True), dict(order="HNKD", packed=True), "block_order"),
    # opaque per-token content: equal sizes only
    (dict(order="HNC", packed=True), dict(order="HNC", packed=True, tokens=8),
     "tokens_per_block"),
    # folded kernel blocks: only an identical block reads the same
    (dict(order="HND", packed=False, tokens=8, kernel_tokens=4),
     dict(order="HND", packed=False, tokens=8), "kernel_tokens"),
    (dict(order="HND", packed=False, tokens=8, kernel_tokens=4),
     dict(order="HND", packed=False, tokens=4), "tokens_per_block"),
    (dict(order="HND", packed=False, dtype="float8_e4m3fn"),
     dict(order="HND", packed=False, dtype="float8_e5m2"), "dtype"),
])
def test_unconvertible_interiors_are_refused_naming_the_field(a: dict, b: dict,
                                                              field: str) -> None:
    a.setdefault("tokens", 4)
    b.setdefault("tokens", 4)
    left, right = Cache(**a).layout, Cache(**b).layout
    for x, y in ((left, right), (right, left)):
        with pytest.raises(LayoutMismatch) as info:
            check_compatible(x, y)
        assert info.value.field == field


IDENTITY = (("model", "org/m"), ("revision", "abc"), ("cache_dtype", "auto"),
            ("attn_backend", "CPU_ATTN"), ("kvpush_protocol", "2"), ("vllm", "0.32"))


@pytest.mark.parametrize(("key", "value"), [("model", "org/other"), ("cache_dtype", "fp8"),
                                            ("attn_backend", "FLASH_ATTN"),
                                            ("kvpush_protocol", "1"), ("vllm", "0.33")])
def test_a_different_engine_is_refused_naming_what_differs(key: str, value: str) -> None:
    other = tuple((k, value if k == key else v) for k, v in IDENTITY)
    ours = Cache(tokens=4, order="HKND", packed=True, identity=IDENTITY).layout
    theirs = Cache(tokens=4, order="HKND", packed=True, identity=other).layout
    with pytest.raises(LayoutMismatch) as info:
        check_compatible(ours, theirs)
    assert info.value.field == f"identity.{key}"
    assert value in str(info.value)
    check_compatible(ours, Cache(tokens=4, order="HKND", packed=True,
                                 identity=IDENTITY[::-1]).layout)  # order of keys: no matter


def test_an_identity_on_one_side_only_is_refused() -> None:
    ours = Cache(tokens=4, order="HND", packed=False, identity=IDENTITY).layout
    theirs = Cache(tokens=4, order="HND", packed=False).layout
    with pytest.raises(LayoutMismatch) as info:
        check_compatible(ours, theirs)
    assert info.value.field == "identity.attn_backend" and info.value.remote is None


def test_identity_and_interior_travel_in_the_wire_form() -> None:
    lay = Cache(tokens=8, order="HKND", packed=True, identity=IDENTITY,
                kernel_tokens=4).layout
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(lay.to_wire()), type=LayoutWire)
    back = KVLayout.from_wire(wire)
    assert back == lay
    assert (back.block_order, back.kernel_tokens, dict(back.identity)["model"]) == \
        ("HKND", 4, "org/m")


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(kv_packed=False, block_order="HNKD"), "block_order"),
    (dict(kv_packed=True, block_order="HND"), "block_order"),
    (dict(kernel_tokens=3), "kernel_tokens"),
    (dict(identity=(("a", "1"), ("a", "2"))), "twice"),
])
def test_bad_interior_fields_are_refused_at_construction(kwargs: dict, match: str) -> None:
    buffers = [np.zeros((4, 1024), np.uint8) for _ in range(2 if kwargs.get(
        "kv_packed", True) else 4)]
    kv_packed = kwargs.pop("kv_packed", True)
    with pytest.raises(ValueError, match=match):
        KVLayout.from_buffers(buffers, num_layers=2, num_blocks=4, tokens_per_block=8,
                              num_kv_heads=2, head_size=16 if kv_packed else 32,
                              dtype="float16", kv_packed=kv_packed, **kwargs)


# -- through a real handshake (Producer and Consumer over NIXL, nothing transferred) --------
@pytest.mark.parametrize(("theirs", "field"), [
    (dict(identity=tuple((k, "org/other" if k == "model" else v) for k, v in IDENTITY)),
     "identity.model"),
    (dict(identity=tuple((k, "fp8_e5m2" if k == "cache_dtype" else v) for k, v in IDENTITY)),
     "identity.cache_dtype"),
    (dict(order="HNKD"), "block_order"),
    (dict(order="HNC", tokens=8), "block_order"),
    (dict(dtype="bfloat16"), "dtype"),
])
def test_handshake_refuses_naming_the_field(theirs: dict, field: str) -> None:
    import kvpush

    base = dict(tokens=4, order="HKND", packed=True, identity=IDENTITY)
    src = Cache(**base)
    dst = Cache(**{**base, **theirs})
    with kvpush.Producer(src.layout) as p, kvpush.Consumer(dst.layout) as c:
        with pytest.raises(LayoutMismatch) as info:
            c.connect(p.address, timeout=10)
        assert info.value.field == field
        assert c.producers() == []


def test_handshake_accepts_a_convertible_block_size() -> None:
    import kvpush

    src = Cache(tokens=4, order="HKND", packed=True, identity=IDENTITY)
    dst = Cache(tokens=16, order="HKND", packed=True, identity=IDENTITY)
    with kvpush.Producer(src.layout) as p, kvpush.Consumer(dst.layout) as c:
        assert c.connect(p.address, timeout=10) in c.producers()
