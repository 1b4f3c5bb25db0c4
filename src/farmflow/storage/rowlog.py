"""Row logs and training checkpoints: what a store keeps besides its content-addressed artifacts.

Row logs are append-only tables, e.g. the row-level annotation cache: each append is one
Parquet file under ``_rows/<namespace>/``, made visible in one step (a rename, or one S3
PUT), so a crash loses at most that chunk and a reader never sees a partial file. A chunk's
name carries its size and sha256 (`farmflow.storage.integrity`): a chunk damaged later is
quarantined when read and its rows left out, instead of failing every reader of the log.

Checkpoints are periodic training states of a stage that has not committed yet, under
``_checkpoints/<stage>/<key>/step-<N>/``. Each becomes visible only once complete
(`_put_folder`); the newest `keep` stay.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from farmflow.storage.integrity import chunk_name, chunk_problem, parquet_bytes, parse_problem
from farmflow.storage.refs import utc_now
from farmflow.storage.schemas import SCHEMAS, conform


class RowLogs:
    """Row logs and checkpoints, mixed into `farmflow.storage.store.Store`."""

    # ---------------------------------------------------------------- row logs
    def rows_dir(self, namespace: str) -> str:
        """The folder of a row log (a filesystem path; `url` gives its URL)."""
        if not namespace or any(part in ("", ".", "..") for part in namespace.split("/")):
            raise ValueError(f"invalid row-log namespace {namespace!r}")
        return self._p("_rows", namespace)

    def append_rows(self, namespace: str, table: pa.Table, format: str) -> str:
        """Append `table` (validated against the schema of `format`) as one chunk; returns its name."""
        data = parquet_bytes(conform(table, format, where=f"row log {namespace!r}"))
        stem = f"{utc_now().replace(':', '').replace('+', 'Z')}-{uuid.uuid4().hex[:8]}"
        name = chunk_name(stem, data)
        with self._io():
            self._write_atomic(f"{self.rows_dir(namespace)}/{name}", data)
        return name

    def row_chunks(self, namespace: str) -> list[str]:
        """The committed chunks of a row log (filesystem paths), oldest first."""
        with self._io():
            return sorted(
                p
                for p in self.fs.glob(f"{self.rows_dir(namespace)}/*.parquet")
                if not p.rsplit("/", 1)[-1].startswith(".")
            )

    def read_rows(self, namespace: str, format: str) -> pa.Table:
        """Every committed chunk of a row log, oldest first (an empty table if none).

        A chunk that does not match the size and sha256 in its name, or does not parse, is quarantined
        (`quarantine_chunk`, one line) and left out."""
        schema = SCHEMAS[format]
        chunks = self.row_chunks(namespace)
        if not chunks:
            return schema.empty_table()
        with self._io():
            raw = self.fs.cat(chunks, on_error="return")
        tables = []
        for path in chunks:
            data = raw.get(path)
            if isinstance(data, FileNotFoundError) or data is None:  # quarantined by another reader meanwhile
                continue
            if isinstance(data, Exception):
                with self._io():
                    raise data
            problem = chunk_problem(path.rsplit("/", 1)[1], len(data), data) or parse_problem(data, full=False)
            if problem:
                self.quarantine_chunk(path, problem)
                continue
            tables.append(pq.read_table(pa.BufferReader(data), schema=schema))
        return pa.concat_tables(tables) if tables else schema.empty_table()

    # ---------------------------------------------------------------- checkpoints
    def _checkpoints(self, stage: str, key: str) -> str:
        return self._p("_checkpoints", stage, key)

    def save_checkpoint(self, stage: str, key: str, step: int, folder: Path, keep: int = 2) -> None:
        root = self._checkpoints(stage, key)
        with self._io():
            self._put_folder(Path(folder), f"{root}/step-{step:09d}")
            for old in self._complete_folders(f"{root}/step-*")[:-keep]:
                self.fs.rm(old, recursive=True)

    def latest_checkpoint(self, stage: str, key: str) -> tuple[int, Path] | None:
        """(completed steps, local folder) of the newest checkpoint, or None."""
        with self._io():
            steps = self._complete_folders(f"{self._checkpoints(stage, key)}/step-*")
            if not steps:
                return None
            return int(steps[-1].rsplit("step-", 1)[1]), self._local_copy(steps[-1])

    def clear_checkpoints(self, stage: str, key: str) -> None:
        with self._io():
            if self.fs.exists(self._checkpoints(stage, key)):
                self.fs.rm(self._checkpoints(stage, key), recursive=True)
