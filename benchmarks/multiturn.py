"""Multi-turn benchmark: TTFT with and without KV reuse across turns, and KV bytes per turn.

``python -m benchmarks.multiturn [--quick] [--real]`` prints a table and writes
``benchmarks/results/multiturn.json`` and ``benchmarks/results/multiturn.png``;
``run(quick)`` returns the same figures (``multiturn_ttft_speedup``: the best, over prefix
lengths, of mean TTFT without reuse / with reuse by push, turns 2..T).

What runs. The engines of ``examples/multiturn`` -- a prefill process and a decode process,
each with a kvpush Producer *and* Consumer over one paged KV cache, this process as the
router -- serve conversations whose first prompt is a long prefix (2k ... 24k tokens: a
system prompt, documents, a code base) and whose every later turn adds ``user`` tokens to
the previous prompt + answer. Three policies per prefix length, each starting from empty
caches: **no reuse** (every turn recomputes its whole prompt and sends all of its KV),
**reuse by pull** and **reuse by push** (the decode side keeps the conversation's blocks;
the prefill side gets back only the blocks it lacks -- last turn's answer --, computes only
the new suffix, and sends forward only the blocks the decode side lacks).

What is measured, what is modelled. Every control message, router hop and KV transfer is
real: real NIXL agents, two processes, the tiny model's real KV layout (4 layers, K and V
separate, 2 KV heads x 32, float32, 16 tokens per block: 32 KiB per block, 2 KiB per
token). The prefill *compute* is not run (the tiny model would need minutes at 24k tokens on
this host); its time comes from a **cost model calibrated on the tiny model** at the start
of the run -- ``t(n, ctx) = a + b*n + c*n*(ctx + (n+1)/2)`` for ``n`` new tokens after
``ctx`` cached ones (linear work + attention), fitted by least squares to real prefills of
the tiny model in this process (up to 2-3k tokens; longer prompts are extrapolated) -- and is
added to the measured critical path (it is serial there: backward transfer -> prefill ->
forward transfer), not slept. ``--real`` runs the tiny model itself instead, at smaller
prefixes (no model in the loop: everything measured), which also checks the cost model.

The tiny model is attention-bound at long contexts (d_model 128), so its reuse speedups are
larger than a big model's on a GPU would be; the bytes per turn are exact for its layout.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from examples.multiturn.engines import (
    Cluster,
    CostModel,
    EngineConfig,
    TurnResult,
    converse,
    make_conversations,
)
from examples.multiturn.model import ModelConfig, PagedKVCache, TinyTransformer

__all__ = ["run"]

NAME = "multiturn"
DESCRIPTION = ("Multi-turn conversations: TTFT with and without KV reuse across turns "
               "(examples/multiturn engines, modelled prefill)")
SUMMARY_KEYS: dict[str, str] = {
    "multiturn_ttft_speedup":
        "mean TTFT of turns 2..T without reuse over with reuse by push, best prefix length",
    "multiturn_ttft_speedup_pull": "the same with reuse by pull",
    "multiturn_best_prefix_tokens": "the prefix length of that best speedup",
    "multiturn_bytes_ratio": "KV bytes per turn without reuse over with reuse, at that prefix",
}

RESULTS = Path(__file__).resolve().parent / "results"
POLICIES = (("none", "push", False), ("pull", "pull", True), ("push", "push", True))

@dataclass(frozen=True)
class Plan:
    """A sweep: first-turn prompt lengths, turns per conversation, conversations per
    prefix, tokens added per turn (user) and generated (answer), calibration points
    ``(new tokens, cached tokens)`` with repeats."""

    prefixes: tuple[int, ...]
    turns: int
    conversations: int
    user: int
    answer: int
    calibration: tuple[tuple[int, int], ...]
    repeats: int


QUICK = Plan(prefixes=(2048, 8192, 24576), turns=3, conversations=1, user=128, answer=64,
             calibration=((256, 0), (512, 0), (1024, 0), (1536, 0), (128, 2048), (128, 4096)),
             repeats=2)
FULL = Plan(prefixes=(2048, 4096, 8192, 12288, 16384, 24576), turns=5, conversations=2,
            user=128, answer=64,
            calibration=((256, 0), (512, 0), (1024, 0), (2048, 0), (3072, 0), (128, 1024),
                         (128, 2048), (256, 4096), (128, 6144)),
            repeats=3)
REAL_PREFIXES = {True: (512, 1024, 2048), False: (512, 1024, 2048, 3072)}


def _log(progress: bool, msg: str) -> None:
    if progress:
        print(f"[multiturn] {msg}", file=sys.stderr, flush=True)


# -- the cost model ---------------------------------------------------------------------------
def calibrate(points: Sequence[tuple[int, int]], repeats: int,
              model: ModelConfig | None = None) -> tuple[CostModel, list[dict[str, float]]]:
    """Time the tiny model's prefill of ``n`` new tokens after ``ctx`` cached ones (one
    thread, as the engines run it; best of ``repeats``) and fit :class:`CostModel`."""
    import torch

    torch.set_num_threads(1)
    cfg = model or ModelConfig()
    tm = TinyTransformer(cfg)
    bs = 16
    need = max(n + ctx for n, ctx in points)
    cache = PagedKVCache(cfg, -(-need // bs), bs)
    table = list(range(cache.num_blocks))
    rng = np.random.default_rng(0)
    tm.next_token(rng.integers(0, cfg.vocab_size, 64).tolist(), 0, cache, table)  # warm up
    rows = []
    for n, ctx in points:
        toks = rng.integers(0, cfg.vocab_size, n).tolist()
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            tm.next_token(toks, ctx, cache, table)  # the prefix's KV values do not matter
            best = min(best, time.perf_counter() - t0)
        rows.append({"new_tokens": n, "cached_tokens": ctx, "measured_s": best})
    x = np.array([[1.0, r["new_tokens"], r["new_tokens"] * (r["cached_tokens"]
                                                            + (r["new_tokens"] + 1) / 2)]
                  for r in rows])
    y = np.array([r["measured_s"] for r in rows])
    # Relative least squares (short and long prefills count alike), coefficients >= 0.
    w = 1.0 / y
    keep = [0, 1, 2]
    coef = np.zeros(3)
    while keep:
        sol, *_ = np.linalg.lstsq(x[:, keep] * w[:, None], y * w, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0
            coef[keep] = sol
            break
        keep.pop(int(np.argmin(sol)))
    cost = CostModel(float(coef[0]), float(coef[1]), float(coef[2]))
    for r in rows:
        r["model_s"] = cost.prefill_s(int(r["new_tokens"]), int(r["cached_tokens"]))
    return cost, rows


# -- the sweep ------------------------------------------------------------------------------
def sweep(cluster: Cluster, prefixes: Sequence[int], turns: int, conversations: int,
          user: int, answer: int, progress: bool) -> list[dict[str, Any]]:
    """Every (prefix, policy, conversation, turn) as one row."""
    vocab = cluster.config.model.vocab_size
    ttl = cluster.config.ttl_s
    rows: list[dict[str, Any]] = []
    for prefix in prefixes:
        convs = make_conversations(prefix, conversations, turns, system_tokens=prefix - user,
                                   user_tokens=user, vocab=vocab)
        for name, mode, reuse in POLICIES:
            cluster.advance_clock(ttl + 1)  # empty caches: policies do not help each other
            t0 = time.monotonic()
            for ci, (system, users) in enumerate(convs):
                results: list[TurnResult] = []

                def serve(prompt: list[int], max_new: int, mode: str = mode,
                          reuse: bool = reuse, results: list[TurnResult] = results
                          ) -> list[int]:
                    results.append(cluster.turn(prompt, max_new, mode=mode, reuse=reuse))
                    return results[-1].tokens

                converse(serve, system, users, answer)
                for t, r in enumerate(results, 1):
                    rows.append({"prefix_tokens": prefix, "policy": name, "conversation": ci,
                                 "turn": t, **{k: v for k, v in r.as_dict().items()
                                               if k not in ("tokens", "rid", "back_mode")}})
            _log(progress, f"prefix {prefix:>6}: {name:<4} {time.monotonic() - t0:.1f} s")
    return rows


def summarize(rows: list[dict[str, Any]], prefixes: Sequence[int]) -> list[dict[str, Any]]:
    out = []
    for prefix in prefixes:
        later = [r for r in rows if r["prefix_tokens"] == prefix and r["turn"] > 1]
        row: dict[str, Any] = {"prefix_tokens": prefix}
        for name, _, _ in POLICIES:
            rs = [r for r in later if r["policy"] == name]
            row[f"ttft_{name}_s"] = float(np.mean([r["ttft_s"] for r in rs]))
            row[f"compute_{name}_s"] = float(np.mean([r["compute_s"] for r in rs]))
            row[f"kv_path_{name}_s"] = float(np.mean([r["ttft_s"] - r["compute_s"]
                                                      for r in rs]))
            row[f"bytes_per_turn_{name}"] = float(np.mean([r["back_bytes"] + r["fwd_bytes"]
                                                           for r in rs]))
            row[f"back_bytes_per_turn_{name}"] = float(np.mean([r["back_bytes"] for r in rs]))
        for name in ("pull", "push"):
            row[f"speedup_{name}"] = row["ttft_none_s"] / row[f"ttft_{name}_s"]
        out.append(row)
    return out


def run(quick: bool, progress: bool = True, real: bool = False) -> dict[str, Any]:
    """Calibrate, sweep, summarize. Returns ``multiturn_ttft_speedup`` (push) and
    ``multiturn_ttft_speedup_pull`` at the best prefix length, the per-prefix summary, every
    turn's row, the cost model and its calibration points (also under ``summary``)."""
    plan = QUICK if quick else FULL
    t_start = time.monotonic()
    cost: CostModel | None = None
    calib: list[dict[str, float]] = []
    if real:
        prefixes = REAL_PREFIXES[quick]
        config = EngineConfig(num_blocks=2048, ttl_s=600.0, timeout_s=60.0)
    else:
        _log(progress, "calibrating the prefill cost model on the tiny model")
        cost, calib = calibrate(plan.calibration, plan.repeats)
        _log(progress, f"cost model: {cost}")
        prefixes = plan.prefixes
        turn_tokens = plan.turns * (plan.user + plan.answer)
        blocks = 2 * (-(-(max(prefixes) + turn_tokens) // 16)) + 256
        config = EngineConfig(num_blocks=blocks, ttl_s=600.0, synthetic=cost, sleep=False,
                              timeout_s=60.0)
    with Cluster(config, start_timeout=180, call_timeout=180) as cluster:
        _log(progress, "engines up")
        rows = sweep(cluster, prefixes, plan.turns, plan.conversations, plan.user,
                     plan.answer, progress)
    table = summarize(rows, prefixes)
    best = max(table, key=lambda r: r["speedup_push"])
    layout_bytes_per_token = config.model.kv_bytes_per_token
    summary = {
        "multiturn_ttft_speedup": best["speedup_push"],
        "multiturn_ttft_speedup_pull": max(r["speedup_pull"] for r in table),
        "multiturn_best_prefix_tokens": best["prefix_tokens"],
        "multiturn_bytes_ratio": best["bytes_per_turn_none"] / best["bytes_per_turn_push"],
    }
    return {
        **summary,
        "summary": summary,
        "method": ("measured: kvpush transfers, control and router hops, 2 processes; "
                   + ("measured: tiny-model prefill compute" if real else
                      "modelled: prefill compute (cost model calibrated on the tiny model, "
                      "added to the measured critical path)")),
        "quick": quick,
        "real": real,
        "cost_model": None if cost is None else asdict(cost),
        "calibration": calib,
        "kv_bytes_per_token": layout_bytes_per_token,
        "turns": plan.turns,
        "conversations": plan.conversations,
        "user_tokens": plan.user,
        "answer_tokens": plan.answer,
        "table": table,
        "rows": rows,
        "elapsed_s": time.monotonic() - t_start,
    }


# -- output ---------------------------------------------------------------------------------
def print_table(result: dict[str, Any]) -> None:
    print(f"\nmulti-turn TTFT, mean of turns 2..{result['turns']} "
          f"({result['conversations']} conversation(s) per prefix; each turn +"
          f"{result['user_tokens']} user, +{result['answer_tokens']} answer tokens)")
    print(f"method: {result['method']}")
    if result["cost_model"]:
        c = result["cost_model"]
        print(f"cost model: {c['fixed_s'] * 1e3:.2f} ms + {c['per_token_s'] * 1e6:.1f} us/token "
              f"+ {c['per_pair_s'] * 1e9:.2f} ns/(token x earlier token)")
        for p in result["calibration"]:
            print(f"  calibration: {p['new_tokens']:>5} new after {p['cached_tokens']:>5}: "
                  f"measured {p['measured_s'] * 1e3:7.1f} ms, model {p['model_s'] * 1e3:7.1f} ms")
    print(f"\n{'prefix':>7} | {'TTFT ms: none':>13} {'pull':>8} {'push':>8} | "
          f"{'speedup pull':>12} {'push':>5} | {'KV path ms: none':>16} {'push':>6} | "
          f"{'KiB/turn: none':>14} {'reuse':>7} {'(back)':>7}")
    for r in result["table"]:
        print(f"{r['prefix_tokens']:>7} | {r['ttft_none_s'] * 1e3:>13.1f} "
              f"{r['ttft_pull_s'] * 1e3:>8.1f} {r['ttft_push_s'] * 1e3:>8.1f} | "
              f"{r['speedup_pull']:>11.1f}x {r['speedup_push']:>4.1f}x | "
              f"{r['kv_path_none_s'] * 1e3:>16.2f} {r['kv_path_push_s'] * 1e3:>6.2f} | "
              f"{r['bytes_per_turn_none'] / 1024:>14.0f} {r['bytes_per_turn_push'] / 1024:>7.0f}"
              f" {r['back_bytes_per_turn_push'] / 1024:>7.0f}")
    print(f"\nmultiturn_ttft_speedup (push, best prefix): {result['multiturn_ttft_speedup']:.1f}x "
          f"at {result['multiturn_best_prefix_tokens']} tokens; pull: "
          f"{result['multiturn_ttft_speedup_pull']:.1f}x")


def plot(result: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = result["table"]
    x = [r["prefix_tokens"] / 1024 for r in table]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, style in (("none", "o-"), ("pull", "s--"), ("push", "^-")):
        ax1.plot(x, [r[f"ttft_{name}_s"] * 1e3 for r in table], style,
                 label={"none": "no reuse"}.get(name, f"reuse, {name}"))
    ax1.set_yscale("log")
    ax1.set_xlabel("first-turn prompt (k tokens)")
    ax1.set_ylabel(f"TTFT, turns 2..{result['turns']} (ms)")
    ax1.set_title("TTFT per turn")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend()
    ax2.plot(x, [r["bytes_per_turn_none"] / 2**20 for r in table], "o-", label="no reuse")
    ax2.plot(x, [r["bytes_per_turn_push"] / 2**20 for r in table], "^-",
             label="reuse (back + forward)")
    ax2.set_yscale("log")
    ax2.set_xlabel("first-turn prompt (k tokens)")
    ax2.set_ylabel("KV moved per turn (MiB)")
    ax2.set_title("bytes moved per turn")
    ax2.grid(True, which="both", alpha=0.3)
    ax2.legend()
    fig.suptitle("kvpush multi-turn reuse (" + ("tiny model, measured" if result["real"]
                 else "tiny-model cost model + measured transfers") + ")")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.multiturn",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer prefixes and turns (~30 s)")
    ap.add_argument("--real", action="store_true",
                    help="run the tiny model itself (prefixes up to 2-3k tokens)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    result = run(args.quick, progress=True, real=args.real)
    print_table(result)
    name = "multiturn_real" if args.real else "multiturn"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=1))
    png = plot(result, args.out / f"{name}.png")
    print(f"\nwrote {args.out / (name + '.json')}, {png}  ({result['elapsed_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
