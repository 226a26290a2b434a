"""Multi-turn KV reuse over kvpush, in two processes: a prefill engine and a decode engine
(each with a Producer and a Consumer over one KV cache) run the tiny model of
``examples/multiturn``; this process is the router and computes the colocated reference.

Greedy tokens must equal the colocated ones exactly (push and pull, 1 and several turns,
full and partial prefix hits, TTL expiry); every transfer moves exactly the blocks its
destination lacks, by the engines' own counts and by the Producer/Consumer counters; the KV
bytes both engines keep equal the colocated engine's bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from examples.multiturn.engines import (  # noqa: E402
    Cluster,
    ColocatedEngine,
    EngineConfig,
    TurnResult,
    converse,
    make_conversations,
)
from kvpush.prefix import block_hashes  # noqa: E402

BS = 16
MAX_NEW = 10
CONFIG = EngineConfig(num_blocks=768, block_size=BS, ttl_s=600.0, timeout_s=20.0)
BYTES_PER_BLOCK = 2 * CONFIG.model.n_layers * BS * CONFIG.model.n_kv_heads \
    * CONFIG.model.head_dim * 4


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    torch.set_num_threads(1)  # the engines use one thread; the reference must compute alike
    with Cluster(CONFIG, start_timeout=120, call_timeout=60) as c:
        yield c


def conversation(seed: int, turns: int, system: int = 90, user: int = 20
                 ) -> tuple[list[int], list[list[int]]]:
    [conv] = make_conversations(seed, 1, turns, system_tokens=system, user_tokens=user,
                                vocab=CONFIG.model.vocab_size)
    return conv


def disaggregated(cluster: Cluster, system: list[int], users: list[list[int]], mode: str,
                  reuse: bool) -> tuple[list[list[int]], list[TurnResult],
                                        list[dict[str, Any]]]:
    """Run a conversation; returns answers, per-turn results, and per-turn counter deltas."""
    results: list[TurnResult] = []
    deltas: list[dict[str, Any]] = []

    def serve(prompt: list[int], max_new: int) -> list[int]:
        before = cluster.stats()
        results.append(cluster.turn(prompt, max_new, mode=mode, reuse=reuse))
        after = cluster.stats()
        deltas.append({
            f"{side}.{ep}.{key}": after[side][ep][key] - before[side][ep][key]
            for side in ("prefill", "decode") for ep in ("producer", "consumer")
            for key in ("blocks_moved", "bytes_moved", "requests_completed")
        } | {"decode.held": after["decode"]["held"], "prefill.held": after["prefill"]["held"]})
        return results[-1].tokens

    answers = converse(serve, system, users, MAX_NEW)
    return answers, results, deltas


def colocated(system: list[int], users: list[list[int]], reuse: bool,
              engine: ColocatedEngine | None = None,
              expire_before: int | None = None) -> list[list[int]]:
    engine = engine or ColocatedEngine(CONFIG)
    turn = [0]

    def serve(prompt: list[int], max_new: int) -> list[int]:
        turn[0] += 1
        if turn[0] == expire_before:
            engine.advance_clock(CONFIG.ttl_s + 1)
        return engine.turn(f"t{turn[0]}", prompt, max_new, reuse)[0]

    return converse(serve, system, users, MAX_NEW)


def expected_blocks(system: list[int], users: list[list[int]]) -> list[tuple[int, int]]:
    """(backward, forward) blocks per turn of a fresh conversation with reuse: only what the
    destination lacks. After a turn the prefill side holds the prompt's full blocks and the
    decode side the full blocks of prompt + answer (but the answer's last token, whose KV is
    never computed)."""
    out = []
    prev_prompt = 0
    length = len(system)
    for i, user in enumerate(users):
        length += len(user)
        cap = (length - 1) // BS
        p_full = prev_prompt // BS
        d_full = (prev_prompt + MAX_NEW - 1) // BS if i else 0
        k_p, k_d = min(p_full, cap), min(d_full, cap)
        out.append((max(0, k_d - k_p), -(-length // BS) - k_d))
        prev_prompt = length
        length += MAX_NEW
    return out


def check_moved(results: list[TurnResult], deltas: list[dict[str, Any]],
                want: list[tuple[int, int]]) -> None:
    for turn, (r, d, (back, fwd)) in enumerate(zip(results, deltas, want, strict=True), 1):
        got = (r.back_blocks, r.fwd_blocks, r.back_bytes, r.fwd_bytes)
        assert got == (back, fwd, back * BYTES_PER_BLOCK, fwd * BYTES_PER_BLOCK), \
            f"turn {turn}: {r}"
        # The same, by kvpush's own counters on both ends of both directions.
        assert d["prefill.producer.blocks_moved"] == d["decode.consumer.blocks_moved"] == fwd
        assert d["decode.producer.blocks_moved"] == d["prefill.consumer.blocks_moved"] == back
        assert d["prefill.producer.bytes_moved"] == fwd * BYTES_PER_BLOCK
        assert d["prefill.consumer.bytes_moved"] == back * BYTES_PER_BLOCK
        # Both requests completed -- the backward one even when empty -- and every source
        # block was released.
        assert d["decode.consumer.requests_completed"] == 1
        assert d["prefill.consumer.requests_completed"] == 1
        assert d["decode.held"] == d["prefill.held"] == 0


def kv_tokens(system: list[int], users: list[list[int]], answers: list[list[int]]) -> list[int]:
    out = list(system)
    for u, a in zip(users, answers, strict=True):
        out += u + a
    return out[:-1]  # the last answer token's KV is never computed


# -- the tests -----------------------------------------------------------------------------
@pytest.mark.parametrize("reuse", [True, False], ids=["reuse", "no-reuse"])
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_single_turn_matches_colocated(cluster: Cluster, mode: str, reuse: bool) -> None:
    seed = {("push", True): 1, ("push", False): 2, ("pull", True): 3, ("pull", False): 4}
    system, users = conversation(seed=seed[mode, reuse], turns=1, system=150)
    answers, results, deltas = disaggregated(cluster, system, users, mode, reuse)
    assert answers == colocated(system, users, reuse)
    n = -(-len(system + users[0]) // BS)
    assert results[0].fwd_blocks == n and results[0].reused_blocks == 0
    assert deltas[0]["decode.consumer.blocks_moved"] == n


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_multi_turn_matches_colocated_and_moves_only_missing_blocks(cluster: Cluster,
                                                                   mode: str) -> None:
    system, users = conversation(seed=11 if mode == "push" else 12, turns=4)
    answers, results, deltas = disaggregated(cluster, system, users, mode, reuse=True)
    reference = ColocatedEngine(CONFIG)
    assert answers == colocated(system, users, reuse=True, engine=reference)
    check_moved(results, deltas, expected_blocks(system, users))
    assert all(r.reused_blocks > 0 for r in results[1:])
    assert sum(r.back_blocks for r in results) > 0  # the decode side's KV went back
    # The KV both engines keep is the colocated engine's, bit for bit.
    hashes = block_hashes(kv_tokens(system, users, answers), BS)
    want = reference.digests(hashes)
    assert None not in want
    assert cluster.digests("decode", hashes) == want
    on_prefill = cluster.digests("prefill", hashes)
    assert sum(d is not None for d in on_prefill) >= len(hashes) - 2
    assert all(d is None or d == w for d, w in zip(on_prefill, want, strict=True))
    # The LM head's scale keeps greedy argmax clear of float noise: recomputing the prefix
    # in one batch instead of reusing decode-time KV gives the same tokens.
    assert answers == colocated(system, users, reuse=False)


def test_multi_turn_without_reuse_matches_colocated(cluster: Cluster) -> None:
    system, users = conversation(seed=13, turns=3)
    answers, results, _ = disaggregated(cluster, system, users, "push", reuse=False)
    assert answers == colocated(system, users, reuse=False)
    assert all(r.reused_blocks == 0 and r.back_blocks == 0 for r in results)
    assert [r.fwd_blocks for r in results] == [-(-r.prompt_tokens // BS) for r in results]


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_full_prefix_hit_sends_nothing_back_but_completes(cluster: Cluster, mode: str) -> None:
    # 96 tokens: 6 full blocks. The prompt's last block is recomputed (a first token needs
    # logits), everything before it is on both sides: the backward request is empty.
    system, users = conversation(seed=21 if mode == "push" else 22, turns=1, system=76)
    prompt = system + users[0]
    assert len(prompt) == 96
    answers, _, _ = disaggregated(cluster, system, users, mode, reuse=True)
    before = cluster.stats()
    again = cluster.turn(prompt, MAX_NEW, mode=mode, reuse=True)
    after = cluster.stats()
    assert again.tokens == answers[0]
    assert (again.local_blocks, again.remote_blocks, again.reused_blocks) == (5, 5, 5)
    assert (again.back_blocks, again.back_bytes) == (0, 0)
    assert (again.fwd_blocks, again.fwd_bytes) == (1, BYTES_PER_BLOCK)
    pc, dp = after["prefill"]["consumer"], before["prefill"]["consumer"]
    assert pc["requests_completed"] - dp["requests_completed"] == 1
    assert pc["bytes_moved"] == dp["bytes_moved"]
    assert after["decode"]["producer"]["bytes_moved"] == before["decode"]["producer"][
        "bytes_moved"]
    assert after["decode"]["held"] == 0
    engine = ColocatedEngine(CONFIG)
    first = colocated(system, users, True, engine)
    assert first == answers and engine.turn("again", prompt, MAX_NEW)[0] == again.tokens


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_partial_hit_on_a_shared_system_prompt(cluster: Cluster, mode: str) -> None:
    convs = make_conversations(31 if mode == "push" else 32, 2, 2, system_tokens=70,
                               user_tokens=20, vocab=CONFIG.model.vocab_size,
                               shared_system=True)
    engine = ColocatedEngine(CONFIG)
    (sa, ua), (sb, ub) = convs
    answers_a, _, _ = disaggregated(cluster, sa, ua, mode, reuse=True)
    answers_b, results_b, deltas_b = disaggregated(cluster, sb, ub, mode, reuse=True)
    assert answers_a == colocated(sa, ua, True, engine)
    assert answers_b == colocated(sb, ub, True, engine)
    first = results_b[0]
    # Conversation B's first turn finds the 4 full blocks of the shared system prompt on
    # both sides: nothing goes back, only B's own 2 blocks go forward.
    assert (first.local_blocks, first.remote_blocks, first.back_blocks) == (4, 4, 0)
    assert first.fwd_blocks == -(-(70 + 20) // BS) - 4 == 2
    assert deltas_b[0]["decode.consumer.blocks_moved"] == 2


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_expired_blocks_are_recomputed(cluster: Cluster, mode: str) -> None:
    system, users = conversation(seed=41 if mode == "push" else 42, turns=3)
    results: list[TurnResult] = []

    def serve(prompt: list[int], max_new: int) -> list[int]:
        if len(results) == 2:  # both engines' TTLs run out before the third turn
            cluster.advance_clock(CONFIG.ttl_s + 1)
        results.append(cluster.turn(prompt, max_new, mode=mode, reuse=True))
        return results[-1].tokens

    answers = converse(serve, system, users, MAX_NEW)
    assert answers == colocated(system, users, reuse=True, expire_before=3)
    assert results[1].reused_blocks > 0
    last = results[2]
    assert (last.local_blocks, last.remote_blocks, last.reused_blocks, last.back_blocks) == \
        (0, 0, 0, 0)
    assert last.fwd_blocks == -(-last.prompt_tokens // BS)


def test_evicted_blocks_are_recomputed_not_stale() -> None:
    # In one process (the eviction logic is the engine's, not the transport's): a cache too
    # small for two conversations evicts one's blocks while the other runs; whatever is
    # missing is recomputed, and the answers are those of a cache that never evicts.
    torch.set_num_threads(1)
    small = ColocatedEngine(EngineConfig(num_blocks=20, block_size=BS))
    big = ColocatedEngine(CONFIG)
    convs = make_conversations(51, 2, 3, system_tokens=90, user_tokens=20,
                               vocab=CONFIG.model.vocab_size)
    histories = [list(s) for s, _ in convs]
    for turn in range(3):
        for c, (_, users) in enumerate(convs):
            histories[c] += users[turn]
            a, _ = small.turn(f"s{c}.{turn}", histories[c], MAX_NEW)
            b, _ = big.turn(f"b{c}.{turn}", histories[c], MAX_NEW)
            assert a == b
            histories[c] += a
    assert small.index.stats()["evicted"] > 0
    assert small.pool.num_free + len(small.index) == 20  # every block accounted for


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_failed_turn_releases_everything(cluster: Cluster, mode: str) -> None:
    # A token id outside the vocabulary makes the prefill's compute fail after the backward
    # transfer and the decode side's registration: the router drops the request on both
    # engines, which abort what is in flight and free every block; the next turn works.
    system, users = conversation(seed=61 if mode == "push" else 62, turns=2)
    first = cluster.turn(system + users[0], MAX_NEW, mode=mode)
    bad = system + users[0] + first.tokens + users[1][:-1] + [CONFIG.model.vocab_size + 7]
    with pytest.raises(RuntimeError, match="prefill engine"):
        cluster.turn(bad, MAX_NEW, mode=mode)
    stats = cluster.stats()
    for side in ("prefill", "decode"):
        s = stats[side]
        assert s["running"] == 0 and s["held"] == 0 and s["index"]["pinned"] == 0, (side, s)
        assert s["free_blocks"] + s["index"]["entries"] == CONFIG.num_blocks, (side, s)
    good = system + users[0] + first.tokens + users[1]
    engine = ColocatedEngine(CONFIG)
    engine.turn("a", system + users[0], MAX_NEW)
    assert cluster.turn(good, MAX_NEW, mode=mode).tokens == engine.turn("b", good, MAX_NEW)[0]
