"""Real processes for the crash tests: run a Python script with farmflow importable, SIGKILL it on cue."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

SRC = str(Path(__file__).resolve().parents[1] / "src")


def python_env(**extra: str) -> dict:
    """The environment of a child Python process that imports this checkout's farmflow."""
    return {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra}


def run_and_kill_when(argv: list[str], cue: Callable[[], bool], what: str, timeout: float = 120) -> None:
    """Run ``python -c <argv...>`` in a real process and SIGKILL it as soon as `cue()` holds.

    Fails if the process ends on its own or `cue` never holds within `timeout` seconds (`what`
    names the awaited event in that message).
    """
    proc = subprocess.Popen(
        [sys.executable, "-c", *argv], env=python_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + timeout
        while not cue():
            assert proc.poll() is None, f"the process ended before {what}: " + proc.communicate()[1].decode()[-3000:]
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
