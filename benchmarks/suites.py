"""The benchmark suites, found by name.

A suite is a module of this package that declares

* ``NAME`` -- its name (the module's own), what ``python -m benchmarks --only`` takes;
* ``DESCRIPTION`` -- one line: what it measures;
* ``SUMMARY_KEYS`` -- every key it adds to ``summary.json``, each with one line of meaning.
  A key may name a family with ``{placeholders}`` (``engine_step_{side}_{mode}_over_quiet``),
  each standing for one word of letters, digits and ``_``;
* ``run(quick, progress)`` -- runs it and returns its results, the figures above under
  ``"summary"``;

and may declare ``table(result) -> str``, printed after the run's tables. :data:`ORDER` is
the order of a full run (quick, in-process suites first).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

__all__ = ["ORDER", "Suite", "load", "load_all"]

ORDER = ("desc_prep", "core_stream", "throughput", "hot_path", "critical_path", "busy_engine",
         "engine_share", "cpu", "cpu_per_request", "layerwise", "multiturn", "containment")


@dataclass(frozen=True)
class Suite:
    """One suite as its module declares it."""

    name: str
    description: str
    summary_keys: Mapping[str, str]
    run: Callable[[bool, bool], dict[str, Any]]
    table: Callable[[dict[str, Any]], str] | None = None

    @cached_property
    def _patterns(self) -> list[re.Pattern[str]]:
        return [re.compile(re.sub(r"\\\{\w+\\\}", "[A-Za-z0-9_]+", re.escape(key)) + r"\Z")
                for key in self.summary_keys]

    def undocumented(self, summary: Mapping[str, Any]) -> list[str]:
        """The keys of ``summary`` that :attr:`summary_keys` does not name."""
        return [key for key in summary if not any(p.match(key) for p in self._patterns)]


def load(name: str) -> Suite:
    """The suite ``name`` (a name of :data:`ORDER`), its module imported."""
    if name not in ORDER:
        raise ValueError(f"no benchmark suite {name!r}; the suites are {', '.join(ORDER)}")
    module = importlib.import_module(f"{__package__}.{name}")
    if getattr(module, "NAME", None) != name:
        raise TypeError(f"benchmarks.{name} declares NAME = {getattr(module, 'NAME', None)!r}")
    return Suite(name, module.DESCRIPTION, module.SUMMARY_KEYS, module.run,
                 getattr(module, "table", None))


def load_all() -> list[Suite]:
    """Every suite, in the order of a full run."""
    return [load(name) for name in ORDER]
