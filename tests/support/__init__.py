"""What the tests share, and what the benchmarks reuse: ``harness`` (caches, fills, a
Producer in a child process), ``cores`` (rigs for the sans-IO protocol cores), ``netns``,
``netns_node`` and ``netns_fabric`` (endpoints on hosts made of network namespaces),
``reference`` (the numpy twin of ``kvpush._core``), ``sim_doubles`` (planted faults for
the simulator) and ``etcd`` (a private etcd member for the discovery tests); here,
``ci_sim_runs`` (the runs of ``.ci/run-sim``, for tests that replay one)."""

from pathlib import Path

#: The repository root: the working directory and ``PYTHONPATH`` of child processes.
ROOT = Path(__file__).resolve().parents[2]


def ci_sim_runs() -> list[list[str]]:
    """The arguments of each run of ``.ci/run-sim``, in order: continued lines joined, and
    ``$FAULTS`` as CI gives it (every fault)."""
    prefix = '"$PY" -m kvpush.testing.sim '
    text = (ROOT / ".ci" / "run-sim").read_text().replace("\\\n", " ")
    return [[arg.replace('"$FAULTS"', "all") for arg in line[len(prefix):].split()]
            for line in map(str.strip, text.splitlines()) if line.startswith(prefix)]
