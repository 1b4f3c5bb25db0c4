"""Verified artifacts: every committed file's size and sha256 in its commit record, checked when it is used.

A file can be cut short or damaged after its commit (a full disk under another tool, a partial copy or
sync of the store, a hand edit, a bit flip). A commit record alone vouches for nothing then: the
artifact looks committed, every reader fails deep inside Parquet or safetensors, and no run ever
computes it again. So:

* `put_table` and `put_model` record ``files`` in ``_COMMIT.json``: relative path → ``{size, sha256}``
  of every data file, hashed from the bytes being written (committing reads nothing back).
* Finding an artifact (`Store.get`: a stage's lookup, the flows' existence check) compares the sizes
  with one listing of its folder, so a truncated or missing file is caught before any stage trusts it.
  Reading a table or a file (`read_table`, `read_file`) also checks the sha256 of the bytes it read
  anyway; a model folder is checked by size (and by hash in `verify`).
* A mismatch moves the artifact to ``_quarantine/<stage>/<key>-<time>/`` (kept, not deleted: the bytes
  may be worth a look) and logs one line naming stage, key and file. The artifact is missing from then
  on: a lookup computes it again in the same run; a reader raises `CorruptArtifact` (one line) and the
  next run computes it again.
* A row-log chunk carries its size and sha256 in its file name; a chunk that does not match, or does
  not parse, goes to ``_quarantine/_rows/...`` and its rows are left out (an annotation run asks those
  pairs again).
* `verify` scans a whole store (sizes and hashes of every artifact and chunk); with ``repair`` it
  quarantines what it found (``farmflow artifacts verify [--repair]``).

Artifacts and chunks written before checksums were recorded are trusted as they are: there is nothing
to compare them with (`verify` still parses their tables and chunks when it hashes).
"""

from __future__ import annotations

import hashlib
import re
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from farmflow.progress import log
from farmflow.storage.errors import CorruptArtifact, StoreError
from farmflow.storage.refs import COMMIT_FILE

QUARANTINE = "_quarantine"
CHUNK = re.compile(r"-(\d+)-([0-9a-f]{16})\.parquet$")
"""A row-log chunk's name ends in ``-<size>-<first 16 hex digits of its sha256>.parquet``."""
BLOCK = 1 << 20


def digest_bytes(data: bytes) -> dict:
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def digest_file(path: Path) -> dict:
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(BLOCK):
            h.update(block)
            size += len(block)
    return {"size": size, "sha256": h.hexdigest()}


def digest_folder(folder: Path, prefix: str = "") -> dict[str, dict]:
    """``prefix + relative path`` → digest of every file under `folder`."""
    return {prefix + p.relative_to(folder).as_posix(): digest_file(p) for p in sorted(folder.rglob("*")) if p.is_file()}


def parquet_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


def chunk_name(stem: str, data: bytes) -> str:
    return f"{stem}-{len(data)}-{hashlib.sha256(data).hexdigest()[:16]}.parquet"


def chunk_problem(name: str, size: int, data: bytes | None = None) -> str | None:
    """What is wrong with a row-log chunk of `size` bytes (and content `data`, when read), going by its name."""
    m = CHUNK.search(name)
    if m is None:
        return None  # named before names carried checksums: parsing it is the check
    if size != int(m.group(1)):
        return f"{size} bytes, written {m.group(1)}"
    if data is not None and hashlib.sha256(data).hexdigest()[:16] != m.group(2):
        return "sha256 differs from the one it was written with"
    return None


def content_problem(name: str, data: bytes, record: dict) -> str | None:
    """What is wrong with the bytes `data` of file `name`, compared with the commit record."""
    d = (record.get("files") or {}).get(name)
    if d is None:
        return None
    if len(data) != d["size"]:
        return f"{name} is {len(data)} bytes, committed {d['size']}"
    if hashlib.sha256(data).hexdigest() != d["sha256"]:
        return f"{name}: sha256 differs from its commit record"
    return None


def local_problem(local: Path, record: dict, prefix: str) -> str | None:
    """A committed file under `prefix` missing from the local folder `local`, or of another size."""
    for name, d in sorted((record.get("files") or {}).items()):
        if not name.startswith(prefix):
            continue
        path = local / name[len(prefix) :]
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != d["size"]:
            return f"{name} is {path.stat().st_size} bytes, committed {d['size']}"
    return None


def _stamp() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + uuid.uuid4().hex[:6]


class Verified:
    """Checks and quarantine, mixed into `farmflow.storage.store.Store` (uses its fs, layout and `_io`)."""

    def size_problem(self, folder: str, record: dict) -> str | None:
        """A committed file that is missing or of another size (one listing); None: all match."""
        files = record.get("files")
        if not files:
            return None
        with self._io():
            try:
                found = self.fs.find(folder, detail=True)
            except FileNotFoundError:
                found = {}
        sizes = {p[len(folder) + 1 :]: int(info.get("size") or 0) for p, info in found.items()}
        for name, d in sorted(files.items()):
            if name not in sizes:
                return f"{name} is missing"
            if sizes[name] != d["size"]:
                return f"{name} is {sizes[name]} bytes, committed {d['size']}"
        return None

    def _hash_problem(self, folder: str, record: dict) -> str | None:
        """A committed file whose sha256 differs (reads every file); None: all match."""
        for name, d in sorted((record.get("files") or {}).items()):
            h = hashlib.sha256()
            with self._io(), self.fs.open(f"{folder}/{name}", "rb") as f:
                while block := f.read(BLOCK):
                    h.update(block)
            if h.hexdigest() != d["sha256"]:
                return f"{name}: sha256 differs from its commit record"
        return None

    def quarantine(self, stage: str, key: str, record: dict | None, problem: str) -> str | None:
        """Move a corrupt artifact to ``_quarantine/`` (not deleted) and log one line; where it went (None: another
        process moved it first)."""
        dest = self._p(QUARANTINE, stage, f"{key}-{_stamp()}")
        try:
            with self._io():
                self.fs.makedirs(dest.rsplit("/", 1)[0], exist_ok=True)
                if record is not None and record.get("data"):  # S3: the record first (the artifact is gone), then data
                    self.fs.copy(self._p(stage, key, COMMIT_FILE), f"{dest}/{COMMIT_FILE}")
                    self.fs.rm_file(self._p(stage, key, COMMIT_FILE))
                    self._move_folder(self._p(stage, key, record["data"]), f"{dest}/{record['data']}")
                else:
                    self._move_folder(self._p(stage, key), dest)
        except FileNotFoundError:
            return None
        log("store: %s/%s is corrupt (%s); moved to %s; it is computed again", stage, key, problem, self.url(dest))
        return dest

    def _move_folder(self, src: str, dest: str) -> None:
        """Copy every file of `src` under `dest`, then delete them (`LocalStore` renames the folder instead)."""
        files = self.fs.find(src)
        if not files:
            raise FileNotFoundError(src)
        for path in files:
            self.fs.copy(path, dest + path[len(src) :])
        self.fs.rm(files)

    def corrupt(self, stage: str, key: str, record: dict, problem: str) -> CorruptArtifact:
        """Quarantine the artifact; the one-line error a reader raises."""
        where = self.quarantine(stage, key, record, problem)
        moved = f"moved to {self.url(where)}" if where else "moved away"
        return CorruptArtifact(
            f"artifact {stage}/{key} is corrupt ({problem}); {moved}; the next run computes it again"
        )

    def quarantine_chunk(self, path: str, problem: str) -> None:
        """Move a corrupt row-log chunk to ``_quarantine/_rows/...`` and log one line."""
        dest = self._p(QUARANTINE, path[len(self.base) + 1 :])
        try:
            with self._io():
                self.fs.makedirs(dest.rsplit("/", 1)[0], exist_ok=True)
                self.fs.copy(path, dest)
                self.fs.rm_file(path)
        except FileNotFoundError:
            return
        log(
            "store: row-log chunk %s is corrupt (%s); moved to %s; its rows are left out",
            self.url(path),
            problem,
            self.url(dest),
        )

    # ------------------------------------------------------------------ the whole store
    def verify(self, hashes: bool = True, repair: bool = False) -> list[dict]:
        """Every corrupt artifact and row-log chunk: {kind, stage, key, path, problem, quarantined}.

        Sizes always, sha256 (and parsing of chunks without checksums) when `hashes`; with `repair`
        each one found is quarantined, so the next run computes it again."""
        found = []
        with self._io():
            records = self.fs.glob(self._p("*", "*", COMMIT_FILE))
        for path in sorted(records):
            stage, key = path.split("/")[-3:-1]
            if stage.startswith((".", "_")):
                continue
            try:
                record = self._read_record(stage, key)
            except StoreError:
                record, problem = None, "unreadable commit record"
            else:
                if record is None:
                    continue
                folder = self._folder(stage, key, record)
                problem = self.size_problem(folder, record) or (self._hash_problem(folder, record) if hashes else None)
            if problem:
                moved = self.quarantine(stage, key, record, problem) if repair else None
                found.append(
                    {
                        "kind": "artifact",
                        "stage": stage,
                        "key": key,
                        "path": self.url(self._p(stage, key)),
                        "problem": problem,
                        "quarantined": self.url(moved) if moved else None,
                    }
                )
        for path, problem in self.bad_chunks(hashes):
            if repair:
                self.quarantine_chunk(path, problem)
            namespace = path[len(self._p("_rows")) + 1 :].rsplit("/", 1)[0]
            found.append(
                {
                    "kind": "row chunk",
                    "stage": "_rows/" + namespace,
                    "key": path.rsplit("/", 1)[1],
                    "path": self.url(path),
                    "problem": problem,
                    "quarantined": self.url(self._p(QUARANTINE, path[len(self.base) + 1 :])) if repair else None,
                }
            )
        return found

    def bad_chunks(self, hashes: bool = False) -> list[tuple[str, str]]:
        """(path, problem) of every corrupt row-log chunk: sizes from one listing; with `hashes`, read and parsed."""
        with self._io():
            try:
                listing = self.fs.find(self._p("_rows"), detail=True)
            except FileNotFoundError:
                listing = {}
        bad = []
        for path, info in sorted(listing.items()):
            name = path.rsplit("/", 1)[1]
            if not name.endswith(".parquet") or name.startswith("."):
                continue
            problem = chunk_problem(name, int(info.get("size") or 0))
            if problem is None and hashes:
                with self._io():
                    data = self.fs.cat_file(path)
                problem = chunk_problem(name, len(data), data) or parse_problem(data)
            if problem:
                bad.append((path, problem))
        return bad


def parse_problem(data: bytes, full: bool = True) -> str | None:
    """Why `data` is not a readable Parquet file (None: it is); not `full`: its footer only (what truncation
    breaks)."""
    try:
        pq.read_table(pa.BufferReader(data)) if full else pq.read_metadata(pa.BufferReader(data))
    except (pa.ArrowException, OSError, ValueError) as err:
        return f"unreadable Parquet ({str(err).splitlines()[0][:100]})"
    return None
