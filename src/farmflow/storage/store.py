"""The store over an fsspec filesystem (`Store`) and its embedded default backend (`LocalStore`).

`Store` holds everything that is the same on a local disk and on S3: the layout, commit
records, listing, Parquet reads and writes, row logs and training checkpoints. A backend
only says how a write becomes visible (`_attempt`, `_finish`, `_put_folder`) and how a
folder becomes local (`_local_copy`).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Iterator

import fsspec
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from farmflow.storage.refs import COMMIT_FILE, ArtifactRef, canonical_json, utc_now
from farmflow.storage.schemas import SCHEMAS, conform


class StoreError(RuntimeError):
    """The store cannot be reached or used. The message names the location, never a credential."""


class Store:
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

    def _write_parquet_atomic(self, table: pa.Table, path: str) -> None:
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
        """The committed artifact for (stage, key), or None."""
        record = self._read_record(stage, key)
        return None if record is None else self._ref(stage, key, record)

    def exists(self, ref: ArtifactRef) -> bool:
        return self._read_record(ref.stage, ref.key) is not None

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

    def _require(self, ref: ArtifactRef) -> str:
        record = self._read_record(ref.stage, ref.key)
        if record is None:
            raise FileNotFoundError(f"artifact {ref.stage}/{ref.key} is not committed in {self.root}")
        return self._folder(ref.stage, ref.key, record)

    # ---------------------------------------------------------------- writes
    @staticmethod
    def _record_of(ref: ArtifactRef, config: Any, inputs: dict | None) -> dict:
        return {
            "ref": ref.model_dump(mode="json"),
            "config": json.loads(canonical_json(config)) if config is not None else None,
            "inputs": {k: (v.key if isinstance(v, ArtifactRef) else v) for k, v in (inputs or {}).items()},
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
        with self._attempt(stage, key) as folder:
            with self._io():
                pq.write_table(table, f"{folder}/data.parquet", filesystem=self.arrow_fs)
                for name, data in (extra_files or {}).items():
                    self.fs.pipe_file(f"{folder}/{name}", data)
                for name, t in extra.items():
                    pq.write_table(t, f"{folder}/{name}", filesystem=self.arrow_fs)
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
            return self._finish(folder, ref, self._record_of(ref, config, inputs))

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
            self._upload(model, f"{folder}/model")
            ref = ArtifactRef(
                uri="", stage=stage, key=key, kind="model", format=format, rows=None, created=utc_now(), metrics=metrics
            )
            committed = self._finish(folder, ref, self._record_of(ref, config, inputs))
            if committed.uri == self.url(folder):  # this upload won: keep the local files as the cached copy
                self._adopt(model, f"{folder}/model")

    # ---------------------------------------------------------------- row logs
    # Append-only tables outside the content-addressed artifacts, e.g. the row-level
    # annotation cache: each append is one Parquet file under ``_rows/<namespace>/``,
    # made visible in one step (a rename, or one S3 PUT), so a crash loses at most that
    # chunk and a reader never sees a partial file.
    def rows_dir(self, namespace: str) -> str:
        """The folder of a row log (a filesystem path; `url` gives its URL)."""
        if not namespace or any(part in ("", ".", "..") for part in namespace.split("/")):
            raise ValueError(f"invalid row-log namespace {namespace!r}")
        return self._p("_rows", namespace)

    def append_rows(self, namespace: str, table: pa.Table, format: str) -> str:
        """Append `table` (validated against the schema of `format`) as one chunk; returns its name."""
        table = conform(table, format, where=f"row log {namespace!r}")
        name = f"{utc_now().replace(':', '').replace('+', 'Z')}-{uuid.uuid4().hex[:8]}.parquet"
        with self._io():
            self._write_parquet_atomic(table, f"{self.rows_dir(namespace)}/{name}")
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
        """Every committed chunk of a row log, oldest first (an empty table if none)."""
        schema = SCHEMAS[format]
        chunks = self.row_chunks(namespace)
        if not chunks:
            return schema.empty_table()
        with self._io():
            return ds.dataset(chunks, schema=schema, format="parquet", filesystem=self.arrow_fs).to_table()

    # ---------------------------------------------------------------- checkpoints
    # Periodic training checkpoints of a stage that has not committed yet, under
    # ``_checkpoints/<stage>/<key>/step-<N>/``. Each becomes visible only once complete
    # (`_put_folder`); the newest `keep` stay.
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

    # ---------------------------------------------------------------- reads
    def read_table(self, ref: ArtifactRef, name: str = "data.parquet", format: str | None = None) -> pa.Table:
        """The artifact's table, or with `name` one of its extra tables (`format`: that table's schema)."""
        if ref.kind != "table":
            raise ValueError(f"artifact {ref.stage}/{ref.key} is a {ref.kind}, not a table")
        path = f"{self._require(ref)}/{name}"
        with self._io():
            return pq.read_table(path, schema=SCHEMAS.get(format or ref.format), filesystem=self.arrow_fs)

    def model_dir(self, ref: ArtifactRef) -> Path:
        """A local folder with the model (downloaded once per artifact on remote stores)."""
        if ref.kind != "model":
            raise ValueError(f"artifact {ref.stage}/{ref.key} is a {ref.kind}, not a model")
        path = f"{self._require(ref)}/model"
        with self._io():
            return self._local_copy(path)

    def read_file(self, ref: ArtifactRef, name: str) -> bytes:
        """One file of a committed artifact (e.g. ``leaderboard.md``)."""
        path = f"{self._require(ref)}/{name}"
        with self._io():
            return self.fs.cat_file(path)

    def files(self, ref: ArtifactRef) -> dict[str, int]:
        """Relative path → size in bytes of every data file of a committed artifact (not the commit record)."""
        folder = self._require(ref)
        with self._io():
            found = self.fs.find(folder, detail=True)
        files = {p[len(folder) + 1 :]: int(info.get("size") or 0) for p, info in sorted(found.items())}
        return {name: size for name, size in files.items() if name != COMMIT_FILE}


def _fsync(path: Path) -> None:
    """Flush a file's (or a folder's entries') data to the disk: a committed artifact survives a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStore(Store):
    """The embedded default store: a folder (``./.farmflow/store`` or ``$FARMFLOW_STORE``).

    Commits: an artifact is assembled in ``<root>/.staging/`` and moved into place with
    one ``rename``; when two processes race on one key, the first rename wins and the
    loser discards its copy.
    """

    def __init__(self, root: str | os.PathLike):
        root = str(root)
        if root.startswith("file://"):
            root = root[len("file://") :]
        self.root = Path(root).expanduser().absolute()
        self.root.mkdir(parents=True, exist_ok=True)
        self.fs = fsspec.filesystem("file")
        self.arrow_fs = pafs.LocalFileSystem()
        self.base = str(self.root)

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    def path(self, stage: str, key: str) -> Path:
        return self.root / stage / key

    def result_storage(self) -> Path:
        return self.root / "_prefect"  # a Path: local result storage, no block to save

    @contextmanager
    def _attempt(self, stage: str, key: str) -> Iterator[str]:
        staging = self.root / ".staging" / f"{stage}-{key}-{uuid.uuid4().hex[:8]}"
        staging.mkdir(parents=True)
        try:
            yield str(staging)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def _finish(self, folder: str, ref: ArtifactRef, record: dict) -> ArtifactRef:
        for path in Path(folder).rglob("*"):  # the data reaches the disk before the record that vouches for it
            if path.is_file():
                _fsync(path)
        with open(Path(folder) / COMMIT_FILE, "w") as f:
            f.write(json.dumps(record, indent=2, sort_keys=True))
            f.flush()
            os.fsync(f.fileno())
        final = self.path(ref.stage, ref.key)
        final.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(folder, final)
            _fsync(final.parent)  # the rename itself survives a power loss
        except OSError:
            if not (final / COMMIT_FILE).is_file():  # not a lost race: a real failure
                raise
        committed = self.get(ref.stage, ref.key)
        assert committed is not None
        return committed

    @contextmanager
    def _workdir(self, folder: str) -> Iterator[Path]:
        yield Path(folder)

    def _put_folder(self, local: Path, dest: str) -> None:
        final = Path(dest)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".{final.name}-{uuid.uuid4().hex[:8]}"
        shutil.copytree(local, tmp)
        if final.exists():  # a re-saved step: move the old copy out of sight first, so `final` is never half deleted
            old = final.parent / f".{final.name}-old-{uuid.uuid4().hex[:8]}"
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)

    def _complete_folders(self, pattern: str) -> list[str]:
        return sorted(p for p in self.fs.glob(pattern) if Path(p).is_dir())

    def _local_copy(self, path: str) -> Path:
        return Path(path)

    def _write_parquet_atomic(self, table: pa.Table, path: str) -> None:
        final = Path(path)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".{final.name}.tmp"
        pq.write_table(table, tmp)
        _fsync(tmp)
        os.rename(tmp, final)
        _fsync(final.parent)
