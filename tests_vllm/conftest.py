"""Fixtures for the real-vLLM tests: a tiny model made offline, colocated reference tokens,
and one pair of vLLM servers with kvpush (prefill on core 0, decode on core 1) plus the
example router, shared by every test of the session and stopped by pid at the end.

Run with ``bash .ci/run-vllm`` (it makes .venv-vllm first).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from examples.vllm import launch
from tests.support.terminate import pytest_configure  # noqa: F401 - the hook: SIGTERM tears down

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

MAX_TOKENS = 16
BLOCK = 32
#: Prompt token counts: under one block, several blocks, ~20 and ~47 blocks.
LENGTHS = (40, 200, 650, 1500)
SHARED_PREFIX = 256  # 8 blocks, for the decode-side prefix-cache tests


def _ids(rng: np.random.Generator, n: int) -> list[int]:
    return [int(x) for x in rng.integers(7, 2048, size=n)]  # no special tokens


def make_prompts() -> dict[str, list[int]]:
    rng = np.random.default_rng(1234)
    prompts = {f"len{n}": _ids(rng, n) for n in LENGTHS}
    for mode in ("push", "pull"):
        prompts[f"{mode}-a"] = _ids(rng, 300)
    for mode in ("push", "pull"):
        prefix = _ids(rng, SHARED_PREFIX)
        prompts[f"{mode}-p1"] = prefix + _ids(rng, 90)
        prompts[f"{mode}-p2"] = prefix + _ids(rng, 130)
    for i in range(6):
        prompts[f"conc{i}"] = _ids(rng, 100 + 97 * i)
    prompts["fault"] = _ids(rng, 500)
    return prompts


PROMPTS = make_prompts()


@dataclass
class Pair:
    prefill: launch.Process
    decode: launch.Process
    router: launch.Process
    producer_address: str

    def complete(self, prompt: list[int], *, mode: str, via_router: bool = True,
                 stream: bool = False, first_token: str | None = None,
                 timeout: float = 120.0) -> tuple[int, dict[str, Any]]:
        body: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS,
                                "temperature": 0, "return_token_ids": True,
                                "kvpush_mode": mode}
        if first_token is not None:  # the router's: which instance gives the first token
            body["kvpush_first_token"] = first_token
        if stream:
            body["stream"] = True
            return stream_tokens(self.router.url + "/v1/completions", body, timeout)
        return launch.http_json(self.router.url + "/v1/completions", body, timeout=timeout)


def sse_events(response: Iterable[bytes]) -> Iterator[dict[str, Any]]:
    """The JSON events of a server-sent-events completion stream, ``[DONE]`` left out."""
    for raw in response:
        line = raw.decode().strip()
        if line.startswith("data:") and line != "data: [DONE]":
            yield json.loads(line[5:])


def stream_tokens(url: str, body: dict[str, Any], timeout: float) -> tuple[int, dict[str, Any]]:
    """POST a streaming completion; gather the token ids of every SSE chunk (and the
    router's ``X-KVPush-First-Token`` answer header, as ``first_token_from``)."""
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    tokens: list[int] = []
    chunks = 0
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for event in sse_events(r):
            chunks += 1
            for choice in event.get("choices", []):
                tokens += choice.get("token_ids") or []
        status = r.status
        first_from = r.headers.get("X-KVPush-First-Token")
    return status, {"choices": [{"token_ids": tokens}], "chunks": chunks,
                    "first_token_from": first_from}


def tokens_of(response: dict[str, Any]) -> list[int]:
    return list(response["choices"][0]["token_ids"])


@pytest.fixture(scope="session")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="session")
def model_dir(workdir: Path) -> Path:
    out = workdir / "tiny-llama"
    subprocess.run([sys.executable, str(REPO / "examples/vllm/make_tiny_model.py"), str(out)],
                   check=True, timeout=300)
    return out


class Colocated:
    """The reference tokens of single colocated vLLM instances (no connector), made by one
    process (``reference.py --serve``, pinned to core 0) for the whole session: vLLM is
    imported once, and each model's engine is made, used and dropped in turn. Started at
    the first request; :meth:`stop` ends it by pid. Outputs are kept in ``workdir``
    (``ref-<tag>-out.json``) and made once."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.log = workdir / "reference.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._reply = -1
        self._buf = b""

    def tokens(self, model: Path, names: list[str] | tuple[str, ...], tag: str, *,
               dtype: str | None = None, prefix_caching: bool = True,
               attention_backend: str | None = None,
               timeout: float = 400.0) -> dict[str, list[int]]:
        """``{name: tokens}`` for the prompts ``names`` of :data:`PROMPTS` (``tag`` names the
        set: one model, dtype, prompt set, caching and attention backend per tag)."""
        src, dst = self.workdir / f"ref-{tag}-in.json", self.workdir / f"ref-{tag}-out.json"
        if not dst.exists():
            src.write_text(json.dumps({"prompts": [PROMPTS[n] for n in names],
                                       "max_tokens": MAX_TOKENS}))
            self._run({"model": str(model), "src": str(src), "dst": str(dst), "dtype": dtype,
                       "prefix_caching": prefix_caching,
                       "attention_backend": attention_backend}, timeout)
        return dict(zip(names, json.loads(dst.read_text()), strict=True))

    def _run(self, job: dict[str, Any], timeout: float) -> None:
        if self._proc is None:
            self._start()
        assert self._proc is not None and self._proc.stdin is not None
        try:
            self._proc.stdin.write(json.dumps(job).encode() + b"\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            self.stop()
            raise RuntimeError(f"the reference process died:\n{self._log_tail()}") from None
        answer = json.loads(self._read_line(timeout))
        if not answer.get("ok"):
            raise RuntimeError(f"reference run of {job['model']} failed: {answer.get('error')}"
                               f"\n{self._log_tail()}")

    def _log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def _start(self) -> None:
        env = {**os.environ, **launch.BASE_ENV, "VLLM_CPU_OMP_THREADS_BIND": "0"}
        read, write = os.pipe()
        try:
            with open(self.log, "ab") as out:
                self._proc = subprocess.Popen(
                    ["taskset", "-c", "0", sys.executable, str(HERE / "reference.py"),
                     "--serve", str(write)], stdin=subprocess.PIPE, stdout=out,
                    stderr=subprocess.STDOUT, env=env, cwd=str(self.workdir),
                    pass_fds=(write,))
        except BaseException:
            os.close(read)
            raise
        finally:
            os.close(write)
        self._reply = read

    def _read_line(self, timeout: float) -> bytes:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._reply], [], [], left)[0]:
                self.stop()
                raise TimeoutError(f"no reference tokens after {timeout:.0f} s "
                                   f"(log: {self.log})")
            chunk = os.read(self._reply, 4096)
            if not chunk:
                self.stop()
                raise RuntimeError(f"the reference process died:\n{self._log_tail()}")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line

    def stop(self) -> None:
        """End the process (its input closed, then by pid if it lingers)."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.stdin is not None:
                try:
                    proc.stdin.close()
                except OSError:
                    pass
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
        if self._reply >= 0:
            os.close(self._reply)
            self._reply = -1
        self._buf = b""


@pytest.fixture(scope="session")
def colocated(workdir: Path) -> Iterator[Colocated]:
    runner = Colocated(workdir)
    try:
        yield runner
    finally:
        runner.stop()


@pytest.fixture(scope="session")
def reference(model_dir: Path, colocated: Colocated) -> dict[str, list[int]]:
    """Tokens of a single colocated vLLM instance (no connector), prompt by prompt."""
    return colocated.tokens(model_dir, list(PROMPTS), "tiny-llama-all")


@pytest.fixture(scope="session")
def pair(model_dir: Path, workdir: Path, reference: dict[str, list[int]]) -> Iterator[Pair]:
    """Prefill (kv_producer, core 0) + decode (kv_consumer, core 1) + router."""
    fleet = launch.Fleet()
    logs = workdir / "logs"
    kv_port, p_port, d_port, r_port = (launch.free_port() for _ in range(4))
    producer = f"tcp://127.0.0.1:{kv_port}"
    common = ["-O0", "--max-num-seqs", "16"]
    try:
        prefill = fleet.add(launch.start_vllm(
            model_dir, p_port, name="prefill", cores="0", log_dir=logs, extra_args=common,
            kv_transfer_config=launch.kvpush_config("kv_producer", kv_port)))
        decode = fleet.add(launch.start_vllm(
            model_dir, d_port, name="decode", cores="1", log_dir=logs, extra_args=common,
            # Fast failure detection for the fault test; the default policy (fail) applies.
            kv_transfer_config=launch.kvpush_config("kv_consumer", peer_timeout_s=3.0,
                                                    heartbeat_s=0.5, request_timeout_s=60.0)))
        router = fleet.add(launch.start_router(
            r_port, prefill=prefill.url, decode=decode.url, log_dir=logs,
            args=["--producers", producer]))
        start = time.monotonic()
        launch.wait_healthy([prefill, decode, router], timeout_s=420)
        print(f"\nservers healthy after {time.monotonic() - start:.0f} s; logs in {logs}")
        yield Pair(prefill, decode, router, producer)
    finally:
        fleet.stop()
