"""kvpush._core (C++) against tests.support.reference (numpy): same results, same errors.

Generated inputs go through both implementations; where one raises, the other must raise
the same class with the same message. The Python-free C++ core has its own test,
csrc/tests/run.sh, which the last test here runs.
"""

from __future__ import annotations

import ast
import random
import re
import shutil
import subprocess
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvpush import _core
from kvpush.errors import InvalidBlockIds
from tests.support import ROOT
from tests.support import reference as _reference

IMPLS = [pytest.param(_core, id="compiled"), pytest.param(_reference, id="reference")]
SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def outcome(fn: Callable[..., Any], *args: Any) -> tuple[str, Any]:
    """("ok", result) or ("raised", (exception class, message))."""
    try:
        return "ok", fn(*args)
    except Exception as exc:  # compared, not swallowed
        return "raised", (type(exc), str(exc))


def assert_same_plan(got: Any, want: Any) -> None:
    for name in ("local_indices", "remote_indices", "runs"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype, name
        assert a.shape == b.shape, name
        np.testing.assert_array_equal(a, b, err_msg=name)
        assert not a.flags.writeable, name
    for name in ("num_blocks", "num_regions", "num_runs", "num_descriptors"):
        assert getattr(got, name) == getattr(want, name), name
    assert repr(got) == repr(want)


def assert_same_outcome(fn_name: str, *args: Any) -> tuple[str, Any]:
    got = outcome(getattr(_core, fn_name), *args)
    want = outcome(getattr(_reference, fn_name), *args)
    assert got[0] == want[0], (got, want)
    if got[0] == "raised":
        assert got[1] == want[1]
    elif fn_name == "plan_transfer":
        assert_same_plan(got[1], want[1])
    else:
        assert got[1].dtype == want[1].dtype
        np.testing.assert_array_equal(got[1], want[1])
    return got


# ---------------------------------------------------------------------------------------
# plan_transfer


def _ids(rng: np.random.Generator, n: int, num_blocks: int, runny: bool) -> np.ndarray:
    """n distinct ids in [0, num_blocks): scattered, or mostly consecutive (runny)."""
    if not runny:
        return rng.choice(num_blocks, n, replace=False)
    window = min(num_blocks, n + int(rng.integers(0, 4)))
    start = int(rng.integers(0, num_blocks - window + 1))
    return np.sort(rng.choice(window, n, replace=False)) + start


@st.composite
def plan_args(draw: st.DrawFn) -> tuple[Any, ...]:
    sizes = st.one_of(st.integers(1, 40), st.integers(1, 3000), st.integers(1, 2**21))
    local_blocks, remote_blocks = draw(sizes), draw(sizes)
    regions = draw(st.integers(1, 6))
    most = min(local_blocks, remote_blocks, 300)
    # Left alone, Hypothesis draws n = 0 a third of the time; empty has its own test.
    n = draw(st.integers(0, most) if draw(st.integers(0, 9)) == 0 else st.integers(1, most))
    rng = np.random.default_rng(draw(st.integers(0, 2**32)))
    runny = draw(st.booleans())
    local = _ids(rng, n, local_blocks, runny)
    remote = _ids(rng, n, remote_blocks, runny)
    perm = rng.permutation(n) if draw(st.booleans()) else np.arange(n)
    local, remote = local[perm], remote[perm]

    # Break it now and then, sometimes twice, so the order of checks is exercised.
    for _ in range(draw(st.sampled_from([0, 0, 1, 2]))):
        fault = draw(
            st.sampled_from(
                ["range", "negative", "dup", "dup", "dup", "length", "regions", "fit", "blocks"]
            )
        )
        target = draw(st.sampled_from(["local", "remote"]))
        ids = local if target == "local" else remote
        if fault in ("range", "negative", "dup") and ids.size == 0:
            continue
        at = draw(st.integers(0, ids.size - 1)) if ids.size else 0
        if fault == "range":
            ids[at] = (local_blocks if target == "local" else remote_blocks) + draw(
                st.integers(0, 3)
            )
        elif fault == "negative":
            ids[at] = -draw(st.integers(1, 3))
        elif fault == "dup" and ids.size > 1:
            ids[at] = ids[draw(st.integers(0, ids.size - 1))]
        elif fault == "length":
            ids = np.append(ids, 0)
        elif fault == "regions":
            regions = draw(st.integers(-2, 0))
        elif fault == "fit":
            regions = draw(st.integers(2**31 // max(local_blocks, remote_blocks) + 1, 2**40))
        elif fault == "blocks":
            if target == "local":
                local_blocks = draw(st.integers(-2, 0))
            else:
                remote_blocks = draw(st.integers(-2, 0))
        if target == "local":
            local = ids
        else:
            remote = ids

    local = local.astype(draw(st.sampled_from([np.int32, np.int64])))
    remote = remote.astype(draw(st.sampled_from([np.int32, np.int64])))
    return local, remote, local_blocks, remote_blocks, regions, draw(st.booleans())


@SETTINGS
@given(plan_args())
def test_plan_matches_reference(args: tuple[Any, ...]) -> None:
    kind, result = assert_same_outcome("plan_transfer", *args)
    # Shows what was covered under --hypothesis-show-statistics.
    event("ok" if kind == "ok" else re.sub(r"-?\d+", "N", result[1]))


@pytest.mark.parametrize("impl", IMPLS)
def test_plan_example(impl: ModuleType) -> None:
    local = np.array([3, 1, 2, 7], dtype=np.int64)
    remote = np.array([10, 8, 9, 0], dtype=np.int32)
    plan = impl.plan_transfer(local, remote, 8, 16, 2)
    assert plan.local_indices.tolist() == [1, 2, 3, 7, 9, 10, 11, 15]
    assert plan.remote_indices.tolist() == [8, 9, 10, 0, 24, 25, 26, 16]
    assert plan.runs.tolist() == [[1, 8, 3], [7, 0, 1]]
    assert (plan.num_blocks, plan.num_regions, plan.num_runs, plan.num_descriptors) == (4, 2, 2, 4)
    assert repr(plan) == "TransferPlan(num_blocks=4, num_regions=2, num_runs=2)"
    # Where adjacent indices are not adjacent bytes (a head shard), NIXL merges nothing.
    plan = impl.plan_transfer(local, remote, 8, 16, 2, merges=False)
    assert (plan.num_runs, plan.num_descriptors) == (2, 8)

    plan = impl.plan_transfer(local, remote, 8, 16, 2, coalesce=False)
    assert plan.local_indices.tolist() == [3, 1, 2, 7, 11, 9, 10, 15]
    assert plan.runs.tolist() == [[3, 10, 1], [1, 8, 2], [7, 0, 1]]


@pytest.mark.parametrize("impl", IMPLS)
def test_plan_empty(impl: ModuleType) -> None:
    plan = impl.plan_transfer(np.empty(0, np.int64), np.empty(0, np.int32), 4, 4, 3)
    assert plan.local_indices.shape == (0,)
    assert plan.local_indices.dtype == np.int32
    assert plan.runs.shape == (0, 3)
    assert plan.runs.dtype == np.int64
    assert (plan.num_blocks, plan.num_runs, plan.num_descriptors) == (0, 0, 0)


@pytest.mark.parametrize("impl", IMPLS)
def test_plan_is_read_only(impl: ModuleType) -> None:
    plan = impl.plan_transfer(np.arange(4), np.arange(4), 8, 8, 2)
    with pytest.raises(ValueError, match="read-only"):
        plan.local_indices[0] = 5
    with pytest.raises(AttributeError):
        plan.num_blocks = 3


def test_plan_qwen_sized_matches_reference() -> None:
    rng = np.random.default_rng(0)
    local = rng.choice(20000, 512, replace=False)
    remote = rng.choice(20000, 512, replace=False).astype(np.int32)
    for coalesce in (True, False):
        assert_same_outcome("plan_transfer", local, remote, 20000, 20000, 64, coalesce)


def test_plan_reuses_large_index_buffers_safely() -> None:
    # Index lists of 4096+ entries come from a pool of reused buffers: a buffer goes back
    # only when no array or view over it is left, and comes back read-only and correct.
    rng = np.random.default_rng(2)
    a = (rng.choice(32768, 512, replace=False), rng.choice(32768, 512, replace=False))
    b = (rng.choice(32768, 512, replace=False), rng.choice(32768, 512, replace=False))
    want_a = _reference.plan_transfer(*a, 32768, 32768, 16)
    want_b = _reference.plan_transfer(*b, 32768, 32768, 16)
    first = _core.plan_transfer(*a, 32768, 32768, 16)
    view = first.remote_indices[100:]  # keeps the buffer even once the plan is gone
    address = first.local_indices.ctypes.data
    del first
    second = _core.plan_transfer(*b, 32768, 32768, 16)
    assert second.local_indices.ctypes.data == address  # reused
    assert_same_plan(second, want_b)
    assert np.array_equal(view, np.asarray(want_a.remote_indices)[100:])  # not overwritten
    assert not view.flags.writeable and not second.local_indices.flags.writeable
    del second
    for _ in range(3):  # more plans than buffers in flight: all still right
        plans = [_core.plan_transfer(*b, 32768, 32768, 16) for _ in range(20)]
        for plan in plans:
            assert_same_plan(plan, want_b)


def test_plan_from_threads() -> None:
    # Short plans keep the GIL, long ones (2**22 entries: 16384 x 256) let it go inside;
    # results must not depend on timing either way.
    rng = np.random.default_rng(1)
    cases = [
        (rng.choice(5000, 300, replace=False), rng.choice(6000, 300, replace=False), 32)
        for _ in range(6)
    ] + [(rng.choice(20000, 16384, replace=False), rng.choice(20000, 16384, replace=False),
          256) for _ in range(2)]
    want = [_reference.plan_transfer(lo, re, 20000, 20000, r) for lo, re, r in cases]
    with ThreadPoolExecutor(max_workers=4) as pool:
        for _ in range(2):
            got = list(pool.map(lambda c: _core.plan_transfer(c[0], c[1], 20000, 20000, c[2]),
                                cases))
            for g, w in zip(got, want, strict=True):
                assert_same_plan(g, w)


def test_short_compiled_work_keeps_the_gil() -> None:
    """Taking the GIL back beside a busy Python thread can cost a whole switch interval
    (5 ms), so work of microseconds must never let go of it: a Qwen3-32B-shaped plan of 512
    blocks (65,536 entries, ~12 us), its split twin, the ids check, and a 1 MiB checksum.
    Only long work does (4M entries, 16 MiB hashed)."""
    rng = np.random.default_rng(3)
    ids = (rng.choice(32768, 512, replace=False), rng.choice(32768, 512, replace=False))
    buffers, bases = make_cache(rng, 1, 64, 16384)
    before = _core._gil_releases()
    _core.plan_transfer(*ids, 32768, 32768, 128)
    _core.plan_split_transfer(ids[0], ids[1][:256], 32768, 32768, 64, 2, 1, 2)
    _core.check_block_ids(rng.choice(1 << 20, 4096, replace=False), 1 << 20)
    _core.block_checksums(bases, 16384, 16384, np.arange(64), 64)  # 1 MiB
    assert _core._gil_releases() == before
    big = (rng.choice(32768, 16384, replace=False), rng.choice(32768, 16384, replace=False))
    _core.plan_transfer(*big, 32768, 32768, 256)
    assert _core._gil_releases() == before + 2  # validation, then the index lists
    del buffers


GOOD = np.arange(3, dtype=np.int64)
BAD_ARRAYS = [
    pytest.param([0, 1, 2], "got <class 'list'>", id="list"),
    pytest.param((0, 1, 2), "got <class 'tuple'>", id="tuple"),
    pytest.param(None, "got <class 'NoneType'>", id="none"),
    pytest.param(np.int64(1), "got <class 'numpy.int64'>", id="numpy-scalar"),
    pytest.param(np.array(1), "got 0-D array of int64", id="0-d"),
    pytest.param(np.zeros((3, 1), np.int64), "got 2-D array of int64", id="2-d"),
    pytest.param(np.zeros((3, 1), np.float32), "got 2-D array of float32", id="2-d-float"),
    pytest.param(np.arange(3, dtype=np.float64), "got float64", id="float64"),
    pytest.param(np.arange(3, dtype=np.uint64), "got uint64", id="uint64"),
    pytest.param(np.arange(3, dtype=np.uint32), "got uint32", id="uint32"),
    pytest.param(np.arange(3, dtype=np.int16), "got int16", id="int16"),
    pytest.param(np.ones(3, dtype=bool), "got bool", id="bool"),
    pytest.param(np.arange(3, dtype=">i8"), "got >i8", id="big-endian"),
    pytest.param(np.arange(6)[::2], "C-contiguous", id="strided"),
    # An int64 view one byte into a buffer: reading it as int64 is undefined behaviour.
    pytest.param(np.frombuffer(bytes(25), dtype=np.int64, offset=1), "aligned to its dtype's size",
                 id="misaligned"),
    pytest.param(np.ma.masked_array(np.arange(3), mask=[False, True, False]),
                 "not a masked array (its mask would be ignored)", id="masked"),
]


@pytest.mark.parametrize(("bad", "fragment"), BAD_ARRAYS)
@pytest.mark.parametrize("side", ["local", "remote"])
def test_plan_rejects_bad_arrays(bad: Any, fragment: str, side: str) -> None:
    args = (bad, GOOD) if side == "local" else (GOOD, bad)
    kind, (cls, message) = assert_same_outcome("plan_transfer", *args, 8, 8, 1)
    assert kind == "raised"
    assert cls is InvalidBlockIds
    assert message.startswith(f"{side}_ids must be")
    assert message.endswith(fragment)


@pytest.mark.parametrize("impl", IMPLS)
def test_plan_accepts_int_dtype_aliases(impl: ModuleType) -> None:
    ids = np.arange(3)
    for dtype in (np.intc, np.longlong, np.int_, "<i4", "=i8"):
        impl.plan_transfer(ids.astype(dtype), ids, 8, 8, 1)
    impl.plan_transfer(np.arange(3)[::1], np.arange(5)[1:4], 8, 8, 1)  # 1-D views are fine


ERRORS = [
    pytest.param(
        ([1, 2, 3], [1, 2, 3, 4], 8, 8, 1), "local_ids and remote_ids differ in length: 3 != 4"
    ),
    pytest.param(([1], [1], 8, 8, 0), "num_regions must be >= 1, got 0"),
    pytest.param(([1], [1], 0, 8, 1), "local_num_blocks must be >= 1, got 0"),
    pytest.param(([1], [1], 8, -1, 1), "remote_num_blocks must be >= 1, got -1"),
    pytest.param(
        ([1], [1], 40_000_000, 8, 64),
        "num_regions * local_num_blocks = 64 * 40000000 does not fit in int32 descriptor indices",
    ),
    pytest.param(
        ([1], [1], 8, 2**31, 1),
        "num_regions * remote_num_blocks = 1 * 2147483648 does not fit in int32 descriptor indices",
    ),
    pytest.param(
        ([1], [1], 2**70, 8, 1),  # clamped to int64 by both
        "num_regions * local_num_blocks = 1 * 9223372036854775807 does not fit in int32 "
        "descriptor indices",
    ),
    pytest.param(
        ([0, 1, 2, 70], [0, 1, 2, 3], 64, 64, 1), "local_ids[3] = 70 is out of range [0, 64)"
    ),
    pytest.param(([0, 1], [0, -1], 64, 64, 1), "remote_ids[1] = -1 is out of range [0, 64)"),
    pytest.param(([5, 5], [0, 99], 64, 64, 1), "remote_ids[1] = 99 is out of range [0, 64)"),
    pytest.param(
        ([5, 9, 1, 9, 5], [0, 1, 2, 3, 4], 64, 64, 1),
        "local_ids has duplicate block id 9 (positions 1 and 3)",
    ),
    pytest.param(
        ([0, 1, 2, 3, 4], [1, 5, 6, 7, 5], 64, 64, 1),
        "remote_ids has duplicate block id 5 (positions 1 and 4)",
    ),
    pytest.param(
        ([3, 3], [1, 1], 2**20, 2**20, 1),  # sparse: found by sorting, same report
        "local_ids has duplicate block id 3 (positions 0 and 1)",
    ),
]


@pytest.mark.parametrize(("args", "message"), ERRORS)
def test_plan_error_messages(args: tuple[Any, ...], message: str) -> None:
    local, remote, *rest = args
    kind, (cls, got) = assert_same_outcome(
        "plan_transfer", np.array(local, np.int64), np.array(remote, np.int32), *rest
    )
    assert (kind, cls, got) == ("raised", InvalidBlockIds, message)


# ---------------------------------------------------------------------------------------
# check_block_ids


@given(
    ids=st.lists(st.integers(-3, 70), max_size=40),
    num_blocks=st.integers(-1, 72),
    int32=st.booleans(),
)
@SETTINGS
def test_check_block_ids_matches_reference(ids: list[int], num_blocks: int, int32: bool) -> None:
    arr = np.array(ids, np.int32 if int32 else np.int64)
    got = assert_same_outcome("check_block_ids", arr, num_blocks, "ids")
    if got[0] == "ok":
        out = _core.check_block_ids(arr, num_blocks, "ids")
        assert out.dtype == np.int64 and not out.flags.writeable
        np.testing.assert_array_equal(out, arr)
        arr[...] = 0  # a copy: the caller may reuse its array at once
        assert out.tolist() == ids


@pytest.mark.parametrize(("bad", "fragment"), BAD_ARRAYS)
def test_check_block_ids_rejects_bad_arrays(bad: Any, fragment: str) -> None:
    kind, (cls, message) = assert_same_outcome("check_block_ids", bad, 8, "block_ids")
    assert (kind, cls) == ("raised", InvalidBlockIds)
    assert message.startswith("block_ids must be")
    assert message.endswith(fragment)


@pytest.mark.parametrize(
    ("ids", "num_blocks", "message"),
    [
        ([1], 0, "num_blocks must be >= 1, got 0"),
        ([0, 1, 2, 70], 64, "block_ids[3] = 70 is out of range [0, 64)"),
        ([5, 5, -1], 64, "block_ids[2] = -1 is out of range [0, 64)"),
        ([5, 9, 1, 9, 5], 64, "block_ids has duplicate block id 9 (positions 1 and 3)"),
        ([3, 3], 2**20, "block_ids has duplicate block id 3 (positions 0 and 1)"),
    ],
)
def test_check_block_ids_error_messages(ids: list[int], num_blocks: int, message: str) -> None:
    kind, (cls, got) = assert_same_outcome("check_block_ids", np.array(ids), num_blocks)
    assert (kind, cls, got) == ("raised", InvalidBlockIds, message)


def test_check_block_ids_large() -> None:
    ids = np.random.default_rng(3).permutation(50_000)[:20_000]
    np.testing.assert_array_equal(_core.check_block_ids(ids, 50_000), ids)
    ids[-1] = ids[0]
    with pytest.raises(InvalidBlockIds, match=r"positions 0 and 19999"):
        _core.check_block_ids(ids, 50_000)


@pytest.mark.parametrize("impl", IMPLS)
def test_plan_counts_must_be_integers(impl: ModuleType) -> None:
    with pytest.raises(TypeError):
        impl.plan_transfer(GOOD, GOOD, 8.0, 8, 1)
    with pytest.raises(TypeError):
        impl.plan_transfer(GOOD, GOOD, 8, 8, "1")
    plan = impl.plan_transfer(GOOD, GOOD, np.int64(8), np.int32(8), True)  # __index__ is fine
    assert plan.num_regions == 1


# ---------------------------------------------------------------------------------------
# plan_split_transfer


def assert_same_split_outcome(*args: Any) -> tuple[str, Any]:
    got = outcome(_core.plan_split_transfer, *args)
    want = outcome(_reference.plan_split_transfer, *args)
    assert got[0] == want[0], (got, want)
    if got[0] == "raised":
        assert got[1] == want[1]
    else:
        assert_same_plan(got[1], want[1])
    return got


def split_by_definition(*args: Any) -> tuple[list[int], list[int], list[list[int]]]:
    """Index lists and runs of a valid split request, straight from the definitions."""
    local, remote, local_blocks, remote_blocks, regions, heads, local_split, remote_split = args
    n = max(len(local), len(remote)) if max(local_split, remote_split) == 1 else None
    if n is None:
        n = len(remote) if local_split > 1 else len(local)

    def desc(side: str, r: int, i: int, h: int) -> int:
        ids, blocks, split = (
            (local, local_blocks, local_split)
            if side == "local"
            else (remote, remote_blocks, remote_split)
        )
        block, slot = int(ids[i // split]), i % split
        return ((r * blocks + block) * split + slot) * heads + h

    order = [(r, i, h) for r in range(regions) for i in range(n) for h in range(heads)]
    local_indices = [desc("local", *e) for e in order]
    remote_indices = [desc("remote", *e) for e in order]
    runs: list[list[int]] = []
    for a, b in zip(local_indices[: n * heads], remote_indices[: n * heads], strict=True):
        if runs and a == runs[-1][0] + runs[-1][2] and b == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([a, b, 1])
    return local_indices, remote_indices, runs


@st.composite
def split_args(draw: st.DrawFn) -> tuple[Any, ...]:
    k, heads, regions = draw(st.integers(1, 8)), draw(st.integers(1, 8)), draw(st.integers(1, 4))
    coarse_side = draw(st.sampled_from(["local", "remote"]))
    n = draw(st.integers(0, 40) if draw(st.integers(0, 9)) == 0 else st.integers(1, 40))
    m = -(-n // k)
    spare = st.one_of(st.integers(0, 8), st.integers(0, 300), st.integers(0, 2**20))
    fine_blocks, coarse_blocks = max(1, n + draw(spare)), max(1, m + draw(spare))
    rng = np.random.default_rng(draw(st.integers(0, 2**32)))
    runny = draw(st.booleans())
    fine, coarse = _ids(rng, n, fine_blocks, runny), _ids(rng, m, coarse_blocks, runny)
    if draw(st.booleans()):
        fine = fine[rng.permutation(n)]
    if draw(st.booleans()):
        coarse = coarse[rng.permutation(m)]
    if coarse_side == "local":
        local, remote, local_blocks, remote_blocks = coarse, fine, coarse_blocks, fine_blocks
        splits = [k, 1]
    else:
        local, remote, local_blocks, remote_blocks = fine, coarse, fine_blocks, coarse_blocks
        splits = [1, k]

    # Break it now and then, sometimes twice, so the order of checks is exercised.
    for _ in range(draw(st.sampled_from([0, 0, 1, 2]))):
        fault = draw(
            st.sampled_from(
                [
                    *("range", "negative", "dup", "dup", "length", "length"),
                    *("regions", "heads", "split", "both-split", "fit", "blocks"),
                ]
            )
        )
        target = draw(st.sampled_from(["local", "remote"]))
        side = 0 if target == "local" else 1
        ids = local if target == "local" else remote
        if fault in ("range", "negative", "dup") and ids.size == 0:
            continue
        at = draw(st.integers(0, ids.size - 1)) if ids.size else 0
        if fault == "range":
            ids[at] = (local_blocks if target == "local" else remote_blocks) + draw(
                st.integers(0, 3)
            )
        elif fault == "negative":
            ids[at] = -draw(st.integers(1, 3))
        elif fault == "dup" and ids.size > 1:
            ids[at] = ids[draw(st.integers(0, ids.size - 1))]
        elif fault == "length":
            ids = np.append(ids, 0) if draw(st.booleans()) or ids.size == 0 else ids[:-1]
        elif fault == "regions":
            regions = draw(st.integers(-2, 0))
        elif fault == "heads":
            heads = draw(st.integers(-2, 0))
        elif fault == "split":
            splits[side] = draw(st.integers(-2, 0))
        elif fault == "both-split":
            splits[side] = max(splits[side], draw(st.integers(2, 9)))
            splits[1 - side] = max(splits[1 - side], draw(st.integers(2, 9)))
        elif fault == "fit":
            regions = draw(st.integers(2**31 // max(local_blocks, remote_blocks) + 1, 2**40))
        elif fault == "blocks":
            if target == "local":
                local_blocks = draw(st.integers(-2, 0))
            else:
                remote_blocks = draw(st.integers(-2, 0))
        if target == "local":
            local = ids
        else:
            remote = ids

    local = local.astype(draw(st.sampled_from([np.int32, np.int64])))
    remote = remote.astype(draw(st.sampled_from([np.int32, np.int64])))
    return local, remote, local_blocks, remote_blocks, regions, heads, splits[0], splits[1]


@SETTINGS
@given(split_args())
def test_split_plan_matches_reference(args: tuple[Any, ...]) -> None:
    kind, result = assert_same_split_outcome(*args)
    event("ok" if kind == "ok" else re.sub(r"-?\d+", "N", result[1]))
    if kind == "ok":
        local_indices, remote_indices, runs = split_by_definition(*args)
        assert result.local_indices.tolist() == local_indices
        assert result.remote_indices.tolist() == remote_indices
        assert result.runs.tolist() == runs


@pytest.mark.parametrize("impl", IMPLS)
def test_split_plan_example(impl: ModuleType) -> None:
    # Remote blocks hold 2 local blocks' tokens, 2 heads, 2 regions. Units (block * split
    # + slot): local 5 6 7 2 (split 1), remote 3.0 3.1 0.0 0.1 = 6 7 0 1.
    local = np.array([5, 6, 7, 2], dtype=np.int64)
    remote = np.array([3, 0], dtype=np.int32)
    plan = impl.plan_split_transfer(local, remote, 8, 4, 2, 2, 1, 2)
    # Region 1 is region 0 shifted by 8 units x 2 heads on both sides.
    region0 = [10, 11, 12, 13, 14, 15, 4, 5]
    assert plan.local_indices.tolist() == region0 + [i + 16 for i in region0]
    region0 = [12, 13, 14, 15, 0, 1, 2, 3]
    assert plan.remote_indices.tolist() == region0 + [i + 16 for i in region0]
    # Units 5,6 -> 6,7 advance together: one run of 2 pairs x 2 heads; then 7 -> 0, 2 -> 1.
    assert plan.runs.tolist() == [[10, 12, 4], [14, 0, 2], [4, 2, 2]]
    # 2 heads and a split of 2: a coarse slot's heads lie apart, so the index runs do not
    # merge and every one of the 16 indices is a descriptor.
    assert (plan.num_blocks, plan.num_regions, plan.num_runs, plan.num_descriptors) == (4, 2, 3, 16)
    assert repr(plan) == "TransferPlan(num_blocks=4, num_regions=2, num_runs=3)"
    one_head = impl.plan_split_transfer(local, remote, 8, 4, 2, 1, 1, 2)
    assert (one_head.num_runs, one_head.num_descriptors) == (3, 6)  # slots are adjacent
    assert impl.plan_split_transfer(local, remote, 8, 4, 2, 1, 1, 2,
                                    merges=False).num_descriptors == 8

    # The mirror image: the coarse side local, an odd count leaving slot 1 of block 0 unused.
    plan = impl.plan_split_transfer(remote, local[:3], 4, 8, 1, 1, 2, 1)
    assert plan.local_indices.tolist() == [6, 7, 0]
    assert plan.remote_indices.tolist() == [5, 6, 7]
    assert plan.runs.tolist() == [[6, 5, 2], [0, 7, 1]]


@pytest.mark.parametrize("impl", IMPLS)
def test_split_plan_without_split_is_per_head_plan(impl: ModuleType) -> None:
    rng = np.random.default_rng(7)
    # Scattered ids around one stretch consecutive on both sides.
    others = rng.permutation(np.r_[0:30, 36:50])[:14], rng.permutation(np.r_[0:40, 46:60])[:14]
    local = np.concatenate([others[0][:3], np.arange(30, 36), others[0][3:]])
    remote = np.concatenate([others[1][:3], np.arange(40, 46), others[1][3:]])
    plain = impl.plan_transfer(local, remote, 50, 60, 3, coalesce=False)
    split = impl.plan_split_transfer(local, remote, 50, 60, 3, 1, 1, 1)
    assert_same_plan(split, plain)
    heads = 4
    split = impl.plan_split_transfer(local, remote, 50, 60, 3, heads, 1, 1)
    per_head = (plain.local_indices[:, None] * heads + np.arange(heads)).ravel()
    np.testing.assert_array_equal(split.local_indices, per_head)
    np.testing.assert_array_equal(split.runs, plain.runs * heads)


@pytest.mark.parametrize("impl", IMPLS)
def test_split_plan_empty(impl: ModuleType) -> None:
    plan = impl.plan_split_transfer(np.empty(0, np.int64), np.empty(0, np.int32), 4, 4, 3, 2, 3, 1)
    assert plan.local_indices.shape == plan.remote_indices.shape == (0,)
    assert plan.local_indices.dtype == np.int32
    assert plan.runs.shape == (0, 3)
    assert plan.runs.dtype == np.int64
    assert (plan.num_blocks, plan.num_regions, plan.num_runs, plan.num_descriptors) == (0, 3, 0, 0)


@pytest.mark.parametrize("impl", IMPLS)
def test_split_plan_is_read_only(impl: ModuleType) -> None:
    plan = impl.plan_split_transfer(np.arange(4), np.arange(2), 8, 8, 2, 2, 1, 2)
    for name in ("local_indices", "remote_indices", "runs"):
        with pytest.raises(ValueError, match="read-only"):
            getattr(plan, name)[0] = 5
    with pytest.raises(AttributeError):
        plan.num_blocks = 3


def test_split_plan_qwen_sized_matches_reference() -> None:
    # 64 regions x 8 heads x 512 blocks: well past the GIL-release threshold.
    rng = np.random.default_rng(8)
    fine = rng.choice(20000, 512, replace=False)
    coarse = rng.choice(10000, 256, replace=False).astype(np.int32)
    assert_same_split_outcome(fine, coarse, 20000, 10000, 64, 8, 1, 2)
    assert_same_split_outcome(coarse, fine, 10000, 20000, 64, 8, 2, 1)


def test_split_plan_from_threads() -> None:
    rng = np.random.default_rng(9)
    cases = [
        (rng.choice(3000, 300, replace=False), rng.choice(1000, 75, replace=False))
        for _ in range(8)
    ]
    want = [_reference.plan_split_transfer(f, c, 3000, 1000, 8, 4, 1, 4) for f, c in cases]
    with ThreadPoolExecutor(max_workers=4) as pool:
        for _ in range(3):
            got = list(
                pool.map(
                    lambda c: _core.plan_split_transfer(c[0], c[1], 3000, 1000, 8, 4, 1, 4), cases
                )
            )
            for g, w in zip(got, want, strict=True):
                assert_same_plan(g, w)


@pytest.mark.parametrize(("bad", "fragment"), BAD_ARRAYS)
@pytest.mark.parametrize("side", ["local", "remote"])
def test_split_plan_rejects_bad_arrays(bad: Any, fragment: str, side: str) -> None:
    args = (bad, GOOD) if side == "local" else (GOOD, bad)
    # Counts that are invalid too: the arrays are checked first.
    kind, (cls, message) = assert_same_split_outcome(*args, 0, 8, 1, 0, 2, 2)
    assert kind == "raised"
    assert cls is InvalidBlockIds
    assert message.startswith(f"{side}_ids must be")
    assert message.endswith(fragment)


_TOP = 2**31 - 1  # INT32_MAX, a prime: only 1 * _TOP * 1 * 1 reaches it exactly
SPLIT_ERRORS = [
    pytest.param(([0, 1], [0], 8, 8, 0, 1, 1, 2), "num_regions must be >= 1, got 0"),
    pytest.param(([0, 1], [0], 0, 8, 1, 1, 1, 2), "local_num_blocks must be >= 1, got 0"),
    pytest.param(([0, 1], [0], 8, -1, 1, 1, 1, 2), "remote_num_blocks must be >= 1, got -1"),
    pytest.param(([0, 1], [0], 8, 8, 1, 0, 1, 2), "heads must be >= 1, got 0"),
    pytest.param(([0, 1], [0], 8, 8, 1, 1, 0, 2), "local_split must be >= 1, got 0"),
    pytest.param(([0, 1], [0], 8, 8, 1, 1, 1, -2), "remote_split must be >= 1, got -2"),
    pytest.param(
        ([0, 1], [0], 8, 8, 1, 1, 2, 3),
        "local_split and remote_split cannot both exceed 1, got 2 and 3",
    ),
    pytest.param(
        ([0, 1, 2, 3, 4], [0, 1], 8, 8, 1, 1, 1, 2),
        "remote_ids has 2 entries, but 5 local_ids at remote_split = 2 need ceil(5 / 2) = 3",
    ),
    pytest.param(
        ([0, 1], [0, 1, 2], 8, 8, 1, 1, 4, 1),
        "local_ids has 2 entries, but 3 remote_ids at local_split = 4 need ceil(3 / 4) = 1",
    ),
    pytest.param(
        ([0, 1, 2], [0, 1], 8, 8, 1, 1, 1, 1),
        "remote_ids has 2 entries, but 3 local_ids at remote_split = 1 need ceil(3 / 1) = 3",
    ),
    pytest.param(
        ([], [0], 8, 8, 1, 1, 1, 2),
        "remote_ids has 1 entries, but 0 local_ids at remote_split = 2 need ceil(0 / 2) = 0",
    ),
    pytest.param(  # length before fit
        ([0, 1, 2], [0], 2**40, 8, 1, 1, 1, 2),
        "remote_ids has 1 entries, but 3 local_ids at remote_split = 2 need ceil(3 / 2) = 2",
    ),
    pytest.param(
        ([1], [1], 40_000_000, 8, 8, 8, 1, 1),
        "num_regions * local_num_blocks * local_split * heads = 8 * 40000000 * 1 * 8 does not "
        "fit in int32 descriptor indices",
    ),
    pytest.param(
        ([0, 1], [0], 8, 2**28, 1, 1, 1, 8),
        "num_regions * remote_num_blocks * remote_split * heads = 1 * 268435456 * 8 * 1 does not "
        "fit in int32 descriptor indices",
    ),
    pytest.param(
        ([_TOP - 1], [0], _TOP, 1, 1, 2, 1, 1),
        "num_regions * local_num_blocks * local_split * heads = 1 * 2147483647 * 1 * 2 does not "
        "fit in int32 descriptor indices",
    ),
    pytest.param(
        ([0], [0], 8, 8, 1, 2**70, 1, 1),  # clamped to int64 by both
        "num_regions * local_num_blocks * local_split * heads = 1 * 8 * 1 * 9223372036854775807 "
        "does not fit in int32 descriptor indices",
    ),
    pytest.param(
        ([0], [0], 8, 8, 2**62, 2**62, 1, 2**62),  # each factor fits, the product does not
        "num_regions * local_num_blocks * local_split * heads = 4611686018427387904 * 8 * 1 * "
        "4611686018427387904 does not fit in int32 descriptor indices",
    ),
    pytest.param(([0, 8], [0], 8, 8, 1, 1, 1, 2), "local_ids[1] = 8 is out of range [0, 8)"),
    pytest.param(([0, 1], [-1], 8, 8, 1, 1, 1, 2), "remote_ids[0] = -1 is out of range [0, 8)"),
    pytest.param(  # range before repeats
        ([5, 5], [99], 8, 8, 1, 1, 1, 5), "remote_ids[0] = 99 is out of range [0, 8)"
    ),
    pytest.param(
        ([5, 9, 1, 9, 5], [0, 1, 2], 64, 64, 1, 1, 1, 2),
        "local_ids has duplicate block id 9 (positions 1 and 3)",
    ),
    pytest.param(
        ([0, 1, 2, 3, 4], [4, 2, 4], 64, 64, 1, 1, 1, 2),
        "remote_ids has duplicate block id 4 (positions 0 and 2)",
    ),
    pytest.param(
        ([7, 7], [1, 2, 3, 1], 2**20, 2**20, 1, 1, 2, 1),  # sparse: found by sorting
        "local_ids has duplicate block id 7 (positions 0 and 1)",
    ),
]


@pytest.mark.parametrize(("args", "message"), SPLIT_ERRORS)
def test_split_plan_error_messages(args: tuple[Any, ...], message: str) -> None:
    local, remote, *rest = args
    kind, (cls, got) = assert_same_split_outcome(
        np.array(local, np.int64), np.array(remote, np.int32), *rest
    )
    assert (kind, cls, got) == ("raised", InvalidBlockIds, message)


@pytest.mark.parametrize("impl", IMPLS)
def test_split_plan_largest_index_space(impl: ModuleType) -> None:
    plan = impl.plan_split_transfer(np.array([_TOP - 1, 0]), np.array([0]), _TOP, 1, 1, 1, 1, 2)
    assert plan.local_indices.tolist() == [_TOP - 1, 0]
    assert plan.remote_indices.tolist() == [0, 1]


@pytest.mark.parametrize("impl", IMPLS)
def test_split_plan_counts_must_be_integers(impl: ModuleType) -> None:
    with pytest.raises(TypeError):
        impl.plan_split_transfer(GOOD, GOOD, 8, 8, 1, 2.0, 1, 1)
    with pytest.raises(TypeError):
        impl.plan_split_transfer(GOOD, GOOD[:2], 8, 8, 1, 1, 1, "2")
    plan = impl.plan_split_transfer(GOOD, GOOD[:2], np.int64(8), 8, True, np.int32(2), 1, 2)
    assert (plan.num_regions, plan.local_indices.size) == (1, 6)


# ---------------------------------------------------------------------------------------
# CompletionTable


@pytest.mark.parametrize("impl", IMPLS)
def test_completion_table(impl: ModuleType) -> None:
    arrival = impl.Arrival
    table = impl.CompletionTable()
    table.expect("a", 3)
    assert "a" in table and "b" not in table and len(table) == 1
    assert table.arrive("a", 1) is arrival.PENDING
    assert table.arrive("a", 1) is arrival.DUPLICATE
    assert table.arrive("a", 3) is arrival.OUT_OF_RANGE
    assert table.arrive("a", -1) is arrival.OUT_OF_RANGE
    assert table.arrive("a", 2**70) is arrival.OUT_OF_RANGE
    assert table.arrive("a", -(2**70)) is arrival.OUT_OF_RANGE
    assert table.arrive("b", 0) is arrival.UNKNOWN
    assert table.progress("a") == (1, 3)
    assert table.arrive("a", np.int64(0)) is arrival.PENDING
    assert table.arrive("a", 2) is arrival.COMPLETE
    assert table.arrive("a", 2) is arrival.DUPLICATE
    assert table.progress("a") == (3, 3)
    assert table.progress("b") is None
    assert table.remove("a") is True
    assert table.remove("a") is False
    assert table.arrive("a", 0) is arrival.UNKNOWN
    assert len(table) == 0

    big = 64 * 8 + 3  # several bitset words
    table.expect("big", big)
    results = [table.arrive("big", p) for p in reversed(range(big))]
    assert results[:-1] == [arrival.PENDING] * (big - 1)
    assert results[-1] is arrival.COMPLETE


def test_arrival_enums_match() -> None:
    got = [(a.name, a.value) for a in _core.Arrival]
    assert got == [(a.name, a.value) for a in _reference.Arrival]
    assert [name for name, _ in got] == [
        "PENDING",
        "COMPLETE",
        "DUPLICATE",
        "UNKNOWN",
        "OUT_OF_RANGE",
    ]


@pytest.mark.parametrize(
    ("parts", "error", "message"),
    [
        (0, ValueError, "parts must be in [1, 16777216], got 0"),
        (-5, ValueError, "parts must be in [1, 16777216], got -5"),
        (2**24 + 1, ValueError, "parts must be in [1, 16777216], got 16777217"),
        (2**80, ValueError, "parts must be in [1, 16777216], got 9223372036854775807"),
        (2, KeyError, "\"completion key 'held' is already expected\""),
    ],
)
def test_completion_expect_errors(parts: int, error: type[Exception], message: str) -> None:
    for impl in (_core, _reference):
        table = impl.CompletionTable()
        table.expect("held", 1)
        with pytest.raises(error) as info:
            table.expect("held", parts)
        assert info.type is error  # plain ValueError, not InvalidBlockIds
        assert str(info.value) == message
        assert len(table) == 1


@pytest.mark.parametrize("impl", IMPLS)
def test_completion_key_types(impl: ModuleType) -> None:
    table = impl.CompletionTable()
    for bad in (b"key", 1, None):
        with pytest.raises(TypeError):
            table.expect(bad, 1)
        with pytest.raises(TypeError):
            table.arrive(bad, 0)
    with pytest.raises(UnicodeEncodeError):
        table.expect("\ud800", 1)
    with pytest.raises(TypeError):
        table.expect("k", 1.0)
    table.expect("k\x00\u00e9\U0001f600", 2)  # any encodable str, NULs included
    assert table.progress("k\x00\u00e9\U0001f600") == (0, 2)
    assert table.progress("k") is None


OPS = st.lists(
    st.tuples(
        st.sampled_from(["expect", "arrive", "remove", "progress", "contains", "len"]),
        st.sampled_from(["a", "b", "c"]),
        st.integers(-2, 6),
    ),
    max_size=60,
)


@SETTINGS
@given(OPS)
def test_completion_matches_reference(ops: list[tuple[str, str, int]]) -> None:
    tables = (_core.CompletionTable(), _reference.CompletionTable())
    for op, key, number in ops:
        results = []
        for table in tables:
            if op == "expect":
                result: Any = outcome(table.expect, key, number)
            elif op == "arrive":
                result = table.arrive(key, number).name
            elif op == "remove":
                result = table.remove(key)
            elif op == "progress":
                result = table.progress(key)
            elif op == "contains":
                result = key in table
            else:
                result = len(table)
            results.append(result)
        assert results[0] == results[1], (op, key, number)


@pytest.mark.parametrize("impl", IMPLS)
def test_completion_threads_hammering(impl: ModuleType) -> None:
    threads_n, keys, parts = 8, 40, 64
    table = impl.CompletionTable()
    for k in range(keys):
        table.expect(f"key{k}", parts)
    counts: Counter[str] = Counter()
    completed: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(threads_n + 1)

    def deliver(seed: int) -> None:
        work = [(f"key{k}", p) for k in range(keys) for p in range(parts)]
        random.Random(seed).shuffle(work)
        local: Counter[str] = Counter()
        done = []
        start.wait()
        for key, part in work:
            result = table.arrive(key, part)
            local[result.name] += 1
            if result.name == "COMPLETE":
                done.append(key)
        with lock:
            counts.update(local)
            completed.extend(done)

    churn_results: list[bool] = []

    def churn() -> None:
        # Other keys come and go meanwhile; they must not disturb the counted ones.
        start.wait()
        for i in range(2000):
            table.expect(f"other{i}", 2)
            pending = table.arrive(f"other{i}", 0).name == "PENDING"
            churn_results.append(pending and table.remove(f"other{i}"))

    # threads_n deliverers: threads_n - 1 threads plus this one; and one churner.
    workers = [threading.Thread(target=deliver, args=(i,)) for i in range(threads_n - 1)]
    workers.append(threading.Thread(target=churn))
    for w in workers:
        w.start()
    deliver(threads_n - 1)
    for w in workers:
        w.join()

    assert churn_results == [True] * 2000
    assert sorted(completed) == sorted(f"key{k}" for k in range(keys))
    assert counts["COMPLETE"] == keys
    assert counts["PENDING"] == keys * (parts - 1)
    assert counts["DUPLICATE"] == keys * parts * (threads_n - 1)
    assert set(counts) == {"COMPLETE", "PENDING", "DUPLICATE"}
    assert len(table) == keys
    assert all(table.progress(f"key{k}") == (parts, parts) for k in range(keys))


# ---------------------------------------------------------------------------------------
# block_checksums


def make_cache(
    rng: np.random.Generator, regions: int, num_blocks: int, stride: int
) -> tuple[list[np.ndarray], np.ndarray]:
    """Separate buffers per region (as real caches have) and their base addresses."""
    buffers = [rng.integers(0, 256, num_blocks * stride, dtype=np.uint8) for _ in range(regions)]
    return buffers, np.array([b.ctypes.data for b in buffers], dtype=np.uint64)


@SETTINGS
@given(
    regions=st.integers(1, 4),
    num_blocks=st.integers(1, 12),
    block_bytes=st.integers(1, 80),
    pad=st.integers(0, 9),
    seed=st.integers(0, 2**32),
    id_list=st.lists(st.integers(-1, 13), max_size=20),
    dtype=st.sampled_from([np.int32, np.int64]),
)
def test_checksums_match_reference(
    regions: int,
    num_blocks: int,
    block_bytes: int,
    pad: int,
    seed: int,
    id_list: list[int],
    dtype: type[np.integer[Any]],
) -> None:
    stride = block_bytes + pad
    buffers, bases = make_cache(np.random.default_rng(seed), regions, num_blocks, stride)
    ids = np.array(id_list, dtype=dtype)
    assert_same_outcome("block_checksums", bases, stride, block_bytes, ids, num_blocks)
    del buffers  # kept alive until here: the addresses point into them


def test_checksums_detect_changes() -> None:
    rng = np.random.default_rng(3)
    stride, nbytes = 40, 37
    buffers, bases = make_cache(rng, 3, 6, stride)
    ids = np.arange(6)
    before = _core.block_checksums(bases, stride, nbytes, ids, 6)
    assert len(set(before.tolist())) == 6

    buffers[2][4 * stride + nbytes - 1] ^= 1  # last hashed byte of block 4, region 2
    after = _core.block_checksums(bases, stride, nbytes, ids, 6)
    assert (after != before).tolist() == [False, False, False, False, True, False]

    buffers[0][nbytes] ^= 0xFF  # padding between blocks is not hashed
    np.testing.assert_array_equal(_core.block_checksums(bases, stride, nbytes, ids, 6), after)

    swapped = bases[[1, 0, 2]]  # region order matters
    assert (_core.block_checksums(swapped, stride, nbytes, ids, 6) != after).all()
    np.testing.assert_array_equal(_reference.block_checksums(bases, stride, nbytes, ids, 6), after)


def test_checksums_large_block_matches_reference() -> None:
    buffers, bases = make_cache(np.random.default_rng(4), 2, 4, 4096)
    ids = np.array([3, 0, 3], dtype=np.int32)
    (kind, sums) = assert_same_outcome("block_checksums", bases, 4096, 4096, ids, 4)
    assert kind == "ok"
    assert sums[0] == sums[2] != sums[1]
    del buffers


CHECKSUM_ERRORS = [
    pytest.param(
        ([1, 2], 16, 16, [0], 4), "base_addresses must be a 1-D uint64 array, got <class 'list'>"
    ),
    pytest.param(
        (np.zeros(1, np.int64), 16, 16, [0], 4),
        "base_addresses must be a 1-D uint64 array, got int64",
    ),
    pytest.param(
        (np.zeros((1, 1), np.uint64), 16, 16, [0], 4),
        "base_addresses must be a 1-D uint64 array, got 2-D array of uint64",
    ),
    pytest.param(
        (np.zeros(4, np.uint64)[::2], 16, 16, [0], 4), "base_addresses must be C-contiguous"
    ),
    pytest.param(
        (np.frombuffer(bytes(17), np.uint64, offset=1), 16, 16, [0], 4),
        "base_addresses must be aligned to its dtype's size",
    ),
    pytest.param(
        (None, 16, 16, [0.5], 4),
        "base_addresses must be a 1-D uint64 array, got <class 'NoneType'>",
    ),
    pytest.param(
        (np.zeros(0, np.uint64), 16, 16, [0], 4),
        "base_addresses is empty: need at least one region",
    ),
    pytest.param(("bases", 16, 0, [0], 4), "block_bytes must be >= 1, got 0"),
    pytest.param(("bases", 8, 16, [0], 4), "block_stride must be >= block_bytes, got 8 < 16"),
    pytest.param(("bases", 16, 16, [0], 0), "num_blocks must be >= 1, got 0"),
    pytest.param(
        ("bases", 2**62, 16, [0], 4),
        "num_blocks * block_stride = 4 * 4611686018427387904 does not fit in int64 byte offsets",
    ),
    pytest.param(("bases", 16, 16, [0, 4], 4), "block_ids[1] = 4 is out of range [0, 4)"),
    pytest.param(("bases", 16, 16, [-1], 4), "block_ids[0] = -1 is out of range [0, 4)"),
]


@pytest.mark.parametrize(("args", "message"), CHECKSUM_ERRORS)
def test_checksum_error_messages(args: tuple[Any, ...], message: str) -> None:
    buffers, bases = make_cache(np.random.default_rng(5), 1, 4, 16)
    base_arg, stride, nbytes, ids, num_blocks = args
    if isinstance(base_arg, str):
        base_arg = bases
    id_arg = np.array(ids)
    kind, (cls, got) = assert_same_outcome(
        "block_checksums", base_arg, stride, nbytes, id_arg, num_blocks
    )
    assert (kind, cls, got) == ("raised", InvalidBlockIds, message)
    del buffers


def test_checksum_rejects_float_ids() -> None:
    buffers, bases = make_cache(np.random.default_rng(6), 1, 4, 16)
    got = assert_same_outcome("block_checksums", bases, 16, 16, np.array([0.0]), 4)
    assert got == (
        "raised",
        (InvalidBlockIds, "block_ids must be a 1-D int32 or int64 array, got float64"),
    )
    del buffers


# ---------------------------------------------------------------------------------------
# module surface


@pytest.mark.parametrize("impl", IMPLS)
def test_module_constants(impl: ModuleType) -> None:
    assert impl.__version__ == "0.1.0"
    assert isinstance(impl.DEBUG, bool)


def _stub_names() -> tuple[set[str], dict[str, set[str]]]:
    """Module-level names of kvpush/_core.pyi, and the members each class declares."""
    stub = ast.parse((ROOT / "kvpush" / "_core.pyi").read_text())
    names: set[str] = set()
    members: dict[str, set[str]] = {}
    for node in stub.body:
        if isinstance(node, ast.FunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.ClassDef):
            names.add(node.name)
            members[node.name] = {m.name for m in node.body if isinstance(m, ast.FunctionDef)}
            members[node.name] |= {
                t.id
                for m in node.body
                if isinstance(m, ast.Assign)
                for t in m.targets
                if isinstance(t, ast.Name)
            }
    return names, members


@pytest.mark.parametrize("impl", IMPLS)
def test_stub_matches_module(impl: ModuleType) -> None:
    names, members = _stub_names()
    assert names <= set(dir(impl))
    instances = {
        "TransferPlan": impl.plan_transfer(GOOD, GOOD, 8, 8, 1),
        "CompletionTable": impl.CompletionTable(),
        "Arrival": impl.Arrival,
        "PreparedLink": impl.PreparedLink(8, 8, 1),
    }
    assert set(instances) == set(members)
    for cls, declared in members.items():
        missing = {m for m in declared if not hasattr(instances[cls], m)}
        assert not missing, f"{impl.__name__}.{cls} lacks {sorted(missing)}"


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")
def test_cpp_core_under_sanitizers() -> None:
    proc = subprocess.run(
        ["bash", str(ROOT / "csrc" / "tests" / "run.sh")],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all checks passed" in proc.stdout


def test_pybind11_bound_matches_the_bindings() -> None:
    """The bindings use pybind11 3 (py::native_enum); a build requirement that admits
    pybind11 2 would fail to compile with a confusing error."""
    root = ROOT
    # tomllib is 3.11+; the build-system table's requires line is simple enough to read.
    requires = re.search(r"^requires\s*=\s*\[(.*)\]", (root / "pyproject.toml").read_text(),
                         re.MULTILINE)
    assert requires
    needs = re.findall(r'"pybind11\s*>=\s*(\d+)[^"]*"', requires.group(1))
    assert len(needs) == 1, requires.group(1)
    if "py::native_enum" in (root / "csrc" / "bindings.cpp").read_text():
        assert int(needs[0]) >= 3, requires.group(1)


@pytest.mark.parametrize("impl", IMPLS)
def test_prepared_link_is_the_plan_functions(impl: ModuleType) -> None:
    """A link's constants checked once at handshake; each request is one call with its ids,
    and gives exactly what the plan functions give with the same constants."""
    rng = np.random.default_rng(11)
    local, remote = rng.choice(500, 40, replace=False), rng.choice(600, 40, replace=False)
    link = impl.PreparedLink(500, 600, 6)
    for coalesce in (True, False):
        assert_same_plan(link.plan(local, remote, coalesce),
                         impl.plan_transfer(local, remote, 500, 600, 6, coalesce))
    shard = impl.PreparedLink(500, 600, 6, merges=False)
    assert shard.plan(local, remote).num_descriptors == 40 * 6
    split = impl.PreparedLink(500, 600, 6, 4, 1, 2)
    assert (split.heads, split.local_split, split.remote_split, split.merges) == (4, 1, 2, True)
    want = impl.plan_split_transfer(local, remote[:20], 500, 600, 6, 4, 1, 2)
    got = split.plan(local, remote[:20])
    assert_same_plan(got, want)
    assert got.num_descriptors == want.num_descriptors == 40 * 4 * 6  # heads lie apart
    with pytest.raises(InvalidBlockIds, match="local_ids has duplicate block id"):
        link.plan(np.array([1, 1]), np.array([2, 3]))
    with pytest.raises(InvalidBlockIds, match=r"remote_ids\[0\] = 600 is out of range"):
        link.plan(np.array([1]), np.array([600]))
    assert repr(split) == ("PreparedLink(local_num_blocks=500, remote_num_blocks=600, "
                           "num_regions=6, heads=4, local_split=1, remote_split=2, merges=True)")


@pytest.mark.parametrize(("args", "message"), [
    ((0, 8, 1), "local_num_blocks must be >= 1, got 0"),
    ((8, 8, 0), "num_regions must be >= 1, got 0"),
    ((8, 8, 1, 0, 2, 1), "a link without heads has splits 1, got 2 and 1"),
    ((8, 8, 1, -1), "heads must be >= 0, got -1"),
    ((8, 8, 1, 2, 2, 2), "local_split and remote_split cannot both exceed 1, got 2 and 2"),
    ((2**30, 8, 4), "num_regions * local_num_blocks = 4 * 1073741824 does not fit in int32 "
                    "descriptor indices"),
    ((8, 2**28, 4, 2, 1, 2), "num_regions * remote_num_blocks * remote_split * heads = "
                             "4 * 268435456 * 2 * 2 does not fit in int32 descriptor indices"),
])
@pytest.mark.parametrize("impl", IMPLS)
def test_prepared_link_refuses_bad_constants(impl: ModuleType, args: tuple[int, ...],
                                             message: str) -> None:
    with pytest.raises(ValueError) as info:
        impl.PreparedLink(*args)
    assert str(info.value) == message
