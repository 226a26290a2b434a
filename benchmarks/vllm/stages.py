"""Where a disaggregated request's time to first token goes, from real vLLM servers' logs.

The adapter's ``stage_log`` (``kv_connector_extra_config``) and the router's ``--stage-log``
write one line per stage and request::

    kvpush stage <time.monotonic()> <stage> <id> r<rank>|router <detail>

``time.monotonic`` is one clock for every process of a host, so the lines of the prefill
instance's ranks, the decode instance's ranks and the router line up. This script reads them
(any number of log files, or folders of ``*.log``), joins each request's stages by its id
(the router's request id, which the router also makes the kvpush transfer id; vLLM's own
request id, ``cmpl-<id>-...``, for ``reported``) and prints, per kind of request, the median
and p90 of each step (ms):

============================  =================================================================
``router -> prefill sched``   the router took the request -> the prefill instance scheduled its
                              last chunk (HTTP, tokenisation, the engine's queue)
``prefill forward``           -> every prefill rank handed the blocks to kvpush (``prefill_done``)
``hand-over``                 -> the decode's kvpush loop had all the KV (push: from the last
                              ``prefill_done``; pull: from the READ's start). The loop's moment is
                              the registration / READ plus the result's ``elapsed_s``
``pull: router -> READ``      (pull) last ``prefill_done`` -> the decode started its READ: the
                              prefill's answer, the router, the decode instance's queue
``engine pickup``             kvpush's loop had it -> vLLM's worker took the result (its next
                              ``get_finished``)
``to first chunk``            vLLM was told (``reported``) -> the router saw the decode's first
                              chunk: a scheduler step, the first decode forward, the answer
``TTFT at router``            router in -> first chunk to the client
============================  =================================================================

Run: ``python -m benchmarks.vllm.stages LOG_OR_DIR [...]`` (``--json`` for the figures as
JSON). :mod:`benchmarks.vllm.compare` turns both logs on and stores this per set-up.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Request", "main", "parse", "summarize"]

_LINE = re.compile(r"kvpush stage (\d+\.\d+) (\w+) (\S+) (r\d+|router) ?(.*)$")
_VLLM_ID = re.compile(r"^(?:cmpl|chatcmpl)-(.+)-\d+-[0-9a-f]+$")
_ELAPSED = re.compile(r"elapsed (\d+\.\d+)")
_REQUEST = re.compile(r"request (\S+)")

STEPS = ("router -> prefill sched", "prefill forward", "hand-over", "pull: router -> READ",
         "engine pickup", "to first chunk", "TTFT at router")


@dataclass
class Request:
    """One request's stamps: stage -> rank -> first time seen (``router`` for the router)."""

    rid: str
    stamps: dict[str, dict[str, float]] = field(default_factory=lambda: defaultdict(dict))
    mode: str = ""
    first_from: str = ""
    elapsed: dict[str, float] = field(default_factory=dict)  # rank -> the result's elapsed_s

    def first(self, stage: str) -> float:
        ranks = self.stamps.get(stage)
        return min(ranks.values()) if ranks else math.nan

    def last(self, stage: str) -> float:
        ranks = self.stamps.get(stage)
        return max(ranks.values()) if ranks else math.nan

    @property
    def ready(self) -> float:
        """When the decode's kvpush loop had every rank's KV: each rank's registration (push)
        or READ (pull) plus its result's ``elapsed_s``, the latest."""
        start = self.stamps.get("registered" if self.mode == "push" else "pull_started", {})
        times = [start[who] + el for who, el in self.elapsed.items() if who in start]
        return max(times) if times else math.nan

    @property
    def label(self) -> str:
        return f"{self.mode}, first token from {self.first_from or 'decode'}"

    def steps(self) -> dict[str, float]:
        """The steps of :data:`STEPS` this request has, in ms."""
        t_in = self.first("router_in")
        sched = self.first("send_planned")
        done = self.last("prefill_done")
        start = self.last("registered" if self.mode == "push" else "pull_started")
        ready = self.ready
        out = {
            "router -> prefill sched": sched - t_in,
            "prefill forward": done - sched,
            "hand-over": ready - (done if self.mode == "push" else start),
            "engine pickup": self.last("loaded") - ready,
            # (from the prefill: the first chunk leaves before the decode has the KV)
            "to first chunk": self.first("first_chunk") - self.last("reported")
            if self.first_from != "prefill" else math.nan,
            "TTFT at router": self.first("first_chunk") - t_in,
        }
        if self.mode == "pull":
            out["pull: router -> READ"] = start - done
        return {k: v * 1e3 for k, v in out.items() if math.isfinite(v)}


def _files(paths: list[str]) -> list[Path]:
    out: list[Path] = []
    for p in map(Path, paths):
        out.extend(sorted(p.glob("*.log")) if p.is_dir() else [p])
    return out


def parse(paths: list[str]) -> dict[str, Request]:
    """Every request with a ``router_in`` stamp in the logs under ``paths``."""
    reqs: dict[str, Request] = {}
    vllm_ids: dict[str, str] = {}   # vLLM's request id -> the transfer id
    reported: list[tuple[str, str, float]] = []

    def req(rid: str) -> Request:
        return reqs.setdefault(rid, Request(rid))

    for path in _files(paths):
        with open(path, errors="replace") as f:
            for line in f:
                m = _LINE.search(line.rstrip("\n"))
                if m is None:
                    continue
                t, stage, rid, who, detail = float(m[1]), m[2], m[3], m[4], m[5].strip()
                if stage == "reported":  # vLLM's id: joined once every log is read
                    reported.append((rid, who, t))
                    continue
                r = req(rid)
                r.stamps[stage].setdefault(who, t)
                if stage == "router_in":
                    r.mode = detail.split()[0] if detail else ""
                elif stage == "first_chunk":
                    r.first_from = detail
                elif stage == "loaded":
                    el = _ELAPSED.search(detail)
                    if el:
                        r.elapsed.setdefault(who, float(el[1]))
                    named = _REQUEST.search(detail)
                    if named:
                        vllm_ids[named[1]] = rid
    for vid, who, t in reported:
        tid = vllm_ids.get(vid)
        if tid is None:
            m = _VLLM_ID.match(vid)
            tid = m[1] if m else vid
        req(tid).stamps["reported"].setdefault(who, t)
    return {rid: r for rid, r in reqs.items() if "router_in" in r.stamps}


def summarize(reqs: dict[str, Request]) -> dict[str, dict[str, dict[str, float]]]:
    """Per kind of request (:attr:`Request.label`): each step's n, p50 and p90 (ms)."""
    by: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in reqs.values():
        for step, ms in r.steps().items():
            by[r.label][step].append(ms)
    out: dict[str, dict[str, dict[str, float]]] = {}
    for label, steps in sorted(by.items()):
        out[label] = {}
        for step in STEPS:
            vals = sorted(steps.get(step, []))
            if vals:
                out[label][step] = {"n": len(vals), "p50": round(statistics.median(vals), 2),
                                    "p90": round(vals[min(len(vals) - 1,
                                                          int(0.9 * len(vals)))], 2)}
    return out


def table(summary: dict[str, dict[str, dict[str, float]]]) -> str:
    lines = ["| requests | " + " | ".join(STEPS) + " |",
             "|---|" + "---|" * len(STEPS)]
    for label, steps in summary.items():
        n = max((s["n"] for s in steps.values()), default=0)
        cells = [f"{steps[s]['p50']} / {steps[s]['p90']}" if s in steps else "—"
                 for s in STEPS]
        lines.append(f"| {label} ({int(n)}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="+", help="log files, or folders of *.log")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = p.parse_args(argv)
    files = _files(args.paths)
    if not files:
        print(f"no log files under {args.paths}", file=sys.stderr)
        return 2
    summary = summarize(parse(args.paths))
    if not summary:
        print("no 'kvpush stage' lines with a router_in stamp: were the adapter's stage_log "
              "and the router's --stage-log on?", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print("p50 / p90 ms per step (see the module's docstring)")
        print(table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
