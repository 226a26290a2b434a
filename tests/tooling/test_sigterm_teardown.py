"""A pytest run sent SIGTERM tears its fixtures down (tests/support/terminate.py): the
process a session fixture started is stopped by it, not left running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tests.conftest
from tests.support import terminate

ROOT = Path(__file__).resolve().parents[2]

CONFTEST = '''
import subprocess, pytest
from pathlib import Path

@pytest.fixture(scope="session")
def service():
    proc = subprocess.Popen(["sleep", "300"])
    Path("service.pid").write_text(str(proc.pid))
    yield proc
    proc.terminate()
    proc.wait(10)
    Path("torn_down").write_text("yes")
'''

TEST = '''
import time
from pathlib import Path

def test_waits(service):
    Path("started").write_text("yes")
    time.sleep(120)
'''


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("plugin", [True, False], ids=["with_the_hook", "without"])
def test_a_terminated_run_stops_what_its_fixtures_started(tmp_path: Path, plugin: bool) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_service.py").write_text(TEST)
    hook = ["-p", "tests.support.terminate"] if plugin else []
    cmd = [sys.executable, "-m", "pytest", *hook, "-q", "-p", "no:cacheprovider",
           "-o", "timeout=0", "test_service.py"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT)
    pid = 0
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "started").exists():
            assert run.poll() is None and time.monotonic() < deadline, run.stdout
            time.sleep(0.05)
        pid = int((tmp_path / "service.pid").read_text())
        run.send_signal(signal.SIGTERM)
        run.wait(30)
        out = run.stdout.read().decode(errors="replace") if run.stdout else ""
        if plugin:
            assert (tmp_path / "torn_down").exists(), out
            assert not _alive(pid)
        else:  # Python's default: the run ends there and its service lives on
            assert not (tmp_path / "torn_down").exists(), out
            assert _alive(pid)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait(10)
        if pid and _alive(pid):
            os.kill(pid, signal.SIGKILL)  # the service this test's run started, by pid
        if run.stdout:
            run.stdout.close()


def test_both_test_trees_install_the_hook() -> None:
    assert tests.conftest.pytest_configure is terminate.pytest_configure
    text = (ROOT / "tests_vllm" / "conftest.py").read_text()
    assert "from tests.support.terminate import pytest_configure" in text
