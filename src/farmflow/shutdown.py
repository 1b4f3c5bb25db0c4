"""Stopping on SIGTERM or SIGINT within seconds, with training checkpointed and the store consistent.

Inside `handling()` (the CLI runs each flow in it), the first SIGTERM or SIGINT:

* asks every loop to stop: `farmflow.models.checkpoint.Checkpointer.save` saves a checkpoint at once and raises
  `Stopped` (each training loop calls it after every step), and a stage about to start raises `Stopped`
  (`farmflow.flows.runner.StageRunner`);
* starts a deadline: `GRACE_S` seconds later the process exits whatever is still running (a sampling or scoring
  stage), later while a training loop is expected at its next step (`beat`: each loop's checkpointer reports every
  step, so its step time is known) or a checkpoint is being written, but never after `MAX_GRACE_S`. Artifacts and
  checkpoints are written atomically, so what a hard exit cuts short is simply not there, and a rerun computes or
  resumes it.

Nothing is raised in the main thread: a flow ends once its running stages have stopped (their Prefect tasks fail
with `Stopped`), and code that commits an artifact is never cut in the middle by an exception. A second signal
exits at once, as does the deadline, after printing `message()` unless the CLI has reported the stop itself.
Child processes that must not outlive this one watch it (`farmflow.cli.guard`).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator

GRACE_S = 5.0
"""Seconds from the first signal until the process exits, unless a training loop is about to checkpoint."""
FIRST_STEP_S = 60.0
"""How long a training loop that has not finished its first step yet is waited for."""
MAX_GRACE_S = 120.0
"""Seconds from the first signal until the process exits even while a checkpoint is being written."""


class Stopped(Exception):
    """A stage ended early because the process was asked to stop; its message says what was saved."""


class _State:
    signum: int | None = None
    saving = 0
    lock = threading.Lock()
    event = threading.Event()
    notes: list[str] = []
    reported = False
    loops: dict[int, tuple[float, float]] = {}  # a training loop -> (its last step's end, seconds per step)


def requested() -> int | None:
    """The signal that asked this process to stop, or None."""
    return _State.signum if _State.event.is_set() else None


def request(signum: int = signal.SIGTERM) -> None:
    """Ask every loop to stop (what the signal handler does; tests call it directly)."""
    _State.signum = signum
    _State.event.set()


def reset() -> None:
    """Forget a stop request (tests, and a CLI process that runs several flows)."""
    _State.event.clear()
    _State.signum = None
    _State.notes.clear()
    _State.reported = False


def check(where: str) -> None:
    """Raise `Stopped` when a stop was requested (called before work starts)."""
    if requested() is not None:
        raise Stopped(f"{where}: not started, the process was asked to stop")


def note(line: str) -> None:
    """Record what a stopping stage saved (the CLI prints these after the stop)."""
    with _State.lock:
        _State.notes.append(line)


def notes() -> list[str]:
    with _State.lock:
        return list(_State.notes)


def message() -> str:
    """What the user reads after a stop: the signal, what was saved, how to go on (one line); marks it reported."""
    _State.reported = True
    name = signal.Signals(_State.signum or signal.SIGTERM).name
    return "; ".join([f"stopped by {name}", *notes(), "finished stages are cached: the same command continues"])


def beat(loop: int) -> None:
    """A training loop (any id) finished a step, or starts (`Checkpointer.restore`)."""
    now = time.monotonic()
    with _State.lock:
        last = _State.loops.get(loop)
        _State.loops[loop] = (now, now - last[0] if last else 0.0)


def done(loop: int) -> None:
    with _State.lock:
        _State.loops.pop(loop, None)


def _loop_due(now: float) -> bool:
    """Is a training loop expected to reach its next step (and checkpoint) soon?"""
    with _State.lock:
        beats = list(_State.loops.values())
    return any(now - last < (1.5 * step + 2.0 if step else FIRST_STEP_S) for last, step in beats)


@contextmanager
def saving() -> Iterator[None]:
    """Mark a checkpoint write in progress: the deadline waits for it (up to MAX_GRACE_S)."""
    with _State.lock:
        _State.saving += 1
    try:
        yield
    finally:
        with _State.lock:
            _State.saving -= 1


def _deadline(signum: int, grace_s: float, max_grace_s: float) -> None:
    start = time.monotonic()
    while True:
        waited = time.monotonic() - start
        if waited >= max_grace_s or (waited >= grace_s and not _State.saving and not _loop_due(time.monotonic())):
            break
        time.sleep(0.1)
    if not _State.reported:
        sys.stderr.write(f"error: {message()}\n")
    sys.stderr.flush()
    os._exit(128 + signum)


def _handle(signum: int, _frame) -> None:
    if requested() is not None:  # the second signal: no more waiting
        os._exit(128 + signum)
    request(signum)
    threading.Thread(target=_deadline, args=(signum, GRACE_S, MAX_GRACE_S), name="farmflow-stop", daemon=True).start()


@contextmanager
def handling() -> Iterator[None]:
    """Handle SIGTERM and SIGINT as the module says while inside (main thread only; elsewhere nothing changes); the
    handlers from before come back afterwards (a test process calling the CLI keeps its Ctrl-C)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    reset()
    before = {sig: signal.signal(sig, _handle) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
