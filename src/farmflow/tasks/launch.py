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

The child runs the stage's own function against an `OutboxStore`: reads come from the real
store, the artifacts it would commit are written (by the main process only) into the output
folder instead. The parent then commits them, so the child never commits and the stage key,
the artifact and its record are the same as inline. A child that fails is one
`StageLaunchError` with the end of its log.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic_core import to_jsonable_python

from farmflow import training_metrics
from farmflow.progress import log
from farmflow.storage import ArtifactRef, canonical_json
from farmflow.storage.refs import utc_now
from farmflow.storage.schemas import conform
from farmflow.tasks.registry import MULTI_PROCESS_STAGES

RECORD = "artifact.json"
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        with open(log_path, "wb") as f, open(log_path, "rb") as child_log:
            proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
            relay = _Relay(child_log)
            try:
                while proc.poll() is None:
                    relay.forward()
                    time.sleep(0.5)
            except BaseException:  # interrupted or cancelled here: the child goes too (as subprocess.run does)
                proc.kill()
                proc.wait()
                raise
            relay.forward(final=True)
            code = proc.returncode
        if code != 0:
            tail, errors = _tail(log_path), sorted(out.glob("error-*.txt"))  # error-<rank>.txt: what the stage raised
            cause = errors[0].read_text() if errors else ""
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


def commit_outbox(store, out: Path) -> list[ArtifactRef]:
    """Commit every artifact a child wrote into `out`, in the order it wrote them."""
    order = json.loads((out / "order.json").read_text()) if (out / "order.json").exists() else []
    refs = []
    for name in order:
        folder = out / name
        rec = json.loads((folder / RECORD).read_text())
        stage, key = rec["stage"], rec["key"]
        if store.get(stage, key) is not None:  # committed meanwhile (another run): first commit wins
            refs.append(store.get(stage, key))
            continue
        if rec["kind"] == "model":
            with store.put_model(stage, key, rec["format"], config=rec["config"], inputs=rec["inputs"]) as (
                model,
                metrics,
            ):
                model.rmdir()
                shutil.move(str(folder / "model"), str(model))
                metrics.update(rec["metrics"])
        else:
            tables = {name: (pq.read_table(folder / name), fmt) for name, fmt in rec.get("extra_tables", {}).items()}
            extra = {
                p.name: p.read_bytes() for p in folder.iterdir() if p.name not in (RECORD, "data.parquet", *tables)
            }
            store.put_table(
                stage,
                key,
                pq.read_table(folder / "data.parquet"),
                rec["format"],
                config=rec["config"],
                inputs=rec["inputs"],
                metrics=rec["metrics"],
                extra_files=extra,
                extra_tables=tables,
                parts=rec.get("parts"),
            )
        refs.append(store.get(stage, key))
    return refs


# ------------------------------------------------------------------------ child side
class OutboxStore:
    """The store a child stage sees: reads from `real`, writes artifacts into `out` (main process only), never
    commits."""

    def __init__(self, real, out: Path, writer: bool):
        self.real, self.out, self.writer = real, Path(out), writer
        self.written: dict[tuple[str, str], ArtifactRef] = {}

    def __getattr__(self, name: str) -> Any:  # read_table, model_dir, record, save_checkpoint, ...
        return getattr(self.real, name)

    def _folder(self, stage: str, key: str) -> Path:
        name = f"{stage}-{key}"
        folder = self.out / name
        folder.mkdir(parents=True, exist_ok=True)
        order = self.out / "order.json"
        names = json.loads(order.read_text()) if order.exists() else []
        order.write_text(json.dumps([*names, name]))
        return folder

    def _record(
        self,
        folder: Path,
        ref: ArtifactRef,
        config: Any,
        inputs: dict | None,
        extra_tables: dict[str, str] | None = None,
    ) -> None:
        record = {
            "stage": ref.stage,
            "key": ref.key,
            "kind": ref.kind,
            "format": ref.format,
            "metrics": ref.metrics,
            "parts": ref.parts,
            "extra_tables": extra_tables or {},
            "config": json.loads(canonical_json(config)) if config is not None else None,
            "inputs": {k: (v.key if isinstance(v, ArtifactRef) else v) for k, v in (inputs or {}).items()},
        }
        (folder / RECORD).write_text(json.dumps(record))
        self.written[(ref.stage, ref.key)] = ref.model_copy(update={"uri": str(folder)})

    def get(self, stage: str, key: str) -> ArtifactRef | None:
        return self.written.get((stage, key)) or self.real.get(stage, key)

    def put_table(
        self,
        stage: str,
        key: str,
        table: pa.Table,
        format: str,
        *,
        config: Any = None,
        inputs: dict | None = None,
        metrics: dict[str, float] | None = None,
        extra_files: dict[str, bytes] | None = None,
        extra_tables: dict[str, tuple[pa.Table, str]] | None = None,
        parts: dict[str, str] | None = None,
    ) -> ArtifactRef:
        """As `Store.put_table`; the parent commits it (`commit_outbox`), extra tables validated again there."""
        table = conform(table, format, where=f"stage {stage!r}")
        extra = {
            name: (conform(t, fmt, where=f"stage {stage!r} {name}"), fmt)
            for name, (t, fmt) in (extra_tables or {}).items()
        }
        ref = ArtifactRef(
            uri="",
            stage=stage,
            key=key,
            kind="table",
            format=format,
            rows=table.num_rows,
            created=utc_now(),
            metrics=dict(metrics or {}),
            parts=dict(parts or {}),
        )
        if self.writer:
            folder = self._folder(stage, key)
            pq.write_table(table, folder / "data.parquet")
            for name, data in (extra_files or {}).items():
                (folder / name).write_bytes(data)
            for name, (t, _) in extra.items():
                pq.write_table(t, folder / name)
            self._record(folder, ref, config, inputs, {name: fmt for name, (_, fmt) in extra.items()})
        return ref

    @contextmanager
    def put_model(
        self, stage: str, key: str, format: str, *, config: Any = None, inputs: dict | None = None
    ) -> Iterator[tuple[Path, dict]]:
        metrics: dict[str, float] = {}
        if not self.writer:  # other processes take part in gathering the weights, then discard
            with tempfile.TemporaryDirectory() as tmp:
                yield Path(tmp), metrics
            return
        folder = self._folder(stage, key)
        (folder / "model").mkdir()
        yield folder / "model", metrics
        if not any((folder / "model").glob("*.safetensors")):
            raise ValueError(f"stage {stage!r} saved no safetensors weights into its model artifact")
        ref = ArtifactRef(
            uri="", stage=stage, key=key, kind="model", format=format, rows=None, created=utc_now(), metrics=metrics
        )
        self._record(folder, ref, config, inputs)

    def clear_checkpoints(self, stage: str, key: str) -> None:
        """The parent drops them once it has committed the artifact."""

    def save_checkpoint(self, stage: str, key: str, step: int, folder: Path, keep: int = 2) -> None:
        if self.writer:
            self.real.save_checkpoint(stage, key, step, folder, keep)
