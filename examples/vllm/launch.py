"""Start and stop vLLM servers (and the example router) for kvpush's vLLM example, its tests
(``tests_vllm/``) and ``benchmarks/vllm/compare.py``. Standard library only.

Every server runs in its own session (process group) pinned to its own cores: ``taskset``
for all its processes, ``VLLM_CPU_OMP_THREADS_BIND`` for vLLM's model threads (see
``/work/shared/docs/VLLM_ON_CPU.md``). :meth:`Process.stop` ends the whole group (SIGTERM,
then SIGKILL), so nothing outlives a test. A vLLM server opens its ZeroMQ IPC sockets and
makes its temporary files in a folder of its own (:func:`rpc_folder`, :func:`scratch_env`),
which goes with the group: a server that is killed cannot remove them itself, and they
would pile up in the system's temp folder.
"""

from __future__ import annotations

import getpass
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
ROUTER = Path(__file__).resolve().parent / "router.py"

#: The environment every server gets: no downloads, a 1 GiB KV cache.
BASE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


#: Ports :func:`free_port` handed out in this process: never handed out twice.
_HANDED_OUT: set[int] = set()


def free_port(count: int = 1) -> int:
    """The first of ``count`` consecutive TCP ports free on 127.0.0.1 now (a TP instance's
    ranks listen at ``port + rank``) that this process has not handed out before. A port
    is only probed, not held, so two calls could otherwise return the same port before
    either server binds it (seen: a vLLM side channel's "Address already in use", and its
    server never healthy)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = int(s.getsockname()[1])
        ports = range(first, first + count)
        if first + count > 65536 or _HANDED_OUT.intersection(ports):
            continue
        if all(_bindable(p) for p in ports[1:]):
            _HANDED_OUT.update(ports)
            return first
    raise RuntimeError(f"no {count} consecutive free ports found")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def kvpush_config(role: str, port: int = 0, **extra: Any) -> dict[str, Any]:
    """``--kv-transfer-config`` for kvpush (role: ``kv_producer`` / ``kv_consumer``)."""
    cfg: dict[str, Any] = {"kv_connector": "KVPushConnector",
                           "kv_connector_module_path": "kvpush.integrations.vllm",
                           "kv_role": role,
                           "kv_connector_extra_config": {"port": port, **extra}}
    policy = cfg["kv_connector_extra_config"].pop("kv_load_failure_policy", None)
    if policy:
        cfg["kv_load_failure_policy"] = policy
    return cfg


def nixl_config(role: str, connector: str = "NixlConnector", engine_id: str | None = None,
                **extra: Any) -> dict[str, Any]:
    """``--kv-transfer-config`` for vLLM's own NIXL connectors on CPU memory."""
    cfg: dict[str, Any] = {"kv_connector": connector, "kv_role": role,
                           "kv_buffer_device": "cpu"}
    if engine_id:
        cfg["engine_id"] = engine_id
    if extra:
        cfg["kv_connector_extra_config"] = extra
    return cfg


@dataclass
class Process:
    """A child process group with a log file."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    port: int
    cores: str = ""
    #: A folder the group alone uses (vLLM's IPC sockets), removed once the group has ended.
    scratch: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def group_pids(self) -> list[int]:
        """Every process of the group (the server and the engine/worker processes)."""
        out = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                if os.getpgid(int(entry)) == self.proc.pid:
                    out.append(int(entry))
            except (ProcessLookupError, PermissionError):
                continue
        return sorted(out)

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, grace_s: float = 8.0) -> None:
        """SIGTERM the group, then SIGKILL whatever is left after ``grace_s``."""
        if self.alive():
            self.signal_group(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        self.signal_group(signal.SIGKILL)  # the engine processes, even if the parent left
        self._reap()

    def kill(self) -> None:
        """SIGKILL the whole group at once (a crash, as the fault tests need)."""
        self.signal_group(signal.SIGKILL)
        self._reap()

    def _reap(self) -> None:
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        if self.scratch is not None:  # a process still in the group after SIGKILL is gone soon
            shutil.rmtree(self.scratch, ignore_errors=True)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def spawn(name: str, cmd: Sequence[str], log: Path, port: int, *, cores: str = "",
          env: Mapping[str, str] | None = None, cwd: Path, scratch: Path | None = None,
          append: bool = False, stdin: int | None = None) -> Process:
    """Start ``cmd`` in a session (process group) of its own, its output to ``log``
    (appended to with ``append``). ``scratch``: a folder the group alone uses, removed
    with it, and at once if it cannot start."""
    try:
        with open(log, "ab" if append else "wb") as out:
            proc = subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT,
                                    stdin=stdin, env=env, start_new_session=True,
                                    cwd=str(cwd))
    except BaseException:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        raise
    return Process(name, proc, log, port, cores, scratch)


def rpc_folder(name: str) -> Path:
    """A new folder for one vLLM server's ZeroMQ IPC sockets (``VLLM_RPC_BASE_PATH``; vLLM
    puts them in the system's temp folder otherwise). Short, because a socket's path must
    fit in 107 bytes."""
    return Path(tempfile.mkdtemp(prefix=f"kvpush-{name[:20]}-"))


def scratch_env(scratch: Path) -> dict[str, str]:
    """The environment that keeps a vLLM server's temporary files in ``scratch`` (removed
    when its process group ends, a killed server's too): its IPC sockets
    (``VLLM_RPC_BASE_PATH``) and whatever it makes in the temp folder (``TMPDIR``: the
    ``vllm_dist_<uuid>`` file store of its process group, one per engine, otherwise left
    in the system's). TorchInductor's compile cache, which also lives in the temp folder by
    default, stays where it was, shared by every server."""
    inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
    return {"VLLM_RPC_BASE_PATH": str(scratch), "TMPDIR": str(scratch),
            "TORCHINDUCTOR_CACHE_DIR": inductor}


def start_vllm(model: str | Path, port: int, *, name: str, cores: str, log_dir: Path,
               kv_transfer_config: Mapping[str, Any] | None = None,
               extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
               python: str | None = None, max_model_len: int = 4096,
               omp_bind: str | None = None) -> Process:
    """Start ``vllm.entrypoints.openai.api_server`` on ``port``, pinned to ``cores``
    (``omp_bind``: vLLM's model-thread binding when it is not ``cores``, e.g. ``0|1`` for
    two tensor-parallel ranks on cores 0 and 1)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{name}.log"
    cmd = ["taskset", "-c", cores, python or sys.executable, "-m",
           "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", "tiny", "--port", str(port), "--host", "127.0.0.1",
           "--block-size", "32", "--max-model-len", str(max_model_len),
           "--disable-uvicorn-access-log", *extra_args]
    if kv_transfer_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    # kvpush comes from the venv (``.ci/bootstrap-vllm`` puts it there); the log folder as
    # working directory keeps a checkout's in-place kvpush/ off ``python -m``'s path.
    scratch = rpc_folder(name)
    full_env = {**os.environ, **BASE_ENV, "VLLM_CPU_OMP_THREADS_BIND": omp_bind or cores,
                **scratch_env(scratch)}
    full_env.update(env or {})
    return spawn(name, cmd, log, port, cores=cores, env=full_env, cwd=log_dir,
                 scratch=scratch)


def start_router(port: int, *, prefill: str, decode: str, log_dir: Path,
                 args: Sequence[str] = (), python: str | None = None,
                 nice: int = 0) -> Process:
    """Start ``examples/vllm/router.py`` (``nice``: its scheduling niceness; below 0 needs
    root or CAP_SYS_NICE)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"router-{port}.log"
    cmd = [python or sys.executable, str(ROUTER), "--port", str(port), "--prefill", prefill,
           "--decode", decode, *args]
    if nice:
        cmd = ["nice", "-n", str(nice), *cmd]
    return spawn("router", cmd, log, port, cwd=log_dir)


def wait_healthy(processes: Iterable[Process], timeout_s: float) -> None:
    """Wait until every process answers ``GET /health``; raise (with its log) if one dies
    or the time runs out."""
    pending = list(processes)
    deadline = time.monotonic() + timeout_s
    while pending:
        for p in list(pending):
            if not p.alive():
                raise RuntimeError(f"{p.name} exited with {p.proc.returncode}:\n{p.log_tail()}")
            try:
                with urllib.request.urlopen(p.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        pending.remove(p)
            except (urllib.error.URLError, OSError):
                pass
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"{[p.name for p in pending]} not healthy after {timeout_s} s:\n"
                               + "\n".join(p.log_tail() for p in pending))
        if pending:
            time.sleep(0.5)


def thread_cores(pid: int) -> dict[int, int]:
    """Last CPU each thread of ``pid`` ran on (``/proc/PID/task/*/stat`` field 39)."""
    out: dict[int, int] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        out[int(tid)] = int(fields[36])  # field 39 overall; fields[0] is field 3
    return out


def repin(process: Process, cores: str) -> None:
    """Pin every thread of every process of the group to ``cores`` again (vLLM's NIXL worker
    moves its model thread on CPU; kvpush never touches affinity)."""
    for pid in process.group_pids():
        subprocess.run(["taskset", "-a", "-p", "-c", cores, str(pid)], check=False,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def http_json(url: str, body: Mapping[str, Any] | None = None, timeout: float = 60.0,
              headers: Mapping[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    """POST (or GET without a body) JSON; returns (status, parsed body or {"raw": text})."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read().decode(errors="replace")
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, {"raw": text}


def metrics(url: str, prefix: str = "vllm:") -> dict[str, float]:
    """Prometheus samples from ``url/metrics`` whose name starts with ``prefix`` (labels
    dropped, values summed over label sets)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


@dataclass
class Fleet:
    """Processes to stop together (a test fixture or a script's ``finally``)."""

    processes: list[Process] = field(default_factory=list)

    def add(self, p: Process) -> Process:
        self.processes.append(p)
        return p

    def stop(self) -> None:
        for p in reversed(self.processes):
            p.stop()
        self.processes.clear()
