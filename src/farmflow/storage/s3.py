"""The artifact store on S3 or any S3-compatible server (MinIO), through s3fs.

Location: ``s3://bucket/prefix``, with non-secret options as query parameters so that one
string carries the whole store to every task and worker (`farmflow.storage.s3_location`)::

    s3://farm/runs?endpoint_url=http://minio:9000&profile=farm&max_attempts=5

Credentials never appear in the location: they come from the standard AWS chain
(``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE`` or ``profile=``, instance
roles...) or from a Prefect ``Secret`` block named by ``credentials_block=`` whose value is
``{"aws_access_key_id": ..., "aws_secret_access_key": ..., "aws_session_token": ...}``.
Client errors are classified in `farmflow.storage.s3_errors`.

Commits (S3 has no rename): an artifact's objects are written under a fresh attempt
folder ``<stage>/<key>/<attempt>/``; then ``<stage>/<key>/_COMMIT.json``, which names the
attempt, is created with a conditional PUT (``If-None-Match: *``; leases use the same
`_create`). The first commit wins;
a loser deletes its attempt and returns the winner's ref. Readers resolve data only
through the commit record, so they never see an uncommitted or losing attempt; an attempt
left by a killed writer is never read.

Models are downloaded once per artifact into a local cache (``cache_dir``, default
``$FARMFLOW_CACHE`` or ``~/.cache/farmflow``), keyed by bucket, prefix, stage, key and
attempt, and moved into place in one rename, so concurrent readers share one copy.

Prefect results go under ``<store>/_prefect/`` too. Prefect 3 only accepts result storage
that is a local path or a block saved on the server: `StoreResults` is that block. It holds
the store location (never a credential) and reads and writes through the store, so Prefect's
cache records are found by any machine with access to the bucket, with the credentials
resolved exactly as for the artifacts.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pyarrow.fs as pafs
from prefect.filesystems import WritableFileSystem
from pydantic import Field, PrivateAttr

from farmflow.storage.errors import StoreError
from farmflow.storage.refs import COMMIT_FILE, ArtifactRef
from farmflow.storage.s3_errors import ACCESS_CODES, LOST_RACE_CODES, error_code, is_connection_error
from farmflow.storage.s3_location import block_credentials, parse_s3_uri, s3_location
from farmflow.storage.store import Store

CONNECT_TIMEOUT_S = 10
COMPLETE = "_COMPLETE"  # marker written last into a checkpoint folder


class S3Store(Store):
    """The artifact store in an S3 bucket (AWS or MinIO); same layout and keys as `LocalStore`."""

    def __init__(self, uri: str):
        import s3fs

        self.bucket, self.prefix, options = parse_s3_uri(uri)
        self.options = options
        self.root = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        self.location = s3_location(self.bucket, self.prefix, options)
        self.base = f"{self.bucket}/{self.prefix}".rstrip("/")
        self.endpoint = (
            options.get("endpoint_url") or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        )
        try:
            attempts = int(options.get("max_attempts", 5))
            assert attempts >= 1
        except (ValueError, AssertionError):
            raise StoreError(f"store {self.root}: max_attempts must be a positive integer") from None
        cache = options.get("cache_dir") or os.environ.get("FARMFLOW_CACHE") or "~/.cache/farmflow"
        self.cache = Path(cache).expanduser().absolute()

        kwargs: dict[str, Any] = {}
        if options.get("profile"):
            kwargs["profile"] = options["profile"]
        if options.get("credentials_block"):
            kwargs.update(block_credentials(options["credentials_block"]))
        client_kwargs = {
            k: v for k, v in {"endpoint_url": self.endpoint, "region_name": options.get("region")}.items() if v
        }
        self.fs = s3fs.S3FileSystem(
            client_kwargs=client_kwargs,
            # botocore retries each request (throttling, 5xx, dropped connections) with backoff;
            # s3fs's own loop also retries throttling and interrupted downloads
            config_kwargs={
                "retries": {"total_max_attempts": attempts, "mode": "standard"},
                "connect_timeout": CONNECT_TIMEOUT_S,
            },
            use_listings_cache=False,  # other processes write: always list the bucket itself
            skip_instance_cache=True,  # credentials may differ between stores in one process
            **kwargs,
        )
        self.fs.retries = attempts  # a class attribute of s3fs, not a constructor argument
        self.arrow_fs = pafs.PyFileSystem(pafs.FSSpecHandler(self.fs))
        self._validate()

    def __repr__(self) -> str:
        return f"S3Store({self.root!r}, endpoint={self.endpoint or 'AWS'!r})"

    def url(self, path: str) -> str:
        return f"s3://{path}"

    # ---------------------------------------------------------------- errors
    def _describe(self, what: str) -> str:
        return f"S3 store {self.root} (endpoint {self.endpoint or 'AWS default'}, bucket {self.bucket!r}): {what}"

    @contextmanager
    def _io(self) -> Iterator[None]:
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, ProfileNotFound

        try:
            yield
        except StoreError:
            raise
        except FileNotFoundError as err:
            if error_code(err) == "NoSuchBucket" or "bucket does not exist" in str(err).lower():
                raise StoreError(self._describe(f"bucket {self.bucket!r} does not exist")) from None
            raise
        except FileExistsError:
            raise
        except (NoCredentialsError, ProfileNotFound) as err:
            hint = (
                f"profile {self.options['profile']!r} not found"
                if isinstance(err, ProfileNotFound)
                else "no credentials found"
            )
            raise StoreError(
                self._describe(
                    f"{hint} (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a profile or a credentials block)"
                )
            ) from None
        except Exception as err:  # noqa: BLE001 - classified below, re-raised when not an S3 problem
            code = error_code(err)
            if isinstance(err, PermissionError) or code in ACCESS_CODES:
                raise StoreError(
                    self._describe(
                        f"access denied ({code or 'AccessDenied'}); check the credentials and the bucket policy"
                    )
                ) from None
            if is_connection_error(err):
                raise StoreError(self._describe(f"cannot connect to the endpoint ({type(err).__name__})")) from None
            if code is not None or isinstance(err, (BotoCoreError, ClientError)):
                raise StoreError(self._describe(f"S3 request failed ({code or type(err).__name__})")) from None
            raise

    def _validate(self) -> None:
        """One cheap listing: fails now, with one clear error, if the store is unusable."""
        with self._io():
            self.fs.call_s3("list_objects_v2", Bucket=self.bucket, Prefix=self.prefix, MaxKeys=1)

    # ---------------------------------------------------------------- commits
    @contextmanager
    def _attempt(self, stage: str, key: str) -> Iterator[str]:
        folder = self._p(stage, key, uuid.uuid4().hex[:12])
        try:
            yield folder
        except BaseException:
            self._remove(folder)
            raise

    def _remove(self, path: str) -> None:
        try:
            with self._io():
                if self.fs.find(path):
                    self.fs.rm(path, recursive=True)
        except (StoreError, FileNotFoundError):
            pass  # best effort: an unreferenced attempt is never read

    def _finish(self, folder: str, ref: ArtifactRef, record: dict) -> ArtifactRef:
        record["data"] = folder.rsplit("/", 1)[1]
        body = json.dumps(record, indent=2, sort_keys=True).encode()
        try:
            with self._io():
                try:
                    self.fs.pipe_file(self._p(ref.stage, ref.key, COMMIT_FILE), body, mode="create")
                except Exception as err:  # noqa: BLE001 - only the lost-race codes are translated; the rest go on to _io
                    if error_code(err) in LOST_RACE_CODES:  # the conditional PUT lost, however the server phrases it
                        raise FileExistsError(ref.key) from None
                    raise
        except FileExistsError:  # another writer committed first: theirs is the artifact
            self._remove(folder)
        committed = self.get(ref.stage, ref.key)
        if committed is None:
            raise StoreError(self._describe(f"artifact {ref.stage}/{ref.key} vanished right after its commit"))
        return committed

    @contextmanager
    def _workdir(self, folder: str) -> Iterator[Path]:
        (self.cache / ".tmp").mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(dir=self.cache / ".tmp"))
        try:
            yield work
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def _upload(self, local: Path, dest: str) -> None:
        files = sorted(p for p in local.rglob("*") if p.is_file())
        with self._io():
            self.fs.put([str(p) for p in files], [f"{dest}/{p.relative_to(local).as_posix()}" for p in files])

    def _cached(self, remote: str) -> Path:
        return self.cache / "s3" / remote

    def _adopt(self, local: Path, remote: str) -> None:
        target = self._cached(remote)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(local, target)
        except OSError:
            pass  # already cached by a concurrent reader

    def _local_copy(self, path: str, cached_as: str | None = None) -> Path:
        """Download `path` once into the cache (complete when visible: downloaded aside, then renamed)."""
        target = self._cached(cached_as or path)
        if target.is_dir():
            return target
        remote = [p for p in self.fs.find(path) if p != f"{path}/{COMPLETE}"]
        tmp = target.parent / f".{target.name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(parents=True)
        try:
            rel = [p[len(path) + 1 :] for p in remote]
            for r in rel:
                (tmp / r).parent.mkdir(parents=True, exist_ok=True)
            self.fs.get(remote, [str(tmp / r) for r in rel])
            try:
                os.rename(tmp, target)
            except OSError:
                if not target.is_dir():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return target

    def _drop_local_copy(self, path: str) -> bool:
        shutil.rmtree(self._cached(path), ignore_errors=True)
        return True

    # ---------------------------------------------------------------- checkpoints, row logs
    def _put_folder(self, local: Path, dest: str) -> None:
        # A checkpoint is complete once its marker exists; the marker's content (a fresh
        # id) becomes part of the folder name in the download cache, so a re-saved step is
        # never served from a stale copy. Whatever an interrupted save left there goes first, and
        # if it cannot be removed the save fails (new files over old ones would mix two checkpoints).
        if self.fs.find(dest):
            self.fs.rm(dest, recursive=True)
        self._upload(local, dest)
        self.fs.pipe_file(f"{dest}/{COMPLETE}", uuid.uuid4().hex.encode())

    def _complete_folders(self, pattern: str) -> list[str]:
        return sorted(p.rsplit("/", 1)[0] for p in self.fs.glob(f"{pattern}/{COMPLETE}"))

    def latest_checkpoint(self, stage: str, key: str) -> tuple[int, Path] | None:
        with self._io():
            steps = self._complete_folders(f"{self._checkpoints(stage, key)}/step-*")
            if not steps:
                return None
            version = self.fs.cat_file(f"{steps[-1]}/{COMPLETE}").decode()
            return int(steps[-1].rsplit("step-", 1)[1]), self._local_copy(steps[-1], cached_as=f"{steps[-1]}-{version}")

    def clear_checkpoints(self, stage: str, key: str) -> None:
        super().clear_checkpoints(stage, key)
        shutil.rmtree(self._cached(self._checkpoints(stage, key)), ignore_errors=True)

    def _write_atomic(self, path: str, data: bytes) -> None:
        self.fs.pipe_file(path, data)  # an S3 object appears complete or not at all

    def _create(self, path: str, data: bytes) -> bool:
        try:
            with self._io():
                try:
                    self.fs.pipe_file(path, data, mode="create")  # a conditional PUT: If-None-Match: *
                except Exception as err:  # noqa: BLE001 - only the lost-race codes are translated; the rest go to _io
                    if error_code(err) in LOST_RACE_CODES:
                        raise FileExistsError(path) from None
                    raise
        except FileExistsError:
            return False
        return True

    # ---------------------------------------------------------------- Prefect
    def result_storage(self) -> Any:
        """A saved `StoreResults` block for this store (it holds the location, never credentials)."""
        return StoreResults.for_store(self.location)

    def read_object(self, path: str) -> bytes:
        with self._io():
            return self.fs.cat_file(self._p(path))

    def write_object(self, path: str, data: bytes) -> None:
        with self._io():
            self.fs.pipe_file(self._p(path), data)

    def register_duckdb(self, con: Any) -> None:
        con.register_filesystem(self.fs)


def block_name(location: str) -> str:
    return "farmflow-results-" + hashlib.sha256(location.encode()).hexdigest()[:16]


SAVED_BLOCKS: dict[str, "StoreResults"] = {}
"""Store location → its `StoreResults` block, saved on the Prefect server once per process."""


class StoreResults(WritableFileSystem):
    """Prefect results kept under ``_prefect/`` of an S3 store."""

    _block_type_name = "Farmflow Store Results"
    store_uri: str = Field(
        description="Location of the farmflow store (s3://bucket/prefix?endpoint_url=...); holds no credentials."
    )
    _store: Any = PrivateAttr(default=None)

    @classmethod
    def for_store(cls, location: str) -> "StoreResults":
        """The block for a store location, saved on the Prefect server once per process."""
        if location not in SAVED_BLOCKS:
            block = cls(store_uri=location)
            block.save(block_name(location), overwrite=True)
            SAVED_BLOCKS[location] = block
        return SAVED_BLOCKS[location]

    def _open(self) -> S3Store:
        if self._store is None:
            self._store = S3Store(self.store_uri)
        return self._store

    def read_path(self, path: str, _sync: bool | None = None) -> bytes:
        return self._open().read_object(f"_prefect/{path}")

    def write_path(self, path: str, content: bytes, _sync: bool | None = None) -> str:
        self._open().write_object(f"_prefect/{path}", content)
        return path

    async def aread_path(self, path: str) -> bytes:
        return await asyncio.to_thread(self.read_path, path)

    async def awrite_path(self, path: str, content: bytes) -> str:
        return await asyncio.to_thread(self.write_path, path, content)
