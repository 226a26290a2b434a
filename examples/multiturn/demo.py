"""kvpush multi-turn demo: a conversation's KV goes back to the prefill side for the next turn.

Three processes, as in disaggregated serving: this one is the router; a **prefill engine**
and a **decode engine** (child processes) run a tiny transformer whose paged KV cache lives
in NIXL-registered memory, and each owns a kvpush Producer *and* Consumer over that cache:
KV moves prefill -> decode for every turn, and decode -> prefill so the next turn computes
only its new tokens. A few conversations are served three ways -- without reuse (each turn
recomputes its whole prompt), with reuse by pull (NIXL READ), with reuse by push (NIXL
WRITE) -- and the greedy tokens are checked against prefill + decode in this one process.

Run ``python -m examples.multiturn.demo`` from the repository root (``--help`` for the
knobs). Takes ~20-30 s here.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from examples.multiturn.engines import (
    Cluster,
    ColocatedEngine,
    EngineConfig,
    TurnResult,
    converse,
    make_conversations,
)

POLICIES = (("no reuse", "push", False), ("reuse, pull", "pull", True),
            ("reuse, push", "push", True))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--conversations", type=int, default=2)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=1024,
                    help="first turn's prompt (system prompt, documents)")
    ap.add_argument("--user-tokens", type=int, default=48, help="new user tokens per turn")
    ap.add_argument("--answer-tokens", type=int, default=24, help="tokens generated per turn")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)  # as the engines: same numerics, and fair on a small host
    config = EngineConfig(num_blocks=2048, ttl_s=600.0)
    convs = make_conversations(0, args.conversations, args.turns,
                               system_tokens=args.system_tokens, user_tokens=args.user_tokens,
                               vocab=config.model.vocab_size)
    t_start = time.monotonic()
    results: dict[str, list[list[TurnResult]]] = {}
    answers: dict[str, list[list[list[int]]]] = {}
    with Cluster(config) as cluster:
        print(f"prefill engine pid {cluster.prefill.process.pid}, decode engine pid "
              f"{cluster.decode.process.pid}: each has a Producer and a Consumer over one "
              f"KV cache ({config.num_blocks} blocks x {config.block_size} tokens)")
        # One throwaway request so that first-call costs do not land on the first policy.
        cluster.turn(convs[0][0][:64], 2, mode="push", reuse=False)
        for name, mode, reuse in POLICIES:
            cluster.advance_clock(config.ttl_s + 1)  # start every policy with empty caches
            results[name], answers[name] = [], []
            for system, users in convs:
                turns: list[TurnResult] = []

                def serve(prompt: list[int], max_new: int, mode: str = mode,
                          reuse: bool = reuse, turns: list[TurnResult] = turns) -> list[int]:
                    turns.append(cluster.turn(prompt, max_new, mode=mode, reuse=reuse))
                    return turns[-1].tokens

                answers[name].append(converse(serve, system, users, args.answer_tokens))
                results[name].append(turns)

    # The reference: prefill and decode in this process, one cache, same steps.
    t_ref = time.monotonic()
    reference: dict[bool, list[list[list[int]]]] = {}
    for reuse in (False, True):
        engine = ColocatedEngine(config)

        def colocated(prompt: list[int], max_new: int, engine: ColocatedEngine = engine,
                      reuse: bool = reuse) -> list[int]:
            return engine.turn("r", prompt, max_new, reuse)[0]

        reference[reuse] = [converse(colocated, s, u, args.answer_tokens) for s, u in convs]
    t_end = time.monotonic()

    bpb = 2 * config.model.n_layers * config.block_size * config.model.n_kv_heads \
        * config.model.head_dim * 4
    print(f"\n{args.conversations} conversations x {args.turns} turns; each turn adds "
          f"{args.user_tokens} user tokens, answers {args.answer_tokens}; KV block = "
          f"{config.block_size} tokens = {bpb // 1024} KiB (all layers). Mean per turn:\n")
    cell = "{:>8} {:>6} {:>5} {:>5} |"
    print(f"{'':>12} |" + "".join(f"{name:^28}|" for name, _, _ in POLICIES))
    print(f"{'turn':>4} {'prompt':>7} |"
          + cell.format("TTFT ms", "reused", "back", "fwd") * len(POLICIES))
    for t in range(args.turns):
        prompt = int(np.mean([c[t].prompt_tokens for c in results["no reuse"]]))
        line = f"{t + 1:>4} {prompt:>7} |"
        for name, _, _ in POLICIES:
            rs = [c[t] for c in results[name]]
            line += cell.format(f"{np.mean([r.ttft_s for r in rs]) * 1e3:.1f}",
                                f"{np.mean([r.reused_blocks for r in rs]):.0f}",
                                f"{np.mean([r.back_blocks for r in rs]):.0f}",
                                f"{np.mean([r.fwd_blocks for r in rs]):.0f}")
        print(line)
    print("(blocks: prompt blocks reused; moved decode -> prefill; moved prefill -> decode)")
    later = {name: np.mean([c[t].ttft_s for c in results[name] for t in range(1, args.turns)])
             for name, _, _ in POLICIES}
    if args.turns > 1:
        print(f"\nturns 2..{args.turns}, mean TTFT: "
              + ", ".join(f"{n} {v * 1e3:.1f} ms" for n, v in later.items())
              + f"  -> reuse speedup: pull {later['no reuse'] / later['reuse, pull']:.1f}x, "
                f"push {later['no reuse'] / later['reuse, push']:.1f}x")
    moved = {name: sum(r.back_bytes + r.fwd_bytes for c in results[name] for r in c)
             for name, _, _ in POLICIES}
    print("KV bytes moved in all: " + ", ".join(f"{n} {v / 2**20:.1f} MiB"
                                               for n, v in moved.items()))

    ok = True
    for name, _, reuse in POLICIES:
        if answers[name] != reference[reuse]:
            ok = False
            print(f"MISMATCH: {name} tokens differ from colocated prefill + decode")
    same = reference[True] == reference[False]
    ntok = sum(len(a) for c in reference[True] for a in c)
    print("\ntokens match: disaggregated greedy decoding (no reuse, reuse by pull, reuse by "
          f"push) gave exactly the colocated tokens ({ntok} per policy)" if ok
          else "\nTOKENS DIFFER from the colocated reference")
    print(f"(reuse and no-reuse answers are {'identical' if same else 'NOT identical'}; "
          f"serving {t_ref - t_start:.1f} s, reference {t_end - t_ref:.1f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
