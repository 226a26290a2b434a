"""Tables, ``summary.json`` and plots from the suites' results."""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from ._common import fmt_bytes

__all__ = ["FLOORS", "TARGETS", "machine", "markdown_tables", "plot", "print_tables", "targets",
           "write_json"]

# key -> (comparison, threshold, what the issue asks)
TARGETS: dict[str, tuple[str, float, str]] = {
    "desc_prep_speedup_vs_numpy": (">=", 20.0, "descriptor prep >= 20x numpy of the same "
                                   "algorithm, int32 out (Qwen3-32B, 8192 blocks)"),
    "write_vs_raw_nixl": (">=", 0.95, "kvpush WRITE >= 0.95x raw NIXL"),
    "read_vs_raw_nixl": (">=", 0.95, "kvpush READ >= 0.95x raw NIXL"),
    "coalesced_vs_uncoalesced_write": (">=", 3.0, "runs: coalescing >= 3x"),
    "handover_overhead_push_over_pull": ("<=", 0.2, "push handover overhead <= 1/5 pull's"),
    "ttft_p50_pull_over_push_high_load": (">=", 3.0, "TTFT p50 pull/push >= 3x, high load"),
    "idle_cpu_pct_pair": ("<=", 2.0, "idle pair <= 2 % of a core"),
    "cpu_seconds_per_gib_vs_raw_nixl_default": ("<=", 0.5,
                                                "CPU-s/GiB <= 0.5x raw NIXL default"),
    "handover_latency_default_over_latency_first": ("<=", 1.2,
                                                    "handover default <= 1.2x latency-first"),
    # the per-request fixed cost, by size, and the busy engine
    "write_vs_raw_nixl_1mib_plus": (">=", 0.9, "kvpush WRITE >= 0.9x raw NIXL, >= 1 MiB"),
    "read_vs_raw_nixl_1mib_plus": (">=", 0.9, "kvpush READ >= 0.9x raw NIXL, >= 1 MiB"),
    "write_vs_raw_nixl_64kib": (">=", 0.7, "kvpush WRITE >= 0.7x raw NIXL at 64 KiB"),
    "read_vs_raw_nixl_64kib": (">=", 0.7, "kvpush READ >= 0.7x raw NIXL at 64 KiB"),
    "kvpush_overhead_us_p50_write": ("<=", 100.0, "kvpush fixed cost per WRITE <= 100 us p50"),
    "kvpush_overhead_us_p50_read": ("<=", 100.0, "kvpush fixed cost per READ <= 100 us p50"),
    "handover_busy_engine_over_idle": ("<=", 1.2,
                                       "handover with a busy engine thread <= 1.2x idle"),
}


#: For a target, the summary key of the same figure measured for the cheapest design of the
#: shape every engine integration has -- raw NIXL with one thread hop and nothing else (the
#: ``inline`` floor of ``benchmarks.throughput``), or a datagram handed to a sleeping thread
#: of one engine process and woken on in the other (``floor_x`` of
#: ``benchmarks.busy_engine``). A target that this floor misses in the same run cannot be
#: met on that host by any such design.
FLOORS: dict[str, str] = {
    "write_vs_raw_nixl_1mib_plus": "write_inline_floor_vs_raw_nixl_1mib_plus",
    "read_vs_raw_nixl_1mib_plus": "read_inline_floor_vs_raw_nixl_1mib_plus",
    "write_vs_raw_nixl_64kib": "write_inline_floor_vs_raw_nixl_64kib",
    "read_vs_raw_nixl_64kib": "read_inline_floor_vs_raw_nixl_64kib",
    "kvpush_overhead_us_p50_write": "inline_floor_us_p50_write",
    "kvpush_overhead_us_p50_read": "inline_floor_us_p50_read",
    "handover_busy_engine_over_idle": "handoff_floor_busy_over_idle",
}


def _meets(val: Any, cmp: str, thr: float) -> bool | None:
    if isinstance(val, (int, float)) and math.isfinite(val):
        return bool(val >= thr if cmp == ">=" else val <= thr)
    return None


def targets(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target with this run's value, whether it is met, and, where one is measured,
    the floor's value and whether the floor itself meets the target."""
    out = []
    for key, (cmp, thr, text) in TARGETS.items():
        val = summary.get(key)
        floor = summary.get(FLOORS[key]) if key in FLOORS else None
        out.append({"key": key, "target": f"{cmp} {thr:g}", "value": val,
                    "met": _meets(val, cmp, thr), "floor": floor,
                    "floor_meets": _meets(floor, cmp, thr), "what": text})
    return out


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"nproc": os.cpu_count(), "python": platform.python_version(),
                            "platform": platform.platform()}
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in lscpu.splitlines():
            if line.startswith("Model name:"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
            elif line.startswith("L3 cache:"):
                info["l3"] = line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        with open("/proc/meminfo") as f:
            kb = int(f.readline().split()[1])
        info["mem_gib"] = round(kb / (1 << 20), 1)
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/proc/loadavg") as f:
            info["loadavg_at_start"] = f.read().split()[:3]
    except OSError:
        pass
    try:
        import importlib.metadata as md

        info["nixl"] = md.version("nixl")
        info["numpy"] = md.version("numpy")
    except Exception:
        pass
    return info


def _f(v: Any, nd: int = 2) -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            return "nan"
        return f"{v:.{nd}f}"
    return str(v)


def _table(headers: list[str], rows: list[list[Any]], md: bool = False) -> str:
    cells = [[_f(c) for c in r] for r in rows]
    if md:  # GitHub markdown, for docs/BENCHMARKS.md
        return "\n".join(["| " + " | ".join(headers) + " |",
                          "|" + "---|" * len(headers)]
                         + ["| " + " | ".join(r) + " |" for r in cells])
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
              for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(out)


def tables(results: dict[str, Any], md: bool = False) -> str:
    parts = []
    table = functools.partial(_table, md=md)
    if "desc_prep" in results:
        r = results["desc_prep"]
        parts.append("Descriptor preparation, us per request (benchmarks.desc_prep: compiled "
                     "= PreparedLink.plan; numpy = same algorithm, int32 out; vLLM = its "
                     "connector's path; NIXL's own make_prepped_xfer and initialize_xfer)")
        parts.append(table(
            ["preset", "blocks", "order", "descs", "merged", "compiled", "via args", "numpy",
             "reference", "vLLM", "NIXL prepped", "NIXL explicit", "x numpy"],
            [[x["preset"], x["blocks"], x["order"], x["descriptors_before"],
              x["descriptors_after"], x["compiled_us"], x["compiled_args_us"], x["numpy_us"],
              x["reference_us"], x["vllm_us"], x.get("nixl_prepped_us", math.nan),
              x.get("nixl_explicit_us", math.nan), x["speedup_vs_numpy"]]
             for x in r["rows"]]))
    if "throughput" in results:
        r = results["throughput"]
        parts.append("Throughput, GB/s (one request at a time; raw = NIXL in kvpush's config)")
        rows = []
        for x in r["rows"]:
            rows.append([fmt_bytes(x["block_bytes"]), x["blocks"], x["order"],
                         x["memcpy_gbps"], x["raw_write_gbps"], x["kv_write_gbps"],
                         x["raw_read_gbps"], x["kv_read_gbps"],
                         x.get("raw_default_write_gbps", math.nan),
                         x.get("raw_default_read_gbps", math.nan),
                         x["write_vs_raw"], x["read_vs_raw"], x["write_vs_raw_best"],
                         x["read_vs_raw_best"], x["write_overhead_us"],
                         x.get("coalesce_gain_write", math.nan)])
        parts.append(table(["block", "n", "order", "memcpy", "raw W", "kv W", "raw R", "kv R",
                             "dflt W", "dflt R", "W/raw", "R/raw", "W/raw best", "R/raw best",
                             "W +us", "coal x"], rows))
    if "throughput" in results:
        rows = results["throughput"]["rows"]
        keys = ["engine_call", "to_loop", "prepare", "in_flight", "in_flight_extra",
                "release", "wake_engine"]
        if rows and "stage_to_loop_us_p50" in rows[0]:
            parts.append("Push by stage, p50 us (benchmarks.throughput.PUSH_STAGES; "
                         "in_flight_extra = in_flight - raw NIXL WRITE p50), and pull()'s call")
            parts.append(table(["block", "n", "order", *keys, "pull call"],
                               [[fmt_bytes(x["block_bytes"]), x["blocks"], x["order"],
                                 *(x.get(f"stage_{k}_us_p50", math.nan) for k in keys),
                                 x.get("stage_pull_call_us_p50", math.nan)] for x in rows]))
        if rows and "raw_write_handoff_us_p50" in rows[0]:
            parts.append("The hand-off floors, p50 us (benchmarks.throughput: raw NIXL handed "
                         "to a sleeping thread and back, or posted here and polled there; "
                         "kvpush over the handoff floor is kvpush's own work)")
            parts.append(table(
                ["block", "n", "order", "raw W", "handoff W", "inline W", "kv W",
                 "kv - handoff W", "raw R", "handoff R", "inline R", "kv R", "kv - handoff R"],
                [[fmt_bytes(x["block_bytes"]), x["blocks"], x["order"],
                  *(x[f"{k}_us_p50"] for k in ("raw_write", "raw_write_handoff",
                                               "raw_write_inline", "kv_write")),
                  x["write_over_handoff_floor_us"],
                  *(x[f"{k}_us_p50"] for k in ("raw_read", "raw_read_handoff",
                                               "raw_read_inline", "kv_read")),
                  x["read_over_handoff_floor_us"]] for x in rows]))
        wake = results["throughput"].get("wake")
        if wake:
            parts.append(f"The host's wake penalty (benchmarks._common.wake_penalty, no kvpush): "
                         f"a fixed piece of Python runs {wake['hot_us_p50']:.0f} us p50 back to "
                         f"back and {wake['cold_us_p50']:.0f} us right after a 2 ms sleep: "
                         f"+{wake['penalty_us_p50']:.0f} us for each thread a hand-over "
                         f"wakes (a raw NIXL loop polled back to back wakes none)")
    if "busy_engine" in results:
        r = results["busy_engine"]
        parts.append("Handover with a busy thread in each engine process, p50 / p90 us "
                     f"(switch interval {r['switch_interval_s'] * 1e3:g} ms)")
        parts.append(table(
            ["mode", "idle p50", "p90", "python p50", "p90", "x idle", "numpy p50", "p90",
             "x idle"],
            [[x["mode"], x["idle_p50_us"], x["idle_p90_us"], x["python_p50_us"],
              x["python_p90_us"], x["python_over_idle"], x["numpy_p50_us"], x["numpy_p90_us"],
              x["numpy_over_idle"]] for x in r["rows"]]))
        if "short_switch" in r:
            parts.append("The same with a 0.5 ms switch interval in both engines")
            parts.append(table(
                ["mode", "idle p50", "p90", "python p50", "p90", "x idle", "numpy p50", "p90",
                 "x idle"],
                [[x["mode"], x["idle_p50_us"], x["idle_p90_us"], x["python_p50_us"],
                  x["python_p90_us"], x["python_over_idle"], x["numpy_p50_us"],
                  x["numpy_p90_us"], x["numpy_over_idle"]]
                 for x in r["short_switch"]["rows"]]))
    if "engine_share" in results:
        r = results["engine_share"]
        parts.append("The engine's model thread beside kvpush: step ms while requests of "
                     f"{fmt_bytes(r['request_bytes'])} move (one every {r['every_steps']} "
                     "steps) and in quiet rounds; CPU outside the model thread")
        parts.append(table(
            ["side", "mode", "steps", "mean", "p50", "p90", "x quiet", "other CPU ms/s",
             "other CPU us/request"],
            [[x["side"], x["mode"], x["steps"], x["step_mean_ms"], x["step_p50_ms"],
              x["step_p90_ms"], x.get("mean_over_quiet", math.nan), x["other_cpu_ms_per_s"],
              x.get("other_cpu_us_per_request", math.nan)] for x in r["rows"]]))
    if "critical_path" in results:
        r = results["critical_path"]
        parts.append("Critical path, 1 prefill + 1 decode (TTFT = arrival -> first token "
                     "from the decode engine)")
        parts.append(table(
            ["mode", "req/s", "ok", "done/s", "keeps up", "TTFT p50 ms", "p90", "p99",
             "prefill->1st tok ms", "handover p50 ms", "overhead p50 us", "vs cold wire",
             "step ms", "batch"],
            [[x["mode"], x["rate"], x["ok"], x["throughput_rps"],
              "yes" if x.get("sustainable") else "no", x["ttft_p50_ms"],
              x["ttft_p90_ms"], x["ttft_p99_ms"], x.get("prefill_to_first_token_p50_ms", math.nan),
              x["handover_p50_ms"], x["handover_overhead_p50_us"],
              x.get("handover_overhead_vs_cold_wire_p50_us", math.nan),
              x.get("decode_step_p50_ms", math.nan), x.get("decode_batch_p50", math.nan)]
             for x in r["runs"]]))
        parts.append(table(["tokens", "bytes", "wire WRITE us p50", "min", "cold",
                             "wire READ us p50", "min", "cold"],
                            [[w["tokens"], fmt_bytes(w["bytes"]), w["write_us"],
                              w.get("write_min_us", math.nan), w.get("write_cold_us", math.nan),
                              w["read_us"], w.get("read_min_us", math.nan),
                              w.get("read_cold_us", math.nan)] for w in r["wire"]]))
        push_rows = [x for x in r["runs"] if x.get("push_stages_p50_us")]
        if push_rows:
            stages = list(push_rows[0]["push_stages_p50_us"])
            parts.append("Push handover by stage, p50 us (kvpush's Release.timings; "
                         "benchmarks.critical_path.PUSH_STAGES)")
            parts.append(table(["req/s", *stages],
                                [[x["rate"], *(x["push_stages_p50_us"][k] for k in stages)]
                                 for x in push_rows]))
    if "containment" in results:
        r = results["containment"]
        parts.append("Contained data plane (TransportConfig.data_plane='child') beside "
                     "in-process, one host, side by side")
        parts.append(table(["mode", "push handover p50 us", "pull handover p50 us",
                            "WRITE GB/s", "READ GB/s"],
                           [[x["mode"], x["push_handover_p50_us"], x["pull_handover_p50_us"],
                             x["write_gbps"], x["read_gbps"]] for x in r["rows"]]))
    if "cpu" in results:
        r = results["cpu"]
        parts.append("CPU and progress policy")
        parts.append(table(["figure", "value"], [[k, v] for k, v in r["summary"].items()]))
    return "\n\n".join(parts)


def _targets_table(summary: dict[str, Any], md: bool) -> str:
    word = {True: "yes", False: "NO", None: "-"}
    return _table(["key", "value", "target", "met", "floor", "floor meets it"],
                  [[t["key"], t["value"], t["target"], word[t["met"]],
                    "-" if t["floor"] is None else t["floor"], word[t["floor_meets"]]]
                   for t in targets(summary)], md)


def print_tables(results: dict[str, Any], summary: dict[str, Any]) -> None:
    print(tables(results))
    print()
    print("Targets")
    print(_targets_table(summary, md=False))


def markdown_tables(results: dict[str, Any], summary: dict[str, Any]) -> str:
    """The printed tables as GitHub markdown (``tables.md`` of a run), for the docs."""
    return f"{tables(results, md=True)}\n\nTargets\n\n{_targets_table(summary, md=True)}\n"


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=1, sort_keys=False, default=_jsonable) + "\n")
    tmp.replace(path)


def _jsonable(obj: Any) -> Any:
    try:
        import numpy as np

        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, np.ndarray):
            return obj.tolist()
    except ImportError:
        pass
    return str(obj)


def plot(results: dict[str, Any], outdir: Path) -> list[Path]:
    """PNG plots; returns the files written (none if matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    outdir.mkdir(parents=True, exist_ok=True)
    written = []
    if "throughput" in results:
        rows = [x for x in results["throughput"]["rows"] if x["order"] == "scattered"]
        # one request size per block size: the largest measured
        best: dict[int, dict[str, Any]] = {}
        for x in rows:
            if x["blocks"] > 1 and (x["block_bytes"] not in best
                                    or x["request_bytes"] > best[x["block_bytes"]]
                                    ["request_bytes"]):
                best[x["block_bytes"]] = x
        pts = [best[k] for k in sorted(best)]
        if pts:
            fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=90)
            xs = [p["block_bytes"] / 1024 for p in pts]
            for key, label, style in (
                ("memcpy_gbps", "memcpy (numpy, 1 thread)", "k--"),
                ("raw_write_gbps", "raw NIXL WRITE", "C0:"),
                ("kv_write_gbps", "kvpush WRITE (push)", "C0-o"),
                ("raw_read_gbps", "raw NIXL READ", "C1:"),
                ("kv_read_gbps", "kvpush READ (pull)", "C1-s"),
                ("raw_default_write_gbps", "raw NIXL WRITE, NIXL defaults", "C2-."),
            ):
                ys = [p.get(key, math.nan) for p in pts]
                if any(math.isfinite(y) for y in ys):
                    ax.plot(xs, ys, style, label=label, linewidth=1.4, markersize=4)
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs)
            ax.set_xticklabels([fmt_bytes(p["block_bytes"]).replace(" ", "") for p in pts])
            ax.set_xlabel("block size (scattered blocks; request = "
                          + ", ".join(f"{p['blocks']}" for p in pts) + " blocks)")
            ax.set_ylabel("GB/s")
            ax.set_title("Throughput vs block size, two processes", fontsize=10)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
            fig.tight_layout()
            path = outdir / "throughput_vs_block_size.png"
            fig.savefig(path)
            plt.close(fig)
            written.append(path)
    if "critical_path" in results:
        runs = results["critical_path"]["runs"]
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=90)
        for mode, color in (("push", "C0"), ("pull", "C1")):
            sel = sorted((x for x in runs if x["mode"] == mode), key=lambda x: x["rate"])
            xs = [x["rate"] for x in sel]
            ax.plot(xs, [x["ttft_p50_ms"] for x in sel], f"{color}-o", label=f"{mode} p50",
                    markersize=4)
            ax.plot(xs, [x["ttft_p90_ms"] for x in sel], f"{color}--", label=f"{mode} p90",
                    linewidth=1)
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_ylabel("TTFT (ms): arrival -> first decode token")
        ax.set_title("Push vs pull, 1 prefill + 1 decode", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = outdir / "ttft_vs_rate.png"
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written
