"""A write-ahead journal for answers that are paid for but not yet in the store.

An annotation run appends judged rows to the store's row log in chunks (one Parquet file
per chunk keeps the log readable). Between two chunks the rows live in memory, so a killed
process would lose answers it had already paid for. Each answer is therefore also written,
as it arrives, to a JSON-lines journal on local disk: one file per run, locked (``flock``)
while the run lives, emptied whenever a chunk reaches the store and deleted when the run
ends. The operating system keeps what was written even if the process is SIGKILLed, so the
next run (`recover`) finds the journal of a dead run unlocked and commits its rows; a
crash or kill then re-asks only the requests that were in flight. A kill between a chunk's
append and the journal's emptying leaves rows in both, so the commit skips rows the store
already holds.

A journal is local to a machine: a run on another machine against the same S3 store does
not see it.
"""

from __future__ import annotations

import fcntl
import json
import os
import uuid
from datetime import datetime
from pathlib import Path
from typing import Callable


def _encode(value: object) -> str:
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"cannot journal a {type(value).__name__}")


class Journal:
    """One run's journal file in `folder`, locked until `close`."""

    def __init__(self, folder: Path):
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"{uuid.uuid4().hex}.jsonl"
        self.file = open(self.path, "a+", encoding="utf-8")
        fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def write(self, rows: list[dict]) -> None:
        """Append rows; once this returns they survive the process being killed."""
        self.file.write("".join(json.dumps(r, default=_encode) + "\n" for r in rows))
        self.file.flush()

    def committed(self) -> None:
        """Everything written so far is in the store: start empty."""
        self.file.seek(0)
        self.file.truncate()

    def close(self, keep: bool = False) -> None:
        """Delete the journal (keep it when its rows could not be committed: the next run recovers them)."""
        if not keep:
            self.path.unlink(missing_ok=True)
        self.file.close()


def recover(folder: Path, commit: Callable[[list[dict]], int]) -> int:
    """Commit the rows of every journal in `folder` whose run is gone (its lock is free); returns how many
    `commit` reports committed (it may skip rows the store already holds)."""
    if not folder.is_dir():
        return 0
    total = 0
    for path in sorted(folder.glob("*.jsonl")):
        try:
            f = open(path, "r+", encoding="utf-8")
        except FileNotFoundError:  # another process recovered it meanwhile
            continue
        with f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a live run holds it
                continue
            if os.fstat(f.fileno()).st_nlink == 0:  # recovered and deleted by another process before we locked it
                continue
            rows = []
            for line in f:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:  # a line cut short by a crash of the machine itself
                    continue
            if rows:
                total += commit(rows)
            path.unlink(missing_ok=True)
    return total


__all__ = ["Journal", "recover"]
