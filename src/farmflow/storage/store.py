"""The store over an fsspec filesystem (`Store`): what is the same on a local disk and on S3.

`Store` holds the layout, commit records, listing, and the Parquet reads and writes of
artifacts; row logs and checkpoints come from `farmflow.storage.rowlog`, checksums and
quarantine from `farmflow.storage.integrity`, leases from `farmflow.storage.leases`. A
backend (`farmflow.storage.local`, `farmflow.storage.s3`) only says how a write becomes
visible (`_attempt`, `_finish`, `_put_folder`, `_write_atomic`, `_create`) and how a folder
becomes local (`_local_copy`).
"""

from __future__ import annotations

import json
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Iterator

import fsspec
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from farmflow.storage.errors import StoreError
from farmflow.storage.integrity import (
    Verified,
    content_problem,
    digest_bytes,
    digest_folder,
    local_problem,
    parquet_bytes,
)
from farmflow.storage.refs import COMMIT_FILE, ArtifactRef, canonical_json, utc_now
from farmflow.storage.rowlog import RowLogs
from farmflow.storage.schemas import SCHEMAS, conform


class Store(RowLogs, Verified):
    """A content-addressed artifact store on an fsspec filesystem ``fs``, rooted at ``base``.

    ``root`` is what users see (a local `Path`, or ``s3://bucket/prefix``).
    """

    fs: fsspec.AbstractFileSystem
    arrow_fs: pafs.FileSystem
    base: str
    root: Any

    # ---------------------------------------------------------------- backend hooks
    def url(self, path: str) -> str:
        """The user-visible location of a filesystem path (DuckDB and refs use it)."""
        return path

    def _io(self):
        """Context that turns client errors into one `StoreError` (nothing to do locally)."""
        return nullcontext()

    @contextmanager
    def _attempt(self, stage: str, key: str) -> Iterator[str]:
        """A private folder to write one artifact into before `_finish` commits it."""
        raise NotImplementedError

    def _finish(self, folder: str, ref: ArtifactRef, record: dict) -> ArtifactRef:
        """Make the artifact written to `folder` visible with its commit record; first commit wins."""
        raise NotImplementedError

    @contextmanager
    def _workdir(self, folder: str) -> Iterator[Path]:
        """A local folder whose contents end up in `folder` (see `_upload`)."""
        raise NotImplementedError

    def _upload(self, local: Path, dest: str) -> None:
        """Copy the files of `local` to `dest` (nothing to do when `dest` is `local`)."""

    def _adopt(self, local: Path, remote: str) -> None:
        """`local` holds what was uploaded to `remote`: a backend with a download cache may keep it."""

    def _put_folder(self, local: Path, dest: str) -> None:
        """Copy `local` to `dest` so that it is only ever seen complete (see `_complete_folders`)."""
        raise NotImplementedError

    def _complete_folders(self, pattern: str) -> list[str]:
        """The complete folders written by `_put_folder` that match a glob, sorted."""
        raise NotImplementedError

    def _local_copy(self, path: str) -> Path:
        """A local folder with the contents of `path` (itself on a local disk)."""
        raise NotImplementedError

    def _drop_local_copy(self, path: str) -> bool:
        """Forget a downloaded copy of `path` (True), or False where `path` is itself local."""
        return False

    def _write_atomic(self, path: str, data: bytes) -> None:
        """Write a file that is only ever seen complete (a row-log chunk)."""
        raise NotImplementedError

    def _create(self, path: str, data: bytes) -> bool:
        """Create a small file only if it does not exist, atomically (leases); False: it exists."""
        raise NotImplementedError

    def result_storage(self) -> Any:
        """Prefect result storage inside this store (``_prefect/``)."""
        raise NotImplementedError

    # ---------------------------------------------------------------- layout
    def _p(self, *parts: str) -> str:
        return "/".join((self.base, *parts))

    def _read_record(self, stage: str, key: str) -> dict | None:
        try:
            with self._io():
                raw = self.fs.cat_file(self._p(stage, key, COMMIT_FILE))
        except FileNotFoundError:
            return None
        return self._parse_record(self._p(stage, key, COMMIT_FILE), raw)

    def _parse_record(self, path: str, raw: bytes) -> dict:
        try:
            record = json.loads(raw)
            if not isinstance(record, dict) or not isinstance(record.get("ref"), dict):
                raise ValueError("no 'ref' object")
            return record
        except ValueError as err:  # json.JSONDecodeError is a ValueError
            raise StoreError(
                f"{self.url(path)}: unreadable commit record ({str(err)[:120]}); move that artifact folder away "
                "to have its stage run again"
            ) from None

    def _folder(self, stage: str, key: str, record: dict) -> str:
        """The folder with the artifact's data: the artifact folder itself, or the attempt it names."""
        data = record.get("data") or ""
        return self._p(stage, key, data) if data else self._p(stage, key)

    def _ref(self, stage: str, key: str, record: dict) -> ArtifactRef:
        ref = ArtifactRef.model_validate(record["ref"])
        return ref.model_copy(update={"uri": self.url(self._folder(stage, key, record))})

    # ---------------------------------------------------------------- lookup
    def get(self, stage: str, key: str) -> ArtifactRef | None:
        """The committed artifact for (stage, key), or None.

        Its files' sizes are checked against the commit record (one listing): a truncated or missing
        file quarantines the artifact (one line) and the answer is None, so it is computed again."""
        record = self._read_record(stage, key)
        if record is None:
            return None
        problem = self.size_problem(self._folder(stage, key, record), record)
        if problem:
            self.quarantine(stage, key, record, problem)
            return None
        return self._ref(stage, key, record)

    def exists(self, ref: ArtifactRef) -> bool:
        return self.get(ref.stage, ref.key) is not None

    def record(self, ref: ArtifactRef) -> dict:
        """The whole commit record (ref, config, inputs) of a committed artifact."""
        record = self._read_record(ref.stage, ref.key)
        if record is None:
            raise FileNotFoundError(f"artifact {ref.stage}/{ref.key} is not committed in {self.root}")
        return record

    def records(self) -> list[dict]:
        """Every commit record, oldest first, each with its ref's ``uri`` filled in."""
        with self._io():
            paths = self.fs.glob(self._p("*", "*", COMMIT_FILE))
            paths = [p for p in paths if not p.split("/")[-3].startswith((".", "_"))]  # not .staging, _rows, ...
            raw = self.fs.cat(paths, on_error="return") if paths else {}
            for (
                data
            ) in raw.values():  # a record that cannot be read is an error, not an artifact left out of the listing
                if isinstance(data, Exception) and not isinstance(
                    data, FileNotFoundError
                ):  # (not found: removed since the glob)
                    raise data
        out = []
        for path, data in raw.items():
            if isinstance(data, FileNotFoundError):
                continue
            stage, key = path.split("/")[-3:-1]
            record = self._parse_record(path, data)
            record["ref"] = self._ref(stage, key, record).model_dump(mode="json")
            out.append(record)
        return sorted(out, key=lambda r: r["ref"]["created"])

    def list(self) -> list[ArtifactRef]:
        return [ArtifactRef.model_validate(r["ref"]) for r in self.records()]

    def _require(self, ref: ArtifactRef) -> tuple[str, dict]:
        """(data folder, commit record) of a committed artifact whose files have their committed sizes."""
        record = self._read_record(ref.stage, ref.key)
        if record is None:
            raise FileNotFoundError(f"artifact {ref.stage}/{ref.key} is not committed in {self.root}")
        folder = self._folder(ref.stage, ref.key, record)
        problem = self.size_problem(folder, record)
        if problem:
            raise self.corrupt(ref.stage, ref.key, record, problem)
        return folder, record

    def _checked(self, ref: ArtifactRef, name: str) -> bytes:
        """The bytes of one file of a committed artifact, checked against its size and sha256."""
        folder, record = self._require(ref)
        with self._io():
            data = self.fs.cat_file(f"{folder}/{name}")
        problem = content_problem(name, data, record)
        if problem:
            raise self.corrupt(ref.stage, ref.key, record, problem)
        return data

    # ---------------------------------------------------------------- writes
    @staticmethod
    def _record_of(ref: ArtifactRef, config: Any, inputs: dict | None, files: dict[str, dict]) -> dict:
        return {
            "ref": ref.model_dump(mode="json"),
            "config": json.loads(canonical_json(config)) if config is not None else None,
            "inputs": {k: (v.key if isinstance(v, ArtifactRef) else v) for k, v in (inputs or {}).items()},
            "files": files,
        }

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
        """Validate `table` against the schema of `format` and commit it atomically.

        `extra_files` (name → bytes) are committed in the same folder, e.g. a rendered
        Markdown table or plot of the data; `extra_tables` (name.parquet → (table, format))
        likewise, each validated against its own schema (read back with `read_table(ref, name)`).
        `parts` (name → content digest) go into the ref for stages that read only some parts.
        """
        table = conform(table, format, where=f"stage {stage!r}")
        extra = {
            name: conform(t, fmt, where=f"stage {stage!r} {name}") for name, (t, fmt) in (extra_tables or {}).items()
        }
        for name in [*(extra_files or {}), *extra]:
            if "/" in name or name.startswith(".") or name in ("data.parquet", COMMIT_FILE):
                raise ValueError(f"invalid extra file name {name!r} for stage {stage!r}")
        bad = [name for name in extra if not name.endswith(".parquet")]
        if bad:
            raise ValueError(f"extra table names must end in .parquet, got {bad} for stage {stage!r}")
        payload = {"data.parquet": parquet_bytes(table), **(extra_files or {})}
        payload |= {name: parquet_bytes(t) for name, t in extra.items()}
        files = {name: digest_bytes(data) for name, data in payload.items()}
        with self._attempt(stage, key) as folder:
            with self._io():
                for name, data in payload.items():
                    self.fs.pipe_file(f"{folder}/{name}", data)
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
            return self._finish(folder, ref, self._record_of(ref, config, inputs, files))

    @contextmanager
    def put_model(
        self,
        stage: str,
        key: str,
        format: str,
        *,
        config: Any = None,
        inputs: dict | None = None,
    ) -> Iterator[tuple[Path, dict[str, float]]]:
        """``with store.put_model(...) as (folder, metrics):`` save into `folder`, fill `metrics`.

        The folder is committed when the block exits without an exception; the committed
        ref is then available as ``store.get(stage, key)``.
        """
        with self._attempt(stage, key) as folder, self._workdir(folder) as work:
            model = work / "model"
            model.mkdir()
            metrics: dict[str, float] = {}
            yield model, metrics
            if not any(model.glob("*.safetensors")):
                raise ValueError(f"stage {stage!r} saved no safetensors weights into its model artifact")
            files = digest_folder(model, "model/")
            self._upload(model, f"{folder}/model")
            ref = ArtifactRef(
                uri="", stage=stage, key=key, kind="model", format=format, rows=None, created=utc_now(), metrics=metrics
            )
            committed = self._finish(folder, ref, self._record_of(ref, config, inputs, files))
            if committed.uri == self.url(folder):  # this upload won: keep the local files as the cached copy
                self._adopt(model, f"{folder}/model")

    # ---------------------------------------------------------------- reads
    def read_table(self, ref: ArtifactRef, name: str = "data.parquet", format: str | None = None) -> pa.Table:
        """The artifact's table, or with `name` one of its extra tables (`format`: that table's schema)."""
        if ref.kind != "table":
            raise ValueError(f"artifact {ref.stage}/{ref.key} is a {ref.kind}, not a table")
        data = self._checked(ref, name)
        return pq.read_table(pa.BufferReader(data), schema=SCHEMAS.get(format or ref.format))

    def model_dir(self, ref: ArtifactRef) -> Path:
        """A local folder with the model (downloaded once per artifact on remote stores), its files' sizes checked
        against the commit record (a damaged download cache is fetched again once before the artifact counts as
        corrupt)."""
        if ref.kind != "model":
            raise ValueError(f"artifact {ref.stage}/{ref.key} is a {ref.kind}, not a model")
        record = self._read_record(ref.stage, ref.key)
        if record is None:
            raise FileNotFoundError(f"artifact {ref.stage}/{ref.key} is not committed in {self.root}")
        path = f"{self._folder(ref.stage, ref.key, record)}/model"
        with self._io():
            local = self._local_copy(path)
            problem = local_problem(local, record, "model/")
            if problem and self._drop_local_copy(path):
                local = self._local_copy(path)
                problem = local_problem(local, record, "model/")
        if problem:
            raise self.corrupt(ref.stage, ref.key, record, problem)
        return local

    def read_file(self, ref: ArtifactRef, name: str) -> bytes:
        """One file of a committed artifact (e.g. ``leaderboard.md``), checked against its commit record."""
        return self._checked(ref, name)

    def files(self, ref: ArtifactRef) -> dict[str, int]:
        """Relative path → size in bytes of every data file of a committed artifact (not the commit record)."""
        folder, _ = self._require(ref)
        with self._io():
            found = self.fs.find(folder, detail=True)
        files = {p[len(folder) + 1 :]: int(info.get("size") or 0) for p, info in sorted(found.items())}
        return {name: size for name, size in files.items() if name != COMMIT_FILE}
