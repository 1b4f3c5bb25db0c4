"""Each GPU stage in its own process: `execution.launcher` 'process' or 'accelerate'.

The parent (the stage task, through `farmflow.tasks.stage.stage_task`) checks the store
for the stage key as usual. On a miss it writes a spec (stage, store, config and input
refs as JSON, an empty output folder) and starts a child (`farmflow.tasks.child`):

* ``process``: ``python -m farmflow.tasks.child SPEC``;
* ``accelerate``: training stages (`MULTI_PROCESS_STAGES`) through ``accelerate launch
  --config_file <execution.accelerate_config> [--num_processes N] -m farmflow.tasks.child SPEC``
  (every process runs the stage; `farmflow.models.runtime.Runtime` splits each batch
  between them; PPO and Quark also split each rollout batch, under DDP only); the other GPU
  stages (sampling, scoring) as with ``process``.

The child runs the stage's own function against an `OutboxStore` (`farmflow.tasks.outbox`):
reads come from the real store, the artifacts it would commit are written (by the main process
only) into the output folder instead. The parent then commits them, so the child never commits
and the stage key, the artifact and its record are the same as inline. A child that fails is one
`StageLaunchError` with the end of its log. A stop (SIGTERM/SIGINT, `farmflow.shutdown`) is
passed on to the child, which checkpoints and stops as an inline stage would.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from pydantic_core import to_jsonable_python

from farmflow import shutdown, training_metrics
from farmflow.loopback import free_port
from farmflow.progress import log
from farmflow.storage import ArtifactRef
from farmflow.tasks.outbox import commit_outbox
from farmflow.tasks.registry import MULTI_PROCESS_STAGES

LOG_TAIL = 40


class StageLaunchError(RuntimeError):
    """A stage's child process failed; the message names the stage and ends with the child's log."""


# ----------------------------------------------------------------------- parent side
SHIPPED = Path(__file__).resolve().parents[1] / "configs" / "accelerate"
"""The accelerate configs installed with farmflow (package data): single_gpu, multi_gpu, fsdp, deepspeed_zero3."""


def find_config(path: str) -> Path:
    """An accelerate config: a file path (relative: to the working directory), else a shipped config by name.

    Shipped names: ``fsdp``, ``fsdp.yaml`` or ``configs/accelerate/fsdp.yaml`` (the repository-style path).
    """
    given = Path(path).expanduser()
    name = given.name if given.parent.as_posix() in (".", "configs/accelerate") else None
    candidates = [given] + ([SHIPPED / name, SHIPPED / f"{name}.yaml"] if name else [])
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    shipped = ", ".join(sorted(p.stem for p in SHIPPED.glob("*.yaml")))
    raise StageLaunchError(
        f"execution.accelerate_config: no file {path!r} in {Path.cwd()} and no shipped config of that name ({shipped})"
    )


def command(stage: str, spec: Path, execution: Any) -> list[str]:
    """The child's command line for this stage and launcher."""
    child = ["-m", "farmflow.tasks.child", str(spec)]
    if execution.launcher != "accelerate" or stage not in MULTI_PROCESS_STAGES:
        return [sys.executable, *child]
    args = [sys.executable, "-m", "accelerate.commands.launch"]
    if execution.accelerate_config:
        args += ["--config_file", str(find_config(execution.accelerate_config))]
    if execution.num_processes:
        args += ["--num_processes", str(execution.num_processes)]
    return [*args, "--main_process_port", str(free_port()), *child]


def _tail(log: Path) -> str:
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return "\n".join(lines[-LOG_TAIL:]) or "(empty log)"


def run_in_child(
    stage: str, store, key: str, store_uri: str, config: Any, params: dict[str, Any], execution: Any
) -> ArtifactRef:
    """Run `stage` in a child process (see the module docstring) and commit what it wrote; returns the stage's ref."""
    inputs = {k: v.model_dump(mode="json") for k, v in params.items() if isinstance(v, ArtifactRef)}
    options = {k: to_jsonable_python(v) for k, v in params.items() if not isinstance(v, ArtifactRef)}
    scratch = getattr(store, "root", None)
    scratch = scratch / ".staging" if isinstance(scratch, Path) else None  # local store: commit by rename, no copy
    if scratch is not None:
        scratch.mkdir(parents=True, exist_ok=True)
    sweep_orphans(Path(scratch or tempfile.gettempdir()))
    with tempfile.TemporaryDirectory(prefix=f"launch-{stage}-{key[:8]}-", dir=scratch) as tmp:
        spec, out, log_path = Path(tmp) / "spec.json", Path(tmp) / "out", Path(tmp) / "child.log"
        out.mkdir()
        (Path(tmp) / PARENT_FILE).write_text(str(os.getpid()))
        spec.write_text(
            json.dumps(
                {
                    "stage": stage,
                    "store_uri": store_uri,
                    "config": to_jsonable_python(config),
                    "inputs": inputs,
                    "options": options,
                    "out": str(out),
                }
            )
        )
        argv = command(stage, spec, execution)
        how = "accelerate launch" if "accelerate.commands.launch" in argv else "a child process"
        log("%s: running in %s", stage, how)
        started = time.perf_counter()
        env = os.environ | {
            PARENT_ENV: str(os.getpid())
        }  # the child (each process under accelerate) exits when this one is gone
        env |= training_metrics.tracker_env(execution)  # its training metrics go to the same trackers
        with open(log_path, "wb") as f, open(log_path, "rb") as child_log, ExitStack() as stopping:
            proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
            relay = _Relay(child_log)
            try:
                while proc.poll() is None:
                    relay.forward()
                    if shutdown.requested() is not None:
                        # this process's stop deadline waits until the child has stopped and what it saved is noted
                        stopping.enter_context(shutdown.saving())
                        stop_child(proc, shutdown.requested())
                    time.sleep(0.5)
            except BaseException:  # interrupted or cancelled here: the child goes too (as subprocess.run does)
                proc.kill()
                proc.wait()
                raise
            relay.forward(final=True)
            code = proc.returncode
            errors = sorted(out.glob("error-*.txt")) if code != 0 else []  # error-<rank>.txt: what the stage raised
            cause = errors[0].read_text() if errors else ""
            if code != 0 and shutdown.requested() is not None:  # the child stopped as asked: what it saved, as inline
                saved = cause.removeprefix("Stopped: ") if cause.startswith("Stopped: ") else f"{stage}: stopped"
                shutdown.note(saved)
                raise shutdown.Stopped(saved)
        if code != 0:
            tail = _tail(log_path)
            if cause and cause not in tail:  # several processes: the launcher's own report ends the log
                tail += f"\n{cause}"
            raise StageLaunchError(f"stage {stage}: {how} exited with code {code}; the last lines of its log:\n{tail}")
        committed = commit_outbox(store, out)
        log(
            "%s: child finished in %.1fs, committed %d artifact(s)",
            stage,
            time.perf_counter() - started,
            len(committed),
        )
    store.clear_checkpoints(stage, key)
    ref = store.get(stage, key)
    if ref is None:
        raise StageLaunchError(f"stage {stage}: the child exited cleanly but wrote no {stage}/{key[:12]} artifact")
    return ref


def stop_child(proc: subprocess.Popen, signum: int) -> None:
    """Pass this process's stop signal on to a stage's child and wait for it to exit, up to `shutdown.MAX_GRACE_S`:
    a training child checkpoints and stops (`farmflow.shutdown`); the caller holds this process's stop deadline
    (`shutdown.saving`) meanwhile. Under ``accelerate launch`` the launcher passes the signal on to every worker."""
    proc.send_signal(signum)
    try:
        proc.wait(timeout=shutdown.MAX_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


RELAY = "[farmflow] "
"""Prefix of the child's log lines (progress, stage summaries) that the parent repeats in its own (the run's) logs."""


class _Relay:
    """Repeats the child's `RELAY` lines from its log file as they are written, so a long stage shows progress in the
    run."""

    def __init__(self, file) -> None:
        self.file, self.partial = file, b""

    def forward(self, final: bool = False) -> None:
        chunk = self.partial + self.file.read()
        lines = chunk.split(b"\n")
        self.partial = b"" if final else lines.pop()  # an unfinished last line waits for the rest
        for line in lines:
            text = line.decode(errors="replace").rstrip("\r")
            if text.startswith(RELAY):
                log("%s", text[len(RELAY) :])


def log_for_parent() -> None:
    """In a launched child: farmflow's INFO lines go to the log file with the `RELAY` prefix (main process only)."""
    import logging

    from farmflow.models.runtime import is_main_process

    logger = logging.getLogger("farmflow")
    if is_main_process():
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(RELAY + "%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    logger.propagate = False


PARENT_ENV = "FARMFLOW_PARENT_PID"
PARENT_FILE = "parent.pid"


def alive(pid: int) -> bool:
    """Is process `pid` running (a zombie, dead but not yet reaped, is not)?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):  # no /proc (macOS): os.kill said it exists
        return True


def exit_with_parent(pid: int, every_s: float = 2.0) -> None:
    """In a launched child: a daemon thread that ends this process when the flow process `pid` is gone.

    A cancelled or killed flow run takes only its own process down; without this, a stage's child (and every
    worker of an `accelerate launch`) would go on holding its GPU."""
    import threading

    def watch() -> None:
        while alive(pid):
            time.sleep(every_s)
        os._exit(3)

    threading.Thread(target=watch, name="farmflow-parent-watch", daemon=True).start()


def sweep_orphans(scratch: Path) -> None:
    """Remove launch folders (spec, outbox, weights) left by flow processes that died mid-stage."""
    for folder in scratch.glob("launch-*"):
        try:
            pid = int((folder / PARENT_FILE).read_text())
        except (OSError, ValueError):
            continue  # being created, or not ours
        if not alive(pid):
            shutil.rmtree(folder, ignore_errors=True)
