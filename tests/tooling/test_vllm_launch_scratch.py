"""``examples/vllm/launch.start_vllm``: a vLLM server opens its ZeroMQ IPC sockets under
``VLLM_RPC_BASE_PATH`` (the system's temp folder by default) and a killed server cannot
remove them, so the tests' servers left thousands of sockets in ``/tmp``; vLLM also leaves
one ``vllm_dist_<uuid>`` file store per engine in the temp folder. Each server now gets a
folder of its own, its temp folder too, that goes when its process group ends. A stand-in
for vLLM binds a socket and makes a file where vLLM would, so no vLLM is needed."""

from __future__ import annotations

import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from examples.vllm import launch

# Called as ``python -m vllm.entrypoints.openai.api_server ...``: binds one IPC socket where
# vLLM puts its own, says so, and sleeps until it is signalled.
STAND_IN = """#!{python}
import os, socket, sys, tempfile, time, uuid
s = socket.socket(socket.AF_UNIX)
s.bind(os.path.join(os.environ["VLLM_RPC_BASE_PATH"], "engine-core"))
# vLLM's process-group file store (get_file_store_init_method): one per engine
open(os.path.join(tempfile.gettempdir(), f"vllm_dist_{{uuid.uuid4().hex}}"), "w").close()
print("bound", flush=True)
time.sleep(120)
"""


def _start(tmp_path: Path) -> launch.Process:
    fake = tmp_path / "python"
    fake.write_text(STAND_IN.format(python=sys.executable))
    fake.chmod(0o755)
    proc = launch.start_vllm("tiny", launch.free_port(), name="stand-in", cores="0",
                             log_dir=tmp_path / "logs", python=str(fake))
    deadline = time.monotonic() + 30
    while "bound" not in proc.log.read_text():
        assert proc.alive() and time.monotonic() < deadline, proc.log_tail()
        time.sleep(0.05)
    return proc


@pytest.mark.parametrize("end", [launch.Process.stop, launch.Process.kill],
                         ids=["stopped", "killed"])
def test_a_servers_ipc_sockets_go_with_it(tmp_path: Path,
                                          end: Callable[[launch.Process], None]) -> None:
    proc = _start(tmp_path)
    try:
        scratch = proc.scratch
        assert scratch is not None and scratch.parent == Path(tempfile.gettempdir())
        assert [p.name for p in scratch.iterdir() if p.is_socket()] == ["engine-core"]
        # what it makes in the temp folder is in its own too
        assert [p.name[:10] for p in scratch.iterdir() if p.is_file()] == ["vllm_dist_"]
        # The longest socket path vLLM makes there (a uuid4) fits a socket's 107 bytes.
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(scratch / ("0" * 36)))
        end(proc)
        assert not proc.alive() and not scratch.exists()
    finally:
        proc.stop()
