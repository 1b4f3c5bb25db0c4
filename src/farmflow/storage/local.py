"""The embedded default store: a local folder (`LocalStore`)."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import fsspec
import pyarrow.fs as pafs

from farmflow.storage.refs import COMMIT_FILE, ArtifactRef
from farmflow.storage.store import Store


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

    def _move_folder(self, src: str, dest: str) -> None:
        Path(dest).parent.mkdir(parents=True, exist_ok=True)
        os.rename(src, dest)  # one step: the artifact is gone from its place and whole in the quarantine

    def _write_atomic(self, path: str, data: bytes) -> None:
        final = Path(path)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".{final.name}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, final)
        _fsync(final.parent)

    def _create(self, path: str, data: bytes) -> bool:
        final = Path(path)
        tmp = final.parent / f".{final.name}-{uuid.uuid4().hex[:8]}.tmp"
        for _ in range(100):
            # A lease's folder goes when its last file does (`Leases._delete`), so another process may remove it
            # between this mkdir and the write; once `tmp` is in it the folder is not empty and stays.
            try:
                final.parent.mkdir(parents=True, exist_ok=True)
                tmp.write_bytes(data)
                break
            except (FileNotFoundError, FileExistsError):  # mkdir saw the folder, then it was gone: make it again
                continue
        else:
            raise OSError(f"could not create {final}: its folder keeps vanishing")
        try:
            os.link(tmp, final)  # fails if `final` exists: the first creator wins, and its content is complete
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)
