"""Periodic training checkpoints that a killed run resumes from (no pickle anywhere).

A checkpoint is a folder: each module's weights as safetensors, each optimizer's tensors
as safetensors plus its scalars and param groups as JSON, each scheduler's state and the
loop's own counters as JSON, random generator states as tensors. `Checkpointer` keeps them
in the artifact store under ``_checkpoints/<stage>/<key>/`` (the stage key of the run),
so a rerun of the same stage on any machine with the store finds them. Modules are saved
unwrapped (what `Runtime.unwrap` gives); with several processes only rank 0 writes.

A loop uses it like this::

    ckpt = Checkpointer(store, "dpo", key, every_steps=100, every_seconds=300)
    start, extra = ckpt.restore(modules={"policy": model}, optimizers={"opt": opt}, schedulers={"sched": sched})
    for step in range(start, total):
        ...
        ckpt.save(step + 1, modules=..., optimizers=..., schedulers=..., extra={"losses": losses})

Data order must be a deterministic function of the step (see `farmflow.models.batch_order`)
so that skipping to `start` replays the same batches.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import load_file, load_model, save_file, save_model

from farmflow import shutdown, training_metrics
from farmflow.models.runtime import is_main_process

STATE_FILE = "state.json"


def save_state(
    folder: str | Path,
    *,
    step: int,
    modules: dict[str, torch.nn.Module] | None = None,
    optimizers: dict[str, torch.optim.Optimizer] | None = None,
    schedulers: dict[str, Any] | None = None,
    generators: dict[str, torch.Generator] | None = None,
    extra: dict[str, Any] | None = None,
) -> None:
    """Write a resumable training state into `folder` (created if needed)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state: dict[str, Any] = {"step": step, "extra": extra or {}, "optimizers": {}, "schedulers": {}}
    for name, module in (modules or {}).items():
        save_model(module, str(folder / f"module-{name}.safetensors"))
    for name, opt in (optimizers or {}).items():
        sd = opt.state_dict()
        tensors, scalars = {}, {}
        for idx, slots in sd["state"].items():
            for slot, value in slots.items():
                if torch.is_tensor(value):
                    tensors[f"{idx}.{slot}"] = value.detach().contiguous().cpu()
                else:
                    scalars[f"{idx}.{slot}"] = value
        save_file(tensors, str(folder / f"optimizer-{name}.safetensors"))
        state["optimizers"][name] = {"param_groups": sd["param_groups"], "scalars": scalars}
    for name, sched in (schedulers or {}).items():
        state["schedulers"][name] = {k: v for k, v in sched.state_dict().items() if k != "lr_lambdas"}
    if generators:
        save_file({name: g.get_state() for name, g in generators.items()}, str(folder / "generators.safetensors"))
    (folder / STATE_FILE).write_text(json.dumps(state, indent=1))


def load_state(
    folder: str | Path,
    *,
    modules: dict[str, torch.nn.Module] | None = None,
    optimizers: dict[str, torch.optim.Optimizer] | None = None,
    schedulers: dict[str, Any] | None = None,
    generators: dict[str, torch.Generator] | None = None,
) -> tuple[int, dict[str, Any]]:
    """Restore what `save_state` wrote into the given objects; returns (step, extra)."""
    folder = Path(folder)
    state = json.loads((folder / STATE_FILE).read_text())
    for name, module in (modules or {}).items():
        load_model(module, str(folder / f"module-{name}.safetensors"))
    for name, opt in (optimizers or {}).items():
        saved = state["optimizers"][name]
        tensors = load_file(str(folder / f"optimizer-{name}.safetensors"))
        slots: dict[int, dict[str, Any]] = {}
        for flat, value in [*tensors.items(), *saved["scalars"].items()]:
            idx, slot = flat.split(".", 1)
            slots.setdefault(int(idx), {})[slot] = value
        opt.load_state_dict({"state": slots, "param_groups": saved["param_groups"]})
    for name, sched in (schedulers or {}).items():
        sched.load_state_dict({**sched.state_dict(), **state["schedulers"][name]})
    if generators:
        states = load_file(str(folder / "generators.safetensors"))
        for name, g in generators.items():
            g.set_state(states[name])
    return int(state["step"]), state["extra"]


class CheckpointStore(Protocol):
    def save_checkpoint(self, stage: str, key: str, step: int, folder: Path) -> None: ...
    def latest_checkpoint(self, stage: str, key: str) -> tuple[int, Path] | None: ...
    def clear_checkpoints(self, stage: str, key: str) -> None: ...


class Checkpointer:
    """Save every `every_steps` steps and/or `every_seconds` seconds; restore the latest on start.

    With no store, or both intervals 0, checkpointing is off: `restore` returns (0, {})
    and `save` does nothing, so loops call both unconditionally.
    """

    def __init__(
        self, store: CheckpointStore | None, stage: str, key: str, every_steps: int = 0, every_seconds: float = 0.0
    ):
        self.store, self.stage, self.key = store, stage, key
        self.every_steps, self.every_seconds = every_steps, every_seconds
        self.saved = 0
        self._last = time.monotonic()

    @property
    def enabled(self) -> bool:
        return self.store is not None and (self.every_steps > 0 or self.every_seconds > 0)

    def switched_off(self) -> "Checkpointer":
        """A checkpointer for the same stage and key that never saves or restores."""
        return Checkpointer(None, self.stage, self.key)

    def due(self, step: int) -> bool:
        by_steps = self.every_steps > 0 and step % self.every_steps == 0
        by_time = self.every_seconds > 0 and time.monotonic() - self._last >= self.every_seconds
        return self.enabled and (by_steps or by_time)

    def restore(self, **objects: Any) -> tuple[int, dict[str, Any]]:
        shutdown.beat(id(self))  # a stop waits for this loop's next step (farmflow.shutdown)
        if not self.enabled:
            return 0, {}
        latest = self.store.latest_checkpoint(self.stage, self.key)
        if latest is None:
            return 0, {}
        step, extra = load_state(latest[1], **objects)
        if training_metrics.current() is not None:  # the stage's metrics rows up to the checkpoint
            training_metrics.current().resume(step, extra.get(training_metrics.FILE))
        return step, extra

    def save(self, step: int, *, force: bool = False, **objects: Any) -> bool:
        """Checkpoint at `step` (the number of completed steps) when it is due; only the main process writes.

        When the process was asked to stop (`farmflow.shutdown`), checkpoint now and raise `Stopped`."""
        shutdown.beat(id(self))
        stopping = shutdown.requested() is not None
        saved = False
        if self.enabled and (force or stopping or self.due(step)) and is_main_process():
            rec = training_metrics.current()
            if rec is not None:  # the metrics rows so far travel with the checkpoint
                objects["extra"] = {**(objects.get("extra") or {}), training_metrics.FILE: rec.state()}
            with shutdown.saving(), tempfile.TemporaryDirectory(prefix="farmflow-ckpt-") as tmp:
                save_state(tmp, step=step, **objects)
                self.store.save_checkpoint(self.stage, self.key, step, Path(tmp))
            self.saved += 1
            self._last = time.monotonic()
            saved = True
        if stopping:
            shutdown.done(id(self))
            kept = f"checkpoint at step {step}, a rerun resumes there" if self.enabled else "checkpoints are off"
            shutdown.note(f"{self.stage}: stopped after step {step} ({kept})")
            raise shutdown.Stopped(f"{self.stage}: stopped after step {step} ({kept})")
        return saved

    def clear(self) -> None:
        """Drop the checkpoints once the final artifact is committed."""
        if self.enabled and is_main_process():
            self.store.clear_checkpoints(self.stage, self.key)
