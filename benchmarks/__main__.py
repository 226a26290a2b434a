"""``python -m benchmarks [--quick] [--only SUITE ...] [--list [--verbose]]``: run the kvpush
benchmark suites (:mod:`benchmarks.suites`), print their tables, and write
``benchmarks/results/summary.json`` (flat figures + targets + machine), ``results.json``
(every row), ``tables.md`` and PNG plots."""

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
from .suites import ORDER, Suite, load, load_all


def _list(verbose: bool) -> None:
    for suite in load_all():
        print(f"{suite.name:<14} {suite.description}")
        if verbose:
            for key, meaning in suite.summary_keys.items():
                print(f"    {key}: {meaning}")
            print()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    ap.add_argument("--quick", action="store_true",
                    help="small sweep, few requests (under 3 minutes on a 2-core host)")
    ap.add_argument("--only", nargs="+", choices=ORDER, default=list(ORDER), metavar="SUITE",
                    help="suites to run (default: all; --list names them)")
    ap.add_argument("--list", action="store_true",
                    help="print each suite's name and what it measures, and exit")
    ap.add_argument("--verbose", "-v", action="store_true",
                    help="with --list: also each suite's summary keys and their meaning")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results",
                    help="output directory (default: benchmarks/results)")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    args = ap.parse_args(argv)
    if args.list:
        _list(args.verbose)
        return 0
    progress = not args.no_progress
    command = "python -m benchmarks " + " ".join(shlex.quote(a) for a in (
        argv if argv is not None else sys.argv[1:]))
    t0 = time.monotonic()
    info = machine()
    results: dict[str, Any] = {}
    errors: dict[str, str] = {}
    summary: dict[str, Any] = {}
    ran: list[Suite] = []
    for name in args.only:
        t_suite = time.monotonic()
        try:
            suite = load(name)
            results[name] = suite.run(args.quick, progress)
        except KeyboardInterrupt:
            raise
        except Exception as exc:
            traceback.print_exc()
            errors[name] = f"{type(exc).__name__}: {exc}"
            continue
        results[name]["elapsed_s"] = time.monotonic() - t_suite
        ran.append(suite)
        summary.update(results[name].get("summary", {}))
    elapsed = time.monotonic() - t0
    plots = [] if args.no_plots else plot(results, args.out)
    print()
    print_tables(results, summary)
    # the suites that format their own tables (markdown), after the report's
    own = "".join(f"\n{suite.name}: {suite.description}\n\n{suite.table(results[suite.name])}\n"
                  for suite in ran if suite.table is not None)
    print(own, end="")
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
    (args.out / "tables.md").write_text(markdown_tables(results, summary) + own)
    print(f"\nwrote {args.out / 'summary.json'}, {args.out / 'results.json'}, "
          f"{args.out / 'tables.md'}" + "".join(f", {p}" for p in plots)
          + f"  ({elapsed:.0f} s)")
    if errors:
        print(f"suites failed: {', '.join(errors)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
