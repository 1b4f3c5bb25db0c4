"""Server processes on 127.0.0.1: a free port, a process that answers its health URL, a clean stop.

The CLI's local judge, `transformers serve` in the benchmarks, and the test harnesses' Prefect, judge and model
servers all start a child process, wait until it answers, and stop it (a signal, then SIGKILL after a grace
period); this is that one routine.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

import httpx


def free_port() -> int:
    """A TCP port nothing listens on at the moment (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(log: Path | None, chars: int = 2000) -> str:
    """The end of a process's log file, for an error message (empty without one)."""
    return log.read_text(errors="replace")[-chars:] if log is not None and log.exists() else ""


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float, what: str, log: Path | None = None) -> None:
    """Return once ``GET url`` answers 200; raise RuntimeError (with the log's end) if `proc` exits first or
    `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}) before answering {url}: {tail(log)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not answer {url} within {timeout:g} s: {tail(log)}")
        time.sleep(0.2)


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, grace: float = 15, group: bool = False) -> None:
    """Send `sig` (to the process group with `group`, for a child started in a session of its own), wait up to
    `grace` seconds, then SIGKILL."""
    if proc.poll() is not None:
        return

    def send(s: int) -> None:
        try:
            os.killpg(proc.pid, s) if group else proc.send_signal(s)
        except ProcessLookupError:
            pass

    send(sig)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        send(signal.SIGKILL)
        proc.wait(timeout=30)


@contextmanager
def server_process(
    command: Sequence[str],
    health_url: str,
    log: Path,
    what: str,
    env: dict | None = None,
    timeout: float = 180,
    stop_signal: int = signal.SIGTERM,
    grace: float = 15,
    group: bool = False,
    cwd: Path | None = None,
) -> Iterator[subprocess.Popen]:
    """Run `command` (output to `log`) until the block ends, once it answers `health_url`; stop it on the way out
    (`stop` with `stop_signal` and `grace`; with `group`, the child runs in a session of its own and the whole
    group is signalled)."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            list(command), stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=group
        )
    try:
        wait_healthy(proc, health_url, timeout, what, log)
        yield proc
    finally:
        stop(proc, stop_signal, grace, group)
