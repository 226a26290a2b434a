"""``python -m benchmarks [--quick] [--only SUITE ...]``: run the kvpush benchmarks, print a
table, and write ``benchmarks/results/summary.json`` (flat figures + targets + machine),
``results.json`` (every row) and PNG plots."""

from __future__ import annotations

import argparse
import shlex
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from . import SCHEMA_VERSION
from .report import machine, markdown_tables, plot, print_tables, targets, write_json

SUITES = ("desc_prep", "throughput", "critical_path", "busy_engine", "engine_share", "cpu",
          "layerwise", "multiturn", "containment")


def _run_suite(name: str, quick: bool, progress: bool) -> dict[str, Any]:
    if name == "desc_prep":
        from . import desc_prep

        return desc_prep.run(quick, progress)
    if name == "throughput":
        from . import throughput

        return throughput.run(quick, progress)
    if name == "critical_path":
        from . import critical_path

        return critical_path.run(quick, progress)
    if name == "busy_engine":
        from . import busy_engine

        return busy_engine.run(quick, progress)
    if name == "engine_share":
        from . import engine_share

        return engine_share.run(quick, progress)
    if name == "cpu":
        from . import cpu

        return cpu.run(quick, progress)
    if name == "layerwise":
        from . import layerwise

        return layerwise.run(quick)
    if name == "multiturn":
        from . import multiturn

        return multiturn.run(quick, progress)
    if name == "containment":
        from . import containment

        return containment.run(quick, progress)
    raise ValueError(name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    ap.add_argument("--quick", action="store_true",
                    help="small sweep, few requests (under 3 minutes on a 2-core host)")
    ap.add_argument("--only", nargs="+", choices=SUITES, default=list(SUITES),
                    help="suites to run (default: all)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results",
                    help="output directory (default: benchmarks/results)")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    args = ap.parse_args(argv)
    progress = not args.no_progress
    command = "python -m benchmarks " + " ".join(shlex.quote(a) for a in (
        argv if argv is not None else sys.argv[1:]))
    t0 = time.monotonic()
    info = machine()
    results: dict[str, Any] = {}
    errors: dict[str, str] = {}
    summary: dict[str, Any] = {}
    for name in args.only:
        t_suite = time.monotonic()
        try:
            results[name] = _run_suite(name, args.quick, progress)
        except KeyboardInterrupt:
            raise
        except Exception as exc:
            traceback.print_exc()
            errors[name] = f"{type(exc).__name__}: {exc}"
            continue
        results[name]["elapsed_s"] = time.monotonic() - t_suite
        summary.update(results[name].get("summary", {}))
    elapsed = time.monotonic() - t0
    plots = [] if args.no_plots else plot(results, args.out)
    print()
    print_tables(results, summary)
    try:
        with open("/proc/loadavg") as f:
            info["loadavg_at_end"] = f.read().split()[:3]
    except OSError:
        pass
    meta = {"schema": SCHEMA_VERSION, "command": command, "quick": args.quick,
            "elapsed_s": round(elapsed, 1), "machine": info, "errors": errors,
            "suite_elapsed_s": {k: round(v["elapsed_s"], 1) for k, v in results.items()},
            "plots": [str(p) for p in plots]}
    write_json(args.out / "summary.json", {**summary, "targets": targets(summary),
                                           "meta": meta})
    write_json(args.out / "results.json", {"meta": meta, **results})
    (args.out / "tables.md").write_text(markdown_tables(results, summary))
    print(f"\nwrote {args.out / 'summary.json'}, {args.out / 'results.json'}, "
          f"{args.out / 'tables.md'}" + "".join(f", {p}" for p in plots)
          + f"  ({elapsed:.0f} s)")
    if errors:
        print(f"suites failed: {', '.join(errors)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
