"""Running the real `farmflow` command for the chaos suite: a process with its output in a file, signals, limits,
and what the store and the output say afterwards."""

from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STAGE_LINE = re.compile(r" - ([\w ()\-]+): (ran|cache hit), .*?key ([0-9a-f]{12})")


@dataclass
class Outcome:
    rc: int | None
    seconds: float
    output: str
    left_behind: list[int] = field(default_factory=list)  # processes it started, alive after it ended
    stop_seconds: float | None = None  # from the signal to the exit

    @property
    def lines(self) -> list[str]:
        return [line for line in self.output.splitlines() if line.strip()]

    @property
    def tracebacks(self) -> int:
        return self.output.count("Traceback (most recent call last)")

    @property
    def error(self) -> str:
        """What the user read last: the ``error:`` line, else the last line."""
        errors = [line for line in self.lines if line.startswith("error: ")]
        return (errors or self.lines or [""])[-1][:300]

    def ran(self) -> set[str]:
        """Key prefixes of the stages this run computed (not cache hits)."""
        return {m.group(3) for m in STAGE_LINE.finditer(self.output) if m.group(2) == "ran"}


def env_for(work: Path, **extra: str) -> dict[str, str]:
    """The environment of a `farmflow` process: this checkout, its own Prefect home and logs (a temporary Prefect
    server per run unless `extra` sets PREFECT_API_URL), no hub access, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env = {
        **env,
        "PYTHONPATH": str(REPO / "src"),
        "PREFECT_HOME": str(work / "prefect"),
        "FARMFLOW_LOG_DIR": str(work / "logs"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "HF_HUB_OFFLINE": "1",
        "FARMFLOW_PROGRESS_EVERY_S": "0",
        **extra,
    }
    return env


def _session(pid: int) -> list[int]:
    """Every process `pid` started, and theirs (servers may run in sessions of their own)."""
    found, todo = [], [pid]
    while todo:
        out = subprocess.run(["pgrep", "-P", str(todo.pop())], capture_output=True, text=True).stdout.split()
        found += [int(p) for p in out]
        todo += [int(p) for p in out]
    return found


def farmflow(
    args: list[str],
    work: Path,
    env: dict[str, str] | None = None,
    timeout_s: float = 900,
    signal_when=None,
    sig: int = signal.SIGKILL,
    fsize_bytes: int | None = None,
) -> Outcome:
    """Run ``farmflow ARGS`` in its own session; with `signal_when(output_so_far, seconds)`, send `sig` once it holds.
    With `fsize_bytes`, no file it writes may grow past that (RLIMIT_FSIZE: a full disk, as the process sees it)."""
    work.mkdir(parents=True, exist_ok=True)
    log = work / f"out-{time.monotonic_ns()}.txt"

    def limits() -> None:
        if fsize_bytes is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead of killing
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_bytes, fsize_bytes))

    cmd = [sys.executable, "-c", "from farmflow.cli import main; main()", *args]
    start = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, env=env or env_for(work), cwd=work, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=limits,
        )  # fmt: skip
    signalled = None
    session: list[int] = []
    while proc.poll() is None and time.monotonic() - start < timeout_s:
        if signal_when is not None and signalled is None and signal_when(log.read_text(), time.monotonic() - start):
            session = _session(proc.pid)
            proc.send_signal(sig)
            signalled = time.monotonic()
        time.sleep(0.2)
    if proc.poll() is None:
        session = session or _session(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rc = None
    else:
        rc = proc.returncode
    end = time.monotonic()
    session = session or []
    time.sleep(2.0 if session else 0)  # a guarded child needs a moment to notice
    left = [p for p in session if _alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    return Outcome(rc, end - start, log.read_text(errors="replace"), left, end - signalled if signalled else None)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def committed(store: Path) -> set[str]:
    """Key prefixes of the artifacts committed in a local store."""
    return {p.parent.name[:12] for p in store.glob("*/*/_COMMIT.json")}
