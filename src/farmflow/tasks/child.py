"""A launched stage's child process: ``python -m farmflow.tasks.child SPEC`` (`farmflow.tasks.launch` starts it).

It runs the stage's own function (`farmflow.tasks.stage.run_stage`) against an `OutboxStore`: reads come from the real
store, the artifacts it would commit go into the spec's output folder for the parent to commit.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import get_type_hints

from pydantic import TypeAdapter

import farmflow.tasks.stage as stages
from farmflow import shutdown
from farmflow.storage import ArtifactRef, open_store
from farmflow.tasks.core import TASKS
from farmflow.tasks.launch import PARENT_ENV, exit_with_parent, log_for_parent
from farmflow.tasks.outbox import OutboxStore
from farmflow.tasks.registry import STAGES


def child_main(spec_path: str) -> None:
    """Run one stage as described by the spec file (what the parent's command line starts)."""
    spec = json.loads(Path(spec_path).read_text())
    if os.environ.get(PARENT_ENV):
        exit_with_parent(int(os.environ[PARENT_ENV]))
    from farmflow.models.runtime import is_main_process, num_processes

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        num_processes()  # join the process group before anything else
    log_for_parent()
    stage, fn = STAGES[spec["stage"]], stages.stage_function(TASKS[spec["stage"]])
    hints = get_type_hints(fn)
    config = TypeAdapter(hints["config"]).validate_python(spec["config"])
    inputs = {k: ArtifactRef.model_validate(v) for k, v in spec["inputs"].items()}
    options = {k: TypeAdapter(hints[k]).validate_python(v) for k, v in spec["options"].items()}
    stages.OUTBOX = OutboxStore(open_store(spec["store_uri"]), Path(spec["out"]), writer=is_main_process())
    try:
        with shutdown.handling():  # SIGTERM from the parent (its own stop): checkpoint and stop, as inline
            stages.run_stage(stage, fn, spec["store_uri"], config, {**inputs, **options})
    except Exception as e:  # for the parent's message: under accelerate launch the log ends with the launcher's report
        (Path(spec["out"]) / f"error-{os.environ.get('RANK', '0')}.txt").write_text(f"{type(e).__name__}: {e}")
        raise


def exit_code(spec_path: str) -> int:
    """Run the stage; its exit code (1 with the traceback on stderr when it raised)."""
    try:
        child_main(spec_path)
    except SystemExit as e:  # as the interpreter reads it: None is success, a message goes to stderr with 1
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    code = exit_code(sys.argv[1])
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything the stage wrote is on disk by now. Skipping the interpreter's teardown keeps a native library's
    # worker threads from aborting it at exit (SIGABRT, "terminate called without an active exception"), which
    # would turn the stage's own exit code, success included, into -6.
    os._exit(code)
